"""Resume inside a run: per-request results are appended to ``<run>/partial/<name>.jsonl`` as they come, so a
preempted or timed-out run continues where it stopped instead of from zero.

    with recording(run_folder / "partial"):       # the runner, around task.run (h2o.pipeline.run.execute)
        log = RequestLog.open("windows")          # a task: None outside recording()
        if log and key in log: row = log[key]     # done before the interruption
        else: ...; log[key] = row                 # appended (one line, flushed) right away

Multiple-choice and generation tasks go through lm-eval: :func:`lm_eval_cache` hands lm-eval a request cache
(lm-eval's own ``CachingLM``, hashing each request) backed by such a JSONL file instead of SQLite, which does not
lock reliably on NFS/Lustre. A torn last line (the process killed mid-write) is ignored. The runner removes the
folder once metrics.json is written; the run folder's identity (its config) is what makes old lines valid.

Test hook: ``H2O_TEST_PAUSE_S`` sleeps that long after each appended result (a slow run to interrupt), in the
first attempt of a Slurm task only (``SLURM_RESTART_COUNT`` unset or 0).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

_FOLDER: list[Path] = []  # the partial folder of the run in progress (a stack: one entry while a run runs)
_OPENED: list["RequestLog"] = []  # the logs opened during the current recording


@contextlib.contextmanager
def recording(folder: Path) -> Iterator[Path]:
    _FOLDER.append(Path(folder))
    _OPENED.clear()
    try:
        yield Path(folder)
    finally:
        _FOLDER.pop()


def partial_file(name: str) -> Path | None:
    """``<partial>/<name>`` of the run being recorded (None outside :func:`recording`): a task's live output,
    removed with the folder once metrics.json is written."""
    return _FOLDER[-1] / name if _FOLDER else None


def resumed() -> int:
    """Results the current (or last) recorded run read back from before an interruption (metrics.json)."""
    return sum(log.resumed for log in _OPENED)


class RequestLog:
    """A dict of JSON results, persisted as one appended line per key (``{"k": key, "v": value}``)."""

    def __init__(self, path: Path, counted: bool = True):
        self.path = Path(path)
        self.rows: dict[str, Any] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    row = json.loads(line)
                    self.rows[row["k"]] = row["v"]
        self.resumed = len(self.rows)
        if counted:  # a log of results (resumed_requests); not a task's own bookkeeping (row_log)
            _OPENED.append(self)

    @classmethod
    def open(cls, name: str) -> "RequestLog | None":
        return cls(_FOLDER[-1] / f"{name}.jsonl") if _FOLDER else None

    def __contains__(self, key) -> bool:
        return str(key) in self.rows

    def __getitem__(self, key):
        return self.rows[str(key)]

    def __setitem__(self, key, value) -> None:
        self.rows[str(key)] = value
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"k": str(key), "v": value}, default=str) + "\n")
            fh.flush()
        pause = float(os.environ.get("H2O_TEST_PAUSE_S", "0") or 0)
        if pause and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep(pause)

    def update(self, rows: dict) -> None:
        """Several keys at once: one write, no test pause (a task's per-batch bookkeeping)."""
        if not rows:
            return
        self.rows.update({str(k): v for k, v in rows.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write("".join(json.dumps({"k": str(k), "v": v}, default=str) + "\n" for k, v in rows.items()))
            fh.flush()

    def get(self, key, default=None):
        return self.rows.get(str(key), default)

    def commit(self) -> None:  # lm-eval's CachingLM calls it (SqliteDict API); lines are written as they come
        pass


def row_log(name: str) -> "RequestLog | None":
    """A task's per-row bookkeeping kept across an interruption (``<partial>/<name>.jsonl``; None outside
    :func:`recording`): what a record's fields are computed from must cover the requests answered before the
    interruption too (lm-eval's request cache answers those without the model). Not counted in resumed()."""
    return RequestLog(_FOLDER[-1] / f"{name}.jsonl", counted=False) if _FOLDER else None


@contextlib.contextmanager
def lm_eval_cache() -> Iterator[str | None]:
    """The ``use_cache`` argument for lm-eval's simple_evaluate while a run records (else None): lm-eval wraps the
    model in its CachingLM, here backed by a RequestLog (``<partial>/lm_eval_rank<r>.db.jsonl``)."""
    if not _FOLDER:
        yield None
        return
    import lm_eval.api.model as lm_model

    class JsonlCachingLM(lm_model.CachingLM):
        def __init__(self, lm, cache_db: str):
            self.lm, self.cache_db = lm, cache_db
            self.dbdict = RequestLog(Path(cache_db + ".jsonl"))
            lm.set_cache_hook(self.get_cache_hook())

    original = lm_model.CachingLM
    lm_model.CachingLM = JsonlCachingLM
    try:
        yield str(_FOLDER[-1] / "lm_eval")
    finally:
        lm_model.CachingLM = original
