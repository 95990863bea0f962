"""Video output (issue #17): an engine with ``output = "video"``, registered from this test alone, runs through the
one run loop and the MP4 sink (``runner.core.sinks.MP4Sink``, ``runner.core.video``).

The toy engine renders a square moving across a gradient, from the item's seed (9 frames, 64x48, 12 fps), so every
frame differs from its neighbours: frames out of order, a dropped or duplicated frame, or a hash of the container
instead of the frames all show. Expectations are recomputed here from the engine's float frames and from the files
on disk, decoded with imageio-ffmpeg's reader directly (not through ``runner.core.video``) where the codec is lossless.

* the MP4s decode exactly to the generated ``uint8`` frames; ``frames_sha256`` is the sha256 of those frames, not
  of the file; ``fps``/size/count are recorded and in the container; NaN and a raising row fail alone;
* the lossy ``h264`` codec: playable yuv420p, close to the frames, ``frames_sha256`` of what the file decodes to;
* the frame dump (``output.video_frames``) holds the generated ``uint8`` frames;
* a SIGKILL after a video's encode and before its rename (through an ffmpeg wrapper) leaves no file under a final
  name without a record; the resume reuses the journaled videos and ends byte-identical to an uninterrupted run;
* a modified MP4 (or frame dump) fails ``verify`` and is regenerated; a remuxed MP4 (same frames, other bytes)
  also fails ``verify`` (resume keeps only the exact file) but passes repro (which compares decoded frames);
* ``report.html`` shows each video's middle frame as its poster;
* a changed codec is refused on resume; a missing encoder is refused before the model loads.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import pytest

from models.base import EngineBase, StageResult, VideoOutput
from models.registry import ENGINES, register_engine, unregister_engine

REPO = Path(__file__).resolve().parent.parent
NUM_FRAMES, W, H = 9, 64, 48
FPS = 12  # in every record's params: wins over VideoOutput.fps
ENGINE_FPS = 16
ROWS = {"a": "a red square", "b": "a blue square", "c": "a green square", "d": "a grey square", "e": "a square"}


# ------------------------------------------------------------------------------------------------ the toy engine
def moving_square(seed: int) -> np.ndarray:
    """float32 (F, H, W, 3) in [0, 1]: a 12x12 square moving 5 px right per frame over a horizontal gradient,
    colours and start from ``seed``."""
    rng = np.random.default_rng(seed)
    bg, fg = rng.uniform(0.05, 0.45, 3), rng.uniform(0.55, 1.0, 3)
    x0, y0 = int(rng.integers(0, W - 12)), int(rng.integers(0, H - 12))
    grad = np.linspace(0.0, 0.3, W, dtype=np.float64)[None, :, None]
    frames = np.empty((NUM_FRAMES, H, W, 3), np.float32)
    for f in range(NUM_FRAMES):
        img = np.broadcast_to(bg + grad, (H, W, 3)).copy()
        x = (x0 + 5 * f) % (W - 12)
        img[y0:y0 + 12, x:x + 12] = fg
        frames[f] = img
    return frames


def as_uint8(frames: np.ndarray) -> np.ndarray:
    """The documented rounding of float frames: clip to [0, 1], x255, round half to even."""
    return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


class MovingSquareEngine(EngineBase):
    """A toy video engine: one moving-square video per item. A prompt with ``nan`` yields NaN frames, one with
    ``boom`` raises (failing its batch, retried alone); one with ``shrunk`` yields 32x32 frames and one with
    ``short`` a frame less while the record says 64x48 and 9 frames (a pipeline whose size rule differs from the
    engine's, like a Wan 2.2 VAE that makes a 48x48 row a 32x32 video)."""

    output = "video"
    unit = "video"
    resumable = True
    default_stage = "denoise"
    events: List[str] = []

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.stage = ctx.stage
        self.source: Dict[str, Any] = {"kind": "toy"}

    def prepare(self) -> Dict[str, Any]:
        MovingSquareEngine.events.append("prepare")
        return self.source

    def read_rows(self) -> Tuple[List[Any], Path]:
        from runner.core import dataset as ds

        g = dict(width=W, height=H, num_inference_steps=1, guidance_scale=None, num_images_per_prompt=1)
        return ds.load_rows(self.ctx.cfg.dataset.format, self.ctx.cfg.dataset.path, defaults=g, size_multiple=16,
                            max_pixels=W * H, limit=self.ctx.cfg.dataset.limit)

    def items(self, rows: Sequence[Any], run_seed: int) -> List[Any]:
        from runner.core import dataset as ds

        return ds.expand_items(rows, run_seed)

    def batches(self, items: Sequence[Any], batch_size: int) -> List[List[Any]]:
        from runner.core import dataset as ds

        return ds.batches(list(items), batch_size)

    def backends_section(self) -> Dict[str, Any]:
        return {}

    def load(self, on_loaded: Any = None) -> Dict[str, Any]:
        MovingSquareEngine.events.append("load")
        return {"model": {"load_s": 0.0}}

    def generate(self, batch: Sequence[Any]) -> List[VideoOutput]:
        if any("boom" in it.row.prompt for it in batch):
            raise RuntimeError("boom in the batch")
        out = []
        for it in batch:
            frames = moving_square(it.seed)
            if "nan" in it.row.prompt:
                frames[4, 3, 3, 1] = np.nan
            if "shrunk" in it.row.prompt:
                frames = frames[:, :32, :32]
            if "short" in it.row.prompt:
                frames = frames[:-1]
            out.append(VideoOutput(frames, fps=ENGINE_FPS))
        return out

    def record(self, item: Any, output: Any, batch_len: int, generate_s: float) -> Dict[str, Any]:
        return {"id": item.row.id, "key": item.key, "seed": item.seed, "prompt": item.row.prompt,
                "prompt_sha256": hashlib.sha256(item.row.prompt.encode()).hexdigest(),
                "params": {"width": W, "height": H, "num_frames": NUM_FRAMES, "fps": FPS}, "batch_size": batch_len}

    def evidence(self, result: StageResult) -> Tuple[Dict[str, Any], List[str]]:
        return {"videos": len(result.records)}, []


@pytest.fixture
def video_engine():
    MovingSquareEngine.events = []
    register_engine("moving_square", MovingSquareEngine)
    yield MovingSquareEngine
    unregister_engine("moving_square")
    assert "moving_square" not in ENGINES


# ------------------------------------------------------------------------------------------------ helpers
def _rows(tmp_path: Path, rows: Dict[str, str] = ROWS) -> Path:
    p = tmp_path / "rows.jsonl"
    p.write_text("".join(json.dumps({"id": k, "prompt": v}) + "\n" for k, v in rows.items()))
    return p


def _ov(data: Path, extra: Sequence[str] = ()) -> List[str]:
    return ["platform=cpu", "model.engine=moving_square", "dataset=jsonl", f"dataset.path={data}", "batch_size=1",
            *extra]


def _run(compose, run_dir: Path, data: Path, extra: Sequence[str] = ()) -> int:
    from runner.app.execute import run

    ov = _ov(data, extra)
    return run(compose(ov), run_dir, ov)


def _records(d: Path) -> List[Dict[str, Any]]:
    p = d / "items.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _decode(path: Path) -> Tuple[Dict[str, Any], np.ndarray]:
    """imageio-ffmpeg's reader, plainly (rgb24): ``(meta, uint8 (F, H, W, 3))``."""
    import imageio_ffmpeg

    gen = imageio_ffmpeg.read_frames(str(path))
    meta = next(gen)
    w, h = meta["size"]
    frames = [np.frombuffer(b, np.uint8).reshape(h, w, 3) for b in gen]
    return meta, np.stack(frames)


def _expected(rec: Dict[str, Any]) -> np.ndarray:
    return as_uint8(moving_square(rec["seed"]))


def _files(d: Path) -> Dict[str, str]:
    """Every non-hidden file of ``videos/`` but its index ``metadata.jsonl`` -> its sha256."""
    v = d / "videos"
    return {f"videos/{p.name}": _sha(p) for p in sorted(v.iterdir())
            if not p.name.startswith(".") and p.name != "metadata.jsonl"} if v.is_dir() else {}


def _temps(d: Path) -> List[str]:
    return sorted(p.name for p in d.rglob(".*.tmp*"))


# ------------------------------------------------------------------------------------------------ the run
def test_videos_decode_exactly_to_the_generated_frames_and_record_their_hash(video_engine, compose, tmp_path):
    rows = {**ROWS, "n": "a nan square", "x": "a boom square"}
    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, rows)) == 1  # two items failed, the others were written
    assert video_engine.events == ["prepare", "load"]
    recs = _records(d)
    assert [r["key"] for r in recs] == list(rows)
    by = {r["key"]: r for r in recs}
    assert by["n"]["status"] == "failed" and "non-finite" in by["n"]["reason"] and by["n"]["file"] is None
    assert by["x"]["status"] == "failed" and "boom in the batch" in by["x"]["reason"]
    ok = [r for r in recs if r["status"] == "ok"]
    assert [r["key"] for r in ok] == list(ROWS)
    for r in ok:
        assert r["file"] == f"videos/{r['key']}.mp4"
        f = d / r["file"]
        assert r["file_sha256"] == _sha(f)
        meta, frames = _decode(f)
        want = _expected(r)
        assert frames.shape == want.shape == (NUM_FRAMES, H, W, 3)
        assert np.array_equal(frames, want), f"{r['key']}: decoded frames differ from the generated ones"
        # the hash of the decoded frames, in frame order, not of the container
        assert r["frames_sha256"] == hashlib.sha256(want.tobytes()).hexdigest() != r["file_sha256"]
        assert (r["num_frames"], r["fps"], r["width"], r["height"]) == (NUM_FRAMES, FPS, W, H)
        assert meta["fps"] == FPS and meta["codec"] == "h264"  # params.fps wins over VideoOutput.fps
        assert r["video"]["codec"] == "h264_lossless" and r["video"]["lossless"] is True
        assert r["video"]["ffmpeg"] and r["inputs_sha256"]
    # every frame of a video differs from the next (so an order swap would show), and videos differ by seed
    f0 = _expected(ok[0])
    assert all(not np.array_equal(f0[i], f0[i + 1]) for i in range(NUM_FRAMES - 1))
    assert len({r["frames_sha256"] for r in ok}) == len(ok)
    assert set(_files(d)) == {r["file"] for r in ok}  # no file without an ok record, no frame dump by default
    assert not (d / "images").exists() and _temps(d) == []
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed_with_failures" and m["counts"] == {"ok": 5, "failed": 2, "reused": 0}
    assert m["dataset"]["items"] == 7
    assert m["timing"]["videos_per_s"] > 0 and m["timing"]["videos_per_hour"] > 0
    assert "images_per_s" not in m["timing"]
    assert m["identity"]["output"]["video"]["encoder"] == "libx264rgb"
    assert m["identity"]["output"]["frames_dump"] is False
    assert m["evidence"]["verdict"] == "nonfinite_outputs"


