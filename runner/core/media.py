"""Media row fields (input files: ``image``, ``mask_image``, ``last_image``, and any field a row spec declares with
``Field(..., media=Media(...))``): the one place input files are resolved, opened, checked, hashed and loaded.

A row field is a media field by its own declaration (``runner.core.dataset.Field.media``, a :class:`Media`: the mode
the pipeline gets, whether it is a mask); which tasks take it is the field's ``tasks``. Everything below reads the
row's spec (:func:`media_fields`), so a field added to a family's row spec gets every check, its sha256 in the item
identity, its record under the item's ``inputs`` and the repro check of its file, with no other edit.

Every input is checked before any weight loads (:func:`attach_inputs`), every bad row listed at once, each problem
naming ``file:line``, the field, the value and the fix:

* **where**: a path relative to the dataset file's folder, or to ``dataset.media_root`` when set; absolute paths as
  given; URLs refused (no network at run time); a Hugging Face ``Image`` cell (``{"bytes": ..., "path": ...}``,
  parquet / ``dataset=hf`` through ``dataset.columns``) read from its bytes;
* **what**: a file PIL can open, intact (``Image.verify`` then a full decode), with at most
  :data:`MAX_INPUT_PIXELS` pixels, checked from the header before anything is decoded (PIL's decompression-bomb
  bound ``Image.MAX_IMAGE_PIXELS``);
* **mode**: converted only by :data:`MODE_RULES` (lossless conversions; RGBA/LA/P with transparency only when every
  pixel is opaque), recorded per input (``mode``, ``input_mode``, ``conversion``); other modes are refused;
* **size**: exactly the row's ``width`` x ``height`` (the runner never resizes an input: every pipeline would
  resize it to the row's size, FluxKontextPipeline to its preferred resolutions, and the output would not show the
  input as given), and a mask the size of its image.

An input's sha256 (of the file's bytes) is part of its item's identity (``runner.core.dataset.RowSpec.identity``),
so resume regenerates exactly the items whose inputs changed. Import-light: PIL is imported by the functions.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from runner.core.errors import DatasetError, UserInputError

#: Characters of a row value an error message shows (:func:`shown`); the rest is cut and counted.
SHOWN_CHARS = 200
#: Leading bytes of the image formats :func:`shown` names.
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"BM", "BMP"))


def shown(value: Any) -> str:
    """A row value as every dataset message shows it (the one formatter of values echoed in problems): its repr,
    but bytes as ``<PNG bytes, 5,321 B>`` (an image cell of a Parquet or Hugging Face dataset), a long string or
    repr cut after :data:`SHOWN_CHARS` characters with the total counted, dicts and lists shown item by item."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        kind = next((k for m, k in _MAGIC if b.startswith(m)), "WebP" if b[:4] == b"RIFF" and b[8:12] == b"WEBP"
                    else None)
        return f"<{kind + ' ' if kind else ''}bytes, {len(b):,} B>"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(shown(v) for v in value[:10]) + (f", ... ({len(value):,} items)" if len(value) > 10 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(value) if isinstance(value, str) else len(text):,} characters)"


#: The most pixels an input may declare in its header, checked before it is decoded: PIL's own decompression-bomb
#: bound (``PIL.Image.MAX_IMAGE_PIXELS``, 89,478,485 = 1024 * 1024 * 1024 // 4 // 3 since Pillow 5), so a small file
#: that would decode to gigabytes is refused, not opened.
MAX_INPUT_PIXELS = 1024 * 1024 * 1024 // 4 // 3
#: The documented mode conversions (all lossless): ``(file mode, target mode) -> rule``. RGBA / LA / PA and P with
#: a transparency key convert only when every pixel's alpha is 255 (nothing is composited); a mask given as RGB
#: only when its channels are equal. Every other mode (CMYK, I;16, I, F, a transparent RGBA...) is refused.
MODE_RULES = {
    ("L", "RGB"): "L->RGB (grey replicated)", ("1", "RGB"): "1->RGB", ("P", "RGB"): "P->RGB (palette expanded)",
    ("RGBA", "RGB"): "RGBA->RGB (alpha all 255, dropped)", ("LA", "RGB"): "LA->RGB (alpha all 255, dropped)",
    ("PA", "RGB"): "PA->RGB (alpha all 255, dropped)", ("1", "L"): "1->L", ("P", "L"): "P->L (grey palette)",
    ("RGB", "L"): "RGB->L (channels equal)", ("RGBA", "L"): "RGBA->L (alpha all 255, channels equal)",
    ("LA", "L"): "LA->L (alpha all 255, dropped)",
}
URL_SCHEMES = ("http://", "https://", "s3://", "gs://", "ftp://", "hf://", "file://", "data:")


