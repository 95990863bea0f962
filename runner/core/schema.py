"""Structured config schema for every Hydra group, registered in Hydra's ConfigStore.

The schema is the contract between the YAML in ``conf/`` and the code: Hydra merges each group's YAML into
these dataclasses, so an unknown key (a typo), a value of the wrong type or a value outside a closed choice fails
at compose time with Hydra's own message (naming the key, the value and, for a choice, the valid values), before
anything is imported or loaded.

Closed choices are :class:`Choice` enums (OmegaConf 2.3 does not take ``Literal``). A member *is* its string:
it compares, hashes, formats, prints and serialises to JSON as its plain value, so ``cfg.compile != "none"`` and
the manifest's ``config`` section read exactly as with plain strings.

Models have one schema per family, each a config of the ``model`` group that model YAMLs extend (Hydra's
"schema per option" pattern, ``defaults: [base_diffusion, _self_]``): ``base_diffusion``
(:class:`DiffusionModelConfig`, diffusers), ``base_ar`` (:class:`ARModelConfig`, vLLM) and ``base_pipeline``
(:class:`PipelineModelConfig`, a diffusion model fed by other stages). A key of another family
(``model.sampling`` on a diffusion model) is refused at compose time.

Unset backend choices are ``None`` (``null`` in YAML), which is distinct from an explicit ``"auto"``; the
resolver (``runner.core.resolve``) keeps the two apart.

Each field declares what its value enters (:func:`declared`, :class:`Factors`; vLLM's ``compile_factors`` idea):
the resume comparison, the run identity, the compile-cache key. ``runner.core.resume`` and
``models.compile_cache``'s callers derive their keys from those declarations (:func:`factor_keys`,
:func:`omitted_fields`, :func:`compile_factors`) instead of keeping lists. After the schema check the composed
config converts once to these dataclasses (:func:`to_typed`); engines read it as ``models.base.StageContext.run``.

Every field is read by some code outside this module (``tests/test_schema.py`` checks it): a field nothing
reads would accept a value and silently ignore it.

Compatible with Hydra 1.3 and 1.4: mutable defaults use ``default_factory``; nothing is built with an
unrestricted ``hydra.utils.instantiate``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runner.core.readers import READERS

# ------------------------------------------------------------------------------------------------ factors

#: What a field's value may enter (vLLM's ``compute_hash``/``compile_factors`` idea, declared per field):
#: ``resume``: the semantic config compared when a run dir is resumed (``runner.core.resume.semantic_diff``; a
#: difference refuses the resume unless ``run.force``); ``identity``: the run identity hashed into every item's
#: ``inputs_sha256`` (``runner.core.resume.run_identity``); ``compile``: the compile settings hashed into the
#: compile-cache key (``models.compile_cache.key_fields``).
RESUME, IDENTITY, COMPILE = "resume", "identity", "compile"
FACTOR_KINDS = (RESUME, IDENTITY, COMPILE)
#: The field-metadata key holding a field's :class:`Factors`.
FACTORS_METADATA = "runner_factors"


@dataclass(frozen=True)
class Factors:
    """A field's declaration of what it enters (field metadata :data:`FACTORS_METADATA`, set by :func:`declared`)."""

    enters: tuple = ()
    """Kinds of :data:`FACTOR_KINDS` the field's whole value enters, under its dotted key (``model.generation``)."""
    omitted_from: tuple = ()
    """Kinds a field *inside* such a value is left out of (``model.generation.width`` reaches the bytes through each
    row, so the identity's ``model.generation`` omits it)."""
    when_set: bool = False
    """Resume comparison and identity: the key enters only while set (``cache`` with a method, a ``compile_mode``
    other than ``default``), so a run that never set it keeps the identity and semantic config it had before the
    field existed; ``runner.core.resume.WHEN_SET`` says per key what *set* means. The compile-cache key takes the
    field always."""


def declared(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
             enters: tuple = (), omitted_from: tuple = (), when_set: bool = False) -> Any:
    """A ``dataclasses.field`` declaring what the field enters (:class:`Factors`).

    Raises:
        ValueError: a kind that is not one of :data:`FACTOR_KINDS`.
    """
    bad = [k for k in (*enters, *omitted_from) if k not in FACTOR_KINDS]
    if bad:
        raise ValueError(f"unknown factor kind(s) {bad}; one of {FACTOR_KINDS}")
    meta = {FACTORS_METADATA: Factors(tuple(enters), tuple(omitted_from), when_set)}
    return field(default=default, default_factory=default_factory, metadata=meta)


def factors_of(f: dataclasses.Field) -> Factors:
    """The :class:`Factors` a dataclass field declares (none: enters nothing)."""
    return f.metadata.get(FACTORS_METADATA) or Factors()


# ------------------------------------------------------------------------------------------------ closed choices


class Choice(str, Enum):
    """A closed choice. Members are named by their value and behave as that plain string everywhere:
    ``==``, ``hash``, ``str()``, f-strings, ``repr()`` (``'regional'``, as a plain string's) and ``json.dumps``."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)

    def __repr__(self) -> str:
        return repr(str.__str__(self))

    __hash__ = str.__hash__


class DType(Choice):
    """Compute dtype of the run. ``auto``: bfloat16 on GPUs/accelerators, float32 on CPU."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Compile(Choice):
    """``torch.compile`` of diffusion stages. ``regional``: each repeated transformer block."""

    none = "none"
    regional = "regional"


class CompileMode(Choice):
    """``torch.compile``'s ``mode`` for ``compile=regional`` (torch spells them with hyphens: ``max_autotune`` is
    ``mode="max-autotune"``). ``default``: Inductor's fusions; ``max_autotune_no_cudagraphs``: also GEMM/conv
    templates chosen among candidates; ``max_autotune``: that plus CUDA graphs; ``reduce_overhead``: CUDA graphs.
    With ``optimize.deterministic_compile`` the max-autotune modes choose without timing on the device
    (Inductor's deterministic choice), so every process still compiles the same kernels."""

    default = "default"
    max_autotune_no_cudagraphs = "max_autotune_no_cudagraphs"
    max_autotune = "max_autotune"
    reduce_overhead = "reduce_overhead"


class ParallelismMode(Choice):
    """How work is spread over devices: ``data`` shards the dataset; ``ulysses`` and ``ring`` split each item's
    sequence over a context group of ranks (diffusers' context parallelism); ``cfg`` is refused at startup
    (diffusers has no CFG parallelism)."""

    single = "single"
    data = "data"
    cfg = "cfg"
    ulysses = "ulysses"
    ring = "ring"


class LauncherName(Choice):
    """Who starts the workers of ``parallelism=data``."""

    local = "local"
    ray = "ray"
    slurm = "slurm"


class SubmititExecutor(Choice):
    """``launcher=slurm``: where submitit runs the job array: ``slurm`` (sbatch) or ``local`` (submitit's
    LocalExecutor: real processes and signals on this machine, one controller per task; for trying it out)."""

    slurm = "slurm"
    local = "local"


class Assignment(Choice):
    """How ``parallelism=data`` hands batches to workers: ``static`` deals them out up front; ``claims``: each
    worker pulls the next batch by claiming it with a lease (``runner.core.claims``)."""

    static = "static"
    claims = "claims"


#: Where and how dataset rows are read: the sources of ``runner.core.readers.READERS`` (a new source is one record
#: there, and a choice here), read by ``runner.core.dataset.read_raw``.
DatasetFormat = Choice("DatasetFormat", [(name, name) for name in READERS], module=__name__,
                       qualname="DatasetFormat")
DatasetFormat.__doc__ = "Where and how dataset rows are read (``runner.core.readers.READERS``)."


