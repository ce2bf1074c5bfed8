"""streaming_llm: attention sinks (the first ``sinks`` tokens) plus the recent window (StreamingLLM, Xiao et al.).

The whole budget is used: ``sinks`` sink tokens and ``total - sinks`` recent ones. When a budget is too small to
hold the sinks and the query, the sinks shrink to ``total - 1`` (a ratio budget on a short sequence).
"""
from .base import NOTHING, TIER, Counts, Policy, PolicyError, bcast


class StreamingLLM(Policy):
    name = "streaming_llm"
    reads = NOTHING  # positions alone
    splits = False
    closed_form = "sliding"  # positions alone; the sinks are the oldest tokens: the first to leave a window

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, sinks: int = 4):
        super().__init__(budget, heavy, recent, heavy_share)
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise PolicyError(f"sinks={sinks!r}: must be an int >= 0")
        if isinstance(self.budget, int) and self.budget < sinks + 1:
            raise PolicyError(f"budget={self.budget} tokens: must be >= sinks + 1 = {sinks + 1}")
        self.sinks = sinks

    def priority(self, pos, acc, now, counts: Counts):
        sinks = bcast((counts.total - 1).clamp(max=self.sinks))
        return (pos < sinks).double() * TIER + pos.double()  # (B, H, S): sinks first, then newest

    def needs(self):
        return [("budget", self.budget, self.sinks + 1)]  # the sinks and the query

    def describe(self):
        return {**super().describe(), "sinks": self.sinks}
