"""The throughput benchmark as a task of the experiment runner (``conf/task/bench_throughput.yaml``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from h2o.bench.throughput import benchmark
from h2o.bench.variants import BASELINES, Variant, make_variants
from h2o.core import engine
from h2o.core.validate import is_int
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

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        variants = [Variant("policy", "full")] + ([] if policy.name == "full" else [Variant.of(policy)])
        variants += [v for v in make_variants([], [policy.budget], self.baselines)
                     if v.kind == "dynamic" or not engine.keeps_all(policy)]
        recs = benchmark(model, prompt_lens=[self.prompt_len], gen_lens=[self.gen_len],
                         batch_sizes=[self.batch_size], repeats=self.repeats, warmup=self.warmup,
                         prefill=self.prefill, prefill_chunk=self.prefill_chunk, seed=seed, variants=variants)
        mine = recs[0] if policy.name == "full" else recs[1]
        info = {k: mine[k] for k in ("prompt_len", "gen_len", "batch_size", "prefill_mode", "attn_implementation")}
        return Result(mine["metrics"], recs, {**info, "repeats": self.repeats})


def pair(key: str, value, what: str = "prompt, batch") -> None:
    """ConfigError unless ``value`` is two ints >= 1."""
    check(isinstance(value, (list, tuple)) and len(value) == 2 and all(is_int(x) and x >= 1 for x in value),
          f"task.{key}={value!r}: expected [{what}] (two ints >= 1)")


@dataclass
class TargetsTask(TaskSpec):
    """``conf/task/bench_targets.yaml``: the benchmark targets (decode, KV bytes, largest batch, simulated forward)
    in one run (``make bench``; :mod:`h2o.bench.targets`).

    The run's policy is measured against full, the ``compare`` policies and transformers' caches at every part;
    metrics: each target's measured ratio; ``targets``: {name: {value, target, met}}; samples: every variant's
    record; ``methods``: every registered method at the run's budget, at ``methods`` ([prompt, batch]; null:
    none) with ``methods_gen`` tokens each (:mod:`h2o.bench.every_policy`); ``long_generation``: every
    decode-time method at ``long_gen_budget`` tokens, every step (where it has a decoding form), every
    ``long_gen_interval`` tokens and on its own schedule, beside full, generating ``long_gen`` ([generated tokens,
    batch]; null: none) after a ``long_gen_prompt``-token prompt (:mod:`h2o.bench.long_generation`;
    ``long_gen_methods``: some of them, null all); ``host_reads_per_layer_step``: every rule's host reads per layer
    per decoding step at each schedule (:func:`host_reads_table`)."""

    name: str
    long: list = field(default_factory=lambda: [4096, 8])
    short: list = field(default_factory=lambda: [2048, 1])
    e2e: list = field(default_factory=lambda: [512, 2])
    sim: int = 1024
    memory: list = field(default_factory=lambda: [1024, 8])
    memory_fraction: float = 0.5
    gen_len: int = 8
    short_gen: int = 64  # generated tokens at `short`: a batch-1 step is short, 8 steps measure noise
    repeats: int = 3
    warmup: int = 1
    prefill_chunk: int = 0
    kv_limit: bool = True
    max_batch_cap: int = 64
    compare: list = field(default_factory=lambda: ["local"])
    compare_e2e: list = field(default_factory=lambda: ["local", "streaming_llm"])
    methods: list | None = field(default_factory=lambda: [512, 1])  # every method side by side (None: none)
    methods_gen: int = 16
    long_gen: list | None = None  # [generated tokens, batch] (None: none; conf/task/bench_targets.yaml: [128, 2])
    long_gen_prompt: int = 32  # the long-generation section's prompt tokens
    long_gen_budget: int = 32  # its whole-cache budget in tokens
    long_gen_interval: int = 16  # its interval schedule's generated tokens between two cuts
    long_gen_methods: list | None = None  # some of its methods (None: all; h2o.bench.long_generation.METHODS)
    shots: int = 0

    kind = "benchmark_targets"
    semantics = ("real",)

    def __post_init__(self):
        from h2o.core.policies import POLICIES

        for key in ("long", "short", "e2e"):
            pair(key, getattr(self, key))
        pair("memory", self.memory, "prompt, generated tokens")
        if self.methods is not None:
            pair("methods", self.methods)
        if self.long_gen is not None:
            pair("long_gen", self.long_gen, "generated tokens, batch")
            check(self.long_gen[0] >= 2, f"task.long_gen={self.long_gen!r}: expected at least 2 generated tokens "
                                         f"(one decoding step)")
        for key in ("long_gen_prompt", "long_gen_budget", "long_gen_interval"):
            check(is_int(getattr(self, key)) and getattr(self, key) >= 1,
                  f"task.{key}={getattr(self, key)!r}: expected an int >= 1")
        from h2o.bench.long_generation import method_error

        error = method_error(self.long_gen_methods)
        check(error is None, error or "")
        check(is_int(self.methods_gen) and self.methods_gen >= 2,
              f"task.methods_gen={self.methods_gen!r}: expected an int >= 2 (one decoding step at least)")
        for key in ("sim", "gen_len", "short_gen", "repeats", "max_batch_cap"):
            check(is_int(getattr(self, key)) and getattr(self, key) >= 1,
                  f"task.{key}={getattr(self, key)!r}: expected an int >= 1")
        for key in ("warmup", "prefill_chunk"):
            check(is_int(getattr(self, key)) and getattr(self, key) >= 0,
                  f"task.{key}={getattr(self, key)!r}: expected an int >= 0")
        check(0 < self.memory_fraction <= 1,
              f"task.memory_fraction={self.memory_fraction!r}: expected a number in (0, 1]")
        for key in ("compare", "compare_e2e"):
            value = getattr(self, key)
            check(isinstance(value, (list, tuple)), f"task.{key}={value!r}: expected a list of policy names")
            bad = [p for p in value if p not in POLICIES or p == "full"]
            check(not bad, f"task.{key}={list(value)}: {bad[0] if bad else ''!r} is not an evicting "
                           f"policy; allowed: {', '.join(p for p in POLICIES if p != 'full')}")
        check(self.shots == 0, f"task.shots={self.shots}: a benchmark takes no in-context examples (0)")

    def check_policy(self, policy) -> None:
        """Full (policy=full, or a ratio budget of 1.0) is the reference every target divides by."""
        from h2o.core.policies import POLICIES

        what = "policy=full" if policy.name == "full" else f"policy={policy.name} policy.budget={policy.budget}"
        check(not engine.keeps_all(policy), f"{what}: task {self.name} measures an evicting policy against full (the "
                                  f"reference); allowed: {', '.join(p for p in POLICIES if p != 'full')} with a "
                                  f"budget below 1.0")

    def run(self, model, tokenizer, policy, semantics: str, seed: int, quant=None) -> Result:
        from h2o.bench import long_generation
        from h2o.bench.every_policy import rows
        from h2o.bench.targets import check_targets, run_targets

        self.check_policy(policy)
        name = getattr(model.config, "_name_or_path", None)
        recs = run_targets(model, self, policy, seed, model_name=name)
        res = check_targets(recs, self.long, self.short, policy.name, policy.budget)
        targets = {k: {"value": x, "target": t, "met": ok} for k, (x, t, ok) in res.items()}
        met = [ok for _, _, ok in res.values() if ok is not None]
        reads = host_reads_table()
        return Result({k: x for k, (x, _, _) in res.items()}, recs,
                      {"targets": targets, "targets_met": f"{sum(met)}/{len(met)}", "methods": rows(recs),
                       "long_generation": long_generation.rows(recs), "host_reads_per_layer_step": reads})


def host_reads_table(out=None) -> dict[str, float]:
    """Every rule's host reads per layer per decoding step, each schedule it runs (:func:`h2o.bench.launches.
    every_layer_syncs`: the tiny LLaMA, the reads a GPU waits on beyond the forward's one), printed and returned."""
    import sys

    from h2o.bench.launches import every_layer_syncs

    reads = every_layer_syncs()
    out = out or sys.stdout
    print("\n== host reads per layer per decoding step (tiny LLaMA; beyond the forward's non-finite flag)", file=out)
    for k, v in reads.items():
        print(f"{k:>28}: {v:g}", file=out)
    out.flush()
    return reads
