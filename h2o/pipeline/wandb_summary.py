"""One summary run per experiment: the sweep as a researcher reads it, in the experiment's wandb group.

    python -m h2o.pipeline.wandb_sync runs/ --experiment table1 --summary      (make wandb EXP=table1)

Its identity follows from the experiment alone (id ``<experiment>-summary-<sha1>``, name ``<experiment>/summary``,
job_type ``summary``), so a rerun updates the same run. It logs:

* ``fig4/<model> <task> ...``: the paper's Fig. 4 as native wandb line plots (``wandb.plot.line``): the metric
  against the budget, one line per policy, the full cache as a flat line over the same budgets. One plot per
  protocol (:func:`curves`: records of two protocols never share a plot); metrics: acc (multiple choice), rouge2
  (summarization), ppl (perplexity).
* ``streaming/<model> <text>``: perplexity against tokens streamed, one line per policy and budget.
* ``tables/<name>``: every table ``python -m analysis tables`` renders for this experiment, as a wandb.Table
  (cells ``0.667 ±0.211`` become a number column and a ``±`` column; ``—`` is missing).
* ``figures/<name>``: every figure ``python -m analysis figures`` draws for it, as an image.
* ``report``: the paper-vs-ours report of these records (``python -m analysis report``, or a given REPORT.md)
  when there is one, as HTML, and its tables as ``report/<n>`` wandb.Tables.
"""
from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from h2o.store.folders import fmt
from h2o.pipeline.wandb_mirror import Settings, is_number, run_id, start, table

CURVE_METRIC = {"multiple_choice": "acc", "summarization": "rouge2", "perplexity": "ppl", "retrieval": "acc",
                "reasoning": "pass_at_1", "shared_context": "acc"}
PROTOCOL = ("model", "task", "shots", "semantics", "scoring", "limit", "seed")
MISSING = {"", "—", "-", "–", "nan", "None"}
NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


