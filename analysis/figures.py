"""The paper's figures from run records (matplotlib, Agg; PNG and PDF).

* ``fig4_budget_curves``: Figure 4, metric vs KV cache budget, one line per policy, the full
  cache as a dashed horizontal line, one panel per model x task (multiple choice: acc at the
  main shot count; summarization: rouge2; perplexity: ppl).
* ``streaming_ppl``: the long-context figure, perplexity vs tokens streamed per policy/budget,
  from the ``tokens`` and ``ppl`` fields of each streaming run's samples.jsonl.
* ``fig2_observations``: Figure 2, one row per observations run, from its ``observations.json``.

``observations.json`` keys read here (others are ignored):

* ``sparsity_per_layer``: list of floats in [0, 1], one per layer (index = layer): the fraction
  of attention probabilities counted as sparse.
* ``sparsity_threshold`` (optional): float, the threshold relative to the row max that defines
  "sparse" (e.g. 0.01); shown in the axis label.
* ``accumulated_attention``: list of floats, the accumulated attention score of each token
  (one layer/head, or pooled). A list of lists (e.g. per head) is flattened (pooled).
* ``accumulated_attention_source`` (optional): string naming what was accumulated, e.g.
  "layer 12, pooled over heads"; shown in the panel title.
* ``heavy_masked``: object label -> accuracy, e.g. ``{"full": 0.8, "heavy_masked": 0.3,
  "random_masked": 0.78}``; one bar per key, in the file's order.

The power-law exponent is a least-squares fit of log10(score) on log10(rank), scores sorted in
decreasing order, zeros dropped: score ~ c * rank ** -alpha (:func:`fit_power_law`).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.grid import key_str, kind, numeric  # noqa: E402
from analysis.records import load_json, load_samples  # noqa: E402
from analysis.tables import POLICIES, label  # noqa: E402

SEMANTICS_STYLE = {"simulated": "-", "real": "-.", "reference": ":"}  # "--" is the full cache
CURVE_METRIC = {"multiple_choice": "acc", "summarization": "rouge2", "perplexity": "ppl"}


def fit_power_law(scores) -> tuple[float, float]:
    """(alpha, c) with sorted scores ~ c * rank ** -alpha, least squares on log-log."""
    s = np.sort(np.asarray(scores, dtype=float).ravel())[::-1]
    s = s[s > 0]
    if len(s) < 2:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(np.log10(np.arange(1, len(s) + 1)), np.log10(s), 1)
    return -slope, 10 ** intercept


def save(fig, out: str | Path, name: str) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for p in paths:
        fig.savefig(p, dpi=150)
    plt.close(fig)
    return paths


def panels(n: int, ncols: int = 3, size=(4.2, 3.2), nrows=None):
    nrows = nrows or -(-n // ncols)
    ncols = min(n, ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows),
                             squeeze=False, layout="constrained")
    for ax in axes.ravel()[n:]:
        ax.set_visible(False)
    return fig, axes.ravel()


def color(policy: str) -> str:
    """One colour per policy across every panel."""
    return f"C{POLICIES.index(policy) % 10}" if policy in POLICIES else "gray"


def policy_order(policies) -> list[str]:
    return sorted(policies, key=lambda p: (POLICIES.index(p) if p in POLICIES else 99, p))


def curve_panel(ax, sub: pd.DataFrame, metric: str, title: str) -> None:
    """One Figure 4 panel: ``metric`` vs budget per policy, full cache dashed."""
    multi = sub["semantics"].nunique() > 1
    for sem, runs in sub[sub["policy"] == "full"].groupby("semantics", dropna=False):
        full = numeric(runs[metric]).mean()
        if pd.notna(full):
            ax.axhline(full, ls="--", color="k", label="full" + (f" ({sem})" if multi else ""))
    for policy in policy_order(sub.loc[sub["policy"] != "full", "policy"].dropna().unique()):
        for sem, runs in sub[sub["policy"] == policy].groupby("semantics", dropna=False):
            pts = runs.assign(y=numeric(runs[metric]), x=numeric(runs["budget"]))
            pts = pts.groupby("x")["y"].mean().dropna()
            name = label(policy) + (f" ({key_str(sem)})" if multi else "")
            ax.plot(pts.index, pts.values, marker="o", label=name, color=color(policy),
                    ls=SEMANTICS_STYLE.get(sem, (0, (1, 3))))
    ax.set(title=title, xlabel="KV cache budget (fraction)", ylabel=metric, xlim=(0, 1.02))
    ax.legend(fontsize=7)


def figure4(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Figure 4: one panel per model x task with a metric, lines per policy over budgets."""
    subs = [kind(df, k).assign(metric=m) for k, m in CURVE_METRIC.items()]
    data = pd.concat([s for s in subs if not s.empty]) if any(len(s) for s in subs) else None
    if data is None:
        return []
    groups = list(data.groupby(["model", "task"], dropna=False))
    fig, axes = panels(len(groups))
    for ax, ((model, task), sub) in zip(axes, groups):
        shots = sub["shots"].dropna().unique()
        note = f", {shots[0]:g}-shot" if len(shots) == 1 else ""
        curve_panel(ax, sub, sub["metric"].iloc[0], f"{model} / {task}{note}")
    return save(fig, out, "fig4_budget_curves")


