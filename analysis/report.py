"""``make report`` -> ``analysis/out/REPORT.md``: every number the paper prints beside ours.

For each paper table rendered by ``analysis.paper_tables``: a paragraph on whether the paper's
qualitative claim holds in our runs (each claim checked per model and task with the 95% interval
of the difference), then every paper number with ours (95% interval), ours - paper and a verdict.
Then the numbers no rendering covers (the text's Fig. 4 gains and summary claims), the
out-of-scope tables with their reason, and every other experiment (e.g. ``default``) as run, with
H2O's differences to the other policies. Runs on an empty ``runs/`` too (everything "not run").
"""
from __future__ import annotations

import re

import pandas as pd

from analysis.layout import fmt
from analysis.paper import OUT_OF_SCOPE, load_paper
from analysis.paper_tables import SPECS, paper_tables
from analysis.protocol import RULE, annotate, as_records, choose, compare, select, task_protocol
from analysis.labels import KIND_METRICS, key_str, label, metric_for
from analysis.tables import experiment_tables

VERDICTS = ["within", "outside", "not comparable", "no interval", "not run"]
LEGEND = ("verdict: **within** = the paper's value lies in our 95% interval; **outside** = it "
          "does not; **not comparable** = ours is another model, an offline stand-in task, or "
          "scored with BOS (or BOS not recorded), so the difference says nothing about the "
          "paper; **no interval** = ours has no standard error; **not run** = no finished "
          "record of the table's experiment fits the cell. Accuracies are `acc_mean` (the paper "
          "code's per-token mean log-likelihood) in percent.")


def kind_of(verdict: str) -> str:
    return next((v for v in VERDICTS if verdict.startswith(v)), verdict)


def md_table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def per_number(cells) -> list:
    """One cell per paper number: ours of the paper's model if run, else of a model or task
    that stands in (not comparable), else not run."""
    best = {}
    for c in (c for c in cells if c.paper):
        rank = 2 if c.ours is None else 1 if kind_of(c.verdict) == "not comparable" else 0
        if c.paper_id not in best or rank < best[c.paper_id][0]:
            best[c.paper_id] = (rank, c)
    return [c for _, c in best.values()]


def number_rows(cells, digits: int) -> list[list]:
    rows = []
    for c in cells:
        keys = [v for k, v in c.keys.items() if k != "column"]
        if c.ours is None:
            ours, delta = "not run", ""
        else:
            e = c.ours
            ours = fmt(e.value, digits) + (f" [{fmt(e.lo, digits)}, {fmt(e.hi, digits)}]"
                                          if e.has_interval else "")
            ours += f" ({c.our_model}, {c.our_task})"
            delta = fmt(e.value - c.paper_number, digits) if c.paper_number == c.paper_number else ""
        rows.append([c.paper_model, " / ".join(keys), c.keys["column"], c.paper, ours, delta,
                     c.verdict])
    return rows


def section(spec, table, cells, claims) -> list[str]:
    lines = [f"## {table.title}", ""]
    ran = any(c.pick for c in cells)
    lines.append(f"**The paper:** {spec.claim}. **Our runs:** " + (
        " ".join(line[2:] for line in claims) if ran else
        f"not run (no finished record of experiment {', '.join(spec.experiments)} fits)."))
    lines.append("")
    with_paper = per_number(cells)
    if with_paper:
        counts = {v: sum(kind_of(c.verdict) == v for c in with_paper) for v in VERDICTS}
        lines.append(f"{len(with_paper)} paper numbers: " + ", ".join(
            f"{n} {v}" for v, n in counts.items() if n) + ".")
        lines += [""] + md_table(["paper model", "row", "column", "paper", "ours [95%]",
                                  "ours − paper", "verdict"], number_rows(with_paper, spec.digits))
    else:
        lines += ["The paper prints no numbers for this one (its Fig. 4 shows curves); ours:", "",
                  table.to_markdown().split("\n\n", 2)[-1].rstrip()]
    return lines + [""]


def fig4_gains(df: pd.DataFrame, paper: pd.DataFrame) -> list[list]:
    """The text's Fig. 4 numbers: H2O minus full at 20% (points; the XSUM unit is unstated)."""
    rows = []
    for _, p in paper[paper["table"] == "Fig. 4 (text)"].iterrows():
        exp = "fig4" if p["task"] != "XSUM" else "helm"
        runs = as_records(df[df["experiment"].astype(str).str.startswith(exp)]) if len(df) else []
        sub = [r for r in select(runs, {"model": p["our_model"], "shots": p["shots"]})
               if r["task"] == p["our_task"]]
        metric = "rouge2" if p["task"] == "XSUM" else "acc_mean"
        h2o, full = (choose(select(sub, w), metric) for w in
                     ({"policy": "h2o", "budget": 0.2}, {"policy": "full"}))
        if h2o is None or full is None:
            ours, verdict = "not run", "not run"
        elif task_protocol(h2o.protocol) != task_protocol(full.protocol):
            ours, verdict = "protocols differ", "not comparable: protocols differ"
        else:
            d = compare(h2o, full, metric).scaled(100)
            ours = f"{fmt(d.value, 2)} [{fmt(d.lo, 2)}, {fmt(d.hi, 2)}]"
            verdict = "within" if d.lo <= p["number"] <= d.hi else "outside"
            verdict += " (unit unstated)" if p["task"] == "XSUM" else ""
        rows.append([p["model"], p["task"], p["metric"], p["value"], ours, verdict])
    return rows


