"""The pieces of a streaming run that need no model: policy specs, perplexity windows, flatness, time estimates."""
from __future__ import annotations

import math
import statistics

import torch

from h2o.assets import policy_config
from h2o.assets.resources import rss_bytes
from h2o.core.policies import Policy

HEAVY_SHARE = 1 / 3  # the authors' streaming split: heavy 32 + recent 64 at 96 tokens


def parse_policy(spec: str) -> tuple[str, dict]:
    """A policy spec -> (name, options), spelled as lm-eval's model_args: ``"h2o,heavy_share=0.5,score=decay"``
    (the keys of conf/policy/h2o.yaml, values read as Hydra reads them: h2o.assets.policy_config); or the colon
    spelling ``"h2o:heavy_share=1/2:score=decay"`` (values: int, float, a fraction ``a/b``, else a string; a notice).
    The spec is also the run's label."""
    if ":" not in spec:
        return policy_config.parse(spec, "--policy")
    name, *opts = spec.split(":")
    options = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or not key:
            raise ValueError(f"policy spec {spec!r}: option {opt!r} is not key=value")
        options[key] = spec_value(value)
    new = ",".join([name, *(f"{k}={v}" for k, v in options.items())])
    policy_config.notice(f"policy spec {spec!r} is spelled --policy {new} now")
    return name, options


def spec_value(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    a, slash, b = value.partition("/")
    if slash:
        try:
            return float(a) / float(b)
        except (ValueError, ZeroDivisionError):
            pass
    return value


def build_policy(spec: str | Policy, budget: int | None, heavy_share: float = HEAVY_SHARE) -> Policy:
    """A policy from a spec (:func:`parse_policy`) with a budget in tokens and ``heavy_share`` unless the spec sets
    them; built as Hydra builds ``policy=<name> policy.<key>=<value>`` (h2o.assets.policy_config)."""
    if isinstance(spec, Policy):
        return spec
    name, options = parse_policy(spec)
    if name != "full":
        options = {"heavy_share": heavy_share, **options}
    return policy_config.at_budget(name, options.pop("budget", budget), "--policy ", **options)


class Windows:
    """Perplexity per window of ``size`` predicted tokens (exact windows, split across chunks)."""

    def __init__(self, size: int, on_sample=None):
        self.size, self.samples, self.on_sample = size, [], on_sample
        self.total_nll, self.total_n = 0.0, 0
        self.nll = self.n = self.t = self.c = 0.0

    def add(self, nll: torch.Tensor, dt: float, dc: float, held: int, last: bool) -> None:
        """nll (q,) of one chunk that took ``dt`` seconds (``dc`` CPU seconds), shared out by tokens."""
        q, i = nll.numel(), 0
        while i < q:
            take = min(q - i, self.size - int(self.n))
            part = float(nll[i:i + take].sum())
            self.nll, self.n = self.nll + part, self.n + take
            self.t, self.c = self.t + dt * take / q, self.c + dc * take / q
            self.total_nll, self.total_n = self.total_nll + part, self.total_n + take
            i += take
            if self.n >= self.size or (last and i == q):
                self.emit(held)

    def emit(self, held: int) -> None:
        m = self.nll / self.n
        self.samples.append({"tokens": self.total_n, "nll": m, "chunk_ppl": math.exp(m),
                             "ppl": math.exp(self.total_nll / self.total_n), "time_s": self.t,
                             "time_per_token_s": self.t / self.n, "cpu_per_token_s": self.c / self.n,
                             "rss_bytes": rss_bytes(), "cache_tokens": held})
        if self.on_sample:
            self.on_sample(self.samples[-1])
        self.nll = self.n = self.t = self.c = 0.0


def estimate(done: int, total: int, seconds: float, runs: int = 1) -> str:
    """One line: the measured speed so far and the wall time it predicts for ``total`` tokens (x ``runs``)."""
    rate = done / max(seconds, 1e-9)
    eta = total / rate
    more = f" ({runs} runs left: ~{hms(eta * runs)} if all ran at this speed)" if runs > 1 else ""
    return f"{rate:.1f} tok/s over the first {done} tokens -> ~{hms(eta)} for {total} tokens{more}"


def hms(seconds: float) -> str:
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def flatness(samples: list[dict], warmup: float = 0.1) -> dict:
    """Growth after the warm-up (the first ``warmup`` fraction of samples, at least two): resident memory at the
    end over memory right after the warm-up, minus 1; median time (and CPU time) per token of the last quarter
    of the samples over the first quarter after the warm-up, minus 1 (medians of quarters: robust to load spikes
    from other processes)."""
    n = len(samples)
    w = min(max(2, int(n * warmup)), n - 1)
    after = samples[w:]
    if len(after) < 2:
        return {"rss_growth": None, "rss_growth_max": None, "time_per_token_growth": None,
                "time_per_token_s_start": None, "time_per_token_s_end": None, "warmup_tokens": None,
                "cpu_per_token_growth": None}
    k = max(1, len(after) // 4)
    t0 = statistics.median(s["time_per_token_s"] for s in after[:k])
    t1 = statistics.median(s["time_per_token_s"] for s in after[-k:])
    out = {"rss_growth": after[-1]["rss_bytes"] / after[0]["rss_bytes"] - 1,
           "rss_growth_max": max(s["rss_bytes"] for s in after) / after[0]["rss_bytes"] - 1,
           "time_per_token_growth": t1 / t0 - 1, "time_per_token_s_start": t0, "time_per_token_s_end": t1,
           "warmup_tokens": samples[w - 1]["tokens"]}
    if all("cpu_per_token_s" in s for s in after):  # CPU seconds: not inflated by other processes' load
        c0 = statistics.median(s["cpu_per_token_s"] for s in after[:k])
        c1 = statistics.median(s["cpu_per_token_s"] for s in after[-k:])
        out.update(cpu_per_token_growth=c1 / c0 - 1, cpu_per_token_s_start=c0, cpu_per_token_s_end=c1)
    return out
