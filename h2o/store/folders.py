"""The run record's folder: where it is (a function of its config), and when it counts as finished.

Folder: ``<runs_dir>/<experiment_name>/<model>/<task>/shots<k>/<policy>/<budget>[/<extras>]`` where
``<budget>`` is the policy's budget (``0.2``; ``64tok`` for a token count; ``h0.15-r0.05`` for a hand split;
``1.0`` for full, whatever budget a sweep gave it) and ``<extras>`` lists, as ``key=value`` joined by ``,``,
every setting that differs from its group file's default (``limit=40``, ``sinks=8``, ``seed=1``,
``semantics=reference``, ...). Settings that cannot change a result (batch size, threads) are left out. Values are
spelled without loss (:func:`fmt`: floats by their shortest exact text, so 0.2000001 is not 0.2; text outside
``[A-Za-z0-9_.+-]`` gets a short hash); ``experiment_name`` must be in that set, and the folder stays inside
``runs_dir``. A finished record is reused only for its own normalised config (:mod:`h2o.store.identity`). Protocol settings (``scoring``, ``add_bos_token``) follow
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
from pathlib import Path
from typing import Any, Iterator

from h2o.assets.paths import group_defaults
from h2o.cli.paths import SAFE, check_name
from h2o.core.validate import check, is_number
from h2o.store.locks import folder_lock

IGNORED = {"_target_", "name", "batch_size", "device_map", "resources", "params", "positions",  # never in <extras>
           "attn_implementation"}
IN_PATH = {"task": {"shots"}, "policy": {"budget", "heavy", "recent"}, "model": set()}


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


UNSET_IS_DEFAULT = ("compress", "interval")  # make_policy reads None as not given


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
            if group == "policy" and key in UNSET_IS_DEFAULT and key not in base and node[key] is None:
                continue  # a schedule option added as null (a sweep's cell without it) is the policy's own default
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


# ------------------------------------------------------------------------------------------ state
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
    h2o.store.locks). Yields False if another process has it."""
    with folder_lock(path, wait=False) as mine:
        yield mine


def clear_partial(path: Path) -> None:
    """Remove what an interrupted attempt left (temporary files, a torn samples file)."""
    for f in path.glob(".*.tmp"):
        f.unlink(missing_ok=True)
    for name in ("samples.jsonl", "env.json"):
        (path / name).unlink(missing_ok=True)