@dataclass(frozen=True)
class Media:
    """What a media row field holds (``runner.core.dataset.Field.media``).

    Attributes:
        mode: the PIL mode the pipeline gets (``RGB`` for images, ``L`` for masks: diffusers' mask processor reads
            one channel); a file of another mode is converted only by :data:`MODE_RULES`.
        mask: the field is a mask: its repaint pixels are recorded (:func:`mask_inside`) and its size must be its
            ``image``'s.
    """

    mode: str = "RGB"
    mask: bool = False

    def __post_init__(self) -> None:
        if self.mode not in {b for _a, b in MODE_RULES}:
            raise ValueError(f"Media mode {self.mode!r} is not one of {sorted({b for _a, b in MODE_RULES})}")


def media_fields(spec: Any) -> Dict[str, Media]:
    """``{field: Media}`` of the media fields a row spec declares (``runner.core.dataset.RowSpec``), in its order;
    ``{}`` for None."""
    return {f.name: f.media for f in (spec.fields if spec is not None else ()) if f.media}


class InputChangedError(UserInputError, OSError):
    """An input file changed (or vanished) between the startup check and its item's generation: the item fails
    alone with this reason (its recorded sha256 would not be what ran)."""


@dataclass(frozen=True)
class InputFile:
    """One checked input of one row.

    Attributes:
        field: the media field (``image``, ``mask_image``, ``last_image``...; ``image[1]`` for the second reference
            of a list).
        given: the value as the row wrote it (a path; ``<bytes>`` for an image cell).
        path: the resolved absolute path (None for an image cell read from its bytes).
        sha256: of the file's bytes (an image cell's bytes).
        width, height: pixels, from the file.
        mode: the file's PIL mode; ``input_mode``: what the pipeline gets (:attr:`Media.mode`).
        conversion: the :data:`MODE_RULES` rule applied, None when the mode was the target's.
        repaint_pixels: a mask's pixels the pipeline repaints (grey value >= 128, its binarisation:
            :func:`mask_inside`), 0 to ``width * height``; None for other fields (:attr:`Media.mask`).
    """

    field: str
    given: str
    path: Optional[str]
    sha256: str
    width: int
    height: int
    mode: str
    input_mode: str
    conversion: Optional[str] = None
    repaint_pixels: Optional[int] = None

    def record(self) -> Dict[str, Any]:
        """The input as ``items.jsonl`` records it: ``{path, sha256, width, height, mode, input_mode, conversion}``,
        and a mask's ``repaint_pixels``."""
        out = {"path": self.path or self.given, "sha256": self.sha256, "width": self.width, "height": self.height,
               "mode": self.mode, "input_mode": self.input_mode, "conversion": self.conversion}
        if self.repaint_pixels is not None:
            out["repaint_pixels"] = self.repaint_pixels
        return out

    def digest(self) -> Dict[str, Any]:
        """What of the input enters the item identity: its bytes' sha256 and what the pipeline gets from them (the
        path does not: a renamed file with the same bytes computes the same item)."""
        return {"sha256": self.sha256, "input_mode": self.input_mode}


def parse_media(value: Any, from_text: bool) -> Any:
    """``Field.parse`` of ``image``: a path, a non-empty list of paths (multi-reference edit; a CSV cell holds it as
    a JSON list) or a Hugging Face ``Image`` cell (``{"bytes", "path"}``).

    Raises:
        ValueError: anything else.
    """
    import json

    if isinstance(value, str) and from_text and value.strip().startswith("["):
        value = json.loads(value)
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() for v in value):
        return list(value)
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        return {"bytes": value.get("bytes"), "path": value.get("path")}
    raise ValueError(value)


def parse_one_media(value: Any, from_text: bool) -> Any:
    """``Field.parse`` of ``mask_image`` / ``last_image``: one path or one image cell (not a list)."""
    out = parse_media(value, from_text)
    if isinstance(out, list):
        raise ValueError(value)
    return out


def is_url(value: str) -> bool:
    """``value`` names a remote resource (:data:`URL_SCHEMES`)."""
    return value.strip().lower().startswith(URL_SCHEMES)


def resolve_path(given: str, src: Path, media_root: Optional[str]) -> Path:
    """Where an input path points: absolute as given (``~`` expanded), else relative to ``media_root``
    (``dataset.media_root``) when set, else to the folder of the dataset file ``src``."""
    p = Path(given).expanduser()
    if p.is_absolute():
        return p
    base = Path(media_root).expanduser() if media_root else Path(src).parent
    return (base / p).resolve()


