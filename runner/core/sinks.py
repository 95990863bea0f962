"""Output sinks and the one reader of journals (``items.jsonl``, ``items.rank<r>.jsonl``, ``<stage>.jsonl``).

A sink turns a stage's outputs into durable files plus journal lines, in that order: ``submit(record, output)``
writes the artifact (temp name, fsync, rename) and only then appends the record (flushed, fsynced), so a journal
line never names a file that is not complete. ``verify(record)`` says whether a journaled artifact is still the one
recorded (resume: :func:`artifact_intact`); ``close()`` finishes every queued write. A new output kind (parquet,
webdataset) is a new sink class and an entry in :data:`SINKS` (engine ``output`` kind -> sink): ``image``
(:class:`ImageSink`), ``video`` (MP4), ``text`` (journal records). A new image file format is one
:class:`ImageFormat` record in :data:`IMAGE_FORMATS` (``output.image_format`` picks it; ``png`` by default). Every file sink checks the artifact it wrote against its record
(:func:`check_artifact_dims`: width, height, frame count equal the record's ``params``) before it is renamed into
place, so no engine can journal a record that disagrees with its file.

Class attributes the run loop reads: ``threaded`` (the constructor takes ``workers``/``max_pending``: artifacts
are encoded on writer threads), ``config_keys`` (run-config keys that change the artifacts: a resume with other
values is refused, like the semantic keys of ``runner.core.resume``); classmethods ``options(cfg)`` (constructor
arguments from the run config) and ``identity(cfg)`` (what encodes the artifacts, added to the run identity;
None: nothing beyond the packages already recorded; may raise a ``runner.core.errors.RunnerError`` at startup).
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from runner.core.artifacts import ArtifactWriter, Journal, atomic_write_bytes, encode_png
from runner.core.dataset import file_sha256
from runner.core.errors import ConfigValueError, RunnerError
from runner.core.media import digests
from runner.core.storage import publishing


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


#: The per-folder index of artifacts (Hugging Face ``imagefolder``/``videofolder`` convention): one JSON line per
#: artifact of the folder, ``file_name`` relative to the folder.
FOLDER_METADATA = "metadata.jsonl"

#: The text fields embedded in every artifact (PNG text chunks, the MP4 ``comment`` as JSON), in this order.
EMBEDDED_FIELDS = ("prompt", "negative_prompt", "seed", "parameters", "model")
#: Record ``params`` kept out of the embedded ``parameters`` (:func:`embedded_params`): the batch composition
#: (``batch_size``) and each LoRA adapter's ``name`` (a label; the adapter is its ``sha256`` and ``scale``). They
#: stay in ``items.jsonl`` and ``metadata.jsonl``; an item at batch 1 and at batch 4 whose pixels are equal has
#: equal file bytes. Part of the sinks' identity, so files that embedded them are regenerated, not reused.
NOT_EMBEDDED = ("batch_size", "lora.name")


def embedded_params(params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A record's ``params`` as an artifact embeds them: without :data:`NOT_EMBEDDED` (``batch_size``; ``lora``
    entries as ``{sha256, scale}``). Other values unchanged."""
    out = {k: v for k, v in (params or {}).items() if k != "batch_size"}
    if isinstance(out.get("lora"), list):
        out["lora"] = [{k: v for k, v in d.items() if k != "name"} if isinstance(d, dict) else d
                       for d in out["lora"]]
    return out


def embedded_fields(record: Dict[str, Any], model: Optional[str]) -> Dict[str, str]:
    """What an artifact carries about itself, as text: ``prompt``, ``negative_prompt`` (left out when none was
    applied), ``seed``, ``parameters`` (the record's ``params`` as applied, JSON with sorted keys, without the batch
    composition and LoRA names: :func:`embedded_params`) and ``model`` (the model name; left out when None).

    Every value is a function of the item's inputs as ``runner.core.resume.item_inputs`` counts them, so equal inputs
    still give equal bytes: neither the row id (it names the file) nor the run's id (a new uuid per process) is
    embedded; both are in ``metadata.jsonl``.
    """
    out = {"prompt": str(record.get("prompt") or "")}
    if record.get("negative_prompt") is not None:
        out["negative_prompt"] = str(record["negative_prompt"])
    out["seed"] = str(record.get("seed"))
    out["parameters"] = json.dumps(embedded_params(record.get("params")), sort_keys=True, default=str)
    if model is not None:
        out["model"] = str(model)
    if record.get("inputs"):  # a conditioned item: its input files by sha256 (their paths are not embedded)
        out["inputs"] = json.dumps(digests(record["inputs"]), sort_keys=True)
    return out


