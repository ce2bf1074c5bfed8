"""What the throughput benchmark measures: a harness policy through :func:`h2o.core.attach` (mode "real") or the
unmodified model with transformers' caches (``hf_sdpa`` / ``hf_eager``: ``DynamicCache``; ``hf_sliding``:
``DynamicSlidingWindowLayer`` of the policy budget in tokens)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from h2o.core import engine
from h2o.core.attach import attach
from h2o.assets.policy_config import at_budget
from h2o.core.policies import Policy, make_policy
from h2o.bench.report import variant_label

BASELINES = ("sdpa", "eager", "sliding")


@dataclass(frozen=True)
class Variant:
    """One thing to measure. ``kind``: "policy" (through h2o.core.attach), "dynamic" (DynamicCache), "sliding"."""

    kind: str
    policy: str  # record's policy: a harness policy name, "hf_sdpa", "hf_eager" or "hf_sliding"
    budget: float | int = 1.0
    attn: str = "sdpa"  # attention implementation of the unmodified model (baselines)
    obj: Policy | None = field(default=None, compare=False)  # a built policy (else at_budget(policy, budget))
    quant: str = "none"  # KV quantization of a policy variant: none, uniform4, kvquant3, ... (h2o.core.quant.quant_of)
    calibration: str | None = field(default=None, compare=False)  # kvquant's calibration file
    timing: str = ""  # a built policy's schedule other than decode (``interval=32``, ``prefill``,
    # ``buffer,interval=16``): two schedules of one method at one budget are two variants

    @staticmethod
    def of(policy: Policy) -> "Variant":
        described = engine.schedule_options(policy)
        options = ",".join(f"{k}={v}" for k, v in described.items() if k != "compress")
        compress = described.get("compress", "")  # named but for interval (its interval says it): buffer's too
        schedule = options if compress == "interval" else ",".join(x for x in (compress, options) if x)
        return Variant("policy", policy.name, policy.budget, obj=policy, timing=schedule)

    def build_quant(self):
        from h2o.core.quant import quant_of

        return quant_of(self.quant, self.calibration)

    def build(self) -> Policy:
        if self.obj is not None:
            return self.obj
        return at_budget(self.policy, self.budget, "--policies ")

    @property
    def label(self) -> str:
        return variant_label(self.policy, self.budget, self.quant) + (f" {self.timing}" if self.timing else "")


def make_variants(policies: Iterable[str], budgets: Iterable[float | int],
                  baselines: Iterable[str] = ("sdpa", "sliding"), quants: Iterable[str] = ("none",),
                  calibration: str | None = None) -> list[Variant]:
    """``full`` first, then each policy at each budget, each with every quantization (``none`` first), then the
    baselines (``sliding`` at each budget)."""
    policies, budgets, baselines, quants = list(policies), list(budgets), list(baselines), list(quants)
    out = [Variant("policy", "full", quant=q, calibration=calibration) for q in quants] if "full" in policies else []
    for p in policies:
        if p != "full":
            out += [Variant("policy", p, b, quant=q, calibration=calibration) for b in budgets for q in quants]
    for b in baselines:
        if b not in BASELINES:
            raise ValueError(f"baseline {b!r}: allowed: {', '.join(BASELINES)}")
        if b == "sliding":
            out += [Variant("sliding", "hf_sliding", x, "sdpa") for x in budgets]
        else:
            out.append(Variant("dynamic", f"hf_{b}", 1.0, b))
    return out


def budget_tokens(budget: float | int, prompt_len: int) -> int:
    """Tokens the policies keep for a budget at this prompt length (the sliding window's size)."""
    return int(make_policy("local", budget=budget).counts(torch.tensor([prompt_len])).total[0])


@contextmanager
def variant_context(model, v: Variant):
    """Puts the model in the variant's attention mode; yields ``new_cache(ref_len)``."""
    if v.kind == "policy":
        with attach(model, v.build(), mode="real", quant=v.build_quant()) as h:
            yield lambda ref_len=None: h.new_cache(ref_len=ref_len)
        return
    previous = model.config._attn_implementation
    model.set_attn_implementation(v.attn)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    try:
        if v.kind == "dynamic":
            yield lambda ref_len=None: Cache(layers=[DynamicLayer() for _ in range(n_layers)])
        else:
            def sliding(ref_len=None):
                k = budget_tokens(v.budget, ref_len)
                return Cache(layers=[DynamicSlidingWindowLayer(sliding_window=k) for _ in range(n_layers)])
            yield sliding
    finally:
        model.set_attn_implementation(previous)