def convert_mode(img: Any, target: str) -> Tuple[Any, Optional[str], Optional[str]]:
    """``img`` converted to ``target`` (``RGB``/``L``) by :data:`MODE_RULES`: ``(image, rule, None)``, or
    ``(None, None, why)`` when no rule applies (the why names what is wrong with the input)."""
    import numpy as np

    mode = file_mode = img.mode  # file_mode: what the messages name (a keyed palette is converted to RGBA below)
    if mode == target:
        return img, None, None
    if mode == "P" and "transparency" in img.info:
        img, mode = img.convert("RGBA"), "PA"
    rule = MODE_RULES.get((mode, target))
    if rule is None:
        return None, None, (f"has mode {file_mode}, which the pipeline cannot take as {target} and no lossless rule "
                            f"converts (rules: {', '.join(sorted({f'{a}->{b}' for a, b in MODE_RULES}))})")
    if mode in ("RGBA", "LA", "PA"):
        alpha = np.asarray(img.getchannel("A"))
        if (alpha < 255).any():
            return None, None, (f"has mode {file_mode} with {int((alpha < 255).sum())} transparent pixel(s) (alpha < "
                                "255); what lies behind them is not defined, so it is not converted")
        img = img.convert("RGB" if mode != "LA" else "L")
    if target == "L" and img.mode == "RGB":
        a = np.asarray(img)
        if not ((a[..., 0] == a[..., 1]).all() and (a[..., 1] == a[..., 2]).all()):
            return None, None, "is a colour image; a mask must be grey (white = repaint, black = keep)"
    return img.convert(target), rule, None


def decode(data: bytes, bound: int) -> Tuple[Any, Optional[str]]:
    """The PIL image in ``data``, fully decoded, or ``(None, why)``: not an image, more than ``bound`` pixels
    declared in its header (checked before decoding), or corrupt (``Image.verify``, then a full load)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            head = Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            return None, "is not an image PIL can read"
        except Image.DecompressionBombError as e:
            return None, f"declares more pixels than PIL's decompression-bomb bound ({e})"
        w, h = head.size
        if w * h > bound:
            return None, (f"declares {w}x{h} = {w * h} pixels, above the input bound of {bound} (PIL's "
                          "decompression-bomb bound Image.MAX_IMAGE_PIXELS); it is not decoded")
        try:
            head.verify()
            img = Image.open(io.BytesIO(data))
            img.load()
        except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError... for a corrupt file
            return None, f"is corrupt ({type(e).__name__}: {e})"
    return img, None


def read_input(field: str, value: Any, src: Path, media_root: Optional[str]) -> Tuple[Optional[bytes], str,
                                                                                     Optional[str], Optional[str]]:
    """The bytes of one input value: ``(data, given, path, why)``; ``data`` None with ``why`` when the value is a
    URL, a missing or unreadable file."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"]), f"<bytes of {value.get('path') or 'an image cell'}>", None, None
        value = str(value.get("path"))
    given = str(value)
    if is_url(given):
        return None, given, None, "is a URL; the runner reads no network at run time"
    p = resolve_path(given, src, media_root)
    if not p.exists():
        return None, given, str(p), f"does not exist (resolved to {p})"
    try:
        return p.read_bytes(), given, str(p), None
    except OSError as e:
        return None, given, str(p), f"cannot be read ({type(e).__name__}: {e.strerror or e})"


#: The fix of each kind of problem, by the first words of its why.
FIXES = {"is a URL": "download it first and give its local path (absolute, or relative to the dataset file's "
                     "folder / dataset.media_root)",
         "does not exist": "give the path of an existing file (relative paths start at the dataset file's folder, or "
                           "at dataset.media_root when set)",
         "cannot be read": "make the file readable by this user",
         "is not an image": "give a PNG/JPEG/WebP image file",
         "declares": "downscale the image (or split it) below the bound",
         "is corrupt": "re-export the image",
         "has mode": "convert it yourself as you mean it: flatten transparency onto your background "
                     "(Image.alpha_composite(Image.new('RGBA', im.size, 'white'), im).convert('RGB')), convert CMYK "
                     "with your colour profile, 16-bit to 8-bit",
         "is a colour image": "save the mask as a grey image (mode L)"}


def fix_of(why: str) -> str:
    """The fix for a problem's ``why`` (:data:`FIXES`)."""
    return next((f for k, f in FIXES.items() if why.startswith(k)), "give a valid image file")


