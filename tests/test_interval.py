"""The schedule ``compress=interval`` (kvpress's ``DecodingPress(press, compression_interval=N, target_size=budget)``):
the prompt cut to the budget, then every N generated tokens, after the N-th attended, the cache cut back to the
budget; between cuts nothing is evicted, so it breathes between ``budget`` and ``budget + N``.

Both paths agree for every rule that has a decoding form, on every tiny architecture (a sliding-window one
included), on a left-padded batch, and under a quantized cache; both equal a naive reference written here (the
model's own eager attention and ``DynamicCache``, token by token, cut by hand every N steps with the rule's
priority), greedy token for token; the option is spelled alike in the API, Hydra and lm-eval; a rule without a
decoding form refuses it in one line; the run folder names it."""
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from h2o import attach, make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core.policies import POLICIES, PolicyError
from h2o.core.policies.base import along_slots
from h2o.core.policies.budget import Unsupported
from h2o.core.schedule import Interval
from tests.calibrated import ready
from tests.two_paths import L, P, PADS, left_padded, padded_paths, quantized_paths_agree, without_a_prompt

ARCHS = (*TINY_ARCHS, "mistral")  # mistral: every layer a sliding window of 16 tokens
# every evicting rule with a decoding form (the others refuse: test_rules_without_a_decoding_form_refuse)
RULES = ("adakv", "fixed", "fixed_h2", "g_kv", "h2_only", "h2o", "keydiff", "knorm", "local", "r_kv", "random",
         "scissorhands", "snapkv", "snapkv_d", "streaming_llm", "strided", "strided_h2", "tova",
         "triattention")
# adakv: with its default inner, snapkv (kvpress's registry runs SnapKV under Ada-KV at decoding); over any inner with
# a decoding form it takes it (test_a_pooled_rule_agrees...)
# options that make a rule's scores decide at these tiny budgets (r_kv's window of 8 would hold the whole budget;
# triattention keeps its prompt unscored, here longer than the budget)
SMALL = {"g_kv": {"window": 2}, "r_kv": {"window": 2, "kernel": 3}, "snapkv": {"window": 3, "kernel": 3},
         "snapkv_d": {"window": 3, "kernel": 3}, "adakv": {"window": 3, "kernel": 3},
         "triattention": {"allow_prefill_compression": True}}
REFUSED = ("expected_attention", "full", "h2o_reference", "kvzip", "pyramidkv", "topk", "topk_h2")


def distinct_batch():
    """(2, L) left-padded ids (no token repeats in a row: a per-key score of a repeated token ties exactly at
    layer 0 and an ulp, which differs between a forward of one token and of all, would decide) and mask."""
    return left_padded(torch.stack([torch.randperm(127, generator=torch.Generator().manual_seed(7 + b))[:L] + 1
                                    for b in range(2)]))


def both_paths(model, policy):
    """:func:`tests.two_paths.padded_paths` on the distinct batch."""
    return padded_paths(model, policy, *distinct_batch())


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


@pytest.mark.parametrize("name", RULES)
def test_both_paths_agree_on_a_padded_batch(model, name):
    policy = make_policy(name, budget=0.3, compress="interval", interval=5, **SMALL.get(name, {}))
    if getattr(policy, "needs_calibration", False) and model.config.model_type == "opt":  # no rotation to undo
        with pytest.raises(PolicyError, match="has no rotary embedding"):
            ready(policy, model)
        return
    policy = ready(policy, model)
    sim, full, cache = both_paths(model, policy)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)  # the cuts change what follows
    # L - P = 12 generated tokens: cuts after the 5th and the 10th, then 2 more held
    totals = [int(policy.counts(torch.tensor([P - n])).total) for n in PADS]
    held = cache.held_tokens()[:, :, 0].tolist()
    if model.config.model_type != "mistral" and not policy.pooled:  # a sliding window may hold fewer; heads of a
        # pooled rule (Ada-KV) hold uneven counts
        assert held == [[t + 2 for t in totals]] * len(cache.layers)


@pytest.mark.parametrize("inner", ["h2o", "knorm", "snapkv"])
def test_a_pooled_rule_agrees_in_both_paths(model, inner):
    """Ada-KV over a rule with a decoding form: each cut is one top-k over the layer's heads (uneven counts)."""
    options = {"window": 3, "kernel": 3} if inner == "snapkv" else {}  # kvpress's registry: SnapKV under Ada-KV
    policy = make_policy("adakv", budget=0.3, inner=inner, compress="interval", interval=5, **options)
    sim, full, cache = both_paths(model, policy)
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)


