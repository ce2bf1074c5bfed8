"""The cluster path against a real Slurm: `make sweep ... LAUNCHER=slurm` (h2o.pipeline.launch) and `make status`
(h2o.pipeline.status) with submitit's Slurm executor, sbatch, squeue, scontrol, scancel and the accounting of
sacct, on the one-node cluster of tests/slurm/up.sh (Debian's Slurm 22.05, 4 task slots, slurmdbd + MariaDB).

The module brings the cluster up itself (installing the packages with apt where they are missing) and stops it at
the end, unless it was up already (`make slurm-up`): then it is left running. Without root, or without the
packages and apt-get, the tests skip with the reason; with CI=true they fail instead.

On the tiny models (austen_ppl, 4 windows of 96 tokens; H2O_TEST_PAUSE_S slows a task's first attempt so that it
can be interrupted mid-run): only the work left is submitted (finished, duplicate and served runs dropped), one
array for the one resource class, chunks of one model; a task requeued mid-run with `scontrol requeue` and one
preempted with USR2 (submitit checkpoints and requeues it) both resume at their first unfinished run and from its
partial log; a second submission sends nothing in flight or finished; the tables equal those of the same sweep run
locally. A task whose 1-minute limit comes is signalled (`cluster.signal_delay_s`), checkpointed and requeued by
submitit as timed out, and finishes on its next attempt. A cancelled task shows as failed in `make status`.

A requeued task waits ~2 min (its BeginTime) before it may run again: the tests release it with
`scontrol update JobId=... StartTime=now`, as an impatient user would.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from analysis.__main__ import main as analysis_main
from analysis.render import MISSING
from h2o.pipeline import launch, status
from h2o.assets.paths import REPO
from h2o.store.files import read_jsonl
from h2o.pipeline.job import execute
from h2o.pipeline.sweep import expand

UP, DOWN = REPO / "tests" / "slurm" / "up.sh", REPO / "tests" / "slurm" / "down.sh"
SCRATCH = Path(os.environ.get("H2O_SLURM_DIR", "/tmp/h2o-slurm"))
TINY = ["experiment=default", "task=austen_ppl", "threads=1", "task_overrides.austen_ppl.n_windows=4",
        "++task_overrides.austen_ppl.window=96", "task_overrides.austen_ppl.batch_size=1"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A running one-node cluster (up.sh), SLURM_CONF set; stopped afterwards if this module started it."""
    ci = os.environ.get("CI", "").lower() == "true"
    try:
        up = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.fail("tests/slurm/up.sh did not finish within 15 min")
    if up.returncode == 3 and not ci:
        why = (up.stderr.strip().splitlines() or ["tests/slurm/up.sh: status 3"])[-1]
        pytest.skip(f"no Slurm here: {why.split('cannot run here: ')[-1]}")
    if up.returncode != 0:
        pytest.fail(f"the Slurm cluster did not come up (tests/slurm/up.sh status {up.returncode}):\n"
                    f"{up.stderr[-3000:]}")
    started = "already up" not in up.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(SCRATCH / "slurm.conf"))  # sbatch, sacct, scontrol here and in the tasks
        yield
    if started:
        subprocess.run(["bash", str(DOWN)], capture_output=True, timeout=300)


def use_checkout(mp: pytest.MonkeyPatch, folder: Path) -> None:
    """This process (and, through sbatch's --export=ALL, every task it submits) imports this checkout and works
    in ``folder``."""
    mp.chdir(folder)
    mp.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    mp.setenv("OMP_NUM_THREADS", "1")


def cancel_submitted(folder: Path) -> None:
    """Leave nothing of ``folder``'s submissions queued or running, even when a test failed."""
    arrays = {t["job_id"].split("_")[0] for f in folder.glob("multirun/*/launch.json")
              for a in json.loads(f.read_text())["arrays"] for t in a["tasks"]}
    if arrays:
        subprocess.run(["scancel", *sorted(arrays)], capture_output=True, timeout=60)


@pytest.fixture
def env(cluster, tmp_path, monkeypatch):
    use_checkout(monkeypatch, tmp_path)
    yield tmp_path
    cancel_submitted(tmp_path)


