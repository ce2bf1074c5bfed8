"""The throughput benchmark as a task of the experiment runner (``conf/task/bench_throughput.yaml``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from h2o.bench.throughput import BASELINES, Variant, benchmark, make_variants
from h2o.tasks.base import Result, TaskSpec, check, positive_or_none


@dataclass
class BenchmarkTask(TaskSpec):
    """``conf/task/bench_*.yaml``: one run of the experiment runner = the configured policy, measured interleaved
    with the full cache (and ``baselines``) at one setting. Metrics: the policy's (with ``vs_full``); samples:
    every variant's record; the setting goes into the record (``prompt_len``, ``gen_len``, ``batch_size``)."""

    name: str
    prompt_len: int = 512
    gen_len: int = 32
    batch_size: int = 1
    repeats: int = 3
    warmup: int = 1
    prefill: str = "each"
    prefill_chunk: int = 0
    baselines: list = field(default_factory=list)
    shots: int = 0

    kind = "benchmark"
    semantics = ("real",)

    def __post_init__(self):
        for key in ("prompt_len", "gen_len", "batch_size", "repeats"):
            positive_or_none(f"task.{key}", getattr(self, key))
        check(self.prefill in ("each", "shared"), f"task.prefill={self.prefill!r}: allowed: each, shared")
        check(all(b in BASELINES for b in self.baselines),
              f"task.baselines={list(self.baselines)}: allowed: {', '.join(BASELINES)}")
        check(self.shots == 0, f"task.shots={self.shots}: a benchmark takes no in-context examples (0)")

    def run(self, model, tokenizer, policy, semantics: str, seed: int) -> Result:
        variants = [Variant("policy", "full")] + ([] if policy.name == "full" else [Variant.of(policy)])
        variants += [v for v in make_variants([], [policy.budget], self.baselines)
                     if v.kind == "dynamic" or not policy.is_full]
        recs = benchmark(model, prompt_lens=[self.prompt_len], gen_lens=[self.gen_len],
                         batch_sizes=[self.batch_size], repeats=self.repeats, warmup=self.warmup,
                         prefill=self.prefill, prefill_chunk=self.prefill_chunk, seed=seed, variants=variants)
        mine = recs[0] if policy.name == "full" else recs[1]
        info = {k: mine[k] for k in ("prompt_len", "gen_len", "batch_size", "prefill_mode", "attn_implementation")}
        return Result(mine["metrics"], recs, {**info, "repeats": self.repeats})
