"""The kvpress side of `make parity`: each kvpress 0.5.5 press on the prompts the harness wrote, as JSON records.

Runs in the parity virtualenv (tools/parity/setup_venv.sh), never in the harness's: it imports kvpress and
transformers, and nothing of ``h2o``. The prompts are token ids (the harness tokenized them), so both sides score
exactly the same tokens.

Protocol, kvpress's own (its pipeline's): the context is prefilled inside ``with press(model)``, which compresses
every layer's cache once, at the end of that forward; what follows is appended to the compressed cache and never
evicted, at the positions it would have had without compression (position ids continue from the context length).

* ``ppl`` prompts (context, continuation): the first continuation token is predicted by the context forward's last
  logits (computed before the cache is compressed, as in kvpress), the others by one teacher-forced forward of the
  continuation through the compressed cache. Recorded: summed NLL and token count.
* ``needle`` prompts (context, question, answer): the context is compressed, then question + answer are one
  teacher-forced forward (kvpress's query-agnostic protocol: the question is not in the compressed prompt).
  Recorded: the answer's summed NLL and whether every answer token is the argmax (greedy would produce it).
* ``--decode`` adds the decoding timing for the presses that have one here: ``PrefillDecodingPress`` (the prompt
  compressed to ``n - 1`` tokens, then ``DecodingPress`` re-scoring to ``n - 1`` after every step), the continuation
  fed one token at a time, so each query sees ``n`` tokens, itself included: the harness's ``compress: decode``.

* ``--interval N`` adds the interval timing for the presses that have one here: ``PrefillDecodingPress`` (the
  prompt compressed to ``n`` tokens, then ``DecodingPress(compression_interval=N, target_size=n)``: back to ``n``
  after every N-th step), the continuation fed one token at a time: the harness's ``compress: interval``.

* ``--variants V.json`` names presses with options: ``{"snapkv_w16": ["snapkv", {"window_size": 16}]}``; such a
  name is then a method of ``--methods`` (its records carry that name), run in the timings its press has here.

Usage: python tools/parity/kvpress_side.py --prompts P.json --model CKPT --out OUT.jsonl [--methods a,b]
       [--ratios 0.5,0.8] [--decode] [--interval N] [--variants V.json] [--threads 1]
Each line of OUT is one record; a record already in OUT (same method, ratio, timing, prompt) is not run again.
The record loop mirrors h2o.parity.driver.run_ours on purpose: this side may not import the harness.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# press name -> (attention implementation, factory(compression_ratio)); eager where a press reads the attention
# weights of the forward (ObservedAttention), sdpa elsewhere (AdaKV refuses eager; the others recompute the
# window attention they need from the queries).
METHODS = ("streaming_llm", "observed_attention", "tova", "snapkv", "pyramidkv", "adakv_snapkv", "knorm",
           "keydiff", "expected_attention", "random", "kvzip")
DECODE_METHODS = ("streaming_llm", "streaming_llm_ordered", "knorm", "keydiff", "random")  # no prompt window
# DecodingPress every N steps (N above a press's window: its window queries are the steps since the last cut)
INTERVAL_METHODS = (*DECODE_METHODS, "tova", "snapkv", "snapkv_ordered")
# presses that hide the removed keys behind fake keys instead of freeing them (AdaKV): what follows the context is
# fed one token at a time, because the fake key of a forward of m queries must have exp(q . k) ~ 0 for all m,
# which kvpress's hyperplane search cannot always find once m exceeds the head size (the tiny golden model: 16)
MASKING = ("adakv_snapkv", "kvzip")


def fail(msg: str) -> None:
    print(f"kvpress_side: {msg}", file=sys.stderr)
    sys.exit(2)


def make_press(name: str, ratio: float, **options):
    """kvpress's press ``name`` at ``compression_ratio`` ratio, ``options`` its other fields (adakv_snapkv: the
    inner SnapKVPress's)."""
    import kvpress as kp

    table = {
        "streaming_llm": lambda: kp.StreamingLLMPress(compression_ratio=ratio, **options),
        "observed_attention": lambda: kp.ObservedAttentionPress(compression_ratio=ratio, **options),
        "tova": lambda: kp.TOVAPress(compression_ratio=ratio, **options),
        "snapkv": lambda: kp.SnapKVPress(compression_ratio=ratio, **options),
        "pyramidkv": lambda: kp.PyramidKVPress(compression_ratio=ratio, **options),
        "adakv_snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=ratio, **options)),
        "knorm": lambda: kp.KnormPress(compression_ratio=ratio, **options),
        "keydiff": lambda: kp.KeyDiffPress(compression_ratio=ratio, **options),
        "expected_attention": lambda: kp.ExpectedAttentionPress(compression_ratio=ratio, **options),
        "random": lambda: kp.RandomPress(compression_ratio=ratio, **{"seed": 0, **options}),
        "kvzip": lambda: kp.KVzipPress(compression_ratio=ratio, **options),
    }
    return table[name]()


