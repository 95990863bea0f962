"""Fault matrix, part 2 (part 1, SIGKILL at seeded random points and SIGTERM, is in test_reliability.py): faults of
the storage and of the weights, injected into real tiny_flux runs on the CPU.

For each fault: the exit code, what was kept (every journal record's file exists with its sha256; no partial or
temp file; no file without a record), and that a re-run of the same command then completes with artifacts
byte-identical to an uninterrupted run.

* a full disk while writing: the 3rd image's write gets half its bytes onto the disk, then ``ENOSPC``;
* an unwritable run dir: every write under it fails with ``EACCES`` (root ignores file modes, so the error is
  injected at the writer's ``open``);
* a truncated weight file in a ``model.path`` snapshot.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import shutil
from pathlib import Path

import pytest

import runner.core.artifacts as artifacts
from runner.app.jobs import run_job

LIMIT = ["dataset.limit=5", "batch_size=1"]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _images(d: Path):
    return {p.name: _sha(p) for p in sorted((d / "images").glob("*")) if p.name != "metadata.jsonl"} if (
        d / "images").is_dir() else {}  # metadata.jsonl: the folder's index of the records (runner.core.sinks)


def _records(d: Path):
    p = d / "items.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _consistent(d: Path) -> None:
    """Every ok record's file exists with its hash; every file in images/ has an ok record; no temp file."""
    ok = {r["file"]: r["file_sha256"] for r in _records(d) if r["status"] == "ok"}
    for rel, sha in ok.items():
        assert _sha(d / rel) == sha, rel
    on_disk = {f"images/{n}" for n in _images(d)}
    assert on_disk == set(ok), f"files without a record: {on_disk - set(ok)}"
    temps = [p.name for p in d.rglob(".*.tmp*")]
    assert not temps, temps


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compose):
    d = tmp_path_factory.mktemp("ref") / "run"
    ov = ["platform=cpu", *LIMIT]
    assert run_job(compose(ov), d, ov) == 0
    return _images(d)


def _job(compose, d: Path, extra=()):
    ov = ["platform=cpu", *LIMIT, *extra]
    return run_job(compose(ov), d, ov)


def test_disk_full_while_writing_stops_keeps_what_was_written_then_resume_is_identical(compose, tmp_path,
                                                                                      monkeypatch, reference):
    d = tmp_path / "run"
    state = {"pngs": 0}

    class HalfThenFull:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        if ".png.tmp" in str(path):
            state["pngs"] += 1
            if state["pngs"] >= 3:
                return HalfThenFull(f)
        return f

    monkeypatch.setattr(artifacts, "open", fake_open, raising=False)
    assert _job(compose, d) == 1
    st = json.loads((d / "job_status.json").read_text())
    assert st["outcome"] == "storage_error" and "No space left" in st["error"] and "re-run" in st["error"]
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "storage_error" and m["ended_at"]
    assert len([r for r in _records(d) if r["status"] == "ok"]) == 2  # the run stopped at the full disk
    _consistent(d)
    monkeypatch.undo()
    assert _job(compose, d) == 0  # the same command, once there is space: resumes
    assert _images(d) == reference
    _consistent(d)


def test_unwritable_run_dir_is_refused_before_the_model_loads(compose, tmp_path, monkeypatch):
    import models.flux as flux

    d = tmp_path / "run"

    def fake_open(path, mode="r", *a, **k):
        if str(path).startswith(str(d)) and any(c in mode for c in "wa"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, mode, *a, **k)

    monkeypatch.setattr(artifacts, "open", fake_open, raising=False)
    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", lambda self: pytest.fail("the model was loaded"))
    assert _job(compose, d) == 1
    assert not _images(d) and not _records(d)


def test_truncated_weight_file_is_refused_at_startup_naming_it(compose, tmp_path, tiny_snapshot, monkeypatch):
    import models.flux as flux

    snap = tmp_path / "snap"
    shutil.copytree(tiny_snapshot, snap)
    w = next((snap / "transformer").glob("*.safetensors"))
    w.write_bytes(w.read_bytes()[:-100])
    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", lambda self: pytest.fail("the model was loaded"))
    d = tmp_path / "run"
    assert _job(compose, d, ["model=flux", f"model.path={snap}"]) == 2
    st = json.loads((d / "job_status.json").read_text())
    assert st["error_type"] == "WeightFileError" and str(w) in st["error"] and "truncated" in st["error"]
    assert not _images(d)


# regression: bug: a resume with a smaller dataset.limit dropped the records of the other items' files, which
# stayed on disk without a record (and the next full run regenerated them)
def test_resume_with_a_smaller_dataset_keeps_a_record_for_every_file(compose, tmp_path):
    d = tmp_path / "run"
    assert _job(compose, d) == 0
    before = _images(d)
    assert _job(compose, d, ["dataset.limit=2"]) == 0  # after LIMIT's 5: the last one wins
    assert len(_records(d)) == 2
    unlisted = [json.loads(line) for line in (d / "items.unlisted.jsonl").read_text().splitlines()]
    assert len(unlisted) == 3
    listed = {r["file"]: r["file_sha256"] for r in _records(d) + unlisted}
    assert listed == {f"images/{n}": sha for n, sha in before.items()}  # every file on disk has a record
    m = json.loads((d / "manifest.json").read_text())
    assert m["unlisted_files"]["count"] == 3
    assert _job(compose, d) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"]["reused"] == 5 and m["counts"]["ok"] == 0  # nothing regenerated
    assert not (d / "items.unlisted.jsonl").exists() and _images(d) == before
    _consistent(d)
