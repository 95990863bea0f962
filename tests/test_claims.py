"""Claims (``parallelism=data parallelism.assign=claims``): workers pull batches by exclusive-create claims with
leases. Real processes and real signals: a worker SIGKILLed mid-batch is taken over by another once its lease
expires and the run completes by itself, byte-identical to a one-worker run, the death recorded with its pid and the
batches it lost. The protocol over the POSIX store with racing processes (each batch claimed once), lease expiry
and take-over, the fleet's agreement check, and the run dir's rules between claims workers and other runs.
Speed (stragglers, claims per second) is measured by ``benchmarks/fleet_cpu.py``, not here."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _helpers import image_hashes, worker_env

from runner.core import rundir
from runner.core.claims import (POOL_DONE, Claims, FedClaims, FleetMismatchError, Lease, PosixClaimStore, batch_id,
                                halt_all)
from runner.core.errors import RunDirInUseError
from runner.core.testing import kill_mid_batch, run_processes

ROWS = 10
LEASE_S = 3
# 3x toy_shapes' steps: a batch lasts about a second on a loaded 2-core machine, long enough to be killed inside
ARGS = ["platform=cpu", "cpu_threads=1", f"dataset.limit={ROWS}", "model.generation.num_inference_steps=48"]
CLAIMS = ["parallelism=data", "parallelism.assign=claims", f"parallelism.lease_s={LEASE_S}"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    d = tmp_path_factory.mktemp("single") / "run"
    r = subprocess.run([sys.executable, "-m", "runner", *ARGS, f"hydra.run.dir={d}"], cwd=d.parent, env=worker_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    h = image_hashes(d)
    assert len(h) == ROWS
    return h


def test_sigkilled_worker_is_taken_over_and_the_run_completes(tmp_path, single):
    d = tmp_path / "run"
    cmd = [sys.executable, "-m", "runner", *ARGS, *CLAIMS, f"hydra.run.dir={d}"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    live = []  # the run's manifest.json seen while both workers ran (the live merge)
    try:
        def alive():
            doc = _live(d)
            if doc is not None:
                live.append(doc)
            return [p.pid for p in procs if p.poll() is None]

        pid, lost = kill_mid_batch(d, alive)  # mid-run: it journaled a batch already, holds one unfinished
        assert pid is not None, "no worker was seen holding a batch"
        victim = next(p for p in procs if p.pid == pid)
        assert victim.wait(timeout=60) == -signal.SIGKILL
        survivor = next(p for p in procs if p is not victim)
        deadline = time.monotonic() + 300
        while survivor.poll() is None and time.monotonic() < deadline:  # no restart: the survivor finishes alone
            alive()  # the live manifest, as the report reads it, while the survivor goes on
            time.sleep(0.2)
        _, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert image_hashes(d) == single  # byte-identical to the one-worker run
    items = [json.loads(line) for line in (d / "items.jsonl").read_text().splitlines()]
    assert len(items) == ROWS and all(i["status"] == "ok" for i in items)
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["missing"] == 0
    assert m["counts"]["ok"] + m["counts"]["reused"] == ROWS
    assert m["parallelism"]["assign"] == "claims" and m["parallelism"]["world_size"] == 2
    deaths = m["claims"]["deaths"]
    assert [x["pid"] for x in deaths] == [victim.pid]  # the death, with its pid
    assert set(lost) <= set(deaths[0]["lost_batches"])  # the batches it held when it died were taken over
    dead = next(w for w in m["workers"] if w["pid"] == victim.pid)
    assert dead["status"] == "crashed" and dead["lost_batches"] == deaths[0]["lost_batches"]
    taken = {t["batch"]: t for t in m["claims"]["taken_over"]}
    for b in lost:
        assert taken[b]["from_pid"] == victim.pid and taken[b]["by_rank"] != dead["rank"]
        assert not taken[b]["released"]  # taken over because its lease expired, not handed back
    assert json.loads((d / f"manifest.rank{dead['rank']}.json").read_text())["status"] == "crashed"
    assert m["evidence"]["verdict"] == "limited" and str(dead["rank"]) in m["evidence"]["limits"][0]
    status = json.loads((d / "job_status.json").read_text())
    assert status["outcome"] == "ok" and status["exit_code"] == 0
    assert not [p for p in d.rglob("*") if ".tmp" in p.name]  # claims' temp files of the killed worker too
    assert not (d / "workers.lock").exists() and not (d / "run.lock").exists()  # the last worker left the dir
    # the live merge: while the workers ran, manifest.json said running with the items so far (runner.report
    # showed it), and the final merge read only what no live step had read
    assert live and all(x["status"] == "running" and x["pool"]["items"] == ROWS for x in live)
    assert any(1 <= x["counts"]["ok"] < ROWS for x in live)  # progress before the end
    assert [x["counts"]["ok"] for x in live] == sorted(x["counts"]["ok"] for x in live)  # it only grows
    final = m["merge"]["final"]
    assert m["merge"]["steps"] > 1 and final["rereads"] == 0
    assert final["bytes_read"] < m["merge"]["journal_bytes"] and final["records_parsed"] < ROWS
    assert m["pool"]["dead"][0]["pid"] == victim.pid and m["pool"]["done"] == ROWS


def _live(d: Path):
    """The run's manifest.json as ``runner.report`` reads it while the run is alive (None: none yet)."""
    from runner.tools.report import load_jobs

    if not (d / "manifest.json").exists():
        return None
    job = load_jobs([d])[0]
    return job.manifest if job.outcome == "running" else None


