"""The figure a single-budget experiment draws (each policy's headline metric with its 95% interval) and the
results pages `make docs-results` regenerates from committed study records."""
import math

import numpy as np
import pytest

from analysis.estimate import wilson
from analysis.figures import all_figures, headline_metric, policy_points
from analysis.protocol import annotate
from analysis.records import load_runs
from test_analysis import mc, perplexity, run

POLICIES = ["full", "local", "streaming_llm", "h2o"]


def ppl_only(root):
    for policy in ("full", "local", "h2o"):
        perplexity(root, policy, 1.0 if policy == "full" else 0.2)


def test_perplexity_alone_draws_each_policy_with_its_interval(tmp_path):
    ppl_only(tmp_path / "runs")
    df = load_runs(tmp_path / "runs")
    paths = all_figures(df, tmp_path / "fig")
    assert {p.name for p in paths} == {"default_policies.png", "default_policies.pdf"}
    assert all(p.stat().st_size > 1000 for p in paths)
    pts = dict(policy_points(annotate(df), "ppl"))
    assert list(pts) == ["full", "local", "h2o"]
    nll = {"full": [2.0, 2.2, 2.4], "local": [3.0, 3.5, 4.0], "h2o": [2.1, 2.3, 2.5]}  # test_analysis's NLL
    for policy, e in pts.items():
        logs = np.asarray(nll[policy])
        ppl = math.exp(logs.mean())
        se = ppl * logs.std(ddof=1) / math.sqrt(3)                  # delta method over the windows
        assert e.value == pytest.approx(ppl)
        assert (e.lo, e.hi) == pytest.approx((ppl - 1.959964 * se, ppl + 1.959964 * se))


def test_multiple_choice_alone_draws_wilson_intervals(tmp_path):
    for policy, acc in zip(POLICIES, (0.6, 0.55, 0.5, 0.45)):
        mc(tmp_path / "runs", "table9", "smollm2-135m", "bb_copa", policy, acc, n=64, headline="acc_mean")
    df = load_runs(tmp_path / "runs")
    assert headline_metric(df) == "acc_mean"
    assert [p.name for p in all_figures(df, tmp_path / "fig")] == ["table9_policies.png", "table9_policies.pdf"]
    pts = dict(policy_points(annotate(df), "acc_mean"))
    assert list(pts) == ["full", "local", "streaming_llm", "h2o"]
    assert (pts["h2o"].lo, pts["h2o"].hi) == pytest.approx(wilson(0.45, 64))


def test_any_task_draws_its_headline_metric(tmp_path):
    """A task kind the analysis has never heard of draws the metric its records name as their headline."""
    for policy, em in zip(("full", "h2o"), (0.9, 0.4)):
        run(tmp_path / "runs", samples=[{"doc_id": i, "exact_match": float(i < em * 10)} for i in range(10)],
            experiment="needles", model="smollm2-135m", task="needle", task_kind="needle", policy=policy,
            budget=1.0 if policy == "full" else 0.2, shots=0, semantics="real", seed=0, n_samples=10,
            headline="exact_match", metrics={"exact_match": em})
    df = load_runs(tmp_path / "runs")
    assert headline_metric(df) == "exact_match"
    assert [p.name for p in all_figures(df, tmp_path / "fig")] == ["needles_policies.png", "needles_policies.pdf"]
    pts = dict(policy_points(annotate(df), "exact_match"))
    assert pts["h2o"].value == 0.4 and pts["h2o"].has_interval   # from the per-sample values
    assert pts["h2o"].hi - pts["h2o"].lo == pytest.approx(2 * 1.959964 * np.std([1.0] * 4 + [0.0] * 6, ddof=1)
                                                          / math.sqrt(10))


def test_budget_sweeps_still_draw_curves(tmp_path):
    for policy, b in [("full", 1.0), ("h2o", 0.2), ("h2o", 0.1)]:
        perplexity(tmp_path / "runs", policy, b)
    names = {p.name for p in all_figures(load_runs(tmp_path / "runs"), tmp_path / "fig")}
    assert names == {"default_budget_curves.png", "default_budget_curves.pdf"}


# ---- the results pages (analysis.results_pages, `make docs-results`)

import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402

from analysis import results_pages  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def study(folder, **spec):
    folder.mkdir(parents=True)
    (folder / "study.yaml").write_text(json.dumps(spec))  # JSON is YAML
    return folder


