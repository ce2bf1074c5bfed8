"""Each policy on hand-made attention matrices whose answer is known, against naive re-implementations."""
import math

import pytest
import torch

from h2o import POLICIES, PolicyError, make_policy
from h2o.core.policies import Policy
from h2o.core.policies.h2o import reference_mask
from h2o.core.simulate import policy_allowed


def run_mask(policy, logits, prompt_len=0):
    """logits (B, H, T, T) -> (B, H, T, T) bool rows seen, one KV head per query head."""
    B, H, T, _ = logits.shape
    valid = torch.ones(B, T, dtype=torch.bool)
    idx = torch.arange(T)
    allowed = (idx[None, :] <= idx[:, None])[None, None, None]
    out = policy_allowed(policy, logits[:, :, None], allowed, valid, prompt_len)
    return out.expand(B, H, 1, T, T)[:, :, 0]


def random_logits(T=32, B=2, H=3, seed=0):
    return torch.randn(B, H, T, T, generator=torch.Generator().manual_seed(seed)) * 3


def static_rows(T, K, tier):
    """Naive cache of K tokens: when full, drop the token of lowest (tier(j, i), j), then add token i."""
    rows = torch.zeros(T, T, dtype=torch.bool)
    keep = []
    for i in range(T):
        if len(keep) == K:
            keep.remove(min(keep, key=lambda j: (tier(j, i), j)))
        keep.append(i)
        rows[i, keep] = True
    return rows


@pytest.mark.parametrize("name", [p for p in POLICIES if p != "full" and Policy.registry[p].schedule.evicts_each_step])
@pytest.mark.parametrize("budget", [0.1, 0.25, 7])
def test_budget_respected_and_no_future_visible(name, budget):
    T = 40
    policy = make_policy(name, budget=budget)
    mask = run_mask(policy, random_logits(T))
    K = int(policy.counts(torch.tensor([T])).total)
    seen = mask.sum(-1)  # (B, H, T)
    assert not mask.triu(1).any()
    assert mask.diagonal(dim1=-2, dim2=-1)[..., K:].all() or not policy.evicts  # the query sees itself
    # exactly the budget once full; restricting policies (topk, topk_h2) fill it too
    assert torch.equal(seen, torch.arange(1, T + 1).clamp(max=K).expand_as(seen))


def test_local_is_a_window():
    T, K = 20, 5
    mask = run_mask(make_policy("local", budget=K), random_logits(T))
    i = torch.arange(T)
    expected = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - K)
    assert torch.equal(mask[0, 0], expected)


def test_streaming_llm_keeps_sinks_and_window():
    T, K = 30, 8
    mask = run_mask(make_policy("streaming_llm", budget=K, sinks=4), random_logits(T))
    i = torch.arange(T)
    expected = (i[None, :] <= i[:, None]) & ((i[None, :] < 4) | (i[None, :] > i[:, None] - (K - 4)))
    assert torch.equal(mask[1, 2], expected)


def test_strided_pattern():
    T, K = 40, 10  # window 5, grid of 5 tokens with stride ceil(40 / 5) = 8: positions 0, 8, 16, 24, 32
    policy = make_policy("strided", budget=K)
    mask = run_mask(policy, random_logits(T))
    tier = lambda j, i: 2 if j > i - 5 else (1 if j % 8 == 0 else 0)
    assert torch.equal(mask[0, 0], static_rows(T, K, tier))
    assert mask[0, 0, 39].nonzero().flatten().tolist() == [0, 8, 16, 24, 32, 35, 36, 37, 38, 39]


def test_fixed_pattern():
    T, K = 40, 10  # blocks of 5 (8 blocks); 5 summary slots -> c = max(1, 5 // 8) = 1: the last of each block
    policy = make_policy("fixed", budget=K)
    mask = run_mask(policy, random_logits(T))
    tier = lambda j, i: 2 if j // 5 == i // 5 else (1 if j % 5 == 4 else 0)
    assert torch.equal(mask[1, 1], static_rows(T, K, tier))
    assert mask[1, 1, 37].nonzero().flatten().tolist() == [9, 14, 19, 24, 29, 33, 34, 35, 36, 37]


def naive_h2o(logits, K, recent, score="sum", decay=0.9):
    """Independent H2O: evict the non-recent token of least score, then add the new one. Scores: the summed
    attention (sum), that sum over the steps held counting the arriving one (mean), or a decayed sum (decay)."""
    T = logits.shape[-1]
    rows = torch.zeros(T, T, dtype=torch.bool)
    keep, acc = [], [0.0] * T
    for i in range(T):
        if len(keep) == K:
            old = [j for j in keep if j <= i - recent]
            held = {j: (i - j + 1 if score == "mean" else 1) for j in old}
            keep.remove(min(old, key=lambda j: (acc[j] / held[j], j)))
        keep.append(i)
        rows[i, keep] = True
        p = torch.softmax(logits[i, keep].double(), -1)
        if score == "decay":
            acc = [a * decay for a in acc]
        for j, pj in zip(keep, p.tolist()):
            acc[j] += pj
    return rows


