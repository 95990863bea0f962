"""Output sinks and the one reader of journals (``items.jsonl``, ``items.rank<r>.jsonl``, ``<stage>.jsonl``).

A sink turns a stage's outputs into durable files plus journal lines, in that order: ``submit(record, output)``
writes the artifact (temp name, fsync, rename) and only then appends the record (flushed, fsynced), so a journal
line never names a file that is not complete. ``verify(record)`` says whether a journaled artifact is still the one
recorded (resume); ``close()`` finishes every queued write. A new output format (MP4, parquet, webdataset) is a
new sink class and an entry in :data:`SINKS`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

from runner.artifacts import ArtifactWriter, Journal, atomic_write_bytes


def read_journal(path: Path) -> List[Dict[str, Any]]:
    """Records of a JSON-lines journal in file order; a truncated last line (a kill mid-write) is ignored, and a
    missing file reads as no records."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def compact_journal(path: Path, order: Optional[List[str]] = None,
                    extra: Optional[Dict[str, Dict[str, Any]]] = None,
                    keep: Optional[Callable[[Dict[str, Any]], bool]] = None) -> None:
    """Rewrite ``path`` atomically with the latest record per ``key`` (``id`` where a record has no key).

    Args:
        order: keys in the order the journal must list them (dataset order; keys with no record are skipped);
            None keeps the order in which keys first appeared.
        extra: records to use for keys the journal itself lacks (ok records of other journals of the run dir).
        keep: records of the journal for which it is False are left out (as if never written).
    """
    latest: Dict[str, Dict[str, Any]] = dict(extra or {})
    for r in read_journal(path):
        k = r.get("key", r.get("id"))
        if k is not None and (keep is None or keep(r)):
            latest[k] = r
    if order is None:
        if not Path(path).is_file():
            return
        order = list(latest)
    atomic_write_bytes(Path(path), "".join(json.dumps(latest[k]) + "\n" for k in order if k in latest).encode())


