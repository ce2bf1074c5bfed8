"""Tables of every experiment as run (the paper's layouts are in ``analysis.paper_tables``).

One table per experiment and task kind, ``<experiment>_<kind>``: rows are model x task (x shots,
x semantics where they vary) x policy, columns the budgets run (the full cache in column ``1``),
cells the metric with its 95% interval, picked by :data:`analysis.protocol.RULE` (one protocol
per cell; a table that shows several tags its cells ``(p1)``, ``(p2)`` and spells them out).
Metrics: multiple choice ``acc_mean`` (the paper code's per-token mean rule; ``acc``, lm-eval's
summed rule, for records that lack it), summarization ``rouge2``, perplexity ``ppl``, retrieval
``acc`` (needle in a haystack, RULER) or ``score`` (LongBench: lm-eval's per-task F1, ROUGE-L, accuracy or edit
similarity, each in [0, 1]). An experiment whose tasks of one kind name different metrics gets one table per
metric, ``<experiment>_<kind>_<metric>``.
Plus ``benchmark`` (Tables 3-5 style, ``make bench`` records). Budgets are total cache ratios;
H2O rows keep only the paper's even split (heavy == recent).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.protocol import RULE, annotate, as_records, choose, protocol_notes, select
from analysis.labels import POLICIES, key_str, label, metric_for, num, pick_text, policy_order
from analysis.render import MISSING, Table

def budget_table(name: str, title: str, runs: pd.DataFrame, metric: str, digits: int) -> Table:
    """Rows: model x task (x varying shots / semantics) x policy; columns: budgets."""
    keys = ["model", "task"] + [k for k in ("shots", "semantics") if runs[k].nunique() > 1]
    levels = [sorted(runs[k].dropna().unique(), key=str) for k in keys]
    budgets = sorted({1.0} | set(pd.to_numeric(runs["budget"], errors="coerce").dropna()))
    policies = policy_order(runs["policy"].dropna().unique())
    grid, picks, recs, served = [], [], as_records(runs), 0
    for combo in pd.MultiIndex.from_product(levels, names=keys):
        sub = [r for r in select(recs, dict(zip(keys, combo))) if r["task"] == combo[1]]
        for policy in policies:
            row = [key_str(v) for v in combo] + [label(policy)]
            for b in budgets:
                if policy == "full" and b != 1.0:
                    row.append(None)
                    continue
                pick = choose(select(sub, {"policy": policy, "budget": b}), metric)
                if pick is None and b == 1.0 and policy != "full":
                    # a 100% ratio budget never evicts: the full cache's run by construction, which a Slurm sweep
                    # runs once, as full (h2o.pipeline.launch lists these runs as served by the full record)
                    pick = choose(select(sub, {"policy": "full"}), metric)
                    served += pick is not None
                row.append(pick)
                picks.append(row[-1])
            grid.append(row)
    tags, notes = protocol_notes(picks)
    if served:
        notes = [*notes, f"budget 1 cells of an evicting policy without a record of their own ({served}): the full "
                         "cache's (a 100% budget never evicts)"]
    rows = [[c if isinstance(c, str) else pick_text(c, digits, tags) for c in r] for r in grid]
    ns = sorted({p.n for p in picks if p is not None and p.n is not None})
    caption = [f"metric: {metric} [95% interval]", RULE, *notes,
               "n_samples per cell: " + ("?" if not ns else key_str(ns[0]) if len(ns) == 1
                                         else f"{ns[0]}–{ns[-1]}"),
               "budget: ratio of the scored sequence (prompt for generation, window for "
               "perplexity); H2O = half heavy hitters, half recent", f"{MISSING} = no finished run"]
    header = keys + ["policy"] + [key_str(b) for b in budgets]
    return Table(name, title, header, rows, caption)


def experiment_tables(df: pd.DataFrame) -> list[Table]:
    """One budget table per experiment and task kind present (the methods experiments: analysis.methods)."""
    from analysis.methods import EXPERIMENTS, methods_tables

    df = annotate(df)
    out = methods_tables(df)
    for (exp, kind), runs in df[~df["experiment"].isin(EXPERIMENTS)].groupby(["experiment", "task_kind"],
                                                                            dropna=True, sort=True):
        by_metric: dict[str, list[pd.DataFrame]] = {}  # each task's metric: RULER's acc beside LongBench's score
        for _, task_runs in runs.groupby("task", dropna=False, sort=True):
            metric = metric_for(kind, task_runs)
            if metric is not None:
                by_metric.setdefault(metric, []).append(task_runs)
        for metric, parts in by_metric.items():
            name = f"{exp}_{kind}" if len(by_metric) == 1 else f"{exp}_{kind}_{metric}"
            out.append(budget_table(name, f"{exp}: {metric} by policy and budget ({kind})", pd.concat(parts),
                                    metric, 2 if metric == "ppl" else 3))
    return out


BENCH_SETTING = ["model", "semantics", "prompt_len", "gen_len", "batch_size"]
BENCH_METRICS = [("throughput (tok/s)", "throughput_tok_s", lambda v: num(v, 1)),
                 ("latency (s)", "latency_s", lambda v: num(v, 3)),
                 ("KV cache (MiB)", "kv_bytes", lambda v: num(v / 2**20, 1)),
                 ("peak mem (MiB)", "peak_mem_bytes", lambda v: num(v / 2**20, 1))]


def ratio(value: float, full: float) -> str:
    return MISSING if pd.isna(value) or pd.isna(full) or full == 0 else f"{value / full:.2f}×"


def table_benchmark(df: pd.DataFrame) -> Table | None:
    """Tables 3-5 style: throughput, latency, KV bytes and peak memory, each also as a ratio to the
    full cache at the same model, semantics, prompt length, generation length and batch size."""
    bench = annotate(df[df["task_kind"] == "benchmark"])
    if bench.empty:
        return None
    bench = bench.assign(**{k: bench.get(k, np.nan) for k in BENCH_SETTING})
    pairs = bench[bench["policy"] != "full"][["policy", "budget"]].drop_duplicates()
    items = [("full", None)] + sorted(map(tuple, pairs.values), key=lambda p: (
        POLICIES.index(p[0]) if p[0] in POLICIES else 99, p[1]))
    header = ["model", "semantics", "prompt", "gen", "batch", "policy", "budget"]
    for name, _, _ in BENCH_METRICS:
        header += [name, name.split(" (")[0] + " × full"]
    rows = []
    settings = bench[BENCH_SETTING].drop_duplicates().sort_values(BENCH_SETTING)
    for _, setting in settings.iterrows():
        sub = as_records(bench[(bench[BENCH_SETTING].map(key_str) ==
                                setting.map(key_str)).all(axis=1)])
        full = choose(select(sub, {"policy": "full"}), "throughput_tok_s")
        for policy, budget in items:
            pick = full if budget is None else choose(
                select(sub, {"policy": policy, "budget": budget}), "throughput_tok_s")
            row = [key_str(v) for v in setting] + [label(policy), key_str(budget or 1.0)]
            for _, metric, fmt in BENCH_METRICS:
                value, ref = (float(np.mean([r.get(metric, np.nan) for r in p.runs]))
                              if p is not None else float("nan") for p in (pick, full))
                row += [fmt(value), ratio(value, ref)]
            rows.append(row)
    caption = ["throughput = generated tokens / (prefill + decode time)",
               "× full: the policy's value over the full cache's at the same setting", RULE,
               "models: " + ", ".join(sorted(bench["model"].dropna().astype(str).unique())),
               f"{MISSING} = no finished run"]
    return Table("benchmark", "Tables 3-5 style: generation throughput, latency and memory",
                 header, rows, caption)


def all_tables(df: pd.DataFrame) -> list[Table]:
    """The paper's tables (always, 'not run' where no record fits) and every experiment's own."""
    from analysis.paper_tables import all_paper_tables
    from analysis.quant_tables import quant_tables
    df = annotate(df) if len(df) else df
    bench = table_benchmark(df) if len(df) else None
    return all_paper_tables(df) + (experiment_tables(df) + quant_tables(df) if len(df) else []) + \
        ([bench] if bench else [])
