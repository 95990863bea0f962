"""Data parallelism on engines people already run: torchrun (one node) and Ray (clusters).

``parallelism=data`` deals the run's batches over the workers (``shard``); each worker runs the
same resolved config on its shard and writes into the one run dir: images under ``images/``, its journal
``items.rank<r>.jsonl`` and its manifest ``manifest.rank<r>.json``. Rank 0 (torchrun) or the driver (Ray) then
merges the journals into one ``items.jsonl`` in dataset order and the manifests into one ``manifest.json`` that
lists every worker (host, device, rank, shard size, status, evidence). Seeds belong to rows, so the artifacts are
the same whatever the world size.

``parallelism.assign=claims``: no deal; every worker (a torchrun rank, or a process started by hand:
:func:`finish_claims` then lets the last one merge) pulls batches through ``runner.core.claims`` and journals what it
generated; :func:`merge` (``assign="claims"``) adds the ``claims`` section (who took over what, who died).

torchrun: ranks agree on the run dir before Hydra starts (rank 0 picks it and broadcasts it over a gloo process
group, used for control messages only), so only rank 0 owns the Hydra run dir; rank r > 0 keeps its Hydra logs
in ``<run dir>/workers/rank<r>``.

``parallelism=ulysses|ring`` (context parallelism, :class:`Layout`): the world is a mesh ``(data, ring, ulysses)``;
the ranks of one context group (``ring_degree x ulysses_degree`` ranks) compute the same items together, each
holding a slice of every sequence (diffusers' ``ContextParallelConfig``, applied by the engine); the ``data``
groups shard the dataset like ``parallelism=data``. Only the group's first rank (its *writer*) writes images and a
journal; every rank writes its manifest (its role and its evidence), and the merge lists them all.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from runner.core import rundir
from runner.core.artifacts import atomic_write_json
from runner.core.errors import (ConfigValueError, ForeignDirError, RefusedError, RunDirInUseError, RunDirLockError,
                                 RunnerError)

log = logging.getLogger("runner")

WORKER_SUBDIR = rundir.WORKER_SUBDIR
SHARDING = "the run's batches dealt whole, in order, each to the rank with the fewest items (see shard)"


CONTEXT_MODES = ("ulysses", "ring")
MESH_DIMS = ("data", "ring", "ulysses")


class ParallelismConfigError(ConfigValueError):
    """A ``parallelism`` setting that cannot describe this launch (degrees, world size, launcher); names the field,
    the value and the fix."""


class ParallelismUnsupportedError(RefusedError, ValueError):
    """A valid context-parallel request this model, backend or platform cannot run (heads not divisible by the
    Ulysses degree, an attention backend without context-parallel support, a model with no context-parallel plan);
    names what refuses it and the fix."""


@dataclass(frozen=True)
class Layout:
    """The device mesh of a context-parallel run: ``data x ring x ulysses`` ranks, rank-major in that order
    (``rank = (d * ring + r) * ulysses + u``, the order of ``torch.distributed.device_mesh.init_device_mesh``)."""

    mode: str
    data: int
    ring: int
    ulysses: int

    @property
    def context(self) -> int:
        """Ranks per context group (each item's sequence is split over them)."""
        return self.ring * self.ulysses

    @property
    def world_size(self) -> int:
        return self.data * self.context

    def role(self, rank: int) -> Dict[str, Any]:
        """Rank ``rank``'s place in the mesh: its data group, its ring and Ulysses ranks, whether it writes."""
        d, c = divmod(rank, self.context)
        r, u = divmod(c, self.ulysses)
        return {"rank": rank, "data_group": d, "context_rank": c, "ring_rank": r, "ulysses_rank": u,
                "writes_artifacts": c == 0,
                "context_group": list(range(d * self.context, (d + 1) * self.context))}

    def section(self) -> Dict[str, Any]:
        """The mesh for the manifest's ``parallelism``: shape, dimension names, the rank at every coordinate."""
        ranks = [[[(d * self.ring + r) * self.ulysses + u for u in range(self.ulysses)] for r in range(self.ring)]
                 for d in range(self.data)]
        return {"shape": [self.data, self.ring, self.ulysses], "dim_names": list(MESH_DIMS), "ranks": ranks}


def layout(cfg: Any, world_size: Optional[int]) -> Optional[Layout]:
    """The context-parallel layout of ``cfg`` for a launch of ``world_size`` ranks (None: not a context mode).

    Raises:
        ParallelismConfigError: a degree below 1 (or below 2 for the mode's own), no torchrun, another launcher,
            or ``data x ulysses_degree x ring_degree`` other than the world size; each names the field and the fix.
    """
    par = cfg.parallelism
    mode = str(par.mode)
    if mode not in CONTEXT_MODES:
        return None
    u, r = int(par.ulysses_degree), int(par.ring_degree)
    for key, v in (("ulysses_degree", u), ("ring_degree", r)):
        if v < 1:
            raise ParallelismConfigError(f"parallelism.{key}={v} must be >= 1")
    own = {"ulysses": ("ulysses_degree", u), "ring": ("ring_degree", r)}[mode]
    if own[1] < 2:
        raise ParallelismConfigError(f"parallelism={mode} with parallelism.{own[0]}={own[1]}: the sequence would not "
                                     f"be split; fix: parallelism.{own[0]}=2 (or more), or parallelism=single")
    if cfg.launcher.name != "local":
        raise ParallelismConfigError(f"parallelism={mode} with launcher={cfg.launcher.name}: context parallelism runs "
                                     "under torchrun only so far (its ranks need one process group); fix: launcher=local "
                                     f"and `torchrun --nproc-per-node N -m runner parallelism={mode}`")
    ctx = u * r
    if world_size is None:
        raise ParallelismConfigError(
            f"parallelism={mode} needs {ctx} ranks per context group (ulysses_degree={u} x ring_degree={r}): launch "
            f"with `torchrun --nproc-per-node {ctx} -m runner parallelism={mode}` (or a multiple of {ctx}, for "
            "data-parallel groups)")
    data = par.data
    if data is None:
        if world_size % ctx:
            raise ParallelismConfigError(
                f"torchrun started {world_size} ranks, not a multiple of the context degree {ctx} (parallelism."
                f"ulysses_degree={u} x parallelism.ring_degree={r}); fix: --nproc-per-node {max(ctx, world_size // ctx * ctx)}"
                " or other degrees")
        data = world_size // ctx
    data = int(data)
    if data < 1 or data * ctx != world_size:
        raise ParallelismConfigError(
            f"parallelism.data={data} x parallelism.ulysses_degree={u} x parallelism.ring_degree={r} = {data * ctx} "
            f"ranks, but torchrun started {world_size} (WORLD_SIZE); fix: --nproc-per-node {max(1, data) * ctx}, or "
            "parallelism.data=null to use every rank")
    return Layout(mode=mode, data=data, ring=r, ulysses=u)


@dataclass(frozen=True)
class Worker:
    """One data-parallel worker: its rank among ``world_size``, host, and the launcher that started it; under
    context parallelism its ``layout`` (which data group it serves, whether it writes)."""

    rank: int
    world_size: int
    launcher: str
    host: str = socket.gethostname()
    layout: Optional[Layout] = None
    assign: str = "static"
    claims: Any = field(default=None, compare=False, repr=False)  # runner.core.claims.Claims under assign=claims

    @property
    def journal(self) -> str:
        return f"items.rank{self.rank}.jsonl"

    @property
    def manifest(self) -> str:
        return f"manifest.rank{self.rank}.json"

    @property
    def shards(self) -> int:
        """How many shards the dataset is dealt into (data-parallel groups)."""
        return self.layout.data if self.layout is not None else self.world_size

    @property
    def shard_index(self) -> int:
        """Which shard this worker computes (its data group)."""
        return self.layout.role(self.rank)["data_group"] if self.layout is not None else self.rank

    @property
    def writes(self) -> bool:
        """Whether this worker writes artifacts and a journal (a context group's first rank; every data worker)."""
        return self.layout is None or self.layout.role(self.rank)["writes_artifacts"]


def shard(batches: List[List[Any]], world_size: int, rank: int) -> List[Any]:
    """The items of ``rank``: the run's batches (``runner.core.dataset.batches`` of every item, formed exactly as a
    one-worker run forms them) dealt whole, in order, each to the rank with the fewest items so far (ties: the
    lowest rank). Each item therefore keeps its batch peers
    and its position in the batch, so a GPU computes it with the same kernels and reduction order as a
    one-worker run does (GEMM kernels may round a row differently at another position in M, seen on the H200).
    Balanced: shard sizes differ by at most ``batch_size`` items.

    Returns:
        The rank's items, batch after batch (re-batching them with the same ``batch_size`` gives back the same
        batches).
    """
    load = [0] * world_size
    mine: List[Any] = []
    for b in batches:
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += len(b)
        if r == rank:
            mine.extend(b)
    return mine


def torchrun_worker(lay: Optional[Layout] = None) -> Optional[Worker]:
    """The torchrun worker of this process (from ``RANK``/``WORLD_SIZE``), or None outside torchrun."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        return Worker(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), launcher="torchrun",
                      layout=lay)
    return None


def torchrun_exit_line(code: int, outcome: str, error: BaseException, job_dir: Path) -> Optional[str]:
    """The one line rank 0 prints under torchrun when the run stops on a runner error: torchrun exits 1 and prints
    its own ``ChildFailedError`` traceback whatever a rank's exit code (2 for a refusal or bad input, 3 for
    contradicting evidence), so the line names the runner's exit code, the outcome and the error, and where it is
    recorded. None outside torchrun, on a rank other than 0 (every rank checks the same config and would say the
    same) and with one rank."""
    w = torchrun_worker()
    if w is None or w.world_size < 2 or w.rank != 0:
        return None
    return (f"runner: exit {code} ({outcome}) on every rank: {type(error).__name__}: {str(error).rstrip('.')}; "
            f"torchrun reports this as its own exit 1 with a ChildFailedError traceback: the runner's exit code is {code}, recorded "
            f"in {Path(job_dir) / 'job_status.json'}")


def _control_group() -> None:
    """The default process group: gloo for CPU tensors (control messages, CPU context parallelism) and, where CUDA
    is available, NCCL for CUDA tensors (the all-to-all / all-gather of context parallelism on GPUs; NCCL only
    creates a communicator at its first CUDA collective, so data-parallel runs never do). In a group torchrun
    restarted (``TORCHELASTIC_RESTART_COUNT`` > 0) the store's keys are prefixed with the attempt."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if not restart or not {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"} <= set(os.environ):
        dist.init_process_group(backend)
        return
    # A group torchrun's agent restarted (--max-restarts): the agent's store (same MASTER_PORT) still holds the
    # addresses the dead attempt's ranks published, and gloo's connectFullMesh may read those (connection refused,
    # or a hang); each attempt's keys go under their own prefix.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, multi_tenant=not agent)
    dist.init_process_group(backend, store=dist.PrefixStore(f"runner/attempt{restart}", store), rank=rank,
                            world_size=world)


