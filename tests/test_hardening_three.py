"""Hardening, round three: the weights checked against the machine before loading, requests whose budget rounds a
part to zero counted in the record, the analysis CLI's missing runs root and unreadable budgets, and the API's
empty inputs. The command-line bad values of this round are rows of tests/test_hardening.py's tables."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_hardening import TINY, no_load, one_line_exit_2  # tests/ is on sys.path (no package)

GiB = 2**30


@pytest.fixture(scope="module", autouse=True)
def release_models():
    """The real runs below keep the tiny model cached; later tests expect none loaded."""
    yield
    from h2o.assets.model_spec import release

    release()


# ---------------------------------------------------------------------------------------- resources
def test_every_model_yaml_declares_its_parameter_count():
    from omegaconf import OmegaConf

    from h2o.assets.models import tiny_model
    from h2o.assets.paths import CONF

    files = sorted((CONF / "model").glob("*.yaml"))
    params = {f.stem: OmegaConf.load(f).params for f in files}
    assert all(isinstance(p, int) and p > 0 for p in params.values()), params
    for arch in ("opt", "llama", "llama_gqa", "gpt_neox"):  # the tiny models: counted on the model itself
        assert params[f"tiny-{arch.replace('_', '-')}"] == sum(p.numel() for p in tiny_model(arch).parameters())
    # the real ones: the published architectures built on the meta device (no weights, no hub)
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig

    def count(cfg):
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())

    assert params["opt-66b"] == count(OPTConfig(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72,
                                                ffn_dim=36864, word_embed_proj_dim=9216))
    assert params["llama-7b"] == count(LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                                   num_attention_heads=32, vocab_size=32000)) == 6738415616


@pytest.fixture
def cpu_machine(monkeypatch):
    """A 24 GiB machine without a GPU."""
    from h2o.assets import resources

    monkeypatch.setattr(resources, "host_memory", lambda: 24 * GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_weights_over_ram_refused_before_loading(cpu_machine, tmp_path, monkeypatch, capsys):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    code = main(["model=opt-66b", "model.device_map=null", "model.resources.gpus=0", "threads=1",
                 f"runs_dir={tmp_path}/runs"])
    one_line_exit_2(code, capsys, ["model=opt-66b", "131.4 GB of weights", "65.7e9 params x 2 bytes, fp16",
                                   "25.8 GB of RAM", "fits: up to 12.9e9 params", "opt-6.7b", "smollm2-135m"])
    assert not (tmp_path / "runs").exists()


def test_gpu_config_on_a_cpu_machine_one_line(cpu_machine, tmp_path, monkeypatch, capsys):
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    code = main(["model=llama-7b", "threads=1", f"runs_dir={tmp_path}/runs"])
    one_line_exit_2(code, capsys, ["model=llama-7b", "a GPU config", "sees no GPU",
                                   "model.device_map=null model.resources.gpus=0"])
    assert not (tmp_path / "runs").exists()


def test_small_weights_pass_and_unknown_params_skip(cpu_machine):
    from h2o.assets.model_spec import ConfigError, ModelSpec
    from h2o.assets.resources import check_fits_here

    check_fits_here(ModelSpec("tiny-llama", "tiny:llama", "fp32", params=115008))
    check_fits_here(ModelSpec("x", "tiny:llama", "fp32", params=None))  # unknown: no check
    with pytest.raises(ConfigError, match="28.0 GB of weights \\(7e9 params x 4 bytes, fp32, auto on the CPU\\)"):
        check_fits_here(ModelSpec("big", "tiny:llama", "auto", params=7 * 10**9))  # 28 GB fp32 > 24 GiB


def test_weights_over_gpu_memory(monkeypatch):
    """Two 24 GB cards (faked): OPT-30B's 60 GB of fp16 weights do not fit; with device_map=cuda:0 one card counts."""
    from h2o.assets.model_spec import ConfigError, ModelSpec
    from h2o.assets.resources import check_fits_here

    card = SimpleNamespace(name="Fake24", total_memory=24 * 10**9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: card)
    spec = ModelSpec("opt-30b", "facebook/opt-30b", "fp16", "auto", {"gpus": 2}, params=29974540288)
    with pytest.raises(ConfigError, match=r"59.9 GB of weights \(30e9 params x 2 bytes, fp16\) .* 48.0 GB of 2 GPUs "
                                          r"\(Fake24\); fits: up to 24e9"):
        check_fits_here(spec)
    spec = ModelSpec("opt-13b", "facebook/opt-13b", "fp16", "cuda:0", {"gpus": 1}, params=12853473280)
    with pytest.raises(ConfigError, match=r"25.7 GB of weights .* 24.0 GB of 1 GPU \(Fake24\)"):
        check_fits_here(spec)
    check_fits_here(ModelSpec("opt-13b", "facebook/opt-13b", "fp16", "auto", {"gpus": 2}, params=12853473280))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the real device's memory")
