"""MP4 encoding and decoding of generated videos, through the ffmpeg binary that ``imageio-ffmpeg`` ships.

Frames are handled as ``uint8`` arrays of layout (F, H, W, 3), RGB, frames in time order. A video is encoded by one
of :data:`CODECS` (``output.video_codec``):

* ``h264_lossless`` (default): H.264 by ``libx264rgb`` at ``-qp 0`` in ``rgb24``: mathematically lossless, so the
  decoded frames are exactly the generated ``uint8`` frames whatever the encoder version; plays in ffmpeg, VLC,
  mpv, not in browsers (High 4:4:4 Predictive profile);
* ``h264``: H.264 by ``libx264`` at ``-crf 18`` in ``yuv420p`` (BT.709, limited range): plays everywhere; lossy
  (4:2:0 chroma), so the decoded frames are a deterministic function of the frames *and* the encoder version;
  width and height must be even.

Both use a fixed thread count (x264's decisions depend on it) and bit-exact swscale conversions, so one
encoder build gives the same bytes for the same frames on any machine. Decoding (:func:`decode_mp4`) always
converts to ``rgb24`` with the same bit-exact BT.709 conversion; H.264 decoding itself is bit-exact by the
standard. :func:`frames_sha256` is what records and repro compare: the sha256 of the decoded frames, which stays
the same when an encoder or muxer version changes only the container bytes.

Audio (a family that generates it: LTX-2) is the MP4's second stream, FLAC (:data:`AUDIO_CODEC`, lossless; ffmpeg
muxes FLAC into MP4 natively): float samples in [-1, 1], layout (channels, samples), are quantised once to 16-bit
PCM (:func:`to_pcm16`), encoded, decoded back with ffmpeg to raw PCM and compared sample for sample before the file
is renamed into place. :func:`audio_sha256` of the decoded PCM is what records and repro compare: a lossless codec
decodes to the same samples on every machine.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import subprocess
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from runner.core.errors import RunnerError, UserInputError

#: swscale flags of every RGB <-> YUV conversion: bit-exact across CPUs, accurate rounding, full chroma.
SWS_FLAGS = "bitexact+accurate_rnd+full_chroma_int"
#: ffmpeg filter of every decode: to RGB with BT.709 limited range (a no-op shuffle for an RGB stream).
DECODE_FILTER = f"scale=in_color_matrix=bt709:in_range=tv:flags={SWS_FLAGS}"
#: x264 threads: fixed, since x264's output depends on the thread count (not on the machine).
ENCODER_THREADS = 4
#: Output options of every encode: fixed threads, no muxer version and no metadata but the tags given, index first.
COMMON_ARGS: Tuple[str, ...] = ("-threads", str(ENCODER_THREADS), "-fflags", "+bitexact", "-map_metadata", "-1",
                                "-movflags", "+faststart")


@dataclass(frozen=True)
class Codec:
    """One encoding preset (:data:`CODECS`).

    Attributes:
        encoder: the ffmpeg encoder (``libx264rgb``).
        pix_fmt: the stored pixel format (``rgb24``, ``yuv420p``).
        args: further ffmpeg output options.
        lossless: decoded frames equal the encoded ``uint8`` frames exactly (the sink checks it on every write).
        even_size: width and height must be even (4:2:0 chroma).
    """

    encoder: str
    pix_fmt: str
    args: Tuple[str, ...]
    lossless: bool
    even_size: bool = False


CODECS: Dict[str, Codec] = {
    "h264_lossless": Codec("libx264rgb", "rgb24", ("-qp", "0", "-preset", "medium"), lossless=True),
    "h264": Codec("libx264", "yuv420p", (
        "-crf", "18", "-preset", "medium", "-vf", f"scale=out_color_matrix=bt709:out_range=tv:flags={SWS_FLAGS}",
        "-colorspace", "bt709", "-color_primaries", "bt709", "-color_trc", "bt709", "-color_range", "tv"),
        lossless=False, even_size=True),
}


#: The audio track's codec: FLAC in MP4 (lossless; ``-c:a flac``), over 16-bit PCM (:data:`AUDIO_SAMPLE_FORMAT`).
AUDIO_CODEC = "flac"
#: The PCM the samples are quantised to and decoded back to (ffmpeg's ``s16le``: signed 16-bit little endian,
#: channels interleaved).
AUDIO_SAMPLE_FORMAT = "s16le"


class VideoEncoderError(UserInputError, RuntimeError):
    """No usable ffmpeg for a video run: ``imageio-ffmpeg`` is not installed, ``IMAGEIO_FFMPEG_EXE`` names a binary
    that does not run, or the binary lacks the codec's encoder. Raised at startup, before any weight loads."""


