"""Generic table engine: select runs, average a metric into cells, lay rows x columns.

A :class:`Col` is a column (or a row item) of a table: equality filters on the runs plus the
metric it shows. :func:`grid` crosses the model/task combinations present with the row items
and columns of a table's definition, so missing runs stay visible as ``—``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from analysis.render import MISSING, Table

PAPER_SHOTS = 5


@dataclass(frozen=True)
class Col:
    """One column (or row item): a label, equality filters on the runs, the metric shown."""
    label: str
    where: dict = field(default_factory=dict)
    metric: str | None = None


def num(v, digits: int = 3) -> str:
    return MISSING if v is None or pd.isna(v) else f"{v:.{digits}f}"


def key_str(v) -> str:
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return "?"
    return f"{v:g}" if isinstance(v, (float, np.floating)) else str(v)


def numeric(s: pd.Series) -> pd.Series:
    return pd.to_numeric(s, errors="coerce").astype(float)


def order(v) -> tuple:
    """Sort key: numbers by value, then strings, then missing."""
    if isinstance(v, str):
        return (1, 0.0, v)
    return (2, 0.0, "") if pd.isna(v) else (0, float(v), "")


def paper_split(df: pd.DataFrame) -> pd.DataFrame:
    """Drop H2O runs whose heavy/recent split is not even (ablations are not the paper's H2O)."""
    uneven = (df["policy"] == "h2o") & df["heavy"].notna() & df["recent"].notna() & ~np.isclose(
        numeric(df["heavy"]).fillna(0), numeric(df["recent"]).fillna(0))
    return df[~uneven]


def select(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    """Rows equal to every ``where`` value (floats compared with a tolerance)."""
    mask = pd.Series(True, index=df.index)
    for col, want in where.items():
        if col not in df.columns:
            return df.iloc[:0]
        if isinstance(want, float):
            mask &= np.isclose(numeric(df[col]), want)
        else:
            mask &= df[col] == want
    return df[mask.fillna(False).astype(bool)]


def largest(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with the most samples: a smoke run never averages into a full-size one."""
    n = numeric(runs["n_samples"]) if "n_samples" in runs.columns else None
    return runs if n is None or n.isna().all() else runs[n == n.max()]


def cell(runs: pd.DataFrame, metric: str, fmt=num) -> str:
    """Mean of ``metric`` over the runs (seeds); '—' if none; '±stderr' if exactly one run."""
    if metric not in runs.columns or runs[metric].dropna().empty:
        return MISSING
    values = pd.to_numeric(runs[metric], errors="coerce").dropna()
    text = fmt(values.mean())
    err = f"{metric}_stderr"
    if len(values) == 1 and err in runs.columns and pd.notna(runs[err].iloc[0]):
        text += f" ±{fmt(runs[err].iloc[0])}"
    return text


def main_shots(df: pd.DataFrame):
    """The paper's 5 shots if present, else the most common shot count."""
    shots = df["shots"].dropna()
    if shots.empty:
        return None
    return PAPER_SHOTS if (shots == PAPER_SHOTS).any() else shots.mode().iloc[0]


def kind(df: pd.DataFrame, task_kind: str | list[str], shots="main") -> pd.DataFrame:
    """Runs of the task kind(s), paper split, at one shot count ('main' = :func:`main_shots`,
    None = all)."""
    kinds = [task_kind] if isinstance(task_kind, str) else task_kind
    sub = paper_split(df[df["task_kind"].isin(kinds)])
    if shots == "main":
        shots = main_shots(sub)
    return sub if shots is None else sub[sub["shots"] == shots]


def same_key(df: pd.DataFrame, combo: pd.Series) -> pd.DataFrame:
    """Rows whose ``combo.index`` columns print like ``combo`` (so NaN matches NaN)."""
    keys = list(combo.index)
    return df[(df[keys].map(key_str) == combo.map(key_str)).all(axis=1)]


def grid(name: str, title: str, df: pd.DataFrame, cols: list[Col], caption: list[str],
         keys=("model", "task"), items: list[Col] | None = None, fmt=num,
         context=("semantics", "shots")) -> Table:
    """Rows = every combination of the ``keys`` values present (e.g. each model x each task)
    x ``items`` (row definitions); columns = ``cols``."""
    varying = [k for k in context if df[k].nunique(dropna=False) > 1]
    keys = [keys[0], *varying, *keys[1:]]
    levels = [sorted(df[k].drop_duplicates(), key=order) for k in keys]
    combos = pd.MultiIndex.from_product(levels, names=keys).to_frame(index=False)
    items = items or [Col("")]
    rows, used = [], []
    for _, combo in combos.iterrows():
        sub = same_key(df, combo)
        for item in items:
            hits = [largest(select(sub, {**item.where, **c.where})) for c in cols]
            cells = [cell(h, c.metric or item.metric, fmt) for h, c in zip(hits, cols)]
            rows.append([key_str(v) for v in combo] + ([item.label] if item.label else []) + cells)
            used.append(pd.concat(hits))
    header = keys + (["policy"] if items[0].label else []) + [c.label for c in cols]
    caption = caption + context_caption(df, [k for k in context if k not in varying])
    return with_n(Table(name, title, header, rows, caption), used)


def context_caption(df: pd.DataFrame, constant: list[str]) -> list[str]:
    lines = [f"{k}: {key_str(df[k].iloc[0])}" for k in constant]
    lines.append("models: " + ", ".join(sorted(df["model"].dropna().astype(str).unique())))
    seeds = sorted(df["seed"].dropna().unique())
    if seeds:
        lines.append("seeds: " + ", ".join(key_str(s) for s in seeds)
                     + (" (cells are means over seeds)" if len(seeds) > 1 else ""))
    lines.append(f"{MISSING} = no finished run")
    return lines


def with_n(table: Table, used: list[pd.DataFrame]) -> Table:
    """Sample count in the caption if constant, else an ``n`` column (range per row)."""
    per_row = [sorted(u["n_samples"].dropna().unique()) if len(u) else [] for u in used]
    every = sorted({n for row in per_row for n in row})
    if len(every) <= 1:
        table.caption.insert(0, f"n_samples: {key_str(every[0]) if every else '?'} per run")
        return table
    table.header.append("n")
    table.caption.insert(0, "n = samples per run (differs between rows)")
    for row, ns in zip(table.rows, per_row):
        row.append(f"{key_str(ns[0])}–{key_str(ns[-1])}" if len(ns) > 1
                   else key_str(ns[0]) if ns else MISSING)
    return table
