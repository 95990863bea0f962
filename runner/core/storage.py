"""Object storage for run dirs and dataset files, through fsspec (``s3://`` with s3fs, ``gs://`` with gcsfs, any
fsspec URL); local paths keep the plain file code of :mod:`runner.core.artifacts` (nothing here runs for them).

**A run dir on object storage** (``output.dir=s3://bucket/prefix``) is *mirrored*: the run works in a local
staging dir (the Hydra run dir: it holds the lock, the job log, and a copy of everything the run writes), and the
URL is the record. :class:`RunMirror` keeps the two consistent under one rule, **a record is published only after
the object it names exists with the recorded sha256**:

* an artifact is written locally as before (temp name, fsync, rename), then uploaded under a temporary key
  (``images/.<name>.tmp<pid>-<random>``), read back and hashed, moved to its final key (S3 has no rename: a
  server-side copy, which readers see whole or not at all, then the temp key deleted), and only then is its record
  appended to the local journal (:func:`publishing` wraps the sink's write function). A write interrupted at any
  point leaves at most a temp key (removed by the next run's :meth:`RunMirror.pull`) or a final object no record
  names (overwritten when its item is regenerated), never a record naming a missing or partial object;
* the control files (``items*.jsonl``, ``manifest*.json``, ``<stage>.jsonl``, ``<folder>/metadata.jsonl``,
  ``repro.sh``) are uploaded whole (one PUT each: readers see the old or the new object) at most every
  :data:`PUSH_EVERY_S` seconds at batch boundaries and at the run's end (:meth:`RunMirror.push`). The remote journal
  is therefore a prefix, at most that old, of the local one, which only holds records of published objects;
* a run (or resume) starts with :meth:`RunMirror.pull`: temp keys of a killed writer removed, the control files
  downloaded (the remote wins over what a reused staging dir holds), and every object an ok record names downloaded
  and hashed: a missing or different object leaves no local file, so the resume plan regenerates its item, exactly
  as a missing or modified local file does.

The staging dir can be removed once the run ended (the URL holds the run); ``python -m runner.repro <URL>`` pulls a
run into a temporary dir and compares from there.

**Claims on object storage** (:class:`ObjectClaimStore`): the claim protocol's exclusive create is a conditional
PUT (``If-None-Match: *``, S3 answers 412 when the key exists; s3fs ``pipe_file(mode="create")``), the holder's
lease renewal an overwrite conditional on the ETag it last wrote (``If-Match``): a renewal that finds its claim
overwritten by another writer fails instead of clobbering it.

**Credentials and endpoints** come from the filesystem's own configuration (for s3fs: botocore's environment and
files, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` for an S3-compatible server; fsspec's ``FSSPEC_S3_*`` variables
and config files for any keyword of the filesystem).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from runner.core.errors import StorageError, UserInputError
from runner.core.errors import install_fix

log = logging.getLogger("runner")

#: Seconds between two uploads of the control files during a run (at batch boundaries; the run's end always
#: uploads them): the remote journal lags the local one by at most this much.
PUSH_EVERY_S = 5.0
#: Objects downloaded (or verified) at once by :meth:`RunMirror.pull`.
PULL_THREADS = 8
#: The install line of the filesystems for object storage.
#: A temp key's name (``.<name>.tmp<pid>-<hex>``): what :meth:`RunMirror.remove_temp` deletes, nothing else.
TEMP_NAME = re.compile(r"\..+\.tmp\d+-[0-9a-f]+")
#: The artifact folders of a run dir (``runner.core.sinks``).
ARTIFACT_FOLDERS = ("images", "videos")

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


class StorageURLError(UserInputError, ValueError):
    """A URL the run cannot use: no filesystem installed for its scheme, or an unknown scheme (names the key, the
    URL and the fix)."""


def is_url(value: Any) -> bool:
    """Whether ``value`` is a URL of a filesystem other than the local one (``s3://``, ``gs://``...); ``file://``
    and plain paths are local."""
    m = _URL.match(str(value)) if value is not None else None
    return bool(m) and m.group(1).lower() not in ("file", "local")


def local_path(value: str) -> Path:
    """A local path given as a path or a ``file://`` URL."""
    s = str(value)
    m = _URL.match(s)
    return Path(s[len(m.group(0)):] if m else s).expanduser()


def filesystem(url: str, key: str = "output.dir") -> Tuple[Any, str]:
    """``(fsspec filesystem, root path in it)`` of ``url``, without cached instances or listings (other processes
    write the same keys).

    Raises:
        StorageURLError: the scheme's filesystem package is not installed, or the scheme is unknown.
    """
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:  # pragma: no cover - a dependency of the runner's dependencies
        raise StorageURLError(f"{key}={url!r}: fsspec is not installed; fix: {install_fix('storage')}") from None
    scheme = _URL.match(url).group(1).lower()
    if scheme not in known_implementations and scheme not in fsspec.available_protocols():
        raise StorageURLError(f"{key}={url!r}: no filesystem is known for {scheme}://; fix: an s3:// or gs:// URL "
                              "(or any fsspec protocol), or a local path")
    try:
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    except ImportError as e:
        raise StorageURLError(f"{key}={url!r}: the filesystem of {scheme}:// is not installed ({e}); fix: "
                              f"{install_fix('storage', 'for gs:// also pip install gcsfs')}") from None
    return fs, root.rstrip("/")


class StorageAccessError(UserInputError):
    """The store refuses this run at startup: no or wrong credentials, no permission, an endpoint that does not
    answer, a bucket that does not exist (names the key, the URL, what failed and the fix: the variables the
    filesystem reads its credentials and endpoint from). Exit 2, like every other bad input."""


#: Exception class names (anywhere in an error's MRO, or of an error it wraps) that mean the store could not be
#: reached or refused who asked: ``{name: kind}`` (botocore, aiohttp, google-auth, the builtins s3fs maps to).
ACCESS_ERRORS = {
    "NoCredentialsError": "credentials", "PartialCredentialsError": "credentials",
    "CredentialRetrievalError": "credentials", "NoAuthTokenError": "credentials", "TokenRetrievalError": "credentials",
    "UnauthorizedSSOTokenError": "credentials", "SSOTokenLoadError": "credentials", "ProfileNotFound": "credentials",
    "DefaultCredentialsError": "credentials", "RefreshError": "credentials",
    "PermissionError": "permission",
    "EndpointConnectionError": "endpoint", "ConnectTimeoutError": "endpoint", "ConnectionClosedError": "endpoint",
    "InvalidEndpointConfigurationError": "endpoint", "NoRegionError": "endpoint", "SSLError": "endpoint",
    "ClientConnectorError": "endpoint", "ServerDisconnectedError": "endpoint", "ConnectionRefusedError": "endpoint",
}
_ACCESS_WORDS = {"credentials": "no usable credentials", "permission": "permission denied",
                 "endpoint": "the endpoint cannot be reached"}


def access_kind(e: Optional[BaseException]) -> Optional[str]:
    """``credentials``, ``permission`` or ``endpoint`` when ``e`` (or an exception it wraps) says the store could
    not be reached or refused who asked (:data:`ACCESS_ERRORS`); None for any other error (a missing object)."""
    for _ in range(5):
        if e is None:
            return None
        for cls in type(e).__mro__:
            if cls.__name__ in ACCESS_ERRORS:
                return ACCESS_ERRORS[cls.__name__]
        e = e.__cause__ or e.__context__
    return None


def access_fix(url: str) -> str:
    """Where the filesystem of ``url`` reads its credentials and endpoint from (docs/object_storage.md)."""
    m = _URL.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme in ("s3", "s3a"):
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to credentials that may read and "
                "write the bucket, and AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL) for an S3-compatible server "
                "(docs/object_storage.md)")
    if scheme in ("gs", "gcs"):
        return ("set GOOGLE_APPLICATION_CREDENTIALS to a key file with access to the bucket, or run gcloud auth "
                "application-default login (docs/object_storage.md)")
    return (f"give the {scheme}:// filesystem its credentials and endpoint (fsspec's FSSPEC_{scheme.upper()}_<KEYWORD> "
            "variables or config files; docs/object_storage.md)")


