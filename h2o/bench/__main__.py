"""``python -m h2o.bench``: the throughput benchmark's command line (``make bench`` runs ``--suite targets``)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from h2o.assets.model_spec import DTYPES, check_device, check_pretrained
from h2o.bench.simulated import simulated_forward
from h2o.bench.throughput import BASELINES, benchmark
from h2o.core.policies import POLICIES, make_policy
from h2o.core.validate import (ArgParser, budget_value, check, check_name, choice, guard, is_number, output_dir,
                               output_file, positive_int, split_list)


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
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the work (validate)
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


def validate(args) -> None:
    """Every value checked before the model loads (h2o.core.validate): BadInput with one line otherwise."""
    check_pretrained(args.model, "--model")
    check(args.dtype in DTYPES, f"--dtype={args.dtype!r}: allowed: {', '.join(DTYPES)}")
    check(args.device is None or args.device == "cpu" or args.device.startswith("cuda"),
          f"--device={args.device!r}: allowed: cpu, cuda, cuda:<n>")
    check_device(args.device)
    for flag in ("prompt", "gen", "batch"):
        split_list(f"--{flag}", getattr(args, flag), positive_int, "an int >= 1")
    for flag in ("long", "short", "e2e"):
        check(len(split_list(f"--{flag}", getattr(args, flag), positive_int, "an int >= 1")) == 2,
              f"--{flag}={getattr(args, flag)!r}: expected prompt,batch (two ints >= 1)")
    policies = choice("--policies", split_list("--policies", args.policies, str, "a policy name"), POLICIES)
    for name in policies:
        for b in split_list("--budget", args.budget, budget_value, "a ratio in (0, 1] or a token count"):
            make_policy(name, budget=b)
    if args.baselines not in ("", "none"):
        choice("--baselines", args.baselines.split(","), BASELINES)
    for flag, low in (("repeats", 1), ("warmup", 0), ("max_batch_cap", 1), ("sim", 1), ("threads", 0),
                      ("prefill_chunk", 0), ("seed", 0)):
        check(getattr(args, flag) >= low, f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= {low}")
    if args.kv_limit_mib != "full":
        mib = split_list("--kv-limit-mib", args.kv_limit_mib, float, "a number of MiB or 'full'")
        check(len(mib) == 1 and is_number(mib[0]) and mib[0] >= 0,
              f"--kv-limit-mib={args.kv_limit_mib!r}: expected one number of MiB >= 0 or 'full'")
    if args.json:
        output_file("--json", args.json)
    if args.runs:
        output_dir("--runs", args.runs)
        check_name("--experiment", args.experiment)


@guard
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog="python -m h2o.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    p.add_argument("--gen", default="32", help="generation lengths, comma-separated (suite: one; make bench: 8)")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="full,local,h2o")
    p.add_argument("--budget", default="0.2", help="budgets: ratios of the prompt or token counts, comma-separated")
    p.add_argument("--quant", default="none", help="KV quantization of each policy variant, comma-separated: "
                   "none, uniform8/4/3/2, kvquant4/3/2 (h2o.bench.quant)")
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
    validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from h2o.assets.models import load_model
    from h2o.assets.paths import cache_dir
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
                            seed=args.seed, model_name=args.model, quants=args.quant.split(","),
                            calibration=str(cache_dir() / "kvquant" / f"{args.model}.pt"))
    write_records(records, args.json, args.runs, args.experiment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
