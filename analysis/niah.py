"""Needle-in-a-haystack heatmaps: accuracy over context length x needle depth, one panel per policy and budget.

From the ``niah`` runs' records (``task_kind`` retrieval; each sample of ``samples.jsonl`` carries ``length``,
``depth`` and ``acc``, h2o.tasks.long_context): one figure per experiment x model x task,
``<experiment>_<task>_heatmap`` (e.g. ``niah_niah_heatmap``), its panels ordered by policy then budget (the full
cache first), each cell the fraction of its samples whose number was found (written in the cell, with the sample
count in the panel title). One record per policy and budget, picked like a table cell
(:data:`analysis.protocol.RULE`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.records import load_samples
from analysis.tables import key_str, label, policy_order


def cell_table(samples: list[dict]) -> pd.DataFrame:
    """Samples -> accuracy (rows: length, ascending; columns: depth, ascending)."""
    df = pd.DataFrame(samples)
    return df.pivot_table(index="length", columns="depth", values="acc", aggfunc="mean").sort_index()


def heatmap_panel(ax, table: pd.DataFrame, title: str) -> object:
    """One heatmap: rows the context lengths, columns the needle depths; the accuracy written in each cell."""
    image = ax.imshow(table.to_numpy(dtype=float), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="lower")
    ax.set_xticks(range(table.shape[1]), [f"{d:g}" for d in table.columns])
    ax.set_yticks(range(table.shape[0]), [str(int(n)) for n in table.index])
    ax.set(title=title, xlabel="needle depth", ylabel="context length (tokens)")
    for (i, j), v in np.ndenumerate(table.to_numpy(dtype=float)):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    return image


def niah_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One record per experiment x model x task x policy x budget of the runs with depth-tagged samples."""
    from analysis.figures import one_each

    runs = df[(df["task_kind"] == "retrieval") & (df.get("lm_eval_task", pd.Series(index=df.index)) == "niah")]
    return one_each(runs, ["experiment", "model", "task", "policy", "budget"], "acc")


def figure_niah(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Every heatmap figure the records allow; returns the files written."""
    from analysis.figures import panels, save

    runs = niah_runs(df)
    written: list[Path] = []
    if runs.empty:
        return written
    for (exp, model, task), group in runs.groupby(["experiment", "model", "task"], dropna=False):
        order = {p: i for i, p in enumerate(policy_order(group["policy"].unique()))}
        group = group.assign(_o=group["policy"].map(order)).sort_values(["_o", "budget"])
        tables = [(run, cell_table(s)) for _, run in group.iterrows() if (s := load_samples(run["path"]))]
        if not tables:
            continue
        fig, axes = panels(len(tables), ncols=4, size=(3.6, 3.0))
        for ax, (run, table) in zip(axes, tables):
            budget = "100%" if run["policy"] == "full" else f"{float(run['budget']):.0%}"
            image = heatmap_panel(ax, table, f"{label(run['policy'])} {budget} (n={int(run['n_samples'])})")
        fig.colorbar(image, ax=list(axes[:len(tables)]), shrink=0.8, label="accuracy")
        fig.suptitle(f"{model} / {task}: needle found, context length x depth ({key_str(exp)})")
        written += save(fig, out, f"{exp}_{task}_heatmap")
    return written
