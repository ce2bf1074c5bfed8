"""r_kv (R-KV's rule) at every decoding step (``compress=decode``): both paths agree on every tiny architecture (a
sliding-window one and GQA among them) on a left-padded batch, without a prompt and under a quantized cache, and
equal a naive token-by-token reference (the model's eager attention over a DynamicCache, its logits recorded, the
cache cut by hand to ``total - 1`` before each full step), greedy token for token; a rule reading probabilities
instead of logits differs from it. Its interval form is in tests/test_interval.py (RULES); its options, defaults
and refusals here; its parity with R-KV's reference scoring in tests/test_r_kv_parity.py."""
import dataclasses

import pytest
import torch
from transformers import DynamicCache

from h2o import attach, make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core.policies import PolicyError
from h2o.core.policies.r_kv import RKV
from h2o.core.policies.base import READ_LOGITS
from tests.test_interval import cut_by_hand, layer_masks, rows_of
from tests.two_paths import padded_paths, quantized_paths_agree, without_a_prompt

ARCHS = (*TINY_ARCHS, "mistral")  # mistral: every layer a sliding window of 16 tokens
SMALL = {"window": 2, "kernel": 3}  # the scores decide at these budgets (a window of 8 would hold them whole)


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


def test_both_paths_agree_on_a_padded_batch(model):
    policy = make_policy("r_kv", budget=0.4, compress="decode", **SMALL)
    sim, full, cache = padded_paths(model, policy)
    assert not torch.allclose(sim[:, -8:], full[:, -8:], atol=1e-3)


def test_token_by_token_without_a_prompt_equals_the_simulated_mask(model):
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:30][None]
    sim, real, _ = without_a_prompt(model, make_policy("r_kv", budget=9, compress="decode", **SMALL), x)
    torch.testing.assert_close(real, sim, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compress", ["decode", "interval"])
def test_paths_agree_under_a_quantized_cache(compress):
    from h2o.core.quant import Uniform

    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:40][None]
    policy = make_policy("r_kv", budget=0.3, compress=compress, interval=3 if compress == "interval" else None,
                         **SMALL)
    quantized_paths_agree(tiny_model("llama_gqa"), policy, x, Uniform(4, 8))


# ------------------------------------------------------------------ the naive reference at every step
class ProbsRKV(RKV):
    """A broken r_kv: given the attention probabilities (as every other rule) where R-KV pools logits."""

    name = ""
    reads = RKV.reads - {READ_LOGITS}


def naive_decode(model, policy, prompt: torch.Tensor, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Greedy decoding of ``steps`` tokens after ``prompt`` (1, P) under ``policy`` at every step, literally: eager
    attention over a DynamicCache, its logits (or probabilities) into the rule's state, each layer cut by hand to
    the budget at the prompt's end (less the rule's ``cut_room``) and to ``total - 1`` before a step that finds it
    full. -> (logits (steps, V), tokens)."""
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    Pn = prompt.shape[1]
    cache = DynamicCache()
    with torch.no_grad(), layer_masks(model, True):
        out = model(prompt, cache=cache, use_cache=True, output_attentions=True)
        counts = policy.counts(torch.tensor([Pn]))
        fewer = dataclasses.replace(counts, total=counts.total - 1, heavy=counts.heavy - 1)
        states = []
        for i, (layer, att) in enumerate(zip(cache.layers, out.attentions)):
            acc = policy.new_state(1, n_kv, Pn, prompt.device)
            policy.accumulate_prompt(acc, rows_of(policy, att, i, n_kv), None, None)
            states.append({"pos": torch.arange(Pn).expand(1, n_kv, Pn).clone(), "acc": acc,
                           "counts": fewer if policy.cut_room else counts})
            cut_by_hand(policy, layer, states[-1], Pn - 1, None)
        logits, tokens = [], []
        token = out.logits[:, -1:].argmax(-1)
        for t in range(steps):
            now = Pn + t
            tokens.append(int(token))
            for layer, state in zip(cache.layers, states):
                if state["pos"].shape[-1] >= int(counts.total):  # full: the arriving token evicts one
                    sub = {"pos": state["pos"], "acc": state["acc"], "counts": fewer}
                    cut_by_hand(policy, layer, sub, now - 1, None)
                    state["pos"], state["acc"] = sub["pos"], sub["acc"]
            out = model(token, cache=cache, use_cache=True, output_attentions=True, position_ids=torch.tensor([[now]]))
            logits.append(out.logits[0, -1])
            for i, (state, att) in enumerate(zip(states, out.attentions)):
                state["pos"] = torch.cat([state["pos"], torch.full((1, n_kv, 1), now)], -1)
                state["acc"] = torch.cat([state["acc"], policy.new_state(1, n_kv, 1, prompt.device)], 2)
                policy.accumulate(state["acc"], rows_of(policy, att, i, n_kv))
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits), tokens


def ours(model, policy, ids: torch.Tensor, Pn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (1, T) through both paths, the first Pn the prompt -> (simulated, real) logits (T - Pn, V) of the rows
    from the prompt's last on, less the last."""
    T = ids.shape[1]
    with torch.no_grad():
        with attach(model, policy, prompt_len=Pn):
            sim = model(ids).logits[0, Pn - 1:-1]
        with attach(model, policy, mode="real") as h:
            cache = h.new_cache()
            real = [model(ids[:, :Pn], cache=cache).logits[0, -1:]]
            real += [model(ids[:, t:t + 1], cache=cache).logits[0] for t in range(Pn, T - 1)]
    return sim, torch.cat(real)


