"""The sinks (runner/core/sinks.py) driven directly, for the mutation run (benchmarks/mutation.py, group
``sinks``): the artifact-dims rule against the record, what a PNG carries and is named, the failure records of an
exception and of a non-finite output, the text and compute-only sinks, the folder index rows and the records of
files a journal no longer lists."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from models.base import ImageOutput, TextOutput
from runner.core import sinks
from runner.core.sinks import (ArtifactMismatchError, ComputeOnlySink, ImageSink, RecordSink, check_artifact_dims,
                               embedded_fields, folder_metadata_row, keep_unlisted, read_journal)


def test_check_artifact_dims_names_each_field_that_differs():
    check_artifact_dims({"params": {"width": 4, "height": 2}}, {"width": 4, "height": 2}, Path("a.png"))
    check_artifact_dims({"params": {"width": None}}, {"width": 4}, Path("a.png"))
    check_artifact_dims({}, {"width": 4}, Path("a.png"))
    check_artifact_dims({"params": {"num_frames": 5, "fps": 8}}, {"width": 4}, Path("a.png"))
    with pytest.raises(ArtifactMismatchError) as e:
        check_artifact_dims({"params": {"width": 4, "height": 2, "num_frames": 9}},
                            {"width": 8, "height": 2, "num_frames": 5}, Path("d/v.mp4"))
    assert str(e.value) == ("v.mp4 as written disagrees with its record's params (width: record 4, artifact 8; "
                            "num_frames: record 9, artifact 5): the engine's output is not the size it recorded; "
                            "the item is failed, not written (an engine or pipeline size rule to fix)")
    assert isinstance(e.value, ValueError)


def test_embedded_fields():
    rec = {"prompt": "p", "seed": 3, "params": {"b": 1, "a": 2}}
    assert embedded_fields(rec, "m") == {"prompt": "p", "seed": "3", "parameters": '{"a": 2, "b": 1}', "model": "m"}
    assert list(embedded_fields({**rec, "negative_prompt": ""}, None)) == ["prompt", "negative_prompt", "seed",
                                                                          "parameters"]
    assert embedded_fields({}, None) == {"prompt": "", "seed": "None", "parameters": "{}"}
    assert embedded_fields({"negative_prompt": 3, "params": {"p": Path("/x")}}, None) == {
        "prompt": "", "negative_prompt": "3", "seed": "None", "parameters": '{"p": "/x"}'}


def test_folder_metadata_row():
    rec = {"file": "images/a.png", "id": "i", "key": "k", "prompt": "p", "seed": 1, "params": {"w": 1},
           "file_sha256": "s", "fps": 8, "num_frames": None, "meta": {"x": 1}, "negative_prompt": "n"}
    assert folder_metadata_row(rec, "m", "r") == {
        "file_name": "a.png", "id": "i", "key": "k", "prompt": "p", "negative_prompt": "n", "seed": 1,
        "parameters": {"w": 1}, "model": "m", "run_id": "r", "file_sha256": "s", "fps": 8, "meta": {"x": 1}}
    assert folder_metadata_row({"file": "images/sub/a.png", "file_name": "sub/a.png"}, None, None)[
        "file_name"] == "sub/a.png"
    assert folder_metadata_row({"file": "images/a.png"}, None, None)["parameters"] == {}


@pytest.mark.parametrize("workers", [0, 2])
def test_png_sink_writes_named_hashed_files_with_their_text_and_fails_bad_outputs(tmp_path, workers):
    seen = []
    sink = ImageSink(tmp_path, "items.rank1.jsonl", workers=workers, on_record=seen.append, model="toy")
    img = np.full((4, 6, 3), 0.25, np.float32)
    sink.submit({"key": "a/b", "prompt": "p", "seed": 1, "params": {"width": 6, "height": 4}}, ImageOutput(img))
    bad = img.copy()
    bad[0, 0, 0] = np.nan
    bad[1, 1, 1] = np.inf
    sink.submit({"key": "nan", "params": {}}, ImageOutput(bad))
    sink.submit({"key": "nan2", "params": {}}, ImageOutput(bad))
    sink.submit({"key": "err", "params": {}}, RuntimeError("boom"))
    sink.drain()
    sink.close()
    recs = {r["key"]: r for r in read_journal(tmp_path / "items.rank1.jsonl")}
    ok = recs["a/b"]
    stem = sinks.Path(ok["file"]).stem
    assert ok["status"] == "ok" and ok["file"] == f"images/{stem}.png" and ok["file_name"] == f"{stem}.png"
    data = (tmp_path / ok["file"]).read_bytes()
    assert ok["file_sha256"] == hashlib.sha256(data).hexdigest()
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == (6, 4)
        assert im.text == {"prompt": "p", "seed": "1", "parameters": '{"height": 4, "width": 6}', "model": "toy"}
    assert recs["nan"] == {"key": "nan", "params": {}, "status": "failed", "file": None,
                           "reason": "non-finite output (2 values)"}
    assert recs["err"]["status"] == "failed" and recs["err"]["file"] is None
    assert recs["err"]["reason"] == "RuntimeError: boom"
    assert sink.counts == {"ok": 1, "failed": 3} and sink.nonfinite == 2
    assert [r["key"] for r in sink.ok_records] == ["a/b"]
    assert sorted(r["key"] for r in seen) == ["a/b", "err", "nan", "nan2"]
    assert sink.verify(ok) is True
    assert sink.verify({**ok, "file_sha256": "0" * 64}) is False
    assert sink.verify(recs["nan"]) is False
    assert sink.write_s >= 0 and sink.wait_s >= 0
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == [f"{stem}.png"]


def test_png_sink_options_and_identity(compose):
    cfg = compose(["model=toy_shapes"])
    assert ImageSink.options(cfg) == {"model": "toy_shapes", "image_format": "png"}
    assert ImageSink.identity(cfg) == {"png_text": list(sinks.EMBEDDED_FIELDS),
                                       "not_embedded": ["batch_size", "lora.name"]}
    assert ImageSink.threaded is True and RecordSink.threaded is False
    assert RecordSink.identity(cfg) is None and RecordSink.options(cfg) == {}


def test_record_sink_journals_each_record_durably(tmp_path):
    seen = []
    sink = RecordSink(tmp_path, "text.jsonl", on_record=seen.append)
    sink.submit({"key": "a", "output_token_ids": [1, 2]}, TextOutput({}))
    sink.submit({"key": "b"}, ValueError("no"))
    assert [r["key"] for r in read_journal(tmp_path / "text.jsonl")] == ["a", "b"]  # before drain or close
    sink.drain()
    sink.close()
    recs = read_journal(tmp_path / "text.jsonl")
    assert recs == [{"key": "a", "output_token_ids": [1, 2], "status": "ok"},
                    {"key": "b", "status": "failed", "reason": "ValueError: no"}]
    assert sink.counts == {"ok": 1, "failed": 1} and [r["key"] for r in seen] == ["a", "b"]
    assert sink.verify(recs[0]) is True
    assert sink.verify({"status": "ok", "output_token_ids": "12"}) is False
    assert sink.verify({"status": "failed", "output_token_ids": [1]}) is False
    assert sink.write_s == 0.0 and sink.wait_s == 0.0 and sink.journal_name == "text.jsonl"


def test_compute_only_sink_counts_without_writing(tmp_path):
    seen = []
    sink = ComputeOnlySink(tmp_path, on_record=seen.append)
    img = np.zeros((2, 2, 3), np.float32)
    bad = img.copy()
    bad[0, 0, 0] = np.nan
    recs = [{"key": "ok"}, {"key": "nan"}, {"key": "err"}]
    sink.submit(recs[0], ImageOutput(img))
    sink.submit(recs[1], ImageOutput(bad))
    sink.submit(recs[2], KeyError("k"))
    sink.submit({"key": "nan2"}, ImageOutput(bad))
    sink.drain()
    sink.close()
    assert sink.nonfinite == 2 and sink.counts == {"ok": 1, "failed": 3}
    seen.pop()
    assert recs == [{"key": "ok", "status": "ok", "file": None},
                    {"key": "nan", "status": "failed", "file": None, "reason": "non-finite output (1 values)"},
                    {"key": "err", "status": "failed", "file": None, "reason": "KeyError: 'k'"}]
    assert seen == recs
    assert sink.verify(recs[0]) is False and list(tmp_path.iterdir()) == []
    assert sink.journal_name is None and sink.write_s == 0.0 and sink.wait_s == 0.0


def _artifact(d: Path, name: str, data: bytes) -> dict:
    (d / "images").mkdir(parents=True, exist_ok=True)
    (d / "images" / name).write_bytes(data)
    return {"key": name, "status": "ok", "file": f"images/{name}", "file_sha256": hashlib.sha256(data).hexdigest()}


def _jsonl(path: Path, recs) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_keep_unlisted_keeps_intact_files_the_journal_dropped(tmp_path):
    a, b, c, e = (_artifact(tmp_path, n, n.encode()) for n in ("a.png", "b.png", "c.png", "e.png"))
    _jsonl(tmp_path / "items.jsonl", [a, {"key": "x", "status": "failed", "file": "images/b.png"}])
    _jsonl(tmp_path / "items.rank1.jsonl", [b, {**c, "status": "failed"}, {**e, "file_sha256": "0" * 64}])
    old_b = {**b, "seed": 1}
    n = keep_unlisted(tmp_path, "items.jsonl", before=[old_b, {**a, "seed": 9}, c])
    assert n == 2
    kept = read_journal(tmp_path / sinks.UNLISTED)
    assert kept == [old_b, c], "latest record per file, sorted by file; a's is listed, e's is not intact"
    _jsonl(tmp_path / "items.jsonl", [a, b, c])
    (tmp_path / "items.rank1.jsonl").unlink()
    assert keep_unlisted(tmp_path, "items.jsonl") == 0
    assert not (tmp_path / sinks.UNLISTED).exists()
    assert keep_unlisted(tmp_path, "items.jsonl") == 0


def test_keep_unlisted_reads_other_journals_not_its_own(tmp_path):
    a, b = _artifact(tmp_path, "a.png", b"a"), _artifact(tmp_path, "b.png", b"b")
    _jsonl(tmp_path / "items.rank0.jsonl", [a])
    _jsonl(tmp_path / "items.jsonl", [b])
    assert keep_unlisted(tmp_path) == 1, "the run's journal is items.jsonl by default: b is listed"
    assert read_journal(tmp_path / sinks.UNLISTED) == [a]
    assert keep_unlisted(tmp_path, "items.rank0.jsonl") == 1  # now b, from items.jsonl
    assert read_journal(tmp_path / sinks.UNLISTED) == [b]


def test_mp4_sink_records_what_the_file_decodes_to_its_metadata_and_frame_dump(tmp_path, compose):
    from models.base import VideoOutput
    from runner.core import video
    from runner.core.sinks import MP4Sink

    frames = np.zeros((3, 16, 16, 3), np.float32)
    frames[1, 4:8, 4:8] = 1.0
    frames[2] = 0.5
    sink = MP4Sink(tmp_path, workers=1, max_pending=8, dump_frames=True, model="vid", codec="h264_lossless")
    assert sink.writer.max_pending == 2, "a pending video holds its frames: at most workers + 1"
    rec = {"key": "v", "prompt": "a square", "seed": 5, "params": {"fps": 8, "width": 16, "height": 16,
                                                                   "num_frames": 3}}
    sink.submit(rec, VideoOutput(frames, fps=24))
    sink.submit({"key": "f", "params": {}}, VideoOutput(frames, fps=12.5))
    sink.submit({"key": "t", "params": {"fps": True}}, VideoOutput(frames, fps=8))
    sink.submit({"key": "n", "params": {"fps": float("nan")}}, VideoOutput(frames))
    sink.submit({"key": "s", "params": {"fps": "8"}}, VideoOutput(frames))
    sink.submit({"key": "bad", "params": {"fps": 8, "num_frames": 4}}, VideoOutput(frames))
    sink.submit({"key": "none", "params": {}}, VideoOutput(frames))
    sink.submit({"key": "neg", "params": {"fps": -1}}, VideoOutput(frames))
    sink.submit({"key": "zero", "params": {"fps": 0}}, VideoOutput(frames, fps=8))
    sink.submit({"key": "half", "params": {"fps": 0.5}}, VideoOutput(frames))
    sink.close()
    by = {r["key"]: r for r in read_journal(tmp_path / "items.jsonl")}
    v = by["v"]
    assert v["status"] == "ok" and v["fps"] == 8 and v["file"] == "videos/v.mp4" and v["file_name"] == "v.mp4"
    assert (v["num_frames"], v["width"], v["height"]) == (3, 16, 16)
    assert v["frames_file"] == "videos/v.frames.npz"
    dumped = np.load(tmp_path / v["frames_file"])["frames"]
    np.testing.assert_array_equal(dumped, video.to_uint8_frames(frames))
    np.testing.assert_array_equal(video.decode_mp4(tmp_path / v["file"]), dumped)
    assert v["frames_sha256"] == video.frames_sha256(dumped)
    assert v["video"] == {k: video.encoder_info("h264_lossless")[k]
                          for k in ("codec", "encoder", "pix_fmt", "lossless", "ffmpeg")}
    meta = video.read_metadata(tmp_path / v["file"])
    assert meta["title"] == "a square"
    assert json.loads(meta["comment"]) == embedded_fields(rec, "vid")
    assert by["f"]["status"] == "ok" and by["f"]["fps"] == 12.5 and "frames_file" in by["f"]
    for k in ("t", "n", "s", "neg"):
        assert by[k]["status"] == "failed" and "file" in by[k] and by[k]["file"] is None, by[k]
    assert by["none"]["reason"] == ("no frame rate: the engine set neither the record's params.fps nor "
                                    "VideoOutput.fps")
    assert by["neg"]["reason"] == "fps=-1 is not a number > 0"
    assert by["zero"]["reason"] == "fps=0 is not a number > 0", "the record's fps wins over the output's"
    assert by["half"]["status"] == "ok" and by["half"]["fps"] == 0.5
    assert by["t"]["reason"] == "fps=True is not a number > 0"
    assert by["n"]["reason"] == "fps=nan is not a number > 0"
    assert by["s"]["reason"] == "fps='8' is not a number > 0"
    assert by["bad"]["status"] == "failed" and "num_frames: record 4, artifact 3" in by["bad"]["reason"]
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == ["f.frames.npz", "f.mp4", "half.frames.npz",
                                                                       "half.mp4", "v.frames.npz", "v.mp4"]
    cfg = compose(["model=toy_shapes", "output.video_codec=h264_lossless", "output.video_frames=true"])
    assert MP4Sink.options(cfg) == {"codec": "h264_lossless", "dump_frames": True, "model": "toy_shapes"}
    assert MP4Sink.identity(cfg) == {"video": video.encoder_info("h264_lossless"), "frames_dump": True,
                                     "metadata": list(sinks.EMBEDDED_FIELDS),
                                     "not_embedded": ["batch_size", "lora.name"]}


def test_mp4_sink_without_a_dump_writes_only_the_video(tmp_path):
    from models.base import VideoOutput
    from runner.core.sinks import MP4Sink

    sink = MP4Sink(tmp_path, model=None)
    sink.submit({"key": "v", "params": {"fps": 8}}, VideoOutput(np.zeros((2, 8, 8, 3), np.float32)))
    sink.close()
    (r,) = read_journal(tmp_path / "items.jsonl")
    assert r["status"] == "ok" and "frames_file" not in r and "frames_file_sha256" not in r
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == ["v.mp4"]
