"""Hardening, round five (issue 50): the reasoning, SCBench, long-generation and study inputs that crashed after the
model loaded or passed silently, each now one ``error:`` line naming the bad value and what is allowed, exit status
2, before any model loads; the lm-eval wrapper checking what h2o-run checks; the study and analysis commands
refusing or skipping a malformed record. No bb_* task: each row names its task."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_hardening import TINY, no_load, one_line_exit_2  # tests/ is on sys.path (no package)
from test_hardening import test_bad_input_one_line_exit_2_nothing_loaded as refused_before_loading

DATA = Path(__file__).parent / "data"
AIME = f"task.data_files={DATA}/reasoning/aime24.jsonl"
RZ = ["task.chat_template=false", "task.max_gen_toks=4", "task.limit=1"]

# (id, args, words the one line must contain, extra environment): {tmp} is the test's tmp_path, which holds
# empty.jsonl (no bytes) and notjson.jsonl (one line that is not JSON)
BAD = [
    # data files: read and checked against the task's own fields
    ("reasoning-data-empty", [*TINY, "task=aime24", "task.data_files={tmp}/empty.jsonl", *RZ],
     ["task.data_files=", "empty.jsonl", "empty (no documents)", "allowed", "Problem, Answer"], {}),
    ("reasoning-data-not-json", [*TINY, "task=aime24", "task.data_files={tmp}/notjson.jsonl", *RZ],
     ["notjson.jsonl", "line 1 is not JSON", "allowed", "Problem, Answer"], {}),
    ("reasoning-data-other-task", [*TINY, "task=gsm8k", AIME, *RZ],
     ["aime24.jsonl", "document 0 lacks 'question'", "its fields: ID, Problem", "allowed", "question, answer",
      "gsm8k_cot_zeroshot"], {}),
    ("scbench-data-empty", [*TINY, "task=scbench", "task.data_files={tmp}/empty.jsonl"],
     ["task.data_files=", "empty (no documents)", "SCBench rows"], {}),
    ("scbench-data-not-json", [*TINY, "task=scbench", "task.data_files={tmp}/notjson.jsonl"],
     ["notjson.jsonl", "line 1 is not JSON", "SCBench rows"], {}),
    ("scbench-data-other-subset", [*TINY, "task=scbench", f"task.data_files={DATA}/scbench/scbench_kv.jsonl",
                                   "task.subset=scbench_choice_eng"],
     ["scbench_kv.jsonl", "row 0's request 0 lacks 'options'", "allowed", "task.subset=scbench_choice_eng"], {}),
    # counts bounded by what the model and the data hold
    ("reasoning-n-huge", [*TINY, "task=aime24", AIME, *RZ, "task.n=1000000000"],
     ["task.n=1000000000", "allowed: an int in 1-1024"], {}),
    ("reasoning-max-gen-toks-cuts-prompt", [*TINY, "task=aime24", AIME, *RZ[:1], "task.limit=1",
                                            "task.max_gen_toks=4095"],
     ["task.max_gen_toks=4095", "longest prompt of task.data_files", "4096 positions", "allowed: max_gen_toks <="],
     {}),
    ("scbench-max-gen-toks-past-positions", [*TINY, "task=scbench", f"task.data_files={DATA}/scbench/scbench_kv.jsonl",
                                             "task.max_gen_toks=5000"],
     ["task.max_gen_toks=5000", "after a context of 2048 tokens", "4096 positions", "allowed: < 2048"], {}),
    ("niah-samples-huge", [*TINY, "task=niah", "task.lengths=[1024]", "task.depths=[0.5]", "task.samples=1000000000"],
     ["task.samples=1000000000", "allowed: task.samples in 1-1000"], {}),
    ("ruler-split-limit-huge", [*TINY, "task=ruler_niah_multikey_1", "task.lm_eval_task=niah_multikey_1_questions",
                                "task.questions=2", "task.limit=1000000000"],
     ["task.limit=1000000000", "allowed: task.limit in 1-1000"], {}),
    # a choice that cannot run here
    ("reasoning-minerva-without-extra", [*TINY, "task=math500", "task.lm_eval_task=minerva_math500"],
     ["task.lm_eval_task=minerva_math500", "math_verify", "lm_eval[math]", "allowed: aime24"], {}),
    # long generation: the instruction counted in the prompt, the answer's measures, the text, the one-pass rule
    ("long-generation-instruction-past-positions", [*TINY, "task=long_generation", "task.instruction=" + "x" * 4100],
     ["task.instruction (4100 characters; 4102 prompt tokens", "tiny-llama's 4096 positions",
      "allowed: a shorter task.instruction (at most 3456 prompt tokens"], {}),
    ("long-generation-ngram-past-answer", [*TINY, "task=long_generation", "task.ngram=1000", "task.max_new_tokens=8"],
     ["task.ngram=1000", "task.max_new_tokens=8", "allowed: ngram in 1-8"], {}),
    ("long-generation-passages-past-text", [*TINY, "task=long_generation", "task.passage_tokens=4000",
                                            "task.prompts=600", "task.max_new_tokens=8"],
     ["task.passage_tokens=4000, task.prompts=600", "passage 599", "the text austen",
      "allowed: fewer prompts or shorter passages"], {}),
    ("long-generation-kvzip", [*TINY, "task=long_generation", "policy=kvzip"],
     ["policy=kvzip", "task long_generation teacher-forces", "no one-pass form", "allowed: a policy with one"], {}),
]


@pytest.mark.parametrize("case, args, words, env", [pytest.param(*c, id=c[0]) for c in BAD])
def test_bad_input_one_line_exit_2_nothing_loaded(case, args, words, env, capsys, tmp_path, monkeypatch):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notjson.jsonl").write_text("not json {\n")
    refused_before_loading(case, args, words, env, capsys, tmp_path, monkeypatch)


def test_minerva_refused_only_without_its_extra(monkeypatch):
    """The refusal follows the module's presence, not the task's name."""
    import importlib.util

    from h2o.tasks.reasoning import check_extra

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "math_verify"
                        else real(name, *a))
    check_extra("minerva_math500")  # the extra installed: accepted


# ------------------------------------------------------------------ the lm-eval wrapper checks what h2o-run checks
LM_EVAL_BAD = [  # (id, --tasks, --model_args, more arguments, words)
    ("max-gen-toks-over-positions", "niah", "pretrained=tiny:llama,policy=h2o",
     ["--gen_kwargs", "max_gen_toks=1000000"],
     ["--gen_kwargs max_gen_toks=1000000", "tiny:llama's 4096 positions", "allowed: < 4096"]),
    ("questions-over-niah-keys", "niah", "pretrained=tiny:llama,policy=h2o,questions=729", [],
     ["--model_args questions=729", "task niah's 728 distinct keys", "allowed: --model_args questions in 1-728"]),
    ("questions-over-ruler-keys", "niah_multikey_1_questions", "pretrained=tiny:llama,policy=h2o,questions=5", [],
     ["questions=5", "niah_multikey_1_questions's 4 distinct keys", "allowed: --model_args questions in 1-4"]),
    ("turns-on-loglikelihood-task", "hellaswag", "pretrained=tiny:llama,policy=h2o,turns=2", [],
     ["--model_args turns=2", "niah and RULER's split tasks", "allowed: --model_args turns=1 for task hellaswag"]),
    ("temperature-inf", "niah", "pretrained=tiny:llama,policy=h2o", ["--gen_kwargs", "temperature=inf"],
     ["--gen_kwargs temperature=inf", "allowed: a number >= 0"]),
    ("top-p-nan", "niah", "pretrained=tiny:llama,policy=h2o", ["--gen_kwargs", "top_p=nan"],
     ["--gen_kwargs top_p=nan", "(0, 1]"]),
    ("niah-samples-huge", "niah", "pretrained=tiny:llama,policy=h2o", ["--metadata", '{"samples": 1000000000}'],
     ["--metadata samples=1000000000", "allowed: --metadata samples in 1-1000"]),
    ("questions-on-one-of-two-tasks", "niah,hellaswag", "pretrained=tiny:llama,policy=h2o,questions=2", [],
     ["--model_args questions=2", "allowed: --model_args questions=1 for task hellaswag"]),
]


@pytest.mark.parametrize("case, tasks, model_args, more, words", LM_EVAL_BAD, ids=[c[0] for c in LM_EVAL_BAD])
def test_lm_eval_cli_bad_input(case, tasks, model_args, more, words, capsys, tmp_path, monkeypatch):
    """``python -m h2o.tasks.lm_eval_cli --model h2o``: h2o-run's rules (h2o.tasks.base.check_room,
    h2o.tasks.question_after.check_many_task, h2o.tasks.reasoning.check_sampling,
    h2o.tasks.long_context.check_drawn), one line before lm-eval loads a model or a task."""
    from lm_eval.models.huggingface import HFLM

    from h2o.tasks import lm_eval_cli

    monkeypatch.setattr(HFLM, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded")))
    monkeypatch.setattr("sys.argv", ["lm_eval_cli", "--model", "h2o", "--model_args", model_args, "--tasks", tasks,
                                     "--include_path", "tasks", "--limit", "1", *more,
                                     "--output_path", str(tmp_path / "out")])
    one_line_exit_2(lm_eval_cli.main(), capsys, words)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- study homes and the study analyses
LG = "title: t\nkind: long_generation\nrecords: records\n"
QS = "title: t\nkind: questions\nrecords: records\n"
STUDY_BAD = [  # (id, study.yaml, words)
    ("sections-texts", "title: t\nkind: streaming\nsections: [a, b]\n",
     ["sections[0]='a': not a mapping", "allowed: a list of mappings {title: ..., samples:"]),
    ("sections-without-samples", "title: t\nkind: streaming\nsections: [{title: x}]\n",
     ["sections[0]: title='x', samples=None", "allowed: a list of mappings"]),
    ("headline-a-text", LG + "headline: h2o beats r_kv\n",
     ["headline='h2o beats r_kv': not a mapping", "allowed: a mapping with a, b, budget, schedule"]),
    ("headline-without-b", LG + "headline: {a: h2o, budget: 64, schedule: every step}\n",
     ["headline lacks 'b'", "allowed: a mapping with a, b, budget, schedule"]),
    ("headline-budget-text", QS + "headline: {a: kvzip, b: keydiff, budget: twenty}\n",
     ["headline.budget='twenty'", "allowed: a number"]),
    ("placement-without-method", QS + "placement: {budget: 0.2}\n", ["placement lacks 'method'"]),
    ("second-family-list", LG + "second_family: [gemma3-270m]\n", ["second_family=['gemma3-270m']: not a mapping"]),
    ("replication-prompts-zero", LG + "replication: {a: h2o, b: r_kv, budget: 64, schedule: every 32, prompts: 0}\n",
     ["replication.prompts=0", "an int >= 1"]),
]


@pytest.mark.parametrize("case, text, words", STUDY_BAD, ids=[c[0] for c in STUDY_BAD])
def test_results_pages_bad_study_home(case, text, words, capsys, tmp_path):
    """A study.yaml whose sections or named comparisons are malformed (each an AttributeError or KeyError while the
    pages were written): one line naming the file and the key, and nothing copied (``--collect``) or written."""
    from analysis import results_pages

    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "metrics.json").write_text(json.dumps({"model": "m", "metrics": {}}))
    (tmp_path / "studies" / "bad" / "records").mkdir(parents=True)
    (tmp_path / "studies" / "bad" / "study.yaml").write_text(text)
    code = results_pages.main(["--collect", str(tmp_path / "runs"), str(tmp_path / "studies" / "bad" / "records"),
                               "--studies", str(tmp_path / "studies"), "--out", str(tmp_path / "pages")])
    one_line_exit_2(code, capsys, ["bad/study.yaml", *words])
    assert not list((tmp_path / "studies" / "bad" / "records").iterdir())  # nothing collected
    assert not (tmp_path / "pages").exists()


def record(folder: Path, rec: dict | str, samples: list[dict]) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(rec if isinstance(rec, str) else json.dumps(rec))
    (folder / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_many_questions_skips_torn_and_non_finite_records(tmp_path, capsys):
    """``python -m analysis.many_questions``: a torn metrics.json and a NaN accuracy are each skipped with one
    warning naming the record; the good records are rendered."""
    from analysis import many_questions

    def rec(policy, budget, acc):
        return {"policy": policy, "budget": budget, "protocol": {"questions": 2}, "metrics": {"acc": acc},
                "task_kind": "niah"}
    samples = [{"doc_id": d, "question": q, "acc": float((d + q) % 2)} for d in range(4) for q in range(2)]
    record(tmp_path / "kvzip", rec("kvzip", 0.2, 0.5), samples)
    record(tmp_path / "keydiff", rec("keydiff", 0.2, 0.5), samples)
    record(tmp_path / "torn", '{"policy": "h2o", "metr', samples)
    record(tmp_path / "nan", json.dumps(rec("snapkv", 0.2, float("nan"))), samples)
    record(tmp_path / "no-acc", rec("tova", 0.2, 0.5), [{"doc_id": 0, "question": 0}])
    assert many_questions.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    warnings = [w for w in out.err.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 3, out.err
    assert any("torn" in w and "malformed" in w for w in warnings)
    assert any("nan" in w and "metrics.acc=nan" in w for w in warnings)
    assert any("no-acc" in w and "sample 0 lacks 'acc'" in w for w in warnings)
    assert "kvzip" in out.out.lower() and "snapkv" not in out.out.lower()


def test_long_generation_analysis_skips_samples_without_its_fields(tmp_path, capsys):
    """``python -m analysis.long_generation`` on a record whose samples lack ``tf_nll_per_token``: skipped with one
    warning (was a KeyError); with no record left, one error line and exit 2."""
    from analysis import long_generation

    rec = {"task_kind": "long_generation", "policy": "h2o", "budget": 64, "model": "m", "n_samples": 2,
           "metrics": {"tf_nll_per_token": 1.0}, "policy_options": {"compress": "decode"}}
    record(tmp_path / "h2o", rec, [{"doc_id": i, "gen_tokens": 4, "distinct_4": 1.0, "first_departure": 1}
                                   for i in range(2)])
    code = long_generation.main([str(tmp_path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "sample 0 lacks 'tf_nll_per_token'" in err and str(tmp_path / "h2o") in err, err
    assert "error: records=" in err


def test_make_sweep_stops_at_a_refused_sweep(tmp_path):
    """``make sweep EXP=nonexistent``: h2o-run's one line and exit 2, and no tables, figures or report after it
    (they ran on an empty runs folder and ended in "some jobs failed")."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(["make", "--no-print-directory", "-f", str(repo / "Makefile"), "-o", ".venv/installed",
                          "sweep", "EXP=nonexistent", f"PY={sys.executable}"], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=600)
    assert out.returncode == 2, out.stderr
    assert "error: experiment=nonexistent: unknown; allowed:" in out.stderr
    assert "analysis" not in out.stdout and "some jobs failed" not in out.stdout + out.stderr
    assert not (tmp_path / "analysis").exists() and not (tmp_path / "runs" / ".sweep-failed").exists()


