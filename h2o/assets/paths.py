"""Where the harness keeps what it fetches: one cache folder outside git.

``CACHE_DIR`` is ``$H2O_CACHE`` when set, else ``~/.cache/h2o``. It is read when this module is
imported; the helpers below re-read the environment on every call, so a test (or a user) that sets
``H2O_CACHE`` later still gets the folder it asked for.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]  # the project root: conf/ and tasks/ live here
# ... in a checkout; a wheel ships them inside the package as h2o/conf and h2o/lm_tasks (setup.py).
_CHECKOUT = (REPO / "conf" / "config.yaml").is_file()
CONF = REPO / "conf" if _CHECKOUT else REPO / "h2o" / "conf"
TASKS = REPO / "tasks" if _CHECKOUT else REPO / "h2o" / "lm_tasks"


def group_defaults(group: str, name: str) -> dict:
    """The group file's own values (``conf/<group>/<name>.yaml``), {} if there is no such file. Read once per
    version of the file (a sweep asks for the same files once per job); the caller gets its own copy."""
    path = CONF / group / f"{name}.yaml"
    return copy.deepcopy(_read_group_file(str(path), path.stat().st_mtime_ns)) if path.exists() else {}


@functools.lru_cache(maxsize=None)
def _read_group_file(path: str, mtime_ns: int) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def cache_dir() -> Path:
    """The cache folder (``$H2O_CACHE`` or ``~/.cache/h2o``), created if missing."""
    path = Path(os.environ.get("H2O_CACHE") or Path.home() / ".cache" / "h2o").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def calibration_file(model: str, given: str | None = None) -> Path:
    """kvquant's calibration file for ``model`` (a conf/model name or pretrained id): ``given`` when set (a
    relative path is taken inside the cache folder), else ``<cache>/kvquant/<model>.pt`` with ``:`` as ``-``
    (``tiny:llama`` -> ``tiny-llama.pt``), where ``python -m h2o.assets.calibrate --model <model>`` writes it."""
    if given:
        path = Path(str(given)).expanduser()
        return path if path.is_absolute() else cache_dir() / path
    return cache_dir() / "kvquant" / f"{model.replace(':', '-')}.pt"


CACHE_DIR: Path = Path(os.environ.get("H2O_CACHE") or Path.home() / ".cache" / "h2o").expanduser()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock on ``<cache>/.locks/<name>/`` so two processes never fetch at once (flock, or an
    O_EXCL lock file where flock does not work: h2o.store.locks)."""
    from h2o.store.locks import folder_lock

    with folder_lock(cache_dir() / ".locks" / name, wait=True):
        yield

