"""``python -m h2o.bench.quant``: Austen perplexity and KV memory for {full, h2o} x {none, uniform, kvquant}.

    python -m h2o.bench.quant --model smollm2-135m --windows 4 --json quant.jsonl
    python -m h2o.bench.quant --long 2048 --long-scored 512 --schemes none,uniform4,kvquant4   # Emma, one context
    python -m h2o.bench.quant --schemes '' --hf hqq4,hqq2 --decoded none,uniform4 --hf-windows 1

Perplexity: ``austen_ppl``'s windows (``--window`` tokens, every 50th window of the six novels, the first
``--windows``), each scored in one forward under the simulated mask with the quantizer attached: every query
attends to the dequantized values the cache would hold (budget = ratio of the window).
Memory: bytes the evicting cache holds after prefilling one window: held slots x the row bytes of keys and
values (codes, scales / zero points, outliers and indices, pre-RoPE columns) + kvquant's sink token (its key and
value in the model's dtype, per layer and KV head) + the quantizer's per-model constants
(tests/test_quant.py checks this count against ``EvictingCache.nbytes``), and beside it the fp16 cache of the
full policy at the same length (``vs_fp16_full``).
Long context (``--long``): the first ``--long`` tokens of *Emma* as one context (within SmolLM2's 8,192), scored
on its last ``--long-scored`` tokens in one pass (h2o's budget a ratio of the context).
Token by token (``--hf``, ``--decoded``, full budget): the first ``--hf-windows`` windows fed one token at a time
through transformers' ``QuantizedCache`` (it never evicts; its prefill returns unquantized keys, so it is only
comparable token by token) or through our evicting cache: perplexity, decode ms per token, bytes held at the end.
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


def perplexity(model, windows, policy, quant, batch_size: int, scored: int | None = None) -> float:
    """Perplexity of ``windows`` (N, W) in one simulated pass each; ``scored``: only the last ``scored`` tokens
    of each window are predicted (the long-context protocol), default all W - 1."""
    from h2o.core.attach import attach

    nll, count = 0.0, 0
    k = windows.shape[1] - 1 if scored is None else scored
    for s in range(0, len(windows), batch_size):
        ids = windows[s:s + batch_size]
        with torch.no_grad(), attach(model, policy, quant=quant):
            logits = model(ids).logits[:, -k - 1:-1].float()  # (b, k, V)
        nll += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, -k:], reduction="sum"))
        count += ids[:, -k:].numel()
    return math.exp(nll / count)


def emma_context(tokenizer, tokens: int) -> torch.Tensor:
    """(1, tokens) ids: the opening of Jane Austen's *Emma* (the long-context protocol's one context)."""
    from h2o.assets.fetch import austen_novels

    ids = tokenizer(austen_novels()["Emma"][:tokens * 8], add_special_tokens=False,
                    return_tensors="pt").input_ids[0]
    if len(ids) < tokens:
        raise SystemExit(f"error: --long={tokens}: Emma's opening has only {len(ids)} tokens")
    return ids[None, :tokens]


def hf_cache_bytes(cache) -> int:
    """Bytes a transformers ``QuantizedCache`` (hqq) holds: packed codes, scales and zero points, residual keys and
    values in the model's dtype."""
    total = 0
    for layer in cache.layers:
        for packed, meta in (layer._quantized_keys, layer._quantized_values):
            total += packed.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
        total += layer.keys.nbytes + layer.values.nbytes
    return total


def decoded_ppl(model, windows, cache_of) -> tuple[float, float, float, int]:
    """Each window fed token by token through ``cache_of(window_len)`` (a fresh cache; a context manager may
    wrap the forwards, see :func:`hf_cache`) -> (perplexity, decode seconds per token (wall, this process's CPU),
    bytes held at the end of the last window, all of it fed)."""
    nll, count, seconds, cpu = 0.0, 0, 0.0, 0.0
    for ids in windows:
        with cache_of(len(ids)) as (cache, nbytes):
            t0, c0 = time.perf_counter(), time.process_time()
            for t in range(len(ids)):  # the last token too: the cache then holds the window, as in the table
                with torch.no_grad():
                    logits = model(ids[None, t:t + 1], cache=cache, use_cache=True).logits[0, -1].float()
                nll -= float(logits.log_softmax(-1)[ids[t + 1]]) if t + 1 < len(ids) else 0.0
            seconds, cpu = seconds + time.perf_counter() - t0, cpu + time.process_time() - c0
            held = nbytes(cache)
        count += len(ids)
    return math.exp(nll / (count - len(windows))), seconds / count, cpu / count, held


def hf_cache(model, backend: str, bits: int, residual: int, group: int = 64, axis: int = 0):
    """cache_of for transformers' QuantizedCache at its defaults: ``axis`` 0 (hqq cuts the flattened (B, H, T, D)
    tensor into ``group`` rows and scales each column: strided groups), the last up to ``residual`` tokens kept in
    the model's dtype until they are flushed into the quantized part (the whole cache re-quantized at each flush).
    Axis 1 (groups of ``group`` channels of each vector, as ``uniform``) fails on SmolLM2 in hqq 0.2.8.post1: its
    4-bit codes pack two rows a byte, and 3 KV heads x 1 token give an odd number of groups (dequantize: "The size
    of tensor a (4) must match the size of tensor b (3)")."""
    from contextlib import contextmanager

    from transformers import QuantizedCache

    @contextmanager
    def make(length):
        yield QuantizedCache(backend, model.config, nbits=bits, axis_key=axis, axis_value=axis, q_group_size=group,
                             residual_length=residual), hf_cache_bytes
    return make


