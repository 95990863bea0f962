"""The toy_edit oracle: reads an edited image with the toy_shapes oracle and checks it against the row.

A row is right when the instructed attribute (parsed from the prompt, ``data.parse``) equals the instruction's value
and every other attribute equals the INPUT's. ``expect`` holds all three (the target's), so ``accuracy`` reports
each attribute over ``expect`` plus the split ``instructed`` (the attribute the prompt names) / ``kept`` (the two the
prompt does not name, which only the input carries). ``check_rows`` checks a row's ``expect`` against its prompt and
its input image (read with the same oracle), so an ``expect`` that does not follow from the input is refused.

The swapped-input control (``data.swapped_rows``) keeps each row's prompt and ``expect`` but feeds another row's input
(different in every attribute): ``kept`` must then collapse while ``instructed`` stays high.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from models.toy_edit.data import ATTRS, VALUES, apply, parse
from models.toy_shapes.oracle import check_vocabulary
from models.toy_shapes.oracle import read as read_shape

__all__ = ["read", "score", "accuracy", "check_rows", "check_expectations", "accuracy_section", "section"]


def read(image: np.ndarray) -> Dict[str, Optional[str]]:
    """The colour, shape and position of an ``(H, W, 3)`` image (``models.toy_shapes.oracle.read``)."""
    return read_shape(image)


def score(got: Dict[str, Optional[str]], prompt: str, expect: Dict[str, str]) -> Dict[str, bool]:
    """Per attribute whether ``got`` matches ``expect``, plus ``instructed`` (the prompt's attribute), ``kept`` (both
    others) and ``all``."""
    attr, _ = parse(prompt)
    hit = {a: got.get(a) == expect[a] for a in ATTRS if a in expect}
    kept = [hit[a] for a in ATTRS if a != attr and a in hit]
    return {**hit, "instructed": hit.get(attr, False), "kept": all(kept), "all": all(hit.values())}


def accuracy(rows: Iterable[Tuple[Dict[str, Optional[str]], str, Dict[str, str]]]) -> Dict[str, object]:
    """Shares over ``(read result, prompt, expect)`` rows: ``color``/``shape``/``position`` (each over the rows that
    state it), ``instructed`` (the prompt's attribute right), ``kept`` (both unnamed attributes right, i.e. equal to the
    input's), ``kept_attrs`` (each unnamed attribute counted once: 2 per row), ``all``, and ``n``; plus
    ``by_instruction`` (``instructed``/``kept`` per edited attribute)."""
    rows = list(rows)
    n = len(rows)
    out: Dict[str, object] = {"n": n}
    if not n:
        return out
    scores = [(score(g, p, e), parse(p)[0], e) for g, p, e in rows]
    for a in ATTRS:
        stated = [s[a] for s, _, e in scores if a in e]
        out[a] = sum(stated) / len(stated) if stated else None
    for k in ("instructed", "kept", "all"):
        out[k] = sum(s[k] for s, _, _ in scores) / n
    kept_attrs = [s[a] for s, attr, e in scores for a in ATTRS if a != attr and a in e]
    out["kept_attrs"] = sum(kept_attrs) / len(kept_attrs) if kept_attrs else None
    by = {}
    for attr in ATTRS:
        sel = [s for s, at, _ in scores if at == attr]
        if sel:
            by[attr] = {"n": len(sel), "instructed": sum(s["instructed"] for s in sel) / len(sel),
                        "kept": sum(s["kept"] for s in sel) / len(sel)}
    out["by_instruction"] = by
    return out


def row_problems(prompt: str, expect: Dict[str, str], input_image: Optional[np.ndarray] = None,
                 where: str = "row") -> List[str]:
    """What is wrong with one row: a prompt that is not an instruction, an ``expect`` whose instructed attribute is
    not the instruction's value, an instruction that changes nothing, or (given the input image) kept attributes of
    ``expect`` that differ from what the oracle reads in the input."""
    try:
        attr, value = parse(prompt)
    except ValueError as e:
        return [f"{where}: {e}"]
    out = []
    if expect.get(attr) != value:
        out.append(f"{where}: expect.{attr}={expect.get(attr)!r} but the prompt {prompt!r} sets {attr}={value!r}; "
                   f"fix: expect.{attr}={value!r}")
    if input_image is not None:
        src = read(input_image)
        if src[attr] == value:
            out.append(f"{where}: the input already has {attr}={value!r}; the instruction changes nothing")
        want = apply({a: src[a] for a in ATTRS}, attr, value)
        for a in ATTRS:
            if a != attr and a in expect and expect[a] != want[a]:
                out.append(f"{where}: expect.{a}={expect[a]!r} but the input image reads {a}={want[a]!r} (a kept "
                           f"attribute comes from the input); fix: expect.{a}={want[a]!r}")
    return out


def check_rows(rows: Iterable[dict], images: Optional[Dict[str, np.ndarray]] = None) -> List[str]:
    """Problems of rows ``{"id", "prompt", "image", "expect"}`` (``images``: input arrays by ``image`` name, to check
    the kept attributes against the input); empty when every row is consistent."""
    out = []
    for r in rows:
        img = images.get(r["image"]) if images is not None else None
        out += row_problems(r["prompt"], r["expect"], img, where=str(r.get("id", r["prompt"])))
    return out


def check_expectations(rows: Iterable, path: object) -> None:
    """The runner's expect check (as ``models.toy_shapes.oracle.check_expectations``): ``expect`` names attributes this
    oracle reads with values it can return, and each row's prompt is an instruction whose value ``expect`` holds.

    Raises:
        runner.core.dataset.DatasetError: one problem per bad key, value or prompt, with file:line.
    """
    from runner.core.dataset import DatasetError

    rows = list(rows)
    check_vocabulary(rows, path, {a: list(VALUES[a]) for a in ATTRS}, "toy_edit")
    problems = []
    for r in rows:
        if r.expect:
            problems += row_problems(r.prompt, r.expect, where=f"{path}:{r.line}")
    if problems:
        raise DatasetError(problems)


def accuracy_section(items: Iterable, records: Dict[str, dict], out_dir: object) -> Dict[str, object]:
    """The manifest's ``accuracy``: every item with ``expect`` read back from its file on disk; failed or missing
    items count as misses (as ``models.toy_shapes.oracle.accuracy_section``; figures: :func:`section`)."""
    from pathlib import Path

    from PIL import Image

    got, prompt, expect = {}, {}, {}
    for it in items:
        if not it.row.expect:
            continue
        rec = records.get(it.key)
        got[it.key] = ({"color": None, "shape": None, "position": None} if not rec or rec.get("status") != "ok"
                       else read(np.asarray(Image.open(Path(out_dir) / rec["file"]).convert("RGB"))))
        prompt[it.key], expect[it.key] = it.row.prompt, dict(it.row.expect)
    return section(got, expect, prompt)


def section(got: Dict[str, dict], expect: Dict[str, dict], prompt: Optional[Dict[str, str]]) -> Dict[str, object]:
    """The ``accuracy`` section from its per-item entries (item key -> what the oracle read, the expectation and the
    prompt): :func:`accuracy` over them plus the entries under ``read``, ``expect`` and ``prompt`` (what a
    data-parallel merge recomputes it from, ``models.oracles.merged_section``).

    Raises:
        ValueError: ``prompt`` lacks an item's prompt (the instruction is part of the score).
    """
    keys = list(expect)
    missing = [k for k in keys if k not in (prompt or {})]
    if missing:
        raise ValueError(f"toy_edit accuracy: no prompt for items {missing[:3]}; the score needs each instruction")
    return {"oracle": "toy_edit", **accuracy((got[k], prompt[k], expect[k]) for k in keys),
            "read": {k: got[k] for k in keys}, "expect": {k: expect[k] for k in keys},
            "prompt": {k: prompt[k] for k in keys}}
