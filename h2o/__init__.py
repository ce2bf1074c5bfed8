"""H2O harness: KV-cache eviction policies, simulated and real, for any transformers attention model."""
from .core.attach import Attached, attach
from .core.cache import EvictingCache
from .core.policies import POLICIES, Policy, PolicyError, make_policy

__all__ = ["attach", "Attached", "EvictingCache", "make_policy", "Policy", "PolicyError", "POLICIES"]
