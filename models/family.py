"""Declarative diffusion family specs: what the generic diffusers engine (:class:`models.pipelines.PipelineEngine`)
needs to know about one diffusers pipeline, as data.

Imitates torchtitan's per-model ``TrainSpec`` (one frozen object per model, registered by name) and diffusers'
``AutoPipelineFor*`` task maps (``tasks``: task -> pipeline class). A family is a :class:`FamilySpec` registered in
:mod:`models.registry`; a family *class* exists only where the pipeline's behaviour really differs (HiDream's MoE,
FLUX's guidance embedding, Qwen-Image's prompt template, Wan's frame rule).

Rules derived from the spec (written once here, not per family):

* :func:`forwards_per_step` from ``cfg`` (the pipeline's classifier-free guidance mode), so every family yields
  an expected forward count;
* :func:`negative_prompt_ignored` (when the pipeline drops a negative prompt) from the same mode;
* the size multiple from the snapshot's own VAE and transformer configs (``size_rule``: :func:`block_out_scale`,
  :func:`temporal_downsample_scale`, :func:`spatial_scale`), as the pipeline computes its ``vae_scale_factor``.

Import-light: no torch, no diffusers (messages list the families without loading a model).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

#: Classifier-free guidance modes (how many transformer forwards one denoising step makes):
#: ``true_cfg``: a second, unbatched forward when the row has a negative prompt and ``true_cfg_scale`` > 1
#: (FluxPipeline, QwenImagePipeline: ``do_true_cfg``); ``batched``: guidance_scale > 1 concatenates the
#: unconditional and conditional inputs into ONE forward (StableDiffusion3Pipeline, HiDreamImagePipeline);
#: ``separate``: guidance_scale > 1 makes a second forward (WanPipeline, ChromaPipeline); ``none``: one forward.
CFG_MODES = ("true_cfg", "batched", "separate", "none")

#: Tasks a spec maps to a pipeline class (diffusers' ``AUTO_*_PIPELINES_MAPPING`` keys, in the runner's names;
#: ``runner.core.schema.Task`` lists the same).
TASKS = ("text_to_image", "image_to_image", "inpaint", "edit", "text_to_video", "image_to_video")
#: The generation tasks: what a family runs when ``model.task`` is null (the first of these it has).
GENERATION_TASKS = ("text_to_image", "text_to_video")
#: The tasks whose pipelines write video.
VIDEO_TASKS = ("text_to_video", "image_to_video")

#: What a task's pipeline does to the size of an input image (:attr:`FamilySpec.input_sizing`), so the runner can
#: refuse or record it: ``resize``: every input is resized to the call's ``width`` x ``height`` (aspect ratio not
#: kept: ``VaeImageProcessor.preprocess(image, height, width)``); ``area``: the pipeline picks each input's size itself
#: from a pixel area and the input's aspect ratio (QwenImageEditPlusPipeline's ``calculate_dimensions``), the output
#: size is the call's ``width`` x ``height``.
INPUT_SIZING = ("resize", "area")


def block_out_scale(vae: Mapping[str, Any], transformer: Mapping[str, Any], patch: int) -> int:
    """``2 ** (len(block_out_channels) - 1) * patch``: FluxPipeline, StableDiffusion3Pipeline, HiDreamImagePipeline,
    ChromaPipeline (``vae_scale_factor`` from ``AutoencoderKL``'s config; default 4 blocks as diffusers' 8)."""
    blocks = vae.get("block_out_channels") or [0] * 4
    return 2 ** (len(blocks) - 1) * patch


def temporal_downsample_scale(vae: Mapping[str, Any], transformer: Mapping[str, Any], patch: int) -> int:
    """``2 ** len(temperal_downsample) * patch``: QwenImagePipeline (``self.vae.temperal_downsample``; the
    ``AutoencoderKLQwenImage`` default ``[False, True, True]``)."""
    return 2 ** len(vae.get("temperal_downsample") or [False, True, True]) * patch


def spatial_scale(vae: Mapping[str, Any], transformer: Mapping[str, Any], patch: int) -> int:
    """``scale_factor_spatial * patch``: WanPipeline's ``vae_scale_factor_spatial = vae.config.scale_factor_spatial``
    (``AutoencoderKLWan``'s default 8 when the config lacks it; a Wan 2.2-style VAE says 16)."""
    factor = vae.get("scale_factor_spatial") or signature_default("AutoencoderKLWan", "scale_factor_spatial", 8)
    return int(factor) * patch


def signature_default(cls_name: str, param: str, fallback: Any) -> Any:
    """The default of ``param`` in diffusers class ``cls_name``'s ``__init__`` (what ``from_pretrained`` uses when a
    config omits it), else ``fallback``."""
    import diffusers

    cls = getattr(diffusers, cls_name, None)
    p = inspect.signature(cls.__init__).parameters.get(param) if cls is not None else None
    return fallback if p is None or p.default is inspect.Parameter.empty or p.default is None else p.default


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    """One diffusion family, declared.

    Attributes:
        name: the ``model.engine`` it is registered under.
        tasks: task (:data:`TASKS`) -> diffusers pipeline class name.
        components: ``{component: (library, model class, config class or None)}``, built in this order from
            ``model.architecture.<component>`` for embedded and dummy weights.
        tokenizers: ``{tokenizer component: (kind, encoder label, text encoder component)}``; kinds registered in
            :mod:`models.tokenizer_kinds` (``clip``, ``t5``, ``qwen2``, ``llama3``, ``gemma``, ``qwen3``,
            ``mistral3``; a new kind is one record there).
        cfg: the pipeline's guidance mode (:data:`CFG_MODES`).
        size_rule: ``(vae config, transformer config, patch) -> pixels`` widths and heights must be multiples of.
        patch: the latent packing / patch size the rule multiplies by; ``"transformer"`` reads the transformer
            config's ``patch_size`` (its last entry for 3-D patches).
        roles: attention layer-name suffix -> role (``attn2`` -> ``cross``); unmatched layers take the model
            config's first role.
        quiet_loggers: pipeline loggers whose per-call "input was truncated" record is filtered (records carry the
            token counts instead).
        max_sequence_length: the most ``max_sequence_length`` the pipeline's ``check_inputs`` accepts.
        attention_processor: ``"module:Class"`` of a processor installed on every attention module after loading,
            for a transformer whose own processor bypasses diffusers' dispatcher (SD3).
        backend_fields, needs_mask, fp8_prefixes: as :class:`models.diffusers_engine.DiffusersEngine`'s.
        engine: ``"module:Class"`` of the family's engine class (default: the generic engine).
        guidance_hint: the model's usual guidance value, quoted in the fixes of the guidance rules.
        multi_image: tasks whose ``image`` may be a list of references (``QwenImageEditPlusPipeline``'s edit);
            elsewhere a row's ``image`` is one path.
        task_components: task -> ``{component: (library, model class, config class or None)}`` its pipeline takes
            beyond ``components`` (Wan 2.1 image-to-video's CLIP ``image_encoder``), built from
            ``model.architecture.<component>`` like them. A task listed here or in ``task_processors`` is a
            checkpoint of its own (Qwen-Image-Edit-2509, Wan2.1-I2V-14B): its embedded snapshot is saved as the
            task's pipeline class (:meth:`snapshot_pipeline`); other tasks load the base snapshot.
        task_processors: task -> ``{processor component: (kind, tokenizer component or None)}``, built locally
            (kinds of :mod:`models.processors`) from ``model.architecture.<component>`` (``{}`` when absent).
        input_sizing: task -> what its pipeline does to an input's size (:data:`INPUT_SIZING`); the family module's
            docstring has the details.
        cfg_threshold: under ``batched``/``separate``, the ``guidance_scale`` above which the pipeline runs CFG (and
            uses the negative prompt): 1 for most (``do_classifier_free_guidance = guidance_scale > 1``), 0 for
            ZImagePipeline (``guidance_scale > 0``).
        experts: the pipeline's denoiser components in the order its schedule uses them (Wan 2.2 A14B:
            ``transformer`` for the high-noise steps, then ``transformer_2``); every one after the first is optional
            (in ``components``, built only when ``model.architecture`` has it, checked only where a snapshot names
            it): a snapshot without it runs the first expert alone (Wan 2.1, Wan 2.2 TI2V-5B).
        pipeline_config: arguments of the pipeline class's ``__init__`` that are settings, not components
            (WanPipeline's ``boundary_ratio``, ``expand_timesteps``): ``model.architecture.pipeline`` for embedded
            and dummy weights, the snapshot's ``model_index.json`` for ``model.path``.
        row_fields: further dataset row fields of the family (``runner.core.dataset.Field``), after the diffusion
            row's (``runner.core.dataset.DIFFUSION_ROW``): validated, in the item identity, recorded; a field with
            ``media`` (``runner.core.media.Media``) is an input file, checked, hashed, attached and recorded as the
            conditioning images are, and passed to the pipeline when its ``__call__`` takes it.
    """

    name: str
    tasks: Mapping[str, str]
    components: Mapping[str, Tuple[str, str, Optional[str]]]
    tokenizers: Mapping[str, Tuple[str, str, str]]
    cfg: str
    size_rule: Callable[[Mapping[str, Any], Mapping[str, Any], int], int] = block_out_scale
    patch: Any = 2
    roles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    quiet_loggers: Tuple[str, ...] = ()
    max_sequence_length: Optional[int] = None
    attention_processor: Optional[str] = None
    backend_fields: Tuple[str, ...] = ("attention", "linear")
    needs_mask: bool = False
    fp8_prefixes: Tuple[str, ...] = ("transformer_blocks.", "single_transformer_blocks.")
    engine: str = "models.pipelines:PipelineEngine"
    guidance_hint: str = ""
    multi_image: Tuple[str, ...] = ()
    task_components: Mapping[str, Mapping[str, Tuple[str, str, Optional[str]]]] = dataclasses.field(
        default_factory=dict)
    task_processors: Mapping[str, Mapping[str, Tuple[str, Optional[str]]]] = dataclasses.field(default_factory=dict)
    input_sizing: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cfg_threshold: float = 1.0
    experts: Tuple[str, ...] = ("transformer",)
    pipeline_config: Tuple[str, ...] = ()
    row_fields: Tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        """Freeze the mappings and check the declared names.

        Raises:
            ValueError: an unknown ``cfg`` mode or task, no base task, a tokenizer kind not registered, or a task
                component, processor or input sizing for a task the spec does not map.
        """
        if self.cfg not in CFG_MODES:
            raise ValueError(f"FamilySpec {self.name!r}: cfg={self.cfg!r} is not one of {', '.join(CFG_MODES)}")
        bad = sorted(set(self.tasks) - set(TASKS))
        if bad or not self.tasks:
            raise ValueError(f"FamilySpec {self.name!r}: tasks {bad or '{}'} not among {', '.join(TASKS)}")
        if not {"text_to_image", "text_to_video"} & set(self.tasks):
            raise ValueError(f"FamilySpec {self.name!r}: tasks {sorted(self.tasks)} lack a base task (text_to_image or "
                             "text_to_video: the pipeline of the family's own checkpoint)")
        extra = sorted((set(self.task_components) | set(self.task_processors) | set(self.input_sizing))
                       - set(self.tasks))
        if extra:
            raise ValueError(f"FamilySpec {self.name!r}: task_components/task_processors/input_sizing name tasks "
                             f"{extra} that are not in its tasks ({', '.join(self.tasks)})")
        missing = [e for e in self.experts if e not in self.components]
        if self.components and missing:
            raise ValueError(f"FamilySpec {self.name!r}: experts {missing} are not among its components")
        from models import tokenizer_kinds

        unknown = sorted({kind for kind, _l, _e in self.tokenizers.values()} - set(tokenizer_kinds.KINDS))
        if unknown:
            raise ValueError(f"FamilySpec {self.name!r}: tokenizer kinds {unknown} are not registered "
                             f"({', '.join(sorted(tokenizer_kinds.KINDS))}); fix: register a "
                             "models.tokenizer_kinds.TokenizerKind for each")
        bad_sizing = sorted(set(self.input_sizing.values()) - set(INPUT_SIZING))
        if bad_sizing:
            raise ValueError(f"FamilySpec {self.name!r}: input_sizing {bad_sizing} not among {', '.join(INPUT_SIZING)}")
        for f in ("tasks", "components", "tokenizers", "roles", "input_sizing"):
            object.__setattr__(self, f, MappingProxyType(dict(getattr(self, f))))
        for f in ("task_components", "task_processors"):
            object.__setattr__(self, f, MappingProxyType({t: MappingProxyType(dict(m))
                                                          for t, m in getattr(self, f).items()}))

    @property
    def video(self) -> bool:
        """The family writes video (its generation task is ``text_to_video``)."""
        return "text_to_video" in self.tasks

    @property
    def generation_task(self) -> str:
        """The task ``model.task: null`` runs: the family's first of :data:`GENERATION_TASKS` (else its first
        task)."""
        return next((t for t in GENERATION_TASKS if t in self.tasks), next(iter(self.tasks)))

    @property
    def pipeline_class(self) -> str:
        """The pipeline class of the family's generation task (what its snapshots' ``model_index.json`` names and
        what an embedded snapshot is saved as)."""
        return self.tasks[self.generation_task]

    def task(self, task: Optional[str]) -> str:
        """``task`` (``model.task``), or the generation task for None.

        Raises:
            ValueError: the family has no pipeline for it; the message names the tasks it has (the engine turns it
                into a startup refusal, exit 2).
        """
        task = self.generation_task if task in (None, "") else str(task)
        if task not in self.tasks:
            raise ValueError(f"model.task={task}: the {self.name} family has no pipeline for it; its tasks: "
                             + ", ".join(f"{t} ({c})" for t, c in self.tasks.items()))
        return task

    def pipeline_for(self, task: Optional[str]) -> str:
        """The diffusers pipeline class name of ``task`` (None: the generation task); raises as :meth:`task`."""
        return self.tasks[self.task(task)]

    def own_snapshot(self, task: Optional[str]) -> bool:
        """``task`` loads a checkpoint of its own (it has task components or processors), not the base one."""
        return task is not None and (task in self.task_components or task in self.task_processors)

    def components_for(self, task: Optional[str] = None) -> Dict[str, Tuple[str, str, Optional[str]]]:
        """The model components ``task``'s pipeline is built from: ``components`` plus its ``task_components``
        (the scheduler kept last, as diffusers lists it)."""
        out = {k: v for k, v in self.components.items() if k != "scheduler"}
        out.update(self.task_components.get(task or "", {}))
        if "scheduler" in self.components:
            out["scheduler"] = self.components["scheduler"]
        return out

    def optional(self, component: str) -> bool:
        """``component`` may be absent: an expert after the first (:attr:`experts`)."""
        return component in self.experts[1:]

    def processors_for(self, task: Optional[str] = None) -> Dict[str, Tuple[str, Optional[str]]]:
        """The processors ``task``'s pipeline takes (``task_processors``; none for the base tasks)."""
        return dict(self.task_processors.get(task or "", {}))

    def snapshot_pipeline(self, task: Optional[str] = None) -> str:
        """The pipeline class an embedded snapshot for ``task`` is saved as: the task's own when it is a checkpoint
        of its own (:meth:`own_snapshot`), else the base :attr:`pipeline_class` (img2img and inpaint pipelines load
        the text-to-image checkpoint, as diffusers' ``AutoPipelineForImage2Image.from_pipe`` does)."""
        return self.tasks[task] if self.own_snapshot(task) else self.pipeline_class

    def size_need(self, vae: Mapping[str, Any], transformer: Mapping[str, Any]) -> int:
        """Pixels widths and heights must be multiples of, from the snapshot's VAE and transformer configs."""
        patch = self.patch
        if patch == "transformer":
            p = transformer.get("patch_size") or 2
            patch = p[-1] if isinstance(p, (list, tuple)) else p
        return int(self.size_rule(vae, transformer, int(patch)))

    def role(self, layer: str, roles: Tuple[str, ...]) -> str:
        """The role of the attention module at ``layer`` among the model config's ``roles``: the first declared
        suffix ``layer`` ends with, if the model config lists it, else the first role."""
        for suffix, role in self.roles.items():
            if layer.endswith(suffix) and role in roles:
                return role
        if self.roles and "self" in roles and not any(layer.endswith(s) for s in self.roles):
            return "self"
        return roles[0]


def forwards_per_step(cfg_mode: str, row: Any, true_cfg_scale: float, threshold: float = 1.0) -> int:
    """Transformer forwards one denoising step makes for ``row`` under ``cfg_mode`` (:data:`CFG_MODES`);
    ``threshold``: the ``guidance_scale`` above which the pipeline runs CFG (:attr:`FamilySpec.cfg_threshold`)."""
    if cfg_mode == "true_cfg":
        return 2 if row.negative_prompt is not None and true_cfg_scale > 1 else 1
    if cfg_mode == "separate":
        return 2 if row.guidance_scale is not None and row.guidance_scale > threshold else 1
    return 1


def negative_prompt_ignored(cfg_mode: str, pipeline: str, true_cfg_scale: float, rows: Any, hint: str = "",
                            threshold: float = 1.0) -> Dict[str, Tuple[Any, ...]]:
    """The ignored-field rules of the guidance mode, as ``{field: (why, fix[, applies(row)])}`` (the form of
    ``DiffusersEngine.ignored_fields``): under ``true_cfg`` a negative prompt needs ``true_cfg_scale`` > 1 and
    ``true_cfg_scale`` > 1 a negative prompt; under ``batched``/``separate`` a negative prompt needs
    ``guidance_scale`` > ``threshold`` (:attr:`FamilySpec.cfg_threshold`) in its row. ``hint`` (the model's usual
    value) is quoted in the fix."""
    hint = f" ({hint})" if hint else ""
    if cfg_mode == "true_cfg":
        if true_cfg_scale <= 1:
            return {"negative_prompt": (f"model.generation.true_cfg_scale={true_cfg_scale} <= 1, and {pipeline} uses a "
                                        "negative prompt only under true CFG (true_cfg_scale > 1)",
                                        f"model.generation.true_cfg_scale=4 to apply it{hint} (twice the "
                                        "transformer forwards per step)")}
        if not any(r.negative_prompt is not None for r in rows):
            return {"true_cfg_scale": (f"no row has a negative_prompt, and {pipeline} runs true CFG only with one",
                                       "add negative_prompt to the rows (an empty string works: ' ')")}
        return {}
    if cfg_mode in ("batched", "separate"):
        t = f"{threshold:g}"
        return {"negative_prompt": (f"guidance_scale <= {t} turns classifier-free guidance off, and {pipeline} uses "
                                    "the negative prompt only with it", f"guidance_scale > {t} in that row{hint}",
                                    lambda r: r.guidance_scale is None or r.guidance_scale <= threshold)}
    return {}


class TruncationFilter(logging.Filter):
    """Drops diffusers' "The following part of your input was truncated ..." records (printed by every
    CLIP/T5-encoding pipeline: FLUX, SD3, Wan, HiDream), which print the whole dropped text on every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("The following part of your input was truncated")


def quiet_truncation_warnings(*modules: str) -> None:
    """Install :class:`TruncationFilter` once on the loggers of the given pipeline modules."""
    for name in modules:
        logger = logging.getLogger(name)
        if not any(isinstance(f, TruncationFilter) for f in logger.filters):
            logger.addFilter(TruncationFilter())