class Task(Choice):
    """What a diffusion model config generates from a row (``model.task``; the family's ``FamilySpec.tasks`` maps
    each to a diffusers pipeline class): ``text_to_image``, ``image_to_image`` (``image`` + ``strength``),
    ``inpaint`` (``image`` + ``mask_image`` + ``strength``), ``edit`` (``image``: one reference, or a list for
    multi-reference editing), ``text_to_video``, ``image_to_video`` (``image``, optional ``last_image``)."""

    text_to_image = "text_to_image"
    image_to_image = "image_to_image"
    inpaint = "inpaint"
    edit = "edit"
    text_to_video = "text_to_video"
    image_to_video = "image_to_video"


class LoraFuse(Choice):
    """Whether run-level LoRA adapters are fused into the base weights at load (``model.lora_fuse``): ``auto`` fuses
    when every row runs the same adapter set (recording why), ``fused`` fuses or refuses a run whose rows need several
    sets, ``unfused`` keeps the LoRA branches unfused (switched per batch with ``set_adapters``)."""

    auto = "auto"
    fused = "fused"
    unfused = "unfused"


class ExtraFields(Choice):
    """What a dataset field that is no row field does: ``error`` refuses it (with a did-you-mean); ``keep`` records
    it under the item's ``meta`` unless it is close to a row field (a typo such as ``promt`` is refused either
    way)."""

    error = "error"
    keep = "keep"


class TrackerName(Choice):
    """Where a finished run is logged besides its run dir (``runner.app.tracking``): ``none`` or ``mlflow``."""

    none = "none"
    mlflow = "mlflow"


class OnIgnored(Choice):
    """What a dataset row or a ``model.generation`` default that the model ignores does (a guidance scale on a model
    without guidance embedding, a negative prompt without true CFG): ``error`` refuses the run at startup;
    ``record`` runs it without the value and records the value as ignored (never as applied)."""

    error = "error"
    record = "record"


class OnTruncation(Choice):
    """What a prompt longer than a text encoder takes does: ``record`` runs it (the encoder sees its first tokens)
    and records per encoder the token count and the tokens dropped; ``error`` refuses the row at startup."""

    record = "record"
    error = "error"


class VideoCodec(Choice):
    """How the MP4 sink encodes videos (``runner.core.video.CODECS``): ``h264_lossless`` (libx264rgb, RGB, lossless: the
    decoded frames are the generated frames; not playable in browsers) or ``h264`` (libx264, yuv420p, CRF 18:
    plays everywhere, lossy; even sizes only)."""

    h264_lossless = "h264_lossless"
    h264 = "h264"


class CacheSchedule(Choice):
    """Which kind of step-cache schedule a run asks for (``models.cache``): ``fixed`` (the steps that reuse are set
    by the config alone, whatever the weights: taylorseer, pab) or ``adaptive`` (decided each step from the
    activations: first_block, magcache)."""

    fixed = "fixed"
    adaptive = "adaptive"


