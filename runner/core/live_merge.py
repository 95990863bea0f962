"""The incremental merge of the workers' journals (``items.rank<r>.jsonl``) into the run's one journal.

A data-parallel run's workers append to their own journals; this module folds what they appended into a merge
state as they go, so that the cost of a merge step is the bytes appended since the last step, and the final merge
(``runner.core.distributed.merge``) only reads what no step has read yet, then writes ``items.jsonl`` and the
folder indexes (``images/metadata.jsonl``) by copying bytes the steps already produced, in dataset order, without
parsing them again.

The state lives in ``<run dir>/merge/<run token>/`` (one per attempt; the final merge removes ``merge/``):

* ``state.json``: per journal its file identity (device, inode) and the byte offset read so far (only whole lines:
  a line still being written is read at the next step), and what each journal held (records, ok, failed); the run's
  totals (``counts``, ``prompts``); the sizes of the two logs below; ``run_id`` and ``model`` of the merged run (the
  first worker manifest seen: they go into every folder-index row).
* ``records.jsonl``: every record a step accepted, as the journal's bytes, in the order accepted (append only).
* ``metadata.jsonl``: the folder-index row (``runner.core.sinks.folder_metadata_row``) of each accepted ok record
  whose artifact lies under ``images/`` or ``videos/`` (append only).
* ``index.bin``: one fixed-size entry per item of the dataset, in dataset order (:data:`ENTRY`): where its record
  and row are in the two logs, its status, its folder, and which journal it came from; updated in place.

Which record an item keeps (the rule of the one-shot merge it replaces): an ok record of the current config (the
``valid`` inputs hashes) over a failed one, in any journal; a failed record only when the item has none yet; an ok
record over an earlier ok one only from the same journal (a journal rewritten in place, by the metrics scoring:
its records supersede their earlier versions). A journal replaced by another file (its inode changed) or shorter
than the offset read is read again from its start (``counters.rereads``).

A step runs under ``merge.lock`` (``filelock``): workers take it without waiting (:meth:`JournalMerge.step` with
``block=False``: a step already running merges their bytes, or the next one will); the final merge waits for it.
A step that died half-way (its process killed) leaves logs longer than ``state.json`` says: the next step starts
the state over from the journals (``recoveries``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import filelock

from runner.core.artifacts import atomic_write_chunks, atomic_write_json
from runner.core.dataset import prompts_add, prompts_summary

MERGE_DIR = "merge"
#: One item's entry of ``index.bin``: record offset and length in ``records.jsonl``, row offset and length in
#: ``metadata.jsonl`` (length 0: no row), status (:data:`NONE`, :data:`OK`, :data:`FAILED`), folder (0: none, else
#: 1 + its index in :data:`FOLDERS`), source journal (index into ``state["sources"]``); little-endian, 32 bytes.
ENTRY = struct.Struct("<qiqiBBH4x")
NONE, OK, FAILED = 0, 1, 2
FOLDERS = ("images", "videos")
VERSION = 1


@dataclass
class Counters:
    """What this process's merge steps read and did (tests and benchmarks assert on them, not on time)."""

    bytes_read: int = 0  # journal bytes read
    records_parsed: int = 0  # journal lines parsed as JSON
    accepted: int = 0  # records that changed an item's entry
    rereads: int = 0  # journals read again from their start (rewritten or replaced)
    steps: int = 0  # steps this process ran
    busy: int = 0  # steps skipped because another process held the lock (block=False)


def _folder(rec: Dict[str, Any]) -> int:
    f = rec.get("file")
    parts = f.split("/") if isinstance(f, str) else ()  # a run-dir relative POSIX path (sinks write them so)
    return 1 + FOLDERS.index(parts[0]) if len(parts) > 1 and parts[0] in FOLDERS else 0


