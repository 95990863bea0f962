"""Crash-safe writing: artifacts via temp file + rename, the item journal appended and fsynced after the
artifact is in place, JSON documents replaced atomically."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Optional

import numpy as np

from runner.core.errors import StorageError


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path`` (a rename in it is then durable); errors are ignored (not every filesystem
    allows it)."""
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


#: errno values that mean "this storage cannot take the write" rather than a fault of one item
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def storage_error(path: Path, e: OSError) -> Exception:
    """``e`` as a :class:`runner.core.errors.StorageError` naming ``path`` and the fix when its errno is one of
    :data:`STORAGE_ERRNOS`, else ``e`` itself."""
    if e.errno not in STORAGE_ERRNOS:
        return e
    err = StorageError(f"cannot write {path}: {os.strerror(e.errno)}",
                       fix=f"free space or fix permissions on {path.parent}, then re-run the same command: finished "
                           "items are kept and the run resumes")
    err.errno = e.errno
    return err


def replace_file(path: Path, data: bytes, tmp: Optional[Path] = None) -> None:
    """Write ``data`` to the temp file ``tmp`` (default ``.<name>.tmp<pid>`` beside ``path``), fsync it and rename it
    over ``path``: readers see the old file or the complete new one. The caller words the error.

    Raises:
        OSError: the write or the rename failed (the temp file is removed, ``path`` is left as it was).
    """
    replace_file_chunks(path, (data,), tmp)


def replace_file_chunks(path: Path, chunks: Iterable[bytes], tmp: Optional[Path] = None) -> None:
    """:func:`replace_file` of the concatenation of ``chunks``, written as they come (a file larger than what one
    wants in memory: the merged journal of a large run).

    Raises:
        OSError: as :func:`replace_file`.
    """
    tmp = tmp or path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for data in chunks:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see either the old file or the complete new one
    (:func:`replace_file`), then fsync the directory.

    Raises:
        runner.core.errors.StorageError: the storage refused the write (disk full, read-only, permission); the temp
            file is removed, ``path`` is left as it was.
    """
    atomic_write_chunks(path, (data,))


def atomic_write_chunks(path: Path, chunks: Iterable[bytes]) -> None:
    """:func:`atomic_write_bytes` of the concatenation of ``chunks`` (:func:`replace_file_chunks`).

    Raises:
        runner.core.errors.StorageError: as :func:`atomic_write_bytes`.
    """
    try:
        replace_file_chunks(path, chunks)
    except OSError as e:
        raise storage_error(path, e) from e
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """``atomic_write_bytes`` of ``obj`` as indented JSON (UTF-8)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def to_uint8(image: np.ndarray) -> np.ndarray:
    """HWC float image in [0, 1] -> uint8, rounding like ``diffusers.VaeImageProcessor.numpy_to_pil``."""
    return (np.clip(image, 0.0, 1.0) * 255).round().astype("uint8")