def access_refusal(key: str, url: str, e: BaseException) -> Optional[StorageAccessError]:
    """The refusal of a request to ``url`` (config key ``key``) made at startup that failed for want of
    credentials, permission or an endpoint (:func:`access_kind`); None when ``e`` is another failure."""
    kind = access_kind(e)
    if kind is None:
        return None
    return StorageAccessError(f"{key}={url!r}: object storage refused the request: {_ACCESS_WORDS[kind]} "
                              f"({type(e).__name__}: {e})", fix=access_fix(url))


def check_access(fs: Any, root: str, url: str, key: str) -> None:
    """One request at startup, before anything of the run is built (the metadata of the URL's bucket): missing
    credentials, permission or endpoint are refused here naming ``key``, ``url`` and the fix, instead of failing
    the run's first upload.

    Raises:
        StorageAccessError: the request failed for want of credentials, permission or an endpoint, or the bucket
            (the URL's first path segment) does not exist; StorageError: any other failure of the request.
    """
    bucket = root.split("/", 1)[0]
    try:
        fs.info(bucket)
    except FileNotFoundError:
        raise StorageAccessError(f"{key}={url!r}: the bucket {bucket!r} does not exist at the store's endpoint",
                                 fix="create the bucket or name an existing one; for an S3-compatible server check "
                                     "AWS_ENDPOINT_URL_S3 (docs/object_storage.md)") from None
    except Exception as e:  # noqa: BLE001 - classified: a refusal, or the store's failure
        raise (access_refusal(key, url, e) or storage_failure("reaching", url, e)) from None


