"""The figures, from run records (matplotlib, Agg; PNG and PDF). Every point is one protocol,
picked by :data:`analysis.protocol.RULE` like a table cell, drawn with its 95% interval.

* ``fig4_budget_curves``: Figure 4, metric vs KV cache budget (experiments ``fig4`` and
  ``helm*``), ``fig8_shots`` (experiment ``fig8``: 0/1-shot budget sweep) and
  ``fig9_streaming_vs_h2o`` (experiment ``fig9``: StreamingLLM vs H2O on XSUM / CNN-DM): one
  panel per model x task (x shots, x semantics), one line per policy, the full cache as a dashed
  line with its interval shaded. Multiple choice: ``acc_mean``; summarization: ``rouge2``;
  perplexity: ``ppl``.
* ``<experiment>_budget_curves``: the same for any other experiment that sweeps budgets.
* ``<experiment>_policies``: any other experiment run at a single budget (e.g. ``default``,
  ``table1``): one panel per model x task (x shots, x semantics), each policy's headline metric
  at that budget with its 95% interval, the full cache as a dashed line with its interval
  shaded. The headline metric is the one the records name (``headline``), else the task kind's
  (:func:`headline_metric`), so any task with a metric and an interval draws.
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

from analysis.plotting import panels, save  # first: it selects matplotlib's display-free backend

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.labels import POLICIES, color, key_str, label, marker, metric_for, policy_order  # noqa: E402
from analysis.layout import eligible  # noqa: E402
from analysis.protocol import annotate, as_records, choose, select  # noqa: E402
from analysis.records import load_json, load_samples  # noqa: E402

SEMANTICS_STYLE = {"simulated": "-", "real": "-.", "reference": ":"}  # "--" is the full cache
PAPER_FIGURES = [  # (file stem, title, experiments, policies drawn: None = every policy run)
    ("fig4_budget_curves", "Figure 4: metric vs KV cache budget", ("fig4", "helm*"),
     ["full", "local", "h2o"]),
    ("fig8_shots", "Figure 8: 0- and 1-shot accuracy vs budget", ("fig8",), None),
    ("fig9_streaming_vs_h2o", "Figure 9: StreamingLLM vs H2O on XSUM / CNN-DM", ("fig9",),
     ["full", "streaming_llm", "h2o"]),
]
NO_CURVES = ("self_bleu", "observations", "methods", "methods_cluster")  # no budget curves (methods: analysis.methods)


def fit_power_law(scores) -> tuple[float, float]:
    """(alpha, c) with sorted scores ~ c * rank ** -alpha, least squares on log-log."""
    s = np.sort(np.asarray(scores, dtype=float).ravel())[::-1]
    s = s[s > 0]
    if len(s) < 2:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(np.log10(np.arange(1, len(s) + 1)), np.log10(s), 1)
    return -slope, 10 ** intercept




def curve_panel(ax, runs: pd.DataFrame, metric: str, title: str, policies=None) -> int:
    """One panel: ``metric`` vs budget per policy (one protocol per point, 95% error bars), the
    full cache dashed with its interval shaded. Returns the number of points drawn."""
    drawn, recs = 0, as_records(runs)
    for policy in policy_order(policies or runs["policy"].dropna().unique()):
        if policy == "full":
            pick = choose(select(recs, {"policy": "full"}), metric)
            if pick is not None:
                e = pick.est
                ax.axhline(e.value, ls="--", color=color("full"), label="full")
                if e.has_interval:
                    ax.axhspan(e.lo, e.hi, color=color("full"), alpha=0.08)
                drawn += 1
            continue
        budgets = sorted(pd.to_numeric(runs.loc[runs["policy"] == policy, "budget"],
                                       errors="coerce").dropna().unique())
        pts = [(b, choose(select(recs, {"policy": policy, "budget": float(b)}), metric))
               for b in budgets]
        pts = [(b, p.est) for b, p in pts if p is not None]
        if not pts:
            continue
        x, y = [b for b, _ in pts], [e.value for _, e in pts]
        err = [[e.value - e.lo if e.has_interval else 0 for _, e in pts],
               [e.hi - e.value if e.has_interval else 0 for _, e in pts]]
        ax.errorbar(x, y, yerr=err, marker=marker(policy), capsize=3, label=label(policy), color=color(policy))
        drawn += len(pts)
    ax.set(title=title, xlabel="KV cache budget (fraction)", ylabel=metric, xlim=(0, 1.02))
    ax.legend(fontsize=7)
    return drawn


def panel_figure(runs: pd.DataFrame, out, name: str, title: str, draw, metric_of, ncols: int = 3,
                 size=(4.2, 3.2)) -> list[Path]:
    """One panel per model x task (x shots, x semantics where they vary) that has a metric
    (``metric_of(group)``), drawn by ``draw(ax, group, metric, panel title)`` -> points drawn; written
    if any point was drawn."""
    runs = annotate(runs)
    keys = ["model", "task"] + [k for k in ("shots", "semantics") if runs[k].nunique() > 1]
    groups = [(k, g, metric_of(g)) for k, g in runs.groupby(keys, dropna=False)]
    groups = [(k, g, m) for k, g, m in groups if m]
    if not groups:
        return []
    fig, axes = panels(len(groups), ncols, size)
    drawn = 0
    for ax, (key, sub, metric) in zip(axes, groups):
        text = " / ".join(key_str(v) if k != "shots" else f"{key_str(v)}-shot"
                          for k, v in zip(keys, key))
        drawn += draw(ax, sub, metric, text)
    if not drawn:
        plt.close(fig)
        return []
    fig.suptitle(f"{title}\n(one protocol per point: the largest sample, see REPORT.md; "
                 f"bars: 95% intervals)", fontsize=9)
    return save(fig, out, name)


def budget_figure(runs: pd.DataFrame, out, name: str, title: str, policies=None) -> list[Path]:
    """Metric vs budget, one panel per model x task (x shots, x semantics), the task kind's metric."""
    return panel_figure(runs, out, name, title,
                        lambda ax, sub, metric, text: curve_panel(ax, sub, metric, text, policies),
                        lambda g: metric_for(g["task_kind"].iloc[0], g))


