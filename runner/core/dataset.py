"""Dataset rows: loading (the sources of ``runner.core.readers.READERS``: builtin, JSONL, CSV, TXT, parquet, a
Hugging Face dataset), validation before any model loads, and expansion into items.

A *row* is one line of the dataset; an *item* is one image to generate (a row with ``num_images_per_prompt: 2``
gives two items). Seeds belong to items, never to batches or ranks, so the images do not depend on
``batch_size`` or on how rows are spread over workers.
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
import json
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from runner.core.errors import DatasetError, UserInputError  # noqa: F401  (DatasetError re-exported)
from runner.core import readers
from runner.core.media import Media, shown
from runner.core.errors import install_fix
from runner.core.paths import RUNNER_DIR
from runner.core.schema import ExtraFields

BUILTIN_PROMPTS = RUNNER_DIR / "data" / "prompts.jsonl"

@dataclass(frozen=True)
class Row:
    """One validated dataset row with every generation parameter filled in (row value, else run config)."""

    id: str
    prompt: str
    negative_prompt: Optional[str]
    seed: Optional[int]
    width: int
    height: int
    num_inference_steps: int
    guidance_scale: Optional[float]
    """None: the model takes no guidance value (its transformer has no guidance embedding)."""
    num_images_per_prompt: int
    line: int
    expect: Optional[Dict[str, Any]] = None
    set_fields: tuple = ()
    """The generation fields the row itself sets (the others come from the run config or the model)."""
    ignored: Optional[Dict[str, Any]] = None
    """Fields the model ignores that the run accepted (``dataset.on_ignored=record``): ``{field: {"value", "why",
    "from"}}``; the row's own value of each is None (not applied)."""
    meta: Optional[Dict[str, Any]] = None
    """The row's extra fields (``dataset.extra_fields=keep``: fields that are no row field and not close to one),
    recorded with the item (``meta``), never passed to the model."""
    values: Dict[str, Any] = dc_field(default_factory=dict)
    """The engine's further row fields (``Field.extra``: a video's ``num_frames`` and ``fps``), those not None;
    read as attributes (``row.num_frames``; None when the row's spec has the field and the row has no value)."""
    spec: Optional["RowSpec"] = dc_field(default=None, compare=False, repr=False)
    """The row spec the row was validated by (None: :data:`VIDEO_ROW`, the diffusion row)."""
    inputs: Optional[Dict[str, Any]] = None
    """The row's checked input files (``runner.core.media.attach_inputs``): ``{field: InputFile | [InputFile]}``
    for ``image``/``mask_image``/``last_image``; None for a text row."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("values", "spec"):
            raise AttributeError(name)
        values = self.__dict__.get("values") or {}
        if name in values:
            return values[name]
        if name in self.row_spec.by_name:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def row_spec(self) -> "RowSpec":
        """The row's spec (:attr:`spec`, else :data:`VIDEO_ROW`)."""
        return self.spec or VIDEO_ROW


@dataclass(frozen=True)
class Item:
    """One image to generate: a row, the image index within the row, and its seed."""

    row: Row
    index: int
    seed: int

    @property
    def key(self) -> str:
        """Stable item key: the row id, with ``-<index>`` when the row has several images."""
        return self.row.id if self.row.num_images_per_prompt == 1 else f"{self.row.id}-{self.index}"

    @property
    def filename_stem(self) -> str:
        """A file name stem safe on every OS for this item (see :func:`safe_stem`)."""
        return safe_stem(self.key)

    @property
    def shape_key(self) -> tuple:
        """Rows with equal shape keys can share a batch: the row spec's batching fields (:meth:`RowSpec.shape_key`:
        latent shape, steps, guidance, whether a negative prompt is set)."""
        return self.row.row_spec.shape_key(self.row)


_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}


def safe_stem(key: str, max_len: int = 96) -> str:
    """File name stem for an item key that stays inside its directory on every OS.

    Characters outside ``[A-Za-z0-9._-]`` become ``_``, leading dots are removed (no ``..``, no hidden files),
    Windows device names (``CON``, ``COM1``...) get a ``_`` prefix, and the result is cut to ``max_len``. Whenever
    the stem differs from the key, ``-<first 8 hex of sha256(key)>`` is appended, so two keys that sanitise to
    the same text (``a/b`` and ``a_b``... or the empty id) still get distinct files.
    """
    import re

    stem = re.sub(r"[^A-Za-z0-9._-]", "_", key).lstrip(".")[:max_len]
    if stem.split(".")[0].upper() in _RESERVED:
        stem = "_" + stem
    if stem != key or not stem:
        stem = f"{stem or 'id'}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    return stem


def derive_seed(run_seed: int, row_id: str) -> int:
    """Deterministic 63-bit seed of a row without one: sha256 of ``"<run_seed>:<row_id>"``."""
    digest = hashlib.sha256(f"{run_seed}:{row_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------ row specs
#: JSON types a row field may declare, with the words a message uses for them.
TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", dict: "an object", bool: "true or false",
              list: "a list of strings"}
#: ``Field.identity`` values: ``always`` (in every item's inputs), ``set`` (only when not None: a field added to a
#: spec later leaves the identities of rows that do not use it as they were), ``no`` (never: names, oracle data).
IDENTITY = ("always", "set", "no")


@dataclass(frozen=True)
class Field:
    """One row field of an engine's row spec (:class:`RowSpec`).

    Attributes:
        name: the field name, as a dataset row spells it.
        type: the JSON type accepted: ``str``, ``int``, ``float`` (ints accepted), ``bool``, ``dict`` or ``list``.
        check: ``check(value, context) -> why`` (None: fine): a range rule, e.g. ``"must be >= 1"``; the driver
            reports ``<file>:<line>: field '<name>' = <value> <why>``. Runs on the row's value, or, for a field with
            a ``default``, on the value the row gets (its own, else the default; None included).
        identity: one of :data:`IDENTITY`: whether the value is part of the item's inputs (``inputs_sha256``).
        batch_key: rows share a batch only when these fields agree; a callable maps the value to its part of the
            key (``negative_prompt``: whether one is set).
        default: key of the engine's defaults mapping (run config / ``model.generation``) that fills the field
            when the row leaves it out; None: no default (the row's value or None).
        parse: ``parse(value, from_text) -> value`` in place of :func:`coerce` (lists, booleans); raises
            ValueError/TypeError when the value is not of the type.
        kind: the words for the type in messages (default :data:`TYPE_WORDS`).
        extra: False for the fields every row of the spec's row class has as attributes; True for an engine's
            further fields, kept in ``Row.values`` (and so in the item's record ``params`` when set).
        media: the value names an input file, of this kind (:class:`runner.core.media.Media`: the mode the pipeline
            gets, whether it is a mask); None: not a file. A media field is checked before any weight loads
            (``runner.core.media.attach_inputs``: missing, unreadable, not an image, mode, size), its identity is the
            file's sha256 (and what the pipeline gets from it), not the path; its batching key the input's size;
            recorded under the item's ``inputs``, not its ``params``; ``runner.repro`` refuses a run whose file
            changed since.
        tasks: ``{task: required}``: the ``model.task`` values that take the field (a row setting it under another
            task is refused: :func:`check_task_inputs`), and whether each requires it; None: every task takes it.
        ident: ``ident(value) -> identity``: what of a set value enters the item's inputs (None: the value itself);
            ``lora``: each adapter's sha256 and scale, not its name (:func:`lora_identity`).
    """

    name: str
    type: type
    check: Optional[Callable[[Any, Mapping[str, Any]], Optional[str]]] = None
    identity: str = "always"
    batch_key: Union[bool, Callable[[Any], Any]] = False
    default: Optional[str] = None
    parse: Optional[Callable[[Any, bool], Any]] = None
    kind: Optional[str] = None
    extra: bool = True
    media: Optional[Media] = None
    ident: Optional[Callable[[Any], Any]] = None
    tasks: Optional[Mapping[str, bool]] = None

    def words(self) -> str:
        """The type in words (``an integer``)."""
        return self.kind or TYPE_WORDS[self.type]

    def value(self, raw: Any, from_text: bool) -> Any:
        """``raw`` converted to the field's type (:func:`coerce`, or ``parse``); raises ValueError/TypeError."""
        return self.parse(raw, from_text) if self.parse else coerce(raw, self.type, from_text)


