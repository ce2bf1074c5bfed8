"""The largest batch a policy fits in a memory limit: found by running on CUDA, estimated on the CPU.

The limit is ``fraction`` of the memory of every GPU the model spans (CUDA) or of the machine (``MemTotal``, CPU).
A batch "fits" when a prefill of ``prompt_len`` random tokens x batch plus ``gen_len - 1`` greedy decoding steps
completes (:func:`h2o.bench.throughput.run_once`): weights, the prefill's scratch, the cache and fragmentation all
count, which the KV-only figure (limit // KV bytes of one sequence) ignores. Both are reported side by side.

* CUDA (``method: "measured"``): ``torch.cuda.set_per_process_memory_fraction(fraction)`` caps the caching
  allocator of each of the model's GPUs (the weights already held count against it); :func:`search_largest`
  doubles the batch from 1 until a run raises ``OutOfMemoryError`` (or reaches ``cap``), then bisects between the
  last batch that ran and the first that did not. The fraction is set back to 1.0 afterwards, also on error.
* CPU (``method: "estimate"``): no allocator can be capped. The peak resident-memory growth of a run
  (:class:`h2o.bench.measure.PeakRSS`, above the resident memory at its start) is measured at two batch sizes
  ``b1 < b2``, memory freed by earlier runs handed back to the system before each (glibc ``malloc_trim``): its
  slope is the bytes one more sequence costs (never taken below the KV bytes of one sequence, measured from the
  cache), its intercept the scratch that does not grow with the batch, so
  ``largest = floor((limit - base - intercept) / slope)``. ``base`` is what a process of its own running this
  model holds before the run: a fresh interpreter that imported the engine (:func:`runtime_bytes`, measured once in
  a subprocess) plus the model's weights, not this process's resident memory, which holds whatever ran before it
  (a test worker's earlier tests: the estimate then came out 0). An estimate, labelled so in the record.
"""
from __future__ import annotations

import functools
import gc
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from h2o.bench.measure import gpu_devices, proc_kib_field, release_freed
from h2o.bench.throughput import run_once
from h2o.bench.variants import Variant, variant_context
from h2o.tasks.batching import is_oom



def search_largest(try_batch: Callable[[int], bool], cap: int = 1024) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch ``b`` in [1, cap] with ``try_batch(b)`` true (an ``OutOfMemoryError`` raised by it counts
    as false), assuming a batch fits when a larger one does; 0 when batch 1 does not. Doubling from 1, then
    bisection: about 2 log2(answer) calls. Returns (batch, [(batch tried, fitted), ...] in order)."""
    trials: list[tuple[int, bool]] = []

    def fits(b: int) -> bool:
        try:
            ok = bool(try_batch(b))
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is an answer; anything else is raised
            if not is_oom(exc):
                raise
            ok = False
        trials.append((b, ok))
        return ok

    if cap < 1 or not fits(1):
        return 0, trials
    lo, hi = 1, None  # lo fits, hi does not
    while hi is None:
        if lo >= cap:
            return cap, trials
        b = min(2 * lo, cap)
        if fits(b):
            lo = b
        else:
            hi = b
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, trials


@contextmanager
def memory_cap(devices, fraction: float):
    """Caps the caching allocator of each CUDA device at ``fraction`` of its memory; 1.0 again on exit."""
    try:
        for d in devices:
            torch.cuda.set_per_process_memory_fraction(fraction, d)
        yield
    finally:
        for d in devices:
            torch.cuda.set_per_process_memory_fraction(1.0, d)
        gc.collect(1)
        torch.cuda.empty_cache()


def machine_bytes() -> int:
    """Physical memory of the machine (``MemTotal``; the page count elsewhere)."""
    total = proc_kib_field("/proc/meminfo", "MemTotal")
    if total is not None:
        return total
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def run_batch(model, v: Variant, prompt_len: int, gen_len: int, batch: int, seed: int = 0, prefill_chunk: int = 0):
    """One prefill + ``gen_len - 1`` decoding steps of ``batch`` random prompts: the RunResult."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(min(100, vocab // 2), vocab, (batch, prompt_len),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    with variant_context(model, v) as new_cache:
        return run_once(model, new_cache, ids, gen_len, prefill_chunk)


RUNTIME = "import h2o.bench.throughput; from h2o.assets.resources import rss_bytes; print(rss_bytes())"


@functools.cache
def runtime_bytes() -> int:
    """Resident memory of a fresh interpreter that imported the engine (torch, transformers, h2o.bench): measured
    once per process, in a subprocess of the same interpreter, so that it does not depend on what this one ran."""
    root = str(Path(__file__).resolve().parents[2])  # the package's root, for a checkout that is not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", RUNTIME], capture_output=True, text=True, env=env, timeout=600)
    last = out.stdout.split()[-1:]
    if out.returncode != 0 or not last or not last[0].isdigit():
        why = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the resident memory of a fresh interpreter could not be measured: {why}")
    return int(last[0])