def test_a_sigkilled_torchrun_rank_is_restarted_by_torchrun_and_the_run_completes(tmp_path, single):
    """torchrun's agent stops the whole group when a rank dies; with ``--max-restarts`` it starts every rank again,
    and the ranks resume from the journals into the same (default) run dir: no manual restart. The death is in
    ``claims.deaths`` with its pid and the batches it held, from the earlier attempt's claims."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1",
           "-m", "runner", *ARGS, *CLAIMS]  # no hydra.run.dir: the default dir is kept across the restart
    p = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def rank1():
            d = _run_dir(tmp_path)
            recs = [json.loads(w.read_text() or "{}") for w in d.glob("claims/*/workers/1.json")] if d else []
            return [r["pid"] for r in recs if r.get("pid")]

        d = None
        while d is None and p.poll() is None:
            d = _run_dir(tmp_path)
            time.sleep(0.1)
        pid, lost = kill_mid_batch(d, rank1)
        assert pid is not None, "rank 1 was not seen holding a batch"
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    assert [x.name for x in (tmp_path / "outputs" / "runs").glob("*/*") if x.is_dir()] == [d.name]  # one run dir
    assert image_hashes(d) == single
    items = [json.loads(line) for line in (d / "items.jsonl").read_text().splitlines()]
    assert len(items) == ROWS and all(i["status"] == "ok" for i in items)
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and m["counts"]["ok"] + m["counts"]["reused"] == ROWS
    death = next(x for x in m["claims"]["deaths"] if x["pid"] == pid)
    assert death["rank"] == 1 and "attempt" in death and set(lost) <= set(death["lost_batches"])
    ended = {w["rank"]: w["resumed_from"] for w in m["workers"]}  # how each rank's first attempt ended
    assert ended[1] == "crashed", m["workers"]  # the SIGKILLed rank
    # the other: torchrun's SIGTERM ended it interrupted (or crashed), or it had written no record of its first
    # attempt yet when the group was torn down (still loading: CI's loaded machine), so it resumes from none
    assert set(ended.values()) <= {"crashed", "interrupted", None}, m["workers"]
    assert f"(pid: {pid})" in err  # torchrun named the rank it lost (its own log line)


def _run_dir(cwd: Path):
    found = [x for x in (cwd / "outputs" / "runs").glob("*/*") if x.is_dir()]
    return found[0] if found else None


def test_a_resume_claims_only_what_is_not_journaled(tmp_path, single):
    """A finished claims run re-run into its dir: nothing is claimed (the journal is the checkpoint), everything
    reused, the same bytes."""
    d = tmp_path / "run"
    cmd = [sys.executable, "-m", "runner", *ARGS, *CLAIMS, f"hydra.run.dir={d}"]
    for _ in range(2):
        r = subprocess.run(cmd, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"ok": 0, "failed": 0, "reused": ROWS, "items": ROWS, "missing": 0}
    assert m["claims"]["claimed"] == 0
    assert image_hashes(d) == single


# ------------------------------------------------------------------------------------- the protocol itself
def _race(root: str, n: int, out: "mp.Queue") -> None:
    c = Claims(PosixClaimStore(Path(root)), lease_s=60)
    out.put([batch_id(i) for i in range(n) if c.try_claim(batch_id(i)) is not None])


def test_each_batch_is_claimed_by_exactly_one_of_racing_processes(tmp_path):
    n, procs = 300, 4
    got = run_processes(_race, (str(tmp_path), n), procs, timeout_s=120)
    flat = [b for g in got for b in g]
    assert sorted(flat) == [batch_id(i) for i in range(n)]  # every batch once, none twice


def test_an_expired_lease_is_taken_over_once_and_the_holder_learns_it_lost(tmp_path):
    now = [0.0]
    store = PosixClaimStore(tmp_path)
    holder, a, b = (Claims(store, lease_s=10) for _ in range(3))
    for c in (a, b):
        c.lease = Lease(10, clock=lambda: now[0])
    assert holder.try_claim("b0000000") is not None
    assert a.try_claim("b0000000") is None  # claimed
    assert a.try_reclaim("b0000000") is None  # first look: the lease clock starts
    now[0] = 9.0
    assert a.try_reclaim("b0000000") is None  # not expired yet
    holder.renew()  # a beat: observers start over
    now[0] = 15.0
    assert a.try_reclaim("b0000000") is None and b.try_reclaim("b0000000") is None
    now[0] = 26.0  # no beat for more than 10 s of the observers' clocks
    got = [a.try_reclaim("b0000000"), b.try_reclaim("b0000000")]
    assert sum(g is not None for g in got) == 1  # exactly one takes it over
    winner = a if got[0] is not None else b
    assert winner.reclaimed[0]["from"]["pid"] == os.getpid() and winner.held["b0000000"].gen == 1
    holder.renew()
    assert holder.held["b0000000"].lost and holder.lost == ["b0000000"]
    winner.complete("b0000000")
    assert a.done("b0000000") and b.done("b0000000")
    assert a.try_reclaim("b0000000") is None  # done: never claimed again


def test_a_released_claim_is_taken_over_at_once(tmp_path):
    store = PosixClaimStore(tmp_path)
    stopping, other = Claims(store, lease_s=60), Claims(store, lease_s=60)
    stopping.try_claim("b0000003")
    stopping.release_all()  # a worker stopped by a signal hands its batch back
    c = other.try_reclaim("b0000003")
    assert c is not None and other.reclaimed[0]["from"]["released"]


def test_a_worker_forming_other_batches_is_refused(tmp_path):
    store = PosixClaimStore(tmp_path)
    desc = {"run_sha": "a" * 64, "batches": 6, "batches_sha256": "b" * 64, "lease_s": 60.0}
    Claims(store, 60).open_fleet(desc)
    Claims(store, 60).open_fleet(desc)  # the same: joins
    with pytest.raises(FleetMismatchError) as e:
        Claims(store, 60).open_fleet({**desc, "batches": 3, "batches_sha256": "c" * 64})
    msg = str(e.value)
    assert "batches: 6 (running workers) vs 3 (this worker)" in msg and "fix:" in msg


def test_workers_register_with_dense_ranks(tmp_path):
    store = PosixClaimStore(tmp_path)
    assert [Claims(store, 60).register() for _ in range(3)] == [0, 1, 2]


def test_bad_lease_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"parallelism.lease_s=0 must be > 0 seconds; fix"):
        Claims(PosixClaimStore(tmp_path), lease_s=0)


def _fed_pull(fed, batches, ids, stop=lambda: False):
    """The run's side of a FedClaims in a thread: every batch it yields is journaled (completed) at once."""
    import threading

    got = []

    def body():
        for b in fed.pull(batches, ids, stop=stop):
            got.append(b)
            fed.complete(ids[batches.index(b)])

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, got


