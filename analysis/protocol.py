"""One protocol per table cell and figure point: which records may share a cell, and which one wins.

A record's *protocol* is everything recorded that changes its number besides the cell's own keys
(model, task, shots, semantics, policy, budget, heavy/recent): the experiment, the scoring rule,
BOS, the ``protocol`` dict of task settings (limit, max_new_tokens, equal_length, window, n_windows,
temperature, ...), the policy's options (sinks, score variant, ...) and any ``quant*`` field. A record written before
these fields existed is a *legacy* protocol of its own (experiment, limit, scoring, BOS and the
``task`` section of its config.yaml): it never shares a cell with a record that has them.

:data:`RULE` is how a cell picks, and it is printed in every table's caption.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.estimate import Estimate, combine, estimate

RULE = ("cell rule: one protocol per cell; of the finished records that fit a cell, the protocol "
        "with the largest sample wins (ties: the paper's protocol, per-token mean scoring without "
        "BOS, then the newest record); its seeds are averaged; records of any other protocol are "
        "left out, never averaged in")
CELL_KEYS = ["model", "task", "shots", "semantics", "policy", "budget", "heavy", "recent"]
NOT_PROTOCOL = {"batch_size", "_target_", "name", "include_path", "shots", "budget", "heavy",
                "recent", "policy", "model", "task", "seed", "semantics"}
LEGACY_FIELDS = ["limit", "scoring", "add_bos_token"]


def _clean(v):
    """JSON-able scalar: NaN -> None, numpy -> Python."""
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v.item() if isinstance(v, np.generic) else v


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
    quant = {k: _clean(v) for k, v in row.items() if k.startswith("quant") and _clean(v) is not None}
    proto = {"experiment": _clean(row.get("experiment")), **settings, **quant,
             **{f"policy.{k}": v for k, v in _prefixed(row, "policy_options.").items()}}
    return {"legacy": True, **proto} if legacy else proto


def annotate(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with ``protocol`` (a JSON key), ``paper_protocol`` (per-token mean scoring
    and no BOS, or not multiple choice), ``mtime`` and, for records that scored with the mean rule
    before ``acc_mean`` existed, ``acc_mean`` = their ``acc``. Idempotent."""
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
    text = ", ".join(f"{k}={'null' if v is None else v}" for k, v in sorted(p.items())
                     if k not in skip)
    return ("legacy record: " if legacy else "") + (text or "no settings recorded")


@dataclass
class Pick:
    """The chosen protocol of a cell and its estimate (mean over the protocol's seeds)."""
    est: Estimate
    protocol: str
    runs: pd.DataFrame                       # the records averaged (one per seed)
    left_out: int = 0                        # records of the cell not used (other protocols)
    row: dict = field(default_factory=dict)  # the first chosen record's fields

    @property
    def n(self):
        n = pd.to_numeric(self.runs["n_samples"], errors="coerce")
        return None if n.isna().all() else int(n.max())


def choose(runs: pd.DataFrame, metric: str) -> Pick | None:
    """Apply :data:`RULE` to the records ``runs`` that fit one cell; None if none has ``metric``."""
    if metric not in runs.columns or runs.empty:
        return None
    runs = annotate(runs)
    runs = runs[pd.to_numeric(runs[metric], errors="coerce").notna()]
    if runs.empty:
        return None
    n = pd.to_numeric(runs["n_samples"], errors="coerce").fillna(-1)
    ranks = runs.assign(_n=n).groupby("protocol").agg(
        n=("_n", "max"), paper=("paper_protocol", "all"), newest=("mtime", "max"))
    best = ranks.sort_values(["n", "paper", "newest"], ascending=False).index[0]
    chosen = runs[runs["protocol"] == best].sort_values("mtime")
    chosen = chosen.drop_duplicates("seed", keep="last")  # same protocol and seed: the newest
    est = combine([estimate(r, metric) for _, r in chosen.iterrows()])
    return Pick(est, best, chosen, len(runs) - len(chosen), chosen.iloc[0].to_dict())


def select(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    """Records fitting a cell's keys (the full cache ignores the budget; H2O keeps only the
    paper's even heavy/recent split; ``task`` is left to the caller: it may have stand-ins)."""
    m = pd.Series(True, index=df.index)
    for k, v in where.items():
        if k == "task" or (k == "budget" and where.get("policy") == "full") or k not in df.columns:
            continue
        col = pd.to_numeric(df[k], errors="coerce") if isinstance(v, (int, float)) else df[k]
        m &= np.isclose(col, v) if isinstance(v, float) else (col == v)
    sub = df[m.fillna(False).astype(bool)]
    h, r = (pd.to_numeric(sub[c], errors="coerce") for c in ("heavy", "recent"))
    uneven = (sub["policy"] == "h2o") & h.notna() & r.notna() & ~np.isclose(h.fillna(0), r.fillna(0))
    return sub[~uneven]


def protocol_notes(picks: list[Pick | None]) -> tuple[dict, list[str]]:
    """Tags for cells when a table shows several protocols (``{protocol: " (p1)"}``), and the
    caption lines that spell each protocol out."""
    protocols = list(dict.fromkeys(p.protocol for p in picks if p is not None))
    if len(protocols) == 1:
        return {}, [f"protocol: {describe(protocols[0], skip=())}"]
    tags = {p: f" (p{i + 1})" for i, p in enumerate(protocols)}
    return tags, [f"protocol p{i + 1}: {describe(p, skip=())}" for i, p in enumerate(protocols)]
