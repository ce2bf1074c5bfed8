"""Both paths on every tiny architecture: the simulated mask and the evicting cache agree token for token."""
import copy

import pytest
import torch

from h2o import PolicyError, attach, make_policy
from h2o.core.policies import BOTH_PATHS, Policy  # BOTH_PATHS: the policies with an evicting cache and a mask
from h2o.assets.models import TINY_ARCHS, tiny_model
from tests.calibrated import ready

ATOL = 1e-4
# dtype-aware: logits of magnitude ~4; fp16 / bf16 round at 2**-11 / 2**-8 relative (paths differ in summation order
# on a GPU; on the CPU they agree exactly)
ATOLS = {torch.float32: ATOL, torch.float16: 1e-2, torch.bfloat16: 5e-2}
VOCAB = 128
# policies with a decoding form (the others are defined at a prompt's end only: without a prompt nothing is cut)
DECODING = [p for p in BOTH_PATHS if p != "full" and Policy.registry[p].schedule.evicts_each_step]


@pytest.fixture(scope="module", params=TINY_ARCHS)
def model(request):
    return tiny_model(request.param)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def plain_logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, **kw).logits


def real_prefill_decode(model, policy, ids, prompt: int, **cache_kw):
    """Prefill ids[:, :prompt] then feed the rest one token at a time through the evicting cache."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache(**cache_kw)
        outs = [model(ids[:, :prompt], cache=cache).logits] if prompt else []
        for t in range(prompt, ids.shape[1]):
            outs.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(outs, 1), cache


def simulated(model, policy, ids, prompt_len=0):
    with torch.no_grad(), attach(model, policy, prompt_len=prompt_len):
        return model(ids).logits


@pytest.mark.parametrize("name", BOTH_PATHS)
def test_full_budget_is_the_unmodified_model(model, name):
    ids = tokens(24, 0)
    ref = plain_logits(model, ids)
    policy = make_policy(name, budget=1.0)
    assert torch.allclose(simulated(model, policy, ids), ref, atol=1e-5)
    real, _ = real_prefill_decode(model, policy, ids, prompt=10)
    assert torch.allclose(real, ref, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("name", DECODING)
def test_token_by_token_cache_equals_simulated_mask(model, name, ratio):
    L = 40
    ids = tokens(L, 1)
    policy = make_policy(name, budget=ratio)
    sim = simulated(model, policy, ids)
    real, cache = real_prefill_decode(model, policy, ids, prompt=0, ref_len=L)
    assert torch.allclose(real, sim, atol=ATOL)
    if name not in ("topk", "topk_h2"):  # masking changes the logits: the test is not vacuous
        assert not torch.allclose(sim, plain_logits(model, ids), atol=1e-3)


@pytest.mark.parametrize("ratio", [0.1, 0.2, 0.5])
@pytest.mark.parametrize("name", [p for p in BOTH_PATHS if p != "full"])
def test_prefill_then_decode_equals_mask_with_prompt_rows_unmasked(model, name, ratio):
    L, P = 48, 30
    ids = tokens(L, 2)
    policy = make_policy(name, budget=ratio)
    rotary = policy.reads_queries or getattr(policy, "needs_calibration", False)  # a rotation undone
    if rotary and model.config.model_type == "opt":  # learned positions: no rotation to undo
        with pytest.raises(PolicyError, match="has no rotary embedding"):
            simulated(model, ready(policy, model), ids, prompt_len=P)
        return
    policy = ready(policy, model)
    sim = simulated(model, policy, ids, prompt_len=P)
    real, cache = real_prefill_decode(model, policy, ids, prompt=P)
    assert torch.allclose(real, sim, atol=ATOL)
    held = {int((layer.pos >= 0).sum(-1).max()) for layer in cache.layers}
    # decode: the budget; prefill: every later token kept; interval (g_kv's default): its last cut and those since
    expected = L if not policy.evicts else policy.schedule.held(int(policy.counts(torch.tensor([P])).total), P, L)
    assert held == {expected}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["h2o", "streaming_llm", "fixed_h2", "topk_h2"])
def test_half_precision_paths_agree(model, name, dtype):
    """fp16/bf16 weights: scores in fp32 from a pre-scaled q; both paths agree within the dtype's tolerance."""
    L, P = 40, 16
    ids = tokens(L, 3)
    half = copy.deepcopy(model).to(dtype)  # the shared fp32 model stays as it is (a round trip would round it)
    policy = make_policy(name, budget=0.2)
    sim = simulated(half, policy, ids, prompt_len=P)
    real, _ = real_prefill_decode(half, policy, ids, prompt=P)
    assert sim.dtype == dtype and torch.isfinite(sim).all()
    assert torch.allclose(real.float(), sim.float(), atol=ATOLS[dtype])
    assert not torch.allclose(sim.float(), plain_logits(half, ids).float(), atol=ATOLS[dtype])


