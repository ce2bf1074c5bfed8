"""The run record: where a run's folder is (a function of its config), and how it is written.

Folder: ``<runs_dir>/<experiment_name>/<model>/<task>/shots<k>/<policy>/<budget>[/<extras>]`` where
``<budget>`` is the policy's budget (``0.2``; ``64tok`` for a token count; ``h0.15-r0.05`` for a hand split;
``1.0`` for full, whatever budget a sweep gave it) and ``<extras>`` lists, as ``key=value`` joined by ``,``,
every setting that differs from its group file's default (``limit=40``, ``sinks=8``, ``seed=1``,
``semantics=reference``, ...). Settings that cannot change a result (batch size, threads) are left out. Values are
spelled without loss (:func:`fmt`: floats by their shortest exact text, so 0.2000001 is not 0.2; text outside
``[A-Za-z0-9_.+-]`` gets a short hash); ``experiment_name`` must be in that set, and the folder stays inside
``runs_dir``. A finished record is reused only for its own normalised config (:func:`identity`, read back from
its config.yaml): :func:`check_reusable` refuses any other. Protocol settings (``scoring``, ``add_bos_token``) follow
the same rule: in the folder only where they differ from the default, always in the identity. So after a default
changes, an older record in the same folder blocks the new protocol (one line naming the difference) until it is
moved; spelling them in every folder would rename every existing record's folder (finished sweeps rerun whole)
for a case that only a change of default causes.

Files (contract read by analysis/): ``config.yaml`` (resolved Hydra config), ``samples.jsonl``, ``env.json``,
then ``metrics.json`` LAST and atomically (tmp file + ``os.replace``): a folder without it is unfinished and
is redone by the next run, whose files replace the old ones whole.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from h2o.assets.locks import append_line, folder_lock
from h2o.assets.paths import REPO, atomic_write_text, group_defaults
from h2o.assets.strict_json import NONFINITE, dumps, finite, strict  # noqa: F401  (re-exported: the record rule)
from h2o.cli.paths import SAFE, check_name
from h2o.core.validate import ConfigError, check, is_number

IGNORED = {"_target_", "name", "batch_size", "device_map", "resources", "params", "positions"}  # never in <extras>
IN_PATH = {"task": {"shots"}, "policy": {"budget", "heavy", "recent"}, "model": set()}
PACKAGES = ("torch", "transformers", "lm_eval", "hydra-core", "omegaconf", "hydra-submitit-launcher", "submitit",
            "datasets", "accelerate", "rouge-score", "wandb", "tokenizers", "numpy", "h2o-harness")


# ------------------------------------------------------------------------------------------- naming

def fmt(value: Any) -> str:
    """A config value as it appears in a folder name, without loss: 0.2, 0.2000001, 1.0, 64, true, null, words;
    text outside the safe character set is spelled safely and tagged with a short hash of the exact text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float: 0.2 vs 0.2000001 differ
    if isinstance(value, int):
        return str(value)
    text = str(value)
    if SAFE.fullmatch(text) and len(text) <= 80:
        return text
    spelled = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:40].lstrip(".") or "_"
    return f"{spelled}~{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def budget_label(policy, hand_split: bool = False) -> str:
    """``0.2`` / ``64tok`` for a budget, ``h<heavy>-r<recent>`` for a hand split (policy.heavy/recent set)."""
    if policy.name == "full":
        return "1.0"
    part = lambda v: fmt(v) if isinstance(v, float) else f"{v}tok"  # noqa: E731
    return f"h{part(policy.heavy)}-r{part(policy.recent)}" if hand_split else part(policy.budget)


@functools.lru_cache(maxsize=None)
def extras(cfg, default_semantics: str) -> list[str]:
    """``key=value`` for every result-relevant setting that differs from its default (sorted)."""
    out = []
    for group in ("model", "task", "policy"):
        node = cfg[group]
        base = group_defaults(group, node.name)
        for key in sorted(node):
            if key in IGNORED or key in IN_PATH[group]:
                continue
            if key not in base or base[key] != node[key]:
                out.append(f"{key}={fmt(node[key])}")
    quant = cfg.get("quant")
    if quant is not None and quant.name != "none":  # quant=<name><bits>, then its other non-default options
        base = group_defaults("quant", quant.name)
        out.append(f"quant={fmt(quant.name)}{fmt(quant.get('bits', ''))}")
        out += [f"{k}={fmt(quant[k])}" for k in sorted(quant)
                if k not in (*IGNORED, "bits", "calibration") and (k not in base or base[k] != quant[k])]
    if cfg.seed != 0:
        out.append(f"seed={fmt(cfg.seed)}")
    if cfg.semantics not in ("auto", default_semantics):
        out.append(f"semantics={fmt(cfg.semantics)}")
    return out


def runs_root(cfg) -> Path:
    """``runs_dir`` as an absolute path (relative to the directory the command was started in)."""
    root = Path(cfg.runs_dir).expanduser()
    if root.is_absolute():
        return root
    try:
        from hydra.core.hydra_config import HydraConfig

        start = Path(HydraConfig.get().runtime.cwd)
    except (ImportError, ValueError):
        start = Path.cwd()
    return start / root


