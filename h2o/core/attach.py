"""``attach(model, policy)``: put a loaded model into the simulated or the real path, restore it on exit.

    with attach(model, make_policy("h2o", budget=0.2)) as h:          # simulated: one-pass scoring
        logits = model(input_ids).logits
    with attach(model, policy, mode="real") as h:                      # real: an evicting cache
        out = model.generate(input_ids, cache=h.new_cache(), max_new_tokens=64)
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from . import attention
from .cache import EvictingCache
from .policies import Policy, PolicyError
from .quant import Quantizer

MODES = ("simulated", "real")
SEMANTICS = ("h2o", "reference")


@dataclass
class Attached:
    """What the attention function reads from each attention module (``module.h2o``)."""

    policy: Policy
    mode: str = "simulated"
    semantics: str = "h2o"  # "reference": the paper code's mask rule (simulated h2o only)
    prompt_len: int = 0  # simulated: the first prompt_len columns are a prompt (rows see their whole prefix)
    num_layers: int = 0
    cache: EvictingCache | None = None
    observer: Callable | None = field(default=None, repr=False)  # observer(layer_idx, probs (B, Hq, T, S))
    quant: Quantizer | None = None  # KV quantization (h2o.core.quant), bound to the model

    def new_cache(self, ref_len: int | None = None) -> EvictingCache:
        """A fresh evicting cache for one generation (real mode). Budget ratios are taken of the prompt's
        length, or of ``ref_len`` if given (to feed a sequence of known length token by token)."""
        if self.mode != "real":
            raise PolicyError(f"mode={self.mode}: new_cache() is for mode='real'")
        self.cache = EvictingCache(self.policy, self.num_layers, ref_len, self.quant)
        return self.cache

    def observe(self, module, probs):
        if self.observer is not None:
            self.observer(module.layer_idx, probs)


def attention_modules(model):
    """The modules that call the attention interface: they carry ``layer_idx`` and a config."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")
            and type(m).__name__.endswith("Attention")]


@contextmanager
def attach(model, policy: Policy, mode: str = "simulated", semantics: str = "h2o", prompt_len: int = 0,
           quant: Quantizer | None = None):
    """``quant`` (default: ``policy.quant``): keys and values as a quantized cache holds them, in both paths."""
    if mode not in MODES:
        raise PolicyError(f"mode={mode!r}: allowed: {', '.join(MODES)}")
    if semantics not in SEMANTICS:
        raise PolicyError(f"semantics={semantics!r}: allowed: {', '.join(SEMANTICS)}")
    if semantics == "reference" and (mode != "simulated" or policy.name not in ("h2o", "h2_only")):
        raise PolicyError(f"semantics=reference: only for policy h2o in mode simulated (got {policy.name}, {mode})")
    modules = attention_modules(model)
    if not modules:
        raise PolicyError(f"{type(model).__name__}: no attention module with layer_idx found")
    quant = quant if quant is not None else policy.quant
    state = Attached(policy, mode, semantics, prompt_len, num_layers=len(modules),
                     quant=quant.bind(model) if quant is not None else None)
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention.NAME)
    for m in modules:
        m.h2o = state
    try:
        yield state
    finally:
        for m in modules:
            del m.h2o
        model.set_attn_implementation(previous)