def input_file_name(inputs: Optional[Dict[str, Any]]) -> Any:
    """``metadata.jsonl``'s ``input_file_name`` of a conditioned record: the path of its ``image`` input (a list for
    a list of references); None without one."""
    img = (inputs or {}).get("image")
    if img is None:
        return None
    paths = [None if str(x["path"]).startswith("<") else x["path"] for x in (img if isinstance(img, list) else [img])]
    return paths if isinstance(img, list) else paths[0]  # None: an image cell's bytes (no file)


def folder_metadata_row(record: Dict[str, Any], model: Optional[str], run_id: Optional[str]) -> Dict[str, Any]:
    """One ``metadata.jsonl`` line of an ok record: ``file_name`` (relative to the artifact's folder), ``id``,
    ``key``, ``prompt``, ``negative_prompt``, ``seed``, ``parameters`` (an object: the params as applied), ``model``,
    ``run_id`` (the manifest's ``run_id`` of the run whose ``items.jsonl`` lists it), ``file_sha256``; a video's
    ``num_frames`` and ``fps``; the record's ``meta`` and ``metrics`` (per-item scores) when it has them; a
    conditioned item's ``input_file_name`` (the path of its ``image`` input) and ``inputs`` (``{field: sha256}``)."""
    row: Dict[str, Any] = {"file_name": record.get("file_name") or Path(record["file"]).name,
                           "id": record.get("id"), "key": record.get("key"), "prompt": record.get("prompt"),
                           "negative_prompt": record.get("negative_prompt"), "seed": record.get("seed"),
                           "parameters": record.get("params") or {}, "model": model, "run_id": run_id,
                           "file_sha256": record.get("file_sha256")}
    for k in ("num_frames", "fps", "meta", "metrics"):
        if record.get(k) is not None:
            row[k] = record[k]
    if record.get("inputs"):
        row["input_file_name"] = input_file_name(record["inputs"])
        row["inputs"] = digests(record["inputs"])
    return row


def write_folder_metadata(out_dir: Path, records: Sequence[Dict[str, Any]], model: Optional[str],
                          run_id: Optional[str], folders: Sequence[str] = ("images", "videos")) -> Dict[str, int]:
    """Write ``<folder>/metadata.jsonl`` (:data:`FOLDER_METADATA`) for each artifact folder of the run dir from the
    run's journal records, atomically: one line per ok record whose ``file`` lies in that folder, in journal order
    (:func:`folder_metadata_row`). ``datasets.load_dataset("imagefolder", data_dir=<run>/images)`` then yields
    each image with its prompt, seed and parameters; files of the folder that no line names (an earlier run's,
    listed in ``items.unlisted.jsonl``) are skipped by that loader.

    Called after every compaction of ``items.jsonl`` (the run's end, the data-parallel merge), so the file lists
    exactly the journal's ok items; a folder with none gets its stale ``metadata.jsonl`` removed.

    Returns:
        ``{"<folder>/metadata.jsonl": lines written}``.

    Raises:
        runner.core.errors.StorageError: the storage refused the write.
    """
    out_dir = Path(out_dir)
    rows: Dict[str, List[Dict[str, Any]]] = {f: [] for f in folders}
    for r in records:
        f = r.get("file")
        if r.get("status") == "ok" and f and Path(f).parts[0] in rows and len(Path(f).parts) > 1:
            rows[Path(f).parts[0]].append(folder_metadata_row(r, model, run_id))
    written: Dict[str, int] = {}
    for folder, lines in rows.items():
        path = out_dir / folder / FOLDER_METADATA
        if not path.parent.is_dir():  # no artifact there (records that name files elsewhere)
            continue
        if lines:
            atomic_write_bytes(path, "".join(json.dumps(x) + "\n" for x in lines).encode())
            written[f"{folder}/{FOLDER_METADATA}"] = len(lines)
        elif path.exists():
            path.unlink()
    return written


