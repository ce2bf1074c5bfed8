"""The protected set of a pattern + heavy hitters policy (:class:`.combine.WithHeavy`) at decoding steps, kept as
state: the same decisions as :meth:`WithHeavy.priority` without ranking the whole cache at every step.

At the step of arriving token ``t`` the protected set is ``P_t = top_k(H_t, pi_t)``: the ``k`` held tokens of
highest pattern priority ``pi_t`` (distinct: tier, then position). The cache then drops an unprotected token
``e_t`` (or takes an empty slot) and puts ``t`` there. Let ``C = P_t - e_t + t`` (the state after ``placed``).

Claim: if every held token ``w`` outside ``C`` has at least ``k - m`` tokens of ``C`` above it under ``pi_{t+1}``,
then ``P_{t+1} = top_k(C + Z)`` with ``Z`` the ``m`` held tokens outside ``C`` of highest ``pi_{t+1}``: a ``w``
outside ``C + Z`` is also below the ``m`` tokens of ``Z``, so ``k`` tokens are above it. It holds with ``m`` the
held tokens that fall in rank from ``pi_t`` to ``pi_{t+1}`` (the others keep their order): ``w`` was below every
token of ``P_t`` (``|P_t| = k``) and stays below those that did not fall; if ``|P_t| < k`` or ``e_t`` was
protected, ``P_t`` held everything and no ``w`` exists. So a step costs one selection of the ``m`` best outside
``C`` and one of the ``d = |C + Z| - min(k, |H|)`` worst inside (one argmax / argmin for 1), with no sort.

The pattern gives ``m`` per step (``demotions``): strided, none (the token leaving the window is replaced at the
top by the arriving one); fixed, none within a block and the ended block's older tokens when a block starts. The
sizes are counted on the host; when they differ between the sequences of a batch (or after a prefill chunk, a cut,
a new slot) the set is rebuilt from :meth:`WithHeavy.priority`'s ranking (tests/test_decoders.py checks both forms
against it on random states).
"""
from __future__ import annotations

import torch

from .base import Counts, Decoder, const, keep_top, tier_key

LOW, HIGH = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max


class Tiered(Decoder):
    """A tiered pattern alone (strided, fixed) at decoding steps: its order as :func:`tier_key` with the
    per-sequence constants made once; float64 (exact) for :func:`select_slot`, the same slot as ``priority``."""

    def __init__(self, policy, counts: Counts):
        super().__init__(policy, counts)
        self.consts = policy.consts(counts)

    def priority(self, pos, acc, now, tok, held, room):
        return tier_key(*self.policy.tiers(pos, now, self.consts), pos).double()  # (B, H, S)


class Protected(Decoder):
    def __init__(self, policy, counts: Counts, host: Counts):
        super().__init__(policy, counts)
        base, host_base = policy.base.counts(counts.length), policy.base.counts(host.length)
        self.base_counts, self.consts = base, policy.base.consts(base)
        self.keep = (base.total.clamp(max=counts.recent) - 1).clamp(min=0)  # (B,) the arriving token not held yet
        self.k = (host_base.total.clamp(max=host.recent) - 1).clamp(min=0).tolist()  # the same on the host
        self.demoted = policy.base.demotions(host_base)
        self.kept: torch.Tensor | None = None  # (B, H, S) bool: the protected set C (None: rebuild)
        self.size: list[int] = []  # |C| per sequence (host)
        self.step: tuple = ()  # (held, room) of the step being decided
        self.bufs: tuple = ()  # (key, sel, priority) buffers of the step's tensors, made at each rebuild

    def reset(self) -> None:
        self.kept = None

    def priority(self, pos, acc, now, tok, held, room):
        base = self.policy.base
        plan = None if self.kept is None else self.plan(tok, held)
        if plan is None:
            self.kept = keep_top(base.priority(pos, None, now, self.base_counts), pos >= 0, self.keep)
            # buffers of the step's tensors: a where(out=) allocates nothing (one op less each)
            self.bufs = (torch.empty_like(pos), torch.empty_like(pos), torch.empty_like(acc))
        else:
            m, d = plan
            key, sel, _ = self.bufs
            tier_key(*base.tiers(pos, now, self.consts), pos, out=key)  # (B, H, S) int64, the order of pi
            if any(h < pos.shape[-1] for h in held):  # empty slots are never selected
                key.masked_fill_(pos < 0, LOW)
            kept = self.kept
            if m:
                torch.where(kept, const(LOW, torch.int64, key.device), key, out=sel)
                kept.scatter_(-1, sel.argmax(-1, keepdim=True) if m == 1 else sel.topk(m, -1).indices, True)
            if d:
                torch.where(kept, key, const(HIGH, torch.int64, key.device), out=sel)
                worst = sel.argmin(-1, keepdim=True) if d == 1 else sel.topk(d, -1, largest=False).indices
                kept.scatter_(-1, worst, False)
        self.step = (held, room)
        score = self.policy.score(pos, acc, now)
        inf = const(float("inf"), score.dtype, score.device)
        return torch.where(self.kept, inf, score, out=self.bufs[2])  # (B, H, S)

    def plan(self, tok: list[int], held: list[int]) -> tuple[int, int] | None:
        """(m, d) of the step of arriving tokens ``tok`` if every sequence has the same, else None (rebuild)."""
        m = self.demoted(tok)
        ms = {min(m, h - c) for h, c in zip(held, self.size)}
        ds = {c + min(m, h - c) - min(k, h) for h, c, k in zip(held, self.size, self.k)}
        return (ms.pop(), ds.pop()) if len(ms) == 1 and len(ds) == 1 else None

    def placed(self, slot: torch.Tensor) -> None:
        self.kept.scatter_(-1, slot, True)
        held, room = self.step
        # |C| = |P_t| - (e_t was protected: an eviction while everything held was protected) + the arriving token
        self.size = [min(k, h) - (not r and h <= k) + 1 for k, h, r in zip(self.k, held, room)]