def storage_failure(what: str, where: str, e: BaseException) -> StorageError:
    """A :class:`runner.core.errors.StorageError` for an object-storage request that failed (not an item's fault:
    the run stops, what was published is kept)."""
    return StorageError(f"{what} {where} failed ({type(e).__name__}: {e})",
                        fix="check the bucket, the credentials and the endpoint (AWS_ENDPOINT_URL_S3 for an "
                            "S3-compatible server), then re-run the same command: published items are kept")


def object_sha256(fs: Any, path: str, chunk_bytes: int = 8 << 20) -> Optional[str]:
    """sha256 of the object at ``path`` as read back from the store; None when there is none."""
    h = hashlib.sha256()
    try:
        with fs.open(path, "rb", block_size=chunk_bytes, cache_type="none") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
    except FileNotFoundError:
        return None
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- dataset input
def fetch(url: str, cache_dir: Optional[Path] = None, key: str = "dataset.path") -> Path:
    """Download the object ``url`` (a dataset file) into the local cache and return the copy's path; the copy is
    replaced atomically on every call (the object may have changed), so the run hashes what it reads.

    Args:
        cache_dir: where copies go (default ``$RUNNER_CACHE`` or ``~/.cache/runner``), under ``remote/<sha of the
            URL>/<name>``.

    Raises:
        StorageURLError: the scheme cannot be read here; StorageAccessError: no credentials, permission or
            endpoint (:func:`access_refusal`); FileNotFoundError: there is no such object.
    """
    fs, path = filesystem(url, key)
    base = cache_dir or Path(os.environ.get("RUNNER_CACHE") or "~/.cache/runner").expanduser()
    dest = base / "remote" / hashlib.sha256(url.encode()).hexdigest()[:16] / (Path(path).name or "data")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fs.get_file(path, str(tmp))
        os.replace(tmp, dest)
    except Exception as e:  # noqa: BLE001 - credentials, permission, endpoint: a refusal; anything else as is
        refusal = access_refusal(key, url, e)
        if refusal is not None:
            raise refusal from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# --------------------------------------------------------------------------------------------- run mirror
