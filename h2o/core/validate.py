"""The one validation layer of every entry point: cheap checks of types, ranges and paths, run before any load.

    check(cond, "task.limit=0: expected a positive int or null")   # ConfigError (one line) unless cond
    check_types(SummarizationTask, options, "task")                # each option against the dataclass field's type
    output_file("--json", path)                                    # the file can be written (before the work)
    parser = ArgParser(prog="python -m h2o.bench")                 # argparse whose errors are one line, exit 2

    @guard                                                         # a BadInput -> "error: <one line>", exit 2
    def main(argv=None) -> int: ...

Every bad value raises a :class:`BadInput` (:class:`ConfigError` for config values, ``PolicyError`` for policy
options) whose message is one line naming the value and what is allowed. ``h2o.pipeline.plan.prepare`` (h2o-run,
h2o.pipeline.sweep), ``python -m h2o.bench``, ``python -m h2o.bench.streaming`` and ``h2o.tasks.lm_eval_cli``
all check through these helpers; ``python -m analysis`` (which imports nothing of h2o) mirrors the path rules.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

MAX_TOKENS = 2**40  # token counts above this overflow the policies' priority tiers (core/policies/base.TIER)
SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # a folder name written as is (no /, no .., no spaces)


class BadInput(ValueError):
    """Bad input of any entry point; the message is one line naming the value and what is allowed."""


class ConfigError(BadInput):
    """A bad config value (model, task, root keys, paths)."""


def check(cond: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``cond``."""
    if not cond:
        raise ConfigError(message)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in options and not type_ok(options[f.name], hints.get(f.name, Any)):
            raise ConfigError(f"{prefix}.{f.name}={options[f.name]!r}: expected {describe(hints[f.name])}")


# ------------------------------------------------------------------------------------------- paths
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


# ------------------------------------------------------------------------------------- command lines
def split_list(flag: str, text: str, parse: Callable[[str], Any], what: str) -> list:
    """``"a,b"`` -> ``[parse("a"), parse("b")]``; a bad or missing item -> ConfigError naming it and ``what``."""
    items = [x.strip() for x in str(text).split(",")]
    out = []
    for x in items:
        try:
            out.append(parse(x))
        except (ValueError, TypeError):
            raise ConfigError(f"{flag}={text!r}: {x!r} is not {what}") from None
    check(bool(out), f"{flag}={text!r}: empty; expected {what}")
    return out


def positive_int(text: str) -> int:
    """A command-line count: an int >= 1 (ValueError otherwise)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def budget_value(text: str) -> int | float:
    """A command-line budget: ``128`` (token count) or ``0.2`` (ratio); range checks are the policy's."""
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else float(text)


def choice(flag: str, values: list[str], allowed) -> list[str]:
    for v in values:
        check(v in allowed, f"{flag}: {v!r} unknown; allowed: {', '.join(allowed)}")
    return values


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are a ConfigError (with :func:`guard`: one line ``error: <prog>: ...``, exit 2)."""

    def error(self, message: str):  # noqa: D102 - argparse API
        raise ConfigError(f"{self.prog}: {message}")


def one_line(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A plain argparse ``parser`` whose errors exit 2 with one line ``error: <prog>: ...`` (no usage): for the
    CLIs that return their exit status without :func:`guard`."""
    parser.error = lambda message: sys.exit(fail(ConfigError(f"{parser.prog}: {message}")))
    return parser


def fail(exc: BaseException) -> int:
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


def guard(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a CLI ``main``: a BadInput anywhere in it prints one line and returns exit status 2."""

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except BadInput as exc:
            return fail(exc)

    return wrapped