def init_context_groups(worker: Optional[Worker]) -> None:
    """Create the gloo process group of every context group (``torch.distributed.new_group`` is entered by every
    rank for every group, in the same order, so each rank calls this once at startup); no-op outside context
    parallelism."""
    if worker is None or worker.layout is None or _GROUPS:
        return
    import torch.distributed as dist

    _control_group()
    lay = worker.layout
    for d in range(lay.data):
        ranks = tuple(range(d * lay.context, (d + 1) * lay.context))
        _GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo")


def context_group_any(flag: bool, worker: Optional[Worker]) -> bool:
    """Whether ``flag`` is set on any rank of this worker's context group (``flag`` itself outside context
    parallelism). Every rank of a group must run the same batches (each forward is a collective over the group),
    so a stop signal seen by one rank stops them all after the same batch (groups from
    :func:`init_context_groups`)."""
    if worker is None or worker.layout is None:
        return flag
    import torch
    import torch.distributed as dist

    group = _GROUPS[tuple(worker.layout.role(worker.rank)["context_group"])]
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


_GROUPS: Dict[tuple, Any] = {}


def agree_argv(argv: List[str]) -> List[str]:
    """Under torchrun with ``WORLD_SIZE > 1``: make every rank use rank 0's run dir (rank r > 0 logs to
    ``<dir>/workers/rank<r>``). Returns the argv to hand to Hydra; unchanged outside torchrun."""
    w = torchrun_worker()
    if w is None or w.world_size == 1:
        return argv
    import torch.distributed as dist

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.core.paths import hydra_quote

    _control_group()
    given = next((a for a in argv if a.startswith("hydra.run.dir=")), None)
    text = OverridesParser.create().parse_override(given).value() if given else None
    if isinstance(text, str) and "${" not in text:  # a plain path: quoted again below, whatever it holds
        given = hydra_quote(text)
    elif given:
        given = given.split("=", 1)[1]  # an interpolation: passed on as written
    box = [given or (_default_dir(w) if w.rank == 0 else None)]
    dist.broadcast_object_list(box, src=0)
    run_dir = box[0]
    argv = [a for a in argv if not a.startswith("hydra.run.dir=")]
    if w.rank == 0:
        return argv + [f"hydra.run.dir={run_dir}"]
    if isinstance(text, str) and "${" not in text:
        return argv + [f"hydra.run.dir={hydra_quote(f'{text}/{WORKER_SUBDIR}/rank{w.rank}')}"]
    return argv + [f"hydra.run.dir={run_dir}/{WORKER_SUBDIR}/rank{w.rank}"]