# ------------------------------------------------------------------------------------------------ Fig. 4
def load_records(folder: Path) -> list[tuple[Path, dict]]:
    out = []
    for f in sorted(Path(folder).rglob("metrics.json")):
        try:
            out.append((f.parent, json.loads(f.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            print(f"[h2o] wandb summary: skipping unreadable record {f}", file=sys.stderr)
    return out


def curves(records: list[tuple[str, dict]]) -> dict[tuple, list[dict]]:
    """{protocol: [{"policy", "budget", metric}, ...]} from (name under runs/, record) pairs: Fig. 4's points, one
    plot per protocol = model, task, shots, semantics, scoring, limit, seed and the record folder's settings part
    (``limit=40,sinks=8``: every setting that differs from its default), so a point is one record and two
    protocols never share a plot; the full cache of the same protocol repeated at every budget (a flat line)."""
    points, full = defaultdict(dict), {}
    for name, r in records:
        metric = CURVE_METRIC.get(r.get("task_kind"))
        value = (r.get("metrics") or {}).get(metric)
        if metric is None or not is_number(value):
            continue
        key = (metric, *(r.get(k) for k in PROTOCOL), "/".join(Path(name).parts[6:]))
        if r.get("policy") == "full":
            full[key] = value
        elif isinstance(r.get("budget"), float):
            points[key][(r["policy"], r["budget"])] = value
    out = {}
    for key, pts in points.items():
        rows = [{"policy": p, "budget": b, key[0]: v} for (p, b), v in sorted(pts.items())]
        if key in full:
            rows += [{"policy": "full", "budget": b, key[0]: full[key]} for b in sorted({b for _, b in pts})]
        out[key] = rows
    return out


def curve_title(key: tuple) -> str:
    metric, model, task, shots, semantics, scoring, limit, seed, settings = key
    parts = [f"{model} {task}", f"{shots}-shot" if shots is not None else None, semantics,
             f"scoring={scoring}" if scoring else None, settings or None]
    return " ".join(p for p in parts if p) + f": {metric}"


def streaming_rows(found: list[tuple[Path, dict]], max_points: int = 500) -> dict[tuple, list[dict]]:
    from h2o.store.files import read_jsonl

    out = defaultdict(list)
    for folder, r in found:
        if r.get("task_kind") != "streaming":
            continue
        samples = [s for s in read_jsonl(folder / "samples.jsonl") if is_number(s.get("tokens"))]
        line = f"{r.get('policy')} {r.get('budget')}"
        for s in samples[::max(1, len(samples) // max_points)]:
            out[(r.get("model"), r.get("task"))].append({"line": line, "tokens": s["tokens"], "ppl": s.get("ppl")})
    return out


# --------------------------------------------------------------------------------------- analysis output
def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows) of every pipe table in a Markdown text."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.strip().startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) >= 2 and all(set(c) <= set("-: ") for c in block[1]):
                found.append((block[0], block[2:]))
            block = []
    return found


VALUE = re.compile(rf"({NUM})\s*(?:±\s*({NUM}))?\s*(?:\[({NUM}),\s*({NUM})\])?\s*(?:x|×|%)?"
                   r"(?:\s*\(no interval\))?\s*[†‡*⁰¹²³⁴⁵⁶⁷⁸⁹ᵃᵇᶜᵈᵉ]*")
PARTS = ("{} paper", "{}", "{} ±", "{} lo", "{} hi", "{} diff")  # the order of a numeric column's sub-columns


def parse_value(text: str) -> dict | None:
    """``0.5``, ``0.5 ±0.1``, ``0.8 [0.3, 0.9]``, ``1.9x``, ``45%`` (marks after it ignored) -> numbers;
    missing / ``not run`` -> None; anything else -> None (not a number)."""
    text = text.strip().replace("−", "-")
    if text in MISSING or text == "not run":
        return {"{}": None}
    m = VALUE.fullmatch(text)
    if not m:
        return None
    v, err, lo, hi = (float(g) if g else None for g in m.groups())
    return {"{}": v, "{} ±": err, "{} lo": lo, "{} hi": hi}


def parse_cell(cell: str) -> dict | None:
    """A cell as numbers, also analysis' ``paper · ours [lo, hi] · ours − paper``; None if it is text."""
    parts = cell.split(" · ")
    if len(parts) == 1:
        return parse_value(cell)
    found = [parse_value(x) for x in parts] + [{"{}": None}] * (3 - len(parts))
    if len(parts) > 3 or None in found:
        return None
    return {"{} paper": found[0]["{}"], **found[1], "{} diff": found[2]["{}"]}


def typed_table_rows(header: list[str], rows: list[list[str]]) -> list[dict]:
    """Rows as dicts; a column whose every cell is a number (:func:`parse_cell`) or missing becomes numbers, split
    into sub-columns where cells carry more (``<col> ±``, ``<col> lo`` / ``hi``, ``<col> paper``, ``<col> diff``);
    any other column stays text."""
    cells = [[r[j] if j < len(r) else "" for j in range(len(header))] for r in rows]
    out = [{} for _ in rows]
    for j, name in enumerate(header):
        parsed = [parse_cell(r[j]) for r in cells]
        numeric = None not in parsed and any(v is not None for p in parsed for v in p.values())
        if not numeric:
            for d, r in zip(out, cells):
                d[name] = None if r[j] in MISSING else r[j]
            continue
        used = [k for k in PARTS if k == "{}" or any(p.get(k) is not None for p in parsed)]
        for d, p in zip(out, parsed):
            d.update({k.format(name): p.get(k) for k in used})
    return out


def analysis_outputs(runs: Path, out: Path) -> None:
    """``python -m analysis tables``, ``figures`` and ``report`` for these records, into ``out`` (its command
    line, in process: its printout is dropped; a failure is one line; an analysis without ``report`` is skipped)."""
    import contextlib
    import io

    from analysis.__main__ import main as analysis

    for what in ("tables", "figures", "report"):
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                analysis([what, "--runs", str(runs), "--out", str(out)])
        except SystemExit as exc:  # argparse: this analysis has no such command
            if what != "report":
                print(f"[h2o] wandb summary: analysis {what} exited {exc.code}: {err.getvalue().strip()[-200:]}",
                      file=sys.stderr)
        except Exception as exc:  # noqa: BLE001 - a missing table must not lose the rest of the summary
            print(f"[h2o] wandb summary: analysis {what} failed ({type(exc).__name__}: {exc})", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ the run
def summary_identity(experiment: str) -> dict:
    return {"id": run_id(experiment, f"{fmt(experiment)}/summary"), "name": f"{fmt(experiment)}/summary",
            "group": experiment, "job_type": "summary", "tags": ["summary"]}


def summarize(root: Path, experiment: str, s: Settings, report: Path | None = None) -> bool:
    """Log the summary run of ``<root>/<experiment>``. Returns True on success; never raises."""
    run = None
    try:
        import wandb

        folder = Path(root) / fmt(experiment)
        found = load_records(folder)
        log = {}
        for key, rows in curves([(str(f.relative_to(root)), r) for f, r in found]).items():
            log[f"fig4/{curve_title(key)}"] = wandb.plot.line(table(rows), "budget", key[0], stroke="policy",
                                                              title=curve_title(key))
        for (model, text), rows in streaming_rows(found).items():
            log[f"streaming/{model} {text}"] = wandb.plot.line(table(rows), "tokens", "ppl", stroke="line",
                                                               title=f"{model} {text}: perplexity vs tokens")
        with tempfile.TemporaryDirectory() as tmp:
            analysis_outputs(folder, Path(tmp))
            for md in sorted(Path(tmp, "tables").glob("*.md")):
                for i, (header, rows) in enumerate(markdown_tables(md.read_text(encoding="utf-8"))):
                    log[f"tables/{md.stem}" + (f"_{i}" if i else "")] = table(typed_table_rows(header, rows))
            for png in sorted(Path(tmp, "figures").glob("*.png")):
                log[f"figures/{png.stem}"] = wandb.Image(str(png))
            report = Path(report) if report else Path(tmp, "REPORT.md")
            if report.exists():
                text = report.read_text(encoding="utf-8")
                log["report"] = wandb.Html(report_html(text))
                for i, (header, rows) in enumerate(markdown_tables(text)):
                    log[f"report/{i}"] = table(typed_table_rows(header, rows))
            config = {"experiment": experiment, "records": len(found), "record": f"{fmt(experiment)}/summary"}
            run = start(s, root, summary_identity(experiment), config)
            run.log(log)
            run.finish()
        return True
    except Exception as exc:  # noqa: BLE001 - a summary is a view; it must not fail a sweep
        print(f"[h2o] wandb summary failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        if run is not None:
            run.finish(exit_code=1)
        return False


def report_html(markdown: str) -> str:
    try:
        from markdown_it import MarkdownIt

        return MarkdownIt("commonmark").enable("table").render(markdown)
    except ImportError:
        import html

        return f"<pre>{html.escape(markdown)}</pre>"


def after_sweep(specs) -> None:
    """The runner's hook at the end of a multirun: one summary run per experiment whose jobs use logger=wandb."""
    from h2o.store.folders import runs_root

    done = set()
    for spec in specs:
        logger = spec.cfg.get("logger") or {}
        key = (str(runs_root(spec.cfg)), spec.cfg.experiment_name)
        if logger.get("wandb") and key not in done:
            done.add(key)
            summarize(Path(key[0]), key[1], Settings.of(logger))
