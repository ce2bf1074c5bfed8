"""Positions inside the cache as a wrapper of any policy's layer: the evicting layer renumbering its own keys after
each forward (``EvictingCache(rerotate=)``) equals renumbering the whole cache from outside after each chunk
(:class:`CachePositions`, the form the key-rank tests check against freshly computed keys)."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.core.policies import REAL_POLICIES  # the policies with an evicting cache
from h2o.assets.models import tiny_model
from h2o.core.cache import EvictingCache
from h2o.core.policies import Policy, PolicyError
from h2o.core.rerotate import CachePositions, KeyShifter
from tests.calibrated import ready


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("name", [p for p in REAL_POLICIES if not Policy.registry[p].pooled])  # pooled: refused
@pytest.mark.parametrize("chunk", [1, 8])
def test_a_layer_renumbering_itself_equals_the_cache_renumbered_from_outside(model, name, chunk):
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(4))
    every = {"interval": 5} if Policy.registry[name].schedule.takes_interval else {}  # g_kv's
    policy = ready(make_policy(name, budget=1.0 if name == "full" else 12, **every), model)  # cuts inside 64 tokens
    n_layers = model.config.num_hidden_layers
    outs, caches = [], []
    for inside in (True, False):
        logits = []
        with torch.no_grad(), attach(model, policy, mode="real") as h:
            cache = h.cache = EvictingCache(policy, n_layers, 12, rerotate=KeyShifter(model) if inside else None)
            outside = None if inside else CachePositions(model, n_layers)
            for s in range(0, 64, chunk):
                n = cache.next_position() if inside else outside.n
                logits.append(model(ids[:, s:s + chunk], cache=cache,
                                    position_ids=torch.arange(n, n + chunk)[None]).logits)
                if outside is not None:
                    outside.after_chunk(cache, s)
        outs.append(torch.cat(logits, 1))
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    for a, b in zip(*(c.layers for c in caches)):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.keys, b.keys)
    held = int((caches[0].layers[0].pos[0, 0] >= 0).sum())
    keeps_all = name in ("full", "topk", "topk_h2") or policy.compress == "prefill"  # cut once, at the first chunk
    # token by token the first token is the prompt, then the schedule's cuts (decode: the budget); a chunk of 8 cuts
    expected = 64 if keeps_all else policy.schedule.held(12, 1, 64) if chunk == 1 else 12
    assert caches[0].next_position() == held == expected


def test_rerotation_refuses_a_quantized_cache(model):
    from h2o.core.quant import make_quant

    with pytest.raises(PolicyError, match="packed rows"):
        EvictingCache(make_policy("h2o", budget=8), 2, rerotate=KeyShifter(model), quant=make_quant("uniform"))