def test_fed_claims_answer_each_offer_once_journaled_and_take_a_dead_holders_batch_over_at_once(tmp_path):
    store = PosixClaimStore(tmp_path)
    dead = Claims(store, lease_s=3600)  # a worker that claimed b1 and died: its lease would last an hour
    dead.me = {**dead.me, "pid": 999999, "rank": 0}
    assert dead.try_claim(batch_id(1)) is not None
    fed = FedClaims(store, lease_s=3600, poll_s=0.05)
    ids = [batch_id(i) for i in (1, 2)]  # b0 is not among them: journaled by an earlier attempt
    t, got = _fed_pull(fed, ["B1", "B2"], ids)
    assert fed.offer(batch_id(0), t.is_alive) == "journaled" and got == []  # nothing generated for it
    assert fed.offer(batch_id(1), t.is_alive) == "generated" and got == ["B1"]
    assert fed.reclaimed == [{"batch": batch_id(1), "from": {"rank": 0, "pid": 999999, "host": dead.me["host"],
                                                             "gen": 0, "released": False}}]
    assert fed.offer(batch_id(2), t.is_alive) == "generated" and got == ["B1", "B2"]
    assert fed.offer(batch_id(2), t.is_alive) == "journaled" and got == ["B1", "B2"]  # done: not again
    fed.close()
    t.join(5)
    assert not t.is_alive()
    assert fed.offer(batch_id(3), t.is_alive) == "journaled"  # an ended run answers at once