def uncovered(paper: pd.DataFrame, df: pd.DataFrame) -> list[str]:
    lines = ["## Numbers no table here renders", "",
             "The text's Fig. 4 gains (H2O minus the full cache at 20%, points; 100 x ROUGE-2 "
             "for XSUM):", ""]
    lines += md_table(["model", "task", "metric", "paper", "ours [95%]", "verdict"],
                      fig4_gains(df, paper)) + [""]
    lines += ["The text's summary claims:", ""]
    text = paper[paper["table"].str.startswith("Text")]
    lines += md_table(["claim", "about", "paper", "here"], [
        [r["metric"], r["task"], r["value"], where_checked(r["task"])] for _, r in text.iterrows()])
    return lines + [""]


def where_checked(about: str) -> str:
    if any(w in about for w in ("throughput", "latency")):
        return "out of scope (FlexGen systems)"
    table = re.search(r"Table \d+", about)
    if table:
        return f"{table.group(0)}'s paragraph above"
    return "Fig. 2 (`make sweep EXP=observations`), not compared" if "WikiText-103" in about \
        else "out of scope (Table 12's GPT-2 training)"


def out_of_scope(paper: pd.DataFrame) -> list[str]:
    lines = ["## Out of scope", ""]
    for table, why in OUT_OF_SCOPE.items():
        n = (paper["table"] == table).sum()
        lines.append(f"- **{table}** ({n} numbers): {why}.")
    return lines + [""]


def findings(runs: pd.DataFrame) -> list[str]:
    """H2O minus each other policy at each budget, per model x task (x shots): `>` better and
    `<` worse with 95% confidence, `≈` unresolved (perplexity: lower is better)."""
    out = []
    for (model, task, shots), g in runs.groupby(["model", "task", "shots"], dropna=False):
        metric = metric_for(g["task_kind"].iloc[0], g)
        if metric is None:
            continue
        sign = -1 if metric == "ppl" else 1
        parts, recs = [], as_records(g)
        for b in sorted(pd.to_numeric(g.loc[g["policy"] == "h2o", "budget"]).dropna().unique()):
            h2o = choose(select(recs, {"policy": "h2o", "budget": float(b)}), metric)
            for other in ["full"] + [p for p in sorted(g["policy"].unique()) if p not in
                                     ("full", "h2o")]:
                o = choose(select(recs, {"policy": other, "budget": float(b)}), metric)
                if h2o is None or o is None or task_protocol(h2o.protocol) != \
                        task_protocol(o.protocol):
                    continue
                d = compare(h2o, o, metric)
                mark = "≈" if not d.has_interval or d.lo <= 0 <= d.hi else \
                    ">" if sign * d.value > 0 else "<"
                digits = 2 if metric == "ppl" else 3
                ci = f" [{fmt(d.lo, digits)}, {fmt(d.hi, digits)}]" if d.has_interval else ""
                parts.append(f"{b:g}: H2O {mark} {label(other)} ({fmt(d.value, digits)}{ci})")
        if parts:
            shot = "" if key_str(shots) == "?" else f"{key_str(shots)}-shot, "
            out.append(f"- {task} ({model}, {shot}{metric}): " + "; ".join(parts))
    return out


def other_experiments(df: pd.DataFrame) -> list[str]:
    covered = {e for s in SPECS for e in s.experiments}
    prefixes = tuple(e[:-1] for e in covered if e.endswith("*"))
    scored = df[df["task_kind"].isin(KIND_METRICS)] if len(df) else df  # not bench/observations
    exps = [e for e in sorted(scored["experiment"].dropna().astype(str).unique())
            if e not in covered and not e.startswith(prefixes)] if len(df) else []
    lines = []
    for exp in exps:
        runs = annotate(df[df["experiment"] == exp])
        lines += [f"## Experiment `{exp}` (not a paper table)", "",
                  "H2O against each other policy at the same budget (`>` better, `<` worse at "
                  "95%, `≈` unresolved; the difference H2O − other with its 95% interval; "
                  "perplexity: lower is better):", ""]
        lines += findings(runs) or ["- no budget with H2O and another policy of one protocol"]
        lines += long_generation_findings(runs)
        for t in experiment_tables(runs):
            lines += ["", t.to_markdown().rstrip()]
        lines.append("")
    return lines


def long_generation_findings(runs: pd.DataFrame) -> list[str]:
    """The experiment's long-generation records: H2O against each other method, paired over prompts (the NLL per
    token of the full cache's answer teacher-forced through each cache; lower is closer to it)."""
    from analysis import long_generation as lg

    long = lg.frame(runs)
    found = lg.versus_h2o(long) if len(long) else []
    if not found:
        return []
    head = (f"- long_generation ({', '.join(sorted(set(long['model'])))}, NLL per token of the full cache's answer, "
            f"over {lg.grid_prompts(long)} prompts; `<`: H2O closer to the full cache at 95%):")
    return [head, *("  " + f for f in found)]


def report(df: pd.DataFrame) -> str:
    paper = load_paper()
    df = annotate(df) if len(df) else df
    results = paper_tables(df, paper)
    n_exp = df["experiment"].nunique() if len(df) else 0
    lines = ["# H2O reproduction report", "",
             f"Generated by `make report` from {len(df)} finished run records "
             f"({n_exp} experiments). {LEGEND}", "", f"{RULE}.", "", "## Summary", ""]
    rows = []
    for spec, table, cells, _ in results:
        with_paper = per_number(cells)
        counts = [sum(kind_of(c.verdict) == v for c in with_paper) for v in VERDICTS]
        rows.append([spec.paper or table.title.split(":")[0], len(with_paper), *counts])
    lines += md_table(["table", "paper numbers", *VERDICTS], rows) + [""]
    for result in results:
        lines += section(*result)
    lines += uncovered(paper, df) + out_of_scope(paper) + other_experiments(df)
    return "\n".join(lines).rstrip() + "\n"
