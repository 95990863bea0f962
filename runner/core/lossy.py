"""Which lanes of a run are lossy by design: a step cache (``cache.method``), a lossy linear backend (``FP8``), a
lossy attention backend (``SAGE_ATTN``: INT8 Q/K), an attention spec with ``quant``/``skip_softmax``, or weight
quantization (``model.quantization.<component>``).

The manifest's ``lossy`` section (``{"lossy": bool, "lanes": [...], "batch_dependent": [...]}``) is written from here
at startup; the report labels such jobs and ``runner.tools.gate`` compares each with the lossless job of the same rows
and batch size. A manifest written before the section existed is labelled from its ``backends``, ``config`` and
``evidence`` the same way (:func:`of_manifest`).

``batch_dependent`` lists the lanes that make an item's output depend on its batch peers, a property of the lane:
an *adaptive* step cache (``cache.schedule`` ``adaptive``: ``first_block``, ``magcache``) decides per pipeline call
from the activations of the whole batch whether to reuse, so an item's image changes with the items it was batched
with (first_block on toy_shapes: up to 46 intensity levels between batch 1 and batch 4, where lossless pairs differ
by at most 1). A fixed schedule (``taylorseer``, ``pab``) and the lossy kernels act per item.

Lanes are strings: ``cache=<method>``, ``model.quantization.<component>=<method>``, ``<stage>.linear=<backend>``, ``<stage>.attention.<role>=<backend>`` (with
``+quant``/``+skip_softmax`` when the spec sets them), ``model.distilled=<preset>`` (a few-step distilled preset:
``model.distilled``, ``docs/lora.md``; its section also holds ``distilled``: the preset, its adapters and ``base``,
the model's own values of the generation fields a preset sets, which the gate's reference must have run).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional


def _cache_method(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    c = (config or {}).get("cache") or {}
    name = str(c.get("method") or "none")
    return None if name.strip().lower() in ("none", "", "null", "off") else name


def lanes(backends: Mapping[str, Mapping[str, Any]], config: Optional[Mapping[str, Any]]) -> List[str]:
    """The lossy lanes of a run.

    Args:
        backends: the manifest's ``backends``: ``{stage: {field: resolution dict with "selected"}}``.
        config: the resolved run config (its ``cache`` section).
    """
    from runner.kernels.registry import is_lossy  # imports torch: not at module import (the readers: repro, report)

    out: List[str] = []
    method = _cache_method(config)
    if method is not None:
        out.append(f"cache={method}")
    out.extend(quantization_lanes(config))
    preset = distilled_preset(config)
    if preset is not None:
        out.append(f"model.distilled={preset}")
    for stage, fields in (backends or {}).items():
        for fname, res in (fields or {}).items():
            sel = (res or {}).get("selected") if isinstance(res, Mapping) else None
            if sel is None:
                continue
            specs = sel.items() if isinstance(sel, Mapping) else [(None, sel)]
            for role, spec in specs:
                if isinstance(spec, Mapping):
                    name = str(spec.get("backend"))
                    extra = [k for k in ("quant", "skip_softmax") if spec.get(k)]
                else:
                    name, extra = str(spec), []
                if is_lossy(fname, name) or extra:
                    key = f"{stage}.{fname}" + (f".{role}" if role is not None else "")
                    out.append(f"{key}={name}" + "".join(f"+{k}" for k in extra))
    return out


def quantization_lanes(config: Optional[Mapping[str, Any]]) -> List[str]:
    """``model.quantization.<component>=<method>`` for every quantized component of the config (each method of
    ``runner.kernels.quantization`` is lossy: weights rounded to fewer bits), spelled as the config gives it."""
    q = (((config or {}).get("model") or {}).get("quantization")) or {}
    return [f"model.quantization.{k}={v}" for k, v in q.items()
            if k != "gguf_file" and v is not None and str(v).strip().lower() not in ("none", "", "null", "off")]


#: The ``model.generation`` fields a distilled preset sets (steps, the scheduler's shift, guidance): the gate compares
#: its run with the base model's run of the same rows at the model's own values of these (``base``).
DISTILLED_FIELDS = ("num_inference_steps", "shift", "guidance_scale", "guidance_scale_2", "true_cfg_scale")


def distilled_preset(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    """``model.distilled.preset`` of a run config (None: not a distilled run, or a config before the field)."""
    d = (((config or {}).get("model") or {}).get("distilled")) or {}
    p = d.get("preset") if isinstance(d, Mapping) else None
    return None if p is None or str(p).strip().lower() in ("", "none", "null") else str(p)


def base_generation(model_name: str, generation: Mapping[str, Any]) -> Dict[str, Any]:
    """The model's own values of :data:`DISTILLED_FIELDS`: ``conf/model/<model_name>.yaml``'s ``generation`` (the
    schema's default for a field it leaves out, null for ``shift``); a model without a YAML there (another config
    search path): the run's own ``generation`` values (its gate then needs a reference at the preset's values)."""
    from omegaconf import OmegaConf

    from runner.core.paths import CONF_DIR
    from runner.core.schema import GenerationDefaults

    yaml = CONF_DIR / "model" / f"{model_name}.yaml"
    if not yaml.is_file():
        return {k: generation.get(k) for k in DISTILLED_FIELDS}
    own = OmegaConf.to_container(OmegaConf.load(yaml).get("generation") or OmegaConf.create({}), resolve=False)
    schema = GenerationDefaults()
    return {k: own[k] if k in own else getattr(schema, k) for k in DISTILLED_FIELDS}


def distilled_section(config: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """The lossy section's ``distilled``: ``{"preset", "adapters", "base"}`` (:func:`base_generation`), None for a
    run that is no distilled preset."""
    preset = distilled_preset(config)
    if preset is None:
        return None
    model = (config or {}).get("model") or {}
    d = model.get("distilled") or {}
    return {"preset": preset, "adapters": list(d.get("adapters") or []),
            "base": base_generation(str(model.get("name")), model.get("generation") or {})}


#: Step-cache schedules whose reuse decision is taken per pipeline call from the whole batch's activations.
BATCH_DEPENDENT_SCHEDULES = ("adaptive",)


def section(backends: Mapping[str, Mapping[str, Any]], config: Optional[Mapping[str, Any]],
            cache_schedule: Optional[str] = None) -> Dict[str, Any]:
    """The manifest's ``lossy``: ``{"lossy": bool, "lanes": [...], "batch_dependent": [...]}``.

    Args:
        cache_schedule: the step cache's schedule as validated (``models.cache.CacheSettings.schedule``:
            ``fixed``/``adaptive``; None: no cache, or unknown); an ``adaptive`` one makes the cache lane
            ``batch_dependent``.
    """
    found = lanes(backends, config)
    method = _cache_method(config)
    dependent = ([f"cache={method}"] if method is not None and cache_schedule in BATCH_DEPENDENT_SCHEDULES
                 else [])
    out = {"lossy": bool(found), "lanes": found, "batch_dependent": dependent}
    distilled = distilled_section(config)
    if distilled is not None:
        out["distilled"] = distilled
    return out


def _recorded_schedule(manifest: Mapping[str, Any]) -> Optional[str]:
    """The step cache's schedule an older manifest records: its evidence's (``stages.<stage>.cache.schedule``),
    else ``config.cache.schedule``."""
    for st in (((manifest.get("evidence") or {}).get("stages")) or {}).values():
        sched = ((st or {}).get("cache") or {}).get("schedule") if isinstance(st, Mapping) else None
        if sched:
            return str(sched)
    sched = ((manifest.get("config") or {}).get("cache") or {}).get("schedule")
    return None if sched is None else str(sched)


def of_manifest(manifest: Mapping[str, Any]) -> Dict[str, Any]:
    """A manifest's ``lossy`` section, or the one its ``backends``, ``config`` and ``evidence`` imply (older
    manifests; ``batch_dependent`` of a section written before it existed, the same way)."""
    doc = manifest.get("lossy")
    implied = section(manifest.get("backends") or {}, manifest.get("config") or {}, _recorded_schedule(manifest))
    if isinstance(doc, Mapping) and "lossy" in doc:
        dependent = doc["batch_dependent"] if "batch_dependent" in doc else implied["batch_dependent"]
        out = {"lossy": bool(doc["lossy"]), "lanes": list(doc.get("lanes") or []),
               "batch_dependent": list(dependent or [])}
        if doc.get("distilled"):
            out["distilled"] = dict(doc["distilled"])
        return out
    return implied
