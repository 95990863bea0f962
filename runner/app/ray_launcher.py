"""``launcher=ray``: the data-parallel workers as Ray actors (one per GPU on a GPU cluster).

The driver (the Hydra job process) starts or joins Ray (``launcher.address``), creates ``launcher.num_workers``
actors with ``num_gpus_per_worker`` GPUs each, and has each run ``runner.app.execute.run`` on its shard of the
dataset into the shared run dir (which must be on storage every node sees). It then merges the workers'
journals and manifests (``runner.core.distributed.merge``). A worker that dies leaves its finished rows intact; a
re-run resumes only the missing rows.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from runner.core import resume, rundir
from runner.core.errors import RunnerError

log = logging.getLogger("runner.ray")


def _worker_main(cfg_dict: Dict[str, Any], out_dir: str, overrides: List[str], rank: int, world_size: int,
                 token: Optional[str] = None) -> int:
    """Body of one Ray worker: join the run that holds the run dir (``token``), rebuild the config and run its
    shard."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from runner.core import rundir
    from runner.core.distributed import Worker
    from runner.app.execute import run

    rundir.join(Path(out_dir), token)
    try:
        from runner.app.console import quiet_libraries, verbose

        quiet_libraries(verbose(overrides))  # a Ray worker is a fresh process: no loader bars there either
        cfg = OmegaConf.create(cfg_dict)
        return run(cfg, Path(out_dir), overrides=overrides, worker=Worker(rank=rank, world_size=world_size,
                                                                          launcher="ray"))
    finally:
        rundir.leave(Path(out_dir))  # a Ray worker process may be reused for another task


def ray_reason(e: BaseException, limit: int = 300) -> str:
    """Ray's account of a worker that died, for its ``workers[].reason``: ``ray: <exception class>: <its first
    line>``, at most ``limit`` characters (Ray's messages run to many lines of actor and node ids)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    text = f"ray: {type(e).__name__}: {first}" if first else f"ray: {type(e).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_on_ray(cfg: DictConfig, out_dir: Path, overrides: List[str], keys: List[str],
               current: Any = None) -> Dict[str, Any]:
    """Run ``parallelism=data`` on Ray actors and merge. Returns the merged manifest
    (``runner.core.distributed.merge``; ``merged_exit_code`` of it is 0 when every item of the dataset was
    written); a worker that died is named there with Ray's account of it (``workers[].reason``).

    Args:
        keys: every item key of the run's dataset, in dataset order (the merged journal follows it).
        current: what ``runner.core.distributed.merge`` takes as ``current`` (records of the current config only).

    Raises:
        ImportError: Ray is not installed (``pip install ray``).
        runner.core.errors.RunnerError: a worker stopped on a user error (bad input, a refused backend...); the first
            one is re-raised in the driver so the run ends with its exit code, as a one-process run does.
    """
    import ray

    from runner.app.console import merged_summary
    from runner.core.distributed import merge

    n = int(cfg.launcher.num_workers)
    if not ray.is_initialized():
        ray.init(address=cfg.launcher.address, include_dashboard=False, log_to_driver=True,
                 num_cpus=None if cfg.launcher.address else max(n * cfg.launcher.num_cpus_per_worker, 1))
    remote = ray.remote(num_cpus=cfg.launcher.num_cpus_per_worker,
                        num_gpus=cfg.launcher.num_gpus_per_worker, max_retries=0)(_worker_main)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    lock = rundir.acquire(out_dir)  # the driver holds the run dir for its workers (re-entrant: run_job holds it)
    try:
        resume.remove_temp_files(out_dir)  # before any worker writes
        refs = [remote.remote(cfg_dict, str(out_dir), list(overrides), r, n, lock.token) for r in range(n)]
        reasons: Dict[int, str] = {}
        refusal = None
        for r, ref in enumerate(refs):
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a dead worker is recorded by the merge, not fatal here
                cause = getattr(e, "cause", e)  # ray.exceptions.RayTaskError wraps the worker's exception
                if isinstance(cause, RunnerError):  # every worker checks the same config: a user error, not a crash
                    refusal = refusal or cause
                else:
                    log.error("ray worker %d failed: %s", r, e)
                    reasons[r] = ray_reason(e)
        if refusal is not None:
            raise refusal  # classified by run_job from its exit_code/outcome, as in a one-process run
        merged = merge(out_dir, n, keys, "ray", current, reasons=reasons)
        log.info("%s", merged_summary(merged, out_dir))  # the run's one summary line (workers log theirs at DEBUG)
        return merged
    finally:
        rundir.release(lock)
