"""``launcher=slurm``: a submitit job array whose tasks claim the run's batches; preemption and time-outs requeue.

The submitting process (``python -m runner parallelism=data launcher=slurm``) does not hold the run dir: it submits
``launcher.num_workers`` tasks (``submitit.SlurmExecutor``, or ``submitit.LocalExecutor`` with
``launcher.executor=local``) of :class:`ClaimsTask` and waits for them. Each task is a claims worker
(``parallelism.assign=claims``, ``runner.core.claims``) of the run in the shared run dir: the tasks join one claims
run (``runner.core.rundir.join_fleet``), pull batches, and the last one to finish merges
(``runner.core.distributed.finish_claims``). The submitter then adds the ``slurm`` section (the jobs and every task's
start, requeue and end, from ``<folder>/tasks.jsonl``) to the merged manifest.

**Preemption and time-outs** go through submitit's checkpoint hook (:class:`submitit.helpers.Checkpointable`):
submitit binds USR2 (what SLURM sends ``signal_delay_s`` before the time limit, ``--signal``) to its
``checkpoint_and_try_requeue``, and the task binds SIGTERM (what SLURM sends a preempted job) to the same handler.
The run generates in a thread of the task; the signal handler only halts the run (flags: it takes no further batch)
and records the signal, and the main thread, which waits for the run in short joins, calls submitit's handler from
there (never inside a signal handler: a handler interrupts the main thread wherever it is, possibly inside a
``logging`` call holding a handler's lock, and a handler that waited there for the run would wait for as long as
the run's thread needs that lock, up to the whole grace time). The run stops after its current batch
(``runner.core.claims.halt_all``: the batch is journaled, the batches it held are released so that the other tasks
take them at once, its manifest ends ``interrupted``); :meth:`ClaimsTask.checkpoint` waits for it, then returns the
same task to requeue (SLURM: ``scontrol requeue``; the local executor: exit 144, its controller starts
the task again). The requeued task joins the run again and plans from the journals: nothing journaled is
generated again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf
from submitit.helpers import Checkpointable

from runner.app.console import profiler_in_this_thread
from runner.core.claims import halt_all
from runner.core.errors import RefusedError, RunnerError
from runner.core.rundir import SLURM_DIR

log = logging.getLogger("runner.slurm")

TASKS_LOG = "tasks.jsonl"


class TaskRefusedError(RunnerError):
    """Every array task stopped at startup on the same user error (bad input, a refused backend): the run ends with
    that error's exit code and outcome, as a one-process run does; the message names the task and its error."""

    def __init__(self, message: str, exit_code: int, outcome: str) -> None:
        super().__init__(message)
        self.exit_code, self.outcome = exit_code, outcome


class SlurmUnavailableError(RefusedError):
    """``launcher.executor=slurm`` where SLURM is not (no ``srun``/``sbatch``): refused naming the fix."""


def folder_of(cfg: DictConfig, out_dir: Path) -> Path:
    """submitit's folder (``launcher.folder``, default ``<run dir>/slurm``)."""
    return Path(cfg.launcher.folder) if cfg.launcher.folder else Path(out_dir) / SLURM_DIR


def _task_env() -> Dict[str, Any]:
    """This task's submitit job id and array task index (None outside submitit)."""
    try:
        import submitit

        env = submitit.JobEnvironment()
        return {"job_id": env.job_id, "array_task": os.environ.get("SLURM_ARRAY_TASK_ID")}
    except RuntimeError:
        return {"job_id": None, "array_task": None}


