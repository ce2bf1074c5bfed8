"""analysis/: fixture run records of known values and mixed protocols -> paper tables, experiment
tables, figures, REPORT.md; Self-BLEU and the power-law fit; nothing is ever blended."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from analysis.__main__ import main
from analysis.estimate import Z95, wilson
from analysis.figures import all_figures, curve_panel, fit_power_law
from analysis.paper_tables import paper_tables
from analysis.protocol import annotate, as_records, choose, compare, select
from analysis.records import load_runs
from analysis.render import MISSING
from analysis.report import report
from analysis.self_bleu import self_bleu
from analysis.tables import experiment_tables, table_benchmark

REPO = Path(__file__).resolve().parents[1]
COUNT = iter(range(10**6))


def run(root, samples=None, observations=None, finished=True, **record):
    """Write one run folder; ``record`` holds metrics.json's fields (``metrics`` included)."""
    d = root / f"{record.get('experiment')}/{record.get('model')}/{record.get('task')}/{next(COUNT)}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("task:\n  name: x\n")
    if samples is not None:
        (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    if observations is not None:
        (d / "observations.json").write_text(json.dumps(observations))
    if finished:
        (d / "metrics.json").write_text(json.dumps(record))
    return d


def mc(root, exp, model, task, policy, acc, budget=0.2, shots=5, n=100, scoring="mean",
       bos=False, limit=None, seed=0, legacy=False, **extra):
    """A multiple-choice record as the runner writes it (``legacy``: before scoring, BOS,
    protocol and acc_mean existed: ``acc`` then is whatever ``scoring`` said)."""
    se = math.sqrt(acc * (1 - acc) / (n - 1))
    rec = {"experiment": exp, "model": model, "task": task, "task_kind": "multiple_choice",
           "policy": policy, "budget": 1.0 if policy == "full" else budget, "shots": shots,
           "semantics": "simulated", "seed": seed, "n_samples": n, "limit": limit,
           "metrics": {"acc": acc, "acc_stderr": se}}
    if policy == "h2o":
        rec.update(heavy=budget / 2, recent=budget / 2)
    rec.update(extra)
    if legacy:
        rec.update({"scoring": scoring} if scoring else {})
    else:
        rec.update(scoring=scoring, add_bos_token=bos, protocol={
            "limit": limit, "shots": shots, "scoring": scoring, "add_bos_token": bos})
        rec["metrics"].update(acc_mean=acc, acc_mean_stderr=se)
    return run(root, **rec)


GENERATIONS = {"full": ["a b c d", "a b c e", "q r s t"], "local": ["x y z w"] * 3,
               "h2o": ["a b c d", "e f g h", "a b c d"]}


def summarization(root, exp, policy, gens, rouge2):
    samples = [{"generation": g, "reference": "ref", "rouge2": r} for g, r in zip(gens, rouge2)]
    return run(root, samples=samples, experiment=exp, model="llama-7b", task="xsum",
               task_kind="summarization", policy=policy, shots=0, semantics="real", seed=0,
               budget=1.0 if policy == "full" else 0.2, n_samples=len(gens),
               protocol={"limit": len(gens), "max_new_tokens": 64, "shots": 0},
               scoring=None, add_bos_token=False, metrics={"rouge2": float(np.mean(rouge2))})


NLL = {"full": [2.0, 2.2, 2.4], "local": [3.0, 3.5, 4.0], "h2o": [2.1, 2.3, 2.5]}


def perplexity(root, policy, budget):
    samples = [{"window": i, "nll": v * 100, "n_tokens": 100} for i, v in enumerate(NLL[policy])]
    return run(root, samples=samples, experiment="default", model="smollm2-135m",
               task="austen_ppl", task_kind="perplexity", policy=policy, shots=0,
               semantics="simulated", seed=0, budget=budget, n_samples=3, scoring=None,
               add_bos_token=False, protocol={"window": 100, "n_windows": 3},
               metrics={"ppl": math.exp(np.mean(NLL[policy]))})


OBS = {"sparsity_per_layer": [0.96, 0.97, 0.99], "sparsity_threshold": 0.01,
       "accumulated_attention": (np.arange(1, 200) ** -1.5).tolist(),
       "heavy_masked": {"full": 0.80, "heavy_masked": 0.35, "random_masked": 0.78}}


QUANT = {"quant": "uniform", "bits": 4, "group_size": 64}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    t2 = "table2"
    mc(root, t2, "opt-30b", "copa", "full", 0.85)
    mc(root, t2, "opt-30b", "copa", "full", 0.10, n=20, limit=20)         # smoke size: loses
    mc(root, t2, "opt-30b", "copa", "local", 0.30)                        # paper 48.00: outside
    mc(root, t2, "opt-30b", "copa", "h2o", 0.84)
    mc(root, t2, "opt-30b", "copa", "h2o", 0.60, scoring="sum")           # same n: mean wins
    mc(root, t2, "opt-30b", "copa", "h2o", 0.01, heavy=0.05, recent=0.15)  # uneven: not H2O
    mc(root, t2, "opt-30b", "piqa", "full", 0.78)
    mc(root, t2, "opt-30b", "piqa", "full", 0.80, seed=1)                 # seeds: mean 79.0
    mc(root, t2, "opt-30b", "openbookqa", "full", 0.43, legacy=True)      # old mean-rule record
    mc(root, t2, "opt-30b", "openbookqa", "h2o", 0.31, legacy=True, scoring="sum")
    mc(root, t2, "smollm2-135m", "bb_copa", "full", 0.60, n=50)           # stand-in task
    mc(root, t2, "opt-30b", "copa", "h2o", 0.10, n=500, quant=QUANT)      # quantized: not H2O
    mc(root, "table6", "opt-30b", "copa", "h2o", 0.83, quant=QUANT)
    mc(root, "table9", "opt-13b", "piqa", "h2o", 0.77)
    mc(root, "table10", "opt-30b", "copa", "full", 0.86, shots=10)
    for budget, acc, n in [(0.1, 0.70, 100), (0.2, 0.80, 100), (0.2, 0.10, 20)]:
        mc(root, "fig4", "opt-6.7b", "copa", "h2o", acc, budget=budget, n=n, limit=n)
    mc(root, "fig4", "opt-6.7b", "copa", "full", 0.81, limit=100)
    mc(root, "table1", "opt-6.7b", "copa", "full", 0.81, limit=100)
    mc(root, "table1", "opt-6.7b", "copa", "h2o", 0.80, limit=100)
    for policy, b, acc in [("full", 1.0, 0.60), ("local", 0.2, 0.40), ("h2o", 0.2, 0.58),
                           ("local", 0.1, 0.35), ("h2o", 0.1, 0.55)]:
        mc(root, "default", "smollm2-135m", "bb_copa", policy, acc, budget=b, n=60)
    for policy, b in [("full", 1.0), ("local", 0.2), ("h2o", 0.2), ("h2o", 0.1)]:
        perplexity(root, policy, b)
    for policy in ("full", "h2o", "local"):
        summarization(root, "self_bleu", policy, GENERATIONS[policy], [0.1, 0.2, 0.3])
    summarization(root, "helm", "h2o", ["z z z z"] * 3, [0.05, 0.1, 0.15])  # not Self-BLEU's
    run(root, samples=[{"x": 1}], finished=False, experiment="table2", model="opt-30b", task="copa")
    for policy, tput, kv in [("full", 100.0, 2**30), ("h2o", 250.0, 0.2 * 2**30)]:
        run(root, experiment="bench", task_kind="benchmark", model="opt-6.7b", task="synthetic",
            policy=policy, budget=1.0 if policy == "full" else 0.2, semantics="real", seed=0,
            n_samples=4, prompt_len=512, gen_len=32, batch_size=1,
            metrics={"throughput_tok_s": tput, "latency_s": 32 / tput, "kv_bytes": kv,
                     "peak_mem_bytes": 2 * kv})
    for policy, base in [("full", 10.0), ("h2o", 11.0)]:
        run(root, samples=[{"tokens": t, "ppl": base + t / 1e4} for t in (1000, 2000, 4000)],
            experiment="streaming", task_kind="streaming", model="llama-7b", task="pg19",
            policy=policy, budget=1.0 if policy == "full" else 0.2, seed=0, n_samples=3,
            metrics={"ppl": base})
    run(root, observations=OBS, experiment="observations", task_kind="observations",
        model="opt-6.7b", task="wikitext", policy="full", budget=1.0, n_samples=8, metrics={})
    return root


@pytest.fixture(scope="module")
def df(runs):
    return load_runs(runs)


@pytest.fixture(scope="module")
def papers(df):
    return {spec.name: (table, cells, claims) for spec, table, cells, claims in paper_tables(df)}


def row(table, *keys):
    """The row whose leading cells are ``keys``, as {header: cell}."""
    hits = [r for r in table.rows if tuple(r[:len(keys)]) == keys]
    assert len(hits) == 1, (keys, table.rows)
    return dict(zip(table.header, hits[0]))


def cell(cells, **keys):
    hits = [c for c in cells if all(c.keys.get(k) == v for k, v in keys.items())]
    assert len(hits) == 1, keys
    return hits[0]


def test_records_skip_unfinished(df):
    assert len(df) == 39 and df["policy"].notna().all()   # the unfinished run is not there
    assert {"acc_mean", "protocol.limit", "throughput_tok_s", "prompt_len"} <= set(df.columns)


def test_a_cell_never_blends_protocols(papers):
    table, cells, _ = papers["table2"]
    copa = cell(cells, model="opt-30b", column="COPA", method="Full")
    assert copa.pick.n == 100 and copa.ours.value == pytest.approx(85.0)   # not the smoke run
    lo, hi = wilson(0.85, 100)
    assert (copa.ours.lo, copa.ours.hi) == pytest.approx((100 * lo, 100 * hi))
    assert copa.text == f"85.00 · 85.0 [{100 * lo:.1f}, {100 * hi:.1f}] (p1) · +0.0"
    h2o = cell(cells, model="opt-30b", column="COPA", method="Local w. H2 (H2O)")
    assert h2o.ours.value == pytest.approx(84.0) and h2o.pick.left_out == 1  # sum run left out
    assert json.loads(h2o.pick.protocol)["scoring"] == "mean"
    md = table.to_markdown()
    for blend in ("· 72.0 [", "· 47.5 [", "· 42.5 [", "· 1.0 ["):  # sum+mean, smoke+full, uneven
        assert blend not in md
    assert "protocol p1:" in md and "legacy record" in md and "cell rule: one protocol" in md


def test_seeds_of_one_protocol_are_averaged(papers):
    piqa = cell(papers["table2"][1], model="opt-30b", column="PiQA", method="Full")
    assert piqa.ours.value == pytest.approx(79.0) and len(piqa.pick.runs) == 2
    se = [max(math.sqrt(p * (1 - p) / 99), (wilson(p, 100)[1] - wilson(p, 100)[0]) / (2 * Z95))
          for p in (0.78, 0.80)]
    assert piqa.ours.hi - piqa.ours.value == pytest.approx(100 * Z95 * math.hypot(*se) / 2)


def test_legacy_records_stand_alone(papers):
    cells = papers["table2"][1]
    obqa = cell(cells, model="opt-30b", column="OpenBookQA", method="Full")
    assert obqa.ours.value == pytest.approx(43.0)                 # acc of an old mean-rule run
    assert obqa.verdict == "not comparable: BOS not recorded" and "†" in obqa.text
    assert cell(cells, model="opt-30b", column="OpenBookQA",
                method="Local w. H2 (H2O)").text == "43.00 · not run"   # summed acc: not acc_mean


def test_verdicts(papers):
    cells = papers["table2"][1]
    assert cell(cells, model="opt-30b", column="COPA", method="Full").verdict == "within"
    local = cell(cells, model="opt-30b", column="COPA", method="Local w.o. H2")
    assert local.verdict == "outside" and local.text.endswith("· −18.0")
    stand_in = cell(cells, model="smollm2-135m", column="COPA", method="Full")
    assert stand_in.verdict == ("not comparable: paper's model is OPT-30B; stand-in task bb_copa")
    assert cell(cells, model="opt-30b", column="COPA", method="Fixed w. H2").verdict == "not run"
    claims = papers["table2"][2]
    assert claims[0].startswith("- H2O beats local at 20%: holds in 1, unresolved in 0, "
                                "contradicted in 0 of 1: copa (opt-30b, 5-shot) ✓ 54.0")


def test_paper_layouts(papers):
    t1 = papers["table1"][0]
    assert [r[1] for r in t1.rows] == ["Full", "0-shot Full", "1-shot Full", "Local", "H2O"]
    assert t1.header == ["model", "method", "PiQA", "COPA", "OpenBookQA", "Winogrande"]
    assert t1.rows[0][2] == "80.09 · not run"            # table1 has no piqa run
    t9 = papers["table9"][0]
    assert t9.header == ["task", "model", "Full", "w. Local", "w. H2", "w. Local + H2"]
    assert [r[:2] for r in t9.rows[:2]] == [["PiQA", "opt-13b"], ["PiQA", "opt-30b"]]
    assert row(t9, "PiQA", "opt-13b")["w. Local + H2"].startswith("77.26 · 77.0 [")
    t10 = papers["table10"][0]
    assert t10.header == ["task", "method", "5-shot opt-30b", "5-shot opt-66b",
                          "10-shot opt-30b", "10-shot opt-66b"]
    assert row(t10, "COPA", "Full")["10-shot opt-30b"].startswith("86.00 · 86.0 [")
    assert row(t10, "COPA", "Full")["5-shot opt-30b"] == "85.00 · not run"
    assert {"helm_0shot", "helm_5shot", "table8", "self_bleu"} <= set(papers)
    t6 = papers["table6"][0]
    assert [r[1] for r in t6.rows] == ["Full", "H2O", "Quant-4bit", "H2O w. Quant-4bit"]
    assert row(t6, "opt-30b", "H2O w. Quant-4bit")["COPA"].startswith("84.00 · 83.0 [")
    assert row(t6, "opt-30b", "H2O")["COPA"] == "84.00 · not run"   # the quantized run is not H2O


def test_self_bleu_reads_only_its_experiment(papers, df):
    cells = papers["self_bleu"][1]
    for method, policy in [("Full", "full"), ("H2O", "h2o"), ("Local", "local")]:
        c = cell(cells, method=method)
        assert c.ours.value == pytest.approx(self_bleu(GENERATIONS[policy]))
    local = cell(cells, method="Local")      # identical generations: 1.0, paper 0.0436
    assert local.text == "0.0436 · 1.0000 [1.0000, 1.0000] · +0.9564" and local.verdict == "outside"
    helm = papers["helm_0shot"][0]
    half = Z95 * 0.05 / math.sqrt(3)          # rouge2 per article 0.05, 0.10, 0.15
    assert row(helm, "llama-7b", "XSUM", "H2O")["0.2"] == f"0.100 [{0.1 - half:.3f}, {0.1 + half:.3f}]"


def test_figure_point_is_one_protocol(df):
    fig, ax = plt.subplots()
    runs = annotate(df[df["experiment"] == "fig4"])
    assert curve_panel(ax, runs, "acc_mean", "t") == 3
    bars = ax.containers[0]
    assert list(bars.lines[0].get_ydata()) == pytest.approx([0.70, 0.80])  # not (0.80+0.10)/2
    assert ax.lines[0].get_ydata()[0] == pytest.approx(0.81)               # full, dashed
    plt.close(fig)


def test_experiment_tables(df):
    tables = {t.name: t for t in experiment_tables(df)}
    mc_t = tables["default_multiple_choice"]
    assert mc_t.header == ["model", "task", "policy", "0.1", "0.2", "1"]
    assert row(mc_t, "smollm2-135m", "bb_copa", "H2O")["0.2"].startswith("0.580 [")
    assert row(mc_t, "smollm2-135m", "bb_copa", "full")["0.2"] == MISSING
    ppl = row(tables["default_perplexity"], "smollm2-135m", "austen_ppl", "local")["0.2"]
    logs = np.array(NLL["local"])
    se = math.exp(logs.mean()) * logs.std(ddof=1) / math.sqrt(3)
    v = math.exp(logs.mean())
    assert ppl == f"{v:.2f} [{v - Z95 * se:.2f}, {v + Z95 * se:.2f}]"
    bench = row(table_benchmark(df), "opt-6.7b", "real", "512", "32", "1", "H2O")
    assert (bench["throughput (tok/s)"], bench["throughput × full"], bench["KV cache × full"]) \
        == ("250.0", "2.50×", "0.20×")


def test_budget_one_without_its_own_record_shows_the_full_cache(tmp_path):
    """A Slurm sweep runs local/h2o at budget 1.0 once, as full (h2o.pipeline.launch: served): the cell shows
    full's value, said in the caption; a record of the policy's own at 1.0 is shown as it is."""
    for policy, budget in (("full", 1.0), ("h2o", 0.2), ("local", 0.2), ("local", 1.0)):
        perplexity(tmp_path, policy, budget)
    (table,) = experiment_tables(load_runs(tmp_path))
    full, h2o, local = (row(table, "smollm2-135m", "austen_ppl", p) for p in ("full", "H2O", "local"))
    assert h2o["1"] == full["1"] != MISSING and h2o["0.2"] != full["1"]
    assert local["1"].startswith(f"{math.exp(np.mean(NLL['local'])):.2f} [")  # its own record
    assert "budget 1 cells of an evicting policy without a record of their own (1): the full cache's" \
        in " ".join(table.caption)


def test_differences_pair_the_samples_both_runs_scored(df):
    recs = [r for r in as_records(df[df["experiment"] == "default"]) if r["task"] == "austen_ppl"]
    full, local = (choose(select(recs, w), "ppl") for w in ({"policy": "full"},
                                                           {"policy": "local", "budget": 0.2}))
    d = compare(local, full, "ppl")              # per-window log-ppl differences 1.0, 1.3, 1.6
    ppl_full, half = math.exp(2.2), Z95 * 0.3 / math.sqrt(3)
    assert d.value == pytest.approx(ppl_full * (math.exp(1.3) - 1))
    assert (d.lo, d.hi) == pytest.approx((ppl_full * (math.exp(1.3 - half) - 1),
                                         ppl_full * (math.exp(1.3 + half) - 1)))
    h2o = choose(select(recs, {"policy": "h2o", "budget": 0.1}), "ppl")
    assert compare(h2o, full, "ppl").lo == pytest.approx(ppl_full * (math.exp(0.1) - 1))
    mc = as_records(df[(df["experiment"] == "default") & (df["task"] == "bb_copa")])
    a, b = (choose(select(mc, {"policy": p, "budget": 0.2}), "acc_mean") for p in ("h2o", "local"))
    assert compare(a, b, "acc_mean").se == pytest.approx(math.hypot(a.est.se, b.est.se))  # no samples


def test_report(df):
    text = report(df)
    # within (COPA full and H2O, PiQA full), outside (COPA local), not comparable (OpenBookQA's
    # legacy full), not run; Table 1's model is unnamed: its two runs are not comparable
    assert "| Table 2 | 28 | 3 | 1 | 1 | 0 | 23 |" in text
    assert "| Table 1 | 20 | 0 | 0 | 2 | 0 | 18 |" in text
    assert "| OPT-30B | opt-30b / Local w.o. H2 | COPA | 48.00 | 30.0 [" in text
    assert "## Experiment `default` (not a paper table)" in text
    assert "- austen_ppl (smollm2-135m, 0-shot, ppl): 0.1: H2O < full" in text  # paired windows
    assert "0.2: H2O > local" in text and "**Table 11** (9 numbers): SpAtten" in text


def test_report_on_empty_runs(tmp_path, capsys):
    (tmp_path / "no").mkdir()  # an empty runs root (a missing one is an error: tests/test_hardening_three.py)
    assert main(["report", "--runs", str(tmp_path / "no"), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"0 finished runs under {tmp_path / 'no'}/; wrote " \
        f"{tmp_path / 'REPORT.md'}\n"
    text = (tmp_path / "REPORT.md").read_text()
    for table, n in [("Table 1", 20), ("Table 2", 28), ("Table 6", 12), ("Table 8", 12),
                     ("Table 9", 32), ("Table 10", 36), ("Self-BLEU (App. C.1)", 3)]:
        assert f"| {table} | {n} | 0 | 0 | 0 | 0 | {n} |" in text
    rows = [line for line in text.splitlines() if line.endswith(" | not run |")]
    assert len(rows) == 1 + 20 + 28 + 12 + 12 + 32 + 36 + 3 + 3  # summary header, numbers, Fig. 4


def test_tables_and_figures_written(runs, tmp_path, capsys):
    assert main(["tables", "--runs", str(runs), "--out", str(tmp_path)]) == 0
    assert "**Table 2: local and Sparse" in capsys.readouterr().out
    names = {p.stem for p in (tmp_path / "tables").glob("*.md")}
    assert {"table1", "table2", "table8", "table9", "table10", "helm_0shot", "helm_5shot",
            "self_bleu", "default_multiple_choice", "default_perplexity", "benchmark"} <= names
    assert names == {p.stem for p in (tmp_path / "tables").glob("*.tex")}
    tex = (tmp_path / "tables" / "table2.tex").read_text()
    assert r"85.00 $\cdot$ 85.0 [" in tex and "·" not in tex and "†" not in tex
    paths = all_figures(load_runs(runs), tmp_path / "figures")
    stems = {p.name for p in paths}
    for name in ("fig4_budget_curves", "default_budget_curves", "streaming_ppl",
                 "fig2_observations"):
        assert {f"{name}.png", f"{name}.pdf"} <= stems
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("what", ["tables", "figures"])
def test_cli_without_runs(tmp_path, what, capsys):
    (tmp_path / "no").mkdir()
    assert main([what, "--runs", str(tmp_path / "no"), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert out.err == "" and out.out.count("\n") == 1 and "no finished runs" in out.out
    assert not (tmp_path / what).exists()


def test_self_bleu_cases():
    assert self_bleu(["the cat sat on the mat"] * 3) == pytest.approx(1.0)
    assert self_bleu(["a b c d", "e f g h", "i j k l"]) == 0.0
    # "a b c d" vs reference "A b c e" (lowercased): 1-grams 3/4, 2-grams 2/3, 3-grams 1/2,
    # 4-grams 0/1 -> method1 smoothing 0.1/1; equal lengths, brevity penalty 1.
    # BLEU = (3/4 * 2/3 * 1/2 * 0.1) ** (1/4) = 0.025 ** 0.25 = 0.39764; symmetric, so the mean too.
    assert self_bleu(["a b c d", "A b c e"]) == pytest.approx(0.025 ** 0.25, abs=1e-9)


def test_wilson_interval_matches_scipy():
    from scipy.stats import binomtest
    for k, n in [(0, 3), (85, 100), (3, 6), (60, 60)]:
        ci = binomtest(k, n).proportion_ci(method="wilson")
        assert wilson(k / n, n) == pytest.approx((ci.low, ci.high), abs=1e-8)


def test_power_law_exponent_recovered():
    rng = np.random.default_rng(0)
    ranks = np.arange(1, 2001)
    scores = 3.0 * ranks ** -1.3 * np.exp(rng.normal(0, 0.05, ranks.size))
    alpha, c = fit_power_law(rng.permutation(scores))
    assert alpha == pytest.approx(1.3, abs=0.03) and c == pytest.approx(3.0, rel=0.1)


def test_analysis_installs_and_runs_without_torch(tmp_path):
    """``pip install ./analysis`` (its own pyproject: pandas, matplotlib, no torch) and ``python -m analysis``
    tables, figures and report from the installed copy, with torch, transformers, lm_eval and h2o unimportable."""
    import shutil
    import zipfile

    from no_torch import blocker

    src = tmp_path / "src"  # a copy: the build leaves no build/ or egg-info in the checkout
    shutil.copytree(REPO / "analysis", src, ignore=shutil.ignore_patterns("out", "__pycache__", "build", "*.egg-info"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert built.returncode == 0, built.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob("h2o_analysis-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert {"analysis/__main__.py", "analysis/tables.py", "analysis/paper_results.csv"} <= set(names)
    meta = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line.split()[1] for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert {"pandas<4,>=3.1", "matplotlib<4,>=3.11"} <= set(requires) and not any("torch" in r for r in requires)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(whl)],
                   check=True)
    work = tmp_path / "work"  # no checkout here: the installed analysis is the one imported
    runs = work / "runs"
    for policy, b, acc in [("full", 1.0, 0.60), ("local", 0.2, 0.40), ("h2o", 0.2, 0.58), ("h2o", 0.1, 0.55)]:
        mc(runs, "default", "smollm2-135m", "bb_copa", policy, acc, budget=b, n=60)
        perplexity(runs, policy, b)
    code = (blocker("h2o", "hydra") + "import runpy, analysis\n"
            f"assert analysis.__file__.startswith({str(site)!r}), analysis.__file__\n"
            "for what in ('tables', 'figures', 'report'):\n"
            f"    sys.argv = ['analysis', what, '--runs', {str(runs)!r}, '--out', 'out']\n"
            "    try:\n        runpy.run_module('analysis', run_name='__main__')\n    except SystemExit as e:\n"
            "        assert not e.code, (what, e.code)\n"
            "try:\n    import torch\nexcept ImportError:\n    pass\nelse:\n    raise SystemExit('not blocked')\n"
            "assert not {'torch', 'transformers', 'h2o'} & set(sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site), "MPLBACKEND": "Agg"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "smollm2-135m" in (work / "out" / "tables" / "default_perplexity.md").read_text()
    assert (work / "out" / "REPORT.md").is_file()
    assert (work / "out" / "figures" / "default_budget_curves.png").stat().st_size > 1000
