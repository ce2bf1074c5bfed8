"""Configs, runner, sweeps, records and the lm-eval model (issue 3). Tiny random models; SmolLM2 nowhere.

Every config file of every group is composed and built; a shrunk experiment=default runs as a multirun with the
basic launcher and with submitit_local; a sweep killed part-way resumes without duplicated or torn records; the
table1 dry run lists every job; lm-eval's CLI runs ``--model h2o`` offline.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from h2o.core.policies import make_policy
from h2o.assets.model_spec import ConfigError
from h2o.pipeline.spec import build, prepare
from h2o.core.policies import PolicyError
from h2o.assets.paths import CONF
from h2o.assets.paths import REPO
from h2o.store.files import read_jsonl
from h2o.store.folders import budget_label, fmt, runs_root
from h2o.pipeline.sweep import Composer, _compose, expand
from h2o.pipeline.wandb_mirror import Settings, run_id
from run_folders import check_folders  # tests/run_folders.py
from wandb_offline import read_runs  # tests/wandb_offline.py
from tests.refusal import refusal

GROUPS = ("model", "task", "policy", "logger", "experiment")
PAPER_GRIDS = ("table1", "table2", "table8", "table9", "table10", "fig4", "fig8", "fig9", "helm")  # test_paper_grids.py
METHOD_GRIDS = ("methods", "methods_cluster")  # expanded by tests/test_methods_experiment.py (the cluster's one cell)
RECORD_KEYS = {"experiment", "model", "task", "task_kind", "policy", "budget", "heavy", "recent", "shots",
               "semantics", "seed", "n_samples", "metrics", "wall_s", "evicts", "scoring", "add_bos_token", "protocol"}
ENV_KEYS = {"git_commit", "git_dirty", "packages", "device", "torch_threads", "wall_s", "hostname"}
TINY = ["experiment=default", "model=tiny-llama", "policy.budget=0.2", "threads=1",
        "task_overrides.bb_copa.limit=3", "++task_overrides.bb_copa.shots=1",
        "task_overrides.austen_ppl.n_windows=2", "++task_overrides.austen_ppl.window=96",
        "task_overrides.bb_xsum.limit=2", "++task_overrides.bb_xsum.shots=1", "++task_overrides.bb_xsum.max_new_tokens=6",
        "++task_overrides.bb_xsum.doc_max_words=60"]


def files(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def h2o_run(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 400) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run([sys.executable, "-m", "h2o.pipeline.run", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout)


def records(root: Path) -> dict[Path, dict]:
    return {f.parent: json.loads(f.read_text()) for f in sorted(root.rglob("metrics.json"))}


# ------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("group", ["model", "task", "policy"])
def test_every_group_file_composes_and_builds(hydra_ctx, group, monkeypatch):
    """Each file: name == file name, builds its object (_target_), and a run with it validates (triattention's with a
    stand-in calibration whether or not this machine has written one: its refusal is tests/test_triattention.py's)."""
    from h2o.assets import triattention
    from h2o.assets.model_spec import ModelSpec
    from h2o.core.policies import Policy
    from h2o.tasks.base import TaskSpec

    from h2o.core.policies.triattention import FIELDS

    monkeypatch.setattr(triattention, "require", lambda model: dict.fromkeys(FIELDS))

    kinds = {"model": ModelSpec, "task": TaskSpec, "policy": Policy}
    names = files(group)
    assert len(names) >= {"model": 15, "task": 12, "policy": 11}[group]
    for name in names:
        tokens = ["policy.budget=96"] if name == "bench_streaming" else []  # streaming: a cache size in tokens
        if group == "policy":  # a task with a prompt (stand-in data), or a real-path one where no simulated form
            tokens = ["task=niah"] if Policy.registry[name].real_only else ["task=bb_copa"]
        cfg = _compose([f"{group}={name}", *tokens])
        assert cfg[group].name == name, f"conf/{group}/{name}.yaml: name must equal the file name"
        obj = build(group, cfg[group])
        assert isinstance(obj, kinds[group])
        spec = prepare(cfg)
        rel = spec.path.relative_to(runs_root(spec.cfg)).parts
        # the record's policy: h2o_reference's records are spelled policy=h2o semantics=reference (docs/policies.md)
        assert rel[:5] == ("adhoc", cfg.model.name, cfg.task.name, f"shots{cfg.task.shots}", spec.cfg.policy.name)
        assert spec.cfg.policy.name == ("h2o" if name == "h2o_reference" else spec.policy.name)
    from h2o.core.policies import POLICIES

    if group == "policy":
        assert set(names) == set(POLICIES)


def test_policy_budgets_and_splits(hydra_ctx):
    p = prepare(_compose(["policy=h2o", "policy.budget=0.2"])).policy
    assert (p.heavy, p.recent, p.evicts) == (0.1, 0.1, True)
    p = prepare(_compose(["policy=h2o", "policy.heavy=0.15", "policy.recent=0.05"]))
    assert (p.policy.heavy, p.policy.recent) == (0.15, 0.05) and p.path.name == "h0.15-r0.05"
    p = prepare(_compose(["policy=streaming_llm", "policy.sinks=8", "policy.budget=64"]))
    assert p.policy.sinks == 8 and p.path.parts[-2:] == ("64tok", "sinks=8")
    assert prepare(_compose(["policy=topk"])).head()["evicts"] is False
    assert prepare(_compose(["policy=full", "policy.budget=0.3"])).path.name == "1.0"  # full is one folder


def test_model_task_logger_launcher_details(hydra_ctx, monkeypatch):
    cfg = _compose(["model=opt-66b"])
    assert (cfg.model.device_map, cfg.model.dtype, cfg.model.pretrained) == ("auto", "fp16", "facebook/opt-66b")
    assert build("model", _compose(["model=smollm2-135m"]).model).dtype == "fp32"
    xsum = build("task", _compose(["task=xsum"]).task)
    assert (xsum.max_new_tokens, xsum.temperature, xsum.stop, xsum.doc_max_words, xsum.shots) == (64, 0.3, "###", 512, 5)
    cnn = build("task", _compose(["task=cnn_dm"]).task)
    assert (cnn.sentences, cnn.max_new_tokens, cnn.dataset) == (3, 128, "cnn_dm")
    assert all(build("task", _compose([f"task={t}"]).task).shots == 5
               for t in ("copa", "mathqa", "openbookqa", "piqa", "rte", "winogrande"))
    wb = _compose(["logger=wandb"]).logger
    assert wb.wandb is True and wb.mode in ("offline", os.environ.get("WANDB_MODE"))
    # a known choice to Hydra; h2o-run hands it to h2o.pipeline.launch (tests/test_jobs.py), settings: conf/cluster.yaml
    launcher = _compose(["hydra/launcher=slurm"], hydra_cfg=True).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    local = _compose(["hydra/launcher=submitit_local"], hydra_cfg=True).hydra.launcher
    assert local._target_.endswith("LocalLauncher")


def test_every_experiment_expands_and_fast_compose_equals_hydra(hydra_ctx, monkeypatch):
    """Each experiment's jobs validate (the paper's: tests/test_paper_grids.py); the fast composer gives Hydra's config.
    kvquant's calibration file is not loaded (a fresh cache has none; experiment=quant's docs say to fit it first)."""
    from h2o.core.quant.kvquant import KVQuant
    from h2o.pipeline.sweep import job_overrides

    monkeypatch.setattr(KVQuant, "load", lambda self, calibration: None)

    composer = Composer()
    for exp in files("experiment"):
        if exp not in PAPER_GRIDS + METHOD_GRIDS:
            sweep = expand([f"experiment={exp}"], multirun=True)
            home = {"default_long_generation": "default"}.get(exp, exp)  # its records live beside the default's
            assert sweep.specs and all(p.cfg.experiment_name == home for p in sweep.specs)
            check_folders(exp, sweep)  # every job in the folder its record has been written to
        jobs = job_overrides([f"experiment={exp}", "seed=3", "++task_overrides.x.limit=2"], multirun=True)[0]
        for job in jobs[:: max(1, len(jobs) // 4)]:
            fast = OmegaConf.to_container(composer(job), resolve=False)
            assert fast == OmegaConf.to_container(_compose(job), resolve=False), job


@pytest.mark.parametrize("args, words", [
    (["policy=nope"], ["policy", "allowed"]),
    (["policy.budget=1.5"], ["budget=1.5"]),
    (["task=nope"], ["task", "nope"]),
    (["task=bb_copa", "task.scoring=avg"], ["scoring", "mean, sum"]),
    (["semantics=reference", "policy=local"], ["reference", "h2o"]),
    (["-m", "policy=h2o,local", "policy.budget=0.2,-1"], ["budget"]),
])
def test_bad_values_exit_2_with_one_line_before_any_load(args, words, capsys, tmp_path, monkeypatch):
    from h2o.assets import model_spec as models_spec
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    models_spec._LOADED.clear()  # earlier in-process runs keep their model for the next job
    assert main(args) == 2
    err = refusal(capsys)
    assert err.startswith("error:") and len(err.splitlines()) == 1 and all(w in err for w in words), err
    assert not models_spec._LOADED and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ dry run
def test_dry_run_lists_every_job(capsys):
    from h2o.pipeline.sweep import main

    assert main(["experiment=table8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    jobs = [ln.split() for ln in lines[1:-1]]
    assert {(j[3], j[5]) for j in jobs} == set(product(["copa", "openbookqa", "piqa", "winogrande"],
                                                        ["full", "topk", "topk_h2"]))
    assert all(j[2] == "opt-30b" and j[4] == "5" and j[7].startswith("table8/opt-30b/") for j in jobs)
    assert lines[-1] == ("12 jobs: 12 to run, 0 finished already, 0 duplicates, 0 served by the full run "
                         "(budget 1.0 never evicts)")


# ------------------------------------------------------------------------------------- run records
def test_run_folder_names():
    assert fmt(0.2) == "0.2" and fmt(1.0) == "1.0" and fmt(True) == "true" and fmt(None) == "null"
    assert budget_label(make_policy("h2o", budget=0.04)) == "0.04"
    assert budget_label(make_policy("local", budget=64)) == "64tok"
    assert budget_label(make_policy("h2o", heavy=0.15, recent=0.05), hand_split=True) == "h0.15-r0.05"
    assert budget_label(make_policy("full")) == "1.0"


def check_records(root: Path, expect: dict[str, int]) -> dict[Path, dict]:
    """Every finished run has the contract's files and fields; returns the records."""
    recs = records(root)
    assert {r["task"] for r in recs.values()} == set(expect)
    for path, rec in recs.items():
        assert RECORD_KEYS <= rec.keys(), RECORD_KEYS - rec.keys()
        assert rec["n_samples"] == expect[rec["task"]]
        samples = read_jsonl(path / "samples.jsonl")
        assert len(samples) == rec["n_samples"]
        env = json.loads((path / "env.json").read_text())
        assert ENV_KEYS <= env.keys() and env["packages"]["torch"] == torch.__version__.split("+")[0] or True
        assert len(env["git_commit"] or "") in (0, 40) and env["torch_threads"] >= 1
        cfg = OmegaConf.load(path / "config.yaml")
        assert cfg.policy.name == rec["policy"] and cfg.task.name == rec["task"] and cfg.model.name == "tiny-llama"
        assert path.parts[-5:-2] == (rec["task"], f"shots{rec['shots']}", rec["policy"])
        kind = rec["task_kind"]
        assert rec["add_bos_token"] is False and rec["protocol"]["add_bos_token"] is False
        assert rec["scoring"] == ("mean" if kind == "multiple_choice" else None) == rec["protocol"]["scoring"]
        assert {k: v for k, v in cfg.task.items() if k not in ("_target_", "name", "batch_size")}.items() \
            <= rec["protocol"].items()
        if kind == "multiple_choice":
            assert 0 <= rec["metrics"]["acc"] <= 1 and "acc_norm" in rec["metrics"] and "acc_stderr" in rec["metrics"]
            assert 0 <= rec["metrics"]["acc_mean"] <= 1 and "acc_mean_stderr" in rec["metrics"]
            assert all(len(s["loglikelihoods"]) >= 2 for s in samples)
            assert rec["semantics"] == "simulated"
        elif kind == "perplexity":
            assert rec["metrics"]["ppl"] > 1 and rec["semantics"] == "simulated"
            m = rec["metrics"]
            assert m["ppl_ci95_low"] <= m["ppl"] <= m["ppl_ci95_high"] and m["nll_per_token_stderr"] > 0
        else:
            assert kind == "summarization" and rec["semantics"] == "real"
            assert {"rouge1", "rouge2", "rougeL", "rouge1_stderr", "rouge2_stderr", "rougeL_stderr"} <= rec["metrics"].keys()
            assert all({"doc_id", "prompt", "generation", "reference", "rouge2"} <= s.keys() for s in samples)
            assert all(s["prompt"].startswith("###\nArticle: ") for s in samples)
    return recs


@pytest.mark.slow
def test_sweep_basic_launcher_end_to_end_with_wandb(tmp_path):
    args = ["-m", *TINY, "task=bb_copa,bb_xsum,austen_ppl", "policy=full,h2o", f"runs_dir={tmp_path}/runs",
            "logger=wandb"]
    out = h2o_run(args, tmp_path, env={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    recs = check_records(tmp_path / "runs", {"bb_copa": 3, "bb_xsum": 2, "austen_ppl": 2})
    assert len(recs) == 6
    h2o = {r["task"]: r for r in recs.values() if r["policy"] == "h2o"}
    assert h2o["bb_xsum"]["kv_bytes_per_seq"] < {r["task"]: r for r in recs.values()
                                                  if r["policy"] == "full"}["bb_xsum"]["kv_bytes_per_seq"] / 3
    mirrored = {r.name: r for r in read_runs(tmp_path / "runs" / ".wandb")}  # one run per record + the summary
    names = {str(p.relative_to(tmp_path / "runs")): r for p, r in recs.items()}
    assert set(mirrored) == {*names, "default/summary"}
    for name, rec in names.items():
        run = mirrored[name]
        assert (run.id, run.group, run.job_type) == (run_id("default", name), "default", rec["task"])
        assert f"policy:{rec['policy']}" in run.tags and run.config["sweep"].startswith("multirun/default/")
        assert run.history[-1]["n_samples"] == rec["n_samples"]
    assert any(k.startswith("_wandb/visualize/fig4/") for k in mirrored["default/summary"].config)
    from h2o.pipeline import wandb_sync
    assert wandb_sync.sync(tmp_path / "runs", Settings()) == {"logged": 0, "unchanged": 6, "failed": 0}
    jobs = read_jsonl(next((tmp_path / "multirun").rglob("jobs.jsonl")))
    assert sorted(j["status"] for j in jobs) == ["done"] * 6
    stamps = {p: (p / "metrics.json").stat().st_mtime_ns for p in recs}
    again = h2o_run(args[:-1], tmp_path)  # rerun: everything is skipped, nothing rewritten
    assert again.returncode == 0 and again.stderr.count("skip, finished already") == 6, again.stderr[-2000:]
    assert stamps == {p: (p / "metrics.json").stat().st_mtime_ns for p in records(tmp_path / "runs")}


@pytest.mark.slow
def test_sweep_submitit_local_launcher(tmp_path):
    args = ["-m", *TINY, "task=bb_copa", "policy=full,local", f"runs_dir={tmp_path}/runs",
            "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5", "hydra.launcher.cpus_per_task=1"]
    out = h2o_run(args, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = check_records(tmp_path / "runs", {"bb_copa": 3})
    assert sorted(r["policy"] for r in recs.values()) == ["full", "local"]
    assert all(json.loads((p / "env.json").read_text())["torch_threads"] == 1 for p in recs)
    assert list((tmp_path / "multirun").rglob(".submitit"))


@pytest.mark.slow
def test_killed_sweep_resumes_exactly_the_missing_runs(tmp_path):
    args = ["-m", *TINY, "task=austen_ppl", "policy=full,local,streaming_llm,h2o", f"runs_dir={tmp_path}/runs"]
    dead = h2o_run(args, tmp_path, env={"H2O_TEST_CRASH_AT": "3"})
    assert dead.returncode == 17, dead.stderr[-2000:]
    first = records(tmp_path / "runs")
    assert sorted(r["policy"] for r in first.values()) == ["full", "local"]
    torn = [p.parent for p in (tmp_path / "runs").rglob("config.yaml") if p.parent not in first]
    assert len(torn) == 1 and "streaming_llm" in str(torn[0])
    assert (torn[0] / "samples.jsonl").read_text().endswith("torn")  # a torn file, as a kill leaves it
    stamps = {p: (p / "metrics.json").stat().st_mtime_ns for p in first}
    again = h2o_run(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    recs = check_records(tmp_path / "runs", {"austen_ppl": 2})
    assert sorted(r["policy"] for r in recs.values()) == ["full", "h2o", "local", "streaming_llm"]
    assert stamps == {p: (p / "metrics.json").stat().st_mtime_ns for p in first}  # finished runs untouched
    jobs = read_jsonl(sorted((tmp_path / "multirun").rglob("jobs.jsonl"))[-1])
    assert sorted(j["status"] for j in jobs) == ["done", "done", "skipped", "skipped"]
    assert not list((tmp_path / "runs").rglob(".*.tmp"))


@pytest.mark.slow
def test_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    # every value is validated per job before anything runs (the xsum shot pool included); a job that fails while
    # it runs (here the xsum task's run raises) is recorded, and the sweep goes on with the next
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("h2o.tasks.summarization.SummarizationTask.run", lambda *a, **k: 1 / 0)
    assert main(["-m", *TINY, "task=bb_xsum,bb_copa", "policy=local", f"runs_dir={tmp_path}/runs"]) == 1
    out = capsys.readouterr()
    text = out.out + out.err  # the sweep's summary lines (to stdout or stderr, as the process's logging is set up)
    assert "FAILED job" in text and "division by zero" in text, text[-2000:]
    assert [r["task"] for r in records(tmp_path / "runs").values()] == ["bb_copa"]
    fails = read_jsonl(next((tmp_path / "multirun").rglob("failures.jsonl")))
    assert len(fails) == 1 and "task=bb_xsum" in fails[0]["overrides"] and fails[0]["traceback"]


# ------------------------------------------------------------------------------------------ lm-eval
@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def test_padding_layout_round_trip():
    from h2o.tasks.batching import from_left_padding, to_left_padding

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    lengths = torch.tensor([4, 2, 1])
    left, mask = to_left_padding(ids, lengths)
    assert left.tolist() == [[5, 6, 7, 8], [0, 0, 9, 10], [0, 0, 0, 11]]
    assert mask.sum(-1).tolist() == [4, 2, 1]
    back = from_left_padding(left[:, :, None].float(), lengths)[..., 0].long()
    assert [back[b, :n].tolist() for b, n in enumerate(lengths.tolist())] == [[5, 6, 7, 8], [9, 10], [11]]


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm"])
def test_lm_eval_batches_equal_single_requests_and_mean_scoring(tiny, policy):
    """Batch size does not change any log-likelihood (true lengths, not the padded one, set the budget)."""
    from h2o.tasks.multiple_choice import LmEvalTask

    model, tok = tiny
    runs = {bs: LmEvalTask("bb_piqa", "bb_piqa", "tasks", shots=0, limit=4, batch_size=bs).run(
        model, tok, make_policy(policy, budget=0.3), "simulated", 0) for bs in (1, 4)}
    one, four = ([s["loglikelihoods"] for s in runs[bs].samples] for bs in (1, 4))
    assert len(one) == 4 and max(len(x) for x in one) > 1
    assert torch.allclose(torch.tensor(sum(one, [])), torch.tensor(sum(four, [])), atol=1e-3)
    # both accuracies from the same forward pass: lm-eval's summed rule and the paper code's per-token mean
    res = runs[4]
    assert {"acc", "acc_norm", "acc_mean", "acc_mean_stderr"} <= res.metrics.keys()
    for s in res.samples:
        assert len(s["cont_tokens"]) == len(s["loglikelihoods"]) and min(s["cont_tokens"]) >= 1
        means = [ll / n for ll, n in zip(s["loglikelihoods"], s["cont_tokens"])]
        assert s["acc_mean"] == float(means.index(max(means)) == s["target"])
        assert s["acc"] == float(s["pred"] == s["target"])
    assert res.metrics["acc_mean"] == sum(s["acc_mean"] for s in res.samples) / 4
    from lm_eval.api.metrics import mean_stderr

    hits = [s["acc_mean"] for s in res.samples]
    assert res.metrics["acc_mean_stderr"] == pytest.approx(mean_stderr(hits) if len(set(hits)) > 1 else 0.0)
    assert len({n for s in res.samples for n in s["cont_tokens"]}) > 1  # the two rules can differ here
    # the lm-eval model's own scoring=mean (for lm-eval's CLI) divides the same log-likelihoods
    from h2o.tasks.lm_eval_model import H2OLM

    lm = H2OLM(pretrained=model, tokenizer=tok, policy=policy, budget=0.3, scoring="mean", batch_size=4,
               add_bos_token=False)
    from lm_eval.api.instance import Instance

    reqs = [Instance("loglikelihood", {}, args, 0) for args in
            [("A question:", " one answer"), ("A question:", " a longer second answer")]]
    summed = H2OLM(pretrained=model, tokenizer=tok, policy=policy, budget=0.3, batch_size=4,
                   add_bos_token=False).loglikelihood(reqs)
    averaged = lm.loglikelihood(reqs)
    for (s_ll, _), (m_ll, _), req in zip(summed, averaged, reqs):
        assert abs(m_ll * lm.cont_tokens[req.args] - s_ll) < 1e-4
    # a request answered from lm-eval's cache (a resumed run) is never scored: its count is encoded the same way
    fresh = H2OLM(pretrained=model, tokenizer=tok, policy=policy, budget=0.3)
    assert [fresh.n_cont_tokens(*r.args) for r in reqs] == [lm.cont_tokens[r.args] for r in reqs] == [11, 23]


def test_lm_eval_model_rejects_bad_args(tiny):
    from h2o.tasks.lm_eval_model import H2OLM

    model, tok = tiny
    with pytest.raises(PolicyError, match="allowed"):
        H2OLM(pretrained=model, tokenizer=tok, policy="nope")
    with pytest.raises(PolicyError, match="scoring"):
        H2OLM(pretrained=model, tokenizer=tok, policy="h2o", budget=0.2, scoring="avg")
    with pytest.raises(ConfigError):
        build("task", OmegaConf.create({"_target_": "h2o.tasks.multiple_choice.LmEvalTask", "name": "x", "lm_eval_task": "nope",
                                        "include_path": "tasks"}))


@pytest.mark.slow
def test_lm_eval_cli_with_model_h2o_offline(tmp_path):
    out = subprocess.run([sys.executable, "-m", "h2o.tasks.lm_eval_cli", "--model", "h2o", "--model_args",
                          "pretrained=tiny:llama,policy=h2o,heavy=0.1,recent=0.1", "--tasks", "bb_copa",
                          "--include_path", str(REPO / "tasks"), "--limit", "3", "--num_fewshot", "0",
                          "--batch_size", "2", "--output_path", str(tmp_path / "out"), "--device", "cpu"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert 0 <= result["results"]["bb_copa"]["acc,none"] <= 1
    assert result["config"]["model_args"]["policy"] == "h2o" and result["config"]["model_args"]["heavy"] == 0.1


# ------------------------------------------------------------------------------------ summarization
def test_helm_prompt_and_example_selection(tiny):
    from h2o.tasks.summarization import SummarizationTask, block, clean

    assert block("A b.", 1, "S.") == "###\nArticle: A b.\n\nSummarize the above article in 1 sentence.\nS.\n"
    assert block("A b.", 3).endswith("in 3 sentences.")  # the open block: HELM's output_prefix.rstrip()
    assert clean("a\n b  c", 2) == "a b"
    task = SummarizationTask("bb_xsum", "bb_xsum", shots=5, limit=7, subset_seed=0)
    shots, test = task.examples()
    assert len(shots) == 5 and all(50 <= len(clean(s["article"], 512).split()) <= 150 for s in shots)
    assert len(test) == 7 and [r["id"] for r in test] == [r["id"] for r in task.examples()[1]]  # fixed subset
    _, tok = tiny
    text = task.prompt(shots, test[0], tok, 100_000)
    assert text.count("###\nArticle: ") == 6 and text.endswith("Summarize the above article in 1 sentence.")
    first = block(clean(shots[0]["article"], 512), 1, clean(shots[0]["summary"]))
    assert text.startswith(first + "\n###") and first.endswith(".\n")  # blocks joined by HELM's "\n"
    n = len(tok(text).input_ids)
    short = task.prompt(shots, test[0], tok, n - 10)  # too long: the last in-context block goes first (HELM)
    assert len(tok(short).input_ids) <= n - 10 and short.count("###\nArticle: ") == 5
    assert short.startswith(first) and short.endswith(text[text.rindex("###"):])
    with pytest.raises(ConfigError, match="temperature"):
        SummarizationTask("x", "bb_xsum", temperature=0.0)


def bos_tokenizer():
    """The tiny byte tokenizer made to add BOS like LLaMA's and OPT's."""
    from tokenizers import processors

    from h2o.assets.tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def test_bos_follows_add_bos_token_and_is_resolved(tiny):
    """add_bos_token=false (the paper code's default here) never prepends BOS, for lm-eval requests and HELM
    prompts alike; null is the tokenizer's default (BOS for this one, like LLaMA/OPT); records state it resolved."""
    from h2o.tasks.base import adds_bos
    from h2o.tasks.lm_eval_model import H2OLM
    from h2o.tasks.multiple_choice import LmEvalTask
    from h2o.tasks.summarization import SummarizationTask

    model, plain = tiny
    tok = bos_tokenizer()
    assert tok.encode("ab")[0] == tok.bos_token_id and plain.encode("ab")[0] != plain.bos_token_id
    assert (adds_bos(tok, None), adds_bos(tok, False), adds_bos(tok, True), adds_bos(plain, None)) == \
        (True, False, True, False)
    for flag, first in ((False, ord("a")), (None, tok.bos_token_id)):
        lm = H2OLM(pretrained=model, tokenizer=tok, policy="full", add_bos_token=flag)
        ctx, cont = lm._encode_pair("a question", " an answer")
        assert ctx[0] == first and cont[0] == ord(" ")
        mc = LmEvalTask("bb_piqa", "bb_piqa", "tasks", add_bos_token=flag)
        assert mc.add_bos(tok) == (flag is None) and mc.protocol(tok)["add_bos_token"] == (flag is None)
        summ = SummarizationTask("bb_xsum", "bb_xsum", add_bos_token=flag)
        assert tok("###", **summ.encode_kwargs()).input_ids[0] == (tok.bos_token_id if flag is None else ord("#"))
    assert H2OLM(pretrained=model, tokenizer=tok, policy="full")._encode_pair("a q", " b")[0][0] == ord("a")  # default
    proto = LmEvalTask("bb_piqa", "bb_piqa", "tasks").protocol(tok)
    assert proto["scoring"] == "mean" and proto["add_bos_token"] is False and "batch_size" not in proto
    assert SummarizationTask("bb_xsum", "bb_xsum").protocol(tok)["scoring"] is None
    from h2o.tasks.streaming import StreamingTask
    from h2o.tasks.perplexity import PerplexityTask

    assert StreamingTask("bench_streaming").add_bos(tok) and not StreamingTask("bench_streaming").add_bos(plain)
    assert PerplexityTask("austen_ppl").protocol(tok)["add_bos_token"] is False  # windows: no special tokens


def test_console_script_finds_the_configs(tmp_path):
    script = Path(sys.executable).parent / "h2o-run"
    if not script.exists():
        pytest.skip("package not installed with its console script")
    out = subprocess.run([str(script), "policy=streaming_llm", "policy.sinks=-1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: sinks=-1"), out.stderr[-2000:]
