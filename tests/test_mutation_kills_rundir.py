"""The run-dir lock's rules in one process (runner/core/rundir.py), for the mutation run (benchmarks/mutation.py,
group ``rundir``). ``flock`` locks belong to an open file description, so a second ``os.open`` of ``run.lock`` in
this process stands for another process holding it: the holder record, re-entrant holds, the refusal naming the
holder, a stale lock taken over, workers still writing after their owner ended, release and what it removes,
liveness (``crashed``) and default dir names."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
from datetime import datetime
from pathlib import Path

import pytest

from runner.core import rundir
from runner.core.errors import RunDirInUseError, RunDirLockError


@pytest.fixture(autouse=True)
def _clean():
    yield
    rundir.release_all()


def _other_holder(d: Path, holder=None, mode=fcntl.LOCK_EX, name=rundir.LOCK_NAME) -> int:
    """Another 'process' holding ``d/<name>`` (an own open file description), with ``holder`` written in it."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / name, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, mode | fcntl.LOCK_NB)
    if holder is not None:
        os.pwrite(fd, json.dumps(holder).encode(), 0)
    return fd


OTHER = {"pid": 4242, "host": "elsewhere", "started_at": "2026-01-01T00:00:00", "command": "python -m runner",
         "token": "t" * 32}


def test_holder_record_names_this_process():
    rec = rundir.holder_record("tok")
    assert rec["pid"] == os.getpid() and rec["host"] == socket.gethostname() and rec["token"] == "tok"
    assert rec["command"] == shlex.join(sys.orig_argv), "the command line as typed (python -m ...)"
    assert rec["cwd"] == os.getcwd()
    assert datetime.fromisoformat(rec["started_at"]).utcoffset().total_seconds() == 0
    assert list(rec) == ["pid", "host", "started_at", "command", "cwd", "token"]


def test_describe():
    assert rundir.describe(None) == "a process that has not recorded itself yet"
    assert rundir.describe({}) == "a process that has not recorded itself yet"
    assert rundir.describe(OTHER) == ("pid 4242 on host elsewhere, started 2026-01-01T00:00:00, command: "
                                      "python -m runner")


def test_lock_record():
    lock = rundir.RunLock(dir=Path("/x"), holder={"token": "a"})
    assert lock.record() == {"file": "run.lock", "holder": {"token": "a"}, "enforced": True}
    assert lock.token == "a"
    lock = rundir.RunLock(dir=Path("/x"), holder={"token": "a"}, took_over=OTHER, enforced=False, reason="nfs")
    assert lock.record() == {"file": "run.lock", "holder": {"token": "a"}, "enforced": False, "reason": "nfs",
                             "took_over": OTHER}


def test_acquire_writes_the_holder_holds_reentrantly_and_the_last_release_removes_the_file(tmp_path):
    d = tmp_path / "a" / "b"
    lock = rundir.acquire(d)
    assert d.is_dir() and lock.enforced and lock.took_over is None and lock.count == 1
    text = (d / "run.lock").read_text()
    assert text.endswith("\n") and json.loads(text) == lock.holder
    assert lock.holder["pid"] == os.getpid() and len(lock.token) == 32
    assert rundir.held(d) is lock and rundir.run_token(d) == lock.token
    assert rundir.lock_state(d) == (lock.holder, True)
    assert rundir.acquire(d) is lock and lock.count == 2
    rundir.release(lock)
    assert (d / "run.lock").exists() and rundir.held(d) is lock
    rundir.release(lock)
    assert not (d / "run.lock").exists() and rundir.held(d) is None and rundir.run_token(d) is None
    rundir.release(None)
    assert rundir.lock_state(d) == (None, False)
    again = rundir.acquire(d)
    assert again is not lock and again.took_over is None


def test_acquire_without_create_holds_no_missing_dir(tmp_path):
    assert rundir.acquire(tmp_path / "missing", create=False) is None
    assert not (tmp_path / "missing").exists()
    assert rundir.acquire(tmp_path, create=False) is not None


def test_a_held_dir_is_refused_naming_the_holder_and_the_key(tmp_path):
    d = tmp_path / "held"
    fd = _other_holder(d, OTHER)
    try:
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d, wait_s=0.1, key="hydra.run.dir")
        msg = str(e.value)
        assert msg == (f"run dir {d} (hydra.run.dir) is in use by another run: {rundir.describe(OTHER)} (lock file "
                       f"{d / 'run.lock'}); two runs writing into one dir would mix their artifacts and records; "
                       f"{rundir.FIX}")
        assert json.loads((d / "run.lock").read_text()) == OTHER, "a refused run never touches the holder's file"
        assert rundir.lock_state(d) == (OTHER, True)
    finally:
        os.close(fd)


