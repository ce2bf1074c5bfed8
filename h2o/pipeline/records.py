"""The run record: where a run's folder is (a function of its config), and how it is written.

Folder: ``<runs_dir>/<experiment_name>/<model>/<task>/shots<k>/<policy>/<budget>[/<extras>]`` where
``<budget>`` is the policy's budget (``0.2``; ``64tok`` for a token count; ``h0.15-r0.05`` for a hand split;
``1.0`` for full, whatever budget a sweep gave it) and ``<extras>`` lists, as ``key=value`` joined by ``,``,
every setting that differs from its group file's default (``limit=40``, ``sinks=8``, ``seed=1``,
``semantics=reference``, ...). Settings that cannot change a result (batch size, threads) are left out.

Files (contract read by analysis/): ``config.yaml`` (resolved Hydra config), ``samples.jsonl``, ``env.json``,
then ``metrics.json`` LAST and atomically (tmp file + ``os.replace``): a folder without it is unfinished and
is redone by the next run, whose files replace the old ones whole.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
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

from h2o.assets.paths import REPO, atomic_write_text

CONF = REPO / "conf"
IGNORED = {"_target_", "name", "batch_size", "device_map"}  # never in <extras>
IN_PATH = {"task": {"shots"}, "policy": {"budget", "heavy", "recent"}, "model": set()}
PACKAGES = ("torch", "transformers", "lm_eval", "hydra-core", "omegaconf", "hydra-submitit-launcher", "submitit",
            "datasets", "accelerate", "rouge-score", "wandb", "tokenizers", "numpy", "h2o-harness")


# ------------------------------------------------------------------------------------------- naming
def fmt(value: Any) -> str:
    """A config value as it appears in a folder name: 0.2, 1.0, 64, true, null, words_with_underscores."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        text = f"{value:g}"
        return text if any(c in text for c in ".en") else f"{text}.0"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in str(value))


def budget_label(policy, hand_split: bool = False) -> str:
    """``0.2`` / ``64tok`` for a budget, ``h<heavy>-r<recent>`` for a hand split (policy.heavy/recent set)."""
    if policy.name == "full":
        return "1.0"
    part = lambda v: fmt(v) if isinstance(v, float) else f"{v}tok"  # noqa: E731
    return f"h{part(policy.heavy)}-r{part(policy.recent)}" if hand_split else part(policy.budget)


@functools.lru_cache(maxsize=None)
def group_defaults(group: str, name: str) -> dict:
    """The group file's own values (``conf/<group>/<name>.yaml``), {} if there is no such file."""
    from omegaconf import OmegaConf

    path = CONF / group / f"{name}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.exists() else {}


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
    names = [fmt(cfg.experiment_name), fmt(cfg.model.name), fmt(cfg.task.name), f"shots{cfg.task.shots}",
             fmt(policy.name), budget_label(policy, cfg.policy.get("heavy") is not None)]
    extra = extras(cfg, default_semantics)
    return runs_root(cfg).joinpath(*names, *([",".join(extra)] if extra else []))


# ------------------------------------------------------------------------------------------ writing
def finished(path: Path) -> bool:
    return (Path(path) / "metrics.json").exists()


@contextlib.contextmanager
def claim(path: Path) -> Iterator[bool]:
    """Hold ``<path>/.lock`` (flock, released when the process dies). Yields False if another process has it."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def clear_partial(path: Path) -> None:
    """Remove what an interrupted attempt left (temporary files, a torn samples file)."""
    for f in path.glob(".*.tmp"):
        f.unlink(missing_ok=True)
    for name in ("samples.jsonl", "env.json"):
        (path / name).unlink(missing_ok=True)


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows))


def append_jsonl(path: Path, row: dict) -> None:
    """Append one line under an exclusive lock (several jobs of a sweep may write at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(row, default=str) + "\n")
        fh.flush()
        fcntl.flock(fh, fcntl.LOCK_UN)


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


# -------------------------------------------------------------------------------------- environment
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
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