class RunMirror:
    """The remote copy of a run dir (``url``) kept consistent with its local staging dir ``local`` (module
    docstring: publish before journaling, control files pushed whole, pull at the start).

    Raises (every method): :class:`runner.core.errors.StorageError` when the store refuses a request.
    """

    def __init__(self, local: Path, url: str, key: str = "output.dir") -> None:
        self.local, self.url, self.key = Path(local), str(url).rstrip("/"), key
        self.fs, self.root = filesystem(self.url, key)
        self.last_push = 0.0
        self.published = 0

    def remote(self, rel: str) -> str:
        """The store path of run-dir-relative ``rel``."""
        return f"{self.root}/{rel}"

    # ----------------------------------------------------------------------------------------- publish
    def publish(self, rel: str, sha256: str) -> None:
        """Upload the local file ``rel`` under a temp key, check the object read back has ``sha256``, move it to
        its final key (readers never see a partial object there) and delete the temp key.

        Raises:
            runner.core.errors.StorageError: a request failed, or the object read back differs (the temp key is
                removed; the final key is left as it was).
        """
        from runner.core.testing import publish_pause

        final = self.remote(rel)
        tmp = f"{final.rsplit('/', 1)[0]}/.{final.rsplit('/', 1)[1]}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.put_file(str(self.local / rel), tmp)
            publish_pause(rel)  # test-only: a kill here leaves the temp object alone (no-op in real runs)
            got = object_sha256(self.fs, tmp)
            if got != sha256:
                raise StorageError(f"{tmp} read back as sha256 {got}, the file written has {sha256}",
                                   fix="check the store (a proxy or a full bucket altering uploads), then re-run")
            self.fs.mv(tmp, final)
        except StorageError:
            self._drop(tmp)
            raise
        except Exception as e:  # noqa: BLE001 - any request failure is the store's, not the item's
            self._drop(tmp)
            raise storage_failure("publishing", f"{self.local / rel} to {final}", e) from e
        self.published += 1

    def _drop(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except (OSError, ValueError):
            pass

    # -------------------------------------------------------------------------------------- control files
    def control_files(self) -> List[str]:
        """Run-dir-relative names of the local control files (journals, manifests, folder indexes, repro.sh)."""
        d = self.local
        names = [p.name for p in sorted(d.glob("*.jsonl")) + sorted(d.glob("manifest*.json")) if p.is_file()]
        names += [n for n in ("repro.sh", "repro_check.json") if (d / n).is_file()]
        names += [f"{f}/metadata.jsonl" for f in ARTIFACT_FOLDERS if (d / f / "metadata.jsonl").is_file()]
        return names

    def remote_control_files(self) -> List[str]:
        """Run-dir-relative names of the control files at the URL."""
        out = []
        try:
            for pattern in ("*.jsonl", "manifest*.json", "repro.sh", "repro_check.json",
                            *(f"{f}/metadata.jsonl" for f in ARTIFACT_FOLDERS)):
                out += [p[len(self.root) + 1:] for p in self.fs.glob(self.remote(pattern))]
        except Exception as e:  # noqa: BLE001
            raise storage_failure("listing", self.url, e) from e
        return sorted(set(out))

    def push(self, force: bool = False) -> bool:
        """Upload the control files (each one whole PUT) and delete the remote ones the local dir no longer has
        (a folder index or ``items.unlisted.jsonl`` a compaction removed). Without ``force``, only when
        :data:`PUSH_EVERY_S` passed since the last push. Returns whether it pushed."""
        now = time.monotonic()
        if not force and now - self.last_push < PUSH_EVERY_S:
            return False
        names = self.control_files()
        try:
            for rel in names:
                self.fs.pipe_file(self.remote(rel), (self.local / rel).read_bytes())
            for rel in set(self.remote_control_files()) - set(names):
                self.fs.rm_file(self.remote(rel))
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise storage_failure("uploading the journal and manifest to", self.url, e) from e
        self.last_push = time.monotonic()
        return True

    # -------------------------------------------------------------------------------------------- pull
    def remove_temp(self) -> List[str]:
        """Delete the temp keys (:data:`TEMP_NAME`) a killed writer left at the URL; returns their names."""
        gone = []
        for sub in ("", *ARTIFACT_FOLDERS):
            base = self.remote(sub) if sub else self.root
            try:
                found = self.fs.glob(f"{base}/.*.tmp*")
            except FileNotFoundError:
                continue
            for p in found:
                if TEMP_NAME.fullmatch(p.rsplit("/", 1)[1]):
                    self._drop(p)
                    gone.append(p[len(self.root) + 1:])
        return gone

    def pull(self, recorded: Callable[[Path], Dict[str, str]]) -> Dict[str, int]:
        """Make the staging dir the URL's run (module docstring): temp keys removed, control files downloaded
        (local ones the URL lacks removed), every object an ok record names downloaded and checked against the
        record's sha256 (a missing or different one leaves no local file: its item is regenerated).

        Args:
            recorded: ``{run-dir-relative file: sha256}`` of what the journals of a run dir record
                (``runner.core.sinks.recorded_files``), read once the control files are here.

        Returns:
            ``{"temp_removed", "control_files", "objects", "objects_missing"}`` counts.
        """
        self.local.mkdir(parents=True, exist_ok=True)
        try:
            gone = self.remove_temp()
            names = self.remote_control_files()
            for rel in names:
                self._download(rel)
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - the run's start: credentials, permission, endpoint are refusals
            raise (access_refusal(self.key, self.url, e) or storage_failure("reading the run at", self.url, e)) from e
        for p in list(self.local.glob("*.jsonl")) + list(self.local.glob("manifest*.json")):
            if p.name not in names:  # the remote is the record: a staging dir's own leftovers go
                p.unlink()
        wanted = recorded(self.local)
        missing = self._download_verified(wanted)
        if gone:
            log.info("object storage: removed %d temp object(s) a killed writer left at %s", len(gone), self.url)
        return {"temp_removed": len(gone), "control_files": len(names), "objects": len(wanted) - missing,
                "objects_missing": missing}

    def _download(self, rel: str, chunk_bytes: int = 8 << 20) -> str:
        """Download ``rel`` into the staging dir (temp name, then rename), hashing the bytes as they come; returns
        their sha256."""
        dest = self.local / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}-{uuid.uuid4().hex[:8]}")
        h = hashlib.sha256()
        try:
            with self.fs.open(self.remote(rel), "rb", block_size=chunk_bytes, cache_type="none") as src, \
                    open(tmp, "wb") as f:
                while chunk := src.read(chunk_bytes):
                    h.update(chunk)
                    f.write(chunk)
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return h.hexdigest()

    def _download_verified(self, wanted: Dict[str, str]) -> int:
        """Download each ``{rel: sha256}``; a missing object, or one whose bytes differ, leaves no local file.
        Returns how many were missing or different."""

        def one(item: Tuple[str, str]) -> bool:
            rel, sha = item
            try:
                ok = self._download(rel) == sha
            except FileNotFoundError:
                ok = False
            except Exception as e:  # noqa: BLE001
                raise storage_failure("downloading", self.remote(rel), e) from e
            if not ok:
                (self.local / rel).unlink(missing_ok=True)
            return ok

        with ThreadPoolExecutor(PULL_THREADS) as pool:
            results = list(pool.map(one, sorted(wanted.items())))
        bad = results.count(False)
        if bad:
            log.warning("object storage: %d object(s) named by ok records at %s are missing or differ from their "
                        "records; their items are regenerated", bad, self.url)
        return bad

    def section(self) -> Dict[str, Any]:
        """The manifest's ``storage`` section: where the run is, the rule, the staging dir."""
        return {"url": self.url, "staging_dir": str(self.local), "protocol": self.url.split("://", 1)[0],
                "consistency": "records published only after their object exists with the recorded sha256 "
                               "(temp key, read back, moved); control files uploaded whole",
                "push_every_s": PUSH_EVERY_S}


