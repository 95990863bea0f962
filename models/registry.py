"""Engine registry: ``model.adapter`` names mapped to lazy import paths, so that vLLM and diffusers are imported
only by a run that uses them (``import vllm`` alone costs 13-30 s on 2 cores).

Imitates vLLM's ``vllm/v1/attention/backends/registry.py`` (values are lazy class paths) and its out-of-tree
``register_backend``: an engine defined outside this package is one :func:`register_engine` call.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Dict, Union

#: engine name (``model.adapter``) -> ``"module:Class"`` or the class itself (registered at run time).
ENGINES: Dict[str, Union[str, type]] = {
    "flux": "models.flux:FluxEngine",
    "sd3": "models.sd3:SD3Engine",
    "qwen_image": "models.qwen_image:QwenImageEngine",
    "wan": "models.wan:WanEngine",
    "hidream": "models.hidream:HiDreamEngine",
    "diffusers": "models.pipelines:PipelineEngine",
    "vllm": "models.vllm.engine:VLLMEngine",
}


def register_engine(name: str, engine: Union[str, type], *, replace: bool = False) -> None:
    """Register an engine class (or its ``"module:Class"`` path) under ``name`` (the ``model.adapter`` value).

    The class must implement :class:`models.base.Engine` and take a :class:`models.base.StageContext`.

    Raises:
        ValueError: ``name`` is already registered and ``replace`` is False.
    """
    if name in ENGINES and not replace:
        raise ValueError(f"engine {name!r} is already registered ({ENGINES[name]!r}); pass replace=True")
    ENGINES[name] = engine


def unregister_engine(name: str) -> None:
    """Remove ``name`` from the registry (tests register engines for their own duration)."""
    ENGINES.pop(name, None)


def engine_class(name: str, where: str = "model.adapter") -> Any:
    """The engine class registered under ``name``, imported on first use.

    Raises:
        runner.core.errors.UserInputError: no engine of that name (lists the registered names and the closest one).
    """
    from runner.core.errors import UserInputError

    target = ENGINES.get(name)
    if target is None:
        close = difflib.get_close_matches(str(name), list(ENGINES), n=1)
        raise UserInputError(f"{where}={name!r} is not a registered engine; known: {', '.join(sorted(ENGINES))}"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
    if isinstance(target, str):
        mod, _, attr = target.partition(":")
        target = getattr(importlib.import_module(mod), attr)
    return target


#: diffusers pipeline class -> the engine (family) that describes it; a snapshot of another pipeline is told which
#: ``model.adapter`` serves it.
PIPELINE_FAMILIES = {"FluxPipeline": "flux", "StableDiffusion3Pipeline": "sd3", "QwenImagePipeline": "qwen_image",
                     "WanPipeline": "wan", "HiDreamImagePipeline": "hidream"}


def family_for_pipeline(pipeline_class: str) -> Any:
    """The engine name whose family loads ``pipeline_class`` (a ``model_index.json`` ``_class_name``), or None."""
    return PIPELINE_FAMILIES.get(str(pipeline_class))
