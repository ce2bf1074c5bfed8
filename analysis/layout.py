"""Render a paper table in the paper's layout: each cell shows the paper's value, ours with its 95%
interval, and the difference, from the records of the table's own experiment(s).

A :class:`Spec` names its row axes and column axes (lists of :class:`Item`: a label plus the cell
keys it fixes: model, task, policy, budget, shots); the axis :data:`MODELS` expands to the paper's
models then every model we ran. A model axis that is in neither rows nor columns becomes a leading
``model`` column (one block of rows per model), as does ``semantics`` when several were run.

Per cell (:func:`cell`): the paper's number (same table, task, policy, budget, shots; the paper's
model, or its only model for a table with one), and ours by :func:`analysis.protocol.choose` over
the matching records (the paper's task, else its offline stand-in). Verdict: ``within`` (the
paper's value lies in our 95% interval), ``outside``, ``not comparable: <why>`` (another model, a
stand-in task, BOS added or not recorded), ``no interval``, or ``not run``.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pandas as pd

from analysis.estimate import Estimate
from analysis.paper import tasks_for
from analysis.protocol import (RULE, Pick, as_records, choose, compare, protocol_notes, select,
                               task_protocol)
from analysis.render import MISSING, Table

MODELS = "models"      # axis placeholder: the paper's models, then ours
NOT_COMPARABLE = "†"


@dataclass(frozen=True)
class Item:
    label: str
    where: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """``a - b > 0`` (kind ">", significant) or ``a - b >= -tol`` (kind ">=", not worse)."""
    text: str
    a: dict
    b: dict
    kind: str = ">"


@dataclass
class Spec:
    name: str                 # output file stem
    title: str
    paper: str                # the CSV's table name ("Table 1"); "" = no printed numbers
    experiments: tuple        # our experiments that fill it (a name ending in * is a prefix)
    rows: list                # row axes: lists of Item, or MODELS
    row_names: list[str]
    cols: list                # column axes, crossed (labels joined)
    metric: str = "acc_mean"
    scale: float = 100.0      # ours x scale = the paper's unit (acc in %)
    digits: int = 1
    tol: float = 5.0          # ">=" claims: not worse by more than tol (paper's unit)
    claim: str = ""           # the paper's qualitative claim, in words
    claims: list[Claim] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    where: dict = field(default_factory=dict)  # fixed for every cell (e.g. shots of a HELM table)


@dataclass
class Cell:
    table: str
    keys: dict                 # labels: block, row and column
    paper: str                 # as printed, or "" if the paper has no number here
    paper_number: float
    paper_model: str
    ours: Estimate | None
    pick: Pick | None
    our_model: str | None
    our_task: str | None
    verdict: str
    paper_id: int | None = None   # the paper number's row in the CSV
    text: str = ""


def eligible(df: pd.DataFrame, experiments) -> pd.DataFrame:
    exp = df["experiment"].astype(str)
    mask = pd.Series(False, index=df.index)
    for e in experiments:
        mask |= exp.str.startswith(e[:-1]) if e.endswith("*") else exp == e
    return df[mask]


def ours(recs: list[dict], where: dict, metric: str):
    """(Pick, task) for a cell: the paper's task first, then its stand-ins; (None, None)."""
    sub = select(recs, where) if recs else []
    for task in tasks_for(where["task"]) if "task" in where else [None]:
        pick = choose(sub if task is None else [r for r in sub if r.get("task") == task], metric)
        if pick is not None:
            return pick, task
    return None, None


def paper_row(pap: list[dict], where: dict):
    """(row, model note) of the paper's number for a cell, or (None, "")."""
    where = {**where, "policy": where.get("paper_policy", where.get("policy"))}

    def fits(r):
        if any(k in where and r[k] != where[k] for k in ("task", "policy")):
            return False
        return all(k not in where or (k == "budget" and where.get("policy") == "full")
                   or math.isnan(r[k]) or math.isclose(r[k], float(where[k])) for k in ("budget", "shots"))
    sub = [r for r in pap if fits(r)]
    exact = [r for r in sub if r["our_model"] == where.get("model")]
    if exact:
        return exact[0], ""
    if len({r["model"] for r in sub}) == 1:
        name = sub[0]["model"]
        return sub[0], ("paper's model unnamed" if name == "unspecified"
                        else f"paper's model is {name}")
    return None, ""


