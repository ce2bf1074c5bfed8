"""A static pattern plus heavy hitters (strided+H2, fixed+H2 of Table 2).

The budget's recent part goes to the pattern (which splits it again into its own window and structure); the
heavy part to the tokens of highest accumulated attention among those the pattern does not keep.
"""

from .base import Counts, Policy, bcast, keep_top
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