@pytest.fixture(scope="module")
def time_limited(cluster, tmp_path_factory):
    """One run with a 1-minute limit whose first attempt takes ~2 min (4 windows, 20 s pause after each),
    submitted before the sweep test so that its minute overlaps that test. A thread watches it: once submitit
    has requeued it, the windows its first attempt left are counted and it is released."""
    tmp = tmp_path_factory.mktemp("time_limit")
    with pytest.MonkeyPatch.context() as mp:
        use_checkout(mp, tmp)
        mp.setenv("H2O_TEST_PAUSE_S", "20")
        args = [*TINY, "model=tiny-llama", "policy=local", "policy.budget=0.5", f"runs_dir={tmp}/runs",
                f"hydra.sweep.dir={tmp}/multirun/t", "cluster.min_time_min=1", "cluster.signal_delay_s=5"]
        assert launch.main(args) == 0
    (task,) = json.loads((tmp / "multirun/t/launch.json").read_text())["arrays"][0]["tasks"]
    watch = {"jid": task["job_id"], "run": Path(task["runs"][0]), "folder": tmp, "limit": job(task["job_id"])}

    def watcher():
        try:
            requeued(watch["jid"], timeout=180)
            watch["held"] = windows_done(watch["run"])
            # the next attempt gets 10 min: on a loaded machine its start-up alone can pass the next warning
            release(watch["jid"], "TimeLimit=10")
        except BaseException as exc:  # noqa: BLE001 - raised again in the test
            watch["error"] = exc

    thread = threading.Thread(target=watcher, daemon=True)
    thread.start()
    watch["thread"] = thread
    yield watch
    cancel_submitted(tmp)


# ------------------------------------------------------------------------------------------------ helpers
def wait_for(cond, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def job(jid: str) -> dict:
    """``scontrol show job`` of one array task as a dict (JobState, Restarts, TimeLimit, ...); {} when unknown."""
    out = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out.splitlines()[0])) if out.strip() else {}


def accounted(jid: str) -> str | None:
    """The state sacct (slurmdbd's accounting) holds for one array task."""
    array = jid.split("_")[0]
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", array], capture_output=True,
                         text=True, timeout=30).stdout
    return next((line.split("|")[1].split()[0] for line in out.splitlines() if line.split("|")[0] == jid), None)


def requeued(jid: str, timeout: float = 120) -> dict:
    """Wait until the task is back in the queue after a requeue (its process has ended)."""
    return wait_for(lambda: (lambda j: j if j.get("JobState") == "PENDING" and int(j.get("Restarts", 0)) >= 1
                             else None)(job(jid)), timeout, f"task {jid} requeued")


def release(jid: str, *more: str) -> None:
    """Let a requeued task start now, not at its BeginTime ~2 min away (``more``: other fields to update)."""
    subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now", *more], check=True, timeout=30)


def windows_done(run: Path) -> int:
    return len(read_jsonl(run / "partial" / "windows.jsonl"))


def all_arrays() -> set[str]:
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-S", "now-1days"], capture_output=True,
                         text=True, timeout=30).stdout
    return {line.split("_")[0] for line in out.split()}


def counts(first_line: str) -> dict[str, int]:
    """``8 jobs: 0 to run, 1 finished already, 2 served by the full run (...)`` -> {"jobs": 8, "to run": 0, ...}."""
    head, rest = first_line.split(": ", 1)
    parts = [re.fullmatch(r"(\d+) ([^(]+?)(?: \(.*\))?", part).groups() for part in [head, *rest.split(", ")]]
    return {name: int(n) for n, name in parts}


