"""Every accelerator a rule declares (Policy.accelerators: its closed form, its incremental decoder, the Triton row
kernel) equals the plain step (h2o.core.step) on random states: random padding, budgets, prompts, sliding windows
and integer scores (ties everywhere). The plain step is what runs where a rule declares none, here forced by
declaring none."""
import pytest
import torch

from h2o import make_policy
from h2o.core import row_kernel, simulate
from h2o.core.policies.base import ACCELERATORS, CLOSED_FORM, DECODER, ROW_KERNEL, Decoder, Policy
from tests.held_steps import held_after_each_step


def declaring(accelerator: str) -> list[str]:
    """The registered rules (default options, a 20% budget) that declare ``accelerator``."""
    return [name for name, cls in sorted(Policy.registry.items())
            if not cls(budget=0.2).whole_forward and accelerator in cls(budget=0.2).accelerators()]


def plain(monkeypatch, policy) -> None:
    """``policy``'s class declares no accelerator: the step runs."""
    monkeypatch.setattr(type(policy), "accelerators", lambda self: frozenset())


def random_valid(g: torch.Generator, B: int, T: int) -> torch.Tensor:
    """(B, T) bool: random left or right padding per sequence (each keeps a real token)."""
    valid = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        pad = int(torch.randint(0, T // 2, (), generator=g))
        if b % 2:
            valid[b, :pad] = False
        else:
            valid[b, T - pad:] = False
    return valid


def test_every_accelerator_is_declared_by_some_rule():
    for accelerator in ACCELERATORS:
        assert declaring(accelerator), accelerator


def test_a_rule_without_one_runs_the_step(monkeypatch):
    policy = make_policy("strided_h2", budget=0.3)
    assert {DECODER, ROW_KERNEL} <= policy.accelerators()
    plain(monkeypatch, policy)
    counts = policy.counts(torch.tensor([20]))
    assert type(policy.decoding(counts, counts)) is Decoder and not row_kernel.supports(policy)
    local = make_policy("local", budget=0.3)
    assert simulate.closed(local, None)
    plain(monkeypatch, local)
    assert not simulate.closed(local, None)


@pytest.mark.parametrize("name", declaring(CLOSED_FORM))
def test_closed_form_equals_the_step(monkeypatch, name):
    g = torch.Generator().manual_seed(len(name))
    for trial in range(12):
        T = int(torch.randint(4, 40, (), generator=g))
        budget = [0.1, 0.35, 6, 9][trial % 4]
        P = int(torch.randint(0, T // 2 + 1, (), generator=g))
        policy = make_policy(name, budget=budget)
        windows = [None, int(torch.randint(2, T + 1, (), generator=g))] if policy.window_closed_form else [None]
        valid = random_valid(g, 3, T)
        for window in windows:
            allowed = simulate.causal_valid(valid, window)
            fast = simulate.policy_allowed(policy, None, allowed, valid, P, window=window)
            with monkeypatch.context() as m:
                plain(m, policy)
                logits = torch.zeros(3, 1, 1, T, T)
                step = simulate.policy_allowed(policy, logits, allowed, valid, P, window=window)
            fast, step = torch.broadcast_tensors(fast, step)
            if window is not None:  # the rows of real tokens (a pad row's output is not read; on a sliding
                real = valid[:, None, None, :, None]  # layer the two forms give pad rows different masks)
                fast, step = fast & real, step & real
            assert torch.equal(fast, step), (name, budget, T, P, window)


@pytest.mark.parametrize("name", [n for n in declaring(DECODER) if Policy.registry[n].evicts])
def test_decoder_equals_the_step(monkeypatch, name):
    g = torch.Generator().manual_seed(7)
    for trial in range(8):
        prompts = torch.randint(3, 40, (int(torch.randint(1, 4, (), generator=g)),), generator=g).tolist()
        heavy, recent = (int(x) for x in torch.randint(0, 8, (2,), generator=g))
        policy = make_policy(name, heavy=heavy, recent=max(recent, 1))
        chunk_at = int(torch.randint(0, 30, (), generator=g))
        fast, layer = held_after_each_step(policy, prompts, 30, chunk_at, trial)
        assert type(layer.decoder) is not Decoder  # the declared decoder decided
        with monkeypatch.context() as m:
            plain(m, policy)
            step, layer = held_after_each_step(policy, prompts, 30, chunk_at, trial)
        assert type(layer.decoder) is Decoder
        assert all(torch.equal(a, b) for a, b in zip(fast, step)), (name, prompts, heavy, recent, chunk_at)


@pytest.mark.parametrize("name", [n for n in declaring(DECODER) if not Policy.registry[n].evicts])
def test_restricting_decoder_equals_the_step(name):
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        heavy, recent = (int(x) for x in torch.randint(0, 9, (2,), generator=g))
        policy = make_policy(name, heavy=heavy, recent=max(recent, 1))
        counts = policy.counts(torch.tensor([20, 20]))
        S = int(torch.randint(1, 40, (), generator=g))
        logits = torch.randint(-2, 3, (2, 2, 3, 1, S), generator=g).float()  # (B, Hkv, G, q, S)
        acc = torch.randint(0, 3, (2, 2, 1, 1, S), generator=g).float()
        allowed = torch.rand(2, 2, 1, 1, S, generator=g) < 0.8
        fast = policy.decoding(counts, counts).restrict(logits, acc, allowed)
        step = Decoder(policy, counts).restrict(logits, acc, allowed)
        assert torch.equal(*torch.broadcast_tensors(fast, step)), (name, heavy, recent, S)


@pytest.mark.parametrize("name", declaring(ROW_KERNEL))
def test_row_kernel_equals_the_step(monkeypatch, name):
    """Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py)."""
    assert row_kernel.triton is not None, "triton is pinned in the test extra"
    g = torch.Generator().manual_seed(11)
    for trial in range(4):
        T = int(torch.randint(8, 24, (), generator=g))
        P = [0, T // 3][trial % 2]
        window = [None, int(torch.randint(3, T, (), generator=g))][trial // 2]
        policy = make_policy(name, budget=[0.3, 5][trial % 2])
        logits = torch.randint(-3, 4, (3, 2, 2, T, T), generator=g).float()  # integer logits: ties
        valid = random_valid(g, 3, T)
        allowed = simulate.causal_valid(valid, window)
        monkeypatch.setenv("H2O_ROW_KERNEL", "triton")
        fast = simulate.policy_allowed(policy, logits, allowed, valid, P, window=window)
        monkeypatch.setenv("H2O_ROW_KERNEL", "auto")
        with monkeypatch.context() as m:
            plain(m, policy)
            step = simulate.policy_allowed(policy, logits, allowed, valid, P, window=window)
        assert torch.equal(*torch.broadcast_tensors(fast, step)), (name, T, P, window)


def once_rules() -> list[str]:
    """The registered rules with a simulated cache that take ``compress=prefill`` (the prompt's queries aside:
    tests/test_expected_attention.py; a calibration aside: tests/test_triattention.py)."""
    out = []
    for name, cls in sorted(Policy.registry.items()):
        p = cls(budget=0.2)
        if p.evicts and not p.is_full and not p.whole_forward and not p.real_only and not p.reads_queries \
                and not getattr(p, "needs_calibration", False):
            out.append(name)
    return out


@pytest.mark.parametrize("name", once_rules())
def test_compressed_once_equals_the_walk(name):
    """``prefill``'s closed form (schedule_rows.compressed_once) equals the row walk under the same schedule
    (simulate.walk: the one loop, cutting where the schedule says, here never after the prompt) on every row of a
    real token (a pad row's output is not read), with random padding, prompts, windows and integer logits."""
    from h2o.core.schedule_rows import compressed_once
    from h2o.core.step import Forward

    g, dropped = torch.Generator().manual_seed(5), False
    for trial in range(6):
        T = int(torch.randint(8, 30, (), generator=g))
        P = int(torch.randint(1, T, (), generator=g))
        window = [None, int(torch.randint(3, T, (), generator=g))][trial % 2]
        policy = make_policy(name, budget=[0.3, 5][trial // 2 % 2]).timed("prefill")
        valid = random_valid(g, 3, T)
        logits = torch.randint(-3, 4, (3, 2, 2, T, T), generator=g).float()  # (B, Hkv, G, T, T)
        key, value = torch.randn(2, 3, 2, T, 8, generator=g)  # (B, Hkv, T, D) each
        counts = policy.counts(simulate.reference_length(valid, P))
        forward = lambda: Forward(logits, simulate.causal_valid(valid, window), valid, P, counts, window, None,  # noqa
                                  key, value)
        fast, loop = torch.broadcast_tensors(compressed_once(policy, forward()), simulate.walk(policy, forward(), P)[0])
        real = valid[:, None, None, :, None]
        assert torch.equal(fast & real, loop & real), (name, T, P, window)
        assert window is not None or torch.equal(fast, loop), (name, T, P)
        dropped |= bool((simulate.causal_valid(valid, window) & ~fast).any())
    assert dropped, name  # the cut dropped tokens (not vacuous)
