"""Crash-safe writing: artifacts via temp file + rename, the item journal appended and fsynced after the
artifact is in place, JSON documents replaced atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict

import numpy as np


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """``atomic_write_bytes`` of ``obj`` as indented JSON (UTF-8)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def to_uint8(image: np.ndarray) -> np.ndarray:
    """HWC float image in [0, 1] -> uint8, rounding like ``diffusers.VaeImageProcessor.numpy_to_pil``."""
    return (np.clip(image, 0.0, 1.0) * 255).round().astype("uint8")


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of an HWC float image in [0, 1] (PIL, no metadata, so equal pixels give equal bytes)."""
    import io

    from PIL import Image

    arr = to_uint8(image)
    img = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class Journal:
    """Append-only JSON-lines journal (``items.jsonl``); each line is flushed and fsynced before returning."""

    def __init__(self, path: Path):
        self.path = path
        if path.exists() and path.stat().st_size:
            with open(path, "rb+") as f:  # a kill mid-write leaves a partial last line: cut it off
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    data = path.read_bytes()
                    f.truncate(data.rfind(b"\n") + 1)
        self._f = open(path, "a", encoding="utf-8")

    def append(self, record: Dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()
