"""Where a model's weights come from, and their digests (issue #17).

* :func:`resolve_model_path`: ``model.path`` is a local directory, or a Hugging Face repo id (``org/name``)
  resolved through the local Hugging Face cache only (``HF_HUB_CACHE`` / ``HF_HOME``; never the network).
* :func:`weight_files`: the ``*.safetensors`` files a diffusers pipeline loads from a snapshot (the components of
  ``model_index.json``; shard indexes; non-variant files), so nothing else is hashed.
* :func:`hash_files`: sha256 of each of those files, with a digest cache under the runner cache dir keyed by the
  file's resolved path, size, modification time, change time and inode: a second job (or another rank) on the
  same snapshot reads no weight bytes; a Hugging Face cache's LFS blobs are named by their sha256, which is taken
  as their digest without reading them (``RUNNER_VERIFY_WEIGHTS=1`` reads and checks them).

No function here imports torch or diffusers, or touches the network.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from runner.core.dataset import file_sha256
from runner.core.errors import UserInputError

log = logging.getLogger("runner")

#: What ``hf download`` needs to fetch for a diffusers snapshot the runner loads (weights, configs, tokenizers).
DOWNLOAD_PATTERNS = "--include '*.safetensors' '*.json' '*.txt' '*.model'"

#: The digest cache's file name under the runner cache dir, and its format version.
DIGEST_CACHE_NAME = "weight_digests.json"
DIGEST_CACHE_VERSION = 1

_LOCAL_PREFIXES = ("/", "./", "../", "~")
_REVISION_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/-]*")


class ModelPathError(UserInputError, ValueError):
    """``model.path`` names no usable weights: a local path that does not exist, a repo id the Hugging Face cache
    does not hold (at the requested revision), an incomplete snapshot, or a snapshot listing weight files it does
    not have. Outcome ``invalid``, exit 2; the message names what was searched and the fix."""


class WeightFileError(UserInputError, ValueError):
    """A weight file of the model is damaged (truncated, bad header); names the file and the fix."""


def check_safetensors(root: Path) -> int:
    """Check every ``*.safetensors`` under ``root`` (or the file ``root``) without loading a tensor: the 8-byte little-endian header size,
    a JSON header, and a file exactly as long as the header says (``8 + header + max(data_offsets end)``; format:
    https://github.com/huggingface/safetensors#format). A file cut short by a full disk or a killed copy would
    otherwise fail inside ``from_pretrained`` after the run started.

    Returns:
        The number of files checked.

    Raises:
        WeightFileError: naming the file, what is wrong, and the fix.
    """
    import json
    import struct

    n = 0
    for f in [Path(root)] if Path(root).is_file() else sorted(Path(root).rglob("*.safetensors")):
        size = f.stat().st_size
        why = None
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                why = f"{size} bytes, shorter than the 8-byte header size"
            else:
                (hlen,) = struct.unpack("<Q", head)
                if 8 + hlen > size:
                    why = f"header of {hlen} bytes announced, file has {size} bytes"
                else:
                    try:
                        header = json.loads(fh.read(hlen))
                        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                                  default=0)
                    except (ValueError, KeyError, TypeError, IndexError) as e:
                        why = f"unreadable header ({type(e).__name__}: {e})"
                    else:
                        if size != 8 + hlen + end:
                            why = f"{size} bytes, the header describes {8 + hlen + end} (truncated or padded)"
        if why:
            raise WeightFileError(f"weight file {f} is damaged: {why}; fix: download or copy it again (or delete "
                                  "the embedded model's cache dir so it is rebuilt)")
        n += 1
    return n


class HubCacheMissError(ModelPathError):
    """A repo id (``model.path=org/name``) the local Hugging Face cache does not hold, or not at
    ``model.revision`` (names the repo, the cache searched, what it does hold, and the download command)."""


# ------------------------------------------------------------------------------------------------ hub ids


def hub_cache_dir() -> Tuple[Path, str]:
    """The Hugging Face hub cache this process would use, read from the environment *now* (huggingface_hub reads
    it once, at import): ``HF_HUB_CACHE``, else the legacy ``HUGGINGFACE_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``).

    Returns:
        ``(directory, the variable that set it, or "default")``.
    """
    def expand(v: str) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(v)))

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand(os.environ[var]), var
    if os.environ.get("HF_HOME"):
        return expand(os.environ["HF_HOME"]) / "hub", "HF_HOME"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return expand(os.path.join(xdg, "huggingface", "hub")), "default"


#: The variables that choose the Hugging Face hub cache (:func:`hub_cache_dir`), recorded as they were set.
HUB_CACHE_ENV = ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")


def hub_environment(sources: Iterable[Dict[str, Any]]) -> Dict[str, str]:
    """The environment that resolved a run's Hub ids, for the manifest's ``environment`` section: another process
    given it resolves the same snapshots whatever its own shell sets (``runner.repro`` and ``repro.sh`` export it).

    Args:
        sources: the stages' ``model.source`` documents; one resolved from a Hub id carries ``hub.cache_dir``
            (:func:`resolve_model_path`).

    Returns:
        ``{}`` when no source came from a Hub id; else ``HF_HUB_CACHE``: the absolute cache dir that resolved it
        (it takes precedence over ``HF_HOME`` in huggingface_hub as in :func:`hub_cache_dir`), plus ``HF_HOME``
        and ``HUGGINGFACE_HUB_CACHE`` as this process had them, where set.
    """
    dirs = [str(Path(s["hub"]["cache_dir"]).resolve()) for s in sources
            if isinstance(s, dict) and isinstance(s.get("hub"), dict) and s["hub"].get("cache_dir")]
    if not dirs:
        return {}
    env = {k: os.environ[k] for k in HUB_CACHE_ENV if os.environ.get(k)}
    env["HF_HUB_CACHE"] = dirs[0]  # one process reads one cache: every stage's is the same
    return env


def looks_like_repo_id(value: str) -> bool:
    """True for ``org/name`` (huggingface_hub's repo id rules: ``[A-Za-z0-9._-]``, no ``--``/``..``, at most 96
    characters) that is not written as a local path (no leading ``/``, ``./``, ``../``, ``~``)."""
    if not value or value.startswith(_LOCAL_PREFIXES) or value.count("/") != 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _cached_revisions(repo_dir: Path) -> Tuple[Dict[str, str], List[str]]:
    """``({ref name: commit}, [snapshot commits])`` of one repo folder of the hub cache."""
    refs: Dict[str, str] = {}
    if (repo_dir / "refs").is_dir():
        for f in sorted((repo_dir / "refs").rglob("*")):
            if f.is_file():
                try:
                    refs[f.relative_to(repo_dir / "refs").as_posix()] = f.read_text().strip()
                except OSError:
                    continue
    snaps = sorted(p.name for p in (repo_dir / "snapshots").iterdir()) if (repo_dir / "snapshots").is_dir() else []
    return refs, snaps


def _download_fix(repo_id: str, revision: Optional[str], cache: Path, source: str) -> str:
    env = f"HF_HUB_CACHE={cache}" if source in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE") else f"HF_HOME={cache.parent}"
    rev = f" --revision {revision}" if revision else ""
    return (f"download it where the network is reachable: {env} hf download {repo_id}{rev} {DOWNLOAD_PATTERNS} "
            f"(or point HF_HOME / HF_HUB_CACHE at a cache that holds it, or pass model.path=<local snapshot dir>)")


def resolve_model_path(value: str, revision: Optional[str] = None) -> Tuple[Path, Dict[str, Any]]:
    """Resolve ``model.path`` to a local snapshot directory, without any network access.

    * An existing local path is returned as given (``~`` expanded); ``model.revision`` stays a label recorded as
      given (nothing can check it against a plain directory).
    * Else a value shaped like a repo id (``org/name``, see :func:`looks_like_repo_id`) is looked up in the local
      Hugging Face cache (:func:`hub_cache_dir`, read from the environment at call time) with
      ``huggingface_hub.snapshot_download(..., local_files_only=True)``: ``revision`` (a branch, tag or full
      commit hash; None: ``main``) picks the snapshot.
    * Else the path does not exist.

    Args:
        value: ``model.path``.
        revision: ``model.revision`` (None: the cache's ``main``).

    Returns:
        ``(snapshot directory, provenance)``; provenance is ``{"kind": "path", "path", "revision"}`` for a local
        directory, ``{"kind": "hub", "repo_id", "revision" (the snapshot's commit hash), "requested_revision",
        "cache_dir", "path"}`` for a repo id.

    Raises:
        ModelPathError: a local-looking path that does not exist, or (for a repo id) a ``revision`` that is not a
            ref name.
        HubCacheMissError: the repo id is not in the cache, not at that revision, or its snapshot is incomplete
            (names the repo, the cache searched, the revisions it holds and the ``hf download`` command).
    """
    p = Path(value).expanduser()
    if p.exists():
        return p, {"kind": "path", "path": str(p.resolve()), "revision": revision}
    if not looks_like_repo_id(value):
        raise ModelPathError(f"model.path={value!r} does not exist; fix: pass a local diffusers snapshot directory "
                               "(the folder with model_index.json), or a Hugging Face repo id org/name held in the "
                               "local cache")
    if revision is not None and (not _REVISION_RE.fullmatch(revision) or ".." in revision):
        raise ModelPathError(f"model.revision={revision!r} is not a branch, tag or commit name; fix: a name such as "
                               "main, v1.0 or a full 40-hex commit hash")
    import huggingface_hub.errors as hf_errors
    from huggingface_hub import snapshot_download

    incomplete = getattr(hf_errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 2.x checks completeness

    cache, source = hub_cache_dir()
    where = f"{cache} ({'from ' + source if source != 'default' else 'the default; HF_HOME / HF_HUB_CACHE unset'})"
    repo_dir = cache / ("models--" + value.replace("/", "--"))
    fix = _download_fix(value, revision, cache, source)
    try:
        snap = Path(snapshot_download(value, revision=revision, cache_dir=str(cache), local_files_only=True))
    except hf_errors.LocalEntryNotFoundError as e:
        if isinstance(e, incomplete):
            raise HubCacheMissError(f"model.path={value!r}: the Hugging Face cache at {where} holds an incomplete "
                                    f"snapshot ({e})", fix=fix) from None
        if not repo_dir.is_dir():
            raise HubCacheMissError(f"model.path={value!r} is not a local directory, and the Hugging Face cache at "
                                    f"{where} has no snapshot of repo {value!r} (no {repo_dir.name}/; the runner "
                                    "never downloads)", fix=fix) from None
        refs, snaps = _cached_revisions(repo_dir)
        held = ", ".join([f"{r} -> {c[:12]}" for r, c in refs.items()] + [c for c in snaps if c not in refs.values()])
        raise HubCacheMissError(f"model.revision={revision or 'main'!r}: the Hugging Face cache at {where} holds "
                                f"repo {value!r} but not that revision (it holds: {held or 'no snapshot'}; a commit "
                                "is given as the full 40-hex hash)", fix=fix) from None
    return snap, {"kind": "hub", "repo_id": value, "revision": snap.name, "requested_revision": revision or "main",
                  "cache_dir": str(cache), "path": str(snap)}


# ------------------------------------------------------------------------------------------------ weight files


def _is_variant(name: str) -> bool:
    """``model.fp16.safetensors``, ``model.fp16-00001-of-00002.safetensors``, ``model-00001-of-00002.fp16.safetensors``
    (diffusers' variant names): a dot inside the stem."""
    return "." in name[: -len(".safetensors")]


def _component_files(snapshot: Path, folder: Path) -> List[Path]:
    """The ``*.safetensors`` files diffusers loads (no ``variant``) from one component folder."""
    # the non-variant indexes: ``x.safetensors.index.fp16.json`` (a variant's) does not match
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        shards: List[Path] = []
        for index in indexes:
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
                raise ModelPathError(f"{index.relative_to(snapshot)} is not a shard index ({e!r}); fix: download "
                                       "the snapshot again") from None
            bad = [n for n in names if not isinstance(n, str) or os.path.isabs(n) or ".." in Path(n).parts]
            if bad:
                raise ModelPathError(f"{index.relative_to(snapshot)} lists shard(s) outside {folder.name}/ "
                                       f"({', '.join(map(repr, bad[:3]))}); fix: download the snapshot again")
            shards.extend(folder / n for n in names)
        return sorted(set(shards))
    files = sorted(f for f in folder.glob("*.safetensors") if f.is_file() or f.is_symlink())
    plain = [f for f in files if not _is_variant(f.name)]
    return plain or files  # only variant files: from_pretrained falls back to them, so hash what it would read


def weight_files(snapshot: Path) -> List[Path]:
    """The weight files a diffusers pipeline loads from ``snapshot`` (``from_pretrained`` without ``variant``).

    For each component of ``model_index.json`` (entries ``[library, class]``; ``_``-prefixed keys and null
    entries skipped), the component folder's ``*.safetensors`` files: the shards its ``*.safetensors.index.json``
    lists (only those) if it has one, else its non-variant files (``model.safetensors``, not
    ``model.fp16.safetensors``), else its variant files. Files outside the components (an extra folder, a
    root-level single-file checkpoint) are not listed.

    Returns:
        Paths under ``snapshot`` (symlinks of a hub cache snapshot kept, not resolved), sorted.

    Raises:
        ModelPathError: no readable ``model_index.json``, an unreadable shard index, or a listed file that is
            missing (an incomplete download, or a cache snapshot whose blob is gone).
    """
    snapshot = Path(snapshot)
    try:
        index = json.loads((snapshot / "model_index.json").read_text())
        if not isinstance(index, dict):
            raise ValueError(f"a JSON {type(index).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise ModelPathError(f"{snapshot}: model_index.json cannot be read ({e}); fix: point at a diffusers "
                               "snapshot root (the folder with model_index.json), or download it again") from None
    out: List[Path] = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or not any(spec):
            continue
        folder = snapshot / name
        if folder.is_dir():
            out.extend(_component_files(snapshot, folder))
    missing = [f.relative_to(snapshot).as_posix() for f in out if not f.is_file()]
    if missing:
        raise ModelPathError(f"{snapshot}: {len(missing)} weight file(s) the pipeline loads are missing or dangling "
                               f"links ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); fix: "
                               f"download the snapshot again (hf download <repo> {DOWNLOAD_PATTERNS})")
    return sorted(out)


# ------------------------------------------------------------------------------------------------ digests


def default_cache_dir() -> Path:
    """The runner cache dir: ``$RUNNER_CACHE``, else ``~/.cache/runner``."""
    return Path(os.environ.get("RUNNER_CACHE") or "~/.cache/runner").expanduser()


#: Per path, the digest cache keeps this many stat variants (the same path on several hosts sharing one cache dir
#: has several inodes; one entry per path would make them evict each other), and at most this many paths.
CACHE_VARIANTS_PER_PATH = 4
CACHE_MAX_PATHS = 20000


_STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "ino")


def _stat_key(st: os.stat_result) -> Dict[str, int]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def _read_cache(path: Path, warn: bool = True) -> Tuple[Dict[str, List[Dict[str, Any]]], bool]:
    """``(entries, corrupt)``: the digest cache's entries, ``{resolved path: [{size, mtime_ns, ctime_ns, ino,
    sha256, stored}, ...]}`` (newest first); a missing file is empty, an unreadable or corrupt one is empty with a
    warning (it is rewritten on the next store)."""
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("version") != DIGEST_CACHE_VERSION:
            raise ValueError(f"not a version-{DIGEST_CACHE_VERSION} digest cache")
        entries = doc["entries"]
        if not isinstance(entries, dict) or not all(isinstance(v, list) and all(isinstance(e, dict) for e in v)
                                                    for v in entries.values()):
            raise ValueError("'entries' is not an object of lists of objects")
        return entries, False
    except FileNotFoundError:
        return {}, False
    except (OSError, ValueError, KeyError) as e:
        if warn:
            log.warning("weight digest cache %s is unreadable or corrupt (%s): ignored; the digests are computed "
                        "and the file rewritten", path, e)
        return {}, True


def _write_cache(path: Path, entries: Dict[str, List[Dict[str, Any]]]) -> None:
    """Write the cache atomically (a temp file in the same dir, fsynced, then ``os.replace``)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": DIGEST_CACHE_VERSION, "entries": entries}, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _hit(entries: Dict[str, List[Dict[str, Any]]], real: str, key: Dict[str, int]) -> Optional[str]:
    for e in entries.get(real, ()):
        if all(e.get(k) == v for k, v in key.items()) and isinstance(e.get("sha256"), str):
            return e["sha256"]
    return None


def _merge(entries: Dict[str, List[Dict[str, Any]]], new: Dict[str, Dict[str, Any]]
           ) -> Dict[str, List[Dict[str, Any]]]:
    """``entries`` with each new entry first in its path's list (same stat key replaced), lists cut to
    :data:`CACHE_VARIANTS_PER_PATH`, and the paths stored longest ago dropped beyond :data:`CACHE_MAX_PATHS`."""
    out = dict(entries)
    for real, entry in new.items():
        rest = [e for e in out.get(real, []) if any(e.get(k) != entry[k] for k in _STAT_FIELDS)]
        out[real] = [entry, *rest][:CACHE_VARIANTS_PER_PATH]
    if len(out) > CACHE_MAX_PATHS:
        newest = sorted(out, key=lambda p: max((e.get("stored", 0) for e in out[p]), default=0), reverse=True)
        out = {p: out[p] for p in newest[:CACHE_MAX_PATHS]}
    return out


#: A Hugging Face cache blob named by its content's sha256 (LFS files: ``blobs/<sha256>``; git-stored files are
#: named by their 40-hex git blob id instead, and are hashed).
HUB_BLOB = re.compile(r"^[0-9a-f]{64}$")
#: ``RUNNER_VERIFY_WEIGHTS=1``: read hub-named blobs too and check them against their names.
VERIFY_ENV = "RUNNER_VERIFY_WEIGHTS"


class WeightDigestError(UserInputError, OSError):
    """A Hugging Face cache blob whose content does not match the sha256 it is named by (a corrupt download);
    exit 2."""


def hub_blob_digest(real: str) -> Optional[str]:
    """The sha256 a Hugging Face cache already states for a file: its resolved path is
    ``<hub cache>/models--<org>--<name>/blobs/<64 hex>`` (huggingface_hub stores an LFS file under its sha256,
    the ``oid`` of its LFS pointer, and checks it on download), else None."""
    p = Path(real)
    if p.parent.name == "blobs" and p.parent.parent.name.startswith(("models--", "datasets--", "spaces--")) \
            and HUB_BLOB.match(p.name):
        return p.name
    return None


def _take_hub_names(items: List[Tuple[str, str, Dict[str, int]]], digests: Dict[str, str], stats: Dict[str, Any],
                    verify: bool) -> Dict[str, str]:
    """``{rel: sha256}`` of the files that resolve to hub blobs named by their sha256 (recorded in
    ``stats["hub_named"]``); unless ``verify``, taken into ``digests`` (nothing to read)."""
    named = {rel: d for rel, real, _ in items for d in [hub_blob_digest(real)] if d is not None}
    stats["hub_named"] = sorted(named)
    if not verify:
        digests.update(named)
    return named


def _check_named(named: Dict[str, str], digests: Dict[str, str]) -> List[str]:
    """The files of ``named`` (all of them, sorted) once each digest computed matches its blob's name.

    Raises:
        WeightDigestError: one does not (names the file, both digests and the fix).
    """
    for rel, want in named.items():
        if digests[rel] != want:
            raise WeightDigestError(f"{rel}: its content's sha256 is {digests[rel]}, not the {want} the Hugging Face "
                                    "cache names its blob by (a corrupt or truncated download); fix: delete that "
                                    "blob and the snapshot's link to it and download the file again "
                                    "(huggingface-cli download <repo> <file> --force-download)")
    return sorted(named)


def _lookup(items: List[Tuple[str, str, Dict[str, int]]], entries: Dict[str, List[Dict[str, Any]]],
            digests: Dict[str, str], stats: Dict[str, Any]) -> List[Tuple[str, str, Dict[str, int]]]:
    """Fill ``digests`` from the cache ``entries`` (recorded in ``stats["cached"]``); return the items still
    missing (those not in ``digests`` already and without a matching cache entry)."""
    todo = []
    for rel, real, key in items:
        if rel in digests:
            continue
        hit = _hit(entries, real, key)
        if hit is not None:
            digests[rel] = hit
            stats["cached"].append(rel)
        else:
            todo.append((rel, real, key))
    return todo


def _compute(todo: List[Tuple[str, str, Dict[str, int]]], digests: Dict[str, str],
             stats: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Read and hash ``todo`` into ``digests``; return the cache entries of the files whose stat did not change
    while they were read."""
    new = {}
    for rel, real, key in todo:
        digest = file_sha256(Path(real))
        digests[rel] = digest
        stats["computed"].append(rel)
        stats["bytes_hashed"] += key["size"]
        if _stat_key(os.stat(real)) == key:
            new[real] = {**key, "sha256": digest, "stored": time.time()}
        else:  # changed while read: the digest is this read's, but nothing durable may claim it
            log.warning("weight file %s changed while it was hashed; its digest is not cached", real)
    return new


def _hash_missing(items: List[Tuple[str, str, Dict[str, int]]], cache_dir: Path, cache_file: Optional[Path],
                  corrupt: bool, digests: Dict[str, str], stats: Dict[str, Any]) -> None:
    """Under the digest cache's lock: read the cache again (a concurrent rank may have just hashed the same
    files), hash what is still missing and merge the new digests into the cache file. A cache that cannot be
    locked or written leaves the digests correct and uncached (``stats["cache_file"]`` None), with a warning."""
    import filelock

    lock = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(cache_file) + ".lock")
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            log.info("waiting for another process hashing weight files (lock %s.lock)", cache_file)
            lock.acquire()
    except OSError as e:
        log.warning("weight digest cache %s cannot be used (%s): digests are computed and not cached",
                    cache_file, e)
        lock, cache_file = None, None
        stats["cache_file"] = None
    try:
        # what a concurrent process stored while this one waited (a corrupt file was already reported)
        entries = _read_cache(cache_file, warn=not corrupt)[0] if cache_file is not None else {}
        new = _compute(_lookup(items, entries, digests, stats), digests, stats)
        if new and cache_file is not None:
            try:
                _write_cache(cache_file, _merge(entries, new))
            except OSError as e:
                log.warning("weight digest cache %s cannot be written (%s): digests are not cached",
                            cache_file, e)
                stats["cache_file"] = None
    finally:
        if lock is not None:
            lock.release()


def hash_files(files: Iterable[Path], root: Path, cache_dir: Optional[Path] = None,
               verify: Optional[bool] = None) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """sha256 of each file, reusing digests cached by an earlier call (this process, another job, another rank).

    A file's cache key is its resolved path (a hub cache symlink counts as its blob) with its size in bytes,
    ``st_mtime_ns``, ``st_ctime_ns`` and inode: any change of size or modification time misses, and so does a
    rewrite whose modification time was restored (that moves the change time). The cache is one JSON file,
    ``<cache_dir>/weight_digests.json``. Lookups read it without a lock (it is only ever replaced atomically); on
    any miss the call takes ``weight_digests.json.lock`` (``filelock``), reads the cache again (a concurrent rank
    may have just hashed the same files), hashes what is still missing, and merges its digests into the file
    (temp file + ``os.replace``). Concurrent cold starts therefore hash each file once, not once per process. A
    digest is stored only if the file's stat did not change while it was read. A cache that cannot be read is
    ignored with a warning; one that cannot be written (read-only dir, no lock support) leaves the digests correct
    and uncached, with a warning. Files are read in 8 MiB chunks (:func:`runner.core.dataset.file_sha256`).

    A file that resolves to a Hugging Face cache blob named by its sha256 (:func:`hub_blob_digest`: every LFS file
    of a Hub snapshot, i.e. the weights) is not read at all: its name is its digest (a first job on a 30-60 GB
    snapshot reads nothing). With ``verify`` such files are hashed like any other (read, or found in the digest
    cache) and must match their names (:class:`WeightDigestError` otherwise).

    Args:
        files: the files to hash (e.g. :func:`weight_files`), all under ``root``.
        root: the snapshot directory; the keys of the result are relative to it.
        cache_dir: the runner cache dir (None: :func:`default_cache_dir`).
        verify: read hub-named blobs and check them (None: ``RUNNER_VERIFY_WEIGHTS`` is 1/true/yes).

    Returns:
        ``({relative posix path: sha256 hex}, stats)`` with stats ``{"computed": [rel...], "cached": [rel...],
        "hub_named": [rel...] (digests taken from hub blob names), "verified": [rel...] (of those, read and checked),
        "hash_s": wall seconds of the whole call, "bytes_hashed": bytes read to compute digests, "bytes_total":
        bytes of all the files, "cache_file": its path, or None when it could not be used}``.

    Raises:
        OSError: a file cannot be stat'ed or read (the weights are unusable).
        WeightDigestError: with ``verify``, a hub blob whose content does not match its name.
        ValueError: a file is not under ``root``.
    """
    verify = os.environ.get(VERIFY_ENV, "").strip().lower() in ("1", "true", "yes", "on") if verify is None else verify

    t0 = time.perf_counter()
    root = Path(root)
    items = []  # (rel, real path, stat key)
    for f in files:
        f = Path(f)
        rel = f.relative_to(root).as_posix()
        real = os.path.realpath(f)
        items.append((rel, real, _stat_key(os.stat(real))))
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_file: Optional[Path] = cache_dir / DIGEST_CACHE_NAME
    digests: Dict[str, str] = {}
    stats: Dict[str, Any] = {"computed": [], "cached": [], "hub_named": [], "verified": [], "bytes_hashed": 0,
                             "bytes_total": sum(k["size"] for _, _, k in items), "cache_file": str(cache_file)}
    named = _take_hub_names(items, digests, stats, verify)

    first, corrupt = _read_cache(cache_file)
    if _lookup(items, first, digests, stats):
        _hash_missing(items, cache_dir, cache_file, corrupt, digests, stats)
    stats["verified"] = _check_named(named, digests) if verify else []  # hashed like any file, then checked
    stats["hash_s"] = time.perf_counter() - t0
    return dict(sorted(digests.items())), stats


def hash_snapshot(snapshot: Path, cache_dir: Optional[Path] = None, verify: Optional[bool] = None
                  ) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """:func:`hash_files` over :func:`weight_files` of ``snapshot``: the manifest's ``model.source.files`` and
    ``model.source.hashing``.

    Raises:
        ModelPathError: see :func:`weight_files`.
        OSError: see :func:`hash_files`.
    """
    return hash_files(weight_files(snapshot), snapshot, cache_dir, verify)
