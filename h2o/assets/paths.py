"""Where the harness keeps what it fetches: one cache folder outside git.

``CACHE_DIR`` is ``$H2O_CACHE`` when set, else ``~/.cache/h2o``. It is read when this module is
imported; the helpers below re-read the environment on every call, so a test (or a user) that sets
``H2O_CACHE`` later still gets the folder it asked for.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[2]  # the project root: conf/ and tasks/ live here


def cache_dir() -> Path:
    """The cache folder (``$H2O_CACHE`` or ``~/.cache/h2o``), created if missing."""
    path = Path(os.environ.get("H2O_CACHE") or Path.home() / ".cache" / "h2o").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


CACHE_DIR: Path = Path(os.environ.get("H2O_CACHE") or Path.home() / ".cache" / "h2o").expanduser()


@contextlib.contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold an exclusive lock ``<cache>/.locks/<name>.lock`` so two processes never fetch at once."""
    lock_dir = cache_dir() / ".locks"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (no half-written files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