def test_streaming_study_skips_torn_and_incomplete_records(tmp_path, capsys):
    """``python -m analysis.streaming_study``: a torn metrics.json, a record without a numeric budget and one whose
    windows lack ``chunk_ppl`` are each skipped with one warning; the good record is read."""
    from analysis import streaming_study as ss

    windows = [{"tokens": 1000 * (i + 1), "nll": 3.0, "chunk_ppl": 20.1, "ppl": 20.1} for i in range(2)]
    rec = {"task_kind": "streaming", "policy": "h2o", "budget": 96, "model": "m", "protocol": {"chunk": 1}}
    record(tmp_path / "good", rec, windows)
    record(tmp_path / "torn", '{"task_kind": "streaming", "pol', windows)
    record(tmp_path / "no-budget", {**rec, "budget": None}, windows)
    record(tmp_path / "no-chunk-ppl", rec, [{"tokens": 1000, "nll": 3.0}])
    found = ss.records(tmp_path)
    warnings = [w for w in capsys.readouterr().err.splitlines() if w.startswith("warning:")]
    assert [(chunk, budget) for chunk, budget, _, _ in found] == [(1, 96)] and len(warnings) == 3, warnings
    assert any("torn" in w for w in warnings) and any("budget=None" in w for w in warnings)
    assert any("no-chunk-ppl" in w and "lacks 'chunk_ppl'" in w for w in warnings)


