"""The state of a sweep's jobs (h2o.pipeline.jobs), one rule for every launcher: each state of the classifier, the
local runner skipping what the full run serves, and ``h2o-run ... hydra/launcher=slurm`` being
``make sweep LAUNCHER=slurm`` (h2o.pipeline.launch)."""
from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from h2o.pipeline import launch, run
from h2o.pipeline.jobs import classify, mark_in_flight, place, summary
from h2o.store.files import read_jsonl
from h2o.store.folders import COMPLETE
from h2o.pipeline.sweep import expand

TINY = ["experiment=default", "model=tiny-llama", "task=austen_ppl", "threads=1",
        "task_overrides.austen_ppl.n_windows=4", "++task_overrides.austen_ppl.window=96",
        "task_overrides.austen_ppl.batch_size=1"]


def finish(spec) -> None:
    """A record of the spec's config that counts as finished (its config.yaml; metrics.json with every COMPLETE
    field and the semantics), without running it."""
    spec.path.mkdir(parents=True, exist_ok=True)
    (spec.path / "config.yaml").write_text(OmegaConf.to_yaml(spec.cfg, resolve=True))
    (spec.path / "metrics.json").write_text(json.dumps({**{k: 0 for k in COMPLETE}, "metrics": {"ppl": 1.0},
                                                        "semantics": spec.semantics}))


def works_of(tmp_path, *overrides):
    sweep = expand([*TINY, f"runs_dir={tmp_path}/runs", f"hydra.sweep.dir={tmp_path}/multirun/s", *overrides],
                   multirun=True)
    return sweep, classify(sweep.jobs, sweep.specs)


def by_job(works):
    return {(w.spec.policy.name, 1.0 if w.spec.policy.name == "full" else w.spec.policy.budget): w for w in works}


def test_each_state_of_the_classifier(tmp_path):
    sweep, works = works_of(tmp_path, "policy=h2o,full,local", "policy.budget=0.2,1.0")
    states = [(w.spec.policy.name, w.spec.policy.budget if w.spec.policy.name != "full" else 1.0, w.state)
              for w in works]
    # full's second job names its first one's folder; h2o and local at 1.0 never evict and full is in the sweep
    # (after h2o in the order: the sweep's order does not matter)
    assert states == [("h2o", 0.2, "todo"), ("h2o", 1.0, "served"), ("full", 1.0, "todo"), ("full", 1.0, "dup"),
                      ("local", 0.2, "todo"), ("local", 1.0, "served")]
    full = by_job(works)[("full", 1.0)].spec.path
    assert all(w.served_by == full for w in works if w.state == "served")
    assert {"full", "1.0"} <= set(full.parts) and "h2o" not in full.parts
    assert summary(works) == ("6 jobs: 3 to run, 0 finished already, 1 duplicates, 2 served by the full run "
                              "(budget 1.0 never evicts)")

    finish(by_job(works)[("h2o", 0.2)].spec)
    finish(by_job(works)[("local", 1.0)].spec)  # a record of its own (a sweep before this rule): done, kept
    _, works = works_of(tmp_path, "policy=h2o,full,local", "policy.budget=0.2,1.0")
    assert [w.state for w in works] == ["done", "served", "todo", "dup", "todo", "done"]


def test_served_by_a_finished_full_run_outside_the_sweep_and_todo_without_one(tmp_path):
    _, works = works_of(tmp_path, "policy=h2o", "policy.budget=1.0")
    (alone,) = works
    assert alone.state == "todo" and alone.served_by is None  # no full run to serve it: it runs itself
    _, (full,) = works_of(tmp_path, "policy=full")
    finish(full.spec)
    _, (again,) = works_of(tmp_path, "policy=h2o", "policy.budget=1.0")
    assert again.state == "served" and again.served_by == full.spec.path
    # another semantics evicts differently (a 1.0 budget under `reference` is not the full run's cell)
    _, (ref,) = works_of(tmp_path, "policy=h2o", "policy.budget=1.0", "semantics=reference")
    assert ref.state == "todo"