@dataclass(frozen=True)
class RowSpec:
    """An engine's dataset row: its fields and the rules across them, read by the one validation driver
    (:func:`validate_rows`).

    Attributes:
        name: the spec's name (``image``, ``video``, ``ar``).
        fields: the row fields, in the order messages list them.
        cross: functions ``cross(where, vals, merged, context, bad) -> problems``: rules across fields (a required
            prompt, ``width * height <= max_pixels``); ``vals`` holds the row's own typed values, ``merged`` every
            defaulted field's value (the row's, else the default), ``bad`` whether the row already has a problem.
        build: ``build(line, row_id, vals, merged, meta, context) -> row``: the validated row object.
        quote_hint: add ``(no quotes)`` to a type error of a quoted non-string value.
        order: the order of the checks after the type checks, as messages list them: field names (the field's
            check), :data:`UNIQUE_ID` (ids unique) and cross rules; the fields and rules it leaves out follow, in
            declaration order (empty: unique ids, the fields, the rules).
    """

    name: str
    fields: Tuple[Field, ...]
    cross: Tuple[Callable[..., List[str]], ...]
    build: Callable[..., Any]
    quote_hint: bool = True
    order: Tuple[Union[str, Callable[..., List[str]]], ...] = ()

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"row spec {self.name!r} declares a field twice: {names}")
        bad = [f.name for f in self.fields if f.identity not in IDENTITY or f.type not in TYPE_WORDS]
        if bad:
            raise ValueError(f"row spec {self.name!r}: fields {bad} have an identity outside {IDENTITY} or a type "
                             f"outside {[t.__name__ for t in TYPE_WORDS]}")

    @property
    def by_name(self) -> Dict[str, Field]:
        """``{name: Field}`` in declaration order."""
        return {f.name: f for f in self.fields}

    def types(self) -> Dict[str, type]:
        """``{field: type}`` (what :data:`ROW_FIELDS` was for the diffusion row)."""
        return {f.name: f.type for f in self.fields}

    def extend(self, name: str, *fields: Field, cross: Tuple[Callable[..., List[str]], ...] = (),
               build: Optional[Callable[..., Any]] = None) -> "RowSpec":
        """This spec under ``name`` with further fields (after its own), further cross-field rules (run after this
        spec's) and, when given, another row builder. Every part is a module-level function, so rows that keep
        their spec pickle (Ray sends them to workers)."""
        return RowSpec(name, self.fields + tuple(fields), self.cross + tuple(cross), build or self.build,
                       self.quote_hint, self.order)

    def steps(self) -> List[Union[Field, str, Callable[..., List[str]]]]:
        """The checks after the type checks, in order (:attr:`order`): fields, :data:`UNIQUE_ID`, cross rules."""
        fields = self.by_name
        named = [fields.get(x, None) if isinstance(x, str) and x != UNIQUE_ID else x for x in self.order]
        named = [x for x in named if x is not None and (not callable(x) or isinstance(x, Field) or x in self.cross)]
        rest = [x for x in (UNIQUE_ID, *self.fields, *self.cross) if x not in named]
        return named + rest

    def identity(self, row: Any) -> Dict[str, Any]:
        """The row's values that are part of its items' inputs (:attr:`Field.identity`)."""
        out = {}
        inputs = getattr(row, "inputs", None) or {}
        for f in self.fields:
            v = getattr(row, f.name, None)
            if f.media and v is not None:
                v = media_identity(inputs.get(f.name), v)
            elif f.ident is not None and v is not None:
                v = f.ident(v)
            if f.identity == "always" or (f.identity == "set" and v is not None):
                out[f.name] = v
        return out

    def shape_key(self, row: Any) -> tuple:
        """The batching key of a row: its :attr:`Field.batch_key` fields' values (or their mapped parts), and for a
        row with inputs their sizes per media field (rows whose inputs have one shape share a pipeline call)."""
        key = tuple(f.batch_key(getattr(row, f.name, None)) if callable(f.batch_key) else getattr(row, f.name, None)
                    for f in self.fields if f.batch_key)
        inputs = getattr(row, "inputs", None)
        if inputs:
            key += (tuple((f, tuple((x.width, x.height) for x in (v if isinstance(v, list) else [v])))
                          for f, v in sorted(inputs.items())),)
            if any(isinstance(v, list) for v in inputs.values()):  # a list of references: a pipeline call per row
                key += (row.id,)
        return key


def media_identity(inp: Any, value: Any) -> Any:
    """The identity of a media field's value: each checked input's ``digest()`` (sha256 of its bytes and what the
    pipeline gets), a list for a list of references; an unchecked value (no ``inputs``) as given, an image cell by
    the sha256 of its bytes."""
    if inp is not None:
        return [x.digest() for x in inp] if isinstance(inp, list) else inp.digest()
    if isinstance(value, dict):
        return {"sha256": hashlib.sha256(bytes(value.get("bytes") or b"")).hexdigest(), "path": value.get("path")}
    return value


