"""Test-only hooks. Each reads an environment variable that only the test suite and the benchmarks set; a real run
never sets them (``runner.core.environment`` checks their values when they are set, like every variable it reads).

``RUNNER_TEST_SLOW_WORKER=<rank>:<factor>``: the data-parallel worker of that rank sleeps ``(factor - 1) x`` the
seconds each batch took, at the batch boundary, so it runs ``factor`` times slower than its peers (the straggler of
``benchmarks/fleet_cpu.py``). Any other process, and every rank when unset, is untouched.

``RUNNER_TEST_PUBLISH_PAUSE=<file>``: object storage (``runner.core.storage.RunMirror.publish``) stops after the
first artifact's temp object is uploaded and before it is verified and moved to its final key: it writes the
artifact's run-dir-relative name into ``<file>`` and sleeps (``tests/test_storage.py`` kills the process there).

:func:`run_processes`: processes racing over the same shared storage (claims); :func:`kill_mid_batch`: a claims
worker SIGKILLed while it holds a batch (the kill verdicts of ``tests/test_claims.py`` and the benchmark);
:func:`preempt_two_tasks`: SLURM's time-limit and preemption signals sent to two tasks of a ``launcher=slurm`` run
(``tests/test_slurm.py`` and the benchmark's preemption verdict).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Set, Tuple, TypeVar

SLOW_WORKER = "RUNNER_TEST_SLOW_WORKER"


def parse_slow_worker(value: str) -> Tuple[int, float]:
    """``"<rank>:<factor>"`` -> ``(rank, factor)``.

    Raises:
        ValueError: not two numbers, a rank below 0 or a factor below 1 (the message names the fix).
    """
    try:
        rank_s, factor_s = value.split(":")
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        raise ValueError(f"{SLOW_WORKER}={value!r} is not <rank>:<factor>; fix: e.g. {SLOW_WORKER}=3:4 (rank 3, "
                         "4x slower), or unset it (a test-only hook)") from None
    if rank < 0 or not factor >= 1:
        raise ValueError(f"{SLOW_WORKER}={value!r}: rank must be >= 0 and factor >= 1; fix: e.g. {SLOW_WORKER}=3:4")
    return rank, factor


def slow_worker_delay(rank: Optional[int], batch_s: float) -> float:
    """At a batch boundary of worker ``rank`` (None: not a data-parallel worker): sleep ``(factor - 1) x batch_s``
    seconds when ``RUNNER_TEST_SLOW_WORKER`` names this rank. Returns the seconds slept (0.0 almost always)."""
    value = os.environ.get(SLOW_WORKER)
    if not value or rank is None:
        return 0.0
    slow, factor = parse_slow_worker(value)
    if rank != slow:
        return 0.0
    delay = (factor - 1.0) * batch_s
    time.sleep(delay)
    return delay


PUBLISH_PAUSE = "RUNNER_TEST_PUBLISH_PAUSE"
_paused = False


def publish_pause(rel: str, seconds: float = 600.0) -> None:
    """Object storage, between a temp object's upload and its publication: when ``RUNNER_TEST_PUBLISH_PAUSE``
    names a file, the first call of the process writes ``rel`` there and sleeps ``seconds`` (the test kills the
    process meanwhile); later calls and unset runs return at once."""
    global _paused
    path = os.environ.get(PUBLISH_PAUSE)
    if not path or _paused:
        return
    _paused = True
    with open(path, "w", encoding="utf-8") as f:
        f.write(rel)
    time.sleep(seconds)


def s3_server() -> Any:
    """Test-only: moto's S3 server (``moto[server]``, the ``s3-server`` extra) on a free loopback port, in a thread
    of this process, started and empty (no bucket of an earlier server of the process); ``.endpoint`` is its URL,
    ``.stop()`` ends it. Every request is served under one lock:
    moto checks ``If-None-Match``/``If-Match`` and then stores the object in two steps, where S3 makes a conditional
    write atomic; serialized, moto's server keeps S3's guarantee (``tests/test_storage.py``,
    ``benchmarks/object_storage_cpu.py``)."""
    import logging
    import threading

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class SerializedMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app, lock = DomainDispatcherApplication(create_backend_app), threading.Lock()

            def serialized(environ: Any, start_response: Any) -> Any:
                with lock:
                    return list(app(environ, start_response))

            self._server = make_server(self._ip_address, self._port, serialized, True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = SerializedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server.endpoint = f"http://{host}:{port}"
    # moto keeps its buckets in module-level backends shared by every server of the process: a second server would
    # start with the first one's buckets and objects (a fixture set up twice in one pytest session then failed its
    # mkdir with FileExistsError). moto's own reset endpoint empties them, so each server starts as a new one would.
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"), timeout=30)
    return server


def run_processes(target: Callable[..., None], args: Tuple[Any, ...], n: int, timeout_s: float = 600.0) -> List[Any]:
    """Start ``n`` processes (``spawn``: no state inherited) each running ``target(*args, queue)``, which puts one
    result on ``queue``; wait for every result and every process. Returns the results in arrival order. The racing
    claimers of ``tests/test_claims.py`` and ``benchmarks/fleet_cpu.py``.

    Raises:
        queue.Empty: a process gave no result within ``timeout_s``.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args, q)) for _ in range(n)]
    for p in ps:
        p.start()
    try:
        return [q.get(timeout=timeout_s) for _ in ps]
    finally:
        for p in ps:
            p.join(timeout=60)


