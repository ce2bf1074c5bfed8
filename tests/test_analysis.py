"""analysis/: a fixture runs/ tree of known values -> tables, figures, Self-BLEU, power-law fit."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.figures import all_figures, fit_power_law
from analysis.records import load_runs
from analysis.render import MISSING
from analysis.self_bleu import self_bleu
from analysis.tables import all_tables

REPO = Path(__file__).resolve().parents[1]
MC = dict(experiment="table1", task_kind="multiple_choice", semantics="simulated", seed=0,
          shots=5, wall_s=1.0)


def run(root, rel, samples=None, observations=None, finished=True, **record):
    """Write one run folder; ``record`` holds metrics.json's fields (``metrics`` included)."""
    d = root / rel
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("policy: x\n")
    if samples is not None:
        (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if observations is not None:
        (d / "observations.json").write_text(json.dumps(observations))
    if finished:
        (d / "metrics.json").write_text(json.dumps(record))


def mc(root, model, task, policy, acc, budget=0.2, n=100, **extra):
    split = dict(heavy=budget / 2, recent=budget / 2) if policy == "h2o" else {}
    rec = {**MC, "model": model, "task": task, "policy": policy, "n_samples": n,
           "budget": 1.0 if policy == "full" else budget, **split,
           "metrics": {"acc": acc, **extra.pop("metrics", {})}, **extra}
    leaf = "_".join(str(rec.get(k, "")) for k in ("policy", "budget", "heavy", "shots", "seed"))
    run(root, f"{rec['experiment']}/{model}/{task}/{leaf}", **rec)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    mc(root, "opt-6.7b", "copa", "full", 0.812, metrics={"acc_stderr": 0.039})
    mc(root, "opt-6.7b", "copa", "local", 0.601)
    mc(root, "opt-6.7b", "copa", "local", 0.123, n=10, experiment="smoke")  # fewer samples: unused
    mc(root, "opt-6.7b", "copa", "h2o", 0.795)
    mc(root, "opt-6.7b", "copa", "h2o", 0.805, seed=1)             # mean over seeds: 0.800
    mc(root, "opt-6.7b", "copa", "h2o", 0.111, heavy=0.05, recent=0.15)  # uneven: not H2O
    for policy, acc in [("strided", 0.550), ("strided_h2", 0.780), ("fixed", 0.530),
                        ("topk", 0.790), ("topk_h2", 0.808), ("h2_only", 0.770)]:
        mc(root, "opt-6.7b", "copa", policy, acc)
    mc(root, "opt-6.7b", "copa", "h2o", 0.700, budget=0.1)            # figure 4 sweep
    mc(root, "opt-6.7b", "copa", "local", 0.500, budget=0.1)
    mc(root, "opt-6.7b", "piqa", "full", 0.760, n=200)
    mc(root, "opt-6.7b", "piqa", "h2o", 0.752, n=200)
    mc(root, "llama-7b", "copa", "full", 0.850)
    mc(root, "llama-7b", "copa", "h2o", 0.840)
    mc(root, "opt-6.7b", "copa", "full", 0.700, shots=0, experiment="table10")
    mc(root, "opt-6.7b", "copa", "h2o", 0.690, shots=0, experiment="table10")
    # unfinished: no metrics.json (a temp file the writer had not renamed yet)
    run(root, "table1/opt-6.7b/copa/unfinished", samples=[{"x": 1}], finished=False)
    (root / "table1/opt-6.7b/copa/unfinished/metrics.json.tmp").write_text('{"acc": 0.999}')
    summarization(root)
    benchmark(root)
    streaming(root)
    run(root, "observations/opt-6.7b/wikitext", observations=OBS, **{
        **MC, "experiment": "observations", "task_kind": "observations", "model": "opt-6.7b",
        "task": "wikitext", "policy": "full", "budget": 1.0, "n_samples": 8, "metrics": {}})
    return root


GENERATIONS = {"full": ["a b c d", "a b c e"], "local": ["x y z w"] * 2,
               "h2o": ["a b c d", "e f g h"]}
ROUGE = {"full": (0.351, 0.123, 0.301), "local": (0.201, 0.050, 0.180),
         "h2o": (0.349, 0.118, 0.297)}


def summarization(root):
    for policy, (r1, r2, rl) in ROUGE.items():
        samples = [{"generation": g, "reference": "ref"} for g in GENERATIONS[policy]]
        run(root, f"xsum/llama-7b/{policy}", samples=samples, **{
            **MC, "experiment": "xsum", "task_kind": "summarization", "model": "llama-7b",
            "task": "xsum", "policy": policy, "budget": 1.0 if policy == "full" else 0.2,
            "n_samples": 1000, "metrics": {"rouge1": r1, "rouge2": r2, "rougeL": rl}})


def benchmark(root):
    for policy, tput, lat, kv in [("full", 100.0, 2.0, 2**30), ("h2o", 250.0, 0.8, 0.2 * 2**30)]:
        run(root, f"bench/opt-6.7b/{policy}", **{
            **MC, "experiment": "throughput", "task_kind": "benchmark", "model": "opt-6.7b",
            "task": "synthetic", "policy": policy, "budget": 1.0 if policy == "full" else 0.2,
            "semantics": "real", "n_samples": 4, "prompt_len": 512, "gen_len": 32,
            "batch_size": 1, "metrics": {"throughput_tok_s": tput, "latency_s": lat,
                                         "kv_bytes": kv, "peak_mem_bytes": 2 * kv}})


def streaming(root):
    for policy, base in [("full", 10.0), ("h2o", 11.0), ("streaming_llm", 12.0)]:
        samples = [{"tokens": t, "ppl": base + t / 1e4, "time_s": 1.0, "rss_bytes": 1}
                   for t in (1000, 2000, 4000)]
        run(root, f"stream/llama-7b/{policy}", samples=samples, **{
            **MC, "experiment": "streaming", "task_kind": "streaming", "model": "llama-7b",
            "task": "pg19", "policy": policy, "budget": 1.0 if policy == "full" else 0.2,
            "n_samples": 3, "metrics": {"ppl": base}})


OBS = {"sparsity_per_layer": [0.96, 0.97, 0.99], "sparsity_threshold": 0.01,
       "accumulated_attention": (np.arange(1, 200) ** -1.5).tolist(),
       "heavy_masked": {"full": 0.80, "heavy_masked": 0.35, "random_masked": 0.78}}


@pytest.fixture(scope="module")
def tables(runs):
    return {t.name: t for t in all_tables(load_runs(runs))}


def row(table, *keys):
    """The row whose leading cells are ``keys``, as {header: cell}."""
    hits = [r for r in table.rows if tuple(r[:len(keys)]) == keys]
    assert len(hits) == 1, (keys, table.rows)
    return dict(zip(table.header, hits[0]))


def test_records_skip_unfinished_and_flatten(runs):
    df = load_runs(runs)
    assert not df["path"].str.contains("unfinished").any()
    assert len(df) == 20 + 3 + 2 + 3 + 1
    assert {"acc", "acc_stderr", "rouge2", "throughput_tok_s", "prompt_len"} <= set(df.columns)
    assert load_runs(runs / "nowhere").empty


def test_table1(tables):
    t = tables["table1"]
    assert row(t, "opt-6.7b", "copa") == {
        "model": "opt-6.7b", "task": "copa", "full": "0.812 ±0.039", "local": "0.601",
        "strided": "0.550", "fixed": "0.530", "top-k": "0.790", "H2O": "0.800",
        "strided+H2": "0.780", "top-k+H2": "0.808", "H2 only": "0.770", "n": "100"}
    assert row(t, "opt-6.7b", "piqa")["local"] == MISSING
    assert row(t, "opt-6.7b", "piqa")["n"] == "200"
    assert row(t, "llama-7b", "piqa")["full"] == MISSING      # models x tasks, nothing dropped
    assert "budget: 0.2" in " ".join(t.caption) and "shots: 5" in t.caption
    for unused in ("0.111", "0.999", "0.123"):  # uneven split, unfinished, smoke run
        assert unused not in t.to_markdown()


def test_tables_2_8_9_10(tables):
    assert [row(tables["table2"], "opt-6.7b", "copa")[k] for k in
            ("full", "strided", "strided+H2", "fixed", "fixed+H2")] == \
        ["0.812 ±0.039", "0.550", "0.780", "0.530", MISSING]
    assert row(tables["table8"], "opt-6.7b", "copa")["top-k+H2"] == "0.808"
    assert [row(tables["table9"], "llama-7b", "copa")[k] for k in ("H2 only", "local", "H2O")] \
        == [MISSING, MISSING, "0.840"]
    t10 = row(tables["table10"], "opt-6.7b", "copa")
    assert [t10[k] for k in ("full 0-shot", "H2O 0-shot", "full 5-shot", "H2O 5-shot")] == \
        ["0.700", "0.690", "0.812 ±0.039", "0.800"]
    assert row(tables["table10"], "llama-7b", "copa")["H2O 0-shot"] == MISSING


def test_summarization_and_self_bleu(tables):
    t = tables["rouge"]
    assert row(t, "llama-7b", "xsum", "H2O")["ROUGE-2"] == "0.118"
    assert row(t, "llama-7b", "xsum", "local")["ROUGE-L"] == "0.180"
    assert "n_samples: 1000 per run" in t.caption
    sb = row(tables["self_bleu"], "llama-7b", "xsum")
    assert (sb["full"], sb["H2O"], sb["local"]) == ("0.3976", "0.0000", "1.0000")
    assert "n_samples: 2 per run" in tables["self_bleu"].caption


def test_benchmark_and_perplexity(tables):
    b = row(tables["benchmark"], "opt-6.7b", "real", "512", "32", "1", "H2O")
    assert (b["throughput (tok/s)"], b["latency (s)"], b["KV cache (MiB)"]) == \
        ("250.0", "0.800", "204.8")
    assert (b["throughput × full"], b["latency × full"], b["KV cache × full"]) == \
        ("2.50×", "0.40×", "0.20×")
    cells = tables["benchmark"].rows[-1]
    assert cells[7:] == ["250.0", "2.50×", "0.800", "0.40×", "204.8", "0.20×", "409.6", "0.20×"]
    p = tables["perplexity"]
    assert row(p, "llama-7b", "pg19", "StreamingLLM")["budget 0.2"] == "12.00"
    assert row(p, "llama-7b", "pg19", "H2O")["budget 1"] == MISSING


def test_tables_written_as_markdown_and_latex(runs, tmp_path):
    out = subprocess.run([sys.executable, "-m", "analysis", "tables", "--runs", str(runs),
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    names = {"table1", "table2", "table8", "table9", "table10", "rouge", "self_bleu",
             "perplexity", "benchmark"}
    assert {p.stem for p in (tmp_path / "tables").glob("*.md")} == names
    assert {p.stem for p in (tmp_path / "tables").glob("*.tex")} == names
    md = (tmp_path / "tables" / "table1.md").read_text()
    assert "| opt-6.7b | copa | 0.812 ±0.039 | 0.601 |" in md and "| — |" in md
    assert "0.812 $\\pm$0.039" in (tmp_path / "tables" / "table1.tex").read_text()
    assert "Table 1" in out.stdout and str(tmp_path / "tables" / "table1.md") in out.stdout


def test_figures_written(runs, tmp_path):
    paths = all_figures(load_runs(runs), tmp_path)
    stems = {p.name for p in paths}
    for name in ("fig4_budget_curves", "streaming_ppl", "fig2_observations"):
        assert {f"{name}.png", f"{name}.pdf"} <= stems
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("what", ["tables", "figures"])
def test_cli_without_runs(tmp_path, what):
    out = subprocess.run([sys.executable, "-m", "analysis", what, "--runs", str(tmp_path / "no"),
                          "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.count("\n") == 1 and "no finished runs" in out.stdout


def test_self_bleu_cases():
    assert self_bleu(["the cat sat on the mat"] * 3) == pytest.approx(1.0)
    assert self_bleu(["a b c d", "e f g h", "i j k l"]) == 0.0
    # "a b c d" vs reference "A b c e" (lowercased): 1-grams 3/4, 2-grams 2/3, 3-grams 1/2,
    # 4-grams 0/1 -> method1 smoothing 0.1/1; equal lengths, brevity penalty 1.
    # BLEU = (3/4 * 2/3 * 1/2 * 0.1) ** (1/4) = 0.025 ** 0.25 = 0.39764; symmetric, so the mean too.
    assert self_bleu(["a b c d", "A b c e"]) == pytest.approx(0.025 ** 0.25, abs=1e-9)


def test_power_law_exponent_recovered():
    rng = np.random.default_rng(0)
    ranks = np.arange(1, 2001)
    scores = 3.0 * ranks ** -1.3 * np.exp(rng.normal(0, 0.05, ranks.size))
    alpha, c = fit_power_law(rng.permutation(scores))
    assert alpha == pytest.approx(1.3, abs=0.03) and c == pytest.approx(3.0, rel=0.1)


def test_varying_semantics_become_a_row_key(tmp_path):
    mc(tmp_path, "opt-6.7b", "copa", "full", 0.812)
    mc(tmp_path, "opt-6.7b", "copa", "h2o", 0.790, semantics="reference", experiment="ref")
    t = {t.name: t for t in all_tables(load_runs(tmp_path))}["table1"]
    assert t.header[:3] == ["model", "semantics", "task"]
    assert row(t, "opt-6.7b", "reference", "copa")["H2O"] == "0.790"
    assert row(t, "opt-6.7b", "reference", "copa")["full"] == MISSING
    assert row(t, "opt-6.7b", "simulated", "copa")["full"] == "0.812"


def test_analysis_imports_no_torch():
    code = ("import sys, analysis.__main__, analysis.tables, analysis.figures; "
            "sys.exit(bool({'torch', 'transformers'} & set(sys.modules)))")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