def test_a_video_whose_size_or_frame_count_differs_from_its_record_fails_and_leaves_no_file(video_engine, compose,
                                                                                             tmp_path):
    """Issue 29: the record must not disagree with its artifact. The MP4 sink decodes each file back and fails the
    item (``ArtifactMismatchError`` naming the record's and the file's value) when its width, height or frame
    count is not the record's ``params``; nothing is left under a final or a temp name, the other items hold."""
    rows = {"a": "a red square", "s": "a shrunk square", "t": "a short square"}
    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, rows)) == 1
    by = {r["key"]: r for r in _records(d)}
    assert by["a"]["status"] == "ok" and (by["a"]["width"], by["a"]["height"]) == (W, H)
    for k in ("s", "t"):
        assert by[k]["status"] == "failed" and by[k]["file"] is None and "ArtifactMismatchError" in by[k]["reason"]
    assert f"width: record {W}, artifact 32" in by["s"]["reason"]
    assert f"height: record {H}, artifact 32" in by["s"]["reason"] and "num_frames" not in by["s"]["reason"]
    assert f"num_frames: record {NUM_FRAMES}, artifact {NUM_FRAMES - 1}" in by["t"]["reason"]
    assert "width" not in by["t"]["reason"]
    assert set(_files(d)) == {"videos/a.mp4"} and _temps(d) == []
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"ok": 1, "failed": 2, "reused": 0}


