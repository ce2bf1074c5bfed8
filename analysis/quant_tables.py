"""The quantization study's table (``conf/experiment/quant.yaml``, docs/quantization.md) from its records.

One table per experiment with quantized records and task: rows the KV quantizer (``none`` first, then each
scheme by falling bits) x model, columns each (policy, budget) run, cells the metric with its 95% interval,
picked by :data:`analysis.protocol.RULE` among the records of that quantizer (``none``: unquantized records).
"""
from __future__ import annotations

import pandas as pd

from analysis.protocol import RULE, annotate, as_records, choose, protocol_notes, select
from analysis.render import MISSING, Table
from analysis.labels import key_str, label, metric_for, pick_text, policy_order

SCHEME_ORDER = ("uniform", "kvquant")


def quant_keys(runs: pd.DataFrame) -> list[tuple[str, int | None]]:
    """(scheme, bits) of the records: ``("none", None)`` first, then each scheme by falling bits."""
    have = runs[["quant.quant", "quant.bits"]].dropna().drop_duplicates()
    keys = sorted({(str(q), int(b)) for q, b in have.itertuples(index=False)},
                  key=lambda k: (SCHEME_ORDER.index(k[0]) if k[0] in SCHEME_ORDER else 99, k[0], -k[1]))
    return [("none", None), *keys]


def quant_table(name: str, runs: pd.DataFrame, metric: str, digits: int) -> Table:
    recs = as_records(runs)
    columns = sorted({(p, 1.0 if p == "full" else float(b)) for p, b in runs[["policy", "budget"]].itertuples(index=False)},
                     key=lambda c: (policy_order(runs["policy"].unique()).index(c[0]), -c[1]))
    picks, rows = [], []
    for model in sorted(runs["model"].dropna().unique()):
        for scheme, bits in quant_keys(runs):
            where = {} if scheme == "none" else {"quant.quant": scheme, "quant.bits": bits}
            row = [model, scheme if bits is None else f"{scheme}{bits}"]
            for policy, budget in columns:
                pick = choose(select(recs, {"model": model, "policy": policy, "budget": budget, **where}), metric)
                picks.append(pick)
                row.append(pick)
            rows.append(row)
    tags, notes = protocol_notes(picks)
    cells = [[c if isinstance(c, str) else pick_text(c, digits, tags) for c in r] for r in rows]
    header = ["model", "quant"] + [f"{label(p)} {key_str(b)}" for p, b in columns]
    caption = [f"metric: {metric} [95% interval]", RULE, *notes,
               "quant: the KV cache's quantizer (conf/quant/*.yaml), scheme and bits; none = as the model computes",
               f"{MISSING} = no finished run"]
    return Table(name, f"{name.split('_quant')[0]}: {metric} by KV quantizer and policy", header, cells, caption)


def quant_tables(df: pd.DataFrame) -> list[Table]:
    """One table per experiment whose records include quantized ones, and task."""
    if "quant.quant" not in df.columns or df["quant.quant"].isna().all():
        return []
    df = annotate(df)
    out = []
    for exp in sorted(df.loc[df["quant.quant"].notna(), "experiment"].dropna().unique()):
        for task, runs in df[df["experiment"] == exp].groupby("task", sort=True):
            metric = metric_for(runs["task_kind"].iloc[0], runs)
            if metric is not None:
                out.append(quant_table(f"{exp}_{task}_quant", runs, metric, 2 if metric == "ppl" else 3))
    return out
