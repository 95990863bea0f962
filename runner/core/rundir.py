"""One run per run dir, unique default dirs, and whether a run a manifest says is ``running`` is still alive.

**The lock.** A run holds an exclusive ``flock`` on ``<run dir>/run.lock`` for its whole life, taken before
anything in the dir is read for a resume or written: ``python -m runner`` takes it in a Hydra callback
(:class:`runner.app.jobs.RunDirLockCallback`) before Hydra writes ``.hydra/`` and the job log there, and
:func:`runner.app.execute.run` takes it (re-entrantly) for in-process callers. The file names its holder: pid, host,
start time, command and a token naming the run. A second process is refused (:class:`RunDirInUseError`, exit 2)
naming the dir and the holder. The kernel drops the lock when its process dies, however it dies; a run that ends
removes the file, so a file found unlocked but naming a holder is the stale lock of a dead run: the next run
takes it over and records the dead holder in its manifest (``lock.took_over``).

**Data parallelism.** One *run* holds the dir, all its workers together: its owner (the single process, torchrun
rank 0, the Ray driver) holds ``run.lock``; its workers (torchrun ranks > 0, Ray actors) hold a shared lock on
``workers.lock`` and check that ``run.lock`` names their run's token (:func:`join`). A new run takes a dir over
only when both are free, i.e. no process of an earlier run still writes there.

**Liveness.** :func:`effective_status`: a manifest at ``status: running`` whose run holds no lock any more is
reported ``crashed`` (its process ended without writing a final status: SIGKILL, power loss, OOM killer).

**A user's folder is not a run dir.** The first take of a dir by the run that will own it (:func:`acquire`: the single
process, torchrun rank 0, the Ray driver; :func:`check_own_dir` for a SLURM submitter) refuses an existing dir that
holds no run and holds files the runner did not write (:class:`runner.core.errors.ForeignDirError`, exit 2), before
anything is written into it: ``hydra.run.dir=~/Pictures`` would otherwise put ``items.jsonl``, ``images/<id>.png``,
``.hydra/`` and logs among the user's files and overwrite same-named ones. Joiners (torchrun ranks > 0, Ray actors,
SLURM array tasks, claims workers) are never checked: the dir they join is their owner's. The rule
(:func:`foreign_entries`): a dir *holds a run* when it has a run manifest (``manifest.json``, or a data-parallel
worker's ``manifest.rank<r>.json``); every run writes its manifest before any artifact or journal line
(``runner.app.run.Run.run_stages`` flushes it before the sink opens ``images/``/``videos/``), so a dir without one
can hold only what the runner writes before a run starts (:data:`PRE_RUN_NAMES`, :data:`PRE_RUN_PATTERNS`: locks,
Hydra's ``.hydra/`` and job log, ``job_status.json``, the torchrun ranks' ``workers/``, the claims store, submitit's
``slurm/``, an interrupted atomic write's temp file). Any other file, at any depth, is the user's, *including*
``images/0.png``: without a manifest no artifact of the runner can be there, and artifact names come from the
user's row ids, so a name that looks like an artifact proves nothing. Folders holding no file lose nothing and are
not counted. A dir that holds a run keeps the resume rules (``runner.core.resume``).

**Default dirs.** ``conf/config.yaml`` names default run and sweep dirs by date, time to the microsecond and
the process id (``${runner_pid:}``), and :func:`new_dir` creates a dir exclusively (``mkdir``, a ``-<n>`` suffix
when the name is taken), so two runs never pick the same default dir whatever second they start in.

This module imports nothing heavy (no torch): readers (report, matrix, sweep) use it.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from runner.core.errors import ForeignDirError, RunDirInUseError, RunDirLockError

log = logging.getLogger("runner")

LOCK_NAME = "run.lock"
WORKERS_NAME = "workers.lock"
FLEET_NAME = "fleet.lock"
WORKER_SUBDIR = "workers"  # torchrun ranks > 0 run Hydra in <run dir>/workers/rank<r> (runner.core.distributed)
CLAIMS_DIR = "claims"  # the claims store of a parallelism.assign=claims run (runner.core.claims)
SLURM_DIR = "slurm"  # submitit's folder of a launcher=slurm run by default (runner.app.slurm_launcher)
#: What the runner writes into a run dir before the run's first manifest (the module docstring): the locks, Hydra's
#: ``.hydra/``, the job's ``job_status.json`` (also of a run refused or crashed at startup), the folders of the
#: data-parallel launchers. Folders named here are not looked into.
PRE_RUN_NAMES = frozenset({LOCK_NAME, WORKERS_NAME, FLEET_NAME, ".hydra", "job_status.json", WORKER_SUBDIR,
                           CLAIMS_DIR, SLURM_DIR})
#: Name patterns of the same (top level only): Hydra's job log ``<job name>.log``; the temp file of an atomic write
#: that was killed (``.<name>.tmp<pid>``, ``runner.core.artifacts``), e.g. of the first ``manifest.json``.
PRE_RUN_PATTERNS = (r"[^/]+\.log", r"\..+\.tmp\d+")
#: A run manifest: the run's, or a data-parallel worker's (written before the merged ``manifest.json``).
MANIFEST_PATTERN = r"manifest(\.rank\d+)?\.json"
SCAN_CAP = 1000  # :func:`foreign_entries` stops counting there
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
FIX = ("fix: wait for that run to end, or write into another dir (hydra.run.dir=<new dir> or "
       "output.dir=<new dir>); a lock whose process is dead is taken over by the next run")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _key(d: Path) -> str:
    return str(Path(d).resolve())


def holder_record(token: str) -> Dict[str, Any]:
    """Who holds (or joins) a run dir: this process's pid, host, start of the hold, command line and the token
    naming the run."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return {"pid": os.getpid(), "host": socket.gethostname(), "started_at": _now(), "command": shlex.join(argv),
            "cwd": os.getcwd(), "token": token}


