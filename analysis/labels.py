"""How the analysis names things: a policy's label and its place in a table or legend, the metric a task kind
reports, a number and an estimate as text."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.render import MISSING

POLICIES = ["full", "local", "strided", "fixed", "streaming_llm", "topk", "h2o",
            "strided_h2", "fixed_h2", "topk_h2", "h2_only"]
LABELS = {"streaming_llm": "StreamingLLM", "strided_h2": "strided+H2", "fixed_h2": "fixed+H2",
          "topk": "top-k", "topk_h2": "top-k+H2", "h2_only": "H2 only", "h2o": "H2O"}
KIND_METRICS = {"multiple_choice": ["acc_mean", "acc"], "summarization": ["rouge2"],
                "perplexity": ["ppl"], "streaming": ["ppl"], "retrieval": ["acc", "score"], "reasoning": ["pass_at_1"],
                "shared_context": ["acc"]}


def label(policy: str) -> str:
    return LABELS.get(policy, policy)


def policy_order(policies) -> list[str]:
    return sorted(policies, key=lambda p: (POLICIES.index(p) if p in POLICIES else 99, p))


def key_str(v) -> str:
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return "?"
    return f"{v:g}" if isinstance(v, (float, np.floating, int, np.integer)) else str(v)


def num(v: float, digits: int) -> str:
    return MISSING if v is None or pd.isna(v) else f"{v:.{digits}f}"


def metric_for(kind: str, runs: pd.DataFrame) -> str | None:
    """The first of the kind's metrics that some record has."""
    return next((m for m in KIND_METRICS.get(kind, []) if m in runs.columns
                 and pd.to_numeric(runs[m], errors="coerce").notna().any()), None)


def pick_text(pick, digits: int, tags: dict) -> str:
    if pick is None:
        return MISSING
    e = pick.est
    ci = f" [{num(e.lo, digits)}, {num(e.hi, digits)}]" if e.has_interval else ""
    return num(e.value, digits) + ci + tags.get(pick.protocol, "")
