"""A record's identity: everything that changes a run's result, normalised (:func:`identity`). A finished record
is reused only for its own identity, read back from its config.yaml (:func:`record_identity`): :func:`check_reusable`
refuses any other with one line naming the difference."""
from __future__ import annotations

import json
from pathlib import Path

from h2o.core.validate import ConfigError
from h2o.store.folders import IGNORED, finished


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