@pytest.mark.parametrize("heavy,recent", [(4, 4), (6, 2), (8, 0), (0, 8), (1, 1)])
def test_h2o_keeps_top_accumulated_scores(heavy, recent):
    logits = random_logits(36, seed=heavy * 10 + recent)
    mask = run_mask(make_policy("h2o", heavy=heavy, recent=recent), logits)
    for b in range(2):
        for h in range(3):
            assert torch.equal(mask[b, h], naive_h2o(logits[b, h], heavy + recent, recent))


@pytest.mark.parametrize("score", ["mean", "decay"])
@pytest.mark.parametrize("heavy,recent", [(4, 4), (6, 2), (8, 0)])
def test_h2o_score_variants_against_naive(score, heavy, recent):
    logits = random_logits(36, seed=heavy * 10 + recent)
    mask = run_mask(make_policy("h2o", heavy=heavy, recent=recent, score=score, decay=0.9), logits)
    summed = run_mask(make_policy("h2o", heavy=heavy, recent=recent), logits)
    assert not torch.equal(mask, summed)  # the variant changes what is kept
    for b in range(2):
        for h in range(3):
            assert torch.equal(mask[b, h], naive_h2o(logits[b, h], heavy + recent, recent, score, 0.9))


def test_score_variants_forget_a_past_heavy_hitter():
    """Token 2 draws all the attention of rows 2-9, token 20 of rows 20 on: the summed score keeps the old one,
    the mean and the decayed scores move to the new one."""
    T = 60
    logits = torch.zeros(1, 1, T, T)
    logits[..., :10, 2] = 8.0
    logits[..., 20:, 20] = 8.0
    kept = {s: run_mask(make_policy("h2o", heavy=1, recent=4, score=s, decay=0.8), logits)[0, 0, -1]
            for s in ("sum", "mean", "decay")}
    assert kept["sum"][2] and not kept["sum"][20]
    assert kept["mean"][20] and not kept["mean"][2] and kept["decay"][20] and not kept["decay"][2]


def test_decay_accumulates_a_block_as_row_by_row():
    """One call over a block of rows (a prefill) equals one call per row (decoding), pad rows skipped."""
    pol = make_policy("strided_h2", budget=8, score="decay", decay=0.7)
    probs = torch.rand(2, 3, 1, 5, 9, generator=torch.Generator().manual_seed(0))  # (B, H, G, r, S)
    valid = torch.tensor([[True] * 5, [False, False, True, True, True]])
    probs = probs * valid[:, None, None, :, None]
    init = torch.rand(2, 3, 9, generator=torch.Generator().manual_seed(1))
    block, rows = init.clone(), init.clone()
    pol.accumulate(block, probs, valid)
    for r in range(5):
        pol.accumulate(rows, probs[..., r:r + 1, :], valid[:, r:r + 1])
    torch.testing.assert_close(block, rows)
    expected = init[1] * 0.7 ** 3 + probs[1, :, 0, 2] * 0.7 ** 2 + probs[1, :, 0, 3] * 0.7 + probs[1, :, 0, 4]
    torch.testing.assert_close(block[1], expected)  # the two pad rows do not decay


def test_h2o_keeps_an_obvious_heavy_hitter_that_local_drops():
    T = 30
    logits = torch.zeros(1, 1, T, T)
    logits[..., 3] = 6.0  # every query attends mostly to token 3
    h2o = run_mask(make_policy("h2o", heavy=2, recent=4), logits)
    local = run_mask(make_policy("local", budget=6), logits)
    assert h2o[0, 0, 3:, 3].all() and not local[0, 0, 10:, 3].any()


def test_h2_only_and_prompt_rows():
    T, P = 30, 12
    logits = random_logits(T)
    policy = make_policy("h2_only", budget=0.25)  # 3 tokens of 12
    mask = run_mask(policy, logits, prompt_len=P)
    i = torch.arange(P)
    assert torch.equal(mask[0, 0, :P, :P], i[None, :] <= i[:, None])  # prompt rows unmasked
    assert (mask[..., P:, :].sum(-1) == 3).all()


