"""The video decode path of the Wan family (issue #41): a bit-identical faster forward of diffusers'
``AutoencoderKLWan`` decoder, and decoded frames converted to ``uint8`` on their own device.

:func:`install` replaces the ``forward`` of three module kinds of ``vae.decoder`` (instance attributes, the classes
untouched; :func:`uninstall` restores them) by versions that run the same operations on the same values in the same
order, and only skip copies (diffusers 0.42.1 ``autoencoder_kl_wan.py``):

* ``WanCausalConv3d``: ``F.pad(torch.cat([cache_x, x], 2))`` (a concatenated copy, a zero-filled buffer, a second
  copy) becomes one buffer of the padded shape, its halo zeroed and ``cache_x`` and ``x`` copied in once
  (:func:`causal_input`); the buffer has the sizes, strides and dtype ``F.pad`` gives (``suggest_memory_format``
  as ATen's ``cat`` and ``constant_pad_nd`` pick it), so the convolution runs on an equal tensor;
* ``WanUpsample`` in a nearest mode: ``interpolate(x.float()).type_as(x)`` becomes ``interpolate(x)``: nearest
  interpolation only copies input elements, whose values survive the bf16/fp16 -> fp32 -> bf16/fp16 round trip
  exactly, so the output is equal without the fp32 copy and its 4x fp32 output;
* ``WanRMS_norm`` on bf16/fp16 input: ``F.normalize(x.float()).to(x.dtype)`` becomes the same norm of ``x.float()``
  and ``torch.div(x, denom, out=<x.dtype>)``: the division of the same fp32 operands (``x``'s values widen exactly),
  rounded once to ``x.dtype`` on store as ``.to`` rounds (round to nearest even), without the fp32 quotient; the
  ``* scale * gamma + bias`` tail is diffusers' expression.

Inputs outside those cases (a cache longer than the causal padding, a padding behind, other dtypes or modes) take
diffusers' own forward. A module whose ``forward`` something else already replaced (an offload hook) is left alone
and counted as skipped. The claim is checked, not assumed: ``tests/test_video_decode.py`` compares the frames of a
patched and an unpatched decode bit for bit (float32 and bfloat16 on the CPU, several latent frames so the causal
cache runs, tiled and untiled), and ``benchmarks/decode_wan_h200.py`` compares their ``frames_sha256`` on the GPU.

:func:`to_uint8` is the runner's float -> ``uint8`` rule (``runner.core.artifacts.to_uint8``, the bytes every PNG and
MP4 holds and ``frames_sha256`` hashes) on a tensor's device; :func:`video_uint8` applies it to a decoded video after
diffusers' own ``VideoProcessor.postprocess_video``, with the count of non-finite values the sinks refuse, and
:func:`frames_arrays` is how every video engine takes a pipeline's frames (``output_type="pt"``,
``models.pipelines.PipelineEngine.output_arrays``): converted where they were decoded, whatever
``optimize.fast_vae_decode`` says (the bytes are the host rule's, so it is not a setting).
"""

from __future__ import annotations

import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from models.passes import Pass

