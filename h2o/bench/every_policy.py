"""The methods section of ``make bench``: every method of the registry side by side, in one interleaved run.

Rows: the harness's full cache (the reference), then every registered policy with an evicting cache
(:data:`h2o.core.policies.REAL_POLICIES` less ``full``: a policy added to the registry gets its row) at the run's
budget, built from its conf/policy file (:func:`h2o.assets.policy_config.at_budget`), so in the timing that file
gives: ``compress: decode`` for the methods with a decoding form (the budget held at every step), ``prefill`` for
those defined at a prompt's end only (cut once to the budget, every decoded token kept). Each variant prefills its
own prompt (the prefill time and what the cut keeps are the method's own), then decodes greedily; ``repeats``
interleaved rounds, medians (:func:`h2o.bench.throughput.benchmark`, ``prefill="each"``, random-token prompts).

Per row (the record's ``methods``, :func:`rows`; the table, :func:`table`): the timing; prefill seconds; KV bytes
stored after the prefill (after the compression; padding included where a method stores uneven heads padded) and
their ratio to full; the tokens held then, per layer, KV head and sequence (mean: held tokens, not slots); the
per-slot state beside keys and values (positions, scores, a history window: ``kv_meta_bytes``); decode tokens/s and
its ratio to full (wall and CPU time); KV bytes at the end.

``python -m h2o.bench.every_policy <run folder or metrics.json>`` prints the table of a finished ``make bench`` record
as markdown (docs/benchmarks.md's table comes from there).
"""
from __future__ import annotations

import sys

from h2o.assets.policy_config import at_budget
from h2o.bench.report import section_rows
from h2o.bench.throughput import benchmark
from h2o.bench.variants import Variant
from h2o.core import engine

SECTION = "methods"  # the records' ``section``: not read by the targets
OPTION = "task.methods"  # the make bench option that turns the section off (null)


def method_names() -> list[str]:
    """Every registered policy with an evicting cache, less full (the reference), in the registry's order."""
    from h2o.core.policies import REAL_POLICIES

    return [p for p in REAL_POLICIES if p != "full"]


def method_variants(budget, model=None) -> list[Variant]:
    """full, then every method at ``budget`` in the timing of its conf/policy file (a rule that reads the model's
    statistics given them: :func:`with_statistics`)."""
    return [Variant("policy", "full")] + [Variant.of(with_statistics(at_budget(n, budget, "task.methods: "), model))
                                          for n in method_names()]


def with_statistics(policy, model):
    """``policy``, and where it reads a model's offline statistics (triattention) with ``model``'s: the cache's
    file (``python -m h2o.assets.triattention``), else computed here over random token ids (what a benchmark
    measures, time and bytes, does not depend on them; the row's record names them)."""
    if model is None or not engine.calibration(policy):
        return policy
    import torch

    from h2o.assets.triattention import calibrate, require
    from h2o.core.policies import PolicyError

    try:
        return policy.calibrated(require(str(model.name_or_path)))
    except PolicyError:  # no calibration (a tiny model has no weight files to key one by)
        vocab = model.config.get_text_config(decoder=True).vocab_size
        ids = torch.randint(0, vocab, (2, 128), generator=torch.Generator().manual_seed(0))
        return policy.calibrated(calibrate(model, ids, "none", {"model": str(model.name_or_path),
                                                                "text": "random ids (benchmark)"}))


def measure(model, prompt_len: int, batch: int, gen_len: int, budget, repeats: int = 3, warmup: int = 1,
            seed: int = 0, model_name: str | None = None, out=None) -> list[dict]:
    """One interleaved run of :func:`method_variants` at (``prompt_len``, ``batch``), ``gen_len`` tokens each;
    the variant records, each with ``section``, ``compress`` and ``kv_tokens_per_head`` (the mean over layers, KV
    heads and sequences of the tokens held after the prefill)."""
    variants = method_variants(budget, model)
    recs = benchmark(model, prompt_lens=[prompt_len], gen_lens=[gen_len], batch_sizes=[batch], prefill="each",
                     repeats=repeats, warmup=warmup, seed=seed, model_name=model_name, variants=variants,
                     verbose=False, out=out)
    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    for v, r in zip(variants, recs):
        held = r["metrics"].get("kv_tokens_prefill")
        r["section"], r["compress"] = SECTION, v.build().compress
        r["kv_tokens_per_head"] = None if held is None else held / (text.num_hidden_layers * heads * batch)
    print_rows(rows(recs), out)
    return recs


