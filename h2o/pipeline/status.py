"""``make status EXP=...``: done / running / queued / failed / left for an experiment, from runs/ and the scheduler.

    python -m h2o.pipeline.status experiment=table1

Runs: the experiment's jobs (composed as the sweep does; nothing loaded), less duplicates and runs served by the
full record (h2o.pipeline.launch). ``done``: a complete metrics.json. The rest is placed by the latest
submission that holds it (``multirun/<experiment>/*/launch.json``) and that array task's Slurm state (``sacct``):
``running`` (the first unfinished run of a running task), ``queued`` (pending, requeued, or later in a running
task's chunk), ``failed`` (a Python error in ``failures.jsonl`` of any sweep of the experiment, or a task the
scheduler ended without the run's record: OUT_OF_MEMORY, NODE_FAIL, TIMEOUT, CANCELLED, FAILED, ...), else
``left`` (never submitted, or its task completed without it). Without ``sacct`` only the Python failures are known.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from h2o.pipeline.launch import LAUNCH_FILE, Work, classify
from h2o.pipeline.records import finished, read_jsonl
from h2o.pipeline.sweep import BAD_INPUT, expand

QUEUED = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "CONFIGURING")
STATES = ("done", "running", "queued", "failed", "left")


def scheduler_states(job_ids: list[str]) -> dict[str, str]:
    """``{<array>_<task>: STATE}`` from sacct ({} without sacct or on its failure)."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    from submitit.slurm.slurm import SlurmInfoWatcher

    arrays = sorted({j.split("_")[0] for j in job_ids})
    cmd = ["sacct", "-o", "JobID,State,ExitCode", "--parsable2", *[x for a in arrays for x in ("-j", a)]]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    info = SlurmInfoWatcher().read_info(out.stdout)
    return {jid: (stats.get("State") or "UNKNOWN").split()[0] for jid, stats in info.items()}


def launches(root: Path) -> list[tuple[Path, dict]]:
    """(sweep dir, launch.json) of every submission under ``root``, oldest first."""
    import json

    found = []
    for f in sorted(root.glob(f"*/{LAUNCH_FILE}"), key=lambda p: p.stat().st_mtime):
        try:
            found.append((f.parent, json.loads(f.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return found


def in_flight(root: Path) -> set[str]:
    """Run folders whose latest submission's array task is still pending or running (per sacct)."""
    where: dict[str, str] = {}
    for _, launch in launches(root):
        for array in launch.get("arrays", []):
            for task in array["tasks"]:
                where.update({run: task["job_id"] for run in task["runs"]})
    states = scheduler_states(sorted(set(where.values())))
    return {run for run, jid in where.items() if states.get(jid) == "RUNNING" or states.get(jid) in QUEUED}


def place(works: list[Work], root: Path) -> tuple[dict[str, list[Work]], dict[str, str]]:
    """Each run to be had (todo or done) in one of STATES; returns (by state, why for the failed ones)."""
    where: dict[str, tuple[str, list[str]]] = {}  # run path -> (array task id, that task's runs)
    for _, launch in launches(root):
        for array in launch.get("arrays", []):
            for task in array["tasks"]:
                for run in task["runs"]:
                    where[run] = (task["job_id"], task["runs"])
    errors: dict[str, str] = {}
    for f in sorted(root.glob("*/failures.jsonl"), key=lambda p: p.stat().st_mtime):
        for row in read_jsonl(f):
            if row.get("run_dir"):
                errors[row["run_dir"]] = row.get("error", "failed")
    states = scheduler_states(sorted({jid for jid, _ in where.values()}))
    out: dict[str, list[Work]] = {s: [] for s in STATES}
    why: dict[str, str] = {}
    for w in works:
        if w.state not in ("todo", "done"):
            continue
        path = str(w.plan.path)
        if finished(path):
            out["done"].append(w)
            continue
        jid, runs = where.get(path, (None, []))
        state = states.get(jid) if jid else None
        if state == "RUNNING":
            first = next((r for r in runs if not finished(r)), None)
            out["running" if first == path else "queued"].append(w)
        elif state in QUEUED:
            out["queued"].append(w)
        elif state not in (None, "COMPLETED", "UNKNOWN"):
            out["failed"].append(w)
            why[path] = f"{state} (job {jid})" + (f"; {errors[path]}" if path in errors else "")
        elif path in errors:
            out["failed"].append(w)
            why[path] = errors[path] + (f" (job {jid})" if jid else "")
        else:
            out["left"].append(w)
    return out, why


def report(works: list[Work], root: Path) -> str:
    by, why = place(works, root)
    n = {s: sum(w.state == s for w in works) for s in ("dup", "served")}
    lines = [f"{len(works)} jobs: {sum(len(v) for v in by.values())} runs, {n['dup']} duplicates, "
             f"{n['served']} served by the full run",
             " | ".join(f"{s} {len(by[s])}" for s in STATES)]
    for w in by["failed"]:
        p = w.plan
        lines.append(f"FAILED {p.model.name} {p.task.name} {p.policy.name} {p.policy.budget}: {why[str(p.path)]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        sweep = expand([a for a in argv if not a.startswith("-") and not a.startswith("cluster.")], multirun=True)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(classify(sweep), Path(sweep.sweep_dir).resolve().parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
