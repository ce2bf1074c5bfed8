"""The long-generation study's page (``experiment=long_generation``, h2o.tasks.long_generation): from its records,
the headline comparison (two methods at one budget and schedule, paired over prompts, a bootstrap 95% interval of
the mean difference), every method against H2O the same way, the table of each cell, and two figures: the KV bytes
held over the generation (one line per method and schedule, full's rising) and the fidelity to the full cache per
method, budget and schedule.

    python -m analysis.long_generation studies/long_generation/records --out analysis/out/long_generation
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.labels import color, label
from analysis.records import checked_samples, load_runs

ORDER = ["full", "h2o", "tova", "streaming_llm", "local", "knorm", "keydiff", "snapkv", "r_kv"]
MIB = 2 ** 20
RESAMPLES = 10000


def schedule_of(row) -> str:
    """``every step`` (compress=decode), ``every N`` (compress=interval), ``-`` (full)."""
    if row.get("policy") == "full":
        return "-"
    options = row.get("policy_options") if isinstance(row.get("policy_options"), dict) else {}
    compress = row.get("compress") if isinstance(row.get("compress"), str) else options.get("compress", "decode")
    if compress == "interval":
        interval = row.get("interval")
        interval = options.get("interval") if interval is None or pd.isna(interval) else interval
        return f"every {int(interval)}"
    return "every step" if compress == "decode" else str(compress)


def runs(root: Path) -> pd.DataFrame:
    """The long-generation records under ``root``, with ``schedule`` and their ``samples`` (by doc_id)."""
    return frame(load_runs(root))


def frame(df: pd.DataFrame) -> pd.DataFrame:
    """The long-generation records of a frame of run records (:func:`analysis.records.load_runs`'), with
    ``schedule``, ``prompts`` and their ``samples`` (by doc_id); the others left out."""
    if df.empty or "task_kind" not in df:
        return df.iloc[0:0]
    df = df[df["task_kind"] == "long_generation"].copy()
    if df.empty:
        return df
    options = [json_options(p) for p in df["path"]]
    df["schedule"] = [schedule_of({**r, "policy_options": o}) for (_, r), o in zip(df.iterrows(), options)]
    samples = [checked_samples(p, SAMPLE_FIELDS, SAMPLE_FIELDS[1:]) for p in df["path"]]  # None: warned, skipped
    df = df[[s is not None for s in samples]].copy()
    if df.empty:
        return df
    df["samples"] = [{s["doc_id"]: s for s in found} for found in samples if found is not None]
    listed = df["protocol.prompts"] if "protocol.prompts" in df else df["n_samples"]
    df["prompts"] = [int(p) if pd.notna(p) else int(n) for p, n in zip(listed, df["n_samples"])]
    df["order"] = [ORDER.index(p) if p in ORDER else 99 for p in df["policy"]]
    return df.sort_values(["budget", "schedule", "order", "prompts"]).reset_index(drop=True)


SAMPLE_FIELDS = ("doc_id", "tf_nll_per_token", "gen_tokens", "distinct_4", "first_departure")  # what the page reads


def json_options(path: str) -> dict:
    import json

    rec = json.loads((Path(path) / "metrics.json").read_text())
    return rec.get("policy_options") or {}


def paired(a: dict, b: dict, key: str = "tf_nll_per_token", seed: int = 0) -> dict | None:
    """a - b over the prompts both have: mean difference, its bootstrap 95% interval (prompts resampled with
    replacement, :data:`RESAMPLES` times, seed ``seed``), the prompts, and how many favour each side."""
    ids = sorted(set(a) & set(b))
    if len(ids) < 2:
        return None
    d = np.array([a[i][key] - b[i][key] for i in ids], dtype=float)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(RESAMPLES, len(d)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"diff": float(d.mean()), "lo": float(lo), "hi": float(hi), "n": len(ids),
            "a_lower": int((d < 0).sum()), "b_lower": int((d > 0).sum())}


def verdict(p: dict) -> str:
    """``<`` (a lower at 95%), ``>`` (a higher), ``≈`` (the interval holds 0)."""
    return "<" if p["hi"] < 0 else ">" if p["lo"] > 0 else "≈"


def grid_prompts(df: pd.DataFrame) -> int:
    """The prompt count most records ran with (the grid's; a study may rerun some cells over more prompts)."""
    return int(df["prompts"].mode().max())


def cell_of(df: pd.DataFrame, policy: str, budget, schedule: str, prompts: int | None = None):
    """The record of ``policy`` at ``budget`` and ``schedule`` over ``prompts`` prompts (the grid's by default)."""
    prompts = grid_prompts(df) if prompts is None else prompts
    hit = df[(df["policy"] == policy) & (df["budget"] == budget) & (df["schedule"] == schedule)
             & (df["prompts"] == prompts)]
    return None if hit.empty else hit.iloc[0]


def pooled(cells: list) -> dict:
    """The samples of several records of one cell (different prompt sets), keyed by (prompts, doc_id)."""
    return {(int(r["prompts"]), i): s for r in cells for i, s in r["samples"].items()}


MEASURES = {"tf_nll_per_token": ("NLL per token of the full cache's answer teacher-forced through each cache", ".3f",
                                 ("lower: closer to the full cache", "higher: further from the full cache")),
            "gen_tokens": ("tokens generated", ".1f", ("shorter", "longer")),
            "distinct_4": ("distinct 4-gram share of the answer", ".3f", ("more repetitive", "less repetitive"))}


def compared(what: str, spec_: str, words: tuple, p: dict | None, A: str, B: str) -> str:
    """One line of a paired comparison: difference, interval, prompts, how many favour each, verdict."""
    if p is None:
        return f"- {what}: fewer than two prompts in common"
    low, high = words
    word = {"<": f"{A} {low} at 95%", ">": f"{A} {high} at 95%", "≈": "not resolved at 95%"}[verdict(p)]
    return (f"- {what}: {format(p['diff'], '+' + spec_)} [{format(p['lo'], '+' + spec_)}, "
            f"{format(p['hi'], '+' + spec_)}] over {p['n']} prompts ({A} lower on {p['a_lower']}, "
            f"{B} lower on {p['b_lower']}): {word}")


def headline(df: pd.DataFrame, spec: dict, word: str = "Headline") -> list[str]:
    """The study's named comparison (``spec``: a, b, budget, schedule, and prompts: the prompt set it is measured
    on, the grid's by default; ``why``: a sentence shown after it): a − b paired over prompts for the fidelity (the
    first of :data:`MEASURES`, the headline), the answer's length and its repetition, each with its bootstrap 95%
    interval and verdict; then the same on every other prompt set where both cells ran, and the fidelity over all of
    them pooled (secondary). ``word`` names it: the headline, or a confirmatory replication named after it."""
    prompts = spec.get("prompts") or grid_prompts(df)
    cell = lambda m, n: cell_of(df, spec[m], spec["budget"], spec["schedule"], n)  # noqa: E731
    a, b = cell("a", prompts), cell("b", prompts)
    A, B = label(spec["a"]), label(spec["b"])
    head = (f"**{word}**: {A} against {B} at {spec['budget']} tokens, {spec['schedule']}, over the {prompts} "
            f"prompts of task.prompts={prompts}, paired over prompts ({A} − {B}, bootstrap 95% interval of the mean "
            f"difference; the first line is the comparison named, the other two the answer it writes)")
    measured = a is not None and b is not None
    head += "" if measured else ": not yet measured (a record is missing)"
    head += f". {spec['why']}" if spec.get("why") else ""
    lines = [head, ""]
    lines += [compared(what, fmt_, words, paired(a["samples"], b["samples"], key), A, B)
              for key, (what, fmt_, words) in MEASURES.items()] if measured else []
    what, fmt_, words = MEASURES["tf_nll_per_token"]
    others = [n for n in sorted(set(df["prompts"]) - {prompts})
              if cell("a", n) is not None and cell("b", n) is not None]
    for n in others:
        lines += [compared(f"secondary, over the {n} prompts of task.prompts={n} (other passages), {what_}", fmt__,
                           words_, paired(cell("a", n)["samples"], cell("b", n)["samples"], key), A, B)
                  for key, (what_, fmt__, words_) in MEASURES.items()]
    if others and measured:
        sets = [prompts, *others]
        lines.append(compared(f"secondary, {what} pooled over every prompt set ({' + '.join(map(str, sets))} "
                              f"distinct passages)", fmt_, words,
                              paired(pooled([cell("a", n) for n in sets]), pooled([cell("b", n) for n in sets])),
                              A, B))
    return lines


def versus_h2o(df: pd.DataFrame) -> list[str]:
    """Every other compressed method against H2O in each cell where both ran."""
    lines = []
    df = df[df["prompts"] == grid_prompts(df)]
    for (budget, schedule), group in df[df["policy"] != "full"].groupby(["budget", "schedule"], sort=False):
        base = cell_of(df, "h2o", budget, schedule)
        if base is None:
            continue
        for _, row in group.iterrows():
            if row["policy"] == "h2o":
                continue
            p = paired(base["samples"], row["samples"])
            if p is not None:
                lines.append(f"- {budget:g} tokens, {schedule}: H2O {verdict(p)} {label(row['policy'])}: "
                             f"{p['diff']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] nats per token "
                             f"({row['tf_nll_per_token']:.3f} for {label(row['policy'])})")
    return lines


def num(v, spec: str) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(df: pd.DataFrame) -> str:
    """One row per record: fidelity, departure, length, repetition, KV held, time."""
    cols = ["method", "budget", "schedule", "prompts", "NLL/token of full's answer [95%]", "top-1 agreement",
            "first departure (median)", "tokens generated", "at length limit", "distinct 4-grams", "KV peak MiB",
            "CPU s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        samples = list(r["samples"].values())
        departure = np.median([s["first_departure"] for s in samples]) if samples else None
        ci = f"{num(r['tf_nll_per_token'], '.3f')} [{num(r.get('tf_nll_per_token_ci95_low'), '.3f')}, " \
             f"{num(r.get('tf_nll_per_token_ci95_high'), '.3f')}]"
        lines.append("| " + " | ".join([
            label(r["policy"]), "—" if r["policy"] == "full" else f"{r['budget']:g}", r["schedule"],
            str(r["prompts"]), ci,
            num(r.get("tf_top1"), ".3f"), num(departure, ".0f"), num(r.get("gen_tokens"), ".0f"),
            num(r.get("at_limit_share"), ".2f"), num(r.get("distinct_4"), ".3f"),
            num(r.get("kv_bytes_peak") / MIB if r.get("kv_bytes_peak") is not None else None, ".2f"),
            num(r.get("cpu_s"), ".0f")]) + " |")
    return "\n".join(lines)


def kv_figure(df: pd.DataFrame, out: Path, suffix: str = "") -> list[Path]:
    """KV MiB held per sequence against generated tokens (the mean over the answers still being written at each
    step): one panel per budget, a line per method and schedule (solid: every step; dashed: every N), full's in
    each panel."""
    from analysis.plotting import panels, save

    budgets = sorted(b for b in df.loc[df["policy"] != "full", "budget"].unique())
    if not budgets:
        return []
    full = df[df["policy"] == "full"]
    fig, axes = panels(len(budgets), ncols=len(budgets), size=(5.2, 3.6))
    for ax, budget in zip(axes, budgets):
        for _, r in pd.concat([full, df[(df["budget"] == budget) & (df["policy"] != "full")]]).iterrows():
            traces = [s["kv_trace"] for s in r["samples"].values() if s.get("kv_trace")]
            if not traces:
                continue
            n = max(len(t) for t in traces)  # at each step, the mean over the answers still being written
            every = int(r.get("trace_every") or 1)
            mean = np.nanmean([list(t) + [np.nan] * (n - len(t)) for t in traces], axis=0) / MIB
            ax.plot(np.arange(n) * every, mean, color=color(r["policy"]),
                    linestyle="--" if r["schedule"].startswith("every ") and r["schedule"] != "every step" else "-",
                    label=f"{label(r['policy'])}" + ("" if r["policy"] == "full" else f" ({r['schedule']})"),
                    linewidth=1.2)
        ax.set(title=f"budget {budget:g} tokens", xlabel="generated tokens", ylabel="KV held per sequence (MiB)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, ncol=2)
    return save(fig, out, "long_generation_kv" + suffix)


HATCHES = ("", "//", "..", "xx")  # one per budget and schedule in the fidelity figure (the colour is the method's)


def fidelity_figure(df: pd.DataFrame, out: Path, suffix: str = "") -> list[Path]:
    """NLL per token of full's answer per method (with its 95% interval), at each budget and schedule."""
    from analysis.plotting import panels, save

    cells = df[df["policy"] != "full"]
    if cells.empty:
        return []
    keys = [(b, s) for b, s in cells[["budget", "schedule"]].drop_duplicates().itertuples(index=False)]
    methods = [p for p in ORDER if p in set(cells["policy"])] + sorted(set(cells["policy"]) - set(ORDER))
    fig, axes = panels(1, ncols=1, size=(7.5, 3.6))
    ax = axes[0]
    width = 0.8 / max(len(keys), 1)
    for k, (budget, schedule) in enumerate(keys):
        ys, los, his = [], [], []
        for m in methods:
            r = cell_of(df, m, budget, schedule)
            v = r["tf_nll_per_token"] if r is not None else np.nan
            ys.append(v)
            los.append(v - (r.get("tf_nll_per_token_ci95_low", v) if r is not None else v))
            his.append((r.get("tf_nll_per_token_ci95_high", v) if r is not None else v) - v)
        ax.bar(np.arange(len(methods)) + (k - (len(keys) - 1) / 2) * width, ys, width, yerr=[los, his],
               label=f"{budget:g} tokens, {schedule}", capsize=2, color=[color(m) for m in methods],
               hatch=HATCHES[k % len(HATCHES)], edgecolor="white")  # the method's colour; the cell's hatch
    base = cell_of(df, "full", 1.0, "-")
    if base is not None:
        ax.axhline(base["tf_nll_per_token"], color=color("full"), linewidth=0.8, label="full")
    ax.set_xticks(np.arange(len(methods)), [label(m) for m in methods])
    ax.set(ylabel="NLL per token of full's answer")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = ([Line2D([], [], color=color("full"), linewidth=0.8, label="full")] if base is not None else []) + [
        Patch(facecolor="white", edgecolor="dimgray", hatch=HATCHES[k % len(HATCHES)],
              label=f"{budget:g} tokens, {schedule}") for k, (budget, schedule) in enumerate(keys)]
    ax.legend(handles=handles, fontsize=7)
    return save(fig, out, "long_generation_fidelity" + suffix)


CAPTIONS = {"long_generation_kv": "KV bytes held per sequence while the answer is written (the mean over the answers "
                                  "still being written): full's rises with every token; the methods at one budget "
                                  "and schedule hold the same bytes, so their lines coincide.",
            "long_generation_fidelity": "NLL per token of the full cache's answer teacher-forced through each cache, "
                                        "with its 95% interval over prompts; the line: full's own."}


def page_body(df: pd.DataFrame, figures: Path, rel: str, spec: dict) -> list[str]:
    """The page below its head: the main model's records (the most numerous) -- runs finished, the headline and
    the replication, the comparisons, the figures and the table -- then a section per other model with its named
    comparison (``spec["second_family"]`` where it names that model), comparisons, figures and table."""
    models = list(df["model"].value_counts(sort=True).index) if "model" in df else [None]
    main = df if models[0] is None else df[df["model"] == models[0]]
    grid = spec.get("runs")
    lines = [f"Runs finished: {len(main)}" + (f" of the committed grid's {grid}" if grid else "") +
             f" ({cpu_of(main):,.0f} CPU-s in all, one thread each)" + (f", {models[0]}" if len(models) > 1 else "")
             + ".", ""]
    named = [(spec[key], word) for key, word in (("headline", "Headline"), ("replication", "Confirmatory replication"),
                                                 ("baselines_2026", "The 2026 decode-time baselines"))
             if spec.get(key)]
    lines += section(main, figures, rel, named, "")
    for model in models[1:]:
        sub = df[df["model"] == model]
        family = spec.get("second_family") or {}
        lines += [f"## {model}", "", f"Runs finished: {len(sub)} ({cpu_of(sub):,.0f} CPU-s in all, one thread each).",
                  "",
                  *section(sub, figures, rel, [(family, "Second family")] if family.get("model") == model else [],
                           f"_{model}")]
    return lines


def cpu_of(df: pd.DataFrame) -> float:
    """The records' CPU seconds in all (NaN without the field)."""
    return pd.to_numeric(df["cpu_s"], errors="coerce").sum() if "cpu_s" in df else float("nan")


def section(df: pd.DataFrame, figures: Path, rel: str, named: list, suffix: str) -> list[str]:
    """One model's records: each named comparison (spec, word), H2O against each method, the figures (their names
    ending in ``suffix``) and the table."""
    lines = []
    for spec_, word in named:
        lines += [*headline(df, spec_, word), ""]
    found = versus_h2o(df)
    if found:
        lines += ["**H2O against each other method, cell by cell** (`<`: H2O's NLL lower at 95%, `>`: higher, `≈`: "
                  "unresolved; H2O − other, paired over prompts, bootstrap 95% interval)", "", *found, ""]
    on_grid = df[df["prompts"] == grid_prompts(df)]  # the figures: the grid's prompts (one record per cell)
    for p in kv_figure(on_grid, figures, suffix) + fidelity_figure(on_grid, figures, suffix):
        if p.suffix == ".png":
            lines += [f"![{p.stem}]({rel}/{p.name})", "", CAPTIONS.get(p.stem.removesuffix(suffix), ""), ""]
        else:
            p.unlink()
    return lines + [table(df), ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m analysis.long_generation", description=__doc__.split("\n")[0])
    p.add_argument("records", help="a folder of long_generation run records")
    p.add_argument("--out", default="analysis/out/long_generation", help="where the figures go")
    args = p.parse_args(argv)
    if not Path(args.records).is_dir():
        print(f"error: records={args.records!r}: no such folder; allowed: a folder of run records", file=sys.stderr)
        return 2
    df = runs(Path(args.records))
    if df.empty:
        print(f"error: records={args.records!r}: no long_generation record there", file=sys.stderr)
        return 2
    print("\n".join(page_body(df, Path(args.out), str(Path(args.out)), {})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
