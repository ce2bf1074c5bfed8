"""One line on stderr, once per process, for an input spelled a second way: what was given and the spelling to use."""
from __future__ import annotations

import sys

_SAID: set[str] = set()


def notice(text: str) -> None:
    """Print ``notice: <text>`` on stderr the first time this process says ``text``."""
    if text not in _SAID:
        _SAID.add(text)
        print(f"notice: {text}", file=sys.stderr, flush=True)
