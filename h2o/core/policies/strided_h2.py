"""strided_h2: the strided pattern plus heavy hitters (Table 2, "Strided + H2")."""
from .base import READ_ROWS
from .combine import WithHeavy
from .strided import Strided


class StridedH2(WithHeavy):
    name = "strided_h2"
    reads = frozenset({READ_ROWS})  # the heavy part's accumulated attention
    pattern = Strided
