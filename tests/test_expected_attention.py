"""expected_attention: the queries before RoPE against the model's own projection, the cut against a naive loop of
kvpress's ExpectedAttentionPress rule (which fails on broken variants), both paths equal on every RoPE family with a
left-padded batch (GQA, multi-query, sliding windows, partial rotary) and a quantized cache, refusals in one line."""
import functools
import math

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import SLIDING_ARCHS, TINY_ARCHS, tiny_model
from h2o.core.attach import attention_modules
from h2o.core.policies import PolicyError
from h2o.core.policies.budget import Unsupported
from h2o.core.prerope import rotary_of
from tests.test_parity import ids, reference
from tests.test_prefill_methods import PADS, P, padded_paths

ROPE_ARCHS = [a for a in TINY_ARCHS + SLIDING_ARCHS if a != "opt"]  # opt: learned positions, no rotation


def hidden_inputs(model):
    """Forward pre-hooks keeping each attention module's input hidden states (B, T, hidden): {layer: tensor}."""
    seen, hooks = {}, []
    for m in attention_modules(model):
        def keep(mod, args, kwargs):
            seen[mod.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)
        hooks.append(m.register_forward_pre_hook(keep, with_kwargs=True))
    return seen, hooks


def projected_queries(module, h):
    """kvpress's get_prerope_query_states written for the tiny families: W_q h (B, Hq, T, D), q_norm where the
    model has one, GPT-NeoX's fused projection split."""
    B, T, _ = h.shape
    if hasattr(module, "query_key_value"):
        D = module.head_size
        return module.query_key_value(h).view(B, T, -1, 3 * D).transpose(1, 2).chunk(3, -1)[0]
    q = module.q_proj(h).view(B, T, -1, module.head_dim).transpose(1, 2)
    return module.q_norm(q) if hasattr(module, "q_norm") else q


@pytest.mark.parametrize("arch", ["llama_gqa", "gpt_neox", "gemma3"])
def test_queries_turned_back_are_the_projected_ones(arch):
    """What the policy is given equals W_q x computed from the layer's input (partial rotary; q_norm)."""
    model = tiny_model(arch, seed=1)
    policy = make_policy("expected_attention", budget=0.5)
    got = {}
    stats = policy.query_stats

    def spy(queries, rows, pos, length):
        got[queries.tap.module.layer_idx] = queries.before_rope(rows)
        return stats(queries, rows, pos, length)

    policy.query_stats = spy
    seen, hooks = hidden_inputs(model)
    x = ids(4, 20)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        model(x, cache=h.new_cache())
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        for m in attention_modules(model):
            torch.testing.assert_close(got[m.layer_idx], projected_queries(m, seen[m.layer_idx]), atol=1e-5, rtol=1e-5)


def rotation(p: int, inv_freq: torch.Tensor, D: int) -> torch.Tensor:
    """(D, D) float64 RoPE at position p, rotate-half layout: pair (i, i + r/2) turned by p * inv_freq[i]."""
    h = inv_freq.numel()
    M = torch.eye(D, dtype=torch.float64)
    for i in range(h):
        a = p * float(inv_freq[i])
        M[i, i], M[i, i + h], M[i + h, i], M[i + h, i + h] = math.cos(a), -math.sin(a), math.sin(a), math.cos(a)
    return M


@functools.cache
def future_rotation(L: int, n: int, inv_freq: tuple, D: int) -> torch.Tensor:
    """(D, D) the rotations of positions L .. L + n - 1 averaged, one matrix at a time."""
    return sum(rotation(p, torch.tensor(inv_freq), D) for p in range(L, L + n)) / n


