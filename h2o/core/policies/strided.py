"""strided: the Sparse Transformer strided pattern (Child et al. 2019) under a fixed cache budget (paper: Table 2).

The budget's recent part is a window of the latest tokens; its heavy part holds "every l-th token": the positions
``j % l == 0``, with the stride ``l = ceil(L / n_grid)`` chosen so the grid spans the reference length ``L``.
When the cache is full, tokens outside both are dropped first, then the oldest grid tokens. The grid is anchored
at position 0 (not at each query) so that a dropped token is never needed again, as a real cache requires.
"""
import torch

from .base import TIER, Counts, Policy, bcast, recent_window


def stride_of(counts: Counts) -> torch.Tensor:
    """(B,) stride so that ``counts.heavy`` grid tokens cover the reference length."""
    grid = counts.heavy.clamp(min=1)
    return torch.div(counts.length + grid - 1, grid, rounding_mode="floor").clamp(min=1)


class Strided(Policy):
    name = "strided"
    position_only = True

    def priority(self, pos, acc, now, counts: Counts):
        window = recent_window(pos, now, counts.recent)
        grid = (pos % bcast(stride_of(counts)) == 0) & bcast(counts.heavy > 0)
        return (2 * window + (grid & ~window)).double() * TIER + pos.double()  # (B, H, S)
