"""``make parity`` / ``python -m h2o.parity``: the harness's methods beside kvpress 0.5.5's, same prompts.

Outside CI (it runs SmolLM2-135M on a few 2,048-token prompts and needs the parity virtualenv,
tools/parity/setup_venv.sh). Three steps, each resumable (a record already written is not run again):

1. **Prompts** (``<out>/prompts.json``): token ids, so both sides score the same tokens. ``ppl``: ``contexts``
   Austen passages of ``context_len`` tokens, each followed by its next ``cont_len`` tokens; ``needle``: Austen
   passages with "The magic number is NNNNN." spliced in at half depth, then a question and the answer.
2. **kvpress** (``<out>/kvpress.jsonl``): tools/parity/kvpress_side.py in the parity virtualenv (imports kvpress,
   never h2o): each press compresses the context once when it ends (kvpress's protocol).
3. **Ours** (``<out>/ours.jsonl``): the harness's evicting cache (``attach(model, policy, mode="real")``) on the same
   ids: a context forward (the cache is then cut to the budget), then one teacher-forced forward of the rest, which
   sees the kept tokens and itself: for the tokens scored this is kvpress's protocol. ``--decode`` also feeds the
   continuation one token at a time (the budget held at every step: ``compress: decode``).

Then the table (docs/results/parity.md, :mod:`h2o.parity.table`). Budgets: kvpress's ``compression_ratio``
``r`` is the share removed; ours is the share kept, as a token count ``n = int(L * (1 - r))`` for a context of
``L`` tokens (kvpress's rounding), so both hold exactly ``n`` tokens per layer and KV head.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from h2o.parity.pairs import DECODE, DECODE_ONLY, EXTRA, OURS
from h2o.parity.sides import ROOT, continuation_nll, forwards, nll_sum, parity_policy, run_kvpress
from h2o.cli.args import ArgParser, choice, guard, positive_int, split_list
from h2o.cli.paths import output_dir, output_file
from h2o.core.validate import check

NEEDLE_Q = "\n\nQuestion: What is the magic number mentioned in the text above?\nAnswer: The magic number is"


# ----------------------------------------------------------------------------------------------- prompts
def make_prompts(tokenizer, text: str, contexts: int, needles: int, context_len: int, cont_len: int,
                 seed: int = 0) -> dict:
    """Token-id prompts from ``text`` (a book): passages spaced evenly over its first tokens, none overlapping."""
    import random

    n = contexts + needles
    span = context_len + cont_len
    ids = tokenizer(text[: (n + 1) * span * 8], add_special_tokens=False).input_ids  # ~4 chars a token
    check(len(ids) >= n * span, f"the text has {len(ids)} tokens; {n} passages of {span} need {n * span}")
    step = len(ids) // n
    rng = random.Random(seed)
    out = {"ppl": [], "needle": [], "context_len": context_len, "cont_len": cont_len}
    for i in range(contexts):
        s = i * step
        out["ppl"].append({"id": f"austen-{i}", "start": s, "context": ids[s:s + context_len],
                           "continuation": ids[s + context_len:s + span]})
    for j in range(needles):
        s = (contexts + j) * step
        number = rng.randrange(10000, 100000)
        needle = tokenizer(f" The magic number is {number}.", add_special_tokens=False).input_ids
        body = ids[s:s + context_len - len(needle)]
        at = len(body) // 2
        out["needle"].append({"id": f"needle-{j}", "start": s, "depth": at, "number": number,
                              "context": body[:at] + needle + body[at:],
                              "question": tokenizer(NEEDLE_Q, add_special_tokens=False).input_ids,
                              "answer": tokenizer(f" {number}.", add_special_tokens=False).input_ids})
    return out


# ----------------------------------------------------------------------------------------------- our side
def run_ours(model, prompts: dict, methods: list[str], ratios: list[float], decode: bool, out: Path,
             threads: int) -> None:
    import torch
    import transformers

    from h2o.parity.table import decodes

    torch.set_num_threads(threads)
    done = read_done(out)
    jobs = [("full", 0.0, "prefill")]
    jobs += [(m, r, "prefill") for m in methods if m != "full" and m not in DECODE_ONLY
             and (OURS.get(m) or EXTRA.get(m)) for r in ratios]
    if decode:
        jobs += [(m, r, "decode") for m in methods if m in DECODE and OURS.get(m) and m not in DECODE_ONLY
                 and decodes(*OURS[m]) for r in ratios]  # ours has a decode form
    with out.open("a") as f:
        for method, ratio, timing in jobs:
            name, options = (OURS.get(method) or EXTRA[method])
            for kind in ("ppl", "needle"):
                for p in prompts[kind]:
                    if (method, ratio, timing, p["id"]) in done or (timing == "decode" and kind == "needle"):
                        continue
                    L = len(p["context"])
                    policy = parity_policy(name, options, L, ratio, timing)
                    ctx = torch.tensor([p["context"]])
                    t0 = time.perf_counter()
                    rec = {"side": "h2o", "method": method, "policy": policy.describe(), "ratio": ratio,
                           "timing": timing, "prompt": p["id"], "kind": kind, "context_len": L,
                           "transformers": transformers.__version__, "torch": torch.__version__}
                    if kind == "ppl":
                        cont = torch.tensor([p["continuation"]])
                        rec["nll"], held = continuation_nll(model, policy, ctx, cont, timing == "decode")
                        rec["n_tokens"] = cont.shape[1]
                    else:
                        q, a = torch.tensor([p["question"]]), torch.tensor([p["answer"]])
                        _, rest, held = forwards(model, policy, ctx, [torch.cat([q, a[:, :-1]], 1)], L)
                        rec["nll"], rec["exact"] = nll_sum(rest[q.shape[1] - 1:], a[0])
                        rec["n_tokens"] = a.shape[1]
                    rec["held_per_layer"] = held
                    rec["seconds"] = round(time.perf_counter() - t0, 2)
                    from h2o.store.strict_json import dumps as strict_dumps  # inf, nan: null
                    f.write(strict_dumps(rec) + "\n")
                    f.flush()
                    print(f"h2o {method} r={ratio} {timing} {p['id']}: nll/token "
                          f"{rec['nll'] / rec['n_tokens']:.4f} ({rec['seconds']} s)", file=sys.stderr, flush=True)


def read_done(path: Path) -> set:
    if not path.is_file():
        return set()
    return {(r["method"], r["ratio"], r["timing"], r["prompt"])
            for r in map(json.loads, path.read_text().splitlines())}


# ----------------------------------------------------------------------------------------------- the CLI
@guard
def main(argv=None) -> int:
    ap = ArgParser(prog="python -m h2o.parity", description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2", help="Austen context-then-continuation prompts")
    ap.add_argument("--needles", default="2", help="needle prompts")
    ap.add_argument("--context-len", default="2048")
    ap.add_argument("--cont-len", default="256")
    ap.add_argument("--ratios", default="0.5,0.8,0.9", help="kvpress compression ratios (share removed)")
    ap.add_argument("--methods", default=",".join([*OURS, *EXTRA]))
    ap.add_argument("--sides", default="kvpress,h2o", help="which sides to run (the table is always written)")
    ap.add_argument("--decode", action="store_true", help="also the decoding timing, token by token")
    ap.add_argument("--venv", default=str(ROOT / ".parity-venv"))
    ap.add_argument("--out", default=str(ROOT / "runs" / "parity"))
    ap.add_argument("--table", default=str(ROOT / "docs" / "results" / "parity.md"))
    ap.add_argument("--threads", default="1")
    ap.add_argument("--golden", action="store_true",
                    help="instead: record the CI golden numbers (kvpress on the committed tiny model, "
                         "tests/data/parity_golden/; h2o/parity/golden.py)")
    a = ap.parse_args(argv)
    counts = {k: split_list(f"--{k.replace('_', '-')}", getattr(a, k), positive_int, "an int >= 1")[0]
              for k in ("contexts", "needles", "context_len", "cont_len", "threads")}
    ratios = split_list("--ratios", a.ratios, float, "a number in (0, 1)")
    for r in ratios:
        check(0 < r < 1 and math.isfinite(r), f"--ratios={a.ratios!r}: {r} is not in (0, 1)")
    methods = choice("--methods", split_list("--methods", a.methods, str, "a method"), [*OURS, *EXTRA])
    sides = choice("--sides", split_list("--sides", a.sides, str, "a side"), ("kvpress", "h2o"))
    out = output_dir("--out", a.out)
    output_file("--table", a.table)
    venv = Path(a.venv)
    check(("kvpress" not in sides and not a.golden) or (venv / "bin" / "python").is_file(),
          f"--venv={a.venv!r}: no virtualenv there; create it with tools/parity/setup_venv.sh {a.venv}")
    if a.golden:
        from h2o.parity.golden import record

        return record(venv, counts["threads"])

    from h2o.assets.fetch import austen_text
    from h2o.assets.models import load_model, smollm2_path
    from h2o.parity.table import write_table

    out.mkdir(parents=True, exist_ok=True)
    model_path = smollm2_path()
    model, tok = load_model(str(model_path), dtype="float32")
    prompts_path = out / "prompts.json"
    if not prompts_path.is_file():
        prompts = make_prompts(tok, austen_text(), counts["contexts"], counts["needles"], counts["context_len"],
                               counts["cont_len"])
        prompts_path.write_text(json.dumps(prompts))
    prompts = json.loads(prompts_path.read_text())
    check(len(prompts["ppl"]) == counts["contexts"] and len(prompts["needle"]) == counts["needles"]
          and prompts["context_len"] == counts["context_len"] and prompts["cont_len"] == counts["cont_len"],
          f"--out={a.out!r}: its prompts.json was made with other sizes; use another --out")
    if "kvpress" in sides:
        t0 = time.perf_counter()
        run_kvpress(venv, prompts_path, model_path, out / "kvpress.jsonl", [m for m in methods if m in OURS],
                    ratios, a.decode, counts["threads"])
        print(f"kvpress side: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if "h2o" in sides:
        t0 = time.perf_counter()
        run_ours(model, prompts, methods, ratios, a.decode, out / "ours.jsonl", counts["threads"])
        print(f"h2o side: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    write_table(out, Path(a.table), prompts)
    print(f"table: {a.table}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
