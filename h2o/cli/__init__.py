"""CLI: what every command line checks before it loads anything: argparse with one-line errors, exit status 2
(:mod:`h2o.cli.args`), and output paths and folder names (:mod:`h2o.cli.paths`).

Imports core (its ``ConfigError`` and ``check``) at most; assets, tasks, bench and pipeline import it."""