#: Where rank 0 notes the default run dir it picked, per torchrun run id (``TORCHELASTIC_RUN_ID``).
RESTART_NOTES = Path("outputs/runs/.torchrun")


def _default_dir(w: Worker) -> str:
    """Rank 0's default run dir (no ``hydra.run.dir``): a new one per torchrun launch, the same one when torchrun's
    agent restarts the group (``--max-restarts``: ``TORCHELASTIC_RESTART_COUNT`` > 0 with the same
    ``TORCHELASTIC_RUN_ID``), so the restarted ranks resume the run instead of starting another (noted in
    ``outputs/runs/.torchrun/<run id>``)."""
    now = datetime.now()
    note = RESTART_NOTES / "".join(c if c.isalnum() or c in "-_." else "_" for c in os.environ["TORCHELASTIC_RUN_ID"])
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 and note.is_file():
        return note.read_text().strip()
    run_dir = f"outputs/runs/{now:%Y-%m-%d}/{now:%H-%M-%S-%f}-{os.getpid()}-dp{w.world_size}"
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        note.write_text(run_dir + "\n")
    except OSError:
        pass  # no note: a restart picks a new dir (the run starts over there)
    return run_dir


def shared_run_dir(hydra_run_dir: Path) -> Path:
    """The run dir all workers write into (rank r > 0 runs Hydra in ``<run dir>/workers/rank<r>``)."""
    if hydra_run_dir.parent.name == WORKER_SUBDIR:
        return hydra_run_dir.parent.parent
    return hydra_run_dir


_CLAIMED: Dict[str, Optional[str]] = {}  # run dir -> the run's token, once claimed by this torchrun rank


def claim_run_dir(out_dir: Path, worker: Optional[Worker], create: bool = True,
                  key: Optional[str] = None) -> Optional[str]:
    """Hold ``out_dir`` for this torchrun run before anything is written into it; returns the run's token (None:
    a missing dir not created, ``create=False``).

    Rank 0 takes the run dir's lock (``runner.core.rundir.acquire``), removes the temp files a killed run left (no
    rank writes yet), and broadcasts the outcome over the control group; every other rank then joins the run
    (``runner.core.rundir.join``: a shared lock on ``workers.lock``), or, when rank 0 was refused, is refused with the
    same error. Once per process and dir (the Hydra callback claims first; ``run_job`` then gets the same token).
    Outside torchrun (or with one rank) this is ``acquire``, counted like it.

    Raises:
        runner.core.errors.RunDirLockError: the dir is held by another run (``RunDirInUseError``), is a user's folder
            (``ForeignDirError``, ``runner.core.rundir.check_own_dir``), or cannot be created.
    """
    if worker is None or worker.world_size == 1:
        lock = rundir.acquire(out_dir, create=create, key=key)
        return lock.token if lock is not None else None
    reg = str(Path(out_dir).resolve())
    if reg in _CLAIMED:
        return _CLAIMED[reg]
    import torch.distributed as dist

    from runner.core import resume

    _control_group()
    box: List[Any] = [None]
    if worker.rank == 0:
        try:
            lock = rundir.acquire(out_dir, create=create, key=key)
            if lock is not None:
                resume.remove_temp_files(out_dir)
            box = [("ok", lock.token if lock is not None else None)]
        except RunDirLockError as e:
            box = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind != "ok":  # every rank is refused with rank 0's error, of its class
        cls = {c.__name__: c for c in (RunDirInUseError, ForeignDirError)}.get(kind, RunDirLockError)
        raise cls(f"(rank 0) {value}")
    if worker.rank != 0 and value is not None:
        rundir.join(out_dir, value)
    _CLAIMED[reg] = value
    return value


class PeerLostError(RunnerError):
    """Another rank of the torchrun group died before the merge (the process group's connection to it closed);
    torchrun's agent stops the group. Names what happens next: with ``--max-restarts`` the group restarts and
    resumes from the journals, else re-running the same command does."""

    exit_code = 1
    outcome = "crashed"


def barrier() -> None:
    """Wait for every torchrun rank (no-op outside a process group).

    Raises:
        PeerLostError: a rank died (gloo: ``Connection closed by peer``), instead of the library's traceback.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLostError(
                f"another rank of the torchrun group died before the merge ({first[:200]}); torchrun stops the group: "
                "started with `torchrun --max-restarts=N` it restarts every rank, which resume from the journals "
                "(a fixed hydra.run.dir, or the default one, kept across restarts); otherwise re-run the same command "
                "(it resumes)") from None


def _ended(status: Optional[str]) -> Optional[str]:
    """A worker's status once every worker ended: ``running`` means its process died without a final status."""
    return "crashed" if status == "running" else status


#: The reason of a worker whose manifest still says ``running`` at the merge, after every worker ended.
DIED_REASON = ("its process ended without a final status (killed, out of memory, or a crash before the run loop "
               "could record one); manifest.rank{rank}.json still said running after every worker ended")


def worker_reason(rank: int, doc: Optional[Dict[str, Any]], reasons: Optional[Dict[int, str]] = None
                  ) -> Optional[str]:
    """Why worker ``rank`` did not complete, for its ``workers[]`` record (None: it completed).

    Args:
        doc: its manifest (``manifest.rank<r>.json``) as read at the merge, or None when it wrote none.
        reasons: what the launcher saw of a worker that died (Ray's exception), by rank; it comes first.
    """
    status = None if doc is None else _ended(doc.get("status"))
    if status in ("completed", "completed_with_failures"):
        return None
    seen = (reasons or {}).get(rank)
    if doc is None:
        why = f"no manifest.rank{rank}.json: the worker died before its run started, or never started"
    elif doc.get("status") == "running":
        why = DIED_REASON.format(rank=rank)
    else:
        why = f"it ended {status}" + (f": {doc['error']}" if doc.get("error") else "")
    return f"{seen}; {why}" if seen else why


