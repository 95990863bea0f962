"""FLUX.1 family (diffusers ``FluxPipeline``) on the generic pipeline engine (:mod:`models.pipelines`).

Three ways to get weights, one loading path (see :class:`models.pipelines.PipelineEngine`): ``model.path`` (a local
snapshot or a Hub id in the local cache), embedded (``tiny_flux``: seeded random weights saved into the cache with
``save_pretrained`` on first use, then loaded with ``from_pretrained`` like a real checkpoint) and
``model.load_format=dummy`` (random weights built on the device, no files).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from models.pipelines import (EMBEDDED_RECIPE, ModelPathError, PipelineEngine, check_snapshot,  # noqa: F401
                              embedded_target)
from runner.core.dataset import Item
from runner.core.errors import ConfigValueError

#: The most T5 tokens FluxPipeline encodes: its ``check_inputs`` raises for ``max_sequence_length > 512`` (after the
#: model loaded); the runner refuses it at startup, with the T5 tokenizer's ``model_max_length`` if lower.
FLUX_MAX_SEQUENCE_LENGTH = 512


class _TruncationFilter(logging.Filter):
    """Drops diffusers' "The following part of your input was truncated ..." records (printed by every
    CLIP/T5-encoding pipeline: FLUX, SD3, Wan), which print the whole dropped text on every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("The following part of your input was truncated")


def quiet_truncation_warnings(*modules: str) -> None:
    """Install :class:`_TruncationFilter` once on the loggers of the given pipeline modules."""
    for name in modules:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TruncationFilter) for f in logger.filters):
            logger.addFilter(_TruncationFilter())


