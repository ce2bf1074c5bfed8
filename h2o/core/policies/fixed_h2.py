"""fixed_h2: the fixed pattern plus heavy hitters (Table 2, "Fixed + H2")."""
from .combine import WithHeavy
from .fixed import Fixed


class FixedH2(WithHeavy):
    name = "fixed_h2"
    pattern = Fixed
