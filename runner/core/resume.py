"""Resume: reuse the finished items of an earlier run in the same dir, regenerate the rest with the same seeds.

An item is reused only when the current run would produce exactly it: its ``items.jsonl`` record says ``ok``, its
artifact exists with the recorded sha256, and the record's ``inputs_sha256`` and ``batch`` equal those the
current run computes for that item (:func:`inputs_sha256`, :func:`expected_inputs`): together, everything that
determines the artifact's bytes,

* the item's own inputs (:func:`item_inputs`): prompt, negative prompt, seed, width, height, steps, guidance
  (every field of its dataset row but the id, the line number and the oracle's ``expect``); in a pipeline the
  row's prompt before the upstream stage rewrote it (the upstream stage's config and template are in the run's
  identity; its output is a function of them);
* its batch (recorded as ``batch: {size, position}``, compared beside the hash): the size of the batch it ran in
  and its position there (batched GEMMs may round a row differently at another size or position:
  ``batch_size=4`` differs from ``batch_size=1`` by one intensity level on CPU); the loop regenerates every batch
  that holds an item it cannot reuse, whole, so items keep their batch peers and positions;
* the run's identity (:func:`run_identity`): the semantic config (model, weights source, architecture,
  generation settings, compile, optimize, cpu_threads, and the step cache when one is on), the resolved dtype and
  the backends selected per stage, the platform kind and device, and the versions of the packages that compute
  or encode it (torch, diffusers, transformers, pillow, vLLM, kernels).

Missing or corrupt artifacts and items whose inputs differ are regenerated. A resume whose *semantic* config
differs from the earlier run's is refused with the differing keys named, unless ``run.force=true``; with it,
only the items whose inputs still match are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from runner.core import media
from runner.core.errors import UserInputError
from runner.core.schema import IDENTITY, RESUME, factor_keys, holds_entries, null_when_unset, omitted_fields

#: Keys of the resolved config compared on resume, derived from the schema's field declarations
#: (``runner.core.schema.declared(..., enters=(RESUME, ...))``); the ``cache`` and ``optimize.compile_mode`` keys
#: count only while set (:data:`WHEN_SET`).
SEMANTIC_KEYS = factor_keys(RESUME)
#: Keys of the resolved config in the run identity (same declarations, ``IDENTITY``).
IDENTITY_KEYS = factor_keys(IDENTITY)


def compile_mode_of(cfg: Dict[str, Any]) -> Optional[str]:
    """``optimize.compile_mode`` when it is not torch's default (it can change the kernels, so the bytes); None
    otherwise, so identities of runs that never set it are unchanged."""
    mode = _get(cfg, "optimize.compile_mode")
    return None if mode in (None, "default") else str(mode)


class ResumeConflictError(UserInputError, ValueError):
    """The run dir holds a run with a different semantic config (names the keys and the fix)."""


def _get(d: Dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _flat(x: Any, prefix: str) -> Dict[str, Any]:
    if isinstance(x, dict):
        out: Dict[str, Any] = {}
        for k, v in x.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out or {prefix: {}}
    return {prefix: x}


def cache_config(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``cache`` section of a resolved config when a step cache is on, else None: a run without a cache (or
    written before the section existed) has the identity and semantic config it had before step caching existed."""
    c = _get(cfg, "cache")
    if not isinstance(c, dict) or str(c.get("method") or "none").strip().lower() in ("none", "", "null", "off"):
        return None
    return c


#: ``model.task`` values that generate from text alone: the task of every run made before tasks existed.
TEXT_TASKS = (None, "text_to_image", "text_to_video")


def task_of(cfg: Dict[str, Any]) -> Optional[str]:
    """``model.task`` when it is a conditioning task (inputs from the rows), else None: a text run's identity and
    semantic config stay what they were before ``model.task`` existed."""
    task = _get(cfg, "model.task")
    return None if task in TEXT_TASKS else str(task)


def inpaint_overlay_of(cfg: Dict[str, Any]) -> Optional[bool]:
    """``output.inpaint_overlay`` of an inpaint run (it changes the pixels outside the mask), else None."""
    return bool(_get(cfg, "output.inpaint_overlay")) if task_of(cfg) == "inpaint" else None


