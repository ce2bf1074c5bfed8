"""The path rules of h2o.cli.paths for the analysis CLIs (analysis imports nothing of h2o): each check returns
the one-line error naming the flag and its value, or None.

    bad = folder_error("--runs", args.runs, "the root of the run records (e.g. runs/)") or writable_error("--out", out)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def one_line(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parser`` whose errors (an unknown flag, a bad choice) are one line ``error: <prog>: ...``, exit status 2,
    instead of the usage and the error."""
    def error(message: str):
        print(f"error: {parser.prog}: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = error
    return parser


def shown(flag: str, path) -> str:
    """``--flag='value'``, a value over 200 characters cut with its length named (the line stays short)."""
    text = repr(str(path))
    return f"{flag}={text if len(text) <= 200 else f'{text[:200]}... ({len(str(path))} characters)'}"


def lookup_error(path) -> str | None:
    """Why the file system refuses to look ``path`` up ("File name too long"), None when it can."""
    try:
        Path(path).exists()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def folder_error(flag: str, path, what: str) -> str | None:
    """Unless ``path`` is an existing folder: the error (``what``: what the folder should hold)."""
    why = lookup_error(path)
    if why is None and not Path(path).exists():
        why = "no such folder"
    elif why is None and not Path(path).is_dir():
        why = "a file, not a folder"
    return f"{shown(flag, path)}: {why}; expected {what}" if why else None


def writable_error(flag: str, path) -> str | None:
    """Unless ``path`` is a folder that exists or can be created (its nearest existing ancestor is a writable
    folder): the error."""
    why = lookup_error(path)
    if why is not None:
        return f"{shown(flag, path)}: {why}; expected a writable folder"
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        why = "is a file, not a folder" if not probe.is_dir() else "is not writable"
        return f"{shown(flag, path)}: {probe} {why}; expected a writable folder"
    return None
