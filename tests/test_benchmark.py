"""h2o.bench.throughput and h2o.tasks.streaming on tiny random models: values, not timings."""
import math

import pytest
import torch

from h2o import attach, make_policy
from h2o.bench.measure import kv_bytes
from h2o.bench.simulated import simulated_forward
from h2o.bench.throughput import benchmark, fork_cache, run_once, shared_prefill
from h2o.bench.variants import Variant, budget_tokens, make_variants, variant_context
from h2o.assets.models import tiny_model
from h2o.core.cache import EvictingCache
from h2o.core.rerotate import KeyShifter
from h2o.tasks.streaming import flatness, stream

T, GEN, B = 105, 6, 2  # 10% of 105 = 10.5: floor makes the budget 20 tokens, one below 0.2 * 105
METRICS = {"throughput_tok_s", "decode_tok_s", "latency_s", "kv_bytes", "kv_bytes_max", "peak_mem_bytes"}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_gqa", max_position_embeddings=4096)


def per_token_bytes(model):
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # keys + values, fp32


def prompt(model, n=T, b=B, seed=0):
    return torch.randint(3, model.config.vocab_size, (b, n), generator=torch.Generator().manual_seed(seed))


def run_variant(model, v, ids, gen=GEN, **kw):
    with variant_context(model, v) as new_cache:
        return run_once(model, new_cache, ids, gen, **kw)


def test_kv_bytes_h2o_vs_full_is_the_budget(model):
    ids, tok = prompt(model), per_token_bytes(model)
    full = run_variant(model, Variant("policy", "full"), ids)
    h2o = run_variant(model, Variant("policy", "h2o", 0.2), ids)
    assert full.kv_prefill == B * T * tok
    assert full.kv_max == full.kv_final == B * (T + GEN - 1) * tok  # grows by one token per decoding step
    kept = budget_tokens(0.2, T)
    assert kept == 20
    assert abs(kept - 0.2 * T) <= 1  # the budget ratio, within one token per head
    assert h2o.kv_prefill == h2o.kv_max == h2o.kv_final == B * kept * tok  # cut at prefill, constant after
    assert abs(h2o.kv_prefill / full.kv_prefill - 0.2) <= 1 / T + 1e-12  # one token per head
    assert h2o.kv_meta == B * model.config.num_hidden_layers * model.config.num_key_value_heads * kept * (8 + 4)


def test_sliding_window_baseline_bytes(model):
    """transformers' sliding-window layer: a view of the whole prompt right after prefill, the window after."""
    ids, tok = prompt(model), per_token_bytes(model)
    r = run_variant(model, Variant("sliding", "hf_sliding", 0.2), ids)
    k = budget_tokens(0.2, T)
    assert r.kv_prefill == B * T * tok  # the kept keys are a view of the prompt's: the whole buffer is held
    # between steps it keeps a view of sliding_window - 1 tokens of a buffer of sliding_window (cached + new)
    assert r.kv_final == B * k * tok
    d = run_variant(model, Variant("dynamic", "hf_sdpa", 1.0, "sdpa"), ids)
    assert d.kv_prefill == B * T * tok and d.kv_final == B * (T + GEN - 1) * tok


def test_sliding_window_matches_local_policy(model):
    """Same budget, same tokens seen: the baseline and the harness's local policy decode the same logits."""
    ids = prompt(model, b=1)
    outs = {}
    for v in (Variant("sliding", "hf_sliding", 0.2), Variant("policy", "local", 0.2)):
        with torch.inference_mode(), variant_context(model, v) as new_cache:
            cache = new_cache(T)
            logits = [model(input_ids=ids, cache=cache, logits_to_keep=1).logits[:, -1]]
            for _ in range(4):
                nxt = logits[-1].argmax(-1, keepdim=True)
                logits.append(model(input_ids=nxt, cache=cache, logits_to_keep=1).logits[:, -1])
            outs[v.policy] = torch.cat(logits)
    torch.testing.assert_close(outs["hf_sliding"], outs["local"], rtol=1e-4, atol=1e-4)


def test_fork_equals_a_real_prefill(model):
    """The shared-prefill fork of a policy's cache is the cache a real prefill of that policy leaves."""
    ids = prompt(model, b=1)
    snap, logits1, _ = shared_prefill(model, ids, prefill_chunk=0)
    v = Variant("policy", "h2o", 0.2)
    with torch.inference_mode(), variant_context(model, v) as new_cache:
        real = new_cache(T)
        real_logits = model(input_ids=ids, cache=real, logits_to_keep=1).logits[:, -1]
        forked, fork_logits = fork_cache(model, v, new_cache, snap, logits1, 3)
    torch.testing.assert_close(fork_logits, real_logits.expand(3, -1))
    for a, b in zip(real.layers, forked.layers):
        assert torch.equal(a.pos.expand_as(b.pos), b.pos)
        torch.testing.assert_close(a.keys.expand_as(b.keys), b.keys)
        torch.testing.assert_close(a.acc.expand_as(b.acc), b.acc)
        assert a.keys.shape[-2] == budget_tokens(0.2, T)


