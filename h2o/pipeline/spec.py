"""One run's spec: its composed config checked once into typed values, from which its folder, identity and the
fields of its record follow. Nothing is loaded: cheap enough to check every job of a sweep.

    spec = prepare(cfg)      # a RunSpec; ConfigError / PolicyError (one line) on any bad value
    spec.path                # the run's record folder (h2o.store.folders.run_dir)
    spec.identity            # what a finished record there must have been run with (h2o.store.identity.identity)
    spec.head()              # the fields of metrics.json that the config fixes
    spec.record(measured, info)  # every field of metrics.json (h2o.pipeline.fields: one rule for a clash)
    spec.full_path()         # the folder of the full run with this run's model, task and settings

The check, in order: the root keys into :class:`Settings` (the group keys against their files); ``task_overrides.
<task name>`` (a root key) merged into ``task``, so that one sweep over several tasks gives each its own sample
count (experiment=default); the experiment's ``grid_only`` cells (a job outside them is refused: OutsideGrid); the
keys a record's config may lack left out at their default (:data:`ADDED`, one rule); each group (policy, task, model,
quant) built once by Hydra's ``instantiate`` after its options are checked against the class's dataclass fields
(:func:`check_types`); the second spelling of the paper code's rule (:func:`reference_spelling`); the checks between
the objects (the policy's reach on the model, the task on this model and policy); the folder, which must be writable
and may hold a finished record of this identity only. The spec is then read, never rebuilt: by the runner
(h2o.pipeline.run), the job classifier (h2o.pipeline.jobs) and the Slurm launcher (h2o.pipeline.launch).

Where Hydra does not serve: no structured-config schema is registered for the groups. Their classes (ModelSpec,
the TaskSpec dataclasses, the policies) are the schema, and a ConfigStore copy of their fields would fill a key
removed from the command line (``~policy.budget``) with its default where it must be refused, and would report a
bad type in OmegaConf's several-line message that names no allowed value. The root keys are typed by
:class:`Settings`, checked with the same one-line messages.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from h2o.store.locks import lock_mode, stale_after
from h2o.assets.model_spec import ModelSpec
from h2o.assets.paths import group_defaults
from h2o.cli.paths import check_name, output_dir
from h2o.core.policies import Policy, PolicyError
from h2o.core.policies.budget import Unsupported
from h2o.core import engine
from h2o.core.engine import PAPER_RULE
from h2o.core.quant import Quantizer
from h2o.core.validate import ConfigError, check, is_int, is_number
from h2o.pipeline.fields import record_fields
from h2o.store.folders import run_dir
from h2o.store.identity import check_reusable, identity
from h2o.tasks.base import TaskSpec

GROUPS = ("model", "task", "policy", "logger", "quant")


# ------------------------------------------------------------------------------------------- types
def type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` (as composed by OmegaConf) fits the annotation ``hint`` (bool, int, float, str, Optional)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return is_int(value)
    if hint is float:
        return is_number(value)
    if hint is str:
        return isinstance(value, str)
    return True  # Any and richer types: the class checks them


def describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    return {type(None): "null", bool: "true/false", int: "an int", float: "a finite number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def check_types(cls: type, options: dict, prefix: str) -> None:
    """ConfigError for the first option of a dataclass ``cls`` whose value does not fit the field's type."""
    if not dataclasses.is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in options and not type_ok(options[f.name], hints.get(f.name, Any)):
            raise ConfigError(f"{prefix}.{f.name}={options[f.name]!r}: expected {describe(hints[f.name])}")


def check_finite(value: Any, where: str) -> None:
    """ConfigError for the first inf or nan anywhere in a group's options (a float option takes finite numbers
    only: a range check written as a comparison lets nan through, and no record may hold a non-finite number)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}={value}: not a finite number; allowed: a finite number in the option's range")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        check_finite(item, f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]")


def build(group: str, node: DictConfig) -> Any:
    """Hydra's ``instantiate`` of a group node (its ``_target_`` called with its other keys as plain values), its
    options first checked against the target's dataclass fields; a bad target or option -> ConfigError (one line),
    an error of the target's own (PolicyError, ConfigError) as it is."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_method, instantiate

    options = OmegaConf.to_container(node, resolve=True)
    check_finite(options, group)
    target = options.pop("_target_", None)
    if not target:
        raise ConfigError(f"{group}: no _target_ in its config")
    try:
        factory = get_method(target)
    except Exception as exc:  # noqa: BLE001 - hydra raises several kinds
        raise ConfigError(f"{group}._target_={target!r}: cannot import ({' '.join(str(exc).split())})") from None
    if isinstance(factory, type):
        check_types(factory, options, group)
    try:
        return instantiate({"_target_": factory, **options}, _convert_="all", _recursive_=False)
    except InstantiationException as wrapped:
        exc = wrapped.__cause__ or wrapped
    unknown = re.search(r"unexpected keyword argument '([^']+)'", str(exc))
    if unknown:  # make_policy turns the TypeError into a PolicyError that names the argument
        allowed = [k for k in group_defaults(group, str(options.get("name"))) if k != "_target_"]
        raise ConfigError(f"{group}.{unknown.group(1)}: no such option for {group}={options.get('name')}; "
                          f"allowed: {', '.join(allowed) or '(see conf/' + group + ')'}") from None
    if isinstance(exc, TypeError):
        raise ConfigError(f"{group}={options.get('name')}: {exc}") from None
    raise exc


