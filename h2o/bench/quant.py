"""``python -m h2o.bench.quant``: Austen perplexity and KV memory for {full, h2o} x {none, uniform, kvquant}.

    python -m h2o.bench.quant --model smollm2-135m --windows 4 --json quant.jsonl

Perplexity: ``austen_ppl``'s windows (``--window`` tokens, every 50th window of the six novels, the first
``--windows``), each scored in one forward under the simulated mask with the quantizer attached: every query
attends to the dequantized values the cache would hold (budget = ratio of the window).
Memory: bytes the evicting cache holds after prefilling one window: held slots x the row bytes of keys and
values (codes, scales / zero points, outliers and indices, pre-RoPE columns) + kvquant's sink token (its key and
value in the model's dtype, per layer and KV head) + the quantizer's per-model constants
(tests/test_quant.py checks this count against ``EvictingCache.nbytes``), and beside it the fp16 cache of the
full policy at the same length (``vs_fp16_full``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

SCHEMES = ("none", "uniform8", "uniform4", "uniform3", "uniform2", "kvquant4", "kvquant3", "kvquant2")


def quant_of(label: str, calibration: str | None = None):
    """``uniform4`` -> Uniform(4, 64); ``kvquant3`` -> KVQuant(3, calibration); ``none`` -> None."""
    from h2o.core.quant import make_quant

    if label == "none":
        return None
    name, bits = label.rstrip("0123456789"), int(label[len(label.rstrip("0123456789")):])
    return make_quant(name, bits=bits, **({"calibration": calibration} if name == "kvquant" else {}))


def kv_bytes_after_prefill(model, policy, quant, length: int) -> tuple[int, int]:
    """(bytes held, bytes of the fp16 full cache) after a prefill of ``length`` tokens."""
    cfg = model.config
    H, D, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    held = length if policy.is_full else int(policy.counts(torch.tensor([length])).total[0])
    row = 2 * D * 2 if quant is None else quant.row_bytes("key", D) + quant.row_bytes("value", D)
    sink = L * H * 2 * D * model.dtype.itemsize if quant is not None and quant.sink else 0  # column 0 as computed
    return L * H * held * row + sink + (quant.const_bytes() if quant else 0), L * H * length * 2 * D * 2


def perplexity(model, windows, policy, quant, batch_size: int) -> float:
    from h2o.core.attach import attach

    nll, count = 0.0, 0
    for s in range(0, len(windows), batch_size):
        ids = windows[s:s + batch_size]
        with torch.no_grad(), attach(model, policy, quant=quant):
            logits = model(ids).logits.float()
        nll += float(torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="sum"))
        count += ids[:, 1:].numel()
    return math.exp(nll / count)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o.bench.quant", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--calibration", default=None, help="kvquant file (default: <cache>/kvquant/<model>.pt)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from h2o.assets.models import load_model
    from h2o.assets.paths import cache_dir
    from h2o.core.policies import make_policy
    from h2o.tasks.perplexity import PerplexityTask

    calibration = args.calibration or str(cache_dir() / "kvquant" / f"{args.model}.pt")
    try:
        quants = {s: quant_of(s, calibration) for s in args.schemes.split(",")}
    except (ValueError, KeyError) as exc:
        print(f"error: --schemes={args.schemes}: {exc}", file=sys.stderr)
        return 2
    model, tok = load_model(args.model)
    windows = PerplexityTask("austen_ppl", window=args.window, n_windows=args.windows, stride=50).windows(tok)
    rows = []
    for pol in (make_policy("full"), make_policy("h2o", budget=args.budget)):
        for label, quant in quants.items():
            t0 = time.time()
            ppl = perplexity(model, windows, pol, quant, args.batch_size)
            held, fp16 = kv_bytes_after_prefill(model, pol, quant.bind(model) if quant else None, args.window)
            row = {"model": args.model, "policy": pol.name, "budget": pol.budget, "quant": label, "ppl": ppl,
                   "kv_bytes": held, "fp16_full_bytes": fp16, "vs_fp16_full": held / fp16, "windows": len(windows),
                   "tokens_scored": len(windows) * (args.window - 1), "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    """Markdown: one line per quantizer, perplexity and KV memory (KiB, share of the fp16 full cache) per policy."""
    pols = list(dict.fromkeys((r["policy"], r["budget"]) for r in rows))
    head = "| quant | " + " | ".join(f"{p} {b:g} ppl | KV KiB (vs fp16 full)" for p, b in pols) + " |"
    out = [head, "|" + "---|" * (1 + 2 * len(pols))]
    for q in dict.fromkeys(r["quant"] for r in rows):
        cells = []
        for p, b in pols:
            r = next((r for r in rows if (r["policy"], r["budget"], r["quant"]) == (p, b, q)), None)
            cells += ["—", "—"] if r is None else [f"{r['ppl']:.2f}",
                                                   f"{r['kv_bytes'] / 1024:,.0f} ({r['vs_fp16_full']:.3f})"]
        out.append(f"| {q} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