@pytest.mark.parametrize("prefill", ["each", "shared"])
def test_benchmark_records(model, prefill):
    recs = benchmark(model, ["full", "h2o", "local"], [0.2], [48], [4], [2], ["sdpa", "eager", "sliding"],
                     repeats=1, warmup=1, prefill=prefill, model_name="tiny", verbose=False,
                     kv_limit=2**20 if prefill == "shared" else None, max_batch_cap=8)
    main = [r for r in recs if "kv_limit_bytes" not in r]
    assert [r["policy"] for r in main] == ["full", "h2o", "local", "hf_sdpa", "hf_eager", "hf_sliding"]
    for r in recs:
        assert r["task_kind"] == "benchmark" and r["model"] == "tiny"
        assert {"policy", "budget", "prompt_len", "gen_len", "batch_size", "metrics"} <= set(r)
        assert METRICS <= set(r["metrics"])
        m = r["metrics"]
        assert m["kv_bytes_max"] >= m["kv_bytes"] > 0 and m["peak_mem_bytes"] > 0 and m["decode_tok_s"] > 0
        if prefill == "each":
            assert m["throughput_tok_s"] > 0 and m["latency_s"] > 0
            assert m["throughput_tok_s"] == pytest.approx(r["batch_size"] * r["gen_len"] / m["latency_s"])
        else:
            assert m["throughput_tok_s"] is None and m["latency_s"] is None
    h2o = main[1]["metrics"]
    assert h2o["vs_full"]["kv_bytes_prefill"] == pytest.approx(budget_tokens(0.2, 48) / 48)
    limited = {r["policy"]: r for r in recs if "kv_limit_bytes" in r}
    if prefill == "shared":
        assert set(limited) == {r["policy"] for r in main} and all(r["batch_size"] >= 1 for r in limited.values())
        assert limited["h2o"]["max_batch"] > limited["full"]["max_batch"]
        assert all(r["batch_size"] == min(8, r["max_batch"]) for r in limited.values())


def test_make_variants():
    vs = make_variants(["full", "h2o"], [0.2, 0.4], ["sdpa", "sliding"])
    assert [(v.policy, v.budget) for v in vs] == [("full", 1.0), ("h2o", 0.2), ("h2o", 0.4), ("hf_sdpa", 1.0),
                                                  ("hf_sliding", 0.2), ("hf_sliding", 0.4)]
    with pytest.raises(ValueError):
        make_variants(["full"], [0.2], ["nope"])


def test_simulated_forward_records(model):
    recs = simulated_forward(model, 32, [("h2o", 0.2)], repeats=1, warmup=0, verbose=False)
    assert [r["policy"] for r in recs] == ["hf_eager", "h2o"]
    assert all(r["semantics"] == "simulated" and r["metrics"]["latency_s"] > 0 for r in recs)


def test_kv_bytes_counts_a_view_as_its_buffer():
    from transformers.cache_utils import Cache, DynamicLayer
    layer = DynamicLayer()
    big = torch.zeros(1, 2, 10, 4)
    layer.keys, layer.values = big[:, :, -3:], big.clone()
    assert kv_bytes(Cache(layers=[layer])) == (2 * big.nbytes, 0)


