"""Extending the engine touches nothing else: a toy rule that reads the held keys at every decoding step and a toy
schedule (a cut every 4 generated tokens) are each one class, written here, found by name (``make_policy``,
``compress=``), and run in both paths equal on every tiny architecture (a sliding-window one included, GQA among
them), on a left-padded batch, and under a quantized cache. The toy schedule is ``interval=4`` under another name:
the same logits."""
import pytest
import torch

from h2o import make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core.policies import Policy
from h2o.core.policies.base import READ_KEYS, TIER, recent_window
from h2o.core.schedule import Schedule
from tests.test_interval import P, both_paths
from tests.two_paths import quantized_paths_agree

ARCHS = (*TINY_ARCHS, "mistral")


@pytest.fixture(scope="module", autouse=True)
def toys():
    """The toy rule and schedule, registered by their classes and removed after this module."""

    class HeldKeys(Policy):
        """A recent window, and of the older held tokens those whose key (after RoPE) has the largest norm: the rule
        reads the held keys at every step (``Policy.cut_score``, which ``step_score`` calls)."""

        name = "toy_held_keys"
        reads = frozenset({READ_KEYS})

        def cut_score(self, acc, keys, held):
            return keys.float().norm(dim=-1)  # (B, H, S)

        def priority(self, pos, acc, now, counts):
            return recent_window(pos, now, counts.recent).double() * TIER + acc.double()

    class EveryFour(Schedule):
        """Cut back to the budget after every 4th generated token."""

        name = "toy_every4"

        def cuts_after(self, generated):
            return (generated > 0) & (generated % 4 == 0)

    yield
    del Policy.registry["toy_held_keys"], Schedule.registry["toy_every4"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


@pytest.mark.parametrize("compress", ["decode", "toy_every4"])
def test_the_toy_rule_runs_in_both_paths(model, compress):
    policy = make_policy("toy_held_keys", budget=0.3, compress=compress)
    assert policy.reads_keys and not policy.needs_scores
    sim, full, cache = both_paths(model, policy)  # asserts the paths agree on the real rows
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)


def test_the_toy_schedule_runs_in_both_paths_and_is_interval_4(model):
    toy = make_policy("h2o", budget=0.3, compress="toy_every4")
    assert toy.describe()["compress"] == "toy_every4"
    sim, full, cache = both_paths(model, toy)
    every4, _, _ = both_paths(model, make_policy("h2o", budget=0.3, compress="interval", interval=4))
    assert torch.equal(sim, every4)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)


@pytest.mark.parametrize("name, compress", [("toy_held_keys", "decode"), ("h2o", "toy_every4")])
def test_the_toys_under_a_quantized_cache(name, compress):
    from h2o.core.quant import Uniform

    model, quant = tiny_model("llama_gqa"), Uniform(4, 8)
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:40][None]
    policy = make_policy(name, budget=0.2, compress=compress)
    quantized_paths_agree(model, policy, x, quant)