class ClaimsTask(Checkpointable):
    """One array task: a claims worker of the run (``runner.app.jobs.run_job`` with ``task=True``), generating in a
    thread while the main thread waits, so that a preemption or time-out signal is handled between batches
    (:meth:`checkpoint`). Its state (``attempt``, ``requeues``) travels through submitit's requeue pickle.

    Args:
        cfg: the resolved run config (a plain dict; ``parallelism.assign`` is set to ``claims``).
        out_dir: the shared run dir; folder: submitit's folder (``tasks.jsonl`` is written there).
        overrides: the CLI overrides; grace_s: at most this long the checkpoint waits for the current batch.
        job: ``runner.app.jobs.run_job`` (given, not imported: jobs imports this module).
    """

    def __init__(self, cfg: Dict[str, Any], out_dir: str, overrides: List[str], folder: str, grace_s: float,
                 job: Callable[..., int]) -> None:
        self.cfg, self.out_dir, self.overrides, self.folder, self.grace_s = cfg, out_dir, overrides, folder, grace_s
        self.job = job
        self.attempt = 0
        self.requeues: List[Dict[str, Any]] = []
        self._thread: Optional[threading.Thread] = None
        self._signum: Optional[int] = None
        self._pending: Optional[int] = None  # a signal received and not yet handed to submitit's handler
        self._halted: Optional[int] = None  # the claims workers the handler halted (runner.core.claims.halt_all)
        self._theirs: Optional[Callable[..., Any]] = None  # submitit's checkpoint-and-requeue handler
        self._result: Dict[str, Any] = {}

    _UNPICKLED = ("_thread", "_signum", "_pending", "_halted", "_theirs", "_result")

    def __getstate__(self) -> Dict[str, Any]:  # what a requeue pickles: no thread, no signal, no handler
        return {k: v for k, v in self.__dict__.items() if k not in self._UNPICKLED}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, _thread=None, _signum=None, _pending=None, _halted=None, _theirs=None,
                             _result={})

    def _event(self, event: str, index: int, **extra: Any) -> None:
        """One line of ``<folder>/tasks.jsonl`` (append-only, one ``write`` per line)."""
        doc = {"event": event, "index": index, "attempt": self.attempt, "pid": os.getpid(),
               "host": socket.gethostname(), "at": time.time(), **_task_env(), **extra}
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(self.folder) / TASKS_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(doc) + "\n").encode())
        finally:
            os.close(fd)

    def _bind_signals(self) -> None:
        """SIGTERM (preemption) goes where submitit sent USR2 (its checkpoint-and-requeue handler): both halt the
        run's claims workers at once (``runner.core.claims.halt_all`` only sets flags: no lock, no I/O, so the run
        takes no further batch) and record the signal (the first one received); :meth:`_wait_run` hands it to
        submitit's handler outside the signal handler."""
        import submitit

        usr = submitit.JobEnvironment._usr_sig()
        theirs = signal.getsignal(usr)
        if not callable(theirs):
            return  # not started by submitit: no requeue to go through
        self._theirs = theirs

        def handler(signum: int, frame: Any) -> None:
            if self._pending is None and self._signum is None:
                self._halted = halt_all(signum)
                self._pending = signum

        signal.signal(usr, handler)
        signal.signal(signal.SIGTERM, handler)

    def _wait_run(self) -> None:
        """Wait for the run's thread in short joins; a signal :meth:`_bind_signals` recorded meanwhile goes to
        submitit's handler from here (:meth:`checkpoint`, the requeue, then ``sys.exit``), in the main thread's
        own frame, holding no lock the run's thread may need."""
        while self._thread.is_alive():
            self._thread.join(0.2)
            signum, self._pending = self._pending, None
            if signum is not None and self._theirs is not None:
                self._signum = signum
                self._theirs(signum, None)

    def __call__(self, index: int) -> Dict[str, Any]:
        """Run the task: returns its exit code, outcome and error (its ``job_status.json``)."""
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self._bind_signals()
        self._event("started", index)
        profiler_in_this_thread()  # the run (and its profiled step) goes in a thread below
        cfg = OmegaConf.create(self.cfg)

        def body() -> None:
            self._result["code"] = self.job(cfg, Path(self.out_dir), list(self.overrides), reraise=False, task=True)

        self._thread = threading.Thread(target=body, name="runner-slurm-run", daemon=True)
        self._thread.start()
        self._wait_run()
        code = int(self._result.get("code", 1))
        self._event("ended", index, exit_code=code)
        return {"index": index, "exit_code": code, **_task_status(Path(self.out_dir))}

    def checkpoint(self, index: int) -> Any:
        """submitit's hook, called by its handler (from :meth:`_wait_run`, once a signal was recorded): halt the run
        after its current batch (journaled, the rest released; the signal handler halted it already), wait for it
        (at most ``grace_s``), and return this task to requeue."""
        signum = self._signum or signal.SIGUSR2
        halted = halt_all(signum) if self._halted is None else self._halted
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join(self.grace_s)
        still = self._thread is not None and self._thread.is_alive()
        unfinished = _held_not_journaled()
        # batch_unfinished: a batch this task claimed is not journaled when it leaves (its claim lapses, another
        # worker takes it over); run_ended: the run's thread returned (it may still be at its end, after the batch:
        # a live merge step or the fleet lock waiting on another worker)
        self._event("requeued", index, signal=signal.Signals(signum).name, halted_workers=halted,
                    waited_s=round(time.monotonic() - t0, 3), batch_unfinished=bool(unfinished),
                    batches_unfinished=unfinished, run_ended=not still)
        self.requeues.append({"signal": signal.Signals(signum).name, "pid": os.getpid(), "at": time.time()})
        self.attempt += 1
        return super().checkpoint(index)


