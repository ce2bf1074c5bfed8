"""local: only the most recent tokens, the whole budget as a sliding window (paper: Fig. 4, Table 1, Table 9)."""
from .base import NOTHING, Counts, Policy


class Local(Policy):
    """Evicts the oldest token: priority is the position."""

    name = "local"
    reads = NOTHING  # positions alone
    splits = False
    closed_form = "sliding"  # positions alone; the budget's window within the layer's window

    def priority(self, pos, acc, now, counts: Counts):
        return pos.double()  # (B, H, S)