def test_weights_over_the_real_gpu():
    from h2o.assets.model_spec import ConfigError, ModelSpec
    from h2o.assets.resources import check_fits_here

    total = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    too_big = total // 4 + 10**9  # fp32: 4 bytes each
    with pytest.raises(ConfigError, match="GB of weights .* GPU"):
        check_fits_here(ModelSpec("big", "tiny:llama", "fp32", "auto", {"gpus": 1}, params=too_big))
    check_fits_here(ModelSpec("tiny", "tiny:llama", "fp32", "auto", {"gpus": 1}, params=115008))


def test_launch_checks_the_weights_against_the_request(tmp_path, monkeypatch, capsys):
    from h2o.pipeline import launch

    monkeypatch.chdir(tmp_path)
    no_load(monkeypatch)
    code = launch.main(["experiment=table1", "model=opt-66b", "model.resources.gpus=1", "task=copa",
                        f"runs_dir={tmp_path}/runs", "--dry"])
    one_line_exit_2(code, capsys, ["model=opt-66b", "131.4 GB", "model.resources.gpus=1 x 80 GB cards",
                                   "fits: up to 40e9 params"])


# -------------------------------------------------------------------------------------- clamped requests
def test_short_marks_the_lengths_a_part_rounds_to_zero():
    from h2o import make_policy

    lengths = torch.tensor([5, 50, 500])
    assert make_policy("h2o", budget=0.05).short(lengths).tolist() == [True, False, False]  # heavy 0.025 x 5 < 1
    assert make_policy("streaming_llm", budget=0.05).short(lengths).tolist() == [True, True, False]  # < 4 sinks + 1
    assert make_policy("local", budget=0.05).short(lengths).tolist() == [True, False, False]
    assert make_policy("h2o", heavy=0.0, recent=0.05).short(lengths).tolist() == [True, False, False]  # 0: not needed
    assert make_policy("h2o", budget=8).short(lengths).tolist() == [False] * 3  # token counts never round
    assert make_policy("full").short(lengths).tolist() == [False] * 3


NIAH = ["task=niah", "task.lengths=[512]", "task.depths=[0.5]", "task.samples=2", "task.batch_size=1"]


@pytest.mark.parametrize("args, clamped", [
    (["task=austen_ppl", "task.n_windows=2", "task.window=48", "policy.budget=0.01"], 2),  # heavy: 0.24 tokens
    (["task=austen_ppl", "task.n_windows=2", "task.window=48", "policy.budget=0.5"], 0),
    (["task=bb_copa", "task.limit=2", "task.shots=0", "policy.budget=0.005"], 4),  # 2 docs x 2 choices, < 400 tokens
    (NIAH + ["policy.budget=0.001"], 2),  # heavy 0.0005 x ~512 prompt tokens = 0.26; x 4096 positions = 2: accepted
    (NIAH + ["policy.budget=0.5"], 0),
], ids=["ppl-clamped", "ppl-not", "copa-clamped", "niah-clamped", "niah-not"])
def test_clamped_requests_in_the_record(args, clamped, tmp_path, monkeypatch):
    from h2o.assets.data import write_task
    from h2o.pipeline.run import main

    write_task("bb_copa")
    monkeypatch.chdir(tmp_path)
    assert main([*TINY, f"runs_dir={tmp_path}/runs", *args]) == 0
    (record,) = [json.loads(f.read_text()) for f in (tmp_path / "runs").rglob("metrics.json")]
    assert record["clamped_requests"] == clamped
    if record["task_kind"] == "multiple_choice":
        assert record["n_samples"] == 2 and record["mean_seq_len"] < 400
    if record["task_kind"] == "retrieval":  # the reference lengths are the prompts (about 512 tokens each)
        assert record["n_samples"] == 2 and 400 < record["mean_prompt_tokens"] < 600


