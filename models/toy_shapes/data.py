"""Procedural captioned images: one coloured shape on a white background.

Vocabulary: colours (``COLORS``), shapes (``SHAPES``: circle, square, triangle) and positions (``POSITIONS``:
the four quadrants and the centre). Caption template: ``"a {color} {shape} in the {position} on a white
background"``. Images are ``size`` x ``size`` RGB uint8, drawn with PIL; the shape's size jitters by a seeded
generator, so a seed gives the same images on every machine.
"""

from __future__ import annotations

import itertools
import random
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

COLORS: Dict[str, Tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS: Dict[str, Tuple[float, float]] = {  # centre as a fraction of the image side (x, y)
    "top left": (0.27, 0.27), "top right": (0.73, 0.27), "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73), "center": (0.5, 0.5),
}


def caption(color: str, shape: str, position: str) -> str:
    """The caption of an image: ``a red circle in the top left on a white background``."""
    return f"a {color} {shape} in the {position} on a white background"


def draw(color: str, shape: str, position: str, size: int = 64, scale: float = 0.36) -> np.ndarray:
    """Render one image, ``(size, size, 3)`` uint8. ``scale``: shape width as a fraction of the side."""
    return draw_at(color, shape, POSITIONS[position][0] * size, POSITIONS[position][1] * size, size, scale)


def draw_at(color: str, shape: str, cx: float, cy: float, size: int = 64, scale: float = 0.36,
            width: Optional[int] = None) -> np.ndarray:
    """One ``(size, width or size, 3)`` uint8 image (``size``: the height): the shape centred at pixel ``(cx, cy)``
    on white, ``scale`` x the height wide (also the frames of ``models.toy_motion``)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width or size, size), (255, 255, 255))
    d = ImageDraw.Draw(img)
    r = scale * size / 2
    box = (cx - r, cy - r, cx + r, cy + r)
    fill = COLORS[color]
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "square":
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return np.asarray(img)


def combos() -> List[Tuple[str, str, str]]:
    """Every (colour, shape, position), in a fixed order."""
    return list(itertools.product(COLORS, SHAPES, POSITIONS))


def samples(n: int, seed: int = 0, size: int = 64) -> Iterator[Tuple[np.ndarray, str, Dict[str, str]]]:
    """``n`` random ``(image, caption, attributes)`` with a size jitter of +-20 %, deterministic for ``seed``."""
    rng = random.Random(seed)
    all_c = combos()
    for _ in range(n):
        c, s, p = all_c[rng.randrange(len(all_c))]
        yield draw(c, s, p, size, scale=0.36 * rng.uniform(0.8, 1.2)), caption(c, s, p), {
            "color": c, "shape": s, "position": p}


#: The input images and masks of the builtin image_to_image / inpaint rows (``runner/data/shapes.<task>.jsonl``),
#: shipped as PNGs beside them (``runner/data/<name>.png``) and reproduced by :func:`conditioning_inputs`.
INPUT_SHAPES = {"shapes_input_red_circle_top_left": ("red", "circle", "top left"),
                "shapes_input_green_triangle_bottom_left": ("green", "triangle", "bottom left"),
                "shapes_input_blue_square_top_right": ("blue", "square", "top right")}
#: Mask quadrants of the builtin inpaint rows: name -> (x0, y0) of the 32x32 quadrant of a 64x64 image.
MASK_QUADRANTS = {"shapes_mask_bottom_right": (32, 32), "shapes_mask_top_right": (32, 0),
                  "shapes_mask_bottom_left": (0, 32)}


def quadrant_mask(x0: int, y0: int, size: int = 64) -> np.ndarray:
    """A ``(size, size)`` uint8 mask (mode ``L``): 255 (repaint) over the quadrant at ``(x0, y0)``, 0 elsewhere."""
    m = np.zeros((size, size), np.uint8)
    m[y0:y0 + size // 2, x0:x0 + size // 2] = 255
    return m


def conditioning_inputs(size: int = 64) -> Dict[str, np.ndarray]:
    """``{file stem: array}`` of the builtin conditioning inputs: the drawn shapes (RGB) and the quadrant masks
    (L); ``tests/test_conditioning.py`` checks the shipped PNGs are exactly these."""
    out = {name: draw(*attrs, size=size) for name, attrs in INPUT_SHAPES.items()}
    out.update({name: quadrant_mask(x, y, size) for name, (x, y) in MASK_QUADRANTS.items()})
    return out


#: The first frames of the builtin image_to_video rows of the full-size Wan 2.1 I2V (``conf/model/wan_i2v.yaml``:
#: ``builtin_prompts: wan480.jsonl``), at its 832x480 (the runner never resizes an input: the 32x32 frames of the tiny
#: model's rows were refused there): name -> (colour, shape, position).
WAN480_INPUTS = {"shapes832x480_input_red_circle_top_left": ("red", "circle", "top left"),
                 "shapes832x480_input_green_triangle_bottom_left": ("green", "triangle", "bottom left")}


def wan480_inputs(width: int = 832, height: int = 480) -> Dict[str, np.ndarray]:
    """``{file stem: (height, width, 3) uint8}`` of :data:`WAN480_INPUTS` (positions as fractions of each side)."""
    return {name: draw_at(c, s, POSITIONS[p][0] * width, POSITIONS[p][1] * height, height, width=width)
            for name, (c, s, p) in WAN480_INPUTS.items()}


def write_conditioning_inputs(folder: str) -> None:
    """Write :func:`conditioning_inputs` as ``<folder>/<stem>.png`` (how ``runner/data``'s were made)."""
    from pathlib import Path

    from PIL import Image

    for name, a in {**conditioning_inputs(), **wan480_inputs()}.items():
        Image.fromarray(a).save(Path(folder) / f"{name}.png")
