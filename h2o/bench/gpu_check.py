"""``make gpu-check``: the harness's GPU claims (kernels, launches, syncs, speed, memory), verified at once on
one GPU, into one JSON.

1. equivalence: on every tiny architecture, fp32/fp16/bf16, the simulated mask equals prefill + token-by-token
   decoding through the evicting cache (max |logit difference| within the dtype's tolerance);
2. launches: aten ops of a simulated forward vs eager, ops and host syncs per decoding step vs sdpa + DynamicCache
   (:mod:`h2o.bench.launches`);
3. speed: decode time per step (CUDA events) of h2o / local vs sdpa + DynamicCache, and the simulated forward vs
   eager, on SmolLM2 (if cached; else the tiny LLaMA, said so in the record);
4. max_batch: the largest batch of full and h2o 20% (512-token prompts, 16 tokens generated) within 10% of the GPU's
   memory, found by running under ``torch.cuda.set_per_process_memory_fraction`` (h2o.bench.max_batch; on the CPU
   an estimate, so labelled), beside the KV-only figure;
5. row_kernels: which policies' simulated rows run the Triton kernel, and which the torch loop (one line each);
6. prefill: one prompt's prefill at 1k, 4k and 8k tokens per policy (the evicting cache; the model run with flash
   attention where installed, which then serves the prefill) beside transformers' sdpa, eager and flash attention
   unattached: seconds, ratio to sdpa, GPU memory added at the peak (:func:`prefill`; one process, unlike
   ``python -m h2o.bench prefill``).

    python -m h2o.bench.gpu_check --json runs/gpu_check.json          # needs CUDA; ~5 min on one GPU
    python -m h2o.bench.gpu_check --device cpu --quick --json out.json  # the same checks, small, on the CPU

Exit 1 if a check fails (the JSON says which), 2 on bad input (before any work). The JSON is rewritten after each
section (``finished`` false until the end), and a section that raises is recorded as ``{"error": ...}`` while the
others still run: a one-shot run on a lent GPU keeps everything it measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ATOLS = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2}  # as in tests/test_paths.py
POLICIES = ("h2o", "local", "streaming_llm", "fixed_h2", "topk_h2")


def equivalence(device: str, dtypes, L: int, P: int, policies=POLICIES) -> list[dict]:
    """Max |simulated - real| logits per (arch, dtype, policy)."""
    from h2o import attach, make_policy
    from h2o.assets.models import TINY_ARCHS, tiny_model

    ids = torch.randint(3, 128, (1, L), generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for arch in TINY_ARCHS:
        base = tiny_model(arch)
        for dt in dtypes:
            model = base.to(device=device, dtype=DTYPES[dt])
            for name in policies:
                policy = make_policy(name, budget=0.2)
                with torch.no_grad():
                    with attach(model, policy, prompt_len=P):
                        sim = model(ids).logits.float()
                    with attach(model, policy, mode="real") as h:
                        cache = h.new_cache()
                        outs = [model(ids[:, :P], cache=cache).logits]
                        outs += [model(ids[:, t:t + 1], cache=cache).logits for t in range(P, L)]
                diff = float((torch.cat(outs, 1).float() - sim).abs().max())
                rows.append({"arch": arch, "dtype": dt, "policy": name, "max_abs_diff": diff,
                             "atol": ATOLS[dt], "ok": diff <= ATOLS[dt]})
            base = model.float().cpu()
    return rows


def launches(device: str) -> dict:
    from h2o.assets.models import tiny_model
    from h2o.bench.launches import decode_counts, simulated_ops
    from h2o.bench.targets import meets
    from h2o.core.policies import make_policy

    model = tiny_model("llama").to(device)
    ids = torch.randint(3, 128, (1, 256), generator=torch.Generator().manual_seed(0)).to(device)
    sim = [simulated_ops(model, make_policy(n, budget=0.2), ids) for n in ("local", "streaming_llm", "h2o")]
    dec = [decode_counts(model, make_policy(n, budget=0.2), ids[:, :64]) for n in ("h2o", "local")]
    ok = all(meets("simulated_ops", r["ratio"]) for r in sim[:2]) and \
        all(meets("syncs_per_step", r["syncs_per_step"]) for r in dec)
    return {"simulated": sim, "decode": dec, "ok": ok}


def decode_time(model, ids, steps: int, device: str, policy=None) -> float:
    """Seconds per decoding step after a prefill of ``ids``: the evicting cache, or sdpa + DynamicCache."""
    from transformers import DynamicCache

    from h2o import attach
    from h2o.bench.measure import Timer, gpu_devices

    with torch.no_grad():
        if policy is None:
            prev = model.config._attn_implementation
            model.set_attn_implementation("sdpa")
            ctx, new = None, lambda: DynamicCache(config=model.config)
        else:
            ctx = attach(model, policy, mode="real")
            h = ctx.__enter__()
            new = h.new_cache
        try:
            cache = new()
            logits = model(ids, cache=cache).logits
            nxt = logits[:, -1:].argmax(-1)
            with Timer(gpu_devices(model)) as t:
                for _ in range(steps):
                    nxt = model(nxt, cache=cache).logits.argmax(-1)
        finally:
            if ctx is None:
                model.set_attn_implementation(prev)
            else:
                ctx.__exit__(None, None, None)
    return t.seconds / steps


def load(device: str, smollm2: bool = True):
    """(SmolLM2 if cached, else the tiny LLaMA; the record's model name, which says why)."""
    from h2o.assets.models import ModelUnavailableError, load_model, tiny_model

    try:
        if not smollm2:
            raise ModelUnavailableError("--quick")
        return load_model("smollm2-135m", dtype="auto", device_map=device)[0], "smollm2-135m"
    except (ModelUnavailableError, OSError) as e:
        return tiny_model("llama").to(device), f"tiny-llama (smollm2 not used: {e})"


def max_batch(model, name: str, prompt: int, gen: int, fraction: float) -> dict:
    """Largest batch of full and h2o 20% within ``fraction`` of the GPU's memory, found by running under
    ``torch.cuda.set_per_process_memory_fraction`` (the CPU: an estimate), beside the KV-only figure."""
    from h2o.bench.max_batch import largest_batch_under_cap
    from h2o.bench.variants import Variant

    recs = largest_batch_under_cap(model, [Variant("policy", "full"), Variant("policy", "h2o", 0.2)], prompt, gen,
                                   fraction)
    return {"model": name, "prompt": prompt, "gen": gen, "method": recs[0]["max_batch_method"],
            "policies": {f"{r['policy']} {r['budget']:g}": r["metrics"] for r in recs}}


def speed(model, name: str, device: str, prompt: int, steps: int, sim_tokens: int) -> dict:
    from h2o.bench.simulated import simulated_forward
    from h2o.core.policies import make_policy

    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab, (1, prompt), generator=torch.Generator().manual_seed(0)).to(device)
    base = decode_time(model, ids, steps, device)
    dec = {n: decode_time(model, ids, steps, device, make_policy(n, budget=0.2)) for n in ("h2o", "local")}
    sim = simulated_forward(model, T=sim_tokens, policies=(("h2o", 0.2), ("local", 0.2)), repeats=2,
                            verbose=False, model_name=name)
    return {"model": name, "dtype": str(next(model.parameters()).dtype), "prompt": prompt, "steps": steps,
            "sdpa_dynamic_s_per_step": base, "decode_s_per_step": dec,
            "decode_vs_sdpa": {n: s / base for n, s in dec.items()},
            "simulated_vs_eager": {r["policy"]: r["metrics"]["vs_eager"] for r in sim}}