_MIRRORS: Dict[str, RunMirror] = {}  # resolved staging dir -> its mirror


def _key(local: Path) -> str:
    return str(Path(local).resolve())


def attach(local: Path, url: str, key: str = "output.dir") -> RunMirror:
    """The mirror of staging dir ``local`` to ``url`` (created once per process and dir; :func:`mirror_of` finds
    it from the staging dir)."""
    k = _key(local)
    m = _MIRRORS.get(k)
    if m is None or m.url != str(url).rstrip("/"):
        m = _MIRRORS[k] = RunMirror(local, url, key)
    return m


def detach(local: Path) -> None:
    """Forget the mirror of ``local`` (the run ended)."""
    _MIRRORS.pop(_key(local), None)


def mirror_of(local: Path) -> Optional[RunMirror]:
    """The mirror of staging dir ``local`` (None: a plain local run dir)."""
    return _MIRRORS.get(_key(local)) if _MIRRORS else None


def target(cfg: Any) -> Optional[Tuple[str, str]]:
    """``(URL, config key)`` when the run's dir (``run.resume`` or ``output.dir``) is an object-storage URL, else
    None."""
    from omegaconf import OmegaConf

    for key in ("run.resume", "output.dir"):
        v = OmegaConf.select(cfg, key)
        if v:
            return (str(v), key) if is_url(v) else None
    return None