def ours_cache(model, policy, quant):
    """cache_of for the harness's evicting cache (real path) with ``quant``."""
    from contextlib import contextmanager

    from h2o.core.attach import attach

    @contextmanager
    def make(length):
        with attach(model, policy, mode="real", quant=quant) as h:
            yield h.new_cache(ref_len=length), lambda c: c.nbytes()
    return make


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2o.bench.quant", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--schemes", default=",".join(SCHEMES), help="simulated one-pass rows ('' for none)")
    p.add_argument("--calibration", default=None, help="kvquant file (default: <cache>/kvquant/<model>.pt; relative: inside <cache>)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--hf", default="", help="transformers QuantizedCache rows, e.g. hqq4,hqq2 (full budget, fed "
                   "token by token beside ours: --decoded; needs the backend installed)")
    p.add_argument("--decoded", default="", help="our schemes fed token by token through the evicting cache "
                   "(full budget), for decode time beside --hf, e.g. none,uniform4")
    p.add_argument("--hf-windows", type=int, default=1, help="windows fed token by token (--hf, --decoded)")
    p.add_argument("--residual", type=int, default=128, help="QuantizedCache's residual_length (its default)")
    p.add_argument("--long", type=int, default=0, help="long context instead of the windows: the first LONG "
                   "tokens of Emma in one pass (budget = ratio of LONG), the last --long-scored predicted")
    p.add_argument("--long-scored", type=int, default=512)
    from h2o.cli.args import one_line

    args = one_line(p).parse_args(argv)
    if args.long and not 1 <= args.long_scored < args.long:
        print(f"error: --long-scored={args.long_scored}: allowed 1-{args.long - 1} (below --long)", file=sys.stderr)
        return 2
    from h2o.assets.models import load_model
    from h2o.assets.paths import calibration_file
    from h2o.core.policies import make_policy
    from h2o.tasks.perplexity import PerplexityTask

    calibration = str(calibration_file(args.model, args.calibration))
    try:
        quants = {s: quant_of(s, calibration) for s in filter(None, args.schemes.split(","))}
    except (ValueError, KeyError) as exc:
        print(f"error: --schemes={args.schemes}: {exc}", file=sys.stderr)
        return 2
    model, tok = load_model(args.model)
    if args.long:
        windows, args.window, scored = emma_context(tok, args.long), args.long, args.long_scored
    else:
        windows = PerplexityTask("austen_ppl", window=args.window, n_windows=args.windows, stride=50).windows(tok)
        scored = args.window - 1
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                from h2o.assets.strict_json import dumps as strict_dumps  # inf, nan: null
                f.write(strict_dumps(row) + "\n")

    _, fp16 = kv_bytes_after_prefill(model, make_policy("full"), None, args.window)
    base = {"model": args.model, "windows": len(windows), "tokens_scored": len(windows) * scored,
            **({"text": "emma", "context": args.long} if args.long else {})}
    for pol in (make_policy("full"), make_policy("h2o", budget=args.budget)) if quants else ():
        for label, quant in quants.items():
            t0 = time.time()
            ppl = perplexity(model, windows, pol, quant, args.batch_size, scored)
            held, _ = kv_bytes_after_prefill(model, pol, quant.bind(model) if quant else None, args.window)
            emit({**base, "policy": pol.name, "budget": pol.budget, "quant": label, "ppl": ppl, "kv_bytes": held,
                  "fp16_full_bytes": fp16, "vs_fp16_full": held / fp16, "seconds": round(time.time() - t0, 1)})
    fed = windows[:args.hf_windows]
    makers = {f"{s} (decoded)": ours_cache(model, make_policy("full"), quant_of(s, calibration))
              for s in filter(None, args.decoded.split(","))}
    for s in filter(None, args.hf.split(",")):
        backend, bits = s.rstrip("0123456789"), int(s[len(s.rstrip("0123456789")):])
        makers[f"hf-{s} r{args.residual}"] = hf_cache(model, backend, bits, args.residual)
    for label, make in makers.items():
        t0 = time.time()
        ppl, step_s, cpu_s, held = decoded_ppl(model, fed, make)
        emit({**base, "windows": len(fed), "tokens_scored": len(fed) * (args.window - 1), "policy": "full",
              "budget": 1.0, "quant": label, "ppl": ppl, "kv_bytes": held, "fp16_full_bytes": fp16,
              "vs_fp16_full": held / fp16, "decode_ms_per_token": round(1000 * step_s, 2),
              "decode_cpu_ms_per_token": round(1000 * cpu_s, 2),
              "seconds": round(time.time() - t0, 1)})
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