def test_a_dead_holder_on_this_host_with_a_live_child_is_named(tmp_path):
    d = tmp_path / "held"
    gone = {**OTHER, "host": socket.gethostname(), "pid": 2 ** 22 + 12345}
    fd = _other_holder(d, gone)
    try:
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d, wait_s=0)
        assert str(e.value) == (f"run dir {d} is in use by another run: {rundir.describe(gone)} (that process is "
                                f"gone, but a child process it started still holds the lock) (lock file "
                                f"{d / 'run.lock'}); two runs writing into one dir would mix their artifacts and "
                                f"records; {rundir.FIX}")
    finally:
        os.close(fd)


def test_a_live_holder_on_this_host_gets_no_note_and_a_late_record_is_waited_for(tmp_path):
    import threading

    d = tmp_path / "live"
    live = {**OTHER, "host": socket.gethostname(), "pid": os.getpid()}
    fd = _other_holder(d, None)
    threading.Timer(0.3, lambda: os.pwrite(fd, json.dumps(live).encode(), 0)).start()
    try:
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d, wait_s=0)
        assert str(e.value) == (f"run dir {d} is in use by another run: {rundir.describe(live)} (lock file "
                                f"{d / 'run.lock'}); two runs writing into one dir would mix their artifacts and "
                                f"records; {rundir.FIX}"), "the holder's record, written late, is waited for"
    finally:
        os.close(fd)


def test_a_stale_lock_is_taken_over_and_recorded(tmp_path):
    d = tmp_path / "stale"
    d.mkdir()
    (d / "run.lock").write_text(json.dumps(OTHER))
    lock = rundir.acquire(d)
    assert lock.took_over == OTHER and lock.record()["took_over"] == OTHER
    assert json.loads((d / "run.lock").read_text()) == lock.holder


def test_workers_of_an_ended_run_still_writing_refuse_the_dir(tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    (d / "run.lock").write_text(json.dumps(OTHER))
    fd = _other_holder(d, None, fcntl.LOCK_SH, rundir.WORKERS_NAME)
    try:
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d)
        assert str(e.value) == (f"run dir {d}: the run of {rundir.describe(OTHER)} ended, but its data-parallel "
                                f"workers still write into it (they hold {d / 'workers.lock'}); {rundir.FIX}")
        assert json.loads((d / "run.lock").read_text()) == OTHER, "the stale record stays for the next try"
        (d / "run.lock").write_text("")
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d)
        assert str(e.value).startswith(f"run dir {d}: an earlier run ended")
    finally:
        os.close(fd)
    lock = rundir.acquire(d)
    assert lock.took_over is None
    rundir.release(lock)
    assert not (d / "workers.lock").exists() and not (d / "run.lock").exists()


def test_release_keeps_a_workers_lock_a_worker_holds(tmp_path):
    d = tmp_path / "k"
    lock = rundir.acquire(d)
    fd = _other_holder(d, None, fcntl.LOCK_SH, rundir.WORKERS_NAME)
    try:
        rundir.release(lock)
        assert (d / "workers.lock").exists() and not (d / "run.lock").exists()
    finally:
        os.close(fd)


def test_an_unwritable_dir_is_a_lock_error(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirLockError) as e:
        rundir.acquire(f / "run", key="output.dir")
    assert str(e.value).startswith(f"cannot create or write the run dir {f / 'run'} (output.dir) (")
    with pytest.raises(RunDirLockError) as e:
        rundir.acquire(f / "run")
    assert str(e.value) == (f"cannot create or write the run dir {f / 'run'} (NotADirectoryError: Not a "
                            "directory); fix: choose a dir whose parents are folders you can write (hydra.run.dir=<dir> or "
                            "output.dir=<dir>)")
    assert "fix: choose a dir whose parents are folders you can write" in str(e.value)


def test_read_holder(tmp_path):
    assert rundir.read_holder(tmp_path) is None
    (tmp_path / "run.lock").write_text("")
    assert rundir.read_holder(tmp_path) is None
    (tmp_path / "run.lock").write_text("[1, 2]")
    assert rundir.read_holder(tmp_path) is None
    (tmp_path / "run.lock").write_text("{not json")
    assert rundir.read_holder(tmp_path) == {"unreadable": "{not json"}
    (tmp_path / "run.lock").write_text(json.dumps(OTHER))
    assert rundir.read_holder(tmp_path) == OTHER


