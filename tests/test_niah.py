"""Needle in a haystack (tasks/niah.yaml, h2o.tasks.niah), its runner and heatmap, and lm-eval's RULER offline."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from h2o.assets.model_spec import ConfigError
from h2o.assets.paths import REPO
from h2o.tasks.niah import INSTRUCTION, NEEDLE, docs, found, process_results


@pytest.fixture(scope="module")
def tiny_path():
    from h2o.assets.tiny import tiny_checkpoint

    return str(tiny_checkpoint("llama"))


def test_needles_sit_at_their_depths_in_prompts_of_their_lengths(tiny_path):
    rows = docs(tiny_path, [1024, 2048], [0.0, 0.5, 1.0], 2, "austen", seed=0)
    assert len(rows) == 12 and rows == docs(tiny_path, [1024, 2048], [0.0, 0.5, 1.0], 2, "austen", seed=0)
    for r in rows:
        needle = NEEDLE.format(key=r["key"], value=r["answer"])
        assert r["prompt"].count(needle) == 1 and re.fullmatch(r"\d{7}", r["answer"])
        assert r["prompt"].startswith(INSTRUCTION) and r["prompt"].endswith("\n") and r["key"] in r["question"]
        assert abs(r["prompt_tokens"] - r["length"]) <= 3  # one token per byte: the spaces around the needle
        hay = r["prompt"][len(INSTRUCTION):-1]
        before = hay.index(needle) / (len(hay) - len(needle))  # the needle's depth in characters = tokens here
        assert abs(before - r["needle_depth"]) < 0.01 and abs(r["needle_depth"] - r["depth"]) < 0.1
    by = {(r["length"], r["depth"], r["sample"]): r for r in rows}
    for n in (1024, 2048):  # one haystack per (length, sample): at depth 1 the needle ends it, at 0 starts it
        for i in (0, 1):
            first, last = by[n, 0.0, i], by[n, 1.0, i]
            hay0 = first["prompt"][len(INSTRUCTION) + len(NEEDLE.format(key=first["key"], value=first["answer"])) + 1:]
            assert hay0[:300] == last["prompt"][len(INSTRUCTION):][:300]
        assert by[n, 0.5, 0]["prompt"] != by[n, 0.5, 1]["prompt"]  # samples differ
    assert docs(tiny_path, [1024], [0.5], 1, "moby_dick")[0]["prompt"] != rows[2]["prompt"]
    with pytest.raises(ValueError, match="too short"):
        docs(tiny_path, [100], [0.5], 1)


def test_exact_match_of_the_number():
    assert found(" 1234567.", "1234567") and found("is 1234567 and 7654321", "1234567")
    assert not found(" 12345678", "1234567") and not found(" 7654321 then 1234567", "1234567")
    assert not found("", "1234567")
    assert process_results({"answer": "1234567"}, [" 1234567."]) == {"exact_match": 1.0}


def test_long_context_task_rejects_bad_values():
    from h2o.tasks.long_context import LongContextTask

    for bad, match in [({"lengths": [0]}, "lengths"), ({"depths": [1.5]}, "depths"), ({"text": "pg19"}, "text"),
                       ({"lm_eval_task": "nope"}, "lm_eval_task"), ({"shots": 5}, "shots")]:
        with pytest.raises(ConfigError, match=match):
            LongContextTask("x", **bad)
    assert LongContextTask("x", "niah_single_2", text="essays").text == "essays"  # RULER's own haystack allowed
    assert LongContextTask("x", lengths=[512, 1024], depths=[0.5], samples=3).tokens() == 3 * (524 + 1036)


def run_sweep(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "h2o.pipeline.run", "-m", "experiment=niah", "model=tiny-llama",
                          "task_overrides.niah.lengths=[1024]", "task_overrides.niah.depths=[0.2,0.8]",
                          "task_overrides.niah.samples=2", "threads=1",
                          f"runs_dir={tmp_path / 'runs'}", *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_niah_sweep_records_cells_and_draws_heatmaps(tmp_path):
    """Two policies through the pipeline on the tiny model -> records with per-sample length, depth and score,
    per-cell accuracies, the budget kept; the heatmap figure from those records."""
    from analysis.niah import cell_table, figure_niah
    from analysis.protocol import annotate
    from analysis.records import load_runs, load_samples

    run_sweep(tmp_path, "policy=full,h2o", "policy.budget=0.2")
    df = annotate(load_runs(tmp_path / "runs"))
    assert sorted(df["policy"]) == ["full", "h2o"] and set(df["task_kind"]) == {"retrieval"}
    for _, run in df.iterrows():
        rec = json.loads((run["path"] / "metrics.json").read_text() if hasattr(run["path"], "read_text")
                         else open(os.path.join(run["path"], "metrics.json")).read())
        samples = load_samples(run["path"])
        assert len(samples) == rec["n_samples"] == 4
        assert rec["metrics"]["acc"] == sum(s["acc"] for s in samples) / 4
        assert [(c["length"], c["depth"], c["n"]) for c in rec["cells"]] == [(1024, 0.2, 2), (1024, 0.8, 2)]
        assert rec["haystack"] == "austen" and rec["chat_template"] is False and rec["cpu_s"] > 0
        assert rec["headline"] == "acc"  # the metric analysis draws (analysis.figures.headline_metric)
        assert rec["kept_ratio"] == (1.0 if run["policy"] == "full" else pytest.approx(0.2, abs=0.01))
        assert all(s["question_tokens"] > 0 for s in samples)  # the seam: the question's tokens end the prompt
        table = cell_table(samples)
        assert list(table.index) == [1024] and list(table.columns) == [0.2, 0.8]
    files = figure_niah(df, tmp_path / "fig")
    assert [f.name for f in files] == ["niah_niah_heatmap.png", "niah_niah_heatmap.pdf"]
    assert files[0].stat().st_size > 10_000


def test_ruler_essay_haystack_is_a_book_with_the_hub_unreachable(tiny_path, monkeypatch):
    """RULER's essay tasks build their samples from Austen through the one hook, with every socket refused and the
    hub switched offline; the record states the haystack."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network unreachable (test)")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager, get_task_dict

    from h2o.tasks.long_context import ruler_folder
    from h2o.tasks.ruler_offline import use_haystack

    with pytest.raises(ValueError, match="allowed"):
        use_haystack("pg19")
    stated = use_haystack("austen")
    assert stated["haystack"] == "austen" and stated["sentences"] in ("punkt_tab", "punkt_untrained")
    tm = TaskManager(include_path=str(ruler_folder()), include_defaults=False,
                     metadata={"tokenizer": tiny_path, "max_seq_lengths": [4096]})
    task = get_task_dict(["niah_single_2"], tm)["niah_single_2"]
    rows = list(task.dataset["test"])
    assert len(rows) == 500 and {r["max_length"] for r in rows} == {4096}
    first = rows[0]
    assert "Dashwood" in first["input"]  # Sense and Sensibility opens the Austen haystack
    assert all(v in first["input"] for v in first["outputs"]) and re.fullmatch(r"\d{7}", first["outputs"][0])
    assert not attempts


@pytest.mark.slow
def test_ruler_task_runs_through_the_evicting_cache_offline(tmp_path):
    """lm-eval's niah_single_2 on SmolLM2 through the pipeline, hub offline: records its haystack and scores."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "h2o.pipeline.run", "task=ruler_niah_single_2", "policy=full",
                          "task.limit=2", "threads=1", f"runs_dir={tmp_path / 'runs'}"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(next((tmp_path / "runs").rglob("metrics.json")).read_text())
    assert rec["haystack"] == "austen" and rec["n_samples"] == 2 and rec["cells"][0]["length"] == 1024
    assert 0 <= rec["metrics"]["acc"] <= 1 and rec["kept_ratio"] == 1.0


def test_lm_eval_cli_refuses_an_unknown_ruler_haystack_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "H2O_RULER_HAYSTACK": "pg19"}
    out = subprocess.run([sys.executable, "-m", "h2o.tasks.lm_eval_cli", "--model", "h2o", "--model_args",
                          "pretrained=tiny:llama", "--tasks", "niah_single_2"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "haystack='pg19'" in out.stderr and "austen, moby_dick, essays" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
