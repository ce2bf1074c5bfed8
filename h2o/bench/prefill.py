"""``python -m h2o.bench prefill``: one prompt's prefill per policy beside transformers' sdpa and eager attention.

Each configuration (a policy through the evicting cache, ``attach(..., mode="real")``, or the unattached model
loaded with ``attn_implementation`` sdpa / eager and a ``DynamicCache``) runs in its own process: the model is
loaded, a 64-token prefill warms the kernels, then one prefill of the prompt (batch 1, random token ids of a fixed
seed) is timed, the cut at its end included. Peak memory: the process's resident high-water mark (``VmHWM``) reset
just before the timed prefill (``/proc/self/clear_refs``), less the resident memory then: what the prefill adds.
Configurations run side by side in one invocation, rotated in each repeat, so that the load of other processes
hits them alike; the medians are printed, with each configuration's ratio to sdpa's seconds at the same length and
its target (docs/benchmarks.md), met or not by the CPU-time ratio: at one thread a process's CPU time
is its own work, where the wall time also holds the waits that other processes on shared cores impose.

    python -m h2o.bench prefill --lengths 1024,4096 --threads 1
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from h2o.cli.args import ArgParser, choice, guard, positive_int, split_list
from h2o.cli.paths import output_file
from h2o.core.validate import check

BASELINES = ("sdpa", "eager")
KERNELS = (*BASELINES, "flash_attention_2")  # transformers' attention, unattached (flash: make gpu-check, on CUDA)
POLICIES = ("full", "knorm", "keydiff", "streaming_llm", "local", "random", "snapkv", "pyramidkv", "adakv", "tova",
            "expected_attention", "scissorhands", "h2o")
TARGETS = {**{p: 1.1 for p in ("full", "knorm", "keydiff", "streaming_llm", "local", "random")},
           **{p: 1.25 for p in ("snapkv", "pyramidkv", "adakv", "tova")}, "h2o": 2.0}


def rss_mib() -> tuple[float, float]:
    """(resident now, resident high-water mark) of this process in MiB (Linux /proc/self/status)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> bool:
    """Reset the resident high-water mark to the resident memory now (Linux >= 4.0); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(config: str, length: int, model_name: str, budget: float, threads: int, seed: int) -> dict:
    """One configuration's timed prefill, in this process."""
    import torch

    from h2o.assets.models import load_model

    torch.set_num_threads(threads)
    model, _ = load_model(model_name, attn_implementation=config if config in BASELINES else "eager")
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    out = timed_prefill(model, config, ids, budget, resident=True)
    return {**out, "threads": threads}


def timed_prefill(model, config: str, ids, budget: float, own: str | None = None, resident: bool = False) -> dict:
    """One prefill of ``ids`` (1, T) on ``model`` after a 64-token warm-up: ``config`` a baseline (transformers'
    attention of that name, ``DynamicCache``, unattached) or a policy through the evicting cache (the model run
    with ``own`` attention while unattached, None: as loaded; a flash kernel serves the prefill). Seconds (CUDA
    synchronised), process CPU seconds; on CUDA the GPU memory the prefill adds at its peak; ``resident``: the
    process's resident memory it adds at its peak (one configuration per process: ``VmHWM`` reset first)."""
    import torch
    from transformers import DynamicCache

    from h2o import attach, make_policy

    device = next(model.parameters()).device
    ids, warm = ids.to(device), ids[:, :64].to(device)
    previous = model.config._attn_implementation
    attention = config if config in KERNELS else own or previous
    model.set_attn_implementation(attention)

    def prefill(x):
        if config in KERNELS:
            model(x, cache=DynamicCache(config=model.config), use_cache=True)
            return
        with attach(model, make_policy(config, budget=budget) if config != "full" else make_policy("full"),
                    mode="real") as h:
            model(x, cache=h.new_cache())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    try:
        with torch.inference_mode():
            prefill(warm)
            sync()
            exact = resident and reset_peak()
            before, _ = rss_mib()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                gpu0 = torch.cuda.memory_allocated(device)
            t0, c0 = time.perf_counter(), time.process_time()
            prefill(ids)
            sync()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        model.set_attn_implementation(previous)
    _, peak = rss_mib()
    out = {"config": config, "prompt": ids.shape[1], "prefill_s": seconds, "prefill_cpu_s": cpu,
           "rss_before_mib": round(before, 1), "peak_added_mib": round(peak - before, 1) if exact else None,
           "device": str(device), "attention": attention,
           "budget": None if config in KERNELS or config == "full" else budget}
    if device.type == "cuda":
        out["gpu_peak_added_mib"] = round((torch.cuda.max_memory_allocated(device) - gpu0) / 2**20, 1)
    return out