def _held_not_journaled() -> List[str]:
    """The batches this process's claims workers hold whose records are not journaled (no ``done`` marker)."""
    from runner.core.claims import LIVE

    out = []
    for c in LIVE:
        with c.lock:
            held = list(c.held)
        out += [b for b in held if not c.done(b)]
    return sorted(out)


def _task_status(out_dir: Path) -> Dict[str, Any]:
    """The ``job_status.json`` this task's claims worker wrote (``workers/rank<n>/``, or the run's when it merged),
    with its ``rank``; ``{}`` when it wrote none."""
    from runner.core.claims import LIVE
    from runner.core.distributed import WORKER_SUBDIR

    rank = LIVE[-1].rank if LIVE else None
    for path in ([out_dir / WORKER_SUBDIR / f"rank{rank}" / "job_status.json"] if rank is not None else []) + [
            out_dir / "job_status.json"]:
        if path.exists():
            return {"rank": rank, **json.loads(path.read_text())}
    return {"rank": rank}


def _executor(cfg: DictConfig, folder: Path) -> Any:
    """The submitit executor of ``launcher.executor`` with the launcher's resources."""
    import submitit

    la = cfg.launcher
    if str(la.executor) == "local":
        ex = submitit.LocalExecutor(folder=str(folder / "%j"), max_num_timeout=int(la.max_num_timeout))
        ex.update_parameters(timeout_min=int(la.timeout_min), signal_delay_s=int(la.signal_delay_s),
                             gpus_per_node=int(la.num_gpus_per_worker))
        return ex
    try:
        ex = submitit.SlurmExecutor(folder=str(folder / "%j"), max_num_timeout=int(la.max_num_timeout))
    except RuntimeError as e:  # submitit: 'Could not detect "srun"'
        raise SlurmUnavailableError(f"launcher=slurm with launcher.executor=slurm: {e} (submitit submits with sbatch "
                                    "from a machine of the cluster); fix: run the command on a SLURM login node, or "
                                    "launcher.executor=local to run the array on this machine") from None
    ex.update_parameters(**slurm_parameters(cfg))
    return ex


def slurm_parameters(cfg: DictConfig) -> Dict[str, Any]:
    """``submitit.SlurmExecutor.update_parameters`` of the launcher: ``--time``, ``--signal=USR2@signal_delay_s``,
    one task per job, ``--cpus-per-task``, ``--gpus-per-node``, ``--partition``, ``--mem``, the array's
    parallelism (every task at once)."""
    la = cfg.launcher
    params: Dict[str, Any] = dict(time=int(la.timeout_min), signal_delay_s=int(la.signal_delay_s), ntasks_per_node=1,
                                  cpus_per_task=max(1, int(la.num_cpus_per_worker)),
                                  array_parallelism=int(la.num_workers), job_name="runner")
    if int(la.num_gpus_per_worker):
        params["gpus_per_node"] = int(la.num_gpus_per_worker)
    if la.partition:
        params["partition"] = str(la.partition)
    if la.mem_gb:
        params["mem"] = f"{int(la.mem_gb)}GB"
    return params