ROTARY = []  # the model's rotary embedding (snapkv_ordered: its window queries at their own positions)
NOW = [0]  # the position of the newest token fed (a compressed cache's cache_position counts its slots instead)


def scorer(name: str, ratio: float = 0.0, **options):
    """The scorer of a decoding-timing press (ratio 0: left to DecodingPress). Two diagnostics, not kvpress methods:
    ``streaming_llm_ordered``, StreamingLLMPress whose kept tokens stay in position order (kvpress gathers them in
    top-k order, so at the next compression "the oldest after the sinks" is then not the 5th slot);
    ``snapkv_ordered``, SnapKVPress with its kept tokens in position order (its pooling reads cache neighbours) and
    its window queries rotated to their own positions (under DecodingPress kvpress rotates them all by the current
    step's position: the step's ``position_embeddings``)."""
    if name not in ("streaming_llm_ordered", "snapkv_ordered"):
        return make_press(name, ratio, **options)
    import kvpress as kp
    import torch

    def ordered(base):
        class Ordered(base):
            def compress(self, module, hidden_states, keys, values, attentions, kwargs):
                scores = self.score(module, hidden_states, keys, values, attentions, kwargs)  # (B, Hkv, S)
                n = int(keys.shape[2] * (1 - self.compression_ratio))
                idx = scores.topk(n, dim=-1).indices.sort(-1).values[..., None].expand(-1, -1, -1, keys.shape[-1])
                return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()

            def score(self, module, hidden_states, keys, values, attentions, kwargs):
                if base is kp.SnapKVPress:  # the window's own positions: the last w before the current one, itself
                    now = NOW[0]
                    at = torch.arange(now + 1 - self.window_size, now + 1, device=keys.device)[None]
                    kwargs = {**kwargs, "position_embeddings": ROTARY[0](hidden_states, at)}
                return super().score(module, hidden_states, keys, values, attentions, kwargs)

        return Ordered

    if name == "streaming_llm_ordered":
        return ordered(kp.StreamingLLMPress)(compression_ratio=ratio, **options)
    return ordered(kp.SnapKVPress)(compression_ratio=ratio, **options)


def attn_impl(name: str) -> str:
    return "eager" if name == "observed_attention" else "sdpa"


def nll_sum(logits, targets):
    """logits (1, n, V), targets (n,) -> (summed NLL, all argmax correct)."""
    import torch

    logp = torch.log_softmax(logits[0].float(), -1)  # (n, V)
    nll = -logp.gather(-1, targets[:, None]).sum().item()
    return nll, bool((logp.argmax(-1) == targets).all().item())