class PlatformName(Choice):
    """A device platform (``auto`` detects one at startup)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    rocm = "rocm"
    xpu = "xpu"
    npu = "npu"
    mps = "mps"


class DeviceType(Choice):
    """A torch device type (``auto``: the platform's own; ROCm GPUs are ``cuda`` to torch)."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    xpu = "xpu"
    npu = "npu"
    mps = "mps"


class Probe(Choice):
    """A capability probe recorded in the manifest (``runner.core.platform``); one that does not apply records null."""

    device_name = "device_name"
    capability = "capability"
    driver = "driver"
    cuda = "cuda"
    cudnn = "cudnn"
    hip = "hip"


class LoadFormat(Choice):
    """Where a model's weights come from: ``auto`` (``path``, or an embedded model built into the cache on first
    use) or ``dummy`` (random weights, no checkpoint; for benchmarks)."""

    auto = "auto"
    dummy = "dummy"



class OffloadMode(Choice):
    """Where weights live between uses (``memory.offload``, ``models.memory``): ``none`` (all on the device),
    ``model`` (diffusers' ``enable_model_cpu_offload``: one component on the device at a time), ``group_block`` /
    ``group_leaf`` (diffusers' group offloading by blocks / by leaf modules), ``auto`` (the fastest plan that fits
    ``memory.max_gpu_gb``, recorded with why; off a GPU: ``none``, recorded so). ``python -m runner ... --plan``
    prints the plan a run would get, on any machine (``runner.tools.plan``)."""

    auto = "auto"
    none = "none"
    model = "model"
    group_block = "group_block"
    group_leaf = "group_leaf"

#: ``model.engine`` values whose models take the AR schema; the engine name itself is an open choice checked
#: against ``models.registry`` (an engine registered out of tree is one ``register_engine`` call).
AR_ENGINES = ("vllm",)


class Oracle(Choice):
    """Readers of generated images that score them against the row's expectations (``accuracy``)."""

    toy_shapes = "toy_shapes"
    toy_motion = "toy_motion"
    toy_edit = "toy_edit"



#: Closed choices the published JSON Schemas (``runner/schemas/<name>.schema.json``) repeat: ``{schema name:
#: {JSON pointer of an ``enum``: the Choice it lists}}``. ``runner.tools.validate.schema`` validates with the
#: Choice's values, and ``tests/test_typed_config.py`` proves the published files list the same.
JSON_SCHEMA_ENUMS = {"manifest": {"/properties/dataset/properties/format": DatasetFormat}}

# ------------------------------------------------------------------------------------------------ backends, stages


@dataclass
class BackendConfig:
    """Backend choices of one scope (run level, a model's defaults, or one stage). ``None``: not set at this layer.
    Names are open (the registry in ``runner.kernels.registry`` knows them, with aliases), so they stay strings."""

    attention: Any = None
    """A backend name (``TORCH_SDPA``, alias ``sdpa``, ..., or ``auto``) or a spec
    ``{default: <spec>, per_role: {<role>: <spec>}}`` where a spec is ``{backend, quant, skip_softmax}``."""
    linear: Optional[str] = None
    """Linear-layer backend name (``TORCH``, ``FP8``, ..., or ``auto``)."""
    moe: Optional[str] = None
    """Mixture-of-experts backend name (``TORCH``, ``TRITON``, ..., or ``auto``)."""


@dataclass
class StageConfig:
    """One stage of a model (FLUX has one: ``denoise``; ``tiny_qwen3_moe`` has ``generate``)."""

    backend: BackendConfig = declared(default_factory=BackendConfig, omitted_from=(IDENTITY,))
    """Backend choices of this stage only (layer ``cli_stage``/``yaml_stage`` of the precedence contract)."""
    engine_extras: Dict[str, Any] = field(default_factory=dict)
    """Further engine arguments: ``vllm.EngineArgs`` fields of a vLLM stage (``max_model_len``, ``max_num_seqs``);
    a diffusers stage takes none (refused)."""
    # Misplaced-key guards: must stay null. A backend name here is rejected at startup with the place it belongs
    # (stages.<name>.backend.<field>) instead of Hydra's bare "key not in struct".
    attention: Any = None
    """Guard: refused when set; the stage's attention backend is ``backend.attention``."""
    linear: Any = None
    """Guard: refused when set; the stage's linear backend is ``backend.linear``."""
    moe: Any = None
    """Guard: refused when set; the stage's MoE backend is ``backend.moe``."""


@dataclass
class GenerationDefaults:
    """Per-model generation defaults of a diffusion model, used for every dataset row that does not set the field."""

    width: int = declared(1024, omitted_from=(IDENTITY,))
    """Image width in pixels (a multiple of ``model.size_multiple``)."""
    height: int = declared(1024, omitted_from=(IDENTITY,))
    """Image height in pixels (a multiple of ``model.size_multiple``)."""
    num_inference_steps: int = declared(28, omitted_from=(IDENTITY,))
    """Denoising steps."""
    guidance_scale: Optional[float] = declared(3.5, omitted_from=(IDENTITY,))
    """Guidance scale (FLUX.1-dev: distilled guidance embedding). null for a model whose transformer has no
    guidance embedding (FLUX.1-schnell, toy_shapes): any value there is ignored, so setting one is refused
    (``dataset.on_ignored``)."""
    guidance_scale_2: Optional[float] = declared(None, omitted_from=(IDENTITY,))
    """Wan 2.2 A14B: the guidance scale of the low-noise expert (``transformer_2``; WanPipeline's
    ``guidance_scale_2``); null: ``guidance_scale``. A model with one expert ignores it (``dataset.on_ignored``)."""
    max_sequence_length: int = 512
    """Token limit of the sequence text encoder (T5, UMT5, Qwen2.5-VL; longer prompts are truncated and recorded;
    at most what the tokenizer and the pipeline take: FLUX and SD3 512, Qwen-Image 1024)."""
    true_cfg_scale: float = 1.0
    """True classifier-free guidance scale (> 1 with a row's ``negative_prompt``: a second, unconditional forward
    per step)."""
    num_frames: Optional[int] = None
    """Video models: frames per video (Wan: 4k+1, e.g. 81); null for image models (a value there is refused)."""
    fps: Optional[int] = None
    """Video models: frames per second of the written video (Wan 2.1: 16); null for image models."""
    shift: Optional[float] = declared(None, when_set=True)
    """The flow-matching scheduler's static timestep shift ``s`` (> 0): every sigma of the schedule becomes
    ``s * sigma / (1 + (s - 1) * sigma)`` whatever the image size (diffusers' ``FlowMatchEulerDiscreteScheduler``
    ``shift`` with ``use_dynamic_shifting`` and ``shift_terminal`` off; ``flow_shift`` of a flow-sigma
    ``UniPCMultistepScheduler``/``DPMSolverMultistepScheduler``, Wan's), applied to the loaded pipeline's scheduler
    (``models.scheduler_shift``); the sigmas the scheduler used are read back after each call into the item's
    ``scheduler`` record and checked in ``evidence.stages.<stage>.scheduler``. Few-step distilled adapters are
    trained at one (Qwen-Image-Lightning: 3, Wan 2.2 Lightning: 5). null: the model's own scheduler (FLUX's and
    Qwen-Image's resolution-dependent shift). A scheduler without a flow shift is refused at startup, naming the
    fix. Enters the resume comparison and the run identity while set (:attr:`Factors.when_set`)."""


# ------------------------------------------------------------------------------------------------ models


@dataclass
class LoraAdapterConfig:
    """One LoRA adapter of a diffusion run's library (``model.lora`` entries; ``models.lora``)."""

    path: str = declared(MISSING, omitted_from=(RESUME,))
    """A ``.safetensors`` LoRA file: diffusers/peft naming or a community format diffusers' converters read (kohya,
    xlabs...). Pickle files are refused. Recorded, not compared on resume: the adapter is its content (sha256, in
    the identity), so a renamed file is a metadata change (``resumed_from.lora_renamed``), not a conflict."""
    scale: float = 1.0
    """The adapter's weight (``set_adapters`` weight, ``fuse_lora(lora_scale=...)``); a row's ``lora_scale`` beats
    it."""
    name: Optional[str] = declared(None, omitted_from=(RESUME,))
    """The name rows use in their ``lora`` field (null: the file's stem); a label, recorded, not compared on resume
    (rows that name an adapter are part of the dataset, compared by its sha256)."""
    expert: Optional[str] = None
    """The denoiser the adapter loads into, by the pipeline's component name: ``transformer`` (the high-noise expert
    of Wan 2.2 A14B; the only denoiser elsewhere), ``transformer_2`` (Wan 2.2 A14B's low-noise expert, diffusers'
    ``load_into_transformer_2``), or ``all`` (each denoiser, at this entry's one scale). Required on a two-expert model
    (diffusers loads into ``transformer`` alone by default: the other expert's steps would run unadapted); null means
    the one denoiser of a one-transformer family, where ``transformer_2`` is refused at startup naming the fix. A
    scale per expert: one entry per expert, each with its ``scale`` (the same path under two names). Few-step
    distilled pairs (Wan 2.2 Lightning / LightX2V) ship one file per expert. In the run identity (a moved adapter is
    another output); an expert that runs no step of a row records its part under the item's ``ignored.lora``."""


@dataclass
class DistilledConfig:
    """A few-step distilled preset (``experiment=wan22_lightning_4step``, ``qwen_image_lightning_8step``,
    ``toy_shapes_fewstep``; ``docs/lora.md``): its adapters are ``model.lora`` entries, its steps, shift and guidance
    ``model.generation``'s. A run that names one is lossy (the lane ``model.distilled=<preset>``,
    ``runner.core.lossy``), and ``runner.gate`` compares it with the base model's run of the same rows (the model's
    own steps, shift and guidance, without the preset's adapters)."""

    preset: Optional[str] = None
    """The preset's name (null: not a distilled run)."""
    adapters: List[str] = field(default_factory=list)
    """The ``model.lora`` entries (by ``name``) that are the preset's distilled adapters, each with its file
    (``path``) for the user to fill in; an entry without a path is refused at startup, naming it and the fix."""
    source: Optional[str] = None
    """Where the adapter files are published, named in that refusal's fix."""


@dataclass
class ModelConfig:
    """What every model has, whatever its family. Model YAMLs extend a family schema (``base_diffusion``,
    ``base_ar``, ``base_pipeline``), never this one directly."""

    name: str = declared(MISSING, enters=(RESUME, IDENTITY))
    """Model name: the manifest's ``model.name``, and the key of ``platform.overlays``."""
    engine: Any = declared(MISSING, enters=(RESUME, IDENTITY))
    """The engine that runs the model (``models.registry``; each family narrows it to its own engines). Called
    ``adapter`` before issue #39 (a word that means LoRA to this field's users): ``adapter`` is refused, naming
    this key."""
    path: Optional[str] = declared(None, enters=(RESUME, IDENTITY))
    """A local checkpoint directory (diffusers snapshot, or Hugging Face model directory for vLLM)."""
    load_format: LoadFormat = declared(LoadFormat.auto, enters=(RESUME, IDENTITY))
    """``auto``: load ``path`` (or build an embedded model on first use); ``dummy``: random weights, no checkpoint."""
    embedded: bool = False
    """The model is built by the runner on first use into ``cache_dir`` (no download)."""
    architecture: Dict[str, Any] = declared(default_factory=dict, enters=(RESUME, IDENTITY))
    """Component configs: what ``load_format=dummy`` and embedded models build (AR: overrides of the tiny model's
    architecture)."""
    roles: List[str] = field(default_factory=list)
    """Attention roles of the model (``backend.attention.per_role`` keys)."""
    backend: BackendConfig = declared(default_factory=BackendConfig, enters=(RESUME,))
    """The model's backend defaults (layer ``model_default`` of the precedence contract)."""
    stages: Dict[str, StageConfig] = declared(default_factory=dict, enters=(RESUME, IDENTITY))
    """The model's stages by name (each family sets its own; a stage the model does not have is refused)."""
    builtin_prompts: str = "prompts.jsonl"
    """Rows of ``dataset=builtin``: the file ``runner/data/<this>``."""
    # Misplaced-key guards (see StageConfig): backend choices belong under model.backend / model.stages.
    attention: Any = None
    """Guard: refused when set; the model's default is ``model.backend.attention``."""
    linear: Any = None
    """Guard: refused when set; the model's default is ``model.backend.linear``."""
    moe: Any = None
    """Guard: refused when set; the model's default is ``model.backend.moe``."""
    adapter: Any = None
    """Guard: the former name of ``engine``; refused when set, naming ``model.engine`` (and ``engine:`` in a model
    YAML)."""


@dataclass
class QuantizationConfig:
    """Weight quantization per pipeline component (``runner.kernels.quantization``: ``int8wo``, ``float8wo``, ``int8dq``
    (W8A8), ``int4wo``, ``nvfp4``, ``nf4``, ``gguf``, and the pre-quantized checkpoints ``nunchaku`` and ``modelopt``;
    null/``none``: the component's weights as stored). Lossy: a run that sets one is labelled lossy and gated
    against the lossless run. A method whose requirements (platform, compute capability, dtype, package) are unmet,
    a component the model does not have, a batch_size the method is known to fail at (``nvfp4``: 32 and more), or a
    checkpoint method without a checkpoint of its kind is refused at startup, every entry at once, each with its
    fix."""

    transformer: Optional[str] = None
    """The denoiser (``gguf``: from ``gguf_file``)."""
    transformer_2: Optional[str] = None
    """The second denoiser of two-stage families (Wan 2.2)."""
    text_encoder: Optional[str] = None
    """The first text encoder (FLUX, SD3: CLIP-L; Wan: UMT5; Qwen-Image: Qwen2.5-VL)."""
    text_encoder_2: Optional[str] = None
    """The second text encoder (FLUX: T5-XXL; SD3: CLIP-G)."""
    text_encoder_3: Optional[str] = None
    """The third text encoder (SD3: T5-XXL)."""
    gguf_file: Optional[str] = None
    """The ``.gguf`` file of the component set to ``gguf`` (e.g. a FLUX.1-dev Q4_K_S transformer), loaded with
    diffusers' ``from_single_file``; its config comes from the snapshot."""


@dataclass
class DiffusionModelConfig(ModelConfig):
    """A diffusion model run through diffusers (``conf/model/flux.yaml``: ``defaults: [base_diffusion, _self_]``)."""

    engine: str = declared("flux", enters=(RESUME, IDENTITY))
    """The engine (``models.registry``): a family, ``flux``, ``sd3``, ``qwen_image``, ``wan``, ``hidream``, ``ltx2``, or
    ``diffusers`` (any transformer-based pipeline, from its snapshot's ``model_index.json``;
    ``models.pipelines.PipelineEngine``)."""
    revision: Optional[str] = declared(None, enters=(RESUME, IDENTITY))
    """Revision of ``path``, recorded in the manifest's model source (and compared on resume)."""
    roles: List[str] = field(default_factory=lambda: ["joint"])
    """Attention roles (FLUX: ``joint``)."""
    stages: Dict[str, StageConfig] = declared(default_factory=lambda: {"denoise": StageConfig()},
                                              enters=(RESUME, IDENTITY))
    """The model's single stage, ``denoise``."""
    generation: GenerationDefaults = declared(default_factory=GenerationDefaults, enters=(RESUME, IDENTITY))
    """Per-row generation defaults."""
    size_multiple: int = 16
    """Widths and heights must be multiples of this (VAE factor x patch size)."""
    task: Optional[Task] = declared(None, enters=(RESUME, IDENTITY), when_set=True)
    """What the model generates from a row (:class:`Task`); null: the family's generation task (``text_to_image``,
    ``text_to_video`` for a video family). A task the family has no pipeline for is refused at startup, naming those
    it has; the conditioning tasks read their inputs from the rows (``image``, ``mask_image``, ``last_image``,
    ``strength``: ``runner.core.media``). Enters the resume comparison and the run identity while it is a
    conditioning task (``runner.core.resume.WHEN_SET``), so text runs keep their identities."""
    oracle: Optional[Oracle] = None
    """Reads generated images back (``models.toy_shapes.oracle``) for the manifest's ``accuracy``; null: none."""
    quantization: QuantizationConfig = declared(default_factory=QuantizationConfig, enters=(RESUME, IDENTITY),
                                                when_set=True)
    """Weight quantization per component (:class:`QuantizationConfig`, lossy). Enters the resume comparison and the
    run identity while any component is quantized (``runner.core.resume.WHEN_SET``)."""
    lora: List[LoraAdapterConfig] = declared(default_factory=list, enters=(RESUME,))
    """The run's LoRA adapters (``models.lora``): every row runs all of them unless it names its own (``lora``,
    ``lora_scale`` row fields). Each adapter's sha256 and scale enter the identity of the items that run it."""
    distilled: DistilledConfig = field(default_factory=DistilledConfig)
    """The few-step distilled preset the run is (:class:`DistilledConfig`; set by its experiment): a label for the
    lossy lane and the gate, entering no identity (the adapters, steps and shift it sets do)."""
    lora_fuse: LoraFuse = declared(LoraFuse.auto, enters=(RESUME,))
    """Fuse the adapters into the base weights at load (:class:`LoraFuse`); the decision is recorded in
    ``model.source.lora`` and enters the run identity."""


@dataclass
class ARModelConfig(ModelConfig):
    """An autoregressive model run through vLLM (``conf/model/tiny_qwen3_moe.yaml``:
    ``defaults: [base_ar, _self_]``)."""

    engine: str = declared("vllm", enters=(RESUME, IDENTITY))
    """The engine (``models.registry``): ``vllm`` (``models.vllm.engine.VLLMEngine``)."""
    roles: List[str] = field(default_factory=lambda: ["decoder"])
    """Attention roles (``decoder``)."""
    stages: Dict[str, StageConfig] = declared(default_factory=lambda: {"generate": StageConfig()},
                                              enters=(RESUME, IDENTITY))
    """The model's single stage, ``generate`` (``engine_extras``: further ``vllm.EngineArgs`` fields)."""
    sampling: Dict[str, Any] = field(default_factory=dict)
    """Default ``vllm.SamplingParams`` fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
    ...); dataset rows override them per row."""
    batch_size: Optional[int] = None
    """Requests per ``LLM.generate`` call (vLLM schedules them continuously, ``max_num_seqs`` at a time). null: the
    run-level ``batch_size`` when it is given on the command line, else every request of the stage in one call (a
    stop signal then takes effect when that call returns)."""


@dataclass
class PipelineStageConfig(StageConfig):
    """A stage of a multi-stage model: its own backends, and for a stage the model's engine does not run, the
    engine and model that run it and what feeds it."""

    engine: Optional[str] = None
    """The engine of a stage that is not the model's own (``vllm``); null for the model's own stage."""
    adapter: Any = None
    """Guard: the former name of ``engine``; refused when set, naming ``model.stages.<stage>.engine``."""
    model: Optional[ModelConfig] = None
    """That stage's model config, composed from a model file: ``defaults: [tiny_qwen3_moe@stages.<stage>.model]``."""
    input: Optional[str] = None
    """What feeds the stage: ``prompt`` (the dataset row's prompt) or the name of the stage whose output text it
    reads."""
    template: Optional[str] = None
    """How the input becomes this stage's prompt: a format string over ``{prompt}`` (the row's prompt) and
    ``{text}`` (the upstream output text); null: ``"{prompt}, {text}"``."""


@dataclass
class PipelineModelConfig(DiffusionModelConfig):
    """A diffusion model fed by other stages (``conf/model/prompt_expand_flux.yaml``). It extends the diffusion
    model it renders with, so its file lists that model first, then this schema, then the schema of each added
    stage: ``defaults: [tiny_flux, base_pipeline, base_pipeline_stage@stages.expand, ...]`` (Hydra merges a
    schema only into a config of the same class or a base class, and a stage added to a composed model gets the
    model's stage schema, ``StageConfig``, unless its own schema comes first)."""

    pipeline: List[str] = field(default_factory=list)
    """Stage names in execution order; the last is the model's own diffusion stage."""
    stages: Dict[str, PipelineStageConfig] = declared(default_factory=lambda: {"denoise": PipelineStageConfig()},
                                                      enters=(RESUME, IDENTITY))
    """Every stage of the pipeline by name."""


MODEL_FAMILIES = {"base_diffusion": DiffusionModelConfig, "base_ar": ARModelConfig, "base_pipeline": PipelineModelConfig}


def model_schema(model: Mapping[str, Any]) -> type:
    """The family schema of a model config as a plain mapping (a run config rebuilt from a dict has lost its
    types): a pipeline when it lists ``pipeline``, AR when its engine is an AR engine, else diffusion."""
    if "pipeline" in model:
        return PipelineModelConfig
    if model.get("engine") in AR_ENGINES:
        return ARModelConfig
    return DiffusionModelConfig


# ------------------------------------------------------------------------------------------------ run-level groups


@dataclass
class PlatformConfig:
    """A device platform: its torch device type and the capability probes to record."""

    name: PlatformName = MISSING
    """The platform (``auto``: detect cuda/rocm, xpu, npu, mps, then cpu)."""
    device: DeviceType = DeviceType.auto
    """Torch device type (``auto``: the platform's)."""
    probes: List[Probe] = field(default_factory=list)
    """Probes whose readings the manifest records (``device_name`` is always recorded)."""
    overlays: Dict[str, Any] = field(default_factory=dict)
    """Model name -> ``{backend: {...}, engine_extras: {...}}`` replacing that model's defaults on this platform
    (layer ``platform_overlay`` of the precedence contract)."""


@dataclass
class ParallelismConfig:
    """How work is spread over devices."""

    mode: ParallelismMode = ParallelismMode.single
    """``single``; ``data``: the dataset sharded over torchrun ranks or Ray workers (the launcher decides how
    many); ``ulysses`` / ``ring``: every item's sequence split over a context group of ``ulysses_degree x
    ring_degree`` torchrun ranks (diffusers' ``ContextParallelConfig``), groups sharding the dataset like ``data``;
    ``cfg`` is refused at startup (diffusers 0.42 has no CFG parallelism)."""
    ulysses_degree: int = 1
    """Ranks of a context group exchanging heads by all-to-all (Ulysses); the model's attention heads must be a
    multiple of it. ``parallelism=ulysses`` needs >= 2."""
    ring_degree: int = 1
    """Ranks of a context group passing key/value chunks around a ring (ring attention). ``parallelism=ring``
    needs >= 2; both degrees > 1 is diffusers' unified (Ulysses x ring) attention."""
    data: Optional[int] = None
    """Context modes: data-parallel groups (each shards the dataset like ``parallelism=data``); ``data x
    ulysses_degree x ring_degree`` must equal torchrun's world size. null: world size / context degree."""
    assign: Assignment = Assignment.static
    """``parallelism=data`` with ``launcher=local``: ``static`` deals the batches over the torchrun ranks up front;
    ``claims``: every worker (a torchrun rank, or a ``python -m runner`` process started by hand, any number, on
    any host sharing the run dir) pulls the next batch by claiming it with a lease, so a slow worker takes fewer
    batches and a dead worker's batch is taken over once its lease expires (``runner.core.claims``).
    ``launcher=ray`` (Ray Data's actor pool) and ``launcher=slurm`` (array tasks claiming) always pull, whatever
    this says; the merged manifest's ``parallelism`` records how."""
    lease_s: float = 60.0
    """``assign=claims``, ``launcher=ray|slurm``: seconds a claim stays valid without its worker renewing it
    (renewed every ``lease_s / 4``); a batch whose claim was not renewed for this long (its worker died or hung) is
    claimed again by another worker. Longer than the worker's longest stall (a GC pause, a slow disk), shorter than a batch is
    worth waiting for."""


@dataclass
class LauncherConfig:
    """Who starts the workers of ``parallelism=data``."""

    name: LauncherName = LauncherName.local
    """``local``: this process, or the ranks torchrun started; ``ray``: a Ray Data actor pool pulling the batches
    (``runner.app.ray_launcher``); ``slurm``: a submitit job array whose tasks claim the batches
    (``runner.app.slurm_launcher``)."""
    num_workers: int = 2
    """Ray: actors in the pool (Ray Data's ``ActorPoolStrategy(size=...)``); SLURM: tasks of the job array."""
    num_gpus_per_worker: float = 0.0
    """GPUs per worker: Ray's ``num_gpus`` per actor; SLURM's ``--gpus-per-node`` per task (a whole number)."""
    num_cpus_per_worker: float = 1.0
    """CPUs per worker: Ray's ``num_cpus`` per actor; SLURM's ``--cpus-per-task`` (a whole number)."""
    address: Optional[str] = None
    """Ray: the cluster to join (``auto``: the one this machine belongs to); null starts a local Ray."""
    executor: SubmititExecutor = SubmititExecutor.slurm
    """SLURM: ``slurm`` submits with sbatch; ``local`` runs the array on this machine (submitit's LocalExecutor)."""
    folder: Optional[str] = None
    """SLURM: submitit's folder (job scripts, pickles, each task's stdout/stderr); null: ``<run dir>/slurm``."""
    partition: Optional[str] = None
    """SLURM: ``--partition`` (null: the cluster's default)."""
    timeout_min: int = 240
    """SLURM: each task's time limit in minutes (``--time``); a task that reaches it is requeued (submitit's
    checkpoint) and resumes from the journal."""
    mem_gb: Optional[float] = None
    """SLURM: memory per task in GB (``--mem``; null: the partition's default)."""
    max_num_timeout: int = 3
    """SLURM: how many times a task that timed out is requeued (preemptions are not counted)."""
    signal_delay_s: int = 120
    """SLURM: seconds before the time limit that SLURM sends USR2 (``--signal``): the task's current batch must
    be journaled within it."""


@dataclass
class DatasetConfig:
    """Where prompts come from."""

    format: DatasetFormat = MISSING
    """``builtin`` (the model's ``builtin_prompts``), ``jsonl``, ``csv``, ``txt``, ``parquet`` (a parquet file) or
    ``hf`` (a local Hugging Face dataset: a dir written by ``save_to_disk`` or a data file read by ``datasets``)."""
    path: Optional[str] = None
    """The rows file, or for ``hf`` the ``save_to_disk`` dir or data file (required except for ``builtin``)."""
    limit: Optional[int] = None
    """Use only the first N rows (null: every row)."""
    split: Optional[str] = None
    """``hf``: the split of a dataset dict to read (null: ``train``, or the only split)."""
    columns: Any = None
    """Row field -> the source column holding it (``dataset.columns={prompt: Prompt}`` reads a CSV's ``Prompt``
    column as the prompt); a column a mapping names must exist. A mapping of strings (checked at startup,
    ``runner.core.dataset.columns_option``); null: none."""
    extra_fields: ExtraFields = ExtraFields.error
    """A field that is no row field: ``error`` (refused, with the closest row field) or ``keep`` (recorded under the
    item's ``meta``, e.g. GenEval's ``tag`` and ``include``; one close to a row field is still refused as a typo)."""
    on_ignored: OnIgnored = OnIgnored.error
    """A row field or ``model.generation`` default that the model ignores: ``error`` (refused at startup) or
    ``record`` (run without it; the item records the value under ``ignored``)."""
    media_root: Optional[str] = None
    """The folder that relative input paths of the rows (``image``, ``mask_image``, ``last_image``) are resolved
    against; null: the dataset file's folder (``runner.core.media.resolve_path``)."""
    on_truncation: OnTruncation = OnTruncation.record
    """A prompt longer than a text encoder takes: ``record`` (run; the item records per encoder its token count and
    the tokens dropped) or ``error`` (refused at startup)."""


@dataclass
class OutputConfig:
    """Artifact settings."""

    dir: Optional[str] = None
    """Run directory (null: the Hydra run dir)."""
    write_workers: int = 2
    """Threads that encode and write artifacts while the next batch generates; 0: inline."""
    image_format: str = "png"
    """Image models: the file format of ``images/<id>.<suffix>`` (a key of ``runner.core.sinks.IMAGE_FORMATS``;
    ``png``: lossless, with the text fields as PNG text chunks). Checked at startup; a format other than ``png`` enters
    the run identity (through the sink's identity)."""
    video_codec: VideoCodec = VideoCodec.h264_lossless
    """Video models: the MP4 encoding (``h264_lossless``: decoded frames equal the generated ones; ``h264``:
    browser-playable, lossy). Records carry the sha256 of the decoded frames either way."""
    inpaint_overlay: bool = declared(True, enters=(RESUME, IDENTITY), when_set=True)
    """``model.task=inpaint``: composite the input image back outside the mask (diffusers' ``apply_overlay`` idea,
    with the pipeline's own mask binarisation: mask value >= 128 is inside), so every pixel outside the mask equals
    the input's exactly; recorded per item (``inputs.overlay``). ``false``: the outside is the VAE's reconstruction
    of the input (recorded as such). Enters the identity only for inpaint runs."""
    audio: bool = declared(True, enters=(RESUME, IDENTITY), when_set=True)
    """Video models that generate sound (LTX-2): write it as the MP4's audio stream (FLAC, lossless; each record
    carries the decoded samples' sha256, sample rate and length). ``false``: the audio is dropped, the MP4 has no
    audio stream and every record says ``params.audio: false``. Enters the resume comparison and the identity only
    while ``false``."""
    video_frames: bool = False
    """Video models: also write each video's generated ``uint8`` frames losslessly to ``videos/<id>.frames.npz``
    (``numpy.load(f)["frames"]``, layout (F, H, W, 3)) for parity checks."""


@dataclass
class OptimizeConfig:
    """Speed settings of diffusion stages that keep the math (each measured alone by
    ``benchmarks/flux_dev_1024.py``)."""

    fuse_qkv: bool = declared(False, enters=(RESUME, IDENTITY, COMPILE))
    """One GEMM for q, k, v (and the text stream's added q, k, v) per attention module, diffusers'
    ``fuse_projections``; the unfused projections are dropped (no duplicate weights in memory)."""
    vae_channels_last: bool = declared(False, enters=(RESUME, IDENTITY))
    """The VAE in channels-last (NHWC) memory format (slower on the H200 with torch 2.11: 127.9 vs 86.7 ms per
    1024x1024 decode; kept for other GPUs and builds)."""
    fast_vae_decode: bool = True
    """Wan video models (diffusers' ``AutoencoderKLWan``): decode with ``models.video_decode``'s forwards, which run
    the same operations on the same values in the same order without diffusers' extra copies, so the frames are
    bit-identical (checked against the plain decode's ``frames_sha256`` by ``tests/test_video_decode.py`` and, on
    the GPU, ``benchmarks/decode_wan_h200.py``); the manifest's ``vae_decode`` section records the calls that took
    it. Recorded as ignored for any other VAE. ``false``: diffusers' own decode."""
    warmup: bool = True
    """With ``compile`` on, one pipeline call of 2 steps at the first batch's shape runs before the timed loop, so
    compilation is not billed to the first batch (``timing.warmup_s``); its output is discarded."""
    deterministic_compile: bool = declared(True, enters=(RESUME, IDENTITY, COMPILE))
    """With ``compile`` on, Inductor's deterministic mode (``torch._inductor.config.deterministic``): no on-device
    benchmarking of kernel configurations that change numerics, so every process compiles the same kernels.
    Without it, reduction configs picked by timing differ between processes and so do the images (seen on the
    H200: two processes of the same run, PSNR ~49 dB apart)."""
    compile_mode: CompileMode = declared(CompileMode.default, enters=(RESUME, IDENTITY, COMPILE), when_set=True)
    """With ``compile`` on: ``torch.compile``'s mode (:class:`CompileMode`); the CUDA-graph modes
    (``max_autotune``, ``reduce_overhead``) are refused: regional compile replays one CUDA graph for every block of a
    class, which overwrites each block's output (seen on the H200, 2026-12-01)."""
    compile_cache: bool = True
    """With ``compile`` on: Inductor's FX-graph, AOTAutograd and Triton caches live under
    ``<cache_dir>/compile/<key>``, the key a hash of the torch/CUDA/Triton versions, the device (GPU name and
    capability, or CPU capability), the denoiser's class and config, the dtype, the backends and the compile
    settings, so a different torch, GPU or model never reuses them; a second process (or another data-parallel
    rank) loads the compiled blocks instead of compiling them. The manifest's ``compile.cache`` records the key,
    the directory and the hits and misses torch counted (``models.compile_cache``)."""


@dataclass
class CacheConfig:
    """Step caching of diffusion stages (``models.cache``): transformer computations of one denoising step reused at
    later steps, through diffusers' cache hooks. Lossy: a run with a cache is labelled ``lossy`` in its manifest and
    report, and ``python -m runner.gate`` compares it with the lossless run of the same rows. Each method reads only
    its own fields (a field it does not read, set, is refused at startup, as is a value out of range); null: the
    method's default."""

    method: str = "none"
    """``none``, ``first_block`` (diffusers' First Block Cache), ``magcache``, ``taylorseer``, ``pab`` (Pyramid
    Attention Broadcast), ``dbcache`` and ``dbcache_taylorseer`` (cache-dit's DBCache, without and with its TaylorSeer
    calibrator; ``pip install -e ".[cache-dit]"``), or a method added with
    ``models.cache.register_cache_method``."""
    schedule: Optional[CacheSchedule] = None
    """``fixed`` or ``adaptive``: refuses a method of the other kind; null: the method's own."""
    threshold: Optional[float] = None
    """Adaptive methods: first_block, the relative change of the first block's residual under which the other
    blocks are skipped (default 0.05); magcache, the accumulated magnitude-ratio error allowed (default 0.06);
    dbcache, the relative L1 change of the first blocks' residual under which the middle blocks are reused
    (cache-dit's ``residual_diff_threshold``, default 0.08)."""
    compute_every: Optional[int] = None
    """Fixed methods: after the warm-up, one step in this many is computed, the others reuse (>= 2; taylorseer
    default 5, pab 2)."""
    warmup_steps: Optional[int] = None
    """Fixed methods: the first steps, always computed (>= 1; taylorseer default 3, pab 1); dbcache: cache-dit's
    ``max_warmup_steps`` (default 8)."""
    max_skip_steps: Optional[int] = None
    """magcache: most consecutive steps skipped (default 3)."""
    retention_ratio: Optional[float] = None
    """magcache: share of the first steps never skipped, in [0, 1) (default 0.2)."""
    mag_ratios: Any = None
    """magcache (required): per-step magnitude ratios calibrated for the checkpoint, a list of floats (interpolated
    to the step count), or ``flux`` (diffusers' FLUX.1 ratios)."""
    order: Optional[int] = None
    """taylorseer, dbcache_taylorseer: order of the Taylor extrapolation of the cached outputs, 0..3 (default 1;
    0 reuses them)."""
    lite: Optional[bool] = None
    """taylorseer: diffusers' lite mode (blocks skipped, the output projection extrapolated; default false)."""
    calibrate: Optional[bool] = None
    """magcache: ``true`` uses the magnitude ratios calibrated for this model, steps and scheduler, stored under
    ``<cache_dir>/magcache`` (``models.cache_calibration``); when none are stored, diffusers' calibration pass
    (``MagCacheConfig(calibrate=True)``, every step computed) runs before the first batch and stores them. Excludes
    ``mag_ratios`` (default false)."""
    fn_compute_blocks: Optional[int] = None
    """dbcache (cache-dit's DBCache ``Fn_compute_blocks``): the first blocks, always computed; their residual's
    change decides whether the middle blocks are reused (>= 1, default 8)."""
    bn_compute_blocks: Optional[int] = None
    """dbcache (cache-dit's ``Bn_compute_blocks``): the last blocks, always computed (>= 0, default 0)."""


@dataclass
class MemoryConfig:
    """Fitting the model to the device (``runner.core.memory`` plans, ``models.memory`` applies): offload, VAE
    tiling/slicing and a memory budget checked at startup and enforced on the device."""

    offload: OffloadMode = OffloadMode.none
    """:class:`OffloadMode`. Offload keeps the math (the same weights, moved); ``auto`` chooses the fastest plan
    whose planned peak fits ``max_gpu_gb`` and records why."""
    use_stream: bool = True
    """Group offload: copy the next group on a side CUDA stream while the current one computes (diffusers
    ``use_stream``; forces one block per group)."""
    record_stream: bool = False
    """Group offload with ``use_stream``: mark each onloaded tensor as used by the compute stream (diffusers
    ``record_stream``) instead of synchronising that stream before each group is offloaded: more overlap of copies
    and compute, and up to one more group resident (the planner counts three). Off by default until measured
    against ``false`` side by side (``benchmarks/memory_lanes.py`` lane ``budget24_rs``)."""
    blocks_per_group: int = 1
    """``group_block`` without a stream: blocks onloaded together (>= 1)."""
    vae_tiling: bool = declared(False, enters=(RESUME, IDENTITY), when_set=True)
    """Decode in overlapping tiles (``vae.enable_tiling()``): less decoder memory; the tiles are blended, so the
    pixels change (enters the identity while true)."""
    vae_slicing: bool = False
    """Decode the batch one image at a time (``vae.enable_slicing()``): the decoder's activations of one image."""
    max_gpu_gb: Optional[float] = None
    """Budget in GiB: a plan whose planned peak exceeds it is refused at startup (exit 2, naming the estimate, the
    budget and the cheapest plan that fits), and the process's CUDA allocator is capped at it
    (``torch.cuda.set_per_process_memory_fraction``), so an overrun fails loudly instead of spilling. null: no
    budget (``auto`` plans against the device's total memory)."""


@dataclass
class EvidenceConfig:
    """Evidence collection (see ``models.denoiser_evidence``)."""

    enabled: bool = True
    """Install probes that record which implementations ran."""
    profile: bool = True
    """Also profile with ``torch.profiler`` (diffusion: the first denoising step) and match the kernels that ran
    against the resolved backends' signatures."""
    strict: bool = True
    """Evidence that contradicts the resolved backends ends the run with exit 3 (false: recorded, ``limited``)."""


@dataclass
class ReportConfig:
    """Sweep report settings (read by ``runner.tools.sweep.SweepCallback`` through ``hydra.callbacks``)."""

    reference: Optional[str] = None
    """The job (number or dir name) the others are compared with (null: the first job)."""
    min_metric_ratio: Dict[str, Optional[float]] = field(default_factory=dict)
    """The sweep's quality gate on per-item metrics (``runner.tools.gate``): metric name -> floor of the lossy job's
    mean score over its lossless twin's (``report.min_metric_ratio.clip_score=0.99``); null: not gated."""


@dataclass
class TrackerConfig:
    """An experiment tracker the finished run is logged to (group ``tracker``, ``runner.app.tracking``)."""

    name: TrackerName = TrackerName.none
    """``none`` or ``mlflow`` (params, metrics, tags and the manifest/items/metadata files as artifacts)."""
    uri: Optional[str] = None
    """The tracking URI (``file:///...``, ``http://host:5000``, ``sqlite:///mlflow.db``); null: the file store
    ``mlruns/`` in the directory the run was started from."""
    experiment: str = "runner"
    """The MLflow experiment (created when missing)."""
    run_name: Optional[str] = None
    """The tracker run's name; null: the run dir's name."""


@dataclass
class MetricsConfig:
    """Per-item quality metrics of the written artifacts (``runner.core.metrics``), scored after generation on the
    run's device and written into ``items.jsonl``, ``metadata.jsonl`` and the manifest's ``metrics`` summary. Not
    part of the run identity: scores never change an artifact (a resume rescores only what lacks a score of the
    same metric model)."""

    names: List[str] = field(default_factory=list)
    """Metrics to score: ``clip_score`` (images, videos), ``pick_score``, ``aesthetic`` (images),
    ``temporal_consistency`` (videos), ``image_reward``, ``hpsv2`` (images, with their packages); empty: none."""
    models: Dict[str, Optional[str]] = field(default_factory=dict)
    """Metric name -> its model: a local dir (a transformers CLIPModel saved with its CLIPProcessor) or a Hub id in
    the local cache; ``image_reward``/``hpsv2``: a checkpoint file."""
    batch_size: int = 32
    """Artifacts scored per metric-model call."""


@dataclass
class RunControl:
    """Resume control."""

    resume: Optional[str] = None
    """An earlier run dir to finish (finished, intact items are kept)."""
    force: bool = False
    """Resume even when the semantic config differs."""


@dataclass
class RunConfig:
    """The composed run config (``conf/config.yaml``)."""

    model: ModelConfig = MISSING
    """The model (group ``model``; one of the family schemas)."""
    platform: PlatformConfig = MISSING
    """The device platform (group ``platform``)."""
    backend: BackendConfig = declared(default_factory=BackendConfig, enters=(RESUME,))
    """Run-level backend choices (group ``backend``; layer ``cli_global``/``yaml_global``)."""
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    """How work is spread over devices (group ``parallelism``)."""
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """Who starts the workers (group ``launcher``)."""
    dataset: DatasetConfig = MISSING
    """Where prompts come from (group ``dataset``)."""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Artifact settings."""
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)
    """Speed settings of diffusion stages that keep the math."""
    cache: CacheConfig = declared(default_factory=CacheConfig, enters=(RESUME, IDENTITY), when_set=True)
    """Step caching of diffusion stages (lossy, off by default)."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """Offload, VAE tiling/slicing and the memory budget of diffusion stages."""
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    """Evidence collection."""
    run: RunControl = field(default_factory=RunControl)
    """Resume control."""
    report: ReportConfig = field(default_factory=ReportConfig)
    """Sweep report settings."""
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    """Where the finished run is logged besides its run dir (group ``tracker``: ``none``, ``mlflow``)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Per-item quality metrics scored after generation (``metrics.names``, ``metrics.models.<name>``)."""
    seed: int = declared(0, enters=(RESUME,))
    """Base seed; each item's seed derives from it and the item key."""
    dtype: DType = declared(DType.auto, enters=(RESUME, IDENTITY))
    """Compute dtype (``auto``: bfloat16 on GPUs, float32 on CPU)."""
    compile: Compile = declared(Compile.none, enters=(RESUME, IDENTITY, COMPILE))
    """``regional``: ``torch.compile`` of the repeated transformer blocks of diffusion stages."""
    cpu_threads: Optional[int] = declared(1, enters=(IDENTITY,))
    """Torch threads on CPU (fixed so CPU outputs are bitwise identical across launchers); null: torch's default."""
    batch_size: int = 1
    """Rows of the same shape and steps generated together."""
    num_images_per_prompt: int = declared(1, enters=(RESUME,))
    """Images per dataset row (each its own item and seed)."""
    max_pixels: int = 4096 * 4096
    """Width x height limit per image."""
    cache_dir: Optional[str] = None
    """Where embedded models are built on first use (null: ``$RUNNER_CACHE`` or ``~/.cache/runner``)."""


def _repo_root() -> str:
    from runner.core.paths import PROJECT_ROOT

    return str(PROJECT_ROOT)


def typed_skeleton(cfg: Mapping[str, Any]) -> Any:
    """A structured ``RunConfig`` whose model nodes have the family schemas of ``cfg``'s models (the top-level
    model and each pipeline stage's model), to merge ``cfg`` into for validation."""
    from omegaconf import OmegaConf

    base = OmegaConf.structured(RunConfig)
    model = cfg.get("model")
    if not isinstance(model, Mapping):
        return base
    typed: Dict[str, Any] = {"model": OmegaConf.structured(model_schema(model))}
    stages = model.get("stages") if "pipeline" in model else None
    for sname, stage in (stages or {}).items():
        if isinstance(stage, Mapping) and isinstance(stage.get("model"), Mapping):
            typed.setdefault("stages", {})[sname] = {"model": OmegaConf.structured(model_schema(stage["model"]))}
    if "stages" in typed:
        typed["model"] = OmegaConf.merge(typed["model"], {"stages": typed.pop("stages")})
    return OmegaConf.merge(base, typed)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent).

    ``runner_schema`` validates the whole run config; ``model/base_diffusion``, ``model/base_ar`` and
    ``model/base_pipeline`` are the family schemas model YAMLs list in their defaults, ``model/base_pipeline_stage``
    the schema of a stage a pipeline adds.
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", _repo_root)  # ${repo_root:}: the checkout's root, or
        # the site-packages folder of an installed runner (both hold models/toy_shapes/weights)
    if not OmegaConf.has_resolver("runner_help_groups"):
        from runner.core.paths import help_groups

        OmegaConf.register_new_resolver("runner_help_groups", help_groups)  # --help: groups without schema bases
    if not OmegaConf.has_resolver("runner_help_choices"):
        from runner.core.paths import help_choices

        OmegaConf.register_new_resolver("runner_help_choices", help_choices)  # --help: a setting's registry values
    if not OmegaConf.has_resolver("runner_pid"):
        from runner.core.rundir import pid_resolver

        OmegaConf.register_new_resolver("runner_pid", pid_resolver)  # ${runner_pid:}: default dir names
    cs = ConfigStore.instance()
    cs.store(name="runner_schema", node=RunConfig)
    cs.store(group="model", name="base_diffusion", node=DiffusionModelConfig)
    cs.store(group="model", name="base_ar", node=ARModelConfig)
    cs.store(group="model", name="base_pipeline", node=_extension(PipelineModelConfig, DiffusionModelConfig))
    cs.store(group="model", name="base_pipeline_stage", node=PipelineStageConfig)


