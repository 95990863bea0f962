"""FLUX.1 family (diffusers ``FluxPipeline``) on the generic pipeline engine (:mod:`models.pipelines`).

Three ways to get weights, one loading path (see :class:`models.pipelines.PipelineEngine`): ``model.path`` (a local
snapshot or a Hub id in the local cache), embedded (``tiny_flux``: seeded random weights saved into the cache with
``save_pretrained`` on first use, then loaded with ``from_pretrained`` like a real checkpoint) and
``model.load_format=dummy`` (random weights built on the device, no files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

from models.family import FamilySpec, block_out_scale
from models.pipelines import (EMBEDDED_RECIPE, ModelPathError, PipelineEngine, check_snapshot,  # noqa: F401
                              embedded_target)
from runner.core.errors import ConfigValueError

#: The most T5 tokens FluxPipeline encodes: its ``check_inputs`` raises for ``max_sequence_length > 512`` (after the
#: model loaded); the runner refuses it at startup, with the T5 tokenizer's ``model_max_length`` if lower.
FLUX_MAX_SEQUENCE_LENGTH = 512


FLUX = FamilySpec(
    name="flux",
    tasks={"text_to_image": "FluxPipeline", "image_to_image": "FluxImg2ImgPipeline",
           "inpaint": "FluxInpaintPipeline", "edit": "FluxKontextPipeline"},
    components={"transformer": ("diffusers", "FluxTransformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKL", None),
                "text_encoder": ("transformers", "CLIPTextModel", "CLIPTextConfig"),
                "text_encoder_2": ("transformers", "T5EncoderModel", "T5Config"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("clip", "clip", "text_encoder"), "tokenizer_2": ("t5", "t5", "text_encoder_2")},
    cfg="true_cfg",  # a negative prompt with true_cfg_scale > 1: a second forward per step
    size_rule=block_out_scale, patch=2,  # VAE scale factor x 2 for the 2x2 latent packing
    quiet_loggers=("diffusers.pipelines.flux.pipeline_flux",),
    max_sequence_length=FLUX_MAX_SEQUENCE_LENGTH,
    backend_fields=("attention", "linear"),  # no MoE layers in FLUX.1
    needs_mask=False,  # FluxAttnProcessor passes attention_mask=None on the text-to-image path
    engine="models.flux:FluxEngine",
)


class FluxEngine(PipelineEngine):
    """The FLUX.1 family on diffusers' ``FluxPipeline`` (engine ``flux``).

    The transformer's attention modules (``FluxAttention``) are the call sites of the model's single attention
    role, ``joint`` (text and image tokens attend jointly in double- and single-stream blocks). A pipeline call
    makes ``num_inference_steps`` transformer forwards, twice that under true CFG (a negative prompt with
    ``true_cfg_scale`` > 1).
    """

    spec = FLUX
    #: the value a refusal of ``guidance_scale: null`` proposes
    guidance_default: ClassVar[str] = "3.5 (FLUX.1-dev's default)"

    @property
    def guidance_embeds(self) -> bool:
        """The transformer takes a guidance value (FLUX.1-dev's and FLUX.2-dev's distilled guidance embedding): its
        config's ``guidance_embeds`` (the default of the spec's transformer class, ``FluxTransformer2DModel`` /
        ``Flux2Transformer2DModel``, when absent). The pipeline's guidance reaches the transformer only then."""
        from models.family import signature_default

        default = signature_default(self.spec.components["transformer"][1], "guidance_embeds", True)
        return bool(self.component_config("transformer").get("guidance_embeds", default))

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[Any, ...]]:
        """The true-CFG rules (:func:`models.family.negative_prompt_ignored`), and ``guidance_scale`` when the
        transformer has no guidance embedding (FluxPipeline then passes no guidance)."""
        out: Dict[str, Tuple[Any, ...]] = {}
        if not self.guidance_embeds:
            out["guidance_scale"] = (
                "its transformer has no guidance embedding (transformer config guidance_embeds=false), so FluxPipeline "
                "passes no guidance and every value gives the same image",
                "use a model with guidance embeddings (e.g. model=flux)")
        return {**out, **super().ignored_fields(rows)}

    def check_family_rows(self, rows: List[Any], path: Any) -> None:
        """Rows without a guidance value on a model that takes one are refused (``model.generation.guidance_scale:
        null`` is for models without guidance embedding).

        Raises:
            ConfigValueError: a guidance value is missing, naming ``model.generation.guidance_scale``.
        """
        if any(r.guidance_scale is None for r in rows) and self.guidance_embeds:
            raise ConfigValueError(
                f"model.generation.guidance_scale=null, but model={self.cfg.name}'s transformer takes a guidance value "
                "(transformer config guidance_embeds=true); fix: model.generation.guidance_scale="
                f"{self.guidance_default}, or a guidance_scale in every row")

    def context_tokens(self, row: Any) -> Dict[str, int]:
        """What ``FluxTransformer2DModel._cp_plan`` splits: the packed image tokens ((height / 16) x (width / 16) for
        FLUX's VAE) and the T5 text tokens (FluxPipeline pads them to ``max_sequence_length``)."""
        need = self.size_need()
        return {"image": (row.width // need) * (row.height // need),
                "text": int(self.cfg.generation.max_sequence_length)}

    def context_fix(self, sequence: str, degree: int) -> str:
        if sequence == "text":
            return f"model.generation.max_sequence_length a multiple of {degree}"
        return f"width and height whose {self.size_need()}-pixel tiles number a multiple of {degree}"


# ---------------------------------------------------------------------------------- module-level entry points
def build_components(arch: Dict[str, Any], device: Any = "cpu", dtype: Any = None) -> Dict[str, Any]:
    """Every FLUX component from ``arch`` with seeded random weights (:meth:`PipelineEngine.build_components`)."""
    import torch

    return FluxEngine.build_components(arch, device=device, dtype=dtype or torch.float32)


def embedded_snapshot(name: str, arch: Dict[str, Any], cache_dir: Optional[str]) -> Path:
    """The cache dir of an embedded FLUX model, created on first use (:meth:`PipelineEngine.embedded_snapshot`)."""
    return FluxEngine.embedded_snapshot_at(embedded_target(name, arch, cache_dir), arch)
