"""Mirror run records to Weights & Biases: one wandb run per record folder, forever. runs/ stays the source of truth.

Identity (:func:`identity`), all derived from the record's folder, so a rerun, a resumed sweep, a requeued job or
``python -m h2o.pipeline.wandb_sync`` lands in the same wandb run (``resume="allow"``), never a second one:

* id: ``<experiment>-<sha1 of the name>[:16]``; name: the folder's path under the runs root
  (``table1/smollm2-135m/bb_copa/shots5/h2o/0.2``); group: the experiment; job_type: the task;
  tags: ``model:``, ``policy:``, ``budget:``, ``semantics:``, ``scoring:`` (and ``score:`` for a score variant).
* config: the record's settings (experiment, model, task, policy, budget, ...), the resolved Hydra config under
  ``hydra_config`` (config.yaml), ``sweep`` (the Hydra sweep that made it, when known) and ``record`` (the name).

Logged: every number of metrics.json as a number (nested dicts flattened with ``.``, as analysis/ names columns:
``vs_full.decode_tok_s``); samples.jsonl as a ``wandb.Table`` whose numeric columns are numeric (nested dicts
flattened, lists as JSON text, at most ``wandb.Table.MAX_ROWS`` rows); for streaming records each sample is also a
history step against ``stream/tokens`` (native line plots of perplexity and cache size against tokens).

Offline by default (``WANDB_MODE`` unset -> offline; data under ``<runs root>/.wandb`` for ``wandb sync``). Every
record mirrored is noted in ``<dir>/h2o-mirrored.jsonl`` (id, destination, digest of metrics.json), so a second
sync of unchanged records logs nothing. Any wandb error is printed as one line and swallowed: the mirror can
neither fail nor lose a run, and wandb is imported only when a record is mirrored.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from h2o.store.files import append_jsonl, read_jsonl
from h2o.store.folders import fmt

LEDGER = "h2o-mirrored.jsonl"
HEAD = ("experiment", "model", "task", "task_kind", "policy", "budget", "heavy", "recent", "shots", "semantics",
        "scoring", "seed", "limit", "evicts", "prompt_len", "gen_len", "batch_size", "prefill_mode", "chunk",
        "positions", "text")
MAX_STREAM_STEPS = 5000  # history steps of a streaming record (evenly thinned beyond; the table keeps the rest)


@dataclass
class Settings:
    """Where the mirror writes: ``conf/logger/wandb.yaml`` or the sync command's options."""
    project: str = "h2o-repro"
    entity: str | None = None
    mode: str = "offline"      # offline | online | disabled
    dir: str | None = None     # None: <runs root>/.wandb

    @classmethod
    def of(cls, cfg) -> "Settings":
        return cls(cfg.get("project") or cls.project, cfg.get("entity"), cfg.get("mode") or "offline",
                   cfg.get("dir"))

    def where(self, root: Path) -> Path:
        return Path(self.dir) if self.dir else Path(root) / ".wandb"


# ---------------------------------------------------------------------------------------------- identity
def split_root(folder: Path, experiment: str | None) -> tuple[Path, str]:
    """(runs root, name): the name starts at the folder component named after the experiment."""
    folder = Path(folder).resolve()
    want = fmt(experiment) if experiment else None
    for up in [folder, *folder.parents]:
        if up.name == want:
            return up.parent, str(folder.relative_to(up.parent))
    return folder.parent, folder.name


def budget_tag(record: dict) -> str | None:
    if record.get("policy") == "full":
        return "1.0"
    b = record.get("budget")
    return None if b is None else fmt(b) if isinstance(b, float) else f"{b}tok" if isinstance(b, int) else str(b)


def run_id(experiment: str | None, name: str) -> str:
    prefix = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(experiment or "run"))[:24]
    return f"{prefix}-{hashlib.sha1(name.encode()).hexdigest()[:16]}"


def identity(record: dict, name: str) -> dict:
    """wandb.init's id, name, group, job_type and tags for a record called ``name`` (its path under runs/)."""
    options = record.get("policy_options") or {}
    tags = {"model": record.get("model"), "policy": record.get("policy"), "budget": budget_tag(record),
            "semantics": record.get("semantics"), "scoring": record.get("scoring"), "score": options.get("score")}
    return {"id": run_id(record.get("experiment"), name), "name": name,
            "group": str(record.get("experiment") or "adhoc"),
            "job_type": str(record.get("task") or record.get("task_kind") or
                            ("benchmark" if "prompt_len" in record else "run"))[:64],
            "tags": [f"{k}:{v}"[:64] for k, v in tags.items() if v is not None]}


# ------------------------------------------------------------------------------------------------ values
def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}, "c": 2} -> {"a.b": 1, "c": 2}."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def numbers(d: dict) -> dict:
    """The numeric leaves of ``d`` (flattened), as int / float; booleans as 0 / 1."""
    return {k: int(v) if isinstance(v, bool) else v for k, v in flatten(d).items()
            if is_number(v) or isinstance(v, bool)}


