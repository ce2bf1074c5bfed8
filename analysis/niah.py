"""Needle-in-a-haystack heatmaps: accuracy over context length x needle depth, one panel per policy and budget.

From the ``niah`` runs' records (``task_kind`` retrieval; each sample of ``samples.jsonl`` carries ``length``,
``depth`` and ``acc``, h2o.tasks.long_context). Each figure is one protocol: one per experiment x model x task x
compression timing (the policy's ``compress``: decode, the default, or prefill) x question placement
(``task.question``: prompt, the default, or after the compressed context), named
``<experiment>_<task>[_<model>][_prefill][_question-after]_heatmap`` (e.g. ``niah_niah_heatmap``; the model only
where the experiment ran the task on several), the timing and question in its title where not the default. Its
panels are ordered by policy then budget (the full cache first), each cell the fraction of its samples whose number
was found (written in the cell, with the sample count in the panel title). The records of one panel's key are
picked like a table cell (:data:`analysis.protocol.RULE`: one protocol, its seeds' samples pooled); a panel that
left records out says how many it used in its title ("1 of 2 records").

A figure with no full-cache record of its own protocol draws the full cache's record of another protocol of the
same experiment, model, task and task settings (:func:`full_stand_in`): the full cache holds every token under either
timing, and at 100% the question inside or after the prompt generates the same tokens
(tests/test_question_after.py), so that record answers the panel; its title says whose record it is ("record of
compress=decode, question=prompt (same tokens)", naming what differs from the figure's protocol).
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.protocol import choose, compress_of, question_of
from analysis.records import checked_samples, load_samples
from analysis.labels import key_str, label, policy_order


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


KEYS = ["experiment", "model", "task", "compress", "question"]  # one figure each
PANEL = ["policy", "budget"]  # one panel each
CELL = ("length", "depth", "acc")  # what a heatmap cell reads from each sample (all numbers)


def niah_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The records with depth-tagged samples, with ``compress`` and ``question`` filled in (their defaults where a
    record does not name them). A record whose samples lack a cell's fields is skipped with one warning naming it
    (:func:`analysis.records.checked_samples`), before any panel counts it."""
    runs = df[(df["task_kind"] == "retrieval") & (df.get("lm_eval_task", pd.Series(index=df.index)) == "niah")]
    runs = runs[[checked_samples(p, CELL, CELL) is not None for p in runs["path"]]]
    if runs.empty:
        return runs
    return runs.assign(compress=[compress_of(r) for _, r in runs.iterrows()],
                       question=[question_of(r) for _, r in runs.iterrows()])


def panel_picks(group: pd.DataFrame) -> list:
    """One :class:`analysis.protocol.Pick` per policy x budget of one figure's records, full first."""
    order = {p: i for i, p in enumerate(policy_order(group["policy"].unique()))}
    keyed = sorted(group.groupby(PANEL, dropna=False), key=lambda kv: (order[kv[0][0]], kv[0][1]))
    return [p for _, g in keyed if (p := choose(g, "acc")) is not None]


def task_settings(protocol: str) -> str:
    """A record's protocol key without what a full cache's tokens do not depend on: the policy's options (its
    timing among them) and the question's placement."""
    kept = {k: v for k, v in json.loads(protocol).items() if not k.startswith("policy.") and k != "question"}
    return json.dumps(kept, sort_keys=True)


def full_stand_in(runs: pd.DataFrame, group: pd.DataFrame):
    """(Pick, the words of its protocol where it differs from the figure's) of the full cache for a figure's records
    ``group`` that have none: picked by the cell rule from the full records of ``runs`` (same experiment, model and
    task) whose task settings are those of a record of ``group``; None where there is none."""
    settings = {task_settings(p) for p in group["protocol"]}
    full = runs[(runs["policy"] == "full") & runs["protocol"].map(lambda p: task_settings(p) in settings)]
    for key in ("experiment", "model", "task"):
        full = full[full[key].astype(str) == str(group[key].iloc[0])]
    pick = choose(full, "acc") if not full.empty else None
    if pick is None:
        return None
    row, mine = pick.row, group.iloc[0]
    words = [f"{k}={v}" for k, v, figure in (("compress", compress_of(row), compress_of(mine)),
                                               ("question", question_of(row), question_of(mine))) if v != figure]
    return pick, ",\n".join(words)


def figure_name(exp, model, task, compress, question, several_models: bool) -> tuple[str, str]:
    """(file name, the title's protocol words): the default protocol unnamed."""
    parts = [str(exp), str(task), *([str(model)] if several_models else []),
             *(["prefill"] if compress != "decode" else []), *(["question-after"] if question != "prompt" else [])]
    words = [*(["compress=prefill"] if compress != "decode" else []),
             *(["question after the compressed prompt"] if question != "prompt" else [])]
    return "_".join(parts) + "_heatmap", "".join(f", {w}" for w in words)


def default_first(item) -> tuple:
    """A figure's sort key: by experiment, model and task, then the default protocol before the others."""
    (exp, model, task, compress, question), _ = item
    return str(exp), str(model), str(task), compress != "decode", question != "prompt"


def figure_niah(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Every heatmap figure the records allow; returns the files written."""
    from analysis.plotting import panels, save

    runs = niah_runs(df)
    written: list[Path] = []
    if runs.empty:
        return written
    models = runs.groupby(["experiment", "task"], dropna=False)["model"].nunique()
    for (exp, model, task, compress, question), group in sorted(runs.groupby(KEYS, dropna=False), key=default_first):
        picks = [(p, "") for p in panel_picks(group)]
        if not any(p.row["policy"] == "full" for p, _ in picks) and (stand_in := full_stand_in(runs, group)):
            picks.insert(0, stand_in)
        tables = []
        for pick, source in picks:
            samples = [s for run in pick.runs for s in load_samples(run["path"])]  # the protocol's seeds pooled
            if samples:
                tables.append((pick, source, cell_table(samples)))
        if not tables:
            continue
        name, words = figure_name(exp, model, task, compress, question, models[exp, task] > 1)
        fig, axes = panels(len(tables), ncols=4, size=(3.6, 3.0))
        for ax, (pick, source, table) in zip(axes, tables):
            run = pick.row
            budget = "100%" if run["policy"] == "full" else f"{float(run['budget']):.0%}"
            n = sum(int(r["n_samples"]) for r in pick.runs)
            used = f", {len(pick.runs)} of {len(pick.runs) + pick.left_out} records" if pick.left_out else ""
            whose = f"\nrecord of {source}\n(same tokens)" if source else ""
            image = heatmap_panel(ax, table, f"{label(run['policy'])} {budget} (n={n}{used}){whose}")
        fig.colorbar(image, ax=list(axes[:len(tables)]), shrink=0.8, label="accuracy")
        title = f"{model} / {task} ({key_str(exp)}): needle found, context length x depth{words}"
        fig.suptitle(textwrap.fill(title, 42 * min(len(tables), 4)))  # as wide as the panels
        written += save(fig, out, name)
    return written
