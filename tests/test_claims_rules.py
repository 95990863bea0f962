"""The claim protocol's rules one by one (``runner.core.claims``), each on a case where a wrong version gives another
answer: hand-computed documents, generations, beats, counts and lease boundaries, on a real POSIX store in
``tmp_path`` (and the loopback S3 server for the object store's failures). Fast: no model, no subprocess."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import threading
import time
from types import SimpleNamespace

import pytest

from runner.core import claims as cl
from runner.core.claims import (CLAIMS_DIR, Claims, FedClaims, FleetMismatchError, Lease, PosixClaimStore, batch_id,
                                batches_sha256, halt_all, posix_store)
from runner.core.errors import StorageError

B = "b0000005"


def _read(store: PosixClaimStore, key: str):
    return json.loads((store.root / key).read_text())


def _clocked(store, lease_s=10.0, **kw):
    """A Claims whose lease is judged on a clock the test moves (``now[0]``)."""
    now = [0.0]
    c = Claims(store, lease_s, **kw)
    c.lease = Lease(lease_s, clock=lambda: now[0])
    return c, now


# ------------------------------------------------------------------------------------------------- Lease
def test_lease_expires_exactly_at_lease_s_of_standing_still_and_restarts_on_a_change_or_forget():
    now = [100.0]
    lease = Lease(10, clock=lambda: now[0])
    assert lease.expired("k", (0, 1)) is False  # first look (default: not released)
    now[0] = 109.999
    assert lease.expired("k", (0, 1)) is False
    now[0] = 110.0
    assert lease.expired("k", (0, 1)) is True  # exactly lease_s: expired (>=)
    assert lease.expired("other", (0, 1)) is False  # per key
    now[0] = 111.0
    assert lease.expired("k", (0, 2)) is False  # a beat: the clock starts over at 111
    now[0] = 120.5
    assert lease.expired("k", (0, 2)) is False
    now[0] = 121.0
    assert lease.expired("k", (0, 2)) is True
    lease.forget("k")
    assert lease.expired("k", (0, 2)) is False  # forgotten: a first look again
    lease.forget("never seen")  # no error
    assert lease.expired("k", None, released=True) is True  # released: at once


# --------------------------------------------------------------------------------------------- the store
def test_posix_store_documents_paths_and_modes(tmp_path):
    store = posix_store(tmp_path / "run", "tok")
    assert store.root == tmp_path / "run" / CLAIMS_DIR / "tok" and (store.root / "workers").is_dir()
    assert store.where() == str(store.root) and store.name == "posix"
    assert PosixClaimStore(store.root).root == store.root  # a second worker opens the same namespace
    old = os.umask(0o022)
    try:
        assert store.create("a.json", {"x": 1}) is True
    finally:
        os.umask(old)
    assert (store.root / "a.json").read_bytes() == b'{"x": 1}\n'
    assert stat.S_IMODE((store.root / "a.json").stat().st_mode) == 0o644
    assert store.create("a.json", {"x": 2}) is False and store.get("a.json") == {"x": 1}
    store.put("a.json", {"x": 3, "y": [1]})
    assert (store.root / "a.json").read_bytes() == b'{"x": 3, "y": [1]}\n'
    store.put("workers/9.json", {"r": 9})  # a key with a folder
    assert store.get("workers/9.json") == {"r": 9}
    assert sorted(p.name for p in store.root.iterdir()) == ["a.json", "workers"]  # no temp file left
    assert store.get("missing.json") is None and store.exists("a.json") and not store.exists("missing.json")
    (store.root / "partial.json").write_bytes(b'{"x": ')  # an exclusive create still writing
    assert store.get("partial.json") == {}
    (store.root / "list.json").write_bytes(b"[1, 2]\n")  # valid JSON, not a document
    assert store.get("list.json") == {}
    (store.root / "bad.json").write_bytes(b"\xff\xfe")
    assert store.get("bad.json") == {}


def test_posix_store_refuses_a_claims_dir_it_cannot_create_and_reads_a_dir_key_as_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StorageError) as e:
        PosixClaimStore(tmp_path / "file" / "claims")
    assert str(e.value).startswith(f"cannot create the claims dir {tmp_path / 'file' / 'claims'} (NotADirectoryError: ")
    assert "); fix: a run dir on storage every worker can write" in str(e.value)
    store = PosixClaimStore(tmp_path / "c")
    (store.root / "d.json").mkdir()
    with pytest.raises(IsADirectoryError):  # not ENOENT/ESTALE: raised, not read as "no document"
        store.get("d.json")
    with pytest.raises(StorageError) as e:
        store.put("nodir/x.json", {})
    assert str(e.value).startswith(f"cannot write claim file {store.root / 'nodir' / 'x.json'} (FileNotFoundError: ")
    with pytest.raises(StorageError) as e:
        store.create("nodir/x.json", {})
    assert str(e.value).startswith(f"cannot create claim file {store.root / 'nodir' / 'x.json'} (FileNotFoundError: ")


def test_a_claim_file_whose_bytes_cannot_be_written_is_a_storage_error(tmp_path):
    """The exclusive create succeeds, its write fails (a file-size limit of 0 bytes: EFBIG, as a full disk would)."""
    import resource
    import signal

    store = PosixClaimStore(tmp_path)
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        with pytest.raises(StorageError) as e:
            store.create("k.json", {"beat": 0})
        with pytest.raises(StorageError) as e2:
            store.put("p.json", {"beat": 0})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_sig)
    assert str(e.value).startswith(f"cannot write claim file {store.root / 'k.json'} (OSError: [Errno 27] File too large")
    assert str(e2.value).startswith(f"cannot write claim file {store.root / 'p.json'} (OSError: [Errno 27] File too")
    # the failed create leaves no empty claim behind (it would read as being written forever)
    assert store.get("k.json") is None and not store.exists("k.json") and not store.exists("p.json")


def test_batches_sha256_is_the_hash_of_the_item_keys_in_order():
    batches = [[SimpleNamespace(key="a"), SimpleNamespace(key="b")], [SimpleNamespace(key="c")]]
    assert batches_sha256(batches) == hashlib.sha256(b'[["a", "b"], ["c"]]').hexdigest()
    assert batch_id(12) == "b0000012"


# ------------------------------------------------------------------------------------------- a worker
def test_a_new_worker_accounts_for_nothing_and_takes_its_poll_from_the_lease(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 1)
    assert c.poll_s == 0.125 and Claims(store, 60).poll_s == 0.25 and Claims(store, 60, poll_s=0.0).poll_s == 0.0
    assert Claims(store, 1e-9).lease_s == 1e-9  # any positive lease
    with pytest.raises(ValueError, match="lease_s=-1 must be > 0"):
        Claims(store, -1)
    assert c.me == {"pid": os.getpid(), "host": socket.gethostname()} and c.rank is None and c.held == {}
    assert c.record_beat == 0 and c.done_seen == set() and c.halted is None and c.finished is False
    assert c.reusable_at_start is None and c in cl.LIVE
    assert c.section() == {"store": "posix", "where": str(tmp_path), "lease_s": 1.0, "rank": None, "claimed": 0,
                           "completed": 0, "reclaimed": [], "lost": [], "busy_s": 0.0, "idle_s": 0.0,
                           "first_claim_at": None, "last_done_at": None}


def test_a_claim_document_names_its_holder_and_the_first_claim_time_is_kept(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 60)
    t0 = time.time()
    a = c.try_claim("b0000001")
    t1 = time.time()
    doc = _read(store, "b0000001.g0")
    assert set(doc) == {"batch", "gen", "pid", "host", "beat", "claimed_at"}
    assert doc["batch"] == "b0000001" and doc["gen"] == 0 and doc["beat"] == 0 and doc["pid"] == os.getpid()
    assert doc["host"] == socket.gethostname() and t0 <= doc["claimed_at"] <= t1
    assert a.gen == 0 and a.doc == doc and c.held == {"b0000001": a}
    time.sleep(0.01)
    c.try_claim("b0000002")
    assert c.first_claim_at == a.claimed_at and c.claimed == ["b0000001", "b0000002"]
    assert c.try_claim("b0000001") is None and c.claimed == ["b0000001", "b0000002"]


def test_head_is_the_newest_generation_at_or_after_start(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 60)
    assert c.head(B) == (-1, None)
    for g in range(3):
        store.create(f"{B}.g{g}", {"gen": g})
    assert c.head(B) == (2, {"gen": 2})
    assert c.head(B, start=1) == (2, {"gen": 2})
    assert c.head(B, start=3) == (-1, None)
    store.create(f"{B}.g4", {"gen": 4})  # a gap ends the walk
    assert c.head(B) == (2, {"gen": 2})


def test_try_reclaim_claims_a_batch_nobody_claimed_and_never_a_done_one(tmp_path):
    store = PosixClaimStore(tmp_path)
    c, now = _clocked(store)
    got = c.try_reclaim(B)
    assert got is not None and got.gen == 0 and got.batch == B and c.reclaimed == []  # generation 0: a plain claim
    assert _read(store, f"{B}.g0")["batch"] == B and c.held == {B: got}
    store.create("b0000006.done", {})
    assert c.try_reclaim("b0000006") is None and not store.exists("b0000006.g0")
    (store.root / "b0000006.done").unlink()
    assert c.done("b0000006") and c.done_seen == {"b0000006"}  # seen done once: done for good, not looked up again


def test_a_take_over_records_whom_from_and_logs_why(tmp_path, caplog):
    store = PosixClaimStore(tmp_path)
    holder = Claims(store, 10)
    holder.me = {"pid": 4242, "host": "hostA", "rank": 3}
    holder.try_claim(B)
    holder.renew()  # beat 1
    taker, now = _clocked(store)
    assert taker.try_reclaim(B) is None  # first look
    now[0] = 10.0
    with caplog.at_level(logging.INFO, logger="runner"):
        got = taker.try_reclaim(B)
    assert got is not None and got.gen == 1 and taker.held[B] is got and got.batch == B
    prev = {"rank": 3, "pid": 4242, "host": "hostA", "gen": 0, "released": False}
    assert taker.reclaimed == [{"batch": B, "from": prev}] and taker.claimed == [B]
    doc = _read(store, f"{B}.g1")
    assert doc["gen"] == 1 and doc["beat"] == 0 and doc["reclaimed_from"] == prev and doc["pid"] == os.getpid()
    assert doc["batch"] == B and got.doc == doc
    assert B not in taker.lease.seen  # forgotten: a later holder is observed afresh
    rec = [r for r in caplog.records if "took over" in r.getMessage()]
    assert len(rec) == 1 and rec[0].levelno == logging.WARNING
    assert rec[0].getMessage() == (f"claims: took over batch {B} from worker rank 3 (pid 4242 on hostA), whose "
                                   "claim was not renewed for 10 s")
    # generation 1 expires too: the next take-over is generation 2, from generation 1
    third, now3 = _clocked(store)
    assert third.try_reclaim(B) is None
    now3[0] = 10.0
    g2 = third.try_reclaim(B)
    assert g2.gen == 2 and third.reclaimed[0]["from"]["gen"] == 1 and store.exists(f"{B}.g2")
    assert third.head(B) == (2, _read(store, f"{B}.g2"))


def test_a_released_claim_is_taken_over_at_once_and_logged_as_info(tmp_path, caplog):
    store = PosixClaimStore(tmp_path)
    holder = Claims(store, 60)
    holder.try_claim(B)
    holder.try_claim("b0000006")
    holder.release_all()
    assert holder.held == {}
    assert _read(store, f"{B}.g0")["released"] is True and _read(store, "b0000006.g0")["released"] is True
    taker = Claims(store, 60)
    with caplog.at_level(logging.INFO, logger="runner"):
        assert taker.try_reclaim(B) is not None
    rec = [r for r in caplog.records if "took over" in r.getMessage()]
    assert len(rec) == 1 and rec[0].levelno == logging.INFO and rec[0].getMessage().endswith("whose claim it released")
    assert taker.reclaimed[0]["from"]["released"] is True


def test_each_batch_has_its_own_lease_clock(tmp_path):
    store = PosixClaimStore(tmp_path)
    holder = Claims(store, 10)
    holder.try_claim("b0000001")
    holder.try_claim("b0000002")  # both at (gen 0, beat 0)
    taker, now = _clocked(store)
    assert taker.try_reclaim("b0000001") is None
    now[0] = 5.0
    assert taker.try_reclaim("b0000002") is None  # b2's clock starts at 5
    now[0] = 10.0
    assert taker.try_reclaim("b0000002") is None  # b2 watched 5 s only
    assert taker.try_reclaim("b0000001") is not None  # b1 watched 10 s
    assert set(taker.lease.seen) == {"b0000002"}


def test_a_batch_done_while_its_expired_lease_was_read_is_not_taken_over(tmp_path):
    store = _CountingStore(tmp_path)
    Claims(store, 10).try_claim(B)
    taker, now = _clocked(store)
    assert taker.try_reclaim(B) is None
    now[0] = 10.0
    store.on_get[f"{B}.g0"] = lambda n: store.create(f"{B}.done", {})  # its holder completes it meanwhile
    assert taker.try_reclaim(B) is None and not store.exists(f"{B}.g1") and taker.reclaimed == []


def test_a_done_batch_is_not_taken_over_even_when_its_lease_expired(tmp_path):
    store = PosixClaimStore(tmp_path)
    Claims(store, 10).try_claim(B)
    taker, now = _clocked(store)
    assert taker.try_reclaim(B) is None
    now[0] = 10.0
    store.create(f"{B}.done", {})  # finished while it was watched
    assert taker.try_reclaim(B) is None and not store.exists(f"{B}.g1") and taker.reclaimed == []


def test_renew_beats_each_held_claim_and_the_worker_record_by_one(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 60)
    c.try_claim("b0000001")
    c.try_claim("b0000002")
    c.renew()  # not registered: no worker record
    assert not store.exists("workers/None.json") and c.record_beat == 0
    assert c.register() == 0
    c.renew()
    c.renew()
    for b in ("b0000001", "b0000002"):
        assert _read(store, f"{b}.g0")["beat"] == 3 and c.held[b].doc["beat"] == 3
    rec = _read(store, "workers/0.json")
    assert rec["beat"] == 2 and c.record_beat == 2 and rec["rank"] == 0 and rec["pid"] == os.getpid()
    (store.root / "workers/0.json").unlink()  # its record went missing: written again from the worker's identity
    c.renew()
    assert _read(store, "workers/0.json") == {**c.me, "rank": 0, "beat": 3}
    assert c.lost == []


def test_renew_marks_a_taken_over_claim_lost_once_and_writes_it_no_more(tmp_path, caplog):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 60)
    c.try_claim("b0000001")
    c.try_claim("b0000002")
    store.create("b0000001.g1", {"gen": 1})  # another worker took b1 over
    with caplog.at_level(logging.WARNING, logger="runner"):
        c.renew()
        c.renew()
    assert c.held["b0000001"].lost and not c.held["b0000002"].lost and c.lost == ["b0000001"]
    assert _read(store, "b0000001.g0")["beat"] == 0 and _read(store, "b0000002.g0")["beat"] == 2
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msgs == ["claims: batch b0000001 was taken over by another worker (this worker's lease of 60 s lapsed); "
                    "finishing it anyway (same inputs, same bytes)"]
    c.release_all()  # a lost claim is not released (its new holder's is the one that counts)
    assert "released" not in _read(store, "b0000001.g0") and _read(store, "b0000002.g0")["released"] is True


def test_complete_writes_the_first_done_marker_with_the_claims_generation(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 60)
    c.try_claim(B)
    store.create(f"{B}.g1", {})
    c.renew()  # lost
    t0 = time.time()
    c.complete(B)
    done = _read(store, f"{B}.done")
    assert set(done) == {"batch", "pid", "host", "gen", "lost", "done_at"}
    assert done["batch"] == B and done["gen"] == 0 and done["lost"] is True and done["pid"] == os.getpid()
    assert c.held == {} and c.completed == [B] and t0 <= c.last_done_at <= time.time()
    (store.root / f"{B}.done").rename(store.root / "kept")
    assert c.done(B) and c.done_seen == {B}  # known done: not looked up again
    (store.root / "kept").rename(store.root / f"{B}.done")
    c.complete("b0000009")  # never held (a fed batch journaled before): gen None, not lost
    assert _read(store, "b0000009.done")["gen"] is None and _read(store, "b0000009.done")["lost"] is False
    other = Claims(store, 60)
    other.complete(B)  # a duplicate's completion keeps the first marker
    assert _read(store, f"{B}.done") == done and other.completed == [B]


def test_release_all_goes_on_past_a_claim_it_cannot_write(tmp_path, caplog):
    class Flaky(PosixClaimStore):
        def put(self, key, doc):
            if key.startswith("b0000001"):
                raise StorageError("refused")
            super().put(key, doc)

    store = Flaky(tmp_path)
    c = Claims(store, 60)
    c.try_claim("b0000001")
    c.try_claim("b0000002")
    with caplog.at_level(logging.WARNING, logger="runner"):
        c.release_all()
    assert _read(store, "b0000002.g0")["released"] is True and c.held == {}
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert msgs == [f"claims: could not release batch b0000001 ({StorageError('refused')}); it is taken over after "
                    "its lease"]


# -------------------------------------------------------------------------------------------- the fleet
def test_the_first_worker_creates_the_fleet_and_a_joiner_gets_that_document(tmp_path):
    store = PosixClaimStore(tmp_path)
    desc = {"run_sha": "a" * 64, "batches": 6, "batches_sha256": "b" * 64, "lease_s": 60.0}
    first = Claims(store, 60)
    t0 = time.time()
    doc = first.open_fleet(desc)
    assert doc == {**desc, "created_by": first.me, "created_at": doc["created_at"]} and t0 <= doc["created_at"]
    assert _read(store, "fleet.json") == doc
    joiner = Claims(store, 60)
    joiner.me = {"pid": 1, "host": "other"}
    assert joiner.open_fleet(desc) == doc  # the first worker's document, not its own
    with pytest.raises(FleetMismatchError) as e:
        Claims(store, 60).open_fleet({**desc, "lease_s": 30.0, "run_sha": "c" * 64})
    msg = str(e.value)
    assert f"cannot join the claims run in {tmp_path}: " in msg
    assert (f"run_sha: {'a' * 64!r} (running workers) vs {'c' * 64!r} (this worker); lease_s: 60.0 (running workers)"
            " vs 30.0 (this worker); the workers of one run") in msg
    assert "batches:" not in msg and msg.endswith(
        "; the workers of one run must form the same batches (same config, dataset, batch_size and lease); fix: start "
        "it with the same command as the running workers, or write into another run dir (hydra.run.dir=<new dir>)")


class _FakeTime:
    """``runner.core.claims.time`` for a test: monotonic() moves only by sleep(); time() is the real one."""

    def __init__(self) -> None:
        self.t, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return round(self.t, 9)

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    time = staticmethod(time.time)


class _CountingStore(PosixClaimStore):
    """A POSIX store that counts its reads of each key and can run ``on_get[key]`` before one."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.gets, self.on_get = {}, {}

    def get(self, key):
        self.gets[key] = self.gets.get(key, 0) + 1
        if key in self.on_get:
            self.on_get[key](self.gets[key])
        return super().get(key)