def test_a_records_study_page_has_its_tables_figure_and_provenance(tmp_path):
    root = study(tmp_path / "studies" / "default", title="The default", kind="records",
                 measured="2-core CPU", commands=["make sweep"]) / "records"
    for policy, acc in zip(POLICIES, (0.6, 0.55, 0.5, 0.45)):
        d = mc(root, "default", "smollm2-135m", "bb_copa", policy, acc, n=64)
        (d / "env.json").write_text(json.dumps({"git_commit": "abcdef0123", "git_dirty": False, "device": "cpu",
                                                "device_name": "Xeon", "n_cpus": 2,
                                                "torch_threads": 2, "hostname": "box",
                                                "started": "2026-11-30T10:00:00+0000",
                                                "ended": "2026-11-30T10:05:00+0000"}))
    ppl_only(root)
    out = tmp_path / "docs"
    assert results_pages.main(["--studies", str(tmp_path / "studies"), "--out", str(out)]) == 0
    page = (out / "default.md").read_text()
    assert page.startswith(results_pages.HEADER)
    assert ("Measured: 2-core CPU; 4 runs, 2026-11-30, commit abcdef0, cpu (Xeon, 2 CPUs), 2 threads, host box"
            in page)
    assert "```bash\nmake sweep\n```" in page
    lo, hi = wilson(0.45, 64)
    flo, fhi = wilson(0.6, 64)  # a 100% budget never evicts: its cell is the full cache's record
    assert f"| smollm2-135m | bb_copa | H2O | 0.450 [{lo:.3f}, {hi:.3f}] | 0.600 [{flo:.3f}, {fhi:.3f}] |" in page
    assert "| smollm2-135m | austen_ppl | local |" in page
    assert "- bb_copa (smollm2-135m, 5-shot, acc_mean): 0.2: H2O ≈ full" in page
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", page)
    assert images == ["default/default_policies.png"]
    assert (out / images[0]).stat().st_size > 1000
    assert not list(out.rglob("*.pdf"))
    assert "[The default](default.md)" in (out / "index.md").read_text()


def test_a_study_without_records_gets_no_page(tmp_path):
    study(tmp_path / "s" / "later", title="Later", kind="records")
    assert results_pages.main(["--studies", str(tmp_path / "s"), "--out", str(tmp_path / "o")]) == 0
    assert not (tmp_path / "o" / "later.md").exists()
    assert "Later: no records committed yet" in (tmp_path / "o" / "index.md").read_text()


@pytest.mark.parametrize("spec, says", [({"title": "x", "kind": "tables"}, "kind='tables': allowed: records, "
                                         "streaming"), ({"kind": "records"}, "'title' missing"),
                                        ({"title": "x", "kind": "streaming"}, "needs 'sections'")])