def test_in_flight_and_placed_states(tmp_path, monkeypatch):
    sweep, works = works_of(tmp_path, "policy=local,h2o", "policy.budget=0.2,0.4")
    runs = [str(w.spec.path) for w in works]
    (tmp_path / "multirun/old").mkdir(parents=True)
    (tmp_path / "multirun/old/launch.json").write_text(json.dumps({"arrays": [{"tasks": [
        {"job_id": "9_0", "runs": runs[:2]}, {"job_id": "9_1", "runs": runs[2:3]}]}]}))
    (tmp_path / "multirun/old/failures.jsonl").write_text(json.dumps({"run_dir": runs[2], "error": "ValueError: x"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\nprintf 'JobID|State|ExitCode\\n9_0|RUNNING|0:0\\n9_1|COMPLETED|0:0\\n'\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    by, why = place(works, tmp_path / "multirun")
    assert {s: [runs.index(str(w.spec.path)) for w in ws] for s, ws in by.items()} == {
        "done": [], "running": [0], "queued": [1], "failed": [2], "left": [3]}
    assert why == {runs[2]: "ValueError: x (job 9_1)"}
    mark_in_flight(works, tmp_path / "multirun")  # a second submission leaves the running task's runs alone
    assert [w.state for w in works] == ["queued", "queued", "todo", "todo"]


def test_local_runner_skips_the_runs_full_serves(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "multirun/s"
    args = ["-m", *TINY, "policy=h2o,full", "policy.budget=0.2,1.0", f"runs_dir={tmp_path}/runs",
            f"hydra.sweep.dir={sweep_dir}"]
    assert run.main(args) == 0
    rows = {tuple(o for o in r["overrides"] if o.startswith("policy")): r["status"]
            for r in read_jsonl(sweep_dir / "jobs.jsonl")}
    assert rows == {("policy=h2o", "policy.budget=0.2"): "done", ("policy=h2o", "policy.budget=1.0"): "served",
                    ("policy=full", "policy.budget=0.2"): "done", ("policy=full", "policy.budget=1.0"): "skipped"}
    records = sorted(p.parent.relative_to(tmp_path / "runs").parts for p in (tmp_path / "runs").rglob("metrics.json"))
    assert len(records) == 2 and {"full", "1.0"} <= set(records[0]) and {"h2o", "0.2"} <= set(records[1])
    # no record at h2o 1.0: the table shows full's there (analysis/tables.py)
    assert json.loads((sweep_dir / "served.json").read_text()) == {
        str(w.spec.path): str(w.served_by) for w in classify(*(lambda s: (s.jobs, s.specs))(
            expand(args[1:], multirun=True))) if w.state == "served"} != {}
    assert run.main(args) == 0  # again: nothing reruns
    assert len(list((tmp_path / "runs").rglob("metrics.json"))) == 2


def test_hydra_slurm_launcher_is_the_launch_path(tmp_path, capfd):
    args = [*TINY, "policy=full,h2o", "policy.budget=0.2,1.0", f"runs_dir={tmp_path}/runs",
            f"hydra.sweep.dir={tmp_path}/multirun/s", "cluster.chunk=1", "--dry"]
    assert launch.main(args) == 0
    direct = capfd.readouterr().out
    assert direct.startswith("4 jobs: 2 to run, 0 finished already, 1 duplicates, 1 served by the full run")
    assert "2 tasks, 2 runs" in direct  # cluster.chunk=1 reached launch
    assert run.main(["-m", "hydra/launcher=slurm", *args]) == 0
    assert capfd.readouterr().out == direct
    assert run.main(["-m", "hydra/launcher=slurm", *args[:-2], "cluster.chunk=0", "--dry"]) == 2
    assert capfd.readouterr().err.strip() == "error: cluster.chunk=0: expected a positive int"



def test_make_sweep_dry_lists_the_defaults_companion_and_slurm_status_prefetch_take_it(tmp_path):
    """``make sweep DRY=1`` lists the default's 8 runs, then its companion's (ALSO_default: the long generation, full's
    run first); LAUNCHER=slurm, status and prefetch take both; ARGS (another grid) or another EXP: the one."""
    import subprocess
    import sys

    from h2o.assets.paths import REPO

    def make(*args, printed=False):  # printed: the commands only (make -n)
        return subprocess.run(["make", "--no-print-directory", "-o", ".venv/installed", *(["-n"] if printed else []),
                               f"PY={sys.executable}", *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    out = make("sweep", "DRY=1", f"ARGS=runs_dir={tmp_path}/runs")  # ARGS: one experiment
    assert out.returncode == 0 and out.stdout.count("total: ") == 1 and "long_generation" not in out.stdout
    out = make("sweep", "DRY=1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "8 jobs: " in out.stdout and "3 jobs: " in out.stdout and out.stdout.count("total: ") == 2
    listed = [line.split()[5] for line in out.stdout.splitlines() if line.split()[3:4] == ["long_generation"]]
    assert listed == ["full", "h2o", "r_kv"]
    for target, module in (("sweep LAUNCHER=slurm", "run"), ("status", "status"), ("prefetch", "prefetch")):
        lines = [ln for ln in make(*target.split(), printed=True).stdout.splitlines() if "h2o.pipeline" in ln]
        assert [f"experiment={e}" in lines[0] for e in ("default", "default_long_generation")] == [True, True]
        assert lines[0].count(f"-m h2o.pipeline.{module} ") == 2, lines
        assert make(*target.split(), "EXP=table1", printed=True).stdout.count("h2o.pipeline.") == 1
