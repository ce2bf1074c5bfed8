"""The methods experiments (experiment=methods, methods_cluster): every eviction method at both compression
timings, from run records.

A record's *timing* is its policy's ``compress`` (``decode``, the default, or ``prefill``), labelled ``<compress>,
question after`` for a task run with ``task.question=after`` (the context compressed alone, then the question: the
query-agnostic protocol; a column and a line of its own). Per experiment x model x
task, with the task kind's metric (perplexity: ``ppl``, lower is better; retrieval: ``acc``; multiple choice:
``acc_mean``), one record per method x budget x timing (:data:`analysis.protocol.RULE` among records of that timing):

* figure ``<experiment>_<task>_methods``: quality against the budget, and quality against the KV cache held at the
  end of the sequence (record ``kv_bytes_end``, MiB per sequence: the two timings hold different amounts for one
  budget: prefill keeps every token after the prompt); one line per method, solid for decode and dashed for prefill,
  the full cache a dotted horizontal line; 95% error bars.
* table ``<experiment>_<task>_methods``: rows the methods, columns budget x timing, each cell the value with its 95%
  interval and the KV MiB held at the end, and the MiB stored where they exceed it (``kv_bytes_stored``: a batch's
  empty slots, adakv's heads padded to the largest; :data:`STORED`).
* :func:`comparisons`: each method against H2O (decode) at the same budget, paired by window or prompt where both
  records scored the same ones (:func:`analysis.estimate.paired_difference`): ``>`` better, ``<`` worse at 95%,
  ``≈`` unresolved.

``python -m analysis methods --runs runs --out analysis/out`` writes the figures and tables; ``make figures`` and
``make tables`` include them; docs/results/methods.md is regenerated from the records under studies/methods/
(a study of kind ``methods``, :mod:`analysis.results_pages`).
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from analysis.estimate import Z95, difference, paired_difference
from analysis.protocol import TIMINGS, annotate, choose, compress_of, question_of
from analysis.render import Table
from analysis.labels import color, label, marker, metric_for, num, pick_text

EXPERIMENTS = ("methods", "methods_cluster")
AFTER = ", question after"  # the label's suffix for task.question=after
LABELS = (*TIMINGS, *(t + AFTER for t in TIMINGS))  # every timing label, the table's column order
STYLES = {"decode": ("-", True, 0.985), "prefill": ("--", False, 1.015), "decode" + AFTER: ((0, (1, 1)), True, 0.955),
          "prefill" + AFTER: ("-.", False, 1.045)}  # line, filled marker, dodge along the budget axis (the marker and
# colour are the method's: analysis.labels.METHODS)
ORDER = ["full", "local", "streaming_llm", "h2o", "tova", "scissorhands", "random", "snapkv", "pyramidkv",
         "adakv", "knorm", "keydiff", "expected_attention"]
LOWER_IS_BETTER = ("ppl",)
MIB = 2 ** 20


def timing_of(row) -> str:
    """The record's timing label: its :func:`compress_of`, with :data:`AFTER` where the question came after the
    compressed context."""
    return compress_of(row) + (AFTER if question_of(row) == "after" else "")


def labels(chosen: dict) -> list[str]:
    """The timing labels of a table: both timings, then the question-after ones its records have."""
    return [t for t in LABELS if t in TIMINGS or any(k[2] == t for k in chosen)]


def methods_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The annotated records of the methods experiments, with a ``timing`` column."""
    if df.empty:
        return df
    runs = annotate(df[df["experiment"].isin(EXPERIMENTS)])
    return runs.assign(timing=[timing_of(r) for _, r in runs.iterrows()]) if len(runs) else runs


def method_order(policies) -> list[str]:
    return sorted(policies, key=lambda p: (ORDER.index(p) if p in ORDER else 99, p))


def picks(runs: pd.DataFrame, metric: str) -> dict[tuple[str, float, str], object]:
    """{(policy, budget, timing): Pick}; the full cache at budget 1.0 under decode."""
    out = {}
    for (policy, budget, timing), group in runs.groupby(["policy", "budget", "timing"], dropna=False):
        pick = choose(group, metric)
        if pick is not None:
            out[policy, 1.0 if policy == "full" else float(budget), timing] = pick
    return out


def kv_mib(pick, key: str = "kv_bytes_end") -> float:
    """The record's KV bytes ``key`` per sequence in MiB (NaN where it has none): held at the end by default,
    ``kv_bytes_stored`` the bytes stored (padding included)."""
    v = pick.row.get(key) if pick is not None else None
    return float(v) / MIB if isinstance(v, (int, float)) and not math.isnan(float(v)) else float("nan")


def groups(df: pd.DataFrame):
    """(experiment, model, task, metric, runs) for each task of the methods experiments."""
    runs = methods_runs(df)
    if runs.empty:
        return
    for (exp, model, task), group in runs.groupby(["experiment", "model", "task"], dropna=False):
        metric = metric_for(group["task_kind"].iloc[0], group)
        if metric is not None:
            yield exp, model, task, metric, group


