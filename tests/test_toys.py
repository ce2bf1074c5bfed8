"""Extending the engine touches nothing else: toy rules and toy schedules, each one class written here, found by name
(``make_policy``, ``compress=``), run in both paths equal on every tiny architecture (a sliding-window one
included, GQA among them), on a left-padded batch, and under a quantized cache:

* a rule that reads the held keys at every decoding step (``toy_held_keys``) and one that reads the rows' logits
  (``toy_newest_logit``: R-KV's input, ``READ_LOGITS``);
* a schedule that cuts every 4 generated tokens (``toy_every4``: ``interval=4`` under another name, the same logits)
  and one that cuts on a condition of the cache, once it holds the budget + 3 (``toy_past_budget``: the harness's
  ``compress=buffer interval=3``, TriAttention's slack trigger), which on a batch whose prompts fill the budget
  unevenly cuts its sequences at different steps."""
import pytest
import torch

from h2o import make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core.policies import Policy
from h2o.core.policies.base import READ_KEYS, READ_LOGITS, READ_WINDOW, TIER, recent_window
from h2o.core.policies.snapkv import push_rows
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

    class NewestLogit(Policy):
        """A recent window, and of the older held tokens those the newest query row gave the largest logit (the
        maximum over a KV head's query heads): the rule reads the rows' logits (``READ_LOGITS``), its state a ring
        of one row per slot."""

        name = "toy_newest_logit"
        reads = frozenset({READ_WINDOW, READ_LOGITS})

        def read_window(self):
            return 1

        def new_state(self, B, H, S, device):
            return torch.zeros(B, H, S, 1, device=device)  # (B, H, S, 1)

        def accumulate(self, acc, probs, valid=None):
            push_rows(acc, probs.float().amax(2).transpose(-1, -2), valid)  # probs: the logits (B, H, G, r, S)

        def accumulate_prompt(self, acc, probs, valid, left):
            self.accumulate(acc, probs, valid)

        def priority(self, pos, acc, now, counts):
            return recent_window(pos, now, counts.recent).double() * TIER + acc[..., 0].double()

    class EveryFour(Schedule):
        """Cut back to the budget after every 4th generated token."""

        name = "toy_every4"

        def cuts_after(self, generated, room=0):
            return (generated > 0) & (generated % 4 == 0)

    class PastBudget(Schedule):
        """Cut back to the budget once the cache holds the budget + 3 (the prompt's cut left ``room`` below it)."""

        name = "toy_past_budget"

        def cuts_after(self, generated, room=0):
            return (generated - room > 0) & ((generated - room) % 3 == 0)

    yield
    for name in ("toy_held_keys", "toy_newest_logit"):
        del Policy.registry[name]
    del Schedule.registry["toy_every4"], Schedule.registry["toy_past_budget"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


@pytest.mark.parametrize("compress", ["decode", "toy_every4", "toy_past_budget"])
def test_the_toy_rule_runs_in_both_paths(model, compress):
    policy = make_policy("toy_held_keys", budget=0.3, compress=compress)
    assert policy.reads_keys and not policy.needs_scores
    sim, full, cache = both_paths(model, policy)  # asserts the paths agree on the real rows
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)


@pytest.mark.parametrize("compress", ["decode", "toy_every4", "toy_past_budget"])
def test_the_toy_logit_rule_runs_in_both_paths(model, compress):
    policy = make_policy("toy_newest_logit", budget=0.3, compress=compress)
    assert policy.reads_logits and policy.needs_scores and not policy.reads_keys
    sim, full, cache = both_paths(model, policy)  # asserts the paths agree on the real rows
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)
    keys = make_policy("toy_held_keys", budget=0.3, compress=compress)
    assert not torch.allclose(sim[:, P:], both_paths(model, keys)[0][:, P:], atol=1e-3)  # the logits decide


def test_the_toy_schedule_runs_in_both_paths_and_is_interval_4(model):
    toy = make_policy("h2o", budget=0.3, compress="toy_every4")
    assert toy.describe()["compress"] == "toy_every4"
    sim, full, cache = both_paths(model, toy)
    every4, _, _ = both_paths(model, make_policy("h2o", budget=0.3, compress="interval", interval=4))
    assert torch.equal(sim, every4)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)


def test_the_condition_schedule_is_buffer_and_cuts_each_sequence_at_its_own_step(model):
    """A budget of 21 tokens: the first prompt (24 tokens) fills it, so its cache passes budget + 3 after 3, 6, 9
    and 12 generated tokens; the second (19 tokens) leaves 2 below it, so after 5, 8 and 11: one batch, cuts at
    different steps. Both paths agree (both_paths asserts it), equal the harness's ``compress=buffer``, and differ
    from ``interval=3``, which cuts both sequences at once."""
    toy = make_policy("h2o", budget=21, compress="toy_past_budget")
    assert [bool(toy.schedule.cuts_after(g, 2)) for g in range(1, 13)] == [g in (5, 8, 11) for g in range(1, 13)]
    sim, full, cache = both_paths(model, toy)
    buffer, _, cached = both_paths(model, make_policy("h2o", budget=21, compress="buffer", interval=3))
    assert torch.equal(sim, buffer)
    if model.config.model_type == "mistral":  # its window of 16 tokens holds less than the budget: nothing to cut
        return
    every3, _, _ = both_paths(model, make_policy("h2o", budget=21, compress="interval", interval=3))
    assert not torch.equal(sim[1, P:], every3[1, P:]) and torch.equal(sim[0], every3[0])
    assert cached.held_tokens()[:, :, 0].tolist() == [[21, 22]] * len(cached.layers)  # after 12: 21 (just cut), 22


@pytest.mark.parametrize("name, compress", [("toy_held_keys", "decode"), ("h2o", "toy_every4"),
                                            ("toy_newest_logit", "toy_past_budget")])
def test_the_toys_under_a_quantized_cache(name, compress):
    from h2o.core.quant import Uniform

    model, quant = tiny_model("llama_gqa"), Uniform(4, 8)
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:40][None]
    policy = make_policy(name, budget=0.2, compress=compress)
    quantized_paths_agree(model, policy, x, quant)
