"""A refused attempt keeps out of the way (issue #38): in a dir that holds another run it writes nothing there (its
``.hydra/``, job log, ``job_status.json`` and ``manifest.json`` stay that run's), and any refusal (exit 2) of a run
in the default dir it named itself removes that dir and says so, even when something created an empty folder there
first (submitit's ``slurm/``) or the run's ``output.dir`` is a URL staged in it. Real ``python -m runner``
processes. A fleet launcher given a single run is refused, not run in this process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from _helpers import requires_extra

pytestmark = pytest.mark.cpu


def _runner(args: List[str], cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _files(run: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_refused_resume_leaves_the_completed_run_as_it_was(subprocess_env, tmp_path):
    run = tmp_path / "b1"
    first = _runner([f"hydra.run.dir={run}", "dataset.limit=1"], tmp_path, subprocess_env)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(run)
    assert ".hydra/overrides.yaml" in before and "job_status.json" in before and "__main__.log" in before
    p = _runner([f"hydra.run.dir={run}", "dataset.limit=1", "seed=5"], tmp_path, subprocess_env)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "ResumeConflictError" in out and "seed: 0 -> 5" in out, out[-3000:]
    assert f"{run} holds another run, left as it was" in out
    after = _files(run)
    assert after.keys() == before.keys()  # no new file (no lock, no refusal manifest)
    changed = [k for k in before if after[k] != before[k]]
    assert not changed, {k: after[k][-400:] for k in changed}  # status, .hydra/* (seed=5), log: all as before
    # a refusal of another kind in the same dir is no different
    p = _runner([f"hydra.run.dir={run}", "batch_size=0"], tmp_path, subprocess_env)
    assert p.returncode == 2 and "batch_size=0 must be >= 1" in p.stdout + p.stderr
    assert _files(run) == before


def _assert_removed(p: subprocess.CompletedProcess, tmp_path: Path, error: str) -> None:
    out = p.stdout + p.stderr
    assert p.returncode == 2 and error in out, out[-3000:]
    assert "its run dir" in out and "is removed" in out, out[-3000:]
    assert not list((tmp_path / "outputs" / "runs").rglob("*")), list((tmp_path / "outputs").rglob("*"))


def test_a_refused_url_run_leaves_no_staging_dir(subprocess_env, tmp_path):
    """``output.dir=<URL>`` is staged in the default dir: refused (no filesystem for the scheme), it goes."""
    _assert_removed(_runner(["output.dir=nosuchfs://bucket/x"], tmp_path, subprocess_env), tmp_path,
                    "StorageURLError: output.dir='nosuchfs://bucket/x'")


@requires_extra("scale")
def test_a_refused_slurm_submission_leaves_no_dir(subprocess_env, tmp_path):
    """submitit makes ``<run dir>/slurm`` before it finds no SLURM here: an empty folder is nothing written."""
    env = {**subprocess_env, "PATH": "/usr/bin:/bin:" + str(Path(sys.executable).parent)}  # no srun/sbatch
    _assert_removed(_runner(["launcher=slurm", "parallelism=data"], tmp_path, env), tmp_path,
                    "SlurmUnavailableError")


@pytest.mark.parametrize("launcher", ["ray", "slurm"])
def test_a_fleet_launcher_with_a_single_run_is_refused_not_run_here(compose, launcher):
    """``launcher=ray`` (or ``slurm``) with ``parallelism=single`` would run in this process while recording the
    launcher: refused at startup, naming the fix (no Ray or submitit needed to be refused)."""
    from runner.app import checks
    from runner.core.errors import ConfigValueError

    with pytest.raises(ConfigValueError) as e:
        checks.check_run_values(compose([f"launcher={launcher}"]))
    assert f"launcher={launcher} with parallelism=single" in str(e.value)
    assert "fix: add parallelism=data (or launcher=local)" in str(e.value)
    checks.check_run_values(compose([f"launcher={launcher}", "parallelism=data"]))  # the fleet's own mode passes