def close_dead_workers(out_dir: Path, docs: List[Optional[Dict[str, Any]]], workers: List[Dict[str, Any]]) -> None:
    """Rewrite each worker manifest still at ``running`` when the merge runs (its process died without a final
    status) as ``crashed``, with ``ended_at`` (the merge's time: when its end was established) and ``crash``
    (``reason``, ``detected_by: merge``), so no rank manifest says ``running`` once the run has ended; a
    resume reads it as it read ``running`` (``resumed_from: crashed``).

    Args:
        docs: the rank manifests as read, by rank (None: none written); updated in place.
        workers: the merged ``workers[]`` records, by rank (their ``reason``).
    """
    from runner.core.manifest import now_iso

    for r, doc in enumerate(docs):
        if doc is not None and doc.get("status") == "running":
            doc.update(status="crashed", ended_at=doc.get("ended_at") or now_iso(),
                       crash={"reason": workers[r].get("reason"), "detected_by": "merge"})
            atomic_write_json(out_dir / f"manifest.rank{r}.json", doc)


def worker_entry(rank: int, doc: Optional[Dict[str, Any]], reasons: Optional[Dict[int, str]] = None
                 ) -> Dict[str, Any]:
    """One ``workers[]`` record of the merged manifest (see :func:`merge`) from worker ``rank``'s manifest ``doc``
    as read (None: it wrote none: ``status: missing``); ``reason`` for a worker that did not complete
    (:func:`worker_reason`)."""
    why = worker_reason(rank, doc, reasons)
    if doc is None:
        return {"rank": rank, "status": "missing", "reason": why}
    w = doc.get("worker", {})
    role = {"role": w["role"]} if "role" in w else {}
    return {"rank": rank, **role, "run_id": doc.get("run_id"), "host": w.get("host"),
            "device": doc.get("platform", {}).get("device"),
            "device_name": doc.get("platform", {}).get("probes", {}).get("device_name"),
            "pid": doc.get("evidence", {}).get("pid") or w.get("pid"),  # a dead worker wrote no evidence
            "shard_items": w.get("shard_items"), "status": _ended(doc.get("status")), "counts": doc.get("counts"),
            "evidence_verdict": doc.get("evidence", {}).get("verdict"),
            "resumed_from": _ended((doc.get("resumed_from") or {}).get("status")),
            "timing": {k: doc.get("timing", {}).get(k) for k in ("wall_s", "load_s", "warmup_s", "loop_s",
                                                                 "images_per_hour")},
            "memory": doc.get("memory"), **({"claims": doc["claims"]} if doc.get("claims") else {}),
            **({"signal": doc["interrupt"].get("signal")} if isinstance(doc.get("interrupt"), dict) else {}),
            **({"reason": why} if why else {})}


