"""full: the unmodified cache. Every token stays; the reference every table compares against."""
from .base import Policy


class Full(Policy):
    """Keeps everything (budget 100%)."""

    name = "full"
    splits = False

    def __init__(self, budget=1.0, heavy=None, recent=None, heavy_share=0.5):
        super().__init__(budget=1.0)

    def needs(self):
        return []

    @property
    def is_full(self) -> bool:
        return True
