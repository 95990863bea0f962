"""Batches pulled by workers through claims with leases (``parallelism=data parallelism.assign=claims``).

The run's batches are formed exactly as a one-worker run forms them (``engine.batches`` of every item), and batch
``i`` is named ``b<i>``; its composition does not depend on the worker, so neither do its bytes. Every worker
(a torchrun rank, or a ``python -m runner`` process started by hand, on any host that shares the run dir) walks
the batches in order and generates each one it manages to *claim*:

* **claim**: an exclusive create of ``b<i>.g0`` in the run's claims namespace (``claims/<run token>/``): exactly
  one worker succeeds, the others move on.
* **lease**: the holder rewrites its claim (``beat`` + 1) every ``lease_s / 4`` seconds from a background thread
  (:class:`Renewer`) while it generates and writes the batch. Expiry is judged by the *observer*: a claim whose
  ``beat`` has not changed for ``lease_s`` seconds of the observer's own monotonic clock is expired, so hosts
  need no synchronized clocks.
* **reclaim**: an expired claim of generation ``g`` is taken over by an exclusive create of ``b<i>.g<g+1>``
  (one worker wins), which records whom it was taken from (``reclaimed_from``: rank, pid, host). A holder that
  finds a newer generation of its claim has *lost* it; it still finishes its batch (same inputs, same batch, so the
  same bytes: a duplicate, never a different result).
* **done**: only once every record of the batch is in the worker's journal (flushed and fsynced, after the
  artifact) does the worker create ``b<i>.done``. The journal stays the checkpoint: a batch whose items a resume
  would reuse is never claimed, and a new attempt (a new run token) starts a fresh namespace, planning from the
  journals alone.

Workers register as ``workers/<n>.json`` (exclusive create of the first free ``n``: the worker's rank and the
names of its journal and manifest, ``items.rank<n>.jsonl``); the record is renewed like a claim, so whether a worker
is alive is judged the same way. ``fleet.json`` (created by the first worker) holds what every worker must agree
on (run identity, batch composition, lease); a worker whose batches differ is refused (:class:`FleetMismatchError`).

**The store** (:class:`ClaimStore`): the protocol needs four primitives of shared storage, implemented for a POSIX
directory by :class:`PosixClaimStore` and for object storage (S3, GCS through fsspec: conditional PUTs) by
:class:`ObjectClaimStore`. Everything above is written against them.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from runner.core import rundir
from runner.core.errors import ConfigValueError, RunDirInUseError, StorageError

log = logging.getLogger("runner")

CLAIMS_DIR = rundir.CLAIMS_DIR
#: The key a scheduler's driver creates once every batch is answered (:class:`FedClaims`: idle workers end their run).
POOL_DONE = "pool_done.json"
#: What the merged manifest's ``parallelism.sharding`` says of a claims run.
CLAIMING = ("the run's batches (formed as a one-worker run forms them) pulled by the workers: each claims the next "
            "unclaimed batch with a lease it renews, an expired lease is claimed again (runner.core.claims)")


class FleetMismatchError(ConfigValueError):
    """A worker joining a claims run whose batches (run identity, batch composition) or lease differ from those of
    the workers already running; names what differs and the fix."""


# ------------------------------------------------------------------------------------------------ the store
class ClaimStore(abc.ABC):
    """The shared storage the claim protocol runs on: keys (``/``-separated names) holding small JSON documents.

    Four primitives, each atomic for a reader:

    * :meth:`create`: write ``key`` only if it does not exist (exactly one of concurrent creators succeeds);
    * :meth:`put`: replace ``key`` (a reader sees the old or the new document whole);
    * :meth:`get`: the document, or None when there is none;
    * :meth:`exists`.

    POSIX (:class:`PosixClaimStore`): ``O_CREAT | O_EXCL`` for ``create`` (atomic on local filesystems and on NFSv3+),
    write-temp-then-``rename`` for ``put``.

    Object storage (:class:`ObjectClaimStore`, ``s3://``/``gs://`` through fsspec): ``create`` is a conditional PUT
    that fails when the object exists (S3 ``If-None-Match: *``, answered 412 Precondition Failed), ``put`` a PUT
    conditional on the holder's last ETag (``If-Match``), GET and HEAD with read-after-write consistency. No listing
    and no locks are needed; the documents stay well below a kilobyte. A ``create`` that ran but whose answer was
    lost is settled by reading the object back and comparing the writer's ``nonce``.
    """

    name = "abstract"

    @abc.abstractmethod
    def create(self, key: str, doc: Dict[str, Any]) -> bool:
        """Create ``key`` holding ``doc`` unless it exists. Returns True when this call created it.

        Raises:
            runner.core.errors.StorageError: the storage refused the write (not: the key exists).
        """

    @abc.abstractmethod
    def put(self, key: str, doc: Dict[str, Any]) -> None:
        """Replace ``key`` with ``doc`` (readers see the old or the new document whole)."""

    @abc.abstractmethod
    def get(self, key: str) -> Optional[Dict[str, Any]]:
        """The document at ``key``; None when there is none, or when it is being created (an exclusive create
        whose bytes are not complete yet reads as an empty document: ``{}``)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def where(self) -> str:
        """Where the store is, for messages and the manifest."""
        return self.name


class PosixClaimStore(ClaimStore):
    """A :class:`ClaimStore` on a POSIX directory (``root``), shared by every worker (a local disk for workers of
    one host; NFS, Lustre, GPFS for several hosts: ``O_EXCL`` and ``rename`` are atomic on them)."""

    name = "posix"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        try:
            (self.root / "workers").mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create the claims dir {self.root} ({type(e).__name__}: {e}); fix: a run dir "
                               "on storage every worker can write") from None

    def _path(self, key: str) -> Path:
        return self.root / key

    def create(self, key: str, doc: Dict[str, Any]) -> bool:
        """``O_CREAT | O_EXCL`` of ``root/key``, then the document written and fsynced (a reader meanwhile sees an
        empty or partial file: :meth:`get` reads it as ``{}``)."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        except OSError as e:
            raise StorageError(f"cannot create claim file {path} ({type(e).__name__}: {e})") from None
        try:
            data = memoryview((json.dumps(doc) + "\n").encode())
            while data:  # os.write may write part (a full disk, a file-size limit): the rest, or its error
                n = os.write(fd, data)
                if n <= 0:
                    raise OSError(f"write returned {n}")
                data = data[n:]
            os.fsync(fd)
        except OSError as e:
            # a truncated claim reads as one being written ({}) forever: remove it, so others may create the key
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise StorageError(f"cannot write claim file {path} ({type(e).__name__}: {e})") from None
        finally:
            os.close(fd)
        return True

    def put(self, key: str, doc: Dict[str, Any]) -> None:
        """Write a temp file beside ``root/key`` and rename it over (atomic for readers)."""
        from runner.core.artifacts import replace_file

        path = self._path(key)
        try:  # the renewer thread and the generating thread may both write: a temp name per thread
            replace_file(path, (json.dumps(doc) + "\n").encode(),
                         path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}"))
        except OSError as e:
            raise StorageError(f"cannot write claim file {path} ({type(e).__name__}: {e})") from None

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ESTALE):
                return None
            raise
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return {}  # an exclusive create still writing
        return doc if isinstance(doc, dict) else {}

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def where(self) -> str:
        return str(self.root)


class ObjectClaimStore(ClaimStore):
    """A :class:`ClaimStore` on object storage (``s3://``, ``gs://`` through fsspec, ``runner.core.storage``): keys
    under ``url``.

    * :meth:`create`: a conditional PUT, ``If-None-Match: *`` (s3fs ``pipe_file(mode="create")``): the store answers
      412 to every creator but the first. A create whose answer was lost (a timeout, a reset) is settled by reading
      the object back: the document carries a ``nonce`` of this call.
    * :meth:`put`: a PUT conditional on the ETag this store last wrote at the key (``If-Match``), when it wrote one:
      a renewal that finds its claim overwritten by another writer raises instead of clobbering it; an unconditional
      PUT otherwise (a torchrun rank's first record).
    * :meth:`get`/:meth:`exists`: GET and HEAD (S3 and GCS are read-after-write consistent).

    Raises (every method): :class:`runner.core.errors.StorageError` when a request fails (not: the key exists);
    the constructor :class:`runner.core.storage.StorageAccessError` (exit 2) when the store cannot be used at all
    (no credentials, permission, endpoint or bucket: ``runner.core.storage.check_access``).
    """

    name = "object"

    def __init__(self, url: str) -> None:
        from runner.core.storage import check_access, filesystem

        self.url = str(url).rstrip("/")
        self.fs, self.root = filesystem(self.url, "claims store")
        check_access(self.fs, self.root, self.url, "claims store")  # credentials, endpoint, bucket: refused now
        self.etags: Dict[str, str] = {}
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _failed(self, what: str, key: str, e: BaseException) -> StorageError:
        from runner.core.storage import storage_failure

        return storage_failure(what, f"claim object {self.url}/{key}", e)

    def create(self, key: str, doc: Dict[str, Any]) -> bool:
        data = (json.dumps({**doc, "nonce": os.urandom(8).hex()}) + "\n").encode()
        path = self._path(key)
        try:
            out = self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            try:  # did our create go through and only its answer get lost?
                if self.fs.cat_file(path) != data:
                    return False
                out = {"ETag": self.fs.info(path).get("ETag")}
            except FileNotFoundError:
                raise self._failed("creating", key, e) from None
            except OSError as e2:
                raise self._failed("creating", key, e2) from None
        self._remember(key, out)
        return True

    def _remember(self, key: str, out: Any) -> None:
        etag = out.get("ETag") if isinstance(out, dict) else None
        with self._lock:
            if etag:
                self.etags[key] = etag
            else:
                self.etags.pop(key, None)

    def put(self, key: str, doc: Dict[str, Any]) -> None:
        with self._lock:
            etag = self.etags.get(key)
        try:
            out = self.fs.pipe_file(self._path(key), (json.dumps(doc) + "\n").encode(),
                                    **({"IfMatch": etag} if etag else {}))
        except OSError as e:
            if etag and (e.errno == errno.EINVAL or "PreconditionFailed" in str(e) or "412" in str(e)):
                raise StorageError(f"claim object {self.url}/{key} was overwritten by another writer since this "
                                   "worker wrote it (If-Match failed); it is not overwritten back") from None
            raise self._failed("writing", key, e) from None
        self._remember(key, out)

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        try:
            data = self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._failed("reading", key, e) from None
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def exists(self, key: str) -> bool:
        try:
            return self.fs.exists(self._path(key))
        except OSError as e:
            raise self._failed("looking up", key, e) from None

    def where(self) -> str:
        return self.url


def object_store(run_url: str, token: str) -> ObjectClaimStore:
    """The claims namespace of the run (token ``token``) at ``run_url``: ``<url>/claims/<token>/``."""
    return ObjectClaimStore(f"{str(run_url).rstrip('/')}/{CLAIMS_DIR}/{token}")


def posix_store(run_dir: Path, token: str) -> PosixClaimStore:
    """The claims namespace of the run (token ``token``) in ``run_dir``: ``<run dir>/claims/<token>/``."""
    return PosixClaimStore(Path(run_dir) / CLAIMS_DIR / token)


# ----------------------------------------------------------------------------------------------- the protocol
def batch_id(index: int) -> str:
    """The name of the run's batch ``index`` (0-based, in the order a one-worker run generates them)."""
    return f"b{index:07d}"


def batches_sha256(batches: Sequence[Sequence[Any]]) -> str:
    """sha256 of the run's batch composition: the item keys of every batch, in order."""
    return hashlib.sha256(json.dumps([[it.key for it in b] for b in batches]).encode()).hexdigest()


@dataclass
class Claim:
    """A batch this worker holds: its generation ``gen`` (0: first claim; ``g+1``: taken over from generation
    ``g``), the lease ``beat``, and whether another worker took it over meanwhile (``lost``)."""

    batch: str
    gen: int
    doc: Dict[str, Any]
    lost: bool = False
    claimed_at: float = field(default_factory=time.time)


class Lease:
    """Whether documents other workers renew have expired, judged on this process's monotonic clock: a document
    whose ``(gen, beat)`` has not changed for ``lease_s`` seconds of observation (or says ``released``)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self.clock = float(lease_s), clock
        self.seen: Dict[str, Tuple[Any, float]] = {}

    def expired(self, key: str, state: Any, released: bool = False) -> bool:
        """Observe ``state`` of ``key`` now; True once it stood still for ``lease_s`` (or was released)."""
        if released:
            return True
        now = self.clock()
        prev = self.seen.get(key)
        if prev is None or prev[0] != state:
            self.seen[key] = (state, now)
            return False
        return now - prev[1] >= self.lease_s

    def forget(self, key: str) -> None:
        self.seen.pop(key, None)


class Claims:
    """One worker's side of the claim protocol over a :class:`ClaimStore` (see the module docstring).

    Args:
        store: the run's claims namespace.
        lease_s: seconds a claim or a worker record lives without renewal (``parallelism.lease_s``).
        poll_s: seconds between looks at the batches other workers hold, when none is free (default
            ``lease_s / 8``, at most 0.25: the run's last batches are seen done within it).

    Thread safety: the renewal thread (:class:`Renewer`) and the generating thread share the held claims under a
    lock; everything else runs in the generating thread.
    """

    def __init__(self, store: ClaimStore, lease_s: float, poll_s: Optional[float] = None) -> None:
        if not lease_s > 0:
            raise ConfigValueError(f"parallelism.lease_s={lease_s} must be > 0 seconds; fix: parallelism.lease_s=60")
        self.store, self.lease_s = store, float(lease_s)
        self.poll_s = poll_s if poll_s is not None else min(0.25, self.lease_s / 8)
        self.rank: Optional[int] = None
        self.me: Dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held: Dict[str, Claim] = {}
        self.lock = threading.Lock()
        self.lease = Lease(self.lease_s)
        self.done_seen: Set[str] = set()
        self.record_beat = 0
        # this worker's account, for its manifest (``section``)
        self.claimed: List[str] = []
        self.completed: List[str] = []
        self.reclaimed: List[Dict[str, Any]] = []
        self.lost: List[str] = []
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.first_claim_at: Optional[float] = None
        self.last_done_at: Optional[float] = None
        self.reusable_at_start: Optional[int] = None  # items the worker's resume plan found journaled
        self.finished = False  # the worker's pull ended with every batch done (set by the run)
        self.halted: Optional[int] = None  # halt(): the signal this worker was stopped for from another thread
        self._stop: Any = None  # the run's runner.app.signals.Stop (attach_stop)
        LIVE.append(self)

    def attach_stop(self, stop: Any) -> None:
        """The run's stop flag (``runner.app.signals.Stop``, whose ``signum`` the run checks before each batch):
        :meth:`halt` sets it as a received signal would. Called by the run once it has one."""
        self._stop = stop
        if self.halted is not None and stop.signum is None:
            stop.signum = self.halted

    def halt(self, signum: int) -> None:
        """Stop this worker after its current batch, as if ``signum`` had reached its run: used from another thread
        than the run's (a signal handler of the main thread while the run generates in a worker thread: a
        scheduler's preemption notice, ``runner.app.slurm_launcher``). The run then ends ``interrupted``, releasing
        the batches it holds."""
        self.halted = signum
        if self._stop is not None and self._stop.signum is None:
            self._stop.signum = signum

    # ---------------------------------------------------------------------------------- fleet and workers
    def open_fleet(self, descriptor: Dict[str, Any]) -> Dict[str, Any]:
        """Create ``fleet.json`` with ``descriptor`` (``run_sha``, ``batches``, ``batches_sha256``, ``lease_s``), or
        check it against the one the first worker created. Returns the fleet's document.

        Raises:
            FleetMismatchError: a value differs (the run identity, the batches, the lease), naming it and the fix.
        """
        doc = {**descriptor, "created_by": self.me, "created_at": time.time()}
        if self.store.create("fleet.json", doc):
            return doc
        deadline = time.monotonic() + 10.0
        have = self.store.get("fleet.json")
        while not have and time.monotonic() < deadline:  # the first worker is still writing it
            time.sleep(0.05)
            have = self.store.get("fleet.json")
        have = have or {}
        diffs = [f"{k}: {have.get(k)!r} (running workers) vs {v!r} (this worker)" for k, v in descriptor.items()
                 if have.get(k) != v]
        if diffs:
            raise FleetMismatchError(
                f"this worker cannot join the claims run in {self.store.where()}: " + "; ".join(diffs)
                + "; the workers of one run must form the same batches (same config, dataset, batch_size and lease); "
                "fix: start it with the same command as the running workers, or write into another run dir "
                "(hydra.run.dir=<new dir>)")
        return have

    def register(self, rank: Optional[int] = None, extra: Optional[Dict[str, Any]] = None) -> int:
        """Register this worker: ``workers/<n>.json`` for the first free ``n`` (or ``rank``, a torchrun rank).
        Returns the worker's rank (its journal is ``items.rank<n>.jsonl``)."""
        doc = {**self.me, "beat": 0, "started_at": time.time(), **(extra or {})}
        if rank is not None:
            self.store.put(f"workers/{rank}.json", {**doc, "rank": rank})
            self.rank = rank
            return rank
        n = 0
        while not self.store.create(f"workers/{n}.json", {**doc, "rank": n}):
            n += 1
        self.rank = n
        self.me["rank"] = n
        return n

    def wait_workers(self, say: Callable[[List[Any]], None] = lambda waiting: None) -> List[Dict[str, Any]]:
        """Wait until every registered worker has ended or died (its record not renewed for ``lease_s``); ``say``
        is called with the ranks still awaited every ``lease_s``. Returns the workers' records."""
        waited = time.monotonic()
        while True:
            ws = self.workers()  # record n is workers/{n}.json: judged by its own lease, also while its bytes are
            # still being written ({}: no rank yet; reading its rank as 0 judged worker 0 instead, and a registering
            # worker was not waited for once worker 0 had ended)
            waiting = [w.get("rank", n) for n, w in enumerate(ws) if not w.get("ended") and self.worker_alive(n)]
            if not waiting:
                return ws
            if time.monotonic() - waited > self.lease_s:
                say(waiting)
                waited = time.monotonic()
            time.sleep(self.poll_s)

    def workers(self) -> List[Dict[str, Any]]:
        """Every registered worker's record, by rank (ranks are dense from 0)."""
        out, n = [], 0
        while True:
            doc = self.store.get(f"workers/{n}.json")
            if doc is None:
                return out
            out.append(doc)
            n += 1

    def worker_alive(self, rank: int) -> bool:
        """Whether worker ``rank`` still renews its record (observed over ``lease_s``; True until then)."""
        doc = self.store.get(f"workers/{rank}.json") or {}
        return not self.lease.expired(f"workers/{rank}", (doc.get("beat"), doc.get("ended")), False) \
            and not doc.get("ended")

    def end(self) -> None:
        """This worker's record says it ended (it renews no more)."""
        if self.rank is not None:
            self.store.put(f"workers/{self.rank}.json", {**self.me, "rank": self.rank, "beat": self.record_beat,
                                                          "ended": True, "ended_at": time.time()})

    # -------------------------------------------------------------------------------------- the batches
    def _doc(self, batch: str, gen: int, reclaimed_from: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        doc = {"batch": batch, "gen": gen, **self.me, "beat": 0, "claimed_at": time.time()}
        if reclaimed_from is not None:
            doc["reclaimed_from"] = reclaimed_from
        return doc

    def head(self, batch: str, start: int = 0) -> Tuple[int, Optional[Dict[str, Any]]]:
        """The newest generation of ``batch``'s claim at or after ``start`` and its document (-1, None: none)."""
        gen, doc = -1, None
        g = start
        while True:
            d = self.store.get(f"{batch}.g{g}")
            if d is None:
                return gen, doc
            gen, doc = g, d
            g += 1

    def done(self, batch: str) -> bool:
        """Whether ``batch``'s records are journaled (its ``done`` marker exists)."""
        if batch in self.done_seen:
            return True
        if self.store.exists(f"{batch}.done"):
            self.done_seen.add(batch)
            return True
        return False

    def try_claim(self, batch: str) -> Optional[Claim]:
        """Claim ``batch`` when no worker has (generation 0). None: claimed already (or done)."""
        doc = self._doc(batch, 0)
        if not self.store.create(f"{batch}.g0", doc):
            return None
        return self._hold(Claim(batch, 0, doc))

    def try_reclaim(self, batch: str) -> Optional[Claim]:
        """Take ``batch`` over when its newest claim expired (:class:`Lease`). None: alive, done, or another
        worker took it over first."""
        if self.done(batch):
            return None
        gen, doc = self.head(batch)
        if gen < 0:
            return self.try_claim(batch)
        doc = doc or {}
        if not self.lease.expired(batch, (gen, doc.get("beat")), released=bool(doc.get("released"))):
            return None
        if self.done(batch):  # it may have finished while we watched
            return None
        self.lease.forget(batch)
        return self._take(batch, gen, doc, f"was not renewed for {self.lease_s:g} s")

    def _take(self, batch: str, gen: int, doc: Dict[str, Any], why: str) -> Optional[Claim]:
        """Take ``batch`` over from its claim of generation ``gen`` (``doc``): an exclusive create of generation
        ``gen + 1`` naming whom it was taken from. None: another worker took it over first."""
        prev = {k: doc.get(k) for k in ("rank", "pid", "host")} | {"gen": gen, "released": bool(doc.get("released"))}
        new = self._doc(batch, gen + 1, reclaimed_from=prev)
        if not self.store.create(f"{batch}.g{gen + 1}", new):
            return None
        self.reclaimed.append({"batch": batch, "from": prev})
        (log.info if prev["released"] else log.warning)(
            "claims: took over batch %s from worker rank %s (pid %s on %s), whose claim %s",
            batch, prev.get("rank"), prev.get("pid"), prev.get("host"), "it released" if prev["released"] else why)
        return self._hold(Claim(batch, gen + 1, new))

    def _hold(self, c: Claim) -> Claim:
        with self.lock:
            self.held[c.batch] = c
        self.claimed.append(c.batch)
        if self.first_claim_at is None:
            self.first_claim_at = c.claimed_at
        return c

    def renew(self) -> None:
        """Renew every held claim and this worker's record (the :class:`Renewer` thread). A claim with a newer
        generation was taken over: it is marked lost and renewed no more."""
        with self.lock:
            held = list(self.held.values())
        for c in held:
            if c.lost:
                continue
            if self.store.exists(f"{c.batch}.g{c.gen + 1}"):
                c.lost = True
                self.lost.append(c.batch)
                log.warning("claims: batch %s was taken over by another worker (this worker's lease of %g s lapsed); "
                            "finishing it anyway (same inputs, same bytes)", c.batch, self.lease_s)
                continue
            c.doc["beat"] = c.doc.get("beat", 0) + 1
            self.store.put(f"{c.batch}.g{c.gen}", c.doc)
        if self.rank is not None:
            self.record_beat += 1
            doc = self.store.get(f"workers/{self.rank}.json") or {**self.me, "rank": self.rank}
            doc["beat"] = self.record_beat
            self.store.put(f"workers/{self.rank}.json", doc)

    def complete(self, batch: str) -> None:
        """Every record of ``batch`` is journaled: its ``done`` marker (the first completer's), the claim let go."""
        with self.lock:
            c = self.held.pop(batch, None)
        self.store.create(f"{batch}.done", {"batch": batch, **self.me, "gen": c.gen if c else None,
                                            "lost": bool(c and c.lost), "done_at": time.time()})
        self.done_seen.add(batch)
        self.completed.append(batch)
        self.last_done_at = time.time()

    def release_all(self) -> None:
        """Let go of every batch held but not done (a worker that stops on a signal): each claim says
        ``released``, so another worker takes it at once instead of after ``lease_s``."""
        with self.lock:
            held, self.held = list(self.held.values()), {}
        for c in held:
            if not c.lost:
                try:
                    self.store.put(f"{c.batch}.g{c.gen}", {**c.doc, "released": True})
                except StorageError as e:
                    log.warning("claims: could not release batch %s (%s); it is taken over after its lease", c.batch, e)

    def pull(self, batches: Sequence[Any], ids: Sequence[str], stop: Callable[[], bool],
             flush: Callable[[], None] = lambda: None) -> Iterator[Any]:
        """Yield the batches of ``batches`` (named ``ids``) this worker claims, in order, until every one of them
        is done (by any worker) or ``stop()``: first each unclaimed batch, then, while other workers hold the rest,
        every ``poll_s`` the ones whose claim expired. The caller calls :meth:`complete` once a batch is journaled;
        ``flush()`` is called before each wait, so that what this worker generated is journaled (and completed)
        while it waits on the others."""
        watch: List[int] = []
        for i, b in enumerate(batches):
            if stop():
                return
            if self.done(ids[i]):
                continue
            c = self.try_claim(ids[i])
            if c is None:
                watch.append(i)
                continue
            t0 = time.perf_counter()
            yield b
            self.busy_s += time.perf_counter() - t0
        while watch:
            if stop():
                return
            watch = [i for i in watch if not self.done(ids[i])]
            took = None
            for i in watch:
                if self.try_reclaim(ids[i]) is not None:
                    took = i
                    break
            if took is None:
                if watch:
                    flush()
                    t0 = time.perf_counter()
                    time.sleep(self.poll_s)
                    self.idle_s += time.perf_counter() - t0
                continue
            watch.remove(took)
            t0 = time.perf_counter()
            yield batches[took]
            self.busy_s += time.perf_counter() - t0

    def section(self) -> Dict[str, Any]:
        """This worker's ``claims`` section of its manifest: the store, the lease, the batches it claimed,
        completed, took over (from whom) and lost, and seconds generating vs waiting for others."""
        return {"store": self.store.name, "where": self.store.where(), "lease_s": self.lease_s, "rank": self.rank,
                "claimed": len(self.claimed), "completed": len(self.completed), "reclaimed": self.reclaimed,
                "lost": self.lost, "busy_s": round(self.busy_s, 3), "idle_s": round(self.idle_s, 3),
                "first_claim_at": self.first_claim_at, "last_done_at": self.last_done_at}


#: Every :class:`Claims` of this process, in creation order (:func:`halt_all`; a few per process at most).
LIVE: List[Claims] = []


def halt_all(signum: int) -> int:
    """:meth:`Claims.halt` every claims worker of this process (a signal handler's way to stop a run generating in
    another thread after its current batch). Returns how many were running (not ended)."""
    n = 0
    for c in LIVE:
        if c._stop is None or c._stop.signum is None:
            n += 1
        c.halt(signum)
    return n


class FedClaims(Claims):
    """A worker's claims when a scheduler hands out the batches (Ray Data's actor pool, ``runner.app.ray_launcher``)
    instead of the worker walking them: :meth:`offer` (the scheduler's call, in its thread) queues a batch id and
    waits until the batch is journaled; :meth:`pull` (the run's thread) yields the offered batches. The claim files,
    ``done`` markers and the merge are those of :class:`Claims`, so a batch is done only once journaled, and the
    merge names who took what over from whom.

    A batch offered again after its holder died (the scheduler retries a task only when its actor died or the task
    failed) is taken over at once (:meth:`take_over`), without waiting for the lease. Each offer is answered with an
    outcome: ``generated`` (journaled by this worker now), ``journaled`` (an earlier attempt, or another worker,
    journaled it: nothing generated), or ``not_generated`` (the run ended first: stopped, or failed).
    """

    def __init__(self, store: ClaimStore, lease_s: float, poll_s: Optional[float] = None) -> None:
        super().__init__(store, lease_s, poll_s)
        import queue

        self.queue: "queue.Queue[Optional[str]]" = queue.Queue()
        self.answers: Dict[str, Tuple[threading.Event, List[str]]] = {}
        self.pending: Optional[Dict[str, Any]] = None  # batch id -> batch still to generate, once the run pulls
        self.pulling = threading.Event()  # set when the run's pull starts: the model is loaded and warmed up
        self.closing = False

    def offer(self, batch: str, running: Callable[[], bool]) -> str:
        """Hand ``batch`` to the run and wait until it is journaled; returns the outcome (class docstring).
        ``running()`` says whether the run's thread is still alive (an ended run answers at once)."""
        ev, box = self.answers.setdefault(batch, (threading.Event(), []))
        self.queue.put(batch)
        while not ev.wait(0.05):
            if not running():  # the run ended (or never pulled: it had nothing to generate)
                if batch in self.completed:
                    return "generated"
                return ("journaled" if self.pending is None or batch not in self.pending or self.done(batch)
                        else "not_generated")
        self.answers.pop(batch, None)
        return box[0]

    def _answer(self, batch: str, outcome: str) -> None:
        ev, box = self.answers.setdefault(batch, (threading.Event(), []))
        box.append(outcome)
        ev.set()

    def close(self) -> None:
        """No more batches will be offered: the run's pull ends (its run finishes) once it has none in hand."""
        self.closing = True
        self.queue.put(None)

    def take_over(self, batch: str) -> Optional[Claim]:
        """Claim ``batch`` (generation 0), or take it over from whoever held it, at once (the scheduler handed it
        here again: its holder died). None: it is done meanwhile, or another worker took it first."""
        c = self.try_claim(batch)
        if c is not None or self.done(batch):
            return c
        gen, doc = self.head(batch)
        return self._take(batch, gen, doc or {}, "was handed to this worker again by the scheduler (its worker died "
                                                 "or its task failed)")

    def pull(self, batches: Sequence[Any], ids: Sequence[str], stop: Callable[[], bool],
             flush: Callable[[], None] = lambda: None) -> Iterator[Any]:
        """Yield each offered batch this worker still has to generate (the run's ``batches``, named ``ids``), until
        :meth:`close` or ``stop()``; an offered batch that is not among them (journaled before) or is done is
        answered ``journaled`` at once."""
        import queue

        self.pending = dict(zip(ids, batches))
        self.pulling.set()
        while True:
            try:
                bid = self.queue.get(timeout=self.poll_s)
            except queue.Empty:
                flush()
                if stop() or self.store.exists(POOL_DONE):
                    return
                continue
            if bid is None or stop():
                flush()
                if bid is not None:
                    self._answer(bid, "not_generated")
                return
            if bid not in self.pending or self.done(bid) or self.take_over(bid) is None:
                self._answer(bid, "journaled")
                continue
            t0 = time.perf_counter()
            yield self.pending[bid]
            self.busy_s += time.perf_counter() - t0
            flush()  # journaled now: the scheduler's task returns once it is (complete() answers it)

    def complete(self, batch: str) -> None:
        super().complete(batch)
        self._answer(batch, "generated")


class Renewer:
    """A daemon thread renewing a :class:`Claims`' leases every ``lease_s / 4`` seconds until :meth:`stop`; a
    storage error is logged and retried at the next beat (the lease lapses only if it persists)."""

    def __init__(self, claims: Claims) -> None:
        self.claims = claims
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="runner-claims-renewer", daemon=True)

    def __enter__(self) -> "Renewer":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.claims.lease_s / 4):
            try:
                self.claims.renew()
            except OSError as e:
                log.warning("claims: renewing the leases failed (%s: %s); retrying", type(e).__name__, e)

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
