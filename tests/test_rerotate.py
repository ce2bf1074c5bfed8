"""Positions inside the cache as a wrapper of any policy's layer (``EvictingCache(rerotate=)``): after each forward
the layer renumbers the keys it holds, so each one is its token's key at its rank among the held tokens."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.core.policies import REAL_POLICIES  # the policies with an evicting cache
from h2o.assets.models import tiny_model
from h2o.core.cache import EvictingCache
from h2o.core.policies import Policy, PolicyError
from h2o.core.rerotate import KeyShifter
from tests.calibrated import ready


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def fresh_keys(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys (1, Hkv, S, D) of the tokens at positions ``pos`` (1, Hkv, S) of ``ids`` (1, T), computed
    fresh at their ranks among the held ones (layer 0's keys depend on the token and its position alone)."""
    attn, base = model.model.layers[0].self_attn, model.model
    hid = base.layers[0].input_layernorm(base.embed_tokens(ids[0, pos[0].clamp(min=0)]))  # (Hkv, S, hidden)
    hkv, S = pos.shape[1:]
    D = attn.k_proj.out_features // hkv
    k = attn.k_proj(hid).view(1, hkv, S, hkv, D)  # (1, head h, slot, head h', D): take h == h'
    k = torch.stack([k[:, i, :, i] for i in range(hkv)], 1)  # (1, Hkv, S, D)
    rank = torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max).argsort(-1).argsort(-1)
    cos, sin = model.model.rotary_emb(k, rank.reshape(1, -1))
    cos, sin = cos.view(1, hkv, S, D), sin.view(1, hkv, S, D)
    return k * cos + torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin


@pytest.mark.parametrize("name", [p for p in REAL_POLICIES if not Policy.registry[p].pooled])  # pooled: refused
@pytest.mark.parametrize("chunk", [1, 8])
def test_a_layer_renumbering_itself_holds_each_key_at_its_rank(model, name, chunk):
    ids = torch.randint(3, 200, (1, 64), generator=torch.Generator().manual_seed(4))
    every = {"interval": 5} if Policy.registry[name].schedule.takes_interval else {}  # g_kv's
    policy = ready(make_policy(name, budget=1.0 if name == "full" else 12, **every), model)  # cuts inside 64 tokens
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.cache = EvictingCache(policy, model.config.num_hidden_layers, 12, rerotate=KeyShifter(model))
        for s in range(0, 64, chunk):
            n = cache.next_position()
            model(ids[:, s:s + chunk], cache=cache, position_ids=torch.arange(n, n + chunk)[None])
        layer = cache.layers[0]
        held = layer.pos >= 0
        torch.testing.assert_close(layer.keys[held], fresh_keys(model, ids, layer.pos)[held], rtol=1e-4, atol=1e-4)
    keeps_all = name in ("full", "topk", "topk_h2") or policy.compress == "prefill"  # cut once, at the first chunk
    # token by token the first token is the prompt, then the schedule's cuts (decode: the budget); a chunk of 8 cuts
    expected = 64 if keeps_all else policy.schedule.held(12, 1, 64) if chunk == 1 else 12
    assert cache.next_position() == int(held[0, 0].sum()) == expected


def test_rerotation_refuses_a_quantized_cache(model):
    from h2o.core.quant import make_quant

    with pytest.raises(PolicyError, match="packed rows"):
        EvictingCache(make_policy("h2o", budget=8), 2, rerotate=KeyShifter(model), quant=make_quant("uniform"))
