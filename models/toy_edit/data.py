"""Editing pairs over the toy_shapes vocabulary: an input image, an instruction that changes ONE attribute, and the
target image that keeps the other two.

Instructions (``instruction``): ``"make it {color}"``, ``"make it a {shape}"``, ``"move it to the {position}"``. The
instruction never names the kept attributes: only the input image carries them, so an output that keeps them proves
the model read its input. Every edit changes its attribute (the new value differs from the input's). Images come
from ``models.toy_shapes.data.draw``; input and target of a pair share the shape's size (``scale``).

Builtin rows (``builtin_rows``): 60 edits, 20 per attribute, drawn at a fixed size (``scale`` 0.36, toy_shapes'
default), each ``{"id", "prompt", "image", "expect"}`` with ``expect`` the target's three attributes; the input images
are shipped beside ``builtin/edits.jsonl`` (``write_builtin`` regenerates them; a test checks they equal fresh
draws). ``swapped_rows`` is the control: each row keeps its instruction and ``expect`` but gets the input image of a
row whose input differs in every attribute, so the kept attributes must fail.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from models.toy_shapes.data import COLORS, POSITIONS, SHAPES, combos, draw

ATTRS = ("color", "shape", "position")
VALUES: Dict[str, Tuple[str, ...]] = {"color": tuple(COLORS), "shape": tuple(SHAPES), "position": tuple(POSITIONS)}
TEMPLATES = {"color": "make it {}", "shape": "make it a {}", "position": "move it to the {}"}
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_SEED = 30  # issue 30
SCALE = 0.36  # toy_shapes' default shape width (fraction of the side)

Attrs = Dict[str, str]


def instruction(attr: str, value: str) -> str:
    """The instruction that sets ``attr`` to ``value``: ``make it blue``, ``make it a square``, ``move it to the
    bottom right``."""
    if value not in VALUES[attr]:
        raise ValueError(f"{attr}={value!r} is not in the vocabulary {VALUES[attr]}")
    return TEMPLATES[attr].format(value)


def instructions() -> List[str]:
    """Every instruction, in a fixed order (12: 4 colours, 3 shapes, 5 positions)."""
    return [instruction(a, v) for a in ATTRS for v in VALUES[a]]


def parse(prompt: str) -> Tuple[str, str]:
    """``(attribute, value)`` of an instruction (the inverse of ``instruction``).

    Raises:
        ValueError: the prompt is not one of ``instructions()``.
    """
    for a in ATTRS:
        for v in VALUES[a]:
            if prompt.strip() == TEMPLATES[a].format(v):
                return a, v
    raise ValueError(f"{prompt!r} is not a toy_edit instruction; valid: {', '.join(instructions())}")


def apply(src: Attrs, attr: str, value: str) -> Attrs:
    """The target's attributes: ``src`` with ``attr`` set to ``value``."""
    return {**src, attr: value}


def edits() -> List[Tuple[Attrs, str, str]]:
    """Every ``(input attributes, attribute, new value)`` whose new value differs from the input's, in a fixed order
    (60 inputs x (3 colours + 2 shapes + 4 positions) = 540)."""
    out = []
    for c, s, p in combos():
        src = {"color": c, "shape": s, "position": p}
        out += [(src, a, v) for a in ATTRS for v in VALUES[a] if v != src[a]]
    return out


def render(attrs: Attrs, size: int = 64, scale: float = SCALE) -> np.ndarray:
    """The ``(size, size, 3)`` uint8 image of ``attrs``."""
    return draw(attrs["color"], attrs["shape"], attrs["position"], size, scale)


def pairs(n: int, seed: int = 0, size: int = 64) -> Iterator[Tuple[np.ndarray, np.ndarray, str, Attrs, Attrs]]:
    """``n`` random ``(input image, target image, instruction, input attrs, target attrs)``, uniform over ``edits()``
    with a shared +-20 % size jitter, deterministic for ``seed``."""
    rng = random.Random(seed)
    all_e = edits()
    for _ in range(n):
        src, a, v = all_e[rng.randrange(len(all_e))]
        scale = SCALE * rng.uniform(0.8, 1.2)
        tgt = apply(src, a, v)
        yield render(src, size, scale), render(tgt, size, scale), instruction(a, v), src, tgt


