"""How the analysis names things: a policy's label and its place in a table or legend, its colour and marker in
every figure (:data:`METHODS`, the one method vocabulary of analysis/), the metric a task kind reports, a number
and an estimate as text."""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.render import MISSING

POLICIES = ["full", "local", "strided", "fixed", "streaming_llm", "topk", "h2o",
            "strided_h2", "fixed_h2", "topk_h2", "h2_only"]
# The one method vocabulary: each method's name (its policy= spelling), label, colour and marker, the same in every
# figure, table and page. Colours: matplotlib's tab10 then tab20's light shades; no two methods share both colour
# and marker. The paper's policies first (their order in :data:`POLICIES`), then the field's methods.
METHODS = {
    "full": ("full", "#000000", "*"),
    "local": ("local", "#7f7f7f", "v"),
    "strided": ("strided", "#c7c7c7", "1"),
    "fixed": ("fixed", "#c7c7c7", "2"),
    "streaming_llm": ("StreamingLLM", "#ff7f0e", "s"),
    "topk": ("top-k", "#dbdb8d", "3"),
    "h2o": ("H2O", "#d62728", "o"),
    "strided_h2": ("strided+H2", "#ff9896", "1"),
    "fixed_h2": ("fixed+H2", "#ff9896", "2"),
    "topk_h2": ("top-k+H2", "#ff9896", "3"),
    "h2_only": ("H2 only", "#ff9896", "4"),
    "h2o_reference": ("h2o_reference", "#d62728", "x"),
    "tova": ("TOVA", "#1f77b4", "D"),
    "scissorhands": ("Scissorhands", "#8c564b", "h"),
    "random": ("random", "#bcbd22", "+"),
    "snapkv": ("SnapKV", "#2ca02c", "^"),
    "pyramidkv": ("PyramidKV", "#98df8a", "<"),
    "adakv": ("Ada-KV", "#17becf", ">"),
    "knorm": ("KNorm", "#9467bd", "p"),
    "keydiff": ("KeyDiff", "#e377c2", "P"),
    "expected_attention": ("Expected Attention", "#aec7e8", "X"),
    "kvzip": ("KVzip", "#ffbb78", "d"),
    "r_kv": ("R-KV", "#c5b0d5", "H"),
    "triattention": ("TriAttention", "#9edae5", "8"),
    "snapkv_d": ("SnapKV-D", "#2ca02c", "v"),
    "g_kv": ("G-KV", "#c49c94", "d"),
}
LABELS = {name: lab for name, (lab, _, _) in METHODS.items()}
KIND_METRICS = {"multiple_choice": ["acc_mean", "acc"], "summarization": ["rouge2"],
                "perplexity": ["ppl"], "streaming": ["ppl"], "retrieval": ["acc", "score"], "reasoning": ["pass_at_1"],
                "shared_context": ["acc"]}


def label(policy: str) -> str:
    return LABELS.get(policy, policy)


def color(policy: str) -> str:
    """The method's colour in every figure (gray for a name outside :data:`METHODS`)."""
    return METHODS[policy][1] if policy in METHODS else "gray"


def marker(policy: str) -> str:
    """The method's marker in every figure ('o' for a name outside :data:`METHODS`)."""
    return METHODS[policy][2] if policy in METHODS else "o"


def method_order(policies) -> list[str]:
    """Methods in :data:`METHODS`' order (others after, by name)."""
    names = list(METHODS)
    return sorted(policies, key=lambda p: (names.index(p) if p in names else len(names), p))


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
