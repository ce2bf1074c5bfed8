"""adakv (kvpress's AdaKVPress): the cut against a naive per-layer flattened top-k with the safeguard, written from
docs/methods.md (a per-head top-k or no safeguard keeps other tokens); both paths equal on every tiny architecture
(left-padded batch, GQA, sliding windows) in both timings, under a quantized cache; the padding visible as tokens
held beside bytes stored; one spelling for Hydra, lm-eval and the API."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import SLIDING_ARCHS, TINY_ARCHS, tiny_model
from h2o.parity.pairs import kept as tokens_kept
from h2o.core.policies import PolicyError
from tests.test_parity import ids
from tests.test_prefill_methods import L as PL, P, PADS, batch, padded_paths, prompt_keys

L, W = 40, 4  # the prompt of the cut tests; snapkv's window (n >= W: the window's ties never decide)


# ------------------------------------------------------------------------------ the naive reference
def snapkv_scores(attn: torch.Tensor, hkv: int, w: int = W, kernel: int = 5) -> torch.Tensor:
    """attn (Hq, L, L) one layer's eager weights -> (Hkv, L) SnapKV's scores, one position at a time: the window
    rows' mean, averaged over the ``kernel`` positions around (zeros past the edges), over each KV head's query
    heads; the window gets the largest + 1."""
    Hq, n, _ = attn.shape
    G, half = Hq // hkv, kernel // 2
    out = torch.zeros(hkv, n)
    for k in range(hkv):
        for j in range(n - w):
            total = 0.0
            for h in range(k * G, (k + 1) * G):
                for c in range(max(0, j - half), min(n - w, j + half + 1)):
                    total += float(attn[h, n - w:, c].mean())
            out[k, j] = total / kernel / G
    out[:, n - w:] = out[:, :n - w].max() + 1
    return out


def naive_adakv(scores: torch.Tensor, n: int, alpha: float) -> torch.Tensor:
    """scores (Hkv, L) -> (Hkv, L) bool kept: each head's top int(alpha n) (at least 1 if alpha > 0) raised to the
    dtype's maximum, then the Hkv (L - n) lowest of the layer's scores removed."""
    hkv, n_pos = scores.shape
    s = scores.clone()
    safe = max(1, int(n * alpha)) if alpha > 0 else 0
    for k in range(hkv):
        s[k, s[k].topk(safe).indices] = torch.finfo(s.dtype).max
    kept = torch.ones(hkv * n_pos, dtype=torch.bool)
    kept[(-s.flatten()).topk(hkv * (n_pos - n)).indices] = False
    return kept.view(hkv, n_pos)


def per_head(scores: torch.Tensor, n: int) -> torch.Tensor:
    """The broken variant: each head's own top n (the inner policy alone)."""
    kept = torch.zeros_like(scores, dtype=torch.bool)
    return kept.scatter(-1, scores.topk(n, -1).indices, True)


def held_mask(layer, n_pos: int) -> torch.Tensor:
    """(Hkv, L) bool: the positions the evicting layer holds for sequence 0."""
    pos = layer.pos[0]
    held = torch.zeros(pos.shape[0], n_pos + 1, dtype=torch.bool)
    return held.scatter(-1, torch.where(pos >= 0, pos, n_pos), True)[:, :n_pos]


def cut(model, policy, context):
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(context, cache=cache)
    return cache


def layer_scores(model, inner: str, context) -> list[torch.Tensor]:
    hkv = model.config.num_key_value_heads
    if inner == "knorm":
        return [-k.norm(dim=-1) for k in prompt_keys(model, context)]
    with torch.no_grad():
        attns = model(context, output_attentions=True).attentions
    return [snapkv_scores(a[0], hkv) for a in attns]


# alpha 0.8: the safeguard binds (some head would keep fewer than int(0.8 n) without it) on this model
CUTS = [("snapkv", 0.8, 0.2), ("snapkv", 0.5, 0.8), ("knorm", 0.8, 0.2), ("knorm", 0.8, 0.8)]


