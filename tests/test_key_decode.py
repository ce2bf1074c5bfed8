"""knorm and keydiff at every decoding step (``compress=decode``): kvpress's ``DecodingPress(press,
compression_interval=1, target_size=n - 1)`` after a prefilling press to ``n - 1``. Both paths hold the same tokens
on every tiny architecture (a sliding-window one included) with a left-padded batch, without a prompt and under a
quantized cache; the held positions at every step equal a literal DecodingPress loop, and broken rules (the highest
norms kept, the prompt cut to the budget before the first step, the anchor including the arriving key) do not;
the timing is spelled alike in Hydra, lm-eval and the API; the rows take the torch loop (the CUDA notice)."""
import pytest
import torch
from transformers import DynamicCache

from h2o import attach, make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from h2o.core import row_kernel
from h2o.core.policies.budget import Unsupported
from h2o.core.policies.keydiff import KeyDiff
from h2o.core.policies.knorm import Knorm
from tests.test_parity import ids
from tests.two_paths import P, PADS, padded_paths, quantized_paths_agree, without_a_prompt

NAMES = ("knorm", "keydiff")
ARCHS = (*TINY_ARCHS, "mistral")  # mistral: every layer a sliding window of 16 tokens


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param, seed=2)


@pytest.mark.parametrize("name", NAMES)
def test_both_paths_agree_on_a_padded_batch(model, name):
    policy = make_policy(name, budget=0.3, compress="decode")
    sim, full, cache = padded_paths(model, policy)  # asserts the real rows agree
    assert not torch.allclose(sim[:, P:], full[:, P:], atol=1e-3)  # eviction changes what follows
    totals = [int(policy.counts(torch.tensor([P - n])).total) for n in PADS]  # each sequence's budget
    assert cache.held_tokens()[:, :, 0].tolist() == [totals] * len(cache.layers)  # held at every step, not more


