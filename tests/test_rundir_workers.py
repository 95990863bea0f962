"""The run-dir lock when a run's owner died while its data-parallel workers still write (``runner.core.rundir``).

Real processes, real ``flock``s: an owner process takes ``run.lock`` (:func:`runner.core.rundir.acquire`), a
worker process joins the run (:func:`runner.core.rundir.join`, a shared lock on ``workers.lock``), the owner is
killed with SIGKILL (no cleanup runs). While the worker lives, the run is alive (a ``running`` manifest of that
run is not ``crashed``), a new run is refused naming the workers, and the dead owner's record stays in
``run.lock``; once the worker is gone, the next run takes the dir over and records the dead owner.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Tuple

import pytest

from runner.core import rundir
from runner.core.errors import RunDirInUseError

REPO = Path(__file__).resolve().parent.parent

OWNER = textwrap.dedent("""
    import sys, time
    from runner.core import rundir
    lock = rundir.acquire(sys.argv[1], wait_s=0)
    print(lock.token, flush=True)
    time.sleep(600)
""")

WORKER = textwrap.dedent("""
    import sys, time
    from runner.core import rundir
    from runner.core.errors import RunDirInUseError
    try:
        tok = rundir.join(sys.argv[1], sys.argv[2] or None)
    except RunDirInUseError as e:
        print("refused:", e, flush=True)
        sys.exit(2)
    print("joined", tok, flush=True)
    if sys.argv[3] == "leave":
        rundir.leave(sys.argv[1])
        print("left", flush=True)
    time.sleep(600)
""")


def _py(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env)


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _owner_and_worker(d: Path) -> Tuple[subprocess.Popen, subprocess.Popen, str]:
    owner = _py(OWNER, str(d))
    token = owner.stdout.readline().strip()
    assert len(token) == 32, token
    worker = _py(WORKER, str(d), token, "stay")
    assert worker.stdout.readline().split() == ["joined", token]
    return owner, worker, token


def _manifest(pid: int, token: str) -> dict:
    return {"status": "running", "owner": {"pid": pid, "host": socket.gethostname(), "token": token},
            "lock": {"enforced": True}}


def test_dead_owner_with_a_live_worker_keeps_the_run_alive_and_the_dir_refused(tmp_path):
    d = tmp_path / "run"
    owner, worker, token = _owner_and_worker(d)
    try:
        os.kill(owner.pid, signal.SIGKILL)
        assert owner.wait(timeout=30) == -signal.SIGKILL
        holder, busy = rundir.lock_state(d)
        assert busy is False and holder["pid"] == owner.pid and holder["token"] == token
        # the run lives on in its worker: its manifest reads running; another run's manifest in the dir is dead
        assert rundir.owner_alive(d, _manifest(owner.pid, token)) is True
        assert rundir.effective_status(d, _manifest(owner.pid, token)) == "running"
        assert rundir.effective_status(d, _manifest(owner.pid, "another-run")) == "crashed"
        with pytest.raises(RunDirInUseError) as e:
            rundir.acquire(d, wait_s=0)
        msg = str(e.value)
        assert "data-parallel workers still write" in msg and str(d / "workers.lock") in msg
        assert f"pid {owner.pid}" in msg and "fix:" in msg
        assert rundir.held(d) is None
        # the refused run left the dead owner's record as it was (the next try takes it over, naming it)
        assert json.loads((d / "run.lock").read_text())["token"] == token
        # a late worker cannot join a run whose owner is gone
        late = _py(WORKER, str(d), token, "stay")
        line = late.stdout.readline()
        assert late.wait(timeout=20) == 2 and line.startswith("refused:") and "held by no run" in line
    finally:
        _stop(owner, worker)
    # the worker is gone too: the run is dead, and the next run takes the dir over, recording the dead owner
    assert rundir.effective_status(d, _manifest(owner.pid, token)) == "crashed"
    lock = rundir.acquire(d, wait_s=0)
    try:
        assert lock.took_over["pid"] == owner.pid and lock.took_over["token"] == token
        assert lock.record()["took_over"] == lock.took_over and lock.token != token
        assert json.loads((d / "run.lock").read_text())["token"] == lock.token
    finally:
        rundir.release(lock)
    assert not (d / "run.lock").exists() and not (d / "workers.lock").exists()


def test_worker_joins_only_the_run_that_holds_the_dir(tmp_path):
    d = tmp_path / "run"
    owner = _py(OWNER, str(d))
    token = owner.stdout.readline().strip()
    try:
        wrong = _py(WORKER, str(d), "not-" + token, "stay")
        line = wrong.stdout.readline()
        assert wrong.wait(timeout=60) == 2 and "not held by its run (token not-" in line
        assert f"pid {owner.pid}" in line
        # the live owner's run is alive; a manifest of another run in its dir is not
        assert rundir.effective_status(d, _manifest(owner.pid, token)) == "running"
        assert rundir.effective_status(d, _manifest(12345, "another-run")) == "crashed"
        # a worker that leaves while the owner lives keeps workers.lock (the owner's release removes it)
        w = _py(WORKER, str(d), "", "leave")
        assert w.stdout.readline().split() == ["joined", token]
        assert w.stdout.readline().strip() == "left"
        assert (d / "workers.lock").exists()
        # no worker holds it any more: a new run is refused by the live owner, not by workers
        with pytest.raises(RunDirInUseError, match="is in use by another run") as e:
            rundir.acquire(d, wait_s=0)
        assert f"pid {owner.pid}" in str(e.value)
        _stop(w)
    finally:
        _stop(owner)
    lock = rundir.acquire(d, wait_s=0)
    assert lock.took_over["token"] == token
    rundir.release(lock)
    assert not (d / "workers.lock").exists()


def test_worker_leaving_after_the_owner_died_removes_workers_lock_only_when_last(tmp_path):
    d = tmp_path / "run"
    owner, worker, token = _owner_and_worker(d)
    try:
        assert rundir.join(d, token) == token and rundir.run_token(d) == token  # this process: a second worker
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        rundir.leave(d)  # the other worker still holds it
        assert rundir.run_token(d) is None and (d / "workers.lock").exists()
        assert rundir.effective_status(d, _manifest(owner.pid, token)) == "running"
    finally:
        rundir.leave(d)
        _stop(owner, worker)
    assert rundir.effective_status(d, _manifest(owner.pid, token)) == "crashed"

    d2 = tmp_path / "run2"
    owner, worker, token = _owner_and_worker(d2)
    try:
        assert rundir.join(d2, token) == token
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=30)
        _stop(worker)
        rundir.leave(d2)  # the last process of the run
        assert not (d2 / "workers.lock").exists()
    finally:
        rundir.leave(d2)
        _stop(owner, worker)


def test_owner_that_ends_before_its_worker_leaves_the_dir_refused_to_the_next_run(tmp_path):
    d = tmp_path / "run"
    lock = rundir.acquire(d, wait_s=0)  # this process owns the run
    worker = _py(WORKER, str(d), lock.token, "stay")
    try:
        assert worker.stdout.readline().split() == ["joined", lock.token]
        rundir.release(lock)  # the owner ends while its worker still writes
        assert not (d / "run.lock").exists() and (d / "workers.lock").exists()
        with pytest.raises(RunDirInUseError, match="data-parallel workers still write"):
            rundir.acquire(d, wait_s=0)
    finally:
        _stop(worker)
    rundir.release(rundir.acquire(d, wait_s=0))
    assert not (d / "workers.lock").exists()
