"""pyramidkv: its per-layer budgets against a line-by-line copy of kvpress's PyramidKVPress.get_layer_budget
(Python floats), each layer's kept positions against the naive SnapKV rule at that layer's budget, both paths."""
import pytest
import torch

from h2o import make_policy
from h2o.assets.models import TINY_ARCHS, tiny_model
from tests.test_parity import ids
from tests.test_prefill_methods import L, P, padded_paths
from tests.test_snapkv import eager, held_after, naive_snapkv

OPTS = {"window": 4, "beta": 2}  # a pyramid on short prompts: k / beta >= window


def kvpress_budget(q_len: int, ratio: float, layer: int, layers: int, window=64, beta=20) -> int:
    """kvpress 0.5.5's PyramidKVPress.get_layer_budget (compression_ratio = ``ratio``, the share removed)."""
    max_capacity_prompt = window + q_len * (1 - ratio)
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return max(1, round(q_len * (1 - ratio)))
    steps = (max_num - min_num) / (layers - 1) if layers > 1 else 0.0
    return round(max_num - layer * steps)


@pytest.mark.parametrize("q_len", [24, 100, 1024, 2048, 4096])
@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.8])
@pytest.mark.parametrize("layers,window,beta", [(30, 64, 20), (2, 4, 2), (1, 4, 2), (5, 8, 3)])
def test_layer_budgets_are_kvpress(q_len, ratio, layers, window, beta):
    policy = make_policy("pyramidkv", budget=1 - ratio, window=window, beta=beta)
    counts = policy.counts(torch.tensor([q_len]))
    ours = [int(policy.layer_counts(counts, i, layers).total) for i in range(layers)]
    assert ours == [kvpress_budget(q_len, ratio, i, layers, window, beta) for i in range(layers)]


def test_the_pyramid_applies_and_keeps_about_the_same_total():
    policy = make_policy("pyramidkv", budget=0.75)
    counts = policy.counts(torch.tensor([2048]))
    per = [int(policy.layer_counts(counts, i, 30).total) for i in range(30)]
    assert per[0] > per[-1] and per == sorted(per, reverse=True)
    assert abs(sum(per) - 30 * 0.75 * 2048) <= 30


def test_each_layer_keeps_snapkv_at_its_budget():
    model = tiny_model("llama_gqa", seed=3)
    hkv = model.config.num_key_value_heads
    ctx = ids(1, 40)
    policy = make_policy("pyramidkv", budget=0.7, **OPTS)
    held = held_after(model, policy, ctx)
    n = [kvpress_budget(40, 1 - 0.7, i, len(held), 4, 2) for i in range(len(held))]
    assert n[0] > n[-1]  # the test is not uniform budgets
    for i, attn in enumerate(eager(model, ctx)):
        assert torch.equal(held[i], naive_snapkv(attn[0], n[i], hkv, w=4)), i
        assert not torch.equal(held[i], naive_snapkv(attn[0], n[1 - i], hkv, w=4))  # the other layer's budget


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_both_paths_agree_on_a_padded_batch(arch):
    _, _, cache = padded_paths(tiny_model(arch, seed=2), make_policy("pyramidkv", budget=0.7, **OPTS))
    held = cache.held_tokens()[:, :, 0] - (L - P)  # (layers, B) the prompt's tokens kept
    assert (held[0] > held[-1]).all()
