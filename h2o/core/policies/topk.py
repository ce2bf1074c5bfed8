"""topk: each query sees only the ``k`` keys of highest attention logit *for that query* (paper: Table 8).

Not an eviction policy: it needs the whole cache (an upper-bound baseline). The evicting cache keeps every token
for it and restricts each query; its run records say so (``evicts: false``). ``k`` is the whole budget.
"""
import torch

from .base import NOTHING, Counts, Decoder, Policy, const


def per_seq(n: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) to broadcast against ``like``."""
    return n.view(-1, *[1] * (like.dim() - 1))


def top_rank(score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Rank (0 = best) of each allowed key by ``score`` along the last dim; earlier keys first on ties."""
    key = score.masked_fill(~allowed, -float("inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    return rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))


def top_mask(score: torch.Tensor, allowed: torch.Tensor | None, n: int) -> torch.Tensor:
    """``top_rank(score, allowed) < n`` (``allowed`` None: every key) without a sort: the n-th best value from one
    top-k (sorted: the first place of its minimum counts the keys above it), then the keys above it and, of the
    keys equal to it, the earliest ones (exact with ties)."""
    if n == 0:
        return torch.zeros_like(score, dtype=torch.bool)
    key = score if allowed is None else torch.where(allowed, score, const(-float("inf"), score.dtype, score.device))
    best = key.topk(min(n, key.shape[-1]), -1).values  # (..., n) in descending order
    nth, n_above = best.min(-1, keepdim=True)  # the n-th value; its first place = how many keys are above it
    above, tie = key > nth, key == nth
    first_ties = torch.bitwise_and(tie, tie.cumsum(-1) <= n - n_above)
    chosen = torch.bitwise_or(above, first_ties)  # (bitwise_*: one op each, `|` and `&` are two)
    return chosen if allowed is None else torch.bitwise_and(chosen, allowed)


class Selecting(Decoder):
    """topk / topk_h2 at decoding steps: :func:`top_mask` with the budget as host ints (the same keys as
    ``restrict``; tests check it on random scores with ties). Sequences with different budgets: ``restrict``."""

    def __init__(self, policy, counts: Counts, host: Counts):
        super().__init__(policy, counts)
        total, heavy = host.total.tolist(), host.heavy.tolist()
        self.n = (total[0], heavy[0]) if len(set(total)) == len(set(heavy)) == 1 else None

    def restrict(self, logits, acc, allowed):
        if self.n is None:
            return super().restrict(logits, acc, allowed)
        return self.policy.select(logits, acc, allowed, *self.n)


class TopK(Policy):
    name = "topk"
    evicts = False
    splits = False  # k is the whole budget
    reads = NOTHING  # each decoding query's own logits, which attention computes anyway; a prefill sees all

    def restrict(self, logits, acc, allowed, counts: Counts):
        return allowed & (top_rank(logits, allowed) < per_seq(counts.total, logits))  # (..., q, S)

    def select(self, logits, acc, allowed, total: int, heavy: int):
        """:meth:`restrict` with one budget for the batch, as host ints (:class:`Selecting`)."""
        return top_mask(logits, allowed, total)

    def decoder(self, counts: Counts, host: Counts):
        return Selecting(self, counts, host)
