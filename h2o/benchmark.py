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
* ``peak_mem_bytes``: the process's peak resident memory while the variant ran (the kernel's ``VmHWM``, reset
  before each run; ``peak_mem_delta_bytes`` above the resident memory at its start) and ``gpu_peak_bytes`` on
  CUDA. Memory freed by earlier runs may stay in the process (the allocator keeps some): the delta is the cleaner
  number, KV bytes the exact one.

Variants: ``full`` and the given policies at the given budgets run through :func:`h2o.attach` (mode "real"),
plus the unmodified model as baselines: ``hf_sdpa`` / ``hf_eager`` (transformers' ``DynamicCache``) and
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
``kv_bytes_max``) and the decode throughput measured at that batch (shared prefill).

``simulated_forward``: one plain forward of T tokens through the simulated mask (:func:`h2o.attach`, the lm-eval
path) against the unmodified eager forward.

CLI: ``python -m h2o.benchmark --model smollm2-135m --prompt 2048 --gen 64 --batch 1 --policies full,local,h2o
--budget 0.2``; ``--suite targets`` runs the issue's targets (``make bench``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from .attach import attach
from .cache import EvictingCache
from .policies import Policy, make_policy
from .taskspec import Result, TaskSpec, check, positive_or_none

BASELINES = ("sdpa", "eager", "sliding")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ------------------------------------------------------------------------------------------ memory
def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm_bytes() -> int | None:
    """Peak resident memory since the last reset (Linux ``VmHWM``), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset this process's peak resident memory (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _hwm_bytes() is not None
    except OSError:
        return False


class PeakRSS:
    """Context manager: ``.peak`` = the process's peak resident memory inside it, ``.start`` = at its start.

    Linux: the kernel's peak (``VmHWM``) is reset on entry and read on exit: exact, and nothing runs meanwhile.
    Elsewhere a thread samples every ``interval`` s (it competes for the GIL: timings get noisier)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self.start = self.peak = rss_bytes()
        if not _reset_hwm():
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = max(self.peak, _hwm_bytes() or 0)
        self.peak = max(self.peak, rss_bytes())


