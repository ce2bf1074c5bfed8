"""H2O harness: KV-cache eviction policies, simulated and real, for any transformers attention model.

The names below load on first use (PEP 562), so ``import h2o.pipeline.status`` and other light command lines
do not import torch until they need it."""
from __future__ import annotations

import importlib

_WHERE = {"attach": "h2o.core.attach", "Attached": "h2o.core.attach", "EvictingCache": "h2o.core.cache",
          "make_policy": "h2o.core.policies", "Policy": "h2o.core.policies", "PolicyError": "h2o.core.policies",
          "POLICIES": "h2o.core.policies"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'h2o' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
