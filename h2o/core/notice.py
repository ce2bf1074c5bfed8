"""One line on stderr, once per process, for an older spelling that still works and the one that replaces it."""
from __future__ import annotations

import sys

_SAID: set[str] = set()


def notice(text: str) -> None:
    """Print ``notice: <text>`` on stderr the first time this process says ``text``."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"notice: {text}", file=sys.stderr, flush=True)
