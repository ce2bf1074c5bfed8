"""Each paper experiment (conf/experiment/) lists the paper's grid: `python -m h2o.pipeline.sweep experiment=<e>`.

The grids are written out here from the paper (tables' rows and columns, figures' axes) and compared with what the
sweep expands to: every (model, task, shots, policy, budget) the paper prints is a job, and nothing else but the
cells a cartesian sweep must add (Table 1's local/H2O at 0 and 1 shots). Full is one run across budgets.
"""
from __future__ import annotations

from itertools import product
from pathlib import Path

import pytest

from h2o.pipeline.sweep import expand, status
from run_folders import check_folders  # tests/run_folders.py

REPO = Path(__file__).resolve().parents[1]

LM_EVAL6 = ["copa", "mathqa", "openbookqa", "piqa", "rte", "winogrande"]
PAPER4 = ["copa", "openbookqa", "piqa", "winogrande"]  # Tables 1, 2, 8
MODELS7 = ["opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "llama-7b", "llama-13b", "gpt-neox-20b"]
BUDGETS7 = [0.04, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0]
HELM_BUDGETS = [0.04, 0.1, 0.2, 0.6]

# experiment -> (models, tasks, shots, policies, budgets, jobs, distinct runs, cells the paper prints)
GRIDS = {
    "table1": (["llama-7b"], PAPER4, [0, 1, 5], ["full", "local", "h2o"], [0.2], 36, 36, 20),
    "table2": (["opt-30b"], PAPER4, [5], ["full", "local", "h2o", "strided", "strided_h2", "fixed", "fixed_h2"],
               [0.2], 28, 28, 28),
    "table8": (["opt-30b"], PAPER4, [5], ["full", "topk", "topk_h2"], [0.2], 12, 12, 12),
    "table9": (["opt-13b", "opt-30b"], ["mathqa", "openbookqa", "piqa", "winogrande"], [5],
               ["full", "local", "h2_only", "h2o"], [0.2], 32, 32, 32),
    "table10": (["opt-30b", "opt-66b"], ["openbookqa", "copa", "mathqa"], [5, 10], ["full", "local", "h2o"], [0.2],
                36, 36, 36),
    "fig4": (MODELS7, LM_EVAL6, [5], ["full", "local", "h2o"], BUDGETS7, 882, 630, None),
    "fig8": (["opt-30b"], LM_EVAL6, [0, 1], ["full", "local", "h2o"], BUDGETS7, 252, 180, None),
    "fig9": (["llama-7b"], ["xsum", "cnn_dm"], [0], ["full", "streaming_llm", "h2o"], HELM_BUDGETS, 24, 18, None),
    "helm": (MODELS7, ["xsum", "cnn_dm"], [0, 5], ["full", "local", "h2o"], HELM_BUDGETS, 336, 252, None),
}


def cell(model, task, shots, policy, budget):
    return model, task, shots, policy, 1.0 if policy == "full" else budget


@pytest.mark.parametrize("exp", sorted(GRIDS))
def test_experiment_lists_the_papers_grid(exp):
    models, tasks, shots, policies, budgets, n_jobs, n_runs, n_paper = GRIDS[exp]
    sweep = expand([f"experiment={exp}"], multirun=True)
    check_folders(exp, sweep)  # every job in the folder its record has been written to
    listed = [cell(p.model.name, p.task.name, p.task.shots, p.policy.name, p.policy.budget) for p in sweep.specs]
    expected = {cell(*c) for c in product(models, tasks, shots, policies, budgets)}
    assert set(listed) == expected
    assert len(listed) == n_jobs and status(sweep).count("dup") == n_jobs - n_runs
    assert len({p.path for p in sweep.specs}) == n_runs == len(expected)
    assert all(p.cfg.experiment_name == exp and p.path.parts[-6] == exp for p in sweep.specs)
    mc = [p for p in sweep.specs if p.task.kind == "multiple_choice"]
    assert all(p.task.scoring == "mean" and p.task.add_bos_token is False for p in mc)  # the paper code's protocol
    if exp == "table1":  # the paper's 20 cells: full at 0/1/5 shots, local and H2O at 20% with 5 shots
        paper = {cell("llama-7b", t, s, "full", 0.2) for t in tasks for s in (0, 1, 5)} | \
                {cell("llama-7b", t, 5, p, 0.2) for t in tasks for p in ("local", "h2o")}
        assert len(paper) == n_paper and paper <= set(listed)
    elif n_paper is not None:
        assert len(expected) == n_paper


def test_the_defaults_third_finding_is_three_long_generation_runs_full_first():
    """`make sweep`'s default then runs long generation (conf/experiment/default_long_generation.yaml, the
    default's companion in the Makefile): one sweep, full's run first (the reference answer), then h2o and r_kv at a
    64-token cache cut every 32 tokens, 4 passages of 256 new tokens, all recorded under the default's folder; full
    takes no schedule (null: its record's folder). The paper-era jobs of experiment=default are untouched (below)."""
    sweep = expand(["experiment=default_long_generation"], multirun=True)
    assert [(p.policy.name, p.cfg.policy.budget, p.cfg.policy.compress, p.cfg.policy.interval)
            for p in sweep.specs] == [("full", 64, None, None), ("h2o", 64, "interval", 32),
                                      ("r_kv", 64, "interval", 32)]
    assert not sweep.refused and len(sweep.outside) == 9
    for p in sweep.specs:
        assert (p.task.name, p.task.prompts, p.task.max_new_tokens, p.task.passage_tokens) == (
            "long_generation", 4, 256, 128)
        assert p.cfg.experiment_name == "default" and "/default/smollm2-135m/long_generation/" in str(p.path)
    assert not str(sweep.specs[0].path).endswith(("compress=decode", "interval=32"))
    make = (REPO / "Makefile").read_text()
    assert "\nALSO_default = default_long_generation\n" in make and "THEN_" not in make


def test_default_spends_its_time_on_one_budget():
    """The CPU default: 4 policies at 20% on the needle task (1,024 tokens x 5 depths x 4 samples) and 16 Austen
    windows, 8 runs; the Austen runs keep their folders (records of earlier defaults stay readable)."""
    sweep = expand(["experiment=default"], multirun=True)
    assert len({p.path for p in sweep.specs}) == len(sweep.specs) == 8
    assert {p.policy.name for p in sweep.specs} == {"full", "local", "streaming_llm", "h2o"}
    assert {p.policy.budget for p in sweep.specs if p.policy.name != "full"} == {0.2}
    sizes = {p.task.name: (p.task.shots, getattr(p.task, "n_windows", None), getattr(p.task, "lengths", None),
                           len(getattr(p.task, "depths", [])) * getattr(p.task, "samples", 0)) for p in sweep.specs}
    assert sizes == {"niah": (0, None, [1024], 20), "austen_ppl": (0, 16, None, 0)}
    ppl = sorted(str(p.path).split("/default/", 1)[1] for p in sweep.specs if p.task.name == "austen_ppl")
    assert ppl == [f"smollm2-135m/austen_ppl/shots0/{name}/{b}" for name, b in
                   [("full", "1.0"), ("h2o", "0.2"), ("local", "0.2"), ("streaming_llm", "0.2")]]
