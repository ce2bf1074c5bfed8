"""One protocol per table cell and figure point: which records may share a cell, and which one wins.

A record's *protocol* is everything recorded that changes its number besides the cell's own keys
(model, task, shots, semantics, policy, budget, heavy/recent): the experiment, the scoring rule,
BOS, the ``protocol`` dict of task settings (limit, max_new_tokens, equal_length, window,
n_windows, temperature, ...), the policy's options (sinks, score variant, ...) and any ``quant*``
field. A record written before these fields existed is a *legacy* protocol of its own
(experiment, limit, scoring, BOS and the ``task`` section of its config.yaml): it never shares a
cell with a record that has them.

:data:`RULE` is how a cell picks, and it is printed in every table's caption.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.estimate import Estimate, combine, difference, estimate, paired_difference

RULE = ("cell rule: one protocol per cell; of the finished records that fit a cell, the protocol "
        "with the largest sample wins (ties: the paper's protocol, per-token mean scoring without "
        "BOS, then the newest record); its seeds are averaged; records of any other protocol are "
        "left out, never averaged in")
CELL_KEYS = ["model", "task", "shots", "semantics", "policy", "budget", "heavy", "recent"]
NOT_PROTOCOL = {"batch_size", "_target_", "name", "include_path", "shots", "budget", "heavy",
                "recent", "policy", "model", "task", "seed", "semantics"}
LEGACY_FIELDS = ["limit", "scoring", "add_bos_token"]
TIMINGS = ("decode", "prefill")  # when a policy compresses: at every decoding step, or once at the prompt's end


def _clean(v):
    """JSON-able scalar: NaN -> None, numpy -> Python."""
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    v = v.item() if isinstance(v, np.generic) else v
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _prefixed(row: pd.Series, prefix: str) -> dict:
    return {k[len(prefix):]: _clean(v) for k, v in row.items()
            if k.startswith(prefix) and k[len(prefix):] not in NOT_PROTOCOL}


def _config_task(path) -> dict:
    """The ``task`` section of the record's config.yaml (legacy records), {} if unreadable."""
    try:
        import yaml
        cfg = yaml.safe_load((Path(path) / "config.yaml").read_text())
    except Exception:  # noqa: BLE001 - a missing or odd config only weakens the legacy key
        return {}
    task = cfg.get("task") if isinstance(cfg, dict) else None
    return {k: v for k, v in task.items() if k not in NOT_PROTOCOL} if isinstance(task, dict) else {}


def protocol_of(row: pd.Series) -> dict:
    """The protocol of one record (see the module doc), as a plain dict."""
    settings = _prefixed(row, "protocol.")
    legacy = not any(v is not None for v in settings.values())
    if legacy:
        settings = {**_config_task(row.get("path")),
                    **{k: _clean(row.get(k)) for k in LEGACY_FIELDS}}
    else:
        settings.update({k: _clean(row.get(k)) for k in ("scoring", "add_bos_token")})
    quant = {k: _clean(v) for k, v in row.items() if k.startswith("quant")}
    proto = {"experiment": _clean(row.get("experiment")), **settings, **quant,
             **{f"policy.{k}": v for k, v in _prefixed(row, "policy_options.").items()}}
    # a frame has every record's columns: null = not recorded, except limit (null = all)
    proto = {k: v for k, v in proto.items() if v is not None or k == "limit"}
    return {"legacy": True, **proto} if legacy else proto