def test_large_scores_stay_finite_in_half_precision():
    """A raw q.k above 65504 is inf in fp16; q is scaled first and the product taken in fp32."""
    from h2o.core.simulate import scores

    q = torch.full((1, 1, 1, 1, 128), 30.0, dtype=torch.float16)
    k = torch.full((1, 1, 1, 128), 30.0, dtype=torch.float16)
    assert torch.isinf((q[0, 0] @ k.transpose(-1, -2)).float()).all()  # 115200 > 65504: the naive product
    out = scores(q, k, 128 ** -0.5)
    assert out.dtype == torch.float32 and out.item() == pytest.approx(900 * 128 ** 0.5, rel=1e-3)


@pytest.mark.parametrize("name", ["h2o", "local", "streaming_llm", "strided_h2", "topk"])
def test_left_padded_batch_equals_each_sequence_alone(model, name):
    padded_batch_equals_alone(model, make_policy(name, budget=0.2), [40, 31, 22], 0.6)


def padded_batch_equals_alone(model, policy, lens: list[int], P: float, seed: int = 10):
    """Sequences of ``lens`` tokens, the first ``P`` of each a prompt: their left-padded batch, prefilled then
    decoded through the evicting cache, gives each sequence's logits alone. Returns (sequences, prompts, alone)."""
    seqs = [tokens(n, seed + n) for n in lens]
    prompts = [int(n * P) for n in lens]
    alone = [real_prefill_decode(model, policy, s, prompt=p)[0] for s, p in zip(seqs, prompts)]
    T, B = max(prompts), len(lens)
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, (s, p) in enumerate(zip(seqs, prompts)):
        ids[b, T - p:], mask[b, T - p:] = s[0, :p], 1
    steps = min(n - p for n, p in zip(lens, prompts))
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache).logits
        for b, p in enumerate(prompts):
            assert torch.allclose(out[b, T - p:], alone[b][0, :p], atol=ATOL)
        for t in range(steps):
            nxt = torch.stack([s[0, p + t] for s, p in zip(seqs, prompts)])[:, None]
            mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
            out = model(nxt, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1, cache=cache).logits
            for b, p in enumerate(prompts):
                assert torch.allclose(out[b, 0], alone[b][0, p + t], atol=ATOL)
        if policy.evicts:  # each sequence holds its own budget; pads are never held
            held = (cache.layers[0].pos >= 0).sum(-1)[:, 0]
            assert held.tolist() == policy.counts(torch.tensor(prompts)).total.tolist()
    return seqs, prompts, alone


