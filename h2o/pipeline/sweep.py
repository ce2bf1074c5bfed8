"""Expand a (multi)run into its jobs exactly as Hydra's basic sweeper does, and validate each one.

    python -m h2o.pipeline.sweep experiment=table1                # dry run: every job, its run folder, done or not
    python -m h2o.pipeline.sweep experiment=table1 task=copa      # command-line values replace the experiment's sweep

Nothing is loaded: each job's config is composed and checked into its spec by :func:`h2o.pipeline.spec.prepare`.
``h2o-run -m`` calls :func:`expand` first, so a bad value in any job stops the sweep before the first model load
(exit status 2). Jobs that share a run folder (``policy=full`` crossed with budgets) are listed once, then as
``dup``; a job served by the full run as ``served`` (h2o.pipeline.jobs). A job whose combination does not exist
(a compression timing its method or task does not define: h2o.core.policies.budget.Unsupported) is listed as
``refused`` with the reason and is not run; a single run of it exits 2 with that line.

Hydra's public API composes (``initialize_config_dir`` + ``compose``: the tree of every distinct set of group
choices, and :func:`_compose` for tests and Hydra's own config) but has no call for two steps, taken from
``hydra._internal`` on purpose (hydra-core is pinned to 1.3.x in pyproject.toml):

* the job list: ``BasicSweeper.split_arguments``, the routine ``h2o-run -m`` launches the jobs with, so the list,
  its order and the job numbers in jobs.jsonl are the launched ones by construction (a copy could drift);
* a job's value overrides on a composed tree: ``ConfigLoaderImpl._apply_overrides_to_config``, the routine
  ``compose`` applies them with. ``compose`` per job costs ~140 ms of CPU here against ~6 ms for
  :class:`Composer` (fig4's 882 jobs: ~2 min against ~5 s, paid before every sweep and in the tests);
  tests/test_experiments.py checks the two give equal configs for jobs of every experiment.
"""
from __future__ import annotations

import copy
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from h2o.assets.paths import CONF
from h2o.cli.args import fail
from h2o.cli.paths import abbrev, output_dir
from h2o.core.validate import BadInput, ConfigError, check
from h2o.core.policies.budget import Unsupported
from h2o.pipeline.jobs import classify, summary
from h2o.store.folders import runs_root
from h2o.pipeline.spec import OutsideGrid, RunSpec, prepare

BAD_INPUT = BadInput  # ConfigError, PolicyError


@dataclass
class Sweep:
    jobs: list[list[str]]  # the override list of each job, in launch order
    specs: list[RunSpec]
    sweep_dir: str  # hydra.sweep.dir, resolved (multirun only)
    refused: list[tuple[list[str], str]] = field(default_factory=list)  # (job overrides, why), not in ``jobs``
    outside: list[tuple[list[str], str]] = field(default_factory=list)  # refused by grid_only: counted, not listed


def _compose(overrides: list[str], hydra_cfg: bool = False):
    from hydra import compose

    return compose(config_name="config", overrides=overrides, return_hydra_config=hydra_cfg)