def verdict(paper: float, est: Estimate | None, why: list[str]) -> str:
    if est is None:
        return "not run"
    if why:
        return "not comparable: " + "; ".join(why)
    if not est.has_interval:
        return "no interval"
    return "within" if est.lo <= paper <= est.hi else "outside"


def cell(spec: Spec, where: dict, recs: list[dict], pap: list[dict], keys: dict) -> Cell:
    prow, model_note = paper_row(pap, where)
    pick, task = ours(recs, where, spec.metric)
    est = pick.est.scaled(spec.scale) if pick else None
    why = [model_note] if model_note and pick else []
    if pick and task != tasks_for(where.get("task", task))[0]:
        why.append(f"stand-in task {task}")
    if pick and spec.metric.startswith("acc"):
        bos = pick.row.get("add_bos_token")
        if bos is True or bos is None or (isinstance(bos, float) and math.isnan(bos)):
            why.append("BOS added" if bos is True else "BOS not recorded")
    number = prow["number"] if prow is not None else float("nan")
    v = verdict(number, est, why) if prow is not None else ("not run" if pick is None else "")
    return Cell(spec.name, keys, prow["value"] if prow is not None else "", number,
                prow["model"] if prow is not None else "", est, pick,
                pick.row.get("model") if pick else None, task, v,
                prow["id"] if prow is not None else None)


def fmt(v: float, digits: int) -> str:
    return f"{v:.{digits}f}".replace("-", "−")


def cell_text(c: Cell, digits: int, tag: str, has_paper: bool = True) -> str:
    """``paper · ours [lo, hi] · ours - paper`` (just ours where the paper prints no table)."""
    paper = c.paper or MISSING
    if c.ours is None:
        return f"{paper} · not run" if c.paper else MISSING
    e = c.ours
    ours = fmt(e.value, digits) + (f" [{fmt(e.lo, digits)}, {fmt(e.hi, digits)}]"
                                  if e.has_interval else " (no interval)")
    if not has_paper:
        return ours + tag
    mark = NOT_COMPARABLE if c.verdict.startswith("not comparable") else ""
    delta = f" · {'+' if e.value >= c.paper_number else ''}{fmt(e.value - c.paper_number, digits)}" \
        if c.paper and not math.isnan(c.paper_number) else ""
    return f"{paper} · {ours}{mark}{tag}{delta}"


def expand(axes: list, models: list[Item]) -> list[tuple[Item, ...]]:
    return list(itertools.product(*[models if a == MODELS else a for a in axes]))


def model_items(pap: pd.DataFrame, recs: list[dict]) -> list[Item]:
    paper = [m for m in dict.fromkeys(pap["our_model"].dropna())] if len(pap) else []
    ran = sorted({r["model"] for r in recs if isinstance(r.get("model"), str)} - set(paper))
    return [Item(m, {"model": m}) for m in paper + ran] or [Item("(not named)", {"model": None})]


def merged(items) -> dict:
    return {k: v for it in items for k, v in it.where.items()}