def test_join_the_run_that_holds_the_dir_and_leave(tmp_path):
    d = tmp_path / "j"
    fd = _other_holder(d, OTHER)
    try:
        with pytest.raises(RunDirInUseError) as e:
            rundir.join(d, "other-token")
        assert str(e.value) == (f"data-parallel worker: run dir {d} is not held by its run (token other-token); "
                                f"it is held by {rundir.describe(OTHER)}; {rundir.FIX}")
        assert rundir.join(d, OTHER["token"]) == OTHER["token"]
        assert rundir.run_token(d) == OTHER["token"]
        assert rundir.join(d, None) == OTHER["token"] and rundir.join(d, OTHER["token"]) == OTHER["token"]
        assert (d / "workers.lock").exists()
        rundir.leave(d)
        assert rundir.run_token(d) is None
        assert (d / "workers.lock").exists(), "the owner still holds run.lock: workers.lock stays"
    finally:
        os.close(fd)


def test_join_a_dir_no_run_holds_is_refused(tmp_path):
    with pytest.raises(RunDirInUseError) as e:
        rundir.join(tmp_path / "free" / "nested", None)
    assert "is not held by its run (token None); it is held by no run" in str(e.value)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunDirLockError) as e:
        rundir.join(f / "run", None)
    assert str(e.value) == (f"cannot create or write the run dir {f / 'run'} (NotADirectoryError: Not a "
                            "directory); fix: choose a dir whose parents are folders you can write (hydra.run.dir=<dir> or "
                            "output.dir=<dir>)")


def test_a_reused_worker_joins_the_next_run_of_the_same_dir(tmp_path):
    d = tmp_path / "ray"
    fd = _other_holder(d, OTHER)
    old = os.umask(0o022)
    try:
        assert rundir.join(d, OTHER["token"]) == OTHER["token"]
        assert os.stat(d / "workers.lock").st_mode & 0o777 == 0o644
        nxt = {**OTHER, "token": "n" * 32}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(nxt).encode(), 0)
        assert rundir.join(d, None) == OTHER["token"], "without a token: the run this worker joined"
        assert rundir.join(d, nxt["token"]) == nxt["token"]
        assert rundir.run_token(d) == nxt["token"]
    finally:
        os.umask(old)
        os.close(fd)


def test_a_holder_that_recorded_no_token_is_joined_with_none(tmp_path):
    d = tmp_path / "old"
    fd = _other_holder(d, {k: v for k, v in OTHER.items() if k != "token"})
    try:
        assert rundir.join(d, None) == ""
        assert rundir.run_token(d) == ""
    finally:
        os.close(fd)


