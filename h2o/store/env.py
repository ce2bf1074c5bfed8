"""What a run's env.json says about where it ran: git commit and dirty flag, package versions, device, threads,
wall time, host, Slurm job."""
from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from h2o.assets.paths import REPO

PACKAGES = ("torch", "transformers", "lm_eval", "hydra-core", "omegaconf", "hydra-submitit-launcher", "submitit",
            "datasets", "accelerate", "rouge-score", "wandb", "tokenizers", "numpy", "h2o-harness")


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
    return {"device": "cpu", "device_name": cpu_name(), "n_cpus": os.cpu_count()}


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), e.g. ``AMD EPYC``; ``platform.processor()`` where that is missing."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or ""


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