def table(exp: str, model: str, task: str, metric: str, runs: pd.DataFrame) -> Table:
    chosen = picks(runs, metric)
    budgets = sorted({b for (p, b, _) in chosen if p != "full"})
    digits = 2 if metric == "ppl" else 3
    timings = labels(chosen)
    header = ["method"] + [f"{b:.0%} {t}" for b in budgets for t in timings]
    rows = []
    for policy in method_order({p for p, _, _ in chosen}):
        if policy == "full":
            pick = chosen.get(("full", 1.0, "decode"))
            rows.append([label(policy)] + [cell(pick, digits)] * len(budgets) * len(timings))
            continue
        rows.append([label(policy)] + [cell(chosen.get((policy, b, t)), digits) for b in budgets for t in timings])
    caption = [f"{metric} [95% interval] · KV MiB held per sequence at the end; — not run or refused (decode for "
               f"methods defined at a prompt's end only, prefill on a task without a prompt); full: 100% of the cache"]
    if any("(stored " in c for r in rows for c in r[1:]):
        caption.append(STORED)
    return Table(f"{exp}_{task}_methods", f"{exp}: {metric} of every method by budget and timing ({model}, {task})",
                 header, rows, caption)


STORED = ("(stored X): the KV MiB stored per sequence (record `kv_bytes_stored`) where they exceed those held at "
          "this precision: a batch stores its shorter prompts' empty slots, and a pooled policy (adakv) each "
          "layer's heads padded to the largest head's count; records written before that field show the bytes "
          "held only")


def cell(pick, digits: int) -> str:
    """``value [lo, hi] · KV MiB`` (:func:`analysis.labels.pick_text`, then the cache held at the end), with
    ``(stored X)`` where the bytes stored exceed it at the shown precision (:data:`STORED`)."""
    kv, stored = kv_mib(pick), kv_mib(pick, "kv_bytes_stored")
    if pick is None or math.isnan(kv):
        return pick_text(pick, digits, {})
    held = f"{kv:.1f}"
    padded = f" (stored {stored:.1f})" if not math.isnan(stored) and f"{stored:.1f}" != held else ""
    return pick_text(pick, digits, {}) + f" · {held}{padded}"


def comparisons(metric: str, runs: pd.DataFrame) -> list[str]:
    """One line per method x timing x budget against H2O decode at that budget (paired where possible)."""
    chosen = picks(runs, metric)
    lower = metric in LOWER_IS_BETTER
    lines = []
    rank = {p: i for i, p in enumerate(method_order({p for p, _, _ in chosen}))}
    for (policy, budget, timing), pick in sorted(chosen.items(), key=lambda kv: (kv[0][1], rank[kv[0][0]], kv[0][2])):
        base = chosen.get(("h2o", budget, "decode"))
        if policy == "full" or base is None or (policy, timing) == ("h2o", "decode"):
            continue
        sign, detail = versus(pick, base, metric, lower)
        lines.append(f"- {budget:.0%}: {label(policy)} ({timing}) {sign} H2O (decode): {detail}")
    return lines


def versus(pick, base, metric: str, lower: bool) -> tuple[str, str]:
    """(sign, ``<metric> a vs b, difference d [lo, hi] paired``) of ``pick`` against ``base``: ``>`` better, ``<``
    worse at 95%, ``≈`` unresolved; paired by window or prompt where both records scored the same ones
    (:func:`analysis.estimate.paired_difference`)."""
    diff = paired_difference(pick.row, base.row, metric)
    paired = diff is not None
    diff = diff if paired else difference(pick.est, base.est)
    lo, hi = diff.value - Z95 * diff.se, diff.value + Z95 * diff.se
    sign = "≈" if math.isnan(diff.se) or lo <= 0 <= hi else (">" if (hi < 0) == lower else "<")
    return sign, (f"{metric} {num(pick.est.value, 3)} vs {num(base.est.value, 3)}, difference {diff.value:+.3f} "
                  f"[{lo:+.3f}, {hi:+.3f}]{' paired' if paired else ''}")


def question_comparisons(metric: str, runs: pd.DataFrame) -> list[str]:
    """One line per method x budget x timing run both ways: the question after the compressed context against
    the question inside it (same method, budget and timing)."""
    chosen = picks(runs, metric)
    rank = {p: i for i, p in enumerate(method_order({p for p, _, _ in chosen}))}
    lines = []
    for (policy, budget, timing), pick in sorted(chosen.items(), key=lambda kv: (kv[0][1], rank[kv[0][0]], kv[0][2])):
        base = chosen.get((policy, budget, timing[:-len(AFTER)])) if timing.endswith(AFTER) else None
        if base is not None:
            sign, detail = versus(pick, base, metric, metric in LOWER_IS_BETTER)
            lines.append(f"- {budget:.0%}: {label(policy)} ({timing}) {sign} the question inside the prompt "
                         f"({base.row.get('timing', timing[:-len(AFTER)])}): {detail}")
    return lines


