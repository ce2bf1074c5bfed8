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