@pytest.mark.parametrize("every", [1, 4])
def test_without_a_prompt_token_by_token_equals_the_simulated_mask(every):
    """No prompt: the first token is the prompt (the cache counts from its first forward), then every ``every``."""
    model = tiny_model("llama_gqa", seed=2)
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:30][None]
    policy = make_policy("h2o", budget=0.2, compress="interval", interval=every)
    sim, real, cache = without_a_prompt(model, policy, x)
    torch.testing.assert_close(real, sim, atol=1e-4, rtol=0)
    total = int(policy.counts(torch.tensor([30])).total)
    assert int(cache.held_tokens().max()) == total + 29 % every


@pytest.mark.parametrize("name", ["h2o", "knorm"])
def test_paths_agree_under_a_quantized_cache(name):
    """Both paths attend to (and rank) the keys a quantized cache holds: logits agree to quantization noise, far
    below what quantization changes (as test_quant's matrix)."""
    from h2o.core.quant import Uniform

    model, quant = tiny_model("llama_gqa"), Uniform(4, 8)
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:40][None]
    policy = make_policy(name, budget=0.2, compress="interval", interval=3)
    quantized_paths_agree(model, policy, x, quant)


# ------------------------------------------------------------------ the naive reference
def grouped_probs(att: torch.Tensor, n_kv: int) -> torch.Tensor:
    """eager attention weights (1, Hq, r, S) -> (1, Hkv, G, r, S)."""
    return att.view(1, n_kv, att.shape[1] // n_kv, *att.shape[2:]).float()


def cut_by_hand(policy, layer, state, now: int, window: int | None) -> None:
    """Keep the rule's budget in one DynamicCache layer: what left the window first, then each head's kept slots
    (``policy.keep`` of its priority, told to its order hook first) gathered in position order."""
    pos, acc, counts = state["pos"], state["acc"], state["counts"]
    held = pos >= 0
    if window is not None:
        held &= pos > now - window
    score = policy.cut_score(acc, layer.keys, held) if policy.reads_keys else acc
    prio = policy.priority(pos.masked_fill(~held, -1), score, torch.tensor([now]), counts)
    policy.cut_order(acc, prio, pos, held, counts)  # the rule's order hook (kvpress's slot order: knorm, keydiff)
    keep = policy.keep(prio, pos, held, counts)  # (1, Hkv, S)
    n = int(keep.sum(-1).max())
    assert bool((keep.sum(-1) == n).all())  # every head keeps as many (a rule with per-head budgets)
    order = keep.long().argsort(dim=-1, descending=True, stable=True)[..., :n].sort(-1).values  # (1, Hkv, n)
    idx = order[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
    layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
    state["pos"], state["acc"] = pos.gather(-1, order), acc.gather(2, along_slots(order, acc))


LAYER_MASKS: dict[int, torch.Tensor] = {}  # a sliding-window model's decoding step: each layer's own mask
LOGITS: dict[int, torch.Tensor] = {}  # each layer's last logits (1, Hq, r, S), for a rule that reads them


def per_layer_eager(module, query, key, value, attention_mask, scaling, **kwargs):
    """transformers' eager attention of the model's own module, the layer's logits recorded in :data:`LOGITS`
    (``query @ key^T * scaling``, the KV heads repeated), and with a sliding window the layer's own mask: after a
    cut the layers hold different slots, and one mask for all layers cannot describe them."""
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], 1)  # (1, Hq, S, D)
    LOGITS[module.layer_idx] = query.float() @ keys.float().transpose(-1, -2) * scaling
    mask = LAYER_MASKS.get(module.layer_idx, attention_mask) if query.shape[-2] == 1 else attention_mask
    return eager(module, query, key, value, mask, scaling=scaling, **kwargs)


@contextmanager
def layer_masks(model, on: bool):
    """The model's eager attention with :data:`LAYER_MASKS` and :data:`LOGITS` inside (``on``), eager again
    after."""
    if not on:
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("per_layer_eager", per_layer_eager)
    AttentionMaskInterface.register("per_layer_eager", eager_mask)
    model.set_attn_implementation("per_layer_eager")
    try:
        yield
    finally:
        model.set_attn_implementation("eager")
        LAYER_MASKS.clear()


def rows_of(policy, att: torch.Tensor, layer: int, n_kv: int) -> torch.Tensor:
    """What the rule accumulates from a layer's forward: the attention weights, or for a rule that reads logits
    (``Policy.reads_logits``) the recorded logits, each (1, Hkv, G, r, S)."""
    return grouped_probs(LOGITS[layer] if policy.reads_logits else att, n_kv)