def test_a_mismatching_video_leaves_no_frame_dump_either(video_engine, compose, tmp_path):
    """The check of the decoded file against the record comes before the frame dump as well as the rename: with
    ``output.video_frames=true`` a mismatching item leaves neither its MP4 nor its ``.frames.npz``; the matching
    item has both."""
    rows = {"a": "a red square", "s": "a shrunk square", "t": "a short square"}
    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, rows), ["output.video_frames=true"]) == 1
    by = {r["key"]: r for r in _records(d)}
    assert by["a"]["status"] == "ok" and by["a"]["frames_file"] == "videos/a.frames.npz"
    assert all(by[k]["status"] == "failed" and "ArtifactMismatchError" in by[k]["reason"] for k in ("s", "t"))
    assert "frames_file" not in by["s"] and "frames_file" not in by["t"]
    assert set(_files(d)) == {"videos/a.mp4", "videos/a.frames.npz"} and _temps(d) == []


# the sink driven alone in a child process; the record's num_frames compares like an int but SIGKILLs the process
# the moment it is compared with the artifact's (check_artifact_dims): what is on disk then is what a kill at the
# verification leaves, whatever the order of the steps around it
KILLED_AT_VERIFY = """import os, signal, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from pathlib import Path
from models.base import VideoOutput
from runner.core.sinks import MP4Sink
from test_video import moving_square, NUM_FRAMES, W, H, FPS


class KillOnCompare(int):
    def __ne__(self, other):
        os.kill(os.getpid(), signal.SIGKILL)

    __eq__ = __ne__


sink = MP4Sink(Path({out!r}), workers=0, dump_frames={dump!r})
sink.submit({{"key": "a", "seed": 1, "params": {{"width": W, "height": H, "num_frames": NUM_FRAMES, "fps": FPS}}}},
            VideoOutput(moving_square(1)))
sink.drain()
sink.submit({{"key": "k", "seed": 2, "params": {{"width": W, "height": H, "num_frames": KillOnCompare(NUM_FRAMES),
                                              "fps": FPS}}}}, VideoOutput(moving_square(2)))
sys.exit(3)  # not reached: the compare kills
"""