def recorded_files(out_dir: Path) -> Dict[str, str]:
    """``{run-dir-relative file: sha256}`` of every artifact (``file``) and frame dump (``frames_file``) that an ok
    record of a journal of ``out_dir`` (``*.jsonl``) names; a later record of a file wins."""
    out: Dict[str, str] = {}
    for p in sorted(Path(out_dir).glob("*.jsonl")):
        for r in read_journal(p):
            if r.get("status") == "ok":
                for name, sha in (("file", "file_sha256"), ("frames_file", "frames_file_sha256")):
                    if r.get(name) and r.get(sha):
                        out[r[name]] = r[sha]
    return out


class ArtifactMismatchError(RunnerError, ValueError):
    """The written artifact disagrees with its record: its width, height or frame count is not the record's
    ``params`` value (an engine whose pipeline changed the size it was asked for). Never ends a run: the item fails
    alone with this as its ``reason`` (``status: failed``) and no file is left under the artifact's name."""


#: artifact dimension -> the record ``params`` key it must equal (every sink, every engine; ``audio_sample_rate``:
#: a video's audio stream, as decoded).
ARTIFACT_DIMS = ("width", "height", "num_frames", "audio_sample_rate")


def check_artifact_dims(record: Dict[str, Any], dims: Dict[str, int], path: Path) -> None:
    """Check that the dimensions of the artifact as written (``dims``: ``width``/``height`` in pixels and, for a
    video, ``num_frames``, read back from the file) equal the record's ``params`` of the same name; a key the
    params lack is not checked (an engine that records no size).

    Raises:
        ArtifactMismatchError: naming each field with the record's and the artifact's value.
    """
    params = record.get("params") or {}
    bad = [f"{k}: record {params[k]!r}, artifact {dims[k]!r}" for k in ARTIFACT_DIMS
           if k in dims and params.get(k) is not None and params[k] != dims[k]]
    if bad:
        raise ArtifactMismatchError(
            f"{path.name} as written disagrees with its record's params ({'; '.join(bad)}): the engine's output "
            "is not the size it recorded; the item is failed, not written (an engine or pipeline size rule to fix)")


def artifact_intact(out_dir: Path, record: Dict[str, Any]) -> bool:
    """An ok record whose artifact ``file`` exists with the recorded ``file_sha256`` and, when it names a frame
    dump (``frames_file``), that file exists with ``frames_file_sha256``."""
    if record.get("status") != "ok" or not record.get("file"):
        return False
    for name, sha in (("file", "file_sha256"), ("frames_file", "frames_file_sha256")):
        if name == "file" or record.get(name):
            f = Path(out_dir) / record[name]
            if not f.is_file() or file_sha256(f) != record.get(sha):
                return False
    return True


class Sink(Protocol):
    """Where one stage's outputs go. ``submit`` never loses a produced output: a write error becomes a
    ``status: failed`` record naming it."""

    journal_name: str

    def submit(self, record: Dict[str, Any], output: Any) -> None: ...

    def drain(self) -> None: ...

    def verify(self, record: Dict[str, Any]) -> bool: ...

    def close(self) -> None: ...


class _Counting:
    """Shared bookkeeping: counts per status and the records written ok in this process; the defaults of the
    class attributes and classmethods the run loop reads (see the module docstring)."""

    threaded = False
    config_keys: tuple = ()

    @classmethod
    def options(cls, cfg: Any) -> Dict[str, Any]:
        """No constructor arguments from the run config."""
        return {}

    @classmethod
    def identity(cls, cfg: Any) -> Optional[Dict[str, Any]]:
        """Nothing to add to the run identity."""
        return None

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


