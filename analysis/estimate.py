"""A metric with its 95% interval (normal approximation, value +- 1.96 standard errors).

Where the standard error comes from, in this order:

* the record's ``<metric>_stderr`` (lm-eval's sample standard error for accuracies; Self-BLEU's
  from its per-generation scores, see ``analysis.self_bleu``);
* the per-sample values in ``samples.jsonl``: ROUGE per article (std / sqrt(n)); perplexity per
  window, from each window's nll per token, mapped to ppl by the delta method (se_ppl = ppl x se);
* an accuracy with ``n_samples`` and no stderr: sqrt(p (1 - p) / (n - 1)), lm-eval's formula.

Several seeds of one protocol: the mean of the values, se = sqrt(sum se_i^2) / k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from analysis.records import load_samples

Z95 = 1.959964


@dataclass(frozen=True)
class Estimate:
    value: float
    se: float = float("nan")   # NaN: no interval

    @property
    def lo(self) -> float:
        return self.value - Z95 * self.se

    @property
    def hi(self) -> float:
        return self.value + Z95 * self.se

    @property
    def has_interval(self) -> bool:
        return not math.isnan(self.se)

    def scaled(self, k: float) -> "Estimate":
        return Estimate(self.value * k, self.se * k)


def _float(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return f


def from_samples(path, metric: str) -> float:
    """Standard error of ``metric`` from the run's samples.jsonl (NaN if it cannot be had)."""
    samples = load_samples(path) if isinstance(path, str) else []
    if metric == "ppl":
        logs = [s["nll"] / s["n_tokens"] for s in samples
                if _float(s.get("nll")) == _float(s.get("nll")) and _float(s.get("n_tokens")) > 0]
        if len(logs) < 2:
            return float("nan")
        return math.exp(float(np.mean(logs))) * float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    vals = [_float(s.get(metric)) for s in samples]
    vals = [v for v in vals if not math.isnan(v)]
    return float(np.std(vals, ddof=1) / math.sqrt(len(vals))) if len(vals) >= 2 else float("nan")


def estimate(row: pd.Series | dict, metric: str) -> Estimate:
    """The record's ``metric`` and its standard error (see the module doc)."""
    value = _float(row.get(metric))
    se = _float(row.get(f"{metric}_stderr"))
    if math.isnan(se):
        se = from_samples(row.get("path"), metric)
    n = _float(row.get("n_samples"))
    if math.isnan(se) and metric.startswith("acc") and n > 1 and 0 <= value <= 1:
        se = math.sqrt(value * (1 - value) / (n - 1))
    return Estimate(value, se)


def combine(ests: list[Estimate]) -> Estimate:
    """Mean of several seeds' estimates; se of the mean (NaN if any is unknown)."""
    k = len(ests)
    return Estimate(sum(e.value for e in ests) / k, math.sqrt(sum(e.se ** 2 for e in ests)) / k)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """a - b for two independent estimates."""
    return Estimate(a.value - b.value, math.sqrt(a.se ** 2 + b.se ** 2))