@pytest.mark.parametrize("dump", [False, True], ids=["mp4", "mp4+frames"])
def test_a_kill_at_verification_leaves_no_file_under_a_final_name(tmp_path, subprocess_env, dump):
    """Issue 29: the MP4 sink verifies a video (its decoded width, height, frame count against the record) *before*
    it is renamed into place, and before its frame dump is written. A SIGKILL at that verification leaves the
    complete video under its temp name only: no ``k.mp4``, no ``k.frames.npz``, no journal line; the video
    journaled before it is intact. (Renaming first, then verifying, leaves an unverified ``k.mp4``.)"""
    from runner.core.sinks import artifact_intact, read_journal

    out = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(KILLED_AT_VERIFY.format(repo=str(REPO), tests=str(REPO / "tests"), out=str(out), dump=dump))
    p = subprocess.run([sys.executable, str(script)], env=subprocess_env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]

    recs = read_journal(out / "items.jsonl")
    assert [r["key"] for r in recs] == ["a"] and artifact_intact(out, recs[0])
    want = {"videos/a.mp4", *(["videos/a.frames.npz"] if dump else [])}
    assert set(_files(out)) == want, "a file under a final name was not verified (or has no record)"
    temps = _temps(out)
    assert len(temps) == 1 and temps[0].startswith(".k.mp4.tmp"), temps
    # what the kill interrupted was the verification of a complete video: the temp file decodes to its frames
    _, frames = _decode(out / "videos" / temps[0])
    assert np.array_equal(frames, as_uint8(moving_square(2)))


