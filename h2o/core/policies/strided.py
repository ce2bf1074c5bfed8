"""strided: the Sparse Transformer strided pattern (Child et al. 2019) under a fixed cache budget (paper: Table 2).

The budget's recent part is a window of the latest tokens; its heavy part holds "every l-th token": the positions
``j % l == 0``, with the stride ``l = ceil(L / n_grid)`` chosen so the grid spans the reference length ``L``.
When the cache is full, tokens outside both are dropped first, then the oldest grid tokens. The grid is anchored
at position 0 (not at each query) so that a dropped token is never needed again, as a real cache requires.
"""
import torch

from .base import NOTHING, Counts, Policy, bcast, recent_window, tiered
from .protected import Tiered


def stride_of(counts: Counts) -> torch.Tensor:
    """(B,) stride so that ``counts.heavy`` grid tokens cover the reference length."""
    grid = counts.heavy.clamp(min=1)
    return torch.div(counts.length + grid - 1, grid, rounding_mode="floor").clamp(min=1)


class Strided(Policy):
    name = "strided"
    reads = NOTHING  # positions alone
    # positions alone, inside a window too: newer tokens outrank a dropped non-grid token; no older one a grid token
    closed_form = "sliding"

    def priority(self, pos, acc, now, counts: Counts):
        return tiered(*self.tiers(pos, now, self.consts(counts)), pos)  # (B, H, S)

    def consts(self, counts: Counts) -> tuple:
        """What :meth:`tiers` reads per sequence: window (B,), stride and the grid's remainder (B, 1, 1): 0, or -1
        (never) when the grid holds no token."""
        return counts.recent, bcast(stride_of(counts)), bcast(torch.where(counts.heavy > 0, 0, -1))

    def tiers(self, pos, now, consts):
        """(B, H, S) bool each: the window (tier 2, the newest tokens); grid tokens (tier 1 outside the window)."""
        recent, stride, grid = consts
        return recent_window(pos, now, recent), pos % stride == grid

    def decoder(self, counts: Counts, host: Counts):
        return Tiered(self, counts)

    kernel_pattern = 1  # the row kernel's protected set of this pattern plus heavy hitters (KernelForm.pattern)

    def kernel_consts(self, counts: Counts) -> list[torch.Tensor]:
        """The row kernel's per-sequence constants (B,) each: window, stride, grid on (holds tokens)."""
        return [counts.recent, stride_of(counts), (counts.heavy > 0).long()]

    def demotions(self, counts: Counts):
        """Host: how many held tokens outside the kept set can rank above what it keeps, per step (see
        :mod:`.protected`): none. Only the oldest window token ``x`` falls (grid membership is fixed); if ``x`` was
        kept, the whole window was, and the arriving token takes its place at the top: every token outside still
        has the ``k - 1`` other kept tokens and the arriving one above it (with a window of one, nothing moves)."""
        return lambda now: 0