def typed_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Columns and rows for a wandb.Table: a column whose values are all numbers (or missing) stays numeric, a
    boolean column boolean, anything else is text (lists and dicts as JSON)."""
    rows = [flatten(r) for r in rows]
    cols = list(dict.fromkeys(k for r in rows for k in r))
    kinds = {}
    for c in cols:
        vals = [r.get(c) for r in rows if r.get(c) is not None]
        kinds[c] = ("number" if vals and all(is_number(v) for v in vals) else
                    "bool" if vals and all(isinstance(v, bool) for v in vals) else "text")

    def cell(v, kind):
        if v is None or kind != "text":
            return None if kind == "number" and v is not None and not math.isfinite(v) else v
        return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)

    return cols, [[cell(r.get(c), kinds[c]) for c in cols] for r in rows]


def table(rows: list[dict]):
    import wandb

    cols, data = typed_rows(rows[:wandb.Table.MAX_ROWS])
    return wandb.Table(columns=cols, data=data)


# ------------------------------------------------------------------------------------------------ mirror
def read_record(folder: Path) -> dict:
    return json.loads((Path(folder) / "metrics.json").read_text(encoding="utf-8"))


def digest(folder: Path) -> str:
    return hashlib.sha1((Path(folder) / "metrics.json").read_bytes()).hexdigest()


def destination(s: Settings, ident: dict) -> str:
    return f"{s.mode}:{s.entity or ''}/{s.project}/{ident['id']}"


def mirrored(s: Settings, root: Path) -> dict:
    """{destination: digest of metrics.json last mirrored there} from the ledger (read again only when it grew)."""
    f = s.where(root) / LEDGER
    return _ledger(str(f), f.stat().st_size if f.exists() else 0)


@functools.lru_cache(maxsize=4)
def _ledger(path: str, size: int) -> dict:
    out = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines() if size else []:
        try:
            row = json.loads(line)
            out[row["to"]] = row["digest"]
        except (ValueError, KeyError, TypeError):  # a line torn by a killed process: that record is redone
            continue
    return out


def config_of(folder: Path, record: dict, name: str, sweep: str | None) -> dict:
    cfg = {k: record[k] for k in HEAD if k in record}
    cfg.update(record=name, policy_options=record.get("policy_options") or {})
    if sweep:
        cfg["sweep"] = sweep
    hydra_cfg = Path(folder) / "config.yaml"
    if hydra_cfg.exists():
        import yaml

        cfg["hydra_config"] = yaml.safe_load(hydra_cfg.read_text(encoding="utf-8"))
    return cfg


def start(s: Settings, root: Path, ident: dict, config: dict):
    """wandb.init for one identity (resume="allow": the same id always continues the same run)."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    where = s.where(root)
    where.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", save_code=False, disable_git=True, disable_job_creation=True,
                              x_disable_stats=True, x_disable_meta=True, x_save_requirements=False)
    return wandb.init(project=s.project, entity=s.entity, dir=str(where), mode=s.mode, resume="allow",
                      reinit="finish_previous", config=config, allow_val_change=True, settings=settings, **ident)


def log_record(run, folder: Path, record: dict) -> None:
    """Metrics and the record's other numbers (one step), samples as a table; streaming: history against tokens."""
    samples = read_jsonl(Path(folder) / "samples.jsonl")
    if record.get("task_kind") == "streaming" and samples:
        run.define_metric("stream/tokens")
        run.define_metric("stream/*", step_metric="stream/tokens")
        stride = max(1, math.ceil(len(samples) / MAX_STREAM_STEPS))
        for row in samples[::stride] + ([samples[-1]] if (len(samples) - 1) % stride else []):
            run.log({f"stream/{k}": v for k, v in numbers(row).items()})
    row = numbers({k: v for k, v in record.items() if k not in ("metrics", "policy_options", *HEAD)})
    for key, value in numbers(record.get("metrics") or {}).items():  # a clash is renamed as analysis/ does
        row[f"metric_{key}" if key in row else key] = value
    if samples:
        row["samples"] = table(samples)
    run.log(row)
    run.summary.update({k: v for k, v in flatten(record.get("metrics") or {}).items() if isinstance(v, str)})


def mirror_folder(folder: Path, s: Settings, record: dict | None = None, root: Path | None = None,
                  sweep: str | None = None, force: bool = True) -> str:
    """Mirror one record folder; returns "logged", "unchanged" (already mirrored there, not forced) or "failed"
    (one line on stderr). Never raises."""
    run = None
    try:
        record = record if record is not None else read_record(folder)
        if root is None:
            root, name = split_root(folder, record.get("experiment"))
        else:
            root, name = Path(root).resolve(), str(Path(folder).resolve().relative_to(Path(root).resolve()))
        ident = identity(record, name)
        to, dig = destination(s, ident), digest(folder)
        if not force and mirrored(s, root).get(to) == dig:
            return "unchanged"
        run = start(s, root, ident, config_of(folder, record, name, sweep))
        log_record(run, folder, record)
        run.finish()
        run = None
        append_jsonl(s.where(root) / LEDGER, {"to": to, "digest": dig, "name": name})
        return "logged"
    except Exception as exc:  # noqa: BLE001 - never fail the run for its mirror
        print(f"[h2o] wandb mirror failed for {folder} ({type(exc).__name__}: {exc}); the run record is intact",
              file=sys.stderr)
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001
                pass
        return "failed"


def mirror_run(logger_cfg, spec, record: dict) -> bool:
    """The runner's hook (``logger=wandb``): mirror the record just written. Returns True on success."""
    from h2o.store.folders import runs_root

    return mirror_folder(spec.path, Settings.of(logger_cfg), record, runs_root(spec.cfg), sweep_id()) == "logged"


def sweep_id() -> str | None:
    """The Hydra sweep this job belongs to (``multirun/<experiment>/<time>``), None outside a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        return str(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    except (ImportError, ValueError):
        return None