# ---------------------------------------------------------------------------------------------- analysis
def test_analysis_refuses_a_missing_runs_root(tmp_path, capsys):
    from analysis.__main__ import main

    for what in ("report", "tables", "figures"):
        one_line_exit_2(main([what, "--runs", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "out")]),
                        capsys, ["--runs=", "nonexistent", "no such folder", "runs/"])
    assert not (tmp_path / "out").exists()


def test_a_record_whose_budget_does_not_parse_is_named_once(tmp_path, capsys):
    from analysis.__main__ import main
    from analysis.records import load_runs

    good = {"experiment": "x", "model": "m", "task": "copa", "task_kind": "multiple_choice", "policy": "h2o",
            "budget": 0.2, "shots": 0, "semantics": "simulated", "seed": 0, "n_samples": 3, "metrics": {"acc": 0.5}}
    for name, budget in {"good": 0.2, "text": "abc", "flag": True, "none": None}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({**good, "budget": budget}))
    df = load_runs(tmp_path)
    warnings = [w for w in capsys.readouterr().err.splitlines() if w.strip()]
    assert sorted(p.rsplit("/", 1)[-1] for p in df.path) == ["good", "none"]  # null: a record without a budget
    assert len(warnings) == 2 and all(w.startswith("warning: skipping malformed") and '"budget"' in w
                                      for w in warnings)
    assert any("text" in w and "'abc'" in w for w in warnings) and any("flag" in w for w in warnings)
    assert main(["tables", "--runs", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "2 finished runs" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------- Python API
@pytest.fixture(scope="module")
def tiny():
    from h2o.assets.models import tiny_model

    return tiny_model("llama")


@pytest.mark.parametrize("mode", ["simulated", "real"])
@pytest.mark.parametrize("shape, what", [((1, 0), "an empty sequence"), ((0, 4), "an empty batch")])
def test_forward_on_empty_input_names_it(tiny, mode, shape, what):
    from h2o import PolicyError, attach, make_policy

    with torch.no_grad(), attach(tiny, make_policy("h2o", budget=0.5), mode=mode) as h:
        kw = {"cache": h.new_cache()} if mode == "real" else {}
        with pytest.raises(PolicyError, match=re.escape(f"input_ids of shape {shape}: {what};")) as err:
            tiny(torch.zeros(shape, dtype=torch.long), **kw)
    assert "\n" not in str(err.value)
    assert tiny(torch.ones(1, 3, dtype=torch.long)).logits.shape == (1, 3, tiny.config.vocab_size)  # hook removed


def test_generate_refuses_an_all_padding_row(tiny):
    from h2o import PolicyError, attach, make_policy

    ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.long)
    with torch.no_grad(), attach(tiny, make_policy("h2o", budget=0.5), mode="real") as h:
        out = tiny.generate(ids, attention_mask=mask, cache=h.new_cache(), max_new_tokens=2, do_sample=False)
        assert out.shape == (2, 10)
        mask[1] = 0
        with pytest.raises(PolicyError, match="attention_mask row 1 of 2 is all padding: nothing to generate from"):
            tiny.generate(ids, attention_mask=mask, cache=h.new_cache(), max_new_tokens=2, do_sample=False)


def test_the_runner_redoes_a_record_whose_budget_does_not_parse(tmp_path):
    from h2o.store.folders import finished

    record = {"model": "m", "task": "t", "policy": "h2o", "metrics": {}, "n_samples": 0, "wall_s": 0.0}
    for budget, done in ((0.2, True), (128, True), (None, True), ("abc", False), (True, False)):
        (tmp_path / "metrics.json").write_text(json.dumps({**record, "budget": budget}))
        assert finished(tmp_path) is done, budget


REQUIRED = {"analysis": ["tables"], "analysis.streaming_study": ["root"], "h2o.pipeline.wandb_workspace": ["--entity", "e"]}


@pytest.mark.parametrize("module", ["h2o.pipeline.wandb_sync", "h2o.pipeline.wandb_workspace", "h2o.assets.calibrate", "h2o.assets.data", "analysis.results_pages",
                                    "analysis.streaming_study", "analysis"])
def test_unknown_flag_is_one_line_everywhere(module, capsys, monkeypatch):
    import importlib

    no_load(monkeypatch)
    main = importlib.import_module(module if module != "analysis" else "analysis.__main__").main
    with pytest.raises(SystemExit) as exit_:
        main([*REQUIRED.get(module, []), "--bogus"])
    one_line_exit_2(exit_.value.code, capsys, [f"python -m {module}", "unrecognized arguments: --bogus"])


# ------------------------------------------------------------------------------------------------ resume
class Killed(BaseException):
    """The run dies here (not an Exception: nothing in the run catches it), as a preempted job would."""


RESUMED = [  # (args, requests kept before the kill: about half of the run's)
    (["task=bb_copa", "task.limit=4", "task.shots=1", "task.batch_size=1", "policy.budget=0.3"], 3),
    (["task=niah", "task.lengths=[400,512]", "task.depths=[0.5]", "task.samples=1", "task.batch_size=1",
      "policy.budget=0.3"], 1),
    (["task=bb_xsum", "task.limit=2", "task.shots=0", "task.max_new_tokens=4", "task.doc_max_words=60",
      "task.greedy=true", "task.batch_size=1", "policy.budget=0.5"], 1),  # greedy: sampled runs do not resume
    (["task=austen_ppl", "task.n_windows=2", "task.window=48", "task.batch_size=1", "policy=streaming_llm",
      "policy.budget=0.5"], 1),
    (["task=ruler_niah_multikey_1", "task.lm_eval_task=niah_multikey_1_questions", "task.questions=2",
      "task.limit=2", "task.max_gen_toks=8", "policy=snapkv", "policy.window=8", "policy.budget=0.5"], 2),
]
TIMINGS = {"wall_s", "cpu_s", "resumed_requests"}  # how long it took, and how much came from before the kill


@pytest.mark.parametrize("args, before", RESUMED, ids=["multiple-choice", "retrieval", "summarization",
                                                       "perplexity", "shared-context"])
def test_a_run_killed_mid_way_and_resumed_records_what_an_uninterrupted_one_does(args, before, tmp_path, monkeypatch):
    """The run dies after ``before`` requests' results is kept (lm-eval's request cache, h2o.tasks.progress);
    the same command resumes it from there; its record equals an uninterrupted run's field by field, timings
    aside (mean_seq_len was once the resumed part's mean only)."""
    from h2o.assets.data import write_task
    from h2o.store.files import read_jsonl
    from h2o.pipeline.run import main
    from h2o.tasks import progress

    write_task("bb_copa")
    monkeypatch.chdir(tmp_path)
    run = [*TINY, "seed=3", *args]
    assert main([*run, f"runs_dir={tmp_path}/whole"]) == 0
    keep = progress.RequestLog.__setitem__
    kept = []

    def dies(self, key, value):
        keep(self, key, value)
        kept.append(key)
        if len(kept) == before:
            raise Killed

    monkeypatch.setattr(progress.RequestLog, "__setitem__", dies)
    with pytest.raises(Killed):
        main([*run, f"runs_dir={tmp_path}/killed"])
    assert not list((tmp_path / "killed").rglob("metrics.json")) and list((tmp_path / "killed").rglob("partial"))
    monkeypatch.setattr(progress.RequestLog, "__setitem__", keep)
    assert main([*run, f"runs_dir={tmp_path}/killed"]) == 0
    (whole,), (resumed,) = (list((tmp_path / d).rglob("metrics.json")) for d in ("whole", "killed"))
    a, b = json.loads(whole.read_text()), json.loads(resumed.read_text())
    assert b["resumed_requests"] == before and a["resumed_requests"] == 0
    assert set(a) == set(b)
    for key in sorted(set(a) - TIMINGS):
        assert a[key] == b[key], (key, a[key], b[key])
    assert read_jsonl(whole.parent / "samples.jsonl") == read_jsonl(resumed.parent / "samples.jsonl")
    field = {"multiple_choice": "mean_seq_len", "perplexity": "tokens_scored"}.get(a["task_kind"],
                                                                                  "mean_prompt_tokens")
    assert a[field] > 0


# ------------------------------------------------------------------------------------------- strict records
def test_a_record_holds_no_non_finite_number(tmp_path, capsys):
    """The rule (h2o.store.strict_json.strict): an inf or nan is written as null and named in ``nonfinite``;
    the file parses as strict JSON; analysis reads the named metric as NaN, left out of every mean."""
    from analysis.records import load_runs
    from h2o.store.files import append_jsonl, write_json, write_jsonl

    def strict_load(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-finite {c} in a record"))

    good = {"experiment": "x", "model": "m", "task": "copa", "task_kind": "multiple_choice", "policy": "h2o",
            "budget": 0.2, "shots": 0, "semantics": "simulated", "seed": 0, "n_samples": 3}
    (tmp_path / "nan").mkdir()
    metrics = {"ppl": float("inf"), "acc": float("nan"), "acc_norm": 0.25}
    write_json(tmp_path / "nan" / "metrics.json", {**good, "metrics": metrics, "cells": [1.0, -float("inf")]})
    rec = strict_load((tmp_path / "nan" / "metrics.json").read_text())
    assert rec["metrics"] == {"ppl": None, "acc": None, "acc_norm": 0.25} and rec["cells"] == [1.0, None]
    assert rec["nonfinite"] == {"metrics.ppl": "inf", "metrics.acc": "nan", "cells[1]": "-inf"}
    write_jsonl(tmp_path / "s.jsonl", [{"ll": float("-inf")}, {"ll": -1.5}])
    append_jsonl(tmp_path / "s.jsonl", {"ll": float("nan")})
    rows = [strict_load(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert rows == [{"ll": None, "nonfinite": {"ll": "-inf"}}, {"ll": -1.5}, {"ll": None, "nonfinite": {"ll": "nan"}}]
    (tmp_path / "good").mkdir()
    write_json(tmp_path / "good" / "metrics.json", {**good, "seed": 1, "metrics": {"ppl": 3.0, "acc": 0.5}})
    assert "nonfinite" not in json.loads((tmp_path / "good" / "metrics.json").read_text())  # unchanged
    df = load_runs(tmp_path)
    row = df[df.path.str.endswith("nan")].iloc[0]
    assert row.nonfinite_metrics == "ppl,acc" and np.isnan(row.ppl) and np.isnan(row.acc) and row.acc_norm == 0.25
    assert df.ppl.mean() == 3.0 and "non-finite metric(s) ppl,acc" in capsys.readouterr().err


def test_every_float_option_refuses_inf_and_nan_through_the_api():
    from h2o import PolicyError, make_policy

    for name, option in (("pyramidkv", "beta"), ("h2o", "heavy_share"), ("h2o", "decay"), ("h2o", "budget"),
                         ("expected_attention", "epsilon"), ("adakv", "alpha_safeguard")):
        for bad in (float("inf"), float("nan"), -float("inf")):
            with pytest.raises(PolicyError, match=f"{option}={bad}: not a finite number"):
                make_policy(name, **{option: bad})


# ----------------------------------------------------------------------------------------- bench.methods
def test_bench_methods_table_of_a_record_with_a_row_lacking_a_field(tmp_path, capsys):
    from h2o.bench import every_policy as methods

    row = {"method": "h2o", "compress": "decode", "prefill_s": 0.1, "kv_bytes_prefill": 2**20,
           "kv_prefill_vs_full": 0.2, "tokens_held": 12.0, "kv_meta_bytes": 0, "decode_tok_s": 5.0,
           "decode_vs_full": 0.9, "decode_cpu_vs_full": 0.9, "kv_bytes": 2**21}
    for bad, words in (({k: v for k, v in row.items() if k != "compress"}, ["methods row 0 (h2o) lacks 'compress'"]),
                       ({**row, "prefill_s": "fast"}, ["methods row 0 (h2o): prefill_s='fast' is not a number"]),
                       ("x", ["methods row 0 is str"])):
        (tmp_path / "metrics.json").write_text(json.dumps({"methods": [bad]}))
        one_line_exit_2(methods.main([str(tmp_path)]), capsys, ["error:", *words, "allowed: a make bench record"])
    (tmp_path / "metrics.json").write_text(json.dumps({"methods": [row]}))
    assert methods.main([str(tmp_path)]) == 0 and "| h2o | decode | 0.10 |" in capsys.readouterr().out
