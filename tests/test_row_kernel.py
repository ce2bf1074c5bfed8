"""The Triton row kernels (h2o, h2_only, strided_h2, fixed_h2 with score sum, mean, decay; topk_h2) against the torch row loop (its reference); without a GPU it runs under
TRITON_INTERPRET=1 (tests/conftest.py), on CUDA tensors where there is one."""
import pytest
import torch

from h2o import make_policy
from h2o.core import row_kernel, simulate
from h2o.core.policies.per_sequence import PerSequence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def masks(policy, logits, valid, prompt_len, choice, monkeypatch):
    monkeypatch.setenv("H2O_ROW_KERNEL", choice)
    allowed = simulate.causal_valid(valid)
    return simulate.policy_allowed(policy, logits, allowed, valid, prompt_len)


KERNEL_POLICIES = ["h2o", "h2_only", "strided_h2", "fixed_h2"]


CASES = [(name, score, *[(0.3, 0), (7, 6)][(i + j) % 2])  # each policy and score, a ratio budget or a token
         for i, name in enumerate(KERNEL_POLICIES) for j, score in enumerate(["sum", "mean", "decay"])]  # + prompt
CASES += [("topk_h2", None, 0.3, 0), ("topk_h2", None, 7, 6)]  # topk_h2 has no score option


@pytest.mark.parametrize("name,score,budget,prompt_len", CASES)
def test_kernel_equals_the_torch_loop(monkeypatch, name, score, budget, prompt_len):
    """Every policy and score the kernel serves (ratio budget, or token budget after a prompt), left and right
    padding: the same mask row for row."""
    assert row_kernel.triton is not None, "triton is pinned in the test extra"
    T = 28
    logits = torch.randn(3, 2, 2, T, T, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 3
    logits[..., 5] = logits[..., 6]  # tied logits: the earlier key first
    valid = torch.ones(3, T, dtype=torch.bool, device=DEVICE)
    valid[1, :4] = False  # left padding
    valid[2, T - 6:] = False  # right padding
    policy = make_policy(name, budget=budget, **({"score": score, "decay": 0.8} if score else {}))
    assert row_kernel.supports(policy)
    loop = masks(policy, logits, valid, prompt_len, "torch", monkeypatch)
    kernel = masks(policy, logits, valid, prompt_len, "triton", monkeypatch)
    assert torch.equal(loop, kernel), (loop != kernel).nonzero()[:5]
    assert not torch.equal(loop, simulate.causal_valid(valid).expand_as(loop))  # something was evicted


def test_kernel_follows_the_score():
    """The score variants change which tokens the kernel keeps (the parameter is read)."""
    T = 28
    logits = torch.randn(1, 1, 1, T, T, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 3
    valid = torch.ones(1, T, dtype=torch.bool, device=DEVICE)
    kept = {}
    for score in ("sum", "mean", "decay"):
        policy = make_policy("h2o", budget=0.3, score=score, decay=0.5)
        with pytest.MonkeyPatch.context() as mp:
            kept[score] = masks(policy, logits, valid, 0, "triton", mp)
    assert not torch.equal(kept["sum"], kept["mean"]) and not torch.equal(kept["sum"], kept["decay"])


def test_kernel_flag_is_checked(monkeypatch):
    monkeypatch.setenv("H2O_ROW_KERNEL", "cuda")
    with pytest.raises(ValueError, match="H2O_ROW_KERNEL='cuda': allowed: auto, triton, torch"):
        row_kernel.use_kernel(make_policy("h2o"), torch.device("cpu"))
    monkeypatch.setenv("H2O_ROW_KERNEL", "triton")
    with pytest.raises(ValueError, match="not h2o\\+local"):
        row_kernel.use_kernel(PerSequence([make_policy("h2o", budget=0.2), make_policy("local", budget=0.2)]), torch.device("cpu"))
    monkeypatch.setenv("H2O_ROW_KERNEL", "auto")
    assert not row_kernel.use_kernel(make_policy("h2o"), torch.device("cpu"))  # the CPU keeps the torch loop


def test_kernel_launches_do_not_grow_with_the_sequence(monkeypatch):
    """h2o's mask through the kernel: the same aten ops at 16 and 32 tokens (the torch loop adds ~20 per row)."""
    from h2o.bench.launches import aten_ops

    def ops(T: int) -> int:
        logits = torch.randn(1, 1, 1, T, T, generator=torch.Generator().manual_seed(0)).to(DEVICE)
        valid = torch.ones(1, T, dtype=torch.bool, device=DEVICE)
        policy = make_policy("h2o", budget=0.25)
        return sum(aten_ops(lambda: simulate.policy_allowed(policy, logits, simulate.causal_valid(valid), valid,
                                                            0)).values())

    monkeypatch.setenv("H2O_ROW_KERNEL", "triton")
    assert ops(16) == ops(32)
    monkeypatch.setenv("H2O_ROW_KERNEL", "torch")
    assert ops(32) > ops(16) + 10 * 16  # the reference loop: launches per row
