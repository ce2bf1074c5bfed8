"""The real path's prefill (h2o.core.prefill): the fused kernel's output and only the statistics a rule reads, equal
to transformers' eager attention: every row's accumulated attention (READ_ROWS, from the kernel's log-sum-exp), the
last rows' (READ_WINDOW), none (the others); over several blocks of rows, left-padded batches and chunks."""
import pytest
import torch

from h2o import attach, make_policy
from h2o.assets.models import tiny_model
from h2o.core import prefill
from h2o.core.policies.base import READ_ROWS, READ_WINDOW

T, PAD = 300, 37  # more rows than a block of the statistics pass (prefill.STAT_ROWS); the 2nd sequence's left pads


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama_gqa", seed=1)


def batch():
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids, mask


def eager_rows(model, ids, mask):
    """Per layer (B, Hkv, G, T, T): transformers' eager attention probabilities, pad rows zeroed."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        att = model(ids, attention_mask=mask, position_ids=pos, output_attentions=True).attentions
    hkv = model.config.num_key_value_heads
    return [a.view(a.shape[0], hkv, -1, T, T) * mask[:, None, None, :, None] for a in att]


def prefilled(model, policy, ids, mask, chunks):
    """The evicting cache after a prefill of ``ids`` in ``chunks`` (token counts); per layer (acc, pos)."""
    with torch.no_grad(), attach(model, policy, mode="real") as h:
        cache = h.new_cache()
        at = 0
        for n in chunks:
            m = mask[:, :at + n]
            model(ids[:, at:at + n], attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0)[:, at:],
                  cache=cache)
            at += n
    return [(layer.acc, layer.pos) for layer in cache.layers]


def by_position(acc, pos, B, H):
    """acc (B, Hkv, S) of the slots at positions pos -> (B, Hkv, T) by column of the unpadded batch."""
    out = torch.zeros(B, H, T)
    cols = torch.where(pos >= 0, pos + torch.tensor([0, PAD]).view(2, 1, 1), T)  # the column of each slot
    return out.scatter_add_(-1, cols.clamp(max=T - 1), torch.where(pos >= 0, acc, 0.0))


@pytest.mark.parametrize("chunks", [[T], [100, 200]])
@pytest.mark.parametrize("name", ["h2o", "h2o-decay", "snapkv", "tova", "knorm"])
def test_the_statistics_a_rule_reads_equal_eager_attention(model, name, chunks):
    ids, mask = batch()
    probs = eager_rows(model, ids, mask)
    options = {"score": "decay"} if name == "h2o-decay" else {}
    policy = make_policy(name.split("-")[0], budget=1.0, **options)  # 100%: nothing cut, the statistics kept
    valid = mask.bool()
    for (acc, pos), p in zip(prefilled(model, policy, ids, mask, chunks), probs):
        B, H = acc.shape[:2]
        got = by_position(acc, pos, B, H)
        if READ_ROWS in policy.reads and name == "h2o":
            want = p.sum((2, 3))
        elif READ_ROWS in policy.reads:  # decay: a row r steps before the last weighs decay ** r
            after = (valid.long().flip(-1).cumsum(-1).flip(-1) - 1).clamp(min=0)  # real rows after each row
            want = (p * (policy.decay ** after.double()).float()[:, None, None, :, None]).sum((2, 3))
        elif name == "tova":  # the last row, averaged over every query head
            want = p[:, :, :, -1].mean((1, 2))[:, None].expand(B, H, T)
        elif READ_WINDOW in policy.reads:  # snapkv: each forward's last window of rows, / (window x G)
            w = policy.read_window()
            ends = torch.tensor(chunks).cumsum(0).tolist()
            want = sum(p[..., e - w:e, :].sum((2, 3)) for e in ends) / (w * p.shape[2])
        else:  # reads no attention: nothing accumulated
            assert policy.reads.isdisjoint({READ_ROWS, READ_WINDOW}) and not got.any()
            continue
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert want.abs().max() > 1e-3  # not vacuous


def test_the_row_pass_with_the_kernels_log_sum_exp_equals_its_own_softmax(model, monkeypatch):
    """READ_ROWS from the CPU kernel's log-sum-exp (one exp per score) and from each block's softmax (elsewhere)."""
    ids, mask = batch()
    policy = make_policy("h2o", budget=1.0)
    with_lse = prefilled(model, policy, ids, mask, [T])
    fused = prefill.fused
    monkeypatch.setattr(prefill, "fused", lambda *a, **kw: (fused(*a, **{**kw, "lse": False})[0], None))
    without = prefilled(model, policy, ids, mask, [T])
    for (a, _), (b, _) in zip(with_lse, without):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def test_blocks_hold_scores_linear_in_the_prompt():
    """The masked fused calls and the statistics' blocks hold at most prefill.CELLS values: rows x S bounded."""
    for S in (1024, 8192, 131072):
        rows = prefill.block_rows(1, 9, S)
        assert rows * 9 * S <= prefill.CELLS or rows == 1
        assert prefill.block_rows(1, 9, S, prefill.STAT_ROWS) <= prefill.STAT_ROWS


def test_the_guards_probe_is_finite_iff_the_tensor_is():
    """attach.finite_probe (the non-finite guard's per-layer value and the logits' check): NaN, inf and -inf seen,
    also together (inf + -inf), and in fp16 past its range."""
    from h2o.core.attach import finite_probe

    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(finite_probe(x)) and finite_probe(x[:0]) == 0
    for bad in ([float("inf")], [-float("inf")], [float("nan")], [float("inf"), -float("inf")]):
        y = x.clone()
        y[2, 5:5 + len(bad)] = torch.tensor(bad)
        assert not torch.isfinite(finite_probe(y)), bad
    assert torch.isfinite(finite_probe(torch.full((4, 10000), 60000.0, dtype=torch.float16)))
