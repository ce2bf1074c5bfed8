"""The run folder of every job of every experiment, as recorded in tests/run_folders.json: a change to how a config
becomes its spec must leave each existing record where it is (a sweep then resumes into today's folders).

    check_folders("table1", expand(["experiment=table1"], multirun=True))   # AssertionError naming the first change

Regenerate the file only for an intended change of a grid or of a folder rule (from the repository root):
``PYTHONPATH=$PWD python tests/run_folders.py > tests/run_folders.json``. An experiment not in the file is new
and has no folders to keep.
"""
from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

FILE = Path(__file__).with_name("run_folders.json")


@cache
def recorded() -> dict[str, list[str]]:
    return json.loads(FILE.read_text(encoding="utf-8"))


def folders(sweep) -> list[str]:
    """Each job's run folder relative to its runs_dir, in job order."""
    from h2o.store.folders import runs_root

    return [str(p.path.relative_to(runs_root(p.cfg))) for p in sweep.specs]


def check_folders(exp: str, sweep) -> None:
    if exp not in recorded():
        return
    now, then = folders(sweep), recorded()[exp]
    assert len(now) == len(then), f"experiment={exp}: {len(now)} jobs, {len(then)} recorded"
    moved = [(i, a, b) for i, (a, b) in enumerate(zip(then, now)) if a != b]
    assert not moved, f"experiment={exp}: {len(moved)} jobs changed folder, e.g. job {moved[0][0]}: " \
                      f"{moved[0][1]} -> {moved[0][2]}"


def main() -> None:
    from h2o.assets.paths import CONF
    from h2o.core.quant.kvquant import KVQuant
    from h2o.pipeline.sweep import expand

    KVQuant.load = lambda self, calibration: None  # folders only: a fresh cache has no kvquant calibration file

    out = {f.stem: folders(expand([f"experiment={f.stem}"], multirun=True))
           for f in sorted((CONF / "experiment").glob("*.yaml"))}
    json.dump(out, sys.stdout, indent=0)
    print()


if __name__ == "__main__":
    main()