def parse_fields(rec: Mapping[str, Any], spec: RowSpec, where: str, from_text: bool, extra_mode: str
                 ) -> Tuple[Dict[str, Any], Dict[str, Any], List[str]]:
    """One raw row's fields typed by ``spec``: ``(vals, meta, problems)``. A field that is no field of the spec
    goes through :func:`extra_field` (did-you-mean, ``dataset.extra_fields``); a value of the wrong type is named
    with its fix (and left out of ``vals``)."""
    fields = spec.by_name
    vals: Dict[str, Any] = {}
    meta: Dict[str, Any] = {}
    problems: List[str] = []
    for key, value in rec.items():
        f = fields.get(key)
        if f is None:
            problem = extra_field(key, value, fields, extra_mode, where, meta)
            if problem:
                problems.append(problem)
            continue
        if value is None:
            continue
        try:
            vals[key] = f.value(value, from_text)
        except (ValueError, TypeError):
            kind = f.words()
            hint = spec.quote_hint and isinstance(value, str) and f.type is not str
            problems.append(f"{where}: field {key!r} = {shown(value)} is not {kind}; fix: write it as {kind}"
                            + (" (no quotes)" if hint else ""))
            continue
    return vals, meta, problems


#: :attr:`RowSpec.order`'s name of the unique-id check.
UNIQUE_ID = "<unique id>"


def field_problem(f: Field, where: str, vals: Mapping[str, Any], merged: Mapping[str, Any],
                  context: Mapping[str, Any]) -> List[str]:
    """``[problem]`` when the field's value breaks its check, else ``[]``: the value the row gets for a field with
    a default (None included), the row's own value otherwise (checked only when set)."""
    if f.check is None or (not f.default and f.name not in vals):
        return []
    v = merged[f.name] if f.default else vals[f.name]
    why = f.check(v, context)
    if why and "fix:" not in why:  # every problem names its fix (a check that gave none: its rule as the fix)
        why += f"; fix: set {f.name} to a value {why[len('must be '):] if why.startswith('must be ') else 'that is valid'}"
    return [f"{where}: field {f.name!r} = {shown(v)} {why}"] if why else []


def validate_rows(raw: Sequence[Tuple[int, Mapping[str, Any]]], spec: RowSpec, src: Any, *,
                  from_text: bool = False, extra_fields: str = "error", defaults: Optional[Mapping[str, Any]] = None,
                  context: Optional[Mapping[str, Any]] = None) -> List[Any]:
    """The one row-validation driver: every raw row checked against an engine's row spec, every problem of every
    row listed in one error, before any model loads.

    Per row: the fields' types (:func:`parse_fields`), each field's check (on the row's value, or on the default it
    takes), unique ids (a row without ``id`` is ``row<line:06d>``), the spec's cross-field rules; a row with no
    problem becomes ``spec.build(...)``.

    Args:
        raw: ``(line, raw row)`` pairs (:func:`read_raw`).
        src: the source file, for ``<src>:<line>`` in messages.
        from_text: the cells are text (CSV): numbers, objects and lists are parsed from it.
        extra_fields: ``dataset.extra_fields`` (``error`` | ``keep``).
        defaults: ``{Field.default: value}``: the engine's run-level values of the fields (``model.generation``).
        context: what the spec's checks need beyond the row (``size_multiple``, the model's vocabulary...);
            ``context["spec"]`` is set to ``spec`` for its builder.

    Raises:
        DatasetError: every problem found (file:line, field, value, fix), or no row at all.
    """
    defaults, context = dict(defaults or {}), {**(context or {}), "spec": spec}
    problems: List[str] = []
    rows: List[Any] = []
    seen: Dict[str, int] = {}
    for n, rec in raw:
        where = f"{src}:{n}"
        vals, meta, found = parse_fields(rec, spec, where, from_text, extra_fields)
        merged = {f.name: vals.get(f.name, defaults.get(f.default)) for f in spec.fields if f.default}
        rid = vals.get("id", f"row{n:06d}")
        for step in spec.steps():
            if step == UNIQUE_ID:
                if rid in seen:
                    found.append(f"{where}: duplicate id {rid!r} (first on line {seen[rid]}); fix: ids must be "
                                 "unique")
                seen.setdefault(rid, n)
            elif isinstance(step, Field):
                found += field_problem(step, where, vals, merged, context)
            else:
                found += step(where, vals, merged, context, bool(found))
        problems += found
        if not found:
            rows.append(spec.build(n, rid, vals, merged, meta, context))
    if problems:
        raise DatasetError(problems)
    if not rows:
        raise DatasetError([f"{src}: no rows; fix: add at least one prompt"])
    return rows