class _FileSink(_Counting):
    """A sink of one file per item under ``out_dir/<subdir>``, encoded and written on ``workers`` threads while the
    next batch generates (:class:`runner.core.artifacts.ArtifactWriter`): the shared part of :class:`ImageSink` and
    :class:`MP4Sink`. Subclasses set ``subdir``/``suffix`` and give ``_payload(record, output)``: the writer's
    payload, or a failure reason."""

    subdir = ""
    suffix = ""
    threaded = True

    def __init__(self, out_dir: Path, journal_name: str, workers: int, max_pending: int,
                 on_record: Optional[Callable[[Dict[str, Any]], None]],
                 write: Optional[Callable[[Path, Any], Dict[str, Any]]] = None) -> None:
        super().__init__(on_record)
        self.out_dir = Path(out_dir)
        self.journal_name = journal_name
        self.dir = self.out_dir / self.subdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.out_dir / journal_name)
        # a run dir at an object-storage URL: each artifact is published there before its record is journaled
        write = publishing(self.out_dir, write or ArtifactWriter.write_png)
        self.writer = ArtifactWriter(self.journal, workers, self._recorded, max_pending=max_pending, write=write)

    def _payload(self, record: Dict[str, Any], output: Any, path: Path) -> Tuple[Any, Optional[str]]:
        raise NotImplementedError

    def submit(self, record: Dict[str, Any], output: Any) -> None:
        """Queue one item's output (or the exception that failed it); the file is named by
        ``runner.core.dataset.safe_stem`` of the record's ``key``. A non-finite output is refused (``status: failed``,
        the count of bad values as reason) and never written."""
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
        from runner.core.dataset import safe_stem

        path = self.dir / f"{safe_stem(record['key'])}{self.suffix}"
        payload, reason = self._payload(record, output, path)
        if reason is not None:
            record.update(status="failed", file=None, reason=reason)
            self.writer.submit(record)
            return
        self.writer.submit(record, path, payload, str(path.relative_to(self.out_dir)), str(path.relative_to(self.dir)))

    def verify(self, record: Dict[str, Any]) -> bool:
        """The record says ok and its files exist with the recorded sha256 (:func:`artifact_intact`)."""
        return artifact_intact(self.out_dir, record)

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


@dataclass(frozen=True)
class ImageFormat:
    """One image file format of :class:`ImageSink` (``output.image_format``).

    Attributes:
        name: the ``output.image_format`` value.
        suffix: the file suffix (``.png``).
        encode: ``encode(image, text) -> bytes``: an HWC float image in [0, 1] and the text fields to embed
            (:func:`embedded_fields`) as the file's bytes, a function of the pixels and the text only (equal inputs,
            equal bytes: resume and repro compare sha256s). PIL must read the bytes back (the written size is checked
            against the record, :func:`check_artifact_dims`).
        lossless: the file decodes to exactly ``runner.core.artifacts.to_uint8`` of the image.
    """

    name: str
    suffix: str
    encode: Callable[[Any, Dict[str, str]], bytes]
    lossless: bool = True


#: ``output.image_format`` -> record; a new image format is one entry (:class:`ImageFormat`).
IMAGE_FORMATS: Dict[str, ImageFormat] = {"png": ImageFormat("png", ".png", encode_png)}


def image_format_record(name: Any) -> ImageFormat:
    """The record of ``output.image_format`` = ``name``.

    Raises:
        runner.core.errors.ConfigValueError: no such format (at startup: the sink's identity is computed before any
            weight loads); the message lists the registered ones.
    """
    fmt = IMAGE_FORMATS.get(str(name))
    if fmt is None:
        raise ConfigValueError(f"output.image_format={name!r} is not a registered image format; fix: one of "
                               f"{', '.join(sorted(IMAGE_FORMATS))} (a new one is an ImageFormat record in "
                               "runner.core.sinks.IMAGE_FORMATS)")
    return fmt