def held_not_done(ns: Path, pid: int) -> List[str]:
    """The batches of the claims namespace ``ns`` (``<run dir>/claims/<token>``) whose newest claim process ``pid``
    holds and that are not done."""
    out = []
    for p in ns.glob("b*.g*"):
        if p.name.startswith("."):
            continue
        b, g = p.name.split(".g")
        if (ns / f"{b}.done").exists() or (ns / f"{b}.g{int(g) + 1}").exists():
            continue
        try:
            doc = json.loads(p.read_text())
        except ValueError:
            continue
        if doc.get("pid") == pid:
            out.append(b)
    return sorted(out)


def kill_mid_batch(run_dir: Path, candidates: Callable[[], List[int]], timeout_s: float = 300.0
                   ) -> Tuple[Optional[int], List[str]]:
    """SIGKILL one claims worker of ``run_dir`` mid-batch: once some worker journaled a batch, the first of
    ``candidates()`` (pids, asked again at every look) seen holding a batch it has not finished is frozen
    (SIGSTOP, so the batches it holds cannot change), checked again and killed. Returns its pid and the batches it
    held when it died (None, []: no candidate was seen holding one within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if list(Path(run_dir).glob("items.rank*.jsonl")):
            for ns in (Path(run_dir) / "claims").glob("*"):
                for pid in candidates():
                    if not held_not_done(ns, pid):
                        continue
                    os.kill(pid, signal.SIGSTOP)  # frozen where the look saw it
                    lost = held_not_done(ns, pid)
                    if lost:
                        os.kill(pid, signal.SIGKILL)
                        return pid, lost
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    return None, []


def worker_pids(run_dir: Path, rank: Optional[int] = None) -> List[int]:
    """The pids of the claims workers registered in ``run_dir`` (``claims/<token>/workers/<n>.json``, every
    namespace: every attempt of the run), only those of ``rank`` when given; a record still being written is
    skipped. Sorted, each once."""
    out = set()
    for w in Path(run_dir).glob(f"claims/*/workers/{'*' if rank is None else rank}.json"):
        try:
            out.add(json.loads(w.read_text())["pid"])
        except (OSError, ValueError, KeyError):
            continue  # still being written
    return sorted(out)


T = TypeVar("T")


def wait_for(cond: Callable[[], T], what: str, timeout_s: float = 300.0) -> T:
    """Poll ``cond()`` every 50 ms until it returns something truthy; returns it.

    Raises:
        TimeoutError: nothing truthy within ``timeout_s`` seconds (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _parent_pid(pid: int) -> int:
    """The parent of process ``pid`` (Linux ``/proc/<pid>/stat``, field 4)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _freeze_holding(run_dir: Path, exclude: Set[int]) -> Optional[int]:
    """Freeze (SIGSTOP) a registered claims worker of ``run_dir`` not in ``exclude`` that holds a batch not
    journaled yet, checked again once frozen (so it is frozen mid-batch). Returns its pid; None when none holds one
    now (a worker seen holding one that finished it before the stop is let go on, SIGCONT)."""
    for pid in worker_pids(run_dir):
        if pid in exclude or not any(held_not_done(ns, pid) for ns in Path(run_dir).glob("claims/*")):
            continue
        os.kill(pid, signal.SIGSTOP)
        if any(held_not_done(ns, pid) for ns in Path(run_dir).glob("claims/*")):
            return pid
        os.kill(pid, signal.SIGCONT)
    return None


def preempt_two_tasks(run_dir: Path, timeout_s: float = 300.0) -> Tuple[int, int]:
    """SLURM's two signals, each sent mid-batch to one of two tasks of a ``launcher=slurm`` run under submitit's
    LocalExecutor (each task process a child of its job's controller):

    1. task B is frozen (SIGSTOP) holding a batch not journaled yet; task A, frozen the same way, gets SIGUSR2 (what
       SLURM's ``--signal=USR2@<delay>`` sends before the time limit) and goes on, while B stays frozen so that A's
       requeued process (A2) joins the same run;
    2. A2 is frozen, B goes on and its controller gets SIGTERM (what SLURM sends a preempted job; the controller
       forwards it to its task, as SLURM does), so that B's requeued process joins the run too; then A2 goes on.

    Each signalled task thus holds a batch when signalled: it finishes and journals it before it is requeued. (A task
    requeued after every other task has left starts a new attempt of the run instead, planned from the journals.)
    Returns ``(A's pid, B's pid)``: the SIGUSR2 task's and the SIGTERM task's first processes.

    Raises:
        TimeoutError: a step not reached within ``timeout_s`` seconds.
    """
    wait_for(lambda: len(worker_pids(run_dir)) >= 2, "both tasks registered", timeout_s)
    term = wait_for(lambda: _freeze_holding(run_dir, set()), "a task holding an undone batch", timeout_s)
    usr2 = wait_for(lambda: _freeze_holding(run_dir, {term}), "the other task holding an undone batch", timeout_s)
    os.kill(usr2, signal.SIGUSR2)  # to the task, as SLURM's --signal=USR2@<delay> does (handled once it goes on)
    os.kill(usr2, signal.SIGCONT)
    a2 = wait_for(lambda: next(iter(set(worker_pids(run_dir)) - {usr2, term}), None),
                  "the SIGUSR2 task's requeued process", timeout_s)
    os.kill(a2, signal.SIGSTOP)
    os.kill(term, signal.SIGCONT)
    os.kill(_parent_pid(term), signal.SIGTERM)  # to the job: its controller forwards it to the task
    wait_for(lambda: set(worker_pids(run_dir)) - {usr2, term, a2}, "the SIGTERM task's requeued process", timeout_s)
    os.kill(a2, signal.SIGCONT)
    return usr2, term