# ------------------------------------------------------------------------------------------------ tests
def test_sweep_only_work_left_requeue_preempt_resume_tables_equal_local(time_limited, env, monkeypatch, capsys,
                                                                       request):
    tmp = env
    sweep = [*TINY, "model=tiny-llama,tiny-opt", "policy=full,h2o", "policy.budget=0.2,1.0", f"runs_dir={tmp}/runs"]
    # finished before the submission: tiny-opt x h2o 0.2, run here
    done_first = execute(expand([*TINY, "model=tiny-opt", "policy=h2o", "policy.budget=0.2",
                                 f"runs_dir={tmp}/runs"], multirun=False).specs[0])
    local_log = (tmp / "local.log").open("w")
    local = subprocess.Popen([sys.executable, "-m", "h2o.pipeline.run", "-m", *sweep[:-1], f"runs_dir={tmp}/local",
                              f"hydra.sweep.dir={tmp}/local-multirun"], cwd=tmp, stdout=subprocess.DEVNULL,
                             stderr=local_log)  # the same sweep here (make sweep's command)
    request.addfinalizer(lambda: local.poll() is None and local.kill())

    monkeypatch.setenv("H2O_TEST_PAUSE_S", "4")  # each task's first attempt: 4 s after each window
    before = all_arrays() | {time_limited["jid"].split("_")[0]}  # sacct may list the fixture's job late
    assert launch.main([*sweep, f"hydra.sweep.dir={tmp}/multirun/s1", "cluster.chunk=2"]) == 0
    out = capsys.readouterr().out
    # 2 models x {full, h2o} x {0.2, 1.0}: full twice (dup), h2o 1.0 served by full, tiny-opt h2o 0.2 finished
    assert counts(out.splitlines()[0]) == {"jobs": 8, "to run": 3, "finished already": 1, "duplicates": 2,
                                           "served by the full run": 2}
    assert "array 0: gpus=0 mem=4G cpus=1 time=15min  2 tasks, 3 runs (chunk <= 2)" in out
    spec = json.loads((tmp / "multirun/s1/launch.json").read_text())
    assert len(spec["arrays"]) == 1
    tasks = spec["arrays"][0]["tasks"]
    array = tasks[0]["job_id"].split("_")[0]
    assert array not in before and [t["job_id"] for t in tasks] == [f"{array}_0", f"{array}_1"]
    assert [(t["model"], [Path(r).parts[-3] for r in t["runs"]]) for t in tasks] == [
        ("tiny-llama", ["full", "h2o"]), ("tiny-opt", ["full"])]  # chunks of one model, sweep order
    assert {Path(s["served_by"]).parts[-3:-1] for s in spec["served"]} == {("full", "1.0")}
    first, second = Path(tasks[0]["runs"][0]), Path(tasks[1]["runs"][0])
    assert job(f"{array}_0")["TimeLimit"] == "00:15:00"

    # mid-run: task 0 requeued by the scheduler, task 1 preempted (USR2, as submitit's job._interrupt sends); a
    # requeued task's process lives on ~5 s (SIGTERM, which submitit ignores, then SIGKILL after KillWait)
    interrupt = {first: ["scontrol", "requeue", f"{array}_0"], second: ["scancel", "--signal", "USR2", f"{array}_1"]}

    def interrupt_scoring() -> bool:  # each task as soon as its first window is scored
        for run in [r for r in interrupt if windows_done(r) >= 1]:
            subprocess.run(interrupt.pop(run), check=True, timeout=30)
        return not interrupt

    wait_for(interrupt_scoring, 180, "both tasks scoring")
    held = {}
    for i, run in ((0, first), (1, second)):
        requeued(f"{array}_{i}")
        held[i] = windows_done(run)  # what the attempt left: its process has ended

    # a second submission while both tasks wait in the queue sends nothing
    assert launch.main([*sweep, f"hydra.sweep.dir={tmp}/multirun/s2", "cluster.chunk=2"]) == 0
    again = counts(capsys.readouterr().out.splitlines()[0])
    assert again["to run"] == 0 and again["finished already"] == 1
    assert again["pending or running from an earlier submission"] == 3
    assert not (tmp / "multirun/s2").exists() and all_arrays() == before | {array}
    assert status.main([*sweep, f"hydra.sweep.dir={tmp}/multirun/s1"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "done 1 | running 0 | queued 3 | failed 0 | left 0"
    for i in (0, 1):
        release(f"{array}_{i}")
    wait_for(lambda: all(accounted(t["job_id"]) == "COMPLETED" for t in tasks), 240, "both tasks to complete")
    assert all(int(job(t["job_id"])["Restarts"]) == 1 for t in tasks)
    log = "\n".join(p.read_text() for p in (tmp / "multirun/s1/slurm").glob(f"{array}_1/*_log.err"))
    assert "this job is preempted" in log  # submitit's own handler checkpointed the chunk and requeued it

    recs = {p: json.loads((Path(p) / "metrics.json").read_text()) for t in tasks for p in t["runs"]}
    assert len(recs) == 3 and not any((Path(p) / "partial").exists() for p in recs)
    # each interrupted run went on after the windows it had scored, the later run of task 0 from zero
    assert 1 <= held[0] < 4 and recs[str(first)]["resumed_requests"] == held[0]
    assert 1 <= held[1] < 4 and recs[str(second)]["resumed_requests"] == held[1]
    assert recs[tasks[0]["runs"][1]]["resumed_requests"] == 0
    assert [s["window"] for s in read_jsonl(first / "samples.jsonl")] == [0, 1, 2, 3]

    # everything finished: nothing to send again
    assert launch.main([*sweep, f"hydra.sweep.dir={tmp}/multirun/s3"]) == 0
    last = counts(capsys.readouterr().out.splitlines()[0])
    assert last["to run"] == 0 and last["finished already"] == 4
    assert not (tmp / "multirun/s3").exists() and all_arrays() == before | {array}
    assert status.main([*sweep, f"hydra.sweep.dir={tmp}/multirun/s1"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "done 4 | running 0 | queued 0 | failed 0 | left 0"

    # the tables equal those of the same sweep run locally
    assert local.wait(timeout=300) == 0, (tmp / "local.log").read_text()[-3000:]
    local_log.close()
    for name in ("runs", "local"):
        assert analysis_main(["tables", "--runs", name, "--out", f"out-{name}"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp / "out-runs/tables").iterdir()) == sorted(
        p.name for p in (tmp / "out-local/tables").iterdir())
    here, there = ((tmp / f"out-{name}/tables/default_perplexity.md").read_text().splitlines()
                   for name in ("runs", "local"))
    rows = [line for line in here if line.startswith("| tiny-")]
    assert rows == [line for line in there if line.startswith("| tiny-")] and len(rows) == 4
    assert all(MISSING not in line for line in rows if "| H2O |" in line)  # budget 0.2 and 1, both models
    # equal, caption included: both launchers serve the budget-1.0 cells from the full record (h2o.pipeline.jobs)
    assert here == there and ("- budget 1 cells of an evicting policy without a record of their own (2): the full "
                              "cache's (a 100% budget never evicts)") in here
    # and every record, resumed or not, holds the metrics of the same run done in one go here
    mine, theirs = ({p.relative_to(tmp / name): json.loads(p.read_text())["metrics"]
                     for p in (tmp / name).rglob("metrics.json")} for name in ("runs", "local"))
    assert len(mine) == 4 and mine == theirs
    assert done_first["metrics"] == mine[next(k for k in mine if "tiny-opt" in str(k) and "h2o" in str(k))]


def test_time_limit_signal_checkpoint_requeue(time_limited):
    """Slurm sends USR2 signal_delay_s before the 1-minute limit (within its 30 s check period), submitit finds
    the job timed out, checkpoints the chunk and requeues it; the next attempt finishes the run from its log."""
    watch = time_limited
    jid, run = watch["jid"], watch["run"]
    assert watch["limit"]["TimeLimit"] == "00:01:00"
    watch["thread"].join(timeout=240)
    if "error" in watch:
        raise watch["error"]
    assert "held" in watch, "the watcher did not finish"
    wait_for(lambda: accounted(jid) == "COMPLETED", 180, "the requeued task to complete")
    log = "\n".join(p.read_text() for p in (watch["folder"] / "multirun/t/slurm").glob(f"{jid}/*_log.err"))
    assert "Caught signal SIGUSR2" in log and "this job is timed-out" in log
    record = json.loads((run / "metrics.json").read_text())
    assert watch["held"] < 4 and record["resumed_requests"] == watch["held"] and record["n_samples"] == 4
    assert int(job(jid)["Restarts"]) == 1


def test_cancelled_task_is_failed_in_status(env, monkeypatch, capsys):
    tmp = env
    sweep = [*TINY, "model=tiny-llama", "policy=h2o", "policy.budget=0.5", f"runs_dir={tmp}/runs",
             f"hydra.sweep.dir={tmp}/multirun/c1"]
    monkeypatch.setenv("H2O_TEST_PAUSE_S", "30")
    assert launch.main(sweep) == 0
    capsys.readouterr()
    (task,) = json.loads((tmp / "multirun/c1/launch.json").read_text())["arrays"][0]["tasks"]
    jid = task["job_id"]
    wait_for(lambda: accounted(jid) == "RUNNING", 120, "the task to start")
    assert status.main(sweep) == 0
    assert capsys.readouterr().out.splitlines()[1] == "done 0 | running 1 | queued 0 | failed 0 | left 0"
    before = all_arrays()  # a second submission while it runs sends nothing
    assert launch.main([*sweep[:-1], f"hydra.sweep.dir={tmp}/multirun/c2"]) == 0
    assert counts(capsys.readouterr().out.splitlines()[0])["pending or running from an earlier submission"] == 1
    assert all_arrays() == before and not (tmp / "multirun/c2").exists()
    subprocess.run(["scancel", jid], check=True, timeout=30)
    wait_for(lambda: accounted(jid) == "CANCELLED", 60, "sacct to hold the cancellation")
    assert status.main(sweep) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "done 0 | running 0 | queued 0 | failed 1 | left 0"
    assert lines[2].startswith(f"FAILED tiny-llama austen_ppl h2o 0.5: CANCELLED (job {jid})")