PREFILL = ("full", "knorm", "keydiff", "streaming_llm", "snapkv", "pyramidkv", "adakv", "tova", "h2o")


def flash_installed(model) -> bool:
    """flash attention 2 for this model: CUDA, half precision, the ``flash_attn`` package."""
    from transformers.utils import is_flash_attn_2_available

    p = next(model.parameters())
    return p.device.type == "cuda" and p.dtype in (torch.float16, torch.bfloat16) and is_flash_attn_2_available()


def prefill(model, name: str, device: str, lengths=(1024, 4096, 8192), policies=PREFILL, budget: float = 0.2
            ) -> dict:
    """Per prompt length: one prefill per configuration (h2o.bench.prefill.timed_prefill): transformers' sdpa,
    eager and flash attention 2 (where installed), unattached, then each policy through the evicting cache, the
    model run with flash attention where installed (its kernel serves the prefill), else sdpa. Rows: seconds,
    ratio to sdpa's at the length, GPU memory added at the peak (None on the CPU)."""
    from h2o.bench.prefill import BASELINES, timed_prefill

    flash = flash_installed(model)
    own = "flash_attention_2" if flash else "sdpa"
    rows = []
    for length in lengths:
        ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        runs = [timed_prefill(model, config, ids, budget, own=own)
                for config in (*BASELINES, *(("flash_attention_2",) if flash else ()), *policies)]
        base = runs[0]["prefill_s"]
        rows += [{k: r.get(k) for k in ("prompt", "config", "attention", "prefill_s", "gpu_peak_added_mib")}
                 | {"x_sdpa": round(r["prefill_s"] / base, 3)} for r in runs]
    return {"model": name, "dtype": str(next(model.parameters()).dtype), "flash_attention": flash,
            "policies_run_with": own, "rows": rows}