def run_dir(cfg: Any, default: Path) -> Path:
    """The local run dir of ``cfg``: ``run.resume`` or ``output.dir`` when it is a local path, else ``default``
    (the Hydra run dir, which stages a run whose dir is a URL)."""
    from omegaconf import OmegaConf

    given = OmegaConf.select(cfg, "run.resume") or OmegaConf.select(cfg, "output.dir")
    if not given or is_url(given):
        return Path(default)
    return local_path(str(given))


def publishing(out_dir: Path, write: Callable[[Path, Any], Dict[str, Any]]
               ) -> Callable[[Path, Any], Dict[str, Any]]:
    """The sink write function ``write`` followed, when ``out_dir`` is mirrored, by :meth:`RunMirror.publish` of
    the artifact (and of its frame dump, ``fields.frames_file``), so that the writer journals a record only after
    its objects are published; ``write`` itself for a plain local run dir."""
    mirror = mirror_of(out_dir)
    if mirror is None:
        return write

    def write_and_publish(path: Path, payload: Any) -> Dict[str, Any]:
        res = write(path, payload)
        mirror.publish(str(Path(path).relative_to(mirror.local)), res["sha256"])
        fields = res.get("fields") or {}
        if fields.get("frames_file"):
            mirror.publish(fields["frames_file"], fields["frames_file_sha256"])
        return res

    return write_and_publish


def check_target(cfg: Any, url: str, key: str) -> None:
    """Refuse, at startup, what an object-storage run dir does not support, and a URL no filesystem here reads.

    Raises:
        StorageURLError: ``run.resume`` given a URL (a run at a URL resumes by running the same command again with
            ``output.dir=<URL>``), a parallelism mode other than ``single`` (the data-parallel merge and the claims
            run read their workers' journals in a shared POSIX dir), or the URL's filesystem is missing;
        StorageAccessError: the store cannot be used: no credentials, permission, endpoint or bucket
            (:func:`check_access`).
    """
    from omegaconf import OmegaConf

    if key == "run.resume":
        raise StorageURLError(f"run.resume={url!r}: run.resume takes a local run dir; fix: run the same command "
                              f"again with output.dir={url} (a run at a URL resumes from what the URL holds)")
    mode = str(OmegaConf.select(cfg, "parallelism.mode"))
    if mode != "single":
        raise StorageURLError(f"{key}={url!r} with parallelism.mode={mode}: an object-storage run dir takes "
                              "parallelism=single (the data-parallel merge and the claims run read their workers' "
                              "journals in a shared POSIX dir); fix: parallelism=single, or a shared POSIX run dir")
    check_access(*filesystem(url, key), url, key)
