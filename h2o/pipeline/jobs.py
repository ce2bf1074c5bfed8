"""The state of a sweep's jobs, one rule for every launcher (``h2o-run``, ``h2o.pipeline.launch``, ``make status``).

Before anything runs, each job is one of:

* ``dup``: its run folder is an earlier job's (``policy=full`` crossed with budgets);
* ``done``: its folder holds a finished record (complete metrics.json), whatever the job is;
* ``served``: it never evicts (a non-full policy at ratio budget 1.0 under the task's default semantics), so it is
  the full run by construction, and the ``full`` run of the same model, task and settings is finished or is a job
  of this sweep: it is not run; tables show the full record's value in its cell (analysis/tables.py);
* ``todo``: the rest (a never-evicting job with no full run to serve it runs itself).

Every launcher reads these states from :func:`classify`: ``h2o-run -m`` (basic, submitit_local) skips the served
jobs (``<sweep dir>/served.json``, read by each job: h2o.pipeline.job), the Slurm launcher submits the ``todo``
ones only, ``make status`` and the dry listing count them. A single run (``h2o-run`` without ``-m``) runs as asked.

Once a sweep was submitted to Slurm, :func:`place` puts each run to be had (``todo`` or ``done``) in one of
:data:`STATES` from runs/, the submissions' ``launch.json`` and ``failures.jsonl``, and the scheduler (``sacct``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from h2o.store.files import read_jsonl
from h2o.store.folders import finished
from h2o.pipeline.spec import RunSpec

LAUNCH_FILE = "launch.json"  # <sweep dir>/launch.json: one Slurm submission (h2o.pipeline.launch)
SERVED_FILE = "served.json"  # <sweep dir>/served.json: {run folder: the full run's folder} of a local sweep
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED", "CONFIGURING")
STATES = ("done", "running", "queued", "failed", "left")


@dataclass
class Work:
    """One job of the sweep and what becomes of it: todo, done, dup, served (by ``served_by``), or queued (in an
    earlier submission's array task that is still pending or running)."""

    index: int
    overrides: list[str]
    spec: RunSpec
    state: str
    served_by: Path | None = None


def never_evicts(spec: RunSpec) -> bool:
    """A non-full policy that keeps every token (ratio budget 1.0) under the default semantics: the full run."""
    from h2o.core import engine

    return spec.policy.name != "full" and engine.keeps_all(spec.policy) and spec.semantics == spec.task.semantics[0]


def classify(jobs: list[list[str]], specs: list[RunSpec]) -> list[Work]:
    """Each job's state (``dup`` > ``done`` > ``served`` > ``todo``, see the module's docstring)."""
    paths = {spec.path for spec in specs}
    seen, out = set(), []
    for i, (job, spec) in enumerate(zip(jobs, specs)):
        served = spec.full_path() if never_evicts(spec) else None
        if served is not None and not (served in paths or finished(served)):
            served = None  # no full run to serve it: run it
        state = ("dup" if spec.path in seen else "done" if finished(spec.path) else
                 "served" if served is not None else "todo")
        seen.add(spec.path)
        out.append(Work(i, list(job), spec, state, served))
    return out


def counts(works: list[Work]) -> dict[str, int]:
    return {s: sum(w.state == s for w in works) for s in ("todo", "done", "dup", "served", "queued")}


def summary(works: list[Work]) -> str:
    """``N jobs: a to run, b finished already, c duplicates, d served by the full run (...)[, e pending ...]``."""
    n = counts(works)
    return (f"{len(works)} jobs: {n['todo']} to run, {n['done']} finished already, {n['dup']} duplicates, "
            f"{n['served']} served by the full run (budget 1.0 never evicts)"
            + (f", {n['queued']} pending or running from an earlier submission" if n["queued"] else ""))


def served_runs(works: list[Work]) -> dict[str, str]:
    """{run folder: the full run's folder} of the served jobs (``launch.json`` ``served``, ``served.json``)."""
    return {str(w.spec.path): str(w.served_by) for w in works if w.state == "served"}


def read_served(sweep_dir: Path) -> dict[str, str]:
    """A local sweep's served runs, written by ``h2o-run -m`` before its first job ({} when absent)."""
    try:
        return json.loads((sweep_dir / SERVED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------------------- the scheduler
def scheduler_states(job_ids: list[str]) -> dict[str, str]:
    """``{<array>_<task>: STATE}`` from sacct ({} without sacct or on its failure)."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    from h2o.cli.process import import_submitit

    SlurmInfoWatcher = import_submitit().slurm.slurm.SlurmInfoWatcher

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
    found = []
    for f in sorted(root.glob(f"*/{LAUNCH_FILE}"), key=lambda p: p.stat().st_mtime):
        try:
            found.append((f.parent, json.loads(f.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return found


def submitted(root: Path) -> dict[str, tuple[str, list[str]]]:
    """{run folder: (array task id, that task's runs)} from the latest submission holding each run."""
    where: dict[str, tuple[str, list[str]]] = {}
    for _, launch in launches(root):
        for array in launch.get("arrays", []):
            for task in array["tasks"]:
                where.update({run: (task["job_id"], task["runs"]) for run in task["runs"]})
    return where


def in_flight(root: Path) -> set[str]:
    """Run folders whose latest submission's array task is still pending or running (per sacct)."""
    where = submitted(root)
    states = scheduler_states(sorted({jid for jid, _ in where.values()}))
    return {run for run, (jid, _) in where.items() if states.get(jid) == "RUNNING" or states.get(jid) in QUEUED}


def mark_in_flight(works: list[Work], root: Path) -> None:
    """``todo`` jobs held by an earlier submission's pending or running task become ``queued``."""
    busy = in_flight(root)
    for w in works:
        if w.state == "todo" and str(w.spec.path) in busy:
            w.state = "queued"


def place(works: list[Work], root: Path) -> tuple[dict[str, list[Work]], dict[str, str]]:
    """Each run to be had (todo or done) in one of STATES; returns (by state, why for the failed ones).
    ``running``: the first unfinished run of a running task; ``queued``: pending, requeued, or later in a running
    task's chunk; ``failed``: a Python error in ``failures.jsonl`` of any sweep under ``root``, or a task the
    scheduler ended without the run's record; else ``left`` (never submitted, or its task completed without it)."""
    where = submitted(root)
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
        path = str(w.spec.path)
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
