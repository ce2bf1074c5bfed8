"""Cache policies: one module per policy, found by name. ``make_policy("h2o", budget=0.2)``."""
import importlib
import math
import pkgutil

from .base import Counts, Policy, PolicyError, keep_top, select_slot

for _m in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_m.name}")

POLICIES = sorted(Policy.registry)
REAL_POLICIES = [n for n in POLICIES if n != "h2o_reference"]  # with an evicting cache (h2o_reference: simulated only)
BOTH_PATHS = [n for n in REAL_POLICIES if not Policy.registry[n].real_only]  # a simulated form too (not kvzip)


def make_policy(name: str, **options) -> Policy:
    """Build a policy by name; a bad name or option fails at once with one line."""
    if not isinstance(name, str) or name not in Policy.registry:
        raise PolicyError(f"policy={name!r}: unknown; allowed: {', '.join(POLICIES)}")
    cls = Policy.registry[name]
    for key, value in options.items():  # inf and nan pass every range check written as a comparison
        if isinstance(value, float) and not math.isfinite(value):
            raise PolicyError(f"{key}={value}: not a finite number; allowed: a finite number (see conf/policy/"
                              f"{name}.yaml for its range)")
    compress = options.pop("compress", None)  # every evicting policy's timing (Policy.timed); None: its default
    interval = options.pop("interval", None)  # compress=interval: its option (h2o.core.schedule)
    try:
        policy = cls(**options)
    except TypeError as e:  # an option the policy does not take
        raise PolicyError(f"policy={name}: {e}") from None
    return policy.timed(policy.compress if compress is None else compress, interval)


__all__ = ["Counts", "Policy", "PolicyError", "POLICIES", "REAL_POLICIES", "BOTH_PATHS", "make_policy", "keep_top", "select_slot"]
