"""Procedural captioned clips: one coloured shape moving across a white background.

Vocabulary: colours and shapes of ``models.toy_shapes.data`` (``COLORS``; ``SHAPES``: circle, square, triangle) and
directions (``DIRECTIONS``: left to right, right to left, top to bottom, bottom to top). Caption template:
``"a {color} {shape} moving from {direction} on a white background"``. Clips are ``(num_frames, size, size, 3)``
RGB uint8 drawn with PIL: the shape's centre moves linearly from about a quarter to about three quarters of the
side along the direction's axis, at about the middle of the other axis. Size, path ends and the cross-axis offset
jitter by a seeded generator, so a seed gives the same clips on every machine.
"""

from __future__ import annotations

import itertools
import random
from typing import Dict, Iterator, List, Tuple

import numpy as np

from models.toy_shapes.data import COLORS, SHAPES

#: direction -> (axis, sign): axis 0 is x (left to right is +), axis 1 is y (top to bottom is +, image rows)
DIRECTIONS: Dict[str, Tuple[int, int]] = {
    "left to right": (0, 1), "right to left": (0, -1), "top to bottom": (1, 1), "bottom to top": (1, -1),
}
NUM_FRAMES = 9  # 4k+1 (Wan's VAE compresses time by 4, keeping the first frame)
SIZE = 64       # a multiple of 16 (VAE factor 8 x patch 2)
SCALE = 0.3     # shape width as a fraction of the side
START, END = 0.25, 0.75  # path ends along the axis, as fractions of the side

__all__ = ["COLORS", "SHAPES", "DIRECTIONS", "caption", "captions", "combos", "draw_frame", "draw", "samples"]


def caption(color: str, shape: str, direction: str) -> str:
    """The caption of a clip: ``a blue square moving from left to right on a white background``."""
    return f"a {color} {shape} moving from {direction} on a white background"


def combos() -> List[Tuple[str, str, str]]:
    """Every (colour, shape, direction), in a fixed order."""
    return list(itertools.product(COLORS, SHAPES, DIRECTIONS))


def captions() -> List[str]:
    """Every caption (the tokenizer corpus), in :func:`combos` order."""
    return [caption(*c) for c in combos()]


def draw_frame(color: str, shape: str, cx: float, cy: float, size: int = SIZE, scale: float = SCALE) -> np.ndarray:
    """One frame, ``(size, size, 3)`` uint8: the shape centred at pixel ``(cx, cy)`` (the shapes of toy_shapes)."""
    from models.toy_shapes.data import draw_at

    return draw_at(color, shape, cx, cy, size, scale)


def draw(color: str, shape: str, direction: str, num_frames: int = NUM_FRAMES, size: int = SIZE,
         scale: float = SCALE, start: float = START, end: float = END, cross: float = 0.5) -> np.ndarray:
    """One clip, ``(num_frames, size, size, 3)`` uint8: the centre moves linearly along the direction's axis from
    ``start`` to ``end`` (fractions of the side, in the direction's sense), at ``cross`` on the other axis."""
    axis, sign = DIRECTIONS[direction]
    frames = []
    for i in range(num_frames):
        u = i / max(1, num_frames - 1)
        along = start + (end - start) * u
        along = along if sign > 0 else 1.0 - along
        x, y = (along, cross) if axis == 0 else (cross, along)
        frames.append(draw_frame(color, shape, x * size, y * size, size, scale))
    return np.stack(frames)


def samples(n: int, seed: int = 0, num_frames: int = NUM_FRAMES, size: int = SIZE
            ) -> Iterator[Tuple[np.ndarray, str, Dict[str, str]]]:
    """``n`` random ``(clip, caption, attributes)``, deterministic for ``seed``: size +-20 %, path ends +-0.05,
    cross-axis position 0.5 +-0.1."""
    rng = random.Random(seed)
    all_c = combos()
    for _ in range(n):
        c, s, d = all_c[rng.randrange(len(all_c))]
        clip = draw(c, s, d, num_frames, size, scale=SCALE * rng.uniform(0.8, 1.2),
                    start=START + rng.uniform(-0.05, 0.05), end=END + rng.uniform(-0.05, 0.05),
                    cross=0.5 + rng.uniform(-0.1, 0.1))
        yield clip, caption(c, s, d), {"color": c, "shape": s, "direction": d}
