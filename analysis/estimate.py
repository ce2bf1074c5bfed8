"""A metric with its 95% interval (normal approximation, value +- 1.96 standard errors, clipped
to the metric's range).

Where the interval comes from, in this order:

* the record's own ``<metric>_ci95_low`` / ``_high`` (perplexity: exp of the nll interval);
* the record's ``<metric>_stderr`` (lm-eval's sample standard error for accuracies; Self-BLEU's
  from its per-generation scores, see ``analysis.self_bleu``);
* the per-sample values in ``samples.jsonl``: ROUGE per article (std / sqrt(n)); perplexity per
  window, from each window's nll per token, mapped to ppl by the delta method (se_ppl = ppl x se).

An accuracy of one record with ``n_samples`` questions gets the Wilson score interval instead
(the normal one collapses to a point at 0 or 1: 0/3 correct is not [0, 0]); its se for
differences is the larger of lm-eval's and the Wilson half-width / 1.96.
Several seeds of one protocol: the mean of the values, se = sqrt(sum se_i^2) / k (normal).
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
    bounds: tuple = (-math.inf, math.inf)   # the metric's range: the interval is clipped to it
    interval: tuple | None = None           # an exact interval (Wilson) replacing value +- z se

    @property
    def lo(self) -> float:
        return self.interval[0] if self.interval else max(self.bounds[0], self.value - Z95 * self.se)

    @property
    def hi(self) -> float:
        return self.interval[1] if self.interval else min(self.bounds[1], self.value + Z95 * self.se)

    @property
    def has_interval(self) -> bool:
        return not math.isnan(self.se)

    def scaled(self, k: float) -> "Estimate":
        return Estimate(self.value * k, self.se * k, (self.bounds[0] * k, self.bounds[1] * k),
                        (self.interval[0] * k, self.interval[1] * k) if self.interval else None)


def wilson(p: float, n: float) -> tuple[float, float]:
    """Wilson score interval of a proportion p of n trials (95%)."""
    z2 = Z95 ** 2
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar_exact(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p-value for paired right/wrong outcomes: ``a_only`` pairs where only the first is
    right, ``b_only`` where only the second is; the smaller count under Binomial(a_only + b_only, 1/2), doubled."""
    n, k = a_only + b_only, min(a_only, b_only)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def bounds(metric: str) -> tuple:
    """Accuracies, ROUGE, Self-BLEU and LongBench's ``score`` lie in [0, 1]; perplexity in [1, inf)."""
    if metric.startswith(("acc", "rouge", "self_bleu")) or metric == "score":
        return (0.0, 1.0)
    return (1.0, math.inf) if metric == "ppl" else (-math.inf, math.inf)


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
    lo, hi = _float(row.get(f"{metric}_ci95_low")), _float(row.get(f"{metric}_ci95_high"))
    if lo <= value <= hi:                       # the task computed its own interval (perplexity)
        return Estimate(value, (hi - lo) / (2 * Z95), bounds(metric), (lo, hi))
    se = _float(row.get(f"{metric}_stderr"))
    if math.isnan(se):
        se = from_samples(row.get("path"), metric)
    n = _float(row.get("n_samples"))
    if metric.startswith("acc") and n > 0 and 0 <= value <= 1:   # a proportion of n questions
        lo, hi = wilson(value, n)
        se = max(0.0 if math.isnan(se) else se, (hi - lo) / (2 * Z95))
        return Estimate(value, se, bounds(metric), (lo, hi))
    return Estimate(value, se, bounds(metric))


def combine(ests: list[Estimate]) -> Estimate:
    """Mean of several seeds' estimates; se of the mean (NaN if any is unknown)."""
    k = len(ests)
    if k == 1:
        return ests[0]
    return Estimate(sum(e.value for e in ests) / k, math.sqrt(sum(e.se ** 2 for e in ests)) / k,
                    ests[0].bounds)


def difference(a: Estimate, b: Estimate) -> Estimate:
    """a - b for two independent estimates."""
    return Estimate(a.value - b.value, math.sqrt(a.se ** 2 + b.se ** 2))


def _sample_ids(samples: list[dict]) -> list:
    return [s.get("doc_id", s.get("window")) for s in samples]


def paired_difference(a: dict, b: dict, metric: str) -> Estimate | None:
    """a - b over the samples both records scored (same ids in the same order, per-sample values
    in samples.jsonl): mean of the per-sample differences +- 1.96 sd / sqrt(n). Perplexity: the
    per-window log-ppl differences d, then ppl_b (exp(d) - 1). None if the samples do not pair."""
    sa, sb = load_samples(a.get("path")), load_samples(b.get("path"))
    if len(sa) < 2 or len(sa) != len(sb) or None in _sample_ids(sa) or \
            _sample_ids(sa) != _sample_ids(sb):
        return None
    if metric == "ppl":
        va = [_float(s.get("nll")) / _float(s.get("n_tokens")) for s in sa]
        vb = [_float(s.get("nll")) / _float(s.get("n_tokens")) for s in sb]
    else:
        va, vb = [_float(s.get(metric)) for s in sa], [_float(s.get(metric)) for s in sb]
    d = np.asarray(va) - np.asarray(vb)
    if not np.isfinite(d).all():
        return None
    m, se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))
    if metric != "ppl":
        return Estimate(m, se)
    ppl_b = _float(b.get("ppl"))
    lo, hi = (ppl_b * (math.exp(m + k * Z95 * se) - 1) for k in (-1, 1))
    return Estimate(ppl_b * (math.exp(m) - 1), (hi - lo) / (2 * Z95), interval=(lo, hi))