def describe(holder: Optional[Dict[str, Any]]) -> str:
    """``pid P on host H, started T, command: C`` (or what is known of it)."""
    if not holder:
        return "a process that has not recorded itself yet"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_at')}, "
            f"command: {holder.get('command')}")


@dataclass
class RunLock:
    """The lock of a run dir held by this process (see the module docstring).

    Attributes:
        holder: :func:`holder_record` of this process, also written into ``run.lock``.
        took_over: the holder recorded in a stale ``run.lock`` this run took over (its process was dead).
        enforced: False where the filesystem has no ``flock`` (the lock could not be taken; ``reason`` says why).
    """

    dir: Path
    holder: Dict[str, Any]
    took_over: Optional[Dict[str, Any]] = None
    enforced: bool = True
    reason: Optional[str] = None
    fd: Optional[int] = None
    count: int = 1

    @property
    def token(self) -> str:
        return self.holder["token"]

    def record(self) -> Dict[str, Any]:
        """The manifest's ``lock`` section."""
        doc: Dict[str, Any] = {"file": LOCK_NAME, "holder": self.holder, "enforced": self.enforced}
        if self.reason:
            doc["reason"] = self.reason
        if self.took_over is not None:
            doc["took_over"] = self.took_over
        return doc


_HELD: Dict[str, RunLock] = {}  # run dir -> the lock this process holds on it
_JOINED: Dict[str, Tuple[int, str]] = {}  # run dir -> (workers.lock fd, run token) of a worker process


def _read_fd(fd: int) -> Optional[Dict[str, Any]]:
    try:
        data = os.pread(fd, 65536, 0)
    except OSError:
        return None
    try:
        doc = json.loads(data.decode("utf-8")) if data.strip() else None
    except ValueError:
        return {"unreadable": data[:200].decode("utf-8", "replace")}
    return doc if isinstance(doc, dict) else None


