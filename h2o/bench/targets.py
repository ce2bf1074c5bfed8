"""The harness's speed and memory targets in one run (``make bench`` = ``h2o-run experiment=bench``, task ``bench_targets``).

The targets live here and only here (:data:`TARGETS`). One run measures, for the run's policy (h2o 20% in the
experiment) beside the harness's full cache, the ``compare`` policies and transformers' caches:

1. decode throughput at ``long`` (prompt, batch; shared prefill), plus the largest batch each variant fits in the
   full cache's KV bytes (KV-only, :func:`h2o.bench.throughput.largest_batch`), and at ``short``;
2. end-to-end generation throughput at ``e2e`` (each variant prefills; ``compare_e2e`` beside);
3. the simulated-mask forward of ``sim`` tokens against the plain eager forward;
4. the largest batch of full and the policy within ``memory_fraction`` of the memory (:mod:`h2o.bench.max_batch`:
   found under a CUDA memory cap, estimated on the CPU) at ``memory`` (prompt, generated tokens).
5. every registered method beside full at ``methods`` (prompt, batch), each prefilling its own prompt in its own
   timing: prefill time, KV bytes and tokens held after the compression, decode throughput (:mod:`h2o.bench.every_policy`;
   information, no target).
6. every decode-time method at a token budget, every step (where it has a decoding form), every
   ``long_gen_interval`` tokens and on its own schedule, beside full while generating ``long_gen`` (generated
   tokens, batch): decode throughput and KV bytes at most and at the end (:mod:`h2o.bench.long_generation`;
   ``long_gen_methods``: some of them; information, no target).

Record: ``metrics`` = {target name: measured ratio}, ``targets`` = {name: {value, target, met}}, samples = every
variant's record (``semantics`` real or simulated; ``kv_limit_bytes`` / ``max_batch_method`` on the batch parts).
"""
from __future__ import annotations

import sys

from h2o.bench import every_policy, long_generation
from h2o.bench.max_batch import largest_batch_under_cap, print_max_batch
from h2o.bench.simulated import simulated_forward
from h2o.bench.throughput import benchmark
from h2o.bench.variants import Variant, make_variants

# name -> (comparison, bound): the speed and memory targets. make bench: decode ratios at LONG and SHORT, KV bytes, simulated
# forward vs eager (time); make gpu-check (h2o.bench.gpu_check): aten ops of a simulated forward vs eager (local and
# streaming_llm), host syncs per decoding step (the one NaN/inf flag read)
OTHER_PARTS = {"kv_limit_bytes", "max_batch_method", "section"}  # keys of the records no target reads
TARGETS = {"decode_long": (">=", 2.0), "decode_short": (">=", 1.15), "kv_bytes": ("<=", 0.21),
           "simulated": ("<=", 2.0), "simulated_ops": ("<=", 1.5), "syncs_per_step": ("<=", 1)}


def meets(kind: str, x: float) -> bool:
    op, bound = TARGETS[kind]
    return x >= bound if op == ">=" else x <= bound


