"""``make status EXP=...``: done / running / queued / failed / left for an experiment, from runs/ and the scheduler.

    python -m h2o.pipeline.status experiment=table1

Runs: the experiment's jobs (composed as the sweep does; nothing loaded), less duplicates and runs served by the
full record. ``done``: a complete metrics.json. The rest is placed by the latest submission that holds it
(``multirun/<experiment>/*/launch.json``) and that array task's Slurm state (``sacct``): ``running``, ``queued``,
``failed`` (a Python error in ``failures.jsonl``, or a task the scheduler ended without the run's record:
OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, CANCELLED, FAILED, ...), else ``left``; the rule is
:func:`h2o.pipeline.jobs.place`. Without ``sacct`` only the Python failures are known.
"""
from __future__ import annotations

import sys
from pathlib import Path

from h2o.pipeline.jobs import STATES, Work, classify, counts, place
from h2o.pipeline.sweep import BAD_INPUT, expand, split_args


def report(works: list[Work], root: Path) -> str:
    by, why = place(works, root)
    n = counts(works)
    lines = [f"{len(works)} jobs: {sum(len(v) for v in by.values())} runs, {n['dup']} duplicates, "
             f"{n['served']} served by the full run",
             " | ".join(f"{s} {len(by[s])}" for s in STATES)]
    for w in by["failed"]:
        p = w.spec
        lines.append(f"FAILED {p.model.name} {p.task.name} {p.policy.name} {p.policy.budget}: {why[str(p.path)]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        sweep = expand(split_args(argv)[2], multirun=True)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(classify(sweep.jobs, sweep.specs), Path(sweep.sweep_dir).resolve().parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