def headline_metric(runs: pd.DataFrame) -> str | None:
    """The metric the records name as their headline (``headline``, e.g. ``acc_mean``) when they
    all name one and have it, else the task kind's (:func:`analysis.labels.metric_for`)."""
    named = runs["headline"].dropna().unique() if "headline" in runs.columns else []
    if len(named) == 1 and named[0] in runs.columns and \
            pd.to_numeric(runs[named[0]], errors="coerce").notna().any():
        return str(named[0])
    kinds = runs["task_kind"].dropna().unique()
    return metric_for(kinds[0], runs) if len(kinds) == 1 else None


def policy_points(runs: pd.DataFrame, metric: str) -> list[tuple[str, object]]:
    """(policy, Estimate) per policy of one panel at its single budget, in the tables' policy
    order; one protocol per point (:func:`analysis.protocol.choose`), the full cache included."""
    recs, out = as_records(runs), []
    for policy in policy_order(runs["policy"].dropna().unique()):
        pick = choose(select(recs, {"policy": policy}), metric)
        if pick is not None and np.isfinite(pick.est.value):
            out.append((policy, pick.est))
    return out


def policy_panel(ax, runs: pd.DataFrame, metric: str, title: str) -> int:
    """Each policy's ``metric`` with its 95% interval (error bars), the full cache dashed with its
    interval shaded across the panel. Returns the number of points drawn."""
    pts = policy_points(runs, metric)
    for i, (policy, e) in enumerate(pts):
        lo, hi = (max(0.0, e.value - e.lo), max(0.0, e.hi - e.value)) if e.has_interval else (0, 0)  # 0/n: float noise
        ax.errorbar([i], [e.value], yerr=[[lo], [hi]], marker=marker(policy), capsize=4, color=color(policy))
        ax.annotate(f"{e.value:.3g}", (i, e.value), xytext=(6, 0), textcoords="offset points",
                    fontsize=7, va="center")
        if policy == "full":
            ax.axhline(e.value, ls="--", color=color("full"), lw=0.8)
            if e.has_interval:
                ax.axhspan(e.lo, e.hi, color=color("full"), alpha=0.08)
    budget = pd.to_numeric(runs.loc[runs["policy"] != "full", "budget"], errors="coerce").dropna()
    ax.set_xticks(range(len(pts)), [label(p) for p, _ in pts], fontsize=8)
    ax.set(title=title + (f", budget {key_str(budget.iloc[0])}" if len(budget) else ""),
           ylabel=metric, xlim=(-0.5, len(pts) - 0.5))
    return len(pts)


