"""Deterministic reader of toy_shapes images: which colour, shape and position the dominant shape has.

Foreground = pixels farther than ``FG_DIST`` (RGB Euclidean, 0-255 scale) from white. Colour = the palette
colour nearest to the foreground's median. Position = the region of ``data.POSITIONS`` nearest to the
foreground's centroid. Shape = by fill ratio of the foreground inside its bounding box (square 1.0, circle
pi/4 = 0.785, triangle 0.5): thresholds halfway between, 0.64 and 0.89.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional

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


def accuracy(pairs: Iterable[tuple]) -> Dict[str, float]:
    """Share of matches per attribute over ``(read_result, expected)`` pairs (each attribute over the rows that
    state it; None when none does), plus ``all`` (every stated attribute right, over all rows) and ``n``."""
    pairs = list(pairs)
    n = len(pairs)
    out: Dict[str, float] = {"n": n}
    if not n:
        return out
    for key in ("color", "shape", "position"):
        stated = [(got, exp) for got, exp in pairs if key in exp]  # rows that state this attribute
        out[key] = sum(got.get(key) == exp[key] for got, exp in stated) / len(stated) if stated else None
    out["all"] = sum(all(got.get(k) == v for k, v in exp.items()) for got, exp in pairs) / n
    return out