def test_simulated_batch_with_padding_equals_batch_one(model):
    policy = make_policy("h2o", budget=0.3)
    a, b = tokens(30, 5), tokens(18, 6)
    ids = torch.zeros(2, 30, dtype=torch.long)
    mask = torch.zeros(2, 30, dtype=torch.long)
    ids[0], mask[0] = a[0], 1
    ids[1, 12:], mask[1, 12:] = b[0], 1
    with torch.no_grad(), attach(model, policy):
        out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    assert torch.allclose(out[0], simulated(model, policy, a)[0], atol=ATOL)
    assert torch.allclose(out[1, 12:], simulated(model, policy, b)[0], atol=ATOL)
    right = torch.zeros(2, 30, dtype=torch.long)  # right padding (lm-eval's layout) gives the same
    right[0], right[1, :18] = a[0], b[0]
    with torch.no_grad(), attach(model, policy):
        out = model(right, attention_mask=torch.stack([torch.ones(30), torch.arange(30) < 18]).long()).logits
    assert torch.allclose(out[1, :18], simulated(model, policy, b)[0], atol=ATOL)


@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_with_the_evicting_cache(model, do_sample):
    """generate() runs the real path; greedy decoding equals the teacher-forced real path on its own output."""
    policy = make_policy("h2o", budget=0.25)
    ids = tokens(32, 7)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        torch.manual_seed(0)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=h.new_cache(), max_new_tokens=12,
                             do_sample=do_sample, min_new_tokens=12, pad_token_id=0)
        held = {int((layer.pos >= 0).sum(-1).max()) for layer in h.cache.layers}
    assert out.shape == (1, 44)
    assert held == {int(policy.counts(torch.tensor([32])).total)}
    if not do_sample:
        forced, _ = real_prefill_decode(model, policy, out[:, :-1], prompt=32)
        assert torch.equal(forced[0, 31:].argmax(-1), out[0, 32:])


def test_cache_bytes_are_the_budget(model):
    """After prefill and after every decode step the tensors hold exactly the budget's keys and values."""
    policy = make_policy("h2o", budget=0.2)
    ids = tokens(60, 8)
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4  # keys + values, fp32
    budget = int(policy.counts(torch.tensor([50])).total)
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids[:, :50], cache=cache)
        assert cache.nbytes() == budget * per_token
        for t in range(50, 60):
            model(ids[:, t:t + 1], cache=cache)
            assert cache.nbytes() == budget * per_token


@pytest.mark.parametrize("mode", ["simulated", "real"])
def test_non_finite_values_fail_naming_layer_and_step(model, mode):
    ids = tokens(12, 9)
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention") and m.layer_idx == 1)
    proj = getattr(layer, "k_proj", None) or getattr(layer, "query_key_value")
    saved = proj.weight.data.clone()
    proj.weight.data[0, 0] = float("nan")
    try:
        with torch.no_grad(), attach(model, make_policy("h2o", budget=0.5), mode=mode) as h:
            kw = {"cache": h.new_cache()} if mode == "real" else {}
            with pytest.raises(FloatingPointError, match="layer 1 at"):
                model(ids, **kw)
    finally:
        proj.weight.data.copy_(saved)


@pytest.mark.parametrize("score", ["mean", "decay"])
@pytest.mark.parametrize("name", ["h2o", "strided_h2"])  # h2_only, fixed_h2: the same classes (test_policies)
def test_score_variants_cache_equals_simulated_mask(model, name, score):
    """Score variants go through the same two hooks in both paths: token by token and prefill + decode agree."""
    L, P = 44, 24
    ids = tokens(L, 3)
    policy = make_policy(name, budget=0.25, score=score, decay=0.5)
    sim = simulated(model, policy, ids)
    real, _ = real_prefill_decode(model, policy, ids, prompt=0, ref_len=L)
    assert torch.allclose(real, sim, atol=ATOL)
    assert not torch.allclose(sim, simulated(model, make_policy(name, budget=0.25), ids), atol=1e-4)  # not vacuous
    sim = simulated(model, policy, ids, prompt_len=P)
    real, _ = real_prefill_decode(model, policy, ids, prompt=P)
    assert torch.allclose(real, sim, atol=ATOL)
