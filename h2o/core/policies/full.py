"""full: the unmodified cache. Every token stays; the reference every table compares against."""
from ..schedule import Schedule
from .base import NOTHING, Policy
from .budget import Unsupported


class Full(Policy):
    """Keeps everything (budget 100%)."""

    name = "full"
    reads = NOTHING  # positions alone
    splits = False

    def __init__(self, budget=1.0, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget=1.0)

    def check_schedule(self, schedule: Schedule) -> None:
        if not schedule.evicts_each_step:  # nothing is ever cut: one run (decode) serves all
            raise Unsupported(f"compress={schedule.name}: full keeps every token, so its one run serves every "
                              "timing; allowed: decode")

    def needs(self):
        return []