def image_name(attrs: Attrs) -> str:
    """File name of an input image: ``red-circle-top-left.png``."""
    return "-".join(attrs[a].replace(" ", "-") for a in ATTRS) + ".png"


def builtin_edits(per_attr: int = 20, seed: int = BUILTIN_SEED) -> List[Tuple[Attrs, str, str]]:
    """The builtin rows' edits: ``per_attr`` per attribute, inputs spread over every colour/shape/position (a seeded
    shuffle of the 60 combinations) and new values cycling through the vocabulary
    (the next one where the cycle would repeat the input's)."""
    rng = random.Random(seed)
    cs = combos()
    rng.shuffle(cs)
    out = []
    for k, a in enumerate(ATTRS):
        for i in range(per_attr):
            c, s, p = cs[(i + k * per_attr) % len(cs)]
            src = {"color": c, "shape": s, "position": p}
            vals = VALUES[a]
            v = vals[i % len(vals)]
            out.append((src, a, v if v != src[a] else vals[(i + 1) % len(vals)]))
    return out


def builtin_rows(per_attr: int = 20) -> List[dict]:
    """The builtin rows: ``{"id", "prompt", "image" (file name under ``builtin/``), "expect"}``; ``input`` (the
    input's attributes) is kept beside for the oracle's checks and the control (the runner's row reads ``image``)."""
    rows = []
    for n, (src, a, v) in enumerate(builtin_edits(per_attr)):
        rows.append({"id": f"{n:02d}-{a}-{v.replace(' ', '-')}", "prompt": instruction(a, v),
                     "image": image_name(src), "expect": apply(src, a, v), "input": src})
    return rows


def swap_partner(rows: List[dict]) -> List[int]:
    """For each row, the index of the first later row (cyclically) whose input differs from its input in every
    attribute: the control gives row ``i`` the input image of row ``swap_partner(rows)[i]``."""
    out = []
    for i, r in enumerate(rows):
        for k in range(1, len(rows)):
            j = (i + k) % len(rows)
            if all(rows[j]["input"][a] != r["input"][a] for a in ATTRS):
                out.append(j)
                break
        else:
            raise ValueError(f"row {r['id']}: no row's input differs from its input in every attribute")
    return out


def swapped_rows(rows: List[dict]) -> List[dict]:
    """The control: each row's ``image`` (and ``input``) replaced by its swap partner's; ``prompt`` and ``expect``
    unchanged, so a model that reads its input fails the kept attributes."""
    part = swap_partner(rows)
    return [{**r, "image": rows[j]["image"], "input": rows[j]["input"], "id": r["id"] + "-swapped"}
            for r, j in zip(rows, part)]


def write_builtin(folder: Optional[Path] = None) -> Path:
    """Write ``edits.jsonl`` (rows without ``input``: the image carries it) and the input PNGs to ``folder``
    (default ``builtin/``); returns the jsonl path."""
    from PIL import Image

    folder = Path(folder or BUILTIN_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    rows = builtin_rows()
    for r in rows:
        if not (folder / r["image"]).is_file():
            Image.fromarray(render(r["input"])).save(folder / r["image"], optimize=True)
    path = folder / "edits.jsonl"
    path.write_text("".join(json.dumps({k: r[k] for k in ("id", "prompt", "image", "expect")}) + "\n" for r in rows))
    return path


def load_image(name: str, folder: Optional[Path] = None) -> np.ndarray:
    """A shipped input image as ``(64, 64, 3)`` uint8."""
    from PIL import Image

    return np.asarray(Image.open(Path(folder or BUILTIN_DIR) / name).convert("RGB"))


if __name__ == "__main__":
    print(write_builtin())
