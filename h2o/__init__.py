"""H2O harness: KV-cache eviction policies, simulated and real, for any transformers attention model.

    from h2o import attach, make_policy

Names are imported on first use, so ``python -m h2o.data`` and friends start without importing transformers.
"""
import importlib

_EXPORTS = {"attach": "attach", "Attached": "attach", "EvictingCache": "cache", "make_policy": "policies",
            "Policy": "policies", "PolicyError": "policies", "POLICIES": "policies"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'h2o' has no attribute {name!r}")
    return getattr(importlib.import_module(f"h2o.{_EXPORTS[name]}"), name)
