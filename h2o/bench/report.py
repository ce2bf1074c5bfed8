"""Benchmark records as ratios to the full cache and as a printed table."""
from __future__ import annotations

import sys


def variant_label(policy: str, budget: float | int, quant: str = "none") -> str:
    """``h2o 0.2``, ``streaming-llm 64``, ``h2o 0.2 +uniform4``; ``full`` and the unmodified baselines without a
    budget."""
    b = "" if policy in ("full", "hf_sdpa", "hf_eager") else f" {budget:g}"
    return policy.replace("_", "-") + b + ("" if quant == "none" else f" +{quant}")


RATIO_METRICS = ("throughput_tok_s", "decode_tok_s", "decode_tok_cpu_s", "latency_s", "kv_bytes_max",
                 "kv_bytes_prefill", "kv_bytes")


def add_ratios(recs: list[dict]) -> None:
    """``metrics["vs_full"]`` (vs the harness's full cache) and ``metrics["vs_sdpa"]`` (unmodified model)."""
    refs = {"vs_full": next((r for r in recs if r["policy"] == "full"), None),
            "vs_sdpa": next((r for r in recs if r["policy"] == "hf_sdpa"), None)}
    for r in recs:
        for key, ref in refs.items():
            if ref is None:
                continue
            r["metrics"][key] = {m: (r["metrics"][m] / ref["metrics"][m]
                                     if r["metrics"].get(m) and ref["metrics"].get(m) else None)
                                 for m in RATIO_METRICS}


def fmt_cell(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def print_table(recs: list[dict], out=None, title: str | None = None) -> None:
    if not recs:
        return
    r0 = recs[0]
    title = title or (f"prompt {r0['prompt_len']} x batch {r0['batch_size']}, gen {r0['gen_len']} "
                      f"(prefill: {r0['prefill_mode']}, medians of {r0['n_samples']}, "
                      f"{r0['metrics']['threads']} threads)")
    cols = ["variant", "batch", "prefill s", "gen tok/s", "x full", "decode tok/s", "x full", "x sdpa",
            "cpu x full", "cpu x sdpa", "latency s", "x full", "KV prefill MiB", "x full", "KV max MiB", "x full",
            "KV end MiB", "peak RSS MiB", "+RSS MiB"]
    rows = []
    for r in recs:
        m = r["metrics"]
        vf, vs = m.get("vs_full", {}), m.get("vs_sdpa", {})
        label = variant_label(r["policy"], r["budget"], r.get("quant", "none"))
        rows.append([label, str(r["batch_size"]), fmt_cell(m["prefill_s"], ".2f"), fmt_cell(m["throughput_tok_s"], ".2f"),
                     fmt_cell(vf.get("throughput_tok_s"), ".2f"), fmt_cell(m["decode_tok_s"], ".2f"),
                     fmt_cell(vf.get("decode_tok_s"), ".2f"), fmt_cell(vs.get("decode_tok_s"), ".2f"),
                     fmt_cell(vf.get("decode_tok_cpu_s"), ".2f"), fmt_cell(vs.get("decode_tok_cpu_s"), ".2f"),
                     fmt_cell(m["latency_s"], ".2f"), fmt_cell(vf.get("latency_s"), ".2f"),
                     fmt_cell(m["kv_bytes_prefill"] / 2**20), fmt_cell(vf.get("kv_bytes_prefill"), ".3f"),
                     fmt_cell(m["kv_bytes_max"] / 2**20), fmt_cell(vf.get("kv_bytes_max"), ".3f"), fmt_cell(m["kv_bytes"] / 2**20),
                     fmt_cell(m["peak_mem_bytes"] / 2**20, ".0f"), fmt_cell(m["peak_mem_delta_bytes"] / 2**20, ".0f")])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    print(f"\n== {title}", file=out or sys.stdout)
    print(line(cols), file=out or sys.stdout)
    for row in rows:
        print(line(row), file=out or sys.stdout)
    (out or sys.stdout).flush()




def section_rows(records: list[dict], section: str, fields) -> list[dict]:
    """A ``make bench`` section's table rows from its records (full first), plain numbers for the run record: the
    fields every section has, then ``fields(record, metrics, vs_full)``'s own."""
    out = []
    for r in (r for r in records if r.get("section") == section):
        m = r["metrics"]
        vf = m.get("vs_full", {})
        out.append({"method": r["policy"], "budget": r["budget"], "prompt_len": r["prompt_len"],
                    "batch_size": r["batch_size"], "gen_len": r["gen_len"], "decode_tok_s": m["decode_tok_s"],
                    "decode_vs_full": vf.get("decode_tok_s"), "decode_cpu_vs_full": vf.get("decode_tok_cpu_s"),
                    "kv_bytes": m["kv_bytes"], **fields(r, m, vf)})
    return out

def print_section(argv: list[str] | None, module) -> int:
    """``python -m <module> <run folder or metrics.json of make bench>``: print the record's ``module.SECTION`` rows
    as markdown (``module.table``); 2 and one line when the record is unreadable, lacks the section (its option
    ``module.OPTION`` was null) or has rows without ``module.FIELDS`` (``module.row_error``)."""
    import json
    from pathlib import Path

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"error: usage: python -m {module.__name__} <run folder or metrics.json of make bench>",
              file=sys.stderr)
        return 2
    path = Path(args[0])
    path = path / "metrics.json" if path.is_dir() else path
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        print(f"error: {path}: not a readable record ({type(e).__name__}); allowed: a make bench run folder",
              file=sys.stderr)
        return 2
    section = module.SECTION
    if not isinstance(record, dict) or not record.get(section):
        print(f"error: {path}: no {section} section ({module.OPTION} was null, or the record predates it)",
              file=sys.stderr)
        return 2
    bad = module.row_error(record[section])
    if bad:
        print(f"error: {path}: {bad}; allowed: a make bench record whose {section} rows have "
              f"{', '.join(module.FIELDS)}", file=sys.stderr)
        return 2
    print(module.table(record[section]))
    return 0