@pytest.mark.parametrize("code,joins", [("ENOLCK", True), ("EIO", False)])
def test_join_where_workers_lock_cannot_be_locked(tmp_path, monkeypatch, code, joins):
    import errno

    d = tmp_path / "w"
    fd = _other_holder(d, OTHER)
    real = fcntl.flock

    def flock(f, op):
        if op & fcntl.LOCK_SH and os.readlink(f"/proc/self/fd/{f}").endswith("workers.lock"):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(f, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        if joins:  # no flock on this filesystem: joined all the same
            assert rundir.join(d, OTHER["token"]) == OTHER["token"]
        else:
            with pytest.raises(RunDirLockError) as e:
                rundir.join(d, OTHER["token"])
            assert str(e.value).startswith(f"cannot create or write the run dir {d} (OSError: ")
            assert rundir.run_token(d) is None
    finally:
        os.close(fd)


def test_the_last_worker_leaving_after_its_owner_removes_workers_lock(tmp_path):
    d = tmp_path / "last"
    fd = _other_holder(d, OTHER)
    rundir.join(d, OTHER["token"])
    os.close(fd)  # the owner is gone
    rundir.leave(d)
    assert not (d / "workers.lock").exists()
    rundir.leave(d)  # twice: nothing


def test_join_in_the_owner_process_returns_its_token(tmp_path):
    lock = rundir.acquire(tmp_path / "own")
    assert rundir.join(tmp_path / "own", "whatever") == lock.token
    assert not (tmp_path / "own" / "workers.lock").exists()


def test_release_after_release_all_is_harmless(tmp_path):
    lock = rundir.acquire(tmp_path / "a")
    rundir.release_all()
    rundir.release(lock)
    assert rundir.held(tmp_path / "a") is None


def test_release_all_drops_every_hold_and_join(tmp_path):
    a = rundir.acquire(tmp_path / "a")
    rundir.acquire(tmp_path / "a")
    fd = _other_holder(tmp_path / "b", OTHER)
    try:
        rundir.join(tmp_path / "b", OTHER["token"])
        rundir.release_all()
        assert a.count == 0 and rundir.held(tmp_path / "a") is None and not (tmp_path / "a" / "run.lock").exists()
        assert rundir.run_token(tmp_path / "b") is None
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------- liveness


def test_effective_status(tmp_path):
    own = {"pid": os.getpid(), "host": socket.gethostname(), "token": "t" * 32}
    running = {"status": "running", "owner": own}
    assert rundir.effective_status(tmp_path, running) == "crashed"
    assert rundir.effective_status(tmp_path, {"status": "completed", "owner": own}) == "completed"
    assert rundir.effective_status(tmp_path, {}) is None
    fd = _other_holder(tmp_path, OTHER)
    try:
        assert rundir.effective_status(tmp_path, running) == "running", "the run of that token holds the dir"
        assert rundir.owner_alive(tmp_path, {"status": "running", "owner": {"token": "other"}}) is False
        assert rundir.owner_alive(tmp_path, {"status": "running", "owner": {}}) is True
    finally:
        os.close(fd)


def test_a_dead_owner_with_live_workers_is_alive(tmp_path):
    (tmp_path / "run.lock").write_text(json.dumps(OTHER))
    doc = {"status": "running", "owner": {"token": OTHER["token"], "pid": 1, "host": "x"}}
    assert rundir.owner_alive(tmp_path, doc) is False
    fd = _other_holder(tmp_path, None, fcntl.LOCK_SH, rundir.WORKERS_NAME)
    try:
        assert rundir.owner_alive(tmp_path, doc) is True
        assert rundir.owner_alive(tmp_path, {**doc, "owner": {**doc["owner"], "token": "other"}}) is False
    finally:
        os.close(fd)


def test_without_enforced_locks_the_owner_pid_on_this_host_decides(tmp_path):
    here = socket.gethostname()
    doc = {"status": "running", "lock": {"enforced": False}, "owner": {"pid": os.getpid(), "host": here}}
    assert rundir.owner_alive(tmp_path, doc) is True
    assert rundir.owner_alive(tmp_path, {**doc, "owner": {"pid": os.getpid(), "host": "elsewhere"}}) is False
    assert rundir.owner_alive(tmp_path, {**doc, "owner": {"pid": 2 ** 22 + 12345, "host": here}}) is False


def test_pid_alive():
    assert rundir._pid_alive(os.getpid()) is True and rundir._pid_alive(str(os.getpid())) is True
    assert rundir._pid_alive(None) is False and rundir._pid_alive("x") is False
    assert rundir._pid_alive(2 ** 22 + 12345) is False
    import signal
    import subprocess
    import time

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        time.sleep(0.2)
        assert rundir._pid_alive(child.pid) is True
        time.sleep(0.2)
        assert child.poll() is None, "the liveness probe sends no signal (0), it never ends the process"
    finally:
        child.kill()
        child.wait()


# ------------------------------------------------------------------------------------------ default dirs


def test_new_dir_takes_the_next_free_suffix(tmp_path):
    parent = tmp_path / "p" / "q"
    assert rundir.new_dir(parent, "run") == parent / "run"
    assert rundir.new_dir(parent, "run") == parent / "run-1"
    assert rundir.new_dir(parent, "run") == parent / "run-2"
    d = rundir.new_dir(parent)
    datetime.strptime(d.name, "%Y-%m-%d_%H-%M-%S-%f")
    assert rundir.pid_resolver() == str(os.getpid())


def test_new_dir_gives_up_after_ten_thousand_names(tmp_path):
    (tmp_path / "run").mkdir()
    for n in range(1, 10000):
        (tmp_path / f"run-{n}").mkdir()
    with pytest.raises(FileExistsError) as e:
        rundir.new_dir(tmp_path, "run")
    assert str(e.value) == f"no free name run-<n> under {tmp_path}"


def test_a_filesystem_without_flock_is_held_unenforced_with_a_warning(tmp_path, monkeypatch, caplog):
    import errno
    import logging

    real = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX and os.readlink(f"/proc/self/fd/{fd}").endswith("run.lock"):
            raise OSError(errno.ENOLCK, "No locks available")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    d = tmp_path / "nfs"
    with caplog.at_level(logging.WARNING, logger="runner"):
        lock = rundir.acquire(d)
    reason = f"OSError: No locks available (flock on {d / 'run.lock'})"
    assert lock.enforced is False and lock.reason == reason and lock.fd is None and lock.dir == d
    assert lock.holder["pid"] == os.getpid() and len(lock.token) == 32
    assert rundir.held(d) is lock and rundir.acquire(d) is lock and lock.count == 2
    assert lock.record() == {"file": "run.lock", "holder": lock.holder, "enforced": False, "reason": reason}
    assert rundir.lock_state(d) == (lock.holder, True)
    (rec,) = [r for r in caplog.records if "NOT protected" in r.getMessage()]
    assert rec.name == "runner" and rec.getMessage() == (
        f"run dir {d}: this filesystem has no file locks ({reason}); the run dir is NOT protected against a "
        "second run writing into it")