# ------------------------------------------------------------------------------------------------ diffusion rows
def check_size(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``width``/``height``: a positive multiple of ``context["size_multiple"]`` (FLUX: 16 = VAE factor 8 x patch
    2)."""
    m = int(context.get("size_multiple") or 1)
    if v is None or v <= 0 or v % m:
        return f"is not a positive multiple of {m}; fix: use e.g. {max(m, round((v or 0) / m) * m)}"
    return None


def check_at_least_one(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """A count that must be >= 1 (a missing default counts as bad)."""
    return "must be >= 1; fix: use e.g. 1" if v is None or v < 1 else None


def check_seed(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """A row seed: the items' seeds ``seed + k`` stay below 2**63."""
    return "must be in [0, 2**63 - 64); fix: use e.g. 0" if not 0 <= v < (1 << 63) - 64 else None


def check_guidance(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``guidance_scale``: finite and >= 0, or None (the model takes no guidance)."""
    import math

    return ("must be a finite number >= 0; fix: use e.g. 3.5" if v is not None and (not math.isfinite(v) or v < 0) else None)


#: The largest ``num_frames``/``fps`` a row may ask for (a typo guard: 100000 frames is over an hour at 24 fps).
MAX_FRAMES = 100_000


def check_video_count(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``num_frames``/``fps``: None (not a video) or in [1, 100000] (model rules, e.g. Wan's 4k+1, are the
    engine's); the fix names the nearest value in range."""
    if v is None or 1 <= v <= MAX_FRAMES:
        return None
    return f"must be an integer from 1 to {MAX_FRAMES}; fix: use e.g. {1 if v < 1 else MAX_FRAMES}"


def is_set(v: Any) -> bool:
    """Batching key part of a field whose presence, not its value, shapes a batch (``negative_prompt``)."""
    return v is not None


def check_prompt(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                 bad: bool) -> List[str]:
    """A diffusion row's prompt: set and not blank."""
    prompt = vals.get("prompt")
    if prompt is None or not prompt.strip():
        return [f"{where}: field 'prompt' is {'missing' if prompt is None else 'empty'}; "
                "fix: give every row a non-empty prompt"]
    return []


def check_max_pixels(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                     bad: bool) -> List[str]:
    """``width * height <= context["max_pixels"]`` (the values the row gets)."""
    w, h, most = merged.get("width") or 0, merged.get("height") or 0, context.get("max_pixels")
    if most is not None and w * h > most:
        return [f"{where}: {merged['width']}x{merged['height']} exceeds max_pixels={most}; "
                "fix: smaller sizes, or raise max_pixels"]
    return []


#: Fields of a diffusion row that are no generation field (not in ``Row.set_fields``).
NOT_GENERATION = ("id", "prompt", "expect")


def build_diffusion_row(line: int, rid: str, vals: Mapping[str, Any], merged: Mapping[str, Any],
                        meta: Mapping[str, Any], context: Mapping[str, Any]) -> Row:
    """The :class:`Row` of a valid diffusion row (``context["spec"]``: the spec it was validated by)."""
    spec = context["spec"]
    own = {f.name for f in spec.fields if not f.extra}
    got = {f.name: merged.get(f.name, vals.get(f.name)) for f in spec.fields}
    values = {k: v for k, v in got.items() if k not in own and v is not None}
    return Row(id=rid, prompt=vals.get("prompt") or "", negative_prompt=got["negative_prompt"], seed=got["seed"],
               width=got["width"], height=got["height"], num_inference_steps=got["num_inference_steps"],
               guidance_scale=got["guidance_scale"], num_images_per_prompt=got["num_images_per_prompt"], line=line,
               expect=got["expect"], meta=dict(meta) or None, values=values, spec=spec,
               set_fields=tuple(k for k in vals if k not in NOT_GENERATION))


#: The diffusion image row: a prompt and the pipeline's generation fields, defaults from ``model.generation``.
IMAGE_ROW = RowSpec("image", (
    Field("id", str, identity="no", extra=False),
    Field("prompt", str, extra=False),
    Field("negative_prompt", str, default="negative_prompt", batch_key=is_set, extra=False),
    Field("seed", int, check=check_seed, extra=False),
    Field("width", int, check=check_size, default="width", batch_key=True, extra=False),
    Field("height", int, check=check_size, default="height", batch_key=True, extra=False),
    Field("num_inference_steps", int, check=check_at_least_one, default="num_inference_steps", batch_key=True,
          extra=False),
    Field("guidance_scale", float, check=check_guidance, default="guidance_scale", batch_key=True, extra=False),
    Field("num_images_per_prompt", int, check=check_at_least_one, default="num_images_per_prompt", identity="no",
          extra=False),
    Field("expect", dict, identity="no", extra=False),  # expected attributes for an oracle, {"color": "red"}
), (check_prompt, check_max_pixels), build_diffusion_row,
    order=(check_prompt, UNIQUE_ID, "width", "height", check_max_pixels, "num_inference_steps", "seed",
           "guidance_scale", "num_frames", "fps", "num_images_per_prompt"))
def check_strength(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``strength``: 0 < s <= 1 (diffusers' img2img/inpaint ``check_inputs`` accept [0, 1]; 0 runs no step)."""
    import math

    if v is not None and not (math.isfinite(v) and 0 < v <= 1):
        return "must be in (0, 1]; fix: e.g. 0.6 (diffusers' default for FLUX img2img), 1.0 repaints fully"
    return None


def task_inputs(spec: "RowSpec") -> Dict[str, Dict[str, bool]]:
    """``{task: {field: required}}`` of the fields of ``spec`` that declare :attr:`Field.tasks` (the conditioning
    fields), tasks in the order the fields name them; a task absent takes none of them."""
    out: Dict[str, Dict[str, bool]] = {}
    for f in spec.fields:
        for task, required in (f.tasks or {}).items():
            out.setdefault(task, {})[f.name] = bool(required)
    return out


def check_task_inputs(where: str, vals: Mapping[str, Any], merged: Mapping[str, Any], context: Mapping[str, Any],
                      bad: bool) -> List[str]:
    """The task-bound fields of a row (:attr:`Field.tasks`, of ``context["spec"]``) against ``context["task"]``
    (``model.task``; default ``text_to_image``): a field the task does not take is refused naming the tasks that take
    it, the family's (``context["tasks"]``) first (as an ignored field: it would not reach the pipeline); a field the
    task requires must be set; a list of references only where ``context["multi_image"]`` (the family's
    multi-reference edit)."""
    spec = context.get("spec") or DIFFUSION_ROW
    table = task_inputs(spec)
    task = str(context.get("task") or "text_to_image")
    takes = table.get(task, {})
    out = []
    for f in (f.name for f in spec.fields if f.tasks is not None):
        if f in vals and f not in takes:
            own = context.get("tasks") or table  # the family's tasks first: the fix names one it has
            users = sorted((t for t, fs in table.items() if f in fs), key=lambda t: t not in own)
            out.append(f"{where}: field {f!r} = {shown(vals[f])} is not taken by model.task={task} (the pipeline would "
                       f"never see it); fix: remove it from the row, or model.task={users[0]} (tasks that take "
                       f"{f}: {', '.join(users)})")
        elif f not in vals and takes.get(f):
            out.append(f"{where}: field {f!r} is missing, and model.task={task} needs it; fix: give every row "
                       f"{f!r} (a path relative to the dataset file's folder or dataset.media_root)")
    if isinstance(vals.get("image"), list) and "image" in takes and not context.get("multi_image"):
        out.append(f"{where}: field 'image' is a list of {len(vals['image'])} paths, and model.task={task} of this "
                   "family takes one image; fix: one path per row (a family with multi-reference edit: "
                   "model.engine=qwen_image)")
    return out


def parse_images(value: Any, from_text: bool) -> Any:
    """``Field.parse`` of ``image``: a path, a list of paths or an image cell (``runner.core.media.parse_media``)."""
    from runner.core import media

    return media.parse_media(value, from_text)


def parse_image(value: Any, from_text: bool) -> Any:
    """``Field.parse`` of ``mask_image``/``last_image``: one path or image cell (``media.parse_one_media``)."""
    from runner.core import media

    return media.parse_one_media(value, from_text)


#: The conditioning fields (``runner.core.media``), each declaring its media kind and the tasks that take it: an
#: input image (a list of references for a multi-reference edit), a mask (mode L), a last frame, and the
#: img2img/inpaint strength. Identity only when set (text rows keep theirs).
CONDITIONING_FIELDS = (
    Field("image", list, identity="set", parse=parse_images, media=Media("RGB"), kind="a path or a list of paths",
          tasks={"image_to_image": True, "inpaint": True, "edit": True, "image_to_video": True}),
    Field("mask_image", str, identity="set", parse=parse_image, media=Media("L", mask=True), kind="a path",
          tasks={"inpaint": True}),
    Field("last_image", str, identity="set", parse=parse_image, media=Media("RGB"), kind="a path",
          tasks={"image_to_video": False}),
    Field("strength", float, check=check_strength, identity="set", batch_key=True,
          tasks={"image_to_image": False, "inpaint": False}),
)




# ------------------------------------------------------------------------------------------------ LoRA rows
def parse_lora_names(value: Any, from_text: bool) -> List[str]:
    """``Field.parse`` of the row field ``lora``: a name, or a list of names (a CSV cell: JSON list or a name).

    Raises:
        ValueError: not a string or a list of strings.
    """
    if from_text and isinstance(value, str) and value.strip().startswith("["):
        value = json.loads(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(value)


def check_lora_scale(v: Any, context: Mapping[str, Any]) -> Optional[str]:
    """``lora_scale``: a finite number (0 turns the adapters off; negative scales are LoRA's inverse)."""
    import math

    return "must be a finite number; fix: e.g. 1.0" if v is not None and not math.isfinite(v) else None


def lora_set_key(value: Any) -> Any:
    """Batching key part of a row's ``lora``: the resolved set's ``(name, scale)`` pairs (rows batch by set)."""
    if value is None:
        return None
    return tuple((d["name"], d["scale"]) if isinstance(d, dict) else (d, None) for d in value)


def lora_identity(value: Any) -> Any:
    """The identity of a row's resolved ``lora`` set: ``[{sha256, scale}]`` in order (an adapter's name is a label:
    renaming it, or its file, changes no byte); names as given before the set is resolved."""
    return [{k: v for k, v in d.items() if k != "name"} if isinstance(d, dict) else d for d in value]


#: The LoRA fields (``models.lora``): adapters of the run's library (``model.lora``) by name, and a scale replacing
#: theirs. The engine resolves ``lora`` to the row's adapter set ``[{name, sha256, scale}]`` (every library adapter
#: for a row without it): that enters the identity and the batching key (rows batch by adapter set).
LORA_FIELDS = (
    Field("lora", list, identity="set", parse=parse_lora_names, batch_key=lora_set_key,
          kind="a name or a list of names", ident=lora_identity),
    Field("lora_scale", float, check=check_lora_scale, identity="set"),
)


#: The video fields: identity only when set, so the items of rows without them keep their identities.
VIDEO_FIELDS = (
    Field("num_frames", int, check=check_video_count, default="num_frames", identity="set", batch_key=True),
    Field("fps", int, check=check_video_count, default="fps", identity="set"),
)
#: The diffusion video row (and every diffusion engine's: an image model refuses the video fields by name in its
#: ``check_rows``, which needs them read).
VIDEO_ROW = IMAGE_ROW.extend("video", *VIDEO_FIELDS)
#: The diffusion row of every diffusion engine: :data:`VIDEO_ROW` and the conditioning fields, each allowed only
#: where ``model.task`` takes it (:func:`check_task_inputs`).
DIFFUSION_ROW = VIDEO_ROW.extend("diffusion", *CONDITIONING_FIELDS, *LORA_FIELDS, cross=(check_task_inputs,))
#: ``{task: {field: required}}`` of the diffusion row (:func:`task_inputs`; a family's own row spec has its own).
TASK_INPUTS = task_inputs(DIFFUSION_ROW)
#: ``{field: type}`` of the text diffusion row (:data:`VIDEO_ROW`: what ``load_rows`` reads without a spec).
ROW_FIELDS: Dict[str, type] = VIDEO_ROW.types()


#: ``dataset.format`` values: where rows come from (the sources of ``runner.core.readers.READERS``, which
#: ``runner.core.schema.DatasetFormat`` lists too).
FORMATS = tuple(readers.READERS)
#: ``dataset.extra_fields`` values: what a field that is no row field does (``runner.core.schema.ExtraFields``).
EXTRA_FIELDS = tuple(f.value for f in ExtraFields)


def _arrow_rows(table: Any, src: Path) -> List[tuple[int, Dict[str, Any]]]:
    """``(row number from 1, row)`` of a pyarrow table, cells as Python values, nulls left out."""
    return [(n, {k: v for k, v in rec.items() if v is not None}) for n, rec in enumerate(table.to_pylist(), 1)]


def read_parquet(path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None
                 ) -> List[tuple[int, Dict[str, Any]]]:
    """``dataset=parquet``: a parquet file's rows (``pyarrow``), numbered from 1.

    Raises:
        DatasetError: pyarrow is missing, or the file is not parquet.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(["dataset.format=parquet needs pyarrow, which is not installed; fix: "
                            f"{install_fix('export', 'or pip install pyarrow')}"]) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise DatasetError([f"{path}: not a readable parquet file ({type(e).__name__}: {e}); fix: pass a .parquet "
                            "file (pyarrow.parquet.write_table, pandas.DataFrame.to_parquet, Dataset.to_parquet)"])
    return _arrow_rows(table, path)


HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def read_hf(path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None
            ) -> List[tuple[int, Dict[str, Any]]]:
    """Rows of a local Hugging Face dataset: a dir written by ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict``
    whose ``split`` is read: default ``train``, or its only split) or a data file read by ``datasets``' builder of
    its extension (:data:`HF_FILE_BUILDERS`), with a temporary cache (nothing is written outside the run dir).
    Cells are read raw from Arrow (no decoding: an image column stays ``{bytes, path}``)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(["dataset.format=hf needs the datasets package, which is not installed; fix: "
                            f"{install_fix('export', 'or pip install datasets')}"]) from None
    import tempfile

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="runner-hf-") as cache:
        try:
            if path.is_dir():
                d = datasets.load_from_disk(str(path), keep_in_memory=True)
            else:
                builder = HF_FILE_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    kind = path.suffix or "a file without extension"
                    raise DatasetError([f"dataset.path={str(path)!r}: dataset=hf reads a dir written by save_to_disk "
                                        f"or a data file ({', '.join(HF_FILE_BUILDERS)}), not {kind}; fix: pass such "
                                        "a dir or file"])
                d = datasets.load_dataset(builder, data_files=str(path), cache_dir=cache, keep_in_memory=True)
        except DatasetError:
            raise
        except Exception as e:  # noqa: BLE001 - datasets raises many types for a dir it cannot read
            raise DatasetError([f"dataset.path={str(path)!r}: datasets cannot read it ({type(e).__name__}: {e}); "
                                "fix: a dir written by Dataset.save_to_disk / DatasetDict.save_to_disk, or a data "
                                f"file ({', '.join(HF_FILE_BUILDERS)})"]) from None
        if isinstance(d, datasets.DatasetDict):
            names = list(d)
            name = split or ("train" if "train" in d else names[0] if len(names) == 1 else None)
            if name not in d:
                raise DatasetError([f"dataset.split={split!r}: {path} holds the splits {', '.join(names)}; fix: "
                                    f"dataset.split={names[0]}" if split else
                                    f"{path} holds the splits {', '.join(names)} and none is 'train'; fix: "
                                    f"dataset.split={names[0]}"])
            d = d[name]
        return _arrow_rows(d.with_format("arrow")[:], path)


def columns_option(value: Any) -> Dict[str, str]:
    """``dataset.columns`` as ``{row field: source column}`` (null: ``{}``); a column name given as a number is
    taken as its text.

    Raises:
        DatasetError: not a mapping, or a value that is not a name (naming the fix).
    """
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise DatasetError([f"dataset.columns={value!r} is not a mapping; fix: dataset.columns={{prompt: Prompt}} "
                            "(row field: source column)"])
    bad = [f"dataset.columns.{k}={v!r} is not a column name; fix: dataset.columns.{k}=<column>"
           for k, v in value.items() if isinstance(v, (dict, list, bool)) or v is None]
    if bad:
        raise DatasetError(bad)
    return {str(k): str(v) for k, v in value.items()}


def apply_columns(raw: List[tuple[int, Dict[str, Any]]], columns: Optional[Dict[str, str]], src: Path,
                  fields: Iterable[str]) -> List[tuple[int, Dict[str, Any]]]:
    """Rename source columns to row fields: ``columns`` maps a row field to the column that holds it
    (``{"prompt": "Prompt"}``: the CSV header ``Prompt`` feeds ``prompt``).

    Raises:
        DatasetError: a key that is no row field (did-you-mean), a column that no row has (naming the columns
            there are), or a row holding both the column and the field it maps to.
    """
    if not columns:
        return raw
    import difflib

    fields = list(fields)
    problems = []
    for field, col in columns.items():
        if field not in fields:
            close = difflib.get_close_matches(field, fields, n=1)
            problems.append(f"dataset.columns.{field}: {field!r} is not a row field; fix: "
                            + (f"did you mean {close[0]!r}?" if close else f"one of {', '.join(fields)}")
                            + " (dataset.columns maps a row field to the column that holds it)")
    seen = {k for _, rec in raw for k in rec}
    for field, col in columns.items():
        if field in fields and col not in seen:
            problems.append(f"dataset.columns.{field}={col!r}: no row of {src} has a column {col!r}; columns: "
                            f"{', '.join(sorted(seen))}; fix: name one of them")
    if problems:
        raise DatasetError(problems)
    out = []
    for n, rec in raw:
        rec = dict(rec)
        for field, col in columns.items():
            if col in rec and col != field:
                if field in rec:
                    problems.append(f"{src}:{n}: both {field!r} and {col!r} (mapped to {field!r} by dataset.columns) "
                                    f"are set; fix: drop one of them, or the mapping")
                rec[field] = rec.pop(col)
        out.append((n, rec))
    if problems:
        raise DatasetError(problems)
    return out


def extra_field(key: str, value: Any, fields: Iterable[str], mode: str, where: str,
                meta: Dict[str, Any]) -> Optional[str]:
    """Handle a row field that is no row field: with ``mode == "keep"`` a field that is not a typo of a known one
    (difflib ratio >= 0.8, case ignored) goes into ``meta`` when it is JSON data, and None is returned; else the
    problem to report (under ``error`` naming a known field at ratio >= 0.6 as the likely one). A typo of a known
    field (``promt``, ``Prompt``, ``seeds``, ``widht``) is refused in either mode, so keeping extra fields never
    hides one.

    Returns:
        The problem text (``<where>: unknown field ...; fix: ...``), or None when the field was kept.
    """
    import difflib

    fields = list(fields)
    # a typo is what the close match finds: under error any near name is a hint (>= 0.6); under keep only a
    # typo-near one (>= 0.8, case ignored) is refused, or ordinary metadata columns were told to map onto row
    # fields (color -> lora, text -> expect, image_id -> image: a new-user report)
    cut = 0.8 if mode == "keep" else 0.6
    close = difflib.get_close_matches(key, fields, n=1, cutoff=cut) or difflib.get_close_matches(
        key.lower(), fields, n=1, cutoff=0.8)
    if close:
        return (f"{where}: unknown field {key!r}; fix: did you mean {close[0]!r}? (a column of that name under "
                f"another spelling: dataset.columns={{{close[0]}: {key}}})")
    if mode != "keep":
        return (f"{where}: unknown field {key!r}; fix: remove it, or dataset.extra_fields=keep to record it under the "
                f"item's meta (row fields: {', '.join(fields)})")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return (f"{where}: extra field {key!r} holds {type(value).__name__}, which cannot be recorded as JSON; fix: "
                "drop that column from the dataset")
    meta[key] = value
    return None


def csv_extra_cells(path: Path, line: int, columns: int, extra: Sequence[str]) -> str:
    """The problem of a CSV row with more cells than its header has columns (``extra``: the cells beyond them).
    Empty extra cells are trailing commas (``a,a red circle,,``: 4 cells, 2 columns), fixed by removing them; a
    non-empty one is a value with an unquoted comma, fixed by quoting it."""
    cells = columns + len(extra)
    head = f"{path}:{line}: row has more cells than the header has columns ({cells} cells, {columns} columns"
    if all(not c.strip() for c in extra):
        return (f"{head}; the {len(extra)} extra cell(s) are empty: trailing commas); fix: remove the trailing "
                "commas")
    return f"{head}); fix: quote prompts that contain commas"


def reader(fmt: Any) -> readers.Reader:
    """The :class:`runner.core.readers.Reader` record of ``dataset.format`` = ``fmt``.

    Raises:
        DatasetError: no such source (naming the registered ones).
    """
    rec = readers.READERS.get(str(fmt))
    if rec is None:
        raise DatasetError([f"dataset.format={str(fmt)!r} is not known; fix: one of {', '.join(FORMATS)}"])
    return rec


def read_raw(fmt: str, path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None,
             fields: Iterable[str] = tuple(ROW_FIELDS)) -> List[tuple[int, Dict[str, Any]]]:
    """Return ``(line_number, raw_row)`` pairs (for ``parquet`` and ``hf``: the row number from 1) read by the
    source's record (:func:`reader`), source columns renamed by ``columns`` (:func:`apply_columns` over the
    engine's row ``fields``; CSV and TXT cells are text, the other formats' cells typed).

    Raises:
        DatasetError: an unknown source, unreadable or malformed input (file, line, what, fix); with the readable
            rows (``rows``, columns renamed) when the reader read past the bad lines.
    """
    try:
        raw = reader(fmt).reader()(path, split, columns)
    except DatasetError as e:
        if e.rows is None:
            raise
        try:
            rows = apply_columns(e.rows, columns, path, fields)
        except DatasetError as m:  # the mapping's problems of the readable rows: named beside the bad lines
            raise DatasetError(e.problems + m.problems) from None
        raise DatasetError(e.problems, rows=rows) from None
    return apply_columns(raw, columns, path, fields)


def read_text(path: Path) -> str:
    """The UTF-8 text of a dataset file (a leading BOM dropped).

    Raises:
        DatasetError: the file does not exist, or is not UTF-8 (naming the line and byte).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError([f"dataset.path: file {str(path)!r} does not exist; fix: pass an existing file"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DatasetError([f"{path}:{line}: text is not UTF-8 (byte {data[e.start]:#04x} at offset {e.start}); "
                            "fix: re-encode the file as UTF-8"])
    return text.lstrip("\ufeff")


def read_jsonl(path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None
               ) -> List[tuple[int, Dict[str, Any]]]:
    """``dataset=jsonl`` (and ``builtin``): one JSON object per line, blank lines skipped.

    Raises:
        DatasetError: every malformed line at once.
    """
    rows: List[tuple[int, Dict[str, Any]]] = []
    problems = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"{path}:{n}: malformed JSON ({e.msg} at column {e.colno}); fix: one JSON object per line")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{path}:{n}: expected a JSON object with a 'prompt' field, got {type(obj).__name__}")
            continue
        rows.append((n, obj))
    if problems:
        raise DatasetError(problems, rows=rows)
    return rows


def read_csv(path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None
             ) -> List[tuple[int, Dict[str, Any]]]:
    """``dataset=csv``: a header line naming the columns; empty cells left out, the prompt column kept.

    Raises:
        DatasetError: no prompt column (naming the mapping that would read one), rows with more cells than the
            header.
    """
    reader = csv.DictReader(io.StringIO(read_text(path)))
    source = (columns or {}).get("prompt", "prompt")
    if not reader.fieldnames or source not in reader.fieldnames:
        close = difflib.get_close_matches(source, reader.fieldnames or [], n=1) or [
            f for f in reader.fieldnames or [] if f.lower() == source.lower()]
        raise DatasetError([f"{path}:1: CSV header {reader.fieldnames!r} has no {source!r} column; fix: "
                            + (f"dataset.columns={{prompt: {close[0]}}} to read the prompt from {close[0]!r}"
                               if close else
                               f"name the prompt column (dataset.columns={{prompt: <column>}})"
                               if reader.fieldnames else "add a header line naming the columns, e.g. id,prompt")])
    rows: List[tuple[int, Dict[str, Any]]] = []
    problems = []
    for rec in reader:
        n = reader.line_num
        if None in rec:
            problems.append(csv_extra_cells(path, n, len(reader.fieldnames), rec[None]))
            continue
        rows.append((n, {k: v for k, v in rec.items() if v not in (None, "")} | {source: rec.get(source) or ""}))
    if problems:
        raise DatasetError(problems, rows=rows)
    return rows


def read_txt(path: Path, split: Optional[str] = None, columns: Optional[Dict[str, str]] = None
             ) -> List[tuple[int, Dict[str, Any]]]:
    """``dataset=txt``: one prompt per non-blank line, ids ``line<number>``."""
    return [(n, {"id": f"line{n:06d}", "prompt": line.strip()})
            for n, line in enumerate(read_text(path).splitlines(), 1) if line.strip()]


def coerce(value: Any, typ: type, from_text: bool) -> Any:
    """Convert a raw value to ``typ`` (text cells from CSV are parsed); raise ValueError when impossible."""
    if typ is str:
        if from_text or isinstance(value, str):
            return str(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        raise ValueError
    if typ is int:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            return value
        if from_text and isinstance(value, str):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError
    if typ is dict:
        if isinstance(value, dict):
            return value
        if from_text and isinstance(value, str):
            obj = json.loads(value)
            if isinstance(obj, dict):
                return obj
        raise ValueError
    if typ is float:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, (int, float)):
            return float(value)
        if from_text and isinstance(value, str):
            return float(value)
        raise ValueError
    raise TypeError(typ)


def source_path(fmt: str, path: Optional[str], builtin: str) -> Path:
    """The file (or, for ``hf``, the file or ``save_to_disk`` dir) rows are read from; for an object-storage URL
    (``s3://bucket/rows.jsonl``) a local copy of the object (``runner.core.storage.fetch``).

    Raises:
        DatasetError: an unknown format, no ``dataset.path`` for a format that needs one, a ``dataset.path``
            beside ``builtin`` (which reads none), or a path (or object) that is not there (naming the fix).
        runner.core.storage.StorageURLError: a URL whose filesystem is not installed.
    """
    rec = reader(fmt)
    if rec.path == "builtin":
        if path:  # a path the builtin prompts would silently not read (the default dataset is builtin)
            from runner.core.readers import READERS

            ext = Path(str(path)).suffix.lstrip(".").lower()
            guess = ext if ext in READERS and reader(ext).path != "builtin" else "jsonl"
            raise DatasetError([f"dataset.path={path!r} is not read by dataset={fmt} (the model's builtin "
                                f"prompts); fix: dataset={guess} dataset.path={path}"])
        return BUILTIN_PROMPTS.parent / builtin
    if not path:
        raise DatasetError([f"dataset.path: required for dataset={fmt}; fix: dataset.path={rec.example_path()}"])
    from runner.core import storage

    if storage.is_url(path):  # object storage: a local copy of the object, hashed and read like a file
        try:
            return storage.fetch(str(path))
        except FileNotFoundError:
            raise DatasetError([f"dataset.path: {path!r}: there is no such object; fix: pass the URL of an "
                                f"existing {fmt} object"]) from None
        except IsADirectoryError:
            raise DatasetError([f"dataset.path: {path!r} is a prefix, not an object; fix: the URL of one {fmt} "
                                "file (a save_to_disk dir is read from a local path only)"]) from None
        except OSError as e:
            raise DatasetError([f"dataset.path: {path!r} cannot be read ({type(e).__name__}: {e}); fix: check "
                                "the bucket, the credentials and the endpoint (AWS_ENDPOINT_URL_S3 for an "
                                "S3-compatible server)"]) from None
    src = Path(path).expanduser()
    dirs = rec.path == "file_or_dir"
    if not (src.is_file() or (dirs and src.is_dir())):
        what = "a dir written by save_to_disk or a data file" if dirs else f"an existing .{fmt} file"
        raise DatasetError([f"dataset.path: {path!r} is not {'a file or dir' if dirs else 'a file'}; fix: "
                            f"pass the path of {what}"])
    return src


def load_rows(fmt: str, path: Optional[str], *, defaults: Dict[str, Any], size_multiple: int, max_pixels: int,
              limit: Optional[int] = None, builtin: str = "prompts.jsonl", split: Optional[str] = None,
              columns: Optional[Dict[str, str]] = None, extra_fields: str = "error",
              spec: Optional[RowSpec] = None, context: Optional[Mapping[str, Any]] = None) -> tuple[List[Row], Path]:
    """Read and validate every diffusion row, before any model loads (:func:`validate_rows` over ``spec``).

    Args:
        fmt: one of :data:`FORMATS`.
        path: file path (ignored for ``builtin``; for ``hf`` a ``save_to_disk`` dir or a data file).
        split: the split of a ``hf`` dataset dict (None: ``train``, or its only split).
        columns: ``{row field: source column}`` (``dataset.columns``, :func:`apply_columns`).
        extra_fields: ``error`` (a field that is no row field is refused) or ``keep`` (kept under the row's ``meta``
            unless it is close to a row field: :func:`extra_field`).
        defaults: run-level values of the row fields by their ``Field.default`` key (``width``, ``height``,
            ``num_inference_steps``, ``guidance_scale``, ``num_images_per_prompt``, ``negative_prompt``...).
        size_multiple: width and height must be positive multiples of this (FLUX: 16 = VAE factor 8 x patch 2).
        max_pixels: upper bound of ``width * height``.
        limit: keep the first ``limit`` rows.
        builtin: file name under ``runner/data`` that ``builtin`` reads (the model's builtin prompts).
        spec: the engine's row spec (None: :data:`VIDEO_ROW`, the diffusion row).
        context: further context of the spec's checks (``task``, ``multi_image``: :func:`check_task_inputs`).

    Returns:
        ``(rows, resolved_path)``.

    Raises:
        DatasetError: listing every problem found (file, line, field, value, fix).
    """
    spec = spec or VIDEO_ROW
    src = source_path(fmt, path, builtin)
    unread: List[str] = []
    try:
        raw = read_raw(fmt, src, split, columns, spec.by_name)
    except DatasetError as e:  # bad lines: the readable rows are checked too, so every problem is named at once
        if e.rows is None:
            raise
        raw, unread = e.rows, e.problems
    if limit is not None:
        raw = raw[:limit]
    try:
        rows = validate_rows(raw, spec, src, from_text=reader(fmt).from_text, extra_fields=extra_fields,
                             defaults=defaults,
                             context={"size_multiple": size_multiple, "max_pixels": max_pixels, **(context or {})})
    except DatasetError as e:
        raise DatasetError(unread + e.problems) from None
    if unread:
        raise DatasetError(unread)
    return rows, src


def apply_ignored(rows: List[Row], path: Any, ignored: Dict[str, tuple], mode: str, model: str,
                  config_values: Optional[Dict[str, tuple]] = None) -> List[Row]:
    """Rows with the fields the model ignores handled by ``dataset.on_ignored`` (``mode``).

    Args:
        ignored: ``{field: (why, fix)}`` or ``{field: (why, fix, applies)}``: the generation fields the model ignores
            under this run's config; ``applies(row)`` limits it to the rows it is true for (e.g. a negative prompt is
            ignored only in rows whose guidance turns guidance off); ``why`` may be ``why(row)``, the reason for
            that row.
        mode: ``error``: a row that sets one is refused; ``record``: the value is removed from the row (not applied)
            and kept under ``row.ignored`` with the reason, for the item's record.
        model: the model name, for the messages.
        config_values: ``{field: (config key, value)}`` of config defaults the model ignores and that the run
            accepted (the caller refuses those of unconditional rules in ``error`` mode); rows that take the default
            (and that the rule applies to) record it as ignored.

    Raises:
        DatasetError: ``mode == "error"``, one problem per row and field (file:line, field, value, why, fix).
    """
    from dataclasses import replace

    problems: List[str] = []
    out: List[Row] = []
    for r in rows:
        hits: Dict[str, Any] = {}
        for f, (why, fix, *applies) in ignored.items():
            if applies and not applies[0](r):
                continue
            why = why(r) if callable(why) else why
            if f in r.set_fields:
                if mode == "error":
                    problems.append(f"{path}:{r.line}: field {f!r} = {shown(getattr(r, f))} is ignored by "
                                    f"model={model}: {why}; fix: remove {f!r} from the row, {fix}, or dataset.on_ignored=record to run "
                                    "it and record the value as ignored")
                else:
                    hits[f] = {"value": getattr(r, f), "why": why, "from": f"{path}:{r.line}"}
            elif config_values and f in config_values:
                key, value = config_values[f]
                hits[f] = {"value": value, "why": why, "from": key}
        if hits:
            values = {k: v for k, v in r.values.items() if k not in hits}
            r = replace(r, ignored=hits, values=values, **{f: None for f in hits if f in Row.__dataclass_fields__})
        out.append(r)
    if problems:
        raise DatasetError(problems)
    return out


def prompts_summary(records: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """Counts over the ok image records of a journal: items, items whose prompt a text encoder truncated (in total
    and per encoder, from each record's ``tokens``), items that carry ``ignored`` fields."""
    out: Dict[str, Any] = {"items": 0, "truncated_items": 0, "truncated_by_encoder": {}, "items_with_ignored_fields": 0}
    for r in records:
        if r.get("status") == "ok":
            prompts_add(out, r, 1)
    return out


def prompts_add(summary: Dict[str, Any], record: Dict[str, Any], sign: int = 1) -> None:
    """Add (``sign=1``) or take away (``-1``) one ok record's share of a :func:`prompts_summary` ``summary`` (the
    incremental merge keeps the run's summary so: ``runner.core.live_merge``)."""
    summary["items"] += sign
    tok = record.get("tokens") or {}
    if any(c.get("dropped") for c in tok.values()):
        summary["truncated_items"] += sign
    per = summary["truncated_by_encoder"]
    for enc, c in tok.items():
        per[enc] = per.get(enc, 0) + (sign if c.get("dropped") else 0)
    if record.get("ignored"):
        summary["items_with_ignored_fields"] += sign


def expand_items(rows: Iterable[Row], run_seed: int) -> List[Item]:
    """One item per image. Seed of image ``k`` of a row: ``row.seed + k`` if the row sets a seed, else
    ``derive_seed(run_seed, row.id) + k`` (mod 2**63).

    Raises:
        DatasetError: two items get the same key (row ``a`` with 2 images makes ``a-1``, which a row may also
            be called), since they would share one file.
    """
    items = []
    seen: Dict[str, Row] = {}
    for row in rows:
        base = row.seed if row.seed is not None else derive_seed(run_seed, row.id)
        for k in range(row.num_images_per_prompt):
            it = Item(row=row, index=k, seed=base + k if row.seed is not None else (base + k) % (1 << 63))
            if it.key in seen:
                raise DatasetError([f"line {row.line}: item key {it.key!r} of row {row.id!r} collides with row "
                                    f"{seen[it.key].id!r} (line {seen[it.key].line}); fix: rename one of the ids"])
            seen[it.key] = row
            items.append(it)
    return items


def batches(items: List[Item], batch_size: int) -> List[List[Item]]:
    """Group items into batches of at most ``batch_size`` with equal ``shape_key``, keeping dataset order
    within each shape group (a group's batches start where its first item stands)."""
    groups: Dict[tuple, List[Item]] = {}
    for it in items:
        groups.setdefault(it.shape_key, []).append(it)
    out = []
    for group in groups.values():
        out.extend(group[i:i + batch_size] for i in range(0, len(group), batch_size))
    return out


def file_sha256(path: Path, chunk_bytes: int = 8 << 20) -> str:
    """sha256 hex digest of a file's bytes, read in chunks of ``chunk_bytes`` (8 MiB) into one reused buffer."""
    import os

    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1 << 16, min(chunk_bytes, os.fstat(f.fileno()).st_size + 1)))  # small file: small buffer
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def dataset_sha256(path: Path) -> str:
    """sha256 of a dataset source: a file's bytes (:func:`file_sha256`), or for a dir (``dataset=hf``, a
    ``save_to_disk`` dir) the sha256 of its files' relative paths and sha256s, one ``<path>\\0<sha256>\\n`` line each
    in sorted order (hidden files and ``*.lock`` left out)."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = f.relative_to(path).as_posix()
        if any(part.startswith(".") for part in rel.split("/")) or rel.endswith(".lock"):
            continue
        h.update(f"{rel}\0{file_sha256(f)}\n".encode())
    return h.hexdigest()
