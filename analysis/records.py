"""Load the run records under ``runs/`` into one tidy DataFrame.

The contract (written by the runner, read here):

* A finished run is a folder at any depth under the root that holds ``metrics.json``.
  ``metrics.json`` is written last and atomically, so a folder without it is unfinished
  and ignored.
* ``metrics.json`` is one JSON object::

      {"experiment": "table1", "model": "opt-6.7b", "task": "copa",
       "task_kind": "multiple_choice" | "summarization" | "perplexity"
                    | "streaming" | "benchmark" | "observations",
       "policy": "h2o", "budget": 0.2, "heavy": 0.1, "recent": 0.1, "shots": 5,
       "semantics": "simulated" | "real" | "reference", "seed": 0,
       "n_samples": 100, "metrics": {"acc": 0.81, ...}, "wall_s": 12.3}

  ``metrics`` is flattened into columns (``acc``, ``rouge2``, ``ppl``, ...); a nested dict
  becomes dotted columns (``{"a": {"b": 1}}`` -> ``a.b``); a metric whose name clashes
  with a top-level field becomes ``metric_<name>``, except where that field is one of the
  policy's options (also in ``policy_options``, which the protocol reads): the metric keeps
  its name and the option's top-level copy becomes ``option_<name>`` (LongBench's ``score``
  beside H2O's ``score: sum``), so one metric is one column whatever the policy. Unknown
  top-level fields are kept.
* Beside it, optionally: ``samples.jsonl`` (one JSON object per sample),
  ``observations.json`` (observations runs, see ``analysis.figures``), ``config.yaml``,
  ``env.json``. Those are read on demand by :func:`load_samples` / :func:`load_json`.
"""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

# Columns every frame has (NaN where a record lacks them), so table code never KeyErrors.
BASE_COLUMNS = ["experiment", "model", "task", "task_kind", "policy", "budget", "heavy",
                "recent", "shots", "semantics", "seed", "n_samples", "wall_s", "path"]


def _flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": 2} -> {"a.b": 1, "c": 2}; lists stay as values."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def record_row(metrics_file: Path) -> dict:
    """One flat dict from one ``metrics.json`` (plus ``path``: the run folder). ValueError naming what is
    wrong when the file is not a record (not an object, ``metrics`` not an object)."""
    rec = json.loads(Path(metrics_file).read_text())
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    metrics = rec.pop("metrics", None)
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, dict):
        raise ValueError(f'"metrics" must be an object, got {type(metrics).__name__}')
    budget = rec.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not math.isfinite(budget)):
        raise ValueError(f'"budget" must be a number or null, got {budget!r}')
    noted = rec.pop("nonfinite", None)  # h2o.store.strict_json: an inf or nan written as null, named here
    noted = [k[len("metrics."):] for k in noted if k.startswith("metrics.")] if isinstance(noted, dict) else []
    row = _flatten(rec)
    options = rec.get("policy_options") if isinstance(rec.get("policy_options"), dict) else {}
    for key, value in _flatten(metrics).items():
        if key in row and key in options:  # the policy's option echoed at the top level: the metric's column
            row[f"option_{key}"] = row.pop(key)
        row[f"metric_{key}" if key in row else key] = value
    row["path"] = str(Path(metrics_file).parent)
    row["nonfinite_metrics"] = ",".join([*(k for k, v in _flatten(metrics).items()
                                          if isinstance(v, float) and not math.isfinite(v)),
                                        *(k for k in noted if k in _flatten(metrics))]) or None
    return row


