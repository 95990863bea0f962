"""The startup check of the dirs a run writes (``runner.core.environment.check_dir``: ``output.dir``, ``run.resume``,
``hydra.run.dir``, ``cache_dir``, ``RUNNER_CACHE``) creates them and writes into them for real, then removes what it
created: ``os.access`` passes for root where nothing can be created (``/proc``, ``/sys``), which let a run go on
to a ``FileNotFoundError`` traceback (exit 1) when it first wrote its cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from runner.core.environment import EnvironmentVariableError, OutputPathError, check_dir, check_environment

UNCREATABLE = "/proc/runner-nope/cache"  # no process, root or not, can create a dir under /proc


@pytest.mark.parametrize("key", ["cache_dir", "output.dir", "run.resume", "hydra.run.dir"])
def test_a_dir_that_cannot_be_created_is_refused_naming_the_key(key):
    with pytest.raises(OutputPathError) as e:
        check_dir(Path(UNCREATABLE), key)
    msg = str(e.value)
    assert msg.startswith(f"{key}={UNCREATABLE!r}: /proc/runner-nope cannot be created") and f"fix: {key}=" in msg
    assert e.value.exit_code == 2


def test_runner_cache_that_cannot_be_created_is_refused_naming_the_variable():
    with pytest.raises(EnvironmentVariableError, match=r"RUNNER_CACHE='/proc/runner-nope/cache': .*cannot be "
                                                       r"created.*fix: point it at a directory you can write"):
        check_environment({"RUNNER_CACHE": UNCREATABLE})


def test_the_check_leaves_no_dir_or_file_behind(tmp_path):
    check_dir(tmp_path / "a" / "b" / "c", "output.dir")  # created, written, removed: the run creates it itself
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    check_dir(tmp_path / "kept", "output.dir")
    assert (tmp_path / "kept").is_dir() and list((tmp_path / "kept").iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="is a file"):
        check_dir(tmp_path / "f" / "sub", "cache_dir")


@pytest.mark.parametrize("how", ["RUNNER_CACHE", "cache_dir"])
def test_cli_uncreatable_cache_exits_2_naming_it_without_traceback(tmp_path, subprocess_env, how):
    env = dict(subprocess_env, **({"RUNNER_CACHE": UNCREATABLE} if how == "RUNNER_CACHE" else {}))
    extra = [f"cache_dir={UNCREATABLE}"] if how == "cache_dir" else []
    p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "dataset.limit=1", *extra,
                        f"output.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert f"{how}={UNCREATABLE!r}: /proc/runner-nope cannot be created" in text and "fix:" in text, text[-3000:]


def test_a_run_into_output_dir_leaves_no_stray_default_dir(subprocess_env, tmp_path):
    """New-user report: ``python -m runner output.dir=myout`` also left Hydra's ``outputs/runs/<date>/<time>/``
    (its ``.hydra/`` and job log) in the working dir. Hydra's run dir is the run's own dir now: ``.hydra/`` and the
    log sit beside the manifest, nothing else is created; a resume of that dir (``run.resume=``) likewise."""
    from _helpers import cli

    p = cli(["output.dir=myout", "dataset.limit=1"], subprocess_env, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["myout"], list(tmp_path.iterdir())
    run = tmp_path / "myout"
    assert (run / "manifest.json").is_file() and (run / ".hydra" / "config.yaml").is_file()
    assert (run / "__main__.log").is_file()
    p = cli(["run.resume=myout", "dataset.limit=1"], subprocess_env, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["myout"], list(tmp_path.iterdir())
    p = cli(["++output.dir=forced", "dataset.limit=1"], subprocess_env, tmp_path)  # Hydra's force-add form
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(x.name for x in tmp_path.iterdir()) == ["forced", "myout"], list(tmp_path.iterdir())
    assert (tmp_path / "forced" / ".hydra" / "config.yaml").is_file()


def _check_often(args):
    root, rank, times = args
    from runner.core.environment import _dir_problem

    return [w for _ in range(times) if (w := _dir_problem(Path(root) / "run" / "workers" / f"rank{rank}"))]


def test_concurrent_checkers_of_sibling_dirs_never_refuse_a_creatable_one(tmp_path):
    """torchrun ranks check their own ``workers/rank<r>`` dirs at once, each creating the shared parents and removing
    what it created: a rank's ``mkdir`` failed with ENOENT after another removed the parent, and the parent was back
    (a third re-created it) by the time the rank looked, so a creatable dir was refused ("cannot be created (No such
    file or directory)": CI, tests/test_context_parallel.py four ranks, 2026-12-08; 11 of 1,800 checks here before
    the fix). Real processes; the check retries an ENOENT under an existing parent and refuses only a lasting one
    (the /proc test above)."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(6) as pool:
        bad = [w for r in pool.map(_check_often, [(str(tmp_path), k, 300) for k in range(6)]) for w in r]
    assert bad == []
