"""h2_only: the ablation "H2 only" of Table 9: the whole budget goes to heavy hitters, no recent window."""
from .base import READ_ROWS
from .h2o import H2O


class H2Only(H2O):
    name = "h2_only"
    reads = frozenset({READ_ROWS})
    splits = False  # the whole budget is heavy

    def __init__(self, budget=0.2, heavy=None, recent=None, heavy_share=0.5, score="sum", decay=0.99):
        super().__init__(budget, heavy, recent, heavy_share, score, decay)
        self.whole_budget()