def row_kernels() -> list[str]:
    """Per registered policy that walks rows in the simulated path: the Triton kernel it declares, or the torch
    row loop (a policy without a kernel form, also noticed once when it runs on CUDA)."""
    from h2o.core.row_kernel import coverage
    return coverage()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU tests)")
    ap.add_argument("--json", required=True, help="where the one JSON record goes")
    args = ap.parse_args(argv)
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        print(f"gpu-check: --device={args.device!r}: allowed: cuda, cuda:N, cpu", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu-check: --device={args.device}: no CUDA device here (torch {torch.__version__}); "
              "run on a GPU node or pass --device cpu", file=sys.stderr)
        return 2
    out = Path(args.json)
    t0 = time.perf_counter()
    dtypes = ("fp32", "bf16") if args.quick else tuple(DTYPES)
    L, P = (24, 10) if args.quick else (96, 40)
    record = {"device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "finished": False}
    loaded = {}

    def model():
        if not loaded:
            loaded["m"] = load(args.device, smollm2=not args.quick)
        return loaded["m"]

    sections = {
        "equivalence": lambda: equivalence(args.device, dtypes, L, P, POLICIES[:2] if args.quick else POLICIES),
        "launches": lambda: launches(args.device),
        "speed": lambda: speed(*model(), args.device, *((32, 4, 64) if args.quick else (1024, 64, 1024))),
        "max_batch": lambda: max_batch(*model(), *((32, 4, 0.1) if args.quick else (512, 16, 0.1))),
        "row_kernels": row_kernels,
        "prefill": lambda: prefill(*model(), args.device, *(((64,), ("full", "h2o", "snapkv")) if args.quick else ())),
    }
    for name, run in sections.items():  # one failing section is recorded and the others still run
        s0 = time.perf_counter()
        try:
            record[name] = run()
        except Exception as e:  # noqa: BLE001 -- a one-shot check on a lent GPU: keep what the others measure
            record[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0]}
        print(f"gpu-check: {name} in {time.perf_counter() - s0:.0f} s", file=sys.stderr, flush=True)
        record["seconds"] = time.perf_counter() - t0
        write(out, record)  # after every section: a run cut short keeps what it measured ("finished": false)
    for line in record["row_kernels"] if isinstance(record["row_kernels"], list) else ():
        print(f"gpu-check: simulated rows of {line}")
    eq = record["equivalence"]
    record["equivalence_ok"] = isinstance(eq, list) and all(r["ok"] for r in eq)
    record["ok"] = record["equivalence_ok"] and record["launches"].get("ok", False) and \
        not any("error" in record[k] for k in ("speed", "max_batch", "prefill"))
    record["finished"] = True
    write(out, record)
    print(f"gpu-check: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']:.0f} s -> {out}")
    return 0 if record["ok"] else 1


def write(out: Path, record: dict) -> None:
    """The JSON replaced whole (never a torn file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
    tmp.write_text(strict_dumps(record, indent=1))
    tmp.replace(out)

if __name__ == "__main__":
    sys.exit(main())
