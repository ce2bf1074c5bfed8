"""Compress once, ask many (``task.questions`` / ``task.turns`` records of the needle task): accuracy per method and
budget with its 95% Wilson interval, each method against kvzip paired by question, the figure, accuracy by turn, and
each question inside its own compressed prompt (``task.question=each``) against compressing once.

    python -m analysis.many_questions studies/many_questions/records --out analysis/out

prints the tables and comparisons (markdown) and writes ``many_questions.png`` (accuracy against the budget) and,
with ``task.turns`` records, ``many_questions_turns.png`` (accuracy against the turn) into ``--out``; every number comes from the records' metrics.json and samples.jsonl. docs/results/many_questions.md is the
same body, made by ``make docs-results`` from studies/many_questions/ (a study of kind ``questions``).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from analysis.estimate import Z95, mcnemar_exact, wilson
from analysis.labels import color, label, marker
from analysis.records import checked_samples, finite, read_records, warn

BASE = "kvzip"  # the method every other is compared with


def load(root: Path) -> list[dict]:
    """Every record under ``root`` with ``task.questions`` or ``task.turns`` above 1: its metrics.json fields, its
    samples (one per question) and its ``mode``: questions (compressed once), each (``task.question=each``: each
    question inside its own compressed prompt) or turns."""
    out = []
    for f, rec in read_records(root):  # a torn record: skipped (warned), the others rendered
        proto = rec.get("protocol") if isinstance(rec, dict) else None
        proto = proto if isinstance(proto, dict) else {}
        if proto.get("questions", 1) == 1 and proto.get("turns", 1) == 1:
            continue
        mode = "turns" if proto.get("turns", 1) > 1 else "each" if rec.get("question") == "each" else "questions"
        why = unusable(rec, mode)
        if why:
            warn(f"skipping run record {f}: {why}")
            continue
        samples = checked_samples(f.parent, ("doc_id", "question", "acc"), ("acc",))
        if samples is not None:
            out.append({**rec, "samples": samples, "mode": mode})
    return out


def unusable(rec: dict, mode: str) -> str | None:
    """Why a record cannot be shown (what the tables and figure read: policy, a finite budget and accuracy, each
    turn's accuracy), or None."""
    metrics = rec.get("metrics") if isinstance(rec.get("metrics"), dict) else {}
    if not isinstance(rec.get("policy"), str):
        return f"policy={rec.get('policy')!r}: expected a method's name"
    for name, value in (("budget", rec.get("budget")), ("metrics.acc", metrics.get("acc"))):
        if not finite(value):
            return f"{name}={value!r}: expected a finite number (nonfinite: {rec.get('nonfinite') or 'none noted'})"
    turns = rec.get("turn_acc")
    if mode == "turns" and not (isinstance(turns, list) and turns and all(finite(a) for a in turns)):
        return f"turn_acc={turns!r}: expected a list of finite accuracies"
    return None


def key(s: dict) -> tuple:
    return s["doc_id"], s["question"]


def paired(a: dict, b: dict) -> tuple[float, float, float, int] | None:
    """a - b accuracy over the questions both answered (by context and question): (mean, lo, hi, n), 95%."""
    sb = {key(s): s["acc"] for s in b["samples"]}
    d = [s["acc"] - sb[key(s)] for s in a["samples"] if key(s) in sb]
    if len(d) < 2:
        return None
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))
    return m, m - Z95 * se, m + Z95 * se, len(d)


def discordant(a: dict, b: dict) -> tuple[int, int]:
    """Questions answered right by a alone and by b alone (paired by context and question)."""
    sb = {key(s): s["acc"] for s in b["samples"]}
    pairs = [(s["acc"], sb[key(s)]) for s in a["samples"] if key(s) in sb]
    return sum(x > y for x, y in pairs), sum(y > x for x, y in pairs)


def by_cell(recs: list[dict], mode: str) -> dict[tuple, dict]:
    """The records of ``mode`` by (policy, budget)."""
    return {(r["policy"], r["budget"]): r for r in recs if r["mode"] == mode}


def sign(lo: float, hi: float) -> str:
    """``>`` (the interval above 0), ``<`` (below), ``≈`` (it holds 0)."""
    return ">" if lo > 0 else "<" if hi < 0 else "≈"


def accuracy(rec: dict) -> str:
    """The record's accuracy with its 95% Wilson interval."""
    acc = rec["metrics"]["acc"]
    lo, hi = wilson(acc, len(rec["samples"]))
    return f"{acc:.2f} [{lo:.2f}, {hi:.2f}]"


def cell(rec: dict) -> str:
    return f"{accuracy(rec)} · {rec.get('kv_bytes_cut', 0) / 2**20:.1f} MiB"