def render(spec: Spec, df: pd.DataFrame, paper: pd.DataFrame) -> tuple[Table, list[Cell]]:
    """The table and its cells (for the report)."""
    recs = as_records(eligible(df, spec.experiments))
    pap = paper[paper["table"] == spec.paper] if spec.paper else paper.iloc[:0]
    models = model_items(pap, recs)
    pap = pap.assign(id=pap.index).to_dict("records")
    rows, cols = expand(spec.rows, models), expand(spec.cols, models)
    block_axes, block_names = [], []
    if MODELS not in spec.rows + spec.cols:
        block_axes.append(models), block_names.append("model")
    sems = sorted({r["semantics"] for r in recs if isinstance(r.get("semantics"), str)})
    if len(sems) > 1:
        block_axes.append([Item(s, {"semantics": s}) for s in sems]), block_names.append("semantics")
    cells, grid = [], []
    for block in itertools.product(*block_axes):
        for row in rows:
            line = [it.label for it in block + row]
            for col in cols:
                where = {**spec.where, **merged(block + row + col)}
                keys = dict(zip(block_names + spec.row_names, line)) | {"column": labels(col)}
                cells.append(cell(spec, where, recs, pap, keys))
                line.append(cells[-1])
            grid.append(line)
    tags, notes = protocol_notes([c.pick for c in cells])
    for c in cells:
        c.text = cell_text(c, spec.digits, tags.get(c.pick.protocol, "") if c.pick else "",
                           bool(spec.paper))
    table_rows = [[x.text if isinstance(x, Cell) else x for x in line] for line in grid]
    header = block_names + spec.row_names + [labels(c) for c in cols]
    return Table(spec.name, spec.title, header, table_rows, caption(spec, cells, notes)), cells


def labels(items) -> str:
    return " ".join(it.label for it in items)


def caption(spec: Spec, cells: list[Cell], notes: list[str]) -> list[str]:
    unit = f"{spec.metric} x {spec.scale:g}" if spec.scale != 1 else spec.metric
    lines = [f"cell: paper's value · ours ({unit}) [95% interval] · ours − paper; "
             f"{NOT_COMPARABLE} = not comparable (another model, a stand-in task, or BOS added or "
             f"not recorded); not run = no finished record", RULE, *notes]
    ns = sorted({c.pick.n for c in cells if c.pick and c.pick.n is not None})
    if ns:
        lines.append("n_samples per cell: " + (f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"))
    return lines + spec.notes + [f"experiments read: {', '.join(spec.experiments)}"]


def claim_lines(spec: Spec, df: pd.DataFrame, cells: list[Cell]) -> list[str]:
    """Each claim checked on every (model, semantics, task, shots) we ran: ✓ holds (95%),
    ~ unresolved, ✗ contradicted (95%), with the differences in the paper's unit."""
    recs = as_records(eligible(df, spec.experiments))
    contexts = []
    for c in cells:
        if c.pick:
            r = c.pick.row
            ctx = {"model": r.get("model"), "semantics": r.get("semantics"), "task": r.get("task"),
                   "shots": r.get("shots")}
            if ctx not in contexts:
                contexts.append(ctx)
    out = []
    for claim in spec.claims:
        results = []
        for ctx in contexts:
            pa, _ = ours(recs, {**spec.where, **ctx, **claim.a}, spec.metric)
            pb, _ = ours(recs, {**spec.where, **ctx, **claim.b}, spec.metric)
            if pa is None or pb is None:
                continue
            if task_protocol(pa.protocol) != task_protocol(pb.protocol):
                results.append(("≠", f"{ctx['task']} ({ctx['model']}) not compared: protocols differ"))
                continue
            d = compare(pa, pb, spec.metric).scaled(spec.scale)
            mark = judge(d, claim.kind, spec.tol)
            key = f"{ctx['task']} ({ctx['model']}, {fmt(float(ctx['shots']), 0)}-shot)"
            ci = f" [{fmt(d.lo, spec.digits)}, {fmt(d.hi, spec.digits)}]" if d.has_interval else ""
            results.append((mark, f"{key} {mark} {fmt(d.value, spec.digits)}{ci}"))
        if not results:
            out.append(f"- {claim.text}: not run.")
            continue
        count = {m: sum(r[0] == m for r in results) for m in "✓~✗≠"}
        out.append(f"- {claim.text}: holds in {count['✓']}, unresolved in {count['~']}, "
                   f"contradicted in {count['✗']} of {len(results) - count['≠']}: "
                   + "; ".join(r[1] for r in results) + ".")
    return out


def judge(d: Estimate, kind: str, tol: float) -> str:
    if not d.has_interval:
        return "~"
    if kind == ">":
        return "✓" if d.lo > 0 else "✗" if d.hi < 0 else "~"
    return "✓" if d.lo >= -tol else "✗" if d.hi < -tol else "~"