def rows(records: list[dict]) -> list[dict]:
    """The table's rows from the section's records (full first), plain numbers for the run record."""
    return section_rows(records, SECTION, lambda r, m, vf: {
        "compress": r["compress"] if r["policy"] != "full" else None, "prefill_s": m["prefill_s"],
        "kv_bytes_prefill": m["kv_bytes_prefill"], "kv_prefill_vs_full": vf.get("kv_bytes_prefill"),
        "tokens_held": r["kv_tokens_per_head"], "kv_meta_bytes": m["kv_meta_bytes"]})


def cell(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = ("method", "timing", "prefill s", "KV after prefill MiB", "x full", "tokens held", "state MiB",
           "decode tok/s", "x full", "CPU x full", "KV end MiB")


def cells(row: dict) -> list[str]:
    mib = 2 ** 20
    return [row["method"], row["compress"] or "-", cell(row["prefill_s"], ".2f"),
            cell(row["kv_bytes_prefill"] / mib, ".2f"), cell(row["kv_prefill_vs_full"], ".3f"),
            cell(row["tokens_held"], ".1f"), cell(row["kv_meta_bytes"] / mib, ".2f"), cell(row["decode_tok_s"], ".2f"),
            cell(row["decode_vs_full"], ".2f"), cell(row["decode_cpu_vs_full"], ".2f"),
            cell(row["kv_bytes"] / mib, ".2f")]


def table(table_rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cells(r)) + " |" for r in table_rows])


def print_rows(table_rows: list[dict], out=None) -> None:
    if not table_rows:
        return
    r0 = table_rows[-1]  # a method's row (full's budget is 1)
    out = out or sys.stdout
    print(f"\n== methods: prompt {r0['prompt_len']} x batch {r0['batch_size']}, gen {r0['gen_len']}, budget "
          f"{r0['budget']:g} (each prefills; medians)", file=out)
    widths = [max(len(c), *(len(cells(r)[i]) for r in table_rows)) for i, c in enumerate(COLUMNS)]
    for line in [list(COLUMNS)] + [cells(r) for r in table_rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)), file=out)
    out.flush()


def main(argv: list[str] | None = None) -> int:
    """Print the methods table of a ``make bench`` record (its folder or metrics.json) as markdown."""
    from h2o.bench.report import print_section

    return print_section(argv, sys.modules[__name__])


FIELDS = ("method", "compress", "prefill_s", "kv_bytes_prefill", "kv_prefill_vs_full", "tokens_held",
          "kv_meta_bytes", "decode_tok_s", "decode_vs_full", "decode_cpu_vs_full", "kv_bytes")  # what cells() reads
TEXT = ("method", "compress")  # the others: numbers (or null where the table prints -)


def row_error(table_rows) -> str | None:
    """What is wrong with a record's ``methods`` rows for :func:`table` (one line), or None."""
    if not isinstance(table_rows, list):
        return f"methods is {type(table_rows).__name__}, expected a list of rows"
    for i, row in enumerate(table_rows):
        if not isinstance(row, dict):
            return f"methods row {i} is {type(row).__name__}, expected an object"
        name = row.get("method", f"#{i}")
        lost = [k for k in FIELDS if k not in row]
        if lost:
            return f"methods row {i} ({name}) lacks {', '.join(repr(k) for k in lost)}"
        for k in FIELDS:
            v = row[k]
            ok = (v is None or isinstance(v, str)) if k in TEXT else \
                (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))
            if not ok or (k in ("method", "kv_bytes_prefill", "kv_meta_bytes", "kv_bytes") and v is None):
                return f"methods row {i} ({name}): {k}={v!r} is not {'a text' if k in TEXT else 'a number'}"
    return None


if __name__ == "__main__":
    sys.exit(main())
