"""The memory planner (``memory.*``): how much accelerator memory each stage of a pipeline call needs under each
offload plan, which plans fit ``memory.max_gpu_gb``, and which one ``memory.offload=auto`` takes.

Pure: it reads module sizes (modules built on the meta device take no memory) and activation estimates, and
never touches a device. ``models.memory`` feeds it from the pipeline's component configs and applies the plan.

**Weights.** Each component is sized from its modules the way diffusers groups them
(``diffusers/hooks/group_offloading.py``, 0.42): *block level* makes one group of every ``num_blocks_per_group``
entries of each top-level ``nn.ModuleList``/``nn.Sequential`` child and keeps everything else (the "unmatched"
modules and the top-level parameters) as one group onloaded while the component runs; with ``use_stream`` the next
group is prefetched (two groups resident; three with ``record_stream``, whose freed group waits for the compute
stream) and ``num_blocks_per_group`` is forced to 1. *Leaf level* makes every
leaf module its own group (two resident with a stream). Quantized ``nn.Linear`` weights count at the method's bits
(``runner.kernels.quantization.WeightQuant.bits``).

**Plans, resident bytes while component ``c`` runs** (``W_c`` its weights, ``A_c`` its activations):

* ``none``: every component on the device: ``sum(W) + A_c``.
* ``model`` (``enable_model_cpu_offload``: one component on the device at a time): ``W_c + A_c``.
* ``group_block``: ``unmatched_c + k * n * max_block_c + A_c`` (``k`` = 2 with a stream, else 1); a component
  without top-level block lists (T5's blocks sit in ``encoder.block``, one level down) is offloaded leaf by leaf,
  as under ``group_leaf``: block level would make all of it one group, resident whole while it runs (FLUX.1-dev's
  T5-XXL: 8.9 GiB, which decided budget12's plan).
* ``group_leaf``: ``k * max_leaf_c + other_c + A_c`` (``other_c``: parameters outside any leaf module).
* under ``memory.max_gpu_gb``, ``group_block`` keeps the denoiser's leading blocks on the device while the budget,
  less :func:`resident_margin`, allows (:func:`keep_resident`): their bytes ``R`` join every stage and leave the
  bytes moved per forward.

The planned peak is the largest stage's, plus :data:`RESERVE_BYTES`. **Speed order** (``auto`` takes the first
that fits): by bytes moved host-to-device per pipeline call, none (0) < model (every component once) < group_block
= group_leaf (the denoiser's weights once per denoiser forward), block before leaf (fewer, larger copies).

**Activations** (bytes; ``B`` batch of the largest batch shape, ``e`` bytes per element of the compute dtype):

* denoiser, per transformer block: ``B * S * D * e * (7 + 3 r)``: the residual, the normed input, the query, key
  and value with their rotary copies in flight, the attention output, the MLP hidden before and after its
  activation (``2 r``) and a concatenation of attention and MLP output (``1 + r``; FLUX's single blocks,
  ``diffusers/models/transformers/transformer_flux.py``), an upper bound for the other blocks; ``S`` image + text
  tokens, ``D`` the inner width, ``r`` the MLP ratio. Attention itself adds no ``S x S`` term (SDPA's fused
  kernels). Measured on the H200 (FLUX.1-dev, batch 16, 1024^2, bf16,
  ``benchmarks/results/memory_lanes_h200_2026-12-03_partial.json``): 8.1 GiB above the weights while denoising,
  19.2 ``B S D e`` (``4 + 3 r`` planned 16, 1 GiB low).
* a text encoder: ``B * S * e * (2 H + 3 F) + B * heads * S^2 * (2 * 4 + 2 e)``: hidden and gated-MLP tensors,
  the eager attention's fp32 scores and probabilities, and the scores and the position bias in the compute dtype
  (T5 adds its bias to materialised scores, then takes the softmax in fp32). Measured on the H200 (FLUX.1-dev's
  T5-XXL, batch 16, 512 tokens, bf16, ``benchmarks/results/memory_lanes_h200_2026-12-03_partial.json``): 12.06 GiB
  observed where ``2 * 4`` alone planned 11.46.
* the VAE decoder: ``3.5 u + min(u, 1 GiB)`` with ``u = B' * F * Hpx * Wpx * C * e``: the first ResNet at full
  resolution holds its input (kept for the shortcut), the GroupNorm and SiLU outputs at ``C`` channels and its
  conv's output at ``C / 2`` (3.5 ``u``), plus cuDNN's convolution workspace; ``C`` the channels of the
  full-resolution upsampler (``block_out_channels[1]``). Measured on the H200 (FLUX's VAE, 1024^2, bf16): 28.0 GiB
  of activations at batch 16 (3.5 ``u``; ``3 u`` planned 24) and 2.45 GiB sliced (4.9 ``u``: the workspace does
  not shrink with the batch). ``B'`` = 1 with ``memory.vae_slicing`` (one
  image at a time), ``Hpx x Wpx`` = the tile (``AutoencoderKL.tile_sample_min_size``) with ``memory.vae_tiling``.
* Wan's causal video VAE decoder (``AutoencoderKLWan``): ``B' Hd Wd e (2 K + 7.5 T C_in) + min(B' T Hd Wd C_up e,
  1 GiB)`` plus two copies of the decoded video ``B x 3 x F x H x W`` (five tiled), bytes
  (:func:`causal_decoder_activation`, ``models.memory.decoder_activations``). From diffusers 0.42.1
  ``models/autoencoders/autoencoder_kl_wan.py``: ``AutoencoderKLWan._decode`` runs ``WanDecoder3d`` once per latent
  frame, each call decoding a chunk of ``T = 2 ** sum(temperal_downsample)`` frames (4) at ``Hd x Wd`` = the pixels
  over ``patch_size`` (Wan 2.2 decodes at H/2 x W/2 and ``unpatchify``-s 12 channels to 3); every
  ``WanCausalConv3d`` that is called with a cache keeps the last ``CACHE_T`` = 2 frames of its input across calls
  (``feat_cache``), so ``K`` sums those inputs' channels, each scaled by its resolution's area over ``Hd x Wd``
  (``models.memory.wan_decoder_geometry``: Wan 2.1 1182.25, Wan 2.2 3568.75). On top of the caches, the chunk's
  transient at full resolution: the last upsampler's float32 ``nearest-exact`` output and its bf16 copy
  (``WanUpsample``), the ResNets' float32 RMS norms (``WanRMS_norm``), the causal conv's ``torch.cat`` with its cache
  and ``F.pad`` copy, Wan 2.2's ``x_copy`` shortcut (``WanResidualUpBlock``): 7.0 to 7.5 ``B T Hd Wd C_in e``,
  ``C_in`` the last up block's input channels (Wan 2.1 96, Wan 2.2 512), measured on the CPU with diffusers'
  modules (random weights, bf16, live tensor storages counted after every aten op,
  ``benchmarks/vae_decode_peak.py``, ``benchmarks/results/vae_decode_peak_cpu_2026-12-06.json``): exactly linear
  in ``H W`` and in the batch, the caches matching ``K`` to the byte; 7.5 is the largest seen (Wan 2.1 at batch
  2). The workspace allowance is the AutoencoderKL rule's: cuDNN's, at most the full-resolution upsampler conv's
  input (``C_up`` = ``(decoder_base_dim or base_dim) * dim_mult[1]``), capped at 1 GiB. Against the H100
  observations: Wan 2.1 14B at 832x480x81 (``benchmarks/results/memory_lanes_h100_2026-12-06_wan48.json``) 4.55 GiB
  of decode activations observed (the peak less the recorded weights), 4.83 planned, 3.95 from the CPU
  measurement's rule (the 0.60 GiB between taken to be cuDNN's workspace: not measured on a GPU); Wan 2.2 TI2V-5B at
  1280x704x121 (``benchmarks/results/families_h100_2026-12-06_flux2_klein_wan22_ti2v.log``) 10.90 observed (the
  peak less the planned weights; that run shared its process with the families benchmark, so what else was
  resident is not recorded), 11.52 planned, 9.62 from the CPU measurement. The rule before
  (``3.5 u + min(u, 1 GiB)`` with ``u`` at ``base_dim * dim_mult[1]`` channels over the full pixels, no caches)
  planned 2.93 and 9.74. With ``memory.vae_slicing`` ``B'`` = 1 (the
  video term keeps ``B``: the slices and their ``torch.cat``); with ``memory.vae_tiling`` ``Hd x Wd`` is one
  256^2 tile (``AutoencoderKLWan.tile_sample_min_height``) and the video is held five times (the tiles with their
  overlaps, the blended rows, their ``torch.cat``, the clamped result).
* LTX-2's and HunyuanVideo-1.5's video VAE decoders (``AutoencoderKLLTX2Video``, ``AutoencoderKLHunyuanVideo15``)
  decode the whole video in one decoder call (diffusers 0.42.1 ``_decode``: no frame chunks, no caches; tiling and
  frame-wise decoding off unless asked for, and neither pipeline asks), so the peak is at the last up block, whose
  ``C`` channels span all ``T`` output frames at ``Hd x Wd`` (``models.memory.ltx2_decoder_geometry`` /
  ``hunyuan15_decoder_geometry``, ``decoder_levels``): LTX-2 128 channels at the pixels over ``patch_size`` 4 (768x512
  x 121: 121 x 128 x 192), HunyuanVideo-1.5 128 channels at the full pixels (848x480x121). What is live there, read off
  the modules and matched by the CPU measurement (``benchmarks/vae_decode_peak.py``,
  ``benchmarks/results/vae_decode_peak_cpu_ltx2_hunyuan_2026-12-06.json``; full-size configs, small shapes):
  LTX-2 (:func:`ltx2_decoder_activation`) in a ResNet's conv: its input (kept for the residual), the SiLU output,
  the causal conv's ``torch.concatenate`` with its edge frames (``T + 2``), the reflect ``F.pad`` copy
  (``(T + 2)(Hd + 2)(Wd + 2)``), the conv's output, and the up block's input held by the decoder's loop;
  HunyuanVideo-1.5 (:func:`hunyuan15_decoder_activation`) in the RMS norm of the last block's 2nd and 3rd ResNets:
  the block's input, the ResNet's residual, conv1's output, and ``HunyuanVideo15RMS_norm``'s float32 upcast and its
  normalised float32 copy (7 ``u`` in bf16, ``u = B C T Hd Wd e``), to the byte; its mid-block attention adds
  ``S^2 e`` for the ``(S, S)`` causal mask over the ``S = t h w`` latent tokens (never the peak at these sizes: 4.5
  GiB at the 480p default), taken as ``S^2 e (1 + 2 B)`` with the scores. Plus :func:`workspace_allowance`, the
  Wan rule's cuDNN allowance: ``min(u, 1 GiB)``. Measured on the CPU the estimate is 1.21 to 1.24x the live tensors
  (LTX-2) and 1.14 to 1.15x (HunyuanVideo-1.5). At the defaults (batch 1, bf16): LTX-2 768x512x121 4.51 GiB (the
  rule before, ``AutoencoderKL``'s at ``block_out_channels[1]`` = 512 channels over the full pixels: 159.8; tiled
  3.01, before 106.9), HunyuanVideo-1.5 848x480x121 83.4 untiled (before: 83.2, right by chance: 256 channels x 3.5 = 128 x 7) and
  14.6 tiled (before: 50.6). With ``memory.vae_slicing`` ``B'`` = 1 and the videos decoded before held; with
  ``memory.vae_tiling`` (LTX-2: 512^2 tiles every 448 pixels, HunyuanVideo-1.5: 256^2 every 192) each tile through
  all frames beside the outputs of the tiles before it (held until they are blended), and at the end the tiles'
  outputs and two copies of the video (``models.memory.whole_video_decoder_activations``).

These are estimates (the manifest records the observed peak per stage beside them).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from runner.core.errors import RefusedError

GIB = 2 ** 30
#: Headroom over the estimate for the allocator's rounding and fragmentation and the GEMM workspaces (a margin
#: chosen, not measured).
RESERVE_BYTES = 512 * 2 ** 20
OFFLOAD_MODES = ("none", "model", "group_block", "group_leaf")
#: Leaf modules diffusers' leaf-level offloading makes groups of (``_GO_LC_SUPPORTED_PYTORCH_LAYERS``).
LEAF_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
              torch.nn.ConvTranspose3d, torch.nn.Linear, torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.Embedding)


class MemoryBudgetError(RefusedError):
    """The requested plan cannot fit ``memory.max_gpu_gb`` (names the estimate, the budget and the cheapest plan
    that fits, or that none does)."""


@dataclass(frozen=True)
class ComponentSize:
    """One pipeline component's bytes as the offload plans see them.

    Attributes:
        name: the pipeline component (``transformer``, ``text_encoder_2``, ``vae``).
        weights: all parameter and buffer bytes (quantized Linears at their bits).
        unmatched: bytes outside the top-level block lists (block level keeps them resident while it runs).
        blocks: bytes of each entry of the top-level block lists, in order.
        max_leaf: the largest leaf module's bytes (leaf level).
        other: bytes outside every leaf module (leaf level keeps them resident).
    """

    name: str
    weights: int
    unmatched: int
    blocks: Tuple[int, ...] = ()
    max_leaf: int = 0
    other: int = 0


def tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``: its inner tensors' for a tensor subclass that flattens (torchao's), else
    ``numel * element_size`` (meta tensors included)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.nn.Parameter and type(t) is not torch.Tensor:
        names, _ = flatten()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def _bytes(tensors: Iterable[torch.Tensor], linear_bits: Optional[float], linear_weights: set) -> int:
    total = 0
    for t in tensors:
        if linear_bits is not None and id(t) in linear_weights:
            total += int(-(-t.numel() * linear_bits // 8))
        else:
            total += tensor_bytes(t)
    return total


def size_module(name: str, module: torch.nn.Module, linear_bits: Optional[float] = None,
                file_bytes: Optional[int] = None, dense: Iterable[str] = ()) -> ComponentSize:
    """A component's :class:`ComponentSize` from its module (meta device: no memory).

    Args:
        linear_bits: bits per ``nn.Linear`` weight element when the component is quantized (None: as stored).
        file_bytes: a GGUF component's file size, which replaces the weights' total (blocks scaled to it).
        dense: qualified names of Linears the quantization leaves as stored
            (``runner.kernels.quantization.kept_dense``).
    """
    keep = set(dense)
    lw = {id(m.weight) for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and n not in keep}

    def own(m: torch.nn.Module) -> int:
        return _bytes(list(m.parameters()) + list(m.buffers()), linear_bits, lw)

    total = own(module)
    blocks: List[int] = []
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            blocks.extend(own(b) for b in child)
    leaves = [m for m in module.modules() if isinstance(m, LEAF_TYPES)]
    in_leaf = sum(own(m) for m in leaves)
    max_leaf = max((own(m) for m in leaves), default=0)
    if file_bytes is not None and total:
        f = file_bytes / total
        return ComponentSize(name, int(file_bytes), int((total - sum(blocks)) * f), tuple(int(b * f) for b in blocks),
                             int(max_leaf * f), int((total - in_leaf) * f))
    return ComponentSize(name, total, total - sum(blocks), tuple(blocks), max_leaf, total - in_leaf)


# ------------------------------------------------------------------------------------------------ activations


def denoiser_activation(batch: int, tokens: int, inner: int, mlp_ratio: float, elem: int) -> int:
    """Peak activation bytes of one transformer block: ``B * S * D * e * (7 + 3 r)`` (module docstring)."""
    return int(batch * tokens * inner * elem * (7 + 3 * mlp_ratio))


def encoder_activation(batch: int, seq: int, hidden: int, ff: int, heads: int, elem: int) -> int:
    """Peak activation bytes of a text encoder layer: ``B S e (2 H + 3 F) + B heads S^2 (2 * 4 + 2 e)`` (module
    docstring)."""
    return int(batch * seq * elem * (2 * hidden + 3 * ff) + batch * heads * seq * seq * (2 * 4 + 2 * elem))


def decoder_activation(batch: int, frames: int, height: int, width: int, channels: int, elem: int) -> int:
    """Peak activation bytes of an image VAE decoder (``AutoencoderKL``): ``3.5 u + min(u, 1 GiB)``,
    ``u = B * F * H * W * C * e`` (module docstring)."""
    unit = batch * frames * height * width * channels * elem
    return int(3.5 * unit + min(unit, GIB))


#: Frames each causal conv of Wan's decoder caches from its input (``CACHE_T``, diffusers 0.42.1
#: ``models/autoencoders/autoencoder_kl_wan.py``).
CAUSAL_CACHE_FRAMES = 2
#: The transient of one decoded chunk at full decoder resolution, in ``B * T * Hd * Wd * C_in * e`` (measured on the
#: CPU with both Wan VAEs: 7.0 to 7.5; module docstring).
CAUSAL_TRANSIENT = 7.5


def causal_decoder_activation(batch: int, chunk: int, height: int, width: int, cache_channels: float, last_in: int,
                              upsampled: int, elem: int) -> int:
    """Peak activation bytes of a causal video VAE decoder (Wan's) decoding one latent frame at a time, the decoded
    video excluded: ``B Hd Wd e (2 K + 7.5 T C_in) + min(B T Hd Wd C_up e, 1 GiB)`` (module docstring).

    Args:
        batch: ``B``, the videos decoded at once; chunk: ``T``, the frames one latent frame decodes to;
        height, width: ``Hd x Wd``, the decoder's output resolution (pixels / the patch size);
        cache_channels: ``K``, the channels of every causal conv's input, each divided by its resolution's area
            ratio to ``Hd x Wd`` (``models.memory.wan_decoder_geometry``); last_in: ``C_in``, the last up block's
            input channels; upsampled: ``C_up``, the channels the last upsampler brings to ``Hd x Wd``.
    """
    px = batch * height * width * elem
    workspace = min(batch * chunk * height * width * upsampled * elem, GIB)
    return int(px * (CAUSAL_CACHE_FRAMES * cache_channels + CAUSAL_TRANSIENT * chunk * last_in) + workspace)


def workspace_allowance(unit: int) -> int:
    """What a video decoder's estimate adds for cuDNN's convolution workspace, which the CPU measurement cannot
    show: its full-resolution tensor's bytes ``unit``, at most 1 GiB (module docstring)."""
    return min(unit, GIB)


def ltx2_decoder_activation(batch: int, level: Sequence[int], prev: Sequence[int], elem: int,
                            reflect: bool = True, out_channels: int = 48) -> int:
    """Peak activation bytes of LTX-2's video VAE decoder (``LTX2VideoDecoder3d``), the whole video in one call:
    the larger of a ResNet conv of the last up block, ``C (T + 2) (4 Hd Wd + (Hd + 2) (Wd + 2)) + C_in T_in H_in
    W_in``, and ``conv_out``, ``C (T + 2) (2 Hd Wd + (Hd + 2) (Wd + 2)) + C_out T Hd Wd``, times ``B e``; plus
    ``min(B C T Hd Wd e, 1 GiB)`` (module docstring; the ``(Hd + 2) (Wd + 2)`` term only with a reflect / replicate
    spatial padding).

    Args:
        level: ``(C, T, Hd, Wd)``, the last up block's channels, frames and resolution (the pixels over
            ``patch_size``); prev: the same of that block's input (the level before it); out_channels:
            ``C_out``, ``conv_out``'s (``3 * patch_size ** 2 * patch_size_t``).
    """
    c, t, h, w = level
    pad = (t + 2) * (h + 2) * (w + 2) * int(reflect)
    resnet = c * ((t + 2) * 4 * h * w + pad) + math.prod(prev)
    conv_out = c * ((t + 2) * 2 * h * w + pad) + out_channels * t * h * w
    return int(batch * elem * max(resnet, conv_out) + workspace_allowance(batch * c * t * h * w * elem))


#: Float32 copies a ``HunyuanVideo15RMS_norm`` makes of a half-precision input: the upcast and the normalised result.
RMS_FLOAT_COPIES = 2


def hunyuan15_decoder_activation(batch: int, level: Sequence[int], mid: Sequence[int], elem: int) -> int:
    """Peak activation bytes of HunyuanVideo-1.5's video VAE decoder (``HunyuanVideo15Decoder3D``), the whole video
    in one call: the largest of its last up block's RMS norm, ``B T Hd Wd (C (3 e + 4 k) + 4)`` (``k`` =
    :data:`RMS_FLOAT_COPIES` in half precision, 1 in float32), that block's conv, ``B C e (4 T Hd Wd + (T + 2)
    (Hd + 2) (Wd + 2))``, and the mid block's attention over ``S`` latent tokens, ``S^2 e (1 + 2 B) + 8 B S C_mid
    e``; plus ``min(B C T Hd Wd e, 1 GiB)`` (module docstring).

    Args:
        level: ``(C, T, Hd, Wd)``, the last up block's channels, frames and resolution (the output's);
        mid: ``(C_mid, S)``, the mid block's channels and latent tokens ``t h w``.
    """
    c, t, h, w = level
    px = t * h * w
    floats = RMS_FLOAT_COPIES if elem < 4 else 1
    norm = px * (c * (3 * elem + 4 * floats) + 4)
    conv = c * elem * (4 * px + (t + 2) * (h + 2) * (w + 2))
    c_mid, s = mid
    attention = s * s * elem * (1 + 2 * batch) + 8 * batch * s * c_mid * elem
    return int(max(batch * max(norm, conv), attention) + workspace_allowance(batch * c * px * elem))


# ------------------------------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class Stage:
    """One phase of a pipeline call: the components it runs (``text``: the encoders, one after the other) and
    each one's activation bytes."""

    name: str
    activations: Mapping[str, int]


@dataclass
class Plan:
    """One offload plan's estimate.

    Attributes:
        offload: one of :data:`OFFLOAD_MODES`.
        use_stream, blocks_per_group, record_stream: its group-offload settings.
        stages: stage -> planned peak bytes (weights resident + activations), :data:`RESERVE_BYTES` excluded.
        peak: the largest stage's bytes plus :data:`RESERVE_BYTES`.
        moved: bytes copied host-to-device per pipeline call (the speed order).
        resident_blocks, resident_bytes: the denoiser's leading blocks kept on the device under ``group_block``
            (:func:`keep_resident`: what a budget leaves beside the streamed plan) and their bytes.
    """

    offload: str
    use_stream: bool
    blocks_per_group: int
    stages: Dict[str, int] = field(default_factory=dict)
    peak: int = 0
    moved: int = 0
    record_stream: bool = False
    resident_blocks: int = 0
    resident_bytes: int = 0

    def to_dict(self) -> Dict[str, Any]:
        return {"offload": self.offload, "use_stream": self.use_stream, "blocks_per_group": self.blocks_per_group,
                "record_stream": self.record_stream, "peak_gb": gb(self.peak), "stages_gb": {k: gb(v) for k, v in self.stages.items()},
                "moved_per_call_gb": gb(self.moved), "resident_blocks": self.resident_blocks,
                "resident_gb": gb(self.resident_bytes)}


def gb(n: float) -> float:
    """Bytes as GiB, 3 decimals."""
    return round(n / GIB, 3)


def _resident(c: ComponentSize, mode: str, stream: bool, n: int, total: int, record: bool = False) -> int:
    k = (3 if record else 2) if stream else 1
    if mode == "none":
        return total
    if mode == "model":
        return c.weights
    if mode == "group_block" and c.blocks:
        n = 1 if stream else n
        top = max((sum(c.blocks[i:i + n]) for i in range(0, len(c.blocks), n)), default=0)
        return c.unmatched + k * top
    return c.other + k * c.max_leaf


def plan(mode: str, sizes: Mapping[str, ComponentSize], stages: Sequence[Stage], denoiser: str, forwards: int,
         use_stream: bool = True, blocks_per_group: int = 1, record_stream: bool = False) -> Plan:
    """The estimate of offload plan ``mode`` (module docstring).

    Args:
        sizes: component -> its size; stages: the call's phases in order; denoiser: the component run ``forwards``
            times per call (its weights move once per forward under group offload).
    """
    total = sum(c.weights for c in sizes.values())
    record = use_stream and record_stream
    p = Plan(mode, use_stream, 1 if use_stream else blocks_per_group, record_stream=record)
    for st in stages:
        p.stages[st.name] = max((_resident(sizes[c], mode, use_stream, blocks_per_group, total, record) + a
                                 for c, a in st.activations.items() if c in sizes), default=0)
    p.peak = max(p.stages.values(), default=0) + RESERVE_BYTES
    others = total - (sizes[denoiser].weights if denoiser in sizes else 0)
    den = sizes[denoiser].weights if denoiser in sizes else 0
    p.moved = {"none": 0, "model": total}.get(mode, others + den * max(1, forwards))
    return p


def resident_margin(budget: int) -> int:
    """Bytes of a budget that :func:`keep_resident` leaves unfilled beyond :data:`RESERVE_BYTES`: 5 % of it, at
    least 1 GiB (the estimates have been up to 1.6 GiB low per stage before a correction: Wan's VAE decoder on the
    H100, ``benchmarks/results/memory_lanes_h100_2026-12-06_wan48.json``; a chosen margin, not a measured one)."""
    return max(GIB, budget // 20)


def keep_resident(p: Plan, sizes: Mapping[str, ComponentSize], denoiser: str, forwards: int, budget: int) -> Plan:
    """``p`` with the denoiser's leading blocks kept on the device while the budget allows (a ``group_block`` plan
    with one block per group: streams, or ``blocks_per_group=1``); otherwise ``p`` unchanged.

    The blocks are taken in order (diffusers' block order: each top-level block list's entries, lists in module
    order) while their bytes stay within ``budget - p.peak - resident_margin(budget)``; they are resident through
    every stage (each stage's estimate grows by their bytes), and no longer move: ``moved`` shrinks by their bytes
    once per denoiser forward. Streaming every block leaves most of a large budget unused (FLUX.1-dev under 24 GiB:
    a 9.9 GiB plan, 22.2 GiB of transformer weights copied per step, 1.058x lossless on the H100,
    ``benchmarks/results/memory_lanes_h100_2026-12-06_b.json``; the issue's target is 1.05).
    """
    c = sizes.get(denoiser)
    if p.offload != "group_block" or c is None or not c.blocks or p.blocks_per_group != 1:
        return p
    spare = budget - p.peak - resident_margin(budget)
    n = kept = 0
    for b in c.blocks:
        if kept + b > spare:
            break
        n, kept = n + 1, kept + b
    if n == 0:
        return p
    return Plan(p.offload, p.use_stream, p.blocks_per_group, {k: v + kept for k, v in p.stages.items()},
                p.peak + kept, p.moved - kept * max(1, forwards), p.record_stream, n, kept)


def plans(sizes: Mapping[str, ComponentSize], stages: Sequence[Stage], denoiser: str, forwards: int,
          use_stream: bool = True, blocks_per_group: int = 1, record_stream: bool = False,
          budget: Optional[int] = None) -> List[Plan]:
    """Every offload plan, fastest first (:data:`OFFLOAD_MODES` is that order); with ``budget`` (bytes:
    ``memory.max_gpu_gb``) ``group_block`` keeps what the budget allows of the denoiser resident
    (:func:`keep_resident`)."""
    out = [plan(m, sizes, stages, denoiser, forwards, use_stream, blocks_per_group, record_stream)
           for m in OFFLOAD_MODES]
    return out if budget is None else [keep_resident(p, sizes, denoiser, forwards, budget) for p in out]


def choose(requested: str, candidates: Sequence[Plan], budget: Optional[int],
           where: str = "memory.offload", already: Sequence[str] = (), bound: Optional[str] = None
           ) -> Tuple[Plan, str]:
    """The plan to run and why.

    Args:
        requested: ``auto`` or one of :data:`OFFLOAD_MODES`.
        candidates: :func:`plans`, fastest first.
        budget: bytes the plan must fit (``memory.max_gpu_gb``, else the device's total memory, as the caller
            decides); None: no limit (``auto`` takes ``none``).
        already: the settings in effect that a fix could otherwise suggest (``memory.vae_slicing=true``,
            ``memory.vae_tiling=true``, ``model.quantization.transformer=<method>``): a fix never suggests them.
        bound: what ``budget`` is, for the messages (default ``memory.max_gpu_gb=<GiB>``; ``the device's <GiB>
            GiB`` where the device's memory bounds the plan: the fix then suggests no budget).

    Raises:
        MemoryBudgetError: the requested plan, or (``auto``) every plan, exceeds the budget; the message names the
            estimate, the budget and the cheapest plan that fits.
    """
    by = {p.offload: p for p in candidates}
    fits = [p for p in candidates if budget is None or p.peak <= budget]
    if requested != "auto":
        p = by[requested]
        if budget is None or p.peak <= budget:
            return p, f"{where}={requested} (as configured)"
        raise MemoryBudgetError(_refusal(p, budget, fits, where, already=already, bound=bound))
    if not fits:
        raise MemoryBudgetError(_refusal(None, budget, [], where, candidates, already, bound))
    skipped = [f"{p.offload} needs {gb(p.peak)} GiB" for p in candidates[:candidates.index(fits[0])]]
    kept = (f", {fits[0].resident_blocks} denoiser blocks ({gb(fits[0].resident_bytes)} GiB) kept resident"
            if fits[0].resident_blocks else "")
    why = (f"auto: {fits[0].offload} is the fastest plan that fits {gb(budget)} GiB (planned peak "
           f"{gb(fits[0].peak)} GiB, {gb(fits[0].moved)} GiB moved per call{kept})" if budget is not None
           else "auto: no budget, nothing offloaded")
    return fits[0], why + (f"; skipped: {', '.join(skipped)}" if skipped else "")


def _refusal(p: Optional[Plan], budget: int, fits: Sequence[Plan], where: str,
             candidates: Sequence[Plan] = (), already: Sequence[str] = (), bound: Optional[str] = None) -> str:
    bound = bound or f"memory.max_gpu_gb={gb(budget)}"
    if p is not None:
        head = (f"{where}={p.offload} plans a peak of {gb(p.peak)} GiB (stages: "
                + ", ".join(f"{k} {gb(v)}" for k, v in p.stages.items())
                + f" GiB, plus {gb(RESERVE_BYTES)} reserve), over {bound}")
    else:
        head = (f"{where}=auto: no plan fits {bound} ("
                + ", ".join(f"{c.offload} {gb(c.peak)} GiB" for c in candidates) + ")")
    if fits:
        best = fits[0]
        fix = f"fix: {where}={best.offload} (the cheapest plan that fits: {gb(best.peak)} GiB)"
    else:  # what lowers the peak, less what is set already (``already``)
        steps = [] if any(a.startswith("model.quantization.transformer=") for a in already) else [
            "quantize the largest component (model.quantization.transformer=nf4 or int8wo)"]
        vae = [k for k in ("memory.vae_slicing=true", "memory.vae_tiling=true") if k not in already]
        steps += ["lower batch_size"] + (["set " + " / ".join(vae)] if vae else [])
        fix = "fix: " + ", ".join(steps) + (", or raise memory.max_gpu_gb" if bound.startswith("memory.max_gpu_gb")
                                            else ", or a GPU with more memory")
    return f"{head}; {fix}"


# ------------------------------------------------------------------------------------------------ measuring


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages of tensors made inside the mode, on any device (the CPU included: how the
    estimates above are checked without a GPU), sampled after every aten op; a storage counts while any tensor
    viewing it lives; storages whose ``data_ptr`` is in ``exclude`` (weights, inputs made before) never count.
    Used by ``benchmarks/vae_decode_peak.py`` and ``tests/test_memory_wan_vae.py``; what the CUDA allocator holds
    beyond it (cuDNN's workspace, rounding) is not seen."""

    def __init__(self, exclude=()):
        super().__init__()
        self.live, self.exclude, self.peak = {}, set(exclude), 0

    def _add(self, t):
        s = t.untyped_storage()
        p, n = s.data_ptr(), s.nbytes()
        if n == 0 or p in self.exclude:
            return
        e = self.live.get(p)
        if e is not None and any(r() is not None for r in e[1]):
            e[1].append(weakref.ref(t))
        else:
            self.live[p] = [n, [weakref.ref(t)]]

    def now(self):
        tot = 0
        for p in list(self.live):
            n, refs = self.live[p]
            refs[:] = [r for r in refs if r() is not None]
            if refs:
                tot += n
            else:
                del self.live[p]
        return tot

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.now())
        return out