def test_topk_each_query_sees_its_best_keys():
    T, k = 20, 4
    logits = random_logits(T)
    mask = run_mask(make_policy("topk", budget=k), logits)
    for i in range(k, T):
        best = logits[1, 2, i, : i + 1].topk(k).indices.sort().values
        assert mask[1, 2, i].nonzero().flatten().tolist() == best.tolist()


def naive_topk_h2(logits, heavy, total):
    """Independent Top-K + H2 for one KV head: logits (G, T, T) of its G query heads -> (G, T, T) bool.

    Row i sees the ``heavy`` keys of highest accumulated attention (earlier first on ties), then the keys of highest
    logit for that query head among the others, ``total`` keys in all; its attention is then added to the scores.
    """
    G, T, _ = logits.shape
    rows = torch.zeros(G, T, T, dtype=torch.bool)
    acc = [0.0] * T
    for i in range(T):
        hitters = sorted(range(i + 1), key=lambda j: (-acc[j], j))[:heavy]
        for g in range(G):
            rest = sorted((j for j in range(i + 1) if j not in hitters), key=lambda j: (-float(logits[g, i, j]), j))
            seen = hitters + rest[:max(total - len(hitters), 0)]
            rows[g, i, seen] = True
        for g in range(G):
            p = torch.softmax(logits[g, i].double().masked_fill(~rows[g, i], -float("inf")), -1)
            for j in range(i + 1):
                acc[j] += float(p[j])
    return rows


@pytest.mark.parametrize("heavy,recent", [(3, 3), (5, 1), (1, 5), (0, 6), (6, 0)])
def test_topk_h2_fills_its_budget_simulated(heavy, recent):
    """Simulated path against the naive reference: heavy hitters first, top logits fill the rest (never fewer
    keys than top-k with the same budget)."""
    T = 24
    logits = random_logits(T, seed=heavy * 7 + recent)
    mask = run_mask(make_policy("topk_h2", heavy=heavy, recent=recent), logits)
    for b in range(2):
        for h in range(3):
            assert torch.equal(mask[b, h], naive_topk_h2(logits[b, h][None], heavy, heavy + recent)[0])
    topk = run_mask(make_policy("topk", budget=heavy + recent), logits)
    assert torch.equal(mask.sum(-1), topk.sum(-1))


@pytest.mark.parametrize("arch", ["llama_gqa", "opt"])
def test_topk_h2_fills_its_budget_real_cache(arch):
    """Real path (the evicting cache, token by token): each step's restriction, recorded with the logits it was
    given, equals the naive reference run on those same logits; GQA included (3 query heads per KV head)."""
    from h2o import attach
    from h2o.assets.models import tiny_model

    model = tiny_model(arch)
    T, n_layers = 20, model.config.num_hidden_layers
    policy = make_policy("topk_h2", heavy=0.2, recent=0.15)  # 4 + 3 of 20 tokens
    calls = []
    for hook in ("restrict", "select"):  # select: the decoding steps' form of restrict (one budget for the batch)
        original = getattr(policy, hook)
        setattr(policy, hook, lambda logits, *rest, f=original: calls.append((logits, f(logits, *rest)))
                or calls[-1][1])
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache(ref_len=T)
        for t in range(T):
            model(ids[:, t:t + 1], cache=cache)
    assert len(calls) == T * n_layers
    for layer in range(n_layers):
        steps = calls[layer::n_layers]  # token t of this layer: logits (1, Hkv, G, 1, t + 1)
        Hkv, G = steps[0][0].shape[1:3]
        logits = torch.full((Hkv, G, T, T), -float("inf"))
        seen = torch.zeros(Hkv, G, T, T, dtype=torch.bool)
        for t, (lg, m) in enumerate(steps):
            logits[:, :, t, :t + 1] = lg[0, :, :, 0]
            seen[:, :, t, :t + 1] = m.expand_as(lg)[0, :, :, 0]
        for kv in range(Hkv):
            assert torch.equal(seen[kv], naive_topk_h2(logits[kv], 4, 7))
        assert torch.equal(seen.sum(-1), torch.arange(1, T + 1).clamp(max=7).expand(Hkv, G, T))


def test_reference_semantics_hand_computed():
    """The paper code's rule, written out by hand for uniform attention, heavy = 2, recent = 1.

    rows 0, 1 < heavy: whole prefix. Scores after them: [1.5, 0.5, 0, 0, 0].
    row 2: top-1 = {0}, itself, band {1, 2}      -> {0, 1, 2}; scores + 1/3 each, zeroed outside {0, 2}
    row 3: top-1 = {0}, itself, band {2, 3}      -> {0, 2, 3}; scores + 1/4 each (unmasked), kept {0, 3}
    row 4: top-1 = {0}, itself, band {3, 4}      -> {0, 3, 4}
    """
    T = 5
    i = torch.arange(T)
    logits = torch.zeros(T, T).masked_fill(i[None, :] > i[:, None], -math.inf)
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 0, 0, 1, 1]])
    assert torch.equal(reference_mask(logits, heavy=2, recent=1).long(), expected)


