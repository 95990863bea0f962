"""Wan 2.1 text-to-video family (diffusers ``WanPipeline``) on the generic pipeline engine.

UMT5 text encoder, ``WanTransformer3DModel`` (self-attention over video tokens, cross-attention to the text: roles
``self`` and ``cross``), the causal video VAE ``AutoencoderKLWan``. Output: ``frames`` (batch, F, H, W, C).
Rules the pipeline applies silently and the runner refuses instead: ``num_frames`` must be ``k * t + 1`` with ``t``
the VAE's temporal factor (its config's ``scale_factor_temporal``, 4 for Wan 2.1) or the pipeline rounds it down with a
warning; classifier-free guidance (``guidance_scale > 1``) makes a second transformer forward per step (unbatched:
``noise_uncond = current_model(...)``), and the negative prompt is used only then.

Image-to-video (issue #30, ``WanImageToVideoPipeline``) is a checkpoint of its own (Wan2.1-I2V-14B-480P): the same
classes plus a CLIP ``image_encoder`` (``CLIPVisionModelWithProjection``: its penultimate hidden states are the
image embeds) and its ``image_processor`` (``CLIPImageProcessor``), and a transformer that takes them (``image_dim`` =
the CLIP hidden size, ``added_kv_proj_dim`` = its inner dim: every ``attn2`` attends to image tokens too,
``in_channels`` 36 = the noise latents 16 + the first-frame mask 4 + the condition latents 16). ``last_image`` (first-last-frame) needs the
FLF2V variant (Wan2.1-FLF2V-14B-720P: ``pos_embed_seq_len`` = 2 x the CLIP tokens, the two images' embeds are
concatenated into one sequence); the I2V transformer fails on it (two image embeds for one video), and the FLF2V one
without it. A Wan 2.2-style I2V (``image_dim`` null, no image encoder: the condition reaches the transformer only
through its input channels) runs on the same pipeline class; its A14B variant has two experts (refused by
:meth:`WanEngine.check_layout`). What the pipeline does to an input's size (diffusers 0.42):

============== ========================== ===================================================================
task           pipeline                   input size
============== ========================== ===================================================================
image_to_video WanImageToVideoPipeline    ``image`` and ``last_image`` resized to the call's ``height`` x ``width``
                                          for the VAE (``VideoProcessor.preprocess``, aspect ratio not kept; height
                                          and width floored to multiples of 16 with a warning); for the CLIP image
                                          encoder its processor resizes the shortest edge to ``size.shortest_edge``
                                          and center-crops to ``crop_size`` (224 for Wan 2.1: the encoder never sees
                                          the borders of a non-square input); the video is ``height`` x ``width``
============== ========================== ===================================================================
"""

from __future__ import annotations

from typing import Any, Dict, List

from models.family import FamilySpec, signature_default, spatial_scale
from models.pipelines import PipelineEngine
from runner.core.dataset import Row


WAN = FamilySpec(
    name="wan",
    tasks={"text_to_video": "WanPipeline", "image_to_video": "WanImageToVideoPipeline"},
    components={"transformer": ("diffusers", "WanTransformer3DModel", None),
                "vae": ("diffusers", "AutoencoderKLWan", None),
                "text_encoder": ("transformers", "UMT5EncoderModel", "UMT5Config"),
                "scheduler": ("diffusers", "UniPCMultistepScheduler", None)},
    tokenizers={"tokenizer": ("t5", "umt5", "text_encoder")},
    cfg="separate",  # guidance_scale > 1: a separate unconditional forward per step
    size_rule=spatial_scale, patch="transformer",  # vae_scale_factor_spatial x the spatial patch (16 for Wan 2.1)
    roles={"attn2": "cross"},  # the blocks' attn2: queries video tokens, keys/values text; the rest: self
    quiet_loggers=("diffusers.pipelines.wan.pipeline_wan",),
    # Wan 2.1's text length (``text_len`` 512; WanPipeline's default): UMT5 embeddings are zero-padded to
    # max_sequence_length, so a larger value only costs memory (100000 tried to allocate 80 GB)
    max_sequence_length=512,
    fp8_prefixes=("blocks.",),  # WanTransformer3DModel names its blocks ``blocks.N``
    needs_mask=False,  # WanAttnProcessor passes no mask: text embeddings are zero-padded to max_sequence_length
    engine="models.wan:WanEngine",
    guidance_hint="Wan 2.1: 5.0",
    # Wan 2.1 I2V / FLF2V: a CLIP vision encoder and its image processor beside the T2V components; the class the
    # diffusers conversion script saves (scripts/convert_wan_to_diffusers.py: CLIPVisionModelWithProjection of
    # laion/CLIP-ViT-H-14; the pipeline reads its penultimate hidden states, not the projection)
    task_components={"image_to_video": {"image_encoder": ("transformers", "CLIPVisionModelWithProjection",
                                                          "CLIPVisionConfig")}},
    task_processors={"image_to_video": {"image_processor": ("clip_image", None)}},
    input_sizing={"image_to_video": "resize"},
)