def tables(recs: list[dict], mode: str) -> list[str]:
    """The accuracy table (methods x budgets) and the paired comparisons against :data:`BASE`."""
    runs = by_cell(recs, mode)
    budgets = sorted({b for p, b in runs if p != "full"})
    methods = [BASE] + sorted({p for p, _ in runs if p not in (BASE, "full")})
    n = max(len(r["samples"]) for r in runs.values())
    lines = [f"Accuracy [95% Wilson] of the {n} questions · KV held by the compressed context (MiB, mean per "
             f"context, stated once per context); `task.{mode}={runs[next(iter(runs))]['protocol'][mode]}`", "",
             "| method | " + " | ".join(f"{b:.0%}" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    full = runs.get(("full", 1.0))
    if full:
        lines.append(f"| full | {cell(full)} |" + " |" * (len(budgets) - 1))
    for m in methods:
        lines.append(f"| {label(m)} | " + " | ".join(cell(runs[(m, b)]) if (m, b) in runs else "—" for b in budgets)
                     + " |")
    base = label(BASE)
    lines += ["", f"{base} against each method at the same budget, paired by question (`>` {base} better, `<` worse at "
                  "95%, `≈` unresolved; difference in accuracy with its 95% interval):", ""]
    for b in budgets:
        for m in methods[1:]:
            if (BASE, b) in runs and (m, b) in runs:
                got = paired(runs[(BASE, b)], runs[(m, b)])
                if got:
                    mean, lo, hi, k = got
                    lines.append(f"* {b:.0%}: {base} {sign(lo, hi)} {label(m)}: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}] "
                                 f"({k} questions)")
    if mode == "turns":
        turns = max(len(r["turn_acc"]) for r in runs.values())
        lines += ["", "Accuracy by turn (the questions asked in turn on one cache):", "",
                  "| method | budget | " + " | ".join(f"turn {k}" for k in range(turns)) + " |",
                  "|---" * (turns + 2) + "|"]
        for (p, b), r in sorted(runs.items()):
            lines.append(f"| {label(p)} | {b:.0%} | " + " | ".join(f"{a:.2f}" for a in r["turn_acc"]) + " |")
    return lines + [""]


def figure(recs: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    runs = [r for r in recs if r["mode"] == "questions"]
    for m in sorted({r["policy"] for r in runs if r["policy"] != "full"}):
        pts = sorted((r["budget"], r["metrics"]["acc"], len(r["samples"])) for r in runs if r["policy"] == m)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        err = [[y - wilson(y, n)[0] for _, y, n in pts], [wilson(y, n)[1] - y for _, y, n in pts]]
        ax.errorbar(xs, ys, yerr=err, marker=marker(m), color=color(m), capsize=3, label=label(m),
                    lw=2.5 if m == BASE else 1)
    full = [r for r in runs if r["policy"] == "full"]
    if full:
        ax.axhline(full[0]["metrics"]["acc"], ls=":", color=color("full"), label="full")
    ax.set_xlabel("budget (share of the context kept)")
    ax.set_ylabel("accuracy (exact match)")
    ax.set_xscale("log")
    budgets = sorted({r["budget"] for r in runs if r["policy"] != "full"})
    ax.set_xticks(budgets, [f"{b:.0%}" for b in budgets])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title("3 needles per context, compressed once, 3 questions")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "many_questions.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def turn_figure(recs: list[dict], out: Path) -> Path:
    """Accuracy against the turn (``task.turns`` records), one line per method and budget, 95% Wilson bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in sorted((r for r in recs if r["mode"] == "turns"), key=lambda r: (r["policy"] != "full", r["policy"])):
        accs = r["turn_acc"]
        n = len(r["samples"]) // len(accs)  # contexts: one question of each per turn
        err = [[max(a - wilson(a, n)[0], 0) for a in accs], [max(wilson(a, n)[1] - a, 0) for a in accs]]
        name = "full" if r["policy"] == "full" else f"{label(r['policy'])} {r['budget']:.0%}"
        ax.errorbar(range(len(accs)), accs, yerr=err, marker=marker(r["policy"]), color=color(r["policy"]), capsize=3,
                    label=name,
                    ls=":" if r["policy"] == "full" else "-")
    turns = max(len(r["turn_acc"]) for r in recs if r["mode"] == "turns")
    ax.set_xticks(range(turns), [str(k) for k in range(turns)])
    ax.set_xlabel("turn (questions and answers before it kept in the cache)")
    ax.set_ylabel("accuracy (exact match)")
    ax.set_title("questions in turn on one cache")
    ax.set_ylim(-0.05, 1.15)
    ax.legend(fontsize=8, loc="upper left", ncol=4)
    fig.tight_layout()
    path = out / "many_questions_turns.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versus(a: dict, b: dict, a_name: str, b_name: str) -> str:
    """``a_name`` − ``b_name`` paired by question: the difference with its 95% interval, the verdict, the discordant
    questions and the exact McNemar p (a phrase that follows a colon)."""
    got = paired(a, b)
    if got is None:
        return "fewer than 2 questions in common"
    mean, lo, hi, k = got
    verdict = f"{a_name} better at 95%" if lo > 0 else f"{a_name} worse at 95%" if hi < 0 else "not resolved at 95%"
    a_only, b_only = discordant(a, b)
    return (f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] over {k} questions, {verdict} (right with {a_name} alone on "
            f"{a_only}, with {b_name} alone on {b_only}: exact McNemar p = {mcnemar_exact(a_only, b_only):.2g})")


def headline(recs: list[dict], spec: dict) -> list[str]:
    """The study's named comparison under ``task.questions`` (``spec``: a, b, budget, and ``why``, a sentence shown
    after it): a − b accuracy paired by question, its 95% interval and verdict."""
    runs = by_cell(recs, "questions")
    a, b, budget = spec["a"], spec["b"], float(spec["budget"])
    A, B = label(a), label(b)
    head = f"**Headline**: {A} against {B} at {budget:.0%}, each context asked its questions (`task.questions`), " \
           f"paired by question ({A} − {B}, difference in accuracy with its 95% interval)"
    if (a, budget) in runs and (b, budget) in runs:
        head += ": " + versus(runs[(a, budget)], runs[(b, budget)], A, B)
    else:
        head += ": not yet measured (a record is missing)"
    return [head + (f". {spec['why']}" if spec.get("why") else ""), ""]


def placement(recs: list[dict], spec: dict | None) -> list[str]:
    """Each question inside its own compressed prompt (``task.question=each``) against the same questions answered
    from the context compressed once: the comparison ``spec`` names (method, budget, ``why``; None: none), then a
    row per method that has both records (accuracy, each − once paired by question, the CPU time of each run)."""
    once, each = by_cell(recs, "questions"), by_cell(recs, "each")
    lines = []
    if spec:
        m, budget = spec["method"], float(spec["budget"])
        head = (f"**Placement**: {label(m)} at {budget:.0%} with each question inside its own compressed prompt "
                f"(`task.question=each`: the context compressed once per question) against the same questions "
                f"answered from the context compressed once (`task.questions`), paired by question (each − once)")
        if (m, budget) in each and (m, budget) in once:
            head += ": " + versus(each[(m, budget)], once[(m, budget)], "each", "once")
        else:
            head += ": not yet measured (a record is missing)"
        lines = [head + (f". {spec['why']}" if spec.get("why") else ""), ""]
    both = sorted(k for k in each if k in once)
    if not both:
        return lines
    lines += ["Where the question goes, each method at its budget: accuracy [95% Wilson] compressed once and with "
              "each question inside its prompt, each − once paired by question (difference with its 95% interval; "
              "`>` each better, `<` worse at 95%, `≈` unresolved), and the CPU time of the runs (one thread):", "",
              "| method | budget | once | each | each − once | CPU-s once / each |", "|---" * 6 + "|"]
    for p, b in both:
        mean, lo, hi, _ = paired(each[(p, b)], once[(p, b)])
        lines.append(f"| {label(p)} | {b:.0%} | {accuracy(once[(p, b)])} | {accuracy(each[(p, b)])} | {sign(lo, hi)} "
                     f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}] | "
                     f"{once[(p, b)]['cpu_s']:.0f} / {each[(p, b)]['cpu_s']:.0f} |")
    return lines + [""]


def page_lines(recs: list[dict], figures: Path, rel: str, named: dict | None = None,
               placement_spec: dict | None = None) -> list[str]:
    """The page's body: the headline ``named`` (study.yaml's), the comparison ``placement_spec`` (its
    ``placement``), the tables of each mode its records have, then the figures (written into ``figures``, linked as
    ``rel/<name>``)."""
    lines = headline(recs, named) if named else []
    if placement_spec or any(r["mode"] == "each" for r in recs):
        lines += placement(recs, placement_spec)
    for mode in ("questions", "turns"):
        if any(r["mode"] == mode for r in recs):
            lines += tables(recs, mode)
    if any(r["mode"] == "questions" for r in recs):
        figures.mkdir(parents=True, exist_ok=True)
        lines += [f"![accuracy against the budget]({rel}/{figure(recs, figures).name})", ""]
    if any(r["mode"] == "turns" for r in recs):
        figures.mkdir(parents=True, exist_ok=True)
        lines += [f"![accuracy against the turn]({rel}/{turn_figure(recs, figures).name})", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m analysis.many_questions", description=__doc__.splitlines()[0])
    ap.add_argument("records", help="a folder of run records")
    ap.add_argument("--out", default="analysis/out")
    a = ap.parse_args(argv)
    recs = load(Path(a.records))
    if not recs:
        print(f"error: {a.records}: no record with task.questions or task.turns above 1", file=sys.stderr)
        return 2
    print("\n".join(page_lines(recs, Path(a.out), a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
