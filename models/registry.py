"""Engine registry: ``model.engine`` names mapped to lazy import paths, so that vLLM and diffusers are imported
only by a run that uses them (``import vllm`` alone costs 13-30 s on 2 cores).

Imitates vLLM's ``vllm/v1/attention/backends/registry.py`` (values are lazy class paths) and its out-of-tree
``register_backend``: an engine defined outside this package is one :func:`register_engine` call.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Dict, List, Union

#: diffusion family name (``model.engine``) -> ``"module:SPEC"`` of its :class:`models.family.FamilySpec` or the
#: spec itself (registered at run time); the one list of families: messages and tests derive theirs from it.
FAMILIES: Dict[str, Any] = {
    "flux": "models.flux:FLUX",
    "flux2": "models.flux2:FLUX2",
    "flux2_klein": "models.flux2:FLUX2_KLEIN",
    "sd3": "models.sd3:SD3",
    "qwen_image": "models.qwen_image:QWEN_IMAGE",
    "wan": "models.wan:WAN",
    "hidream": "models.hidream:HIDREAM",
    "ltx2": "models.ltx2:LTX2",
    "zimage": "models.zimage:ZIMAGE",
    "hunyuanvideo15": "models.hunyuanvideo15:HUNYUANVIDEO15",
}

#: engine name (``model.engine``) -> ``"module:Class"`` or the class itself (registered at run time); every family
#: of :data:`FAMILIES` is an engine too (:func:`engine_class` builds it from its spec).
ENGINES: Dict[str, Union[str, type]] = {
    "diffusers": "models.pipelines:PipelineEngine",
    "vllm": "models.vllm.engine:VLLMEngine",
}

_BUILT: Dict[str, type] = {}  # family name -> engine class built from its spec


def family_names() -> List[str]:
    """The registered diffusion families, sorted."""
    return sorted(FAMILIES)


def family_spec(name: str) -> Any:
    """The :class:`models.family.FamilySpec` registered under ``name``, imported on first use.

    Raises:
        KeyError: no family of that name.
    """
    target = FAMILIES[name]
    if isinstance(target, str):
        target = load_path(target)
    return target


def register_family(spec: Any, *, replace: bool = False) -> None:
    """Register a :class:`models.family.FamilySpec` under its ``name`` (the ``model.engine`` value).

    Raises:
        ValueError: the name is already an engine or family and ``replace`` is False.
    """
    if (spec.name in FAMILIES or spec.name in ENGINES) and not replace:
        raise ValueError(f"family {spec.name!r} is already registered; pass replace=True")
    FAMILIES[spec.name] = spec
    _BUILT.pop(spec.name, None)


def unregister_family(name: str) -> None:
    """Remove family ``name`` (tests register families for their own duration)."""
    FAMILIES.pop(name, None)
    _BUILT.pop(name, None)


def load_path(target: str) -> Any:
    """The object a ``"module:attr"`` path names (imported)."""
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def spec_engine(spec: Any) -> type:
    """The engine class of ``spec``: its ``engine`` class when that class declares this spec, else a subclass of it
    carrying the spec (one generic engine drives every spec without a class of its own)."""
    base = load_path(spec.engine)
    if getattr(base, "spec", None) is spec:
        return base
    name = "".join(p.capitalize() for p in spec.name.split("_")) + "Engine"
    return type(name, (base,), {"spec": spec, "__module__": base.__module__,
                                "__doc__": f"The {spec.name} family on {base.__name__} (spec-driven)."})


def register_engine(name: str, engine: Union[str, type], *, replace: bool = False) -> None:
    """Register an engine class (or its ``"module:Class"`` path) under ``name`` (the ``model.engine`` value).

    The class must implement :class:`models.base.Engine` and take a :class:`models.base.StageContext`.

    Raises:
        ValueError: ``name`` is already registered and ``replace`` is False.
    """
    if (name in ENGINES or name in FAMILIES) and not replace:
        raise ValueError(f"engine {name!r} is already registered ({ENGINES.get(name, FAMILIES.get(name))!r}); pass "
                         "replace=True")
    ENGINES[name] = engine


def unregister_engine(name: str) -> None:
    """Remove ``name`` from the registry (tests register engines for their own duration)."""
    ENGINES.pop(name, None)


def engine_class(name: str, where: str = "model.engine") -> Any:
    """The engine class registered under ``name``, imported on first use.

    Raises:
        runner.core.errors.UserInputError: no engine of that name (lists the registered names and the closest one).
    """
    from runner.core.errors import UserInputError

    target = ENGINES.get(name)
    if target is None and name in FAMILIES:
        if name not in _BUILT:
            _BUILT[name] = spec_engine(family_spec(name))
        return _BUILT[name]
    if target is None:
        known = sorted([*ENGINES, *FAMILIES])
        close = difflib.get_close_matches(str(name), known, n=1)
        raise UserInputError(f"{where}={name!r} is not a registered engine; known: {', '.join(known)}"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
    if isinstance(target, str):
        target = load_path(target)
    return target


def family_for_pipeline(pipeline_class: str) -> Any:
    """The family name whose spec loads ``pipeline_class`` (a ``model_index.json`` ``_class_name``) for one of its
    tasks, or None."""
    for name in family_names():
        if str(pipeline_class) in family_spec(name).tasks.values():
            return name
    return None