def test_videos_carry_their_prompt_and_fields_and_the_folder_index_lists_them(video_engine, compose, tmp_path):
    """MP4 tags: ``title`` = the prompt, ``comment`` = JSON of the embedded fields; ``videos/metadata.jsonl`` (the
    videofolder convention) names each ok video with its prompt, seed, parameters, frame count and fps."""
    from runner.core.video import read_metadata

    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, {"a": "a red = square; #1 \\ ü", "b": "a blue square"})) == 0
    recs = _records(d)
    index = [json.loads(x) for x in (d / "videos" / "metadata.jsonl").read_text().splitlines()]
    assert [m["file_name"] for m in index] == [r["file_name"] for r in recs] == ["a.mp4", "b.mp4"]
    run_id = json.loads((d / "manifest.json").read_text())["run_id"]
    for r, m in zip(recs, index):
        tags = read_metadata(d / r["file"])
        assert tags["title"] == r["prompt"] == m["prompt"]
        fields = json.loads(tags["comment"])
        assert fields["prompt"] == r["prompt"] and int(fields["seed"]) == r["seed"] == m["seed"]
        assert r["params"] == m["parameters"]
        assert json.loads(fields["parameters"]) == {k: v for k, v in r["params"].items() if k != "batch_size"}
        assert (m["num_frames"], m["fps"], m["run_id"], m["file_sha256"]) == (NUM_FRAMES, FPS, run_id, r["file_sha256"])
    # the tags are functions of the inputs: a second run writes the same bytes
    assert _run(compose, tmp_path / "again", _rows(tmp_path, {"a": "a red = square; #1 \\ ü", "b": "a blue square"})) == 0
    assert _files(tmp_path / "again") == _files(d)


def test_frame_dump_holds_the_generated_frames(video_engine, compose, tmp_path):
    from runner.core.sinks import artifact_intact

    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, {"a": "one", "b": "two"}), ["output.video_frames=true"]) == 0
    recs = _records(d)
    for r in recs:
        assert r["frames_file"] == f"videos/{r['key']}.frames.npz"
        dump = d / r["frames_file"]
        assert r["frames_file_sha256"] == _sha(dump)
        with np.load(dump) as z:
            frames = z["frames"]
        assert frames.dtype == np.uint8 and np.array_equal(frames, _expected(r))
        assert hashlib.sha256(frames.tobytes()).hexdigest() == r["frames_sha256"]
    assert all(artifact_intact(d, r) for r in recs)  # MP4Sink.verify, resume
    (d / recs[0]["frames_file"]).write_bytes(b"not the frames")
    assert not artifact_intact(d, recs[0]) and artifact_intact(d, recs[1])
    # a resume regenerates the item whose dump no longer matches, reuses the other
    assert _run(compose, d, _rows(tmp_path, {"a": "one", "b": "two"}), ["output.video_frames=true"]) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"ok": 1, "failed": 0, "reused": 1}
    r = _records(d)[0]
    with np.load(d / r["frames_file"]) as z:
        assert np.array_equal(z["frames"], _expected(r))


