"""Pipeline: configs to runs (plan, sweep, run), run records and the wandb mirror.

Imports tasks, bench, core, cli and assets; analysis/ imports none of the package."""