@pytest.mark.parametrize("name", NAMES)
def test_token_by_token_without_a_prompt_equals_the_simulated_mask(model, name):
    """No token repeats: at layer 0 a repeated token's key norm can tie exactly in one path and differ by an ulp in
    the other (a key computed in a forward of one token or of all), and then the paths drop different keys."""
    x = torch.randperm(128, generator=torch.Generator().manual_seed(1))[:40][None]
    policy = make_policy(name, budget=0.2, compress="decode")
    sim, real, _ = without_a_prompt(model, policy, x)
    with torch.no_grad():
        full = model(x).logits
    torch.testing.assert_close(real, sim, atol=1e-4, rtol=0)
    assert not torch.allclose(sim, full, atol=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_paths_agree_under_a_quantized_cache(name):
    """The step ranks the dequantized keys attention reads, in both paths (as test_quant's matrix: logits agree
    to quantization noise, far below what quantization changes)."""
    from h2o.core.quant import Uniform

    model, quant = tiny_model("llama_gqa"), Uniform(4, 8)
    x = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    policy = make_policy(name, budget=0.2, compress="decode")
    quantized_paths_agree(model, policy, x, quant)


# ------------------------------------------------------------------ kvpress's DecodingPress, literally
def naive_scores(name: str, keys: torch.Tensor) -> list[float]:
    """keys (S, D) of one head -> kvpress's score per key (higher = keep), one key at a time."""
    norms = [float(k.double().norm()) for k in keys]
    if name == "knorm":
        return [-n for n in norms]
    anchor = sum(k.double() / n for k, n in zip(keys, norms)) / len(norms)  # mean unit key, every key held
    return [-float(k.double() @ anchor) / (n * float(anchor.norm())) for k, n in zip(keys, norms)]


def press(name, cache, pos, target: int) -> None:
    """ScorerPress on every layer of ``cache``: each head keeps its ``target`` keys of highest score (in slot
    order; the slots' positions ``pos``, per layer (Hkv, S), move along)."""
    for i, layer in enumerate(cache.layers):
        kept = []
        for h, head in enumerate(layer.keys[0]):  # (S, D)
            s = naive_scores(name, head)
            kept.append(sorted(sorted(range(len(s)), key=lambda j: -s[j])[:target]))
        idx = torch.tensor(kept)  # (Hkv, target)
        gather = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        pos[i] = pos[i].gather(1, idx)


def literal_decoding_press(model, name, context, cont, target: int):
    """kvpress's ``PrefillDecodingPress(press to target, DecodingPress(press, compression_interval=1,
    target_size=target))``: the context prefilled and pressed to ``target`` per head; each token of ``cont`` (one
    at a time, positions L, L + 1, ...) attends the ``target`` held and itself, then the layer's ``target + 1``
    keys are re-scored (the newest among them) and pressed back to ``target``. Returns (logits (m + 1, V), per step
    per layer the positions the token attended (Hkv, target + 1), sorted)."""
    L = context.shape[1]
    cache = DynamicCache()
    with torch.no_grad():
        out = model(context, cache=cache, use_cache=True)
        pos = [torch.arange(L).expand(layer.keys.shape[1], L) for layer in cache.layers]
        press(name, cache, pos, target)
        logits, steps = [out.logits[0, -1:]], []
        for t in range(cont.shape[1]):
            pos = [torch.cat([p, torch.full((p.shape[0], 1), L + t)], 1) for p in pos]
            logits.append(model(cont[:, t:t + 1], cache=cache, position_ids=torch.tensor([[L + t]])).logits[0])
            steps.append([p.sort(-1).values for p in pos])
            press(name, cache, pos, target)
    return torch.cat(logits), steps


def ours(model, policy, context, cont):
    """The evicting cache: the context, then ``cont`` one token at a time. Returns (logits (m + 1, V), per step
    per layer the held positions (Hkv, n), sorted)."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        logits, steps = [model(context, cache=cache).logits[0, -1:]], []
        for t in range(cont.shape[1]):
            logits.append(model(cont[:, t:t + 1], cache=cache).logits[0])
            steps.append([layer.pos[0].sort(-1).values for layer in cache.layers])
    return torch.cat(logits), steps


def literal_topk(model, score, context, cont, target: int):
    """kvpress's own selection in :func:`literal_decoding_press`'s loop: ``score(keys (1, Hkv, S, D)) -> (1, Hkv,
    S)``, each press ``topk(target)`` on the row in the cache's slot order and the kept keys gathered in ``topk``'s
    order (kvpress's ScorerPress); each new token appended after them. Returns the per-step positions attended."""
    L = context.shape[1]
    cache, steps = DynamicCache(), []

    def press_all(pos):
        for i, layer in enumerate(cache.layers):
            idx = score(layer.keys).topk(target, dim=-1).indices  # (1, Hkv, target) in topk order
            gather = idx[..., None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
            pos[i] = pos[i].gather(-1, idx)
        return pos

    with torch.no_grad():
        model(context, cache=cache, use_cache=True)
        pos = press_all([torch.arange(L).expand(1, layer.keys.shape[1], L) for layer in cache.layers])
        for t in range(cont.shape[1]):
            pos = [torch.cat([p, torch.full((*p.shape[:2], 1), L + t)], -1) for p in pos]
            model(cont[:, t:t + 1], cache=cache, position_ids=torch.tensor([[L + t]]))
            steps.append([p[0].sort(-1).values for p in pos])
            pos = press_all(pos)
    return steps


def same_steps(a, b) -> bool:
    return all(torch.equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


class HighNorm(Knorm):  # no name of its own: not registered
    def cut_score(self, acc, keys, held):
        return -super().cut_score(acc, keys, held)


class NoRoom(KeyDiff):
    cut_room = 0  # the prompt cut to the budget, then the first step drops one by the anchor of what was kept


class AnchorWithArriving(KeyDiff):
    def step_score(self, acc, keys, held, pos, counts):
        """The anchor also over the arriving key (one unpadded sequence: the column after the newest held)."""
        col = torch.arange(held.shape[-1])
        last = torch.where(held, col, -1).amax(-1, keepdim=True)
        return super().step_score(acc, keys, held | (col == last + 1), pos, counts)


class Coarse(Knorm):
    """knorm with its score rounded to halves: most keys tie exactly, so which one goes is topk's choice."""

    def cut_score(self, acc, keys, held):
        return torch.round(super().cut_score(acc, keys, held) * 2) / 2


class CoarseOldestFirst(Coarse):
    def step_score(self, acc, keys, held, pos, counts):
        return self.cut_score(acc, keys, held)  # exact ties to select_slot: the oldest goes


@pytest.fixture(scope="module")
def gqa():
    return tiny_model("llama_gqa", seed=3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("target", [6, 19])
def test_held_positions_at_every_step_are_a_literal_decoding_press(gqa, name, target):
    ctx, cont = ids(1, 40), ids(2, 12)
    ref_logits, ref_steps = literal_decoding_press(gqa, name, ctx, cont, target)
    policy = make_policy(name, budget=target + 1, compress="decode")  # the query itself counted
    logits, steps = ours(gqa, policy, ctx, cont)
    assert [[tuple(x.shape) for x in s] for s in steps] == [[(2, target + 1)] * 2] * cont.shape[1]
    assert same_steps(steps, ref_steps)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad(), attach(gqa, policy, prompt_len=40):  # the simulated mask: the same logits
        sim = gqa(torch.cat([ctx, cont[:, :-1]], 1)).logits[0, 39:]
    torch.testing.assert_close(sim, ref_logits[:-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("broken,name", [(HighNorm, "knorm"), (NoRoom, "keydiff")])
def test_a_broken_rule_holds_other_positions(gqa, broken, name):
    ctx, cont = ids(1, 40), ids(2, 12)
    _, ref_steps = literal_decoding_press(gqa, name, ctx, cont, 6)
    _, steps = ours(gqa, broken(budget=7).timed("decode"), ctx, cont)
    assert not same_steps(steps, ref_steps)


def test_exact_ties_go_as_kvpress_topk_on_its_slot_order_decides(gqa):
    """kvpress's slot order (kept keys in topk order, the newest last) decides which tied key goes; ours carries it
    (h2o/core/policies/decoding_press.py): the same positions at every step; the oldest-first rule differs."""
    ctx, cont = ids(1, 40), ids(2, 12)
    coarse = Coarse(budget=7).timed("decode")
    ref = literal_topk(gqa, lambda keys: coarse.cut_score(None, keys, None), ctx, cont, 6)
    _, steps = ours(gqa, coarse, ctx, cont)
    assert same_steps(steps, ref)
    _, oldest = ours(gqa, CoarseOldestFirst(budget=7).timed("decode"), ctx, cont)
    assert not same_steps(oldest, ref)
    with torch.no_grad():  # and the simulated path holds the same
        x = torch.cat([ctx, cont[:, :-1]], 1)
        with attach(gqa, coarse, prompt_len=40):
            sim = gqa(x).logits[0, 39:]
        real, _ = ours(gqa, coarse, ctx, cont)
    torch.testing.assert_close(sim, real[:-1], atol=1e-5, rtol=1e-5)


def test_the_anchor_without_the_arriving_key_is_kvpress_rule(gqa):
    """In the simulated row loop an anchor that also reads the arriving key gives other logits."""
    ctx, cont = ids(1, 40), ids(2, 12)
    ref_logits, _ = literal_decoding_press(gqa, "keydiff", ctx, cont, 6)
    x = torch.cat([ctx, cont[:, :-1]], 1)
    with torch.no_grad(), attach(gqa, AnchorWithArriving(budget=7).timed("decode"), prompt_len=40):
        sim = gqa(x).logits[0, 39:]
    assert not torch.allclose(sim, ref_logits[:-1], atol=1e-3)


# ------------------------------------------------------------------ spellings, refusals, the kernel
@pytest.mark.parametrize("name", NAMES)
def test_decode_is_spelled_alike_in_hydra_lm_eval_and_the_api(hydra_ctx, name):
    from lm_eval.utils import simple_parse_args_string

    from h2o.pipeline.spec import build
    from h2o.pipeline.sweep import _compose
    from h2o.tasks.lm_eval_model import lm_policy

    hydra = build("policy", _compose([f"policy={name}", "policy.compress=decode"]).policy)
    args = simple_parse_args_string(f"pretrained=tiny:llama,policy={name},compress=decode")
    lm = lm_policy(args.pop("policy"), args)
    api = make_policy(name, compress="decode")
    assert args == {"pretrained": "tiny:llama"}
    prefill = make_policy(name).describe()  # kvpress's default, named in the record
    assert prefill["compress"] == "prefill"  # decode is every record's unnamed default (analysis.methods)
    assert hydra.describe() == lm.describe() == api.describe() == {k: v for k, v in prefill.items() if k != "compress"}
    assert (type(hydra), type(lm), hydra.cut_room, lm.cut_room) == (type(api), type(api), 1, 1)
    assert make_policy(name).compress == "prefill" and make_policy(name).cut_room == 0  # kvpress's default kept


@pytest.mark.parametrize("name", ["pyramidkv", "expected_attention"])
def test_the_methods_without_a_decoding_form_still_refuse_it(name):
    with pytest.raises(Unsupported, match=f"compress=decode: {name} (is defined at the end of a prompt only|has no "
                                          f"faithful decoding form)"):
        make_policy(name, compress="decode")


@pytest.mark.parametrize("name", NAMES)
def test_decoding_rows_take_the_torch_loop_with_the_cuda_notice(monkeypatch, name):
    monkeypatch.delenv("H2O_ROW_KERNEL", raising=False)
    monkeypatch.setattr(row_kernel, "NOTICED", set())
    policy = make_policy(name, budget=0.2, compress="decode")
    assert row_kernel.walks_rows(policy) and row_kernel.form_of(policy) is None
    with pytest.warns(RuntimeWarning, match=f"policy={name}: no Triton row kernel form declared"):
        assert not row_kernel.use_kernel(policy, torch.device("cuda"))
    assert f"{name}: no kernel form declared, the torch row loop serves it on CUDA" in row_kernel.coverage()


def test_one_rule_per_sequence_refuses_a_policy_that_ranks_keys():
    from h2o.core.policies import PolicyError
    from h2o.core.policies.per_sequence import PerSequence

    with pytest.raises(PolicyError, match="PerSequence: knorm ranks the held keys; allowed: policies whose state"):
        PerSequence([make_policy("h2o", budget=8), make_policy("knorm", budget=8, compress="decode")])