def warn(message: str) -> None:
    """One warning line on stderr (``warnings.warn`` prints two)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def read_records(root: Path) -> Iterator[tuple[Path, object]]:
    """(its metrics.json, its JSON) of every run record under ``root`` (any depth, in path order); one that cannot
    be read or parsed (torn) is skipped with one warning line naming it, the others still read."""
    for f in sorted(root.rglob("metrics.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError) as err:
            warn(f"skipping malformed run record {f}: {' '.join(str(err).split())}")
            continue
        yield f, rec


def load_runs(root: str | Path = "runs") -> pd.DataFrame:
    """One row per finished run under ``root`` (any depth); empty frame if there is none.

    A malformed record (its metrics.json, or its samples.jsonl: half-written or unreadable, :func:`torn_samples`)
    is skipped with one warning line naming the file, never counted; a record with a NaN or infinite metric is
    kept, its metric set to NaN (so no mean includes it) and named in ``nonfinite_metrics``, with one warning."""
    rows = []
    for f in sorted(Path(root).rglob("metrics.json")) if Path(root).is_dir() else []:
        try:
            row = record_row(f)
        except (OSError, ValueError) as err:  # a corrupt record should not hide the others
            warn(f"skipping malformed run record {f}: {' '.join(str(err).split())}")
            continue
        why = torn_samples(f.parent)
        if why:  # its intervals, pairings and heatmaps read the samples: the record is not counted either
            warn(f"skipping malformed run record {f.parent / 'samples.jsonl'}: {why}")
            continue
        if row["nonfinite_metrics"]:
            warn(f"non-finite metric(s) {row['nonfinite_metrics']} in {f}: shown as NaN, left out of every mean")
            for key in row["nonfinite_metrics"].split(","):
                name = f"metric_{key}" if f"metric_{key}" in row else key
                row[name] = np.nan
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in BASE_COLUMNS:
        if col not in df.columns:
            df[col] = np.nan
    return df[BASE_COLUMNS + [c for c in df.columns if c not in BASE_COLUMNS]]


def finite(value) -> bool:
    """A number (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def checked_samples(run_path: str | Path, fields: tuple[str, ...], numbers: tuple[str, ...] = ()) -> list[dict] | None:
    """The run's samples when each is an object holding ``fields``, those of ``numbers`` finite numbers; else None,
    with one warning line naming the run, the sample and the field (an analysis skips the run, never crashes)."""
    try:
        samples = load_samples(run_path)
    except (OSError, ValueError) as err:  # a torn samples.jsonl
        warn(f"skipping run record {run_path}: samples.jsonl unreadable ({' '.join(str(err).split())})")
        return None
    for i, s in enumerate(samples):
        bad = next((f for f in fields if not isinstance(s, dict) or f not in s), None)
        bad = bad or next((f for f in numbers if not finite(s.get(f))), None)
        if bad:
            what = "lacks" if not isinstance(s, dict) or bad not in s else f"has a non-number {s[bad]!r} in"
            warn(f"skipping run record {run_path}: sample {i} {what} {bad!r} (needed: {', '.join(fields)})")
            return None
    return samples


def torn_samples(run_path: str | Path) -> str | None:
    """Why the run's ``samples.jsonl`` cannot be read (a line that is not a JSON object: a file cut mid-write or
    mid-copy), or None (readable, or absent)."""
    f = Path(run_path) / "samples.jsonl"
    if not f.exists():
        return None
    try:
        lines = f.read_text().splitlines()
    except (OSError, ValueError) as err:  # unreadable, or not UTF-8
        return " ".join(str(err).split())
    for i, line in enumerate(lines, 1):
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError as err:
            return f"line {i}: {' '.join(str(err).split())}"
        if not isinstance(row, dict):
            return f"line {i} is not a JSON object"
    return None


def load_samples(run_path: str | Path) -> list[dict]:
    """The run's ``samples.jsonl`` as a list of dicts ([] if the file is absent)."""
    f = Path(run_path) / "samples.jsonl"
    return read_jsonl(f) if f.exists() else []


def read_jsonl(f: str | Path) -> list[dict]:
    """A JSON-lines file as a list of dicts (blank lines skipped)."""
    return [json.loads(line) for line in Path(f).read_text().splitlines() if line.strip()]


def load_json(run_path: str | Path, name: str) -> dict | None:
    """A JSON file beside the record (e.g. ``observations.json``), or None if absent."""
    f = Path(run_path) / name
    return json.loads(f.read_text()) if f.exists() else None
