"""fixed: the Sparse Transformer fixed pattern (Child et al. 2019) under a fixed cache budget (paper: Table 2).

Blocks of ``b`` tokens, ``b`` = the budget's recent part: the current block stays whole, and the last ``c``
positions of every earlier block are its "summary" tokens, ``c = max(1, n_heavy // n_blocks)`` with
``n_blocks = ceil(L / b)``, so the summaries fill the heavy part. When the cache is full, tokens that are neither
are dropped first, then the oldest summaries.
"""
import torch

from .base import NOTHING, Counts, Policy, bcast, tiered
from .protected import Tiered


def pattern(counts: Counts) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) block size ``b`` and (B,) summary tokens per block ``c``."""
    block = counts.recent.clamp(min=1)
    n_blocks = torch.div(counts.length + block - 1, block, rounding_mode="floor").clamp(min=1)
    return block, torch.where(counts.heavy > 0, (counts.heavy // n_blocks).clamp(min=1), 0)


class Fixed(Policy):
    name = "fixed"
    reads = NOTHING  # positions alone
    closed_form = "global"  # positions alone (on a sliding-window layer the row loop serves)

    def priority(self, pos, acc, now, counts: Counts):
        return tiered(*self.tiers(pos, now, self.consts(counts)), pos)  # (B, H, S)

    def consts(self, counts: Counts) -> tuple:
        """What :meth:`tiers` reads per sequence: block (B,), block and its first summary offset (B, 1, 1)."""
        block, c = pattern(counts)
        return block, bcast(block), bcast(block - c)

    def tiers(self, pos, now, consts):
        """(B, H, S) bool each: the current block (tier 2, the newest tokens); summaries (tier 1 outside it)."""
        block, b, first = consts
        current = torch.div(pos, b, rounding_mode="floor") == bcast(torch.div(now, block, rounding_mode="floor"))
        return current, pos % b >= first

    def decoder(self, counts: Counts, host: Counts):
        return Tiered(self, counts)

    kernel_pattern = 2  # the row kernel's protected set of this pattern plus heavy hitters (KernelForm.pattern)

    def kernel_consts(self, counts: Counts) -> list[torch.Tensor]:
        """The row kernel's per-sequence constants (B,) each: block, summaries per block, (unused) 0."""
        block, c = pattern(counts)
        return [block, torch.minimum(c, block), torch.zeros_like(block)]

    def demotions(self, counts: Counts):
        """Host: how many held tokens outside the kept set can rank above what it keeps, per step (see
        :mod:`.protected`), for the arriving positions ``now`` (B,): when ``now`` starts a block, the older
        tokens of the block that ends fall from the top tier (up to ``b - 1``); within a block nothing moves."""
        blocks = pattern(counts)[0].tolist()
        return lambda now: max((b - 1) if n % b == 0 else 0 for n, b in zip(now, blocks))

    def held_rows(self, pos, now, counts: Counts, first: int):
        """Closed form of the eviction sequence (the top-priority rule does not hold: a dropped summary would
        outrank the block that just ended). The current block is always held; past blocks hold the newest ``S``
        summaries and the newest ``Z`` other tokens, where the summaries held follow
        ``S(i) = min(S(i-1) + new(i), K - 1 - cur(i))``, i.e. ``S = N + min(0, cummin(K - 1 - cur - N))``
        with ``N`` the summaries of the past blocks and ``cur`` the older tokens of the current block."""
        block, c = pattern(counts)
        b, c = block[:, None], torch.minimum(c, block)[:, None]  # (B, 1)
        k1 = (counts.total - 1)[:, None]
        blk, cur = torch.div(now.clamp(min=0), b, rounding_mode="floor"), now.clamp(min=0) % b  # (B, R)
        n_sum, n_other = blk * c, blk * (b - c)  # summaries / other tokens of past blocks
        gap = (k1 - cur - n_sum).double()
        gap[:, :first] = float("inf")  # no eviction before the cache starts evicting
        s = n_sum + gap.cummin(-1).values.clamp(max=0).long()  # summaries held
        z = k1 - cur - s  # other past tokens held
        p = pos[:, None, :]  # (B, 1, S)
        b3, c3, at = b[..., None], c[..., None], now[..., None]  # (B, 1, 1), (B, R, 1)
        p_blk, p_off = torch.div(p, b3, rounding_mode="floor"), p % b3
        summary = p_off >= b3 - c3
        current = p_blk == torch.div(at.clamp(min=0), b3, rounding_mode="floor")
        held_sum = summary & (p_blk * c3 + p_off - (b3 - c3) >= (n_sum - s)[..., None])
        held_other = ~summary & (p_blk * (b3 - c3) + p_off >= (n_other - z)[..., None])
        return (p >= 0) & (p < at) & (current | held_sum | held_other)  # (B, R, S)
