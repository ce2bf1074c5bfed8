"""Benchmarks of the real evicting cache (the paper's Tables 3-5): throughput, latency and memory.

For every setting (prompt length x generation length x batch size) and every *variant* this measures

* ``throughput_tok_s``: generated tokens / (prefill time + decode time), the paper's generation throughput;
* ``decode_tok_s``: decode-only throughput, ``batch * (gen_len - 1) / decode time`` (the first token of each
  sequence comes out of the prefill forward, the other ``gen_len - 1`` out of one decoding forward each);
* ``latency_s``: same-batch latency, prefill + decode time of the whole batch;
* ``kv_bytes`` (at the end), ``kv_bytes_prefill`` (right after the prefill) and ``kv_bytes_max`` (the largest
  value seen after the prefill and after every decoding step): bytes of the key/value *storage* held by the
  cache, so a tensor that is a small view of a large buffer counts the whole buffer (what is really held);
  ``kv_meta_bytes``: the evicting cache's per-slot state beside keys and values (positions, scores);
  ``kv_tokens_prefill``: the tokens it holds right after the prefill (over layers, sequences and KV heads);
* ``peak_mem_bytes``: the process's peak resident memory while the variant ran (the kernel's ``VmHWM``, reset
  before each run; ``peak_mem_delta_bytes`` above the resident memory at its start) and ``gpu_peak_bytes`` on
  CUDA. Memory freed by earlier runs may stay in the process (the allocator keeps some): the delta is the cleaner
  number, KV bytes the exact one.

Variants (:mod:`h2o.bench.variants`): ``full`` and the given policies at the given budgets run through
:func:`h2o.core.attach` (mode "real"), plus the unmodified model as baselines: ``hf_sdpa`` / ``hf_eager`` (transformers' ``DynamicCache``) and
``hf_sliding`` (``Cache(layers=[DynamicSlidingWindowLayer(k)] * L)`` with ``k`` the policy budget in tokens; after
the prefill its layers keep a *view* of the whole prompt's keys and values until the first decoding step, which the
storage bytes show). Every variant prefills the prompt with full attention, then decodes greedily for ``gen_len``
tokens with the same loop (no stopping at EOS), on random-token prompts of one length (no padding).

Timing: a warm-up run per variant, then ``repeats`` rounds in which every variant runs once, in an order rotated
each round (interleaved, so load from other processes hits every variant alike); medians are reported.

Two prefill modes:

* ``prefill="each"`` (default): each run prefills its own prompt (timed), then decodes. All metrics are measured.
* ``prefill="shared"``: one prefill of a single prompt through the full evicting cache (it holds keys, values and the
  accumulated attention of the prompt); each run then *forks* its cache from it: repeated to the batch size (decoding
  cost does not depend on the values), and cut by the variant's policy exactly as the end of a real prefill cuts
  (the prefill is full attention in every variant, so the cut sees the same keys and scores). Only decoding is
  timed: ``throughput_tok_s`` and ``latency_s`` are then None and ``prefill_s`` is the one shared prefill. This is
  what makes 4096-token x batch-8 settings measurable on a small CPU.

``largest_batch``: for a KV-memory limit (bytes), the largest batch each variant fits (from its measured per-sequence
``kv_bytes_max``) and the decode throughput measured at that batch (shared prefill). A KV-only figure: the batch
that really runs in a memory limit (weights and scratch too) is :mod:`h2o.bench.max_batch`'s.

``simulated_forward``: one plain forward of T tokens through the simulated mask (:func:`h2o.core.attach`, the lm-eval
path) against the unmodified eager forward.

Run records: ``make bench`` (:mod:`h2o.bench.targets`, ``experiment=bench``) and
``experiment=bench_tables`` (:class:`h2o.bench.task.BenchmarkTask`); ``python -m h2o.bench`` explores.
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

import torch

from h2o.core import engine
from h2o.core.attach import attach
from h2o.core.cache import EvictingCache
from h2o.core.policies import make_policy
from h2o.bench.measure import (PeakRSS, Timer, gpu_devices, gpu_peak_bytes, held_tokens, kv_bytes, median,
                               reset_gpu_peaks, sync)
from h2o.bench.report import add_ratios, print_table
from h2o.bench.variants import Variant, budget_tokens, make_variants, variant_context


# ---------------------------------------------------------------------------------------- one run
@dataclass
class RunResult:
    prefill_s: float
    decode_s: float
    kv_prefill: int
    kv_max: int
    kv_final: int
    kv_meta: int
    peak_rss: int = 0
    rss_start: int = 0
    gpu_peak: int | None = None
    prefill_cpu_s: float = 0.0
    decode_cpu_s: float = 0.0
    held_prefill: int | None = None  # tokens held after the prefill (an evicting cache; None: transformers')


def forward(model, ids, cache, prefill_chunk: int = 0):
    """Prefill ``ids`` (B, T) into ``cache`` (in chunks of ``prefill_chunk`` if > 0); logits of the last token."""
    T = ids.shape[1]
    step = prefill_chunk if prefill_chunk and prefill_chunk < T else T
    for s in range(0, T, step):
        out = model(input_ids=ids[:, s:s + step], cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def decode(model, cache, first_logits, n_steps: int, track=None):
    """Greedy decoding: ``n_steps`` forwards of one token each. ``track(cache)`` after each step."""
    nxt = first_logits.argmax(-1, keepdim=True)
    for _ in range(n_steps):
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        if track is not None:
            track(cache)
    return nxt


@torch.inference_mode()
def run_once(model, new_cache, ids, gen_len: int, prefill_chunk: int = 0, fork=None) -> RunResult:
    """One timed generation. ``fork``: a callable returning ``(cache, first_logits)`` (shared prefill)."""
    device = ids.device
    gpus = gpu_devices(model)  # memory and time over every GPU the model spans
    reset_gpu_peaks(gpus)
    with PeakRSS() as mem:
        sync(device)
        c0 = time.process_time()
        with Timer(gpus) as t_prefill:
            if fork is None:
                cache = new_cache(ids.shape[1])
                logits = forward(model, ids, cache, prefill_chunk)
            else:
                cache, logits = fork()
        c1 = time.process_time()
        kv0, meta = kv_bytes(cache)
        held0 = held_tokens(cache)
        kv_max = [kv0]

        def track(c):
            kv_max[0] = max(kv_max[0], kv_bytes(c)[0])

        with Timer(gpus) as t_decode:
            decode(model, cache, logits, gen_len - 1, track)
        c2 = time.process_time()
        kv_end, meta_end = kv_bytes(cache)
    res = RunResult(t_prefill.seconds, t_decode.seconds, kv0, kv_max[0], kv_end, max(meta, meta_end), mem.peak,
                    mem.start, gpu_peak_bytes(gpus), c1 - c0, c2 - c1, held0)
    del cache, logits
    gc.collect(1)  # young generations only: a full pass costs ~0.6 s once lm-eval and Hydra are loaded
    return res


# ----------------------------------------------------------------------------------- shared prefill
@torch.inference_mode()
def shared_prefill(model, ids1, prefill_chunk: int = 1024):
    """Prefill one prompt (1, T) through the full evicting cache: (snapshot cache, last logits, seconds)."""
    device = ids1.device
    full = engine.reading_rows(make_policy("full"))  # every row's attention kept: the forks' cuts rank by it
    with attach(model, full, mode="real") as h:
        cache = h.new_cache(ref_len=ids1.shape[1])
        sync(device)
        t0 = time.perf_counter()
        logits = forward(model, ids1, cache, prefill_chunk)
        sync(device)
        return cache, logits, time.perf_counter() - t0


def fork_cache(model, v: Variant, new_cache, snap: EvictingCache, logits1, batch: int):
    """The variant's cache right after a prefill of ``batch`` copies of the snapshot's prompt (see module doc):
    an evicting cache forks it (:meth:`EvictingCache.fork`: the cut per sequence, then the kept slots repeated);
    transformers' layers take the prompt's keys and values through their own ``update``."""
    rep = lambda t, n: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731 (a copy: its own storage)
    T = snap.get_seq_length()  # one unpadded prompt: its tokens
    cache = new_cache(T)
    if v.kind == "policy":
        return cache.fork(snap, batch), rep(logits1, batch)
    for i, s in enumerate(snap.layers):
        keys, values = s.read()  # full, unquantized: the prompt's keys and values as held
        cache.update(rep(keys, batch), rep(values, batch), i)
    return cache, rep(logits1, batch)


# ------------------------------------------------------------------------------------------ driver

def summarize_runs(v: Variant, runs: list[RunResult], prompt_len: int, gen_len: int, batch: int, shared: bool,
              shared_prefill_s: float | None = None) -> dict:
    prefill = median([r.prefill_s for r in runs])
    dec = median([r.decode_s for r in runs])
    gen_tokens = batch * gen_len
    lat = None if shared else prefill + dec
    metrics = {
        "throughput_tok_s": None if shared else gen_tokens / lat,
        "decode_tok_s": batch * (gen_len - 1) / dec if gen_len > 1 and dec > 0 else None,
        "latency_s": lat,
        "prefill_s": shared_prefill_s if shared else prefill,
        "fork_s": prefill if shared else None,
        "decode_s": dec,
        # CPU seconds of this process (all threads): robust to other processes on the machine, not to spinning
        "decode_cpu_s": median([r.decode_cpu_s for r in runs]),
        "prefill_cpu_s": median([r.prefill_cpu_s for r in runs]),
        "decode_tok_cpu_s": (batch * (gen_len - 1) / median([r.decode_cpu_s for r in runs])
                             if gen_len > 1 else None),
        "threads": torch.get_num_threads(),
        "kv_bytes": runs[-1].kv_final,
        "kv_bytes_prefill": runs[-1].kv_prefill,
        "kv_bytes_max": max(r.kv_max for r in runs),
        "kv_meta_bytes": max(r.kv_meta for r in runs),
        "kv_tokens_prefill": runs[-1].held_prefill,
        "peak_mem_bytes": max(r.peak_rss for r in runs),
        "peak_mem_delta_bytes": max(r.peak_rss - r.rss_start for r in runs),
        "gpu_peak_bytes": max(r.gpu_peak for r in runs) if runs[0].gpu_peak is not None else None,
        "decode_s_runs": [r.decode_s for r in runs],
        "prefill_s_runs": [r.prefill_s for r in runs],
    }
    return {"task_kind": "benchmark", "task": "synthetic", "semantics": "real", "policy": v.policy,
            **({"quant": v.quant} if v.quant != "none" else {}),
            "budget": float(v.budget) if isinstance(v.budget, float) else v.budget,
            "prompt_len": prompt_len, "gen_len": gen_len, "batch_size": batch, "n_samples": len(runs),
            "prefill_mode": "shared" if shared else "each", "attn_implementation": v.attn if v.kind != "policy"
            else "h2o", "window_tokens": budget_tokens(v.budget, prompt_len) if v.kind != "dynamic" else None,
            "metrics": metrics}


def benchmark(model, policies=("full", "h2o"), budgets=(0.2,), prompt_lens=(512,), gen_lens=(32,),
              batch_sizes=(1,), baselines=("sdpa", "sliding"), repeats: int = 3, warmup: int = 1,
              prefill: str = "each", prefill_chunk: int = 0, kv_limit: int | None = None,
              max_batch_cap: int = 64, seed: int = 0, model_name: str | None = None,
              verbose: bool = True, out=None, variants: list[Variant] | None = None,
              quants=("none",), calibration: str | None = None) -> list[dict]:
    """Measure every variant at every setting; returns run records (``task_kind: "benchmark"``).

    Variants: ``make_variants(policies, budgets, baselines)``, or ``variants`` as given.
    ``prefill``: "each" or "shared" (module doc). ``kv_limit`` (bytes, or "full": the full cache's ``kv_bytes_max``
    at the largest batch): also measure the largest batch each variant fits in that much KV memory (records with
    ``"kv_limit_bytes"``; decode throughput, shared prefill; needs "full" among the policies for "full").
    """
    if prefill not in ("each", "shared"):
        raise ValueError(f"prefill={prefill!r}: allowed: each, shared")
    variants = variants or make_variants(policies, budgets, baselines, quants, calibration)
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(seed)
    name = model_name or getattr(model.config, "_name_or_path", type(model).__name__)
    records = []
    for T in prompt_lens:
        prompt = torch.randint(min(100, vocab // 2), vocab, (max(batch_sizes), T), generator=gen).to(device)
        snap = None
        if prefill == "shared" or kv_limit:
            snap, logits1, snap_s = shared_prefill(model, prompt[:1], prefill_chunk or 1024)
            if verbose:
                print(f"[bench] shared prefill of {T} tokens: {snap_s:.1f} s", file=sys.stderr, flush=True)
        for G in gen_lens:
            for B in batch_sizes:
                ids = prompt[:B]
                shared = prefill == "shared"
                res = measure_interleaved(model, variants, ids, G, repeats, warmup, prefill_chunk,
                              (snap, logits1) if shared else None, verbose)
                recs = [summarize_runs(v, res[v], T, G, B, shared, snap_s if shared else None) for v in variants]
                add_ratios(recs)
                for r in recs:
                    r["model"] = name
                records += recs
                if verbose:
                    print_table(recs, out=out)
        if kv_limit:
            limit = kv_limit
            if kv_limit == "full":  # what the full cache held at this prompt length and the largest batch
                limit = max(r["metrics"]["kv_bytes_max"] for r in records
                            if r["policy"] == "full" and r["prompt_len"] == T and r["batch_size"] == max(batch_sizes))
            last = {(r["policy"], r["budget"], r.get("quant", "none")): r for r in records if r["prompt_len"] == T and
                    r["gen_len"] == max(gen_lens) and r["batch_size"] == max(batch_sizes)}
            per_seq = {v: last[(v.policy, v.budget, v.quant)]["metrics"]["kv_bytes_max"] // max(batch_sizes)
                       for v in variants if (v.policy, v.budget, v.quant) in last}
            recs = largest_batch(model, variants, snap, logits1, prompt, max(gen_lens), limit, min(repeats, 2),
                                 warmup, max_batch_cap, verbose, per_seq)
            for r in recs:
                r["model"] = name
            records += recs
            if verbose:
                print_table(recs, out=out, title=f"largest batch within a KV limit of {limit / 2**20:.0f} MiB "
                                                 f"(decode throughput at that batch; medians of {repeats})")
        del snap
        gc.collect()
    return records


def measure_interleaved(model, variants, ids, gen_len, repeats, warmup, prefill_chunk, shared, verbose, batches=None):
    """Warm-up, then ``repeats`` interleaved rounds (order rotated each round). {variant: [RunResult]}.

    ``batches``: {variant: batch size} for shared-prefill runs at different batches (default: ``ids``' batch)."""
    res = {v: [] for v in variants}
    T = ids.shape[1]
    for rnd in range(-warmup, repeats):
        k = rnd % len(variants)
        for v in variants[k:] + variants[:k]:
            B = (batches or {}).get(v, ids.shape[0])
            with variant_context(model, v) as new_cache:
                fork = None
                if shared is not None:
                    fork = lambda: fork_cache(model, v, new_cache, shared[0], shared[1], B)  # noqa: E731
                if rnd < 0 and shared is None:  # warm-up on a short prompt (a long prefill would cost minutes)
                    r = run_once(model, new_cache, ids[:, :min(T, 64)], min(gen_len, 4), prefill_chunk)
                else:
                    r = run_once(model, new_cache, ids, gen_len if rnd >= 0 else min(gen_len, 4),
                                 prefill_chunk, fork)
            if rnd >= 0:
                res[v].append(r)
            if verbose:
                tag = "warm-up" if rnd < 0 else f"round {rnd + 1}/{repeats}"
                print(f"[bench] {T}x{B} gen {gen_len} {tag} {v.label:>16}: prefill {r.prefill_s:7.2f} s "
                      f"decode {r.decode_s:7.2f} s kv {r.kv_max / 2**20:8.1f} MiB", file=sys.stderr, flush=True)
    return res


def largest_batch(model, variants, snap, logits1, prompt, gen_len, kv_limit, repeats, warmup, cap, verbose,
                  per_seq: dict | None = None):
    """For each variant: its largest batch within ``kv_limit`` bytes of KV memory and the decode throughput there
    (the variants interleaved, each at its own batch). ``per_seq``: {variant: KV bytes of one sequence at most};
    measured by a batch-1 run where missing."""
    T = prompt.shape[1]
    per_seq = dict(per_seq or {})
    for v in variants:
        if v not in per_seq:
            with variant_context(model, v) as new_cache:
                r = run_once(model, new_cache, prompt[:1], gen_len, 0,
                             lambda: fork_cache(model, v, new_cache, snap, logits1, 1))
            per_seq[v] = r.kv_max
    fit = {v: int(kv_limit // per_seq[v]) for v in variants}
    todo = [v for v in variants if fit[v] >= 1]
    batches = {v: min(fit[v], cap) for v in todo}
    res = measure_interleaved(model, todo, prompt[:1], gen_len, repeats, warmup, 0, (snap, logits1), verbose, batches)
    recs = []
    for v in todo:
        rec = summarize_runs(v, res[v], T, gen_len, batches[v], True)
        rec["kv_limit_bytes"], rec["max_batch"], rec["max_batch_capped"] = kv_limit, fit[v], fit[v] > cap
        recs.append(rec)
    add_ratios(recs)
    return recs
