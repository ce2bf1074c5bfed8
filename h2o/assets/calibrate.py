"""``python -m h2o.assets.calibrate``: fit KVQuant's offline constants for a model (h2o.core.quant.calibrate).

    python -m h2o.assets.calibrate --model smollm2-135m            # -> <cache>/kvquant/smollm2-135m.pt

Calibration text: ``--windows`` windows of ``--window`` tokens of Jane Austen's novels, taken half-way between
the windows ``austen_ppl`` scores (tokens ``(offset + i * stride) * window``, offset 25, stride 50, as the task's
stride 50): the perplexity table is never measured on text the datatypes were fitted on.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def calibration_windows(tokenizer, window: int, n: int, stride: int = 50, offset: int = 25) -> torch.Tensor:
    """(n, window) token ids of Austen, starting at tokens ``(offset + i * stride) * window``."""
    from h2o.assets.fetch import austen_text

    starts = [(offset + i * stride) * window for i in range(n)]
    ids = tokenizer(austen_text()[:(starts[-1] + window) * 8], add_special_tokens=False,
                    return_tensors="pt").input_ids[0]
    if starts[-1] + window > len(ids):
        raise SystemExit(f"error: --windows={n}: Austen has {len(ids)} tokens, too few for {n} windows")
    return torch.stack([ids[s:s + window] for s in starts])


def main(argv: list[str] | None = None) -> int:
    from h2o.assets.paths import calibration_file
    from h2o.core.quant import BITS

    p = argparse.ArgumentParser(prog="python -m h2o.assets.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="a conf/model name's pretrained (smollm2-135m, tiny:llama)")
    p.add_argument("--name", default=None, help="file name (default: --model); read as quant.calibration")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--out", default=None, help="default: <cache>/kvquant/<name>.pt")
    from h2o.cli.args import one_line

    args = one_line(p).parse_args(argv)
    if args.window < 2 or args.windows < 1:
        print(f"error: --window={args.window}, --windows={args.windows}: expected >= 2 and >= 1", file=sys.stderr)
        return 2
    from h2o.assets.model_spec import resolve_tiny
    from h2o.assets.models import load_model
    from h2o.core.quant.calibrate import fit

    t0 = time.time()
    model, tokenizer = load_model(resolve_tiny(args.model), attn_implementation="eager")  # as the committed fits
    windows = calibration_windows(tokenizer, args.window, args.windows)
    cal = fit(model, windows, BITS, meta={"model": args.model, "text": "austen", "window": args.window,
                                          "windows": args.windows})
    from pathlib import Path

    out = Path(args.out) if args.out else calibration_file(args.name or args.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    torch.save(cal, tmp)
    tmp.replace(out)  # no half-written file
    print(f"[calibrate] {cal['tokens']} tokens, {len(cal['codebooks'])} codebooks -> {out} "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