@pytest.mark.parametrize("inner,ratio,alpha", CUTS)
def test_cut_is_the_flattened_topk_with_the_safeguard(inner, ratio, alpha):
    model = tiny_model("llama_gqa", seed=3)
    n, ctx = tokens_kept(L, ratio), ids(1, L)
    opts = {"window": W} if inner == "snapkv" else {}
    cache = cut(model, make_policy("adakv", inner=inner, budget=n, alpha_safeguard=alpha, **opts), ctx)
    uneven = False
    for i, s in enumerate(layer_scores(model, inner, ctx)):
        held = held_mask(cache.layers[i], L)
        assert torch.equal(held, naive_adakv(s, n, alpha)), i
        counts = held.sum(-1)
        assert int(counts.sum()) == s.shape[0] * n and int(counts.min()) >= int(n * alpha)
        assert cache.layers[i].keys.shape[-2] == int(counts.max())  # padded to the largest head, no more
        uneven |= int(counts.min()) != int(counts.max())
    assert uneven  # heads got uneven budgets: the test is not vacuous


def test_naive_reference_is_not_blind():
    """A per-head top-k (the inner policy alone) and a cut without the safeguard keep other tokens; with
    alpha_safeguard = 1 every head keeps its own top n: the inner policy."""
    model = tiny_model("llama_gqa", seed=3)
    n, ctx = tokens_kept(L, 0.8), ids(1, L)
    scores = layer_scores(model, "knorm", ctx)
    cache = cut(model, make_policy("adakv", inner="knorm", budget=n, alpha_safeguard=0.8), ctx)
    held = [held_mask(layer, L) for layer in cache.layers]
    assert all(not torch.equal(h, per_head(s, n)) for h, s in zip(held, scores))
    assert all(not torch.equal(h, naive_adakv(s, n, 0.0)) for h, s in zip(held, scores))
    for policy in (make_policy("knorm", budget=n), make_policy("adakv", inner="knorm", budget=n, alpha_safeguard=1.0)):
        kept = cut(model, policy, ctx)
        assert all(torch.equal(held_mask(layer, L), per_head(s, n)) for layer, s in zip(kept.layers, scores))


