"""A record's identity: everything that changes a run's result, normalised (:func:`identity`). A finished record
is reused only for its own identity, read back from its config.yaml (:func:`record_identity`): :func:`check_reusable`
refuses any other with one line naming the difference."""
from __future__ import annotations

import json
from pathlib import Path

from h2o.assets.paths import group_defaults
from h2o.core.validate import ConfigError
from h2o.store.folders import IGNORED, UNSET_IS_DEFAULT, finished


def identity(cfg, policy, semantics: str) -> dict:
    """Everything that changes a run's result, normalised: the model, task and policy options (less IGNORED;
    the policy as its built heavy/recent split, so a full policy's unused budget does not count; a schedule option
    its group file lacks, added as null, left out as the folder leaves it out: the policy's own default), seed and
    the resolved semantics. Two configs with one identity share a record; a record is reused only for its own."""
    from omegaconf import OmegaConf

    nodes = {g: {k: v for k, v in OmegaConf.to_container(cfg[g], resolve=True).items() if k not in IGNORED}
             for g in ("model", "task", "policy")}
    base = group_defaults("policy", cfg.policy.name)
    for key in UNSET_IS_DEFAULT:  # ``++policy.compress=null``: a sweep's cell without it (h2o.store.folders.extras)
        if key in nodes["policy"] and nodes["policy"][key] is None and key not in base:
            del nodes["policy"][key]
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
        absent = object()  # a key one side lacks is named as absent, not as None
        spell = lambda d, k: repr(d[k]) if k in d else "absent"  # noqa: E731
        diff = "; ".join(f"{k}: {spell(h, k)} there, {spell(w, k)} here" for k in sorted(set(h) | set(w))
                         if h.get(k, absent) != w.get(k, absent))
    raise ConfigError(f"{path}: a finished record with a different config is there ({diff}); it is not reused: "
                      f"set another experiment_name or runs_dir, or move that folder away")
