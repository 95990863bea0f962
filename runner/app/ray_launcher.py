"""``launcher=ray``: the run's batches pulled by a pool of long-lived Ray actors through Ray Data.

The driver (the Hydra job process) holds the run dir, starts or joins Ray (``launcher.address``) and runs
``ray.data.from_items(batch ids).map_batches(BatchWorker, batch_size=1, compute=ActorPoolStrategy(size=
launcher.num_workers, max_tasks_in_flight_per_actor=1), num_gpus=launcher.num_gpus_per_worker)``: one task per batch
of the run (batch ``i`` as a one-worker run forms it), handed to whichever actor is idle, so a slow actor takes
fewer batches and a fast one more.

Each actor (:class:`BatchWorker`) loads the pipeline once, in its constructor (its *start-up*, measured and reported
apart from generation), and keeps one run (``runner.app.execute.run``) going in a thread for its whole life: a
claims worker (``runner.core.claims.FedClaims``) whose batches are the ones Ray hands it. A task returns only once
its batch is journaled (the journal is the checkpoint). When an actor dies (SIGKILL, OOM, a lost node), Ray restarts
it and retries its task (Ray Data's actor pool: ``max_restarts=-1``, ``max_task_retries=-1``); the actor that gets
the batch takes the dead one's claim over at once, so the merge names the dead worker, its pid and the batches it
lost (``claims.deaths``). A batch journaled by an earlier attempt is answered ``journaled`` without generating (a
re-run resumes).

Once every task is answered, the driver marks the pool done (``claims.POOL_DONE``), waits until every actor's run
has ended (or is seen dead), and merges (``runner.core.distributed.merge``), adding the ``ray`` section: the pool,
every actor's start-up, and what each batch's task answered.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from runner.core import resume, rundir
from runner.core.errors import RunnerError

log = logging.getLogger("runner.ray")

#: What the merged manifest's ``parallelism.scheduler`` says of a ``launcher=ray`` run.
RAY_DATA = ("ray.data: map_batches over the run's batch ids with an actor pool (ActorPoolStrategy, one task in "
            "flight per actor): an idle actor gets the next batch; a task of an actor that died is retried on "
            "another actor, which takes the batch's claim over")


class BatchWorker:
    """Ray Data's callable class (one instance per actor): the constructor joins the run dir and starts the run in a
    thread, returning once its model is loaded (or once the run ended: nothing left to generate, or a refusal); each
    call hands its batch ids to the run and returns, per batch, once it is journaled.

    Args:
        cfg: the resolved run config (a plain dict).
        out_dir: the shared run dir; token: the run's token (``runner.core.rundir``: the driver holds the dir).
        overrides: the CLI overrides (the precedence layers); lease_s: ``parallelism.lease_s``.
    """

    def __init__(self, cfg: Dict[str, Any], out_dir: str, overrides: List[str], token: str, lease_s: float) -> None:
        t0 = time.perf_counter()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from runner.app.console import library_env_defaults, profiler_in_this_thread, quiet_libraries, verbose

        library_env_defaults(list(overrides))  # before the run imports torch, as the CLI's entry does
        from runner.core.claims import FedClaims, posix_store
        from runner.core.distributed import Worker

        self.out_dir, self.cfg, self.overrides = Path(out_dir), OmegaConf.create(cfg), list(overrides)
        rundir.join(self.out_dir, token)
        quiet_libraries(verbose(self.overrides))  # a Ray worker is a fresh process: no loader bars there either
        profiler_in_this_thread()  # the run (and its profiled step) goes in a thread below
        self.claims = FedClaims(posix_store(self.out_dir, token), lease_s)
        rank = self.claims.register(extra={"launcher": "ray"})
        self.worker = Worker(rank=rank, world_size=0, launcher="ray", assign="claims", claims=self.claims)
        self.code: Optional[int] = None
        self.error: Optional[BaseException] = None
        # not a daemon: when Ray Data releases an idle actor, its process waits for the run to end (POOL_DONE)
        self.thread = threading.Thread(target=self._run, name="runner-ray-run", daemon=False)
        self.thread.start()
        while not self.claims.pulling.wait(0.05) and self.thread.is_alive():
            pass
        self.startup_s = round(time.perf_counter() - t0, 3)
        log.debug("ray actor rank %d (pid %d) started in %.1f s", rank, os.getpid(), self.startup_s)

    def _run(self) -> None:
        from runner.app.execute import run

        try:
            self.code = run(self.cfg, self.out_dir, overrides=self.overrides, worker=self.worker)
        except BaseException as e:  # noqa: BLE001 - answered to the driver (a refusal) or raised in the next call
            self.error = e
            log.error("ray actor rank %d: the run ended with %s: %s", self.worker.rank, type(e).__name__, e)

    def __call__(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """``{"batch": [i, ...]}`` -> one row per batch: ``outcome`` (``generated``, ``journaled``), this actor's
        ``rank``, ``pid``, ``host``, ``startup_s``, the seconds the call took, and ``refusal`` (a user error every
        actor would raise, pickled, for the driver to raise; empty otherwise).

        Raises:
            RuntimeError: the actor's run ended on an unexpected error, or was stopped, before the batch was
                journaled (Ray Data then fails the run; the driver merges what was journaled).
        """
        import numpy as np

        from runner.core.claims import batch_id

        ids = [int(i) for i in batch["batch"]]
        outcomes, refusal, took = [], "", []
        for i in ids:
            t0 = time.perf_counter()
            if isinstance(self.error, RunnerError):
                outcomes.append("refused")
                refusal = base64.b64encode(pickle.dumps(self.error)).decode()
            else:
                outcome = self.claims.offer(batch_id(i), self.thread.is_alive)
                if outcome == "not_generated" or (self.error is not None and outcome != "generated"):
                    why = f"{type(self.error).__name__}: {self.error}" if self.error else f"exit code {self.code}"
                    raise RuntimeError(f"ray actor rank {self.worker.rank} (pid {os.getpid()}): its run ended "
                                       f"({why}) before batch {batch_id(i)} was journaled")
                outcomes.append(outcome)
            took.append(round(time.perf_counter() - t0, 3))
        n = len(ids)
        return {"batch": np.array(ids, dtype=np.int64), "outcome": np.array(outcomes),
                "rank": np.full(n, self.worker.rank), "pid": np.full(n, os.getpid()),
                "host": np.array([self.worker.host] * n), "startup_s": np.full(n, self.startup_s),
                "call_s": np.array(took), "refusal": np.array([refusal] * n)}

    def close(self) -> None:
        """No more batches: the run finishes (its manifest final, its claims ended) and the actor leaves the dir."""
        self.claims.close()
        self.thread.join()
        rundir.leave(self.out_dir)

    def __del__(self) -> None:  # Ray Data's graceful actor shutdown (ActorPoolMapOperator: __ray_shutdown__)
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown; the driver sees the record end or lapse
            pass


def ray_reason(e: BaseException, limit: int = 300) -> str:
    """Ray's account of a failure, for the manifest: ``ray: <exception class>: <its first line>``, at most ``limit``
    characters (Ray's messages run to many lines of actor and node ids)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    text = f"ray: {type(e).__name__}: {first}" if first else f"ray: {type(e).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _init_ray(cfg: DictConfig) -> float:
    """Start or join Ray (``launcher.address``); returns the seconds it took. Ray Data's own progress bars are off
    (the run's console shows one summary)."""
    import ray

    t0 = time.perf_counter()
    n = int(cfg.launcher.num_workers)
    if not ray.is_initialized():
        ray.init(address=cfg.launcher.address, include_dashboard=False, log_to_driver=True,
                 num_cpus=None if cfg.launcher.address else max(n * cfg.launcher.num_cpus_per_worker, 1))
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    return round(time.perf_counter() - t0, 3)


def _pool(cfg: DictConfig, out_dir: Path, overrides: List[str], token: str, batches: int) -> Any:
    """The Ray Data pipeline: one row per batch id, mapped by the actor pool."""
    import ray

    launcher = cfg.launcher
    return ray.data.from_items([{"batch": i} for i in range(batches)], override_num_blocks=max(1, batches)).map_batches(
        BatchWorker, batch_size=1, batch_format="numpy",
        fn_constructor_args=(OmegaConf.to_container(cfg, resolve=True), str(out_dir), list(overrides), token,
                             float(cfg.parallelism.lease_s)),
        compute=ray.data.ActorPoolStrategy(size=int(launcher.num_workers), max_tasks_in_flight_per_actor=1),
        num_cpus=float(launcher.num_cpus_per_worker), num_gpus=float(launcher.num_gpus_per_worker) or None)


def _run_pool(cfg: DictConfig, out_dir: Path, overrides: List[str], token: str, batches: int) -> Dict[str, Any]:
    """Run the pool to the end. Returns the ``ray`` section (timing, actors, outcomes; ``error``: Ray's account of
    a pool that failed).

    Raises:
        runner.core.errors.RunnerError: the actors' runs refused the config (every actor checks the same one).
    """
    init_s = _init_ray(cfg)
    rows: List[Dict[str, Any]] = []
    error = None
    t0 = time.perf_counter()
    try:
        rows.extend(_pool(cfg, out_dir, overrides, token, batches).iter_rows())
    except Exception as e:  # noqa: BLE001 - recorded; the merge says what was journaled
        log.error("the Ray Data pool failed: %s", ray_reason(e))
        error = ray_reason(e)
    refused = next((r["refusal"] for r in rows if r["refusal"]), None)
    if refused:
        raise pickle.loads(base64.b64decode(refused))
    actors: Dict[str, Dict[str, Any]] = {}
    for r in rows:
        a = actors.setdefault(str(int(r["rank"])), {"pid": int(r["pid"]), "host": str(r["host"]),
                                                    "startup_s": float(r["startup_s"]), "batches": 0})
        a["batches"] += 1
    outcomes = [str(r["outcome"]) for r in rows]
    return {"scheduler": RAY_DATA, "ray_version": __import__("ray").__version__,
            "pool_size": int(cfg.launcher.num_workers), "num_gpus_per_actor": float(cfg.launcher.num_gpus_per_worker),
            "num_cpus_per_actor": float(cfg.launcher.num_cpus_per_worker), "batches": batches,
            "answered": len(rows), "generated": outcomes.count("generated"), "journaled": outcomes.count("journaled"),
            "timing": {"ray_init_s": init_s, "pool_s": round(time.perf_counter() - t0, 3),
                       "actor_startup_s": max((a["startup_s"] for a in actors.values()), default=None)},
            "actors": actors, **({"error": error} if error else {})}


def run_on_ray(cfg: DictConfig, out_dir: Path, overrides: List[str], data: Any) -> Dict[str, Any]:
    """Run ``parallelism=data`` on a Ray Data actor pool and merge (module docstring). Returns the merged manifest
    (``runner.core.distributed.merge``, with the ``ray`` section); ``merged_exit_code`` of it is 0 when every item
    of the dataset was written.

    Args:
        data: the run's items (``runner.app.execute.DatasetItems.read``: keys in dataset order, ``batch_count``).

    Raises:
        ImportError: Ray is not installed (``pip install -e ".[scale]"``).
        runner.core.errors.RunnerError: the actors refused the config (a user error, a refused backend...): raised in
            the driver so the run ends with its exit code, as a one-process run does.
    """
    from runner.app.console import merged_summary
    from runner.core.artifacts import atomic_write_json
    from runner.core.claims import POOL_DONE, Claims, posix_store
    from runner.core.distributed import merge
    from runner.core.manifest import now_iso

    lock = rundir.acquire(out_dir)  # the driver holds the run dir for its actors (re-entrant: run_job holds it)
    try:
        resume.remove_temp_files(out_dir)  # before any actor writes
        pool = _run_pool(cfg, out_dir, overrides, lock.token, int(data.batch_count))
        claims = Claims(posix_store(out_dir, lock.token), float(cfg.parallelism.lease_s))
        claims.store.create(POOL_DONE, {"at": now_iso(), "answered": pool["answered"]})
        workers = claims.wait_workers(lambda waiting: log.info("ray: merging once actor run(s) %s end (or their "
                                                               "records go %g s without renewal)", waiting,
                                                               claims.lease_s))
        resume.remove_temp_files(out_dir)  # what a dead actor was writing goes
        merged = merge(out_dir, len(workers), data.keys(), "ray", data.current(), assign="claims")
        merged["parallelism"]["scheduler"] = pool["scheduler"]
        merged["ray"] = pool
        atomic_write_json(out_dir / "manifest.json", merged)
        log.info("%s", merged_summary(merged, out_dir))  # the run's one summary line (actors log theirs at DEBUG)
        return merged
    finally:
        rundir.release(lock)
