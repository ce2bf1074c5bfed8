"""topk: each query sees only the ``k`` keys of highest attention logit *for that query* (paper: Table 8).

Not an eviction policy: it needs the whole cache (an upper-bound baseline). The evicting cache keeps every token
for it and restricts each query; its run records say so (``evicts: false``). ``k`` is the whole budget.
"""
import torch

from .base import Counts, Policy


def per_seq(n: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) to broadcast against ``like``."""
    return n.view(-1, *[1] * (like.dim() - 1))


def top_rank(score: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Rank (0 = best) of each allowed key by ``score`` along the last dim; earlier keys first on ties."""
    key = score.masked_fill(~allowed, -float("inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    return rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))


class TopK(Policy):
    name = "topk"
    evicts = False

    def restrict(self, logits, acc, allowed, counts: Counts):
        return allowed & (top_rank(logits, allowed) < per_seq(counts.total, logits))  # (..., q, S)