def naive_interval(model, policy, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, P) under ``policy`` at ``interval`` N, literally:
    transformers' eager attention over a DynamicCache, the attention weights summed per KV head by the rule's
    ``accumulate``, the layers cut by hand at the prompt's end and after every N-th generated token.
    -> (logits (steps, V) of the generated positions, the generated tokens)."""
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    window = getattr(cfg, "sliding_window", None)
    G = cfg.num_attention_heads // n_kv
    Pn = prompt.shape[1]
    cache = DynamicCache()
    logits_rule = policy.reads_logits
    with torch.no_grad(), layer_masks(model, logits_rule):
        out = model(prompt, cache=cache, use_cache=True, output_attentions=True)
        counts = policy.counts(torch.tensor([Pn]))
        states = []
        for i, (layer, att) in enumerate(zip(cache.layers, out.attentions)):
            acc = policy.new_state(1, n_kv, Pn, prompt.device)
            if policy.needs_scores:
                policy.accumulate_prompt(acc, rows_of(policy, att, i, n_kv), None, (Pn - 1 - torch.arange(Pn))[None])
            states.append({"pos": torch.arange(Pn).expand(1, n_kv, Pn).clone(), "acc": acc,
                           "counts": policy.layer_counts(counts, i, len(cache.layers))})
            cut_by_hand(policy, layer, states[-1], Pn - 1, window)
        logits, tokens = [], []
        token = out.logits[:, -1:].argmax(-1)  # (1, 1)
        for t in range(1, steps + 1):
            now = Pn + t - 1
            tokens.append(int(token))
            for i, (layer, state) in enumerate(zip(cache.layers, states)):
                if window is not None:  # what left the window is masked (per head), then dropped at the next cut
                    gone = (state["pos"] <= now - window).repeat_interleave(G, 1)  # (1, Hq, S)
                    low = torch.where(gone, torch.finfo(torch.float32).min, 0.0)
                    LAYER_MASKS[i] = torch.cat([low, torch.zeros(1, low.shape[1], 1)], -1)[:, :, None]
            with layer_masks(model, window is not None and not logits_rule):
                out = model(token, cache=cache, use_cache=True, output_attentions=True,
                            position_ids=torch.tensor([[now]]))
            logits.append(out.logits[0, -1])
            for i, (layer, state, att) in enumerate(zip(cache.layers, states, out.attentions)):
                state["pos"] = torch.cat([state["pos"], torch.full((1, n_kv, 1), now)], -1)
                state["acc"] = torch.cat([state["acc"], policy.new_state(1, n_kv, 1, prompt.device)], 2)
                if policy.needs_scores:
                    policy.accumulate(state["acc"], rows_of(policy, att, i, n_kv))
                if t % policy.interval == 0:
                    cut_by_hand(policy, layer, state, now, window)
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits), tokens


# knorm ranks keys by their norm: a repeated token's keys tie at layer 0 (RoPE keeps the norm), and which copy goes is
# decided by the key's last bit, which on some CPUs differs between a forward of one token and of many (an AMD EPYC:
# k_proj 9.5e-07 apart; docs/results/parity.md). So its sequences are run alone, shaped as the naive loop runs them.
TIED_BY_THE_LAST_BIT = ("knorm",)


def both_paths_greedy(model, policy, x, mask, Pn: int, steps: int):
    """x, mask (B, Pn + steps) left-padded -> (sim logits (B, Pn + steps, V), real logits (B, steps, V): each the
    logits that chose the generated token)."""
    with torch.no_grad():
        with attach(model, policy, prompt_len=Pn):
            sim = model(x, attention_mask=mask).logits
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            real = [model(x[:, :Pn], attention_mask=mask[:, :Pn], cache=cache).logits[:, -1:]]
            real += [model(x[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache).logits
                     for t in range(Pn, Pn + steps - 1)]
    return sim, torch.cat(real, 1)


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming_llm", "knorm", "scissorhands", "r_kv", "snapkv", "g_kv",
                                  "snapkv_d"])
def test_both_paths_equal_a_naive_reference_token_for_token(model, name):
    """Greedy decoding under the naive loop; the generated sequence through both paths (each sequence of a
    left-padded batch; alone for a rule whose ties the last bit decides) gives the same logits, and the same greedy
    token at every step."""
    policy = make_policy(name, budget=0.4, compress="interval", interval=3, **SMALL.get(name, {}))
    Pn, steps = 14, 10
    prompts = [torch.randperm(120, generator=torch.Generator().manual_seed(s))[:Pn - n][None] + 1
               for s, n in zip((3, 4), (0, 3))]  # two prompts, the second 3 tokens shorter
    runs = [naive_interval(model, policy, p, steps) for p in prompts]
    seqs = [torch.cat([p[0], torch.tensor(toks)]) for p, (_, toks) in zip(prompts, runs)]
    if name in TIED_BY_THE_LAST_BIT:
        outs = [both_paths_greedy(model, policy, q[None], torch.ones_like(q[None]), len(p[0]), steps)
                for p, q in zip(prompts, seqs)]
        outs = [(torch.nn.functional.pad(sim, (0, 0, Pn - len(p[0]), 0)), real) for p, (sim, real) in zip(prompts, outs)]
    else:
        x = torch.zeros(2, Pn + steps, dtype=torch.long)
        mask = torch.zeros_like(x)
        for b, q in enumerate(seqs):
            x[b, Pn + steps - len(q):], mask[b, Pn + steps - len(q):] = q, 1
        sim, real = both_paths_greedy(model, policy, x, mask, Pn, steps)
        outs = [(sim[b:b + 1], real[b:b + 1]) for b in range(2)]
    for (logits, toks), (sim, real) in zip(runs, outs):
        naive = torch.cat([torch.zeros_like(logits[:1]), logits[:-1]])  # step 0's from the prompt's forward
        torch.testing.assert_close(real[0, 1:], naive[1:], atol=1e-4, rtol=0)
        torch.testing.assert_close(sim[0, Pn:Pn + steps - 1], logits[:-1], atol=1e-4, rtol=0)
        assert real[0].argmax(-1).tolist() == toks and sim[0, Pn - 1:-1].argmax(-1).tolist() == toks


def test_a_wrong_schedule_differs_from_the_naive_reference():
    """The reference is sharp: the same rule cut every step (interval 1) or every 4 gives other logits."""
    model = tiny_model("llama", seed=2)
    prompt = torch.randperm(120, generator=torch.Generator().manual_seed(3))[:14][None] + 1
    every3, _ = naive_interval(model, make_policy("h2o", budget=0.4, compress="interval", interval=3), prompt, 8)
    for n in (1, 4):
        other, _ = naive_interval(model, make_policy("h2o", budget=0.4, compress="interval", interval=n), prompt, 8)
        assert not torch.allclose(other, every3, atol=1e-3)


# ------------------------------------------------------------------ spelling, refusals, folders
def test_spelled_alike_in_the_api_hydra_and_lm_eval():
    from h2o.assets.policy_config import build_policy, parse

    api = make_policy("h2o", budget=0.2, compress="interval", interval=4)
    assert api.schedule == Interval(4) and api.interval == 4 and api.schedule != Interval(3)
    assert api.describe() == {"policy": "h2o", "budget": 0.2, "heavy": 0.1, "recent": 0.1, "score": "sum",
                              "compress": "interval", "interval": 4}
    name, options = parse("policy=h2o,budget=0.2,compress=interval,interval=4", where="--model_args ")
    assert build_policy(name, "--model_args ", **options).describe() == api.describe()
    assert make_policy("h2o").describe().keys() == {"policy", "budget", "heavy", "recent", "score"}  # today's
    assert make_policy("knorm", compress="interval", interval=2).describe()["interval"] == 2


@pytest.mark.parametrize("name", REFUSED)
def test_rules_without_a_decoding_form_refuse(name):
    with pytest.raises(Unsupported, match=r"^compress=interval: .*; allowed: \w+") as e:
        make_policy(name, compress="interval", interval=4)
    assert "\n" not in str(e.value)
    assert sorted(RULES + REFUSED) == POLICIES  # every rule is on one side


@pytest.mark.parametrize("bad, match", [({"interval": 0}, "interval=0: compress=interval needs"),
                                        ({"interval": "4"}, "interval='4': compress=interval needs"),
                                        ({}, "interval=None: compress=interval needs")])
def test_bad_interval_fails_in_one_line(bad, match):
    with pytest.raises(PolicyError, match=match):
        make_policy("h2o", compress="interval", **bad)
    with pytest.raises(PolicyError, match="interval=4: read only with compress=interval"):
        make_policy("h2o", interval=4)


def test_the_run_folder_names_the_option():
    from hydra import compose, initialize_config_dir

    from h2o.assets.paths import CONF
    from h2o.store.folders import extras

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", ["task=bb_copa", "policy=h2o", "+policy.compress=interval", "+policy.interval=4"])
        today = compose("config", ["task=bb_copa", "policy=h2o"])
    assert extras(cfg, "simulated") == ["compress=interval", "interval=4"]
    assert extras(today, "simulated") == []
