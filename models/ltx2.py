"""LTX-2 text-to-video-and-audio family (diffusers ``LTX2Pipeline``, Lightricks/LTX-2) on the generic pipeline engine.

Gemma 3 text encoder (``Gemma3ForConditionalGeneration``: the pipeline stacks all its hidden states), text
``connectors`` (``LTX2TextConnectors``: one stream for video, one for audio), ``LTX2VideoTransformer3DModel`` (a video
and an audio stream; per block ``attn1``/``audio_attn1`` self-attention, ``attn2``/``audio_attn2`` cross-attention to
the text, ``audio_to_video_attn``/``video_to_audio_attn`` between the streams: roles ``self`` and ``cross``, every one
through diffusers' attention dispatcher), the video VAE ``AutoencoderKLLTX2Video``, the audio VAE
``AutoencoderKLLTX2Audio`` (mel spectrograms) and the vocoder ``LTX2Vocoder`` (mel -> waveform). Output: ``frames``
(batch, F, H, W, C) and ``audio`` (batch, channels, samples) at the vocoder's ``output_sampling_rate``; the MP4 sink
writes the audio as the video's sound track (``output.audio``).

Rules the pipeline applies silently (diffusers 0.42) and the runner refuses or records instead:

* width and height: ``check_inputs`` refuses other than multiples of 32, and the latents are ``// vae
  spatial_compression_ratio``: the size multiple is ``lcm(32, spatial ratio x patch_size)`` (:func:`ltx2_scale`);
* ``num_frames`` must be ``k * t + 1`` (``t`` = the VAE's ``temporal_compression_ratio``, 8 for LTX-2), else the VAE
  decodes ``(n - 1) // t * t + 1`` frames (:meth:`LTX2Engine.check_family_rows`);
* guidance: classifier-free guidance concatenates the unconditional and conditional inputs into ONE transformer forward
  (``torch.cat([latents] * 2)``) when ``guidance_scale > 1`` or ``audio_guidance_scale > 1`` (``batched``); the
  pipeline's own defaults (the LTX-2.3 recipe) add a spatio-temporal-guidance forward that skips self-attention in
  ``spatio_temporal_guidance_blocks`` and a modality-isolation forward that skips the audio-video attention: call sites
  that would not run once per forward, which the attention evidence cannot count. The runner runs the LTX-2.0 recipe
  (:data:`LTX2_0_GUIDANCE`: STG and modality guidance off, one guidance scale for video and audio, no rescale, the
  legacy timestep of the cross-modal attention) and records it per item;
* every selected attention backend must take the audio stream's head size too (:meth:`LTX2Engine.resolve_backends`);
* ``optimize.fuse_qkv`` is refused: the attention processor never reads fused projections
  (:meth:`LTX2Engine.check_config`);
* ``frame_rate`` (the row's ``fps``) conditions the positional embedding and the audio length
  (``num_frames / frame_rate`` seconds): it is passed, and recorded, as the video's frame rate.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from models.base import VideoOutput
from models.family import FamilySpec, signature_default
from models.pipelines import PipelineEngine
from runner.core.dataset import Item, Row
from runner.core.errors import ConfigValueError

#: The LTX-2.0 sampling recipe the runner passes to ``LTX2Pipeline.__call__`` (the pipeline's docstring defaults of
#: LTX-2.0: STG ``stg_scale`` 0 and modality guidance ``modality_scale`` 1 off, ``guidance_rescale`` 0,
#: ``use_cross_timestep=False`` "the legacy LTX-2.0 behavior"; diffusers' own LTX-2 tests pin the same values).
#: ``audio_guidance_scale`` is the row's ``guidance_scale`` (one CFG scale, as LTX-2.0 had).
LTX2_0_GUIDANCE: Mapping[str, Any] = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0,
                                      "audio_modality_scale": 1.0, "guidance_rescale": 0.0,
                                      "audio_guidance_rescale": 0.0, "spatio_temporal_guidance_blocks": None,
                                      "use_cross_timestep": False}
#: The multiple ``LTX2Pipeline.check_inputs`` requires of height and width.
CHECK_INPUTS_MULTIPLE = 32


def vae_ratios(vae: Mapping[str, Any]) -> tuple:
    """``(spatial, temporal)`` compression of an ``AutoencoderKLLTX2Video`` config as its ``__init__`` computes them:
    ``spatial_compression_ratio`` / ``temporal_compression_ratio`` when set, else ``patch_size`` (``patch_size_t``)
    x 2 ** the number of ``spatio_temporal_scaling`` blocks (diffusers 0.42, ``autoencoder_kl_ltx2.py``)."""
    def default(p: str) -> Any:
        return signature_default("AutoencoderKLLTX2Video", p, None)

    scaling = vae.get("spatio_temporal_scaling") or default("spatio_temporal_scaling") or ()
    n = sum(bool(x) for x in scaling)
    spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size") or default("patch_size")) * 2 ** n
    temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t") or default("patch_size_t")) * 2 ** n
    return int(spatial), int(temporal)


def ltx2_scale(vae: Mapping[str, Any], transformer: Mapping[str, Any], patch: int) -> int:
    """``lcm(32, spatial compression x patch)``: what ``LTX2Pipeline`` keeps as a width or height (its
    ``check_inputs`` refuses non-multiples of 32; the latents are ``height // vae_spatial_compression_ratio``)."""
    return math.lcm(CHECK_INPUTS_MULTIPLE, vae_ratios(vae)[0] * patch)


LTX2 = FamilySpec(
    name="ltx2",
    tasks={"text_to_video": "LTX2Pipeline"},
    components={"transformer": ("diffusers", "LTX2VideoTransformer3DModel", None),
                "vae": ("diffusers", "AutoencoderKLLTX2Video", None),
                "audio_vae": ("diffusers", "AutoencoderKLLTX2Audio", None),
                "vocoder": ("diffusers.pipelines.ltx2", "LTX2Vocoder", None),
                "connectors": ("diffusers.pipelines.ltx2", "LTX2TextConnectors", None),
                "text_encoder": ("transformers", "Gemma3ForConditionalGeneration", "Gemma3Config"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("gemma", "gemma3", "text_encoder")},
    cfg="batched",  # guidance_scale > 1: unconditional and conditional inputs in ONE forward (under LTX2_0_GUIDANCE)
    size_rule=ltx2_scale, patch="transformer",
    roles={"attn2": "cross", "audio_to_video_attn": "cross", "video_to_audio_attn": "cross"},
    quiet_loggers=("diffusers.pipelines.ltx2.pipeline_ltx2",),
    fp8_prefixes=("transformer_blocks.",),  # LTX2VideoTransformer3DModel names its blocks transformer_blocks.N
    needs_mask=True,  # LTX2AudioVideoAttnProcessor passes the text attention mask to the dispatcher
    engine="models.ltx2:LTX2Engine",
    guidance_hint="LTX-2: 4.0",
)


class LTX2Engine(PipelineEngine):
    """The LTX-2 family (engine ``ltx2``): video with its audio."""

    spec = LTX2
    #: The last call's audio per item, float32 (channels, samples) (:meth:`output_arrays`); None without audio.
    last_audio: Optional[List[np.ndarray]] = None

    def temporal_factor(self) -> int:
        """The video VAE's temporal compression (:func:`vae_ratios`; 8 for LTX-2)."""
        return vae_ratios(self.component_config("vae"))[1]

    def check_config(self) -> None:
        """The base checks, and no ``optimize.fuse_qkv``: ``LTX2AudioVideoAttnProcessor`` reads ``to_q``/``to_k``/
        ``to_v`` and never a fused projection, and the audio-video cross-attention's queries and keys have other
        widths (diffusers' ``fuse_projections`` fails on them), so fusing would break the call.

        Raises:
            ConfigValueError: naming the key and the fix.
        """
        super().check_config()
        if self.ctx.run.optimize.fuse_qkv:
            raise ConfigValueError(
                f"optimize.fuse_qkv=true: model={self.cfg.name}'s attention processor (LTX2AudioVideoAttnProcessor) "
                "reads to_q/to_k/to_v and never a fused projection, and its audio-video cross-attention has queries "
                "and keys of other widths, so the projections cannot be fused; fix: optimize.fuse_qkv=false")

    def resolve_backends(self) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """The generic resolution (checked against the video stream's ``attention_head_dim``), then every selected
        attention backend against the audio stream's ``audio_attention_head_dim`` too: the audio self- and
        cross-attention run at that head size (64 for LTX-2, 128 for its video), and a backend compiled for one
        head size would fail there after loading.

        Raises:
            runner.kernels.registry.BackendUnavailableError: naming the backend, the audio head size and why.
        """
        from runner.kernels import registry as reg

        resolutions, extras = super().resolve_backends()
        audio = self.component_config("transformer").get("audio_attention_head_dim")
        if audio is None or "attention" not in resolutions:
            return resolutions, extras
        plat = self.ctx.plat
        ctx = reg.SelectionContext(platform_kind=plat.kind, sm=plat.sm, dtype=self.dtype, head_dim=int(audio),
                                   needs_mask=self.needs_mask)
        for role, spec in resolutions["attention"].selected.items():
            why = reg.get("attention", spec["backend"]).unmet(ctx)
            if why:
                raise reg.BackendUnavailableError(
                    f"backend.attention={spec['backend']} (role {role}) cannot run model={self.cfg.name}'s audio "
                    f"attention (audio_attention_head_dim {audio}): {'; '.join(why)}; fix: an attention backend "
                    "that takes both head sizes (e.g. backend.attention=TORCH_SDPA)")
        return resolutions, extras

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """``num_frames`` of every row must be ``k * t + 1`` (:meth:`PipelineEngine.check_frame_counts`), and every
        row needs a ``guidance_scale``: without one ``LTX2Pipeline`` applies its own defaults (3.0 for the video,
        7.0 for the audio: the LTX-2.3 recipe), which the record would show as not applied.

        Raises:
            DatasetError / ConfigValueError: as ``check_frame_counts``; a row (or the default) without guidance.
        """
        self.check_frame_counts(rows, path, self.temporal_factor())
        unset = [r for r in rows if r.guidance_scale is None]
        if unset:
            raise ConfigValueError(
                f"guidance_scale=null ({len(unset)} row(s), first {path}:{unset[0].line}): model={self.cfg.name}'s "
                "LTX2Pipeline would apply its own defaults (3.0 video, 7.0 audio), unrecorded; fix: "
                "model.generation.guidance_scale=4.0 (LTX-2's; <= 1 turns classifier-free guidance off)")

    def audio_on(self) -> bool:
        """``output.audio``: the audio is written as the MP4's sound track (else generated and dropped)."""
        return bool(self.ctx.run.output.audio)

    def sample_rate(self) -> int:
        """The audio's sample rate in Hz: the vocoder config's ``output_sampling_rate`` (what the pipeline's example
        passes to ``encode_video``; 24000 for LTX-2)."""
        conf = self.component_config("vocoder")
        return int(conf.get("output_sampling_rate") or signature_default("LTX2Vocoder", "output_sampling_rate", 24000))

    def family_kwargs(self, batch: Sequence[Item]) -> Dict[str, Any]:
        """``frame_rate`` (the row's ``fps``), the LTX-2.0 guidance recipe (:data:`LTX2_0_GUIDANCE`) and
        ``audio_guidance_scale`` = the row's ``guidance_scale``."""
        r0 = batch[0].row
        kw: Dict[str, Any] = {"frame_rate": float(r0.fps), **LTX2_0_GUIDANCE}
        if r0.guidance_scale is not None:
            kw["audio_guidance_scale"] = r0.guidance_scale
        return kw

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """The base values (``num_frames``, ``fps``), the guidance recipe as applied, and the audio: ``audio``
        (``output.audio``) and ``audio_sample_rate`` (Hz; null without audio), which the sink checks against the
        written file."""
        out = {**super().applied_params(row), **LTX2_0_GUIDANCE}
        out["audio_guidance_scale"] = row.guidance_scale
        out.update(audio=self.audio_on(), audio_sample_rate=self.sample_rate() if self.audio_on() else None)
        return out

    def output_arrays(self, out: Any) -> List[np.ndarray]:
        """The frames, and (``output.audio``) each item's audio kept for :meth:`video_outputs`: float32
        (channels, samples)."""
        self.last_audio = ([np.asarray(a.float().cpu(), dtype=np.float32) for a in out.audio] if self.audio_on()
                           else None)
        return super().output_arrays(out)

    def video_outputs(self, videos: List[Any], batch: Sequence[Item]) -> List[VideoOutput]:
        """The videos with their audio at :meth:`sample_rate` (none when ``output.audio=false``)."""
        audio = self.last_audio or [None] * len(videos)
        rate = self.sample_rate() if self.audio_on() else None
        return [VideoOutput(f, fps=it.row.fps, audio=a, sample_rate=rate) for f, a, it in zip(videos, audio, batch)]