def worker_failure(merged: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """The job outcome of a merged run with a worker that did not complete: ``(outcome, error)`` for
    ``job_status.json``, the error naming each such worker (rank, pid, host, status, reason), the items no worker
    wrote and the fix; None when every worker completed (the items decide the outcome then). The outcome is
    ``crashed`` when a worker died or wrote no manifest, ``interrupted`` when one was stopped by a signal, else
    ``failed_items``."""
    bad = [w for w in merged.get("workers") or [] if w.get("status") not in ("completed", "completed_with_failures")]
    if not bad or (merged.get("parallelism") or {}).get("assign") == "claims" and not (merged.get("counts") or {}).get(
            "missing"):
        return None  # (claims: the others took over what a dead worker held; its death is in claims.deaths)
    names = "; ".join(f"rank {w['rank']} (pid {w.get('pid')}, host {w.get('host')}) {w.get('status')}: "
                      f"{w.get('reason')}" for w in bad)
    c = merged.get("counts") or {}
    error = (f"{len(bad)} of {len(merged['workers'])} data-parallel workers did not complete: {names}; "
             f"{c.get('missing', 0)} of {c.get('items', 0)} items were not written; fix: re-run the same command "
             "(it resumes: only the missing items are generated)")
    statuses = {w.get("status") for w in bad}
    outcome = ("crashed" if statuses & {"crashed", "missing"} else
               "interrupted" if "interrupted" in statuses else "failed_items")
    return outcome, error


def rank_docs(out_dir: Path, world_size: int, cache: Optional[Dict[int, Tuple[Any, Any]]] = None
              ) -> List[Optional[Dict[str, Any]]]:
    """The workers' manifests (``manifest.rank<r>.json``), by rank (None: none written). ``cache`` (rank ->
    ``((mtime_ns, size), doc)``, kept by the caller between live merge steps): only the manifests that changed since
    are read again (a worker rewrites its own after every batch)."""
    docs: List[Optional[Dict[str, Any]]] = []
    for r in range(world_size):
        p = out_dir / f"manifest.rank{r}.json"
        try:
            s = p.stat()
        except FileNotFoundError:
            docs.append(None)
            continue
        sig = (s.st_mtime_ns, s.st_size)
        if cache is not None and r in cache and cache[r][0] == sig:
            docs.append(cache[r][1])
            continue
        try:
            doc = json.loads(p.read_text())
        except ValueError:  # replaced while read (an atomic rename): the next step reads it
            doc = cache[r][1] if cache is not None and r in cache else None
        if cache is not None and doc is not None:
            cache[r] = (sig, doc)
        docs.append(doc)
    return docs


def _valid_inputs(docs: List[Optional[Dict[str, Any]]],
                  current: Optional[Callable[[List[str]], Any]]) -> Optional[Any]:
    """The ``inputs_sha256`` values each item's ok record may carry (``current`` of the workers' identities)."""
    if current is None:
        return None
    return current([d["identity"]["sha256"] for d in docs if d and (d.get("identity") or {}).get("sha256")])


def _base_doc(docs: List[Optional[Dict[str, Any]]]) -> Dict[str, Any]:
    return next((d for d in docs if d is not None), {})


def _parallelism_section(docs: List[Optional[Dict[str, Any]]], world_size: int, launcher: str,
                         lay: Optional[Layout], assign: str = "static") -> Dict[str, Any]:
    """The merged manifest's ``parallelism``: data parallelism (dealt, or pulled through claims), or the
    context-parallel mesh and roles."""
    if assign == "claims":
        from runner.core.claims import CLAIMING

        return {"mode": "data", "world_size": world_size, "launcher": launcher, "assign": "claims",
                "sharding": CLAIMING}
    if lay is None:
        return {"mode": "data", "world_size": world_size, "launcher": launcher, "sharding": SHARDING}
    return {
        "mode": lay.mode, "world_size": world_size, "launcher": launcher, "data": lay.data,
        "ulysses_degree": lay.ulysses, "ring_degree": lay.ring, "context_degree": lay.context,
        "sharding": SHARDING.replace("rank", "data group") + "; every rank of a context group computes its "
                    "group's items together, the group's first rank writes them",
        "mesh": lay.section(), "roles": [lay.role(r) for r in range(world_size)],
        "context_parallel": {str(r): (d or {}).get("context_parallel") for r, d in enumerate(docs)}}


def _merged_timing(workers: List[Dict[str, Any]], lay: Optional[Layout]) -> Dict[str, Any]:
    """Workers run side by side: the run's generation loop lasts as long as its slowest worker's; images per
    hour are the writing ranks' ok images over it."""
    loops = [w["timing"]["loop_s"] for w in workers if w.get("timing", {}).get("loop_s")]
    walls = [w["timing"]["wall_s"] for w in workers if w.get("timing", {}).get("wall_s")]
    return {"loop_s": max(loops) if loops else None, "wall_s": max(walls) if walls else None,
            "images_per_hour": round(3600 * sum((w.get("counts") or {}).get("ok", 0) for w in workers
                                                if lay is None or lay.role(w["rank"])["writes_artifacts"])
                                     / max(loops), 1) if loops else None,
            "per_worker": "workers[].timing"}


#: Worker evidence verdicts that contradict nothing (``limited``: a check could not be made, recorded).
_CONSISTENT = ("verified", "not_collected")


def _merged_evidence(docs: List[Optional[Dict[str, Any]]], claims: bool = False,
                     running: Sequence[int] = ()) -> Dict[str, Any]:
    """The merged ``evidence``: every worker's section; ``verified`` when every worker verified (or collected
    nothing), ``limited`` when the others are limited, else ``mismatch``; the mismatches named by rank.

    ``claims``: a worker that died (no evidence: its process ended before its verdict) is a limit, not a mismatch,
    when the others took its batches over: ``limits`` names it and how many items it journaled unverified.
    ``running`` (a live merge): these ranks have no verdict yet; while any runs the verdict is ``pending`` (the
    verdicts so far and the mismatches already found are listed)."""
    if running:
        done = [d if r not in running else None for r, d in enumerate(docs)]
        so_far = _merged_evidence([d for d in done if d is not None], claims) if any(done) else {}
        return {"workers": {str(r): (d or {}).get("evidence") for r, d in enumerate(docs)}, "verdict": "pending",
                "pending": sorted(running), "verdict_so_far": so_far.get("verdict"),
                "mismatches": so_far.get("mismatches", [])}
    dead = {r for r, d in enumerate(docs) if claims and (d is None or not (d.get("evidence") or {}).get("verdict"))}
    verdicts = [(d or {}).get("evidence", {}).get("verdict") for r, d in enumerate(docs) if r not in dead]
    verdict = ("verified" if all(v in _CONSISTENT for v in verdicts) and not dead else
               "limited" if all(v in (*_CONSISTENT, "limited") for v in verdicts) else "mismatch")
    doc = {"workers": {str(r): (d or {}).get("evidence") for r, d in enumerate(docs)}, "verdict": verdict,
           "mismatches": [f"rank {r}: {m}" for r, d in enumerate(docs)
                          for m in ((d or {}).get("evidence") or {}).get("mismatches") or []]
           + [f"rank {r}: no manifest" for r, d in enumerate(docs) if d is None and r not in dead]}
    if dead:
        doc["limits"] = [f"rank {r} died before its evidence verdict: the "
                         f"{((d or {}).get('counts') or {}).get('ok', 0)} item(s) it journaled carry no verified "
                         "evidence (its batches still running were taken over by other workers)"
                         for r, d in enumerate(docs) if r in dead]
    return doc


def _claims_section(docs: List[Optional[Dict[str, Any]]], workers: List[Dict[str, Any]],
                    dead: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """The merged manifest's ``claims``: the store and lease, batches claimed and completed per worker, every
    batch taken over (from which worker, by which), and each worker that did not complete with its pid and the
    batches it lost (taken over from it by the others). ``dead`` (a live merge): the ranks whose record went
    ``lease_s`` without renewal (the others still run); None (the final merge): every worker that did not
    complete."""
    secs = {r: (d or {}).get("claims") or {} for r, d in enumerate(docs)}
    taken = [{"batch": t["batch"], "from_rank": t["from"].get("rank"), "from_pid": t["from"].get("pid"),
              "released": t["from"].get("released", False), "by_rank": r}
             for r, sec in secs.items() for t in sec.get("reclaimed") or []]
    deaths = []
    for w in workers:
        if (w.get("status") in ("completed", "completed_with_failures") if dead is None else w["rank"] not in dead):
            continue
        lost = sorted(t["batch"] for t in taken if t["from_rank"] == w["rank"])
        pid = w.get("pid") or next((t["from_pid"] for t in taken if t["from_rank"] == w["rank"]), None)
        deaths.append({"rank": w["rank"], "pid": pid, "host": w.get("host"), "status": w.get("status"),
                       "lost_batches": lost, "taken_over_by": {t["batch"]: t["by_rank"] for t in taken
                                                               if t["from_rank"] == w["rank"]}})
        w["lost_batches"] = lost
    first = [s["first_claim_at"] for s in secs.values() if s.get("first_claim_at")]
    last = [s["last_done_at"] for s in secs.values() if s.get("last_done_at")]
    any_sec = next((s for s in secs.values() if s), {})
    return {"store": any_sec.get("store"), "where": any_sec.get("where"), "lease_s": any_sec.get("lease_s"),
            "claimed": sum(s.get("claimed", 0) for s in secs.values()),
            "completed": sum(s.get("completed", 0) for s in secs.values()),
            "per_worker": {str(r): {k: s.get(k) for k in ("claimed", "completed", "busy_s", "idle_s")}
                           for r, s in secs.items()},
            "taken_over": taken, "deaths": deaths,
            "span_s": round(max(last) - min(first), 3) if first and last else None}


def earlier_deaths(out_dir: Path, token: Optional[str]) -> List[Dict[str, Any]]:
    """The workers of earlier attempts of a claims run dir that died: a torchrun group restarted by its agent
    (``--max-restarts``) after a rank was killed, or claims workers killed before a re-run. Per earlier claims
    namespace (``claims/<token>/``, not ``token``'s), each registered worker whose record never said ``ended``
    (a worker stopped by a signal or an error ends it; a killed one cannot), with its pid, host and the batches
    whose newest claim it held and that nobody completed in that attempt (``lost_batches``: this attempt
    generated them again). Reads the namespace's file names once, and only the claims not done."""
    from runner.core.claims import CLAIMS_DIR

    out: List[Dict[str, Any]] = []
    root = Path(out_dir) / CLAIMS_DIR
    for ns in sorted(p for p in root.iterdir() if p.is_dir() and p.name != token) if root.is_dir() else ():
        dead = {}
        for w in sorted((ns / "workers").glob("*.json")):
            try:
                doc = json.loads(w.read_text())
            except (OSError, ValueError):
                continue
            if not doc.get("ended"):
                dead[doc.get("pid")] = doc
        if not dead:
            continue
        names = os.listdir(ns)
        done = {n[:-len(".done")] for n in names if n.endswith(".done")}
        newest: Dict[str, int] = {}
        for n in names:
            b, sep, g = n.partition(".g")
            if sep and not n.startswith(".") and g.isdigit() and b not in done:
                newest[b] = max(newest.get(b, -1), int(g))
        lost: Dict[Any, List[str]] = {}
        for b, g in sorted(newest.items()):
            try:
                holder = json.loads((ns / f"{b}.g{g}").read_text()).get("pid")
            except (OSError, ValueError):
                continue
            if holder in dead:
                lost.setdefault(holder, []).append(b)
        out += [{"attempt": ns.name, "rank": d.get("rank"), "pid": pid, "host": d.get("host"), "status": "crashed",
                 "lost_batches": lost.get(pid, []), "taken_over_by": "the next attempt (restart or re-run)"}
                for pid, d in dead.items()]
    return out


#: A worker whose rate is below this fraction of the pool's median rate is named slow (``pool.slow``).
SLOW_FRACTION = 0.5


def pool_section(docs: List[Optional[Dict[str, Any]]], counts: Dict[str, int], claims: Optional[Dict[str, Any]],
                 now: float) -> Dict[str, Any]:
    """The pool at a glance (the merged manifest's ``pool``; the console's bar and summary, ``runner.report``):
    items done of the run, batches claimed and retried (taken over from another worker), and per worker its items
    done and its rate (items per second since its first batch, from its manifest's ``progress``: written after
    every batch); ``dead``: the workers that died (``claims.deaths``); ``slow``: the live workers below
    :data:`SLOW_FRACTION` of the median rate (of two or more workers)."""
    dead = {d["rank"]: d for d in (claims or {}).get("deaths") or []}
    per = []
    for r, d in enumerate(docs):
        prog = (d or {}).get("progress") or {}
        done = prog.get("done", 0)
        span = (prog.get("at") or now) - prog["since"] if prog.get("since") is not None else None
        per.append({"rank": r, "pid": ((d or {}).get("worker") or {}).get("pid"), "done": done,
                    "rate_items_per_s": round(done / span, 4) if span and span > 0 else None,
                    "status": "dead" if r in dead else (d or {}).get("status", "missing")})
    rates = sorted(p["rate_items_per_s"] for p in per if p["rate_items_per_s"] and p["rank"] not in dead)
    median = rates[len(rates) // 2] if rates else None
    slow = [p["rank"] for p in per if median and len(rates) > 1 and p["rank"] not in dead
            and (p["rate_items_per_s"] or 0.0) < SLOW_FRACTION * median]
    return {"items": counts.get("items"), "done": counts.get("ok", 0) + counts.get("failed", 0)
            + counts.get("reused", 0), "ok": counts.get("ok", 0), "failed": counts.get("failed", 0),
            "reused": counts.get("reused", 0),
            "claimed": (claims or {}).get("claimed"), "retried": len((claims or {}).get("taken_over") or []),
            "workers": per, "median_rate_items_per_s": median,
            "dead": [{"rank": r, "pid": d.get("pid"), "lost_batches": d.get("lost_batches")} for r, d in dead.items()],
            "slow": slow}


def _merged_counts(st: Dict[str, Any], docs: List[Optional[Dict[str, Any]]], n: int, lay: Optional[Layout],
                   assign: str) -> Dict[str, int]:
    """Same meaning as a one-worker run's counts: ok = written by this attempt, reused = kept from an earlier one;
    plus the run's size and what no worker produced (from the merge state's totals, ``runner.core.live_merge``)."""
    ok, failed = st["counts"]["ok"], st["counts"]["failed"]
    wc = [(d or {}).get("counts") or {} for r, d in enumerate(docs) if lay is None or lay.role(r)["writes_artifacts"]]
    reused = (ok - min(ok, sum(c.get("ok", 0) for c in wc)) if assign == "claims"
              else sum(c.get("reused", 0) for c in wc))  # claims: a worker's share is what it generated
    return {"ok": ok - reused, "failed": failed, "reused": reused, "items": n, "missing": n - ok - failed}


#: A worker's statuses after its verdict step (which writes its ``accuracy`` where its items carry ``expect``).
VERDICT_STATUSES = ("completed", "completed_with_failures", "interrupted", "evidence_mismatch", "limited")


def merged_accuracy(docs: List[Optional[Dict[str, Any]]], keys_in_order: List[str], lay: Optional[Layout],
                    missing: int, assign: str) -> Optional[Dict[str, Any]]:
    """The run's ``accuracy``: the oracle's section recomputed over the union of the writing workers' per-item
    entries (``models.oracles.merged_section``; an item two workers scored counts once); None without an oracle.
    Says ``incomplete`` instead of figures when a writing worker's manifest is missing, a worker ended before its
    verdict step, or (``claims``: a worker scores only what it journaled) items no worker journaled."""
    from models.oracles import merged_section

    sections, gaps = [], []
    for r, d in enumerate(docs):
        if lay is not None and not lay.role(r)["writes_artifacts"]:
            continue
        if d is None:
            gaps.append(f"worker {r}'s manifest is missing")
        elif isinstance(d.get("accuracy"), dict):
            sections.append(d["accuracy"])
        elif d.get("status") not in VERDICT_STATUSES:
            gaps.append(f"worker {r} ended {d.get('status')!r} before scoring its items")
    if assign == "claims" and missing:
        gaps.append(f"{missing} items no worker journaled are not scored")
    return merged_section(sections, keys_in_order, gaps)


def _merged_doc(docs: List[Optional[Dict[str, Any]]], st: Dict[str, Any], workers: List[Dict[str, Any]], n: int,
                launcher: str, lay: Optional[Layout], assign: str, dead: Optional[Sequence[int]] = None
                ) -> Dict[str, Any]:
    """The merged manifest of the workers' manifests ``docs`` and the merge state ``st``: the final one, or
    (``dead`` given: the ranks seen dead so far) a live one (``status: running``)."""
    base = _base_doc(docs)
    merged = dict(base)
    merged.pop("worker", None)
    merged.pop("progress", None)
    merged.pop("accuracy", None)  # rank 0's items only: the final merge recomputes it (:func:`merged_accuracy`)
    merged["run_id"] = st["run_id"] if st.get("run_id") else base.get("run_id")  # what the folder-index rows carry
    merged["counts"] = _merged_counts(st, docs, n, lay, assign)
    merged["dataset"] = {**(base.get("dataset") or {}), "items": n}  # the run's, not rank 0's shard
    if "prompts" in base:  # truncated prompts and ignored fields of the whole run, not of rank 0's shard
        merged["prompts"] = {**base["prompts"], **st["prompts"]}
    merged["parallelism"] = _parallelism_section(docs, len(docs), launcher, lay, assign)
    merged.pop("context_parallel", None)
    merged.pop("claims", None)
    merged["workers"] = workers
    merged["timing"] = _merged_timing(workers, lay)
    running = [w["rank"] for w in workers if w.get("status") in ("running", "starting")] if dead is not None else []
    merged["evidence"] = _merged_evidence(docs, claims=assign == "claims", running=running)
    statuses = {w["status"] for w in workers}
    if assign == "claims":  # whoever wrote them: the items decide
        merged["claims"] = _claims_section(docs, workers, dead)
        statuses = {"completed_with_failures" if merged["counts"]["failed"] else "completed"}
    import time

    merged["pool"] = pool_section(docs, merged["counts"], merged.get("claims"), time.time())
    missing = merged["counts"]["missing"]
    ended = statuses - {"completed", "completed_with_failures"}
    merged["status"] = ("running" if dead is not None else
                        "completed" if statuses == {"completed"} and not missing else
                        "completed_with_failures" if not ended and not missing else
                        "interrupted" if ended == {"interrupted"} else "incomplete")  # (a signal stopped them all)
    merged["failed_workers"] = [w["rank"] for w in workers if w["status"] not in ("completed",
                                                                                   "completed_with_failures",
                                                                                   "running", "starting")]
    merged["merge"] = {"steps": st.get("steps"), "recoveries": st.get("recoveries", 0),
                       "journal_bytes": sum(j["offset"] for j in st["journals"].values()),
                       "updated_at": st.get("updated_at")}
    return merged


def _merge_state(out_dir: Path, keys_in_order: List[str], live: Optional[Any]) -> Any:
    from runner.core.live_merge import JournalMerge

    return live if live is not None else JournalMerge(out_dir, keys_in_order, rundir.run_token(out_dir))


def merge(out_dir: Path, world_size: int, keys_in_order: List[str], launcher: str,
          current: Optional[Callable[[List[str]], Dict[str, List[str]]]] = None,
          lay: Optional[Layout] = None, reasons: Optional[Dict[int, str]] = None,
          assign: str = "static", live: Optional[Any] = None) -> Dict[str, Any]:
    """Merge the workers' journals and manifests of ``out_dir`` into ``items.jsonl`` and ``manifest.json``.

    The journals go through the run's merge state (``runner.core.live_merge.JournalMerge``): what the workers'
    live merge steps (:func:`live_merge`) folded in already is not read again; this reads what they appended since,
    then writes ``items.jsonl`` and ``images/metadata.jsonl`` from the state and removes it.

    Args:
        keys_in_order: every item key of the dataset, in dataset order (the merged journal follows it).
        current: given the workers' run identity hashes, the ``inputs_sha256`` values an item's ok record may
            carry (``runner.app.execute.DatasetItems.current``); an ok record with another value is an earlier config's
            output and is left out (the same rule as a resume's, ``runner.core.resume``). None: every ok record counts.
        lay: the context-parallel layout (None: ``parallelism=data``): counts and throughput come from the writing
            ranks; ``parallelism`` gets the mesh, the degrees and every rank's role.
        reasons: what the launcher saw of each worker that died, by rank (Ray's exception text), added to its
            ``reason``.
        assign: ``claims``: the workers pulled batches (``runner.core.claims``): the merged manifest gets a
            ``claims`` section (:func:`_claims_section`), the status follows the items alone (a worker that died
            while the others took its batches over is recorded in ``claims.deaths``, and does not fail the run),
            and ``reused`` is what no worker of this attempt generated.
        live: this process's merge state (its live steps' counters), or None: the run dir's, by its run token.

    Returns:
        The merged manifest. Its ``status`` is ``completed`` only when every worker completed; ``workers`` lists
        each rank's host, device, pid, shard size, status, counts, evidence verdict, timing, memory, the status
        its previous attempt ended with (``resumed_from``: a worker that died shows ``crashed`` there; a worker
        manifest still at ``running`` when the merge runs, after every worker ended, is ``crashed`` too, and is
        rewritten so: :func:`close_dead_workers`) and, for a worker that did not complete, ``reason``
        (:func:`worker_reason`). ``pool``: :func:`pool_section`; ``merge``: the state's steps and, under
        ``final``, what this last step read (``bytes_read``, ``records_parsed``, ``rereads``).
        ``timing.images_per_hour`` is every worker's ok images over the slowest worker's generation loop.
    """
    # merged after every worker ended: a worker manifest still at ``running`` is one whose process died
    # without a final status (``crashed``)
    docs = rank_docs(out_dir, world_size)
    jm = _merge_state(out_dir, keys_in_order, live)
    before = dict(vars(jm.counters))
    st = jm.step(block=True, valid=_valid_inputs(docs, current), base=_base_doc(docs))
    workers = [worker_entry(r, doc, reasons) for r, doc in enumerate(docs)]
    close_dead_workers(out_dir, docs, workers)
    merged = _merged_doc(docs, st, workers, len(keys_in_order), launcher, lay, assign)
    acc = merged_accuracy(docs, keys_in_order, lay, merged["counts"]["missing"], assign)
    if acc is not None:
        merged["accuracy"] = acc
    if assign == "claims":  # the workers of earlier attempts that died (a torchrun group restarted, a re-run)
        merged["claims"]["deaths"] += earlier_deaths(out_dir, rundir.run_token(out_dir))
        merged["pool"]["dead"] += [{"rank": d["rank"], "pid": d["pid"], "lost_batches": d["lost_batches"],
                                    "attempt": d["attempt"]} for d in merged["claims"]["deaths"] if "attempt" in d]
    merged["merge"]["final"] = {k: v - before[k] for k, v in vars(jm.counters).items() if k != "busy"}
    lock = rundir.held(out_dir)  # the merge runs in the process that holds the run dir (rank 0, the Ray driver)
    if lock is not None:
        merged["lock"] = lock.record()
        merged["owner"] = lock.holder
    merged["folder_metadata"] = jm.write_outputs()  # images/metadata.jsonl follows the merged journal
    merged_attempts(out_dir, merged, docs)
    atomic_write_json(out_dir / "manifest.json", merged)
    jm.remove()
    return merged


def merged_attempts(out_dir: Path, merged: Dict[str, Any], docs: List[Optional[Dict[str, Any]]]) -> None:
    """The merged manifest's ``items_by_attempt`` over the merged ``items.jsonl`` (each item carries the run_id of
    the worker that wrote it: every worker of this attempt counts as the current attempt; earlier attempts from
    rank 0's ``resumed_from.attempts``, kept as the base of the merged manifest), and each attempt's ``items``."""
    from runner.core.provenance import count_items_by_attempt
    from runner.core.sinks import read_journal

    if isinstance(merged.get("resumed_from"), dict):  # rank 0's: its attempts' items counted over the whole run
        merged["resumed_from"] = {**merged["resumed_from"], "attempts": [
            dict(a) for a in merged["resumed_from"].get("attempts") or [] if isinstance(a, dict)]}
    try:
        records = read_journal(out_dir / "items.jsonl")
    except OSError:
        return
    merged["items_by_attempt"] = count_items_by_attempt(records, merged, [(d or {}).get("run_id") for d in docs])


def live_merge(out_dir: Path, jm: Any, world_size: int, launcher: str,
               current: Optional[Callable[[List[str]], Any]] = None, assign: str = "static",
               dead: Sequence[int] = (), cache: Optional[Dict[int, Tuple[Any, Any]]] = None
               ) -> Optional[Dict[str, Any]]:
    """One live merge step, between a worker's batches: fold what the journals appended into the merge state
    ``jm`` (``runner.core.live_merge.JournalMerge``), and write ``manifest.json`` at ``status: running`` with the
    run's totals, every worker's entry, the evidence so far (verdict ``pending``), ``claims`` and ``pool`` as they
    stand (``runner.report`` on the live run shows them). Returns that manifest, or None when another process's
    step is running (nothing waits).

    Args:
        dead: the ranks seen dead so far (a claims worker's record not renewed for ``lease_s``).
        cache: the worker manifests read by earlier steps of this process (:func:`rank_docs`).
    """
    docs = rank_docs(out_dir, world_size, cache)
    st = jm.step(block=False, valid=_valid_inputs(docs, current), base=_base_doc(docs))
    if st is None:
        return None
    workers = []
    for r, doc in enumerate(docs):
        w = worker_entry(r, doc)
        if r not in dead and (doc is None or doc.get("status") == "running"):
            w.update(status="running" if doc is not None else "starting")  # no manifest yet: not started yet
            w.pop("reason", None)
        workers.append(w)
    merged = _merged_doc(docs, st, workers, len(jm.keys), launcher, None, assign, dead=list(dead))
    merged["owner"] = _base_doc(docs).get("owner")
    atomic_write_json(out_dir / "manifest.json", merged)
    return merged


def merged_exit_code(merged: Dict[str, Any]) -> int:
    """Exit code of a merged data-parallel run (``merge``'s result): 0 all written; ``128 + N`` when a signal N
    stopped every worker that did not complete (``interrupted``: the code a one-process run interrupted by N
    exits with; N read from the workers' ``interrupt.signal``, SIGINT when none recorded it); 1 otherwise."""
    if merged["status"] == "completed":
        return 0
    if merged["status"] == "interrupted":
        import signal

        names = [w.get("signal") for w in merged.get("workers") or [] if w.get("status") == "interrupted"]
        name = next((n for n in names if n in signal.Signals.__members__), "SIGINT")
        log.warning("data-parallel run interrupted (%s): workers stopped: %s; missing items: %d", name,
                    merged["failed_workers"], merged["counts"]["missing"])
        return 128 + int(signal.Signals[name])
    log.error("data-parallel run %s: workers not completed: %s; missing items: %d", merged["status"],
              merged["failed_workers"], merged["counts"]["missing"])
    return 1


def worker_record(w: Worker, shard_items: Optional[int]) -> Dict[str, Any]:
    """The ``worker`` section of a worker's manifest (under context parallelism with its ``role``)."""
    doc = {f.name: getattr(w, f.name) for f in fields(w) if f.name not in ("layout", "claims")}
    if w.layout is not None:
        doc["role"] = w.layout.role(w.rank)
    return {**doc, "shard_items": shard_items, "pid": os.getpid()}


def finish_claims(out_dir: Path, worker: Worker, keys_in_order: List[str],
                  current: Optional[Callable[[List[str]], Dict[str, List[str]]]] = None) -> Optional[Dict[str, Any]]:
    """After a claims worker's run (``parallelism.assign=claims`` without torchrun): when the run's batches are
    all done, the first worker to get here (an exclusive create of ``merge.json`` in the claims store) waits until
    every registered worker has ended or died (its record not renewed for ``lease_s``) and merges (:func:`merge`).
    Returns the merged manifest, or None for every other worker (and when batches are left: this worker stopped).
    """
    c = worker.claims
    if not getattr(c, "finished", False):
        return None
    from runner.core.manifest import now_iso

    if not c.store.create("merge.json", {**c.me, "at": now_iso()}):
        return None
    ws = c.wait_workers(lambda waiting: log.info("claims: merging once worker(s) %s end (or their records go %g s "
                                                 "without renewal)", waiting, c.lease_s))
    from runner.core.resume import remove_temp_files

    remove_temp_files(out_dir)  # every worker ended: what a dead one was writing goes
    return merge(out_dir, len(ws), keys_in_order, worker.launcher, current, assign="claims")