def child(config: str, length: int, args, timeout: float) -> dict:
    """``measure`` in a fresh process (its own allocator and high-water mark)."""
    cmd = [sys.executable, "-m", "h2o.bench.prefill", "--one", config, "--lengths", str(length), "--model",
           args.model, "--budget", str(args.budget), "--threads", str(args.threads), "--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"config": config, "prompt": length, "error": f"timed out after {timeout:g} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"config": config, "prompt": length, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def summarize(runs: list[dict]) -> list[dict]:
    """The median seconds and memory of each (prompt, config), with the ratio to sdpa's and the target."""
    rows = []
    for length in sorted({r["prompt"] for r in runs}):
        at = [r for r in runs if r["prompt"] == length]
        configs = list(dict.fromkeys(r["config"] for r in at))
        sdpa = [r for r in at if r["config"] == "sdpa" and "error" not in r]
        base = statistics.median(r["prefill_s"] for r in sdpa) if sdpa else None
        base_cpu = statistics.median(r["prefill_cpu_s"] for r in sdpa) if sdpa else None
        for config in configs:
            ok = [r for r in at if r["config"] == config and "error" not in r]
            row = {"prompt": length, "config": config, "runs": len(ok)}
            if not ok:
                row["error"] = next(r["error"] for r in at if r["config"] == config)
                rows.append(row)
                continue
            s = statistics.median(r["prefill_s"] for r in ok)
            cpu = statistics.median(r["prefill_cpu_s"] for r in ok)
            mem = [r["peak_added_mib"] for r in ok if r["peak_added_mib"] is not None]
            row.update(prefill_s=round(s, 3), prefill_cpu_s=round(cpu, 3),
                       peak_added_mib=round(statistics.median(mem), 1) if mem else None,
                       ratio_sdpa=round(s / base, 2) if base else None,
                       cpu_ratio_sdpa=round(cpu / base_cpu, 2) if base_cpu else None, target=TARGETS.get(config))
            if row["cpu_ratio_sdpa"] is not None and row["target"] is not None:
                row["met"] = row["cpu_ratio_sdpa"] <= row["target"]
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| prompt | config | prefill s | x sdpa | CPU s | CPU x sdpa | peak added MiB | target | met (CPU) |\n"
            "|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['prompt']:,} | {r['config']} | {r['error']} | | | | | | |")
            continue
        target = f"<= {r['target']}x" if r["target"] else ""
        met = {True: "yes", False: "no"}.get(r.get("met"), "")
        mem = "" if r["peak_added_mib"] is None else f"{r['peak_added_mib']:,.1f}"
        ratio = "" if r["ratio_sdpa"] is None else f"{r['ratio_sdpa']:.2f}"
        cpu = "" if r["cpu_ratio_sdpa"] is None else f"{r['cpu_ratio_sdpa']:.2f}"
        lines.append(f"| {r['prompt']:,} | {r['config']} | {r['prefill_s']:.2f} | {ratio} | {r['prefill_cpu_s']:.2f} "
                     f"| {cpu} | {mem} | {target} | {met} |")
    return "\n".join(lines)


@guard
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m h2o.bench prefill", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,8192", help="prompt lengths, comma-separated")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies through the evicting cache")
    p.add_argument("--baselines", default="sdpa,eager", help="transformers' attention: sdpa, eager, or 'none'")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--budget", type=float, default=0.2, help="the policies' budget, a ratio of the prompt")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--repeats", type=int, default=1, help="rounds, each configuration once per round")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration's process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every measured run here (JSON lines)")
    p.add_argument("--one", default=None, help=argparse_hidden())
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from h2o.core.policies import REAL_POLICIES

    lengths = split_list("--lengths", args.lengths, positive_int, "an int >= 1")
    check(0 < args.budget <= 1, f"--budget={args.budget}: allowed: a ratio in (0, 1]")
    for flag, low in (("threads", 1), ("repeats", 1), ("seed", 0)):
        check(getattr(args, flag) >= low, f"--{flag}={getattr(args, flag)}: must be >= {low}")
    check(args.timeout > 0, f"--timeout={args.timeout}: must be > 0")
    if args.one is not None:  # a child: one configuration, one JSON line
        choice("--one", [args.one], [*BASELINES, *REAL_POLICIES])
        print(json.dumps(measure(args.one, lengths[0], args.model, args.budget, args.threads, args.seed)))
        return 0
    baselines = [] if args.baselines in ("", "none") else choice("--baselines", args.baselines.split(","), BASELINES)
    policies = choice("--policies", split_list("--policies", args.policies, str, "a policy name"), REAL_POLICIES)
    if args.json:
        output_file("--json", args.json)
    configs = [*baselines, *policies]
    runs = []
    for length in lengths:
        for k in range(args.repeats):
            order = configs[k % len(configs):] + configs[:k % len(configs)]  # rotated each round
            for config in order:
                runs.append(child(config, length, args, args.timeout))
                r = runs[-1]
                print(f"# {length} {config}: " + (r["error"] if "error" in r else f"{r['prefill_s']:.2f} s "
                      f"(CPU {r['prefill_cpu_s']:.2f} s), +{r['peak_added_mib']} MiB"), file=sys.stderr, flush=True)
    print(table(summarize(runs)))
    if args.json:
        with open(args.json, "w") as f:
            for r in runs:
                f.write(json.dumps(r) + "\n")
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
