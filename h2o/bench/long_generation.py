"""The long-generation section of ``make bench``: every decode-time method (:data:`METHODS`) at a whole-cache token
budget, under each schedule it runs (the budget held at every step, ``compress=decode``, where it has a decoding
form; cut back to it every ``interval`` generated tokens, ``compress=interval``; then its own schedule where it is
neither, :data:`OWN`) beside the harness's full cache, generating ``gen_len`` tokens at ``batch`` rows in one
interleaved run. A rule that reads a model's offline statistics (triattention) is given them as the methods section
gives them (:func:`h2o.bench.every_policy.with_statistics`: the cache's file, else computed over random ids).
``methods`` (``task.long_gen_methods``) measures some of them (full always).

Each variant prefills its own random-token prompt of ``prompt_len`` tokens, then decodes greedily for ``gen_len``
tokens (no stop at EOS); ``repeats`` interleaved rounds, medians (:func:`h2o.bench.throughput.benchmark`,
``prefill="each"``). Per row (the record's ``long_generation``, :func:`rows`): decode tokens/s and its ratio to full
(wall and CPU time), the KV bytes at their most over the generation and at its end, and their ratio to full (full's
grow with every token; a budget's stay at it, an interval's breathe up to ``budget + interval``).

The field's size is 2,048 tokens at batch 8 (a GPU: ``task.long_gen=[2048,8]``); ``make bench`` on a CPU measures a
smaller one (conf/task/bench_targets.yaml), labelled with its sizes in the table's title.
``python -m h2o.bench.long_generation <run folder or metrics.json>`` prints a finished record's table as markdown.
"""
from __future__ import annotations

import sys

from h2o.bench.report import section_rows
from h2o.bench.throughput import benchmark
from h2o.bench.variants import Variant
from h2o.core.engine import keeps_all

SECTION = "long_generation"  # the records' ``section``: not read by the targets
OPTION = "task.long_gen"  # the make bench option that turns the section off (null)
FIRST = ("h2o", "tova", "streaming_llm", "local", "knorm", "keydiff")  # the first record's (2026-12-02) methods
METHODS = FIRST + ("triattention", "snapkv_d", "g_kv")  # the decode-time methods the section measures
NO_DECODE = ("g_kv",)  # cut at intervals only (compress=decode refused: docs/g_kv.md)
OWN = {"triattention": {"compress": "buffer"},  # its slack trigger: cut back once budget + interval are held
       "snapkv_d": {"compress": "interval", "interval": 1}}  # a cut after every token attended (docs/methods.md)


def schedules(interval: int, methods=METHODS) -> list[tuple[str, dict]]:
    """(method, schedule options) in the table's order: every step (the methods with a decoding form), every
    ``interval`` tokens (all), then each method's own schedule (:data:`OWN`; buffer's slack is ``interval``)."""
    every = {"compress": "interval", "interval": interval}
    return ([(m, {"compress": "decode"}) for m in methods if m not in NO_DECODE] + [(m, every) for m in methods]
            + [(m, {**every, **OWN[m]}) for m in methods if m in OWN])


def variants(budget: int, interval: int, methods=METHODS, model=None) -> list[Variant]:
    """full, then each method at ``budget`` under each of its :func:`schedules` (a rule that reads a model's
    statistics given ``model``'s: :func:`h2o.bench.every_policy.with_statistics`)."""
    from h2o.bench.every_policy import with_statistics
    from h2o.core.policies import make_policy

    return [Variant("policy", "full")] + [Variant.of(with_statistics(make_policy(m, budget=budget, **kw), model))
                                          for m, kw in schedules(interval, methods)]


def method_error(methods) -> str | None:
    """What is wrong with ``task.long_gen_methods`` (one line), or None (null: all of :data:`METHODS`)."""
    if methods is None:
        return None
    allowed = f"allowed: a list of {', '.join(METHODS)} (full is always measured)"
    if not isinstance(methods, (list, tuple)) or not methods:
        return f"task.long_gen_methods={methods!r}: expected a non-empty list of methods or null (all); {allowed}"
    bad = [m for m in methods if m not in METHODS] or [m for i, m in enumerate(methods) if m in methods[:i]]
    if bad:
        what = "named twice" if bad[0] in METHODS else "not a method of the long-generation section"
        return f"task.long_gen_methods={list(methods)}: {bad[0]!r} is {what}; {allowed}"
    return None


