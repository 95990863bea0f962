"""The diffusers engine for any transformer-based ``DiffusionPipeline``; model families are small subclasses.

:class:`PipelineEngine` holds what does not depend on the model: loading with the pipeline class the snapshot's
``model_index.json`` names (its parts: :class:`models.source.WeightSource`, where weights come from and the layout
check; :class:`models.snapshot.ComponentBuilder`, random-weight components from ``model.architecture``;
:class:`models.prompt_tokens.PromptTokens`; :class:`models.diffusion_rows.FamilyRows`, row fields onto the
pipeline's ``__call__`` arguments, a field it does not take refused at startup;
:class:`models.backend_passes.AttentionSites`), QKV fusion, phase timers, the forward rule and the call, between
the passes' ``before_pipe`` / ``after_pipe``.

A family (``models/flux.py``, ``models/sd3.py``, ``models/qwen_image.py``, ``models/wan.py``,
``models/hidream.py``; torchtitan's "same files for every model, a small spec per model") declares its pipeline class, its components and tokenizers, and
the rules the pipeline applies silently (forwards per step under guidance, sequence-length ceilings, size
multiples, frame counts), so the runner refuses what the pipeline would change and counts what it must run.

``model.engine=diffusers`` serves a snapshot of a pipeline no family describes: the pipeline class comes from
its ``model_index.json``; forward counts are then not predicted: the evidence records the forward-count check as
``limited`` (never ``verified``) and still requires every attention call site to have run.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from models import conditioning, memory
from models.backend_passes import (AttentionSites, attention_modules, fuse_qkv, module_dispatches,  # noqa: F401
                                   uses_dispatcher)  # (re-exported)
from models.context_parallel import ContextSplit
from models.diffusers_engine import DiffusersEngine
from models.diffusion_rows import FamilyRows
from models.prompt_tokens import PromptTokens
from models.source import WeightSource, family_names, models_with_task  # noqa: F401 (re-exported)
from models.family import forwards_per_step, quiet_truncation_warnings
from models.oracles import ORACLES, oracle  # noqa: F401 - the oracles by name (re-exported)
# snapshot building and reading live in models.snapshot; these names stay importable from here
from models.snapshot import (EMBEDDED_RECIPE, ComponentBuilder, check_snapshot, embedded_target,  # noqa: F401
                             missing_weights, read_index, snapshot_complete)
from runner.core.dataset import Item
from runner.core.errors import ConfigValueError
from runner.core.weights import ModelPathError  # the one class for a model.path that cannot be used (re-exported)

log = logging.getLogger("runner")


class PipelineEngine(WeightSource, PromptTokens, FamilyRows, AttentionSites, ContextSplit, ComponentBuilder,
                     DiffusersEngine):
    """A diffusion stage on a diffusers pipeline (engine ``diffusers``); one engine drives every family spec.

    A family is a :class:`models.family.FamilySpec` (``spec``, registered in :data:`models.registry.FAMILIES`);
    :func:`models.registry.spec_engine` gives it this class (or the family's own subclass, where behaviour really
    differs), whose class attributes below are then taken from the spec (``__init_subclass__``); building a family's
    components, tokenizers and embedded snapshot is :class:`models.snapshot.ComponentBuilder`'s (classmethods over
    the same attributes):

    * ``pipeline_class``: the diffusers pipeline class (None: the snapshot's ``model_index.json`` decides);
    * ``components``: ``{component: (library, model class, config class or None)}`` built in this order from
      ``model.architecture.<component>`` for embedded and dummy weights (a ``transformers`` model is built as
      ``Model(Config(**kw))``, a diffusers one as ``Model(**kw)``);
    * ``tokenizers_spec``: ``{tokenizer component: (kind, encoder label, text encoder component)}``; kinds of
      :mod:`models.tokenizer_kinds`; the label names the encoder in records' ``tokens``;
    * ``max_sequence_length_limit``: the most ``max_sequence_length`` the pipeline accepts (its ``check_inputs``);
    * ``video``: the pipeline returns ``frames`` (batch, frames, H, W, C) instead of ``images``.
    """

    max_sequence_length_limit: ClassVar[Optional[int]] = None
    video: ClassVar[bool] = False
    arch_other: ClassVar[Dict[str, Any]] = {"weights_seed": None, "dummy_weight_scale": None,
                                            "tokenizer": ("corpus", "vocab_size", "clip_max_length")}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass declaring ``spec`` (:class:`models.family.FamilySpec`) takes its class attributes from it."""
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is None:
            return
        cls.pipeline_class, cls.video = spec.pipeline_class, spec.video
        cls.components, cls.tokenizers_spec = dict(spec.components), dict(spec.tokenizers)
        cls.max_sequence_length_limit = spec.max_sequence_length
        cls.needs_mask, cls.fp8_prefixes = spec.needs_mask, spec.fp8_prefixes
        if "backend_fields" not in cls.__dict__:
            cls.backend_fields = spec.backend_fields
        if spec.video:
            cls.output = cls.unit = "video"

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self._toks: Optional[Dict[str, Any]] = None
        self._token_cache: Dict[str, Dict[str, Dict[str, int]]] = {}
        self._call_params: Optional[set] = None
        self.fit: Any = None  # models.memory.Fitting, made by models.memory.FittingPass; loading builds by its plan
        self._settings: Tuple[Optional[str], Dict[str, Any]] = (None, {})  # (weight source key, pipeline settings)
        self._experts: Optional[List[Tuple[str, torch.nn.Module]]] = None  # taken once after loading (experts)

    # ----------------------------------------------------------------------------------------------- family
    @classmethod
    def family(cls) -> str:
        """The family's name (the ``model.engine`` it is registered under; ``diffusers`` without a spec)."""
        return cls.spec.name if cls.spec is not None else "diffusers"

    @property
    def task(self) -> str:
        """``model.task`` resolved: null is the family's generation task (``text_to_image``; a video family's
        ``text_to_video``); without a spec (``model.engine=diffusers``) the generation task of the snapshot.

        Raises:
            ConfigValueError: the family has no pipeline for the task (exit 2), naming the tasks it has.
        """
        task = getattr(self.cfg, "task", None)
        task = None if task is None else str(task)
        if self.spec is None:
            if task not in (None, "text_to_image", "text_to_video"):
                raise ConfigValueError(
                    f"model.task={task}: model.engine=diffusers runs the snapshot's own pipeline (a generation "
                    f"task); a conditioning task needs a family that maps it to a pipeline; fix: model.engine="
                    f"{'|'.join(family_names())} (its spec's tasks), or model.task=null")
            return task or ("text_to_video" if self.video else "text_to_image")
        try:
            return self.spec.task(task)
        except ValueError as e:
            others = models_with_task(str(task))
            raise ConfigValueError(f"{e}; fix: model.task=<one of those>, or a model that has the task" + (
                f" (model={'|'.join(others)})" if others else " (a model config of a family that lists it)")) from None

    def check_config(self) -> None:
        """The base checks (``model.generation``, ``max_pixels``, ``cache.*``), then ``guidance_scale_2`` only where the
        row takes it, ``model.task`` against the family's tasks (:attr:`task`), a video family's
        ``model.generation.num_frames``/``fps`` set.

        Raises:
            ConfigValueError: naming the key, the value and the fix.
        """
        super().check_config()
        g2 = self.cfg.generation.guidance_scale_2
        if g2 is not None and "guidance_scale_2" not in self.row_spec().by_name:
            raise ConfigValueError(f"model.generation.guidance_scale_2={g2}: model={self.cfg.name} "
                                   f"({self.pipeline_name()}) has no second expert to apply it to; fix: "
                                   "model.generation.guidance_scale_2=null (Wan 2.2 A14B models take it)")
        self.task  # noqa: B018 - refused here when the family has no pipeline for it
        g = self.cfg.generation
        if self.video and (g.num_frames is None or g.fps is None):
            raise ConfigValueError(f"model={self.cfg.name} generates video: model.generation.num_frames and "
                                   "model.generation.fps must be set; fix: e.g. model.generation.num_frames=81 "
                                   "model.generation.fps=16 (Wan 2.1's defaults; LTX-2's: 121 at 24)")

    # ----------------------------------------------------------------------------------------------- loading
    # ------------------------------------------------------------------------------------------- building





    def load_pipeline(self) -> None:
        """Build the pipeline on ``self.device`` in ``self.dtype``; records weight-file hashes in ``source``. The
        spec's ``quiet_loggers`` lose diffusers' per-call truncation warning first (the whole dropped text: 4.4 MB
        of console for one 2-million-character prompt; every record carries its ``tokens`` per encoder)."""
        if self.spec is not None:
            quiet_truncation_warnings(*self.spec.quiet_loggers)
        kind = self.source["kind"]
        cls = self.pipeline_cls()
        if kind == "dummy":
            build, park = self.fit.build_device(self.device, self.weight_bytes())
            if build == "cpu" and str(self.device) != "cpu":
                self.source["weights_built_on"] = "cpu"  # the CPU generator's numbers: other weights than on the GPU
            comps = self.build_components(self.arch_copy(), device=build, dtype=self.dtype, task=self.task)
            for comp, method in self.fit.choices.items():  # torchao's quantize_, as diffusers applies it
                memory.quantize_built(comps[comp], method, self.fit.libraries[comp], self.dtype, str(self.device))
            if park is not None:  # built where they compute, kept on the host until the offload plan onloads them
                memory.torchao_device_copies()
                for m in comps.values():
                    if isinstance(m, torch.nn.Module):
                        m.to(park)
                torch.cuda.empty_cache()
            self.pipe = cls(**comps)
        else:
            path = Path(self.source["path"]) if kind == "path" else self.embedded_snapshot(self.arch_copy())
            self.source["path"] = str(path)
            self.source.update(self.hash_weights(path))
            from models.processors import processor_overrides

            load_kw: Dict[str, Any] = {}
            for p in self.passes:  # the quantization's keywords (models.memory.FittingPass)
                load_kw.update(p.load_kwargs(path))

            self.pipe = cls.from_pretrained(path, dtype=self.dtype, local_files_only=True, use_safetensors=True,
                                            **processor_overrides(path), **load_kw)
        if not self.fit.defers():  # an offload plan is applied after the install passes (Fitting.defers)
            self.fit.place(self.pipe, self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self._experts = None
        self.experts()  # taken now: the modules the probes will watch
        self.prepare_attention()
        self._toks = None  # records count with the loaded tokenizers
        self._token_cache = {}
        self._time_phases()

    def prepare_plan(self, platform_kind: str) -> None:
        """What ``--plan`` reads (``runner.tools.plan``), checked as :meth:`prepare` checks it, for a run on
        ``platform_kind`` that need not be this machine's: the weight source (architecture or snapshot configs;
        nothing loads), the model's limits, and each pass's part (:meth:`models.passes.Pass.prepare_plan`:
        ``model.lora``, the memory fitting). Backends and the quantization methods' packages are not resolved: they
        are the target machine's.

        Raises:
            runner.core.errors.RunnerError subclasses, as :meth:`prepare` raises them for these checks.
        """
        self.resolve_source()
        self.check_source()
        self.check_task_components()
        for p in self.passes:
            p.prepare_plan(platform_kind)

    def expected_sequence(self, row: Any) -> int:
        """Image tokens the edit transformer's sequence holds at a call's first forward for ``row``: FLUX Kontext's
        target plus reference tokens (:func:`models.conditioning.edit_tokens`); families override it."""
        return sum(conditioning.edit_tokens(row, self.size_need() or 1))

    def input_sizes(self, row: Any) -> Dict[str, Any]:
        """What the task's pipeline does to ``row``'s input sizes (the spec's ``input_sizing``), recorded in the
        evidence: ``resize``: every input to the row's ``width`` x ``height``; else the inputs as given."""
        refs = [x for f in ("image", "mask_image", "last_image") for x in (
            lambda v: v if isinstance(v, list) else [v] if v is not None else [])((row.inputs or {}).get(f))]
        rule = self.spec.input_sizing.get(self.task) if self.spec is not None else None
        out: Dict[str, Any] = {"rule": rule, "inputs": [[x.width, x.height] for x in refs],
                               "output": [row.width, row.height]}
        if rule == "resize":
            out["resized_to"] = [row.width, row.height]
        return out

    def inputs_any_size(self) -> bool:
        """The spec's ``input_sizing`` for the task is ``area`` (Edit-Plus sizes each reference from a pixel area and
        its aspect ratio; :meth:`input_sizes` records what it picks), so inputs of any size are taken."""
        return self.spec is not None and self.spec.input_sizing.get(self.task) == "area"

    def _time_phases(self) -> None:
        """Accumulate wall seconds of text encoding and VAE decoding via forward hooks on those modules (with a
        device sync at their boundaries only, never inside the denoising loop). Denoising time is the pipeline
        call minus these (``timing_phases``)."""
        import time

        self.phase_s = {"text_encode": 0.0, "vae_decode": 0.0}
        sync = torch.cuda.synchronize if str(self.device).startswith("cuda") else (lambda: None)
        encoders = [getattr(self.pipe, n) for n in sorted(vars(self.pipe.config)) if n.startswith("text_encoder")]
        vae = getattr(self.pipe, "vae", None)
        for phase, mods in (("text_encode", encoders), ("vae_decode", (getattr(vae, "decoder", None),))):
            for mod in mods:
                if not isinstance(mod, torch.nn.Module):
                    continue
                start: Dict[str, float] = {}

                def pre(m, a, _s=start):
                    sync()
                    _s["t"] = time.perf_counter()

                def post(m, a, o, _s=start, _p=phase):
                    sync()
                    self.phase_s[_p] += time.perf_counter() - _s.pop("t", time.perf_counter())

                mod.register_forward_pre_hook(pre)
                mod.register_forward_hook(post)

    @property
    def denoiser(self) -> torch.nn.Module:
        """The stage's denoising model (the pipeline's ``transformer``; the first expert of two)."""
        return self.pipe.transformer

    def experts(self) -> List[Tuple[str, torch.nn.Module]]:
        """``(component, module)`` of the loaded pipeline's denoisers in schedule order: the spec's experts the
        pipeline holds (Wan 2.2 A14B: ``transformer``, ``transformer_2``); taken once after loading, so a module
        swapped in later is not mistaken for the one the probes watch."""
        if self._experts is None:
            names = self.spec.experts if self.spec is not None else ("transformer",)
            self._experts = [(n, getattr(self.pipe, n)) for n in names
                             if isinstance(getattr(self.pipe, n, None), torch.nn.Module)]
        return self._experts

    # ------------------------------------------------------------------------------------------- attention
    # ------------------------------------------------------------------------------------------------ speed
    def optimize(self, opts: Any) -> Dict[str, Any]:
        """Apply the math-preserving speed settings of ``optimize`` (``runner.core.schema.OptimizeConfig``) to the
        loaded pipeline, before backends are installed (so FP8 linear sees the fused projections).

        ``fuse_qkv``: diffusers' ``fuse_projections`` per attention module that supports it (q|k|v weights
        concatenated into one ``to_qkv`` Linear; cross-attention k|v into ``to_kv``; the text stream's into
        ``to_added_qkv``/``to_added_kv``); the unfused Linears a fused one replaces are then deleted, which frees
        their copy of the weights and keeps linear evidence exact (no module that never runs).
        ``vae_channels_last``: the VAE's parameters in NHWC layout (``torch.channels_last``; a video VAE's 5-D
        weights in NDHWC, ``torch.channels_last_3d``); measured slower on
        the H200 with torch 2.11 (``benchmarks/results/flux_dev_1024_h200.json`` ablation), so off by default.

        Returns:
            What was applied, for the manifest: ``{"fuse_qkv": {"modules": n} | False, "vae_channels_last": bool}``.
        """
        applied: Dict[str, Any] = {"fuse_qkv": False, "vae_channels_last": False}
        if opts.fuse_qkv:
            applied["fuse_qkv"] = {"modules": sum(fuse_qkv(m) for _, m in self.experts())}
        if opts.vae_channels_last:  # NHWC for 2-D convolutions, NDHWC for a video VAE's 3-D ones (Wan, HunyuanVideo,
            # LTX-2: ``Module.to(memory_format=torch.channels_last)`` raises "required rank 4 tensor" on 5-D weights)
            layout = {4: torch.channels_last, 5: torch.channels_last_3d}
            self.pipe.vae._apply(lambda t: t.contiguous(memory_format=layout[t.dim()]) if t.dim() in layout else t)
            applied["vae_channels_last"] = True
        return applied

    # --------------------------------------------------------------------------------------- tokens, limits
    def size_need(self) -> Optional[int]:
        """The multiple widths and heights must be for the pipeline to keep them (it rounds or refuses others):
        the VAE's spatial scale factor times the transformer's patch size, by the spec's ``size_rule`` on the
        snapshot's own configs (as the pipeline computes its ``vae_scale_factor``); None without a spec."""
        if self.spec is None:
            return None
        return self.spec.size_need(self.component_config("vae"), self.component_config("transformer"))

    def check_source(self) -> None:
        """What the model's configs and tokenizers decide, checked before anything loads:
        ``max_sequence_length`` at most :meth:`sequence_limit`; ``model.size_multiple`` a multiple of
        :meth:`size_need`.

        Raises:
            ConfigValueError: naming the key, the value, the model's limit and the fix.
        """
        g = self.cfg.generation
        limit = self.sequence_limit() if self.tokenizers_spec else None
        if limit is not None and g.max_sequence_length > limit:
            raise ConfigValueError(
                f"model.generation.max_sequence_length={g.max_sequence_length} exceeds {limit}, the most tokens "
                f"model={self.cfg.name} encodes ({self.pipeline_name()}'s ceiling: "
                f"{self.max_sequence_length_limit}; or its tokenizer's model_max_length is lower); fix: "
                f"model.generation.max_sequence_length={limit}")
        need = self.size_need()
        if need and self.cfg.size_multiple % need:
            raise ConfigValueError(
                f"model.size_multiple={self.cfg.size_multiple}, but model={self.cfg.name}'s VAE and patch size need "
                f"widths and heights in multiples of {need}: {self.pipeline_name()} would round or refuse the "
                f"others; fix: model.size_multiple={need}")

    # -------------------------------------------------------------------------------------- call arguments
    def call_params(self) -> set:
        """The argument names of the pipeline class's ``__call__``."""
        if self._call_params is None:
            self._call_params = set(inspect.signature(self.pipeline_cls().__call__).parameters)
        return self._call_params

    def call_kwargs(self, batch: Sequence[Item]) -> Dict[str, Any]:
        """The pipeline ``__call__`` arguments for ``batch`` (all items share ``shape_key``), without
        ``generator`` and ``output_type``."""
        r0 = batch[0].row
        kw: Dict[str, Any] = {"prompt": [it.row.prompt for it in batch], "height": r0.height, "width": r0.width,
                              "num_inference_steps": r0.num_inference_steps}
        if r0.guidance_scale is not None:
            kw["guidance_scale"] = r0.guidance_scale
        if r0.negative_prompt is not None:
            kw["negative_prompt"] = [it.row.negative_prompt for it in batch]
        if getattr(r0, "num_frames", None) is not None:
            kw["num_frames"] = r0.num_frames
        if "max_sequence_length" in self.call_params():
            kw["max_sequence_length"] = int(self.cfg.generation.max_sequence_length)
        kw.update(self.family_kwargs(batch))
        for p in self.passes:  # the passes' row fields as the pipeline takes them (a conditioning task's inputs)
            kw.update(p.call_args(batch))
        return kw

    def family_kwargs(self, batch: Sequence[Item]) -> Dict[str, Any]:
        """Further call arguments: under true CFG ``true_cfg_scale``, the configured value with negative prompts, else
        1 (QwenImagePipeline's default is 4, which with no negative prompt only warns; FluxPipeline's is 1)."""
        if self.spec is None or self.spec.cfg != "true_cfg":
            return {}
        neg = batch[0].row.negative_prompt is not None
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale) if neg else 1.0}

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """Generation values that determine the item's bytes beyond the row's: ``num_frames`` and ``fps`` of a
        video; for image_to_image / inpaint the ``strength`` applied and ``steps_run``, the denoising steps the
        item's call ran (:func:`models.conditioning.steps_run`: 1 of 16 at strength 0.05, 8 at 0.5), beside the
        requested ``num_inference_steps``; under true CFG ``true_cfg_scale`` when the row's negative prompt is
        applied, else null."""
        out: Dict[str, Any] = {"num_frames": row.num_frames, "fps": row.fps} if self.video else {}
        for p in self.passes:  # what each pass applied (conditioning: strength, steps_run, inpaint_overlay)
            out.update(p.applied_params(row))
        if self.spec is not None and self.spec.cfg == "true_cfg":
            out["true_cfg_scale"] = (float(self.cfg.generation.true_cfg_scale) if row.negative_prompt is not None
                                     else None)
        return out

    def warmup_call(self, batch: List[Item], steps: int = 2) -> None:
        """One pipeline call of ``steps`` denoising steps at ``batch``'s shape, output discarded, so that
        ``torch.compile`` (static shapes) compiles before the timed loop; the phase timers are reset after it.
        Uses its own generator, so no row's noise changes."""
        kw = {**self.call_kwargs(batch), "num_inference_steps": steps}
        with torch.inference_mode():
            self.pipe(**kw, generator=torch.Generator(device="cpu").manual_seed(0), output_type="np")
        for k in self.phase_s:
            self.phase_s[k] = 0.0

    def expected_forwards(self, batch: List[Item]) -> Optional[int]:
        """Transformer forwards one pipeline call makes for ``batch``: steps x the forwards per step of the spec's
        guidance mode (:func:`models.family.forwards_per_step`); None without a spec (``model.engine=diffusers``:
        the evidence then records the forward-count check as ``limited``)."""
        if self.spec is None:
            return None
        r = batch[0].row
        steps = r.num_inference_steps
        for p in self.passes:  # fewer where a pass runs part of the schedule (conditioning's strength)
            steps = p.applied_params(r).get("steps_run", steps)
        return steps * forwards_per_step(self.spec.cfg, r, float(self.cfg.generation.true_cfg_scale),
                                         self.spec.cfg_threshold)

    def step_forwards(self, batch: List[Item]) -> int:
        """Transformer forwards per step of the spec's guidance mode (:func:`models.family.forwards_per_step`);
        1 without a spec."""
        if self.spec is None:
            return 1
        return forwards_per_step(self.spec.cfg, batch[0].row, float(self.cfg.generation.true_cfg_scale))

    def has_forward_rule(self) -> bool:
        """A spec gives the forward rule; ``model.engine=diffusers`` (no spec) has none."""
        return self.spec is not None

    def call(self, batch: List[Item]) -> List[np.ndarray]:
        """One pipeline call over ``batch`` (all items share ``shape_key``), one seeded generator per item, between
        the passes' ``before_pipe`` and ``after_pipe`` (probes armed, what they saw; an inpaint overlay).

        Returns:
            One array per item (:meth:`output_arrays`): images float32 (H, W, C) in [0, 1] (NaN/inf preserved for
            the finite check); videos (F, H, W, C) as ``uint8``, or float32 where an item has a non-finite value.
        """
        gens = [torch.Generator(device="cpu").manual_seed(it.seed) for it in batch]
        kw = self.call_kwargs(batch)
        for p in self.passes:
            p.before_pipe(batch, kw)
        with torch.inference_mode():
            out = self.pipe(**kw, generator=gens, output_type="pt" if self.video else "np")
        arrays = self.output_arrays(out)
        for p in self.passes:
            arrays = p.after_pipe(batch, kw, arrays)
        return arrays

    def output_arrays(self, out: Any) -> List[np.ndarray]:
        """One array per item of a pipeline output ``out``: its ``images`` as float32, or its ``frames``, which a
        video pipeline called with ``output_type="pt"`` returns as a (B, F, C, H, W) tensor on the device it decoded
        on: converted to ``uint8`` there (``models.video_decode.frames_arrays``: the sinks' bytes; an item with a
        non-finite value stays float32 for the sink to refuse); frames a pipeline returns as arrays are taken as
        float32. A family whose pipeline returns more (LTX-2's audio) keeps that here too."""
        if self.video and isinstance(out.frames, torch.Tensor):
            from models.video_decode import frames_arrays

            return frames_arrays(out.frames)
        return [np.asarray(a, dtype=np.float32) for a in (out.frames if self.video else out.images)]

    def expected_experts(self, row: Any) -> List[Tuple[float, str]]:
        """``(timestep, expert)`` of each denoising step of ``row``'s call, for a pipeline with several experts; none
        by default: a family whose snapshots hold several says how its pipeline switches (``models.wan.WanEngine``),
        else every call's forwards are a mismatch (nothing predicted them)."""
        return []

    def expert_rule(self) -> str:
        """The family's expert switch rule in words (for the evidence); none by default."""
        return "one expert"

    def accuracy(self, items: List[Item], records: Dict[str, Dict[str, Any]], out_dir: Path
                 ) -> Optional[Dict[str, Any]]:
        """Share of items whose output matches the row's ``expect``, read back by the model's oracle
        (``model.oracle``); None when the model has no oracle or no row carries expectations."""
        for p in self.passes:  # what a pass changes about the oracle's expectations (a LoRA adapter's declared effect)
            items = p.expect(items)
        if not self.cfg.oracle or not any(it.row.expect for it in items):
            return None
        return oracle(self.cfg.oracle).accuracy_section(items, records, out_dir)