def _extension(cls: type, base: type) -> Any:
    """``cls``'s schema with the fields it inherits from ``base`` left missing: merged after a config of class
    ``base`` it adds ``cls``'s own fields and type, but does not reset the values that config set (a structured
    node's defaults would). The stages it names keep their own new fields, and their ``StageConfig`` fields are left
    missing the same way."""
    import dataclasses

    from omegaconf import OmegaConf

    node = OmegaConf.structured(cls)
    own = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(base)}
    for f in dataclasses.fields(base):
        if f.name == "stages":
            for sname in list(node.stages):  # a stage keeps its own new fields, as the model does
                for sf in dataclasses.fields(StageConfig):
                    node.stages[sname][sf.name] = MISSING
        elif f.name not in own:
            node[f.name] = MISSING
    return node


# ------------------------------------------------------------------------------------------------ typed config


def to_typed(cfg: Any) -> RunConfig:
    """The composed run config as the schema's dataclasses: a :class:`RunConfig` whose ``model`` (and each pipeline
    stage's ``model``) is an instance of its family's class (:func:`model_schema`), closed choices :class:`Choice`
    members, built once with ``OmegaConf.to_object`` after ``runner.app.execute.check_schema`` accepted ``cfg``.

    Args:
        cfg: a ``DictConfig`` composed by Hydra (interpolations are resolved here) or the same as a plain dict.

    Raises:
        omegaconf.errors.OmegaConfBaseException: ``cfg`` does not match the schema (``check_schema`` refuses such a
            config first, with a message naming the key and the fix).
    """
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    return OmegaConf.to_object(OmegaConf.merge(typed_skeleton(plain), plain))


