"""Fitting a diffusers pipeline to the device: weight quantization configs, the memory plan's inputs (component
sizes on the meta device, activations of the largest batch), the offload plan applied through diffusers, the
budget enforced on the device, and what evidence observes of them.

* **Quantization** (``model.quantization``): ``quant_mapping`` builds diffusers' ``PipelineQuantizationConfig``
  from the ``runner.kernels.quantization`` records (a diffusers config for diffusers components, a transformers config for
  the text encoders); :class:`QuantProbe` counts, per quantized component, the Linear calls whose weight was of the
  method's tensor class when it executed.
* **Offload** (``memory.offload``): :func:`apply_offload` calls diffusers' ``enable_model_cpu_offload`` or
  ``enable_group_offload``; :class:`OffloadProbe` wraps every group-offload ``ModuleGroup.onload_`` (and, under
  model offload, a pre-hook per component that sees its weights off the device) and counts the bytes onloaded.
* **Budget** (``memory.max_gpu_gb``): :func:`set_budget` caps the process's CUDA caching allocator with
  ``torch.cuda.set_per_process_memory_fraction``; :class:`PhasePeaks` records the allocator's peak per stage.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from runner.kernels import quantization as quant
from runner.core import memory as planner
from runner.core.errors import ConfigValueError

#: Platform kinds whose device memory the planner fits (``runner.core.platform.PlatformInfo.kind``).
GPU_KINDS = ("cuda", "rocm")
#: ``model.quantization`` fields that name a component (``gguf_file`` is the GGUF method's file).
QUANT_COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass(frozen=True)
class MemorySettings:
    """``memory.*`` as validated (:func:`settings`)."""

    offload: str
    use_stream: bool
    blocks_per_group: int
    record_stream: bool
    vae_tiling: bool
    vae_slicing: bool
    max_gpu_gb: Optional[float]

    @property
    def active(self) -> bool:
        """Anything beyond the default (all weights on the device, no budget, no VAE change) is asked for."""
        return (self.offload != "none" or self.max_gpu_gb is not None or self.vae_tiling or self.vae_slicing)


#: The largest budget taken (GiB): far above any GPU, and small enough that its bytes stay an exact integer.
MAX_GPU_GB = 1 << 20


def settings(mem: Any, platform_kind: str, parallel: Any) -> MemorySettings:
    """Validate ``memory.*`` for a stage on ``platform_kind``; every bad field at once.

    ``memory.offload=auto`` is taken anywhere: off a GPU it means no offload (:meth:`Fitting.choose` records why).

    Raises:
        ConfigValueError: an offload plan (``model``, ``group_*``) or a budget off a CUDA device, offload under
            context parallelism, ``blocks_per_group`` < 1, a budget <= 0.
    """
    s = MemorySettings(str(mem.offload), bool(mem.use_stream), int(mem.blocks_per_group),
                       bool(getattr(mem, "record_stream", False)), bool(mem.vae_tiling), bool(mem.vae_slicing),
                       None if mem.max_gpu_gb is None else float(mem.max_gpu_gb))
    bad: List[str] = []
    if s.offload not in ("none", "auto") and platform_kind not in GPU_KINDS:
        bad.append(f"memory.offload={s.offload} moves weights between the host and a GPU, and this platform is "
                   f"{platform_kind}; fix: memory.offload=none or auto (or platform=cuda); to see the plan a GPU "
                   "would get: python -m runner <the same overrides, platform=cuda> --plan")
    if s.max_gpu_gb is not None and platform_kind not in GPU_KINDS:
        bad.append(f"memory.max_gpu_gb={s.max_gpu_gb} budgets GPU memory, and this platform is {platform_kind}; "
                   "fix: memory.max_gpu_gb=null; to see the plan a GPU would get under it: python -m runner "
                   "<the same overrides, platform=cuda> --plan")
    if s.max_gpu_gb is not None and not (math.isfinite(s.max_gpu_gb) and 0 < s.max_gpu_gb <= MAX_GPU_GB):
        bad.append(f"memory.max_gpu_gb={s.max_gpu_gb} must be a finite number of GiB in (0, {MAX_GPU_GB}], or null "
                   "(no budget); fix: e.g. memory.max_gpu_gb=24")
    if s.blocks_per_group < 1:
        bad.append(f"memory.blocks_per_group={s.blocks_per_group} must be >= 1")
    offloads = s.offload not in ("none", "auto") or (s.offload == "auto" and platform_kind in GPU_KINDS)
    if offloads and parallel is not None:
        bad.append(f"memory.offload={s.offload} under context parallelism ({parallel.mode}) is not supported; fix: "
                   "memory.offload=none, or parallelism=data")
    if bad:
        raise ConfigValueError("; ".join(bad))
    return s


def quant_choices(qcfg: Any) -> Dict[str, str]:
    """``model.quantization``'s component -> canonical method (``none`` left out).

    Raises:
        runner.kernels.quantization.QuantizationError: an unknown method name.
    """
    out: Dict[str, str] = {}
    for comp in QUANT_COMPONENTS:
        m = quant.normalize(getattr(qcfg, comp), f"model.quantization.{comp}")
        if m != quant.NONE:
            out[comp] = m
    return out


def quant_mapping(choices: Mapping[str, str], libraries: Mapping[str, str], dtype: torch.dtype,
                  modules: Optional[Mapping[str, torch.nn.Module]] = None) -> Dict[str, Any]:
    """``{component: library quantization config}`` for diffusers' ``PipelineQuantizationConfig(quant_mapping=)``
    (GGUF components are loaded apart, :func:`load_gguf`; a pre-quantized checkpoint's config is its own); each
    leaving out the Linears its method keeps dense (:func:`runner.kernels.quantization.kept_dense`), named from
    ``modules`` (the components built on the meta device)."""
    return {c: quant.get(m).config(libraries[c], dtype, keep_dense(m, (modules or {}).get(c)))
            for c, m in choices.items() if m != "gguf" and quant.get(m).checkpoint is None}


def keep_dense(method: str, module: Any) -> List[str]:
    """:func:`runner.kernels.quantization.kept_dense` of ``method`` on ``module`` (none: not a module)."""
    return quant.kept_dense(quant.get(method), module) if isinstance(module, torch.nn.Module) else []


def needs_names(choices: Mapping[str, str]) -> bool:
    """Whether a chosen method leaves some Linears dense, which are named from the components' modules."""
    return any(quant.get(m).min_rows for m in choices.values())


def on_device_components(choices: Mapping[str, str]) -> List[str]:
    """The components whose method quantizes on the GPU only (``WeightQuant.quantize_on_device``: int4wo), which
    :func:`load_on_device` loads apart from the pipeline."""
    return [c for c, m in choices.items() if quant.get(m).quantize_on_device]


def load_on_device(model_cls: type, path: str, comp: str, config: Any, dtype: torch.dtype, device: str) -> Any:
    """Component ``comp`` of snapshot ``path`` loaded and quantized on ``device``: diffusers'/transformers'
    ``from_pretrained(subfolder=comp, quantization_config=config, device_map={"": device})`` (the quantizer
    creates each quantized parameter on the device map's device; without a map, on the CPU, where torchao's int4
    packing has no kernel: ``NotImplementedError ... _convert_weight_to_int4pack ... 'CPU' backend``, H100
    2026-12-06)."""
    return model_cls.from_pretrained(path, subfolder=comp, quantization_config=config, dtype=dtype,
                                     device_map={"": torch.device(device)}, local_files_only=True,
                                     use_safetensors=True)


def before_loading(choices: Mapping[str, str]) -> List[str]:
    """Call each chosen method's :attr:`runner.kernels.quantization.WeightQuant.before_load` once (ModelOpt's
    ``enable_huggingface_checkpointing``, which restores its quantized modules in ``from_pretrained``); returns
    what was called."""
    from runner.kernels.registry import load_object

    done = []
    for m in dict.fromkeys(choices.values()):
        ref = quant.get(m).before_load
        if ref:
            load_object(ref)()
            done.append(ref)
    return done


def checkpoint_configs(source: Mapping[str, Any], components: Sequence[str]) -> Dict[str, Optional[Dict[str, Any]]]:
    """``<component>/config.json`` of a ``model.path`` snapshot for each of ``components`` (None: no readable file);
    empty for any other weight source."""
    import json
    from pathlib import Path

    if source.get("kind") != "path":
        return {}
    out: Dict[str, Optional[Dict[str, Any]]] = {}
    for comp in components:
        try:
            out[comp] = json.loads((Path(source["path"]) / comp / "config.json").read_text())
        except (OSError, ValueError):
            out[comp] = None
    return out


def check_checkpoints(choices: Mapping[str, str], source: Mapping[str, Any], components: Sequence[str], ctx: Any,
                      model: str) -> None:
    """Pre-quantized checkpoints before anything loads: a checkpoint method without a checkpoint of its kind
    (:func:`runner.kernels.quantization.checkpoint_problems`), a checkpoint the config does not name
    (:func:`runner.kernels.quantization.undeclared_checkpoints`).

    Raises:
        runner.kernels.quantization.QuantizationError: every problem, each with its fix.
    """
    configs = checkpoint_configs(source, components)
    bad = quant.undeclared_checkpoints(configs, dict(choices))
    for comp, m in choices.items():
        q = quant.get(m)
        if q.checkpoint is not None:
            bad += quant.checkpoint_problems(comp, q, str(source.get("kind")), configs.get(comp), ctx, model)
    if bad:
        raise quant.QuantizationError("; ".join(bad))


def checkpoint_bytes(source: Mapping[str, Any], choices: Mapping[str, str]) -> Dict[str, int]:
    """The bytes of each pre-quantized checkpoint component's weight files (``*.safetensors`` in its folder of a
    ``model.path`` snapshot): the planner sizes it from them (absent: at the method's bits)."""
    from pathlib import Path

    out: Dict[str, int] = {}
    if source.get("kind") != "path":
        return out
    for comp, m in choices.items():
        files = sorted((Path(source["path"]) / comp).glob("*.safetensors")) if quant.get(m).checkpoint else []
        if files:
            out[comp] = sum(f.stat().st_size for f in files)
    return out


def pipeline_quantization(choices: Mapping[str, str], libraries: Mapping[str, str], dtype: torch.dtype,
                          modules: Optional[Mapping[str, torch.nn.Module]] = None) -> Any:
    """diffusers' ``PipelineQuantizationConfig`` for ``from_pretrained`` (None: nothing to quantize there);
    ``modules``: as :func:`quant_mapping`'s."""
    mapping = quant_mapping(choices, libraries, dtype, modules)
    if not mapping:
        return None
    from diffusers.quantizers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping=mapping)