class ImageSink(_FileSink):
    """Images as files ``images/<stem><suffix>`` of an :class:`ImageFormat` (lossless PNG by default), encoded and
    written on ``workers`` threads while the next batch generates (:class:`runner.core.artifacts.ArtifactWriter`).
    Each file carries text fields (:func:`embedded_fields`: prompt, negative prompt, seed, parameters as JSON, model;
    PNG text chunks, ``PIL.Image.open(f).text`` reads them), all functions of the item's inputs, so equal pixels and
    inputs still give equal bytes.

    ``submit(record, output)``: ``output`` is a :class:`models.base.ImageOutput`, or the exception that failed the
    item; a non-finite image is refused (``status: failed``, the count of bad values as reason) and never written.
    The record gets ``status``, ``file`` (relative to the run dir), ``file_name`` (relative to ``images/``) and
    ``file_sha256`` once the file is in place. An image whose size is not the record's ``params.width``/``height``
    is not written: the item fails with an :class:`ArtifactMismatchError` naming both (:func:`check_artifact_dims`).

    Args:
        out_dir: the run dir; images go to ``out_dir/images``.
        journal_name: the journal file in ``out_dir`` (``items.jsonl``, or a worker's ``items.rank<r>.jsonl``).
        workers: encoder threads (0: inline).
        max_pending: outputs held before ``submit`` waits (bounds host memory: a 1024x1024 float32 image is 12 MiB).
        on_record: called in the caller's thread with each record once it is journaled.
        model: the model name embedded in each file (None: not embedded).
        image_format: a key of :data:`IMAGE_FORMATS`.

    Raises:
        runner.core.errors.ConfigValueError: an unknown ``image_format``.
    """

    subdir = "images"

    def __init__(self, out_dir: Path, journal_name: str = "items.jsonl", workers: int = 0, max_pending: int = 16,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None, model: Optional[str] = None,
                 image_format: str = "png") -> None:
        self.model = model
        self.format = image_format_record(image_format)
        self.suffix = self.format.suffix
        super().__init__(out_dir, journal_name, workers, max_pending, on_record, write=self._write)

    @classmethod
    def options(cls, cfg: Any) -> Dict[str, Any]:
        """``model`` from ``model.name``, ``image_format`` from ``output.image_format``."""
        return {"model": str(cfg.model.name), "image_format": str(cfg.output.image_format)}

    @classmethod
    def identity(cls, cfg: Any) -> Dict[str, Any]:
        """The text fields each file embeds (a file written before they were embedded is not reused), and the image
        format when it is not ``png`` (so a PNG run's identities are those of runs before formats were a choice).

        Raises:
            runner.core.errors.ConfigValueError: an unknown ``output.image_format``.
        """
        fmt = image_format_record(cfg.output.image_format)
        out: Dict[str, Any] = {"png_text": list(EMBEDDED_FIELDS), "not_embedded": list(NOT_EMBEDDED)}
        if fmt.name != "png":
            out["image_format"] = fmt.name
        return out

    def _payload(self, record: Dict[str, Any], output: Any, path: Path) -> Tuple[Any, Optional[str]]:
        return (output.image, embedded_fields(record, self.model), record), None

    def _write(self, path: Path, payload: Any) -> Dict[str, Any]:
        """Encode the image (:attr:`ImageFormat.encode`), read its size back from the encoded bytes and check it
        against the record's params (:func:`check_artifact_dims`) before the file is written (temp name, fsync,
        rename)."""
        import hashlib
        import io

        from PIL import Image

        image, text, record = payload
        data = self.format.encode(image, text)
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
        check_artifact_dims(record, {"width": width, "height": height}, path)
        atomic_write_bytes(path, data)
        return {"sha256": hashlib.sha256(data).hexdigest()}


