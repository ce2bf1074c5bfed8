"""Turn a composed config into a validated plan, loading nothing: cheap enough to check every job of a sweep.

    plan = prepare(cfg)      # ConfigError / PolicyError (one line) on any bad value
    plan.path                # the run's record folder (h2o.pipeline.records.run_dir)
    plan.head()              # the fields of metrics.json that the config fixes

``task_overrides.<task name>`` (a root config key) is merged into ``task`` first: it lets one sweep over several
tasks give each its own sample count (experiment=default).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from h2o.assets.locks import lock_mode, stale_after
from h2o.assets.model_spec import ConfigError, ModelSpec
from h2o.core.policies import Policy, PolicyError
from h2o.core.policies.h2o_reference import H2OReference, as_reference
from h2o.core.quant import Quantizer
from h2o.core.validate import check, check_types, is_int, output_dir
from h2o.assets.paths import group_defaults
from h2o.pipeline.records import check_name, check_reusable, identity, run_dir
from h2o.tasks.base import TaskSpec


def build(group: str, node: DictConfig) -> Any:
    """Call the node's ``_target_`` with its other keys; a bad target or option -> ConfigError (one line)."""
    from hydra.utils import get_method

    options = OmegaConf.to_container(node, resolve=True)
    target = options.pop("_target_", None)
    if not target:
        raise ConfigError(f"{group}: no _target_ in its config")
    try:
        factory = get_method(target)
    except Exception as exc:  # noqa: BLE001 - hydra raises several kinds
        raise ConfigError(f"{group}._target_={target!r}: cannot import ({exc})") from None
    if isinstance(factory, type):
        check_types(factory, options, group)
    try:
        return factory(**options)
    except (TypeError, PolicyError) as exc:  # make_policy turns the TypeError into a PolicyError
        import re

        unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
        if isinstance(exc, PolicyError) and not unknown:
            raise
        if unknown:
            allowed = [k for k in group_defaults(group, str(options.get("name"))) if k != "_target_"]
            raise ConfigError(f"{group}.{unknown.group(1)}: no such option for {group}={options.get('name')}; "
                              f"allowed: {', '.join(allowed) or '(see conf/' + group + ')'}") from None
        raise ConfigError(f"{group}={options.get('name')}: {exc}") from None


def check_keys(cfg: DictConfig) -> None:
    """ConfigError for a root key conf/config.yaml does not have (``+seeds=3``), a root or group key that was
    removed (``~policy.budget``), or a root value of the wrong type or range."""
    root = group_defaults_root()
    unknown = sorted(set(cfg) - set(root) - set(GROUPS))
    check(not unknown, f"{unknown[0] if unknown else ''}: no such config key; allowed: {', '.join(sorted(root))} "
                       f"and the groups {', '.join(GROUPS)}")
    for key in [*root, *GROUPS]:
        check(key in cfg, f"{key}: missing (removed?); it is required")
    for group in ("model", "task", "policy"):
        check(isinstance(cfg[group], DictConfig) and "name" in cfg[group], f"{group}: expected a config group")
        missing = [k for k in group_defaults(group, str(cfg[group].name)) if k not in cfg[group]]
        check(not missing, f"{group}.{missing[0] if missing else ''}: missing (removed?); every key of "
                           f"conf/{group}/{cfg[group].name}.yaml is required")
    lock_mode(), stale_after()  # the lock settings a run reads when it claims its folder
    check_name("experiment_name", cfg.experiment_name)
    check(is_int(cfg.seed) and 0 <= cfg.seed < 2**32, f"seed={cfg.seed!r}: expected an int in [0, 2**32)")
    threads = cfg.threads
    check(threads is None or (is_int(threads) and threads >= 1),
          f"threads={threads!r}: expected a positive int or null")
    check(isinstance(cfg.fail_fast, bool), f"fail_fast={cfg.fail_fast!r}: expected true or false")
    check(isinstance(cfg.semantics, str), f"semantics={cfg.semantics!r}: expected auto, simulated, reference or real")
    runs_dir = cfg.runs_dir  # an interpolation: resolved once
    check(isinstance(runs_dir, str) and runs_dir.strip() != "", f"runs_dir={runs_dir!r}: expected a folder path "
                                                                 f"(not empty)")
    check(cfg.task_overrides is None or isinstance(cfg.task_overrides, DictConfig),
          f"task_overrides={cfg.task_overrides!r}: expected {{<task name>: {{key: value}}}}")


GROUPS = ("model", "task", "policy", "logger", "quant")


def group_defaults_root() -> dict:
    """conf/config.yaml's own keys (less defaults and hydra)."""
    return {k: v for k, v in group_defaults(".", "config").items() if k not in ("defaults", "hydra")}