def quantization_of(cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """``model.quantization``'s set entries (component -> method, and ``gguf_file``) while any component is
    quantized, else None: an unquantized run keeps the identity it had before the field existed."""
    q = _get(cfg, "model.quantization") or {}
    set_ = {k: v for k, v in dict(q).items() if v not in (None, "none")}
    return set_ if any(k != "gguf_file" for k in set_) else None


def vae_tiling_of(cfg: Dict[str, Any]) -> Optional[bool]:
    """``memory.vae_tiling`` while true (tiled decoding changes the pixels), else None."""
    return True if _get(cfg, "memory.vae_tiling") else None


def audio_of(cfg: Dict[str, Any]) -> Optional[bool]:
    """``output.audio`` when it is off (the videos of an audio family lose their audio stream), else None, so the
    identities of runs that never turned it off are unchanged."""
    return False if _get(cfg, "output.audio") is False else None


#: The keys that enter only while set (``Factors.when_set``), each with what reads its set value (None: unset).
WHEN_SET = {"cache": cache_config, "optimize.compile_mode": compile_mode_of, "model.task": task_of,
            "output.inpaint_overlay": inpaint_overlay_of, "model.quantization": quantization_of,
            "memory.vae_tiling": vae_tiling_of, "output.audio": audio_of}


def _when_set_keys(kind: str) -> tuple:
    """The :data:`WHEN_SET` keys that enter ``kind``, in :data:`WHEN_SET`'s order.

    Raises:
        KeyError: the schema declares a key that enters only while set, and :data:`WHEN_SET` does not say what
            *set* means for it.
    """
    keys = factor_keys(kind, when_set=True)
    unknown = set(keys) - set(WHEN_SET)
    if unknown:
        raise KeyError(f"{sorted(unknown)} enter only while set, but WHEN_SET does not say what set means for them")
    return tuple(k for k in WHEN_SET if k in keys)


def current_names(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A resolved config recorded by an earlier version, under today's key names: ``model.adapter`` (before issue
    #39) is ``model.engine``, in the model, each pipeline stage and its stage model. Returns a new dict; ``cfg`` as it
    is when it has nothing to rename."""
    model = cfg.get("model") if isinstance(cfg, dict) else None
    if not isinstance(model, dict):
        return cfg

    def node(m: Dict[str, Any]) -> Dict[str, Any]:
        if m.get("adapter") is None or "engine" in m:
            return m
        return {**{k: v for k, v in m.items() if k != "adapter"}, "engine": m["adapter"]}

    new = node(model)
    stages = new.get("stages")
    if isinstance(stages, dict):
        new = {**new, "stages": {n: {**node(st), **({"model": node(st["model"])} if isinstance(st.get("model"), dict)
                                                   else {})} if isinstance(st, dict) else st
                                 for n, st in stages.items()}}
    return cfg if new == model else {**cfg, "model": new}


def semantic_diff(old_cfg: Dict[str, Any], new_cfg: Dict[str, Any], old_dataset_sha: Optional[str],
                  new_dataset_sha: str, keys: Sequence[str] = ()) -> List[str]:
    """Dotted keys whose values differ between two resolved configs (plus ``dataset.sha256``), as
    ``"key: old -> new"`` strings.

    Args:
        keys: further keys compared beside :data:`SEMANTIC_KEYS` (the sink's ``config_keys``: ``output.video_codec``
            of a video run), so that they count only for the runs whose artifacts they change.
    """
    diffs = []
    old_cfg = current_names(old_cfg)
    for key in (*SEMANTIC_KEYS, *keys):
        a, b = (_flat(_entries_without_omitted(key, _get(c, key)), key) for c in (old_cfg, new_cfg))
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                diffs.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    for key in _when_set_keys(RESUME):
        a, b = WHEN_SET[key](old_cfg), WHEN_SET[key](new_cfg)
        if a != b:
            shown = (a, b) if key == "cache" else tuple("default" if v is None else v for v in (a, b))
            diffs.append(f"{key}: {shown[0]!r} -> {shown[1]!r}")
    if old_dataset_sha is not None and old_dataset_sha != new_dataset_sha:
        diffs.append(f"dataset.sha256: {old_dataset_sha[:12]}… -> {new_dataset_sha[:12]}…")
    return diffs


def _entries_without_omitted(key: str, value: Any) -> Any:
    """A list-of-entries value (``model.lora``) without the fields its schema leaves out of the resume comparison
    (``runner.core.schema.omitted_fields``: an adapter's ``path`` and ``name``); other values as they are."""
    if not isinstance(value, list) or key not in SEMANTIC_KEYS:
        return value
    drop = omitted_fields(key, RESUME)
    if not drop:
        return value
    return [{k: v for k, v in e.items() if k not in drop} if isinstance(e, dict) else e for e in value]


def lora_renames(prev: Optional[Dict[str, Any]], source: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Adapters of this run whose content (sha256) the earlier run (``prev``, its manifest) held under another path
    or name: ``[{"sha256", "from": {"name", "path"}, "to": {"name", "path"}}]``. A rename is recorded metadata, not a
    conflict and not a new identity (the identity holds the adapter's sha256 and scale: :func:`_source_fingerprint`);
    items reused from the earlier run keep the name they were generated under."""
    old = {a.get("sha256"): a for a in ((((prev or {}).get("model") or {}).get("source") or {}).get("lora") or {})
           .get("adapters") or []}
    out = []
    for a in (source.get("lora") or {}).get("adapters") or []:
        o = old.get(a.get("sha256"))
        if o is not None and (o.get("name"), o.get("path")) != (a.get("name"), a.get("path")):
            out.append({"sha256": a["sha256"], "from": {"name": o.get("name"), "path": o.get("path")},
                        "to": {"name": a.get("name"), "path": a.get("path")}})
    return out


def previous_run(out_dir: Path, names: tuple = ("manifest.json",)) -> Optional[Dict[str, Any]]:
    """The earlier manifest in ``out_dir`` (the first of ``names`` that exists), or None when the dir holds no
    run (or only a run refused before it produced anything).

    Raises:
        ResumeConflictError: the manifest is not a JSON object (empty, truncated, edited): what the dir holds cannot be
            compared with this run, so nothing is resumed or overwritten; names the file and the fix.
    """
    p = next((out_dir / n for n in names if (out_dir / n).is_file()), None)
    if p is None:
        return None
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except (ValueError, OSError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        doc = e
    if not isinstance(doc, dict):
        raise ResumeConflictError(
            f"{p} is not a run's manifest ({type(doc).__name__}: {str(doc)[:120] or 'empty'}): the dir's earlier run "
            "cannot be compared with this one, so nothing is resumed or overwritten; fix: another run dir "
            "(hydra.run.dir=...), or move the dir's files away if they are not a run's")
    if doc.get("status") in ("refused", "invalid"):  # stopped before any artifact: nothing to resume
        return None
    return doc


def merged_manifest(out_dir: Path, manifest_name: str) -> Optional[Dict[str, Any]]:
    """A data-parallel worker's view of the dir's merged ``manifest.json`` (a merge's: it has ``workers``), read
    beside its own ``manifest_name``; None for a one-process run (its manifest is that file) or when there is none
    or it cannot be read. Its ``workers`` name the run_ids the earlier attempt's items carry
    (``runner.core.provenance.attempts_chain``)."""
    if manifest_name == "manifest.json":
        return None
    try:
        doc = json.loads((out_dir / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("workers"), list) else None


def remove_temp_files(out_dir: Path) -> List[str]:
    """Delete temp files that a killed run or worker left: ``.<name>.tmp<pid>`` in ``out_dir``, ``out_dir/images``
    and ``out_dir/videos``, and the claim store's ``.<key>.tmp<pid>.<thread id>`` anywhere under ``out_dir/claims``
    (a worker SIGKILLed while its lease renewer rewrote its claim or worker record: ``runner.core.claims``).
    Returns their names. Only names of those patterns are touched.

    Call it only while no writer is live in ``out_dir``: before the run's workers start, or once every worker
    ended (the claims merge, the Ray driver), since a live writer's temp file would go before its rename."""
    import re

    gone = []
    dirs = [out_dir, out_dir / "images", out_dir / "videos"]
    claims = out_dir / "claims"
    if claims.is_dir():
        dirs += [p for p in sorted(claims.rglob("*")) if p.is_dir()]
    for d in dirs:
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file() and re.fullmatch(r"\..+\.tmp\d+(\.\d+)?" if claims in d.parents else r"\..+\.tmp\d+",
                                                p.name):
                    p.unlink()
                    gone.append(p.name)
    return gone


def finished(out_dir: Path) -> Dict[str, Dict[str, Any]]:
    """``{item key: record}`` of items whose artifact exists and matches its recorded sha256 (and so does its frame
    dump, when it names one: ``runner.core.sinks.artifact_intact``), whatever inputs produced it (:func:`reusable` keeps
    those the current run would produce)."""
    from runner.core.sinks import artifact_intact, read_journal

    done: Dict[str, Dict[str, Any]] = {}
    records = [rec for p in sorted(out_dir.glob("items*.jsonl")) for rec in read_journal(p)]  # + workers' journals
    for rec in records:
        if rec.get("status") != "ok" or not rec.get("file"):
            continue
        if artifact_intact(out_dir, rec):
            done[rec["key"]] = rec
        elif rec["key"] in done and not (out_dir / done[rec["key"]]["file"]).is_file():
            done.pop(rec["key"], None)
    return done


# ------------------------------------------------------------------------------------------------ identity
#: Row fields that do not change an item's bytes: the id and line name the file, ``expect`` is the oracle's,
#: ``num_images_per_prompt`` makes more items (each with its own seed, which is part of the inputs), ``meta`` (extra
#: fields kept by ``dataset.extra_fields=keep``) is only recorded.
ITEM_FIELDS_EXCLUDED = ("id", "line", "expect", "num_images_per_prompt", "meta")
#: Row fields whose run-level defaults (``model.generation.<field>``) reach the bytes only through the rows (declared
#: on ``runner.core.schema.GenerationDefaults``: omitted from the identity).
ROW_DEFAULTS = omitted_fields("model.generation", IDENTITY)
#: Package versions that do not change what is computed or encoded.
PACKAGES_EXCLUDED = ("python", "hydra-core", "omegaconf")


def _canonical(x: Any) -> bytes:
    return json.dumps(x, sort_keys=True, default=str, separators=(",", ":")).encode()


def item_inputs(item: Any) -> Dict[str, Any]:
    """What of one item determines its bytes, and its effective seed: for a row validated by a row spec
    (``runner.core.dataset.RowSpec``), the spec's identity fields (``Field.identity``: ``always``, or ``set`` when
    not None; a field an engine adds reaches the identity through its spec alone) with the row's ``set_fields`` and
    ``ignored``; for another row object, every field except :data:`ITEM_FIELDS_EXCLUDED`."""
    row = item.row
    spec = getattr(row, "row_spec", None)
    if spec is not None:  # a validated row: its spec's identity fields, and what validation made of the row
        d = {**spec.identity(row), "set_fields": row.set_fields, "ignored": row.ignored}
    else:
        d = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else dict(vars(row))
        d = {k: v for k, v in d.items() if k not in ITEM_FIELDS_EXCLUDED}
    d["seed"] = item.seed
    return d


def _source_fingerprint(source: Dict[str, Any]) -> Dict[str, Any]:
    """The weight source, with a cheap fingerprint of a local snapshot: every config/index JSON's sha256 and every
    weight file's name and size (hashing the weights would read gigabytes before anything starts); LoRA adapters by
    their sha256, scale and layers (not their path or name: renaming a file changes no byte)."""
    out = {k: v for k, v in source.items() if k != "files"}
    if isinstance(out.get("lora"), dict):  # an adapter is its content and scale; its path and name are labels
        out["lora"] = {**out["lora"], "adapters": [{k: v for k, v in a.items() if k not in ("name", "path")}
                                                   for a in out["lora"].get("adapters") or []]}
    path = source.get("path")
    if source.get("kind") == "path" and path and Path(path).is_dir():
        root = Path(path)
        files = {}
        for f in sorted(root.rglob("*")):
            if not f.is_file():
                continue
            rel = str(f.relative_to(root))
            files[rel] = (hashlib.sha256(f.read_bytes()).hexdigest() if f.suffix == ".json" and
                          f.stat().st_size < (1 << 24) else f.stat().st_size)
        out["files"] = files
    return out


def _identity_value(cfg: Dict[str, Any], key: str) -> Any:
    """``key``'s value in the identity: as canonical JSON, without the fields declared omitted from it
    (``runner.core.schema.omitted_fields``: row defaults, per-stage backends), in each entry of a mapping, and
    without the fields that count only while set when they are null (``runner.core.schema.null_when_unset``:
    ``model.generation.shift``)."""
    val = json.loads(_canonical(_get(cfg, key)))
    if isinstance(val, dict) and not holds_entries(key):
        unset = [k for k in null_when_unset(key) if val.get(k) is None]
        val = {k: v for k, v in val.items() if k not in unset}
    drop = omitted_fields(key, IDENTITY)
    if drop and isinstance(val, dict):
        if holds_entries(key):
            return {n: {k: v for k, v in (e or {}).items() if k not in drop} for n, e in val.items()}
        return {k: v for k, v in val.items() if k not in drop}
    return val


def _former_names(config: Dict[str, Any]) -> Dict[str, Any]:
    """The identity's config under the key names it had when the identity was first recorded, so a rename of a
    config key leaves every run's identity (and so its resume) unchanged: ``model.engine`` was ``model.adapter``
    before issue #39, in the model and in each pipeline stage and its stage model (whose former guard of that name,
    always null, did not exist then)."""
    out = dict(config)
    if "model.engine" in out:
        out["model.adapter"] = out.pop("model.engine")
    stages = out.get("model.stages")
    if isinstance(stages, dict):
        out["model.stages"] = {n: _former_stage(e) for n, e in stages.items()}
    return out


def _former_stage(entry: Any) -> Any:
    if not isinstance(entry, dict) or "engine" not in entry:  # a one-stage model's StageConfig has neither
        return entry
    e = {k: v for k, v in entry.items() if k not in ("engine", "adapter")}
    e["adapter"] = entry["engine"]
    if isinstance(e.get("model"), dict) and "engine" in e["model"]:
        e["model"] = {**{k: v for k, v in e["model"].items() if k not in ("engine", "adapter")},
                      "adapter": e["model"]["engine"]}
    return e


def run_identity(cfg: Dict[str, Any], dtype: str, platform: Dict[str, Any], backends: Dict[str, Any],
                 packages: Dict[str, Any], source: Optional[Dict[str, Any]] = None,
                 output: Optional[Dict[str, Any]] = None, context: Any = None) -> Dict[str, Any]:
    """The part of every item's identity that the whole run shares (see the module docstring).

    Args:
        cfg: the resolved run config.
        dtype: the resolved compute dtype (``float32``).
        platform: ``PlatformInfo.to_dict()``.
        backends: ``{stage: {field: FieldResolution.to_dict()}}``; only what is *selected* counts (``auto`` and an
            explicit name that select the same backend compute the same bytes).
        packages: ``runner.core.manifest.package_versions()``.
        source: the final stage's weight source (``model.source``).
        output: what encodes the artifacts beyond the packages (the sink's ``identity``: a video run's codec
            preset, imageio-ffmpeg and ffmpeg versions, frame dump), kept as ``output``; None: no such key.
        context: the context-parallel layout (``runner.core.distributed.Layout``), kept as ``context_parallel``
            (its Ulysses and ring degrees: a split sequence's attention sums in another order than a whole one, so
            its images are close to, not equal to, a one-device run's); None: no such key (data parallelism
            computes the same bytes as one device).
    """
    config = _former_names({key: _identity_value(cfg, key) for key in IDENTITY_KEYS})
    for key in _when_set_keys(IDENTITY):  # absent while unset, so identities of runs that never set it are unchanged
        val = WHEN_SET[key](cfg)
        if val is not None:
            config[key] = json.loads(_canonical(val))
    probes = platform.get("probes") or {}
    doc = {
        "config": config,
        "dtype": dtype,
        "platform": {"kind": platform.get("kind"), "capability": platform.get("capability"),
                     "device_name": probes.get("device_name") if platform.get("kind") != "cpu" else None},
        "backends": {st: {f: (r or {}).get("selected") for f, r in (fields or {}).items()}
                     for st, fields in backends.items()},
        "packages": {k: v for k, v in packages.items() if k not in PACKAGES_EXCLUDED},
        "source": _source_fingerprint(source or {}),
    }
    if output is not None:
        doc["output"] = output
    if context is not None:
        doc["context_parallel"] = {"ulysses_degree": context.ulysses, "ring_degree": context.ring}
    return doc


def identity_sha256(identity: Dict[str, Any]) -> str:
    """sha256 of a run identity (:func:`run_identity`)."""
    return hashlib.sha256(_canonical(identity)).hexdigest()


def inputs_sha256(run_sha: str, item: Any) -> str:
    """The ``inputs_sha256`` of one item: its inputs (:func:`item_inputs`) under the run identity ``run_sha``."""
    return hashlib.sha256(_canonical({"run": run_sha, "item": item_inputs(item)})).hexdigest()


def expected_inputs(run_sha: str, batches: Iterable[Sequence[Any]]) -> Dict[str, Dict[str, Any]]:
    """``{item key: {"inputs_sha256", "batch": {"size", "position"}}}`` of every item of ``batches``, as the run
    forms them."""
    return {it.key: {"inputs_sha256": inputs_sha256(run_sha, it), "batch": {"size": len(b), "position": p}}
            for b in batches for p, it in enumerate(b)}


def identity_diff(old: Optional[Dict[str, Any]], new: Dict[str, Any]) -> List[str]:
    """Dotted keys of two run identities that differ (``config.model.generation.true_cfg_scale``, ``packages.torch``),
    for the log of a resume that regenerates items."""
    if not old:
        return ["(the earlier run recorded no identity)"]
    a, b = _flat(old, "identity"), _flat(new, "identity")
    return [f"{k[len('identity.'):]}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def reusable(done: Dict[str, Dict[str, Any]], expected: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The finished records the current run would produce exactly: ``inputs_sha256`` and ``batch`` (size and
    position) equal to ``expected``'s. A record without them (written before identities were recorded) is never
    reused."""
    return {k: r for k, r in done.items() if k in expected
            and r.get("inputs_sha256") == expected[k]["inputs_sha256"] and r.get("batch") == expected[k]["batch"]}


def why_not_reused(rec: Dict[str, Any], item: Any, run_changed: bool) -> str:
    """The first reason ``rec`` is not the current run's output of ``item``: prompt, seed, a parameter, the batch,
    or the run identity."""
    r = item.row
    if rec.get("prompt_sha256") not in (None, hashlib.sha256(r.prompt.encode()).hexdigest()):
        return "prompt"
    if rec.get("seed") is not None and rec.get("seed") != item.seed:
        return "seed"
    now, was = media.digests(getattr(r, "inputs", None)), media.digests(rec.get("inputs"))
    for f in sorted(now):  # a media input whose bytes changed (runner.core.media)
        if was.get(f) != now[f]:
            return f"input {f} changed"
    params = rec.get("params") or {}
    for k, v in item_inputs(item).items():
        if k in params and params[k] != v:
            return k
    if "inputs_sha256" not in rec:
        return "no inputs_sha256 recorded"
    if run_changed:
        return "run config/platform/backends/packages"
    return "its batch: size/position " + "/".join(str((rec.get("batch") or {}).get(k)) for k in ("size", "position"))


def regenerate_batches(batches: Sequence[Sequence[Any]], reuse: Dict[str, Any]) -> List[Any]:
    """Items of every batch that holds an item not in ``reuse``, batch after batch: such a batch runs again whole,
    so each of its items keeps its batch peers and position (its reused items are written again, same bytes)."""
    return [it for b in batches if any(it.key not in reuse for it in b) for it in b]


@dataclasses.dataclass
class ResumePlan:
    """What a run does with what its dir already holds, decided before anything loads (:func:`plan`).

    Attributes:
        run_sha: the run identity's sha256 (:func:`identity_sha256`).
        expected: ``{item key: {inputs_sha256, batch}}`` this run computes for each item (:func:`expected_inputs`).
        prev: the earlier run's manifest (``status`` ``crashed`` when it still said ``running``: this run holds the
            dir, so that process is gone), None for a fresh dir or a stage that does not resume.
        done: the dir's finished ok records by key (:func:`finished`); ``{}`` without ``prev``.
        reuse: the records of ``done`` this run reuses (:func:`reusable`).
        todo: the items to generate, in dataset order: every item of a batch holding one it cannot reuse
            (:func:`regenerate_batches`; the batch runs again whole), or every item of a stage that does not resume.
    """

    run_sha: str
    expected: Dict[str, Dict[str, Any]]
    prev: Optional[Dict[str, Any]]
    done: Dict[str, Dict[str, Any]]
    reuse: Dict[str, Dict[str, Any]]
    todo: List[Any]


def plan(out_dir: Path, *, items: Sequence[Any], batches: Sequence[Sequence[Any]], identity: Dict[str, Any],
         resumable: bool, manifest_names: tuple, resume_dir: Optional[str], force: bool,
         config: Dict[str, Any], dataset_sha: Optional[str], config_keys: Sequence[str] = ()) -> ResumePlan:
    """The resume decision of one run (or one data-parallel worker) into ``out_dir``.

    Args:
        items: every item of this process, in dataset order; ``batches``: the same items as this run batches them
            (empty for a stage that does not resume).
        identity: the run identity (:func:`run_identity`); config / dataset_sha: the resolved run config and the
            dataset's sha256, compared with the earlier run's (:func:`semantic_diff`, plus ``config_keys``: the
            output sink's own keys).
        resumable: whether the final stage resumes at all; manifest_names: where an earlier run's manifest may be.
        resume_dir / force: ``run.resume`` and ``run.force``.

    Raises:
        ResumeConflictError: ``run.resume`` names a dir without a run, or the earlier run's semantic config differs
            and ``run.force`` is false (naming every differing key and the fix).
    """
    run_sha = identity_sha256(identity)
    expected = expected_inputs(run_sha, batches)
    prev = previous_run(out_dir, manifest_names) if resumable else None
    if resume_dir and prev is None:
        raise ResumeConflictError(f"run.resume={resume_dir!r} holds no manifest.json, so there is no run "
                                  "to resume; fix: point at an earlier run dir")
    if prev is not None and prev.get("status") == "running":  # this run holds the dir: that process is gone
        prev = {**prev, "status": "crashed"}
    done: Dict[str, Dict[str, Any]] = {}
    reuse: Dict[str, Dict[str, Any]] = {}
    if prev is not None:
        diffs = semantic_diff(prev.get("config", {}), config, prev.get("dataset", {}).get("sha256"), dataset_sha,
                              keys=config_keys)
        if diffs and not force:
            raise ResumeConflictError(
                f"{out_dir} holds a run with a different config; resuming would mix artifacts. Differing keys:\n  "
                + "\n  ".join(diffs) + "\nfix: use a new run dir, or run.force=true to resume anyway (only items "
                "whose inputs still match are kept)")
        done = finished(out_dir)
        reuse = reusable(done, expected)
        log_not_reused(done, reuse, items, {k: v for k, v in (prev.get("identity") or {}).items() if k != "sha256"},
                       identity)
    again = {it.key for it in regenerate_batches(batches, reuse)}
    todo = [it for it in items if it.key in again] if resumable else list(items)
    return ResumePlan(run_sha=run_sha, expected=expected, prev=prev, done=done, reuse=reuse, todo=todo)


def log_not_reused(done: Dict[str, Dict[str, Any]], reuse: Dict[str, Dict[str, Any]], items: Sequence[Any],
                   old_identity: Optional[Dict[str, Any]], identity: Dict[str, Any]) -> None:
    """Log the finished items of the dir that are regenerated because the current run would not produce them
    exactly, with the reason of each (the first few) and what differs in the run identity."""
    import logging

    by_key = {it.key: it for it in items}
    stale = [k for k in done if k in by_key and k not in reuse]
    if not stale:
        return
    run_diff = identity_diff(old_identity, identity) if old_identity != identity else []
    reasons = [f"{k} ({why_not_reused(done[k], by_key[k], bool(run_diff))})" for k in stale[:10]]
    logging.getLogger("runner").warning(
        "%d finished item(s) are regenerated, their inputs differ from this run's: %s%s%s", len(stale),
        ", ".join(reasons), " ..." if len(stale) > 10 else "",
        ("; run identity differs: " + "; ".join(run_diff[:8])) if run_diff else "")