def kv_bytes(cache: Cache) -> tuple[int, int]:
    """(bytes of key/value storage held by ``cache``, bytes of the evicting cache's per-slot state).

    Storage bytes: a key tensor that is a view of a larger buffer counts the whole buffer (it keeps it alive)."""
    seen: set[int] = set()
    kv = meta = 0
    for layer in cache.layers:
        for name, is_meta in (("keys", False), ("values", False), ("pos", True), ("acc", True)):
            t = getattr(layer, name, None)
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            if is_meta:
                meta += st.nbytes()
            else:
                kv += st.nbytes()
    return kv, meta


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One thing to measure. ``kind``: "policy" (through h2o.attach), "dynamic" (DynamicCache), "sliding"."""

    kind: str
    policy: str  # record's policy: a harness policy name, "hf_sdpa", "hf_eager" or "hf_sliding"
    budget: float | int = 1.0
    attn: str = "sdpa"  # attention implementation of the unmodified model (baselines)
    obj: Policy | None = field(default=None, compare=False)  # a built policy (else make_policy(policy, budget))

    @staticmethod
    def of(policy: Policy) -> "Variant":
        return Variant("policy", policy.name, policy.budget, obj=policy)

    def build(self) -> Policy:
        if self.obj is not None:
            return self.obj
        return make_policy(self.policy) if self.policy == "full" else make_policy(self.policy, budget=self.budget)

    @property
    def label(self) -> str:
        b = "" if self.policy in ("full", "hf_sdpa", "hf_eager") else f" {self.budget:g}"
        return self.policy.replace("_", "-") + b


def make_variants(policies: Iterable[str], budgets: Iterable[float | int],
                  baselines: Iterable[str] = ("sdpa", "sliding")) -> list[Variant]:
    """``full`` first, then each policy at each budget, then the baselines (``sliding`` at each budget)."""
    policies, budgets, baselines = list(policies), list(budgets), list(baselines)
    out = [Variant("policy", "full")] if "full" in policies else []
    for p in policies:
        if p != "full":
            out += [Variant("policy", p, b) for b in budgets]
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
        with attach(model, v.build(), mode="real") as h:
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
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    with PeakRSS() as mem:
        sync(device)
        c0, t0 = time.process_time(), time.perf_counter()
        if fork is None:
            cache = new_cache(ids.shape[1])
            logits = forward(model, ids, cache, prefill_chunk)
        else:
            cache, logits = fork()
        sync(device)
        c1, t1 = time.process_time(), time.perf_counter()
        kv0, meta = kv_bytes(cache)
        kv_max = [kv0]

        def track(c):
            kv_max[0] = max(kv_max[0], kv_bytes(c)[0])

        decode(model, cache, logits, gen_len - 1, track)
        sync(device)
        c2, t2 = time.process_time(), time.perf_counter()
        kv_end, meta_end = kv_bytes(cache)
    res = RunResult(t1 - t0, t2 - t1, kv0, kv_max[0], kv_end, max(meta, meta_end), mem.peak, mem.start,
                    torch.cuda.max_memory_allocated(device) if cuda else None, c1 - c0, c2 - c1)
    del cache, logits
    gc.collect()
    return res


# ----------------------------------------------------------------------------------- shared prefill
@torch.inference_mode()
def shared_prefill(model, ids1, prefill_chunk: int = 1024):
    """Prefill one prompt (1, T) through the full evicting cache: (snapshot cache, last logits, seconds)."""
    device = ids1.device
    with attach(model, make_policy("full"), mode="real") as h:
        cache = h.new_cache(ref_len=ids1.shape[1])
        sync(device)
        t0 = time.perf_counter()
        logits = forward(model, ids1, cache, prefill_chunk)
        sync(device)
        return cache, logits, time.perf_counter() - t0


BATCH_STATE = ("keys", "values", "pos", "acc", "n_tok")


def fork_cache(model, v: Variant, new_cache, snap: EvictingCache, logits1, batch: int):
    """The variant's cache right after a prefill of ``batch`` copies of the snapshot's prompt (see module doc).

    An evicting policy cuts the single sequence first (the cut is per sequence), then the kept slots are repeated:
    a large batch never holds the whole prompt ``batch`` times."""
    rep = lambda t, n: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731 (a copy: its own storage)
    T = int(snap.layers[0].n_tok[0])
    cache = new_cache(T)
    for layer, s in zip(cache.layers, snap.layers):
        if v.kind == "policy":
            for name, value in vars(s).items():  # scalars (seen, n_new, ...) as the prefill left them
                if name not in ("policy", "ref_len", "counts") + BATCH_STATE:
                    setattr(layer, name, value)
            for name in BATCH_STATE:
                setattr(layer, name, rep(getattr(s, name), 1))
            ref = layer.n_tok if layer.ref_len is None else torch.full_like(layer.n_tok, layer.ref_len)
            layer.counts = layer.policy.counts(ref)
            if layer.policy.evicts and not layer.policy.is_full:
                layer.cut()  # what real_attention does at the end of a prefill (chunk)
            if batch > 1:
                for name in BATCH_STATE:
                    setattr(layer, name, rep(getattr(layer, name), batch))
                ref = layer.n_tok if layer.ref_len is None else torch.full_like(layer.n_tok, layer.ref_len)
                layer.counts = layer.policy.counts(ref)
        else:  # transformers' layers take the prompt's keys and values through their own update()
            layer.update(rep(s.keys, batch), rep(s.values, batch))
    return cache, rep(logits1, batch)


# ------------------------------------------------------------------------------------------ driver
def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(v: Variant, runs: list[RunResult], prompt_len: int, gen_len: int, batch: int, shared: bool,
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
        "peak_mem_bytes": max(r.peak_rss for r in runs),
        "peak_mem_delta_bytes": max(r.peak_rss - r.rss_start for r in runs),
        "gpu_peak_bytes": max(r.gpu_peak for r in runs) if runs[0].gpu_peak is not None else None,
        "decode_s_runs": [r.decode_s for r in runs],
        "prefill_s_runs": [r.prefill_s for r in runs],
    }
    return {"task_kind": "benchmark", "task": "synthetic", "semantics": "real", "policy": v.policy,
            "budget": float(v.budget) if isinstance(v.budget, float) else v.budget,
            "prompt_len": prompt_len, "gen_len": gen_len, "batch_size": batch, "n_samples": len(runs),
            "prefill_mode": "shared" if shared else "each", "attn_implementation": v.attn if v.kind != "policy"
            else "h2o", "window_tokens": budget_tokens(v.budget, prompt_len) if v.kind != "dynamic" else None,
            "metrics": metrics}


def benchmark(model, policies=("full", "h2o"), budgets=(0.2,), prompt_lens=(512,), gen_lens=(32,),
              batch_sizes=(1,), baselines=("sdpa", "sliding"), repeats: int = 3, warmup: int = 1,
              prefill: str = "each", prefill_chunk: int = 0, kv_limit: int | None = None,
              max_batch_cap: int = 64, seed: int = 0, model_name: str | None = None,
              verbose: bool = True, out=None, variants: list[Variant] | None = None) -> list[dict]:
    """Measure every variant at every setting; returns run records (``task_kind: "benchmark"``).

    Variants: ``make_variants(policies, budgets, baselines)``, or ``variants`` as given.
    ``prefill``: "each" or "shared" (module doc). ``kv_limit`` (bytes, or "full": the full cache's ``kv_bytes_max``
    at the largest batch): also measure the largest batch each variant fits in that much KV memory (records with
    ``"kv_limit_bytes"``; decode throughput, shared prefill; needs "full" among the policies for "full").
    """
    if prefill not in ("each", "shared"):
        raise ValueError(f"prefill={prefill!r}: allowed: each, shared")
    variants = variants or make_variants(policies, budgets, baselines)
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
                res = measure(model, variants, ids, G, repeats, warmup, prefill_chunk,
                              (snap, logits1) if shared else None, verbose)
                recs = [summarize(v, res[v], T, G, B, shared, snap_s if shared else None) for v in variants]
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
            last = {(r["policy"], r["budget"]): r for r in records if r["prompt_len"] == T and
                    r["gen_len"] == max(gen_lens) and r["batch_size"] == max(batch_sizes)}
            per_seq = {v: last[(v.policy, v.budget)]["metrics"]["kv_bytes_max"] // max(batch_sizes)
                       for v in variants if (v.policy, v.budget) in last}
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


def measure(model, variants, ids, gen_len, repeats, warmup, prefill_chunk, shared, verbose, batches=None):
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
    res = measure(model, todo, prompt[:1], gen_len, repeats, warmup, 0, (snap, logits1), verbose, batches)
    recs = []
    for v in todo:
        rec = summarize(v, res[v], T, gen_len, batches[v], True)
        rec["kv_limit_bytes"], rec["max_batch"], rec["max_batch_capped"] = kv_limit, fit[v], fit[v] > cap
        recs.append(rec)
    add_ratios(recs)
    return recs


# ------------------------------------------------------------------------------------------ output
RATIO_METRICS = ("throughput_tok_s", "decode_tok_s", "decode_tok_cpu_s", "latency_s", "kv_bytes_max",
                 "kv_bytes_prefill", "kv_bytes")


def add_ratios(recs: list[dict]) -> None:
    """``metrics["vs_full"]`` (vs the harness's full cache) and ``metrics["vs_sdpa"]`` (unmodified model)."""
    refs = {"vs_full": next((r for r in recs if r["policy"] == "full"), None),
            "vs_sdpa": next((r for r in recs if r["policy"] == "hf_sdpa"), None)}
    for r in recs:
        for key, ref in refs.items():
            if ref is None:
                continue
            r["metrics"][key] = {m: (r["metrics"][m] / ref["metrics"][m]
                                     if r["metrics"].get(m) and ref["metrics"].get(m) else None)
                                 for m in RATIO_METRICS}


def fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def print_table(recs: list[dict], out=None, title: str | None = None) -> None:
    if not recs:
        return
    r0 = recs[0]
    title = title or (f"prompt {r0['prompt_len']} x batch {r0['batch_size']}, gen {r0['gen_len']} "
                      f"(prefill: {r0['prefill_mode']}, medians of {r0['n_samples']}, "
                      f"{r0['metrics']['threads']} threads)")
    cols = ["variant", "batch", "prefill s", "gen tok/s", "x full", "decode tok/s", "x full", "x sdpa",
            "cpu x full", "cpu x sdpa", "latency s", "x full", "KV prefill MiB", "x full", "KV max MiB", "x full",
            "KV end MiB", "peak RSS MiB", "+RSS MiB"]
    rows = []
    for r in recs:
        m = r["metrics"]
        vf, vs = m.get("vs_full", {}), m.get("vs_sdpa", {})
        label = Variant("x", r["policy"], r["budget"]).label
        rows.append([label, str(r["batch_size"]), fmt(m["prefill_s"], ".2f"), fmt(m["throughput_tok_s"], ".2f"),
                     fmt(vf.get("throughput_tok_s"), ".2f"), fmt(m["decode_tok_s"], ".2f"),
                     fmt(vf.get("decode_tok_s"), ".2f"), fmt(vs.get("decode_tok_s"), ".2f"),
                     fmt(vf.get("decode_tok_cpu_s"), ".2f"), fmt(vs.get("decode_tok_cpu_s"), ".2f"),
                     fmt(m["latency_s"], ".2f"), fmt(vf.get("latency_s"), ".2f"),
                     fmt(m["kv_bytes_prefill"] / 2**20), fmt(vf.get("kv_bytes_prefill"), ".3f"),
                     fmt(m["kv_bytes_max"] / 2**20), fmt(vf.get("kv_bytes_max"), ".3f"), fmt(m["kv_bytes"] / 2**20),
                     fmt(m["peak_mem_bytes"] / 2**20, ".0f"), fmt(m["peak_mem_delta_bytes"] / 2**20, ".0f")])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(f"\n== {title}", file=out or sys.stdout)
    print(line(cols), file=out or sys.stdout)
    for row in rows:
        print(line(row), file=out or sys.stdout)
    (out or sys.stdout).flush()


# -------------------------------------------------------------------------------- simulated forward
@torch.inference_mode()
def simulated_forward(model, T: int = 1024, policies=(("h2o", 0.2),), repeats: int = 3, warmup: int = 1,
                      batch: int = 1, seed: int = 0, model_name: str | None = None, verbose: bool = True,
                      out=None) -> list[dict]:
    """Plain forward of ``T`` tokens: the unmodified eager model vs :func:`h2o.attach` (simulated mask) per policy.

    Records: ``semantics`` "simulated" (``policy`` "hf_eager" for the plain forward), ``gen_len`` 0,
    ``metrics``: ``latency_s`` (median), ``throughput_tok_s`` (tokens scored per second), ``vs_eager`` ratio."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(min(100, vocab // 2), vocab, (batch, T),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    variants = [("hf_eager", None)] + [tuple(p) for p in policies]
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    peaks = {v: 0 for v in variants}
    prev = model.config._attn_implementation
    for rnd in range(-warmup, repeats):
        k = rnd % len(variants)
        for v in variants[k:] + variants[:k]:
            if v[0] == "hf_eager":
                model.set_attn_implementation("eager")
                ctx = nullcontext()
            else:
                ctx = attach(model, make_policy(v[0]) if v[0] == "full" else make_policy(v[0], budget=v[1]))
            n = T if rnd >= 0 else min(T, 64)
            with ctx, PeakRSS() as mem:
                sync(device)
                c0, t0 = time.process_time(), time.perf_counter()
                model(input_ids=ids[:, :n], logits_to_keep=1)
                sync(device)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            model.set_attn_implementation(prev)
            if rnd >= 0:
                times[v].append(dt)
                cpu[v].append(dc)
                peaks[v] = max(peaks[v], mem.peak)
            if verbose:
                print(f"[bench] simulated forward {n} tokens {v[0]} {v[1] or ''}: {dt:.2f} s",
                      file=sys.stderr, flush=True)
    base, base_cpu = median(times[variants[0]]), median(cpu[variants[0]])
    recs = []
    for v in variants:
        lat = median(times[v])
        recs.append({"task_kind": "benchmark", "task": "synthetic", "semantics": "simulated", "policy": v[0],
                     "budget": 1.0 if v[1] is None else v[1], "prompt_len": T, "gen_len": 0, "batch_size": batch,
                     "n_samples": repeats, "model": model_name or getattr(model.config, "_name_or_path", ""),
                     "metrics": {"latency_s": lat, "throughput_tok_s": batch * T / lat, "vs_eager": lat / base,
                                 "cpu_s": median(cpu[v]), "vs_eager_cpu": median(cpu[v]) / base_cpu,
                                 "latency_s_runs": times[v], "cpu_s_runs": cpu[v], "peak_mem_bytes": peaks[v],
                                 "threads": torch.get_num_threads()}})
    if verbose:
        print(f"\n== simulated-mask forward, {batch} x {T} tokens (medians of {repeats})", file=out or sys.stdout)
        for r in recs:
            m = r["metrics"]
            print(f"{Variant('x', r['policy'], r['budget']).label:>16}: {m['latency_s']:8.2f} s  x eager "
                  f"{m['vs_eager']:6.2f}   CPU {m['cpu_s']:8.2f} s  x eager {m['vs_eager_cpu']:6.2f}",
                  file=out or sys.stdout)
        (out or sys.stdout).flush()
    return recs



# ------------------------------------------------------------------------------------ runner task
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

# --------------------------------------------------------------------------------------------- CLI
def ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x]


def budgets_arg(s: str) -> list[float | int]:
    return [int(x) if x.isdigit() else float(x) for x in str(s).split(",") if x]


def check_targets(records: list[dict], long=(4096, 8), short=(2048, 1), out=None) -> dict:
    """The issue's targets, from the records of ``--suite targets``: {name: (value, target, met)}.

    Decode throughput of h2o 20% over full at ``long`` (>= 2x) and ``short`` (>= 1.15x), over the harness's full
    cache and over the unmodified model (DynamicCache, sdpa); KV bytes of h2o 20% over full <= 0.21 after the
    prefill, at most and at the end; simulated-mask forward over the plain eager forward <= 2x."""
    res = {}

    def rec(policy, P, B, budget=None, semantics="real"):
        for r in records:
            if (r["policy"], r["prompt_len"], r["batch_size"], r["semantics"]) == (policy, P, B, semantics) and \
                    (budget is None or r["budget"] == budget) and "kv_limit_bytes" not in r:
                return r
        return None

    for (P, B), target in ((tuple(long), 2.0), (tuple(short), 1.15)):
        h, f, s, w = rec("h2o", P, B, 0.2), rec("full", P, B), rec("hf_sdpa", P, B), rec("hf_sliding", P, B, 0.2)
        for name, ref in (("full", f), ("hf_sdpa", s)):
            if h and ref:
                for m, tag in (("decode_tok_s", ""), ("decode_tok_cpu_s", " (CPU time)")):
                    x = h["metrics"][m] / ref["metrics"][m]
                    res[f"decode {P}x{B} h2o/{name}{tag}"] = (x, f">= {target}", x >= target)
        if w and s:  # the ceiling: no scores, no policy, transformers' own window
            x = w["metrics"]["decode_tok_s"] / s["metrics"]["decode_tok_s"]
            res[f"decode {P}x{B} hf_sliding/hf_sdpa (ceiling)"] = (x, "info", None)
        if h and f:
            for m in ("kv_bytes_prefill", "kv_bytes_max", "kv_bytes"):
                x = h["metrics"][m] / f["metrics"][m]
                res[f"{m} {P}x{B} h2o/full"] = (x, "<= 0.21", x <= 0.21)
    sim = [r for r in records if r["semantics"] == "simulated" and r["policy"] == "h2o"]
    for r in sim:
        for m, tag in (("vs_eager", ""), ("vs_eager_cpu", " (CPU time)")):
            x = r["metrics"][m]
            res[f"simulated forward {r['prompt_len']} h2o/eager{tag}"] = (x, "<= 2", x <= 2.0)
    print("\n== targets", file=out or sys.stdout)
    for k, (x, t, ok) in res.items():
        verdict = "" if ok is None else "met" if ok else "MISSED"
        print(f"{k:>48}: {x:7.3f}  target {t:>7}  {verdict}", file=out or sys.stdout)
    (out or sys.stdout).flush()
    return res


def suite_targets(model, args, out=None) -> list[dict]:
    """The issue's targets: decode at LONG (shared prefill) and SHORT, KV bytes, simulated forward, e2e, max batch."""
    long, short = tuple(ints(args.long)), tuple(ints(args.short))
    recs = []
    common = dict(repeats=args.repeats, warmup=args.warmup, seed=args.seed, model_name=args.model, out=out)
    # 1. decode throughput, shared prefill: LONG (plus the largest batch within the full cache's KV bytes) and SHORT
    for (P, B), limit in ((long, "full" if args.max_batch else None), (short, None)):
        recs += benchmark(model, ["full", "h2o", "local"], [0.2], [P], [args.gen], [B], ["sdpa", "sliding"],
                          prefill="shared", prefill_chunk=args.prefill_chunk, kv_limit=limit,
                          max_batch_cap=args.max_batch_cap, **common)
    # 2. end-to-end generation throughput (each variant prefills): the paper's definition
    P, B = ints(args.e2e)
    recs += benchmark(model, ["full", "local", "streaming_llm", "h2o"], [0.2], [P], [args.gen], [B],
                      ["sdpa", "eager", "sliding"], prefill="each", **common)
    # 3. simulated-mask forward vs the plain eager forward
    recs += simulated_forward(model, args.sim, [("full", 1.0), ("h2o", 0.2)], repeats=args.repeats,
                              warmup=args.warmup, seed=args.seed, model_name=args.model, out=out)
    check_targets(recs, long, short, out=out)
    return recs


def write_records(records: list[dict], path: str | None, runs: str | None, experiment: str) -> None:
    if path:
        with open(path, "w") as f:
            for r in records:
                f.write(json.dumps({"experiment": experiment, **r}) + "\n")
    if runs:
        for r in records:
            leaf = "_".join(str(x) for x in (r["semantics"], r["policy"], r["budget"], r["prompt_len"],
                                             r["gen_len"], r["batch_size"], r.get("prefill_mode", ""),
                                             "kvlim" if "kv_limit_bytes" in r else ""))
            d = Path(runs) / experiment / str(r["model"]).replace("/", "_") / leaf.strip("_")
            d.mkdir(parents=True, exist_ok=True)
            (d / "metrics.json").write_text(json.dumps({"experiment": experiment, **r}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o.benchmark", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    p.add_argument("--gen", default="32", help="generation lengths, comma-separated (suite: one; make bench: 8)")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="full,local,h2o")
    p.add_argument("--budget", default="0.2", help="budgets: ratios of the prompt or token counts, comma-separated")
    p.add_argument("--baselines", default="sdpa,sliding", help=f"of {','.join(BASELINES)}, or 'none'")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prefill", choices=("each", "shared"), default="each")
    p.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one)")
    p.add_argument("--kv-limit-mib", default="0",
                   help="also find the largest batch within this KV memory (MiB, or 'full': what full held)")
    p.add_argument("--max-batch-cap", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the records here (JSON lines)")
    p.add_argument("--runs", default=None, help="also write one run folder per record under this root")
    p.add_argument("--experiment", default="benchmark")
    p.add_argument("--suite", choices=("targets",), default=None, help="run the issue's targets (make bench)")
    p.add_argument("--long", default="4096,8", help="suite: prompt,batch of the long decode target")
    p.add_argument("--short", default="2048,1", help="suite: prompt,batch of the short decode target")
    p.add_argument("--e2e", default="512,2", help="suite: prompt,batch of the end-to-end throughput run")
    p.add_argument("--sim", type=int, default=1024, help="suite: tokens of the simulated-mask forward")
    p.add_argument("--max-batch", type=int, default=1, help="suite: 1 = measure the largest batch at LONG")
    p.add_argument("--sim-only", action="store_true", help="only the simulated-mask forward (--prompt tokens)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .models import load_model
    device_map = args.device if args.device else None
    model, _ = load_model(args.model, dtype=args.dtype, device_map=device_map)
    if args.suite == "targets":
        args.gen = ints(args.gen)[0]
        records = suite_targets(model, args)
    elif args.sim_only:
        records = simulated_forward(model, ints(args.prompt)[0], [(x, b) for x in args.policies.split(",")
                                                                  for b in budgets_arg(args.budget)],
                                    repeats=args.repeats, warmup=args.warmup, seed=args.seed, model_name=args.model)
    else:
        baselines = [] if args.baselines in ("", "none") else args.baselines.split(",")
        records = benchmark(model, args.policies.split(","), budgets_arg(args.budget), ints(args.prompt),
                            ints(args.gen), ints(args.batch), baselines, repeats=args.repeats, warmup=args.warmup,
                            prefill=args.prefill, prefill_chunk=args.prefill_chunk,
                            kv_limit="full" if args.kv_limit_mib == "full" else int(float(args.kv_limit_mib) * 2**20)
                            or None, max_batch_cap=args.max_batch_cap,
                            seed=args.seed, model_name=args.model)
    write_records(records, args.json, args.runs, args.experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