class MP4Sink(_FileSink):
    """Videos as MP4 files ``videos/<stem>.mp4`` (``runner.core.video``: H.264, ``output.video_codec``), encoded on writer
    threads like :class:`ImageSink`'s images, with the same crash-safety order (temp name, fsync, rename, then the
    journal line). Every written file is decoded back and checked before it is renamed into place: every pixel
    for a lossless codec, and its width, height and frame count against the record's ``params``
    (:func:`check_artifact_dims`; a mismatch fails the item with an :class:`ArtifactMismatchError` naming both,
    and no file is left).

    ``output`` is a :class:`models.base.VideoOutput` (float32 frames (F, H, W, 3) in [0, 1]) or the exception that
    failed the item; a video holding NaN/inf is refused (``status: failed``) and never written. Its frame rate is
    the record's ``params.fps`` when the engine set it, else ``output.fps``; neither, or not a number > 0, fails
    the item.

    Each file's container metadata holds ``title`` (the prompt) and ``comment`` (JSON of :func:`embedded_fields`:
    prompt, negative prompt, seed, parameters, model), all functions of the item's inputs.

    A video with ``output.audio`` (LTX-2) gets its audio as the file's second stream (``runner.core.video``: FLAC,
    lossless, decoded back and compared sample for sample before the rename) and the record ``audio_sha256`` (of the
    decoded 16-bit PCM: repro compares it), ``audio_sample_rate`` (Hz; checked against ``params.audio_sample_rate``),
    ``audio_samples`` (per channel), ``audio_channels`` and ``audio_codec``; a video without has no audio stream.

    The record gets ``status``, ``file`` (``videos/<stem>.mp4``), ``file_name`` (relative to ``videos/``),
    ``file_sha256`` (the container's bytes: resume
    reuses only that exact file), ``frames_sha256`` (``runner.core.video.frames_sha256`` of the frames the file decodes
    to: repro compares it, it survives a muxer or encoder version that changes only the container),
    ``num_frames``, ``fps``, ``width``, ``height``, ``video`` (codec name, encoder, pixel format, lossless, ffmpeg
    version) and, with ``output.video_frames=true``, ``frames_file`` (``videos/<stem>.frames.npz``: the generated
    ``uint8`` frames, lossless, ``numpy.load(f)["frames"]``) and ``frames_file_sha256``.

    Args:
        out_dir: the run dir; videos go to ``out_dir/videos``.
        journal_name: the journal file in ``out_dir``.
        workers: encoder threads (0: inline).
        max_pending: outputs held before ``submit`` waits; at most ``workers + 1`` (each holds its ``uint8``
            frames, F*H*W*3 bytes: 97 MiB for 81 frames of 832x480).
        on_record: called in the caller's thread with each record once it is journaled.
        codec: a key of ``runner.core.video.CODECS``.
        dump_frames: also write the lossless frame dump.
        model: the model name embedded in each file (None: not embedded).

    Raises:
        runner.core.video.VideoEncoderError: no usable ffmpeg or encoder.
    """

    subdir = "videos"
    suffix = ".mp4"
    config_keys = ("output.video_codec", "output.video_frames")

    def __init__(self, out_dir: Path, journal_name: str = "items.jsonl", workers: int = 0, max_pending: int = 16,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None, codec: str = "h264_lossless",
                 dump_frames: bool = False, model: Optional[str] = None) -> None:
        from runner.core import video

        self.model = model
        self.codec = str(codec)
        self.dump_frames = bool(dump_frames)
        info = video.encoder_info(self.codec)
        self.video_doc = {k: info[k] for k in ("codec", "encoder", "pix_fmt", "lossless", "ffmpeg")}
        super().__init__(out_dir, journal_name, workers, min(max_pending, workers + 1), on_record, write=self._write)

    @classmethod
    def options(cls, cfg: Any) -> Dict[str, Any]:
        """``codec`` from ``output.video_codec``, ``dump_frames`` from ``output.video_frames``, ``model`` from
        ``model.name``."""
        return {"codec": str(cfg.output.video_codec), "dump_frames": bool(cfg.output.video_frames),
                "model": str(cfg.model.name)}

    @classmethod
    def identity(cls, cfg: Any) -> Dict[str, Any]:
        """The encoder (``runner.core.video.encoder_info``: codec preset, imageio-ffmpeg and ffmpeg versions) and whether
        frames are dumped.

        Raises:
            runner.core.video.VideoEncoderError: no usable ffmpeg or encoder (at startup, before any weight loads).
        """
        from runner.core import video

        return {"video": video.encoder_info(str(cfg.output.video_codec)),
                "frames_dump": bool(cfg.output.video_frames), "metadata": list(EMBEDDED_FIELDS),
                "not_embedded": list(NOT_EMBEDDED)}

    def _payload(self, record: Dict[str, Any], output: Any, path: Path) -> Tuple[Any, Optional[str]]:
        """``(uint8 frames, fps, dump path)``: the frames converted here, so a pending video holds a quarter of
        the float32 frames."""
        import math

        from runner.core import video

        fps = (record.get("params") or {}).get("fps")
        fps = output.fps if fps is None else fps
        if fps is None:
            return None, "no frame rate: the engine set neither the record's params.fps nor VideoOutput.fps"
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            return None, f"fps={fps!r} is not a number > 0"
        try:
            frames = video.to_uint8_frames(output.frames)
        except ValueError as e:
            return None, str(e)
        dump = path.with_name(f"{path.stem}.frames.npz") if self.dump_frames else None
        try:
            audio = None if output.audio is None else video.to_pcm16(output.audio)
        except ValueError as e:
            return None, str(e)
        meta = video.container_metadata(embedded_fields(record, self.model))
        return (frames, fps, dump, meta, record, audio, output.sample_rate), None

    def _write(self, path: Path, payload: Any) -> Dict[str, Any]:
        """Write the video (``runner.core.video.write_video``), checking the size and frame count the file decodes
        to against the record's params (:func:`check_artifact_dims`) before it is renamed into place."""
        from runner.core import video

        frames, fps, dump, meta, record, audio, rate = payload
        res = video.write_video(path, frames, fps, self.codec, dump, metadata=meta,
                                check=lambda fields: check_artifact_dims(record, fields, path), audio=audio,
                                sample_rate=rate)
        res["fields"]["video"] = dict(self.video_doc)
        if dump is not None:
            res["fields"] = {"frames_file": str(dump.relative_to(self.out_dir)), **res["fields"]}
        return res


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


