"""A static pattern plus heavy hitters (strided+H2, fixed+H2 of Table 2).

The budget's recent part goes to the pattern (which splits it again into its own window and structure); the
heavy part to the tokens of highest accumulated attention among those the pattern does not keep.
"""
import torch

from .base import Counts, KernelForm, Policy, bcast, declared, keep_top
from .protected import Protected
from .score import Scored


class WithHeavy(Scored):
    """Base class: subclasses set ``pattern`` to the pattern's policy class. ``score``: :mod:`.score`."""

    pattern: type[Policy]

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, score="sum", decay=0.99):
        super().__init__(budget, heavy, recent, heavy_share)
        self.set_score(score, decay)
        self.base = self.pattern(budget=self.recent) if self.recent else None

    def priority(self, pos, acc, now, counts: Counts):
        prio = self.score(pos, acc, now)  # (B, H, S)
        if self.base is None:
            return prio
        base_counts = self.base.counts(counts.length)
        valid = pos >= 0
        arriving = ~(pos == bcast(now)).any(-1).all(-1)  # (B,): `now` is not cached yet
        keep = (base_counts.total.clamp(max=counts.recent) - arriving.long()).clamp(min=0)
        protected = keep_top(self.base.priority(pos, acc, now, base_counts), valid, keep)
        return prio.masked_fill(protected, float("inf"))

    def decoder(self, counts: Counts, host: Counts):
        """Decoding steps: the protected set kept as state (:mod:`.protected`), the same decisions."""
        return super().decoder(counts, host) if self.base is None else Protected(self, counts, host)

    def kernel_form(self) -> KernelForm | None:
        """The row kernel: the pattern's protected set where the pattern declares its kernel constants
        (``kernel_pattern``, ``kernel_consts``); without a recent part, nothing protected (an empty window)."""
        base = self.base
        if base is None:
            return self.evict_form()
        consts = declared(base, "kernel_consts")
        if consts is None:
            return None

        def params(counts: Counts) -> torch.Tensor:  # (B, 4)
            part = base.counts(counts.length)
            n_keep = (part.total.clamp(max=counts.recent) - 1).clamp(min=0)  # the arriving token is not held yet
            return torch.stack([*consts(part), n_keep], -1)

        return self.evict_form(params, base.kernel_pattern)
