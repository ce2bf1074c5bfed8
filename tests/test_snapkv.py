"""snapkv against a naive re-implementation of kvpress's SnapKVPress rule (docs/methods.md), computed from
transformers' eager attention weights; the evicting cache at a prompt's end holds exactly its positions, and the
logits after the prompt equal kvpress's protocol run by hand."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.parity import driver as parity
from h2o.parity.pairs import kept as tokens_kept
from h2o.core.policies import PolicyError
from tests.test_parity import ids, reference

L, W = 40, 4  # n >= W at both ratios: with n < W kvpress breaks the window's ties by topk's order


def naive_snapkv(attn: torch.Tensor, n: int, hkv: int, w: int = W, kernel: int = 5, pool: str = "avg"):
    """attn (Hq, L, L) one layer's eager weights -> (Hkv, n) kept positions, sorted. ``pool="max"``: the paper's
    max pooling (a deliberately different rule)."""
    Hq, L, _ = attn.shape
    m = attn[:, L - w:, :L - w].mean(1)  # (Hq, L - w) the window rows' mean
    half = kernel // 2
    padded = torch.cat([torch.zeros(Hq, half), m, torch.zeros(Hq, half)], 1)
    windows = torch.stack([padded[:, j:j + kernel] for j in range(L - w)], 1)  # (Hq, L - w, kernel)
    p = windows.sum(-1) / kernel if pool == "avg" else windows.amax(-1)
    s = p.view(hkv, Hq // hkv, L - w).mean(1)  # (Hkv, L - w) averaged over each KV head's query heads
    s = torch.cat([s, torch.full((hkv, w), float(s.max()) + 1)], 1)  # the window always kept
    return s.topk(n, -1).indices.sort(-1).values


def held_after(model, policy, context):
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(context, cache=cache)
    return [layer.pos[0].sort(-1).values for layer in cache.layers]  # (Hkv, n) per layer


def eager(model, context):
    with torch.no_grad():
        return model(context, output_attentions=True).attentions  # per layer (1, Hq, L, L)


@pytest.mark.parametrize("arch", ["llama_gqa", "opt"])
@pytest.mark.parametrize("ratio", [0.5, 0.8])
def test_cut_holds_kvpress_snapkv_positions(arch, ratio):
    model = tiny_model(arch, seed=3)
    n = tokens_kept(L, ratio)
    hkv = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    ctx = ids(1, L)
    held = held_after(model, make_policy("snapkv", budget=n, window=W), ctx)
    for i, attn in enumerate(eager(model, ctx)):
        assert torch.equal(held[i], naive_snapkv(attn[0], n, hkv)), i


def test_logits_after_the_prompt_are_kvpress_protocol():
    model = tiny_model("llama_gqa", seed=3)
    n, hkv = tokens_kept(L, 0.8), model.config.num_key_value_heads
    ctx, cont = ids(1, L), ids(2, 9)
    first, rest, held = parity.forwards(model, make_policy("snapkv", budget=n, window=W), ctx, [cont], L)
    ref_first, ref_rest = reference(model, ctx, cont, lambda i, attn: naive_snapkv(attn[0], n, hkv))
    assert held == [n] * model.config.num_hidden_layers
    torch.testing.assert_close(first, ref_first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rest, ref_rest, atol=1e-5, rtol=1e-5)


def test_naive_reference_is_not_blind():
    """Max pooling (the paper's) or a window of another size keep other positions on this model."""
    model = tiny_model("llama_gqa", seed=3)
    n, hkv = tokens_kept(L, 0.8), model.config.num_key_value_heads
    ctx = ids(1, L)
    held = held_after(model, make_policy("snapkv", budget=n, window=W), ctx)
    attns = eager(model, ctx)
    assert any(not torch.equal(held[i], naive_snapkv(a[0], n, hkv, pool="max")) for i, a in enumerate(attns))
    assert any(not torch.equal(held[i], naive_snapkv(a[0], n, hkv, w=W // 2)) for i, a in enumerate(attns))


def test_left_padding_does_not_change_the_selection():
    model = tiny_model("llama_gqa", seed=3)
    ctx = ids(1, L)
    policy = make_policy("snapkv", budget=0.3, window=W)
    alone = held_after(model, policy, ctx)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ctx], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, L, dtype=torch.long)], 1)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(torch.cat([padded, ids(4, L + 5)]), attention_mask=torch.cat([mask, torch.ones_like(mask)]),
              cache=cache)
    for i, layer in enumerate(cache.layers):
        pos = layer.pos[0]
        assert torch.equal(pos[pos >= 0].view(pos.shape[0], -1).sort(-1).values, alone[i])


def test_decode_timing_and_bad_options_refused_in_one_line():
    assert make_policy("snapkv").compress == "prefill"
    with pytest.raises(PolicyError, match="compress=decode: pyramidkv is defined at the end of a prompt only"):
        make_policy("pyramidkv", compress="decode")  # snapkv's per-layer budgets: no decoding form
    with pytest.raises(PolicyError, match="kernel=4"):
        make_policy("snapkv", kernel=4)
    with pytest.raises(PolicyError, match="window=0"):
        make_policy("snapkv", window=0)


# ------------------------------------------------------------------ its decoding form
@pytest.mark.parametrize("arch", ["llama_gqa", "llama", "gpt_neox", "mistral"])
@pytest.mark.parametrize("compress", ["decode", "interval"])
def test_its_decoding_form_agrees_in_both_paths_on_a_padded_batch(arch, compress):
    """The window over the newest rows at every step or every N steps: both paths (GQA, a sliding window)."""
    from tests.two_paths import padded_paths

    policy = make_policy("snapkv", budget=0.4, window=3, kernel=3, compress=compress,
                         interval=4 if compress == "interval" else None)
    sim, full, _ = padded_paths(tiny_model(arch, seed=2), policy)
    assert not torch.allclose(sim[:, -8:], full[:, -8:], atol=1e-3)


def test_every_step_equals_a_naive_reference_token_for_token():
    """The prompt cut to total - 1, then each full step cut by hand before the token attends (kvpress's
    DecodingPress at interval 1); greedy, token for token, both paths."""
    from tests.test_r_kv import naive_decode, ours

    model = tiny_model("llama_gqa", seed=2)
    policy = make_policy("snapkv", budget=7, window=3, kernel=3, compress="decode")
    prompt = torch.randperm(120, generator=torch.Generator().manual_seed(3))[:14][None] + 1
    logits, tokens = naive_decode(model, policy, prompt, 12)
    sim, real = ours(model, policy, torch.cat([prompt, torch.tensor([tokens])], 1), prompt.shape[1])
    torch.testing.assert_close(real[1:], logits[:-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(sim[1:], logits[:-1], atol=1e-4, rtol=0)
    assert real.argmax(-1).tolist() == tokens == sim.argmax(-1).tolist()
