"""pyramidkv: SnapKV's selection with per-layer budgets that shrink with depth (PyramidKV, Cai et al., arXiv
2406.02069), as kvpress 0.5.5's PyramidKVPress (docs/methods.md), at the end of a prompt only.

With L prompt tokens, ``k`` tokens kept on average (``budget * L`` for a ratio, unrounded as kvpress's
``L * (1 - r)``; the count itself for a token budget), N layers, w = ``window``, ``beta``:
``lo = k / beta``, ``hi = 2 k - lo``; if ``hi >= L - w``: ``hi = L - w``, ``lo = 2 k - hi``. If
``L >= hi >= lo >= w`` fails, every layer keeps ``max(1, round(k))``; else layer l keeps
``round(hi - l (hi - lo) / (N - 1))`` (N = 1: ``hi``): a line from ``hi`` down to ``lo``, about ``N k`` in all.
``round`` is half to even, as Python's. Defaults: window 64, kernel 5, beta 20 (kvpress's).
"""
import torch

from .base import READ_WINDOW, Counts, PolicyError
from .snapkv import SnapKV


class PyramidKV(SnapKV):
    name = "pyramidkv"
    reads = frozenset({READ_WINDOW})  # snapkv's
    decode_form = False  # its per-layer budgets are defined at a prompt's end only

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, window: int = 64, kernel: int = 5,
                 beta: float = 20):
        super().__init__(budget, heavy, recent, heavy_share, window, kernel)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 1:
            raise PolicyError(f"beta={beta!r}: the pyramid's ratio must be a number >= 1")
        self.beta = beta

    def layer_counts(self, counts: Counts, layer: int, layers: int) -> Counts:
        """counts of :meth:`counts` (B,) -> this layer's (B,), computed in float64 as kvpress's Python floats."""
        L = counts.length.double()  # (B,)
        k = self.budget * L if isinstance(self.budget, float) else torch.full_like(L, float(self.budget))
        w = float(self.window)
        span = (w + k) - w  # kvpress's (max_capacity_prompt - window_size), rounded alike
        lo = span / self.beta
        hi = span * 2 - lo
        capped = hi >= L - w
        hi = torch.where(capped, L - w, hi)
        lo = torch.where(capped, span * 2 - hi, lo)
        pyramid = (L >= hi) & (hi >= lo) & (lo >= w)
        step = (hi - lo) / (layers - 1) if layers > 1 else torch.zeros_like(hi)
        total = torch.where(pyramid, torch.round(hi - layer * step), torch.round(k).clamp(min=1)).long()
        return Counts(total=total, heavy=total, recent=torch.zeros_like(total), length=counts.length)

    def describe(self):
        return {**super().describe(), "beta": self.beta}