def check_input(field: str, value: Any, src: Path, media_root: Optional[str], bound: int, kind: Media = Media()
                ) -> Tuple[Optional[InputFile], Optional[str]]:
    """One input value of a field of ``kind`` checked: ``(InputFile, None)``, or ``(None, "field 'x' = 'v' <why>;
    fix: ...")``."""
    data, given, path, why = read_input(field, value, src, media_root)
    img = None
    if data is not None:
        img, why = decode(data, bound)
    rule, converted = None, None
    if img is not None:
        converted, rule, why = convert_mode(img, kind.mode)
    if why is not None:
        return None, f"field {field!r} = {shown(given)} {why}; fix: {fix_of(why)}"
    repaint = int(mask_inside(converted).sum()) if kind.mask else None
    return InputFile(field=field, given=given, path=path, sha256=hashlib.sha256(data).hexdigest(),
                     width=img.width, height=img.height, mode=img.mode,
                     input_mode=kind.mode, conversion=rule, repaint_pixels=repaint), None


def size_problems(row: Any, inputs: Mapping[str, Any], any_size: bool = False) -> List[str]:
    """Every input of ``row`` must be exactly the row's ``width`` x ``height``, and a mask (:attr:`Media.mask`) its
    image's size; ``any_size``: the pipeline sizes each input itself from a pixel area (``input_sizing: area``:
    Edit-Plus), so only the mask rule applies (the sizes it picks are recorded in the evidence)."""
    out = []
    w, h = row.width, row.height
    image = inputs.get("image")
    mask = next((v for v in inputs.values() if isinstance(v, InputFile) and v.repaint_pixels is not None), None)
    named = isinstance(image, InputFile) and isinstance(mask, InputFile) and (mask.width, mask.height) != (
        image.width, image.height)
    if named:
        out.append(f"field {mask.field!r} = {shown(mask.given)} is {mask.width}x{mask.height}, its image "
                   f"{shown(image.given)} "
                   f"is {image.width}x{image.height}; fix: a mask of the image's size")
    for inp in [x for v in inputs.values() for x in (v if isinstance(v, list) else [v])] if not any_size else []:
        if (inp.width, inp.height) != (w, h) and not (named and inp is mask):  # named once
            out.append(f"field {inp.field!r} = {shown(inp.given)} is {inp.width}x{inp.height}, and the row generates "
                       f"{w}x{h}; the runner never resizes an input (the pipeline would resize it and the output "
                       f"would not show the input as given); fix: resize the file to {w}x{h}, or set "
                       f"width={inp.width} and height={inp.height} in the row")
    return out


def row_inputs(row: Any, where: str, src: Path, media_root: Optional[str], bound: int, any_size: bool = False
               ) -> Tuple[Dict[str, Any], List[str]]:
    """The checked inputs of one row, ``({field: InputFile | [InputFile]}, problems)``: every media field of its row
    spec (:func:`media_fields`) that the row sets (problems prefixed with ``where``, ``file:line``; ``any_size``: as
    :func:`size_problems`)."""
    inputs: Dict[str, Any] = {}
    problems: List[str] = []
    for field, kind in media_fields(row.row_spec).items():
        value = getattr(row, field, None)
        if value is None:
            continue
        many = isinstance(value, list)
        got = []
        for i, v in enumerate(value if many else [value]):
            inp, why = check_input(f"{field}[{i}]" if many else field, v, src, media_root, bound, kind)
            if why:
                problems.append(f"{where}: {why}")
            else:
                got.append(inp)
        if len(got) == (len(value) if many else 1):
            inputs[field] = got if many else got[0]
    if not problems:
        problems = [f"{where}: {p}" for p in size_problems(row, inputs, any_size)]
    return inputs, problems


def attach_inputs(rows: Sequence[Any], src: Path, media_root: Optional[str] = None,
                  bound: int = MAX_INPUT_PIXELS, any_size: bool = False) -> List[Any]:
    """Every row's input files checked (:func:`row_inputs`) and attached as ``row.inputs``, before any weight loads;
    rows without inputs are returned as they are. ``any_size``: the pipeline sizes inputs itself
    (:func:`size_problems`).

    Raises:
        runner.core.errors.DatasetError: every problem of every row at once (``file:line: field 'image' = 'x.png'
            <why>; fix: ...``): missing or unreadable file, URL, not an image, above ``bound`` pixels, corrupt, a
            mode no rule converts, a size other than the row's, a mask of another size than its image.
    """
    from dataclasses import replace

    out, problems = [], []
    for r in rows:
        if not any(getattr(r, f, None) is not None for f in media_fields(r.row_spec)):
            out.append(r)
            continue
        inputs, found = row_inputs(r, f"{src}:{r.line}", src, media_root, bound, any_size)
        problems += found
        out.append(replace(r, inputs=inputs))
    if problems:
        raise DatasetError(problems)
    warn_empty_masks(out, src)
    return out