@pytest.mark.parametrize("arch", ["llama_gqa", "llama"])
def test_both_paths_equal_a_naive_reference_token_for_token(arch):
    model = tiny_model(arch, seed=2)
    policy = make_policy("r_kv", budget=6, compress="decode", **SMALL)
    prompt = torch.randperm(120, generator=torch.Generator().manual_seed(3))[:14][None] + 1
    logits, tokens = naive_decode(model, policy, prompt, 12)
    ids = torch.cat([prompt, torch.tensor([tokens])], 1)
    sim, real = ours(model, policy, ids, prompt.shape[1])
    torch.testing.assert_close(real[1:], logits[:-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(sim[1:], logits[:-1], atol=1e-4, rtol=0)
    assert real.argmax(-1).tolist() == tokens == sim.argmax(-1).tolist()
    broken, _ = naive_decode(model, ProbsRKV(budget=6, **SMALL).timed("decode"), prompt, 12)
    assert not torch.allclose(broken, logits, atol=1e-3)  # the reference is sharp: logits, not probabilities


# ------------------------------------------------------------------ options
def test_the_reference_codes_defaults():
    p = make_policy("r_kv", compress="interval")
    assert p.describe() == {"policy": "r_kv", "budget": 128, "heavy": 128, "recent": 0, "compress": "interval",
                            "interval": 128, "window": 8, "kernel": 7, "mix_lambda": 0.07, "threshold": 0.5}
    assert make_policy("r_kv").schedule.evicts_each_step  # the API's default timing is every rule's
    assert make_policy("r_kv", compress="interval", interval=16).interval == 16


def test_its_config_is_the_reference_codes(hydra_ctx):
    from hydra import compose
    from hydra.utils import instantiate

    cfg = compose("config", ["task=bb_copa", "policy=r_kv"])
    assert instantiate(cfg.policy).describe() == make_policy("r_kv").describe()
    buffer = compose("config", ["task=bb_copa", "policy=r_kv", "+policy.compress=interval"])
    assert instantiate(buffer.policy).describe() == make_policy("r_kv", compress="interval").describe()


@pytest.mark.parametrize("bad, match", [({"window": 0}, r"^window=0: .*allowed: an int >= 1$"),
                                        ({"kernel": 4}, r"^kernel=4: .*allowed: an odd int >= 1$"),
                                        ({"mix_lambda": 1.5}, r"^mix_lambda=1.5: allowed: a number in \[0, 1\]$"),
                                        ({"threshold": "x"}, r"^threshold='x': allowed: a number in \[-1, 1\]$"),
                                        ({"compress": "interval", "interval": 0}, r"^interval=0: ")])
def test_bad_options_fail_in_one_line(bad, match):
    with pytest.raises(PolicyError, match=match):
        make_policy("r_kv", **bad)


def test_wrappers_refuse_it():
    from h2o.core.policies.per_sequence import PerSequence

    with pytest.raises(PolicyError, match="^inner='r_kv': adakv wraps an evicting policy; allowed: "):
        make_policy("adakv", inner="r_kv")
    with pytest.raises(PolicyError, match="^PerSequence: r_kv keeps its own state per slot"):
        PerSequence([make_policy("r_kv", budget=8), make_policy("h2o", budget=8)])


@pytest.mark.parametrize("share", [0.2, 0.5, 0.9])
def test_redundancy_over_the_held_keys_equals_it_over_every_slot(share):
    """The simulated path's rows hold at most the budget of every position: the similarity taken over the held
    keys only (gathered) gives the figures of the whole S x S one, and 0 where nothing is held."""
    from h2o.core.policies.r_kv import redundancy, redundancy_of

    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 3, 40, 8
    keys = torch.randn(B, H, S, D, generator=g)
    held = torch.rand(B, H, S, generator=g) < share
    held[0, 0] = False  # a head holding nothing
    pos = torch.where(held, torch.arange(S).expand(B, H, S), -1)
    want = redundancy_of(keys, pos, held, 0.5)
    torch.testing.assert_close(redundancy(keys, pos, held, 0.5), want, rtol=0, atol=1e-7)
    assert bool((want[~held] == 0).all()) and torch.allclose(want.sum(-1)[held.any(-1)], torch.tensor(1.0))
