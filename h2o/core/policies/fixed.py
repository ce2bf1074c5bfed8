"""fixed: the Sparse Transformer fixed pattern (Child et al. 2019) under a fixed cache budget (paper: Table 2).

Blocks of ``b`` tokens, ``b`` = the budget's recent part: the current block stays whole, and the last ``c``
positions of every earlier block are its "summary" tokens, ``c = max(1, n_heavy // n_blocks)`` with
``n_blocks = ceil(L / b)``, so the summaries fill the heavy part. When the cache is full, tokens that are neither
are dropped first, then the oldest summaries.
"""
import torch

from .base import TIER, Counts, Policy, bcast


class Fixed(Policy):
    name = "fixed"

    def priority(self, pos, acc, now, counts: Counts):
        block = counts.recent.clamp(min=1)  # (B,)
        n_blocks = torch.div(counts.length + block - 1, block, rounding_mode="floor").clamp(min=1)
        c = torch.where(counts.heavy > 0, (counts.heavy // n_blocks).clamp(min=1), 0)
        b = bcast(block)
        current = torch.div(pos, b, rounding_mode="floor") == bcast(torch.div(now, block, rounding_mode="floor"))
        summary = (pos % b) >= b - bcast(c)
        return (2 * current + (summary & ~current)).double() * TIER + pos.double()  # (B, H, S)