def test_h264_codec_is_playable_yuv420p_and_records_the_hash_of_what_it_decodes_to(video_engine, compose, tmp_path):
    from runner.tools.report import psnr
    from runner.core.video import decode_mp4

    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, {"a": "one", "b": "two"}), ["output.video_codec=h264"]) == 0
    for r in _records(d):
        f = d / r["file"]
        meta, _ = _decode(f)
        assert meta["codec"] == "h264" and meta["pix_fmt"].startswith("yuv420p")
        assert r["video"] == {**r["video"], "codec": "h264", "encoder": "libx264", "pix_fmt": "yuv420p",
                              "lossless": False}
        frames = decode_mp4(f)
        want = _expected(r)
        assert frames.shape == want.shape
        assert not np.array_equal(frames, want)  # lossy ...
        assert min(psnr(a, b) for a, b in zip(frames, want)) > 30  # ... but close, frame by frame, in order
        assert r["frames_sha256"] == hashlib.sha256(frames.tobytes()).hexdigest()
        assert np.array_equal(decode_mp4(f), frames)  # decoding is deterministic


def test_sink_frame_rate_and_shape_rules(tmp_path):
    from runner.core.sinks import MP4Sink, read_journal

    sink = MP4Sink(tmp_path, workers=1)
    frames = moving_square(1)
    sink.submit({"key": "engine_fps", "params": {}}, VideoOutput(frames, fps=ENGINE_FPS))
    sink.submit({"key": "no_fps", "params": {}}, VideoOutput(frames))
    sink.submit({"key": "zero_fps", "params": {"fps": 0}}, VideoOutput(frames, fps=ENGINE_FPS))
    sink.submit({"key": "image", "params": {"fps": FPS}}, VideoOutput(frames[0]))
    sink.submit({"key": "gray", "params": {"fps": FPS}}, VideoOutput(frames[..., :1]))
    sink.close()
    by = {r["key"]: r for r in read_journal(tmp_path / "items.jsonl")}
    assert by["engine_fps"]["status"] == "ok" and by["engine_fps"]["fps"] == ENGINE_FPS
    assert _decode(tmp_path / by["engine_fps"]["file"])[0]["fps"] == ENGINE_FPS
    assert "no frame rate" in by["no_fps"]["reason"] and "fps=0" in by["zero_fps"]["reason"]
    assert "(frames, height, width, 3)" in by["image"]["reason"] and "(9, 48, 64, 1)" in by["gray"]["reason"]
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == ["engine_fps.mp4"]
    ok = by["engine_fps"]
    sink = MP4Sink(tmp_path)  # verify (resume's check): the exact file
    assert sink.verify(ok) and not sink.verify(by["no_fps"])
    f = tmp_path / ok["file"]
    f.write_bytes(f.read_bytes() + b"\0")
    assert not sink.verify(ok)
    sink.close()


# ------------------------------------------------------------------------------------------------ crash, resume
KILLING_FFMPEG = """#!/bin/sh
# the real ffmpeg; after the {kill_at}th MP4 encode (the video complete under its temp name, not yet renamed),
# SIGKILL the runner that started it
"{real}" "$@"
rc=$?
case " $* " in
  *" -f mp4 "*)
    n=$(cat "{counter}" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "{counter}"
    if [ "$n" = "{kill_at}" ]; then kill -9 $PPID; sleep 2; fi ;;
esac
exit $rc
"""

LAUNCHER = """import runpy, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from models.registry import register_engine
register_engine("moving_square", "test_video:MovingSquareEngine")
sys.argv = ["runner", *sys.argv[1:]]
runpy.run_module("runner", run_name="__main__", alter_sys=True)
"""