# ------------------------------------------------------------------------------------------- root keys
@dataclass(frozen=True)
class Settings:
    """conf/config.yaml's own keys, checked (each value's type and range, one line each)."""

    experiment_name: str
    seed: int
    semantics: str  # auto | simulated | real | reference (an alias of the paper code's rule, engine.PAPER_RULE)
    runs_dir: str
    threads: int | None
    fail_fast: bool
    task_overrides: dict  # {<task name>: {key: value}}
    grid_only: list  # [{"when": {dotted key: value}, "only": {dotted key: value}}] (a sweep's sparse cells)

    @classmethod
    def of(cls, cfg: DictConfig) -> Settings:
        check_name("experiment_name", cfg.experiment_name)
        check(is_int(cfg.seed) and 0 <= cfg.seed < 2**32, f"seed={cfg.seed!r}: expected an int in [0, 2**32)")
        threads = cfg.threads
        check(threads is None or (is_int(threads) and threads >= 1),
              f"threads={threads!r}: expected a positive int or null")
        check(isinstance(cfg.fail_fast, bool), f"fail_fast={cfg.fail_fast!r}: expected true or false")
        check(isinstance(cfg.semantics, str),
              f"semantics={cfg.semantics!r}: expected auto, simulated, reference or real")
        runs_dir = cfg.runs_dir  # an interpolation: resolved once
        check(isinstance(runs_dir, str) and runs_dir.strip() != "",
              f"runs_dir={runs_dir!r}: expected a folder path (not empty)")
        overrides = cfg.task_overrides
        check(overrides is None or isinstance(overrides, DictConfig),
              f"task_overrides={overrides!r}: expected {{<task name>: {{key: value}}}}")
        grid = added_default(cfg, "grid_only")
        rules = (OmegaConf.to_container(grid, resolve=True) if isinstance(grid, ListConfig) else
                 list(grid) if isinstance(grid, list) else None)
        check(rules is not None and all(isinstance(r, dict) and set(r) == {"when", "only"} and
                                        all(isinstance(r[k], dict) and r[k] for k in r) for r in rules),
              f"grid_only={grid!r}: expected [{{when: {{<key>: <value>}}, only: {{<key>: <value>}}}}]")
        return cls(cfg.experiment_name, cfg.seed, cfg.semantics, runs_dir, threads, cfg.fail_fast,
                   OmegaConf.to_container(overrides, resolve=True) if overrides is not None else {}, rules)


def root_keys() -> dict:
    """conf/config.yaml's own keys (less defaults and hydra)."""
    return {k: v for k, v in group_defaults(".", "config").items() if k not in ("defaults", "hydra")}


# Keys a committed record's config may lack, each with the value such a record ran with (its class's default for
# a group key, conf/config.yaml's for a root key). The one rule for them: a key missing from a record's config
# takes that default; a key at that default is left out of the run's config (so of its record's config.yaml,
# folder and identity), so that a record without the key and a run at its default are the same run. A config may
# also spell one for a group that has no such option (``++task.question=prompt`` crossed with tasks that ask no
# question): at the default it is each of them's own behaviour.
ADDED = {"model.positions": None,  # ModelSpec: read from the model's config.json when null
         "task.question": "prompt",  # the long-context and lm-eval tasks: the question inside the prompt
         "task.questions": 1,  # niah: one question per context
         "task.turns": 1,  # niah: one turn
         "grid_only": [],  # Settings: no sparse cells
         "model.attn_implementation": "auto",  # load_model: sdpa, or flash attention 2 where installed on a GPU
         "task.long_gen": None,  # bench_targets: no long-generation section (h2o.bench.long_generation)
         "task.long_gen_prompt": 32, "task.long_gen_budget": 32, "task.long_gen_interval": 16,
         "task.long_gen_methods": None,  # bench_targets: every method of the long-generation section
         "policy.per_head_pruning": False}  # triattention: each layer chooses alone (its per_layer_perhead_pruning)