# ------------------------------------------------------------------------------ both paths, both timings
@pytest.fixture(scope="module", params=TINY_ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


TIMED = [("knorm", "prefill"), ("snapkv", "prefill"), ("expected_attention", "prefill"), ("h2o", "decode"),
         ("random", "decode"), ("scissorhands", "decode"), ("keydiff", "decode")]
OPTIONS = {"snapkv": {"window": 4}, "scissorhands": {"history": 8, "window": 2}}  # both within the prompt


@pytest.mark.parametrize("inner,compress", TIMED)
def test_both_paths_agree_on_a_padded_batch(model, inner, compress):
    """The left-padded batch of tests/test_prefill_methods.py (a prompt, then one token at a time): real ==
    simulated on every real row; each layer keeps the inner's total; the inner alone would keep other tokens."""
    policy = make_policy("adakv", inner=inner, budget=0.4, compress=compress, **OPTIONS.get(inner, {}))
    if inner == "expected_attention" and model.config.model_type == "opt":  # it reads rotary queries: refused
        with pytest.raises(PolicyError, match="model_type=opt has no rotary embedding"):
            padded_paths(model, policy)
        return
    sim, full, cache = padded_paths(model, policy)
    assert not torch.allclose(sim, full, atol=1e-3)
    held = cache.held_tokens()  # (layers, B, Hkv)
    n = policy.counts(torch.tensor([P - pads for pads in PADS])).total  # (B,) the budget of each prompt
    after = 0 if compress == "decode" else PL - P  # compressed once: every later token kept
    assert held.sum(-1).tolist() == [((n + after) * held.shape[-1]).tolist()] * held.shape[0]
    alone = make_policy(inner, budget=0.4, compress=compress, **OPTIONS.get(inner, {}))
    x, mask = batch()
    with torch.no_grad(), attach(model, alone, prompt_len=P):  # the inner's per-head budgets hold other tokens
        assert not torch.allclose(model(x, attention_mask=mask).logits[:, P:], sim[:, P:], atol=1e-4)


@pytest.mark.parametrize("inner", ["h2o", "tova"])
def test_token_by_token_cache_equals_simulated_mask(model, inner):
    """From the first token on, the budget held at every step. tova scores every head alike, so the layer's
    top-k is its own per-head rule: the same logits (a property of the definition)."""
    from tests.test_paths import plain_logits, real_prefill_decode, simulated, tokens

    ids_ = tokens(40, 1)
    policy = make_policy("adakv", inner=inner, budget=0.3, compress="decode")
    sim = simulated(model, policy, ids_)
    real, cache = real_prefill_decode(model, policy, ids_, prompt=0, ref_len=40)
    torch.testing.assert_close(real, sim, atol=1e-4, rtol=0)
    assert not torch.allclose(sim, plain_logits(model, ids_), atol=1e-3)
    alone = simulated(model, make_policy(inner, budget=0.3), ids_)
    assert torch.allclose(sim, alone, atol=1e-5) == (inner == "tova")


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
@pytest.mark.parametrize("inner,compress", [("h2o", "decode"), ("knorm", "prefill")])
def test_sliding_window_layers_in_both_paths(arch, inner, compress):
    from tests.test_sliding_window import W as SW, batch, close, real, simulated, windows

    model = tiny_model(arch)
    policy = make_policy("adakv", inner=inner, budget=0.5, compress=compress)
    x, mask = batch(56, 3)
    sim = simulated(model, policy, x, mask, prompt_len=24)
    out, cache, slots = real(model, policy, x, mask, prompt=24)
    assert close(out, sim)
    for w, s, layer in zip(windows(model), slots, cache.layers):
        if w:
            assert s <= SW and int((layer.pos >= 0).sum(-1).max()) <= SW


@pytest.mark.parametrize("compress", ["prefill", "decode"])
def test_quantized_cache_holds_and_attends_to_the_same_values(compress):
    """One attention layer fed identical keys and values (GQA: 4 query heads on 2 KV heads, a batch of 2): the
    evicting cache's packed rows give exactly the simulated path's outputs."""
    from h2o.core.attach import Attached
    from h2o.core.attention import h2o_attention
    from h2o.core.quant import Uniform
    from tests.test_quant import Module

    gen = torch.Generator().manual_seed(3)
    T, prompt = 30, 12
    q, k, v = torch.randn(2, 4, T, 16, generator=gen), torch.randn(2, 2, T, 16, generator=gen) * 2, \
        torch.randn(2, 2, T, 16, generator=gen)
    quant = Uniform(4, 8).bind(tiny_model("llama_gqa"))
    policy = make_policy("adakv", inner="h2o" if compress == "decode" else "knorm", budget=0.5, compress=compress)
    sim, _ = h2o_attention(Module(Attached(policy, num_layers=1, quant=quant, prompt_len=prompt)), q, k, v, None)
    state = Attached(policy, "real", num_layers=1, quant=quant)
    layer = state.new_cache().layers[0]
    keys, values = layer.update(k[..., :prompt, :], v[..., :prompt, :])  # the prompt, then one token at a time
    outs = [h2o_attention(Module(state), q[..., :prompt, :], keys, values, None)[0]]
    for t in range(prompt, T):
        keys, values = layer.update(k[..., t:t + 1, :], v[..., t:t + 1, :])
        outs.append(h2o_attention(Module(state), q[..., t:t + 1, :], keys, values, None)[0])
    torch.testing.assert_close(torch.cat(outs, 1), sim, atol=1e-5, rtol=0)
    held = (layer.pos >= 0).sum(-1)  # (B, Hkv)
    assert (held[:, 0] != held[:, 1]).any()  # uneven heads: not vacuous


def test_beam_search_moves_each_beams_uneven_heads_with_it():
    """generate with 4 beams (two left-padded prompts of different lengths, decode timing): at every step each
    sequence's layer holds its total (its heads unevenly); each returned beam's score is its tokens' log-probability
    fed alone through the evicting cache, so every reorder moved the padded heads with their beam."""
    from transformers import StoppingCriteriaList

    from tests.test_beam_search import BEAMS, GEN, Held, alone, prompts

    model = tiny_model("llama")
    lengths = [20, 14]
    ids, mask = prompts(lengths, seed=1)
    policy = make_policy("adakv", inner="h2o", budget=0.3, compress="decode")
    totals = torch.tensor([int(policy.counts(torch.tensor([n])).total) for n in lengths]).repeat_interleave(4)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        held = Held(h)
        out = model.generate(ids, attention_mask=mask, cache=h.new_cache(), num_return_sequences=2,
                             stopping_criteria=StoppingCriteriaList([held]), return_dict_in_generate=True,
                             output_scores=True, **BEAMS)
    uneven = False
    for step in held.steps:
        for n_held, slots in step:  # (B * beams, Hkv)
            assert torch.equal(n_held.sum(-1), totals * n_held.shape[-1]) and slots == int(n_held.max())
            uneven |= bool((n_held.amin(-1) != n_held.amax(-1)).any())
    assert uneven and len(held.steps) == GEN
    T = ids.shape[1]
    for r, seq in enumerate(out.sequences):  # (B * returned, T + GEN)
        b = r // 2
        logp, _ = alone(model, policy, seq[None, T - lengths[b]:-1], lengths[b])
        assert float(logp.gather(-1, seq[T:, None]).sum()) == pytest.approx(float(out.sequences_scores[r]), abs=1e-3)


# ------------------------------------------------------------------------------ tokens held, bytes stored
def test_footprint_shows_the_padding():
    model = tiny_model("llama_gqa", seed=3)
    n, ctx = tokens_kept(L, 0.8), ids(1, L)
    cache = cut(model, make_policy("adakv", inner="knorm", budget=n), ctx)
    f = cache.footprint()
    layers, hkv = len(cache.layers), model.config.num_key_value_heads
    row = 2 * 4 * model.config.hidden_size // model.config.num_attention_heads  # fp32 key + value per slot
    slots = sum(hkv * layer.keys.shape[-2] for layer in cache.layers)
    assert f["tokens_held"] == layers * hkv * n == int(cache.held_tokens().sum())
    assert f["slots_stored"] == slots > f["tokens_held"]
    assert (f["bytes_held"], f["bytes_stored"]) == (f["tokens_held"] * row, slots * row) == \
        (f["tokens_held"] * row, cache.nbytes())
    even = cut(model, make_policy("knorm", budget=n), ctx).footprint()  # per-head budgets: no padding
    assert even["bytes_held"] == even["bytes_stored"] == f["bytes_held"]


# ------------------------------------------------------------------------------ spelling and bad input
def test_hydra_lm_eval_and_the_api_build_the_same_policy():
    from hydra import initialize_config_dir
    from lm_eval.utils import simple_parse_args_string

    from h2o.pipeline.spec import build
    from h2o.assets.paths import CONF
    from h2o.pipeline.sweep import _compose
    from h2o.tasks.lm_eval_model import lm_policy

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        hydra = build("policy", _compose(["policy=adakv", "policy.inner=snapkv", "policy.window=32",
                                          "policy.budget=0.3"]).policy)
        default = build("policy", _compose(["policy=adakv"]).policy)
        tova = build("policy", _compose(["policy=adakv", "policy.inner=tova"]).policy)
    args = simple_parse_args_string("pretrained=tiny:llama,policy=adakv,inner=snapkv,window=32,budget=0.3")
    lm = lm_policy(args.pop("policy"), args)
    api = make_policy("adakv", inner="snapkv", window=32, budget=0.3)
    assert args == {"pretrained": "tiny:llama"}
    for p in (hydra, lm):
        assert p.describe() == api.describe() and vars(p.inner) == vars(api.inner)
    assert api.describe() == {"policy": "adakv", "inner": "snapkv", "budget": 0.3, "heavy": 0.3, "recent": 0.0,
                              "compress": "prefill", "window": 32, "kernel": 5, "alpha_safeguard": 0.2}
    assert (default.inner.name, default.alpha_safeguard, default.compress, default.budget) == \
        ("snapkv", 0.2, "prefill", 0.2)
    assert tova.compress == "decode"  # compress null: the inner's own timing


@pytest.mark.parametrize("options,message", [
    ({"inner": "topk"}, "inner='topk': adakv wraps an evicting policy; allowed: "),
    ({"inner": "adakv"}, "inner='adakv'"),
    ({"alpha_safeguard": 1.5}, "alpha_safeguard=1.5: the share"),
    ({"inner": "knorm", "window": 8}, "window=8: inner=knorm has no option window"),
    ({"inner": "pyramidkv", "compress": "decode"}, "compress=decode: pyramidkv is defined at the end of a prompt only"),
    ({"colour": 1}, "colour: no such option for policy=adakv"),
])
def test_bad_options_fail_in_one_line(options, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")) as err:
        make_policy("adakv", **options)
    assert "\n" not in str(err.value)


def test_positions_inside_the_cache_are_refused():
    from h2o.core.cache import EvictingCache
    from h2o.core.rerotate import KeyShifter

    with pytest.raises(PolicyError, match="policy=adakv gives heads uneven counts"):
        EvictingCache(make_policy("adakv"), 2, rerotate=KeyShifter(tiny_model("llama")))


def test_the_run_record_carries_tokens_held_and_bytes_stored():
    """A summarization run (real path, generate on a left-padded batch): the record's bytes stored exceed the bytes
    the held tokens take, by the padding (a per-head policy's are equal: test_footprint_shows_the_padding)."""
    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.summarization import SummarizationTask

    model, tok = ModelSpec("tiny-llama", "tiny:llama").load()
    task = SummarizationTask("bb_xsum", "bb_xsum", shots=0, limit=2, max_new_tokens=4, doc_max_words=40,
                             greedy=True, batch_size=2)
    info = task.run(model, tok, make_policy("adakv", inner="knorm", budget=0.2), "real", 0).info
    row = 2 * 4 * model.config.hidden_size // model.config.num_attention_heads  # fp32 key + value per token-head
    assert info["kv_bytes_per_seq"] > info["kv_held_bytes_per_seq"] > 0
    assert info["kv_held_bytes_per_seq"] == pytest.approx(info["kv_tokens_per_seq"] * row, abs=row)  # rounded


@pytest.mark.parametrize("ratio, variant", [
    (0.5, ("snapkv", {})),  # per-head budgets: the inner alone
    (0.8, ("adakv", {"inner": "snapkv", "alpha_safeguard": 0.0})),  # no safeguard
    (0.8, "ties"),  # the window's ties (51 kept < window 64) broken newer first, not by kvpress's topk
])
def test_kvpress_golden_numbers_catch_a_broken_variant(monkeypatch, ratio, variant):
    """tests/test_parity_golden.py holds adakv_snapkv to kvpress's recorded NLL; each broken variant misses it."""
    from h2o.core.policies.adakv import AdaKV
    from tests.test_parity_golden import TOLERANCE, largest_gap, load_model, newest_first_at_the_cut

    if variant == "ties":
        monkeypatch.setattr(AdaKV, "keep", newest_first_at_the_cut)
        variant = None
    assert largest_gap(load_model(), "adakv_snapkv", ratio, variant) > 10 * TOLERANCE
