"""triattention's ``per_head_pruning`` (the reference's default mode: one set of positions per KV head, the same in
every layer): the kept set equals the reference's formula computed naively (each layer's query heads standardised,
the maximum over a KV head's group, the mean over layers, the best ``budget - prompt``); through the evicting
cache every layer holds the same positions, the schedule's counts, on a left-padded batch; ours equals the
reference's kept sets and greedy tokens through the golden numbers ``python -m h2o.parity.triattention --reference
DIR --per-head-pruning --golden`` recorded (tests/data/parity_golden/triattention_per_head.json); the simulated
path, ``compress=decode``, rerotate and sliding-window layers are refused in one line; the default is unchanged."""
import json

import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.assets.triattention import calibrate
from h2o.core import engine
from h2o.core.policies import PolicyError
from h2o.core.policies.base import keep_top
from h2o.core.policies.budget import Unsupported
from h2o.core.policies.triattention import TriAttention
from h2o.parity import triattention as parity
from tests.golden import recorded_model
from tests.test_triattention import austen_ids, naive_scores


@pytest.fixture(scope="module", params=("llama_gqa", "gpt_neox"))
def calibrated(request):
    model = tiny_model(request.param, seed=2)
    return model, calibrate(model, austen_ids(), "test", {"model": request.param})


def kv_heads(model) -> int:
    return getattr(model.config, "num_key_value_heads", None) or model.config.num_attention_heads


