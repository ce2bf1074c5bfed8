"""No two methods are silently the same: the audit KVDiagnosis found a published PyramidKV that kept exactly SnapKV's
tokens. Every registered method runs at one budget on one context, in each path it has (the evicting cache token by
token, the simulated mask in one pass). Two methods keep the same tokens at every layer, head and step exactly when
they give the same logits at every position: on a random tiny model any different kept set changes them. So the
check is on logits, and fails for every pair that the docs call different but that comes out equal.

Equal by definition, documented here and in docs/policies.md: at a prompt no longer than SnapKV's observation window
(64 tokens), the whole prompt is window and SnapKV keeps its newest tokens, so ``snapkv``, ``pyramidkv`` (SnapKV's
score under a pyramid of layer budgets that a window-long prompt flattens) and ``adakv`` (its inner rule is snapkv)
keep the same tokens (``test_a_prompt_within_the_window_makes_the_snapkv_family_one``). Past the window they differ.
So does ``g_kv`` there: half of 24 tokens is within its window of 16, which it keeps whole (the newest), and its
next cut (every 128 generated tokens) does not come in the 24 decoded.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.model_spec import ModelSpec
from h2o.core.policies import Policy
from h2o.core.policies.base import PolicyError
from tests.calibrated import ready

BUDGET, NEW = 0.5, 24
SNAPKV_FAMILY = frozenset({"snapkv", "pyramidkv", "adakv"})
NEWEST_AT_24 = SNAPKV_FAMILY | {"g_kv"}  # the methods keeping the newest tokens of a 24-token prompt at 50%


@pytest.fixture(scope="module")
def tiny():
    return ModelSpec("tiny-llama", "tiny:llama").load()  # a random LLaMA with a tokenizer folder (kvzip replays)


def runs(model, prompt: int, mode: str) -> dict[str, torch.Tensor]:
    """Each method (not full) at BUDGET on one context of ``prompt`` + NEW random ids -> its logits (1, T, V) in
    ``mode``; a method without that path is left out (h2o_reference has no evicting form)."""
    x = torch.randint(1, 128, (1, prompt + NEW), generator=torch.Generator().manual_seed(11))
    out = {}
    for name in sorted(set(Policy.registry) - {"full"}):
        policy = ready(make_policy(name, budget=BUDGET), model)  # triattention: calibrated over the model
        try:
            with torch.no_grad(), attach(model, policy, mode=mode, prompt_len=prompt) as h:
                if mode == "simulated":
                    out[name] = model(x).logits
                    continue
                cache = h.new_cache()
                steps = [model(x[:, :prompt], cache=cache).logits]
                steps += [model(x[:, t:t + 1], cache=cache).logits for t in range(prompt, x.shape[1])]
                out[name] = torch.cat(steps, 1)
        except PolicyError as exc:
            assert f"mode={mode}" in str(exc) or "allowed: mode=" in str(exc), exc  # only a path it lacks
    return out


def equal_pairs(logits: dict[str, torch.Tensor]) -> set[frozenset]:
    return {frozenset(p) for p in itertools.combinations(logits, 2)
            if torch.allclose(logits[p[0]], logits[p[1]], atol=1e-6, rtol=0)}


@pytest.mark.parametrize("mode", ["real", "simulated"])
def test_every_pair_of_methods_keeps_different_tokens(tiny, mode):
    model, _ = tiny
    logits = runs(model, prompt=200, mode=mode)
    assert len(logits) >= len(Policy.registry) - 3  # every method in its paths (full, and one per path, aside)
    assert equal_pairs(logits) == set()
    with torch.no_grad():
        full = model(torch.randint(1, 128, (1, 200 + NEW), generator=torch.Generator().manual_seed(11))).logits
    assert not [n for n, v in logits.items() if torch.allclose(v, full, atol=1e-6, rtol=0)]  # each one evicts


def test_a_prompt_within_the_window_makes_the_snapkv_family_one(tiny):
    """The check finds equal methods where they are equal by definition (and only those)."""
    model, _ = tiny
    pairs = equal_pairs(runs(model, prompt=24, mode="real"))
    assert pairs == {frozenset(p) for p in itertools.combinations(NEWEST_AT_24, 2)}