def run_dir(cfg, policy, default_semantics: str) -> Path:
    names = [check_name("experiment_name", cfg.experiment_name), fmt(cfg.model.name), fmt(cfg.task.name),
             f"shots{fmt(cfg.task.shots)}", fmt(policy.name), budget_label(policy, cfg.policy.get("heavy") is not None)]
    extra = extras(cfg, default_semantics)
    root = runs_root(cfg)
    joined = ",".join(extra)  # each value spelled by fmt: safe characters, = and ,
    if len(joined) > 200:  # a folder name has at most 255 bytes
        joined = f"{joined[:180]}~{hashlib.sha1(joined.encode()).hexdigest()[:8]}"
    path = root.joinpath(*names, *([joined] if extra else []))
    check(path.resolve().is_relative_to(root.resolve()), f"experiment_name={cfg.experiment_name!r}: the run folder "
                                                         f"{path} is outside runs_dir={cfg.runs_dir!r}")
    return path


def identity(cfg, policy, semantics: str) -> dict:
    """Everything that changes a run's result, normalised: the model, task and policy options (less IGNORED;
    the policy as its built heavy/recent split, so a full policy's unused budget does not count), seed and the
    resolved semantics. Two configs with one identity share a record; a record is reused only for its own."""
    from omegaconf import OmegaConf

    nodes = {g: {k: v for k, v in OmegaConf.to_container(cfg[g], resolve=True).items() if k not in IGNORED}
             for g in ("model", "task", "policy")}
    for key in ("budget", "heavy", "recent", "heavy_share"):
        nodes["policy"].pop(key, None)
    nodes["policy"].update(name=policy.name, heavy=policy.heavy, recent=policy.recent)
    return {**nodes, "seed": cfg.seed, "semantics": semantics}


def record_identity(path: Path) -> dict | None:
    """The identity a finished record was run with (its config.yaml and metrics.json), None if unreadable."""
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(Path(path) / "config.yaml")
        rec = json.loads((Path(path) / "metrics.json").read_text(encoding="utf-8"))
        from h2o.core.policies import make_policy

        options = {k: v for k, v in OmegaConf.to_container(cfg.policy, resolve=True).items() if k != "_target_"}
        return identity(cfg, make_policy(**options), rec["semantics"])
    except Exception:  # noqa: BLE001 - any damage means: not provably the same run
        return None


def flat(d: dict, prefix: str = "") -> dict:
    """{"task": {"shots": 5}} -> {"task.shots": 5}."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_reusable(path: Path, wanted: dict) -> None:
    """ConfigError when ``path`` holds a finished record whose identity differs from ``wanted`` (never reused)."""
    if not finished(path):
        return
    have = record_identity(path)
    if have == wanted:
        return
    if have is None:
        diff = "its config.yaml or metrics.json is unreadable"
    else:
        h, w = flat(have), flat(wanted)
        diff = "; ".join(f"{k}: {h.get(k)!r} there, {w.get(k)!r} here" for k in sorted(set(h) | set(w))
                         if h.get(k) != w.get(k))
    raise ConfigError(f"{path}: a finished record with a different config is there ({diff}); it is not reused: "
                      f"set another experiment_name or runs_dir, or move that folder away")


# ------------------------------------------------------------------------------------------ writing
COMPLETE = ("model", "task", "policy", "metrics", "n_samples", "wall_s")  # fields every metrics.json has


def finished(path: Path) -> bool:
    """A run is finished when its metrics.json parses and holds every field of COMPLETE, ``metrics`` an object and
    ``budget`` a number or null, as the analysis reads it (an empty or torn file, as a node crash can leave on a
    shared filesystem, does not count: the run is redone)."""
    try:
        record = json.loads((Path(path) / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and all(k in record for k in COMPLETE) and isinstance(record["metrics"], dict)
            and (record.get("budget") is None or is_number(record["budget"])))


@contextlib.contextmanager
def claim(path: Path) -> Iterator[bool]:
    """Hold the run folder's lock (flock, or an O_EXCL lock file with a heartbeat where flock does not work:
    h2o.assets.locks). Yields False if another process has it."""
    with folder_lock(path, wait=False) as mine:
        yield mine


def clear_partial(path: Path) -> None:
    """Remove what an interrupted attempt left (temporary files, a torn samples file)."""
    for f in path.glob(".*.tmp"):
        f.unlink(missing_ok=True)
    for name in ("samples.jsonl", "env.json"):
        (path / name).unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, dumps(obj, indent=2) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r, ensure_ascii=False) + "\n" for r in rows))


def append_jsonl(path: Path, row: dict) -> None:
    """Append one line in one write, fsync'd (several jobs of a sweep may write at once)."""
    append_line(Path(path), dumps(row))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file; a torn line (a writer killed mid-write) is left out."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line)) if line.strip() else None
    return rows


# -------------------------------------------------------------------------------------- environment
def slurm_job_id() -> str | None:
    """``<array job>_<task>`` inside a Slurm array task (what sacct and scancel take), else SLURM_JOB_ID."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def device_info() -> dict:
    import torch

    if torch.cuda.is_available():
        return {"device": "cuda", "device_name": torch.cuda.get_device_name(0), "n_gpus": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"device": "cpu", "device_name": cpu, "n_cpus": os.cpu_count()}


def env_info(started: float, ended: float) -> dict:
    """Git commit and dirty flag, package versions, device, torch threads, wall time, host."""
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "packages": {p: _version(p) for p in PACKAGES},
        "python": sys.version.split()[0],
        **device_info(),
        "torch_threads": torch.get_num_threads(),
        "hostname": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "ended": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(ended)),
        "wall_s": round(ended - started, 3),
        "argv": sys.argv,
        "slurm_job_id": slurm_job_id(),
    }
