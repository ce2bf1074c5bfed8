"""fixed_h2: the fixed pattern plus heavy hitters (Table 2, "Fixed + H2")."""
from .base import READ_ROWS
from .combine import WithHeavy
from .fixed import Fixed


class FixedH2(WithHeavy):
    name = "fixed_h2"
    reads = frozenset({READ_ROWS})  # the heavy part's accumulated attention
    pattern = Fixed
