"""Sweeps on a Slurm cluster (issue 11) without one: the dry run (arrays, resources, GPU-hours), bad cluster
settings, the per-request log a requeued run resumes from, the states only a bigger cluster produces (a stand-in
sacct), the wheel, and a missing model caught before submission. The cluster path end to end against a real
Slurm: tests/test_slurm_real.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

from h2o.pipeline import launch, status
from h2o.assets.paths import REPO
from h2o.pipeline.sweep import expand
from h2o.tasks.progress import RequestLog, recording

TINY = ["experiment=default", "model=tiny-llama", "task=austen_ppl", "threads=1",
        "task_overrides.austen_ppl.n_windows=4", "++task_overrides.austen_ppl.window=96",
        "task_overrides.austen_ppl.batch_size=1"]


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


def test_status_names_what_the_scheduler_ended(tmp_path, monkeypatch, capsys):
    """What a one-node Slurm here cannot show, with a stand-in ``sacct``: tasks the scheduler ended as
    OUT_OF_MEMORY (needs cgroup memory enforcement, absent with TaskPlugin=task/none) and NODE_FAIL (needs a
    node to die) are failed in ``make status``, with the state and job id. tests/test_slurm_real.py covers the
    rest against a real Slurm: submission, requeue, preemption, time limits, cancellation, sacct's states."""
    sweep = [*TINY, "policy=local,h2o", "policy.budget=0.2", f"runs_dir={tmp_path}/runs",
             f"hydra.sweep.dir={tmp_path}/multirun/s1"]
    runs = [str(p.path) for p in expand(sweep, multirun=True).specs]
    (tmp_path / "multirun/s1").mkdir(parents=True)
    (tmp_path / "multirun/s1/launch.json").write_text(json.dumps({"arrays": [{"tasks": [
        {"job_id": "7_0", "runs": runs[:1]}, {"job_id": "7_1", "runs": runs[1:]}]}]}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\nprintf 'JobID|State|ExitCode\\n7_0|OUT_OF_MEMORY|0:125\\n"
                                   "7_0.batch|OUT_OF_MEMORY|0:125\\n7_1|NODE_FAIL|1:0\\n'\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert status.main(sweep) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "done 0 | running 0 | queued 0 | failed 2 | left 0",
        "FAILED tiny-llama austen_ppl local 0.2: OUT_OF_MEMORY (job 7_0)",
        "FAILED tiny-llama austen_ppl h2o 0.2: NODE_FAIL (job 7_1)"]


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
