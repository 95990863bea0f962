"""Deterministic reader of toy_shapes images: which colour, shape and position the dominant shape has.

Foreground = pixels farther than ``FG_DIST`` (RGB Euclidean, 0-255 scale) from white. Colour = the palette
colour nearest to the foreground's median. Position = the region of ``data.POSITIONS`` nearest to the
foreground's centroid. Shape = by fill ratio of the foreground inside its bounding box (square 1.0, circle
pi/4 = 0.785, triangle 0.5): thresholds halfway between, 0.64 and 0.89.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Sequence

import numpy as np

from models.toy_shapes.data import COLORS, POSITIONS

FG_DIST = 80.0


def read(image: np.ndarray) -> Dict[str, Optional[str]]:
    """Attributes of an ``(H, W, 3)`` image (uint8, or float in [0, 1]). Values are None when no foreground."""
    img = np.asarray(image, dtype=np.float32)
    if img.max() <= 1.0:
        img = img * 255.0
    dist = np.linalg.norm(255.0 - img, axis=-1)
    fg = dist > FG_DIST
    if fg.sum() < 4:
        return {"color": None, "shape": None, "position": None}
    px = img[fg]
    med = np.median(px, axis=0)
    color = min(COLORS, key=lambda c: float(np.linalg.norm(med - np.array(COLORS[c], dtype=np.float32))))
    ys, xs = np.nonzero(fg)
    h, w = fg.shape
    cx, cy = xs.mean() / w, ys.mean() / h
    position = min(POSITIONS, key=lambda p: (POSITIONS[p][0] - cx) ** 2 + (POSITIONS[p][1] - cy) ** 2)
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = fg.sum() / box
    shape = "square" if fill > 0.89 else ("circle" if fill > 0.64 else "triangle")
    return {"color": color, "shape": shape, "position": position}


def accuracy(pairs: Iterable[tuple], attrs: Iterable[str] = ("color", "shape", "position")) -> Dict[str, float]:
    """Share of matches per attribute of ``attrs`` over ``(read_result, expected)`` pairs (each attribute over the
    rows that state it; None when none does), plus ``all`` (every stated attribute right, over all rows) and ``n``.
    Shared by the toy oracles (``models.toy_motion.oracle`` reads ``direction`` instead of ``position``)."""
    pairs = list(pairs)
    n = len(pairs)
    out: Dict[str, float] = {"n": n}
    if not n:
        return out
    for key in attrs:
        stated = [(got, exp) for got, exp in pairs if key in exp]  # rows that state this attribute
        out[key] = sum(got.get(key) == exp[key] for got, exp in stated) / len(stated) if stated else None
    out["all"] = sum(all(got.get(k) == v for k, v in exp.items()) for got, exp in pairs) / n
    return out


def check_expectations(rows: Iterable, path: object) -> None:
    """``expect`` of every row names attributes this oracle reads (``color``, ``shape``, ``position``) with values
    it can return; a typo would otherwise count as a miss (or as not stated) in ``accuracy``.

    Raises:
        runner.core.dataset.DatasetError: naming the file and line, the key or value, the valid ones and the closest
            match.
    """
    from models.toy_shapes.data import SHAPES

    check_vocabulary(rows, path, {"color": list(COLORS), "shape": list(SHAPES), "position": list(POSITIONS)},
                     "toy_shapes")


def check_vocabulary(rows: Iterable, path: object, valid: Dict[str, list], oracle: str) -> None:
    """Every row's ``expect`` keys among ``valid`` and each value among ``valid[key]`` (the toy oracles' check).

    Raises:
        runner.core.dataset.DatasetError: one problem per bad key or value, with file:line, the valid ones and the
            closest match.
    """
    import difflib

    from runner.core.dataset import DatasetError

    problems = []
    for r in rows:
        for key, value in (r.expect or {}).items():
            if key not in valid:
                close = difflib.get_close_matches(key, list(valid), n=1)
                problems.append(f"{path}:{r.line}: expect.{key} is not an attribute the {oracle} oracle reads; "
                                f"valid: {', '.join(valid)}" + (f"; fix: expect.{close[0]}" if close else ""))
            elif value not in valid[key]:
                close = difflib.get_close_matches(str(value), valid[key], n=1)
                problems.append(f"{path}:{r.line}: expect.{key}={value!r} is not a value the oracle returns; valid: "
                                f"{', '.join(valid[key])}" + (f"; fix: {close[0]!r}" if close else ""))
    if problems:
        raise DatasetError(problems)


def inside_mask(image: np.ndarray, row: object) -> np.ndarray:
    """An inpainted item's image with everything outside its mask made white (``runner.core.media.mask_inside``: the
    pipeline's binarisation), so the oracle reads what the prompt asked for inside the mask, not the kept input; other
    items unchanged."""
    inputs = getattr(row, "inputs", None) or {}
    if "mask_image" not in inputs:
        return image
    from runner.core import media

    inside = media.mask_inside(media.load_input(inputs["mask_image"], getattr(row, "mask_image", None)))
    return np.where(inside[..., None], image, np.uint8(255)).astype(np.uint8)


def accuracy_section(items: Iterable, records: Dict[str, dict], out_dir: object) -> Dict[str, object]:
    """The manifest's ``accuracy``: every item with ``expect`` read back from its file on disk (``records``: the
    run's journal records by item key; an inpainted item inside its mask, :func:`inside_mask`); failed or missing
    items count as misses. The figures come from :func:`section` of the per-item entries, as a merge's do."""
    from pathlib import Path

    from PIL import Image

    got, expect = {}, {}
    for it in items:
        if not it.row.expect:
            continue
        rec = records.get(it.key)
        got[it.key] = ({"color": None, "shape": None, "position": None} if not rec or rec.get("status") != "ok"
                       else read(inside_mask(np.asarray(Image.open(Path(out_dir) / rec["file"]).convert("RGB")),
                                             it.row)))
        expect[it.key] = dict(it.row.expect)
    return section(got, expect)


def section(got: Dict[str, Dict[str, Any]], expect: Dict[str, Dict[str, Any]], prompt: Optional[Dict[str, str]] = None,
            oracle: str = "toy_shapes", attrs: Sequence[str] = ("color", "shape", "position")) -> Dict[str, Any]:
    """The ``accuracy`` section from its per-item entries (item key -> what the oracle read, ``got``, and the
    expectation it is scored against, ``expect``; same keys): :func:`accuracy` over them, plus the entries under
    ``read`` and ``expect``, so that a data-parallel merge recomputes the run's section from the workers' sections
    (``models.oracles.merged_section``). ``prompt`` is unused (the toy_edit oracle's ``section`` reads it)."""
    keys = list(expect)
    return {"oracle": oracle, **accuracy(((got[k], expect[k]) for k in keys), attrs),
            "read": {k: got[k] for k in keys}, "expect": {k: expect[k] for k in keys}}