def test_sigkill_between_encode_and_rename_then_resume_equals_uninterrupted(video_engine, compose, tmp_path,
                                                                           subprocess_env):
    import imageio_ffmpeg

    data = _rows(tmp_path)
    ref = tmp_path / "ref"
    assert _run(compose, ref, data) == 0

    wrapper = tmp_path / "ffmpeg"
    wrapper.write_text(KILLING_FFMPEG.format(real=imageio_ffmpeg.get_ffmpeg_exe(), counter=tmp_path / "count",
                                             kill_at=3))
    wrapper.chmod(0o755)
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=str(REPO), tests=str(REPO / "tests")))
    d = tmp_path / "run"
    env = dict(subprocess_env, IMAGEIO_FFMPEG_EXE=str(wrapper))
    p = subprocess.run([sys.executable, str(launcher), "model=tiny_flux", *_ov(data, ["output.write_workers=0"]),
                        f"hydra.run.dir={d}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stdout[-2000:] + p.stderr[-3000:]

    # what the kill left: two journaled videos, complete; the third only under its temp name
    recs = _records(d)
    assert [r["key"] for r in recs] == ["a", "b"] and all(r["status"] == "ok" for r in recs)
    for r in recs:
        assert _sha(d / r["file"]) == r["file_sha256"]
        assert np.array_equal(_decode(d / r["file"])[1], _expected(r))
    assert set(_files(d)) == {r["file"] for r in recs}, "a video under its final name has no record"
    assert [n for n in _temps(d) if n.startswith(".c.mp4.tmp")], _temps(d)

    # the resume (in process, without the killing ffmpeg) reuses a and b and ends as the uninterrupted run
    assert _run(compose, d, data, ["output.write_workers=0"]) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"ok": 3, "failed": 0, "reused": 2} and m["status"] == "completed"
    assert _files(d) == _files(ref)  # same container bytes: the encoder is deterministic
    strip = lambda r: {k: v for k, v in r.items() if k not in ("timing", "inputs_sha256", "run_id")}  # noqa: E731
    assert [strip(r) for r in _records(d)] == [strip(r) for r in _records(ref)]
    # a and b were written by the killed attempt, the other three by the resume (items_by_attempt)
    first = m["resumed_from"]["attempts"][-1]["run_id"]
    assert [r["run_id"] for r in _records(d)] == [first] * 2 + [m["run_id"]] * 3 and first != m["run_id"]
    assert _temps(d) == []


def test_modified_video_fails_verify_and_is_regenerated_remux_too(video_engine, compose, tmp_path):
    import imageio_ffmpeg

    from runner.core.sinks import artifact_intact

    data = _rows(tmp_path, {"a": "one", "b": "two", "c": "three"})
    d = tmp_path / "run"
    assert _run(compose, d, data) == 0
    recs = {r["key"]: r for r in _records(d)}
    original = {k: (d / r["file"]).read_bytes() for k, r in recs.items()}
    assert all(artifact_intact(d, r) for r in recs.values())

    # a: one byte of the stream flipped; b: remuxed (same frames, other container bytes)
    fa = d / recs["a"]["file"]
    raw = bytearray(original["a"])
    raw[len(raw) // 2] ^= 0xFF
    fa.write_bytes(bytes(raw))
    fb = d / recs["b"]["file"]
    tmp = tmp_path / "remux.mp4"
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(fb), "-c", "copy",
                    "-metadata", "title=remuxed", str(tmp)], check=True)
    assert tmp.read_bytes() != original["b"] and np.array_equal(_decode(tmp)[1], _decode(fb)[1])
    tmp.replace(fb)
    assert not artifact_intact(d, recs["a"]) and not artifact_intact(d, recs["b"]) and artifact_intact(d, recs["c"])

    assert _run(compose, d, data) == 0
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"ok": 2, "failed": 0, "reused": 1}
    assert {k: (d / r["file"]).read_bytes() for k, r in recs.items()} == original


