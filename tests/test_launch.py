"""Sweeps on a Slurm cluster (issue 11), without a cluster: the real submitit Slurm executor against the fake Slurm
of tests/fake_slurm (sbatch, srun, sacct, squeue, scancel, scontrol running array tasks as local processes).

End to end on tiny-llama: submit only the work left (a duplicate and two budget-1.0 runs served by full are
dropped), two array tasks of chunked runs, preempt a task mid-run (USR2: submitit checkpoints, requeues), the
requeued task resumes inside the run from its partial log, then status, a killed task reported as failed, tables.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from h2o.pipeline import launch, status
from h2o.pipeline.records import REPO, read_jsonl
from h2o.pipeline.run import execute
from h2o.pipeline.sweep import expand
from h2o.tasks.progress import RequestLog, recording

FAKE = Path(__file__).parent / "fake_slurm"
TINY = ["experiment=default", "model=tiny-llama", "task=austen_ppl", "threads=1",
        "task_overrides.austen_ppl.n_windows=4", "++task_overrides.austen_ppl.window=96",
        "task_overrides.austen_ppl.batch_size=1"]


def wait_for(cond, timeout: float, what: str):
    end = time.time() + timeout
    while time.time() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def task_state(root: Path, task: str) -> dict:
    try:
        return json.loads((root / f"{task}.json").read_text())
    except (OSError, ValueError):
        return {}


def test_fig4_dry_run_lists_arrays_with_resources(capsys):
    assert launch.main(["experiment=fig4", "task=copa,mathqa", "--dry"]) == 0  # two of its six tasks (time)
    out = capsys.readouterr().out.splitlines()
    # 7 models x 2 tasks x (full, local, h2o) x 7 budgets: full once per model x task, budget 1.0 served by full
    assert out[0] == ("294 jobs: 182 to run, 0 finished already, 84 duplicates, "
                      "28 served by the full run (budget 1.0 never evicts)")
    arrays = [line for line in out if line.startswith("array ")]
    assert len(arrays) == 5  # 7 models in 5 resource classes
    assert any("gpus=4 mem=320G" in a and "opt-66b" in a for a in arrays)
    assert any("gpus=1 mem=64G" in a and "opt-6.7b, llama-7b" in a for a in arrays)
    total = out[-1]
    assert total.startswith("total: 5 arrays") and " 182 runs," in total and "GPU-h" in total
    # chunks of <= 8 runs of one model (26 each): at least 4 tasks per model, more where the time cap cuts
    assert sum(int(a.split(" tasks,")[0].split()[-1]) for a in arrays) >= 7 * 4


def test_bad_cluster_setting_exits_2(capsys):
    assert launch.main(["experiment=table1", "--dry", "cluster.chunk=0"]) == 2
    assert capsys.readouterr().err.strip() == "error: cluster.chunk=0: expected a positive int"
    assert launch.main(["experiment=table1", "--dry", "cluster.nodes=2"]) == 2
    assert capsys.readouterr().err.startswith("error: cluster.nodes: no such cluster setting; allowed: partition")


def test_request_log_resumes_and_ignores_a_torn_line(tmp_path):
    with recording(tmp_path):
        log = RequestLog.open("windows")
        log[0] = {"nll": 1.5}
        log[1] = [0.25, True]
    (tmp_path / "windows.jsonl").write_text((tmp_path / "windows.jsonl").read_text() + '{"k": "2", "v": {"nl')
    with recording(tmp_path):
        again = RequestLog.open("windows")
    assert again.resumed == 2 and again[0] == {"nll": 1.5} and again[1] == [0.25, True] and 2 not in again
    assert RequestLog.open("windows") is None  # outside a recorded run: no log


def test_fake_slurm_end_to_end_preempt_requeue_resume_status_tables(tmp_path, monkeypatch, capsys):
    slurm = tmp_path / "slurm"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{FAKE}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SLURM_DIR", str(slurm))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("H2O_TEST_PAUSE_S", "3")  # first attempts pause 3 s after each window: a "mid-run" to preempt
    sweep = [*TINY, "policy=full,local,h2o", "policy.budget=0.2,1.0", f"runs_dir={tmp_path}/runs",
             f"hydra.sweep.dir={tmp_path}/multirun/s1"]
    assert launch.main([*sweep, "cluster.chunk=2"]) == 0  # submits and returns
    out = capsys.readouterr().out
    assert out.startswith("6 jobs: 3 to run, 0 finished already, 1 duplicates, 2 served by the full run")
    assert "2 tasks, 3 runs (chunk <= 2)" in out and "submitted 2 array tasks: 1000" in out
    plan = json.loads((tmp_path / "multirun/s1/launch.json").read_text())
    tasks = plan["arrays"][0]["tasks"]
    assert [t["job_id"] for t in tasks] == ["1000_0", "1000_1"] and [len(t["runs"]) for t in tasks] == [2, 1]
    assert {Path(s["served_by"]).parts[-3:-1] for s in plan["served"]} == {("full", "1.0")}

    first = Path(tasks[0]["runs"][0])  # full, then local, in task 1000_0
    wait_for(lambda: len(read_jsonl(first / "partial" / "windows.jsonl")) == 2, 120, "a run half done")
    subprocess.run(["scancel", "--signal", "USR2", "1000_0"], check=True)  # preemption, as submitit's _interrupt
    wait_for(lambda: all(task_state(slurm, t["job_id"]).get("State") == "COMPLETED" for t in tasks), 120,
             "both tasks to complete")
    assert task_state(slurm, "1000_0")["Requeues"] == 1 and task_state(slurm, "1000_1")["Requeues"] == 0
    recs = {p: json.loads((Path(p) / "metrics.json").read_text()) for t in tasks for p in t["runs"]}
    assert len(recs) == 3 and not any((Path(p) / "partial").exists() for p in recs)
    assert recs[str(first)]["resumed_requests"] == 2  # the requeued run continued after the 2 windows it had scored
    assert [s["window"] for s in read_jsonl(first / "samples.jsonl")] == [0, 1, 2, 3]
    assert sorted(r["resumed_requests"] for r in recs.values())[:2] == [0, 0]

    # the same run from zero, in this process: the resumed record is identical
    monkeypatch.setenv("H2O_TEST_PAUSE_S", "0")
    again = execute(expand([*TINY, "policy=full", f"runs_dir={tmp_path}/fresh"], multirun=False).plans[0])
    assert again["metrics"] == recs[str(first)]["metrics"] and again["resumed_requests"] == 0

    assert status.main(sweep) == 0
    assert capsys.readouterr().out.splitlines()[1] == "done 3 | running 0 | queued 0 | failed 0 | left 0"

    # a second submission: only the new run goes out; killing its task (as an OOM kill would) is a failure
    monkeypatch.setenv("H2O_TEST_PAUSE_S", "5")
    more = [*TINY, "policy=full,h2o", "policy.budget=0.2,0.5", f"runs_dir={tmp_path}/runs",
            f"hydra.sweep.dir={tmp_path}/multirun/s2"]
    assert launch.main(more) == 0
    assert capsys.readouterr().out.startswith("4 jobs: 1 to run, 2 finished already, 1 duplicates")
    wait_for(lambda: task_state(slurm, "1001").get("StepPid"), 60, "the task to start")
    assert launch.main([*more[:-1], f"hydra.sweep.dir={tmp_path}/multirun/s3", "--dry"]) == 0  # not submitted twice
    assert capsys.readouterr().out.startswith("4 jobs: 0 to run, 2 finished already, 1 duplicates, 0 served by the "
                                              "full run (budget 1.0 never evicts), 1 pending or running from an "
                                              "earlier submission")
    subprocess.run(["scancel", "1001"], check=True)
    assert status.main(more) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "done 2 | running 0 | queued 0 | failed 1 | left 0"
    assert lines[2].startswith("FAILED tiny-llama austen_ppl h2o 0.5: CANCELLED (job 1001)")

    from analysis.__main__ import main as analysis_main

    assert analysis_main(["tables", "--runs", "runs", "--out", "out"]) == 0  # tables whenever asked
    assert "3 finished runs under runs/" in capsys.readouterr().out


@pytest.fixture(autouse=True)
def _stop_fake_tasks(tmp_path):
    """Leave no fake-Slurm task behind, even when the test fails (each task runs in its own session)."""
    yield
    import signal

    for f in (tmp_path / "slurm").glob("*.json"):
        info = task_state(tmp_path / "slurm", f.stem)
        if info.get("State") in ("RUNNING", "PENDING") and info.get("Pid"):
            (tmp_path / "slurm" / f"{f.stem}.json").write_text(json.dumps({**info, "State": "CANCELLED"}))
            try:
                os.killpg(info["Pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_wheel_ships_configs_and_task_yamls_and_runs(tmp_path):
    """A built wheel (no checkout on the path) finds conf/ and tasks/ and runs a tiny model end to end."""
    src = tmp_path / "src"  # a copy of the project's files: no build/ or stale egg-info of the checkout used
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "multirun", "outputs", "wandb",
                                                             "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("h2o_harness-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {"h2o/conf/config.yaml", "h2o/conf/cluster.yaml", "h2o/conf/model/opt-66b.yaml", "h2o/lm_tasks/bb_copa.yaml",
            "h2o/pipeline/launch.py", "analysis/paper_results.csv"} <= set(names)
    assert any(n.endswith("licenses/LICENSE") for n in names)
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Python: >=3.11" in meta and "License-Expression: Apache-2.0" in meta and "sacrebleu" not in meta
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)], check=True)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "h2o.pipeline.run", "model=tiny-llama", "task=bb_copa", "task.limit=2",
                          "task.shots=1", "threads=1", "runs_dir=runs"], capture_output=True, text=True, cwd=tmp_path,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = (tmp_path / "runs").rglob("metrics.json")
    assert json.loads(record.read_text())["n_samples"] == 2
    where = "import importlib.util as u; print(u.find_spec('h2o').origin)"  # the wheel's h2o, not the checkout's
    assert subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, cwd=tmp_path,
                          env=env).stdout.startswith(str(site))


def test_missing_model_fails_before_submission_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: nothing could be submitted anyway
    args = ["experiment=table1", "model=opt-6.7b", "task=copa", "policy=h2o", "policy.budget=0.2",
            f"runs_dir={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/multirun/x"]
    assert launch.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: opt-6.7b x copa: facebook/opt-6.7b is not in the Hugging Face cache; run `make prefetch "
                   "EXP=...` on the login node first (or cluster.offline=false where compute nodes reach the hub)"]
    assert not (tmp_path / "multirun").exists()
    from h2o.pipeline.prefetch import main as prefetch

    assert prefetch([*args, "--check"]) == 1
    out = capsys.readouterr().out
    assert "model opt-6.7b: facebook/opt-6.7b is not in the Hugging Face cache" in out