def annotate(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with ``protocol`` (a JSON key), ``paper_protocol`` (per-token mean scoring
    and no BOS, or not multiple choice; streaming: token by token), ``mtime`` and, for records
    that scored with the mean rule before ``acc_mean`` existed, ``acc_mean`` = their ``acc``.
    Idempotent."""
    if "protocol" in df.columns and df["protocol"].map(lambda v: isinstance(v, str)).all():
        return df
    df = df.copy()
    for col in ("scoring", "add_bos_token", "acc", "acc_stderr", "acc_mean", "acc_mean_stderr"):
        if col not in df.columns:
            df[col] = np.nan
    protos = [protocol_of(r) for _, r in df.iterrows()]
    df["protocol"] = [json.dumps(p, sort_keys=True, default=str) for p in protos]
    old_mean = df["acc_mean"].isna() & (df["scoring"] == "mean")
    df.loc[old_mean, "acc_mean"] = df.loc[old_mean, "acc"]
    df.loc[old_mean, "acc_mean_stderr"] = df.loc[old_mean, "acc_stderr"]
    mc = df["task_kind"] == "multiple_choice"
    df["paper_protocol"] = ~mc | ((df["scoring"] == "mean") & (df["add_bos_token"] == False))  # noqa: E712
    if "protocol.chunk" in df.columns:  # streaming: token by token is the authors' protocol, chunks are not
        df["paper_protocol"] &= ~((df["task_kind"] == "streaming") & (df["protocol.chunk"].fillna(1) != 1))
    df["mtime"] = [_mtime(p) for p in df["path"]]
    return df


def _mtime(path) -> float:
    try:
        return os.stat(Path(path) / "metrics.json").st_mtime
    except (OSError, TypeError):
        return 0.0


def describe(protocol: str, skip=("experiment",)) -> str:
    """Short readable form of a protocol key: ``limit=20, scoring=mean, ...``."""
    p = json.loads(protocol)
    legacy = p.pop("legacy", False)
    text = ", ".join(f"{k}={'all' if v is None else v}" for k, v in sorted(p.items())
                     if k not in skip)
    return ("legacy record: " if legacy else "") + (text or "no settings recorded")


Record = dict   # one annotated record: a row of :func:`annotate`'s frame as a dict


def as_records(runs) -> list[Record]:
    """Annotated records as a list of dicts (cell selection runs on these: a few hundred cells
    x a few pandas operations each was the whole cost of the analysis)."""
    if isinstance(runs, list):
        return runs
    return annotate(runs).to_dict("records") if len(runs) else []


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


@dataclass
class Pick:
    """The chosen protocol of a cell and its estimate (mean over the protocol's seeds)."""
    est: Estimate
    protocol: str
    runs: list[Record]                       # the records averaged (one per seed), oldest first
    left_out: int = 0                        # records of the cell not used (other protocols)

    @property
    def row(self) -> Record:
        return self.runs[0]

    @property
    def n(self) -> int | None:
        ns = [_num(r.get("n_samples")) for r in self.runs]
        ns = [n for n in ns if not math.isnan(n)]
        return int(max(ns)) if ns else None


def choose(runs, metric: str) -> Pick | None:
    """Apply :data:`RULE` to the records ``runs`` that fit one cell; None if none has ``metric``."""
    runs = [r for r in as_records(runs) if not math.isnan(_num(r.get(metric)))]
    if not runs:
        return None
    groups: dict[str, list[Record]] = {}
    for r in runs:
        groups.setdefault(r["protocol"], []).append(r)

    def rank(item):
        n = [_num(r.get("n_samples")) for r in item[1]]
        return (max((x for x in n if not math.isnan(x)), default=-1),
                all(bool(r.get("paper_protocol")) for r in item[1]),
                max(r.get("mtime", 0.0) for r in item[1]))
    best, group = max(groups.items(), key=rank)
    per_seed = {}
    for r in sorted(group, key=lambda r: r.get("mtime", 0.0)):  # same protocol and seed: newest
        per_seed[_clean(r.get("seed"))] = r
    chosen = list(per_seed.values())
    est = combine([estimate(r, metric) for r in chosen])
    return Pick(est, best, chosen, len(runs) - len(chosen))


def _fits(r: Record, k: str, v) -> bool:
    have = r.get(k)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = _num(have)
        return not math.isnan(x) and math.isclose(x, float(v), rel_tol=1e-9, abs_tol=1e-9)
    return have == v


def _quantized(r: Record) -> bool:
    return any(k.startswith("quant") and _clean(v) is not None for k, v in r.items())


def select(runs, where: dict) -> list[Record]:
    """Records fitting a cell's keys (the full cache ignores the budget; H2O keeps only the
    paper's even heavy/recent split; a quantized KV cache only where ``where`` names ``quant.*``;
    ``task`` is left to the caller: it may have stand-ins; ``paper_*`` keys are the paper's)."""
    keys = {k: v for k, v in where.items() if k != "task" and not k.startswith("paper_")
            and not (k == "budget" and where.get("policy") == "full")}
    quant = any(k.startswith("quant") for k in keys)
    out = []
    for r in as_records(runs):
        if not all(_fits(r, k, v) for k, v in keys.items()) or (_quantized(r) and not quant):
            continue
        h, rec = _num(r.get("heavy")), _num(r.get("recent"))
        if r.get("policy") == "h2o" and not (math.isnan(h) or math.isnan(rec)) \
                and not math.isclose(h, rec):
            continue
        out.append(r)
    return out


def task_protocol(protocol: str) -> str:
    """The protocol without the policy's own options (which differ between policies by nature):
    what two cells of one table, or the two sides of a comparison, must share."""
    p = json.loads(protocol)
    return json.dumps({k: v for k, v in p.items() if not k.startswith("policy.")}, sort_keys=True)


def protocol_notes(picks: list[Pick | None]) -> tuple[dict, list[str]]:
    """Tags for cells when a table shows several task protocols (``{protocol: " (p1)"}``), and
    the caption lines that spell each one out."""
    shown = [p.protocol for p in picks if p is not None]
    tasks = list(dict.fromkeys(task_protocol(p) for p in shown))
    if len(tasks) <= 1:
        return {}, [f"protocol: {describe(t, skip=())}" for t in tasks]
    tags = {p: f" (p{tasks.index(task_protocol(p)) + 1})" for p in shown}
    return tags, [f"protocol p{i + 1}: {describe(t, skip=())}" for i, t in enumerate(tasks)]


def compare(a: Pick, b: Pick, metric: str) -> Estimate:
    """a - b: paired over the samples both scored when each cell is one record whose samples.jsonl
    pairs with the other's (same questions, windows or articles: far tighter than treating them
    as independent), else the difference of two independent estimates."""
    if len(a.runs) == len(b.runs) == 1:
        d = paired_difference(a.runs[0], b.runs[0], metric)
        if d is not None:
            return d
    return difference(a.est, b.est)


def compress_of(row) -> str:
    """The record's compression timing: describe() names ``compress`` only when it is not the default, decode."""
    for key in ("compress", "policy_options.compress"):
        v = row.get(key)
        if isinstance(v, str) and v in TIMINGS:
            return v
    return "decode"


def question_of(row) -> str:
    """Where the task's question went: ``after`` the compressed context, else ``prompt`` (inside it: every record
    without the field, the protocol naming it only when it is not the default)."""
    return "after" if any(row.get(k) == "after" for k in ("protocol.question", "question")) else "prompt"