def run_prefill(model, press, context, after, stepwise=False):
    """Compress ``context`` (1, L) with ``press`` (None: full cache), then one teacher-forced forward of ``after``
    (1, m); one token at a time where the layers hold unequal lengths (then a multi-token forward's mask, sized by
    layer 0, does not fit the others; a query of one token needs no mask) or with ``stepwise`` (the same attention).
    Returns (last context logits (1, 1, V), logits of ``after`` (1, m, V), tokens held per layer)."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    L = context.shape[1]
    with torch.no_grad():
        with press(model) if press is not None else contextlib.nullcontext():
            first = model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits
        held = [cache.get_seq_length(i) for i in range(len(cache))]
        pos = torch.arange(L, L + after.shape[1])[None]
        if len(set(held)) == 1 and not stepwise:
            rest = model(input_ids=after, past_key_values=cache, position_ids=pos).logits
        else:  # unequal layers (PyramidKV: one forward's mask would be sized by layer 0's), or a MASKING press
            rest = torch.cat([model(input_ids=after[:, i:i + 1], past_key_values=cache,
                                    position_ids=pos[:, i:i + 1]).logits for i in range(after.shape[1])], 1)
    return first, rest, held


def run_decode(model, name, ratio, context, cont, options):
    """The decoding timing: budget n = int(L * (1 - ratio)); the prompt is compressed to n - 1 tokens, each step
    sees n - 1 tokens plus itself and the cache is re-scored back to n - 1 after it. Returns (logits (1, m, V))."""
    import kvpress as kp
    import torch
    from transformers import DynamicCache

    L = context.shape[1]
    n = int(L * (1 - ratio))
    pre = scorer(name, 1 - (n - 0.5) / L, **options)  # int(L * (1 - r)) = int(n - 0.5) = n - 1, no float edge
    dec = kp.DecodingPress(base_press=scorer(name, **options), compression_interval=1, target_size=n - 1)
    press = kp.PrefillDecodingPress(prefilling_press=pre, decoding_press=dec)
    cache = DynamicCache()
    out = []
    with torch.no_grad(), press(model):
        out.append(model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits)
        for i in range(cont.shape[1] - 1):
            pos = torch.tensor([[L + i]])
            out.append(model(input_ids=cont[:, i:i + 1], past_key_values=cache, position_ids=pos).logits)
            assert cache.get_seq_length(0) == n - 1, (cache.get_seq_length(0), n - 1)
    return torch.cat(out, 1)


def run_interval(model, name, ratio, context, cont, options, every: int):
    """The interval timing: budget n = int(L * (1 - ratio)); the prompt is compressed to n tokens, then after every
    ``every``-th step (the step attended) the cache is re-scored back to n. Returns (logits (1, m, V))."""
    import kvpress as kp
    import torch
    from transformers import DynamicCache

    L = context.shape[1]
    n = int(L * (1 - ratio))
    pre = scorer(name, 1 - (n + 0.5) / L, **options)  # int(L * (1 - r)) = int(n + 0.5) = n, no float edge
    dec = kp.DecodingPress(base_press=scorer(name, **options), compression_interval=every, target_size=n)
    press = kp.PrefillDecodingPress(prefilling_press=pre, decoding_press=dec)
    cache = DynamicCache()
    out = []
    with torch.no_grad(), press(model):
        NOW[0] = L - 1
        out.append(model(input_ids=context, past_key_values=cache, logits_to_keep=1).logits)
        for i in range(cont.shape[1] - 1):
            pos = torch.tensor([[L + i]])
            NOW[0] = L + i
            out.append(model(input_ids=cont[:, i:i + 1], past_key_values=cache, position_ids=pos).logits)
            held = n + (i + 1) % every
            assert cache.get_seq_length(0) == held, (cache.get_seq_length(0), held)
    return torch.cat(out, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="full," + ",".join(METHODS))
    ap.add_argument("--ratios", default="0.5,0.8,0.9", help="kvpress compression ratios (share removed)")
    ap.add_argument("--decode", action="store_true", help="also the decoding timing (DecodingPress)")
    ap.add_argument("--interval", type=int, default=0, help="also the interval timing (DecodingPress every N)")
    ap.add_argument("--variants", help="JSON file: {name: [press, {option: value}]}, presses with options")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    presses = {m: (m, {}) for m in ("full", *METHODS, *INTERVAL_METHODS)}  # record name -> (press, options)
    if args.variants:
        try:
            variants = json.loads(Path(args.variants).read_text())
        except (OSError, ValueError) as e:
            fail(f"--variants {args.variants}: not a readable JSON file ({e})")
        for name, spec in variants.items():
            if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in METHODS + INTERVAL_METHODS
                    and isinstance(spec[1], dict)):
                fail(f"--variants {args.variants}: {name}: {spec!r} is not [press, {{options}}] with a press of "
                     f"{', '.join(dict.fromkeys(METHODS + INTERVAL_METHODS))}")
            presses[name] = (spec[0], spec[1])
    bad = [m for m in methods if m not in presses]
    if bad:
        fail(f"--methods {','.join(bad)}: allowed: {', '.join(presses)}")
    try:
        ratios = [float(r) for r in args.ratios.split(",")]
    except ValueError:
        fail(f"--ratios {args.ratios!r}: expected comma-separated numbers in (0, 1)")
    if not all(0 < r < 1 for r in ratios):
        fail(f"--ratios {args.ratios!r}: each compression ratio must be in (0, 1)")
    if args.interval < 0:
        fail(f"--interval {args.interval}: allowed: an int >= 1 (0: no interval timing)")
    if not Path(args.prompts).is_file():
        fail(f"--prompts {args.prompts}: no such file")
    if not (Path(args.model) / "config.json").is_file():
        fail(f"--model {args.model}: not a checkpoint folder (no config.json)")

    import importlib.metadata as md

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompts = json.loads(Path(args.prompts).read_text())
    out = Path(args.out)
    done = set()
    if out.is_file():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["method"], r["ratio"], r["timing"], r["prompt"]))
    models = {}

    def model_for(impl):
        if impl not in models:
            models[impl] = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                                attn_implementation=impl).eval()
        ROTARY[:] = [models[impl].model.rotary_emb]
        return models[impl]

    versions = {"kvpress": md.version("kvpress"), "transformers": transformers.__version__,
                "torch": torch.__version__}
    jobs = [("full", 0.0, "prefill")] + [(m, r, "prefill") for m in methods if presses[m][0] in METHODS
                                         for r in ratios]
    if args.decode:
        jobs += [(m, r, "decode") for m in methods if presses[m][0] in DECODE_METHODS for r in ratios]
    if args.interval:
        jobs += [(m, r, "interval") for m in methods if presses[m][0] in INTERVAL_METHODS for r in ratios]
    with out.open("a") as f:
        for method, ratio, timing in jobs:
            if method == "full" and "full" not in methods:
                continue
            for kind in ("ppl", "needle"):
                for p in prompts[kind]:
                    if (method, ratio, timing, p["id"]) in done or (timing != "prefill" and kind == "needle"):
                        continue
                    press_name, options = presses[method]
                    model = model_for(attn_impl(press_name))
                    ctx = torch.tensor([p["context"]])
                    t0 = time.perf_counter()
                    rec = {"side": "kvpress", "method": method, "ratio": ratio, "timing": timing, "prompt": p["id"],
                           "kind": kind, "context_len": ctx.shape[1], **versions,
                           **({"press": press_name, "options": options} if options else {})}
                    if kind == "ppl":
                        cont = torch.tensor([p["continuation"]])
                        if timing == "decode":
                            logits = run_decode(model, press_name, ratio, ctx, cont, options)
                        elif timing == "interval":
                            logits = run_interval(model, press_name, ratio, ctx, cont, options, args.interval)
                            rec["interval"] = args.interval
                        else:
                            press = None if method == "full" else make_press(press_name, ratio, **options)
                            first, rest, held = run_prefill(model, press, ctx, cont[:, :-1], press_name in MASKING)
                            logits = torch.cat([first, rest], 1)
                            rec["held_per_layer"] = held
                        rec["nll"], _ = nll_sum(logits, cont[0])
                        rec["n_tokens"] = cont.shape[1]
                    else:
                        q, a = torch.tensor([p["question"]]), torch.tensor([p["answer"]])
                        press = None if method == "full" else make_press(press_name, ratio, **options)
                        _, rest, held = run_prefill(model, press, ctx, torch.cat([q, a[:, :-1]], 1),
                                                    press_name in MASKING)
                        rec["nll"], rec["exact"] = nll_sum(rest[:, q.shape[1] - 1:], a[0])
                        rec["n_tokens"] = a.shape[1]
                        rec["held_per_layer"] = held
                    rec["seconds"] = round(time.perf_counter() - t0, 2)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    print(f"kvpress {method} r={ratio} {timing} {p['id']}: nll/token "
                          f"{rec['nll'] / rec['n_tokens']:.4f} ({rec['seconds']} s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