def yaml_section(path: Any, key: str) -> Any:
    """Section ``key`` of the YAML file ``path`` as plain dicts and lists (OmegaConf's YAML loader, as Hydra
    reads config files; interpolations resolved): e.g. a model file's ``architecture`` for a training script."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path)[key], resolve=True)


# ------------------------------------------------------------------------------------------------ derived factors


def _field_class(cls: type, name: str) -> Optional[type]:
    """The dataclass a field of ``cls`` holds: its type (``Optional`` unwrapped), or the value type of a
    ``Dict[str, X]``; None when it holds no dataclass."""
    import typing

    t = typing.get_type_hints(cls)[name]
    if typing.get_origin(t) is typing.Union:
        t = next((a for a in typing.get_args(t) if a is not type(None)), t)
    if typing.get_origin(t) is dict:
        t = typing.get_args(t)[1]
    return t if dataclasses.is_dataclass(t) else None


def _classes_of(cls: Optional[type]) -> List[type]:
    """The schemas a field typed ``cls`` may hold: every model family for :class:`ModelConfig`, else ``cls``."""
    if cls is ModelConfig:
        return list(MODEL_FAMILIES.values())
    return [cls] if cls is not None else []


def _declared_fields(cls: type = RunConfig, prefix: str = "") -> List[tuple]:
    """``(dotted key, field, owner class)`` of every field declaring :class:`Factors` ``enters``, in declaration order
    (the model's fields once, over every family), descending into dataclass fields that declare nothing."""
    out: List[tuple] = []
    seen = set()
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if factors_of(f).enters:
            out.append((key, f, cls))
            continue
        sub = None if str(f.type).startswith("Dict") else _field_class(cls, f.name)  # mappings: not descended
        for c in _classes_of(sub):
            for entry in _declared_fields(c, key + "."):
                if entry[0] not in seen:
                    seen.add(entry[0])
                    out.append(entry)
    return out


def factor_keys(kind: str, *, when_set: Optional[bool] = False) -> tuple:
    """Dotted keys of the fields whose value enters ``kind`` (:data:`FACTOR_KINDS`), in declaration order.

    Args:
        when_set: False: the keys that always enter; True: those that enter only while set
            (:attr:`Factors.when_set`); None: both.
    """
    return tuple(key for key, f, _ in _declared_fields() if kind in factors_of(f).enters
                 and (when_set is None or factors_of(f).when_set == when_set))


def omitted_fields(key: str, kind: str) -> tuple:
    """Names of the fields inside ``key``'s value (inside each entry of a mapping of dataclasses, such as
    ``model.stages``, or of a list of them, such as ``model.lora``) that declare they are left out of ``kind``
    (:attr:`Factors.omitted_from`)."""
    import typing

    for k, f, owner in _declared_fields():
        if k == key:
            sub = _field_class(owner, f.name)
            held = typing.get_type_hints(owner)[f.name]
            if sub is None and typing.get_origin(held) is list:
                sub = typing.get_args(held)[0] if dataclasses.is_dataclass(typing.get_args(held)[0]) else None
            return tuple(g.name for g in dataclasses.fields(sub) if kind in factors_of(g).omitted_from) if sub else ()
    raise KeyError(f"{key} declares no factors")


def null_when_unset(key: str) -> tuple:
    """Names of the fields inside ``key``'s value declared :attr:`Factors.when_set` (``model.generation.shift``): left
    out of the resume comparison and the identity while null, so runs that never set one keep what they had before
    the field existed."""
    for k, f, owner in _declared_fields():
        if k == key:
            sub = _field_class(owner, f.name)
            return tuple(g.name for g in dataclasses.fields(sub) if factors_of(g).when_set) if sub else ()
    raise KeyError(f"{key} declares no factors")


def holds_entries(key: str) -> bool:
    """Whether ``key``'s value is a mapping of dataclasses (``model.stages``), so :func:`omitted_fields` apply to
    each entry rather than to the value itself."""
    import typing

    for k, f, owner in _declared_fields():
        if k == key:
            held = typing.get_type_hints(owner)[f.name]
            return typing.get_origin(held) is dict and _field_class(owner, f.name) is not None
    raise KeyError(f"{key} declares no factors")


def select(cfg: Any, dotted: str) -> Any:
    """The value at ``dotted`` of a config (dataclasses, ``DictConfig`` or plain dicts); None when absent."""
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, Mapping) or hasattr(node, "keys"):
            node = node.get(part) if part in node else None
        else:
            node = getattr(node, part, None)
        if node is None:
            return None
    return node


def compile_factors(cfg: Any) -> Dict[str, Any]:
    """The compile settings of a run config that enter the compile-cache key, by field name (``{compile,
    compile_mode, fuse_qkv, deterministic_compile}``): booleans as ``bool``, choices as their plain string."""
    import typing

    out: Dict[str, Any] = {}
    for key, f, owner in _declared_fields():
        if COMPILE in factors_of(f).enters:
            v = select(cfg, key)
            out[f.name] = bool(v) if typing.get_type_hints(owner)[f.name] is bool else str(v)
    return out
