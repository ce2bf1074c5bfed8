"""Mirror a finished run to Weights & Biases (``logger=wandb``). The runs/ record is the source of truth.

Offline by default (``WANDB_MODE=offline``, data under ``${runs_dir}/.wandb`` for ``wandb sync``). Called after
metrics.json is written; any wandb error is printed as one line and swallowed, so it can neither fail nor lose
a run.
"""
from __future__ import annotations

import os
import sys

from omegaconf import OmegaConf


def mirror_run(logger_cfg, plan, record: dict) -> bool:
    """Log the record's metrics, config and a table of (up to 200) samples. Returns True on success."""
    try:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        os.makedirs(logger_cfg.dir, exist_ok=True)
        name = str(plan.path.relative_to(plan.path.parents[5])) if len(plan.path.parents) > 5 else str(plan.path)
        run = wandb.init(project=logger_cfg.project, entity=logger_cfg.entity, group=logger_cfg.group,
                         name=name, dir=logger_cfg.dir, mode=logger_cfg.mode, tags=list(logger_cfg.tags),
                         config=OmegaConf.to_container(plan.cfg, resolve=True), reinit="finish_previous")
        run.log({k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))})
        run.summary.update({k: v for k, v in record.items() if k != "metrics" and isinstance(v, (int, float, str))})
        samples = [s for s in _samples(plan.path)][:200]
        if samples:
            cols = sorted({k for s in samples for k in s})
            run.log({"samples": wandb.Table(columns=cols, data=[[str(s.get(c)) for c in cols] for s in samples])})
        run.finish()
        return True
    except Exception as exc:  # noqa: BLE001 - never fail the run for its mirror
        print(f"[h2o] wandb mirror failed ({type(exc).__name__}: {exc}); the run record is intact", file=sys.stderr)
        return False


def _samples(path):
    import json

    f = path / "samples.jsonl"
    if f.exists():
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield json.loads(line)
