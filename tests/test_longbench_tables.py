"""A LongBench record's metric is ``score`` (lm-eval's per-sample score, h2o.tasks.long_context): its table cell has
the record's value and its 95% interval (value +- 1.96 stderr, clipped to [0, 1]) whatever the policy, including
H2O, whose record also carries ``score: sum`` (its option) at the top level; a RULER task in the same experiment keeps
its ``acc`` table."""
import json
import math

import pytest

from analysis.estimate import Z95, wilson
from analysis.protocol import annotate, protocol_of
from analysis.records import load_runs
from analysis.tables import experiment_tables

SCORES = {("full", 1.0): (0.412, 0.031), ("h2o", 0.2): (0.288, 0.029), ("local", 0.2): (0.02, 0.015)}
N = 200


def record(root, policy, budget, metrics, task="longbench_qasper", lm_eval_task=None, n=N):
    """A metrics.json as the runner writes a long-context run (h2o.pipeline.job: spec.head(), then the task's)."""
    options = {"budget": budget, "heavy": None, "recent": None, "heavy_share": 0.5}
    head = {"policy": policy, "budget": budget, "heavy": None, "recent": None}
    if policy == "h2o":  # its describe() extras at the top level, its options in policy_options
        options.update(score="sum", decay=0.99)
        head.update(heavy=budget / 2, recent=budget / 2, score="sum")
    elif policy == "full":
        options = {}
    rec = {"experiment": "longbench_cluster", "model": "llama-3-8b", "task": task, "task_kind": "retrieval",
           **head, "shots": 0, "semantics": "real", "seed": 0, "evicts": policy != "full", "limit": None,
           "policy_options": options, "scoring": None, "add_bos_token": None,
           "protocol": {"lm_eval_task": lm_eval_task or task, "lengths": [8192], "limit": None, "max_gen_toks": None,
                        "clip_to_model": True, "add_bos_token": True, "scoring": None},
           "n_samples": n, "metrics": metrics, "lm_eval_task": lm_eval_task or task,
           "cells": [{"length": 8192, "n": n, **metrics}]}
    folder = root / task / policy / str(budget)
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps(rec))
    return folder


@pytest.fixture
def runs(tmp_path):
    for (policy, budget), (value, se) in SCORES.items():
        record(tmp_path, policy, budget, {"score": value, "score_stderr": se})
    return tmp_path


def cell(table, policy: str, budget: str) -> str:
    col = table.header.index(budget)
    return next(r[col] for r in table.rows if r[table.header.index("policy")] == policy)


def test_longbench_cells_show_the_score_and_its_interval(runs):
    tables = {t.name: t for t in experiment_tables(load_runs(runs))}
    table = tables["longbench_cluster_retrieval"]
    assert "metric: score [95% interval]" in table.caption
    for (policy, budget), (value, se) in SCORES.items():
        lo, hi = max(0.0, value - Z95 * se), min(1.0, value + Z95 * se)  # clipped: local's low end is 0
        label = {"h2o": "H2O"}.get(policy, policy)
        assert cell(table, label, f"{budget:g}") == f"{value:.3f} [{lo:.3f}, {hi:.3f}]"
    assert cell(table, "local", "0.2").startswith("0.020 [0.000, ")


def test_the_policys_score_option_stays_its_protocol(runs):
    """H2O's ``score: sum`` moves to ``option_score``; the protocol still reads it from policy_options."""
    df = load_runs(runs)
    h2o = df[df["policy"] == "h2o"].iloc[0]
    assert h2o["score"] == pytest.approx(0.288) and h2o["option_score"] == "sum"
    assert protocol_of(h2o)["policy.score"] == "sum"
    assert annotate(df)["score"].astype(float).tolist() == pytest.approx(
        [SCORES[(r.policy, r.budget)][0] for r in df.itertuples()])


def test_a_ruler_task_beside_longbench_keeps_its_acc_table(runs):
    for policy, budget, acc in (("full", 1.0, 0.9), ("h2o", 0.2, 0.1)):
        record(runs, policy, budget, {"acc": acc, "acc_stderr": math.sqrt(acc * (1 - acc) / 9)},
               task="ruler_niah_single_1", lm_eval_task="niah_single_1", n=10)
    tables = {t.name: t for t in experiment_tables(load_runs(runs))}
    assert set(tables) == {"longbench_cluster_retrieval_acc", "longbench_cluster_retrieval_score"}
    acc, score = tables["longbench_cluster_retrieval_acc"], tables["longbench_cluster_retrieval_score"]
    assert {r[1] for r in acc.rows} == {"ruler_niah_single_1"} and {r[1] for r in score.rows} == {"longbench_qasper"}
    lo, hi = wilson(0.1, 10)  # an accuracy of 10 questions: the Wilson interval
    assert cell(acc, "H2O", "0.2") == f"0.100 [{lo:.3f}, {hi:.3f}]"
    assert cell(score, "H2O", "0.2") == "0.288 [0.231, 0.345]"
