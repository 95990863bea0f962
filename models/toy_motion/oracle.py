"""Deterministic reader of toy_motion clips: which colour and shape the moving shape has and where it goes.

Input: frames ``(F, H, W, 3)`` (uint8, or float in [0, 1]). Foreground = pixels farther than ``FG_DIST`` (RGB
Euclidean, 0-255 scale) from white, per frame. Colour = the palette colour nearest to the median of every
foreground pixel of the clip. Shape = by the median over frames of the foreground's fill ratio inside its bounding
box (square 1.0, circle pi/4 = 0.785, triangle 0.5; thresholds 0.64 and 0.89, as ``models.toy_shapes.oracle``).
Direction = from the foreground centroid's trajectory: the mean centroid of the last third of the frames minus that
of the first third; the larger axis and its sign decide; a displacement under ``MIN_MOVE`` of the side reads None
(no motion).
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

import numpy as np

from models.toy_motion.data import COLORS, DIRECTIONS, SHAPES

FG_DIST = 80.0
MIN_MOVE = 0.08  # the drawn clips move ~0.5 of the side
ATTRS = ("color", "shape", "direction")
NONE = {k: None for k in ATTRS}


def read(frames: np.ndarray) -> Dict[str, Optional[str]]:
    """Attributes of a clip ``(F, H, W, 3)``. Values are None when no frame has a foreground (direction: also when
    the shape does not move)."""
    v = np.asarray(frames, dtype=np.float32)
    if v.ndim == 3:
        v = v[None]
    if v.max() <= 1.0:
        v = v * 255.0
    fg = np.linalg.norm(255.0 - v, axis=-1) > FG_DIST  # (F, H, W)
    counts = fg.reshape(len(fg), -1).sum(1)
    seen = [i for i in range(len(fg)) if counts[i] >= 4]
    if not seen:
        return dict(NONE)
    med = np.median(v[fg], axis=0)
    color = min(COLORS, key=lambda c: float(np.linalg.norm(med - np.array(COLORS[c], dtype=np.float32))))
    fills, cents = [], {}
    h, w = fg.shape[1:]
    for i in seen:
        ys, xs = np.nonzero(fg[i])
        fills.append(counts[i] / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)))
        cents[i] = (xs.mean() / w, ys.mean() / h)
    fill = float(np.median(fills))
    shape = "square" if fill > 0.89 else ("circle" if fill > 0.64 else "triangle")
    k = max(1, len(fg) // 3)
    first = [cents[i] for i in seen if i < k]
    last = [cents[i] for i in seen if i >= len(fg) - k]
    direction = None
    if first and last:
        dx = np.mean([c[0] for c in last]) - np.mean([c[0] for c in first])
        dy = np.mean([c[1] for c in last]) - np.mean([c[1] for c in first])
        if max(abs(dx), abs(dy)) >= MIN_MOVE:
            axis, sign = (0, np.sign(dx)) if abs(dx) >= abs(dy) else (1, np.sign(dy))
            direction = next(d for d, (a, s) in DIRECTIONS.items() if a == axis and s == sign)
    return {"color": color, "shape": shape, "direction": direction}


def accuracy(pairs: Iterable[tuple]) -> Dict[str, float]:
    """Share of matches per attribute (colour, shape, direction) over ``(read_result, expected)`` pairs, plus
    ``all`` and ``n`` (``models.toy_shapes.oracle.accuracy`` over :data:`ATTRS`)."""
    from models.toy_shapes.oracle import accuracy as shared

    return shared(pairs, ATTRS)


def check_expectations(rows: Iterable, path: object) -> None:
    """``expect`` of every row names attributes this oracle reads (``color``, ``shape``, ``direction``) with values
    it can return; a typo would otherwise count as a miss (or as not stated) in ``accuracy``.

    Raises:
        runner.core.dataset.DatasetError: naming the file and line, the key or value, the valid ones and the closest
            match.
    """
    from models.toy_shapes.oracle import check_vocabulary

    check_vocabulary(rows, path, {"color": list(COLORS), "shape": list(SHAPES), "direction": list(DIRECTIONS)},
                     "toy_motion")


def read_video(path: object) -> np.ndarray:
    """The frames of a video file as uint8 ``(F, H, W, 3)``: ``runner.core.video.decode_mp4`` where the runner has it
    (the MP4 sink's own decoder), else imageio-ffmpeg's reader (its bundled ffmpeg, RGB24)."""
    from pathlib import Path

    try:
        from runner.core.video import decode_mp4
    except ImportError:
        decode_mp4 = None
    if decode_mp4 is not None:
        return np.asarray(decode_mp4(Path(path)), dtype=np.uint8)
    import imageio_ffmpeg

    gen = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    meta = next(gen)
    w, h = meta["size"]
    frames = [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in gen]
    return np.stack(frames) if frames else np.zeros((0, h, w, 3), np.uint8)


def accuracy_section(items: Iterable, records: Dict[str, dict], out_dir: object) -> Dict[str, object]:
    """The manifest's ``accuracy``: every item with ``expect`` read back from its video file on disk (``records``:
    the run's journal records by item key); failed or missing items count as misses (figures: :func:`section`)."""
    from pathlib import Path

    got, expect = {}, {}
    for it in items:
        if not it.row.expect:
            continue
        rec = records.get(it.key)
        got[it.key] = (dict(NONE) if not rec or rec.get("status") != "ok"
                       else read(read_video(Path(out_dir) / rec["file"])))
        expect[it.key] = dict(it.row.expect)
    return section(got, expect)


def section(got: Dict[str, dict], expect: Dict[str, dict], prompt: Optional[Dict[str, str]] = None
            ) -> Dict[str, object]:
    """The ``accuracy`` section from its per-item entries (``models.toy_shapes.oracle.section`` over :data:`ATTRS`)."""
    from models.toy_shapes.oracle import section as shared

    return shared(got, expect, oracle="toy_motion", attrs=ATTRS)
