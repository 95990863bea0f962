"""``runner.core.artifacts`` rule by rule (issue #42, mutation tests): the uint8 rounding of a float image, the PNG of
a gray and of an RGB image, the partial last line a killed run leaves in a journal, the temp file ``replace_file``
writes through, and the writer's back-pressure, threads and timers. Expectations are computed by hand.
"""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from PIL import Image

from runner.core.artifacts import ArtifactWriter, Journal, encode_png, replace_file, to_uint8

pytestmark = pytest.mark.cpu


# ------------------------------------------------------------------------------------------------ to_uint8


def test_to_uint8_clips_to_0_1_then_scales_by_255_and_rounds():
    img = np.array([[[-0.5, 0.0, 0.5], [1.0, 1.5, 0.2]]], dtype=np.float32)  # 1x2x3
    # -0.5 -> 0 (clipped, not wrapped), 0.5*255 = 127.5 -> 128, 1.0 -> 255, 1.5 -> 255 (clipped), 0.2*255 = 51
    assert to_uint8(img).tolist() == [[[0, 0, 128], [255, 255, 51]]]
    assert to_uint8(img).dtype == np.uint8


# ------------------------------------------------------------------------------------------------ encode_png


def _decode(data: bytes) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    return im


def test_a_one_channel_image_is_a_gray_png_of_its_pixels():
    img = np.array([[0.0, 1.0, 0.2], [0.5, 0.0, 1.0]], dtype=np.float32)[..., None]  # 2x3x1: H != W != 1
    im = _decode(encode_png(img))
    assert im.mode == "L" and im.size == (3, 2)
    assert np.asarray(im).tolist() == [[0, 255, 51], [128, 0, 255]]


def test_a_three_channel_image_is_an_rgb_png_of_its_pixels():
    img = np.zeros((3, 1, 3), dtype=np.float32)  # width 1: a shape[1] == 1 must not make it gray
    img[0, 0] = (1.0, 0.0, 0.2)
    img[2, 0] = (0.0, 1.0, 0.5)
    im = _decode(encode_png(img))
    assert im.mode == "RGB" and im.size == (1, 3)
    assert np.asarray(im).tolist() == [[[255, 0, 51]], [[0, 0, 0]], [[0, 255, 128]]]


def test_text_chunks_are_embedded_and_no_text_gives_none():
    img = np.full((2, 2, 3), 0.25, dtype=np.float32)
    plain = _decode(encode_png(img))
    assert "prompt" not in plain.info
    both = _decode(encode_png(img, {"prompt": "a fox", "seed": "7"}))
    assert (both.info["prompt"], both.info["seed"]) == ("a fox", "7")
    assert encode_png(img, {}) == encode_png(img)  # empty text: no chunk


# ------------------------------------------------------------------------------------------------ Journal


@pytest.mark.parametrize("content,kept", [
    (b'{"i": 1}\n{', b'{"i": 1}\n'),  # one stray byte after the last newline (the byte before it is the newline)
    (b'{}\n{"i', b'{}\n'),  # the file's third byte is a newline, its last is not
    (b'{"i": 1}\n{"i": 2}\n', b'{"i": 1}\n{"i": 2}\n'),  # complete: kept as is
])
def test_a_journal_opened_on_a_partial_last_line_cuts_it_off(tmp_path, content, kept):
    p = tmp_path / "items.jsonl"
    p.write_bytes(content)
    j = Journal(p)
    assert p.read_bytes() == kept
    j.append({"i": 3})
    j.close()
    lines = p.read_text().splitlines()
    assert [json.loads(ln) for ln in lines][-1] == {"i": 3}  # every line parses: the new record starts on its own


def test_a_journal_keeps_the_field_order_of_a_record(tmp_path):
    j = Journal(tmp_path / "items.jsonl")
    j.append({"z": 1, "a": 2})
    j.close()
    assert (tmp_path / "items.jsonl").read_text() == '{"z": 1, "a": 2}\n'


# ------------------------------------------------------------------------------------------------ replace_file


def test_replace_file_writes_through_the_given_temp_file(tmp_path):
    p = tmp_path / "state.json"
    p.write_bytes(b"old")
    replace_file(p, b"new", tmp=tmp_path / "t.tmp")
    assert p.read_bytes() == b"new" and not (tmp_path / "t.tmp").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["state.json"]
    # a temp file that cannot be created: the OSError reaches the caller and the old file is left as it was
    with pytest.raises(FileNotFoundError):
        replace_file(p, b"newer", tmp=tmp_path / "no-such-dir" / "t.tmp")
    assert p.read_bytes() == b"new"


# ------------------------------------------------------------------------------------------------ ArtifactWriter


class BlockingWrite:
    """A ``write`` of :class:`ArtifactWriter` that waits for ``go`` and counts the writes running at once."""

    def __init__(self, hold: float = 0.0):
        self.go = threading.Event()
        self.hold = hold
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0
        self.threads: List[str] = []

    def __call__(self, path: Path, payload: Any) -> Dict[str, Any]:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.threads.append(threading.current_thread().name)
        try:
            self.go.wait(10)
            time.sleep(self.hold)
            path.write_bytes(payload)
            return {"sha256": "0" * 64}
        finally:
            with self.lock:
                self.active -= 1


def _records(p: Path) -> List[Dict[str, Any]]:
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def test_the_default_back_pressure_is_16_pending_submissions(tmp_path):
    j = Journal(tmp_path / "items.jsonl")
    write = BlockingWrite()
    w = ArtifactWriter(j, workers=1, on_record=lambda r: None, write=write)  # max_pending left at its default
    for i in range(16):
        w.submit({"i": i}, path=tmp_path / f"{i}.bin", image=b"x", rel=f"{i}.bin")
    assert _records(tmp_path / "items.jsonl") == []  # 16 pending: submit did not wait
    timer = threading.Timer(0.3, write.go.set)
    timer.start()
    w.submit({"i": 16}, path=tmp_path / "16.bin", image=b"x", rel="16.bin")  # the 17th: waits for all of them
    assert [r["i"] for r in _records(tmp_path / "items.jsonl")] == list(range(17))
    assert w.wait_s > 0.1
    w.close()
    j.close()


def test_workers_bound_the_writes_at_once_and_run_on_named_threads(tmp_path):
    j = Journal(tmp_path / "items.jsonl")
    write = BlockingWrite(hold=0.05)
    write.go.set()
    w = ArtifactWriter(j, workers=1, on_record=lambda r: None, write=write)
    for i in range(4):
        w.submit({"i": i}, path=tmp_path / f"{i}.bin", image=b"x", rel=f"{i}.bin")
    w.close()
    j.close()
    assert write.most == 1  # workers=1: one write at a time
    assert len(write.threads) == 4 and all(n.startswith("runner-write") for n in write.threads), write.threads
    assert not [t for t in threading.enumerate() if t.name.startswith("runner-write")]  # close stopped them


def test_inline_writes_run_in_the_callers_thread_and_wait_for_nothing(tmp_path):
    j = Journal(tmp_path / "items.jsonl")
    write = BlockingWrite()
    write.go.set()
    seen: List[Dict[str, Any]] = []
    w = ArtifactWriter(j, workers=0, on_record=seen.append, write=write)
    w.submit({"i": 0}, path=tmp_path / "0.bin", image=b"x", rel="0.bin")
    assert [r["status"] for r in seen] == ["ok"]  # journaled before submit returned
    w.close()
    j.close()
    assert write.threads == [threading.current_thread().name]
    assert w.wait_s == 0.0
    assert w.thread_s > 0.0