def policy_figure(runs: pd.DataFrame, out, name: str, title: str) -> list[Path]:
    """Each policy at the experiment's single budget, one panel per model x task (x shots, x
    semantics), the records' headline metric."""
    return panel_figure(runs, out, name, title, policy_panel, headline_metric, ncols=2, size=(4.6, 3.4))


def budget_figures(df: pd.DataFrame, out) -> list[Path]:
    """The paper's budget figures (their own experiments only), then one per other experiment: its
    budget curves, or its policies at the one budget it ran."""
    paths, covered = [], pd.Series(False, index=df.index)
    for name, title, experiments, policies in PAPER_FIGURES:
        runs = eligible(df, experiments)
        covered[runs.index] = True
        paths += budget_figure(runs, out, name, title, policies)
    other = df[~covered & ~df["experiment"].isin(NO_CURVES)]
    for exp, runs in other.groupby("experiment"):
        budgets = runs.loc[runs["policy"] != "full", "budget"].nunique()
        if budgets > 1:
            paths += budget_figure(runs, out, f"{exp}_budget_curves", f"{exp}: metric vs budget")
        elif budgets == 1:
            paths += policy_figure(runs, out, f"{exp}_policies", f"{exp}: each policy at its budget")
    return paths


def one_each(runs: pd.DataFrame, keys: list[str], metric: str) -> pd.DataFrame:
    """One record per ``keys`` group, chosen by the cell rule (the first seed of its protocol)."""
    picks = [choose(g, metric) for _, g in runs.groupby(keys, dropna=False)] if len(runs) else []
    return pd.DataFrame([p.row for p in picks if p is not None])


def figure_streaming(df: pd.DataFrame, out: str | Path) -> list[Path]:
    """Long-context figure: perplexity vs tokens streamed, one line per policy and budget."""
    runs = one_each(df[df["task_kind"] == "streaming"],
                    ["experiment", "model", "task", "policy", "budget"], "ppl")
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
    runs = one_each(df[(df["task_kind"] == "observations") | (df["experiment"] == "observations")],
                    ["experiment", "model", "task"], "n_samples")
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
    if df.empty:
        return []
    df = annotate(df)
    from analysis.methods import methods_figures  # every method at both timings (analysis/methods.py)
    from analysis.niah import figure_niah  # needle-in-a-haystack heatmaps (analysis/niah.py)

    long = df["task_kind"] == "long_generation"  # drawn by analysis.long_generation, not as budget curves
    return (budget_figures(df[~long], out) + figure_streaming(df, out) + figure2(df, out) + figure_niah(df, out)
            + methods_figures(df, out) + long_generation_figures(df[long], out))


def long_generation_figures(df: pd.DataFrame, out) -> list[Path]:
    """Per experiment with long-generation records, :mod:`analysis.long_generation`'s two figures (KV bytes held
    over the answer, fidelity to the full cache's answer) on its grid's prompts; named ``long_generation_kv`` and
    ``long_generation_fidelity``, then ``_<experiment>`` for any experiment but long_generation."""
    from analysis import long_generation as lg

    paths = []
    for exp, sub in df.groupby("experiment"):
        runs = lg.frame(sub)
        on_grid = runs[runs["prompts"] == lg.grid_prompts(runs)]
        suffix = "" if exp == "long_generation" else f"_{exp}"
        paths += lg.kv_figure(on_grid, Path(out), suffix) + lg.fidelity_figure(on_grid, Path(out), suffix)
    return paths