def read_tasks(folder: Path) -> List[Dict[str, Any]]:
    """The events of ``<folder>/tasks.jsonl`` (every task's start, requeue and end), in order."""
    path = folder / TASKS_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(jobs: List[Any]) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Each job's result (the task's status) or its error, in array order."""
    results, errors = [], []
    for i, job in enumerate(jobs):
        try:
            results.append(job.result())
        except Exception as e:  # noqa: BLE001 - a task that failed: recorded, the merge says what is missing
            first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
            errors.append(f"task {i} (job {job.job_id}): {first}")
            log.error("slurm: task %d (job %s) failed: %s", i, job.job_id, e)
    return results, errors


def run_on_slurm(cfg: DictConfig, out_dir: Path, overrides: List[str], job: Callable[..., int]
                 ) -> Optional[Dict[str, Any]]:
    """Submit the array, wait for it and return the merged manifest (written by the last task), with the ``slurm``
    section added; None when no task merged (batches left: every task stopped first). ``job``: what each task runs
    (``runner.app.jobs.run_job``).

    Raises:
        ImportError: submitit is not installed (``pip install -e ".[scale]"``).
        TaskRefusedError: every task stopped at startup on a user error (the first one's is raised).
    """
    from runner.app import checks
    from runner.core.artifacts import atomic_write_json

    checks.check_schema(cfg)  # what can be checked here is, before anything is submitted
    checks.check_run_values(cfg)
    out_dir = Path(out_dir)
    folder = folder_of(cfg, out_dir)
    task_cfg = OmegaConf.to_container(cfg, resolve=True)
    task_cfg["parallelism"]["assign"] = "claims"  # the tasks pull the batches (recorded so in their config)
    task = ClaimsTask(task_cfg, str(out_dir), list(overrides), str(folder),
                      grace_s=max(1.0, float(cfg.launcher.signal_delay_s) - 10.0), job=job)
    jobs = submit(cfg, folder, task)
    log.info("slurm: submitted %d task(s) (%s executor): job(s) %s; logs in %s", len(jobs), cfg.launcher.executor,
             ", ".join(str(j.job_id) for j in jobs), folder)
    results, errors = _wait(jobs)
    manifest = out_dir / "manifest.json"
    merged = json.loads(manifest.read_text()) if manifest.exists() else None
    if merged is None or (merged.get("parallelism") or {}).get("launcher") != "slurm":
        refused = [r for r in results if r.get("outcome") in ("refused", "invalid")]
        if refused and len(refused) == len(jobs):
            r = refused[0]
            raise TaskRefusedError(f"every array task stopped at startup; task {r['index']}: {r.get('error_type')}: "
                                   f"{r.get('error')}", int(r["exit_code"]), str(r["outcome"]))
        log.error("slurm: no task merged the run (its batches are not all done: %s); fix: submit the same command "
                  "again (it resumes from the journals)", "; ".join(errors) or "every task stopped first")
        return None
    merged["slurm"] = {"executor": str(cfg.launcher.executor), "folder": str(folder),
                       "jobs": [str(j.job_id) for j in jobs], "results": results, "errors": errors,
                       "tasks": read_tasks(folder)}
    atomic_write_json(manifest, merged)
    return merged


def submit(cfg: DictConfig, folder: Path, task: ClaimsTask) -> List[Any]:
    """``launcher.num_workers`` array tasks of ``task`` (``executor.map_array``; index ``i`` each)."""
    folder.mkdir(parents=True, exist_ok=True)
    return _executor(cfg, folder).map_array(task, list(range(int(cfg.launcher.num_workers))))
