"""What every diffusers-served stage shares: the loop's protocol (:class:`models.base.Engine`) implemented once,
each phase a loop over the engine's passes (:mod:`models.passes`: LoRA, the backends, context parallelism, the
memory plan, compile, the step cache, conditioning, ...), which it names only in :attr:`DiffusersEngine.PASSES`;
the denoiser probe and the stage's evidence; its parts :class:`models.diffusion_rows.DiffusionRows` (rows and
records) and :class:`models.backend_passes.BackendSelection` (backends under the precedence contract).
:class:`models.pipelines.PipelineEngine` is the one subclass; a model family declares itself there.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from models.base import EngineBase, ImageOutput, StageContext, StageResult, VideoOutput
from runner.core import dataset as ds
from models import denoiser_evidence as evidence
from models.backend_passes import BackendSelection
from models.diffusion_rows import DiffusionRows
from models.passes import Passes
from runner.core.errors import ConfigValueError


from runner.core.weights import WeightFileError, check_safetensors  # noqa: E402,F401  (re-exported)

log = logging.getLogger("runner")


class DiffusersEngine(DiffusionRows, BackendSelection, EngineBase):
    """Base of diffusion stages run through a diffusers pipeline; subclasses provide the model knowledge:

    * ``resolve_source()``, ``head_dim()``, ``weight_bytes()``, ``load_pipeline()``: where weights come from and
      how the pipeline is built (nothing loads before ``load``);
    * ``denoiser`` (the ``torch.nn.Module`` whose forwards are counted), ``attention_sites()`` (``(role, layer,
      module)`` of every attention call site), ``expected_forwards(batch)`` (denoiser forwards one pipeline call
      makes), ``call(batch)`` (one pipeline call: float32 (H, W, C) arrays in [0, 1]);
    * for MoE layers (``"moe"`` in ``backend_fields``): ``moe_blocks()`` (``(layer, block)`` of every MoE block),
      ``moe_layout()`` (a ``runner.kernels.moe.ExpertsLayout``) and ``moe_probe()`` (one block of the model's shape, for
      ``moe=auto``'s measurement);
    * optionally ``optimize(opts)`` and ``warmup_call(batch)``, ``check_rows(rows, path)`` and ``accuracy(...)``;
    * what the model honours: ``check_source()`` (config checks that need the model's configs, no weights),
      ``ignored_fields(rows)`` (generation fields the model ignores under the run's config, with why) and
      ``prompt_tokens(prompts)`` (per text encoder: token count, limit, tokens dropped).

    The loop's protocol (:class:`models.base.Engine`) is implemented here once for all of them.
    """

    output: ClassVar[str] = "image"
    unit: ClassVar[str] = "img"
    resumable: ClassVar[bool] = True
    default_stage: ClassVar[str] = "denoise"
    backend_fields: ClassVar[Tuple[str, ...]] = ("attention", "linear")
    """Backend fields the stage's model has layers for; a field outside it set to a backend is refused at startup
    naming the model (``backend.moe=TRITON`` on FLUX). A family with MoE layers adds ``moe``."""
    needs_mask: ClassVar[bool] = False
    fp8_prefixes: ClassVar[Tuple[str, ...]] = ("transformer_blocks.", "single_transformer_blocks.")
    """Module-name prefixes of the denoiser whose Linears FP8 linear may replace (the transformer blocks; embedders
    and the output projection stay dense)."""
    reads_engine_extras: ClassVar[bool] = False
    applies_cache: ClassVar[bool] = True  # cache.* (models.cache): the step cache of the denoiser

    PASSES: ClassVar[Tuple[str, ...]] = (
        "models.prompt_tokens:TruncationPass", "models.scheduler_shift:ShiftPass",
        "models.conditioning:ConditioningPass",
        "models.denoiser_evidence:ExpertsPass", "models.lora:LoraPass", "models.backend_passes:AttentionPass", "models.backend_passes:MoePass",
        "models.backend_passes:LinearPass", "models.context_parallel:ContextParallelPass",
        "models.video_decode:FastDecodePass", "models.memory:FittingPass", "models.compile:CompileBeneathHooksPass",
        "models.cache:StepCachePass", "models.compile:CompilePass")
    """The engine's features as passes (:mod:`models.passes`), as ``"module:Class"`` paths, in install order (every
    phase runs them in this order, ``close`` in reverse): the scheduler's shift (``model.generation.shift``) replaces
    the scheduler only; LoRA adapters first among those that touch the weights (fused weights are what the backends
    then wrap); the attention backends before context parallelism (diffusers checks each processor's); the MoE
    backend before linear (the routed experts' Linears belong to it); the memory plan's placement after every pass
    that replaces or rewrites parameters (fused LoRA, MoE, linear backends; ``optimize`` ran before all passes) and
    before the hooks and compile that wrap the modules as they will run (``models.memory.Fitting.defers``; the fast
    Wan decode's forwards before that, so an offload hook wraps them); compile beneath a step cache's hooks when both
    are on (the hooks stay eager), the cache after the backends (its hooks wrap the modules as they will run),
    regional compile last otherwise. A family engine may extend the tuple."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.stage = ctx.stage
        self.cfg = self.model_cfg = ctx.model  # the stage's typed model config (``cfg`` in model subclasses)
        self.cache_dir = ctx.run.cache_dir if ctx.run is not None else None
        self.pipe: Any = None
        self.source: Dict[str, Any] = {}
        self.resolutions: Dict[str, Any] = {}
        self.probes: Dict[str, Any] = {}
        self.probe: Optional[evidence.DenoiserProbe] = None
        self.phase_s: Dict[str, float] = {}
        self.want_forwards: Optional[int] = 0
        self.raised = False
        self.load_s = self.warmup_s = 0.0
        self.passes = Passes(self, self.PASSES)

    @property
    def device(self) -> str:
        """The torch device string of this process's platform (known once the loop detected it)."""
        return self.ctx.plat.device

    @property
    def dtype(self) -> torch.dtype:
        """The stage's compute dtype."""
        return self.ctx.dtype

    # ------------------------------------------------------------------------------------------ 1. config checks
    def check_config(self) -> None:
        """Generation defaults of ``model.generation`` and the run's ``max_pixels`` (errors name the config key,
        not a data file).

        Then every pass's own config checks (:meth:`models.passes.Pass.check_config`).

        Raises:
            ConfigValueError: naming the field, the value and the fix (a pass's subclass of it for its fields).
        """
        run = self.ctx.run
        for p in self.passes:
            p.check_config()
        g = self.model_cfg.generation
        m = self.model_cfg.size_multiple
        for key, v in (("width", g.width), ("height", g.height)):
            if v <= 0 or v % m:
                raise ConfigValueError(f"model.generation.{key}={v} is not a positive multiple of {m} (model "
                                       f"{self.model_cfg.name}); fix: e.g. model.generation.{key}="
                                       f"{max(m, round(v / m) * m)}")
        if run.max_pixels >= 1 and g.width * g.height > run.max_pixels:
            raise ConfigValueError(f"model.generation width x height = {g.width}x{g.height} exceeds max_pixels="
                                   f"{run.max_pixels}; fix: smaller sizes, or raise max_pixels")
        if g.num_inference_steps < 1:
            raise ConfigValueError(f"model.generation.num_inference_steps={g.num_inference_steps} must be >= 1; fix: "
                                   "e.g. model.generation.num_inference_steps=28")
        if g.max_sequence_length < 1:
            raise ConfigValueError(f"model.generation.max_sequence_length={g.max_sequence_length} must be >= 1; fix: "
                                   "e.g. model.generation.max_sequence_length=512")
        for key, v in (("guidance_scale", g.guidance_scale), ("true_cfg_scale", g.true_cfg_scale)):
            if v is None and key == "guidance_scale":  # null: the model takes no guidance (check_ignored)
                continue
            if v is None or not math.isfinite(v) or v < 0:
                raise ConfigValueError(f"model.generation.{key}={v} must be a finite number >= 0; fix: e.g. "
                                       f"model.generation.{key}={1.0 if key == 'true_cfg_scale' else 3.5}"
                                       + (", or null for a model without guidance" if key == "guidance_scale" else ""))

    # --------------------------------------------------------------------------------------------- 2. prepare
    def prepare(self) -> Dict[str, Any]:
        """Check the weight source, resolve and check the backends, check the memory; nothing loads.

        Returns:
            The manifest's ``model.source``.

        Raises:
            runner.core.errors.RunnerError subclasses (model path, backend selection, memory), naming the fix.
        """
        self.resolve_source()
        if self.source.get("kind") == "path":
            check_safetensors(Path(self.source["path"]))
        self.check_source()
        self.check_task_components()
        for p in self.passes:
            p.prepare()
        self.resolutions, _ = self.resolve_backends()
        for p in self.passes:
            p.after_resolve()
        return self.source

    def lossy_traits(self) -> Dict[str, Any]:
        """What the passes' configs say about the lossy lanes (:meth:`models.passes.Pass.lossy_traits`)."""
        return self.passes.lossy_traits()

    @property
    def task(self) -> str:
        """``model.task`` as the engine runs it; a text-to-image stage by default."""
        return "text_to_image"

    def pipeline_name(self) -> Optional[str]:
        """The diffusers pipeline class name the stage loads; None (not known) by default."""
        return None

    def component_config(self, name: str) -> Optional[Dict[str, Any]]:
        """The config of pipeline component ``name``, read without weights; None (not known) by default."""
        return None

    def declared_experts(self) -> List[str]:
        """The denoisers the model has, known before loading; the ``transformer`` alone by default."""
        return ["transformer"]

    def transformer_class(self) -> Optional[str]:
        """The diffusers class name of the denoiser, known before loading (step caches are checked against it);
        None by default (a subclass that knows it says so)."""
        return None

    def start_parallel(self) -> None:
        """Every pass's collective set-up (:meth:`models.passes.Pass.start`; a context-parallel mesh)."""
        for p in self.passes:
            p.start()

    def site_calls_per_forward(self, layer: str, module: Any) -> int:
        """Dispatcher calls the attention call site ``layer`` (``module``) makes per forward of its denoiser; 1 by
        default."""
        return 1

    def check_source(self) -> None:
        """Config checks that need the model's own configs or tokenizers (read from the weight source, no weights
        load); none by default."""

    def check_task_components(self) -> None:
        """After :meth:`check_source`: architecture components this run's task would ignore
        (:meth:`models.source.WeightSource.check_task_components`); none by default."""

    def row_expert_steps(self, row: ds.Row) -> Optional[Dict[str, int]]:
        """``{expert: steps it runs}`` in ``row``'s call on a model of several denoisers; None (one denoiser: it runs
        every step) by default."""
        return None

    # MoE layers of the denoiser: a family with ``moe`` in ``backend_fields`` provides these.
    # ------------------------------------------------------------------------------------------------ 3. rows
    # ------------------------------------------------------------------------ what the model honours
    def prompt_tokens(self, prompts: Sequence[str]) -> List[Dict[str, Dict[str, int]]]:
        """Per prompt, per text encoder: ``{"count", "limit", "dropped"}`` (tokens with the special tokens, the most
        the encoder takes, how many it drops). Empty dicts by default (a model without text encoders)."""
        return [{} for _ in prompts]

    # ------------------------------------------------------------------------------------------------ 4. load
    def load(self, on_loaded: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
        """Load the pipeline, apply ``optimize``, install the backends with their probes (attention call sites, MoE
        blocks when the family has them, linear layers), compile if asked.

        ``on_loaded(self)`` runs after the probe is attached (tests tamper with the model there).

        Returns:
            Manifest sections to add: ``model`` (source and ``load_s``) and ``optimize`` (what was applied).
        """
        cfg = self.ctx.run
        for p in self.passes:
            p.before_load()
        t0 = time.perf_counter()
        self.load_pipeline()
        self.load_s = time.perf_counter() - t0
        sections: Dict[str, Any] = {"model": {"load_s": round(self.load_s, 3)},
                                    "optimize": self.optimize(cfg.optimize)}
        self.observe = bool(cfg.evidence.enabled) and not any(p.hides_calls() for p in self.passes)
        self.probes = {"observed": self.observe}
        for p in self.passes:
            p.install(sections)
        self._on_loaded = on_loaded
        return sections

    def experts(self) -> List[Tuple[str, torch.nn.Module]]:
        """``(component, module)`` of the stage's denoisers in schedule order; the :attr:`denoiser` alone by default
        (a pipeline with two experts lists both: ``models.pipelines.PipelineEngine.experts``). Every install pass
        applies to each."""
        return [("transformer", self.denoiser)]

    def optimize(self, opts: Any) -> Dict[str, Any]:
        """Math-preserving speed settings; none by default."""
        return {}

    def warmup(self, batch: Sequence[ds.Item]) -> float:
        """A warm-up call at ``batch``'s shape when a pass asks for one (:meth:`models.passes.Pass.wants_warmup`:
        compile, so that compilation happens before the timed loop), between the passes' ``before_warmup`` and
        ``after_warmup``; then each pass's own runs (``prime``: a step cache's calibration). Then the denoiser probe
        is attached (profiling the 2nd forward when calls are hidden without a warm-up, since the 1st compiles) and
        ``on_loaded`` runs. Returns the seconds of both."""
        cfg = self.ctx.run
        if batch and any(p.wants_warmup() for p in self.passes):
            for p in self.passes:
                p.before_warmup(batch)
            t0 = time.perf_counter()
            self.warmup_call(batch)
            self.warmup_s = time.perf_counter() - t0
            for p in self.passes:
                p.after_warmup()
        prime_s = sum(p.prime() for p in self.passes)  # not the warm-up: compile.warmup_s stays the compile's
        experts = self.experts()
        hidden = any(p.hides_calls() for p in self.passes)
        self.probe = evidence.DenoiserProbe(dict(experts) if len(experts) > 1 else self.denoiser,
                                            profile=cfg.evidence.enabled and cfg.evidence.profile,
                                            device_kind=self.ctx.plat.kind,
                                            profile_forward=2 if hidden and not self.warmup_s else 1)
        if self._on_loaded is not None:
            self._on_loaded(self)
        return self.warmup_s + prime_s

    def warmup_call(self, batch: Sequence[ds.Item], steps: int = 2) -> None:
        """One pipeline call of ``steps`` steps whose output is discarded; a subclass that compiles provides it."""

    def step_forwards(self, batch: Sequence[ds.Item]) -> int:
        """Transformer forwards per denoising step of ``batch``'s pipeline call (2 with CFG);
        1 by default."""
        return 1

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Restore the attention, linear and MoE call counters of the evidence after the block (a pipeline call
        that is no part of the run)."""
        sites = list(self.probes.get("attention") or []) + list((self.probes.get("moe") or {}).get("sites") or [])
        lin = self.probes.get("linear")
        saved = [(x, type(x.observed)(x.observed)) for x in sites] + ([(lin, dict(lin.observed))] if lin else [])
        try:
            yield
        finally:
            for x, observed in saved:
                x.observed = observed

    # -------------------------------------------------------------------------------------------- 5. generate
    def generate(self, batch: Sequence[ds.Item]) -> List[ImageOutput]:
        """One pipeline call over ``batch``; counts the denoiser forwards it should have made.

        Raises:
            Whatever the pipeline raises; the loop then retries the batch's items one by one.
        """
        for p in self.passes:
            p.before_call(batch)
        try:
            images = self.call(batch)
        except Exception:
            self.raised = True  # a call raised part-way: forward totals are no longer predictable
            for p in self.passes:
                p.call_failed()
            raise
        want = self.expected_forwards(batch)  # None: the pipeline's forward count is not known (not checked)
        self.want_forwards = None if want is None or self.want_forwards is None else self.want_forwards + want
        for p in self.passes:
            p.after_call(batch, want)
        if self.output == "video":
            return self.video_outputs(images, batch)
        return [ImageOutput(img) for img in images]

    def video_outputs(self, videos: List[Any], batch: Sequence[ds.Item]) -> List[VideoOutput]:
        """One :class:`models.base.VideoOutput` per item of a call's videos (F, H, W, 3: ``uint8``, or float32), at
        the row's ``fps``; a family that generates audio adds it (LTX-2)."""
        return [VideoOutput(frames, fps=it.row.fps) for frames, it in zip(videos, batch)]

    # -------------------------------------------------------------------------------------------- 6. evidence
    def evidence(self, result: StageResult) -> Tuple[Dict[str, Any], List[str]]:
        """The stage's evidence (``models.denoiser_evidence.build``): attention call sites and linear layers observed,
        denoiser forwards against :meth:`expected_forwards`, profiled kernels against each backend's signature.

        Returns:
            ``(evidence.stages.<stage>, mismatches)``.
        """
        ev = evidence.build(self.stage, self.probes, self.probe, None if self.raised else self.want_forwards,
                            finite=result.nonfinite == 0, device=self.device, **self.passes.evidence_inputs(),
                            forward_rule=self.has_forward_rule())
        section, mismatches = ev["stages"][self.stage], list(ev["mismatches"])
        mismatches += self.passes.evidence(section)
        return section, mismatches

    def inputs_any_size(self) -> bool:
        """The task's pipeline sizes each input itself (``runner.core.media.size_problems``); False by default."""
        return False

    def has_forward_rule(self) -> bool:
        """The engine predicts its denoiser forwards (:meth:`expected_forwards`); True unless a subclass says not."""
        return True

    def timing_phases(self, generate_s: float) -> Dict[str, float]:
        """Seconds per pipeline phase (text encoding, VAE decoding; denoising is the rest of ``generate_s``)."""
        phases = dict(self.phase_s or {})
        if phases:
            phases["denoise"] = max(0.0, generate_s - sum(phases.values()))
        return phases

    def final_sections(self) -> Dict[str, Any]:
        """The passes' manifest sections at the end of the run (:meth:`models.passes.Pass.final_sections`)."""
        return self.passes.final_sections()

    def accuracy(self, items: Sequence[ds.Item], records: Dict[str, Dict[str, Any]], out_dir: Path
                 ) -> Optional[Dict[str, Any]]:
        """The model's oracle score over ``items`` (None: the model has no oracle)."""
        return None

    def close(self) -> None:
        """Close every pass; leave the compile scope (deterministic mode restored); lift the memory budget's
        allocator cap."""
        self.passes.close()