# --------------------------------------------------------------------------------------- streaming
def stream_ids(model, n=400, seed=1):
    return torch.randint(3, model.config.vocab_size, (1, n + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm", "local"])
def test_streaming_cache_stays_at_budget(model, policy):
    ids = stream_ids(model)
    metrics, samples = stream(model, ids, policy, 32, chunk=8, window=8)
    assert len(samples) == 50 and samples[-1]["tokens"] == 400
    assert all(s["cache_tokens"] == 32 for s in samples[4:])  # full after four chunks, never more
    assert metrics["cache_tokens_max"] == 32
    assert metrics["max_position_id"] <= 32 + 8 - 1  # positions inside the cache
    assert math.isfinite(metrics["ppl"]) and metrics["ppl"] > 1
    assert all(math.isfinite(s["ppl"]) and s["rss_bytes"] > 0 for s in samples)
    assert metrics["kv_bytes"] == 32 * per_token_bytes(model)


def test_streaming_positions_local_equal_true_positions(model):
    """For a contiguous window, positions inside the cache give the same distances as the true ones."""
    ids = stream_ids(model, 200)
    a, _ = stream(model, ids, "local", 24, chunk=8, positions="cache")
    b, _ = stream(model, ids, "local", 24, chunk=8, positions="true")
    assert a["ppl"] == pytest.approx(b["ppl"], rel=1e-5)
    assert a["max_position_id"] == 24 + 8 - 1 and b["max_position_id"] == 199


def test_key_shifter_composes_rotations(model):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    rot = model.model.rotary_emb
    k = torch.randn(1, 2, 5, 16)
    p = torch.tensor([[3, 40, 7, 100, 0]])
    d = torch.tensor([-3, -30, 0, -99, 0])
    cos, sin = rot(k, p)
    moved = KeyShifter(model).rotate(apply_rotary_pos_emb(k, k, cos, sin)[1], d.expand(1, 2, 5))
    cos2, sin2 = rot(k, p + d)
    torch.testing.assert_close(moved, apply_rotary_pos_emb(k, k, cos2, sin2)[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["h2o", "streaming_llm"])
def test_streaming_cached_keys_sit_at_their_rank(model, policy):
    """Layer 0's keys depend only on the token and its position: after streaming, each kept key equals the key
    of its token computed fresh at its rank among the kept tokens (the renumbering is exact)."""
    ids = stream_ids(model, 120)
    pol = make_policy(policy, budget=20)
    with torch.inference_mode(), attach(model, pol, mode="real") as h:
        cache = h.cache = EvictingCache(pol, model.config.num_hidden_layers, rerotate=KeyShifter(model))
        for s in range(0, 120, 8):
            x, n = ids[:, s:s + 8], cache.next_position()
            model(input_ids=x, cache=cache, position_ids=torch.arange(n, n + 8)[None])
        layer = cache.layers[0]
        attn = model.model.layers[0].self_attn
        hid = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids[0, layer.pos.clamp(min=0)]))
        hkv, S, D = layer.keys.shape[1], layer.keys.shape[2], layer.keys.shape[3]
        k = attn.k_proj(hid).view(1, hkv, S, hkv, D)  # (1, head h, slot, head h', D): take h == h'
        k = torch.stack([k[:, i, :, i] for i in range(hkv)], 1)  # (1, Hkv, S, D)
        rank = layer.pos.argsort(-1).argsort(-1)
        cos, sin = model.model.rotary_emb(k, rank.reshape(1, -1))
        cos, sin = cos.view(1, hkv, S, D), sin.view(1, hkv, S, D)
        fresh = k * cos + torch.cat([-k[..., D // 2:], k[..., :D // 2]], -1) * sin
    assert (layer.pos >= 0).all() and layer.pos.shape[-1] == 20
    torch.testing.assert_close(layer.keys, fresh, rtol=1e-4, atol=1e-4)


def test_streaming_keys_in_bf16_are_rotated_once(model):
    """bf16, 100 renumberings: each key is one rounding away from its fresh value (cumulative bf16 rotations
    drift: heavy hitters move at every renumbering)."""
    ids = stream_ids(model, 400)
    half = model.to(torch.bfloat16)
    pol = make_policy("h2o", budget=20)
    try:
        with torch.inference_mode(), attach(half, pol, mode="real") as h:
            cache = h.cache = EvictingCache(pol, half.config.num_hidden_layers, rerotate=KeyShifter(half))
            for s in range(0, 400, 4):
                n = cache.next_position()
                half(input_ids=ids[:, s:s + 4], cache=cache, position_ids=torch.arange(n, n + 4)[None])
            layer = cache.layers[0]
            rank = layer.pos.argsort(-1).argsort(-1)
            rot = KeyShifter(half)
            # move each key back to its rank 0 frame and compare with the same token's key at its rank, fresh
            attn, base = half.model.layers[0].self_attn, half.model
            hid = base.layers[0].input_layernorm(base.embed_tokens(ids[0, layer.pos.clamp(min=0)]))
            hkv, S, D = layer.keys.shape[1:]
            k = attn.k_proj(hid).view(1, hkv, S, hkv, D)
            k = torch.stack([k[:, i, :, i] for i in range(hkv)], 1).float()
            fresh = rot.rotate(k, rank)
        err = ((layer.keys.float() - fresh.float()).norm(dim=-1) / fresh.float().norm(dim=-1)).mean()
        assert err < 0.01, float(err)
    finally:
        model.float()


def test_flatness():
    samples = [{"tokens": 10 * i, "rss_bytes": 1000 + (50 if i < 3 else 0), "time_per_token_s": 1.0}
               for i in range(1, 41)]
    f = flatness(samples)
    assert f["rss_growth"] == 0.0 and f["time_per_token_growth"] == 0.0


@pytest.mark.parametrize("prompt_len, budget, chunk", [(300, 0.2, 0), (200, 0.2, 0), (0, 260, 16)])
def test_real_prefill_rows_beyond_one_block(model, prompt_len, budget, chunk):
    """Prefills of more than a block of rows (a 300-token prompt), or a chunk on a cache of >= 256 slots
    (streaming with a 256-token budget), keep every query row (regression: an empty row slice)."""
    if chunk:
        metrics, _ = stream(model, stream_ids(model, 320), "h2o", budget, chunk=chunk)
        assert metrics["cache_tokens_max"] == budget and math.isfinite(metrics["ppl"])
    else:
        r = run_variant(model, Variant("policy", "h2o", budget), prompt(model, n=prompt_len, b=1), gen=2)
        assert r.kv_prefill == budget_tokens(budget, prompt_len) * per_token_bytes(model)