class Composer:
    """Compose job configs fast, with Hydra's semantics.

    Hydra merges the defaults tree (root, model, task, policy, logger, then the experiment overlay) and applies
    value overrides last. So the tree is composed by Hydra once per distinct set of non-leaf group choices
    (experiment, hydra/...); a job's leaf group choices (model, task, policy, logger: files without a defaults
    list) swap in ``merge(group file, the experiment overlay's part for that group)``; then the job's value
    overrides are applied with Hydra's own routine (``hydra.*`` values do not touch the job config).
    tests/test_experiments.py checks the result equals Hydra's compose for jobs of every experiment.
    """

    LEAVES = ("model", "task", "policy", "logger", "quant")

    def __init__(self):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        self.parser = OverridesParser.create()
        self.trees: dict[tuple[str, ...], tuple] = {}
        self.files: dict[tuple[str, str], object] = {}  # (group, choice) -> its file, read once per sweep

    @staticmethod
    def is_group(override) -> bool:
        key = override.key_or_group
        return key.startswith("hydra/") or (CONF / key).is_dir()

    def leaf(self, override) -> bool:
        return (override.key_or_group in self.LEAVES and override.package is None and not override.is_add()
                and not override.is_force_add() and not override.is_delete()
                and not has_defaults(override.key_or_group, str(override.value())))

    def tree(self, groups: tuple[str, ...]):
        """(config, choices, experiment overlay body) for the non-leaf group overrides."""
        if groups not in self.trees:
            from omegaconf import OmegaConf, open_dict

            cfg = _compose(list(groups), hydra_cfg=True)
            choices = dict(cfg.hydra.runtime.choices)
            with open_dict(cfg):
                del cfg["hydra"]
            exp = choices.get("experiment")
            body = OmegaConf.load(CONF / "experiment" / f"{exp}.yaml") if exp and exp != "null" else OmegaConf.create()
            self.trees[groups] = (cfg, choices, body)
        return self.trees[groups]

    def __call__(self, job: list[str]):
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from omegaconf import OmegaConf, open_dict

        parsed = self.parser.parse_overrides(job)
        groups = [o for o in parsed if self.is_group(o)]
        leaves = {o.key_or_group: str(o.value()) for o in groups if self.leaf(o)}
        base, choices, body = self.tree(tuple(o.input_line for o in groups if not self.leaf(o)))
        cfg = copy.deepcopy(base)
        for group, choice in leaves.items():
            if choices.get(group) != choice:
                if (group, choice) not in self.files:
                    self.files[group, choice] = OmegaConf.load(CONF / group / f"{choice}.yaml")
                node = OmegaConf.merge(self.files[group, choice], body.get(group) or {})  # merge copies
                with open_dict(cfg):
                    cfg[group] = node
        values = [o for o in parsed if not self.is_group(o) and not o.key_or_group.startswith("hydra.")]
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg


def has_defaults(group: str, choice: str) -> bool:
    """Whether a group file has its own defaults list (then only Hydra composes it); missing files -> True."""
    path = CONF / group / f"{choice}.yaml"
    return not path.exists() or "defaults:" in path.read_text(encoding="utf-8")


def one_line(exc: BaseException) -> str:
    """A Hydra or config error as one line (Hydra's messages span several); unknown group choices name the
    allowed ones."""
    text = " ".join(str(exc).split())
    m = re.search(r"Could not find '([\w/]+)/([^']+)' Available options in '[\w/]+': (.*?) Config search path", text)
    if m:
        return f"{m.group(1)}={m.group(2)}: unknown; allowed: {', '.join(m.group(3).split())}"
    text = text.split(" Config search path")[0]
    return text if len(text) < 400 else text[:397] + "..."


DIGITS = 4300  # Python's limit of digits for reading an int (sys.get_int_max_str_digits)


def check_overrides(overrides: list[str]) -> None:
    """ConfigError for an override Hydra would misreport: a group removed whole (``~task``), a group choice given
    as a path (``experiment=../model/x``: Hydra reads the file and blames a key of it), or a number longer than
    Python reads (Hydra's message does not name the key)."""
    for text in overrides:
        key, sep, value = text.partition("=")
        name = key.lstrip("~+")
        group = "." not in name and (CONF / name).is_dir()
        allowed = ", ".join(sorted(f.stem for f in (CONF / name).glob("*.yaml"))) if group else ""
        if group and key.startswith("~"):
            raise ConfigError(f"{key}: removes the whole {name} group, which every run needs; allowed: "
                              f"{name}=<name> to choose another ({allowed})")
        if group and sep and ("/" in value or "\\" in value or ".." in value):
            raise ConfigError(f"{name}={value}: a config name, not a path; allowed: {allowed}")
        digits = max((len(m) for m in re.findall(r"\d+", value)), default=0)
        if digits > DIGITS:
            raise ConfigError(f"{key}={value[:8]}... ({digits} digits): too long a number to read; allowed: "
                              f"budgets and counts up to 2**40 (13 digits)")