def test_a_joiner_waits_for_a_fleet_document_still_being_written(tmp_path, monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(cl, "time", fake)
    store = _CountingStore(tmp_path)
    desc = {"run_sha": "a" * 64, "batches": 2}
    (store.root / "fleet.json").write_bytes(b"")  # created, bytes not written yet
    full = {**desc, "created_by": {"pid": 7}}
    store.on_get["fleet.json"] = lambda n: n == 4 and store.put("fleet.json", full)  # written before the 4th read
    assert Claims(store, 60).open_fleet(desc) == full
    assert store.gets["fleet.json"] == 4 and fake.sleeps == [0.05] * 3
    store.gets.clear()
    assert Claims(store, 60).open_fleet(desc) == full  # written: read once, no wait
    assert store.gets == {"fleet.json": 1} and fake.sleeps == [0.05] * 3


def test_a_joiner_gives_up_on_an_empty_fleet_document_after_10_s(tmp_path, monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(cl, "time", fake)
    store = _CountingStore(tmp_path)
    (store.root / "fleet.json").write_bytes(b"")  # its creator died before writing it
    with pytest.raises(FleetMismatchError, match=r"run_sha: None \(running workers\) vs 'a' \(this worker\)"):
        Claims(store, 60).open_fleet({"run_sha": "a"})
    assert fake.monotonic() == 10.0 and fake.sleeps == [0.05] * 200 and store.gets["fleet.json"] == 201


def test_register_takes_the_first_free_rank_or_the_one_given(tmp_path):
    store = PosixClaimStore(tmp_path)
    a, b, t = Claims(store, 60), Claims(store, 60), Claims(store, 60)
    t0 = time.time()
    assert a.register(extra={"journal": "items.rank0.jsonl"}) == 0 and a.rank == 0 and a.me["rank"] == 0
    assert t.register(rank=5) == 5 and t.rank == 5 and "rank" not in t.me
    assert b.register() == 1 and b.rank == 1 and b.me["rank"] == 1
    rec = _read(store, "workers/0.json")
    assert rec["rank"] == 0 and rec["beat"] == 0 and rec["journal"] == "items.rank0.jsonl" and rec["pid"] == os.getpid()
    assert t0 <= rec["started_at"] <= time.time() and set(rec) == {"pid", "host", "beat", "started_at", "journal", "rank"}
    rec5 = _read(store, "workers/5.json")
    assert rec5["rank"] == 5 and rec5["beat"] == 0 and set(rec5) == {"pid", "host", "beat", "started_at", "rank"}


def test_workers_alive_ended_and_waited_for(tmp_path):
    store = PosixClaimStore(tmp_path)
    ws = [Claims(store, 60) for _ in range(4)]
    for w in ws:
        w.register()
    obs, now = _clocked(store)
    assert [d["rank"] for d in obs.workers()] == [0, 1, 2, 3]
    assert obs.worker_alive(1) is True  # first look
    now[0] = 9.0
    ws[1].renew()
    assert obs.worker_alive(1) is True  # a beat: observed afresh
    now[0] = 18.9
    assert obs.worker_alive(1) is True
    now[0] = 19.0
    assert obs.worker_alive(1) is False  # stood still for lease_s
    assert obs.worker_alive(7) is True  # no record yet: not judged dead before lease_s
    ws[2].record_beat = 4
    t0 = time.time()
    ws[2].end()
    rec = _read(store, "workers/2.json")
    assert rec == {**ws[2].me, "rank": 2, "beat": 4, "ended": True, "ended_at": rec["ended_at"]}
    assert t0 <= rec["ended_at"] <= time.time()
    assert obs.worker_alive(2) is False  # ended: at once
    Claims(store, 60).end()  # never registered: writes nothing
    fresh, now2 = _clocked(store)  # each worker's record has its own lease clock
    assert fresh.worker_alive(0) is True
    now2[0] = 5.0
    assert fresh.worker_alive(3) is True  # rank 3 first seen at 5 (the same beat, 0, as rank 0)
    now2[0] = 10.0
    assert fresh.worker_alive(3) is True and fresh.worker_alive(0) is False
    assert [d["rank"] for d in obs.workers()] == [0, 1, 2, 3]


def test_wait_workers_returns_once_every_worker_ended_or_died_and_names_the_awaited(tmp_path):
    store = PosixClaimStore(tmp_path)
    a, b = Claims(store, 60), Claims(store, 60)
    a.register()
    b.register()
    a.end()
    waiter = Claims(store, 0.4, poll_s=0.02)
    said = []
    t0 = time.monotonic()
    got = waiter.wait_workers(say=said.append)  # b never renews: dead after 0.4 s of observation
    waited = time.monotonic() - t0
    assert 0.4 <= waited < 3 and [d["rank"] for d in got] == [0, 1]
    assert said == [[1]] or said == []  # at most once within the lease: only b is awaited
    c = Claims(store, 0.6, poll_s=0.02)  # 20 renewals a lease: a renewal thread starved for 0.3 s on a loaded CI
    # machine (two xdist workers on 2 cores) made b look dead at lease 0.3
    stop = threading.Event()

    def beat():
        while not stop.wait(0.03):
            b.renew()
    t = threading.Thread(target=beat, daemon=True)
    t.start()
    said = []
    threading.Timer(2.0, lambda: (stop.set(), b.end())).start()
    t0 = time.monotonic()
    got = c.wait_workers(say=said.append)
    assert 1.9 <= time.monotonic() - t0 < 6 and got[1]["ended"] is True
    assert 2 <= len(said) <= 4 and all(s == [1] for s in said)  # every lease_s (0.6) while b renews for 2 s
    t.join(2)


def test_wait_workers_waits_for_a_worker_whose_record_is_still_being_written(tmp_path):
    """Regression: a worker record still being written reads as ``{}`` (no rank); wait_workers judged it by rank 0,
    so once worker 0 had ended the registering worker was not waited for (the merge could start without it). It is
    judged by its own record: awaited until it has not changed for ``lease_s``."""
    store = PosixClaimStore(tmp_path)
    a = Claims(store, 60)
    a.register()
    a.end()
    (store.root / "workers" / "1.json").write_bytes(b"")  # an exclusive create whose bytes are not written yet
    assert store.get("workers/1.json") == {}
    waiter = Claims(store, 0.4, poll_s=0.02)
    said = []
    t0 = time.monotonic()
    got = waiter.wait_workers(say=said.append)
    assert time.monotonic() - t0 >= 0.4 and got[1] == {}  # waited a whole lease for record 1
    assert said in ([], [[1]])  # named by its index


def test_section_accounts_for_claims_take_overs_losses_and_time(tmp_path):
    store = PosixClaimStore(tmp_path)
    c = Claims(store, 10)
    c.register()
    first = c.try_claim("b0000001")
    c.try_claim("b0000002")
    store.create("b0000002.g1", {})
    c.renew()
    c.complete("b0000001")
    c.busy_s, c.idle_s = 1.23456, 2.5004
    s = c.section()
    assert s == {"store": "posix", "where": str(tmp_path), "lease_s": 10.0, "rank": 0, "claimed": 2, "completed": 1,
                 "reclaimed": [], "lost": ["b0000002"], "busy_s": 1.235, "idle_s": 2.5,
                 "first_claim_at": first.claimed_at, "last_done_at": c.last_done_at}
    assert s["last_done_at"] >= s["first_claim_at"]


# --------------------------------------------------------------------------------------------- stopping
def test_attach_stop_passes_on_a_halt_that_came_first_but_not_over_a_received_signal():
    store = None
    c = Claims.__new__(Claims)  # no store needed: only the stop flag
    c.halted, c._stop = None, None
    stop = SimpleNamespace(signum=None)
    c.attach_stop(stop)
    assert stop.signum is None and c._stop is stop  # not halted: nothing to pass on
    c.halt(10)
    assert stop.signum == 10 and c.halted == 10
    c2 = Claims.__new__(Claims)
    c2.halted, c2._stop = 12, None
    s2 = SimpleNamespace(signum=None)
    c2.attach_stop(s2)
    assert s2.signum == 12  # halted before the run had its stop flag
    c3 = Claims.__new__(Claims)
    c3.halted, c3._stop = 12, None
    s3 = SimpleNamespace(signum=15)
    c3.attach_stop(s3)
    assert s3.signum == 15  # a signal received first is kept
    c3.halt(10)
    assert s3.signum == 15 and c3.halted == 10
    assert store is None


def test_halt_all_halts_every_worker_and_counts_those_still_running(tmp_path, monkeypatch):
    monkeypatch.setattr(cl, "LIVE", [])
    store = PosixClaimStore(tmp_path)
    bare, running, stopped, other = (Claims(store, 60) for _ in range(4))
    running.attach_stop(SimpleNamespace(signum=None))
    stopped.attach_stop(SimpleNamespace(signum=2))  # stopped already: not counted
    other.attach_stop(SimpleNamespace(signum=None))
    assert cl.LIVE == [bare, running, stopped, other]
    assert halt_all(15) == 3
    assert [c.halted for c in cl.LIVE] == [15, 15, 15, 15]
    assert running._stop.signum == 15 and stopped._stop.signum == 2
    assert halt_all(15) == 1  # now only the one without a stop flag
    monkeypatch.setattr(cl, "LIVE", [])
    assert halt_all(15) == 0


# ------------------------------------------------------------------------------------------- fed claims
def test_fed_claims_start_with_nothing_offered():
    fed = FedClaims(PosixClaimStore.__new__(PosixClaimStore), 60, poll_s=0.5)
    assert fed.queue.empty() and fed.answers == {} and fed.pending is None and not fed.pulling.is_set()
    assert fed.closing is False and fed.poll_s == 0.5 and fed.lease_s == 60.0
    fed.close()
    assert fed.closing is True and fed.queue.get_nowait() is None


def test_an_offer_to_a_run_that_ended_is_answered_from_what_it_journaled(tmp_path):
    store = PosixClaimStore(tmp_path)
    fed = FedClaims(store, 60, poll_s=0.01)
    dead = lambda: False  # noqa: E731
    assert fed.offer("b0000001", dead) == "journaled"  # never pulled: nothing to generate
    fed.pending = {"b0000001": "B1", "b0000002": "B2"}
    assert fed.offer("b0000001", dead) == "not_generated"  # pulled, not journaled: the run ended first
    assert fed.offer("b0000003", dead) == "journaled"  # not among the run's batches
    store.create("b0000002.done", {})
    assert fed.offer("b0000002", dead) == "journaled"  # done by another worker
    fed.completed.append("b0000001")
    assert fed.offer("b0000001", dead) == "generated"


def test_an_answered_offer_returns_its_outcome_and_is_forgotten(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    threading.Timer(0.2, lambda: fed._answer("b0000001", "generated")).start()
    t0 = time.monotonic()
    assert fed.offer("b0000001", lambda: True) == "generated"
    assert time.monotonic() - t0 >= 0.15 and fed.answers == {} and fed.queue.get_nowait() == "b0000001"
    fed._answer("b0000002", "journaled")  # answered before it was offered: kept until it is
    ev, box = fed.answers["b0000002"]
    assert ev.is_set() and box == ["journaled"]
    assert fed.offer("b0000002", lambda: True) == "journaled" and fed.answers == {}


def test_concurrent_offers_of_one_batch_share_its_answer(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    got = []
    ts = [threading.Thread(target=lambda: got.append(fed.offer("b0000001", lambda: True)), daemon=True)
          for _ in range(2)]
    for t in ts:
        t.start()
    time.sleep(0.2)
    fed._answer("b0000001", "generated")
    for t in ts:
        t.join(5)
    assert got == ["generated", "generated"] and fed.answers == {}


def test_an_offer_to_an_ended_run_is_answered_within_a_poll(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    t0 = time.monotonic()
    for _ in range(3):
        assert fed.offer("b0000001", lambda: False) == "journaled"
    assert time.monotonic() - t0 < 0.6  # each within one 0.05 s wait


def test_a_stopped_pull_answers_the_offer_in_hand_not_generated(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    fed.queue.put("b0000001")  # offered, and the run is stopped before it takes it
    assert list(fed.pull(["B1"], ["b0000001"], stop=lambda: True)) == []
    ev, box = fed.answers["b0000001"]
    assert ev.is_set() and box == ["not_generated"]


def test_a_fed_batch_another_worker_journaled_is_not_generated_again(tmp_path):
    store = PosixClaimStore(tmp_path)
    store.create("b0000001.done", {})  # journaled by another worker; no claim file of it here
    fed = FedClaims(store, 60, poll_s=0.01)
    fed.queue.put("b0000001")
    fed.queue.put(None)
    assert list(fed.pull(["B1"], ["b0000001"], stop=lambda: False)) == []
    assert fed.answers["b0000001"][1] == ["journaled"] and not store.exists("b0000001.g0")


def test_a_fed_pull_accounts_the_time_spent_generating(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    ids = ["b0000001", "b0000002"]
    for b in ids:
        fed.queue.put(b)
    fed.queue.put(None)
    t0 = time.perf_counter()
    for b in fed.pull(["B1", "B2"], ids, stop=lambda: False):
        time.sleep(0.1)  # generating
        fed.complete(ids[["B1", "B2"].index(b)])
    wall = time.perf_counter() - t0
    assert 0.2 <= fed.busy_s <= wall and fed.completed == ids


def test_take_over_claims_a_fresh_batch_and_takes_a_held_one_at_once(tmp_path, caplog):
    store = PosixClaimStore(tmp_path)
    fed = FedClaims(store, 3600, poll_s=0.01)
    c = fed.take_over("b0000001")  # nobody claimed it: a plain claim
    assert c.gen == 0 and fed.reclaimed == [] and "reclaimed_from" not in _read(store, "b0000001.g0")
    assert not store.exists("b0000001.g1")
    holder = Claims(store, 3600)
    holder.me = {"pid": 31, "host": "h", "rank": 2}
    holder.try_claim("b0000002")
    with caplog.at_level(logging.INFO, logger="runner"):
        c2 = fed.take_over("b0000002")  # held, lease not expired: taken at once
    assert c2.gen == 1 and fed.reclaimed == [{"batch": "b0000002", "from": {"rank": 2, "pid": 31, "host": "h",
                                                                            "gen": 0, "released": False}}]
    assert [r.getMessage() for r in caplog.records if "took over" in r.getMessage()] == [
        "claims: took over batch b0000002 from worker rank 2 (pid 31 on h), whose claim was handed to this worker "
        "again by the scheduler (its worker died or its task failed)"]
    holder.try_claim("b0000003")
    holder.complete("b0000003")
    assert fed.take_over("b0000003") is None and not store.exists("b0000003.g1")  # done meanwhile


def test_the_renewer_beats_every_quarter_lease_and_retries_after_a_storage_error(tmp_path, caplog):
    from runner.core.claims import Renewer

    class Counting(Claims):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.at = []

        def renew(self) -> None:
            self.at.append(time.monotonic())
            if len(self.at) == 1:
                raise OSError("disk full")
            super().renew()

    c = Counting(PosixClaimStore(tmp_path), 0.4)
    c.try_claim(B)
    r = Renewer(c)
    assert r.claims is c and r.thread.name == "runner-claims-renewer" and r.thread.daemon is True
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="runner"), r:
        time.sleep(0.75)
    assert not r.thread.is_alive()  # stopped and joined on exit
    n = len(c.at)
    assert 3 <= n <= 8, c.at
    gaps = [b - a for a, b in zip([t0] + c.at, c.at)]
    assert min(gaps) >= 0.095, gaps  # lease_s / 4 = 0.1 s between beats, never sooner
    assert _read(c.store, f"{B}.g0")["beat"] == n - 1  # every beat after the failed one was written
    assert [x.getMessage() for x in caplog.records if "renewing" in x.getMessage()] == [
        "claims: renewing the leases failed (OSError: disk full); retrying"]
    time.sleep(0.25)
    assert len(c.at) == n  # no beat after stop


def test_pull_walks_the_free_batches_then_takes_an_expired_one_over_and_accounts_its_time(tmp_path):
    store = PosixClaimStore(tmp_path)
    ids = [batch_id(i) for i in range(5)]
    batches = [f"B{i}" for i in range(5)]
    store.create(f"{ids[1]}.done", {})  # journaled already
    alive, dead = Claims(store, 0.3), Claims(store, 0.3)
    alive.try_claim(ids[2])  # held by a worker that renews it
    dead.try_claim(ids[3])  # held by a worker that died: expires after 0.3 s
    beating = threading.Event()

    def beat():
        while not beating.wait(0.03):
            alive.renew()
    threading.Thread(target=beat, daemon=True).start()
    puller = Claims(store, 0.3, poll_s=0.02)
    got, flushes = [], []
    t0 = time.perf_counter()

    def body():
        for b in puller.pull(batches, ids, stop=lambda: False, flush=lambda: flushes.append(1)):
            got.append(b)
            time.sleep(0.05)  # generating
            puller.complete(ids[batches.index(b)])
            if b == "B3":  # the live worker finishes its batch
                beating.set()
                alive.complete(ids[2])
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(10)
    wall = time.perf_counter() - t0
    assert not t.is_alive() and got == ["B0", "B4", "B3"]
    assert puller.reclaimed[0]["batch"] == ids[3] and puller.claimed == [ids[0], ids[4], ids[3]]
    assert not store.exists(f"{ids[1]}.g0") and not store.exists(f"{ids[2]}.g1")
    assert flushes and 0.15 <= puller.busy_s <= wall and 0.2 <= puller.idle_s <= wall
    assert puller.busy_s + puller.idle_s <= wall


def test_pull_stops_when_asked_before_each_batch_and_while_waiting(tmp_path):
    store = PosixClaimStore(tmp_path)
    ids = [batch_id(i) for i in range(3)]
    c = Claims(store, 60, poll_s=0.01)
    asked = []
    stop = lambda: len(asked) >= 1  # noqa: E731
    got = []
    for b in c.pull(["B0", "B1", "B2"], ids, stop=stop):
        got.append(b)
        asked.append(b)
    assert got == ["B0"] and c.claimed == [ids[0]]  # stopped before the second batch
    other = Claims(store, 60, poll_s=0.01)
    n = [0]

    def stop2():
        n[0] += 1
        return n[0] > 5
    assert list(other.pull(["B0"], [ids[0]], stop=stop2)) == [] and n[0] == 6  # waited on b0 until stopped


def test_puts_of_one_key_from_two_threads_never_collide(tmp_path):
    """The renewer thread and the generating thread may rewrite the same claim at once: each writes its own temp
    file (a shared one would be renamed away under the other writer, failing its rename)."""
    store = PosixClaimStore(tmp_path)
    errors = []

    def writer(n):
        for i in range(150):
            try:
                store.put("b0000001.g0", {"writer": n, "beat": i})
            except Exception as e:  # noqa: BLE001
                errors.append(e)
    ts = [threading.Thread(target=writer, args=(n,)) for n in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert errors == [] and store.get("b0000001.g0")["beat"] == 149
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b0000001.g0", "workers"]


def test_a_short_write_of_a_created_claim_file_is_a_storage_error(tmp_path):
    """Regression: create ignored os.write's count, so a short write (a full disk, a file-size limit) returned True
    and left a truncated claim file; fleet.json truncated so made every joiner wait 10 s and be refused."""
    import resource
    import signal

    store = PosixClaimStore(tmp_path)
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4, hard))  # room for 4 bytes of the document only
    try:
        with pytest.raises(StorageError, match="cannot write claim file"):
            store.create("fleet.json", {"run_sha": "a" * 64})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_sig)
    # no truncated claim left behind (it would read as one being written, {}, forever): the key can be created again
    assert not (tmp_path / "fleet.json").exists() and store.get("fleet.json") is None
    assert store.create("fleet.json", {"run_sha": "a" * 64}) and store.get("fleet.json") == {"run_sha": "a" * 64}


def test_pull_claims_every_free_batch_before_taking_an_expired_one_over(tmp_path):
    store = PosixClaimStore(tmp_path)
    ids = [batch_id(i) for i in range(3)]
    Claims(store, 10).try_claim(ids[1])  # its holder died
    puller, now = _clocked(store, poll_s=0.01)
    assert puller.try_reclaim(ids[1]) is None  # watched from t=0
    now[0] = 10.0  # expired, as seen by this worker, before its pull starts
    got = []
    for b in puller.pull(["B0", "B1", "B2"], ids, stop=lambda: False):
        got.append(b)
        puller.complete(ids[["B0", "B1", "B2"].index(b)])
    assert got == ["B0", "B2", "B1"] and [r["batch"] for r in puller.reclaimed] == [ids[1]]


def test_a_fed_batch_journaled_by_the_running_pull_answers_its_offer(tmp_path):
    fed = FedClaims(PosixClaimStore(tmp_path), 60, poll_s=0.01)
    got = []

    def body():
        for b in fed.pull(["B1"], ["b0000001"], stop=lambda: False):
            got.append(b)
            fed.complete("b0000001")
    t = threading.Thread(target=body, daemon=True)
    t.start()
    out = []
    o = threading.Thread(target=lambda: out.append(fed.offer("b0000001", lambda: True)), daemon=True)
    o.start()
    o.join(5)
    assert out == ["generated"] and got == ["B1"] and t.is_alive()  # answered by complete(), the run still pulling
    fed.close()
    t.join(5)
    assert not t.is_alive()
