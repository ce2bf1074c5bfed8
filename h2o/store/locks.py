"""Locks and durable writes that hold on shared filesystems (Lustre, NFS) as well as on a local disk.

    with folder_lock(run_folder, wait=False) as mine:     # mine: False when another process holds it
        ...
    durable_replace(tmp, final)                           # fsync file + folder before and after os.replace

``flock`` is used where it works. Where it fails with ENOSYS / EOPNOTSUPP / ENOLCK (Lustre mounted
``noflock``, some NFS setups), or when ``H2O_LOCK=file`` says so (Lustre ``localflock``: flock works but only
within one node), the lock is an ``O_CREAT | O_EXCL`` file ``<folder>/.claim`` holding the holder's host, PID
and a heartbeat that a thread rewrites every ``H2O_LOCK_STALE_S / 10`` seconds. A lock file is stale, and is
broken, when its heartbeat is older than ``H2O_LOCK_STALE_S`` (default 600 s, generous for clock skew between
nodes) or when its holder is a dead PID on this very host.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)
CLAIM = ".claim"
MODES = ("auto", "flock", "file")


def lock_mode() -> str:
    """``H2O_LOCK``; a ConfigError (checked at the start of a run, h2o.pipeline.spec) unless one of MODES."""
    from h2o.core.validate import ConfigError

    mode = os.environ.get("H2O_LOCK", "auto")
    if mode not in MODES:
        raise ConfigError(f"H2O_LOCK={mode!r}: allowed: {', '.join(MODES)} (or unset: auto)")
    return mode


def stale_after() -> float:
    """``H2O_LOCK_STALE_S`` in seconds; a ConfigError unless a number > 0."""
    from h2o.core.validate import ConfigError, is_number

    text = os.environ.get("H2O_LOCK_STALE_S", "600")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not is_number(value) or value <= 0:
        raise ConfigError(f"H2O_LOCK_STALE_S={text!r}: expected seconds, a number > 0 (or unset: 600)")
    return value


# ------------------------------------------------------------------------------------------ durable writes
def fsync_dir(folder: Path) -> None:
    """fsync a folder so that a rename or a new entry in it survives a crash (no-op where not supported)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def durable_write(path: Path, data: bytes) -> None:
    """Write ``data`` through a temporary file: fsync it and the folder, rename, fsync the folder again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)
    os.replace(tmp, path)
    fsync_dir(path.parent)


# ------------------------------------------------------------------------------------------ the lock file
def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}


def read_holder(lock: Path) -> dict | None:
    """The lock file's content, or None (missing, or torn while its holder wrote it)."""
    try:
        return json.loads(lock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(holder: dict | None, lock: Path) -> bool:
    """A lock whose heartbeat is too old, or whose holder is a dead PID on this host."""
    if holder is None:  # unreadable: judge by the file's age (a holder writes its content right away)
        try:
            return time.time() - lock.stat().st_mtime > stale_after()
        except FileNotFoundError:
            return True
    if time.time() - float(holder.get("heartbeat", 0)) > stale_after():
        return True
    return holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1)))


class FileLock:
    """An O_EXCL lock file with a heartbeat thread. ``acquire()`` returns False when someone else holds it."""

    def __init__(self, lock: Path):
        self.lock = Path(lock)
        self.fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        data = json.dumps(_holder()).encode()
        os.pwrite(self.fd, data.ljust(256), 0)  # fixed length: a rewrite never leaves a longer tail behind
        os.fsync(self.fd)

    def _break_stale(self) -> bool:
        """Move a stale lock aside (one process wins the rename); True if it is gone now."""
        holder = read_holder(self.lock)
        if not is_stale(holder, self.lock):
            return False
        aside = self.lock.with_name(f"{self.lock.name}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.lock, aside)
        except FileNotFoundError:
            return True
        if read_holder(aside) != holder:  # another process replaced the stale lock meanwhile: put it back
            with contextlib.suppress(OSError):
                os.link(aside, self.lock)
            aside.unlink(missing_ok=True)
            return False
        aside.unlink(missing_ok=True)
        return True

    def acquire(self) -> bool:
        self.lock.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                self.fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._break_stale():
                    continue
                return False
            self._write()
            fsync_dir(self.lock.parent)
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()
            return True
        return False

    def _beat(self) -> None:
        period = max(stale_after() / 10, 0.05)
        while not self._stop.wait(period):
            with contextlib.suppress(OSError):
                self._write()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            holder = read_holder(self.lock)
            if holder and holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid():
                self.lock.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ one entry point
@contextlib.contextmanager
def folder_lock(folder: Path, wait: bool = False, poll_s: float = 0.5) -> Iterator[bool]:
    """Hold ``folder``'s lock: flock on ``<folder>/.lock`` where it works, else the O_EXCL file ``.claim``.

    ``wait=False`` yields False at once when another process holds it; ``wait=True`` blocks until it is free.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mode = lock_mode()
    if mode != "file":
        with open(folder / ".lock", "w") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            except OSError as exc:
                if exc.errno not in NO_FLOCK or mode == "flock":
                    raise
            else:
                try:
                    yield True
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
                return
    lock = FileLock(folder / CLAIM)
    while not lock.acquire():
        if not wait:
            yield False
            return
        time.sleep(poll_s)
    try:
        yield True
    finally:
        lock.release()


def append_line(path: Path, line: str) -> None:
    """Append one line in a single write (O_APPEND), under flock where flock works; fsync'd."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line.rstrip("\n") + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        locked = False
        if lock_mode() != "file":
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                locked = True
            except OSError as exc:
                if exc.errno not in NO_FLOCK or lock_mode() == "flock":
                    raise
        os.write(fd, data)
        os.fsync(fd)
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