def figure(exp: str, model: str, task: str, metric: str, runs: pd.DataFrame, out) -> list[Path]:
    from analysis.plotting import panels, save

    chosen = picks(runs, metric)
    fig, axes = panels(2, ncols=2, size=(5.6, 4.2))
    policies = [p for p in method_order({p for p, _, _ in chosen}) if p != "full"]
    full = chosen.get(("full", 1.0, "decode"))
    for ax, by_kv in zip(axes, (False, True)):
        for policy in policies:
            colour = color(policy)
            for timing in labels(chosen):
                style, filled, dodge = STYLES[timing]
                pts = sorted((b, p) for (q, b, t), p in chosen.items() if q == policy and t == timing)
                if not pts:
                    continue
                xs = [kv_mib(p) if by_kv else b * dodge for b, p in pts]  # the timings side by side at a budget
                ys = [p.est.value for _, p in pts]
                err = [[max(0.0, p.est.value - p.est.lo) if p.est.has_interval else 0 for _, p in pts],
                       [max(0.0, p.est.hi - p.est.value) if p.est.has_interval else 0 for _, p in pts]]
                ax.errorbar(xs, ys, yerr=err, fmt=style, marker=marker(policy), ms=4, capsize=2, color=colour,
                            mfc=colour if filled else "none", label=f"{label(policy)} {timing}")
        if full is not None:
            ax.axhline(full.est.value, color=color("full"), ls=":", lw=1, label="full")
            if by_kv and not math.isnan(kv_mib(full)):
                ax.plot([kv_mib(full)], [full.est.value], marker=marker("full"), color=color("full"), ms=8, ls="")
        if by_kv:
            ax.set_xlabel("KV cache held at the end (MiB per sequence)")
        else:
            budgets = sorted({b for (q, b, _) in chosen if q != "full"})
            ax.set_xscale("log")
            ax.set_xticks(budgets, [f"{b:.0%}" for b in budgets])
            ax.minorticks_off()
            ax.set_xlim(min(budgets) / 1.3, max(budgets) * 1.3)
            ax.set_xlabel("budget (share of the prompt)")
        ax.set(ylabel=metric, title=f"{task}: {metric} vs {'KV bytes held' if by_kv else 'budget'}")
        if metric == "ppl":
            ax.set_yscale("log")
    axes[1].legend(fontsize=6, ncol=2, loc="best")
    after = "; dash-dot prefill, question after" if any(k[2].endswith(AFTER) for k in chosen) else ""
    fig.suptitle(f"{model} / {task} ({exp}): solid decode, dashed prefill (hollow){after}; full: dotted (its KV: "
                 "the star)")
    return save(fig, out, f"{exp}_{task}_methods")


def methods_figures(df: pd.DataFrame, out) -> list[Path]:
    return [p for exp, model, task, metric, runs in groups(df) for p in figure(exp, model, task, metric, runs, out)]


def methods_tables(df: pd.DataFrame) -> list[Table]:
    return [table(exp, model, task, metric, runs) for exp, model, task, metric, runs in groups(df)]


def page_body(df: pd.DataFrame, figures: Path, rel: str) -> list[str]:
    """The docs page's body (after its head): per task its figure (and a needle task's heatmaps, one per
    protocol: :mod:`analysis.niah`), table and comparisons."""
    from analysis.niah import figure_niah  # it reads this module's timings

    lines = []
    for exp, model, task, metric, runs in groups(df):
        lines += [f"## {task} ({model}, {exp})", ""]
        for p in figure(exp, model, task, metric, runs, figures) + figure_niah(runs, figures):
            if p.suffix == ".png":
                lines += [f"![{p.stem}]({rel}/{p.name})", ""]
            else:
                p.unlink()
        lines += [table(exp, model, task, metric, runs).to_markdown(), ""]
        found = comparisons(metric, runs)
        if found:
            lines += [f"Each method against H2O (decode) at the same budget (`>` better, `<` worse at 95%, `≈` "
                      "unresolved; the difference with its 95% interval, paired by window or prompt):", "", *found, ""]
        moved = question_comparisons(metric, runs)
        if moved:
            lines += ["The question after the compressed context (`task.question=after`: the context compressed "
                      "alone, then the question) against inside it, same method, budget and timing:", "", *moved, ""]
        times = pd.to_numeric(runs.get("cpu_s"), errors="coerce")
        walls = pd.to_numeric(runs.get("wall_s"), errors="coerce")
        lines += [f"{len(runs)} records; CPU time {times.sum():,.0f} s in all (task only, model load excluded), wall "
                  f"{walls.sum():,.0f} s in all (shared cores: wall times are inflated).", ""]
    return lines