def test_halt_all_stops_a_pull_in_another_thread_as_a_signal_would(tmp_path):
    from types import SimpleNamespace

    fed = FedClaims(PosixClaimStore(tmp_path), lease_s=60, poll_s=0.05)
    stop = SimpleNamespace(signum=None)  # the run's Stop: the pull checks its signum
    fed.attach_stop(stop)
    t, got = _fed_pull(fed, ["B0"], [batch_id(0)], stop=lambda: stop.signum is not None)
    assert halt_all(signal.SIGUSR2) >= 1
    t.join(5)
    assert not t.is_alive() and stop.signum == signal.SIGUSR2 and fed.halted == signal.SIGUSR2
    assert fed.offer(batch_id(0), t.is_alive) == "not_generated" and got == []


def test_the_pool_done_key_ends_an_idle_pull(tmp_path):
    store = PosixClaimStore(tmp_path)
    fed = FedClaims(store, lease_s=60, poll_s=0.05)
    t, _ = _fed_pull(fed, ["B0"], [batch_id(0)])
    time.sleep(0.2)
    assert t.is_alive()  # idle, waiting for offers
    store.create(POOL_DONE, {})
    t.join(5)
    assert not t.is_alive()


# ---------------------------------------------------------------------------------------- the run dir
def _acquire(d: str) -> str:
    try:
        rundir.acquire(Path(d))
    except RunDirInUseError as e:
        return str(e)
    return "acquired"


def _join(d: str) -> str:
    try:
        return rundir.join_fleet(Path(d))
    except RunDirInUseError as e:
        return "refused: " + str(e)


def test_claims_workers_share_the_dir_and_other_runs_are_kept_out(tmp_path):
    ctx = mp.get_context("spawn")
    token = rundir.join_fleet(tmp_path)
    with ctx.Pool(1) as pool:
        assert pool.apply(_join, (str(tmp_path),)) == token  # a second worker joins the same run
        assert "still write into it" in pool.apply(_acquire, (str(tmp_path),))  # a plain run is refused
    rundir.leave(tmp_path)
    assert not (tmp_path / "workers.lock").exists() and not (tmp_path / "run.lock").exists()
    lock = rundir.acquire(tmp_path)  # a plain run holds the dir: a claims worker is refused
    try:
        with ctx.Pool(1) as pool:
            assert pool.apply(_join, (str(tmp_path),)).startswith("refused: ")
    finally:
        rundir.release(lock)


def _rank(rank: int, port: int, q: "mp.Queue") -> None:
    import torch.distributed as tdist

    from runner.core import distributed as dp

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        os._exit(9)  # dies before the merge's barrier
    try:
        dp.barrier()
        q.put("no error")
    except dp.PeerLostError as e:
        q.put(f"{e.exit_code} {e.outcome} {e}")


def test_a_rank_waiting_for_the_merge_names_the_dead_peer_in_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(2)]
    for p in ps:
        p.start()
    try:
        got = q.get(timeout=120)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got.startswith("1 crashed another rank of the torchrun group died before the merge"), got
    assert "--max-restarts" in got and "Traceback" not in got
