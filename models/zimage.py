"""Z-Image family (diffusers ``ZImagePipeline``: Tongyi-MAI/Z-Image and Z-Image-Turbo) on the generic pipeline engine.

``ZImageTransformer2DModel``: a single-stream DiT (S3-DiT) whose every attention module (``noise_refiner.N``,
``context_refiner.N`` and ``layers.N`` ``.attention``, diffusers' ``Attention`` with ``ZSingleStreamAttnProcessor``,
which calls ``dispatch_attention_fn``) attends over one sequence, the image latents and the caption joined: role
``joint``. The caption embeddings keep only each prompt's own tokens (``prompt_embeds[i][mask[i]]``), so a batch of
prompts of different lengths is padded inside the transformer and the attention takes a mask (``needs_mask``).
Text encoder: Qwen3 (``Qwen3Model``; the second-to-last hidden state), fed the prompt in Qwen3's chat template with
``enable_thinking=True``, truncated at ``max_sequence_length``. VAE: FLUX.1's ``AutoencoderKL``; sizes must be
multiples of ``vae_scale_factor * 2`` (``__call__`` raises otherwise).

Guidance (diffusers 0.42 ``pipeline_z_image.py``): ``do_classifier_free_guidance = guidance_scale > 0`` (not > 1);
CFG batches the conditional and unconditional inputs into ONE transformer forward per step (``latents.repeat(2, ...)``,
``prompt_embeds + negative_prompt_embeds``), with an empty negative prompt when the row has none; Z-Image-Turbo runs
with ``guidance_scale=0`` (no CFG). ``cfg_truncation`` (default 1.0) can switch CFG off for late steps; the runner
passes neither it nor ``cfg_normalization`` (the pipeline's defaults apply; the forward count is the same either way).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from models.family import FamilySpec, block_out_scale
from models.pipelines import PipelineEngine
from runner.core.errors import ConfigValueError

ZIMAGE = FamilySpec(
    name="zimage",
    tasks={"text_to_image": "ZImagePipeline"},
    components={"transformer": ("diffusers", "ZImageTransformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKL", None),
                "text_encoder": ("transformers", "Qwen3Model", "Qwen3Config"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("qwen3", "qwen3", "text_encoder")},
    cfg="batched",  # CFG: conditional and unconditional in one forward per step
    cfg_threshold=0.0,  # do_classifier_free_guidance = guidance_scale > 0
    size_rule=block_out_scale, patch=2,  # ZImagePipeline: vae_scale_factor * 2
    needs_mask=True,  # prompts of different lengths: the transformer pads and masks the joint sequence
    fp8_prefixes=("layers.", "noise_refiner.", "context_refiner."),
    engine="models.zimage:ZImageEngine",
    guidance_hint="Z-Image: 4.0; Z-Image-Turbo: 0",
)


class ZImageEngine(PipelineEngine):
    """The Z-Image family (engine ``zimage``)."""

    spec = ZIMAGE

    @classmethod
    def build_components(cls, arch: Dict[str, Any], device: Any = "cpu", dtype: Any = None,
                         task: Optional[str] = None) -> Dict[str, Any]:
        """The components (:meth:`PipelineEngine.build_components`), with the transformer's ``x_pad_token`` and
        ``cap_pad_token`` filled from a generator seeded by ``weights_seed``: ``ZImageTransformer2DModel`` creates
        them with ``torch.empty`` (arbitrary memory: NaN possible, and a rebuilt snapshot would not hash the same)."""
        import torch

        comps = super().build_components(arch, device=device, dtype=dtype or torch.float32, task=task)
        tr = comps["transformer"]
        if str(device) != "meta":
            gen = torch.Generator().manual_seed(int(arch.get("weights_seed", 0)))
            with torch.no_grad():
                for p in (tr.x_pad_token, tr.cap_pad_token):
                    p.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
        return comps

    def head_dim(self) -> int:
        """``dim // n_heads`` of the transformer config (ZImageTransformerBlock's ``dim_head``; the config has no
        ``attention_head_dim``)."""
        conf = self.component_config("transformer")
        return int(conf.get("dim", 3840)) // int(conf.get("n_heads", 30))

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Tokens of the prompt in Qwen3's chat template with ``enable_thinking=True`` (what the pipeline truncates
        at ``max_sequence_length``; the embeddings keep exactly these, up to the limit)."""
        from models.tokenizers import chat_prompt_lengths

        return chat_prompt_lengths(tok, prompts, enable_thinking=True)

    def check_family_rows(self, rows: List[Any], path: Any) -> None:
        """A row without a guidance value is refused: ZImagePipeline would apply its default 5.0 (CFG on) while the
        record says null.

        Raises:
            ConfigValueError: naming ``model.generation.guidance_scale`` and the fix.
        """
        if any(r.guidance_scale is None for r in rows):
            raise ConfigValueError(
                f"model.generation.guidance_scale=null, but ZImagePipeline (model={self.cfg.name}) would apply its "
                "default 5.0 (CFG on) unrecorded; fix: model.generation.guidance_scale=4.0 (Z-Image) or 0 "
                "(Z-Image-Turbo: no CFG), or a guidance_scale in every row")