def with_task_overrides(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with ``task_overrides[task.name]`` merged into ``task``."""
    cfg = cfg.copy()
    extra = (cfg.get("task_overrides") or {}).get(cfg.task.name)
    if extra:
        with open_dict(cfg):
            cfg.task = OmegaConf.merge(cfg.task, extra)
    return cfg


@dataclass
class Plan:
    cfg: DictConfig
    model: ModelSpec
    task: TaskSpec
    policy: Policy
    semantics: str
    path: Path
    quant: Quantizer | None = None  # how the run's caches store keys and values (None: unquantized)

    def head(self) -> dict:
        d = self.policy.describe()
        extra = {k: v for k, v in d.items() if k not in ("policy", "budget", "heavy", "recent")}
        return {"experiment": self.cfg.experiment_name, "model": self.model.name, "task": self.task.name,
                "task_kind": self.task.kind, "policy": self.cfg.policy.name, "budget": self.policy.budget,
                "heavy": self.policy.heavy, "recent": self.policy.recent, "shots": self.task.shots,
                "semantics": self.semantics, "seed": self.cfg.seed, "evicts": bool(self.policy.evicts),
                "limit": self.cfg.task.get("limit"),
                "policy_options": {k: v for k, v in OmegaConf.to_container(self.cfg.policy, resolve=True).items()
                                   if k not in ("_target_", "name")},
                **({"quant": self.quant.describe()} if self.quant is not None else {}),
                **extra}


def prepare(cfg: DictConfig) -> Plan:
    """Validate everything cheap (keys, policy, task, model, semantics, seed, threads, whether the task fits the
    model, paths) and name the run folder; a finished record there must have this config."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        check_keys(cfg)
        cfg = with_task_overrides(cfg)
    except OmegaConfBaseException as exc:  # e.g. an interpolation to a removed key
        raise ConfigError(" ".join(str(exc).split()[:40])) from None
    built = build("policy", cfg.policy)
    built.check_unused(cfg.policy)
    cfg, policy = reference_spelling(cfg, built)
    named = build("policy", cfg.policy) if isinstance(policy, H2OReference) else policy  # the record's policy
    task = build("task", cfg.task)
    model = build("model", cfg.model)
    longest = model.max_positions()
    if longest:
        policy.check_reach(longest, f"the longest context of {model.name}")
    quant = build_quant(cfg, model)
    if not isinstance(task, TaskSpec):
        raise ConfigError(f"task={cfg.task.name}: _target_ must build an h2o.tasks.base.TaskSpec")
    if isinstance(policy, H2OReference) and "reference" not in task.semantics:
        raise ConfigError(f"policy=h2o_reference: the paper code's mask rule is for one-pass scoring; task "
                          f"{task.name} ({task.kind}) runs {', '.join(task.semantics)}")
    semantics = task.resolve_semantics(cfg.semantics)
    task.check_model(model)
    task.check_policy(policy)
    task.check_quant(quant)
    path = run_dir(cfg, named, task.semantics[0])
    check_writable(path, cfg.runs_dir)
    check_reusable(path, identity(cfg, named, semantics))
    return Plan(cfg, model, task, policy, semantics, path, quant)


def reference_spelling(cfg: DictConfig, policy: Policy) -> tuple[DictConfig, Policy]:
    """(the record's config, the policy that runs). The paper code's mask rule is spelled ``policy=h2o_reference``
    or, older, ``policy=h2o|h2_only semantics=reference`` (a notice); both run an h2o_reference policy and share
    one record, spelled as the older one (``<h2o|h2_only>/<budget>/...semantics=reference``: the folders and
    identities of the records made before h2o_reference existed)."""
    from h2o.assets.policy_config import notice

    if cfg.semantics == "reference":
        reference = as_reference(policy)  # a policy out of its scope: the error, without the notice
        notice(f"semantics=reference is spelled policy=h2o_reference now (same run folder); policy={policy.name}")
        return cfg, reference
    if not isinstance(policy, H2OReference):
        return cfg, policy
    check(cfg.semantics == "auto", f"semantics={cfg.semantics}: policy=h2o_reference is the paper code's mask "
                                   f"rule, its own semantics; allowed: semantics=auto")
    record = cfg.copy()
    with open_dict(record):
        split = {k: cfg.policy[k] for k in ("budget", "heavy", "recent", "heavy_share")}
        record.policy = OmegaConf.merge(group_defaults("policy", "h2o"), split)
        record.semantics = "reference"
    return record, policy


def build_quant(cfg: DictConfig, model: ModelSpec):
    """The run's KV quantizer (None for quant=none), checked against the model's shape read without loading."""
    node = cfg.get("quant")
    if node is None or node.name == "none":
        return None
    calibration = node.get("calibration")
    if calibration:
        from h2o.assets.paths import calibration_file

        node = OmegaConf.merge(node, {"calibration": str(calibration_file(model.name, str(calibration)))})
    quant = build("quant", node)
    quant.check_geometry(*model.geometry())
    return quant


def check_writable(path: Path, runs_dir) -> None:
    """ConfigError unless ``path`` can be created: its nearest existing ancestor is a writable folder."""
    output_dir("runs_dir", path, shown=runs_dir)


__all__ = ["Plan", "prepare", "build", "ConfigError", "PolicyError"]