def naive_scores(model, context, n_future=512, n_sink=4, covariance=True, after_rope=False, vnorm=True,
                 future=True):
    """Per layer (Hkv, L) ExpectedAttentionPress's scores for one unpadded prompt (1, L), written out from its
    definition in float64 with loops. Broken variants: ``after_rope`` (statistics of the rotated queries), ``future``
    False (the statistics not rotated to the future positions)."""
    from transformers import DynamicCache

    seen, hooks = hidden_inputs(model)
    cache = DynamicCache()
    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    inv_freq = rotary_of(model).inv_freq.double()
    L = context.shape[1]
    out = []
    for i, m in enumerate(attention_modules(model)):
        keys, values = cache.layers[i].keys[0].double(), cache.layers[i].values[0].double()  # (Hkv, L, D)
        with torch.no_grad():
            q = projected_queries(m, seen[i])[0].double()  # (Hq, L, D)
        Hq, _, D = q.shape
        Hkv = keys.shape[0]
        if after_rope:
            q = torch.stack([torch.stack([rotation(t, inv_freq, D) @ q[h, t] for t in range(L)]) for h in range(Hq)])
        R = future_rotation(L, n_future, tuple(inv_freq.tolist()), D) if future else torch.eye(D).double()
        s = torch.zeros(Hkv, L, dtype=torch.float64)
        for h in range(Hq):
            rows = q[h, n_sink:]
            mu = rows.mean(0)
            S = sum(torch.outer(r - mu, r - mu) for r in rows) / rows.shape[0]
            mu, S = R @ mu, R @ S @ R.T
            k = keys[h // (Hq // Hkv)]
            z = torch.tensor([float(k[j] @ mu) / math.sqrt(D) + covariance * float(k[j] @ S @ k[j]) / (2 * D)
                              for j in range(n_sink, L)])
            s[h // (Hq // Hkv), n_sink:] += torch.softmax(z, 0) / (Hq // Hkv)
        if vnorm:
            s[:, n_sink:] *= values[:, n_sink:].norm(dim=-1)
        s[:, :n_sink] = s[:, n_sink:].max() + 1
        out.append(s)
    return out


def kept_by(scores, n):
    return [s.topk(n, -1).indices.sort(-1).values for s in scores]


@pytest.mark.parametrize("arch,vnorm", [("llama_gqa", True), ("llama_gqa", False), ("gpt_neox", True)])
def test_cut_is_kvpress_rule(arch, vnorm):
    """The evicting cache keeps, per layer and KV head, the n keys of highest naive score; its scores equal the
    naive ones; the logits after the prompt equal kvpress's protocol done by hand with those keys kept."""
    model = tiny_model(arch, seed=3)
    ctx, cont, n = ids(1, 40), ids(2, 9), 16
    naive = naive_scores(model, ctx, vnorm=vnorm)
    policy = make_policy("expected_attention", budget=n, use_vnorm=vnorm)
    got = []
    score = policy.query_score
    policy.query_score = lambda *a: got.append(score(*a)) or got[-1]
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ctx, cache=cache)
        held = [layer.pos[0].sort(-1).values for layer in cache.layers]  # (Hkv, n) per layer
        rest = model(cont, cache=cache).logits[0]
    for i, kept in enumerate(kept_by(naive, n)):
        torch.testing.assert_close(got[i][0].double(), naive[i], rtol=1e-4, atol=1e-7)
        assert torch.equal(held[i], kept), i
    _, ref_rest = reference(model, ctx, cont, lambda i, attn: kept_by(naive, n)[i])
    torch.testing.assert_close(rest, ref_rest, atol=1e-5, rtol=1e-5)


def test_naive_reference_is_not_blind():
    """Broken variants keep other positions: the statistics not rotated to the future positions, no covariance
    term, no value norms; and (where the value norms do not decide alone) statistics after RoPE."""
    model = tiny_model("llama_gqa", seed=3)
    ctx, n = ids(1, 40), 16
    right = {vnorm: kept_by(naive_scores(model, ctx, vnorm=vnorm), n) for vnorm in (True, False)}
    for vnorm, broken in [(True, dict(future=False)), (True, dict(covariance=False)), (True, dict(vnorm=False)),
                          (False, dict(after_rope=True))]:
        base = {"vnorm": vnorm, **broken}
        wrong = kept_by(naive_scores(model, ctx, **base), n)
        assert any(not torch.equal(a, b) for a, b in zip(right[vnorm], wrong)), base


@pytest.fixture(scope="module", params=ROPE_ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


def test_both_paths_agree_on_a_padded_batch(model):
    """Simulated mask == evicting cache on a left-padded batch, every RoPE family (GQA, multi-query, sliding
    layers, partial rotary); the cut changes what follows; a global layer holds the budget + the continuation."""
    policy = make_policy("expected_attention", budget=0.3)
    sim, full, cache = padded_paths(model, policy)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)
    kept = [int(policy.counts(torch.tensor([P - n])).total) + sim.shape[1] - P for n in PADS]
    for layer in cache.layers:
        if layer.window is None:
            assert (layer.pos >= 0).sum(-1)[:, 0].tolist() == kept


def test_both_paths_agree_under_a_quantized_cache():
    """Keys and values as a 4-bit cache holds them, in both paths: the score reads the same dequantized rows."""
    from h2o.core.quant import Uniform

    model, quant = tiny_model("llama_gqa", seed=2), Uniform(4, 8)
    x = ids(5, 36)
    policy = make_policy("expected_attention", budget=0.3)
    with torch.no_grad():
        with attach(model, policy, prompt_len=24, quant=quant):
            sim = model(x).logits
        with attach(model, policy, prompt_len=24):
            plain = model(x).logits
        with attach(model, policy, mode="real", quant=quant) as h:
            cache = h.new_cache()
            real = torch.cat([model(x[:, :24], cache=cache).logits, model(x[:, 24:], cache=cache).logits], 1)
    gap, effect = (real - sim).abs(), (sim - plain).abs()  # a key on a rounding boundary may take the next code
    assert gap.mean() < 0.01 * effect.mean() and gap.max() < 0.1 * effect.max(), (gap.max(), effect.max())
    assert effect.mean() > 1e-2  # the quantizer changes what is attended to


def test_generate_keeps_the_compressed_prompt():
    """generate() with a left-padded batch: the prompt is cut once to the budget, every generated token kept."""
    model = tiny_model("llama_gqa", seed=2)
    x, mask = ids(6, 30).repeat(2, 1), torch.ones(2, 30, dtype=torch.long)
    x[1, :6], mask[1, :6] = 0, 0
    policy = make_policy("expected_attention", budget=10)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        out = model.generate(x, attention_mask=mask, cache=cache, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 35)
    assert cache.held_tokens()[:, :, 0].tolist() == [[10 + 4, 10 + 4]] * len(cache.layers)


def test_refusals_in_one_line():
    for bad, needle in [(dict(n_sink=-1), "n_sink=-1"), (dict(n_future_positions=0), "n_future_positions=0"),
                        (dict(use_covariance="yes"), "use_covariance='yes'"), (dict(epsilon=-1.0), "epsilon=-1.0"),
                        (dict(compress="decode"), "compress=decode: expected_attention has no faithful decoding")]:
        with pytest.raises(PolicyError, match=needle) as e:
            make_policy("expected_attention", **bad)
        assert "\n" not in str(e.value)
    opt = tiny_model("opt")
    with pytest.raises(PolicyError, match="model_type=opt has no rotary embedding") as e:
        with attach(opt, make_policy("expected_attention", budget=0.5), prompt_len=8):
            pass
    assert "\n" not in str(e.value)
    with attach(opt, make_policy("expected_attention", budget=1.0)):  # a full budget undoes nothing: allowed
        pass
    dynamic = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(PolicyError, match="rope type 'dynamic', whose frequencies change with the length"):
        with attach(dynamic, make_policy("expected_attention", budget=0.5), prompt_len=8):
            pass


@pytest.mark.parametrize("options,why", [
    ({}, "which n_sink=4 removes: the mean and covariance of 0 queries are NaN, so every score is NaN"),
    ({"n_sink": 1}, "which n_sink=1 removes: the mean and covariance of 0 queries are NaN"),
    ({"n_sink": 0}, "with n_sink=0 the covariance is 0 and the future rotation averages positions "
                    "1..n_future_positions"),
    ({"inner": "expected_attention"}, "which n_sink=4 removes"),  # through adakv: the inner's refusal
])
def test_decode_is_refused_saying_why_kvpress_decoding_form_is_degenerate(options, why):
    """kvpress's DecodingPress(ExpectedAttentionPress, compression_interval=1) re-scores from one buffered hidden
    state (tools/parity/expected_attention_decoding.py): refused in one line that says what it would compute under
    the policy's n_sink, as Unsupported (a sweep lists the job as refused), and prefill stays allowed."""
    name = "adakv" if "inner" in options else "expected_attention"
    with pytest.raises(Unsupported, match=r"compress=decode: expected_attention has no faithful decoding form "
                       r"\(kvpress's DecodingPress\(ExpectedAttentionPress, compression_interval=1\) scores from "
                       r"the one hidden state buffered since its last cut, ") as e:
        make_policy(name, compress="decode", **options)
    assert why in str(e.value) and str(e.value).endswith("; allowed: prefill") and "\n" not in str(e.value)
    assert make_policy(name, compress="prefill", **options).compress == "prefill"


def test_a_forked_prefill_is_refused():
    """The bench's shared prefill forks a full cache, which has no query statistics: refused in one line."""
    model = tiny_model("llama_gqa")
    x = ids(7, 20)
    with torch.no_grad():
        with attach(model, make_policy("full"), mode="real") as h:
            snap = h.new_cache()
            model(x, cache=snap)
        with attach(model, make_policy("expected_attention", budget=8), mode="real") as h:
            with pytest.raises(PolicyError, match="no query statistics"):
                h.new_cache().fork(snap)


def test_one_spelling_for_hydra_lm_eval_and_the_api():
    from h2o.assets.policy_config import build_policy, parse

    name, options = parse("policy=expected_attention,budget=0.3,n_sink=2,use_vnorm=false,epsilon=1e-3")
    built = build_policy(name, "--model_args ", **options)
    direct = make_policy("expected_attention", budget=0.3, n_sink=2, use_vnorm=False, epsilon=1e-3)
    assert built.describe() == direct.describe() == {
        "policy": "expected_attention", "budget": 0.3, "heavy": 0.3, "recent": 0.0, "compress": "prefill",
        "n_future_positions": 512, "n_sink": 2, "use_covariance": True, "use_vnorm": False, "epsilon": 1e-3}


def test_adakv_over_expected_attention_reads_the_queries():
    """adakv(inner=expected_attention), kvpress's AdaKVPress(ExpectedAttentionPress): the layer-wide top-k runs on
    the naive expected-attention scores (heads get uneven counts), and both paths agree on a padded batch."""
    model = tiny_model("llama_gqa", seed=3)
    ctx, n = ids(1, 40), 16
    naive = naive_scores(model, ctx)
    policy = make_policy("adakv", inner="expected_attention", budget=n)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ctx, cache=cache)
    counts = policy.counts(torch.tensor([40]))
    pos = torch.arange(40).expand(1, 2, 40)
    for i, layer in enumerate(cache.layers):
        want = policy.keep(naive[i][None].float(), pos, torch.ones(1, 2, 40, dtype=torch.bool), counts)[0]
        got = (torch.arange(40)[None, :, None] == layer.pos[0][:, None, :]).any(-1)  # (Hkv, L) position held
        assert torch.equal(got, want), i
    assert any(len(set((layer.pos[0] >= 0).sum(-1).tolist())) > 1 for layer in cache.layers)  # uneven heads
    padded_paths(tiny_model("llama_gqa", seed=2), make_policy("adakv", inner="expected_attention", budget=0.3))
