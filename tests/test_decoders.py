"""The policies' forms for decoding steps (Policy.decoder) decide as their definitions, on random states with ties.

* strided_h2 / fixed_h2: the protected set kept as state (h2o.core.policies.protected) against WithHeavy.priority's
  ranking of the whole cache: two evicting layers, one per form, fed the same random states (integer scores: many
  ties), padded batches with different budgets, a prefill chunk mid-way, tiny budgets.
* topk / topk_h2: the selection without a sort (policies.topk.top_mask) against restrict's ranks."""
import itertools

import pytest
import torch

from h2o import make_policy
from h2o.core.policies.base import Decoder, Policy
from h2o.core.policies.combine import WithHeavy
from h2o.core.policies.protected import Protected
from h2o.core.policies.topk import top_mask, top_rank
from tests.held_steps import held_after_each_step


CASES = [  # (budget options, prompts)
    ({"budget": 0.3}, [40, 40]),
    ({"budget": 0.3}, [40, 31, 22]),
    ({"budget": 12, "heavy_share": 0.5}, [30, 17]),
    ({"heavy": 5, "recent": 9}, [33]),
    ({"heavy": 2, "recent": 1}, [10, 6]),
    ({"heavy": 0, "recent": 4}, [12]),
    ({"heavy": 1, "recent": 2}, [3]),
    ({"budget": 0.5}, [24, 9]),
]


@pytest.mark.parametrize("name,score", list(itertools.product(["strided_h2", "fixed_h2"], ["sum", "mean", "decay"])))
def test_kept_state_decides_as_the_ranking(monkeypatch, name, score):
    for i, (opts, prompts) in enumerate(CASES):
        policy = make_policy(name, score=score, decay=0.5, **opts)
        made = []
        original = WithHeavy.decoder
        monkeypatch.setattr(type(policy), "decoder", lambda self, c, h: made.append(original(self, c, h)) or made[-1])
        fast = held_after_each_step(policy, prompts, 40, 17, i)[0]
        monkeypatch.setattr(type(policy), "decoder", Policy.decoder)  # the reference: priority as it is
        slow = held_after_each_step(policy, prompts, 40, 17, i)[0]
        assert all(torch.equal(a, b) for a, b in zip(fast, slow)), (name, score, opts, prompts)
        if policy.base is not None:
            assert made and all(isinstance(d, Protected) for d in made)
        else:
            assert all(type(d) is Decoder for d in made)


def test_top_mask_is_the_rank_below_n():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        S = int(torch.randint(1, 30, (), generator=g))
        score = torch.randint(-3, 4, (2, 3, S), generator=g).float()  # integers: ties everywhere
        score[0, 0, :: 4] = float("inf")  # heavy hitters rank first in topk_h2
        allowed = torch.rand(2, 3, S, generator=g) < 0.7 if trial % 2 else None
        for n in range(S + 3):
            ref = top_rank(score, torch.ones((), dtype=torch.bool) if allowed is None else allowed) < n
            ref = ref if allowed is None else ref & allowed
            assert torch.equal(top_mask(score, allowed, n), ref), (trial, n)


@pytest.mark.parametrize("name", ["topk", "topk_h2"])
def test_select_is_restrict(name):
    g = torch.Generator().manual_seed(1)
    for heavy, recent in [(3, 4), (0, 5), (6, 0), (2, 30)]:
        policy = make_policy(name, heavy=heavy, recent=recent)
        counts = policy.counts(torch.tensor([20, 20]))
        for trial in range(10):
            S = int(torch.randint(1, 40, (), generator=g))
            logits = torch.randint(-2, 3, (2, 2, 3, 1, S), generator=g).float()  # (B, Hkv, G, q, S)
            acc = torch.randint(0, 3, (2, 2, 1, 1, S), generator=g).float()
            allowed = torch.rand(2, 2, 1, 1, S, generator=g) < 0.8
            for mask in (allowed, None):
                ref = policy.restrict(logits, acc, torch.ones((), dtype=torch.bool) if mask is None else mask, counts)
                got = policy.select(logits, acc, mask, heavy + recent, heavy)
                assert torch.equal(got, ref), (name, heavy, recent, trial, mask is None)