def figure_streaming(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Long-context figure: perplexity vs tokens streamed, one line per policy and budget."""
    runs = df[df["task_kind"] == "streaming"]
    if runs.empty:
        return []
    groups = list(runs.groupby(["model", "task"], dropna=False))
    fig, axes = panels(len(groups), ncols=2, size=(5.5, 3.5))
    for ax, ((model, task), sub) in zip(axes, groups):
        for _, run in sub.sort_values(["policy", "budget"]).iterrows():
            pts = pd.DataFrame(load_samples(run["path"]))
            if pts.empty or not {"tokens", "ppl"} <= set(pts.columns):
                continue
            pts = pts.sort_values("tokens")
            name = "full" if run["policy"] == "full" else \
                f"{label(run['policy'])} {key_str(run['budget'])}"
            ax.plot(pts["tokens"], pts["ppl"], ls="--" if run["policy"] == "full" else "-",
                    label=name)
        ax.set(title=f"{model} / {task}", xlabel="tokens streamed", ylabel="perplexity",
               xscale="log")
        ax.legend(fontsize=7)
    return save(fig, out, "streaming_ppl")


def flat(values) -> np.ndarray:
    """A flat float array from a list, or from a (ragged) list of lists (pooled)."""
    try:
        return np.asarray(values, dtype=float).ravel()
    except ValueError:
        return np.concatenate([flat(v) for v in values]) if values else np.zeros(0)


def observation_row(axes, obs: dict, title: str) -> None:
    """Figure 2 for one run: layer sparsity, accumulated attention power law, masking bars."""
    sparsity = obs.get("sparsity_per_layer") or []
    axes[0].bar(range(len(sparsity)), sparsity)
    axes[0].axhline(0.95, ls="--", color="k", label="95%")
    thr = obs.get("sparsity_threshold")
    axes[0].set(title=f"{title}: attention sparsity", xlabel="layer", ylim=(0, 1),
                ylabel="sparsity" + (f" (< {thr:g} x row max)" if thr is not None else ""))
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=7)
    scores = flat(obs.get("accumulated_attention") or [])
    s = np.sort(scores[scores > 0])[::-1]
    alpha, c = fit_power_law(s)
    ranks = np.arange(1, len(s) + 1)
    axes[1].loglog(ranks, s, ".", ms=3, label="tokens")
    if np.isfinite(alpha):
        axes[1].loglog(ranks, c * ranks ** -alpha, "r-", label=f"fit: rank^-{alpha:.2f}")
    src = obs.get("accumulated_attention_source")
    axes[1].set(title="accumulated attention" + (f" ({src})" if src else ""),
                xlabel="rank", ylabel="score")
    axes[1].legend(fontsize=7)
    masked = obs.get("heavy_masked") or {}
    axes[2].bar(list(masked), list(masked.values()), color="C2")
    axes[2].set(title="masking heavy hitters", ylabel="accuracy")
    axes[2].tick_params(axis="x", labelsize=7)


def figure2(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Figure 2: one row of three panels per observations run that has observations.json."""
    runs = df[(df["task_kind"] == "observations") | (df["experiment"] == "observations")]
    found = [(r, load_json(r["path"], "observations.json")) for _, r in runs.iterrows()]
    found = [(r, o) for r, o in found if o]
    if not found:
        return []
    fig, axes = panels(3 * len(found), ncols=3, size=(4.5, 3.3), nrows=len(found))
    for i, (run, obs) in enumerate(found):
        observation_row(axes[3 * i: 3 * i + 3], obs, f"{run['model']} / {run['task']}")
    return save(fig, out, "fig2_observations")


def all_figures(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Every figure the records allow; returns the files written."""
    return figure4(df, out) + figure_streaming(df, out) + figure2(df, out)