def test_reference_semantics_checked_once_per_forward():
    """semantics=reference reads the host once per forward (is the input unpadded), not per layer: with the
    non-finite guard, 2 syncs at 2 and at 4 layers (it was 2 + 3 per layer); padding fails in one line."""
    from h2o import attach
    from h2o.assets.models import tiny_model
    from h2o.bench.launches import SYNC, aten_ops

    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    for layers in (2, 4):
        model = tiny_model("llama", num_hidden_layers=layers)
        with torch.no_grad(), attach(model, make_policy("h2o", budget=0.3), semantics="reference"):
            model(ids)
            assert aten_ops(lambda: model(ids))[SYNC] == 2, layers
            mask = torch.ones(1, 24, dtype=torch.long)
            mask[0, :3] = 0
            with pytest.raises(ValueError, match=r"semantics=reference\): needs unpadded input") as e:
                model(ids, attention_mask=mask)
            assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(budget=0.0), "budget=0"), (dict(budget=1.5), "budget=1.5"), (dict(budget=-3), "budget=-3"),
    (dict(heavy=0.6, recent=0.6), "heavy + recent = 1.2"), (dict(heavy=0.1), "give both"),
    (dict(budget="big"), "budget='big'"), (dict(heavy=0.1, recent=3), "two ratios or two token counts"),
])
def test_bad_budgets_fail_with_one_line(kwargs, needle):
    with pytest.raises(PolicyError) as e:
        make_policy("h2o", **kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs, needle", [({"score": "max"}, "score='max'"), ({"score": "decay", "decay": 1.0},
                                                                                    "decay=1.0")])
def test_bad_score_options_fail_with_one_line(kwargs, needle):
    with pytest.raises(PolicyError, match=needle):
        make_policy("h2o", budget=8, **kwargs)


def test_unknown_policy_and_option():
    with pytest.raises(PolicyError, match=f"policy='h3o': unknown; allowed: {', '.join(POLICIES)}$"):
        make_policy("h3o")
    with pytest.raises(PolicyError, match="policy=local: .*unexpected keyword argument 'sinks'"):
        make_policy("local", sinks=4)
    with pytest.raises(PolicyError, match="budget=3 tokens: must be >= sinks"):
        make_policy("streaming_llm", budget=3, sinks=4)


def test_column_key_picks_select_slots_slot():
    """The simulated loop's eviction (first minimum of column_key) is select_slot's on columns in position order:
    ties (quantized priorities) go to the oldest held column, a sequence with room takes a free column."""
    from h2o.core.policies import select_slot
    from h2o.core.simulate import column_key
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        B, H, T = 3, 2, 12
        keep = torch.rand(B, H, T, generator=g) < 0.6
        keep[..., -1] = False  # the arriving column is never held
        prio = torch.randint(0, 3, (B, H, T), generator=g).float()  # many ties
        room = torch.tensor([trial % 2 == 0, False, True])
        pos = torch.arange(T).expand(B, H, T).masked_fill(~keep, -1)
        inf = torch.tensor(float("inf"))
        fill = torch.where(room, -inf, inf).view(B, 1, 1)
        ours = column_key(keep, prio, fill).argmin(-1, keepdim=True)
        theirs = select_slot(prio, pos, keep, room)
        full = ~room
        assert torch.equal(ours[full], theirs[full])  # the same held column dropped
        assert not keep.gather(-1, ours)[room].any()  # room: a free column (dropping it changes nothing)


@pytest.mark.parametrize("name", ["h2o", "strided_h2", "topk_h2"])
@pytest.mark.parametrize("prompt_len", [0, 9])
def test_row_loop_probabilities_are_the_masks_softmax(name, prompt_len):
    """The probabilities the torch row loop hands back (so the layer skips a second T x T softmax) are exactly
    masked_softmax(logits, mask), pad rows and a left-padded sequence included."""
    from h2o.core.simulate import causal_valid, masked_softmax, policy_attention
    logits = torch.randn(2, 2, 3, 30, 30, generator=torch.Generator().manual_seed(1)) * 3  # (B, Hkv, G, T, T)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :5] = False
    mask, probs = policy_attention(make_policy(name, budget=0.3), logits, causal_valid(valid), valid, prompt_len)
    assert probs is not None and torch.equal(probs, masked_softmax(logits, mask))
