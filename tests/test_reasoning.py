"""Reasoning tasks (h2o.tasks.reasoning): lm-eval's own aime24, aime25, gsm8k_cot_zeroshot and hendrycks_math500 on
local stand-ins of their data (tests/data/reasoning: a few problems in each data set's own fields; lm-eval's YAML
included, its loaders untouched), in a chat template, through ``h2o-run`` and ``--model h2o``, each sample's
record fields; lm-eval's own scoring; the generation rows' arithmetic."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h2o.assets.paths import REPO
from h2o.tasks.generation_rows import FIELDS, ended_at
from h2o.tasks.reasoning import ReasoningTask, interval, score_all, stand_in

DATA = REPO / "tests" / "data" / "reasoning"
TASKS = {"aime24": "aime24", "aime25": "aime25", "gsm8k": "gsm8k_cot_zeroshot", "math500": "hendrycks_math500"}
# a chat template with a thinking switch (Qwen3's shape): enable_thinking=false closes an empty thinking block
TEMPLATE = ("{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>{%- if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The tiny random Llama checkpoint with :data:`TEMPLATE` as its tokenizer's chat template."""
    from transformers import AutoTokenizer

    from h2o.assets.tiny import tiny_checkpoint

    out = tmp_path_factory.mktemp("chat") / "tiny-chat-llama"
    shutil.copytree(tiny_checkpoint("llama"), out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(out)
    return out


def lm_eval_task(name: str, folder: Path):
    from lm_eval.tasks import TaskManager

    stand_in(TASKS[name], str(DATA / f"{name}.jsonl"), folder)
    return TaskManager(include_path=str(folder), include_defaults=False).load([TASKS[name]])["tasks"][TASKS[name]]


# right and wrong answers to each stand-in's first problem, as a model would write them
ANSWERS = {"aime24": ("so the walk takes $\\boxed{204}$ minutes.", "so the walk takes $\\boxed{240}$ minutes."),
           "aime25": ("The sum is \\boxed{70}.", "The sum is \\boxed{16}."),
           "gsm8k": ("48 + 24 = 72. The answer is 72.", "48 + 48 = 96. The answer is 96."),
           "math500": ("The polar coordinates are $\\left( 3, \\frac{\\pi}{2} \\right)$",
                       "The polar coordinates are $\\left( 3, \\pi \\right)$")}


@pytest.mark.parametrize("name", list(TASKS))
def test_lm_evals_own_scoring_of_every_sample(name, tmp_path):
    """A known-correct answer scores 1 and a wrong one 0 under lm-eval's own filters and process_results, each
    answer alone (lm-eval itself scores only the first repeat)."""
    task = lm_eval_task(name, tmp_path)
    doc = next(iter(task.test_docs()))
    right, wrong = score_all(task, doc, list(ANSWERS[name]))
    heads = {"gsm8k": ("flexible-extract", "strict-match")}.get(name, ("none",))
    for f in heads:
        assert right[f]["exact_match"] == 1.0 and wrong[f]["exact_match"] == 0.0, (f, right, wrong)


def test_stop_length_and_interval():
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    text = [ord(c) for c in "abc Question: x"]
    assert ended_at([5, 6, 2, 7], {2}, [], decode) == 3  # EOS counted
    assert ended_at(text, {2}, ["Question:"], decode) == len("abc Question:")  # the token completing the stop
    assert ended_at([5, 6, 7], {2}, ["zz"], decode) is None  # never stopped: the length limit
    mean, se, half = interval([1.0, 0.0, 0.5, 0.5])
    assert mean == 0.5 and se == pytest.approx((1 / 6) ** 0.5 / 2) and half == pytest.approx(1.96 * se)
    assert interval([0.25]) == (0.25, 0.0, 0.0)


def test_records_hold_each_samples_generation_and_cache(chat_model):
    """In process, full and h2o at 50% on aime24's stand-in, two samples per problem, batch 2: every sample's
    fields; full holds the prompt and every generated token but the last, h2o half the prompt throughout."""
    from h2o import make_policy
    from h2o.assets.models import load_model

    model, tok = load_model(str(chat_model))
    task = ReasoningTask("aime24", "aime24", limit=2, n=2, max_gen_toks=6, data_files=str(DATA / "aime24.jsonl"),
                         system_prompt="Reason step by step.", thinking=False, batch_size=2)
    per_entry = 2 * 4  # layers x KV heads of the tiny Llama
    for policy in (make_policy("full"), make_policy("h2o", budget=0.5)):
        res = task.run(model, tok, policy, "real", seed=0)
        assert len(res.samples) == 4 and res.info["problems"] == 2 and res.info["samples_per_problem"] == 2
        assert [(s["doc_id"], s["sample"]) for s in res.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert res.info["prompt_example"].startswith("<|system|>Reason step by step.<|user|>Question: Every")
        assert res.info["prompt_example"].endswith("<|assistant|><think></think>")  # thinking=false, recorded
        assert res.info["thinking"] is False and res.info["sampling"] == "sample"
        assert res.metrics["pass_at_1"] == sum(s["score"] for s in res.samples) / 4
        for s in res.samples:
            assert set(FIELDS) <= set(s) and all(s[f] is not None for f in FIELDS), s
            assert 1 <= s["gen_tokens"] <= 6 and (s["gen_tokens"] == 6 or not s["at_limit"])
            assert s["kv_bytes_end"] == s["kv_tokens_end"] * 2 * 16 * 4  # keys and values, head size 16, fp32
            assert s["time_s"] > 0 and s["kv_tokens_peak"] >= s["kv_tokens_end"]
            if policy.name == "full":
                assert s["kv_tokens_end"] == per_entry * (s["prompt_tokens"] + s["gen_tokens"] - 1)
            else:
                kept = int(policy.counts(torch.tensor([s["prompt_tokens"]])).total[0])
                assert 0 < kept < s["prompt_tokens"] and s["kv_tokens_end"] == s["kv_tokens_peak"] == per_entry * kept
        assert res.samples[0]["generation"] != res.samples[1]["generation"]  # sampled, not one greedy answer twice
    greedy = ReasoningTask("aime24", "aime24", limit=1, n=2, temperature=0, max_gen_toks=6,
                           data_files=str(DATA / "aime24.jsonl"))
    twice = greedy.run(model, tok, make_policy("full"), "real", seed=0).samples
    assert twice[0]["generation"] == twice[1]["generation"]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_four_tasks_through_h2o_run(chat_model, tmp_path):
    over = [f"+task_overrides.{t}={{data_files: {DATA / t}.jsonl, limit: 1, n: 2, max_gen_toks: 4}}" for t in TASKS]
    run(["-m", "h2o.pipeline.run", "-m", "model=tiny-llama", f"model.pretrained={chat_model}",
         f"task={','.join(TASKS)}", "policy=h2o", "policy.budget=0.5", "threads=1", *over,
         f"runs_dir={tmp_path / 'runs'}", "experiment_name=reasoning_test"], tmp_path)
    records = sorted((tmp_path / "runs").rglob("metrics.json"))
    assert sorted(p.relative_to(tmp_path / "runs").parts[2] for p in records) == sorted(TASKS)
    for path in records:
        rec = json.loads(path.read_text())
        samples = [json.loads(line) for line in (path.parent / "samples.jsonl").read_text().splitlines()]
        assert rec["task_kind"] == "reasoning" and rec["headline"] == "pass_at_1" and rec["n_samples"] == 2
        assert rec["protocol"]["temperature"] == 0.6 and rec["protocol"]["n"] == 2 and rec["chat_template"] is True
        assert rec["metrics"]["pass_at_1"] == sum(s["score"] for s in samples) / 2
        assert rec["lm_eval_task"] == TASKS[path.relative_to(tmp_path / "runs").parts[2]]
        for s in samples:
            assert all(s[f] is not None for f in FIELDS) and s["gen_tokens"] <= 4 and s["kv_tokens_end"] > 0


@pytest.mark.slow
def test_four_tasks_through_model_h2o(chat_model, tmp_path):
    """lm-eval's own command line: the four tasks' stand-ins (two samples each), a chat template and a system
    prompt, sampling; ``generation_log`` holds each answer's fields."""
    folder = tmp_path / "tasks"
    for name, lm_task in TASKS.items():
        stand_in(lm_task, str(DATA / f"{name}.jsonl"), folder / name, repeats=2)
    log = tmp_path / "rows.jsonl"
    run(["-m", "h2o.tasks.lm_eval_cli", "--model", "h2o", "--model_args",
         f"pretrained={chat_model},policy=h2o,budget=0.5,generation_log={log}", "--tasks", *TASKS.values(),
         "--include_path", str(folder), "--limit", "1", "--apply_chat_template", "--system_instruction", "Be brief.",
         "--gen_kwargs", "do_sample=True", "temperature=0.6", "top_p=0.95", "max_gen_toks=4",
         "--output_path", str(tmp_path / "out"), "--log_samples"], tmp_path)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted((r["task"], r["doc_id"], r["repeat"]) for r in rows) == sorted(
        (t, 0, k) for t in TASKS.values() for k in (0, 1))
    assert all(r[f] is not None for r in rows for f in FIELDS) and all(r["gen_tokens"] <= 4 for r in rows)


# refusals of the command line's reasoning options, before any model loads (h2o-run's: tests/test_hardening.py)
CLI_BAD = [
    (["--gen_kwargs", "temperature=-1"], ["temperature=-1", "allowed: a number >= 0"]),
    (["--gen_kwargs", "top_p=0"], ["top_p=0", "(0, 1]"]),
    (["--gen_kwargs", "max_gen_toks=0"], ["max_gen_toks=0", "an int >= 1"]),
    (["--model_args", "pretrained=tiny:llama,enable_thinking=maybe"], ["enable_thinking='maybe'", "true, false"]),
    (["--model_args", "pretrained=tiny:llama,enable_thinking=true"], ["enable_thinking=true", "think_end_token"]),
]


@pytest.mark.parametrize("args, words", CLI_BAD, ids=[a[1] for a, _ in CLI_BAD])
def test_lm_eval_cli_refuses_bad_sampling(args, words, capsys, tmp_path, monkeypatch):
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    argv = ["lm_eval_cli", "--model", "h2o", "--tasks", "aime24", "--output_path", str(tmp_path / "out"), *args]
    if "--model_args" not in args:
        argv += ["--model_args", "pretrained=tiny:llama"]
    monkeypatch.setattr("sys.argv", argv)
    assert lm_eval_cli.main() == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), (words, err)


def test_cluster_grid_lists_both_models_four_tasks_and_token_budgets():
    """experiment=reasoning_cluster offline: 488 runs, the field's sizes per task, whole-cache token budgets, each
    policy at every step and every 128 tokens (R-KV's buffer), the 2026 baselines every 128 tokens; TriAttention's
    32 listed as refused here, naming the calibration command (the models are not on this machine); the launcher's
    estimate of an AIME run."""
    from h2o.pipeline import launch
    from h2o.pipeline.sweep import expand
    from h2o.tasks.reasoning import DECODE_COST

    sweep = expand(["experiment=reasoning_cluster"], multirun=True)
    specs = sweep.specs
    runs = {p.path: p for p in specs}
    assert len(runs) == 456
    uncalibrated = [why for job, why in sweep.refused if "policy=triattention" in job]
    assert len(uncalibrated) == 32 and all("python -m h2o.assets.triattention model=" in w for w in uncalibrated)
    assert {p.model.name for p in specs} == {"deepseek-r1-distill-qwen-7b", "qwen3-8b"}
    assert {(p.task.name, p.task.lm_eval_task, p.task.n) for p in specs} == {
        ("aime24", "aime24", 8), ("aime25", "aime25", 8), ("math500", "hendrycks_math500", 1),
        ("gsm8k", "gsm8k_cot_zeroshot", 1)}
    assert all(p.task.max_gen_toks == 32768 and p.task.limit is None and p.task.thinking is True
               and p.task.think_end_token == "</think>" for p in specs)
    cells = {(p.policy.name, p.policy.budget, p.policy.compress, p.policy.interval)
             for p in runs.values() if p.policy.name != "full"}
    assert cells == {(m, b, *schedule) for m in ("h2o", "snapkv", "streaming_llm", "tova", "knorm", "r_kv")
                     for b in (512, 1024, 2048, 4096) for schedule in (("decode", None), ("interval", 128))} | {
        (m, b, "interval", 128) for m in ("snapkv_d", "g_kv") for b in (512, 1024, 2048, 4096)}
    assert sum(p.policy.name == "full" for p in runs.values()) == 8  # one per model and task
    aime = next(p for p in specs if p.task.name == "aime24" and p.model.name == "qwen3-8b")
    assert launch.run_minutes(aime, launch.cluster_config([])) == pytest.approx(
        165 * 30 * 8 * (200 + DECODE_COST * 14000) / 1e6 / 60)