def warn_empty_masks(rows: Sequence[Any], src: Path) -> List[str]:
    """Log one warning naming every row whose mask (``mask_image``: :attr:`Media.mask`) selects no pixel (none >=
    128): the pipeline runs every step and repaints nothing (with ``output.inpaint_overlay`` the output is the input;
    without, its VAE reconstruction). The item runs, and its record says ``inputs.mask_image.repaint_pixels: 0``.
    Returns the ``file:line`` of each such row."""
    empty = [f"{src}:{r.line} ({r.id})" for r in rows
             if any(getattr(v, "repaint_pixels", None) == 0 for v in (getattr(r, "inputs", None) or {}).values())]
    if empty:
        import logging

        logging.getLogger("runner").warning(
            "%d row(s) have a mask_image that selects no pixel to repaint (no grey value >= 128): %s%s; their items "
            "repaint nothing (the output is the input, or its VAE reconstruction with output.inpaint_overlay=false) "
            "and record inputs.mask_image.repaint_pixels: 0; fix: white (>= 128) where the image should change, or "
            "drop the row", len(empty), ", ".join(empty[:5]), " ..." if len(empty) > 5 else "")
    return empty


def load_input(inp: InputFile, value: Any = None) -> Any:
    """The PIL image the pipeline gets for ``inp`` (mode ``inp.input_mode``, by the recorded rule), read again and
    checked against the sha256 recorded at startup (``value``: the row's value, for an image cell's bytes).

    Raises:
        InputChangedError: the file is gone or its bytes changed since the check.
    """
    if inp.path is None:
        data = bytes((value or {}).get("bytes") or b"")
    else:
        try:
            data = Path(inp.path).read_bytes()
        except OSError as e:
            raise InputChangedError(f"input {inp.path} ({inp.field}) cannot be read any more ({e}); fix: keep the "
                                    "inputs in place while the run runs") from None
    if hashlib.sha256(data).hexdigest() != inp.sha256:
        raise InputChangedError(f"input {inp.path or inp.given} ({inp.field}) changed since the startup check (sha256 "
                                f"{inp.sha256[:12]}...); fix: keep the inputs unchanged while the run runs")
    img, why = decode(data, MAX_INPUT_PIXELS)
    img, _rule, why = convert_mode(img, inp.input_mode) if img is not None else (None, None, why)
    if img is None:
        raise InputChangedError(f"input {inp.path or inp.given} ({inp.field}) {why}")
    return img


def mask_inside(mask: Any) -> Any:
    """``(H, W)`` bool: where a mask repaints, by the pipeline's own binarisation (diffusers'
    ``VaeImageProcessor.binarize`` on the mask scaled to [0, 1]: ``>= 0.5`` is 1), i.e. grey value >= 128."""
    import numpy as np

    return np.asarray(mask.convert("L"), dtype=np.float32) / 255.0 >= 0.5


def overlay(generated: Any, image: Any, mask: Any) -> Any:
    """The inpainted ``generated`` (``(H, W, 3)`` float in [0, 1]) with the input ``image`` (PIL RGB) composited
    back outside the mask (diffusers' ``apply_overlay`` idea, with a binary mask): outside, every pixel is the
    input's ``uint8 / 255``, which the PNG encoder's rounding turns back into the input's exact bytes."""
    import numpy as np

    inside = mask_inside(mask)[..., None]
    src = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return np.where(inside, np.asarray(generated, dtype=np.float32), src).astype(np.float32)


def records(inputs: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``{field: InputFile.record() | [..]}`` of a row's inputs (None without any), for ``items.jsonl``."""
    if not inputs:
        return None
    return {f: ([x.record() for x in v] if isinstance(v, list) else v.record()) for f, v in inputs.items()}


def digests(inputs: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``{field: sha256 | [sha256]}`` of a row's checked inputs (:class:`InputFile`) or of a record's ``inputs``
    (their :meth:`InputFile.record` dicts; a missing sha256 reads None): what an artifact embeds (``inputs``),
    ``metadata.jsonl`` lists, and resume compares (``runner.core.resume.why_not_reused``); ``{}`` without any."""
    def sha(x: Any) -> Optional[str]:
        return x.sha256 if isinstance(x, InputFile) else (x or {}).get("sha256")

    return {f: ([sha(x) for x in v] if isinstance(v, list) else sha(v)) for f, v in (inputs or {}).items()}
