"""What an entry point may change in the process that runs it, and how it puts it back.

Tests (and notebooks) call ``h2o-run``'s ``main``, ``python -m h2o.bench``'s and the other entry points in their own
process, so an entry point leaves the process as it found it (:func:`kept`):

    with kept():          # log handlers and levels, sys.argv and streams, environment, working folder, torch's
        hydra_main()      # thread count and default dtype: as they were, however the body ends

Hydra's logging configs bind a handler to the ``sys.stdout`` of that moment; a caller that closes that stream
afterwards (pytest's captured output) would otherwise see every later log line of the process fail with
"I/O operation on closed file". tests/conftest.py compares :func:`snapshot` before and after every test.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Iterator

# Set by pytest for each phase of each test, or by a library for the life of the process when first needed
# (torch's compiler cache, wandb's service, the tokenizers library at the first fork after it ran in parallel):
# not state an entry point changed
VOLATILE_ENV = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "WANDB_SERVICE", "TOKENIZERS_PARALLELISM")


def _ours(handler: logging.Handler) -> bool:
    """Whether a log handler belongs to the process rather than to pytest's own per-phase capture."""
    return not type(handler).__module__.startswith("_pytest")


def _loggers() -> dict[str, logging.Logger]:
    return {"": logging.getLogger(), **{name: lg for name, lg in logging.root.manager.loggerDict.items()
                                        if isinstance(lg, logging.Logger)}}


def snapshot() -> dict:
    """The process state an entry point must leave as it found it, as comparable values."""
    torch = sys.modules.get("torch")  # only where imported already: a torch-free command stays torch-free
    policies = sys.modules.get("h2o.core.policies.base")
    hydra = sys.modules.get("hydra.core.global_hydra")
    logs = {name: (lg.handlers[:], lg.level, lg.propagate, lg.disabled)
            for name, lg in _loggers().items()}
    return {"loggers": logs, "argv": list(sys.argv), "streams": (sys.stdout, sys.stderr, sys.stdin),
            "environ": {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}, "cwd": os.getcwd(),
            "torch_threads": torch and torch.get_num_threads(), "default_dtype": torch and torch.get_default_dtype(),
            "policies": policies and dict(policies.Policy.registry),
            "hydra": bool(hydra and hydra.GlobalHydra.instance().is_initialized())}


def _closed(handler: logging.Handler) -> bool:
    return bool(getattr(getattr(handler, "stream", None), "closed", False))


def changed(before: dict, after: dict) -> list[str]:
    """The names of what differs between two snapshots. A logger a library created since (on its first import) is
    no change, unless one of its handlers, like any logger's, writes to a closed stream."""
    out = [key for key in before if key != "loggers" and before[key] is not None and before[key] != after[key]]
    if before["environ"] != after["environ"]:
        keys = set(before["environ"]) ^ set(after["environ"])
        keys |= {k for k in before["environ"] if after["environ"].get(k, before["environ"][k]) != before["environ"][k]}
        out[out.index("environ")] = f"environ ({', '.join(sorted(keys))})"
    mine = lambda state: state and ([h for h in state[0] if _ours(h)], *state[1:])  # noqa: E731
    for name, state in after["loggers"].items():
        was, now = mine(before["loggers"].get(name)), mine(state)
        if (was is not None and was != now) or any(_closed(h) for h in now[0]):
            out.append(f"logger {name or 'root'!r}")
    return out


def restore(state: dict) -> None:
    """Put the process back as :func:`snapshot` saw it."""
    torch, policies = sys.modules.get("torch"), sys.modules.get("h2o.core.policies.base")
    hydra = sys.modules.get("hydra.core.global_hydra")
    for name, lg in _loggers().items():
        handlers, level, propagate, disabled = state["loggers"].get(name, ([], lg.level, lg.propagate, lg.disabled))
        for handler in [h for h in lg.handlers if _ours(h) and h not in handlers]:
            lg.removeHandler(handler)
        for handler in [h for h in handlers if h not in lg.handlers]:
            lg.addHandler(handler)
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled
    sys.argv[:] = state["argv"]
    sys.stdout, sys.stderr, sys.stdin = state["streams"]
    for key in [k for k in os.environ if k not in state["environ"] and k not in VOLATILE_ENV]:
        del os.environ[key]
    os.environ.update(state["environ"])
    os.chdir(state["cwd"])
    if torch is not None and state["torch_threads"]:  # None: torch was imported since, nothing to put back
        if torch.get_num_threads() != state["torch_threads"]:
            torch.set_num_threads(state["torch_threads"])
        torch.set_default_dtype(state["default_dtype"])
    if policies is not None and state["policies"] is not None:
        policies.Policy.registry.clear()
        policies.Policy.registry.update(state["policies"])
    if hydra is not None and hydra.GlobalHydra.instance().is_initialized() and not state["hydra"]:
        hydra.GlobalHydra.instance().clear()


class CurrentStream:
    """Writes to whichever ``sys.stdout`` or ``sys.stderr`` is current at each write."""

    def __init__(self, name: str):
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(text)

    def flush(self) -> None:
        getattr(sys, self.name).flush()

    def close(self) -> None:
        """Nothing: a handler that closes its stream when logging shuts its handlers down leaves sys's open."""


def import_submitit():
    """submitit, its log lines going to the streams current when each is written: its import configures handlers
    on the ``sys.stdout``/``sys.stderr`` of that moment, which a caller may have closed by the next line."""
    import submitit

    for handler in logging.getLogger("submitit").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler.stream, CurrentStream):
            handler.setStream(CurrentStream("stderr" if handler.level >= logging.WARNING else "stdout"))
    return submitit


def rouge_scorer():
    """rouge-score's scorer module, with absl's log handler (which its import brings) writing to the sys.stderr
    current at each line. absl binds its handler to the sys.stderr of its import and closes that stream when logging
    shuts its handlers down (Hydra's logging config does, at every run) unless it is the sys.stderr of that later
    moment: under pytest, the captured stderr of the whole worker, after which every test of the worker errors."""
    import absl.logging
    from rouge_score import rouge_scorer as module

    handler = absl.logging.get_absl_handler().python_handler
    if not isinstance(handler.stream, CurrentStream):
        handler.setStream(CurrentStream("stderr"))
    return module


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run the body, then put back what :func:`snapshot` covers, however the body ended."""
    state = snapshot()
    try:
        yield
    finally:
        restore(state)
