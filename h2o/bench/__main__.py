"""``python -m h2o.bench``: exploratory throughput measurements, printed (and ``--json``: the rows as JSON lines).

``python -m h2o.bench prefill --lengths 1024,4096``: prefill seconds and peak memory per policy beside transformers'
sdpa and eager attention, one process per configuration (:mod:`h2o.bench.prefill`).

Run records under runs/ come from the experiments only: ``make bench`` (``h2o-run experiment=bench``, the benchmark
targets, :mod:`h2o.bench.targets`) and ``h2o-run -m experiment=bench_tables`` (one run per policy)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from h2o.assets.model_spec import DTYPES, check_device, check_pretrained
from h2o.bench.simulated import simulated_forward
from h2o.bench.throughput import benchmark
from h2o.bench.variants import BASELINES
from h2o.assets.policy_config import at_budget
from h2o.core.policies import REAL_POLICIES
from h2o.cli.args import ArgParser, budget_value, choice, guard, positive_int, split_list
from h2o.cli.paths import output_file
from h2o.core.validate import check, is_number


def ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x]


def budgets_arg(s: str) -> list[float | int]:
    return [int(x) if x.isdigit() else float(x) for x in str(s).split(",") if x]


def write_rows(records: list[dict], path: str | None) -> None:
    """The measured rows as JSON lines (exploration; run records: ``h2o-run experiment=bench|bench_tables``)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # checked creatable before the work (validate)
        with open(path, "w") as f:
            for r in records:
                from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
                f.write(strict_dumps(r) + "\n")


def validate(args) -> None:
    """Every value checked before the model loads (h2o.cli): BadInput with one line otherwise."""
    check_pretrained(args.model, "--model")
    check(args.dtype in DTYPES, f"--dtype={args.dtype!r}: allowed: {', '.join(DTYPES)}")
    check(args.device is None or args.device == "cpu" or args.device.startswith("cuda"),
          f"--device={args.device!r}: allowed: cpu, cuda, cuda:<n>")
    check_device(args.device)
    for flag in ("prompt", "gen", "batch"):
        split_list(f"--{flag}", getattr(args, flag), positive_int, "an int >= 1")
    longest = max(split_list("--prompt", args.prompt, positive_int, "an int >= 1"))
    policies = choice("--policies", split_list("--policies", args.policies, str, "a policy name"), REAL_POLICIES)
    for name in policies:
        for b in split_list("--budget", args.budget, budget_value, "a ratio in (0, 1] or a token count"):
            policy = at_budget(name, b, "--policies ")  # as Hydra's policy=<name> policy.budget=<b>
            policy.check_reach(longest, f"--prompt {longest}, the longest")
    if args.baselines not in ("", "none"):
        choice("--baselines", args.baselines.split(","), BASELINES)
    for flag, low in (("repeats", 1), ("warmup", 0), ("max_batch_cap", 1), ("threads", 0),
                      ("prefill_chunk", 0), ("seed", 0)):
        check(getattr(args, flag) >= low, f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= {low}")
    if args.kv_limit_mib != "full":
        mib = split_list("--kv-limit-mib", args.kv_limit_mib, float, "a number of MiB or 'full'")
        check(len(mib) == 1 and is_number(mib[0]) and mib[0] >= 0,
              f"--kv-limit-mib={args.kv_limit_mib!r}: expected one number of MiB >= 0 or 'full'")
    if args.json:
        output_file("--json", args.json)


@guard
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prefill"]:  # python -m h2o.bench prefill ...: one prompt's prefill per policy (h2o.bench.prefill)
        from h2o.bench.prefill import main as prefill_main

        return prefill_main(argv[1:])
    p = ArgParser(prog="python -m h2o.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    p.add_argument("--gen", default="32", help="generation lengths, comma-separated")
    p.add_argument("--batch", default="1", help="batch sizes, comma-separated")
    p.add_argument("--policies", default="full,local,h2o")
    p.add_argument("--budget", default="0.2", help="budgets: ratios of the prompt or token counts, comma-separated")
    p.add_argument("--quant", default="none", help="KV quantization of each policy variant, comma-separated: "
                   "none, uniform8/4/3/2, kvquant4/3/2 (h2o.core.quant.quant_of)")
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
    p.add_argument("--sim-only", action="store_true", help="only the simulated-mask forward (--prompt tokens)")
    args = p.parse_args(argv)
    validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    from h2o.assets.models import load_model
    from h2o.assets.paths import calibration_file
    device_map = args.device if args.device else None
    model, _ = load_model(args.model, dtype=args.dtype, device_map=device_map)
    if args.sim_only:
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
                            calibration=str(calibration_file(args.model)))
    write_rows(records, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
