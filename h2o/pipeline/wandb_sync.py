"""``python -m h2o.pipeline.wandb_sync runs/``: mirror existing run records to wandb, idempotently.

    python -m h2o.pipeline.wandb_sync runs/                          every record under runs/ (offline by default)
    python -m h2o.pipeline.wandb_sync runs/ --experiment table1 --summary      one experiment + its summary run
    WANDB_MODE=online python -m h2o.pipeline.wandb_sync runs/        straight to the server (after `wandb login`)
    make wandb EXP=table1                                            the same as the second line

Each record keeps its id (h2o.pipeline.wandb_mirror.identity), so syncing again, or after the runner mirrored it,
never creates a second run: records already mirrored to the same destination with the same metrics.json are
skipped (``--force`` logs them again, into the same runs). A record's sweep id (config ``sweep``) is read from the
runner's ``multirun/<experiment>/<time>/jobs.jsonl``, as the runner's own mirror sets it. Offline data go to
``<runs root>/.wandb``; push them later with ``wandb sync <runs root>/.wandb/wandb/offline-run-*``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from h2o.cli.args import guard
from h2o.store.files import read_jsonl
from h2o.store.folders import fmt
from h2o.pipeline.wandb_mirror import Settings, mirror_folder, read_record, split_root

MODES = ("offline", "online", "disabled")


def record_folders(path: Path, experiment: str | None) -> list[Path]:
    """Finished record folders under ``path`` (metrics.json), of ``experiment`` only when given."""
    folders = sorted(f.parent for f in Path(path).rglob("metrics.json") if ".wandb" not in f.parts)
    return [f for f in folders if experiment is None or fmt(experiment) in f.resolve().parts]


def sweeps(multirun: Path | None) -> dict[Path, str]:
    """{record folder: the Hydra sweep that finished it last} from the runner's ``<sweep dir>/jobs.jsonl`` files."""
    out = {}
    for f in sorted(Path(multirun).rglob("jobs.jsonl")) if multirun and Path(multirun).is_dir() else []:
        try:
            rows = read_jsonl(f)
        except ValueError:  # a torn last line of a killed sweep
            continue
        out.update({Path(r["run_dir"]).resolve(): str(f.parent) for r in rows
                    if r.get("status") == "done" and r.get("run_dir")})
    return out


def sync(path: Path, s: Settings, experiment: str | None = None, force: bool = False,
         multirun: Path | None = None) -> dict[str, int]:
    """Mirror every record under ``path``; returns how many were logged, unchanged or failed."""
    counts = {"logged": 0, "unchanged": 0, "failed": 0}
    made_by = sweeps(multirun)
    for folder in record_folders(path, experiment):
        counts[mirror_folder(folder, s, sweep=made_by.get(folder.resolve()), force=force)] += 1
    return counts


def experiments(path: Path) -> list[tuple[Path, str]]:
    """(runs root, experiment) of every experiment with a record under ``path``."""
    found = {}
    for folder in record_folders(path, None):
        try:
            exp = read_record(folder).get("experiment")
        except (OSError, ValueError):
            continue
        if exp:
            found[(split_root(folder, exp)[0], exp)] = True
    return sorted(found)


@guard
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o.pipeline.wandb_sync", description=__doc__.split("\n")[0])
    p.add_argument("path", nargs="?", default="runs", help="runs root, or any folder under it (default: runs)")
    p.add_argument("--experiment", default=None, help="only this experiment's records")
    p.add_argument("--summary", action="store_true", help="also log each experiment's summary run")
    p.add_argument("--report", default=None, help="paper-vs-ours report for the summary (default: made from the "
                   "experiment's records by `python -m analysis report`, where analysis has it)")
    p.add_argument("--project", default="h2o-repro")
    p.add_argument("--entity", default=None)
    p.add_argument("--mode", default=os.environ.get("WANDB_MODE") or "offline", help=f"one of {', '.join(MODES)}")
    p.add_argument("--dir", default=None, help="wandb data folder (default: <runs root>/.wandb)")
    p.add_argument("--force", action="store_true", help="log records again even if mirrored unchanged")
    p.add_argument("--multirun", default="multirun", help="Hydra sweep folders: the sweep id of each record")
    from h2o.cli.args import one_line

    args = one_line(p).parse_args(argv)
    if args.mode not in MODES:
        print(f"error: --mode={args.mode!r}: allowed: {', '.join(MODES)}", file=sys.stderr)
        return 2
    path = Path(args.path)
    if not path.is_dir():
        print(f"error: path={args.path!r}: not a folder; expected a runs root (e.g. runs/)", file=sys.stderr)
        return 2
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("error: wandb is not installed; `pip install wandb` to mirror records", file=sys.stderr)
        return 2
    s = Settings(args.project, args.entity, args.mode, args.dir)
    counts = sync(path, s, args.experiment, args.force, Path(args.multirun))
    print(f"[h2o] wandb ({args.mode}): {counts['logged']} logged, {counts['unchanged']} unchanged, "
          f"{counts['failed']} failed")
    if args.summary:
        from h2o.pipeline.wandb_summary import summarize

        for root, exp in experiments(path):
            if args.experiment in (None, exp):
                ok = summarize(root, exp, s, args.report)
                print(f"[h2o] wandb summary of {exp}: {'logged' if ok else 'failed'}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