class Sink(Protocol):
    """Where one stage's outputs go. ``submit`` never loses a produced output: a write error becomes a
    ``status: failed`` record naming it."""

    journal_name: str

    def submit(self, record: Dict[str, Any], output: Any) -> None: ...

    def drain(self) -> None: ...

    def verify(self, record: Dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


class _Counting:
    """Shared bookkeeping: counts per status and the records written ok in this process."""

    def __init__(self, on_record: Optional[Callable[[Dict[str, Any]], None]]) -> None:
        self.counts = {"ok": 0, "failed": 0}
        self.ok_records: List[Dict[str, Any]] = []
        self.nonfinite = 0
        self._on_record = on_record

    def _recorded(self, rec: Dict[str, Any]) -> None:
        self.counts["ok" if rec["status"] == "ok" else "failed"] += 1
        if rec["status"] == "ok":
            self.ok_records.append(rec)
        if self._on_record is not None:
            self._on_record(rec)


class PNGSink(_Counting):
    """Images as lossless PNG files ``images/<stem>.png`` (no metadata, so equal pixels give equal bytes), encoded
    and written on ``workers`` threads while the next batch generates (:class:`runner.artifacts.ArtifactWriter`).

    ``submit(record, output)``: ``output`` is a :class:`models.base.ImageOutput`, or the exception that failed the
    item; a non-finite image is refused (``status: failed``, the count of bad values as reason) and never written.
    The record gets ``status``, ``file`` (relative to the run dir) and ``file_sha256`` once the file is in place.

    Args:
        out_dir: the run dir; images go to ``out_dir/images``.
        journal_name: the journal file in ``out_dir`` (``items.jsonl``, or a worker's ``items.rank<r>.jsonl``).
        workers: encoder threads (0: inline).
        max_pending: outputs held before ``submit`` waits (bounds host memory: a 1024x1024 float32 image is 12 MiB).
        on_record: called in the caller's thread with each record once it is journaled.
    """

    suffix = ".png"

    def __init__(self, out_dir: Path, journal_name: str = "items.jsonl", workers: int = 0, max_pending: int = 16,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        super().__init__(on_record)
        self.out_dir = Path(out_dir)
        self.journal_name = journal_name
        self.dir = self.out_dir / "images"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.out_dir / journal_name)
        self.writer = ArtifactWriter(self.journal, workers, self._recorded, max_pending=max_pending)

    def submit(self, record: Dict[str, Any], output: Any) -> None:
        """Queue one item's output; the file is named by ``runner.dataset.safe_stem`` of the record's ``key``."""
        if isinstance(output, BaseException):
            record.update(status="failed", file=None, reason=f"{type(output).__name__}: {output}")
            self.writer.submit(record)
            return
        bad = output.nonfinite()
        if bad:
            record.update(status="failed", file=None, reason=f"non-finite output ({bad} values)")
            self.nonfinite += 1
            self.writer.submit(record)
            return
        from runner.dataset import safe_stem

        path = self.dir / f"{safe_stem(record['key'])}{self.suffix}"
        self.writer.submit(record, path, output.image, str(path.relative_to(self.out_dir)))

    def verify(self, record: Dict[str, Any]) -> bool:
        """The record says ok and its file exists with the recorded sha256."""
        if record.get("status") != "ok" or not record.get("file"):
            return False
        f = self.out_dir / record["file"]
        return f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() == record.get("file_sha256")

    def drain(self) -> None:
        """Wait for every queued write and journal it."""
        self.writer.drain(block=True)

    @property
    def write_s(self) -> float:
        """Summed encode + write seconds in the writer threads."""
        return self.writer.thread_s

    @property
    def wait_s(self) -> float:
        """Seconds the generating thread waited for writes."""
        return self.writer.wait_s

    def close(self) -> None:
        """Finish every queued write (nothing produced is lost), then close the journal."""
        try:
            self.writer.close()
        finally:
            self.journal.close()


class RecordSink(_Counting):
    """Text records (AR outputs) as journal lines of ``<journal_name>``: the record is the artifact, so
    ``submit`` appends it (flushed, fsynced) with ``status: ok``; a failed item gets ``status: failed`` and the
    reason. ``verify`` accepts an ok record carrying its output token ids."""

    def __init__(self, out_dir: Path, journal_name: str = "items.jsonl",
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        super().__init__(on_record)
        self.out_dir = Path(out_dir)
        self.journal_name = journal_name
        self.journal = Journal(self.out_dir / journal_name)

    def submit(self, record: Dict[str, Any], output: Any) -> None:
        """Journal one item's record (``output``: a :class:`models.base.TextOutput` or the exception)."""
        if isinstance(output, BaseException):
            record.update(status="failed", reason=f"{type(output).__name__}: {output}")
        else:
            record["status"] = "ok"
        self.journal.append(record)
        self._recorded(record)

    def verify(self, record: Dict[str, Any]) -> bool:
        """An ok record with its ``output_token_ids``."""
        return record.get("status") == "ok" and isinstance(record.get("output_token_ids"), list)

    def drain(self) -> None:
        """Nothing is queued: every submit is durable when it returns."""

    write_s = 0.0
    wait_s = 0.0

    def close(self) -> None:
        """Close the journal."""
        self.journal.close()


#: engine output kind -> sink class
SINKS: Dict[str, Any] = {"image": PNGSink, "text": RecordSink}


UNLISTED = "items.unlisted.jsonl"


def keep_unlisted(out_dir: Path, journal_name: str = "items.jsonl", before: Sequence[Dict[str, Any]] = ()) -> int:
    """Keep a record for every artifact in ``out_dir`` that the run's journal no longer lists, in
    ``items.unlisted.jsonl`` (latest record per file; rewritten atomically, removed when empty).

    A resume can leave such files: a smaller ``dataset.limit``, a row removed from the dataset, an item of an
    earlier config a forced resume did not get to regenerate. Their records are dropped from ``items.jsonl`` (which
    lists exactly this run's items), but the files stay; kept here, no file in the dir is without a record, and a
    later run whose identity matches reuses them (``runner.resume.finished`` reads every ``items*.jsonl``).

    Args:
        before: the journal's records as they were before it was compacted (the latest candidates).

    Returns:
        The number of such files.
    """
    out_dir = Path(out_dir)
    listed = {r.get("file") for r in read_journal(out_dir / journal_name) if r.get("status") == "ok"}
    keep: Dict[str, Dict[str, Any]] = {}
    for p in sorted(out_dir.glob("items*.jsonl")):
        if p.name == journal_name:
            continue
        for r in read_journal(p):
            f = r.get("file")
            if r.get("status") == "ok" and f and f not in listed:
                keep[f] = r
    for r in before:
        f = r.get("file")
        if r.get("status") == "ok" and f and f not in listed:
            keep[f] = r
    ok = {f: r for f, r in keep.items() if (out_dir / f).is_file()
          and hashlib.sha256((out_dir / f).read_bytes()).hexdigest() == r.get("file_sha256")}
    path = out_dir / UNLISTED
    if ok:
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for _, r in sorted(ok.items())).encode())
    elif path.exists():
        path.unlink()
    return len(ok)