def test_reasoning_prompt_past_positions_refused_before_generating():
    """The hub's problems are known only once lm-eval has loaded them: ``run`` measures them there, before any
    generation, by the rule the local file is checked with before loading (lm-eval would keep only the last tokens
    of a prompt that does not fit beside ``max_gen_toks``, while the record showed the whole problem)."""
    from h2o import make_policy
    from h2o.assets.models import load_model
    from h2o.assets.tiny import tiny_checkpoint
    from h2o.core.validate import ConfigError
    from h2o.tasks.reasoning import ReasoningTask

    model, tok = load_model(str(tiny_checkpoint("llama")))
    task = ReasoningTask("aime24", "aime24", limit=1, max_gen_toks=4095, chat_template=False,
                         data_files=str(DATA / "reasoning" / "aime24.jsonl"))
    with pytest.raises(ConfigError, match=r"^task.max_gen_toks=4095 and the longest prompt of task.data_files "
                                          r"\(\d+ tokens\) pass model .*'s 4096 positions"):
        task.run(model, tok, make_policy("full"), "real", seed=0)


def test_niah_methods_and_leaderboard_skip_torn_records(tmp_path, capsys):
    """A half-written record (metrics.json or samples.jsonl cut mid-write or mid-copy) or one whose samples lack a
    heatmap cell's fields: skipped with one warning naming the file by the needle heatmaps, the methods table and
    figure and the leaderboard, never counted, and the good records drawn (each crashed on a torn samples.jsonl)."""
    from analysis import leaderboard
    from analysis.methods import methods_tables
    from analysis.niah import figure_niah, niah_runs
    from analysis.records import load_runs
    from test_methods_experiment import record as methods_record  # tests/test_methods_experiment.py

    root = tmp_path / "studies" / "niah" / "records"
    cells = [{"doc_id": i, "length": 512, "depth": d, "acc": float(i % 2)} for i, d in enumerate((0.1, 0.5) * 2)]
    for name, policy, budget in (("full", "full", 1.0), ("h2o", "h2o", 0.2), ("torn-samples", "local", 0.2),
                                 ("no-depth", "tova", 0.2), ("torn-metrics", "knorm", 0.2)):
        rec = {"experiment": "niah", "model": "m", "task": "niah", "task_kind": "retrieval", "lm_eval_task": "niah",
               "policy": policy, "budget": budget, "shots": 0, "semantics": "real", "seed": 0, "n_samples": 4,
               "metrics": {"acc": 0.5}}
        record(root / name, '{"experiment": "niah", "pol' if name == "torn-metrics" else rec,
               [{k: v for k, v in c.items() if name != "no-depth" or k != "depth"} for c in cells])
    (root / "torn-samples" / "samples.jsonl").write_text(json.dumps(cells[0]) + '\n{"doc_id": 1, "len')
    df = load_runs(root)
    assert sorted(df["policy"]) == ["full", "h2o", "tova"]  # the torn metrics.json and samples.jsonl: not counted
    assert [p.name for p in figure_niah(df, tmp_path / "fig")] == ["niah_niah_heatmap.png", "niah_niah_heatmap.pdf"]
    warnings = [w for w in capsys.readouterr().err.splitlines() if w.startswith("warning:")]
    assert list(niah_runs(df)["policy"]) == ["full", "h2o"]  # its two panels
    assert len(warnings) == 3, warnings
    assert any(f"{root / 'torn-metrics' / 'metrics.json'}:" in w for w in warnings)
    assert any(f"{root / 'torn-samples' / 'samples.jsonl'}: line 2:" in w for w in warnings)
    assert any("no-depth" in w and "lacks 'depth'" in w for w in warnings)

    methods = tmp_path / "studies" / "methods" / "records"
    mib = 2 ** 20
    for policy, budget, timing, ppl in (("full", 1.0, "decode", 18.0), ("h2o", 0.2, "decode", 30.0),
                                        ("snapkv", 0.2, "prefill", 21.0), ("knorm", 0.2, "decode", 25.0)):
        methods_record(methods, policy, budget, timing, ppl, 20 * mib)
    torn = methods / "austen_ctx-knorm-0.2-decode" / "samples.jsonl"
    torn.write_text(torn.read_text()[:-20])  # cut mid-line, as a copy interrupted leaves it
    [table] = methods_tables(load_runs(methods))
    assert [r[0] for r in table.rows] == ["full", "H2O", "SnapKV"]
    capsys.readouterr()
    assert leaderboard.main(["--studies", str(tmp_path / "studies"), "--out", str(tmp_path / "docs")]) == 0
    err = capsys.readouterr().err
    assert err.count(f"warning: skipping malformed run record {torn}: line 4:") == 1, err  # read once, warned once
    page = (tmp_path / "docs" / "leaderboard.md").read_text()
    assert "| H2O | every step |" in page and "KNorm" not in page