#: ``WanUpsample`` modes whose output elements are input elements (no arithmetic).
NEAREST_MODES = ("nearest", "nearest-exact")
#: dtypes ``WanRMS_norm`` widens to float32 (diffusers: ``float16``, ``bfloat16``; float4/float8 take its forward).
NARROW_DTYPES = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------- memory layout
def strides_like_channels_last_3d(t: torch.Tensor) -> bool:
    """Whether ATen's ``suggest_memory_format`` says ``channels_last_3d`` for the 5-D tensor ``t``: c10's
    ``is_channels_last_strides_3d_s5`` (``c10/core/MemoryFormat.h``), strides non-decreasing over C, W, H, D, N with
    its fallback to NCDHW for ambiguous strides."""
    sizes, strides = t.shape, t.stride()
    if t.dim() != 5 or strides[1] == 0:
        return False
    least = 0
    for d in (1, 4, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < least:
            return False
        if d == 0 and least == strides[1]:
            return False
        least = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return True


def causal_input(conv: Any, x: torch.Tensor, cache_x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor ``WanCausalConv3d.forward`` convolves, ``F.pad(torch.cat([cache_x, x], 2), padding)`` with the
    cache's frames taken from the causal (front) padding, written once: the halo zeroed, ``cache_x`` and ``x``
    copied into the interior. Sizes, strides and dtype are the ones ``cat`` then ``constant_pad_nd`` give (both
    allocate in ``suggest_memory_format`` of their input: ``channels_last_3d`` when every input's strides are like
    it, else contiguous).

    Args:
        conv: the ``WanCausalConv3d`` (its ``_padding``: ``(left, right, top, bottom, front, back)``).
        x: (B, C, T, H, W).
        cache_x: (B, C, n, H, W) frames before ``x`` (diffusers passes at most ``CACHE_T`` = 2), or None.

    Returns:
        The padded input, or None where diffusers' forward must run instead: no padding at all (``F.pad`` then
        returns a clone), a padding behind, no cached frame or more than the front padding (``F.pad`` would crop), or
        a cache whose dtype or sizes ``cat`` would promote or refuse.
    """
    left, right, top, bottom, front, back = conv._padding
    use_cache = cache_x is not None and front > 0
    if back or not any(conv._padding) or x.dim() != 5:
        return None
    n = int(cache_x.shape[2]) if use_cache else 0
    if use_cache and (cache_x.dtype != x.dtype or cache_x.dim() != 5 or not 0 < n <= front
                      or cache_x.shape[:2] != x.shape[:2] or cache_x.shape[3:] != x.shape[3:]):
        return None
    parts = ([cache_x] if use_cache else []) + [x]
    cl3d = all(strides_like_channels_last_3d(p) for p in parts)
    b, c, t, h, w = x.shape
    lead = front - n
    buf = torch.empty((b, c, lead + n + t, top + h + bottom, left + w + right), dtype=x.dtype, device=x.device,
                      memory_format=torch.channels_last_3d if cl3d else torch.contiguous_format)
    if lead:
        buf[:, :, :lead].zero_()
    body = buf[:, :, lead:]
    for rows in (body[:, :, :, :top], body[:, :, :, top + h:]):
        rows.zero_()
    for cols in (body[:, :, :, top:top + h, :left], body[:, :, :, top:top + h, left + w:]):
        cols.zero_()
    inner = body[:, :, :, top:top + h, left:left + w]
    if n:
        inner[:, :, :n].copy_(cache_x)
    inner[:, :, n:].copy_(x)
    return buf


# ---------------------------------------------------------------------------------------------- forwards
#: Instance attribute counting the calls a module's patched forward took its own path (not diffusers' fallback):
#: the evidence that the decode path ran (:func:`fast_calls`).
CALLS = "_runner_fast_decode_calls"


def _count(module: Any) -> None:
    d = module.__dict__  # not ``Module.__setattr__``: a plain int on the instance, once per call
    d[CALLS] = d.get(CALLS, 0) + 1


def causal_conv_forward(self: Any, x: torch.Tensor, cache_x: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``WanCausalConv3d.forward`` on :func:`causal_input` (diffusers' own forward where that returns None)."""
    buf = causal_input(self, x, cache_x)
    if buf is None:
        return type(self).forward(self, x, cache_x)
    _count(self)
    return torch.nn.Conv3d.forward(self, buf)


def upsample_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``WanUpsample.forward`` without the float32 round trip in a nearest mode (module docstring)."""
    if self.mode not in NEAREST_MODES or x.dtype not in NARROW_DTYPES + (torch.float32,):
        return type(self).forward(self, x)
    _count(self)
    return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                         recompute_scale_factor=self.recompute_scale_factor)


def rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``WanRMS_norm.forward`` with the normalized values rounded to ``x.dtype`` in the division's store (module
    docstring); ``F.normalize``'s denominator: the 2-norm over the channel dim clamped to at least 1e-12."""
    if x.dtype not in NARROW_DTYPES:
        return type(self).forward(self, x)
    _count(self)
    xf = x.float()
    denom = xf.norm(2.0, 1 if self.channel_first else -1, keepdim=True).clamp_min(1e-12).expand_as(xf)
    del xf
    normalized = torch.div(x, denom, out=torch.empty_like(x))
    return normalized * self.scale * self.gamma + self.bias


#: class name in diffusers' ``autoencoder_kl_wan`` -> the forward :func:`install` gives its instances.
FORWARDS = {"WanCausalConv3d": causal_conv_forward, "WanUpsample": upsample_forward,
            "WanRMS_norm": rms_norm_forward}


def install(vae: Any) -> Dict[str, Any]:
    """Give every ``WanCausalConv3d``, ``WanUpsample`` and ``WanRMS_norm`` of ``vae.decoder`` the bit-identical
    forward of :data:`FORWARDS` (module docstring); idempotent.

    Returns:
        ``{"modules": {class name: patched count}, "skipped": count}`` (skipped: a module whose ``forward`` was
        already replaced by something else, e.g. an offload hook).

    Raises:
        TypeError: ``vae`` is no ``AutoencoderKLWan`` (names its class).
    """
    if type(vae).__name__ != "AutoencoderKLWan" or getattr(vae, "decoder", None) is None:
        raise TypeError(f"the Wan decode path patches diffusers' AutoencoderKLWan, got {type(vae).__name__}")
    counts = {name: 0 for name in FORWARDS}
    skipped = 0
    for m in vae.decoder.modules():
        fn = FORWARDS.get(type(m).__name__)
        if fn is None:
            continue
        own = m.__dict__.get("forward")
        if own is not None and getattr(own, "__func__", None) is not fn:
            skipped += 1
            continue
        m.forward = types.MethodType(fn, m)
        m.__dict__[CALLS] = 0
        counts[type(m).__name__] += 1
    return {"modules": counts, "skipped": skipped}


def fast_calls(vae: Any) -> Dict[str, int]:
    """Calls per class name of ``vae.decoder``'s patched modules that took the fast path since :func:`install`
    (a fallback to diffusers' forward is not counted)."""
    out: Dict[str, int] = {name: 0 for name in FORWARDS}
    for m in vae.decoder.modules():
        if type(m).__name__ in out:
            out[type(m).__name__] += m.__dict__.get(CALLS, 0)
    return out


def uninstall(vae: Any) -> int:
    """Remove what :func:`install` set on ``vae.decoder``; returns the number of modules restored."""
    n = 0
    for m in vae.decoder.modules():
        own = m.__dict__.get("forward")
        if own is not None and getattr(own, "__func__", None) in FORWARDS.values():
            del m.forward
            m.__dict__.pop(CALLS, None)
            n += 1
    return n


# ------------------------------------------------------------------------------------------------- uint8
def to_uint8(frames: torch.Tensor) -> torch.Tensor:
    """Float frames in [0, 1] -> ``uint8`` of the same shape on the same device, with the bytes of
    ``runner.core.artifacts.to_uint8`` (``(np.clip(a, 0, 1) * 255).round().astype("uint8")`` on the float32 array
    the engines return): widened to float32 (exact for bf16/fp16), clamped to [0, 1], times 255 in float32, rounded
    half to even (``torch.round`` as ``np.round``), cast. The byte of a NaN is unspecified, as in the numpy rule: the
    sinks refuse a non-finite output before converting it (:func:`video_uint8` counts them)."""
    return frames.to(torch.float32).clamp(0.0, 1.0).mul(255).round().to(torch.uint8)


def uint8_frames(pt: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Postprocessed frames as the ``uint8`` frames the runner writes, on ``pt``'s device.

    Args:
        pt: (B, F, C, H, W) in [0, 1], any float dtype (``VideoProcessor.postprocess_video(..., output_type="pt")``).

    Returns:
        ``(frames, nonfinite)``: ``uint8`` (B, F, H, W, C) contiguous (:func:`to_uint8`), and int64 (B,) counts of
        non-finite values per item (what ``models.base.VideoOutput.nonfinite`` counts on the float32 frames).
    """
    nonfinite = (~torch.isfinite(pt)).flatten(1).sum(1)
    return to_uint8(pt).permute(0, 1, 3, 4, 2).contiguous(), nonfinite


def video_uint8(video: torch.Tensor, processor: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """A decoded video batch as the ``uint8`` frames the runner writes, on ``video``'s device.

    Args:
        video: ``vae.decode``'s output, (B, C, F, H, W) in [-1, 1].
        processor: the pipeline's ``VideoProcessor``: its ``postprocess_video(video, output_type="pt")`` denormalizes
            as ``output_type="np"`` does (``(x * 0.5 + 0.5).clamp(0, 1)`` in ``video``'s dtype), without the copy to
            the host.

    Returns:
        :func:`uint8_frames` of the postprocessed video.
    """
    return uint8_frames(processor.postprocess_video(video, output_type="pt"))


def frames_arrays(pt: torch.Tensor) -> List[np.ndarray]:
    """A pipeline's postprocessed video batch (``output_type="pt"``: (B, F, C, H, W) in [0, 1], on the device it was
    decoded on) as one host array per item, converted to ``uint8`` where it lies (:func:`uint8_frames`: the bytes the
    sinks would make of the float32 frames, a quarter of the copy to the host, and no float32 pass on the host).

    Returns:
        Per item: ``uint8`` (F, H, W, 3); an item with a non-finite value instead keeps its float32 frames (F, H, W, 3)
        with the NaN/inf, as ``output_type="np"`` gives them, so that the sink refuses it naming the count.
    """
    frames, nonfinite = uint8_frames(pt)
    host = frames.cpu().numpy()
    return [host[i] if not bad else pt[i].permute(0, 2, 3, 1).float().cpu().numpy()
            for i, bad in enumerate(nonfinite.tolist())]


# -------------------------------------------------------------------------------------------------- pass
class FastDecodePass(Pass):
    """``optimize.fast_vae_decode`` (default on): :func:`install` on the loaded pipeline's VAE where it is diffusers'
    ``AutoencoderKLWan`` (Wan 2.1 / 2.2 A14B / TI2V), before the memory plan's hooks wrap its modules (an offload
    hook then wraps the patched forward); any other VAE is left alone and the setting recorded as ignored there.

    Manifest section ``vae_decode`` (end of run): ``fast`` (installed), the patched modules per class, the calls
    that took the fast path per class (:func:`fast_calls`: the evidence it ran), or ``ignored`` with the reason.
    Evidence: a run that decoded with the path installed but saw no fast call is a mismatch (the patch did not act).
    The decode is bit-identical to diffusers' (module docstring), so the setting enters neither identity nor resume.
    """

    name = "fast_vae_decode"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.vae: Any = None
        self.section: Dict[str, Any] = {}
        self.calls = 0  # pipeline calls that returned (each decoded its batch)

    def install(self, sections: Dict[str, Any]) -> None:
        run = self.engine.ctx.run
        if run is None or not run.optimize.fast_vae_decode:
            self.section = {"fast": False, "why": "optimize.fast_vae_decode=false"}
            return
        vae = getattr(self.engine.pipe, "vae", None)
        kind = type(vae).__name__ if vae is not None else None
        if kind != "AutoencoderKLWan":
            self.section = {"fast": False, "ignored": f"optimize.fast_vae_decode: {kind or 'no VAE'} has no fast "
                                                      "decode path (AutoencoderKLWan only)"}
            return
        self.vae = vae
        self.section = {"fast": True, **install(vae)}

    def after_call(self, batch: Sequence[Any], want: Optional[int]) -> None:
        self.calls += 1

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        if self.vae is None:
            return []
        calls = fast_calls(self.vae)
        section["vae_decode"] = {"fast": True, "fast_calls": calls, "pipeline_calls": self.calls}
        if self.calls and not any(calls.values()):
            return ["optimize.fast_vae_decode: the Wan decode path was installed but no patched module took its fast "
                    "path"]
        return []

    def final_sections(self) -> Dict[str, Any]:
        if self.vae is not None:
            self.section["fast_calls"] = fast_calls(self.vae)
        return {"vae_decode": self.section} if self.section else {}

    def close(self) -> None:
        if self.vae is not None:  # the counts stay in the section (the manifest may be written after close)
            self.section["fast_calls"] = fast_calls(self.vae)
            uninstall(self.vae)
            self.vae = None
