"""A task's local data file (``task.data_files``), read and checked against the task's own fields before any model
loads: one ``ConfigError`` line naming the file, the first bad document and what is allowed.

    rows = documents("task.data_files", path, ("Problem", "Answer"), "lm-eval task aime24")

The file is what lm-eval's ``json`` loader and the tasks' own readers take: JSON lines (one object a line), or one
JSON list of objects. Read once per file version (a sweep checks many runs of one file).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from h2o.cli.paths import abbrev
from h2o.core.validate import ConfigError


def documents(key: str, path, fields: tuple[str, ...], what: str) -> list[dict]:
    """The documents of the JSON file ``path``, each an object holding every one of ``fields``; ConfigError (one
    line, ``key=path``) for a file that is empty, not JSON, or whose first bad document lacks a field."""
    file = Path(str(path)).expanduser()
    allowed = f"allowed: a JSON lines file of documents with fields {', '.join(fields)} ({what})"
    name = f"{key}={abbrev(str(path))}"
    stat = file.stat()
    rows = _parsed(str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if isinstance(rows, str):
        raise ConfigError(f"{name}: {rows}; {allowed}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{name}: document {i} is {type(row).__name__}, not an object; {allowed}")
        lacks = [f for f in fields if f not in row]
        if lacks:
            has = ", ".join(abbrev(k, 40, quote=False) for k in list(row)[:8]) or "none"
            raise ConfigError(f"{name}: document {i} lacks {', '.join(map(repr, lacks))} (its fields: {has}); "
                              f"{allowed}")
    return rows


@lru_cache(maxsize=8)
def _parsed(path: str, size: int, mtime_ns: int) -> list | str:
    """The file's documents, or why it has none (empty, not JSON): JSON lines, or one JSON list."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    if not text.strip():
        return "empty (no documents)"
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"not JSON ({exc.msg}, line {exc.lineno})"
        return rows if rows else "an empty list (no documents)"
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                return f"line {number} is not JSON ({exc.msg})"
    return rows