def measure(model, prompt_len: int, batch: int, gen_len: int, budget: int, interval: int, repeats: int = 3,
            warmup: int = 1, seed: int = 0, model_name: str | None = None, out=None, methods=None) -> list[dict]:
    """One interleaved run of :func:`variants` (``methods``: some of :data:`METHODS`, None all); the variant
    records, each with ``section``, ``compress`` and ``interval``; prints the table."""
    chosen = variants(budget, interval, METHODS if methods is None else tuple(methods), model)
    recs = benchmark(model, prompt_lens=[prompt_len], gen_lens=[gen_len], batch_sizes=[batch], prefill="each",
                     repeats=repeats, warmup=warmup, seed=seed, model_name=model_name, variants=chosen,
                     verbose=False, out=out)
    for v, r in zip(chosen, recs):
        policy = v.build()
        r["section"] = SECTION
        r["compress"] = None if keeps_all(policy) else policy.compress
        r["interval"] = None if keeps_all(policy) else policy.interval
    print_rows(rows(recs), out)
    return recs


def rows(records: list[dict]) -> list[dict]:
    """The table's rows from the section's records (full first), plain numbers for the run record."""
    return section_rows(records, SECTION, lambda r, m, vf: {
        "compress": r["compress"], "interval": r["interval"], "kv_bytes_max": m["kv_bytes_max"],
        "kv_max_vs_full": vf.get("kv_bytes_max"), "kv_end_vs_full": vf.get("kv_bytes")})


COLUMNS = ("method", "schedule", "budget", "decode tok/s", "x full", "CPU x full", "KV max MiB", "x full",
           "KV end MiB", "x full")
FIELDS = ("method", "compress", "interval", "budget", "decode_tok_s", "decode_vs_full", "decode_cpu_vs_full",
          "kv_bytes_max", "kv_max_vs_full", "kv_bytes", "kv_end_vs_full")  # what cells() reads


def cell(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def schedule(row: dict) -> str:
    """every step (decode), every N (interval), at budget+N (buffer: cut back once budget + N are held)."""
    if row["compress"] is None:
        return "-"
    if row["compress"] == "buffer":
        return f"at budget+{row['interval']}"
    return "every step" if row["compress"] == "decode" else f"every {row['interval']}"


def cells(row: dict) -> list[str]:
    mib = 2 ** 20
    return [row["method"], schedule(row), "-" if row["compress"] is None else f"{row['budget']:g}",
            cell(row["decode_tok_s"], ".2f"), cell(row["decode_vs_full"], ".2f"),
            cell(row["decode_cpu_vs_full"], ".2f"),
            cell(row["kv_bytes_max"] / mib, ".2f"), cell(row["kv_max_vs_full"], ".3f"),
            cell(row["kv_bytes"] / mib, ".2f"), cell(row["kv_end_vs_full"], ".3f")]


def title(table_rows: list[dict]) -> str:
    r0 = table_rows[0]
    return (f"long generation: prompt {r0['prompt_len']} x batch {r0['batch_size']}, {r0['gen_len']} tokens "
            f"generated (each prefills; medians)")


def table(table_rows: list[dict]) -> str:
    """The rows as a markdown table, its sizes in a line above."""
    lines = [f"{title(table_rows)}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in table_rows])


def print_rows(table_rows: list[dict], out=None) -> None:
    if not table_rows:
        return
    out = out or sys.stdout
    print(f"\n== {title(table_rows)}", file=out)
    widths = [max(len(c), *(len(cells(r)[i]) for r in table_rows)) for i, c in enumerate(COLUMNS)]
    for line in [list(COLUMNS)] + [cells(r) for r in table_rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)), file=out)
    out.flush()


def row_error(table_rows) -> str | None:
    """What is wrong with a record's ``long_generation`` rows for :func:`table` (one line), or None."""
    if not isinstance(table_rows, list) or not table_rows:
        return f"long_generation is {type(table_rows).__name__}, expected a non-empty list of rows"
    for i, row in enumerate(table_rows):
        lost = [k for k in FIELDS if not isinstance(row, dict) or k not in row]
        if lost:
            return f"long_generation row {i} lacks {', '.join(repr(k) for k in lost)}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Print the long-generation table of a ``make bench`` record (its folder or metrics.json) as markdown."""
    from h2o.bench.report import print_section

    return print_section(argv, sys.modules[__name__])


if __name__ == "__main__":
    sys.exit(main())
