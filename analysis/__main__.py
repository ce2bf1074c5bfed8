"""``python -m analysis {tables,figures,report,models,methods} [--runs runs] [--out analysis/out]``.

Tables go to ``<out>/tables/<name>.md`` and ``.tex`` (the Markdown is also printed), figures to
``<out>/figures/<name>.png`` and ``.pdf``, the report to ``<out>/REPORT.md``, the two-model table of
``experiment=models`` to ``<out>/models_results.md`` (``--out docs`` for the docs page); ``methods``: the methods
experiments' figures and tables only (analysis.methods; ``tables`` and ``figures`` include them). Prints the paths
written. With no finished run under ``--runs``, ``tables`` and ``figures`` print one line and exit
0 (nothing to do is not an error); ``report`` and ``models`` still write their page (everything "not run").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.paths import folder_error, one_line, writable_error
from analysis.records import load_runs


def check_paths(runs: str, out: str) -> str | None:
    """The rules of h2o.cli.paths for this CLI (analysis imports nothing of h2o): ``--runs`` is a folder
    (as h2o.pipeline.wandb_sync requires: a missing one is a typo, not an empty study), ``--out`` a folder
    that exists or can be created. Returns the one-line error, or None."""
    return folder_error("--runs", runs, "the root of the run records (e.g. runs/)") or writable_error("--out", out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["tables", "figures", "report", "models", "methods"])
    parser.add_argument("--runs", default="runs", help="root of the run records (default: runs)")
    parser.add_argument("--out", default="analysis/out", help="output root (default: analysis/out)")
    args = one_line(parser).parse_args(argv)
    bad = check_paths(args.runs, args.out)
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    df = load_runs(args.runs)
    if args.what in ("report", "models"):
        from analysis.models_table import render
        from analysis.report import report
        path = Path(args.out) / ("REPORT.md" if args.what == "report" else "models_results.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((report if args.what == "report" else render)(df))
        print(f"{len(df)} finished runs under {args.runs}/; wrote {path}")
        return 0
    if df.empty:
        print(f"no finished runs under {args.runs}/ (a run is finished once its folder has "
              f"metrics.json): no {args.what} written")
        return 0
    if args.what == "methods":
        from analysis.methods import methods_figures, methods_tables
        tables = methods_tables(df)
        paths = [p for t in tables for p in t.write(Path(args.out) / "tables")]
        paths += methods_figures(df, Path(args.out) / "figures")
        for t in tables:
            print(t.to_markdown())
    elif args.what == "tables":
        from analysis.tables import all_tables
        tables = all_tables(df)
        paths = [p for t in tables for p in t.write(Path(args.out) / "tables")]
        for t in tables:
            print(t.to_markdown())
    else:
        from analysis.figures import all_figures
        paths = all_figures(df, Path(args.out) / "figures")
    print(f"{len(df)} finished runs under {args.runs}/; wrote {len(paths)} files:")
    for p in paths:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