def test_a_bad_study_is_one_line(tmp_path, capsys, spec, says):
    study(tmp_path / "s" / "bad", **spec)
    assert results_pages.main(["--studies", str(tmp_path / "s"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "study.yaml" in err


# pages of docs/results/ that another command writes from records committed under studies/
OTHER_GENERATORS = {"parity.md": "make parity (h2o.parity.table) from studies/parity/"}


def test_the_parity_page_is_what_its_records_give(tmp_path):
    """docs/results/parity.md is rebuilt from the parity records committed under studies/parity/."""
    from h2o.parity.table import write_table

    records = REPO / "studies" / "parity"
    write_table(records, tmp_path / "parity.md", json.loads((records / "prompts.json").read_text()))
    assert (tmp_path / "parity.md").read_text() == (REPO / "docs" / "results" / "parity.md").read_text()


def test_the_committed_pages_are_what_the_records_give(tmp_path):
    """docs/results/ is regenerated, never edited: building it again from analysis/ gives the same Markdown
    (figures are compared by name: their bytes depend on matplotlib's build)."""
    import shutil
    for spec in (REPO / "studies").glob("*/study.yaml"):  # the same layout, so relative links read the same
        shutil.copytree(spec.parent, tmp_path / "studies" / spec.parent.name)
    out, committed = tmp_path / "docs" / "results", REPO / "docs" / "results"
    assert results_pages.main(["--studies", str(tmp_path / "studies"), "--out", str(out)]) == 0
    assert {p.name for p in out.glob("*.md")} == {p.name for p in committed.glob("*.md")} - set(OTHER_GENERATORS)
    for page in out.glob("*.md"):
        assert page.read_text() == (committed / page.name).read_text(), f"run `make docs-results`: {page.name}"
    assert {p.relative_to(out) for p in out.rglob("*.png")} == \
        {p.relative_to(committed) for p in committed.rglob("*.png")}


def test_collect_copies_finished_records_only(tmp_path):
    runs = tmp_path / "runs" / "default"
    done = perplexity(runs, "h2o", 0.2)
    (done / "partial").mkdir()
    (done / "partial" / "windows.jsonl").write_text("{}\n")
    run(runs, finished=False, experiment="default", model="smollm2-135m", task="austen_ppl")
    dest = tmp_path / "studies" / "default" / "records"
    assert results_pages.collect(runs, dest) == 1
    copied = dest / done.relative_to(runs)
    assert sorted(p.name for p in copied.iterdir()) == ["config.yaml", "metrics.json", "samples.jsonl"]
    assert load_runs(dest)["ppl"].tolist() == load_runs(runs)["ppl"].tolist()
    assert results_pages.main(["--collect", str(tmp_path / "nope"), str(dest)]) == 2


# ---- the leaderboard (analysis.leaderboard, `make leaderboard`, a section of `make docs-results`)

def test_the_committed_leaderboard_is_what_the_records_give_byte_for_byte(tmp_path):
    """docs/results/leaderboard.md and every figure of docs/results/leaderboard/ are rebuilt from the committed study
    records alone, to the byte (figures: fixed metadata, the pinned matplotlib)."""
    import shutil

    from analysis import leaderboard

    for spec in (REPO / "studies").glob("*/study.yaml"):
        shutil.copytree(spec.parent, tmp_path / "studies" / spec.parent.name)
    out, committed = tmp_path / "docs" / "results", REPO / "docs" / "results"
    assert leaderboard.main(["--studies", str(tmp_path / "studies"), "--out", str(out)]) == 0
    assert (out / "leaderboard.md").read_text() == (committed / "leaderboard.md").read_text(), \
        "run `make leaderboard`"
    made = sorted(p.name for p in (out / "leaderboard").iterdir())
    assert made == sorted(p.name for p in (committed / "leaderboard").iterdir())
    assert made == sorted(["leaderboard.png", *(f"{f.key}.png" for f in leaderboard.FAMILIES)])
    for name in made:
        assert (out / "leaderboard" / name).read_bytes() == (committed / "leaderboard" / name).read_bytes(), name


def test_the_leaderboard_says_which_family_has_no_records(tmp_path):
    from analysis import leaderboard

    root = tmp_path / "studies" / "ruler" / "records"
    for policy, budget, acc in (("full", 1.0, 0.9), ("h2o", 0.2, 0.4), ("local", 0.2, 0.5)):
        run(root, samples=[{"doc_id": i, "acc": float(i < acc * 10)} for i in range(10)], experiment="ruler",
            model="smollm2-135m", task="ruler_niah_single_1", task_kind="retrieval", policy=policy, budget=budget,
            shots=0, semantics="real", seed=0, n_samples=10, headline="acc", metrics={"acc": acc})
    out = tmp_path / "docs"
    assert leaderboard.main(["--studies", str(tmp_path / "studies"), "--out", str(out)]) == 0
    page = (out / "leaderboard.md").read_text()
    assert page.startswith(leaderboard.HEADER)
    assert "No records committed yet under `studies/methods/`." in page
    lo, hi = wilson(0.4, 10)
    assert f"| RULER | H2O | every step | {0.4:.2f} [{lo:.2f}, {hi:.2f}] | — |" in page
    assert f"| RULER | full | — | — | {0.9:.2f} [{wilson(0.9, 10)[0]:.2f}, {wilson(0.9, 10)[1]:.2f}] |" in page
    assert sorted(p.name for p in (out / "leaderboard").iterdir()) == ["leaderboard.png", "ruler.png"]


def test_one_method_vocabulary():
    """Every method has one label, one colour and one marker, used by every page and figure of analysis/: no two
    methods share both colour and marker, and no module keeps a vocabulary of its own."""
    from analysis import labels, long_generation, many_questions, methods

    pairs = [(c, m) for _, c, m in labels.METHODS.values()]
    assert len(set(pairs)) == len(pairs)
    assert labels.label("knorm") == "KNorm" and labels.label("r_kv") == "R-KV" and labels.label("h2o") == "H2O"
    assert set(labels.POLICIES) <= set(labels.METHODS)
    for module in (long_generation, many_questions, methods):
        assert not isinstance(getattr(module, "LABELS", None), dict) and module.label is labels.label


def test_every_figure_takes_its_colours_from_the_one_vocabulary():
    """No module of analysis/ but labels.py spells a colour: a method's is labels.color, full's line too (no "k" or
    "black"); the streaming study's lines are their methods' (colour, marker), a variant of a method (other
    settings) the same colour and marker in another line style, labelled by the method's label."""
    import re

    from analysis import labels, streaming_study as ss

    for path in sorted((REPO / "analysis").glob("*.py")):
        if path.name == "labels.py":
            continue
        text = path.read_text()
        assert not re.findall(r"['\"]#[0-9a-fA-F]{6}['\"]", text), f"{path.name}: a colour outside analysis.labels"
        black = len(re.findall(r"color=['\"](?:k|black)['\"]", text))
        assert black == (1 if path.name == "figures.py" else 0), path.name  # figures.py: Fig. 2's 95% line
    look = ss.styles(["streaming_llm", "h2o_heavy_share1-2", "h2o", "h2o:heavy_share=1/12", "local"])
    for run, method in (("h2o", "h2o"), ("h2o_heavy_share1-2", "h2o"), ("h2o:heavy_share=1/12", "h2o"),
                        ("streaming_llm", "streaming_llm"), ("local", "local")):
        assert ss.method_of(run) == method
        assert (look[run]["color"], look[run]["marker"]) == (labels.color(method), labels.marker(method)), run
    assert look["h2o"]["ls"] == "-" and {look["h2o_heavy_share1-2"]["ls"], look["h2o:heavy_share=1/12"]["ls"]} == {
        "--", ":"}
    assert look["h2o"]["label"] == "H2O" and look["h2o_heavy_share1-2"]["label"] == "H2O (heavy_share1-2)"
    assert ss.method_of("h2o_reference") == "h2o_reference" and ss.method_of("nope_1") == "nope_1"
