"""Structured config schema for every Hydra group, registered in Hydra's ConfigStore.

The schema is the contract between the YAML in ``conf/`` and the code: Hydra merges each group's YAML into
these dataclasses, so an unknown key (a typo) or a value of the wrong type fails at compose time with Hydra's
own message, before anything is imported or loaded.

Unset backend choices are ``None`` (``null`` in YAML), which is distinct from an explicit ``"auto"``; the
resolver (``runner.resolve``) keeps the two apart.

Compatible with Hydra 1.3 and 1.4: mutable defaults use ``default_factory``; nothing is built with an
unrestricted ``hydra.utils.instantiate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class BackendConfig:
    """Backend choices of one scope (run level, a model's defaults, or one stage).

    ``attention`` is a backend name (``TORCH_SDPA``, alias ``sdpa``, ... or ``auto``) or a spec
    ``{default: <spec>, per_role: {<role>: <spec>}}`` where a spec is ``{backend, quant, skip_softmax}``.
    ``linear`` and ``moe`` are names. ``None`` means "not set at this layer".
    """

    attention: Any = None
    linear: Optional[str] = None
    moe: Optional[str] = None


@dataclass
class StageConfig:
    """One stage of a model's pipeline (FLUX has one: ``denoise``; ``tiny_qwen3_moe`` has ``generate``).

    ``engine_extras``: further engine arguments (vLLM stages: ``vllm.EngineArgs`` fields such as ``max_model_len``,
    ``max_num_seqs``; diffusers stages take none). In a multi-stage model (``model.pipeline``):
    ``adapter`` runs the stage when it is not the model's own (``vllm``), ``model`` is that stage's model config
    (same fields as ``model``, e.g. composed from ``conf/model/tiny_qwen3_moe.yaml``), ``input`` says what feeds
    it (``prompt``: the dataset row's prompt; ``<stage>``: that stage's output text) and ``template`` how the
    input becomes this stage's prompt (``{prompt}``: the row's prompt, ``{text}``: the upstream output text).
    """

    backend: BackendConfig = field(default_factory=BackendConfig)
    engine_extras: Dict[str, Any] = field(default_factory=dict)
    adapter: Optional[str] = None
    model: Dict[str, Any] = field(default_factory=dict)
    input: Optional[str] = None
    template: Optional[str] = None
    # Misplaced-key guards: must stay null. A backend name here is rejected at startup with the place it belongs
    # (stages.<name>.backend.<field>) instead of Hydra's bare "key not in struct".
    attention: Any = None
    linear: Any = None
    moe: Any = None


@dataclass
class GenerationDefaults:
    """Per-model generation defaults, used for every dataset row that does not set the field."""

    width: int = 1024
    height: int = 1024
    num_inference_steps: int = 28
    guidance_scale: float = 3.5
    max_sequence_length: int = 512
    true_cfg_scale: float = 1.0


@dataclass
class ModelConfig:
    """A model: which adapter builds it, from where, and its defaults.

    ``load_format``: ``auto`` (load ``path``, or for an embedded model create it on first use into the cache),
    ``dummy`` (the architecture in ``architecture`` with random weights built directly on the device, no
    checkpoint; for benchmarks).
    """

    name: str = MISSING
    adapter: str = "flux"
    path: Optional[str] = None
    revision: Optional[str] = None
    load_format: str = "auto"
    embedded: bool = False
    architecture: Dict[str, Any] = field(default_factory=dict)
    roles: List[str] = field(default_factory=lambda: ["joint"])
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    backend: BackendConfig = field(default_factory=BackendConfig)
    stages: Dict[str, StageConfig] = field(default_factory=lambda: {"denoise": StageConfig()})
    size_multiple: int = 16
    builtin_prompts: str = "prompts.jsonl"  # dataset=builtin reads runner/data/<this>
    # Autoregressive models (adapter vllm): default ``vllm.SamplingParams`` fields (max_tokens, temperature,
    # top_p, top_k, seed, ...); dataset rows override them per row.
    sampling: Dict[str, Any] = field(default_factory=dict)
    # Multi-stage models: stage names in execution order (empty: the single stage of ``adapter``).
    pipeline: List[str] = field(default_factory=list)
    oracle: Optional[str] = None  # reads generated images back (models.toy_shapes.oracle) for `accuracy`
    # Misplaced-key guards (see StageConfig): backend choices belong under model.backend / model.stages.
    attention: Any = None
    linear: Any = None
    moe: Any = None


@dataclass
class PlatformConfig:
    """A device platform: its torch device type and the capability probes to record.

    ``overlays`` maps a model name to backend values that replace that model's defaults on this platform
    (layer 5 of the precedence contract).
    """

    name: str = MISSING
    device: str = "auto"
    probes: List[str] = field(default_factory=list)
    overlays: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelismConfig:
    """How work is spread over devices.

    ``mode``: ``single`` | ``data`` (dataset sharded over torchrun ranks or Ray workers) | ``cfg`` (CFG-parallel) |
    ``ulysses`` (Ulysses sequence parallel). ``cfg`` and ``ulysses`` are refused at startup (not implemented).
    ``degree``: devices per replica for the model-parallel modes.
    """

    mode: str = "single"
    world_size: int = 1
    degree: int = 1


@dataclass
class LauncherConfig:
    """Who starts the workers of ``parallelism=data``. ``local``: this process, or torchrun; ``ray``: Ray actors
    (``num_workers`` of them, ``num_gpus_per_worker`` each, on the cluster at ``address``, or a local one)."""

    name: str = "local"
    num_workers: int = 2
    num_gpus_per_worker: float = 0.0
    num_cpus_per_worker: float = 1.0
    address: Optional[str] = None


@dataclass
class DatasetConfig:
    """Where prompts come from. ``format``: ``builtin`` | ``jsonl`` | ``csv`` | ``txt``."""

    format: str = MISSING
    path: Optional[str] = None
    limit: Optional[int] = None


@dataclass
class OutputConfig:
    """Artifact settings. ``dir`` defaults to the Hydra run dir."""

    dir: Optional[str] = None
    image_format: str = "png"
    write_workers: int = 2  # threads that encode and write artifacts while the next batch generates; 0: inline


@dataclass
class OptimizeConfig:
    """Speed settings of diffusion stages that keep the math (each measured alone by
    ``benchmarks/flux_dev_1024.py``).

    Attributes:
        fuse_qkv: one GEMM for q, k, v (and the text stream's added q, k, v) per attention module, diffusers'
            ``fuse_projections``; the unfused projections are dropped (no duplicate weights in memory).
        vae_channels_last: the VAE in channels-last (NHWC) memory format (slower on the H200 with torch 2.11:
            127.9 vs 86.7 ms per 1024x1024 decode; kept for other GPUs and builds).
        warmup: with ``compile`` on, one pipeline call of 2 steps at the first batch's shape runs before the timed
            loop, so compilation is not billed to the first batch (``timing.warmup_s``); its output is discarded.
        deterministic_compile: with ``compile`` on, Inductor's deterministic mode
            (``torch._inductor.config.deterministic``): no on-device benchmarking of kernel configurations that
            change numerics, so every process compiles the same kernels. Without it, reduction configs picked by
            timing differ between processes and so do the images (seen on the H200: two processes of the same
            run, PSNR ~49 dB apart).
    """

    fuse_qkv: bool = False
    vae_channels_last: bool = False
    warmup: bool = True
    deterministic_compile: bool = True


@dataclass
class EvidenceConfig:
    """Evidence collection (see ``runner.evidence``)."""

    enabled: bool = True
    profile: bool = True
    strict: bool = True


@dataclass
class ReportConfig:
    """Sweep report settings. ``reference``: the job (number or dir name) the others are compared with."""

    reference: Optional[str] = None


@dataclass
class RunControl:
    """Resume control. ``resume``: an earlier run dir to finish (finished, intact items are kept); ``force``:
    resume even when the semantic config differs."""

    resume: Optional[str] = None
    force: bool = False


@dataclass
class RunConfig:
    """The composed run config (``conf/config.yaml``)."""

    model: ModelConfig = MISSING
    platform: PlatformConfig = MISSING
    backend: BackendConfig = field(default_factory=BackendConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    dataset: DatasetConfig = MISSING
    output: OutputConfig = field(default_factory=OutputConfig)
    optimize: OptimizeConfig = field(default_factory=OptimizeConfig)
    evidence: EvidenceConfig = field(default_factory=EvidenceConfig)
    run: RunControl = field(default_factory=RunControl)
    report: ReportConfig = field(default_factory=ReportConfig)
    seed: int = 0
    dtype: str = "auto"
    compile: str = "none"
    cpu_threads: Optional[int] = 1
    batch_size: int = 1
    num_images_per_prompt: int = 1
    max_pixels: int = 4096 * 4096
    cache_dir: Optional[str] = None


def _repo_root() -> str:
    from runner.paths import PROJECT_ROOT

    return str(PROJECT_ROOT)


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent).

    ``runner_schema`` validates the whole run config; ``schema/<group>`` nodes are available to group YAML
    files that want to name their schema explicitly.
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", _repo_root)  # ${repo_root:}: the checkout's root, or
        # the site-packages folder of an installed runner (both hold models/toy_shapes/weights)
    cs = ConfigStore.instance()
    cs.store(name="runner_schema", node=RunConfig)
    cs.store(group="schema/model", name="base", node=ModelConfig)
    cs.store(group="schema/platform", name="base", node=PlatformConfig)
    cs.store(group="schema/dataset", name="base", node=DatasetConfig)
    cs.store(group="schema/backend", name="base", node=BackendConfig)
    cs.store(group="schema/parallelism", name="base", node=ParallelismConfig)
