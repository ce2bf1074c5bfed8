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