def check_targets(records: list[dict], long=(4096, 8), short=(2048, 1), policy: str = "h2o", budget=0.2,
                  out=None) -> dict:
    """The targets, from a run's records: {name: (value, target, met)} (met None: information only).

    Decode throughput of the policy over full at ``long`` and ``short``, over the harness's full cache and over the
    unmodified model (DynamicCache, sdpa), wall and CPU time; KV bytes of the policy over full after the prefill, at
    most and at the end; simulated-mask forward over the plain eager forward."""
    res = {}

    def rec(name, P, B, b=None, semantics="real"):
        for r in records:
            if (r["policy"], r["prompt_len"], r["batch_size"], r["semantics"]) == (name, P, B, semantics) and \
                    (b is None or r["budget"] == b) and not OTHER_PARTS & r.keys():
                return r
        return None

    def put(name, x, kind):
        res[name] = (x, "info" if kind is None else " ".join(map(str, TARGETS[kind])),
                     None if kind is None else meets(kind, x))

    for (P, B), kind in ((tuple(long), "decode_long"), (tuple(short), "decode_short")):
        h, f, s, w = rec(policy, P, B, budget), rec("full", P, B), rec("hf_sdpa", P, B), rec("hf_sliding", P, B, budget)
        for name, ref in (("full", f), ("hf_sdpa", s)):
            if h and ref:
                for m, tag in (("decode_tok_s", ""), ("decode_tok_cpu_s", " (CPU time)")):
                    put(f"decode {P}x{B} {policy}/{name}{tag}", h["metrics"][m] / ref["metrics"][m], kind)
        if w and s:  # the ceiling: no scores, no policy, transformers' own window
            x = w["metrics"]["decode_tok_s"] / s["metrics"]["decode_tok_s"]
            put(f"decode {P}x{B} hf_sliding/hf_sdpa (ceiling)", x, None)
        if h and f:
            for m in ("kv_bytes_prefill", "kv_bytes_max", "kv_bytes"):
                put(f"{m} {P}x{B} {policy}/full", h["metrics"][m] / f["metrics"][m], "kv_bytes")
    for r in records:
        if r["semantics"] == "simulated" and r["policy"] == policy:
            for m, tag in (("vs_eager", ""), ("vs_eager_cpu", " (CPU time)")):
                put(f"simulated forward {r['prompt_len']} {policy}/eager{tag}", r["metrics"][m], "simulated")
    out = out or sys.stdout
    print("\n== targets", file=out)
    for k, (x, t, ok) in res.items():
        verdict = "" if ok is None else "met" if ok else "MISSED"
        print(f"{k:>48}: {x:7.3f}  target {t:>7}  {verdict}", file=out)
    out.flush()
    return res


def run_targets(model, task, policy, seed: int = 0, model_name: str | None = None, out=None) -> list[dict]:
    """Every part of the module doc for ``policy`` (a built Policy) with the settings of ``task``
    (:class:`h2o.bench.task.TargetsTask`); returns the variant records."""
    name, budget = policy.name, policy.budget
    common = dict(repeats=task.repeats, warmup=task.warmup, seed=seed, model_name=model_name, out=out)

    def variants(others, baselines):
        return ([Variant("policy", "full"), Variant.of(policy)] + [Variant("policy", p, budget) for p in others]
                + make_variants([], [budget], baselines))

    recs = []
    for (P, B), G, limit in ((task.long, task.gen_len, "full" if task.kv_limit else None),
                             (task.short, task.short_gen, None)):
        recs += benchmark(model, prompt_lens=[P], gen_lens=[G], batch_sizes=[B], prefill="shared",
                          prefill_chunk=task.prefill_chunk, kv_limit=limit, max_batch_cap=task.max_batch_cap,
                          variants=variants(task.compare, ["sdpa", "sliding"]), **common)
    P, B = task.e2e
    recs += benchmark(model, prompt_lens=[P], gen_lens=[task.gen_len], batch_sizes=[B], prefill="each",
                      variants=variants(task.compare_e2e, ["sdpa", "eager", "sliding"]), **common)
    recs += simulated_forward(model, task.sim, [("full", 1.0), (name, budget)], repeats=task.repeats,
                              warmup=task.warmup, seed=seed, model_name=model_name, out=out)
    P, G = task.memory
    capped = largest_batch_under_cap(model, [Variant("policy", "full"), Variant.of(policy)], P, G,
                                     task.memory_fraction, seed=seed, prefill_chunk=task.prefill_chunk)
    for r in capped:
        r["model"] = model_name
    print_max_batch(capped, out=out)
    if task.methods:  # every method of the registry side by side (h2o.bench.every_policy)
        P, B = task.methods
        recs += every_policy.measure(model, P, B, task.methods_gen, budget, **common)
    if task.long_gen:  # every decoding method, both schedules, a long generation (h2o.bench.long_generation)
        G, B = task.long_gen
        recs += long_generation.measure(model, task.long_gen_prompt, B, G, task.long_gen_budget,
                                        task.long_gen_interval, methods=task.long_gen_methods, **common)
    return recs + capped