def encode_png(image: np.ndarray, text: Optional[Dict[str, str]] = None) -> bytes:
    """PNG bytes of an HWC float image in [0, 1] (PIL, default compression).

    Args:
        text: text chunks to embed, in this order (``tEXt``, or ``iTXt`` for a value that is not Latin-1, PIL's
            ``PngInfo.add_text``); None or empty: none. The bytes are a function of the pixels and ``text`` only (no
            time stamp), so equal pixels and equal text give equal bytes.
    """
    import io

    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    arr = to_uint8(image)
    img = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
    info = None
    if text:
        info = PngInfo()
        for k, v in text.items():
            info.add_text(k, v)
    buf = io.BytesIO()
    img.save(buf, format="PNG", pnginfo=info)
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
        """Append one record as a line, flushed and fsynced before returning.

        Raises:
            runner.core.errors.StorageError: the storage refused the write (a partial line is cut off by the next
                :class:`Journal` opened on the file).
        """
        try:
            self._f.write(json.dumps(record, sort_keys=False) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise storage_error(self.path, e) from e

    def close(self) -> None:
        self._f.close()


class ArtifactWriter:
    """Encodes and writes artifacts on worker threads while the caller generates the next batch.

    Journal records are appended in submission order, each only after its artifact is in place (temp file +
    rename, fsynced), so the crash-safety order of :class:`Journal` holds: a journal line never names a file that
    is not complete. PNG encoding (zlib) and file I/O release the GIL, so the threads overlap with the GPU work
    of the next batch; ``workers=0`` writes inline.

    Args:
        journal: where finished records go.
        workers: encoder threads (0: inline, in the caller's thread).
        on_record: called in the caller's thread with each record once it is journaled (counts, progress bar).
        max_pending: submissions held before ``submit`` waits for the oldest (bounds host memory: a 1024x1024
            float32 image is 12 MiB).
        write: ``write(path, payload) -> {"sha256": of the file's bytes, "fields": {...} (optional, added to the
            record)}``, called in a writer thread; it must leave ``path`` complete or absent (temp name, fsync,
            rename) and raise :class:`runner.core.errors.StorageError` when the storage refuses. Default: the payload is
            an HWC float image, written as PNG.
    """

    def __init__(self, journal: Journal, workers: int, on_record, max_pending: int = 16,
                 write: Optional[Callable[[Path, Any], Dict[str, Any]]] = None):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.journal = journal
        self.on_record = on_record
        self.max_pending = max(1, max_pending)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="runner-write") if workers > 0 else None
        self._pending: Any = deque()
        self.thread_s = 0.0  # summed encode + write seconds in the worker threads
        self.wait_s = 0.0  # seconds the caller spent waiting for writes
        self._write_artifact = write or self.write_png

    @staticmethod
    def write_png(path: Path, image: Any) -> Dict[str, Any]:
        """``image``: an HWC float image, or ``(image, text chunks)`` (:func:`encode_png`)."""
        import hashlib

        data = encode_png(*image) if isinstance(image, tuple) else encode_png(image)
        atomic_write_bytes(path, data)
        return {"sha256": hashlib.sha256(data).hexdigest()}

    def _write(self, path: Path, payload: Any) -> Dict[str, Any]:
        import time

        t0 = time.perf_counter()
        res = dict(self._write_artifact(path, payload))
        res["s"] = time.perf_counter() - t0
        return res

    def submit(self, record: Dict[str, Any], path: Optional[Path] = None, image: Any = None,
               rel: Optional[str] = None, file_name: Optional[str] = None) -> None:
        """Queue ``record``; with ``path``/``image`` (the payload of ``write``) the artifact is written first and the
        record gets ``status=ok``, ``file=rel``, ``file_name`` (when given: the name relative to the artifact's
        folder), ``file_sha256`` and the write's ``fields`` (or ``status=failed`` with the write error as
        reason)."""
        from concurrent.futures import Future

        fut: Optional[Future] = None
        if path is not None:
            if self._pool is not None:
                fut = self._pool.submit(self._write, path, image)
            else:
                fut = Future()
                try:
                    fut.set_result(self._write(path, image))
                except Exception as e:  # noqa: BLE001 - recorded on the item
                    fut.set_exception(e)
        self._pending.append((fut, record, rel, file_name))
        self.drain(block=len(self._pending) > self.max_pending)

    def drain(self, block: bool = False) -> None:
        """Journal every finished submission at the head of the queue; ``block``: wait for all of them."""
        import time

        while self._pending:
            fut, rec, rel, name = self._pending[0]
            if fut is not None and not fut.done():
                if not block:
                    return
                t0 = time.perf_counter()
                try:
                    fut.exception()
                finally:
                    self.wait_s += time.perf_counter() - t0
            self._pending.popleft()
            if fut is not None:
                err = fut.exception()
                if isinstance(err, StorageError):
                    raise err  # the storage is the fault, not this item: stop the run, keep what was written
                if err is None:
                    res = fut.result()
                    self.thread_s += res["s"]
                    rec.update(status="ok", file=rel, **({"file_name": name} if name is not None else {}),
                               file_sha256=res["sha256"], **res.get("fields", {}))
                    rec.setdefault("timing", {})["write_s"] = round(res["s"], 4)
                else:
                    rec.update(status="failed", file=None, reason=f"writing the artifact failed: "
                                                                  f"{type(err).__name__}: {err}")
            self.journal.append(rec)
            self.on_record(rec)

    def close(self) -> None:
        """Finish every queued write (nothing produced is lost), then stop the threads."""
        try:
            self.drain(block=True)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
