"""Crash-safe writing (``runner.core.artifacts``, the journal readers of ``runner.core.sinks``) under deterministic faults.

A write is atomic when a reader, or the next run, sees either the old file or the complete new one, never a part.
The random SIGKILL test (test_reliability.py) cannot tell an in-place write from an atomic one when the kill lands
outside the write, so here the fault is placed exactly: the storage fills up half-way through the data, the rename
fails, the process is killed between writing the data and renaming it. Each time the file at the path must still
hold the old bytes (or be absent), the error must say what happened, and no temp file may be left behind (or only
the ``.<name>.tmp<pid>`` one a resume removes).

Then the journal (a killed run's partial last line), the artifact writer (records journaled in submission order,
only after their file is complete; a failed item is recorded as failed; a full disk stops the run), and the
readers a resume relies on.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

from runner.core import artifacts as art
from runner.core import sinks
from runner.core.errors import StorageError
from runner.core.resume import remove_temp_files

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _leftovers(d: Path) -> List[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp" in p.name)


# --------------------------------------------------------------------------------------------- atomic write


def test_write_creates_and_replaces(tmp_path):
    p = tmp_path / "a.bin"
    art.atomic_write_bytes(p, b"first")
    assert p.read_bytes() == b"first"
    art.atomic_write_bytes(p, b"second, longer")
    assert p.read_bytes() == b"second, longer"
    art.atomic_write_bytes(p, b"")
    assert p.read_bytes() == b""
    assert _leftovers(tmp_path) == []


class _DiskFillsUp:
    """``open`` for the files under ``root``: the first ``write`` puts half its bytes on the disk, then ENOSPC."""

    def __init__(self, root: Path, err: int = errno.ENOSPC):
        self.root, self.err, self.real = str(root), err, builtins.open
        self.opened: List[str] = []

    def __call__(self, file, mode="r", *a, **kw):
        f = self.real(file, mode, *a, **kw)
        if "w" not in mode or not str(file).startswith(self.root):
            return f
        self.opened.append(str(file))
        err, real_write = self.err, f.write

        def write(data):
            real_write(data[: len(data) // 2])
            f.flush()
            raise OSError(err, os.strerror(err))

        f.write = write
        return f


def test_disk_full_half_way_leaves_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "image.png"
    p.write_bytes(b"old complete file")
    fault = _DiskFillsUp(tmp_path)
    monkeypatch.setattr(builtins, "open", fault)
    with pytest.raises(StorageError) as e:
        art.atomic_write_bytes(p, b"new bytes " * 100)
    monkeypatch.undo()
    assert p.read_bytes() == b"old complete file"  # never the half-written new one
    assert fault.opened and Path(fault.opened[0]) != p  # the data went to a temp file, not to the path
    assert _leftovers(tmp_path) == []  # the temp file is removed
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == (f"cannot write {p}: {os.strerror(errno.ENOSPC)}; fix: free space or fix permissions on "
                            f"{tmp_path}, then re-run the same command: finished items are kept and the run resumes")
    assert isinstance(e.value.__cause__, OSError)


def test_disk_full_on_a_new_file_leaves_nothing(tmp_path, monkeypatch):
    p = tmp_path / "new.png"
    monkeypatch.setattr(builtins, "open", _DiskFillsUp(tmp_path))
    with pytest.raises(StorageError):
        art.atomic_write_bytes(p, b"x" * 1000)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_failed_rename_leaves_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / "manifest.json"
    p.write_text("old")

    def fail(src, dst):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(StorageError) as e:
        art.atomic_write_bytes(p, b"new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert _leftovers(tmp_path) == []
    assert e.value.errno == errno.EROFS


def test_other_errors_pass_through_and_clean_up(tmp_path, monkeypatch):
    p = tmp_path / "x.png"
    p.write_bytes(b"old")
    monkeypatch.setattr(builtins, "open", _DiskFillsUp(tmp_path, errno.EIO))
    with pytest.raises(OSError) as e:
        art.atomic_write_bytes(p, b"new data")
    monkeypatch.undo()
    assert not isinstance(e.value, StorageError) and e.value.errno == errno.EIO
    assert p.read_bytes() == b"old" and _leftovers(tmp_path) == []


def test_cleanup_failure_does_not_hide_the_error(tmp_path, monkeypatch):
    p = tmp_path / "x.png"
    monkeypatch.setattr(builtins, "open", _DiskFillsUp(tmp_path))
    real_unlink = Path.unlink

    def unlink(self, *a, **kw):
        raise PermissionError(errno.EACCES, "no")

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(StorageError) as e:
        art.atomic_write_bytes(p, b"data")
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC  # the write's error, not the clean-up's
    for name in _leftovers(tmp_path):
        real_unlink(tmp_path / name)


_KILLED_BEFORE_RENAME = r"""
import os, signal, sys
from pathlib import Path
import runner.core.artifacts as art
os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)  # the data is on disk, the rename never happens
art.atomic_write_bytes(Path(sys.argv[1]), b"new" * 1000)
"""


def test_killed_between_the_data_and_the_rename(tmp_path):
    p = tmp_path / "images" / "fox.png"
    p.parent.mkdir()
    p.write_bytes(b"old complete file")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_RENAME, str(p)], env=env, capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert p.read_bytes() == b"old complete file"
    (left,) = _leftovers(p.parent)
    assert left == f".fox.png.tmp{left.rsplit('tmp', 1)[1]}" and (p.parent / left).read_bytes() == b"new" * 1000
    assert remove_temp_files(tmp_path) == [left]  # what a resume removes first
    assert _leftovers(p.parent) == []


def test_concurrent_reader_sees_old_or_new_only(tmp_path):
    p = tmp_path / "doc.json"
    old, new = b"A" * 200_000, b"B" * 300_000
    p.write_bytes(old)
    seen = set()
    stop = threading.Event()

    def read():
        while not stop.is_set():
            seen.add(_sha(p.read_bytes()))

    t = threading.Thread(target=read)
    t.start()
    try:
        for i in range(30):
            art.atomic_write_bytes(p, new if i % 2 == 0 else old)
    finally:
        stop.set()
        t.join()
    assert seen <= {_sha(old), _sha(new)}


def test_write_json(tmp_path):
    p = tmp_path / "m.json"
    art.atomic_write_json(p, {"b": 1, "a": Path("/x"), "c": [1, {"d": None}]})
    assert p.read_text() == '{\n  "b": 1,\n  "a": "/x",\n  "c": [\n    1,\n    {\n      "d": null\n    }\n  ]\n}\n'


@pytest.mark.parametrize("code", sorted(art.STORAGE_ERRNOS))
def test_storage_errnos_become_storage_errors(tmp_path, code):
    err = art.storage_error(tmp_path / "f", OSError(code, os.strerror(code)))
    assert isinstance(err, StorageError) and err.errno == code
    assert err.exit_code == 1 and err.outcome == "storage_error"
    assert str(err).startswith(f"cannot write {tmp_path / 'f'}: {os.strerror(code)}; fix: free space or fix "
                               f"permissions on {tmp_path}")


def test_other_errnos_stay_what_they_are(tmp_path):
    e = OSError(errno.EIO, "I/O error")
    assert art.storage_error(tmp_path / "f", e) is e
    assert art.storage_error(tmp_path / "f", OSError("no errno")).errno is None


# -------------------------------------------------------------------------------------------------- journal


def test_journal_appends_durable_lines(tmp_path):
    p = tmp_path / "items.jsonl"
    j = art.Journal(p)
    j.append({"key": "a", "status": "ok"})
    assert p.read_text() == '{"key": "a", "status": "ok"}\n'  # on disk before close
    j.append({"key": "b"})
    j.close()
    assert sinks.read_journal(p) == [{"key": "a", "status": "ok"}, {"key": "b"}]


def test_journal_lines_keep_the_records_key_order(tmp_path):
    p = tmp_path / "items.jsonl"
    j = art.Journal(p)
    j.append({"status": "ok", "key": "a", "file": "images/a.png"})
    j.close()
    assert p.read_text() == '{"status": "ok", "key": "a", "file": "images/a.png"}\n'


def test_journal_cuts_a_partial_last_line_of_a_killed_run(tmp_path):
    p = tmp_path / "items.jsonl"
    p.write_bytes(b'{"key": "a"}\n{"key": "b"}\n{"key": "c", "sta')
    j = art.Journal(p)
    assert p.read_bytes() == b'{"key": "a"}\n{"key": "b"}\n'
    j.append({"key": "c"})
    j.close()
    assert [r["key"] for r in sinks.read_journal(p)] == ["a", "b", "c"]


def test_journal_partial_only_line_and_clean_files(tmp_path):
    p = tmp_path / "items.jsonl"
    p.write_bytes(b'{"key": "a", "st')
    art.Journal(p).close()
    assert p.read_bytes() == b""
    p.write_bytes(b'{"key": "a"}\n')
    art.Journal(p).close()
    assert p.read_bytes() == b'{"key": "a"}\n'
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    art.Journal(empty).close()
    assert empty.read_bytes() == b""
    new = tmp_path / "new.jsonl"
    art.Journal(new).close()
    assert new.exists()


def test_journal_storage_error(tmp_path, monkeypatch):
    j = art.Journal(tmp_path / "items.jsonl")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StorageError) as e:
        j.append({"key": "a"})
    assert str(tmp_path / "items.jsonl") in str(e.value) and e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    j.close()


# --------------------------------------------------------------------------------------------- the writer


def _img(v: float, h: int = 4, w: int = 4) -> np.ndarray:
    return np.full((h, w, 3), v, dtype=np.float32)


@pytest.mark.parametrize("workers", [0, 2])
def test_writer_journals_in_submission_order_after_each_file(tmp_path, workers):
    (tmp_path / "images").mkdir()
    j = art.Journal(tmp_path / "items.jsonl")
    seen: List[Dict[str, Any]] = []

    def on_record(rec):
        if rec.get("status") == "ok":  # the record comes only once its file is complete on disk
            assert _sha((tmp_path / rec["file"]).read_bytes()) == rec["file_sha256"]
        seen.append(rec)

    w = art.ArtifactWriter(j, workers, on_record, max_pending=2)
    for i in range(6):
        rel = f"images/{i}.png"
        w.submit({"key": str(i)}, tmp_path / rel, _img(i / 6, 8 + i, 8), rel=rel, file_name=f"{i}.png")
    w.submit({"key": "no-artifact", "status": "failed", "reason": "nan"})
    w.close()
    j.close()
    recs = sinks.read_journal(tmp_path / "items.jsonl")
    assert [r["key"] for r in recs] == [str(i) for i in range(6)] + ["no-artifact"]
    assert recs == seen
    for i, r in enumerate(recs[:6]):
        assert (r["status"], r["file"], r["file_name"]) == ("ok", f"images/{i}.png", f"{i}.png")
        assert r["file_sha256"] == _sha((tmp_path / r["file"]).read_bytes())
        assert r["timing"]["write_s"] >= 0
        from PIL import Image

        assert Image.open(tmp_path / r["file"]).size == (8, 8 + i)
    assert recs[6] == {"key": "no-artifact", "status": "failed", "reason": "nan"}
    assert w.thread_s > 0 and w.wait_s >= 0
    assert _leftovers(tmp_path / "images") == []


def test_writer_png_text_chunks_and_no_file_name(tmp_path):
    from PIL import Image

    j = art.Journal(tmp_path / "items.jsonl")
    w = art.ArtifactWriter(j, 0, lambda r: None)
    w.submit({"key": "a"}, tmp_path / "a.png", (_img(0.5), {"prompt": "a fox", "seed": "3"}), rel="a.png")
    w.close()
    rec = sinks.read_journal(tmp_path / "items.jsonl")[0]
    assert "file_name" not in rec
    assert Image.open(tmp_path / "a.png").text == {"prompt": "a fox", "seed": "3"}
    assert rec["file_sha256"] == _sha(art.encode_png(_img(0.5), {"prompt": "a fox", "seed": "3"}))


@pytest.mark.parametrize("workers", [0, 1])
def test_writer_a_failed_item_is_recorded_and_the_run_goes_on(tmp_path, workers):
    j = art.Journal(tmp_path / "items.jsonl")
    w = art.ArtifactWriter(j, workers, lambda r: None)
    w.submit({"key": "bad"}, tmp_path / "bad.png", "not an image", rel="bad.png")
    w.submit({"key": "good"}, tmp_path / "good.png", _img(0.2), rel="good.png")
    w.close()
    bad, good = sinks.read_journal(tmp_path / "items.jsonl")
    assert bad["status"] == "failed" and bad["file"] is None
    assert bad["reason"].startswith("writing the artifact failed: ") and "Error: " in bad["reason"]
    assert good["status"] == "ok" and not (tmp_path / "bad.png").exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_writer_a_full_disk_stops_the_run_keeping_what_was_written(tmp_path, workers, monkeypatch):
    j = art.Journal(tmp_path / "items.jsonl")
    calls = {"n": 0}

    def write(path: Path, payload: Any) -> Dict[str, Any]:
        calls["n"] += 1
        if payload == "third":
            raise art.storage_error(path, OSError(errno.ENOSPC, "No space left on device"))
        art.atomic_write_bytes(path, payload.encode())
        return {"sha256": _sha(payload.encode()), "fields": {"bytes": len(payload)}}

    w = art.ArtifactWriter(j, workers, lambda r: None, write=write)
    w.submit({"key": "1"}, tmp_path / "1", "first", rel="1")
    w.submit({"key": "2"}, tmp_path / "2", "second", rel="2")
    with pytest.raises(StorageError):
        w.submit({"key": "3"}, tmp_path / "3", "third", rel="3")
        w.submit({"key": "4"}, tmp_path / "4", "fourth", rel="4")
        w.close()
    recs = sinks.read_journal(tmp_path / "items.jsonl")
    assert [(r["key"], r["status"], r["bytes"]) for r in recs] == [("1", "ok", 5), ("2", "ok", 6)]
    assert not (tmp_path / "3").exists()


def test_writer_bounds_pending_submissions(tmp_path):
    gate = threading.Event()

    def slow(path: Path, payload: Any) -> Dict[str, Any]:
        gate.wait(10)
        return {"sha256": "x"}

    j = art.Journal(tmp_path / "items.jsonl")
    w = art.ArtifactWriter(j, 1, lambda r: None, max_pending=2, write=slow)
    w.submit({"key": "a"}, tmp_path / "a", 1)
    w.submit({"key": "b"}, tmp_path / "b", 2)
    assert len(w._pending) == 2 and sinks.read_journal(tmp_path / "items.jsonl") == []
    threading.Timer(0.2, gate.set).start()
    w.submit({"key": "c"}, tmp_path / "c", 3)  # a third one waits for the oldest
    assert [r["key"] for r in sinks.read_journal(tmp_path / "items.jsonl")][:1] == ["a"]
    assert w.wait_s > 0.1
    w.close()
    assert [r["key"] for r in sinks.read_journal(tmp_path / "items.jsonl")] == ["a", "b", "c"]


def test_writer_times_add_up_over_items(tmp_path):
    import time

    def slow(path: Path, payload: Any) -> Dict[str, Any]:
        time.sleep(0.3)
        return {"sha256": "s"}

    w = art.ArtifactWriter(art.Journal(tmp_path / "items.jsonl"), 1, lambda r: None, max_pending=1, write=slow)
    for k in "abc":
        w.submit({"key": k}, tmp_path / k, k)  # each submission beyond one pending waits for the oldest
    w.close()
    assert 0.85 <= w.thread_s < 30  # summed over the three writes
    assert 0.5 <= w.wait_s < 30  # summed over the waits
    for r in sinks.read_journal(tmp_path / "items.jsonl"):
        assert 0.29 <= r["timing"]["write_s"] < 30


def test_writer_records_write_seconds_to_four_decimals(tmp_path, monkeypatch):
    import time

    clock = iter([100.0, 100.0123456, 200.0, 200.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    w = art.ArtifactWriter(art.Journal(tmp_path / "items.jsonl"), 0, lambda r: None,
                           write=lambda p, x: {"sha256": "s"})
    w.submit({"key": "a"}, tmp_path / "a", 1)
    w.submit({"key": "b"}, tmp_path / "b", 2)
    monkeypatch.undo()
    w.close()
    assert [r["timing"]["write_s"] for r in sinks.read_journal(tmp_path / "items.jsonl")] == [0.0123, 0.5]
    assert w.thread_s == pytest.approx(0.5123456)


def test_writer_max_pending_at_least_one(tmp_path):
    w = art.ArtifactWriter(art.Journal(tmp_path / "j"), 0, lambda r: None, max_pending=0)
    assert w.max_pending == 1
    w.close()


def test_writer_drain_without_block_leaves_unfinished_writes_queued(tmp_path):
    gate = threading.Event()
    j = art.Journal(tmp_path / "items.jsonl")
    w = art.ArtifactWriter(j, 1, lambda r: None, max_pending=8,
                           write=lambda p, x: (gate.wait(10), {"sha256": "s"})[1])
    w.submit({"key": "a"}, tmp_path / "a", 1)
    w.drain()
    assert sinks.read_journal(tmp_path / "items.jsonl") == []
    gate.set()
    w.close()
    assert sinks.read_journal(tmp_path / "items.jsonl")[0]["status"] == "ok"


# ------------------------------------------------------------------------------------------- the readers


def test_read_journal(tmp_path):
    p = tmp_path / "items.jsonl"
    assert sinks.read_journal(p) == []
    p.write_text('{"key": "a"}\nnot json\n{"key": "b"}\n{"key": "c", "tr')
    assert sinks.read_journal(p) == [{"key": "a"}, {"key": "b"}]
    assert sinks.read_journal(str(p)) == [{"key": "a"}, {"key": "b"}]


def test_compact_journal_keeps_the_latest_record_per_key(tmp_path):
    p = tmp_path / "items.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"key": "a", "v": 1}, {"key": "b", "v": 1}, {"key": "a", "v": 2}, {"id": "row9", "v": 1}, {"v": "no key"}]))
    sinks.compact_journal(p)
    assert sinks.read_journal(p) == [{"key": "a", "v": 2}, {"key": "b", "v": 1}, {"id": "row9", "v": 1}]
    assert _leftovers(tmp_path) == []


def test_compact_journal_order_extra_and_keep(tmp_path):
    p = tmp_path / "items.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [
        {"key": "a", "status": "ok", "run": "old"}, {"key": "b", "status": "ok", "run": "new"}]))
    sinks.compact_journal(p, order=["c", "b", "a", "z"], extra={"c": {"key": "c", "from": "rank1"}},
                          keep=lambda r: r["run"] == "new")
    assert sinks.read_journal(p) == [{"key": "c", "from": "rank1"}, {"key": "b", "status": "ok", "run": "new"}]


def test_compact_journal_journal_wins_over_extra(tmp_path):
    p = tmp_path / "items.jsonl"
    p.write_text(json.dumps({"key": "a", "v": "journal"}) + "\n")
    sinks.compact_journal(p, extra={"a": {"key": "a", "v": "extra"}})
    assert sinks.read_journal(p) == [{"key": "a", "v": "journal"}]


def test_compact_journal_of_a_missing_file(tmp_path):
    sinks.compact_journal(tmp_path / "none.jsonl")
    assert not (tmp_path / "none.jsonl").exists()
    sinks.compact_journal(tmp_path / "made.jsonl", order=["a"], extra={"a": {"key": "a"}})
    assert sinks.read_journal(tmp_path / "made.jsonl") == [{"key": "a"}]


def _ok(key: str, file: str, **kw: Any) -> Dict[str, Any]:
    return {"key": key, "id": key, "status": "ok", "file": file, "prompt": f"p {key}", "seed": 1,
            "params": {"steps": 4}, "file_sha256": "s", **kw}


def test_folder_metadata_lists_the_ok_items_of_each_folder(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "videos").mkdir()
    recs = [_ok("a", "images/a.png"), _ok("v", "videos/v.mp4", num_frames=9, fps=8, meta={"src": 1}),
            {"key": "f", "status": "failed", "file": None}, _ok("b", "images/b.png", file_name="b.png"),
            _ok("x", "elsewhere/x.png"), _ok("top", "top.png")]
    assert sinks.write_folder_metadata(tmp_path, recs, "tiny_flux", "run-1") == {
        "images/metadata.jsonl": 2, "videos/metadata.jsonl": 1}
    images = sinks.read_journal(tmp_path / "images" / "metadata.jsonl")
    assert images[0] == {"file_name": "a.png", "id": "a", "key": "a", "prompt": "p a", "negative_prompt": None,
                         "seed": 1, "parameters": {"steps": 4}, "model": "tiny_flux", "run_id": "run-1",
                         "file_sha256": "s"}
    assert [r["file_name"] for r in images] == ["a.png", "b.png"]
    (video,) = sinks.read_journal(tmp_path / "videos" / "metadata.jsonl")
    assert (video["num_frames"], video["fps"], video["meta"]) == (9, 8, {"src": 1})


def test_folder_metadata_of_videos_without_an_images_folder(tmp_path):
    (tmp_path / "videos").mkdir()
    recs = [_ok("v", "videos/v.mp4"), _ok("folder", "images"), _ok("img", "images/i.png")]
    assert sinks.write_folder_metadata(tmp_path, recs, None, None) == {"videos/metadata.jsonl": 1}
    assert not (tmp_path / "images").exists()


def test_folder_metadata_never_lists_the_folder_itself(tmp_path):
    (tmp_path / "images").mkdir()
    recs = [_ok("folder", "images"), _ok("a", "images/a.png")]
    assert sinks.write_folder_metadata(tmp_path, recs, None, None) == {"images/metadata.jsonl": 1}


def test_folder_metadata_removes_a_stale_index(tmp_path):
    (tmp_path / "images").mkdir()
    stale = tmp_path / "images" / "metadata.jsonl"
    stale.write_text('{"file_name": "old.png"}\n')
    assert sinks.write_folder_metadata(tmp_path, [{"key": "f", "status": "failed"}], None, None) == {}
    assert not stale.exists()
    assert sinks.write_folder_metadata(tmp_path, [], None, None) == {}  # nothing to remove: fine


def test_artifact_intact(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(b"png")
    (tmp_path / "images" / "a.npz").write_bytes(b"frames")
    rec = {"status": "ok", "file": "images/a.png", "file_sha256": _sha(b"png")}
    assert sinks.artifact_intact(tmp_path, rec)
    assert not sinks.artifact_intact(tmp_path, dict(rec, file_sha256=_sha(b"other")))
    assert not sinks.artifact_intact(tmp_path, dict(rec, status="failed"))
    assert not sinks.artifact_intact(tmp_path, dict(rec, file=None))
    assert not sinks.artifact_intact(tmp_path, dict(rec, file="images/missing.png"))
    dump = dict(rec, frames_file="images/a.npz", frames_file_sha256=_sha(b"frames"))
    assert sinks.artifact_intact(tmp_path, dump)
    assert not sinks.artifact_intact(tmp_path, dict(dump, frames_file_sha256=_sha(b"x")))
    assert not sinks.artifact_intact(tmp_path, dict(dump, frames_file="images/gone.npz"))
    assert sinks.artifact_intact(tmp_path, dict(rec, frames_file=None))