class VideoEncodeError(RunnerError, RuntimeError):
    """ffmpeg failed to encode one video, or what it wrote does not decode to the frames given. Never ends a run:
    the item fails alone, with this as its ``reason`` (``status: failed``)."""


# ------------------------------------------------------------------------------------------------ the binary
def ffmpeg_exe() -> str:
    """Path of the ffmpeg binary: ``IMAGEIO_FFMPEG_EXE`` when set, else the one bundled with imageio-ffmpeg.

    Raises:
        VideoEncoderError: imageio-ffmpeg is not installed (names the fix).
    """
    try:
        import imageio_ffmpeg
    except ImportError:
        raise VideoEncoderError("video output needs imageio-ffmpeg (it ships its own ffmpeg binary), which is not "
                                "installed; fix: pip install imageio-ffmpeg") from None
    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as e:
        raise VideoEncoderError(f"imageio-ffmpeg found no ffmpeg binary ({e}); fix: reinstall imageio-ffmpeg "
                                "(pip install --force-reinstall imageio-ffmpeg) or set IMAGEIO_FFMPEG_EXE to an "
                                "ffmpeg binary") from None


@lru_cache(maxsize=8)
def _probe(exe: str, codec: str) -> Tuple[str, bool]:
    """``(ffmpeg version, has the codec's encoder)`` of ``exe`` (one ``-version`` and one ``-encoders`` call)."""
    try:
        v = subprocess.run([exe, "-hide_banner", "-version"], capture_output=True, text=True, timeout=60)
        enc = subprocess.run([exe, "-hide_banner", "-encoders"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise VideoEncoderError(f"ffmpeg binary {exe!r} does not run ({type(e).__name__}: {e}); fix: reinstall "
                                "imageio-ffmpeg, or unset/correct IMAGEIO_FFMPEG_EXE") from None
    if v.returncode != 0:
        raise VideoEncoderError(f"ffmpeg binary {exe!r} exited {v.returncode} on -version: {v.stderr[-300:]!r}; "
                                "fix: reinstall imageio-ffmpeg, or unset/correct IMAGEIO_FFMPEG_EXE")
    version = (v.stdout.split("\n", 1)[0].split(" version ", 1)[-1].split(" Copyright")[0]).strip()
    names = {ln.split()[1] for ln in enc.stdout.splitlines() if len(ln.split()) > 1 and ln.startswith(" V")}
    return version, CODECS[codec].encoder in names


def encoder_info(codec: str) -> Dict[str, Any]:
    """What encodes this run's videos, for the run identity and the records: the codec preset (its name,
    encoder, pixel format, options, lossless), the imageio-ffmpeg version and the ffmpeg version.

    Raises:
        VideoEncoderError: no usable ffmpeg, or it lacks the codec's encoder (names the fix).
        KeyError: ``codec`` is not a key of :data:`CODECS` (the schema's choice prevents it).
    """
    import importlib.metadata

    spec = CODECS[codec]
    exe = ffmpeg_exe()
    version, has_encoder = _probe(exe, codec)
    if not has_encoder:
        others = [c for c in CODECS if c != codec and _probe(exe, c)[1]]
        raise VideoEncoderError(f"output.video_codec={codec}: ffmpeg {exe!r} ({version}) has no {spec.encoder} "
                                "encoder; fix: unset IMAGEIO_FFMPEG_EXE to use the ffmpeg bundled with imageio-ffmpeg"
                                + (f", or output.video_codec={others[0]}" if others else ""))
    try:
        iio = importlib.metadata.version("imageio-ffmpeg")
    except importlib.metadata.PackageNotFoundError:
        iio = None
    return {"codec": codec, **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(spec).items()},
            "common_args": list(COMMON_ARGS), "decode_filter": DECODE_FILTER, "imageio_ffmpeg": iio,
            "ffmpeg": version}


# ------------------------------------------------------------------------------------------------ frames
def to_uint8_frames(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1], layout (F, H, W, 3), as C-contiguous ``uint8`` (F, H, W, 3), rounded like the PNG
    sink (``runner.core.artifacts.to_uint8``); ``uint8`` input is taken as it is.

    Raises:
        ValueError: not 4-D with 3 channels, or no frame (names the shape).
    """
    from runner.core.artifacts import to_uint8

    a = np.asarray(frames)
    if a.ndim != 4 or a.shape[-1] != 3 or min(a.shape) < 1:
        raise ValueError(f"video frames must have layout (frames, height, width, 3) with at least one frame, got "
                         f"shape {a.shape}")
    return np.ascontiguousarray(a if a.dtype == np.uint8 else to_uint8(a))


def frames_sha256(frames: np.ndarray) -> str:
    """sha256 of ``uint8`` frames (F, H, W, 3): the RGB bytes of frame 0 row by row, then frame 1, ... (the
    C-order bytes of the array)."""
    a = np.asarray(frames)
    if a.dtype != np.uint8 or a.ndim != 4:
        raise ValueError(f"frames_sha256 takes uint8 frames (F, H, W, 3), got {a.dtype} {a.shape}")
    return hashlib.sha256(np.ascontiguousarray(a).data).hexdigest()


def fps_arg(fps: float) -> str:
    """ffmpeg's frame rate argument: the exact rational of ``fps`` (``16``, ``24000/1001``)."""
    return str(Fraction(fps).limit_denominator(1_000_000))


def _storage_errno(stderr: str) -> Optional[int]:
    """The errno of a storage failure ffmpeg reported (its text is the C library's ``strerror``), else None."""
    from runner.core.artifacts import STORAGE_ERRNOS

    return next((e for e in sorted(STORAGE_ERRNOS) if os.strerror(e) in stderr), None)


def container_metadata(fields: Dict[str, str]) -> Dict[str, str]:
    """The MP4 container metadata of a video from its embedded fields (``runner.core.sinks.embedded_fields``):
    ``title`` = the prompt, ``comment`` = every field as one JSON object (sorted keys). Read back with
    :func:`read_metadata`."""
    import json

    return {"title": fields.get("prompt", ""), "comment": json.dumps(fields, sort_keys=True, ensure_ascii=False)}


def read_metadata(path: Path) -> Dict[str, str]:
    """The global metadata tags of a media file (lower-case keys: ``title``, ``comment``...), read by the ffmpeg
    binary (``-f ffmetadata``; its escapes of ``=;#\\`` and newlines undone).

    Raises:
        VideoEncoderError: no usable ffmpeg.
        OSError: ffmpeg cannot read the file.
    """
    p = subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-i", str(path),
                        "-f", "ffmetadata", "-"], capture_output=True)
    if p.returncode != 0:
        raise OSError(errno.EIO, f"ffmpeg cannot read the metadata of {path}: "
                                 f"{p.stderr.decode('utf-8', 'replace')[-300:]}")
    out: Dict[str, str] = {}
    key = None
    text = p.stdout.decode("utf-8")
    lines = text.split("\n")
    buf = ""
    for line in lines[1:]:  # the first line is the ";FFMETADATA1" header
        buf += line
        if buf.endswith("\\") and not buf.endswith("\\\\"):  # an escaped newline continues the value
            buf = buf[:-1] + "\n"
            continue
        if buf and not buf.startswith((";", "#", "[")) and "=" in buf:
            i = _unescaped_eq(buf)
            key, val = buf[:i], buf[i + 1:]
            out[_unescape(key).lower()] = _unescape(val)
        buf = ""
    return out