class ComputeOnlySink(_Counting):
    """The sink of a context-parallel rank that computes its group's items without writing them (the group's
    first rank writes the artifacts and the journal): each output is checked (NaN/inf counts as failed, as in a
    writing sink) and counted; no file, no journal. Records get ``status`` and ``file: null``."""

    def __init__(self, out_dir: Path, journal_name: Optional[str] = None,
                 on_record: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        super().__init__(on_record)
        self.out_dir = Path(out_dir)
        self.journal_name = journal_name

    def submit(self, record: Dict[str, Any], output: Any) -> None:
        """Count one item's output (or the exception that failed it)."""
        if isinstance(output, BaseException):
            record.update(status="failed", file=None, reason=f"{type(output).__name__}: {output}")
        elif output.nonfinite():
            record.update(status="failed", file=None, reason=f"non-finite output ({output.nonfinite()} values)")
            self.nonfinite += 1
        else:
            record.update(status="ok", file=None)
        self._recorded(record)

    def verify(self, record: Dict[str, Any]) -> bool:
        """Nothing of this rank's is on disk to verify."""
        return False

    def drain(self) -> None:
        """Nothing is queued."""

    write_s = 0.0
    wait_s = 0.0

    def close(self) -> None:
        """Nothing to close."""


#: engine output kind -> sink class
SINKS: Dict[str, Any] = {"image": ImageSink, "video": MP4Sink, "text": RecordSink}


UNLISTED = "items.unlisted.jsonl"


def keep_unlisted(out_dir: Path, journal_name: str = "items.jsonl", before: Sequence[Dict[str, Any]] = ()) -> int:
    """Keep a record for every artifact in ``out_dir`` that the run's journal no longer lists, in
    ``items.unlisted.jsonl`` (latest record per file; rewritten atomically, removed when empty).

    A resume can leave such files: a smaller ``dataset.limit``, a row removed from the dataset, an item of an
    earlier config a forced resume did not get to regenerate. Their records are dropped from ``items.jsonl`` (which
    lists exactly this run's items), but the files stay; kept here, no file in the dir is without a record, and a
    later run whose identity matches reuses them (``runner.core.resume.finished`` reads every ``items*.jsonl``).

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
    ok = {f: r for f, r in keep.items() if artifact_intact(out_dir, r)}
    path = out_dir / UNLISTED
    if ok:
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for _, r in sorted(ok.items())).encode())
    elif path.exists():
        path.unlink()
    return len(ok)