class WanEngine(PipelineEngine):
    """The Wan 2.1 text-to-video family (engine ``wan``)."""

    spec = WAN

    def check_layout(self, path: Any) -> None:
        """The generic layout check, and no second transformer: a Wan 2.2 snapshot (``transformer_2``, the low-noise
        expert, switched at ``boundary_ratio``) runs steps on a module the probes do not watch, so it is refused
        until the engine observes both.

        Raises:
            ModelPathError: naming the component and the fix.
        """
        from models.pipelines import ModelPathError, read_index

        super().check_layout(path)
        entry = read_index(path).get("transformer_2") or [None, None]
        if entry[1]:
            raise ModelPathError(f"model.path={str(path)!r} is a Wan 2.2 two-expert snapshot (transformer_2: {entry[1]}); "
                                 "the runner serves Wan 2.1 text-to-video (one transformer) so far; fix: a Wan 2.1 "
                                 "snapshot (e.g. Wan-AI/Wan2.1-T2V-14B-Diffusers)")

    def install_attention(self, sections: Dict[str, Any]) -> None:
        """The attention backends and probes, then two dispatcher calls per forward expected at every cross-attention
        with added image keys (Wan 2.1 I2V: ``add_k_proj``; ``WanAttnProcessor`` attends to the image tokens and the
        text tokens separately)."""
        from models.pipelines import attention_modules

        super().install_attention(sections)
        mods = dict(attention_modules(self.pipe.transformer))
        for site in self.probes["attention"]:
            if getattr(mods.get(site.layer), "add_k_proj", None) is not None:
                site.per_forward = 2

    def temporal_factor(self) -> int:
        """The VAE's temporal compression as WanPipeline reads it: ``vae.config.scale_factor_temporal``
        (``AutoencoderKLWan``'s default 4 when the config lacks it)."""
        vae = self.component_config("vae")
        factor = vae.get("scale_factor_temporal") or signature_default("AutoencoderKLWan", "scale_factor_temporal", 4)
        return int(factor)

    def context_tokens(self, row: Any) -> Dict[str, int]:
        """What ``WanTransformer3DModel._cp_plan`` splits: the video tokens (latent frames x (height / 16) x (width /
        16)); the text tokens are not split (diffusers keeps ``encoder_hidden_states`` whole for Wan)."""
        need = self.size_need()
        frames = (int(row.num_frames) - 1) // self.temporal_factor() + 1
        return {"video": frames * (row.height // need) * (row.width // need)}

    def splits_attention(self, layer: str) -> bool:
        """Only self-attention (``attn1``) runs split: diffusers' ``WanAttnProcessor`` passes its parallel config only
        without ``encoder_hidden_states``; cross-attention (``attn2``) attends local queries to the whole text."""
        return not layer.endswith("attn2")

    def context_fix(self, sequence: str, degree: int) -> str:
        return (f"num_frames, width and height whose latent frames x {self.size_need()}-pixel tiles number a "
                f"multiple of {degree}")

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """``num_frames`` of every row must be ``k * t + 1`` (t = the VAE's temporal factor,
        :meth:`models.pipelines.PipelineEngine.check_frame_counts`): WanPipeline rounds other counts down with a
        warning, and the video would have fewer frames than its record says."""
        self.check_frame_counts(rows, path, self.temporal_factor())
