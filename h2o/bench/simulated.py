"""The simulated-mask forward (the lm-eval path) timed against the unmodified eager forward."""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext

import torch

from h2o.core.attach import attach
from h2o.assets.policy_config import at_budget
from h2o.bench.measure import PeakRSS, median, sync
from h2o.bench.report import variant_label


@torch.inference_mode()
def simulated_forward(model, T: int = 1024, policies=(("h2o", 0.2),), repeats: int = 3, warmup: int = 1,
                      batch: int = 1, seed: int = 0, model_name: str | None = None, verbose: bool = True,
                      out=None) -> list[dict]:
    """Plain forward of ``T`` tokens: the unmodified eager model vs :func:`h2o.core.attach` (simulated mask) per policy.

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
                ctx = attach(model, at_budget(v[0], v[1], "--policies "))
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
            print(f"{variant_label(r['policy'], r['budget']):>16}: {m['latency_s']:8.2f} s  x eager "
                  f"{m['vs_eager']:6.2f}   CPU {m['cpu_s']:8.2f} s  x eager {m['vs_eager_cpu']:6.2f}",
                  file=out or sys.stdout)
        (out or sys.stdout).flush()
    return recs