def job_overrides(overrides: list[str], multirun: bool) -> tuple[list[list[str]], str]:
    """The jobs' override lists and the resolved sweep dir (Hydra's BasicSweeper.split_arguments)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    if not multirun:
        return [overrides], ""
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    base = _compose(fixed, hydra_cfg=True)
    params = [f"{k}={v}" for k, v in (base.hydra.sweeper.get("params") or {}).items()]
    jobs = BasicSweeper.split_arguments(parser.parse_overrides(params + overrides), None)[0]
    return jobs, str(base.hydra.sweep.dir)


def expand(overrides: list[str], multirun: bool) -> Sweep:
    """Compose and validate every job. Raises ConfigError/PolicyError (or a Hydra error) with one line."""
    from contextlib import nullcontext

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    ready = GlobalHydra.instance().is_initialized()  # e.g. inside a test's initialize_config_dir
    with nullcontext() if ready else initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        try:
            check_overrides(overrides)
            jobs, sweep_dir = job_overrides(overrides, multirun)
            specs, kept, refused, outside, compose = [], [], [], [], Composer()
            for job in jobs:
                try:
                    specs.append(prepare(compose(job)))
                    kept.append(job)
                except Unsupported as exc:
                    if not multirun:
                        raise
                    (outside if isinstance(exc, OutsideGrid) else refused).append((job, str(exc)))
                except BAD_INPUT as exc:
                    raise type(exc)(f"{exc}  [job: {' '.join(abbrev(a, 80, quote=False) for a in job)}]") from None
        except BAD_INPUT:
            raise
        except (HydraException, OmegaConfBaseException, ValueError, TypeError) as exc:  # range(0,1,0): ValueError
            raise ConfigError(one_line(exc)) from None
    if multirun:
        output_dir("hydra.sweep.dir", sweep_dir)
    return Sweep(kept, specs, sweep_dir, refused, outside)


SETTING = ("cluster.", "hydra.launcher.")  # two spellings of a Slurm setting: cluster.chunk=4, hydra.launcher.chunk=4


def split_args(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(flags, cluster settings: cluster.* or hydra.launcher.*, Hydra overrides)."""
    flags = [a for a in argv if a.startswith("-")]
    cluster = [a for a in argv if not a.startswith("-") and a.startswith(SETTING)]
    return flags, cluster, [a for a in argv if not a.startswith("-") and not a.startswith(SETTING)]


def status(sweep: Sweep) -> list[str]:
    """Per job: ``dup``, ``done``, ``served`` or ``todo`` (:func:`h2o.pipeline.jobs.classify`)."""
    return [w.state for w in classify(sweep.jobs, sweep.specs)]


def describe(sweep: Sweep, root: Path | None = None) -> str:
    """The dry-run listing: one line per job, then a summary."""
    works = classify(sweep.jobs, sweep.specs)
    lines = [f"{'#':>4} {'status':6} {'model':14} {'task':12} {'shots':>5} {'policy':14} {'budget':8} run folder"]
    for i, (spec, state) in enumerate(zip(sweep.specs, (w.state for w in works))):
        p = spec.policy
        budget = "1.0" if p.name == "full" else str(p.budget)
        folder = spec.path.relative_to(root) if root and spec.path.is_relative_to(root) else spec.path
        lines.append(f"{i:>4} {state:6} {spec.model.name:14} {spec.task.name:12} {spec.task.shots:>5} "
                     f"{p.name:14} {budget:8} {folder}")
    lines += [f"   - refused {' '.join(job)}: {why}" for job, why in sweep.refused]
    lines.append(summary_line(sweep, works))
    return "\n".join(lines)


def summary_line(sweep: Sweep, works) -> str:
    """:func:`h2o.pipeline.jobs.summary`, the refused jobs' count and the count outside ``grid_only``'s cells."""
    return summary(works) + (f"; {len(sweep.refused)} refused (not run)" if sweep.refused else "") + (
        f"; {len(sweep.outside)} outside the experiment's grid_only cells (not run, not listed)" if sweep.outside
        else "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        flag = next((a for a in argv if a.startswith("-") and a not in ("-m", "--multirun")), None)
        check(flag is None, f"{flag}: unknown option; allowed: key=value overrides (every job is listed)")
        sweep = expand(overrides, multirun=True)
    except BAD_INPUT as exc:
        return fail(exc)
    root = runs_root(sweep.specs[0].cfg) if sweep.specs else None
    print(describe(sweep, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