def read_holder(run_dir: Path, wait_s: float = 0.0) -> Optional[Dict[str, Any]]:
    """The holder recorded in ``run_dir/run.lock`` (None: no file, or not written yet after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(Path(run_dir) / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            doc = _read_fd(fd)
        finally:
            os.close(fd)
        if doc is not None or time.monotonic() >= deadline:
            return doc
        time.sleep(0.02)


def _probe(path: Path, mode: int) -> Optional[bool]:
    """True: some process holds a lock on ``path`` conflicting with ``mode``; False: none (or no file); None:
    the filesystem has no flock."""
    try:  # write access for an exclusive probe (NFS emulates flock with POSIX locks, which need it)
        fd = os.open(path, (os.O_RDWR if mode == fcntl.LOCK_EX else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as e:
        return True if e.errno in _BUSY else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _unwritable(d: Path, e: OSError, key: Optional[str] = None) -> RunDirLockError:
    return RunDirLockError(f"cannot create or write the run dir {d}{f' ({key})' if key else ''} "
                           f"({type(e).__name__}: {e.strerror or e}); fix: choose a dir whose parents are folders "
                           "you can write (hydra.run.dir=<dir> or output.dir=<dir>)")


def _in_use(d: Path, path: Path, key: Optional[str]) -> RunDirInUseError:
    holder = read_holder(d, 2.0)
    note = ""
    if holder and holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
        note = " (that process is gone, but a child process it started still holds the lock)"
    return RunDirInUseError(f"run dir {d}{f' ({key})' if key else ''} is in use by another run: "
                            f"{describe(holder)}{note} (lock file {path}); two runs writing into one dir would mix "
                            f"their artifacts and records; {FIX}")


def acquire(run_dir: Path, create: bool = True, wait_s: float = 0.5, key: Optional[str] = None,
            own: bool = True) -> Optional[RunLock]:
    """Hold ``run_dir`` for this process's run (re-entrant: a dir this process holds is counted again).

    Args:
        create: create the dir when missing; with False a missing dir is not held (None is returned).
        wait_s: how long a busy lock is retried (a reader's momentary probe also holds it).
        key: the config key that named the dir (``hydra.run.dir``, ``output.dir``...), for messages.
        own: the dir is to be a run dir (:func:`check_own_dir` on the first take); False for a tool that holds an
            existing run's dir (score) or a sweep dir.

    Raises:
        ForeignDirError: (``own``) an existing dir that holds no run but files the runner did not write.
        RunDirInUseError: another process holds the dir, or workers of an earlier run still write into it.
        RunDirLockError: the dir cannot be created or written.
    """
    d = Path(run_dir)
    reg = _key(d)
    if reg in _HELD:
        _HELD[reg].count += 1
        return _HELD[reg]
    if own:
        check_own_dir(d, key)
    if not d.is_dir():
        if not create:
            return None
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unwritable(d, e, key) from None
    path = d / LOCK_NAME
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unwritable(d, e, key) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _BUSY:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise _in_use(d, path, key) from None
            if e.errno in _UNSUPPORTED:
                return _unenforced(d, token, f"{type(e).__name__}: {e.strerror} (flock on {path})")
            raise _unwritable(d, e, key) from None
        if _same_file(fd, path):  # a holder that ends unlinks the file before unlocking: lock the current one
            break
        os.close(fd)
    prev = _read_fd(fd)
    if _probe(d / WORKERS_NAME, fcntl.LOCK_EX):
        os.close(fd)  # the stale holder's record (if any) stays for the next try
        who = f"the run of {describe(prev)}" if prev else "an earlier run"
        raise RunDirInUseError(f"run dir {d}: {who} ended, but its data-parallel workers still write into it "
                               f"(they hold {d / WORKERS_NAME}); {FIX}")
    lock = RunLock(dir=d, holder=holder_record(token), took_over=prev, fd=fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(lock.holder) + "\n").encode(), 0)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        raise _unwritable(d, e, key) from None
    _HELD[reg] = lock
    return lock


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run manifest (:data:`MANIFEST_PATTERN`: ``manifest.json`` or a worker's
    ``manifest.rank<r>.json``), whatever its status."""
    import re

    try:
        return any(re.fullmatch(MANIFEST_PATTERN, p.name) for p in Path(run_dir).iterdir())
    except OSError:
        return False


def foreign_entries(run_dir: Path, limit: int = 4, cap: int = SCAN_CAP) -> Tuple[List[str], int]:
    """The files of ``run_dir`` that the runner did not write (relative paths, the shallowest first, sorted; at most
    ``limit``), and how many there are (counting stops at ``cap``: a home dir is not walked whole): none when the
    dir is missing or holds a run (:func:`holds_run`). The rule is the module docstring's: without a manifest, only
    :data:`PRE_RUN_NAMES` (not looked into) and :data:`PRE_RUN_PATTERNS` are the runner's; a symlink counts as a
    file (it is not followed); folders holding no file are not counted, a sub-folder that cannot be listed counts
    as one entry.

    Raises:
        OSError: ``run_dir`` itself cannot be listed.
    """
    import re
    from collections import deque

    d = Path(run_dir)
    if not d.is_dir() or holds_run(d):
        return [], 0
    found: List[str] = []
    todo = deque(sorted(p for p in d.iterdir() if p.name not in PRE_RUN_NAMES
                        and not any(re.fullmatch(pat, p.name) for pat in PRE_RUN_PATTERNS)))
    while todo and len(found) < cap:
        p = todo.popleft()  # breadth first: the files a user sees at the top are named first
        if p.is_dir() and not p.is_symlink():
            try:
                todo.extend(sorted(p.iterdir()))
            except OSError:
                found.append(f"{p.relative_to(d)}/")  # unreadable: it may hold anything
            continue
        found.append(str(p.relative_to(d)))
    return found[:limit], len(found)


def check_own_dir(run_dir: Path, key: Optional[str] = None) -> None:
    """Refuse to make ``run_dir`` a run dir when it is an existing dir that holds no run but files the runner did
    not write (:func:`foreign_entries`); before anything is written into it. A missing or empty dir, and one that
    holds a run (resume rules apply), pass.

    Raises:
        ForeignDirError: naming ``key``, the dir, a few of its files and the fix (exit 2).
    """
    try:
        shown, count = foreign_entries(run_dir)
    except OSError as e:
        shown, count = [f"(unreadable: {type(e).__name__}: {e.strerror or e})"], 1
    if not count:
        return
    key = key or "hydra.run.dir"
    more = f" and {count - len(shown)}{'+' if count >= SCAN_CAP else ''} more" if count > len(shown) else ""
    fix = ("point run.resume at an earlier run dir (one with manifest.json)" if key == "run.resume" else
           f"an empty or new dir ({key}=<new dir>), or move those files away")
    raise ForeignDirError(
        f"{key}={str(run_dir)!r} is an existing folder that holds no run (no manifest.json) but files the runner "
        f"did not write: {', '.join(shown)}{more}; a run there would write items.jsonl, images/, .hydra/ and logs "
        f"among them and could overwrite same-named files; nothing was written; fix: {fix}")


def _unenforced(d: Path, token: str, reason: str) -> RunLock:
    log.warning("run dir %s: this filesystem has no file locks (%s); the run dir is NOT protected against a "
                "second run writing into it", d, reason)
    lock = RunLock(dir=d, holder=holder_record(token), enforced=False, reason=reason)
    _HELD[_key(d)] = lock
    return lock


def release(lock: Optional[RunLock]) -> None:
    """Give back one hold of :func:`acquire`; the last one removes ``run.lock`` (and ``workers.lock`` when no
    worker holds it) and unlocks."""
    if lock is None:
        return
    lock.count -= 1
    if lock.count > 0:
        return
    _HELD.pop(_key(lock.dir), None)
    _drop(lock)


def _drop(lock: RunLock) -> None:
    if lock.fd is None:
        return
    fd, lock.fd = lock.fd, None
    try:
        w = lock.dir / WORKERS_NAME
        if w.exists() and _probe(w, fcntl.LOCK_EX) is False:
            w.unlink()
        if _same_file(fd, lock.dir / LOCK_NAME):
            os.unlink(lock.dir / LOCK_NAME)  # before unlocking: a waiter then finds no file, or a new one
    except OSError:
        pass
    finally:
        os.close(fd)


def release_all() -> None:
    """Drop every lock of this process, and leave every run it joined (at exit, and before a forced
    ``os._exit``)."""
    for key in list(_HELD):
        lock = _HELD.pop(key)
        lock.count = 0
        _drop(lock)
    for key in list(_JOINED):
        leave(Path(key))


atexit.register(release_all)


def held(run_dir: Path) -> Optional[RunLock]:
    """The lock this process holds on ``run_dir``, if any."""
    return _HELD.get(_key(run_dir))


def join(run_dir: Path, token: Optional[str]) -> str:
    """Register this process as a data-parallel worker of the run that holds ``run_dir`` (token ``token``):
    a shared lock on ``workers.lock`` for the rest of the process. Returns the run's token.

    Raises:
        RunDirInUseError: ``run_dir`` is held by no run, or by another run than ``token``'s.
    """
    key = _key(run_dir)
    if key in _HELD:  # this process owns the run (torchrun rank 0)
        return _HELD[key].token
    if key in _JOINED:
        if token is None or _JOINED[key][1] == token:
            return _JOINED[key][1]
        leave(run_dir)  # a reused worker process (Ray) joining the next run of the same dir
    d = Path(run_dir)
    while True:
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d / WORKERS_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unwritable(d, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                os.close(fd)
                raise _unwritable(d, e) from None
            break
        if _same_file(fd, d / WORKERS_NAME):  # the last worker to leave unlinks it: hold the current file
            break
        os.close(fd)
    info, busy = lock_state(d)
    if busy is not False and info and (token is None or info.get("token") == token):
        _JOINED[key] = (fd, info.get("token") or token or "")
        return _JOINED[key][1]
    os.close(fd)
    raise RunDirInUseError(f"data-parallel worker: run dir {d} is not held by its run (token {token}); it is "
                           f"held by {describe(info) if busy else 'no run'}; {FIX}")


def join_fleet(run_dir: Path, key: Optional[str] = None) -> str:
    """Join (or start) the claims run of ``run_dir``: workers started by hand (``parallelism.assign=claims`` without
    torchrun) are peers, none owns the dir. Under a short exclusive ``flock`` on ``fleet.lock`` (so two workers
    starting together agree): when workers of a run already hold ``workers.lock``, this process joins that run
    (its token is the one ``run.lock`` names); otherwise it starts a new run (a new token written into ``run.lock``,
    which nobody holds: a plain run that tries the dir later is refused because ``workers.lock`` is held). Then a
    shared lock on ``workers.lock`` for the rest of the process (:func:`leave` at exit). Returns the run's token.

    Raises:
        RunDirInUseError: a run that is not a claims run holds the dir (a single run, a torchrun or Ray owner), or
            workers of such a run still write into it.
        RunDirLockError: the dir cannot be created or written.
    """
    d = Path(run_dir)
    reg = _key(d)
    if reg in _JOINED:
        return _JOINED[reg][1]
    try:
        d.mkdir(parents=True, exist_ok=True)
        mfd = os.open(d / FLEET_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise _unwritable(d, e, key) from None
    try:
        try:
            fcntl.flock(mfd, fcntl.LOCK_EX)  # held for milliseconds by each joining worker
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise _unwritable(d, e, key) from None
        try:
            wfd = os.open(d / WORKERS_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _unwritable(d, e, key) from None
        others = _probe(d / WORKERS_NAME, fcntl.LOCK_EX)  # before ours: does a live worker hold it?
        try:
            fcntl.flock(wfd, fcntl.LOCK_SH)
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                os.close(wfd)
                raise _unwritable(d, e, key) from None
        info, busy = lock_state(d)
        if busy:  # a single run, or the owner of a torchrun / Ray run
            os.close(wfd)
            raise RunDirInUseError(f"run dir {d}{f' ({key})' if key else ''} is in use by another run: "
                                   f"{describe(info)} (lock file {d / LOCK_NAME}); a claims worker joins only a claims "
                                   f"run; {FIX}")
        if others:
            if not info or not info.get("fleet"):
                os.close(wfd)
                raise RunDirInUseError(f"run dir {d}: workers of {describe(info) if info else 'an earlier run'} still "
                                       f"write into it (they hold {d / WORKERS_NAME}) and it is not a claims run; "
                                       f"{FIX}")
            token = str(info["token"])
        else:
            token = uuid.uuid4().hex
            doc = {**holder_record(token), "fleet": True}
            try:
                from runner.core.artifacts import atomic_write_bytes

                atomic_write_bytes(d / LOCK_NAME, (json.dumps(doc) + "\n").encode())
            except OSError as e:
                os.close(wfd)
                raise _unwritable(d, e, key) from None
        _JOINED[reg] = (wfd, token)
        return token
    finally:
        os.close(mfd)


def leave(run_dir: Path) -> None:
    """Undo :func:`join` (at the end of a worker's part, and at exit). The last process of the run to leave
    (no other worker, and the owner gone) removes ``workers.lock``."""
    fd_token = _JOINED.pop(_key(run_dir), None)
    if fd_token is None:
        return
    fd = fd_token[0]
    mfd = None
    if (Path(run_dir) / FLEET_NAME).exists():  # a claims run: no worker joins while the last one leaves
        try:
            mfd = os.open(Path(run_dir) / FLEET_NAME, os.O_RDWR | os.O_CLOEXEC)
            fcntl.flock(mfd, fcntl.LOCK_EX)
        except OSError:
            pass
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other worker holds it
        path = Path(run_dir) / WORKERS_NAME
        if _same_file(fd, path) and not lock_state(run_dir)[1]:
            info = read_holder(run_dir)
            if info and info.get("fleet") and info.get("token") == fd_token[1]:
                os.unlink(Path(run_dir) / LOCK_NAME)  # the last claims worker: its run's record goes
            os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
        if mfd is not None:
            os.close(mfd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev)


def run_token(run_dir: Path) -> Optional[str]:
    """The token of the run this process holds or joined ``run_dir`` for (None: neither)."""
    key = _key(run_dir)
    if key in _HELD:
        return _HELD[key].token
    return _JOINED[key][1] if key in _JOINED else None


# ----------------------------------------------------------------------------------------------- liveness
def lock_state(run_dir: Path) -> Tuple[Optional[Dict[str, Any]], Optional[bool]]:
    """``(holder, held)`` of ``run_dir/run.lock``: the recorded holder, and whether a live process holds it
    (None: the filesystem has no flock)."""
    key = _key(run_dir)
    if key in _HELD:
        return _HELD[key].holder, True
    path = Path(run_dir) / LOCK_NAME
    return read_holder(run_dir), _probe(path, fcntl.LOCK_SH)


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def owner_alive(run_dir: Path, doc: Dict[str, Any]) -> bool:
    """Whether the run that wrote manifest ``doc`` in ``run_dir`` is still alive: its lock (or, when its owner
    died, its workers' lock) is held. Manifests record the run's token in ``owner``; without one (a run dir
    written before run locks) any live holder counts. Where the filesystem has no flock, the owner's pid is
    checked when it ran on this host."""
    owner = doc.get("owner") or {}
    token = owner.get("token")
    info, busy = lock_state(run_dir)
    same_run = token is None or not info or info.get("token") == token
    if busy:
        return same_run
    if busy is None or (doc.get("lock") or {}).get("enforced") is False:
        return owner.get("host") == socket.gethostname() and _pid_alive(owner.get("pid"))
    if info and token and info.get("token") == token and _probe(Path(run_dir) / WORKERS_NAME, fcntl.LOCK_EX):
        return True  # the owner died; workers of its run still write
    return False


def effective_status(run_dir: Path, doc: Dict[str, Any]) -> Optional[str]:
    """The manifest's ``status``, except ``running`` whose run is no longer alive: ``crashed``."""
    st = doc.get("status")
    if st == "running" and not owner_alive(run_dir, doc):
        return "crashed"
    return st


# ------------------------------------------------------------------------------------------- default dirs
def new_dir(parent: Path, stem: Optional[str] = None) -> Path:
    """A new dir under ``parent`` named ``stem`` (default: ``<date>_<time with microseconds>``), created
    exclusively: when the name is taken (another process in the same instant) ``-1``, ``-2``... is appended."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    stem = stem or datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")
    for n in range(10000):
        d = parent / (stem if n == 0 else f"{stem}-{n}")
        try:
            d.mkdir()
            return d
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name {stem}-<n> under {parent}")


def pid_resolver() -> str:
    """``${runner_pid:}`` in ``conf/config.yaml``: this process's id (default dir names)."""
    return str(os.getpid())