def added_default(cfg: DictConfig, key: str) -> Any:
    """``cfg``'s value of the dotted ``key``, or its :data:`ADDED` default where ``cfg`` lacks it."""
    return OmegaConf.select(cfg, key, default=ADDED[key])


class OutsideGrid(Unsupported):
    """A sweep job outside its experiment's ``grid_only`` cells: listed as refused, not run."""


def without_added_defaults(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` without the :data:`ADDED` keys that hold their default."""
    def at_default(value, default) -> bool:  # true or 1.0 for 1: kept, for the type check to refuse
        kind = (list, ListConfig) if isinstance(default, list) else type(default)
        return isinstance(value, kind) and not (isinstance(value, bool) and not isinstance(default, bool)) \
            and value == default

    drop = [key for key in ADDED if at_default(OmegaConf.select(cfg, key, default=object()), ADDED[key])]
    if not drop:
        return cfg
    cfg = cfg.copy()
    with open_dict(cfg):
        for key in drop:
            *group, name = key.split(".")
            del (cfg[group[0]] if group else cfg)[name]
    return cfg


def check_grid(cfg: DictConfig, settings: Settings) -> None:
    """OutsideGrid when ``cfg`` matches a ``grid_only`` rule's ``when`` and not all of its ``only``."""
    for rule in settings.grid_only:
        if all(OmegaConf.select(cfg, k) == v for k, v in rule["when"].items()):
            off = {k: OmegaConf.select(cfg, k) for k, v in rule["only"].items() if OmegaConf.select(cfg, k) != v}
            if off:
                when = ", ".join(f"{k}={v}" for k, v in rule["when"].items())
                raise OutsideGrid(f"{', '.join(f'{k}={v}' for k, v in off.items())}: outside the grid of "
                                  f"experiment_name={cfg.experiment_name}, which runs {when} at "
                                  f"{', '.join(f'{k}={v}' for k, v in rule['only'].items())} only (grid_only)")


def check_keys(cfg: DictConfig) -> Settings:
    """The root settings; ConfigError for a root key conf/config.yaml does not have (``+seeds=3``), a root or
    group key that was removed (``~policy.budget``), or a root value of the wrong type or range."""
    root = root_keys()
    unknown = sorted(set(cfg) - set(root) - set(GROUPS))
    check(not unknown, f"{unknown[0] if unknown else ''}: no such config key; allowed: {', '.join(sorted(root))} "
                       f"and the groups {', '.join(GROUPS)}")
    for key in [*root, *GROUPS]:
        check(key in cfg or key in ADDED, f"{key}: missing (removed?); it is required")
    for group in ("model", "task", "policy"):
        check(isinstance(cfg[group], DictConfig) and "name" in cfg[group], f"{group}: expected a config group")
        missing = [k for k in group_defaults(group, str(cfg[group].name))
                   if k not in cfg[group] and f"{group}.{k}" not in ADDED]
        check(not missing, f"{group}.{missing[0] if missing else ''}: missing (removed?); every key of "
                           f"conf/{group}/{cfg[group].name}.yaml is required")
    lock_mode(), stale_after()  # the lock settings a run reads when it claims its folder
    return Settings.of(cfg)


def with_task_overrides(cfg: DictConfig, settings: Settings) -> DictConfig:
    """A copy of ``cfg`` with ``task_overrides[task.name]`` merged into ``task``."""
    cfg = cfg.copy()
    extra = settings.task_overrides.get(cfg.task.name)
    if extra:
        with open_dict(cfg):
            cfg.task = OmegaConf.merge(cfg.task, extra)
    return cfg


# ------------------------------------------------------------------------------------------- the spec
@dataclass
class RunSpec:
    """One run, checked: the objects its config names (built, not loaded) and what follows from them."""

    cfg: DictConfig  # the record's config: task_overrides merged, the paper code's rule spelled as its record
    model: ModelSpec
    task: TaskSpec
    policy: Policy  # the policy that runs
    semantics: str  # resolved (auto -> the task's default)
    path: Path  # the record folder
    settings: Settings
    named: Policy  # the record's policy: ``policy`` but for the paper code's rule, spelled h2o (reference_spelling)
    quant: Quantizer | None = None  # how the run's caches store keys and values (None: unquantized)
    identity: dict = dataclasses.field(default_factory=dict)  # records.identity: what its record must match

    def run_fields(self) -> dict:
        """The record's fields that the config fixes (the run's, in h2o.pipeline.fields' rule)."""
        return {"experiment": self.settings.experiment_name, "model": self.model.name, "task": self.task.name,
                "task_kind": self.task.kind, "policy": self.cfg.policy.name, "budget": self.policy.budget,
                "heavy": self.policy.heavy, "recent": self.policy.recent, "shots": self.task.shots,
                "semantics": self.semantics, "seed": self.settings.seed, "evicts": engine.drops_tokens(self.policy),
                "limit": self.cfg.task.get("limit"),
                "policy_options": {k: v for k, v in OmegaConf.to_container(self.cfg.policy, resolve=True).items()
                                   if k not in ("_target_", "name")},
                **({"quant": self.quant.describe()} if self.quant is not None else {})}

    def record(self, measured: dict | None = None, info: dict | None = None) -> dict:
        """The record's fields: the config's, the policy's described options (``describe()`` called once), what
        the run ``measured`` and the task's ``info``, merged by h2o.pipeline.fields' one rule."""
        return record_fields(self.run_fields(), self.policy.describe(), measured, info)

    def head(self) -> dict:
        """The record's fields that the config fixes: :meth:`record` before anything is measured."""
        return self.record()

    def full_path(self) -> Path:
        """The folder of the ``full`` run with this run's model, task and settings (conf/policy/full.yaml)."""
        cfg = self.cfg.copy()
        with open_dict(cfg):
            cfg.policy = group_defaults("policy", "full")
        return run_dir(cfg, build("policy", cfg.policy), self.task.semantics[0])


def prepare(cfg: DictConfig) -> RunSpec:
    """Check ``cfg`` once into its :class:`RunSpec` (see the module's docstring for the order)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        settings = check_keys(cfg)
        cfg = with_task_overrides(cfg, settings)
    except OmegaConfBaseException as exc:  # e.g. an interpolation to a removed key
        raise ConfigError(" ".join(str(exc).split()[:40])) from None
    check_grid(cfg, settings)
    cfg = without_added_defaults(cfg)
    built = build("policy", cfg.policy)
    built.check_unused(cfg.policy)
    cfg, policy = reference_spelling(cfg, built)
    named = build("policy", cfg.policy) if engine.whole_forward(policy) else policy
    task = build("task", cfg.task)
    model = build("model", cfg.model)
    if not isinstance(task, TaskSpec):
        raise ConfigError(f"task={cfg.task.name}: _target_ must build an h2o.tasks.base.TaskSpec")
    longest = model.max_positions()
    if longest:
        policy.check_reach(longest, f"the longest context of {model.name}")
        policy.check_run_counts(longest, f"the longest context of {model.name}")
    if getattr(policy, "reads_queries", False):  # the queries before RoPE: the config says whether there is one
        policy.check_rotary(model.geometry()[1], model.name)
    if engine.calibration(policy):  # a model's offline statistics (triattention): found before
        from h2o.assets.triattention import require  # the model loads, or a one-line refusal naming the command

        calibrated = policy.calibrated(require(model))
        named, policy = (calibrated if named is policy else named), calibrated
    quant = build_quant(cfg, model)
    if engine.whole_forward(policy) and "reference" not in task.semantics:
        raise ConfigError(f"policy={policy.name}: the paper code's mask rule is for one-pass scoring; task "
                          f"{task.name} ({task.kind}) runs {', '.join(task.semantics)}")
    semantics = task.resolve_semantics(cfg.semantics)
    check(not engine.no_simulated_form(policy) or semantics == "real",
          f"policy={policy.name}: semantics={semantics}: {engine.no_simulated_form(policy) or ''}; allowed: a task that "
          f"runs the real path (niah, RULER, summarization, reasoning)")
    task.check_model(model)
    task.check_policy(policy)
    task.check_quant(quant)
    path = run_dir(cfg, named, task.semantics[0])
    output_dir("runs_dir", path, shown=settings.runs_dir)  # its nearest existing ancestor is a writable folder
    wanted = identity(cfg, named, semantics)
    check_reusable(path, wanted)
    return RunSpec(cfg, model, task, policy, semantics, path, settings, named, quant, wanted)


def reference_spelling(cfg: DictConfig, policy: Policy) -> tuple[DictConfig, Policy]:
    """(the record's config, the policy that runs). The paper code's mask rule is spelled ``policy=<PAPER_RULE>``
    or ``policy=h2o|h2_only semantics=reference`` (with a notice); both run that rule's policy and share one
    record, spelled as the second (``<h2o|h2_only>/<budget>/...semantics=reference``: the folders and identities
    of the records made with that spelling)."""
    from h2o.assets.policy_config import notice

    if cfg.semantics == "reference":
        reference = engine.as_paper_rule(policy)  # a policy out of its scope: the error, without the notice
        notice(f"semantics=reference is spelled policy={PAPER_RULE} now (same run folder); policy={policy.name}")
        return cfg, reference
    if not engine.whole_forward(policy):
        return cfg, policy
    check(cfg.semantics == "auto", f"semantics={cfg.semantics}: policy={PAPER_RULE} is the paper code's mask "
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


__all__ = ["RunSpec", "Settings", "prepare", "build", "ConfigError", "PolicyError"]