def cpu_estimate(limit: int, base: int, growth: dict[int, int], kv_per_seq: int) -> dict:
    """The CPU estimate (module doc) from the peak resident growth at two batch sizes {b: bytes} above ``base``,
    the resident memory of a process of its own before the run (runtime and weights)."""
    (b1, g1), (b2, g2) = sorted(growth.items())
    slope = max((g2 - g1) / (b2 - b1), kv_per_seq, 1)
    fixed = max(g1 - slope * b1, 0)
    return {"largest_batch": max(int(math.floor((limit - base - fixed) / slope)), 0),
            "bytes_per_seq": slope, "fixed_bytes": fixed, "base_bytes": base,
            "rss_growth_bytes": {str(b): g for b, g in growth.items()}}


def largest_batch_under_cap(model, variants: list[Variant], prompt_len: int, gen_len: int, fraction: float = 0.5,
                            cap: int = 1024, batches: tuple[int, int] = (1, 2), seed: int = 0,
                            prefill_chunk: int = 0) -> list[dict]:
    """Per variant: the largest batch within ``fraction`` of the memory (module doc) beside the KV-only figure.

    Records (``semantics`` "real", ``max_batch_method`` "measured" on CUDA or "estimate" on the CPU):
    ``metrics`` = {largest_batch, kv_only_batch, kv_bytes_per_seq, limit_bytes, weight_bytes, capped, ...}."""
    gpus = gpu_devices(model)
    limit = int(fraction * (sum(torch.cuda.get_device_properties(d).total_memory for d in gpus) if gpus
                            else machine_bytes()))
    recs = []
    for v in variants:
        one = run_batch(model, v, prompt_len, gen_len, 1, seed, prefill_chunk)  # KV of one sequence (+ warm-up)
        kv = one.kv_max
        metrics = {"limit_bytes": limit, "memory_fraction": fraction, "weight_bytes": weight_bytes(model),
                   "kv_bytes_per_seq": kv, "kv_only_batch": limit // kv if kv else None}
        if gpus:
            def try_batch(b):
                gc.collect(1)
                torch.cuda.empty_cache()
                run_batch(model, v, prompt_len, gen_len, b, seed, prefill_chunk)
                return True

            with memory_cap(gpus, fraction):
                best, trials = search_largest(try_batch, cap)
            metrics.update(largest_batch=best, capped=best >= cap, trials=[list(t) for t in trials])
            method = "measured"
        else:
            growth = {}
            for b in batches:
                release_freed()  # else memory the allocator kept from the last run hides part of this one's growth
                r = run_batch(model, v, prompt_len, gen_len, b, seed, prefill_chunk)
                growth[b] = r.peak_rss - r.rss_start
            runtime = runtime_bytes()
            metrics.update(cpu_estimate(limit, runtime + metrics["weight_bytes"], growth, kv))
            metrics.update(runtime_bytes=runtime, rss_start_bytes=r.rss_start, capped=False)  # this process: not used
            method = "estimate"
        recs.append({"task_kind": "benchmark", "task": "synthetic", "semantics": "real", "policy": v.policy,
                     "budget": float(v.budget) if isinstance(v.budget, float) else v.budget,
                     "prompt_len": prompt_len, "gen_len": gen_len, "batch_size": metrics["largest_batch"],
                     "max_batch_method": method, "metrics": metrics})
    return recs


def print_max_batch(recs: list[dict], out=None) -> None:
    import sys
    out = out or sys.stdout
    if not recs:
        return
    r0 = recs[0]
    m0 = r0["metrics"]
    print(f"\n== largest batch in {m0['memory_fraction']:g} of the memory ({m0['limit_bytes'] / 2**30:.1f} GiB), "
          f"prompt {r0['prompt_len']}, gen {r0['gen_len']}: {r0['max_batch_method']}"
          + (" (CPU: no allocator cap; from peak RSS growth at two batch sizes)" if r0["max_batch_method"] ==
             "estimate" else " (CUDA memory cap, doubling then bisection)"), file=out)
    for r in recs:
        m = r["metrics"]
        print(f"{r['policy']:>14} {r['budget']:<5g}: largest batch {m['largest_batch']:>6}"
              f"{' (cap)' if m['capped'] else ''}   KV-only {m['kv_only_batch']:>7}   "
              f"KV/seq {m['kv_bytes_per_seq'] / 2**20:8.2f} MiB", file=out)
    out.flush()
