"""One job of the CLI: run it, classify the outcome, and leave a record that sweeps and the matrix can read.

Every job dir gets ``job_status.json``: ``{exit_code, outcome, error_type, error}``. Outcomes:

* ``ok``: every item written, evidence verified (or not collected).
* ``failed_items``: some items failed (non-finite or raised); the rest were written.
* ``crashed``/``interrupted`` of a data-parallel run (Ray, torchrun) whose worker died or was stopped: ``error_type``
  ``WorkerFailed``, ``error`` names each such worker (rank, pid, host, status, reason) and the items not written
  (``runner.core.distributed.worker_failure``); exit 1 as before.
* ``refused``: a documented refusal at startup: an explicitly selected backend cannot run on this platform
  (``runner.core.errors.RefusedError``: ``BackendUnavailableError``, ``AttentionWiringError``). The job dir also gets a
  ``manifest.json`` with ``status: refused``.
* ``invalid``: any other bad input (``runner.core.errors.UserInputError``: unknown names, bad rows, bad paths...), also
  with a ``status: invalid`` manifest.
* ``evidence_mismatch``: what executed differs from the resolution (``runner.core.errors.EvidenceMismatchError``).
* ``crashed``: an unexpected exception (its traceback is in the job log).
* ``interrupted``: a signal stopped it (``128 + N``; a second signal writes this before the process exits).

A :class:`runner.core.errors.RunnerError` carries its own ``outcome`` and ``exit_code``; nothing here lists classes,
except that a run dir held by another run (``runner.core.errors.RunDirLockError``) gets no ``job_status.json`` at all:
the dir is not this job's. The job holds its run dir (``runner.core.rundir``) from before the run until its status is
written; ``RunDirLockCallback`` takes it even earlier, before Hydra writes into the dir.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from runner.core import rundir, storage
from runner.core.artifacts import atomic_write_json
from runner.core.errors import RunDirLockError, RunnerError
from runner.core.manifest import Manifest, git_state, now_iso, package_versions
from runner.core.paths import PROJECT_ROOT

log = logging.getLogger("runner")

EXIT = {"ok": 0, "failed_items": 1, "crashed": 1, "refused": 2, "invalid": 2, "evidence_mismatch": 3}
# Outcomes of a run stopped before anything was generated: recorded with a ``status: <outcome>`` manifest that a
# resume never trusts (``runner.core.resume.previous_run``).
STARTUP_OUTCOMES = ("refused", "invalid")

#: This process's attempts that wrote no ``job_status.json`` because their dir is another run's (it holds that run's
#: records, or another process holds its lock), by the Hydra job dir (resolved): ``{exit_code, outcome, error_type,
#: error, overrides}``. A sweep's summary reads them (``runner.tools.sweep.summarize``), so a job refused there is
#: reported as refused, not as the earlier run its dir still holds.
UNRECORDED: Dict[str, Dict[str, Any]] = {}


def _refusal_manifest(out_dir: Path, cfg: DictConfig, overrides: List[str], status: str, err: BaseException) -> None:
    """A manifest for a run stopped before its model loaded (never trusted by a resume: status refused/invalid)."""
    m = Manifest(out_dir / "manifest.json")
    m.doc.update(status=status, ended_at=now_iso())
    m.section("config", OmegaConf.to_container(cfg, resolve=False))
    m.section("overrides", overrides)
    m.section("error", {"type": type(err).__name__, "message": str(err)})
    m.section("git", git_state(PROJECT_ROOT))
    m.section("packages", package_versions())
    try:
        from runner.core.platform import detect

        m.section("platform", detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes)).to_dict())
    except Exception as e:  # noqa: BLE001 - the platform itself may be what was refused
        m.section("platform", {"error": str(e)})
    m.flush()


def _torchrun_worker(cfg: DictConfig) -> Optional[Any]:
    """This process's ``runner.core.distributed.Worker`` when torchrun started it for a data or context-parallel
    run (a context mode's layout, degrees x data = world size, is checked at startup by ``check_run_values``)."""
    from runner.core import distributed as dp

    if cfg.parallelism.mode not in ("data", *dp.CONTEXT_MODES) or dp.torchrun_worker() is None:
        return None
    try:
        lay = dp.layout(cfg, dp.torchrun_worker().world_size)
    except RunnerError:
        lay = None  # refused by the run's own checks, with the same message
    return dp.torchrun_worker(lay)


def _hold_run_dir(cfg: DictConfig, out_dir: Path, task: bool = False) -> Optional[Any]:
    """Hold the run dir before anything else (re-entrant: the Hydra callback took it already in
    ``python -m runner``); under torchrun the run holds it through rank 0, and every rank learns whether it was
    refused (then None is returned: rank 0's lock holds it).

    Raises:
        runner.core.errors.UserInputError: a path no run can use (exit 2, named); RunDirLockError: another run's.
    """
    from runner.core import distributed as dp
    from runner.core.environment import check_dir

    check_dir(out_dir, _dir_key(cfg))  # a path no run can use is bad input (exit 2, named), not a lock matter
    if task or claims_worker(cfg):  # a peer of the claims run in the dir (or its first worker)
        rundir.join_fleet(out_dir, key=_dir_key(cfg))
        return None
    if slurm_submitter(cfg):  # its array tasks hold the dir together, as a claims run
        return None
    tw = dp.torchrun_worker()
    if tw is not None and tw.world_size > 1:
        dp.claim_run_dir(out_dir, tw, create=not cfg.run.resume, key=_dir_key(cfg))
        return None
    return rundir.acquire(out_dir, create=not cfg.run.resume, key=_dir_key(cfg))


def claims_worker(cfg: Any) -> bool:
    """Whether this process is a claims worker started by hand (``parallelism=data parallelism.assign=claims``,
    ``launcher=local``, not under torchrun): it joins the run dir's claims run instead of holding the dir."""
    from runner.core import distributed as dp

    sel = OmegaConf.select
    return (str(sel(cfg, "parallelism.mode")) == "data" and str(sel(cfg, "parallelism.assign")) == "claims"
            and str(sel(cfg, "launcher.name")) == "local" and dp.torchrun_worker() is None)


def slurm_submitter(cfg: Any) -> bool:
    """Whether this process submits a ``launcher=slurm`` array (``runner.app.slurm_launcher``; its tasks run with
    ``task=True``)."""
    sel = OmegaConf.select
    return str(sel(cfg, "parallelism.mode")) == "data" and str(sel(cfg, "launcher.name")) == "slurm"


def _with_claims(cfg: DictConfig, out_dir: Path, worker: Optional[Any], task: bool = False) -> Optional[Any]:
    """The worker with its claims (``runner.core.claims.Claims`` in the run's namespace, registered): a torchrun
    rank keeps its rank; a worker started by hand (or a SLURM array task, ``task``) gets the first free one.
    Unchanged without ``assign=claims``."""
    if not task and (str(cfg.parallelism.mode) != "data" or str(cfg.parallelism.get("assign", "static")) != "claims"
                     or str(cfg.launcher.name) != "local"):
        return worker
    from dataclasses import replace

    from runner.core.claims import Claims, posix_store
    from runner.core.distributed import Worker

    token = rundir.run_token(out_dir)
    if token is None:  # not held nor joined: nothing else may write here
        raise RunDirLockError(f"claims worker: the run dir {out_dir} is not held by this run; fix: start the worker "
                              "with `python -m runner parallelism=data parallelism.assign=claims hydra.run.dir=<dir>`")
    claims = Claims(posix_store(out_dir, token), float(cfg.parallelism.lease_s))
    if worker is None:
        rank = claims.register()
        return Worker(rank=rank, world_size=0, launcher=str(cfg.launcher.name), assign="claims", claims=claims)
    claims.register(worker.rank)
    return replace(worker, assign="claims", claims=claims)


def _launch(cfg: DictConfig, out_dir: Path, overrides: List[str], worker: Optional[Any],
            on_exit: Callable[[int], None]) -> Tuple[int, Optional[Dict[str, Any]]]:
    """The run itself: on Ray workers (the driver merges), on SLURM array tasks (the last task merges), as a
    torchrun rank (rank 0 merges after the barrier) or in this process. Returns the exit code and the merged
    manifest of a data-parallel run (else None)."""
    from runner.app.console import merged_summary, pool_summary
    from runner.app.execute import DatasetItems, run
    from runner.core import distributed as dp

    if worker is None and slurm_submitter(cfg):
        from runner.core.requirements import check_feature

        check_feature("submitit", "launcher=slurm")
        from runner.app.slurm_launcher import run_on_slurm

        merged = run_on_slurm(cfg, out_dir, overrides, job=run_job)
        if merged is None:
            return 1, None
        log.info("%s", merged_summary(merged, out_dir))
        return dp.merged_exit_code(merged), merged

    if cfg.parallelism.mode == "data" and cfg.launcher.name == "ray":
        from runner.core.requirements import check_feature

        check_feature("ray", "launcher=ray")
        from runner.app.ray_launcher import run_on_ray

        data = DatasetItems.read(cfg)  # the driver runs no stage: its one read of the rows
        merged = run_on_ray(cfg, out_dir, overrides, data)
        return dp.merged_exit_code(merged), merged
    if worker is not None and worker.world_size == 0:  # a claims worker started by hand: the last one merges
        data = DatasetItems()
        code = run(cfg, out_dir, overrides=overrides, worker=worker, on_exit=on_exit, dataset=data)
        merged = dp.finish_claims(out_dir, worker, data.keys(), data.current())
        if merged is None:
            c = worker.claims
            log.info("claims worker rank %d: %d batch(es) generated, %d taken over; %s", worker.rank, len(c.completed),
                     len(c.reclaimed), "another worker merges the run" if c.finished else
                     "stopped before the run's batches were done")
            return code, None
        log.info("%s", merged_summary(merged, out_dir))
        log.info("%s", pool_summary(merged["pool"]))
        return dp.merged_exit_code(merged), merged
    if worker is None or worker.world_size <= 1:
        return run(cfg, out_dir, overrides=overrides, on_exit=on_exit), None
    data = DatasetItems()  # filled by the run's own read of the rows
    code = run(cfg, out_dir, overrides=overrides, worker=worker, on_exit=on_exit, dataset=data)
    dp.barrier()
    if worker.rank != 0:
        return code, None
    merged = dp.merge(out_dir, worker.world_size, data.keys(), "torchrun", data.current(), lay=worker.layout,
                      assign=worker.assign)
    log.info("%s", merged_summary(merged, out_dir))  # the run's one summary line (workers log theirs at DEBUG)
    log.info("%s", pool_summary(merged["pool"]))  # and the pool's: items, claims, rates, the dead and the slow
    return dp.merged_exit_code(merged), merged


def run_job(cfg: DictConfig, out_dir: Path, overrides: List[str], reraise: bool = True, task: bool = False) -> int:
    """Run ``runner.app.execute.run`` and record the outcome in ``out_dir/job_status.json``.

    Args:
        reraise: re-raise unexpected exceptions (single runs); in a multirun they are recorded and the sweep goes on.
        task: a ``launcher=slurm`` array task (``runner.app.slurm_launcher``): a claims worker, not the submitter.

    Returns: the exit code (see the module docstring).
    """
    from runner.app.console import quiet_libraries, verbose
    from runner.core import distributed as dp

    job_dir = hydra_dir = Path(out_dir)  # where this process's job_status.json goes (rank > 0: its own Hydra dir)
    out_dir = storage.run_dir(cfg, dp.shared_run_dir(Path(out_dir)))  # a URL's run is staged locally
    if job_dir == dp.shared_run_dir(job_dir):
        job_dir = out_dir
    status: Dict[str, Any] = {"error_type": None, "error": None}
    worker = _torchrun_worker(cfg)
    lock = None
    merged = None  # the merged manifest of a data-parallel run (Ray, or torchrun's rank 0)

    def on_exit(code: int) -> None:  # a second signal ends the process at once: its job status first
        _write_status(job_dir, code, "interrupted", {"error_type": "Interrupted",
                                                     "error": "a second signal ended the run at once"})

    try:
        lock = _hold_run_dir(cfg, out_dir, task)
        from runner.app.preflight import check_rows_before_engines

        check_rows_before_engines(cfg)  # a missing input file: refused before diffusers/vLLM/torch are imported
        # one progress bar: the runner's (RUNNER_VERBOSE=1 keeps the libraries'); theirs go off as the run loads
        quiet_libraries(verbose(sys.argv[1:]), loading_bars=False)
        worker = _with_claims(cfg, out_dir, worker, task)
        code, merged = _launch(cfg, out_dir, overrides, worker, on_exit)
        outcome = _outcome(code, merged, status)
        if worker is not None and worker.world_size == 0 and merged is None:  # a claims worker that did not merge
            job_dir = out_dir / dp.WORKER_SUBDIR / f"rank{worker.rank}"  # the run's job_status.json is the merger's
    except RunDirLockError as e:  # the dir is another run's (or unusable): write nothing into it
        log.error("%s: %s", type(e).__name__, e)
        rundir.release(lock)
        return _unrecorded(hydra_dir, e.exit_code, e.outcome, {"error_type": type(e).__name__, "error": str(e)},
                           overrides)
    except KeyboardInterrupt:  # a signal outside the run loop's own handling (before it started, or after)
        log.error("interrupted")
        outcome, code = "interrupted", 128 + 2
        status.update(error_type="KeyboardInterrupt", error="interrupted")
    except RunnerError as e:  # a user mistake, a refusal or contradicting evidence: its message, no traceback
        log.error("%s: %s", type(e).__name__, e)
        outcome, code = e.outcome, e.exit_code
        _torchrun_note(code, outcome, e, job_dir)  # torchrun's own exit 1 hides this code: one line names it
        status.update(error_type=type(e).__name__, error=str(e))
        if outcome in STARTUP_OUTCOMES and _leave_refused_dirs(cfg, out_dir, hydra_dir, lock,
                                                               reraise and worker is None):
            return _unrecorded(hydra_dir, code, outcome, status, overrides)  # nothing of it is left (the log says why)
        if outcome in STARTUP_OUTCOMES and reraise and worker is None and _default_dir(cfg):
            lock = None  # released; the dir holds more than the refusal wrote: record the refusal there as usual
        if outcome in STARTUP_OUTCOMES:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                if not (out_dir / "manifest.json").exists():
                    _refusal_manifest(out_dir, cfg, overrides, outcome, e)
            except OSError:  # the run dir itself was refused (output.dir under a file...): the job dir gets it
                job_dir = hydra_dir
                if not (job_dir / "manifest.json").exists():
                    _refusal_manifest(job_dir, cfg, overrides, outcome, e)
    except Exception as e:  # noqa: BLE001
        log.error("job crashed: %s", traceback.format_exc())
        outcome, code = "crashed", EXIT["crashed"]
        status.update(error_type=type(e).__name__, error=str(e))
        if reraise:
            _write_status(job_dir, code, outcome, status)
            rundir.release(lock)
            raise
    _write_status(job_dir, code, outcome, status)
    if outcome not in STARTUP_OUTCOMES and (worker is None and not slurm_submitter(cfg) or worker is not None and (
            merged is not None if worker.assign == "claims" else worker.rank == 0)):  # SLURM: the merging task's
        _track(cfg, out_dir, code)
    rundir.release(lock)
    return code


#: What a run dir holds before its run starts: Hydra's job log and ``.hydra``, the run's lock, its status file.
_BEFORE_RUN = {"__main__.log", ".hydra", rundir.LOCK_NAME, "job_status.json"}


def _leave_refused_dirs(cfg: DictConfig, out_dir: Path, hydra_dir: Path, lock: Optional[Any], single: bool) -> bool:
    """For a run refused at startup (exit 2): leave no trace where no record belongs, and say so. Returns True when
    nothing of it is to be recorded (the lock is then released), False when the refusal is recorded in ``out_dir``
    as usual (the lock too is released when ``single`` and the dir is this process's default one).

    * ``out_dir`` holds another run (its ``manifest.json``, not a refusal's): nothing is written there, and Hydra's
      files of this attempt (``.hydra/``, the job log) are put back as they were (:func:`keep_hydra_files`), so the
      dir's records still describe that run alone (a refused resume with another ``seed``...);
    * ``single`` (a single ``python -m runner`` run) in a dir this process named itself (:func:`_default_dir`),
      which holds nothing but what a run writes before it starts (:func:`_remove_refused_dir`): the dir goes.
    """
    if _holds_other_run(out_dir):
        log.info("nothing was run; %s holds another run, left as it was (no job_status.json written, its .hydra/ and "
                 "log restored)", out_dir)
        rundir.release(lock)
        restore_hydra_files(hydra_dir)
        if hydra_dir != out_dir and single and _default_dir(cfg, hydra_only=True):
            _remove_refused_dir(hydra_dir)  # the default dir Hydra made for a run.resume=<dir> run
        return True
    if not (single and _default_dir(cfg)):
        return False
    rundir.release(lock)
    if _remove_refused_dir(out_dir):
        log.info("nothing was run; its run dir %s is removed (a refused run keeps a dir only when named with "
                 "hydra.run.dir or output.dir)", out_dir)
        return True
    return False


def _holds_other_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds another run's ``manifest.json`` (a run refused at startup writes its manifest only
    after this is asked; a refusal's own ``status: refused/invalid`` manifest is not a run to protect)."""
    import json

    path = out_dir / "manifest.json"
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("status") not in STARTUP_OUTCOMES
    except (OSError, ValueError, AttributeError):
        return True  # unreadable: not this attempt's to overwrite


#: Hydra's files of run dirs that held a run before this process started (``RunDirLockCallback`` keeps them before
#: Hydra's job start rewrites ``.hydra/`` and appends to the job log): path -> bytes (``.hydra/*``) or size (logs).
_KEPT: Dict[Path, Dict[Path, Any]] = {}


def _hydra_files(hydra_dir: Path) -> List[Path]:
    """The files Hydra writes into a run dir at job start: ``.hydra/*`` and the job log (``<job name>.log``)."""
    return [p for p in [*(hydra_dir / ".hydra").glob("*"), *hydra_dir.glob("*.log")] if p.is_file()]


def keep_hydra_files(hydra_dir: Path) -> None:
    """Remember ``hydra_dir``'s Hydra files when it holds a run (:func:`_holds_other_run`), before Hydra's job start
    overwrites them, so that a refused attempt can put them back (:func:`restore_hydra_files`). Keeping bytes and
    putting them back was chosen over moving Hydra's ``output_subdir``: ``.hydra/`` stays where Hydra, resume and the
    docs expect it for every accepted run."""
    hydra_dir = Path(os.path.abspath(hydra_dir))
    if _holds_other_run(hydra_dir):
        _KEPT[hydra_dir] = {p: p.stat().st_size if p.suffix == ".log" else p.read_bytes()
                            for p in _hydra_files(hydra_dir)}


def restore_hydra_files(hydra_dir: Path) -> None:
    """Put back the files :func:`keep_hydra_files` kept (a log is cut back to its former length; a file this
    attempt added is removed). Nothing when none were kept; an OSError is logged (the refusal stands)."""
    kept = _KEPT.pop(Path(os.path.abspath(hydra_dir)), None)
    if kept is None:
        return
    try:
        for p in _hydra_files(Path(os.path.abspath(hydra_dir))):
            if p not in kept:
                p.unlink()
        for p, was in kept.items():
            if isinstance(was, int):
                os.truncate(p, was)
            else:
                p.write_bytes(was)
    except OSError as e:
        log.error("the Hydra files of %s could not be restored (%s: %s)", hydra_dir, type(e).__name__, e)


def _default_dir(cfg: DictConfig, hydra_only: bool = False) -> bool:
    """The run dir is Hydra's default one (``outputs/runs/<date>/<time>-<pid>``, named by this process) of a single
    ``python -m runner`` run, not one the user named (``hydra.run.dir=``, ``output.dir``, ``run.resume``) or one an
    in-process caller of :func:`run_job` passed. A run whose ``output.dir`` is a URL is staged in that default dir
    (``runner.core.storage``); ``hydra_only`` asks about Hydra's dir whatever else names the run's dir (that of a
    ``run.resume=<dir>`` run holds only Hydra's files)."""
    if (cfg.output.dir or cfg.run.resume) and not (hydra_only or storage.is_url(cfg.output.dir)):
        return False
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return False
    return not any(str(o).lstrip("+").split("=", 1)[0] == "hydra.run.dir" for o in HydraConfig.get().overrides.hydra)


def _remove_refused_dir(out_dir: Path) -> bool:
    """Remove ``out_dir`` when it holds only what a run writes before it starts (:data:`_BEFORE_RUN`, and folders
    with no file in them), and its date
    folder when that is left empty; anything else in it is kept. Returns whether ``out_dir`` was removed."""
    import shutil

    try:
        if not out_dir.is_dir() or any(p.name not in _BEFORE_RUN and not _empty_tree(p) for p in out_dir.iterdir()):
            return False
        shutil.rmtree(out_dir)
        if out_dir.parent.is_dir() and not any(out_dir.parent.iterdir()):
            out_dir.parent.rmdir()
        return True
    except OSError as e:  # the refusal stands; the dir stays
        log.debug("refused run dir %s not removed: %s", out_dir, e)
        return False


def _empty_tree(path: Path) -> bool:
    """Whether ``path`` is a folder holding no file at any depth (e.g. submitit's ``slurm/`` folder, made before
    ``launcher.executor=slurm`` was refused): nothing was written there."""
    return path.is_dir() and not path.is_symlink() and all(_empty_tree(p) for p in path.iterdir())


def _outcome(code: int, merged: Optional[Dict[str, Any]], status: Dict[str, Any]) -> str:
    """The outcome of a run that returned ``code``; a merged data-parallel run (``merged``) whose worker did not
    complete is named by that worker (``runner.core.distributed.worker_failure``: ``status`` gets ``error_type``
    ``WorkerFailed`` and the error), not by its items."""
    from runner.core import distributed as dp

    failure = dp.worker_failure(merged) if merged is not None else None
    if failure is None:
        return "ok" if code == 0 else ("failed_items" if code == 1 else "interrupted")
    status.update(error_type="WorkerFailed", error=failure[1])
    return failure[0]


def _torchrun_note(code: int, outcome: str, e: BaseException, job_dir: Path) -> None:
    """Print ``runner.core.distributed.torchrun_exit_line`` to stderr (rank 0 under torchrun only)."""
    from runner.core import distributed as dp

    line = dp.torchrun_exit_line(code, outcome, e, job_dir)
    if line:
        print(line, file=sys.stderr, flush=True)


def _track(cfg: DictConfig, out_dir: Path, code: int) -> None:
    """Log the finished run to ``tracker`` (``runner.app.tracking.log_run``); a tracker failure is logged, the run's
    exit code stands (everything is in the run dir)."""
    from runner.app.tracking import log_run

    try:
        log_run(cfg, out_dir, code)
    except Exception as e:  # noqa: BLE001 - the tracker is a copy; the run dir is the record
        log.error("tracker=%s: logging the run failed (%s: %s); the run dir has everything", cfg.tracker.name,
                  type(e).__name__, e)


def _dir_key(cfg: DictConfig) -> str:
    """The config key that names the run dir (for messages)."""
    return "run.resume" if cfg.run.resume else "output.dir" if cfg.output.dir else "hydra.run.dir"


def _unrecorded(hydra_dir: Path, code: int, outcome: str, status: Dict[str, Any], overrides: List[str]) -> int:
    """Note in :data:`UNRECORDED` an attempt that writes no ``job_status.json`` (its dir is another run's); returns
    its exit code."""
    UNRECORDED[str(hydra_dir.resolve())] = {"exit_code": code, "outcome": outcome, **status, "overrides": overrides}
    return code


def _write_status(out_dir: Path, code: int, outcome: str, status: Dict[str, Any]) -> None:
    """Write ``job_status.json``; where the dir cannot take it (disk full, read-only) the outcome is logged instead
    (the exit code still says it)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out_dir / "job_status.json", {"exit_code": code, "outcome": outcome, **status})
    except OSError as e:  # StorageError included
        log.error("job_status.json not written (%s: %s); outcome %s, exit %d", type(e).__name__, e, outcome, code)


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency of the CLI
    _HydraCallback = object  # type: ignore[misc,assignment]


def _refuse(e: RunnerError) -> None:
    import sys

    print(f"[runner] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.exit(e.exit_code)  # Hydra only warns about a callback's exceptions


class RunDirLockCallback(_HydraCallback):
    """Holds the run dir from the start of ``python -m runner`` (``on_run_start``: before Hydra writes ``.hydra/``
    and the job log into it) until the process ends; for a multirun, the sweep dir (``on_multirun_start``; each
    job's dir is then held by its job, ``run_job``). A refusal (``runner.core.errors.RunDirInUseError``: another run
    holds the dir; ``ForeignDirError``: the dir is a user's folder, ``runner.core.rundir.check_own_dir``) ends the
    process with exit 2 before anything is written. Under torchrun, rank 0 takes the lock and tells the other ranks
    (``runner.core.distributed.claim_run_dir``); claims workers join (never checked as the dir's owner)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from runner.core import distributed as dp

        resume = OmegaConf.select(config, "run.resume")
        hydra_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        keep_hydra_files(hydra_dir)  # a refused attempt in a dir that holds a run puts them back (run_job)
        given = resume or OmegaConf.select(config, "output.dir")
        if storage.is_url(given):  # an object-storage run is staged in the Hydra run dir (runner.core.storage)
            given = resume = None
        # relative to where the run will be: Hydra's run dir when hydra.job.chdir moves the process there
        base = hydra_dir if OmegaConf.select(config, "hydra.job.chdir") else Path.cwd()
        target = base / str(given) if given else dp.shared_run_dir(hydra_dir)
        key = "run.resume" if resume else "output.dir" if given else "hydra.run.dir"
        from runner.core.environment import OutputPathError, check_dir

        try:
            check_dir(target, key)
        except OutputPathError:  # not a dir this run could use: the run's startup checks refuse it (exit 2, with
            return  # job_status.json in Hydra's dir), nothing to hold
        try:
            if slurm_submitter(config):  # its array tasks hold the dir together (runner.app.slurm_launcher)
                rundir.check_own_dir(target, key)  # but it owns the dir's first take: not a user's folder
                return
            if claims_worker(config):  # a peer of the dir's claims run: no worker owns the dir
                rundir.join_fleet(target, key=key)
            else:
                dp.claim_run_dir(target, dp.torchrun_worker(), create=not resume, key=key)
        except RunDirLockError as e:
            _refuse(e)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            rundir.acquire(Path(str(OmegaConf.select(config, "hydra.sweep.dir"))).absolute(), own=False)
        except RunDirLockError as e:
            _refuse(e)
