"""Quantized KV cache: the formats against naive re-implementations, both paths equal under every policy and
scheme, memory counted from the rows, bad input up front. Tiny models; the calibration is fitted on random tokens."""
from __future__ import annotations

import math
import time

import pytest
import torch

from h2o import attach, make_policy
from h2o.core.policies import BOTH_PATHS as REAL_POLICIES  # the policies with an evicting cache and a mask
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core.attach import Attached
from h2o.core.attention import h2o_attention
from tests.calibrated import ready
from tests.two_paths import quantized_paths_agree
from h2o.core.quant import KVQuant, QuantError, Uniform, make_quant
from h2o.core.quant.base import pack_bits, unpack_bits
from h2o.core.quant.calibrate import fit, kmeans_1d
from h2o.core.quant.rope import rotary_inv_freq, rotate

G = lambda seed: torch.Generator().manual_seed(seed)  # noqa: E731


@pytest.fixture(scope="module")
def gqa():
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def calibrations():
    """{arch: calibration dict} fitted on random tokens (3 bits only: fast)."""
    return {a: fit(tiny_model(a), torch.randint(3, 256, (2, 64), generator=G(5)), bits=(3,)) for a in TINY_ARCHS}


def schemes(arch: str, cal: dict) -> dict:
    rotary = arch != "opt"
    return {"uniform2": Uniform(2, 16), "uniform4-g8": Uniform(4, 8), "uniform8": Uniform(8, 16),
            "kvquant3": KVQuant(3, pre_rope=rotary, calibration=cal),
            "kvquant2-plain": KVQuant(2, per_channel_keys=False, pre_rope=False, nonuniform=False, outliers=False)}


# ----------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bit_packing_round_trips(bits):
    codes = torch.randint(0, 2 ** bits, (3, 5, 16), generator=G(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 16), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_uniform_is_flexgen_min_max(bits):
    """Against a naive FlexGen-style loop: per group of 16, codes round((x - min) / step), step = range / (2^b-1)."""
    x = torch.randn(2, 3, 5, 32, generator=G(0)) * 3
    q = Uniform(bits, 16)
    rows = q.pack(x, "key", 0, 0)
    assert rows.shape[-1] == q.row_bytes("key", 32) == 32 * bits // 8 + 2 * 4
    out = q.unpack(rows, "key", 0, torch.float32)
    levels = 2 ** bits - 1
    for b, h, t, g in [(0, 0, 0, 0), (1, 2, 4, 1), (0, 1, 3, 1)]:
        v = x[b, h, t, g * 16:(g + 1) * 16]
        m, s = v.min().half().float(), ((v.max() - v.min()) / levels).half().float()
        ref = [min(max(round(float((e - m) / s)), 0), levels) * s + m for e in v]
        assert torch.allclose(out[b, h, t, g * 16:(g + 1) * 16], torch.stack(ref), atol=1e-6)
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / levels
    assert ((out - x).abs() <= step * 0.5 + 2e-3 * x.abs().amax()).all()  # half a step (+ fp16 scale rounding)


# ---- references the tests compare against: one simulated pass, and a cache fed token by token
def perplexity(model, windows, policy, quant, batch_size: int) -> float:
    """Perplexity of ``windows`` (N, W) in one simulated pass each, every token but the first predicted."""
    from h2o.core.attach import attach

    nll, count = 0.0, 0
    k = windows.shape[1] - 1
    for s in range(0, len(windows), batch_size):
        ids = windows[s:s + batch_size]
        with torch.no_grad(), attach(model, policy, quant=quant):
            logits = model(ids).logits[:, -k - 1:-1].float()  # (b, k, V)
        nll += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, -k:], reduction="sum"))
        count += ids[:, -k:].numel()
    return math.exp(nll / count)


def hf_cache_bytes(cache) -> int:
    """Bytes a transformers ``QuantizedCache`` (hqq) holds: packed codes, scales and zero points, residual keys and
    values in the model's dtype."""
    total = 0
    for layer in cache.layers:
        for packed, meta in (layer._quantized_keys, layer._quantized_values):
            total += packed.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
        total += layer.keys.nbytes + layer.values.nbytes
    return total