# ------------------------------------------------------------------------------------------------ report, repro
def test_report_shows_the_middle_frame_of_each_video_as_its_poster(video_engine, compose, tmp_path):
    from PIL import Image

    from runner.tools.report import write_report

    d = tmp_path / "run"
    assert _run(compose, d, _rows(tmp_path, {"a": "one", "b": "two", "c": "three"})) == 0
    html = write_report([d], d / "report.html").read_text()
    posters = re.findall(r'<img class="poster" alt="([^"]*)"[^>]*src="data:image/jpeg;base64,([^"]*)"', html)
    assert [alt.split(" ")[0] for alt, _ in posters] == ["a", "b", "c"]
    assert "frame 5 of 9" in html and "videos/s" in html and "Images and videos" in html
    for (_, b64), r in zip(posters, _records(d)):
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.float64)
        frames = _expected(r).astype(np.float64)
        err = [np.abs(img - f).mean() for f in frames]
        assert img.shape == (H, W, 3) and int(np.argmin(err)) == NUM_FRAMES // 2 and err[NUM_FRAMES // 2] < 4


def test_repro_compares_decoded_frames_not_container_bytes(video_engine, compose, tmp_path):
    import imageio_ffmpeg

    from runner.tools.repro import compare
    from runner.core.video import encode_mp4

    data = _rows(tmp_path, {"a": "one", "b": "two"})
    orig, new = tmp_path / "orig", tmp_path / "new"
    assert _run(compose, orig, data) == 0 and _run(compose, new, data) == 0
    res = compare(orig, new)
    assert res["ok"] and res["mode"] == "bytes", res["problems"]
    assert [(r["compared"], r["original_sha256"]) for r in res["items"]] == [
        ("frames", r["frames_sha256"]) for r in _records(orig)]

    # the re-run's container differs (remuxed), its frames do not: still reproduced
    recs = _records(new)
    f = new / recs[0]["file"]
    tmp = tmp_path / "remux.mp4"
    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(f), "-c", "copy", "-metadata",
                    "title=remuxed", str(tmp)], check=True)
    tmp.replace(f)
    recs[0]["file_sha256"] = _sha(f)
    (new / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = compare(orig, new)
    assert res["ok"], res["problems"]

    # frames in another order: the same bytes per frame, so only a frame-by-frame comparison sees it
    frames = _expected(recs[1])
    encode_mp4(new / recs[1]["file"], frames[[0, 2, 1, *range(3, NUM_FRAMES)]], FPS)
    res = compare(orig, new)
    assert not res["ok"] and res["problems"] == ["item 'b': decoded frames differ (frames_sha256)"]
    psnr_mode = compare(orig, new, exact=False)
    row = next(r for r in psnr_mode["items"] if r["key"] == "b")
    assert not psnr_mode["ok"] and 0 < row["psnr_db"] < 40 and row["max_abs_diff"] > 100


# ------------------------------------------------------------------------------------------------ refusals
def test_resume_with_another_codec_is_refused_naming_the_key(video_engine, compose, tmp_path):
    from runner.core.resume import ResumeConflictError

    data = _rows(tmp_path, {"a": "one"})
    d = tmp_path / "run"
    assert _run(compose, d, data) == 0
    with pytest.raises(ResumeConflictError, match=r"output.video_codec: 'h264_lossless' -> 'h264'"):
        _run(compose, d, data, ["output.video_codec=h264"])


def test_missing_encoder_is_refused_before_the_model_loads(video_engine, compose, tmp_path, monkeypatch):
    from runner.core.environment import EnvironmentVariableError, check_environment
    from runner.core.video import VideoEncoderError

    fake = tmp_path / "ffmpeg"  # runs, but has no H.264 encoder
    fake.write_text("#!/bin/sh\necho 'ffmpeg version 0.0-fake Copyright'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(fake))
    d = tmp_path / "run"
    with pytest.raises(VideoEncoderError, match=r"has no libx264rgb encoder.*fix: unset IMAGEIO_FFMPEG_EXE") as e:
        _run(compose, d, _rows(tmp_path, {"a": "one"}))
    assert e.value.exit_code == 2
    assert "load" not in video_engine.events and not (d / "videos").exists()
    with pytest.raises(EnvironmentVariableError, match="IMAGEIO_FFMPEG_EXE"):
        check_environment({"IMAGEIO_FFMPEG_EXE": str(tmp_path / "nope")})