def load_gguf(model_cls: type, gguf_file: str, config_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """A component from a GGUF file, its config from the snapshot's component dir (diffusers ``from_single_file``
    with ``GGUFQuantizationConfig(compute_dtype=dtype)``)."""
    q = quant.get("gguf").config("diffusers", dtype)
    return model_cls.from_single_file(gguf_file, quantization_config=q, config=config_dir, torch_dtype=dtype,
                                      local_files_only=True)


def quantize_built(module: torch.nn.Module, method: str, library: str, dtype: torch.dtype,
                   device: Optional[str] = None) -> None:
    """Quantize a built (``load_format=dummy``) module's Linears in place with the same torchao config diffusers'
    ``TorchAoHfQuantizer`` applies while loading (``torchao.quantization.quantize_``, Linears only, less those the
    method keeps dense: :func:`keep_dense`, diffusers' ``modules_to_not_convert``); a method that
    quantizes on the GPU only (``quantize_on_device``) moves each Linear to ``device`` first (``quantize_(device=)``).

    Raises:
        ConfigValueError: a method that quantizes only while loading a checkpoint (bitsandbytes, GGUF).
    """
    cfg = quant.get(method).config(library, dtype)
    keep = set(keep_dense(method, module))
    ao = getattr(cfg, "quant_type", None)
    if ao is None or isinstance(ao, (str, dict)):
        raise ConfigValueError(f"model.quantization={method} with model.load_format=dummy: {method} quantizes while "
                               "a checkpoint loads (from_pretrained); fix: an embedded model or model.path, or a "
                               "torchao method (int8wo, float8wo)")
    from torchao.quantization import quantize_
    from torchao.quantization.quant_api import _is_linear

    on = device if quant.get(method).quantize_on_device and device is not None else None
    quantize_(module, ao, device=on,
              filter_fn=lambda m, fqn: _is_linear(m, fqn) and fqn not in keep)  # torchao's default, less ``keep``


def check_dummy_methods(choices: Mapping[str, str]) -> None:
    """``load_format=dummy`` builds modules without a checkpoint: only torchao methods quantize those.

    Raises:
        ConfigValueError: naming each component whose method needs a checkpoint.
    """
    bad = [f"model.quantization.{c}={m}" for c, m in choices.items() if m in ("nf4", "gguf")]
    if bad:
        raise ConfigValueError(f"{', '.join(bad)} with model.load_format=dummy: bitsandbytes and GGUF quantize while "
                               "a checkpoint loads; fix: an embedded model or model.path (a snapshot), or int8wo / "
                               "float8wo (torchao) for random weights")


# ------------------------------------------------------------------------------------------------ sizing


def meta_components(classes: Mapping[str, Tuple[str, str, Optional[str]]], config: Callable[[str], Dict[str, Any]],
                    dtype: torch.dtype) -> Dict[str, torch.nn.Module]:
    """Every model component built on the meta device from its config (no memory): a diffusers class with
    ``from_config``, a transformers class as ``Model(Config(**config))``."""
    out: Dict[str, torch.nn.Module] = {}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
    try:
        for comp, (lib, cls_name, cfg_name) in classes.items():
            if comp == "scheduler":
                continue
            mod = importlib.import_module(lib)
            model_cls, conf = getattr(mod, cls_name), dict(config(comp))
            with torch.device("meta"):
                if cfg_name:
                    out[comp] = model_cls(getattr(mod, cfg_name)(**conf))
                else:
                    out[comp] = model_cls.from_config({k: v for k, v in conf.items()})
    finally:
        torch.set_default_dtype(prev)
    return out


def component_sizes(modules: Mapping[str, torch.nn.Module], choices: Mapping[str, str],
                    gguf_bytes: Optional[int] = None,
                    file_bytes: Optional[Mapping[str, int]] = None) -> Dict[str, planner.ComponentSize]:
    """:class:`runner.core.memory.ComponentSize` of every model component, quantized ones at their method's bits
    (a GGUF one at its file's bytes, a pre-quantized checkpoint's at ``file_bytes[component]`` where given)."""
    out = {}
    for name, m in modules.items():
        if not isinstance(m, torch.nn.Module):
            continue
        method = choices.get(name)
        bits = quant.get(method).bits if method else None
        fb = gguf_bytes if method == "gguf" else (file_bytes or {}).get(name)
        out[name] = planner.size_module(name, m, linear_bits=bits, file_bytes=fb,
                                        dense=keep_dense(method, m) if method else ())
    return out


def _get(conf: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if conf.get(k) is not None:
            return conf[k]
    return default


def text_activations(encoders: Mapping[str, Mapping[str, Any]], batch: int, seq: int, elem: int) -> Dict[str, int]:
    """Activation bytes of each text encoder (``runner.core.memory.encoder_activation``) from its config."""
    out = {}
    for name, c in encoders.items():
        hidden = int(_get(c, "d_model", "hidden_size", default=0))
        ff = int(_get(c, "d_ff", "intermediate_size", default=4 * hidden))
        heads = int(_get(c, "num_heads", "num_attention_heads", default=1))
        n = min(seq, int(_get(c, "max_position_embeddings", default=seq)))
        out[name] = planner.encoder_activation(batch, n, hidden, ff, heads, elem)
    return out


def denoiser_activations(conf: Mapping[str, Any], batch: int, tokens: int, elem: int) -> int:
    """Activation bytes of the denoiser (``runner.core.memory.denoiser_activation``): inner width ``heads x
    head_dim``, MLP ratio from ``ffn_dim`` / ``mlp_ratio`` (diffusers' FLUX default 4)."""
    inner = int(_get(conf, "num_attention_heads", default=1)) * int(_get(conf, "attention_head_dim", default=64))
    ratio = float(conf["ffn_dim"]) / inner if conf.get("ffn_dim") else float(_get(conf, "mlp_ratio", default=4.0))
    return planner.denoiser_activation(batch, tokens, inner, ratio, elem)


def wan_decoder_geometry(conf: Mapping[str, Any]) -> Dict[str, Any]:
    """What :func:`runner.core.memory.causal_decoder_activation` reads of ``AutoencoderKLWan``'s decoder, from its
    config, built as ``WanDecoder3d.__init__`` builds it (diffusers 0.42.1, ``autoencoder_kl_wan.py``): channels
    ``dims = d * [m[-1]] + d * m[::-1]`` (``d`` = ``decoder_base_dim`` or ``base_dim``, ``m`` = ``dim_mult``); up
    block ``i`` runs at ``1 / 4 ** (L - i)`` of the output area (``L = len(m) - 1`` spatial 2x upsamplers), its
    input ``dims[i]``, halved for ``i > 0`` unless ``is_residual`` (Wan 2.1's ``WanUpBlock`` upsamplers halve the
    channels, Wan 2.2's ``WanResidualUpBlock`` ones keep them), ``num_res_blocks + 1`` ResNets of two causal convs.

    Returns ``{"cache": K, "last_in": C_in, "upsampled": C_up, "chunk": T, "patch": p}``: ``K`` the input channels
    of every causal conv that keeps a feature cache (``conv_in``, the mid block's 2 ResNets, the up blocks'
    ResNets, each temporal upsampler's ``time_conv``, ``conv_out``), each divided by its resolution's area ratio;
    ``T = 2 ** sum(temperal_downsample)``; ``p`` the ``patch_size`` (the decoder runs at ``H / p x W / p``)."""
    d = int(_get(conf, "decoder_base_dim", "base_dim", default=96))
    mult = [int(m) for m in (conf.get("dim_mult") or [1, 2, 4, 4])]
    nres = int(_get(conf, "num_res_blocks", default=2))
    residual = bool(conf.get("is_residual", False))
    tup = [bool(t) for t in (conf.get("temperal_downsample") or [False, True, True])][::-1]
    dims = [d * m for m in [mult[-1]] + mult[::-1]]
    n = len(mult) - 1
    cache = int(_get(conf, "z_dim", default=16)) / 4 ** n + 4 * dims[0] / 4 ** n  # conv_in, the mid block
    last_in = dims[0]
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        cin = cin if i == 0 or residual else cin // 2
        convs = cin + (2 * (nres + 1) - 1) * cout + (cout if i < n and tup[i] else 0)  # + time_conv
        cache += convs / 4 ** (n - i)
        last_in = cin
    cache += dims[-1]  # conv_out
    return {"cache": cache, "last_in": last_in, "upsampled": dims[n], "chunk": 2 ** sum(tup),
            "patch": int(conf.get("patch_size") or 1)}


#: ``AutoencoderKLWan.tile_sample_min_height`` / ``_width`` (diffusers 0.42.1): the tile ``vae.enable_tiling()``
#: decodes, in output pixels.
WAN_TILE = 256
#: ``AutoencoderKLLTX2Video.tile_sample_min_height`` and ``tile_sample_stride_height`` (diffusers 0.42.1, the same
#: across the width): the tile ``vae.enable_tiling()`` decodes and the step between tiles, in output pixels.
LTX2_TILE, LTX2_STRIDE = 512, 448
#: ``AutoencoderKLHunyuanVideo15.tile_sample_min_height`` and ``tile_overlap_factor`` (diffusers 0.42.1): tiles of
#: ``256 / spatial_compression_ratio`` latent rows and columns, one every ``int(tile * (1 - 0.25))``.
HY15_TILE, HY15_OVERLAP = 256, 0.25
#: The video VAEs that decode the whole video in one decoder call (no frame chunks, no caches), by class name.
WHOLE_VIDEO_VAES = ("AutoencoderKLLTX2Video", "AutoencoderKLHunyuanVideo15")


def _per_block(value: Any, default: Any, n: int) -> List[Any]:
    """A per-block setting as a list of ``n``: None -> ``default`` each, a scalar repeated (diffusers' own rule)."""
    if value is None:
        value = default
    return list(value)[:n] if isinstance(value, (list, tuple)) else [value] * n


def ltx2_decoder_geometry(conf: Mapping[str, Any]) -> Dict[str, Any]:
    """``AutoencoderKLLTX2Video``'s decoder from its config, built as ``LTX2VideoDecoder3d.__init__`` builds it
    (diffusers 0.42.1, ``autoencoder_kl_ltx2.py``): ``decoder_block_out_channels``, ``decoder_spatio_temporal_scaling``
    and ``upsample_factor`` reversed (``upsample_type`` is not), the mid block at ``boc[0]`` channels, up block ``i``
    leaving ``boc[i] // upsample_factor[i]`` channels at twice the frames (``temporal`` / ``spatiotemporal``: ``T ->
    2 T - 1``, the upsampler drops its first frame) and twice the height and width (``spatial`` /
    ``spatiotemporal``); the decoder's output is ``patch_size`` x its last level (``unpatchify``).

    Returns ``{"channels": [C_mid, C_1, ...], "up": [(temporal, spatial) stride of each up block], "spatial",
    "temporal"`` (pixels and frames per latent one, as ``vae.spatial_compression_ratio`` / ``temporal_...``),
    ``"patch_t", "reflect"`` (a padded copy per conv: ``decoder_spatial_padding_mode`` not ``zeros``),
    ``"out_channels"`` (``conv_out``'s, ``out_channels * patch_size ** 2 * patch_size_t``), ``"tile", "stride"``
    (:data:`LTX2_TILE`, in latents)}."""
    boc = [int(c) for c in _get(conf, "decoder_block_out_channels", default=(256, 512, 1024))][::-1]
    n = len(boc)
    scaling = _per_block(conf.get("decoder_spatio_temporal_scaling"), True, n)[::-1]
    factor = [int(f) for f in _per_block(conf.get("upsample_factor"), 2, n)][::-1]
    kinds = _per_block(conf.get("upsample_type"), "spatiotemporal", n)
    up = [(2 if k != "spatial" else 1, 2 if k != "temporal" else 1) if s else (1, 1) for s, k in zip(scaling, kinds)]
    p, pt = int(_get(conf, "patch_size", default=4)), int(_get(conf, "patch_size_t", default=1))
    spatial = int(_get(conf, "spatial_compression_ratio", default=p * math.prod(s for _, s in up)))
    return {"channels": [boc[0]] + [c // f for c, f in zip(boc, factor)], "up": up, "spatial": spatial,
            "temporal": int(_get(conf, "temporal_compression_ratio", default=pt * math.prod(t for t, _ in up))),
            "patch_t": pt, "reflect": str(_get(conf, "decoder_spatial_padding_mode", default="reflect")) != "zeros",
            "out_channels": int(_get(conf, "out_channels", default=3)) * p * p * pt,
            "tile": int(conf.get("tile_sample_min_height") or LTX2_TILE) // spatial,  # not config keys: tests pass
            "stride": int(conf.get("tile_sample_stride_height") or LTX2_STRIDE) // spatial}  # smaller tiles


def hunyuan15_decoder_geometry(conf: Mapping[str, Any]) -> Dict[str, Any]:
    """``AutoencoderKLHunyuanVideo15``'s decoder from its config, built as ``HunyuanVideo15Decoder3D.__init__``
    builds it (diffusers 0.42.1, ``autoencoder_kl_hunyuanvideo15.py``): ``block_out_channels`` reversed, the mid
    block (ResNet, attention, ResNet) at ``boc[0]`` channels; up block ``i`` upsamples twice in height and width
    while ``i < log2(spatial_compression_ratio)`` and in frames (``T -> 2 T - 1``: the first frame is not repeated)
    while ``i < log2(temporal_compression_ratio)``, to ``boc[i + 1]`` channels (``upsample_match_channel``, else
    ``boc[i]``); no patching (the last level is the output's resolution).

    Returns what :func:`ltx2_decoder_geometry` returns (``"patch_t"`` 1, ``"reflect"`` True: the causal conv's
    ``F.pad`` copy), the tiles of ``tiled_decode`` (:data:`HY15_TILE`)."""
    boc = [int(c) for c in _get(conf, "block_out_channels", default=(128, 256, 512, 1024, 1024))][::-1]
    spatial = int(_get(conf, "spatial_compression_ratio", default=16))
    temporal = int(_get(conf, "temporal_compression_ratio", default=4))
    match = bool(_get(conf, "upsample_match_channel", default=True))
    channels, up = [boc[0]], []
    for i, c in enumerate(boc):
        s, t = 2 ** i < spatial, 2 ** i < temporal
        up.append((2 if t else 1, 2 if s else 1))
        channels.append((boc[i + 1] if match else c) if s or t else c)
    tile = int(conf.get("tile_sample_min_height") or HY15_TILE) // spatial  # not a config key: tests pass a smaller
    return {"channels": channels, "up": up, "spatial": spatial, "temporal": temporal, "patch_t": 1,
            "reflect": True, "tile": tile, "stride": int(tile * (1 - HY15_OVERLAP))}


def decoder_levels(g: Mapping[str, Any], t: int, h: int, w: int) -> List[Tuple[int, int, int, int]]:
    """``(channels, frames, height, width)`` of the mid block's output and each up block's, from ``t x h x w``
    latents (geometry of :func:`ltx2_decoder_geometry` / :func:`hunyuan15_decoder_geometry`)."""
    out = [(g["channels"][0], t, h, w)]
    for (st, ss), c in zip(g["up"], g["channels"][1:]):
        t, h, w = st * (t - 1) + 1, h * ss, w * ss
        out.append((c, t, h, w))
    return out


def _tiles(n: int, tile: int, stride: int) -> List[int]:
    """The latent sizes of the tiles ``tiled_decode`` takes along an axis of ``n`` latents."""
    return [min(tile, n - i) for i in range(0, n, stride)]


def _whole_video_call(g: Mapping[str, Any], ltx2: bool, b: int, t: int, h: int, w: int, elem: int) -> int:
    """One decoder call's peak over ``b`` videos of ``t x h x w`` latents (``runner.core.memory``'s rule)."""
    levels = decoder_levels(g, t, h, w)
    if ltx2:
        return planner.ltx2_decoder_activation(b, levels[-1], levels[-2], elem, g["reflect"], g["out_channels"])
    return planner.hunyuan15_decoder_activation(b, levels[-1], (levels[0][0], t * h * w), elem)


def whole_video_decoder_activations(cls: str, conf: Mapping[str, Any], batch: int, frames: int, height: int,
                                    width: int, elem: int, tiling: bool, slicing: bool) -> int:
    """Activation bytes of LTX-2's and HunyuanVideo-1.5's video VAE decoders (:data:`WHOLE_VIDEO_VAES`): one decoder
    call over all frames (``_decode``), its peak at the last up block (``runner.core.memory.ltx2_decoder_activation``
    / ``hunyuan15_decoder_activation`` with :func:`decoder_levels`). With ``memory.vae_slicing`` ``B'`` = 1, the
    videos decoded before the last held beside it, and at the end two copies of all (the slices, their
    ``torch.cat``). With ``memory.vae_tiling`` (``tiled_decode``, where the latents exceed a tile) each tile in
    ``tiled_decode``'s order through all frames beside the outputs of the tiles before it (every tile's is held
    until they are blended), and at the end the tiles' outputs and two copies of the video (the rows' and the
    result's ``torch.cat``)."""
    ltx2 = cls == "AutoencoderKLLTX2Video"
    g = ltx2_decoder_geometry(conf) if ltx2 else hunyuan15_decoder_geometry(conf)
    t, h, w = (frames - 1) // g["temporal"] + 1, height // g["spatial"], width // g["spatial"]
    b = 1 if slicing else batch
    px = 3 * decoder_levels(g, t, 1, 1)[-1][1] * g["patch_t"] * g["spatial"] ** 2 * elem  # a video, per latent px
    video, held = px * h * w, (batch - b) * px * h * w  # sliced: the videos decoded before the last
    end = 2 * batch * video if slicing else 0
    if tiling and (h > g["tile"] or w > g["tile"]):
        rows, cols = _tiles(h, g["tile"], g["stride"]), _tiles(w, g["tile"], g["stride"])
        peak = tiles = 0
        for th in rows:
            for tw in cols:
                peak = max(peak, _whole_video_call(g, ltx2, b, t, th, tw, elem) + tiles)
                tiles += b * px * th * tw
        h, w = rows[0], cols[0]
        end = max(end, tiles + 2 * b * video + held)
    else:
        peak = _whole_video_call(g, ltx2, b, t, h, w, elem)
    c, f, hd, wd = decoder_levels(g, t, h, w)[-1]
    return int(max(peak + held, end + planner.workspace_allowance(b * c * f * hd * wd * elem)))


def decoder_activations(conf: Mapping[str, Any], batch: int, frames: int, height: int, width: int, elem: int,
                        tiling: bool, slicing: bool, vae_class: Optional[str] = None) -> int:
    """Activation bytes of the VAE decoder: ``AutoencoderKL`` (``block_out_channels``):
    ``runner.core.memory.decoder_activation`` with the channels of the full-resolution upsampler
    (``block_out_channels[1]``); Wan's causal VAE (``AutoencoderKLWan``): ``runner.core.memory
    .causal_decoder_activation`` with :func:`wan_decoder_geometry`, plus the decoded video ``B x 3 x F x H x W``
    (module docstring of ``runner.core.memory``).

    Wan's VAE decodes one latent frame at a time (``AutoencoderKLWan._decode``), each causal conv keeping the last
    frames of its input across calls (``feat_cache``); the decoded video grows by ``torch.cat`` and is unpatchified
    and clamped after the last call: two copies of it (``decode`` with ``memory.vae_slicing``: the slices and their
    ``torch.cat``, also two). Tiled (``memory.vae_tiling``, ``AutoencoderKLWan.tiled_decode``): each 256^2 tile is
    decoded through all frames with fresh caches, and every tile's output (up to ``(256 / 192) ** 2`` of the video
    with the overlaps), the blended rows, their ``torch.cat`` and the clamped result are held at once: five
    copies. LTX-2's and HunyuanVideo-1.5's VAEs (``vae_class``, else the config's ``_class_name``, in
    :data:`WHOLE_VIDEO_VAES`): :func:`whole_video_decoder_activations`."""
    cls = vae_class or conf.get("_class_name")
    if cls in WHOLE_VIDEO_VAES:
        return whole_video_decoder_activations(str(cls), conf, batch, frames, height, width, elem, tiling, slicing)
    boc = conf.get("block_out_channels")
    b = 1 if slicing else batch
    if boc:
        if tiling:
            tile = int(_get(conf, "sample_size", default=512) if not isinstance(conf.get("sample_size"), list)
                       else conf["sample_size"][0])
            height, width = min(height, tile), min(width, tile)
        return planner.decoder_activation(b, frames, height, width, int(boc[1] if len(boc) > 1 else boc[0]), elem)
    g = wan_decoder_geometry(conf)
    video = batch * 3 * frames * height * width * elem
    if tiling:
        tile = int(conf.get("tile_sample_min_height") or WAN_TILE)  # not a config key: tests pass a smaller tile
        height, width = min(height, tile), min(width, tile)
    p = g["patch"]
    return planner.causal_decoder_activation(b, min(frames, g["chunk"]), height // p, width // p, g["cache"],
                                             g["last_in"], g["upsampled"], elem) + (5 if tiling else 2) * video


# ------------------------------------------------------------------------------------------------ applying


def torchao_device_copies() -> int:
    """Make torchao tensor subclasses movable between devices by diffusers' offload hooks; returns how many
    subclasses were patched (0 when torchao is not imported, or all are patched already).

    torchao 0.18 implements ``aten.to.dtype_layout`` for every ``TorchAOBaseTensor`` subclass
    (``torchao/utils.py``, ``_implements_common_tensor_ops``) by moving the inner tensors and then calling
    ``return_and_correct_aliasing``, which aliases the output's storage to the input's because the op's schema
    says the result may alias ``self`` (as it does when nothing changes). With torch 2.11 on a GPU, a move to
    another device then fails with ``RuntimeError: Attempted to set the storage of a tensor on device "cuda:0" to
    a storage on different device "cpu"`` (``_functionalize_unsafe_set``): every group-offload onload of an
    ``Int8Tensor`` / ``Float8Tensor`` weight, streamed or not, failed on the H200 (issue #37,
    ``benchmarks/results/memory_diag_h200_2026-12-03.json``: plain diffusers + torchao, no runner code).
    A move to another device is a copy, never an alias, so for a device change the wrapped implementation
    returns the moved tensor as it is, ``non_blocking`` passed on to the inner tensors (torchao's own asserts on
    that keyword, which the streamed offload hooks pass: every item failed with an empty ``AssertionError`` on the
    H200, ``benchmarks/results/cuda_memory_h200_2026-12-03.log``); anything else (no device change, another dtype
    or layout) goes to torchao's own.
    """
    import sys

    ao = sys.modules.get("torchao.utils")
    base = getattr(ao, "TorchAOBaseTensor", None) if ao is not None else None
    if base is None:
        return 0
    op = torch.ops.aten.to.dtype_layout
    patched = 0
    classes, todo = [], [base]
    while todo:  # every subclass defined so far (each keeps its own op table)
        c = todo.pop()
        classes.append(c)
        todo.extend(c.__subclasses__())
    for cls in classes:
        table = cls.__dict__.get("_ATEN_OP_TABLE", {}).get(cls)
        orig = table.get(op) if table is not None else None
        if orig is None or getattr(orig, "_runner_device_copy", False):
            continue

        def to(func: Any, types: Any, args: Any, kwargs: Any, _orig: Callable[..., Any] = orig) -> Any:
            self, dev, nb = args[0], kwargs.get("device"), bool(kwargs.get("non_blocking", False))
            same = (kwargs.get("dtype") in (None, self.dtype) and kwargs.get("layout") in (None, self.layout)
                    and kwargs.get("copy") in (None, False) and kwargs.get("memory_format") is None
                    and not set(kwargs) - {"device", "dtype", "layout", "non_blocking", "copy", "memory_format"})
            if len(args) != 1 or not same or dev is None or torch.device(dev) == self.device:
                return _orig(func, types, args, kwargs)  # torchao's own (it asserts what it does not support)
            return self._apply_fn_to_data(lambda x: func(x, device=dev, non_blocking=nb))

        to._runner_device_copy = True  # type: ignore[attr-defined]
        table[op] = to
        patched += 1
    return patched


def apply_offload(pipe: Any, plan: planner.Plan, device: str) -> Dict[str, Any]:
    """Put the pipeline on ``device`` under ``plan`` (diffusers' offload APIs; ``none``: ``pipe.to(device)``).

    Returns:
        What was applied, for the manifest.
    """
    mode = plan.offload
    if mode == "none":
        pipe.to(device)
    elif mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    else:
        levels = group_levels(pipe.components, mode)
        from diffusers.hooks import apply_group_offloading

        kw: Dict[str, Any] = {"onload_device": torch.device(device), "offload_device": torch.device("cpu"),
                              "use_stream": plan.use_stream, "record_stream": plan.use_stream and plan.record_stream}
        for name, level in levels.items():  # as diffusers' pipeline.enable_group_offload, one level per component
            extra = {"num_blocks_per_group": plan.blocks_per_group} if level == "block_level" else {}
            comp = pipe.components[name]
            apply = getattr(comp, "enable_group_offload", None)  # a diffusers model's own checks first
            if apply is not None:
                apply(offload_type=level, **kw, **extra)
            else:
                apply_group_offloading(comp, offload_type=level, **kw, **extra)
        resident = (keep_blocks(pipe.components["transformer"], plan.resident_blocks, device)
                    if plan.resident_blocks and levels.get("transformer") == "block_level" else [])
        return {"offload": mode, "use_stream": plan.use_stream, "blocks_per_group": plan.blocks_per_group,
                "record_stream": plan.use_stream and plan.record_stream, "levels": levels,
                "resident_blocks": len(resident), "resident": resident}
    return {"offload": mode, "use_stream": plan.use_stream, "blocks_per_group": plan.blocks_per_group,
            "record_stream": plan.use_stream and plan.record_stream}


def blocks_in_order(module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """``(name, block)`` of every entry of ``module``'s top-level block lists, in the order diffusers' block-level
    offloading groups them and ``runner.core.memory.size_module`` sizes them."""
    return [(f"{n}.{i}", b) for n, ch in module.named_children()
            if isinstance(ch, (torch.nn.ModuleList, torch.nn.Sequential)) for i, b in enumerate(ch)]


def keep_blocks(module: torch.nn.Module, n: int, device: str) -> List[str]:
    """Keep the first ``n`` blocks of a block-level offloaded ``module`` on ``device``: each one's group-offload
    hook (one block per group) and, under ``use_stream``, the execution tracker diffusers' lazy prefetching put on it
    are removed before the first forward, so that prefetching, which chains the groups it saw run in that forward
    (``LazyPrefetchGroupOffloadingHook``, diffusers 0.42), streams the others only; then the block is moved to
    ``device``. Returns the blocks' names.

    Raises:
        RuntimeError: a block to keep is not its own group (its hook's group holds other modules)."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER,
                                                  _LAZY_PREFETCH_GROUP_OFFLOADING)

    lazy = HookRegistry.check_if_exists_or_initialize(module).get_hook(_LAZY_PREFETCH_GROUP_OFFLOADING)
    full = {id(m): n for n, m in module.named_modules()}
    kept = []
    for name, block in blocks_in_order(module)[:n]:
        reg = HookRegistry.check_if_exists_or_initialize(block)
        hook = reg.get_hook(_GROUP_OFFLOADING)
        if hook is not None and list(hook.group.modules) != [block]:
            raise RuntimeError(f"memory.offload=group_block: block {name} shares its offload group; a resident "
                               "block must be its own group (blocks_per_group=1)")
        reg.remove_hook(_GROUP_OFFLOADING, recurse=False)
        # Under use_stream the lazy-prefetch hook has put an execution tracker on every hooked block: left on a
        # kept block, its first forward lists the block among the groups to prefetch and reads its (removed)
        # group hook: AttributeError in diffusers' post_forward, and the batch re-ran item by item unprefetched.
        reg.remove_hook(_LAYER_EXECUTION_TRACKER, recurse=False)
        if lazy is not None:
            lazy._layer_execution_tracker_module_names.discard(full[id(block)])
        block.to(device)
        kept.append(name)
    return kept


def group_levels(components: Mapping[str, Any], mode: str) -> Dict[str, str]:
    """diffusers' group-offload level for each module component under ``mode``: ``group_leaf`` leaf level for all;
    ``group_block`` block level for a component with top-level ``nn.ModuleList``/``nn.Sequential`` children (the
    blocks diffusers groups) and leaf level for one without (block level would make all of it one group: T5's
    blocks are one level down), as ``runner.core.memory`` plans it."""
    out: Dict[str, str] = {}
    for name, m in components.items():
        if not isinstance(m, torch.nn.Module):
            continue
        lists = any(isinstance(ch, (torch.nn.ModuleList, torch.nn.Sequential)) for ch in m.children())
        out[name] = "block_level" if mode == "group_block" and lists else "leaf_level"
    return out


def apply_vae(pipe: Any, tiling: bool, slicing: bool) -> Dict[str, bool]:
    """``vae.enable_tiling()`` / ``vae.enable_slicing()`` as asked (diffusers' VAE methods)."""
    vae = getattr(pipe, "vae", None)
    if tiling:
        vae.enable_tiling()
    if slicing:
        vae.enable_slicing()
    return {"vae_tiling": tiling, "vae_slicing": slicing}


def device_total(device: str) -> int:
    """The total memory of CUDA device ``device`` (``cuda:0``), in bytes (``torch.cuda.get_device_properties``)."""
    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def set_budget(max_gpu_gb: Optional[float], device: str) -> Optional[Dict[str, Any]]:
    """Cap this process's CUDA caching allocator at ``max_gpu_gb`` GiB on ``device`` (an allocation past it raises
    ``torch.OutOfMemoryError`` instead of growing); None without a budget."""
    if max_gpu_gb is None:
        return None
    dev = torch.device(device)
    total = device_total(device)
    frac = min(1.0, max_gpu_gb * planner.GIB / total)
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    return {"max_gpu_gb": max_gpu_gb, "fraction": round(frac, 6), "device_total_gb": planner.gb(total)}


# ------------------------------------------------------------------------------------------------ evidence


@dataclass
class OffloadProbe:
    """Bytes onloaded to the device, observed at diffusers' offload hooks.

    Attributes:
        onloads: onload calls seen; bytes: their bytes (each group's parameters and buffers, storage bytes).
    """

    onloads: int = 0
    bytes: int = 0
    groups: int = 0
    _undo: List[Callable[[], None]] = field(default_factory=list)

    def watch_groups(self, modules: Sequence[torch.nn.Module]) -> None:
        """Wrap ``onload_`` of every group-offload ``ModuleGroup`` hooked into ``modules`` (each group once)."""
        from diffusers.hooks.group_offloading import ModuleGroup

        seen = set()
        for root in modules:
            for m in root.modules():
                reg = getattr(m, "_diffusers_hook", None)
                for hook in (getattr(reg, "hooks", None) or {}).values():
                    g = getattr(hook, "group", None)
                    if isinstance(g, ModuleGroup) and id(g) not in seen:
                        seen.add(id(g))
                        self._wrap(g)
        self.groups = len(seen)

    def _wrap(self, g: Any) -> None:
        tensors = {id(t): t for mod in g.modules for t in (*mod.parameters(), *mod.buffers())}
        tensors.update({id(t): t for t in (*g.parameters, *g.buffers)})
        size = sum(planner.tensor_bytes(t) for t in tensors.values())
        orig = g.onload_

        def onload_(*a: Any, **k: Any) -> Any:
            self.onloads += 1
            self.bytes += size
            return orig(*a, **k)

        g.onload_ = onload_
        self._undo.append(lambda: delattr(g, "onload_"))

    def watch_models(self, components: Mapping[str, torch.nn.Module], device: str) -> None:
        """Under model offload: a pre-hook per component that counts its bytes when its weights are not on
        ``device`` as it starts (accelerate's hook moves them after this one, ``add_hook_to_module``)."""
        want = torch.device(device).type
        for m in components.values():
            size = sum(planner.tensor_bytes(t) for t in (*m.parameters(), *m.buffers()))

            def pre(mod: torch.nn.Module, args: Any, _n: int = size) -> None:
                p = next(mod.parameters(), None)
                if p is not None and p.device.type != want:
                    self.onloads += 1
                    self.bytes += _n

            self._undo.append(m.register_forward_pre_hook(pre).remove)
        self.groups = len(components)


@dataclass
class QuantProbe:
    """Calls of the quantized components' Linears, by the class their weight had when they ran.

    Attributes:
        method: component -> method; calls: component -> weight class name -> calls; linears: Linears per
        component; quantized: component -> Linears whose weight had the method's class at load; changed: Linears
        quantized at load that later ran with another weight class; kept: component -> the Linears its method
        leaves dense (:func:`keep_dense`), ``kept_quantized`` those of them that hold its weight all the same; rows: component -> Linear name -> the most rows (input elements over
        ``in_features``) one call gave it, with ``samples``: component -> the most samples (the batch of its
        ``hidden_states``, the length of Z-Image's latent list) one forward of it took; both recorded only under a method with a row limit
        (:attr:`runner.kernels.quantization.WeightQuant.min_rows`).
    """

    method: Dict[str, str]
    calls: Dict[str, Dict[str, int]] = field(default_factory=dict)
    linears: Dict[str, int] = field(default_factory=dict)
    quantized: Dict[str, int] = field(default_factory=dict)
    changed: Dict[str, List[str]] = field(default_factory=dict)
    kept: Dict[str, List[str]] = field(default_factory=dict)
    rows: Dict[str, Dict[str, int]] = field(default_factory=dict)
    samples: Dict[str, int] = field(default_factory=dict)
    kept_quantized: Dict[str, List[str]] = field(default_factory=dict)
    quantized_names: Dict[str, set] = field(default_factory=dict)
    observe: bool = True

    def attach(self, components: Mapping[str, torch.nn.Module]) -> None:
        """A forward pre-hook on every ``nn.Linear`` of each quantized component, and on every module of a
        method's replacement class (``quant.is_quantized_linear_site``; read-only); under a method with a row
        limit, one on the component too (the samples per forward). Without :attr:`observe` (compiled code runs no
        hooks) only what loading left: the Linears, the quantized and the kept ones."""
        for comp, method in self.method.items():
            mod = components.get(comp)
            if not isinstance(mod, torch.nn.Module):
                continue
            q = quant.get(method)
            want = q.tensor_classes
            counts, changed = self.calls.setdefault(comp, {}), self.changed.setdefault(comp, [])
            lins = [(n, m) for n, m in mod.named_modules() if quant.is_quantized_linear_site(m)]
            self.linears[comp] = len(lins)
            self.quantized[comp] = 0
            self.kept[comp] = keep_dense(method, mod)
            rows = self.rows.setdefault(comp, {}) if q.min_rows and self.observe else None
            if rows is not None:
                mod.register_forward_pre_hook(self._samples_hook(comp), with_kwargs=True)
            for name, lin in lins:
                was = bool(set(quant.weight_class_names(lin)) & set(want))
                self.quantized[comp] += was
                if was:
                    self.quantized_names.setdefault(comp, set()).add(name)
                if was and name in self.kept[comp]:
                    self.kept_quantized.setdefault(comp, []).append(name)
                if not self.observe:
                    continue

                def pre(m: torch.nn.Module, args: Any, _c: Dict[str, int] = counts, _was: bool = was,
                        _n: str = name, _w: Tuple[str, ...] = want, _r: Optional[Dict[str, int]] = rows) -> None:
                    names = quant.weight_class_names(m)
                    _c[names[0] if names else "None"] = _c.get(names[0] if names else "None", 0) + 1
                    if _was and not set(names) & set(_w) and _n not in changed:
                        changed.append(_n)
                    if _r is not None and args and isinstance(args[0], torch.Tensor) and args[0].dim():
                        x = args[0]
                        _r[_n] = max(_r.get(_n, 0), x.numel() // max(1, x.shape[-1]))

                lin.register_forward_pre_hook(pre)

    def _samples_hook(self, comp: str) -> Callable[..., None]:
        def pre(m: torch.nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
            x = kwargs.get("hidden_states", kwargs.get("x", args[0] if args else None))
            n = len(x) if isinstance(x, (list, tuple)) else int(x.shape[0]) if isinstance(x, torch.Tensor) and \
                x.dim() else 0  # Z-Image takes a list of per-sample latents
            self.samples[comp] = max(self.samples.get(comp, 0), n)
        return pre

    def section(self) -> Tuple[Dict[str, Any], List[str]]:
        """``{component: {method, linears, quantized_linears, calls_by_weight_class, quantized_calls, calls_observed,
        kept_dense}}`` (``calls_observed`` false under compile: no call counted, the load-time counts stand)
        and the mismatches: a quantized component none of whose Linears holds the method's weight class, a Linear
        quantized at load that ran with another weight, a component whose Linears ran while none of its quantized
        ones did (0 quantized calls: the quantization claimed is not what executed), a Linear recorded as kept dense
        that holds the method's weight; under a method with a row limit, a quantized Linear that ran with no more
        rows than the forward had samples (a per-sample Linear :data:`runner.kernels.quantization.PER_SAMPLE_LINEARS`
        missed: its GEMM refuses it at small batches); the kept ones that ran with more rows are recorded
        (``kept_dense.ran_per_token``)."""
        out: Dict[str, Any] = {}
        bad: List[str] = []
        for comp, method in self.method.items():
            q = quant.get(method)
            want = q.tensor_classes
            calls = self.calls.get(comp, {})
            out[comp] = {"method": method, "linears": self.linears.get(comp, 0),
                         "quantized_linears": self.quantized.get(comp, 0), "calls_by_weight_class": calls,
                         "quantized_calls": sum(n for k, n in calls.items() if k in want),
                         "calls_observed": self.observe}
            kept = self.kept.get(comp, [])
            if kept:
                out[comp]["kept_dense"] = {"linears": len(kept), "names": kept,
                                           "why": f"they see one row per sample; {method} needs at least "
                                                  f"{q.min_rows} rows per call ({q.min_rows_source})"}
            if comp in self.linears and not self.quantized.get(comp):
                bad.append(f"model.quantization.{comp}={method}: none of its {self.linears[comp]} Linears holds a "
                           f"{'/'.join(want)} weight after loading")
            if self.changed.get(comp):
                bad.append(f"model.quantization.{comp}={method}: Linears quantized at load ran with another weight: "
                           + ", ".join(self.changed[comp][:5]))
            elif self.quantized.get(comp) and sum(calls.values()) and not out[comp]["quantized_calls"]:
                bad.append(f"model.quantization.{comp}={method}: its Linears ran {sum(calls.values())} times, none "
                           f"with a {'/'.join(want)} weight (0 quantized Linears executed)")
            if self.kept_quantized.get(comp):
                bad.append(f"model.quantization.{comp}={method}: Linears recorded as kept dense hold a "
                           f"{'/'.join(want)} weight: {', '.join(self.kept_quantized[comp][:5])}")
            bad += self._rows(comp, method, kept, out[comp].get("kept_dense"))
        return out, bad

    def _rows(self, comp: str, method: str, kept: Sequence[str], record: Optional[Dict[str, Any]]) -> List[str]:
        """Under a method with a row limit: the quantized Linears that ran with no more rows than the forward had
        samples (a mismatch: the GEMM refuses them at small batches on CUDA); the kept ones that ran with more
        (``record["ran_per_token"]``: kept for nothing, at no risk; Wan 2.2 TI2V-5B's ``expand_timesteps`` gives
        its time embedder one timestep per token)."""
        rows, samples = self.rows.get(comp), self.samples.get(comp)
        if rows is None or not samples:
            return []
        quantized = self.quantized_names.get(comp, set())
        missed = sorted(n for n, r in rows.items() if r <= samples and n in quantized)
        if record is not None:
            record["ran_per_token"] = [n for n in kept if rows.get(n, 0) > samples]
        if not missed:
            return []
        return [f"model.quantization.{comp}={method}: {len(missed)} quantized Linears ran with one row per sample "
                f"(at most {samples}), which {method}'s GEMM refuses below {quant.get(method).min_rows} rows on "
                f"CUDA: {', '.join(missed[:8])}; runner.kernels.quantization.PER_SAMPLE_LINEARS misses them"]


class PhasePeaks:
    """The CUDA allocator's peak bytes per pipeline phase (``text_encode``, ``denoise``, ``vae_decode``): the peak
    statistic is reset as a phase's module starts and read as it ends; :attr:`overall` keeps the maximum across
    resets (the run's own peak reads it, ``runner.app.run.peak_memory``)."""

    overall: int = 0

    def __init__(self) -> None:
        self.peaks: Dict[str, int] = {}

    def attach(self, phases: Mapping[str, Sequence[torch.nn.Module]]) -> None:
        """Hooks on each phase's modules (no device synchronisation: the allocator's counters are host-side)."""
        for phase, mods in phases.items():
            for mod in mods:
                if isinstance(mod, torch.nn.Module):
                    mod.register_forward_pre_hook(lambda m, a: self._start())
                    mod.register_forward_hook(lambda m, a, o, _p=phase: self._end(_p))

    def _start(self) -> None:
        PhasePeaks.overall = max(PhasePeaks.overall, torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    def _end(self, phase: str) -> None:
        peak = torch.cuda.max_memory_allocated()
        PhasePeaks.overall = max(PhasePeaks.overall, peak)
        self.peaks[phase] = max(self.peaks.get(phase, 0), peak)


def quant_kernels(record: Optional[Dict[str, Any]], trace: Any) -> List[str]:
    """Match the quantized transformer's profiled device kernels against its method's signature (recorded in
    ``record["kernels"]``); a GPU trace with none of them is a mismatch. Nothing to match on CPU (no device
    kernels) or for a method without a signature of its own."""
    import re

    if record is None or trace is None or not getattr(trace, "kernels", None):
        return []
    sig = quant.get(record["method"]).signature
    if sig is None:
        return []
    found = sorted(k for k in trace.kernels if re.search(sig, k, re.I))
    record["kernels"] = found[:20]
    return [] if found else [f"model.quantization.transformer={record['method']}: the profiled denoiser forward "
                             f"ran no kernel matching {sig!r}"]


def offload_evidence(probe: Optional[OffloadProbe], mode: str, forwards: int) -> Tuple[Dict[str, Any], List[str]]:
    """``{offload, groups, onloads, bytes_onloaded, bytes_onloaded_per_forward}`` and the mismatches: an offload
    plan under which nothing was onloaded."""
    if probe is None:
        return {"offload": mode, "observed": False}, []
    sec = {"offload": mode, "observed": True, "groups": probe.groups, "onloads": probe.onloads,
           "bytes_onloaded": probe.bytes,
           "bytes_onloaded_per_forward": round(probe.bytes / forwards) if forwards else None}
    bad = [] if probe.onloads or mode == "none" else [
        f"memory.offload={mode}: no onload was observed at diffusers' offload hooks"]
    return sec, bad


# ------------------------------------------------------------------------------------------------ one stage


class Fitting:
    """A diffusion stage's quantization and memory plan, from startup checks to evidence (held by
    ``models.pipelines.PipelineEngine`` as ``fit``).

    Args:
        mem: the run's ``memory`` config; qcfg: the model's ``quantization`` config (None: a model schema without
            one, nothing quantized).
        libraries: component -> library (``diffusers`` | ``transformers``) of the stage's pipeline.
    """

    def __init__(self, mem: Any, qcfg: Any, libraries: Mapping[str, str], platform_kind: str,
                 parallel: Any) -> None:
        self.settings = settings(mem, platform_kind, parallel)
        self.platform_kind = platform_kind
        self.choices = quant_choices(qcfg) if qcfg is not None else {}
        gguf = qcfg.gguf_file if qcfg is not None else None
        self.gguf_file: Optional[str] = None if gguf is None else str(gguf)
        self.libraries = dict(libraries)
        self.plan: Optional[planner.Plan] = None
        self.why = ""
        self.candidates: List[planner.Plan] = []
        self.budget: Optional[int] = None
        self.bound_name: Optional[str] = None  # what the budget is (Fitting.bound): memory.max_gpu_gb or the device
        self.offload_probe: Optional[OffloadProbe] = None
        self.quant_probe: Optional[QuantProbe] = None
        self.peaks: Optional[PhasePeaks] = None
        self.applied: Dict[str, Any] = {}
        self.placed = False
        self.resident: List[torch.nn.Module] = []  # the denoiser blocks a budgeted group_block plan keeps on device
        self.device = ""

    def check(self, ctx: Any, dummy: bool, fuse_qkv: bool, linear_backend: Optional[str],
              batch_size: Optional[int] = None) -> None:
        """Startup refusals of ``model.quantization`` (``runner.kernels.quantization.check``), dummy weights with a
        checkpoint-only method, a GGUF file that is not there, and what cannot combine with a quantized denoiser.

        Raises:
            runner.kernels.quantization.QuantizationError / QuantizationUnavailableError; ConfigValueError.
        """
        import os

        quant.check(self.choices, self.libraries, ctx, self.gguf_file, batch_size)
        if dummy:
            check_dummy_methods(self.choices)
        if self.gguf_file and not os.path.isfile(self.gguf_file):
            raise ConfigValueError(f"model.quantization.gguf_file={self.gguf_file!r} is not a file; fix: the path "
                                   "of the .gguf file")
        denoisers = [c for c in ("transformer", "transformer_2") if c in self.choices]  # Wan 2.2: both experts
        if denoisers and fuse_qkv:
            c = denoisers[0]
            raise ConfigValueError(f"optimize.fuse_qkv=true with model.quantization.{c}="
                                   f"{self.choices[c]}: fusing concatenates the projection weights, "
                                   "which are quantized tensors; fix: optimize.fuse_qkv=false")
        if denoisers and linear_backend not in (None, "TORCH"):
            c = denoisers[0]
            raise ConfigValueError(f"linear backend {linear_backend} with model.quantization.{c}="
                                   f"{self.choices[c]}: both replace the transformer's Linear weights; "
                                   f"fix: backend.linear=TORCH (or auto), or model.quantization.{c}=none")

    def lanes(self) -> List[str]:
        """The lossy lanes of the quantized components (``model.quantization.<component>=<method>``)."""
        return [f"model.quantization.{c}={m}" for c, m in self.choices.items()]

    def choose(self, sizes: Mapping[str, planner.ComponentSize], stages: Sequence[planner.Stage], forwards: int,
               device_total: Optional[int]) -> None:
        """Plan every offload mode and take the requested one (or ``auto``'s), against ``memory.max_gpu_gb`` or
        else ``device_total`` (bytes: the GPU's total memory; None: unknown). Off a GPU (``platform_kind`` not in
        :data:`GPU_KINDS`) ``auto`` takes ``none``: there is no device memory to fit, and the record says so.

        Raises:
            runner.core.memory.MemoryBudgetError: the plan cannot fit (names estimate, budget, cheapest fit).
        """
        s = self.settings
        self.budget, bound = self.bound(device_total)
        self.bound_name = bound if self.budget is not None else None
        if self.bound_name is None and s.max_gpu_gb is not None:
            self.bound_name = f"memory.max_gpu_gb={s.max_gpu_gb:g}"
        # group_block keeps blocks resident up to a bound the run was given: memory.max_gpu_gb, or the device's
        # memory that auto fits against; a configured group_block without a budget streams every block
        fill = self.budget if s.max_gpu_gb is not None or s.offload == "auto" else None
        self.candidates = planner.plans(sizes, stages, "transformer", forwards, s.use_stream, s.blocks_per_group,
                                        s.record_stream, fill)
        where = "memory.offload"
        if s.offload == "auto" and self.platform_kind not in GPU_KINDS:
            self.plan = {p.offload: p for p in self.candidates}["none"]  # the weights stay on this platform's device
            self.why = (f"{where}=auto on platform {self.platform_kind}: no GPU memory to fit, nothing offloaded "
                        "(none)")
            return
        already = [f"memory.{k}=true" for k in ("vae_slicing", "vae_tiling") if getattr(s, k)] + [
            f"model.quantization.{c}={m}" for c, m in self.choices.items()]
        if s.max_gpu_gb is None and s.offload != "auto":  # no budget asked: only the device's memory bounds it
            plan = {p.offload: p for p in self.candidates}[s.offload]
            if device_total is not None and plan.peak > device_total:  # it cannot run here: refused, not an OOM
                planner.choose(s.offload, self.candidates, device_total, where, already, bound)
            self.plan = plan
            fit = f"its peak fits {bound}" if device_total is not None else "nothing to fit against"
            self.why = f"{where}={s.offload} as configured (no memory.max_gpu_gb: {fit}; {where}=auto with a budget chooses)"
            return
        self.plan, self.why = planner.choose(s.offload, self.candidates, self.budget, where, already, bound)

    def bound(self, device_total: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
        """``(bytes, name)`` the plan must fit: ``memory.max_gpu_gb``, capped at ``device_total`` (the GPU's bytes;
        None: unknown) where it is more than the device has (the budget of a shared YAML run on a smaller GPU),
        else the device's total memory; ``name``: what a refusal says it exceeded where that is the device (None:
        the budget, ``memory.max_gpu_gb=<GiB>``)."""
        s = self.settings
        dev = f"the device's {planner.gb(device_total)} GiB" if device_total is not None else None
        if s.max_gpu_gb is None:
            return device_total, dev or "the device's memory"
        budget = int(s.max_gpu_gb * planner.GIB)
        if device_total is not None and budget > device_total:
            return device_total, f"{dev} (memory.max_gpu_gb={s.max_gpu_gb} is more than the device has)"
        return budget, None

    def section(self) -> Dict[str, Any]:
        """The manifest's ``memory_plan``: the plan taken and why, the budget, every candidate's estimate, the
        quantized components, what was applied."""
        return {"offload": self.plan.offload if self.plan else self.settings.offload, "why": self.why,
                "budget_gb": planner.gb(self.budget) if self.budget else None,
                "max_gpu_gb": self.settings.max_gpu_gb, "bound": self.bound_name,
                "planned": self.plan.to_dict() if self.plan else None,
                "candidates": [p.to_dict() for p in self.candidates], "reserve_gb": planner.gb(planner.RESERVE_BYTES),
                "quantization": dict(self.choices), "applied": self.applied}

    def build_device(self, device: str, weight_bytes: Optional[int] = None) -> Tuple[str, Optional[str]]:
        """Where random (``load_format=dummy``) weights are built, and where they are moved once built and
        quantized (``None``: they stay): ``(build, park)``.

        Without an offload plan: on ``device``. Under one, on ``device`` too when ``weight_bytes`` (every
        component in the compute dtype, before quantization) fit its free memory now, then moved to the host
        (``park="cpu"``) before the plan is applied: the same weights as a run without offload (the device's random
        generator, seeded alike) in seconds, where building on the host draws other numbers from the CPU's
        generator and took 397 s for FLUX.1-dev on the H200 (issue #37, ``memory_lanes_h200.json`` budget24
        ``load_s``). Otherwise on the host (float8 weight-only excepted: torchao quantizes it on a GPU only).
        A budget (``memory.max_gpu_gb``) applies from placement on; the build may use more of the device."""
        off = self.plan.offload if self.plan is not None else self.settings.offload
        if off in ("none", "auto"):
            return device, None
        free = 0
        if str(device).startswith("cuda") and torch.cuda.is_available():
            free = torch.cuda.mem_get_info(torch.device(device))[0]
        if (weight_bytes is not None and weight_bytes + planner.RESERVE_BYTES <= free) or \
                "float8wo" in self.choices.values():
            return device, "cpu"
        return "cpu", None

    def defers(self) -> bool:
        """Whether the pipeline is placed only after the engine's install passes (``place`` called from the
        ``placement`` pass) rather than as it loads: under an offload plan.

        diffusers' group offload keys its host copies by the ``Parameter`` objects it saw when applied
        (``ModuleGroup.cpu_param_dict``, pinned copies with ``use_stream``; diffusers 0.42
        ``hooks/group_offloading.py``): a pass that replaces a parameter afterwards (``optimize.fuse_qkv``, FP8
        linear, ``FP8_TORCHAO``) fails every forward with ``KeyError: Parameter containing...``, and one that
        rewrites a parameter's data (LoRA fusion) is undone at the next onload from the stale copy. So every such
        pass runs first, on the host, and the plan is applied to the parameters that will run."""
        plan = self.plan.offload if self.plan is not None else self.settings.offload
        return plan not in ("none", "auto")

    def place(self, pipe: Any, device: str) -> None:
        """The budget on the device, then the pipeline placed under the plan, then the VAE settings."""
        self.placed = True
        torchao_device_copies()  # quantized weights (torchao) move under the offload hooks and pipe.to alike
        s = self.settings
        if s.max_gpu_gb is not None:
            self.applied["budget"] = set_budget(s.max_gpu_gb, device)
        plan = self.plan or planner.Plan(s.offload if s.offload != "auto" else "none", s.use_stream,
                                         s.blocks_per_group, record_stream=s.use_stream and s.record_stream)
        self.applied.update(apply_offload(pipe, plan, device))
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()  # blocks freed by offloading leave the allocator's cache, under the cap
        self.applied.update(apply_vae(pipe, s.vae_tiling, s.vae_slicing))

    def close(self) -> None:
        """Lift the allocator cap this stage set (a later run in the same process starts unbudgeted)."""
        if self.applied.get("budget") and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)

    def attach(self, pipe: Any, device: str, observe: bool) -> None:
        """The probes: offload transfers, quantized Linear calls, per-phase peaks on a CUDA device."""
        comps = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        mode = self.applied.get("offload", "none")
        self.device = str(device)
        kept = set(self.applied.get("resident") or ())
        self.resident = [b for n, b in blocks_in_order(comps["transformer"]) if n in kept] if kept else []
        if observe and mode in ("group_block", "group_leaf"):
            self.offload_probe = OffloadProbe()
            self.offload_probe.watch_groups(list(comps.values()))
        elif observe and mode == "model":
            self.offload_probe = OffloadProbe()
            self.offload_probe.watch_models(comps, device)
        if self.choices:  # what loading quantized (and kept dense) is recorded even where no call is observed
            self.quant_probe = QuantProbe(dict(self.choices), observe=observe)
            self.quant_probe.attach(comps)
        if str(device).startswith("cuda"):
            self.peaks = PhasePeaks()
            vae = comps.get("vae")
            self.peaks.attach({"text_encode": [m for n, m in comps.items() if n.startswith("text_encoder")],
                               "denoise": [m for n, m in comps.items() if n.startswith("transformer")],
                               "vae_decode": [getattr(vae, "decoder", None)]})

    def evidence(self, forwards: int, trace: Any = None) -> Tuple[Dict[str, Any], List[str]]:
        """``evidence.stages.<stage>.memory``: offload transfers, quantized calls, peaks per phase beside the plan;
        with the mismatches.

        Args:
            forwards: denoiser forwards of the run; trace: the profiled denoiser forward
                (``models.denoiser_evidence.KernelTrace``: device kernel names on a GPU).
        """
        off, bad = offload_evidence(self.offload_probe, self.applied.get("offload", "none"), forwards)
        if self.resident:  # where the kept blocks' weights are after the run (a later hook or move would show)
            want = torch.device(self.device)
            devs = {t.device for b in self.resident for t in (*b.parameters(), *b.buffers())}
            off["resident_blocks"], off["resident_on"] = len(self.resident), sorted(map(str, devs))
            if any(d.type != want.type or want.index not in (None, d.index) for d in devs):
                on = off["resident_on"]
                bad.append(f"memory.offload={off['offload']}: the {len(self.resident)} resident denoiser blocks "
                           f"were on {', '.join(on)} after the run, not {self.device}")
        sec: Dict[str, Any] = {"offload": off}
        if self.quant_probe is not None:
            q, qbad = self.quant_probe.section()
            sec["quantization"], bad = q, bad + qbad
            kbad = quant_kernels(q.get("transformer"), trace)
            bad += kbad
        if self.peaks is not None:
            sec["observed_peak_gb"] = {k: planner.gb(v) for k, v in self.peaks.peaks.items()}
            if self.plan is not None:
                planned = self.plan.to_dict()
                sec["planned_peak_gb"] = planned["stages_gb"]
                over = estimate_exceeded(sec["observed_peak_gb"], planned["peak_gb"])
                sec["estimate_exceeded"] = over
                if over:
                    import logging

                    logging.getLogger(__name__).warning(
                        "the memory planner's estimate (%s GiB with its reserve) is below the observed peak of %s; "
                        "a budget this close would be exceeded", planned["peak_gb"],
                        ", ".join(f"{k} {v} GiB" for k, v in over.items()))
        return sec, bad


def estimate_exceeded(observed: Mapping[str, float], planned_peak: float) -> Dict[str, float]:
    """The phases whose observed allocator peak (GiB) is above the plan's peak (GiB, the largest stage's
    estimate plus ``runner.core.memory.RESERVE_BYTES``): where a budget set at the estimate would be exceeded."""
    return {k: v for k, v in observed.items() if v > planned_peak}


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402


def available_bytes(plat: Any) -> Optional[int]:
    """Free bytes where the weights will live: the GPU's free bytes, or the host's ``MemAvailable`` (Linux)."""
    if plat.kind in ("cuda", "rocm"):
        return torch.cuda.mem_get_info(torch.cuda.current_device())[0]
    from pathlib import Path

    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class FittingPass(Pass):
    """``model.quantization`` and ``memory.*`` on a diffusion stage (:mod:`models.passes`), from the engine's
    :class:`Fitting` (``engine.fit``, which loading reads: where components are built, what is quantized, whether
    placement waits for the installs):

    * after the backends are resolved (:meth:`after_resolve`): the fitting made and checked (unknown methods or
      components, unmet requirements), and with every weight on the device and no budget, the weights against the
      free memory; for ``--plan`` (:meth:`prepare_plan`) the fitting of the target platform;
    * with the rows (:meth:`prepare_rows`): the plan of the rows' largest batch shape (:meth:`plan`), refused when
      it cannot fit;
    * at install: an offload plan applied now (the pipeline stayed on the host through the passes before, which
      replace or rewrite parameters: fused LoRA, MoE and linear backends), then the offload, quantization and
      per-phase memory probes on the modules as they will run, before the hooks and compile that wrap them
      (:meth:`Fitting.defers`); ``from_pretrained`` keywords of the quantization (:meth:`load_kwargs`);
    * the evidence of the plan against the observed peaks; the budget's allocator cap lifted at close.

    The engine provides ``task_components(task)``, ``declared_experts()``, ``component_config(name)``,
    ``build_components(...)``, ``size_need()``, ``expected_forwards(batch)``, ``weight_bytes()``.
    """

    name = "memory"

    def fitting(self, platform_kind: str) -> Fitting:
        """A fresh :class:`Fitting` of the stage's ``memory.*`` and ``model.quantization`` for a run on
        ``platform_kind`` (``memory.*`` validated for it; nothing planned yet).

        Raises:
            ConfigValueError: ``memory.*`` that this platform kind cannot take (:func:`settings`).
        """
        e = self.engine
        libs = {c: lib for c, (lib, _m, _k) in e.task_components(e.task).items() if c != "scheduler"}
        return Fitting(e.ctx.run.memory, getattr(e.cfg, "quantization", None), libs, platform_kind, e.ctx.parallel)

    def prepare_plan(self, platform_kind: str) -> None:
        self.engine.fit = self.fitting(platform_kind)

    def after_resolve(self) -> None:
        """Raises:
            runner.kernels.quantization.QuantizationError subclasses; ConfigValueError (also: the weights alone
            cannot fit the free memory, naming the model, the bytes needed and available, and the fix)."""
        from runner.kernels.registry import SelectionContext

        e = self.engine
        run, plat = e.ctx.run, e.ctx.plat
        e.fit = self.fitting(plat.kind)
        lin = e.resolutions.get("linear")
        ctx = SelectionContext(platform_kind=plat.kind, sm=plat.sm, dtype=e.dtype)
        e.fit.check(ctx, e.source.get("kind") == "dummy", bool(run.optimize.fuse_qkv),
                    None if lin is None else str(lin.selected), int(run.batch_size))
        check_checkpoints(e.fit.choices, e.source, list(e.fit.libraries), ctx, e.model_cfg.name)
        s = e.fit.settings
        if s.max_gpu_gb is None and (s.offload == "none" or (s.offload == "auto" and plat.kind not in GPU_KINDS)):
            self.check_free_memory()  # every weight on the device

    def check_free_memory(self) -> None:
        """Refuse before loading when the weights alone cannot fit (``load_format=dummy`` sizes are exact).

        Raises:
            ConfigValueError: naming the model, the bytes needed and available, and the fix.
        """
        e = self.engine
        need = e.weight_bytes()
        have = available_bytes(e.ctx.plat)
        if need is None or have is None or need <= have:
            return
        fix = ("memory.offload=auto (the planner keeps on the device what fits and offloads the rest), a weight "
               "quantization (model.quantization.transformer=int8wo), or a device with more free memory (another "
               "process may hold some: nvidia-smi)" if e.ctx.plat.kind in GPU_KINDS else
               "run it on a GPU (platform=cuda dtype=bfloat16), or use model=tiny_flux / model=toy_shapes on this "
               "machine")
        raise ConfigValueError(
            f"model={e.model_cfg.name} needs {need / 2**30:.1f} GiB for its weights in "
            f"{str(e.dtype).replace('torch.', '')} on {e.ctx.plat.device}, but only {have / 2**30:.1f} GiB "
            f"is free; fix: {fix}")

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """With an offload plan, ``auto`` or a budget, and on a CUDA device always: :meth:`plan` against the
        device's total memory (refused when it cannot fit). Without a budget the plan is the one asked for
        (``none``: everything on the device), recorded so that the evidence sets the estimate beside the observed
        peak per phase; ``auto`` off a GPU is ``none``, recorded with why."""
        e = self.engine
        fit, plat = e.fit, e.ctx.plat  # plat None: rows read without a platform (a Ray driver splitting the items)
        on_gpu = plat is not None and str(plat.device).startswith("cuda") and torch.cuda.is_available()
        if fit is None or not rows or plat is None or (not on_gpu and fit.settings.offload == "none"
                                                       and fit.settings.max_gpu_gb is None):
            return rows  # on a GPU every run is planned: its evidence holds the estimate beside the observed peaks
        self.plan(rows, device_total(plat.device) if on_gpu else None)
        return rows

    def plan(self, rows: Sequence[Any], total: Optional[int]) -> Dict[str, Any]:
        """The one planning step of a run (:meth:`prepare_rows`) and of ``--plan`` (``runner.tools.plan``): size every
        component on the meta device, estimate the activations of the rows' largest batch shape
        (:meth:`stages`), plan every offload mode and choose (:meth:`Fitting.choose`) against ``memory.max_gpu_gb``
        or else ``total`` (the GPU's bytes; None: unknown).

        Returns:
            ``fit.section()``: the manifest's ``memory_plan`` as it stands before placement (``applied`` empty).

        Raises:
            runner.core.memory.MemoryBudgetError: no plan asked for fits (``fit.candidates`` hold the estimates).
        """
        import os

        from runner.core.dataset import Item

        e = self.engine
        fit = e.fit
        gguf = os.path.getsize(fit.gguf_file) if fit.gguf_file else None
        sizes = component_sizes(self.meta_modules(), fit.choices, gguf, checkpoint_bytes(e.source, fit.choices))
        forwards = max(e.expected_forwards([Item(row=r, index=0, seed=0)]) or 1 for r in rows)
        fit.choose(sizes, self.stages(rows), forwards, total)
        return fit.section()

    def meta_modules(self) -> Dict[str, Any]:
        """Every model component on the meta device (no memory), from the architecture or the snapshot's configs;
        an optional expert the snapshot lacks (``declared_experts``: Wan 2.1 has no ``transformer_2``) is left
        out."""
        e = self.engine
        if e.source.get("kind") in ("dummy", "embedded"):
            return e.build_components(e.arch_copy(), device="meta", dtype=e.dtype, task=e.task)
        return meta_components(self.present_components(), e.component_config, e.dtype)

    def present_components(self) -> Dict[str, Tuple[str, str, Optional[str]]]:
        """The task's components without an optional expert the model lacks (``declared_experts``: Wan 2.1 and
        TI2V-5B have no ``transformer_2``), known before loading."""
        e = self.engine
        has = set(e.declared_experts())
        return {k: v for k, v in e.task_components(e.task).items()
                if k in has or e.spec is None or not e.spec.optional(k)}

    def stages(self, rows: Sequence[Any]) -> List[Any]:
        """The phases of the largest batch shape with each component's activation bytes."""
        from runner.core.memory import Stage

        e = self.engine
        run = e.ctx.run
        big = max(rows, key=lambda r: r.width * r.height * (getattr(r, "num_frames", None) or 1))
        batch = max(1, min(int(run.batch_size), len(rows) * int(run.num_images_per_prompt)))
        elem = torch.empty((), dtype=e.dtype).element_size()
        need = e.size_need() or 16
        frames = getattr(big, "num_frames", None) or 1
        latent_frames = (frames - 1) // 4 + 1 if e.video else 1  # Wan's VAE: 4x temporal (first frame alone)
        seq = int(e.cfg.generation.max_sequence_length)
        tokens = (big.width // need) * (big.height // need) * latent_frames + seq
        guided = e.spec is not None and e.spec.cfg == "batched" and (big.guidance_scale or 0) > 1
        present = self.present_components()
        encoders = {n: e.component_config(n) for n in present if n.startswith("text_enc")}
        den = {n: denoiser_activations(e.component_config(n), batch * (2 if guided else 1), tokens, elem)
               for n in present if n.startswith("transformer")}
        s = e.fit.settings
        vae = decoder_activations(e.component_config("vae"), batch, frames, big.height, big.width, elem,
                                  s.vae_tiling, s.vae_slicing, present["vae"][1] if "vae" in present else None)
        return [Stage("text_encode", text_activations(encoders, batch, seq, elem)),
                Stage("denoise", den), Stage("vae_decode", {"vae": vae})]

    def load_kwargs(self, path: Any) -> Dict[str, Any]:
        """``from_pretrained`` keywords of ``model.quantization``: diffusers' ``PipelineQuantizationConfig`` and a
        GGUF component loaded from its file (its config from the snapshot's component dir)."""
        e = self.engine
        fit = e.fit
        out: Dict[str, Any] = {}
        before_loading(fit.choices)
        apart = on_device_components(fit.choices)
        metas = self.meta_modules() if needs_names(fit.choices) else {}
        q = pipeline_quantization({c: m for c, m in fit.choices.items() if c not in apart}, fit.libraries, e.dtype,
                                  metas)
        if q is not None:
            out["quantization_config"] = q
        for comp in apart:
            lib, cls_name, _ = e.task_components(e.task)[comp]
            method = quant.get(fit.choices[comp])
            out[comp] = load_on_device(getattr(importlib.import_module(lib), cls_name), str(path), comp,
                                       method.config(fit.libraries[comp], e.dtype,
                                                     keep_dense(method.name, metas.get(comp))),
                                       e.dtype, str(e.device))
        for comp, method in fit.choices.items():
            if method == "gguf":
                lib, cls_name, _ = e.task_components(e.task)[comp]
                model_cls = getattr(importlib.import_module(lib), cls_name)
                out[comp] = load_gguf(model_cls, str(fit.gguf_file), str(path / comp), e.dtype)
        return out


    def install(self, sections: Dict[str, Any]) -> None:
        e = self.engine
        fit = e.fit
        if fit is None:
            return
        if not fit.placed:
            fit.place(e.pipe, e.device)
        fit.attach(e.pipe, e.device, e.observe)
        sections["memory_plan"] = fit.section()

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        """``memory``: the plan's estimate beside the observed peak per phase, and the offload and quantization
        observed (:meth:`Fitting.evidence`), when anything was planned, applied or measured."""
        e = self.engine
        fit = e.fit
        if fit is None or not (fit.choices or fit.applied.get("offload", "none") != "none" or fit.peaks is not None):
            return []
        trace = getattr(e.probe, "trace", None) if e.probe is not None else None
        section["memory"], bad = fit.evidence(e.want_forwards or 0, trace)
        return list(bad)

    def close(self) -> None:
        if self.engine.fit is not None:
            self.engine.fit.close()
