"""Run-folder locks and records on a shared filesystem: flock where it works, the O_EXCL lock file where flock
fails with ENOSYS (Lustre ``noflock``), stale locks, finished() on torn records."""
import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from h2o.store import locks
from h2o.store.files import append_jsonl, read_jsonl
from h2o.store.folders import claim, finished

HOLD = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("locks", sys.argv[3])  # this module alone: no torch import
locks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(locks)
with locks.folder_lock(Path(sys.argv[1])) as mine:
    print("mine" if mine else "busy", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold(folder, seconds, env=None):
    """A second process that takes the folder's lock and keeps it for ``seconds``."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds), locks.__file__], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    assert proc.stdout.readline().strip() == "mine"
    return proc


@pytest.fixture
def no_flock(monkeypatch):
    """flock fails as on a Lustre client mounted noflock."""
    def enosys(*a, **k):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(fcntl, "flock", enosys)


def test_flock_excludes_another_process(tmp_path):
    proc = hold(tmp_path / "run", 30)
    try:
        with claim(tmp_path / "run") as mine:
            assert mine is False
    finally:
        proc.kill(), proc.wait()
    with claim(tmp_path / "run") as mine:  # released when its holder died
        assert mine is True


def test_enosys_falls_back_to_lock_file(tmp_path, no_flock):
    run = tmp_path / "run"
    with claim(run) as mine:
        assert mine is True
        holder = json.loads((run / locks.CLAIM).read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
        with claim(run) as again:  # held (by this live process): a second claim is refused
            assert again is False
    assert not (run / locks.CLAIM).exists()  # released
    append_jsonl(tmp_path / "jobs.jsonl", {"a": 1})  # appending works without flock too
    assert read_jsonl(tmp_path / "jobs.jsonl") == [{"a": 1}]


def test_lock_file_mode_excludes_another_process(tmp_path):
    env = {"H2O_LOCK": "file"}
    proc = hold(tmp_path / "run", 30, env)
    try:
        os.environ["H2O_LOCK"] = "file"
        with claim(tmp_path / "run") as mine:
            assert mine is False
    finally:
        os.environ.pop("H2O_LOCK")
        proc.kill(), proc.wait()
    with claim(tmp_path / "run") as mine:  # the holder's PID is dead on this host: its lock is stale
        pass
    os.environ["H2O_LOCK"] = "file"
    try:
        with claim(tmp_path / "run") as mine:
            assert mine is True
    finally:
        os.environ.pop("H2O_LOCK")


def test_stale_heartbeat_is_broken_and_live_one_is_kept(tmp_path, no_flock, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    other = {"host": "node-17", "pid": 4242, "heartbeat": time.time()}
    (run / locks.CLAIM).write_text(json.dumps(other))
    with claim(run) as mine:  # another node, fresh heartbeat: held
        assert mine is False
    other["heartbeat"] = time.time() - 601  # older than H2O_LOCK_STALE_S (600): its holder is gone
    (run / locks.CLAIM).write_text(json.dumps(other))
    with claim(run) as mine:
        assert mine is True
        assert json.loads((run / locks.CLAIM).read_text())["pid"] == os.getpid()


def test_heartbeat_advances_while_held(tmp_path, no_flock, monkeypatch):
    monkeypatch.setenv("H2O_LOCK_STALE_S", "1")  # heartbeat every 0.1 s
    run = tmp_path / "run"
    with claim(run) as mine:
        assert mine
        first = json.loads((run / locks.CLAIM).read_text())["heartbeat"]
        time.sleep(0.5)
        later = json.loads((run / locks.CLAIM).read_text())["heartbeat"]
        assert later > first
        assert not locks.is_stale(json.loads((run / locks.CLAIM).read_text()), run / locks.CLAIM)


@pytest.mark.parametrize("content,done", [
    (None, False), ("", False), ('{"model": "m", "metr', False), ("[]", False),
    ('{"model": "m", "task": "t", "policy": "h2o", "metrics": {"acc": 0.5}, "n_samples": 3}', False),
    ('{"model": "m", "task": "t", "policy": "h2o", "metrics": {"acc": 0.5}, "n_samples": 3, "wall_s": 1.0}', True),
])
def test_finished_needs_a_complete_metrics_json(tmp_path, content, done):
    if content is not None:
        (tmp_path / "metrics.json").write_text(content)
    assert finished(tmp_path) is done


def test_durable_write_replaces_whole_and_leaves_no_tmp(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    locks.durable_write(tmp_path / "a.json", b"1")
    locks.durable_write(tmp_path / "a.json", b"22")
    assert (tmp_path / "a.json").read_bytes() == b"22"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
    assert len(synced) == 6  # per write: the file, the folder before and after the rename


def test_cache_lock_without_flock_uses_the_lock_file(tmp_path, no_flock, monkeypatch):
    from h2o.assets.paths import cache_lock

    monkeypatch.setenv("H2O_CACHE", str(tmp_path))
    with cache_lock("fetch-x"):
        assert (tmp_path / ".locks" / "fetch-x" / locks.CLAIM).exists()
    assert not (tmp_path / ".locks" / "fetch-x" / locks.CLAIM).exists()