def test_the_kept_set_is_the_references_formula(calibrated):
    """Random held keys per layer, the same positions in every layer (a prompt of 5, then generated tokens): the
    kept set per KV head is the prompt plus the top ``budget - 5`` of the mean over layers of the group maxima of
    the standardised naive scores, the same for every layer; the per-layer rule (the default) keeps otherwise."""
    model, cal = calibrated
    L, Hkv, D = cal["layers"], kv_heads(model), cal["q_abs_mean"].shape[-1] * 2
    Hq = cal["q_abs_mean"].shape[1]
    g = torch.Generator().manual_seed(4)
    pos = torch.tensor([0, 1, 2, 3, 4, 7, 9, 12, 20, 21, 22, 30, 31, 40, 41, 42, 50, 60])
    S, now, prompt, budget = len(pos), 61, 5, 11
    keys = [torch.randn(Hkv, S, D, generator=g) for _ in range(L)]
    policy = make_policy("triattention", budget=budget, stats=cal, per_head_pruning=True)
    counts = policy.counts(torch.tensor([prompt]))
    P = pos.expand(1, Hkv, S)
    rules = [policy.for_layer(i, L) for i in range(L)]
    prio = policy.layers_priority(rules, [k[None] for k in keys], P, torch.tensor([now]), counts)
    kept = keep_top(prio, P >= 0, counts.total)[0]  # (Hkv, S)
    each = []
    for layer, k in enumerate(keys):
        s = naive_scores(model, cal, layer, k, pos, now)[:, prompt:]  # (Hq, S - prompt)
        s = (s - s.mean(-1, keepdim=True)) / s.std(-1, unbiased=False, keepdim=True).clamp(min=1e-6)
        each.append(s.view(Hkv, Hq // Hkv, -1).amax(1))  # (Hkv, S - prompt)
    mean = torch.stack(each).mean(0)
    torch.testing.assert_close(prio[0, :, prompt:], mean, atol=1e-4, rtol=1e-5)
    for h in range(Hkv):
        want = set(range(prompt)) | {prompt + int(i) for i in mean[h].topk(budget - prompt).indices}
        assert set(torch.nonzero(kept[h]).flatten().tolist()) == want
    alone = [make_policy("triattention", budget=budget, stats=cal).for_layer(i, L) for i in range(L)]
    per_layer = [r.keep(r.priority(P, k[None], torch.tensor([now]), counts), P, P >= 0, counts)[0]
                 for r, k in zip(alone, keys)]
    assert any(not torch.equal(k, kept) for k in per_layer)  # the modes differ on these keys


@pytest.mark.parametrize("compress,interval", [("buffer", 3), ("interval", 4), ("prefill", None)])
def test_every_layer_holds_the_same_positions_within_the_budget(calibrated, compress, interval):
    """A left-padded batch of two through the evicting cache, one token at a time: after each forward every layer
    holds the same positions, each (sequence, KV head) the count the schedule gives its prompt, every prompt token
    among them (a prompt within the budget; the newest token competes with the other generated ones)."""
    model, cal = calibrated
    budget, P_, T = 14, 10, 40
    policy = make_policy("triattention", budget=budget, stats=cal, compress=compress, interval=interval,
                         per_head_pruning=True)
    ids = torch.randint(3, 200, (2, T), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0  # the second row: 3 pads, a prompt of 7
    prompts = [P_, P_ - 3]
    cut = 0
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids[:, :P_], attention_mask=mask[:, :P_], cache=cache)
        for t in range(P_, T):
            model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache)
            pos = cache.positions()
            assert all(torch.equal(p, pos[0]) for p in pos[1:]), t
            for b in range(2):
                fed = prompts[b] + t - P_ + 1
                want = policy.schedule.held(budget, prompts[b], fed)
                held = (pos[0][b] >= 0).sum(-1)
                assert (held == want).all(), (t, b, held, want)
                assert all(((pos[0][b] == p).any(-1)).all() for p in range(prompts[b]))  # the prompt: pinned
                cut += int(want < fed)
    assert (cut > 0) == (compress != "prefill")  # a prompt within the budget: prefill never cuts


def golden_record() -> dict:
    return json.loads(parity.HEAD_RECORD.read_text())


@pytest.fixture(scope="module")
def recorded():
    golden = golden_record()
    assert golden["per_head_pruning"] is True and golden["options"] == parity.OPTIONS
    model = recorded_model(golden, ids=parity.golden_ids()[0].tolist())
    return golden, parity.calibration(model), parity.record_states(model, parity.golden_ids())


def test_the_cuts_and_tokens_equal_the_references_per_head_pruning(recorded):
    """The golden first cuts (3 budgets), later cuts (the slack trigger) and 160 greedy tokens of the reference's
    per_head_pruning (its model patch) are ours; each cut keeps one set per KV head for every layer, other than
    the per-layer mode's (triattention.json): the comparison is not vacuous."""
    golden, cal, states = recorded
    first = parity.first_cuts(cal, states, per_head=True)
    per_layer = json.loads(parity.RECORD.read_text())
    for budget, row in first.items():
        assert row["ours_kept"] == golden["first_cut"][budget]["kept"], budget
        assert all(layer == row["ours_kept"][0] for layer in row["ours_kept"])
        assert row["ours_kept"] != per_layer["first_cut"][budget]["kept"]
    later = parity.later_cuts(cal, states, golden["budgets"][0], per_head=True)
    assert [(r["now"], r["ours"]) for r in later] == [(r["now"], r["kept"]) for r in golden["later_cuts"]]
    assert len(later) > 3
    gen = parity.generation(cal, per_head=True)
    tokens, logp = gen["ours"]
    assert tokens == golden["generation"]["tokens"] != per_layer["generation"]["tokens"]
    assert max(abs(a - b) for a, b in zip(logp, golden["generation"]["logprob"])) < 1e-5
    assert golden["summary"]["first_cut"]["heads_kept_differently"] == 0
    assert golden["summary"]["later_cuts"]["heads_kept_differently"] == 0


def test_the_evicting_caches_cuts_keep_the_references_positions_in_every_layer(recorded):
    """The golden prompt, then one token at a time at compress=buffer: at each of the reference's cuts every layer
    holds the reference's kept positions per KV head (one set for all layers: every layer is checked)."""
    from h2o.parity.golden import load_model

    golden, cal, _ = recorded
    model, ids = load_model(), parity.golden_ids()
    policy = make_policy("triattention", budget=golden["budgets"][0], stats=cal, compress="buffer",
                         interval=parity.EVERY, per_head_pruning=True, **parity.OPTIONS)
    cuts = {r["now"]: r["kept"] for r in golden["later_cuts"]}
    seen = 0
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        model(ids[:, :parity.PROMPT], cache=cache)
        for t in range(parity.PROMPT, ids.shape[1]):
            model(ids[:, t:t + 1], cache=cache)
            if t in cuts and not seen:  # later cuts: the keys are the evicted attention's, not the recorded ones
                held = [[sorted(p for p in head.tolist() if p >= 0) for head in pos[0]] for pos in cache.positions()]
                assert held == cuts[t], t
                seen += 1
    assert seen == 1


# ----------------------------------------------------------------------------------------------- refusals
def test_the_simulated_path_and_other_timings_are_refused_in_one_line(calibrated):
    model, cal = calibrated
    policy = make_policy("triattention", budget=8, stats=cal, per_head_pruning=True)
    assert engine.no_simulated_form(policy).startswith("per_head_pruning=true")
    with pytest.raises(PolicyError, match=r"^policy=triattention: mode=simulated: per_head_pruning=true cuts every "
                                          r"layer at once .*allowed there: per_head_pruning=false; allowed: "
                                          r"mode=real$"):
        with attach(model, policy, mode="simulated"):
            pass
    with pytest.raises(Unsupported, match=r"^compress=decode: per_head_pruning=true .*; allowed: buffer, interval, "
                                          r"prefill \(or per_head_pruning=false\)$"):
        make_policy("triattention", stats=cal, per_head_pruning=True, compress="decode")
    with pytest.raises(PolicyError, match=r"^per_head_pruning=1: allowed: true or false$"):
        make_policy("triattention", per_head_pruning=1)
    from h2o.core.cache import EvictingCache
    from h2o.core.rerotate import KeyShifter

    with pytest.raises(PolicyError, match=r"^rerotate: .*policy=triattention gives heads uneven counts \(pooled: "
                                          r".*every layer after the forward\); allowed: a policy with per-head budgets$"):
        EvictingCache(policy, cal["layers"], rerotate=KeyShifter(model))


def test_a_model_with_sliding_window_layers_is_refused_in_one_line():
    model = tiny_model("gemma3", seed=2)
    cal = calibrate(model, austen_ids(), "test", {"model": "gemma3"})
    policy = make_policy("triattention", budget=6, stats=cal, compress="interval", interval=2, per_head_pruning=True)
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(PolicyError, match=r"^policy=triattention: per_head_pruning=true: the model has "
                                          r"sliding-window layers.*allowed: per_head_pruning=false$"):
        with torch.no_grad(), attach(model, policy, mode="real") as h:
            model(ids, cache=h.new_cache())


def test_the_default_is_the_per_layer_rule_as_before(calibrated):
    """``per_head_pruning=false`` (the default) is the rule of every committed record: the same description (no
    new field), a simulated form, no hook, every layer cutting alone (the golden per-layer tests: test_triattention)."""
    model, cal = calibrated
    default, off = make_policy("triattention", stats=cal), make_policy("triattention", stats=cal, per_head_pruning=False)
    assert default.describe() == off.describe() and "per_head_pruning" not in default.describe()
    assert engine.no_simulated_form(off) is None and TriAttention.real_only is None
    assert off.attach_hooks(model, None) == [] and not off.pooled and off.real_only is None
    assert make_policy("triattention", stats=cal, per_head_pruning=True).describe()["per_head_pruning"] is True
