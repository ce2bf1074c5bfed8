"""A record's fields: the run's own fields are never overwritten by a policy option, a task names its headline
metric, and every task turns cache footprints into record fields through one function (h2o.tasks.kv_held)."""
from __future__ import annotations

import pytest

from h2o.assets.paths import CONF
from h2o.pipeline.spec import prepare
from h2o.pipeline.sweep import _compose

TINY = ["model=tiny-llama", "task=bb_copa", "task.limit=2", "task.shots=0"]


@pytest.fixture(scope="module")
def hydra_ctx():
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def test_a_policy_option_never_overwrites_a_run_field(hydra_ctx):
    head = prepare(_compose([*TINY, "policy=random", "policy.seed=3", "seed=0"])).head()
    assert head["seed"] == 0 and head["policy_options"]["seed"] == 3  # the run's seed, the policy's in its options
    assert (head["policy"], head["budget"]) == ("random", 0.2)
    same = prepare(_compose([*TINY, "policy=random", "policy.seed=5", "seed=5"])).head()
    assert same["seed"] == 5 and same["policy_options"]["seed"] == 5


def test_a_policys_other_options_stay_top_level_fields_in_their_place(hydra_ctx):
    head = prepare(_compose([*TINY, "policy=snapkv", "policy.compress=prefill"])).head()
    keys = list(head)
    assert keys[:14] == ["experiment", "model", "task", "task_kind", "policy", "budget", "heavy", "recent", "shots",
                         "semantics", "seed", "evicts", "limit", "policy_options"]
    assert keys[14:] == ["compress", "window", "kernel"] and head["compress"] == "prefill"


@pytest.fixture(scope="module")
def tiny_lm():
    from h2o.assets.model_spec import ModelSpec

    return ModelSpec("tiny-llama", "tiny:llama").load()


def test_a_longbench_record_names_score_its_headline_and_analysis_draws_it(tiny_lm, monkeypatch):
    """LongContextTask.run on a LongBench task, lm-eval's evaluation replaced by two scored samples (the data set is
    on the hub): its record names ``score`` as its headline, which analysis.figures.headline_metric picks."""
    import lm_eval
    import lm_eval.tasks
    import pandas as pd
    from omegaconf import OmegaConf

    from analysis.figures import headline_metric
    from h2o.core.policies import make_policy
    from h2o.pipeline.spec import build

    task = build("task", OmegaConf.load(CONF / "task" / "longbench.yaml"))
    scored = [{"doc_id": i, "doc": {"answers": ["x"]}, "filtered_resps": ["y"], "score": s}
              for i, s in enumerate((0.25, 0.75))]
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: None)
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: {"samples": {task.lm_eval_task: scored}})
    result = task.run(*tiny_lm, make_policy("h2o", budget=0.2), "real", 0)
    assert result.metrics["score"] == 0.5 and result.info["headline"] == "score"
    runs = pd.DataFrame([{"task_kind": "retrieval", "headline": result.info["headline"], "acc": 0.3,
                          "score": result.metrics["score"]}])  # a column of another task's metric beside it
    assert headline_metric(runs) == "score"
    assert headline_metric(runs.assign(headline=None)) == "acc"  # unnamed: the kind's first metric
