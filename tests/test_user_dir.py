"""A user's own folder is not a run dir (new-user trial): ``python -m runner hydra.run.dir=<folder>`` (or
``output.dir=``) where the folder exists, holds no run (no ``manifest.json``) and holds the user's files
(``notes.txt``, an ``images/0.png`` of their own) is refused at startup, exit 2, naming the key, the path, the files
and the fix, and the folder is left byte for byte as it was (no ``.hydra/``, no ``run.lock``, no log). An empty
existing dir, and a dir holding only what the runner itself leaves before a run's manifest (a refused or
crashed-at-startup attempt, a killed torchrun run's ``workers/``, locks, a temp file), still take a run
(``runner.core.rundir.check_own_dir``); ``python -m runner.repro --out <a user's folder>`` is refused the same way.
Real ``python -m runner`` processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from _helpers import cli, run_module, skip_without_extra, worker_env
from runner.core import rundir

pytestmark = pytest.mark.cpu

PNG = b"\x89PNG\r\n\x1a\n the user's own picture, not the runner's"
NOTES = b"my notes\n"


def _snapshot(d: Path) -> Dict[str, object]:
    """Every entry under ``d``: files by bytes, folders as ``dir``."""
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(d.rglob("*"))}


def _user_folder(d: Path) -> Path:
    (d / "images").mkdir(parents=True)
    (d / "notes.txt").write_bytes(NOTES)
    (d / "images" / "0.png").write_bytes(PNG)
    return d


@pytest.mark.parametrize("key", ["hydra.run.dir", "output.dir"])
def test_a_users_folder_is_refused_and_left_as_it_was(subprocess_env, tmp_path, key):
    mine = _user_folder(tmp_path / "mine")
    before = _snapshot(mine)
    p = cli([f"{key}={mine}", "dataset.limit=1"], subprocess_env, tmp_path)
    text = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert "ForeignDirError" in text and f"{key}={str(mine)!r}" in text, text[-3000:]
    assert "images/0.png" in text and "notes.txt" in text and f"fix: an empty or new dir ({key}=<new dir>)" in text
    assert _snapshot(mine) == before  # same names, same bytes: no .hydra/, run.lock, log, job_status.json
    assert sorted(x.name for x in tmp_path.iterdir()) == ["mine"]  # and nothing written anywhere else


def test_an_artifact_named_file_alone_is_foreign_and_a_worker_manifest_is_a_run(tmp_path):
    """Without a manifest no artifact of the runner can exist (every run writes its manifest before its sink opens
    ``images/``), so ``images/0.png`` alone is the user's even though a row with id ``0`` would write that name; a
    data-parallel worker's ``manifest.rank<r>.json`` holds a run (its merged ``manifest.json`` comes at the end)."""
    d = tmp_path / "d"
    (d / "images").mkdir(parents=True)
    (d / "images" / "0.png").write_bytes(PNG)
    (d / "empty" / "deeper").mkdir(parents=True)  # folders holding no file lose nothing
    assert rundir.foreign_entries(d) == (["images/0.png"], 1)
    with pytest.raises(rundir.ForeignDirError, match=r"output.dir=.*images/0.png.*fix: an empty or new dir"):
        rundir.check_own_dir(d, "output.dir")
    (d / "manifest.rank0.json").write_text("{}")
    assert rundir.foreign_entries(d) == ([], 0)
    rundir.check_own_dir(d, "output.dir")


def test_an_empty_dir_and_one_left_by_the_runners_own_attempts_take_a_run(subprocess_env, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    p = cli([f"hydra.run.dir={empty}", "dataset.limit=1"], subprocess_env, tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (empty / "manifest.json").is_file() and (empty / "images").is_dir()
    # `python -m runner.repro <run> --out <a user's folder>`: refused before the re-run (no repro_check.json there)
    mine = _user_folder(tmp_path / "mine")
    before = _snapshot(mine)
    p = run_module("runner.repro", [empty, "--out", mine], tmp_path)
    assert p.returncode == 2 and "ForeignDirError: --out=" in p.stderr and "notes.txt" in p.stderr, p.stderr[-3000:]
    assert _snapshot(mine) == before
    # what a refused or crashed-at-startup attempt, or a killed data-parallel start, leaves before any manifest
    left = tmp_path / "left"
    left.mkdir()
    shutil.copytree(empty / ".hydra", left / ".hydra")
    shutil.copy(empty / "__main__.log", left / "__main__.log")
    (left / "job_status.json").write_text(json.dumps({"exit_code": 1, "outcome": "crashed"}))
    (left / "run.lock").write_text(json.dumps({"pid": 1, "host": "gone", "token": "t"}))  # a stale lock
    (left / ".manifest.json.tmp4242").write_text("{")  # killed mid-write of its first manifest
    shutil.copytree(empty / ".hydra", left / "workers" / "rank1" / ".hydra")  # a torchrun rank's Hydra dir
    (left / "slurm").mkdir()
    p = cli([f"hydra.run.dir={left}", "dataset.limit=1"], subprocess_env, tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert json.loads((left / "manifest.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("how", ["torchrun", "slurm"])
def test_the_owner_of_a_data_parallel_run_refuses_a_users_folder(subprocess_env, tmp_path, how):
    """torchrun: rank 0 (the owner) refuses, every rank stops before Hydra writes (rank 1's ``workers/rank1`` too);
    ``launcher=slurm``: the submitter refuses before submitting (its array tasks join without the check)."""
    mine = _user_folder(tmp_path / "mine")
    before = _snapshot(mine)
    args = ["parallelism=data", "dataset.limit=2", f"hydra.run.dir={mine}"]
    if how == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner", *args]
        p = subprocess.run(cmd, cwd=tmp_path, env=worker_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode != 0  # torchrun's own exit 1 (docs/exit_codes.md); each rank exits 2
    else:
        skip_without_extra("scale")
        p = cli([*args, "launcher=slurm", "launcher.executor=local"], subprocess_env, tmp_path)
        assert p.returncode == 2
    text = p.stdout + p.stderr
    assert "ForeignDirError" in text and "notes.txt" in text and "fix: an empty or new dir" in text, text[-3000:]
    assert _snapshot(mine) == before
