"""``python -m runner``: the Hydra app over ``conf/config.yaml``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _interrupted_at_start(signum: int, frame: object) -> None:
    """Ctrl-C before the run started (imports, Hydra's composition, the startup checks): one line and exit 130,
    not a traceback from wherever the import machinery was; the run installs its own handling as it starts
    (``runner.app.signals.Stop``; :func:`main` restores Python's default first)."""
    print("runner: interrupted before the run started (nothing was written)", file=sys.stderr)
    raise SystemExit(128 + signum)


def _exit_interrupted(code: int) -> None:
    """End a run a SIGINT stopped with ``code`` (130) once its status is written: flush, then ``os._exit``. A plain
    ``sys.exit(130)`` sometimes ended the process by SIGINT after the interpreter's finalization instead (returncode
    -2 with the run's "interrupted" logged; CI, and a reproduction at aac4159: a few % of Ctrl-Cs 1-2.5 s after the
    start; root cause not pinned down), so the finalization is skipped: the run has written and released what it
    holds by now."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":  # before anything imports torch: its CUDA library aborts on a malformed allocator setting
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (nohup, &)
        signal.signal(signal.SIGINT, _interrupted_at_start)
    from runner.core.environment import EnvironmentVariableError, check_before_torch

    from runner.core.requirements import DependencyVersionError, check_versions

    try:
        check_before_torch()
        check_versions()  # an untested diffusers (private names, context-parallel and cache APIs): exit 2 now
    except (EnvironmentVariableError, DependencyVersionError) as e:
        print(f"runner: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    from runner.app.console import library_env_defaults

    library_env_defaults(sys.argv[1:])  # before torch/vLLM read them: no kineto USDT lines, no vLLM INFO lines

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from runner.core.paths import CONF_DIR  # noqa: E402
from runner.core.schema import register_configs  # noqa: E402

log = logging.getLogger("runner")

register_configs()
_TASK_STARTED = False  # set once Hydra composed a config and called the task


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> int:
    """Compose the run config, then execute it into the Hydra run dir.

    Exit codes: 0 every item written and verified; 1 some items failed (or a crash); 2 bad input or a backend
    refused at startup; 3 evidence contradicts the resolved backends; 128+N interrupted by signal N.
    In a multirun each job's outcome is written to ``job_status.json`` and the sweep goes on, except after an
    interrupted job (SIGINT/SIGTERM), which ends the sweep with that job's 128+N; otherwise the sweep callback
    (``runner.tools.sweep.SweepCallback``) sets the sweep's exit code.
    """
    from hydra.types import RunMode

    from runner.app.jobs import run_job

    global _TASK_STARTED
    _TASK_STARTED = True
    import signal

    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:  # the run's own handling from here on
        signal.signal(signal.SIGINT, signal.default_int_handler)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    code = run_job(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task), reraise=not multirun)
    if code and (not multirun or code > 128):  # an interrupted job ends the sweep too: Ctrl-C means stop
        sys.exit(code)
    return code


def hydra_dir_at_run_dir(argv: list) -> list:
    """``output.dir=X`` or ``run.resume=X`` (also ``+``/``++`` prefixed; a local path, no interpolation) without
    ``hydra.run.dir``, in a single process (not a sweep, not torchrun): Hydra's run dir is X too, so its ``.hydra/``
    and job log go with the run, not into a stray ``outputs/runs/<date>/<time>/`` beside the working dir (new-user
    report). Returns the argv."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.core import storage
    from runner.core.distributed import torchrun_worker
    from runner.core.paths import hydra_quote

    if any(a in ("-m", "--multirun") or a.lstrip("+").startswith("hydra.run.dir=") for a in argv) \
            or torchrun_worker() is not None:
        return argv
    # `+output.dir=X` / `++output.dir=X` (Hydra's add / force-add forms) name the same key
    given = {a.split("=", 1)[0].lstrip("+"): a for a in argv
             if a.split("=", 1)[0].lstrip("+") in ("output.dir", "run.resume")}
    arg = given.get("run.resume") or given.get("output.dir")
    try:
        value = OverridesParser.create().parse_override(arg).value() if arg else None
    except Exception:  # noqa: BLE001 - Hydra reports a value it cannot parse
        return argv
    if not isinstance(value, str) or not value or "${" in value or storage.is_url(value):
        return argv
    return [*argv, f"hydra.run.dir={hydra_quote(value)}"]


if __name__ == "__main__":
    from runner.core.distributed import agree_argv

    sys.argv = sys.argv[:1] + agree_argv(sys.argv[1:])  # torchrun: every rank uses rank 0's run dir
    sys.argv = sys.argv[:1] + hydra_dir_at_run_dir(sys.argv[1:])
    from runner.core.environment import OutputPathError, check_launch_dirs

    from runner.tools.plan import refuse, stray_plan_flag

    try:
        check_launch_dirs(sys.argv[1:])  # Hydra creates the run dir before the task: a bad one is a traceback
    except OutputPathError as e:
        sys.exit(refuse(sys.argv[1:], type(e).__name__, str(e), e.exit_code))
    from runner.app.console import override_key_problem
    from runner.tools.sweep import run_dir_in_sweep_problem, sweep_backend_problem, sweep_override_problem

    # `-m model=a,b key.only.a.has=x`: why, and what works (not Hydra's "+key", which fails too)
    problem = run_dir_in_sweep_problem(sys.argv[1:]) or sweep_override_problem(sys.argv[1:])
    problem = problem or override_key_problem(sys.argv[1:])  # `batchsize=4`: did you mean batch_size (not "+batchsize")
    problem = problem or sweep_backend_problem(sys.argv[1:])  # `-m backend.attention=sdpa,cudnnx`: before any job
    if problem:
        sys.exit(refuse(sys.argv[1:], None, problem, 2))
    from runner.tools.plan import wants_plan

    problem = stray_plan_flag(sys.argv[1:])
    if problem:
        print(f"runner: {problem}", file=sys.stderr)
        sys.exit(2)

    if wants_plan(sys.argv[1:]):  # `... --plan`: the memory plan of the composed run, nothing loaded, no run dir
        from runner.tools.plan import main as plan_main

        sys.exit(plan_main(sys.argv[1:]))
    try:
        main()
    except KeyboardInterrupt:  # a signal after the run recorded its final status (or before it started)
        _exit_interrupted(128 + 2)
    except SystemExit as e:
        if e.code == 128 + 2:  # Ctrl-C, handled: its status is written
            _exit_interrupted(e.code)
        # Hydra reports a composition error (unknown option, wrong type) with exit 1; bad input is exit 2 here.
        if e.code == 1 and not _TASK_STARTED:
            from runner.core.resolve import override_hints

            for hint in override_hints(sys.argv[1:]):  # Hydra's "not in struct" does not say where a key belongs
                print(f"runner: {hint}", file=sys.stderr)
            sys.exit(2)
        raise
