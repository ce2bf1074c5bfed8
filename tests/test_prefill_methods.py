"""The methods defined at a prompt's end (snapkv, knorm, keydiff): both paths hold the same tokens on every tiny
architecture, with a left-padded batch; knorm and keydiff against naive re-implementations of kvpress's rules."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.parity import driver as parity
from h2o.parity.pairs import kept as tokens_kept
from tests.test_parity import ids, reference
from tests.two_paths import L, P, PADS, batch, padded_paths  # noqa: F401  (L, PADS, batch: other tests import them here)

METHODS = {"snapkv": {"window": 4}, "knorm": {}, "keydiff": {}}


@pytest.fixture(scope="module", params=TINY_ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


@pytest.mark.parametrize("name", list(METHODS))
def test_both_paths_agree_on_a_padded_batch(model, name):
    policy = make_policy(name, budget=0.3, **METHODS[name])
    sim, full, cache = padded_paths(model, policy)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)  # the cut changes what follows
    kept = [int(policy.counts(torch.tensor([P - n])).total) + L - P for n in PADS]
    assert cache.held_tokens()[:, :, 0].tolist() == [kept] * len(cache.layers)


def naive_knorm(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys (Hkv, L, D) -> (Hkv, n) kept positions: the n lowest L2 norms per head."""
    norms = torch.tensor([[sum(float(x) ** 2 for x in k) ** 0.5 for k in head] for head in keys])
    return (-norms).topk(n, -1).indices.sort(-1).values


def naive_keydiff(keys: torch.Tensor, n: int) -> torch.Tensor:
    """keys (Hkv, L, D) -> (Hkv, n): the n keys of lowest cosine to the mean unit key, per head."""
    out = []
    for head in keys:
        unit = [k / k.norm() for k in head]
        anchor = sum(unit) / len(unit)
        cos = torch.stack([k @ anchor / (k.norm() * anchor.norm()) for k in head])
        out.append((-cos).topk(n).indices.sort().values)
    return torch.stack(out)


NAIVE = {"knorm": naive_knorm, "keydiff": naive_keydiff}


def prompt_keys(model, context):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
    return [layer.keys[0] for layer in cache.layers]  # per layer (Hkv, L, D) after RoPE


@pytest.mark.parametrize("name", list(NAIVE))
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_cut_is_kvpress_rule(name, ratio):
    model = tiny_model("llama_gqa", seed=3)
    n = tokens_kept(40, ratio)
    ctx, cont = ids(1, 40), ids(2, 9)
    keys = prompt_keys(model, ctx)
    with torch.no_grad(), attach(model, make_policy(name, budget=n), mode="real") as h:
        cache = h.new_cache()
        model(ctx, cache=cache)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(layer.pos[0].sort(-1).values, NAIVE[name](keys[i], n)), i
    first, rest, held = parity.forwards(model, make_policy(name, budget=n), ctx, [cont], 40)
    ref_first, ref_rest = reference(model, ctx, cont, lambda i, attn: NAIVE[name](keys[i], n))
    torch.testing.assert_close(rest, ref_rest, atol=1e-5, rtol=1e-5)


def test_naive_references_are_not_blind():
    """A broken rule (the highest norms; the anchor of raw, unnormalised keys) keeps other positions."""
    model = tiny_model("llama_gqa", seed=3)
    keys = prompt_keys(model, ids(1, 40))
    n = tokens_kept(40, 0.5)
    high = [k.norm(dim=-1).topk(n, -1).indices.sort(-1).values for k in keys]
    assert any(not torch.equal(h, naive_knorm(k, n)) for h, k in zip(high, keys))

    def raw_anchor(head_keys):
        a = head_keys.mean(1, keepdim=True)
        cos = torch.nn.functional.cosine_similarity(head_keys, a, dim=-1)
        return (-cos).topk(n, -1).indices.sort(-1).values

    assert any(not torch.equal(raw_anchor(k), naive_keydiff(k, n)) for k in keys)


def test_simulated_forward_without_a_prompt_is_refused_in_one_line():
    """A prefill-timed policy with no prompt would cut nothing (the full cache, silently): refused."""
    from h2o.core.policies import PolicyError

    model = tiny_model("llama_gqa")
    for name in ["snapkv", "knorm", "h2o"]:
        with pytest.raises(PolicyError, match=f"compress=prefill: {name} compresses a prompt at its end"):
            with attach(model, make_policy(name, budget=0.3, compress="prefill")):
                pass
    with attach(model, make_policy("snapkv", budget=1.0)):  # a full budget compresses nothing anyway
        pass