def decoded_ppl(model, windows, cache_of) -> tuple[float, float, float, int]:
    """Each window fed token by token through ``cache_of(window_len)`` (a fresh cache; a context manager may
    wrap the forwards, see :func:`hf_cache`) -> (perplexity, decode seconds per token (wall, this process's CPU),
    bytes held at the end of the last window, all of it fed)."""
    nll, count, seconds, cpu = 0.0, 0, 0.0, 0.0
    for ids in windows:
        with cache_of(len(ids)) as (cache, nbytes):
            t0, c0 = time.perf_counter(), time.process_time()
            for t in range(len(ids)):  # the last token too: the cache then holds the window, as in the table
                with torch.no_grad():
                    logits = model(ids[None, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
                nll -= float(logits.log_softmax(-1)[ids[t + 1]]) if t + 1 < len(ids) else 0.0
            seconds, cpu = seconds + time.perf_counter() - t0, cpu + time.process_time() - c0
            held = nbytes(cache)
        count += len(ids)
    return math.exp(nll / (count - len(windows))), seconds / count, cpu / count, held


def hf_cache(model, backend: str, bits: int, residual: int, group: int = 64, axis: int = 0):
    """cache_of for transformers' QuantizedCache at its defaults: ``axis`` 0 (hqq cuts the flattened (B, H, T, D)
    tensor into ``group`` rows and scales each column: strided groups), the last up to ``residual`` tokens kept in
    the model's dtype until they are flushed into the quantized part (the whole cache re-quantized at each flush).
    Axis 1 (groups of ``group`` channels of each vector, as ``uniform``) fails on SmolLM2 in hqq 0.2.8.post1: its
    4-bit codes pack two rows a byte, and 3 KV heads x 1 token give an odd number of groups (dequantize: "The size
    of tensor a (4) must match the size of tensor b (3)")."""
    from contextlib import contextmanager

    from transformers import QuantizedCache

    @contextmanager
    def make(length):
        yield QuantizedCache(backend, model.config, nbits=bits, axis_key=axis, axis_value=axis, q_group_size=group,
                             residual_length=residual), hf_cache_bytes
    return make


def ours_cache(model, policy, quant):
    """cache_of for the harness's evicting cache (real path) with ``quant``."""
    from contextlib import contextmanager

    from h2o.core.attach import attach

    @contextmanager
    def make(length):
        with attach(model, policy, mode="real", quant=quant) as h:
            yield h.new_cache(ref_len=length), lambda c: c.nbytes()
    return make


def test_kvquant_outliers_kept_and_range_of_the_rest():
    x = torch.randn(1, 2, 4, 64, generator=G(1))
    x[0, 1, 2, 17] = 40.0  # one spike
    q = KVQuant(4, per_channel_keys=False, pre_rope=False, nonuniform=False)
    q.head_dim = 64
    out = q.unpack(q.pack(x, "value", 0, 0), "value", 0, torch.float32)
    assert out[0, 1, 2, 17] == 40.0  # exact (fp16-representable)
    rest = torch.cat([x[0, 1, 2, :17], x[0, 1, 2, 18:]])
    assert (out[0, 1, 2, :17] - x[0, 1, 2, :17]).abs().max() <= (rest.max() - rest.min()) / 15 / 2 + 1e-3
    no = KVQuant(4, per_channel_keys=False, pre_rope=False, nonuniform=False, outliers=False)
    no.head_dim = 64
    worse = no.unpack(no.pack(x, "value", 0, 0), "value", 0, torch.float32)
    assert (worse - x)[0, 1, 2].abs().mean() > 3 * (out - x)[0, 1, 2].abs().mean()
    assert q.row_bytes("value", 64) == 32 + 4 + 3 and no.row_bytes("value", 64) == 32 + 4


def test_pre_rope_undoes_the_models_rotation(gqa):
    """rotate(., -p) of the keys the model caches equals its keys before RoPE (k_proj output)."""
    ids = torch.randint(3, 256, (1, 12), generator=G(2))
    captured = {}
    attn = gqa.model.layers[0].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, i, o: captured.setdefault("k", o))
    with torch.no_grad():
        cache = gqa(ids, use_cache=True).past_key_values
    hook.remove()
    pre = captured["k"].view(1, 12, 2, 16).transpose(1, 2)
    back = rotate(cache.layers[0].keys, torch.arange(12), rotary_inv_freq(gqa), -1)
    assert torch.allclose(back, pre, atol=1e-5) and not torch.allclose(cache.layers[0].keys, pre, atol=1e-2)


def test_kmeans_finds_clusters_and_codebooks_are_fitted(calibrations):
    u = torch.cat([torch.full((100,), -0.5), torch.full((300,), 0.25), torch.full((50,), 0.9)])
    assert torch.allclose(kmeans_1d(u, 3), torch.tensor([-0.5, 0.25, 0.9]), atol=1e-3)
    cal = calibrations["llama"]
    cb = cal["codebooks"]["key/ch-pre-out/3"]  # (layers, 8) sorted in [-1, 1], not the even grid
    assert cb.shape == (2, 8) and (cb.diff(dim=-1) > 0).all() and cb.abs().max() <= 1
    assert not torch.allclose(cb[0], torch.linspace(-1, 1, 8), atol=0.02)
    assert cal["ranges"]["pre"]["qhi"].shape == (2, 4, 16)


# ------------------------------------------------------------------------- both paths, same values
class Module:
    """What h2o_attention reads from an attention module."""

    def __init__(self, state):
        self.h2o, self.layer_idx = state, 0


SCHEME_IDS = ["uniform2", "uniform4-g8", "kvquant3", "kvquant2-plain"]


@pytest.mark.parametrize("scheme", SCHEME_IDS)
@pytest.mark.parametrize("name", REAL_POLICIES)
def test_attention_paths_hold_and_attend_to_the_same_values(gqa, calibrations, name, scheme):
    """Identical keys/values fed to both paths (GQA, 2 KV heads): the evicting cache's rows decode to exactly the
    values the simulated mask attends to, and the outputs agree token by token."""
    quant = schemes("llama_gqa", calibrations["llama_gqa"])[scheme].bind(gqa)
    T, policy = 30, ready(make_policy(name, budget=0.3))  # triattention: random statistics (no model here)
    q = torch.randn(2, 4, T, 16, generator=G(3))
    k, v = torch.randn(2, 2, T, 16, generator=G(4)) * 2, torch.randn(2, 2, T, 16, generator=G(5))
    sim, _ = h2o_attention(Module(Attached(policy, num_layers=1, quant=quant)), q, k, v, None)
    state = Attached(policy, "real", num_layers=1, quant=quant)
    layer = state.new_cache(ref_len=T).layers[0]
    outs = []
    for t in range(T):
        keys, values = layer.update(k[..., t:t + 1, :], v[..., t:t + 1, :])
        outs.append(h2o_attention(Module(state), q[..., t:t + 1, :], keys, values, None)[0])
    assert torch.allclose(torch.cat(outs, 1), sim, atol=1e-5)
    fk, fv = quant.fake_kv(k, v, 0)
    held = layer.pos >= 0  # (B, H, S); decode what the cache holds and compare at the same positions
    dk, dv = layer.read()
    idx = layer.pos.clamp(min=0)[..., None].expand_as(dk)
    assert torch.equal(dk[held], fk.gather(-2, idx)[held]) and torch.equal(dv[held], fv.gather(-2, idx)[held])
    assert not torch.allclose(fk, k, atol=1e-3)  # quantization changed the values: not vacuous


# model-level combinations: every architecture x three schemes with the first eleven policies dealt round-robin;
# each policy added later takes the next pair, so a new policy never moves another to a different combination
PAIRS = [(a, s) for a in TINY_ARCHS for s in ("uniform4-g8", "kvquant3", "uniform2")]
FIRST = ["fixed", "fixed_h2", "full", "h2_only", "h2o", "local", "streaming_llm", "strided", "strided_h2", "topk",
         "topk_h2"]
ADDED = ["keydiff", "knorm", "pyramidkv", "random", "snapkv", "tova", "adakv"]  # appended in the order added
ROTARY = {"expected_attention": ("llama_gqa", "kvquant3")}  # policies that need rotary embeddings: a RoPE model
LATER = [n for n in ADDED if n in REAL_POLICIES] + [n for n in REAL_POLICIES if n not in FIRST + ADDED + list(ROTARY)]
COMBOS = [(*pair, FIRST[i % len(FIRST)]) for i, pair in enumerate(PAIRS)]
COMBOS += [(*PAIRS[(len(PAIRS) + i) % len(PAIRS)], name) for i, name in enumerate(LATER)]
COMBOS += [(*pair, name) for name, pair in ROTARY.items()]


@pytest.mark.parametrize("arch,scheme,name", COMBOS)
def test_model_paths_agree_under_quantization(calibrations, arch, scheme, name):
    """Whole tiny models, token by token vs one pass. The two paths compute each key in a differently shaped
    forward (1e-7 apart); a value that lands on a rounding boundary may take the next code in one path, so logits
    agree to quantization noise, far below what quantization itself changes."""
    model = tiny_model(arch)
    quant = schemes(arch, calibrations[arch])[scheme]
    ids = torch.randint(0, 128, (1, 40), generator=G(1))
    policy = ready(make_policy(name, budget=0.2), model)
    P = 24 if policy.compress == "prefill" else 0  # a policy defined at a prompt's end is given one
    effect, cache = quantized_paths_agree(model, policy, ids, quant, P)
    assert effect.mean() > 1e-2
    rows = quant.row_bytes("key", 16) + quant.row_bytes("value", 16)
    held = sum(int((layer.pos >= 0).sum()) for layer in cache.layers)
    sink = quant.sink * len(cache.layers) * cache.layers[0].keys.shape[1] * 2 * 16 * 4  # fp32 key and value
    assert cache.nbytes() == held * rows + sink + quant.const_bytes()


def test_kvquant_sink_keeps_the_first_token_exact(gqa, calibrations):
    """sink=true: column 0's key and value as computed in both paths, even where the offline per-channel ranges
    clip it (a sink-like key 30x out of range); the other tokens as without it. sink=false: the sink is clipped."""
    cal = calibrations["llama_gqa"]
    on, off = (KVQuant(3, calibration=cal, sink=s).bind(gqa) for s in (True, False))
    k, v = torch.randn(1, 2, 12, 16, generator=G(8)), torch.randn(1, 2, 12, 16, generator=G(9))
    k[..., 0, :] *= 30
    (ok, ov), (fk, fv) = on.fake_kv(k, v, 0), off.fake_kv(k, v, 0)
    assert torch.equal(ok[..., 0, :], k[..., 0, :]) and torch.equal(ov[..., 0, :], v[..., 0, :])
    assert torch.equal(ok[..., 1:, :], fk[..., 1:, :]) and torch.equal(ov[..., 1:, :], fv[..., 1:, :])
    assert (fk[..., 0, :] - k[..., 0, :]).norm() > 0.5 * k[..., 0, :].norm()  # clipped without the sink
    policy = make_policy("h2o", budget=0.5)
    state = Attached(policy, "real", num_layers=1, quant=on)
    layer = state.new_cache().layers[0]
    keys, values = layer.update(k, v)
    q = torch.randn(1, 4, 12, 16, generator=G(10))
    h2o_attention(Module(state), q, keys, values, None)  # registers positions, keeps the sink, cuts to the budget
    dk, dv = layer.read()
    assert (layer.pos[..., 0] == 0).all()  # h2o keeps a token this large, in slot 0 (slots in position order)
    assert torch.equal(dk[..., 0, :], k[..., 0, :]) and torch.equal(dv[..., 0, :], v[..., 0, :])
    assert torch.equal(dk[..., 1:, :], fk.gather(-2, layer.pos[..., 1:, None].expand(-1, -1, -1, 16)))
    assert layer.nbytes() == layer.keys.nbytes + layer.values.nbytes + 2 * 2 * 16 * 4


def test_left_padded_sink_is_the_first_real_token_in_both_paths(gqa, calibrations):
    """Two left-padded sequences (1 and 3 pads): the first real token is kept as computed, the pads and the other
    tokens decoded; the real cache's slots equal the simulated values and the outputs agree."""
    quant = KVQuant(3, calibration=calibrations["llama_gqa"]).bind(gqa)
    k, v = torch.randn(2, 2, 8, 16, generator=G(11)) * 3, torch.randn(2, 2, 8, 16, generator=G(12))
    valid = torch.arange(8) >= torch.tensor([[1], [3]])  # (B, T)
    mask = valid[:, None, None, :] & torch.ones(8, 8, dtype=torch.bool).tril()  # (B, 1, T, T) causal + padding
    fk, fv = quant.fake_kv(k, v, 0, valid)
    for b, first in ((0, 1), (1, 3)):
        assert torch.equal(fk[b, :, first], k[b, :, first]) and torch.equal(fv[b, :, first], v[b, :, first])
        assert not torch.allclose(fk[b, :, :first], k[b, :, :first], atol=1e-3)  # the pads: decoded
    q = torch.randn(2, 4, 8, 16, generator=G(13))
    policy = make_policy("full")
    sim, _ = h2o_attention(Module(Attached(policy, num_layers=1, quant=quant)), q, k, v, mask)
    state = Attached(policy, "real", num_layers=1, quant=quant)
    layer = state.new_cache().layers[0]
    keys, values = layer.update(k, v)
    real, _ = h2o_attention(Module(state), q, keys, values, mask)
    dk, dv = layer.read()
    assert torch.equal(dk[valid[:, None].expand(-1, 2, -1)], fk[valid[:, None].expand(-1, 2, -1)])
    assert torch.allclose(real[valid], sim[valid], atol=1e-6)


def test_quant_none_changes_nothing(gqa):
    assert make_quant("none") is None
    ids = torch.randint(0, 128, (1, 20), generator=G(6))
    policy = make_policy("h2o", budget=0.3)
    with torch.no_grad(), attach(gqa, policy, quant=None):
        a = gqa(ids).logits
    with torch.no_grad(), attach(gqa, policy):
        b = gqa(ids).logits
    assert torch.equal(a, b)


def test_h2o_20_percent_at_4_bits_holds_a_eighteenth_of_the_fp16_cache():
    """Head size 64 (SmolLM2's), group 64: a 4-bit row is 32 code bytes + fp16 min and step = 36 of fp16's 128."""
    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    ids = torch.randint(3, 256, (1, 200), generator=G(7))
    with torch.no_grad():
        with attach(model, make_policy("full"), mode="real") as h:
            full = h.new_cache()
            model(ids, cache=full)
        with attach(model, make_policy("h2o", budget=0.2), mode="real", quant=Uniform(4, 64)) as h:
            small = h.new_cache()
            model(ids, cache=small)
    fp16_full = full.nbytes() // 2  # the tiny model is fp32: the same cache in fp16
    assert small.nbytes() == 2 * 2 * 2 * 40 * 36  # layers x (K, V) x heads x 40 tokens x 36 bytes
    assert small.nbytes() / fp16_full == pytest.approx(0.2 * 36 / 128)  # 1/17.8


# -------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,needle", [
    (dict(name="uniform", bits=5), "quant.bits=5: allowed: 2, 3, 4, 8"),
    (dict(name="kvquant", bits=1, per_channel_keys=False, nonuniform=False), "quant.bits=1"),
    (dict(name="uniform", group_size=0), "quant.group_size=0"),
    (dict(name="kvquant", calibration="/nowhere/x.pt"), "quant.calibration='/nowhere/x.pt': no such file"),
    (dict(name="kvquant", pre_rope="yes", nonuniform=False, per_channel_keys=False), "quant.pre_rope='yes'"),
    (dict(name="int4"), "quant='int4': unknown; allowed: none, uniform, kvquant"),
])
def test_bad_quant_options_fail_with_one_line(kwargs, needle):
    with pytest.raises(QuantError) as e:
        make_quant(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args,needle", [
    (["quant=uniform", "quant.bits=6"], "quant.bits=6: allowed"),
    (["quant=uniform", "quant.group_size=12"], "quant.group_size=12: does not divide the model's head size 16"),
    (["model=tiny-opt", "quant=kvquant", "quant.per_channel_keys=false", "quant.nonuniform=false"],
     "quant.pre_rope=true: the model has no rotary embeddings"),
    (["quant=kvquant", "quant.calibration=/nowhere/cal.pt"], "quant.calibration='/nowhere/cal.pt': no such file"),
    (["quant=uniform", "+quant.foo=1"], "quant.foo: no such option for quant=uniform; allowed: name, bits, group_size"),
])
def test_bad_quant_config_exit_2_before_loading(args, needle, capsys, tmp_path, monkeypatch):
    from h2o.assets import model_spec
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    model_spec._LOADED.clear()
    assert main(["model=tiny-llama", "task=austen_ppl", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and needle in err, err
    assert not model_spec._LOADED and not (tmp_path / "runs").exists()


def test_run_folder_names_the_quantizer():
    from h2o.pipeline.sweep import expand

    base = ["model=tiny-llama", "task=austen_ppl"]
    none, = expand([*base, "quant=none"], True).specs
    uniform, = expand([*base, "quant=uniform", "quant.group_size=16"], True).specs
    assert none.path.name == "0.2" and none.quant is None and "quant" not in none.head()
    assert none.path == expand(base, True).specs[0].path  # quant=none: the folder of old
    assert uniform.path.name == "quant=uniform4,group_size=16" and uniform.head()["quant"]["bits"] == 4
    assert uniform.path.parent == none.path


def test_bench_measures_quantized_variants_beside_the_unquantized_cache():
    """make bench's variants x quant: the KV bytes are the packed rows (36 bytes a 4-bit row of 64 channels)."""
    from h2o.bench.throughput import benchmark

    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    recs = benchmark(model, ["full", "h2o"], [0.2], [64], [3], [1], [], repeats=1, warmup=0, prefill="shared",
                     quants=("none", "uniform4"), verbose=False)
    got = {(r["policy"], r.get("quant", "none")): r["metrics"] for r in recs}
    held = {"full": 66, "h2o": 12}  # 64 prompt tokens + 2 decoded; h2o keeps 20% of 64
    for (policy, quant), m in got.items():
        row = 36 if quant == "uniform4" else 64 * 4  # fp32 tiny model
        assert m["kv_bytes"] == 2 * 2 * 2 * held[policy] * row and m["decode_tok_s"] > 0
    assert got[("h2o", "uniform4")]["vs_full"]["kv_bytes"] == pytest.approx(12 * 36 / (66 * 256))


def test_bench_shared_prefill_forks_the_sink(tmp_path):
    """make bench's shared prefill (a forked full snapshot, batch 2) gives kvquant's cache its sink: the bytes are
    the rows + the sink's fp32 key and value per layer and KV head, per sequence + the constants once."""
    from h2o.bench.throughput import benchmark

    model = tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64)
    cal = fit(model, torch.randint(3, 256, (2, 64), generator=G(15)), bits=(3,))
    torch.save(cal, tmp_path / "cal.pt")
    quant = KVQuant(3, calibration=cal)
    recs = benchmark(model, ["h2o"], [0.2], [64], [3], [2], [], repeats=1, warmup=0, prefill="shared",
                     quants=("kvquant3",), calibration=str(tmp_path / "cal.pt"), verbose=False)
    rows = quant.row_bytes("key", 64) + quant.row_bytes("value", 64)
    assert recs[0]["metrics"]["kv_bytes"] == 2 * 2 * (2 * 12 * rows + 2 * 64 * 4 * 2) + quant.const_bytes()


def test_lm_eval_model_args_set_the_quantizer(tmp_path):
    """``--model_args quant=kvquant,quant_bits=3,...``: the lm-eval model scores under the quantizer; a batch of
    differently long (left-padded) requests equals a hand computation of each request under attach(quant=...)."""
    from lm_eval.api.instance import Instance

    from h2o.assets.model_spec import ModelSpec
    from h2o.tasks.lm_eval_model import H2OLM

    model, tok = ModelSpec("tiny-llama", "tiny:llama").load()
    torch.save(fit(model, torch.randint(3, 256, (2, 64), generator=G(16)), bits=(3,)), tmp_path / "cal.pt")
    args = dict(pretrained=model, tokenizer=tok, policy="h2o", budget=0.3, batch_size=3, add_bos_token=False)
    lm = H2OLM(**args, quant="kvquant", quant_bits=3, quant_calibration=str(tmp_path / "cal.pt"))
    assert lm.quant.describe() == {"quant": "kvquant", "bits": 3, "per_channel_keys": True, "pre_rope": True,
                                   "nonuniform": True, "outliers": True, "sink": True}
    reqs = [("A question:", " one answer"), ("Q:", " a longer second answer here"), ("Why?", " no")]
    got = [ll for ll, _ in lm.loglikelihood([Instance("loglikelihood", {}, r, 0) for r in reqs])]
    plain = [ll for ll, _ in H2OLM(**args).loglikelihood([Instance("loglikelihood", {}, r, 0) for r in reqs])]
    quant = KVQuant(3, calibration=str(tmp_path / "cal.pt"))
    for (ctx, cont), ll, ll_plain in zip(reqs, got, plain):
        c, n = tok.encode(ctx, add_special_tokens=False), tok.encode(cont, add_special_tokens=False)
        ids = torch.tensor([c + n])
        with torch.no_grad(), attach(model, make_policy("h2o", budget=0.3), quant=quant):
            logp = model(ids[:, :-1]).logits.log_softmax(-1)[0, -len(n):]
        assert ll == pytest.approx(float(logp.gather(-1, torch.tensor(n)[:, None]).sum()), abs=1e-3)
        assert abs(ll - ll_plain) > 1e-3  # quantization changed the score: not vacuous
    uniform = H2OLM(**args, quant="uniform", quant_bits=4, quant_group_size=16).quant
    assert (uniform.bits, uniform.group_size) == (4, 16)


def test_decoded_perplexity_matches_one_pass_and_transformers_quantized_cache_runs():
    """Token by token: our evicting cache fed one token at a time gives the one-pass perplexity
    (unquantized: equal; uniform4: to quantization noise); transformers' QuantizedCache (hqq) at 8 bits is the
    unquantized perplexity, at 2 bits it is not, and its bytes are the packed codes + scales + residual."""
    model = tiny_model("llama")
    windows = torch.randint(3, 256, (2, 40), generator=G(17))
    full = make_policy("full")
    for quant in (None, Uniform(4, 16)):
        one_pass = perplexity(model, windows, full, quant, 2)
        fed, step_s, cpu_s, held = decoded_ppl(model, windows, ours_cache(model, full, quant))
        assert fed == pytest.approx(one_pass, rel=1e-4 if quant is None else 1e-2) and step_s > 0 and cpu_s > 0
    plain = perplexity(model, windows, full, None, 2)
    hq8, _, _, bytes8 = decoded_ppl(model, windows, hf_cache(model, "hqq", 8, residual=8, group=16))
    hq2, _, _, bytes2 = decoded_ppl(model, windows, hf_cache(model, "hqq", 2, residual=8, group=16))
    assert hq8 == pytest.approx(plain, rel=1e-2) and abs(hq2 - plain) > 5 * abs(hq8 - plain)
    cfg = model.config
    fp32 = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 40 * 16 * 4  # 40 tokens held, fp32
    assert bytes2 < bytes8 < fp32


def test_streaming_refuses_a_quantized_cache(capsys, tmp_path, monkeypatch):
    """The streaming key shifter rotates stored keys: quant with the streaming task is one line, exit 2, before
    loading; the Streamer itself refuses a policy with quant set."""
    from h2o.assets import model_spec
    from h2o.tasks.streaming import Streamer
    from h2o.pipeline.run import main

    monkeypatch.chdir(tmp_path)
    model_spec._LOADED.clear()
    assert main(["model=tiny-llama", "task=bench_streaming", "policy.budget=16", "quant=uniform",
                 "quant.group_size=16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: quant=uniform4: the streaming task's cache is not quantized") and "\n" not in err
    assert not model_spec._LOADED and not (tmp_path / "runs").exists()
    policy = make_policy("h2o", budget=16)
    policy.quant = Uniform(4, 16)
    with pytest.raises(ValueError, match="quant set"):
        Streamer(tiny_model("llama"), torch.randint(3, 256, (1, 40)), [policy])