def _unescaped_eq(s: str) -> int:
    i = 0
    while i < len(s):
        if s[i] == "\\":
            i += 2
            continue
        if s[i] == "=":
            return i
        i += 1
    return len(s)


def _unescape(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 1 < len(s):
            out.append(s[i + 1])
            i += 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def encode_mp4(path: Path, frames: np.ndarray, fps: float, codec: str = "h264_lossless",
               metadata: Optional[Dict[str, str]] = None, audio: Optional[np.ndarray] = None,
               sample_rate: Optional[int] = None) -> None:
    """Encode ``uint8`` frames (F, H, W, 3) at ``fps`` frames per second into the MP4 file ``path`` (written in
    place: callers write a temp name and rename it). The container is MP4 whatever the name's suffix.
    ``metadata``: global container tags (``{"title": ..., "comment": ...}``, ffmpeg's ``-metadata key=value``);
    the bytes stay a function of the frames, the codec and these tags. ``audio``: ``int16`` PCM (samples, channels)
    (:func:`to_pcm16`) at ``sample_rate`` Hz, muxed as a second stream in :data:`AUDIO_CODEC` (read from a temp file
    beside ``path``, removed after); None: no audio stream.

    Raises:
        ValueError: bad frames, fps not > 0, an odd size for a codec that needs even sizes, bad audio or sample rate.
        OSError: the storage refused the write (``ENOSPC``, ``EACCES``, ... as ffmpeg reported it).
        VideoEncodeError: ffmpeg failed otherwise (its stderr's tail in the message).
        VideoEncoderError: no usable ffmpeg.
    """
    spec = CODECS[codec]
    a = to_uint8_frames(frames)
    f, h, w, _ = a.shape
    if not (isinstance(fps, (int, float)) and np.isfinite(fps) and fps > 0):
        raise ValueError(f"fps={fps!r} must be a finite number > 0")
    if spec.even_size and (w % 2 or h % 2):
        raise ValueError(f"output.video_codec={codec} stores 4:2:0 chroma and needs an even width and height, got "
                         f"{w}x{h}; fix: even sizes, or output.video_codec=h264_lossless")
    pcm = path.with_name(f"{path.name}.pcm") if audio is not None else None
    cmd = [ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-y",
           "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{w}x{h}", "-framerate", fps_arg(fps), "-i", "-",
           *(_audio_input(pcm, audio, sample_rate) if pcm is not None else ("-an",)),
           "-c:v", spec.encoder, *spec.args, "-pix_fmt", spec.pix_fmt, *COMMON_ARGS,
           *(a for k, v in (metadata or {}).items() for a in ("-metadata", f"{k}={v}")), "-f", "mp4", str(path)]
    try:
        if pcm is not None:  # an OSError here is the storage's (propagated as such)
            pcm.write_bytes(np.ascontiguousarray(audio, dtype="<i2").data)
        try:
            p = subprocess.run(cmd, input=a.data, capture_output=True)
        except OSError as e:
            raise VideoEncodeError(f"ffmpeg did not start: {e}") from e
    finally:
        if pcm is not None:
            pcm.unlink(missing_ok=True)
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace")
        no = _storage_errno(err)
        if no is not None:
            raise OSError(no, f"{os.strerror(no)} (ffmpeg writing {path})")
        raise VideoEncodeError(f"ffmpeg {spec.encoder} exited {p.returncode}: {err.strip()[-800:]}")


def _audio_input(pcm: Path, audio: np.ndarray, sample_rate: Optional[int]) -> Tuple[str, ...]:
    """ffmpeg's arguments for the audio input ``pcm`` (``int16`` (samples, channels) at ``sample_rate`` Hz) and its
    FLAC encoding, both streams mapped.

    Raises:
        ValueError: not ``int16`` (samples, channels), no sample, or a sample rate that is not an int > 0.
    """
    if audio.dtype != np.int16 or audio.ndim != 2 or audio.shape[0] < 1 or audio.shape[1] < 1:
        raise ValueError(f"audio must be int16 PCM of layout (samples, channels), got {audio.dtype} {audio.shape}")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate <= 0:
        raise ValueError(f"audio sample_rate={sample_rate!r} must be an int > 0 (Hz)")
    return ("-f", AUDIO_SAMPLE_FORMAT, "-ar", str(sample_rate), "-ac", str(audio.shape[1]), "-i", str(pcm),
            "-map", "0:v:0", "-map", "1:a:0", "-c:a", AUDIO_CODEC)


def to_pcm16(samples: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1], layout (channels, samples) (what ``LTX2Pipeline``'s vocoder returns per item), as
    ``int16`` PCM of layout (samples, channels): clipped to [-1, 1], times 32767, rounded half to even.

    Raises:
        ValueError: not 2-D, no sample, or non-finite values.
    """
    a = np.asarray(samples, dtype=np.float64)
    if a.ndim != 2 or min(a.shape) < 1:
        raise ValueError(f"audio samples must have layout (channels, samples), got shape {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError("audio samples hold NaN/inf")
    return np.ascontiguousarray(np.round(np.clip(a, -1.0, 1.0) * 32767.0).astype(np.int16).T)


def audio_sha256(pcm: np.ndarray) -> str:
    """sha256 of ``int16`` PCM (samples, channels): its little-endian bytes, channels interleaved (ffmpeg's
    ``s16le``)."""
    a = np.asarray(pcm)
    if a.dtype != np.int16 or a.ndim != 2:
        raise ValueError(f"audio_sha256 takes int16 PCM (samples, channels), got {a.dtype} {a.shape}")
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<i2").data).hexdigest()


def audio_stream(path: Path) -> Optional[Dict[str, Any]]:
    """The first audio stream of a media file as ffmpeg reports it: ``{"codec", "sample_rate", "layout",
    "channels"}`` (``layout``: ffmpeg's name, ``mono``/``stereo``/``N channels``; ``channels``: their number); None
    when it has none.

    Raises:
        VideoEncoderError: no usable ffmpeg.
        OSError: ffmpeg cannot read the file.
    """
    import re

    p = subprocess.run([ffmpeg_exe(), "-hide_banner", "-nostdin", "-i", str(path)], capture_output=True)
    err = p.stderr.decode("utf-8", "replace")
    if "Stream #" not in err:
        raise OSError(errno.EIO, f"ffmpeg cannot read {path}: {err[-300:]}")
    m = re.search(r"Stream #\S+.*?: Audio: (\w+)[^,]*, (\d+) Hz, ([^,]+)", err)
    if m is None:
        return None
    layout = m.group(3).strip()
    channels = {"mono": 1, "stereo": 2}.get(layout) or int(re.match(r"\d+", layout).group(0))
    return {"codec": m.group(1), "sample_rate": int(m.group(2)), "layout": layout, "channels": channels}


def read_audio(path: Path) -> Optional[Tuple[np.ndarray, int]]:
    """``(int16 PCM (samples, channels), sample rate in Hz)`` of a media file's first audio stream as ffmpeg decodes
    it (:func:`decode_audio`), or None when it has no audio stream.

    Raises:
        OSError: ffmpeg cannot read or decode the file.
        VideoEncoderError: no usable ffmpeg.
    """
    stream = audio_stream(path)
    if stream is None:
        return None
    return decode_audio(path, stream["channels"]), stream["sample_rate"]


def decode_audio(path: Path, channels: int) -> np.ndarray:
    """The first audio stream of ``path`` decoded by ffmpeg to ``int16`` PCM (samples, ``channels``), no resampling.

    Raises:
        OSError: ffmpeg cannot decode it (no audio stream included).
        VideoEncoderError: no usable ffmpeg.
    """
    p = subprocess.run([ffmpeg_exe(), "-hide_banner", "-loglevel", "error", "-nostdin", "-i", str(path),
                        "-map", "0:a:0", "-f", AUDIO_SAMPLE_FORMAT, "-acodec", "pcm_s16le", "-ac", str(channels),
                        "-"], capture_output=True)
    if p.returncode != 0:
        raise OSError(errno.EIO, f"ffmpeg cannot decode the audio of {path}: "
                                 f"{p.stderr.decode('utf-8', 'replace')[-300:]}")
    return np.frombuffer(p.stdout, dtype="<i2").astype(np.int16).reshape(-1, channels)


def decode_mp4(path: Path, frame: Optional[int] = None) -> np.ndarray:
    """Decode a video file to ``uint8`` RGB frames (F, H, W, 3) in presentation order, every frame once (no frame
    rate conversion), through imageio-ffmpeg's reader; ``frame``: only that frame (0-based), as (1, H, W, 3), or
    (0, H, W, 3) past the end. A corrupt stream stops at the first decoding error, so it decodes to fewer frames.

    Raises:
        OSError: the file cannot be read as a video (imageio-ffmpeg's message).
        VideoEncoderError: no usable ffmpeg.
    """
    ffmpeg_exe()
    import imageio_ffmpeg

    vf = DECODE_FILTER if frame is None else f"select=eq(n\\,{int(frame)}),{DECODE_FILTER}"
    out = ["-map", "0:v:0", "-fps_mode", "passthrough", "-vf", vf] + ([] if frame is None else ["-frames:v", "1"])
    gen = imageio_ffmpeg.read_frames(str(path), input_params=["-nostdin", "-xerror", "-err_detect", "explode"],
                                     output_params=out)
    try:
        meta = next(gen)
        w, h = meta["size"]
        buf = b"".join(gen)
    finally:
        gen.close()
    return np.frombuffer(buf, dtype=np.uint8).reshape(-1, h, w, 3)


def frames_npz(frames: np.ndarray) -> bytes:
    """The lossless frame dump: an ``.npz`` holding ``frames`` (``uint8`` (F, H, W, 3)), zip-deflated with a fixed
    timestamp, so equal frames give equal bytes. ``numpy.load(path)["frames"]`` reads it."""
    import zipfile

    a = to_uint8_frames(frames)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        info = zipfile.ZipInfo("frames.npy", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            np.lib.format.write_array(f, a, allow_pickle=False)
    return buf.getvalue()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_video(path: Path, frames: np.ndarray, fps: float, codec: str,
                dump: Optional[Path] = None, metadata: Optional[Dict[str, str]] = None,
                check: Optional[Callable[[Dict[str, Any]], None]] = None, audio: Optional[np.ndarray] = None,
                sample_rate: Optional[int] = None) -> Dict[str, Any]:
    """Write one video durably: encode to a temp name beside ``path`` (``.<name>.tmp<pid>``), fsync it, decode it
    back and check it (frame count and size; for a lossless codec every pixel), write the frame dump ``dump``
    when given (atomically), then rename the video into place and fsync the dir. A kill at any point leaves no
    partial file under a final name.

    Args:
        frames: ``uint8`` (F, H, W, 3).
        fps: frames per second (> 0).
        codec: a key of :data:`CODECS`.
        dump: where to write the lossless frame dump (:func:`frames_npz`), or None.
        metadata: container tags (:func:`container_metadata`), or None.
        check: called with the fields of the file as decoded (``num_frames``, ``width``, ``height``, ...) before
            the dump and the rename; what it raises fails the write like an encode error (the temp file is
            removed, nothing is left under ``path``). The MP4 sink checks them against the record's params.
        audio: ``int16`` PCM (samples, channels) (:func:`to_pcm16`) muxed as the audio stream, decoded back and
            compared sample for sample; None: the file has no audio stream.
        sample_rate: the audio's sample rate in Hz (with ``audio``).

    Returns:
        ``{"sha256": container bytes' sha256, "fields": {frames_sha256, num_frames, fps, width, height[,
        audio_sha256, audio_sample_rate, audio_samples, audio_channels, audio_codec][, frames_file_sha256]}}``.

    Raises:
        runner.core.errors.StorageError: the storage refused a write (the temp file is removed).
        VideoEncodeError, ValueError: this item cannot be encoded as asked (the temp file is removed).
        Whatever ``check`` raises (the temp file is removed).
    """
    from runner.core.artifacts import atomic_write_bytes, fsync_dir, storage_error
    from runner.core.dataset import file_sha256

    a = to_uint8_frames(frames)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        try:
            encode_mp4(tmp, a, fps, codec, metadata, audio=audio, sample_rate=sample_rate)
            _fsync_file(tmp)
            sha = file_sha256(tmp)
        except OSError as e:
            raise storage_error(path, e) from e
        back = decode_mp4(tmp)
        if back.shape != a.shape:
            raise VideoEncodeError(f"the encoded video decodes to frames of shape {back.shape}, not {a.shape}")
        if CODECS[codec].lossless and not np.array_equal(back, a):
            n = int(np.count_nonzero((back != a).any(axis=(1, 2, 3))))
            raise VideoEncodeError(f"{codec} is lossless but {n} of {len(a)} decoded frames differ from the frames "
                                   "encoded (an ffmpeg build that converts colours?); fix: unset IMAGEIO_FFMPEG_EXE")
        fields: Dict[str, Any] = {"frames_sha256": frames_sha256(back), "num_frames": int(back.shape[0]),
                                  "fps": fps, "width": int(back.shape[2]), "height": int(back.shape[1])}
        fields.update(_audio_fields(tmp, audio))
        if check is not None:
            check(fields)
        if dump is not None:
            blob = frames_npz(a)
            atomic_write_bytes(dump, blob)
            fields["frames_file_sha256"] = hashlib.sha256(blob).hexdigest()
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise storage_error(path, e) from e
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return {"sha256": sha, "fields": fields}


def _audio_fields(path: Path, audio: Optional[np.ndarray]) -> Dict[str, Any]:
    """The audio fields of an encoded file, as decoded (:func:`write_video`): none when ``audio`` is None and the
    file has no audio stream.

    Raises:
        VideoEncodeError: the file's audio stream is missing, unexpected, or does not decode to ``audio`` exactly.
    """
    stream = audio_stream(path)
    if audio is None:
        if stream is not None:
            raise VideoEncodeError(f"the encoded video has an audio stream ({stream}) though none was given")
        return {}
    if stream is None:
        raise VideoEncodeError("the encoded video has no audio stream though audio was given")
    back = decode_audio(path, int(audio.shape[1]))
    if back.shape != audio.shape or not np.array_equal(back, audio):
        raise VideoEncodeError(f"{AUDIO_CODEC} is lossless but the audio decodes to {back.shape} samples that differ "
                               f"from the {audio.shape} encoded; fix: unset IMAGEIO_FFMPEG_EXE")
    return {"audio_sha256": audio_sha256(back), "audio_sample_rate": stream["sample_rate"],
            "audio_samples": int(back.shape[0]), "audio_channels": int(back.shape[1]), "audio_codec": stream["codec"]}


def poster(path: Path, num_frames: Optional[int] = None) -> np.ndarray:
    """The poster frame of a video: its middle frame (index ``num_frames // 2``; the first when the count is not
    known), ``uint8`` (H, W, 3).

    Raises:
        OSError: the file cannot be decoded, or holds no frame there.
    """
    k = (num_frames or 0) // 2
    frames = decode_mp4(path, frame=k)
    if not len(frames):
        raise OSError(errno.EIO, f"{path} has no frame {k}")
    return frames[0]
