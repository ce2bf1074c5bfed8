"""H2O harness: KV-cache eviction policies, simulated and real, for any transformers attention model."""
from .attach import Attached, attach
from .cache import EvictingCache
from .policies import POLICIES, Policy, PolicyError, make_policy

__all__ = ["attach", "Attached", "EvictingCache", "make_policy", "Policy", "PolicyError", "POLICIES"]