class JournalMerge:
    """The merge state of one attempt of a run dir (see the module docstring).

    Args:
        out_dir: the run dir; its journals are ``items*.jsonl``.
        keys_in_order: every item key of the dataset, in dataset order (records of other keys are ignored).
        token: the attempt's run token (``runner.core.rundir.run_token``): the state's dir; None: a one-shot merge
            (no run holds the dir), whose state starts empty.
    """

    def __init__(self, out_dir: Path, keys_in_order: Sequence[str], token: Optional[str] = None) -> None:
        self.out_dir = Path(out_dir)
        self.keys = list(keys_in_order)
        self.index_of = {k: i for i, k in enumerate(self.keys)}
        self.dir = self.out_dir / MERGE_DIR / (token or "unheld")
        self.counters = Counters()
        self.state: Dict[str, Any] = {}
        if token is None and self.dir.exists():
            shutil.rmtree(self.dir)

    # ------------------------------------------------------------------------------------------- state
    def _fresh(self, base: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in ("records.jsonl", "metadata.jsonl"):
            (self.dir / name).write_bytes(b"")
        with open(self.dir / "index.bin", "wb") as f:
            f.truncate(ENTRY.size * len(self.keys))  # zeros: every item NONE
        base = base or {}
        return {"version": VERSION, "items": len(self.keys), "log_bytes": 0, "meta_bytes": 0, "journals": {},
                "sources": [], "counts": {"ok": 0, "failed": 0}, "prompts": prompts_summary(()),
                "run_id": base.get("run_id"), "model": ((base.get("config") or {}).get("model") or {}).get("name"),
                "steps": 0, "recoveries": 0, "created_at": time.time(), "updated_at": None}

    def _load(self, base: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """The state on disk, checked against its logs; a fresh one when there is none, it is another dataset's,
        or a step died half-way (its logs are longer than the state says)."""
        try:
            st = json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return self._fresh(base)
        sizes = [(self.dir / n).stat().st_size if (self.dir / n).exists() else -1
                 for n in ("records.jsonl", "metadata.jsonl", "index.bin")]
        if st.get("version") != VERSION or st.get("items") != len(self.keys) or sizes != [
                st["log_bytes"], st["meta_bytes"], ENTRY.size * len(self.keys)]:
            recoveries = int(st.get("recoveries", 0)) + 1 if st.get("items") == len(self.keys) else 0
            st = self._fresh(base)
            st["recoveries"] = recoveries
        return st

    # -------------------------------------------------------------------------------------------- steps
    def step(self, block: bool = True, valid: Optional[Mapping[str, Sequence[str]]] = None,
             base: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
        """Fold what the journals appended since the last step into the state.

        Args:
            block: wait for a step another process is running (the final merge); False: return None at once when
                one runs (a worker between batches).
            valid: item key -> the ``inputs_sha256`` values an ok record of the current config carries (None: every
                ok record counts); looked up only for the keys of new records.
            base: a worker manifest, for a new state's ``run_id`` and ``model`` (fixed when the state is created:
                every folder-index row carries them).

        Returns:
            The state after the step (``counts``, ``prompts``, ``journals``...), or None (``block=False``, busy).

        Raises:
            runner.core.errors.StorageError: the state could not be written.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(self.dir / "merge.lock"))
        try:
            lock.acquire(timeout=-1 if block else 0)
        except filelock.Timeout:
            self.counters.busy += 1
            return None
        try:
            st = self._load(base)
            self._fold(st, valid)
            st["steps"] += 1
            st["updated_at"] = time.time()
            atomic_write_json(self.dir / "state.json", st)
            self.counters.steps += 1
            self.state = st
            return st
        finally:
            lock.release()

    def _journals(self) -> List[Path]:
        return sorted(p for p in self.out_dir.glob("items*.jsonl") if p.is_file())

    def _new_lines(self, st: Dict[str, Any], path: Path) -> Tuple[int, List[bytes]]:
        """The whole lines ``path`` appended since the last step (from its start when it was replaced or
        truncated); moves its offset. Returns its source number and the lines."""
        s = os.stat(path)
        j = st["journals"].get(path.name)
        if j is None:
            st["sources"].append(path.name)
            j = st["journals"][path.name] = {"source": len(st["sources"]) - 1, "dev": s.st_dev, "ino": s.st_ino,
                                             "offset": 0, "records": 0, "ok": 0, "failed": 0,
                                             "first_at": time.time(), "last_at": None}
        elif (j["dev"], j["ino"]) != (s.st_dev, s.st_ino) or s.st_size < j["offset"]:
            self.counters.rereads += 1
            j.update(dev=s.st_dev, ino=s.st_ino, offset=0, records=0, ok=0, failed=0)
        if s.st_size <= j["offset"]:
            return j["source"], []
        with open(path, "rb") as f:
            f.seek(j["offset"])
            data = f.read(s.st_size - j["offset"])
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next step
        self.counters.bytes_read += len(data)
        j["offset"] += end
        if end:
            j["last_at"] = time.time()
        return j["source"], [ln for ln in data[:end].split(b"\n") if ln.strip()]

    def _fold(self, st: Dict[str, Any], valid: Optional[Mapping[str, Sequence[str]]]) -> None:
        """Read every journal's new lines and accept the records that change an item's entry."""
        rec_add: List[bytes] = []
        meta_add: List[bytes] = []
        sizes = [st["log_bytes"], st["meta_bytes"]]  # where the next accepted record and row go
        updates: Dict[int, bytes] = {}
        with open(self.dir / "index.bin", "r+b") as idx, open(self.dir / "records.jsonl", "rb") as old:
            for path in self._journals():
                source, lines = self._new_lines(st, path)
                j = st["journals"][path.name]
                for line in lines:
                    rec = self._parse(line)
                    if rec is None:
                        continue
                    i = self.index_of.get(rec["key"])
                    ok = rec.get("status") == "ok"
                    j["records"] += 1
                    j["ok" if ok else "failed"] += 1
                    if i is None or (ok and valid is not None
                                     and rec.get("inputs_sha256") not in valid.get(rec["key"], ())):
                        continue  # not an item of this dataset, or an earlier config's output
                    entry = self._entry(idx, updates, i)
                    prev = ENTRY.unpack(entry)
                    if not self._wins(prev, ok, source):
                        continue
                    self._account(st, prev, rec, ok, old, rec_add)
                    row = self._row(st, rec) if ok else b""
                    folder = _folder(rec) if row else 0
                    rec_add.append(line + b"\n")
                    meta_add.append(row)
                    updates[i] = ENTRY.pack(sizes[0], len(line) + 1, sizes[1], len(row), OK if ok else FAILED, folder,
                                            source)
                    sizes[0] += len(line) + 1
                    sizes[1] += len(row)
                    self.counters.accepted += 1
            self._append(st, rec_add, meta_add)
            for i, e in sorted(updates.items()):
                idx.seek(ENTRY.size * i)
                idx.write(e)
            idx.flush()

    def _entry(self, idx: Any, updates: Dict[int, bytes], i: int) -> bytes:
        if i in updates:
            return updates[i]
        idx.seek(ENTRY.size * i)
        return idx.read(ENTRY.size)

    def _parse(self, line: bytes) -> Optional[Dict[str, Any]]:
        self.counters.records_parsed += 1
        try:
            rec = json.loads(line)
        except ValueError:
            return None  # a torn line of a killed writer (never a whole one)
        return rec if isinstance(rec, dict) and isinstance(rec.get("key"), str) else None

    @staticmethod
    def _wins(prev: Tuple[Any, ...], ok: bool, source: int) -> bool:
        """Whether a new record (``ok``, from journal ``source``) replaces the item's entry ``prev``."""
        status, prev_source = prev[4], prev[6]
        if status == NONE:
            return True
        if not ok:
            return False  # a failed record never replaces one
        return status == FAILED or prev_source == source  # an ok one replaces a failed one, or its own rewrite

    def _account(self, st: Dict[str, Any], prev: Tuple[Any, ...], rec: Dict[str, Any], ok: bool, old: Any,
                 pending: List[bytes]) -> None:
        """Move the totals from the item's previous record (``prev``) to ``rec``."""
        c = st["counts"]
        if prev[4] == OK:  # an ok record superseded by its own journal's rewrite: its prompt counts go
            c["ok"] -= 1
            prompts_add(st["prompts"], self._read_record(st, prev, old, pending), -1)
        elif prev[4] == FAILED:
            c["failed"] -= 1
        c["ok" if ok else "failed"] += 1
        if ok:
            prompts_add(st["prompts"], rec, 1)

    @staticmethod
    def _read_record(st: Dict[str, Any], entry: Tuple[Any, ...], old: Any, pending: List[bytes]) -> Dict[str, Any]:
        off, n = entry[0], entry[1]
        if off >= st["log_bytes"]:  # accepted earlier in this step, not yet appended
            blob = b"".join(pending)[off - st["log_bytes"]:off - st["log_bytes"] + n]
        else:
            old.seek(off)
            blob = old.read(n)
        return json.loads(blob)

    @staticmethod
    def _row(st: Dict[str, Any], rec: Dict[str, Any]) -> bytes:
        """The record's folder-index row (``runner.core.sinks.folder_metadata_row``), b"" when it has none."""
        from runner.core.sinks import folder_metadata_row

        if not _folder(rec):
            return b""
        return (json.dumps(folder_metadata_row(rec, st.get("model"), st.get("run_id"))) + "\n").encode()

    def _append(self, st: Dict[str, Any], rec_add: List[bytes], meta_add: List[bytes]) -> None:
        for name, chunks, key in (("records.jsonl", rec_add, "log_bytes"), ("metadata.jsonl", meta_add, "meta_bytes")):
            data = b"".join(chunks)
            if data:
                with open(self.dir / name, "ab") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                st[key] += len(data)

    # ------------------------------------------------------------------------------------------- outputs
    def entries(self) -> Iterator[Tuple[int, Tuple[Any, ...]]]:
        """``(item index, entry)`` of every item with a record, in dataset order."""
        data = (self.dir / "index.bin").read_bytes()
        for i, e in enumerate(ENTRY.iter_unpack(data)):
            if e[4] != NONE:
                yield i, e

    def write_outputs(self) -> Dict[str, int]:
        """Write ``items.jsonl`` (every item's record, dataset order) and each artifact folder's
        ``metadata.jsonl`` (its ok items' rows; a folder with none loses a stale one) from the state, copying the
        logs' bytes (``os.pread`` of each entry: memory stays the index's, whatever the run's size). Returns
        ``{"<folder>/metadata.jsonl": rows}`` (``runner.core.sinks.write_folder_metadata``'s result)."""
        rfd = os.open(self.dir / "records.jsonl", os.O_RDONLY)
        mfd = os.open(self.dir / "metadata.jsonl", os.O_RDONLY)
        try:
            atomic_write_chunks(self.out_dir / "items.jsonl", (os.pread(rfd, e[1], e[0]) for _, e in self.entries()))
            written: Dict[str, int] = {}
            for n, folder in enumerate(FOLDERS, start=1):
                path = self.out_dir / folder / "metadata.jsonl"
                if not path.parent.is_dir():
                    continue
                count = [0]

                def rows(n: int = n, count: List[int] = count) -> Iterator[bytes]:
                    for _, e in self.entries():
                        if e[4] == OK and e[5] == n and e[3]:
                            count[0] += 1
                            yield os.pread(mfd, e[3], e[2])

                atomic_write_chunks(path, rows())
                if count[0]:
                    written[f"{folder}/metadata.jsonl"] = count[0]
                else:
                    path.unlink()  # no row: no index (a stale one goes too)
        finally:
            os.close(rfd)
            os.close(mfd)
        return written

    def ok_records(self) -> Iterator[Dict[str, Any]]:
        """The ok records of the state, dataset order (parsed: for callers that need every record)."""
        with open(self.dir / "records.jsonl", "rb") as f:
            for _, e in self.entries():
                if e[4] == OK:
                    f.seek(e[0])
                    yield json.loads(f.read(e[1]))

    def remove(self) -> None:
        """Remove every merge state of the run dir (the run's files now hold what they held)."""
        shutil.rmtree(self.out_dir / MERGE_DIR, ignore_errors=True)