class FluxEngine(PipelineEngine):
    """The FLUX.1 family on diffusers' ``FluxPipeline`` (engine ``flux``).

    The transformer's attention modules (``FluxAttention``) are the call sites of the model's single attention
    role, ``joint`` (text and image tokens attend jointly in double- and single-stream blocks). A pipeline call
    makes ``num_inference_steps`` transformer forwards, twice that under true CFG (a negative prompt with
    ``true_cfg_scale`` > 1).
    """

    pipeline_class = "FluxPipeline"
    components = {"transformer": ("diffusers", "FluxTransformer2DModel", None),
                  "vae": ("diffusers", "AutoencoderKL", None),
                  "text_encoder": ("transformers", "CLIPTextModel", "CLIPTextConfig"),
                  "text_encoder_2": ("transformers", "T5EncoderModel", "T5Config"),
                  "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)}
    tokenizers_spec = {"tokenizer": ("clip", "clip", "text_encoder"), "tokenizer_2": ("t5", "t5", "text_encoder_2")}
    max_sequence_length_limit = FLUX_MAX_SEQUENCE_LENGTH
    backend_fields = ("attention", "linear")  # no MoE layers in FLUX.1
    needs_mask = False  # FluxAttnProcessor passes attention_mask=None on the text-to-image path

    @classmethod
    def family(cls) -> str:
        return "flux"

    def size_need(self) -> int:
        """VAE scale factor (2 ** (len(block_out_channels) - 1)) x 2 for the 2x2 latent packing: FluxPipeline rounds
        other widths and heights down and would write an image of another size than the record says."""
        blocks = self.component_config("vae").get("block_out_channels") or [0] * 4
        return 2 ** (len(blocks) - 1) * 2

    @property
    def guidance_embeds(self) -> bool:
        """The transformer takes a guidance value (FLUX.1-dev's distilled guidance embedding): its config's
        ``guidance_embeds`` (diffusers' ``FluxTransformer2DModel`` default when absent). FluxPipeline passes
        ``guidance_scale`` to the transformer only then."""
        import inspect

        from diffusers import FluxTransformer2DModel

        default = inspect.signature(FluxTransformer2DModel.__init__).parameters["guidance_embeds"].default
        return bool(self.component_config("transformer").get("guidance_embeds", default))

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[str, str]]:
        """What FluxPipeline ignores here: ``guidance_scale`` when the transformer has no guidance embedding;
        ``negative_prompt`` unless ``true_cfg_scale`` > 1 (its true-CFG rule); ``true_cfg_scale`` > 1 when no row
        has a negative prompt."""
        g = self.cfg.generation
        out: Dict[str, Tuple[str, str]] = {}
        if not self.guidance_embeds:
            out["guidance_scale"] = (
                "its transformer has no guidance embedding (transformer config guidance_embeds=false), so FluxPipeline "
                "passes no guidance and every value gives the same image",
                "use a model with guidance embeddings (e.g. model=flux)")
        tc = float(g.true_cfg_scale)
        if tc <= 1:
            out["negative_prompt"] = (
                f"model.generation.true_cfg_scale={tc} <= 1, and FluxPipeline uses a negative prompt only under true "
                "CFG (true_cfg_scale > 1)", "model.generation.true_cfg_scale=4 to apply it (twice the transformer "
                                             "forwards per step)")
        elif not any(r.negative_prompt is not None for r in rows):
            out["true_cfg_scale"] = (
                "no row has a negative_prompt, and FluxPipeline runs true CFG only with one",
                "add negative_prompt to the rows")
        return out

    def check_family_rows(self, rows: List[Any], path: Any) -> None:
        """Rows without a guidance value on a model that takes one are refused (``model.generation.guidance_scale:
        null`` is for models without guidance embedding).

        Raises:
            ConfigValueError: a guidance value is missing, naming ``model.generation.guidance_scale``.
        """
        if any(r.guidance_scale is None for r in rows) and self.guidance_embeds:
            raise ConfigValueError(
                f"model.generation.guidance_scale=null, but model={self.cfg.name}'s transformer takes a guidance value "
                "(transformer config guidance_embeds=true); fix: model.generation.guidance_scale=3.5 (FLUX.1-dev's "
                "default), or a guidance_scale in every row")

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """``true_cfg_scale`` when the row's negative prompt is applied (true CFG), else null."""
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale) if row.negative_prompt is not None
                else None}

    def family_kwargs(self, batch: List[Item]) -> Dict[str, Any]:
        """``true_cfg_scale`` with the rows' negative prompts (FluxPipeline's true CFG)."""
        if batch[0].row.negative_prompt is None:
            return {}
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale)}

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

    def load_pipeline(self) -> None:
        """The generic loading; diffusers' per-call truncation warning (the whole dropped text: 4.4 MB of console
        for one 2-million-character prompt) is filtered out: every record carries its ``tokens`` per encoder."""
        quiet_truncation_warnings("diffusers.pipelines.flux.pipeline_flux")
        super().load_pipeline()

    def expected_forwards(self, batch: List[Item]) -> int:
        """Transformer forwards one ``FluxPipeline`` call makes for ``batch``: steps, doubled under true CFG."""
        r = batch[0].row
        true_cfg = float(self.cfg.generation.true_cfg_scale)
        return r.num_inference_steps * (2 if r.negative_prompt is not None and true_cfg > 1 else 1)


# ---------------------------------------------------------------------------------- module-level entry points
def build_components(arch: Dict[str, Any], device: Any = "cpu", dtype: Any = None) -> Dict[str, Any]:
    """Every FLUX component from ``arch`` with seeded random weights (:meth:`PipelineEngine.build_components`)."""
    import torch

    return FluxEngine.build_components(arch, device=device, dtype=dtype or torch.float32)


def embedded_snapshot(name: str, arch: Dict[str, Any], cache_dir: Optional[str]) -> Path:
    """The cache dir of an embedded FLUX model, created on first use (:meth:`PipelineEngine.embedded_snapshot`)."""
    eng = FluxEngine.__new__(FluxEngine)
    eng.cfg, eng.cache_dir, eng.source = type("M", (), {"name": name})(), cache_dir, {}
    return eng.embedded_snapshot(arch)
