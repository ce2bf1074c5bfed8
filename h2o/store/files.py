"""Durable files: whole files written through a temporary file and a rename (never half-written), JSON and JSON
lines, and appends of one line in one write (several jobs of a sweep may append at once)."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from h2o.store.locks import append_line, durable_write
from h2o.store.strict_json import dumps  # strict JSON: an inf or nan written as null, named (its rule)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (no half-written files), fsync'd: the
    file and its folder before and after the rename (:func:`h2o.store.locks.durable_write`)."""
    durable_write(Path(path), text.encode("utf-8"))


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, dumps(obj, indent=2) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r, ensure_ascii=False) + "\n" for r in rows))


def append_jsonl(path: Path, row: dict) -> None:
    """Append one line in one write, fsync'd (several jobs of a sweep may write at once)."""
    append_line(Path(path), dumps(row))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file; a torn line (a writer killed mid-write) is left out."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line)) if line.strip() else None
    return rows
