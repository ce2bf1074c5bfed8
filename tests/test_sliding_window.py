"""Sliding-window layers (tiny Gemma-3: one sliding and one global layer, multi-query; Mistral: every layer slides;
Qwen2 with use_sliding_window: one global, one sliding layer), window 16, left-padded batches: `full` is the plain
eager model in both paths, generation through the evicting cache is plain `generate`, every policy is the same in
both paths, and a sliding layer's cache never holds more than its window."""
from contextlib import contextmanager

import pytest
import torch
from transformers import AttentionInterface

from h2o import PolicyError, attach, make_policy
from h2o.core.policies import BOTH_PATHS as REAL_POLICIES  # the policies with an evicting cache and a mask
from h2o.assets.models import SLIDING_ARCHS, SLIDING_WINDOW as W, tiny_model
from h2o.core import attention
from h2o.core.policies import Policy
from tests.calibrated import ready

ATOL = 1e-4
PAD = 8  # the second sequence of each batch is left-padded by this many columns


@pytest.fixture(scope="module", params=SLIDING_ARCHS)
def model(request):
    return tiny_model(request.param)


def batch(T: int, seed: int):
    """ids (2, T), attention mask (2, T): the second sequence left-padded by PAD columns."""
    ids = torch.randint(3, 200, (2, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


def plain(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions(mask)).logits


def simulated(model, policy, ids, mask, prompt_len=0):
    with torch.no_grad(), attach(model, policy, prompt_len=prompt_len):
        return model(ids, attention_mask=mask, position_ids=positions(mask)).logits


def real(model, policy, ids, mask, prompt: int, **cache_kw):
    """Prefill ids[:, :prompt], then one token at a time through the evicting cache; the largest number of
    slots each layer had at any step."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache(**cache_kw)
        outs = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], position_ids=positions(mask[:, :prompt]),
                      cache=cache).logits]
        slots = [layer.keys.shape[-2] for layer in cache.layers]
        for t in range(prompt, ids.shape[1]):
            m = mask[:, :t + 1]
            outs.append(model(ids[:, t:t + 1], attention_mask=m, position_ids=positions(m)[:, -1:],
                              cache=cache).logits)
            slots = [max(s, layer.keys.shape[-2]) for s, layer in zip(slots, cache.layers)]
    return torch.cat(outs, 1), cache, slots


def windows(model):
    return [m.sliding_window if hasattr(m, "sliding_window") else model.config.sliding_window
            for m in model.modules() if type(m).__name__.endswith("Attention")]


def close(a, b, atol=ATOL):
    """Equal on the real tokens of the batch (pad rows are not compared)."""
    return torch.allclose(a[0], b[0], atol=atol) and torch.allclose(a[1, PAD:], b[1, PAD:], atol=atol)


def test_the_tiny_models_slide():
    """The window comes from transformers' own configs: hybrid Gemma-3 and Qwen2, all-sliding Mistral."""
    assert windows(tiny_model("gemma3")) == [W, None]
    assert windows(tiny_model("mistral")) == [W, W]
    assert windows(tiny_model("qwen2")) == [None, W]
    assert tiny_model("gemma3").config.num_key_value_heads == 1  # multi-query; the others grouped-query


def test_full_is_the_plain_model_beyond_the_window(model):
    T = 64
    ids, mask = batch(T, 0)
    ref = plain(model, ids, mask)
    sim = simulated(model, make_policy("full"), ids, mask)
    assert close(sim, ref, 1e-5)
    out, cache, slots = real(model, make_policy("full"), ids, mask, prompt=24)
    assert close(out, ref, 1e-5)
    for w, s, layer in zip(windows(model), slots, cache.layers):
        assert s <= (W if w else T)  # a sliding layer's cache never holds more than its window
        if w:
            assert int((layer.pos >= 0).sum(-1).max()) == W
    # not vacuous: beyond the window the plain model differs from the same model without its window
    with torch.no_grad():
        arch = {"gemma3_text": "gemma3"}.get(model.config.model_type, model.config.model_type)
        no_window = tiny_model(arch, layer_types=["full_attention"] * 2,
                               **({"sliding_window": None} if arch == "mistral" else {}))
        assert not close(plain(no_window, ids, mask), ref, 1e-2)


def test_greedy_generation_equals_plain_generate(model):
    ids, mask = batch(48, 1)
    kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        for name in ("full", "local"):  # local with a budget of the window: the plain model on a sliding layer
            policy = make_policy("full") if name == "full" else make_policy("local", budget=10 * W)
            with attach(model, policy, mode="real") as h:
                out = model.generate(ids, cache=h.new_cache(), **kw)
                slots = [layer.keys.shape[-2] for layer in h.cache.layers]
            assert torch.equal(out, ref), name
            assert all(s <= W for s, w in zip(slots, windows(model)) if w), slots


@pytest.mark.parametrize("budget", [W, 24])
def test_local_with_a_budget_of_the_window_is_the_plain_model_on_mistral(budget):
    """Mistral: every layer slides, so local with budget >= W keeps exactly what the model sees."""
    model = tiny_model("mistral")
    ids, mask = batch(64, 2)
    ref = plain(model, ids, mask)
    policy = make_policy("local", budget=budget)
    assert close(simulated(model, policy, ids, mask), ref)
    assert close(simulated(model, policy, ids, mask, prompt_len=30), ref)
    out, _, slots = real(model, policy, ids, mask, prompt=30)
    assert close(out, ref) and max(slots) <= W
    assert not close(simulated(model, make_policy("local", budget=W - 4), ids, mask), ref, 1e-3)  # not vacuous


@contextmanager
def key_norms_that_differ(model, name: str):
    """knorm ranks the keys' norms; Gemma-3 normalises its keys (RMSNorm, weights ``1 + w``, ``w = 0`` in a
    random model), so every key norm is sqrt(head_dim) up to rounding and knorm's choice is rounding's (which the
    two paths' kernels do differently: the fused prefill, the eager mask). Random weights make the norms differ."""
    norms = [m.k_norm for m in model.modules() if hasattr(m, "k_norm")] if name == "knorm" else []
    saved = [n.weight.data.clone() for n in norms]
    g = torch.Generator().manual_seed(0)
    for n in norms:
        n.weight.data.copy_(torch.rand(n.weight.shape, generator=g) - 0.5)
    try:
        yield
    finally:
        for n, w in zip(norms, saved):
            n.weight.data.copy_(w)


@pytest.mark.parametrize("name", REAL_POLICIES)
def test_every_policy_is_the_same_in_both_paths(model, name):
    """Prefill + decode (left-padded batch) against the simulated mask with the prompt's rows unmasked, and token
    by token from the first token against the simulated mask; a sliding layer holds at most min(budget, W)."""
    with key_norms_that_differ(model, name):
        one_policy_in_both_paths(model, name)


STEPWISE = {"triattention": {"compress": "decode", "allow_prefill_compression": True}}


def one_policy_in_both_paths(model, name):
    T, P = 56, 24
    ids, mask = batch(T, 3)
    every = {"interval": 4} if Policy.registry[name].schedule.takes_interval else {}  # g_kv's
    # 7 and 4 tokens of the prompts, 12 of 40: less than the window (triattention: at every step, every token scored)
    policy = ready(make_policy(name, budget=0.3, **STEPWISE.get(name, every)), model)
    sim = simulated(model, policy, ids, mask, prompt_len=P)
    out, cache, slots = real(model, policy, ids, mask, prompt=P)
    assert close(out, sim)
    budget = policy.counts(torch.tensor([P, P - PAD])).total  # (B,) of each prompt's tokens
    once = policy.compress == "prefill"  # cut once at the prompt's end: what follows is kept (within the window)
    # decode: the budget; interval: the last cut's budget and the tokens since
    held = torch.tensor([policy.schedule.held(int(b), P - pad, T - pad) for b, pad in zip(budget, (0, PAD))])
    limit = held.clamp(max=W) if policy.evicts and not policy.is_full and not once else torch.full((2,), W)
    for w, s, layer in zip(windows(model), slots, cache.layers):
        if w:
            assert s <= W
            assert ((layer.pos >= 0).sum(-1) <= limit[:, None]).all()  # (B, Hkv) held: min(budget, W)
    if once:  # defined at a prompt's end only: no form from the first token on
        return
    one = ids[:1, :40]
    sim = simulated(model, policy, one, torch.ones_like(one))
    out, _, _ = real(model, policy, one, torch.ones_like(one), prompt=1, ref_len=40)
    assert torch.allclose(out, sim, atol=ATOL)
    if name not in ("full", "topk", "topk_h2"):  # the policy drops tokens inside the window: not vacuous
        assert not torch.allclose(sim, simulated(model, make_policy("full"), one, torch.ones_like(one)), atol=1e-3)


def test_ignoring_the_window_is_caught():
    """The checks above fail for an attention function that drops the window (the bug they guard against)."""
    model = tiny_model("gemma3")
    ids, mask = batch(64, 0)
    ref = plain(model, ids, mask)

    def windowless(module, *args, sliding_window=None, **kwargs):
        return attention.h2o_attention(module, *args, **kwargs)

    AttentionInterface.register(attention.NAME, windowless)
    try:
        assert not close(simulated(model, make_policy("full"), ids, mask), ref, 1e-2)
        assert not close(real(model, make_policy("full"), ids, mask, prompt=24)[0], ref, 1e-2)
    finally:
        AttentionInterface.register(attention.NAME, attention.h2o_attention)
    assert close(simulated(model, make_policy("full"), ids, mask), ref, 1e-5)


def test_softcap_is_honoured_in_both_paths():
    """Gemma-2 passes its attention logit soft-capping (tanh(x / c) * c): full equals the plain model."""
    from transformers import Gemma2Config

    from h2o.assets.models import tiny_config
    base = tiny_config("gemma3")
    cfg = Gemma2Config(**{k: getattr(base, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                                         "query_pre_attn_scalar", "sliding_window",
                                                         "pad_token_id", "bos_token_id", "eos_token_id")},
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                       attn_logit_softcapping=0.5, initializer_range=0.1)
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids, mask = batch(40, 4)
    ref = plain(model, ids, mask)
    assert close(simulated(model, make_policy("full"), ids, mask), ref, 1e-5)
    assert close(real(model, make_policy("full"), ids, mask, prompt=20)[0], ref, 1e-5)
    model.config.attn_logit_softcapping = None  # not vacuous: the cap changes the logits
    for m in model.modules():
        if hasattr(m, "attn_logit_softcapping"):
            m.attn_logit_softcapping = None
    assert not close(plain(model, ids, mask), ref, 1e-3)


@pytest.mark.parametrize("setting,needle", [
    (dict(attention_chunk_size=8), "chunked attention"),
    (dict(use_bidirectional_attention=True), "bidirectional attention"),
])
def test_unsupported_settings_are_refused_at_attach(setting, needle):
    model = tiny_model("gemma3", **setting)
    with pytest.raises(PolicyError, match=needle) as e:
        with attach(model, make_policy("full")):
            pass
    assert "\n" not in str(e.value) and "gemma3" in str(e.value)
    model = tiny_model("gemma3")
    with pytest.raises(PolicyError, match="policy=h2o_reference: the paper code's rule has no sliding window"):
        with attach(model, make_policy("h2o"), semantics="reference"):
            pass
    model.train()
    model.config.attention_dropout = 0.1
    with pytest.raises(PolicyError, match="attention dropout 0.1 in training mode"):
        with attach(model, make_policy("full")):
            pass


def tiny_gpt_oss():
    """GPT-OSS: alternating sliding (window 16) and global layers, learned sink logits (drawn large enough to
    matter), mixture-of-experts MLP."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                       num_experts_per_tok=1, sliding_window=W, pad_token_id=0, initializer_range=0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.data = torch.randn(m.sinks.shape) * 2
    return model


@pytest.mark.parametrize("name", ["full", "h2o", "streaming_llm"])
def test_learned_sinks_are_honoured_in_both_paths(name):
    """GPT-OSS's s_aux: one more logit per query head in the softmax's denominator. full is the plain model;
    a policy is the same in both paths; the sinks change the logits (not vacuous)."""
    model = tiny_gpt_oss()
    assert windows(model) == [W, None]
    ids, mask = batch(48, 5)
    policy = make_policy(name, budget=0.3)
    sim = simulated(model, policy, ids, mask, prompt_len=20)
    out, _, slots = real(model, policy, ids, mask, prompt=20)
    assert close(out, sim) and slots[0] <= W
    if name == "full":
        ref = plain(model, ids, mask)
        assert close(sim, ref, 1e-5) and close(simulated(model, policy, ids, mask), ref, 1e-5)
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.data.fill_(-float("inf"))  # no sink
        assert not close(plain(model, ids, mask), ref, 1e-3)


@pytest.mark.parametrize("name,score,budget,prompt_len,T", [  # each kernel branch once (the interpreter is slow)
    ("h2o", "mean", 0.3, 0, 24), ("fixed_h2", "decay", 7, 6, 24), ("topk_h2", None, 0.4, 0, 16)])
def test_row_kernel_honours_the_window(monkeypatch, name, score, budget, prompt_len, T):
    """The Triton kernel (under TRITON_INTERPRET=1 without a GPU) against the torch loop with a window of 8 over
    T rows, left and right padding: the same rows, and the window changes the decisions (not vacuous)."""
    from h2o.core import row_kernel, simulate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    window = 8 if T > 16 else 6
    logits = torch.randn(3, 2, 2, T, T, generator=torch.Generator().manual_seed(4)).to(device) * 3
    valid = torch.ones(3, T, dtype=torch.bool, device=device)
    valid[1, :4] = False
    valid[2, T - 6:] = False
    policy = make_policy(name, budget=budget, **({"score": score, "decay": 0.8} if score else {}))
    assert row_kernel.supports(policy)
    rows = {}
    for choice, w in (("torch", window), ("triton", window), ("torch", None)):
        monkeypatch.setenv("H2O_ROW_KERNEL", choice)
        allowed = simulate.causal_valid(valid, w)
        rows[choice, w] = simulate.policy_allowed(policy, logits, allowed, valid, prompt_len, window=w)
    assert torch.equal(rows["torch", window], rows["triton", window])
    assert not torch.equal(rows["torch", window], rows["torch", None] & simulate.causal_valid(valid, window))


@pytest.mark.parametrize("name,budget", [("local", 5), ("local", 0.2), ("streaming_llm", 9), ("streaming_llm", 0.2),
                                         ("strided", 8), ("strided", 0.3)])
def test_closed_forms_stay_exact_with_the_window(monkeypatch, name, budget):
    """local, streaming_llm and strided keep their closed form on sliding layers (``Policy.closed_form = "sliding"``):
    equal to the row loop, which makes the decisions step by step, with and without a prompt, left padding."""
    from h2o.core import simulate

    T, window = 40, 12
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :7] = False
    policy = make_policy(name, budget=budget)
    logits = torch.randn(2, 1, 1, T, T, generator=torch.Generator().manual_seed(6))
    for prompt_len in (0, 20):
        allowed = simulate.causal_valid(valid, window)
        closed = simulate.policy_allowed(policy, logits, allowed, valid, prompt_len, window=window)
        monkeypatch.setattr(type(policy), "closed_form", "global")
        loop = simulate.policy_allowed(policy, logits, allowed, valid, prompt_len, window=window)
        monkeypatch.undo()
        assert torch.equal(closed.expand_as(loop), loop), prompt_len
        assert not torch.equal(loop, allowed.expand_as(loop))  # the policy drops tokens inside the window


def test_quantized_cache_on_a_sliding_layer():
    """A quantized cache (uniform 4-bit) on Gemma-3's sliding layer: both paths agree to quantization noise and
    the sliding layer holds at most its window."""
    from h2o.core.quant import Uniform

    model = tiny_model("gemma3")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    policy, quant = make_policy("full"), Uniform(4, 8)
    with torch.no_grad():
        with attach(model, policy, quant=quant):
            sim = model(ids).logits
        with attach(model, policy, mode="real", quant=quant) as h:
            cache = h.new_cache(ref_len=40)
            out = torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(40)], 1)
    effect = (sim - plain(model, ids, torch.ones_like(ids))).abs()
    assert (out - sim).abs().max() < 0.01 * effect.max() and effect.max() > 1e-2
    assert [layer.keys.shape[-2] for layer in cache.layers] == [W, 40]


def test_learned_sinks_weigh_the_prompts_scores_in_both_paths():
    """compress=prefill: the prompt rows' attention that snapkv's cut ranks has GPT-OSS's sink logit in its softmax
    in both paths (the simulated closed form had none: 1.8 apart in the logits here)."""
    from tests.two_paths import padded_paths
    padded_paths(tiny_gpt_oss(), make_policy("snapkv", budget=0.3, compress="prefill", window=3, kernel=3))
