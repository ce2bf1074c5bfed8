"""Command-line arguments checked before any load: one line naming the bad value and what is allowed, exit 2.

    parser = ArgParser(prog="python -m h2o.bench")     # argparse whose errors are one line, exit 2 (with guard)

    @guard                                             # a BadInput -> "error: <one line>", exit 2
    def main(argv=None) -> int: ...

    split_list("--budgets", "0.1,0.2", budget_value, "a budget")   # [0.1, 0.2]; a bad item -> ConfigError

Every bad value raises a :class:`h2o.core.validate.BadInput` (``ConfigError`` for config values, ``PolicyError``
for policy options). ``h2o-run``, ``python -m h2o.bench``, ``python -m h2o.tasks.streaming_cli`` and
``h2o.tasks.lm_eval_cli`` all check through these helpers; ``python -m analysis`` (which imports nothing of h2o)
mirrors the path rules.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable

from h2o.core.validate import BadInput, ConfigError, check


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
    """Print ``error: <the message on one line>`` to stderr; returns the exit status of bad input, 2."""
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


def guard(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap a CLI ``main``: a BadInput anywhere in it prints one line and returns exit status 2; the process is
    left as the caller had it (:func:`h2o.cli.process.kept`)."""
    from h2o.cli.process import kept

    @functools.wraps(main)
    def wrapped(*args, **kwargs) -> int:
        with kept():
            try:
                return main(*args, **kwargs)
            except BadInput as exc:
                return fail(exc)

    return wrapped
