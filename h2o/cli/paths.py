"""Paths a command writes to, and names used as folders, checked before the work starts.

    output_dir("runs_dir", path)          # ConfigError (one line) unless the folder exists or can be created
    output_file("--json", path)           # the file can be written: not a folder, its folder creatable
    check_name("experiment_name", name)   # the safe character set of a folder name
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from h2o.core.validate import check

SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a folder name written as is (no /, no .., no spaces)


def check_name(key: str, value: Any) -> str:
    """A name used as a folder (experiment_name, --experiment): the safe character set, at most 80 characters."""
    text = value if isinstance(value, str) else ""
    check(bool(SAFE.fullmatch(text)) and len(text) <= 80,
          f"{key}={value!r}: allowed: 1-80 characters of A-Z a-z 0-9 _ . + - (not starting with . _ + -)")
    return text


def abbrev(value: Any, limit: int = 200, quote: bool = True) -> str:
    """``repr(value)`` (``str`` with ``quote=False``), cut to ``limit`` characters with its length named: a
    5,000-character path stays a short line."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(str(value))} characters)"


def path_error(path: str | os.PathLike) -> str | None:
    """Why the file system refuses to look ``path`` up (e.g. "File name too long"), None when it can."""
    try:
        Path(path).expanduser().exists()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def nearest_existing(path: Path) -> Path:
    probe = Path(path).expanduser().absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def output_dir(flag: str, path: str | os.PathLike, shown: Any = None) -> Path:
    """ConfigError unless the folder ``path`` exists or can be created (its nearest existing ancestor is a
    writable folder, no file on the way). The message names ``flag=shown`` (default: the path)."""
    name = f"{flag}={abbrev(str(path if shown is None else shown))}"
    check(str(path).strip() != "", f"{name}: empty; expected a folder path")
    why = path_error(path)
    check(why is None, f"{name}: {why}; expected a writable folder")
    probe = nearest_existing(Path(path))
    check(probe.is_dir(), f"{name}: {probe} is a file, not a folder; expected a writable folder")
    check(os.access(probe, os.W_OK | os.X_OK), f"{name}: {probe} is not writable; expected a writable folder")
    return Path(path)


def output_file(flag: str, path: str | os.PathLike) -> Path:
    """ConfigError unless the file ``path`` can be written: not a folder, its folder exists or can be created."""
    p = Path(path).expanduser()
    check(str(path).strip() != "" and not p.is_dir(), f"{flag}={str(path)!r}: expected a file path, not a folder")
    output_dir(flag, p.parent)
    check(not p.exists() or os.access(p, os.W_OK), f"{flag}={str(path)!r}: the file is not writable")
    return p
