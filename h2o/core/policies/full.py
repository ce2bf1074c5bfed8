"""full: the unmodified cache. Every token stays; the reference every table compares against."""
from .base import NOTHING, Policy
from .budget import Unsupported


class Full(Policy):
    """Keeps everything (budget 100%)."""

    name = "full"
    reads = NOTHING  # positions alone
    splits = False

    def __init__(self, budget=1.0, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget=1.0)

    def timed(self, compress: str) -> Policy:
        if compress == "prefill":  # nothing is ever cut: one run (decode, the default) serves both timings
            raise Unsupported("compress=prefill: full keeps every token, so its one run serves both timings; "
                              "allowed: decode")
        return super().timed(compress)

    def needs(self):
        return []

    @property
    def is_full(self) -> bool:
        return True
