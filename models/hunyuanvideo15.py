"""HunyuanVideo-1.5 text-to-video family (diffusers ``HunyuanVideo15Pipeline``, diffusers 0.42) on the generic
pipeline engine.

Components (``scripts/convert_hunyuan_video1_5_to_diffusers.py`` in diffusers): the Qwen2.5-VL-7B-Instruct language
model as ``text_encoder`` (``Qwen2_5_VLTextModel``; the pipeline renders the prompt with the tokenizer's chat
template under a fixed system message, pads to 1000 + 108 tokens, takes the hidden states 3 layers from the top and
drops the first 108 tokens: the template's prefix), a ByT5 glyph encoder as ``text_encoder_2`` (``T5EncoderModel``
of Glyph-SDXL-v2 on google/byt5-small; it encodes only the quoted text of a prompt, ``extract_glyph_texts``,
padded to 256 bytes; without quotes its embeddings are zeros), ``HunyuanVideo15Transformer3DModel`` (54 dual-stream
blocks whose attention runs over the video and text tokens concatenated: role ``joint``; a 2-block token refiner
over the text), the causal video VAE ``AutoencoderKLHunyuanVideo15`` (16x spatial, 4x temporal compression),
``FlowMatchEulerDiscreteScheduler`` and a ``ClassifierFreeGuidance`` **guider component**.

Rules the pipeline applies silently and the runner refuses or applies instead:

* guidance is the guider's, not a call argument: ``__call__`` takes no ``guidance_scale``; the guider runs a second,
  separate transformer forward per step whenever its ``guidance_scale`` is not 1 (``_is_cfg_enabled``:
  ``not isclose(guidance_scale, 1.0)``, so also below 1). The engine applies each batch's ``guidance_scale`` with
  ``guider.new(guidance_scale=...)`` and refuses values below 1 (the ``separate`` forward rule counts 2 forwards
  only above 1) and snapshots whose guider skips steps (``start``/``stop``) or is disabled;
* the negative prompt is encoded only when the guider has two conditions (``guidance_scale != 1``);
* widths and heights: latents are ``height // vae.spatial_compression_ratio`` (no check, no warning), so other sizes
  lose pixels; the VAE's ratio times the transformer's ``patch_size`` (1) is the multiple;
* ``num_frames``: latent frames are ``(num_frames - 1) // temporal_compression_ratio + 1`` and the VAE decodes
  ``4 * (latent - 1) + 1`` frames, so a count that is not ``4k+1`` silently yields fewer frames;
* no ``max_sequence_length``: the text length is fixed (1000 Qwen tokens, 256 ByT5 bytes of quoted text).

Attention: the dual-stream blocks' ``HunyuanVideo15AttnProcessor2_0`` calls diffusers' dispatcher and always passes a
boolean mask (padding of both text streams); the token refiner's ``Attention`` modules carry diffusers'
``AttnProcessor2_0``, which calls ``F.scaled_dot_product_attention`` directly, so the engine gives them
:class:`RefinerDispatchAttnProcessor` (the same self-attention with its mask, through the dispatcher;
tests/test_hunyuanvideo15.py checks the outputs equal diffusers') and every attention call is selected and observed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from models.context_parallel import ContextSplit
from models.family import FamilySpec, signature_default
from models.pipelines import PipelineEngine
from models.wan import WanEngine
from runner.core.dataset import DatasetError, Row
from runner.core.errors import ConfigValueError

#: HunyuanVideo15Pipeline's fixed text lengths (``__init__``: ``tokenizer_max_length = 1000``,
#: ``tokenizer_2_max_length = 256``, ``prompt_template_encode_start_idx = 108``; diffusers 0.42).
QWEN_TOKENS, BYT5_TOKENS, TEMPLATE_TOKENS = 1000, 256, 108


def compression_scale(vae: Mapping[str, Any], transformer: Mapping[str, Any], patch: int) -> int:
    """``spatial_compression_ratio * patch``: HunyuanVideo15Pipeline's ``vae_scale_factor_spatial =
    vae.spatial_compression_ratio`` (``AutoencoderKLHunyuanVideo15``'s default 16 when the config lacks it)."""
    ratio = vae.get("spatial_compression_ratio") or signature_default(
        "AutoencoderKLHunyuanVideo15", "spatial_compression_ratio", 16)
    return int(ratio) * patch


class RefinerDispatchAttnProcessor:
    """diffusers' ``AttnProcessor2_0`` (diffusers 0.42, ``attention_processor.py``) as the token refiner of
    ``HunyuanVideo15Transformer3DModel`` runs it (self-attention, no group/spatial norm, no residual, output scale 1),
    with the attention call routed through ``dispatch_attention_fn(..., backend=self._attention_backend)``; handles
    fused projections (``to_qkv`` after ``fuse_projections``).

    Layout at the dispatcher: ``(batch, text_tokens, heads, head_dim)``; ``attention_mask``: the refiner's boolean
    ``(batch, 1, text_tokens, text_tokens)`` (True where both tokens are unpadded), passed as is (AttnProcessor2_0
    repeats it per head, the same values).
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Any, hidden_states: Any, encoder_hidden_states: Any = None, attention_mask: Any = None,
                 *args: Any, **kwargs: Any) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if encoder_hidden_states is not None:
            raise ValueError("RefinerDispatchAttnProcessor serves the token refiner's self-attention only")
        if getattr(attn, "fused_projections", False) and getattr(attn, "to_qkv", None) is not None:
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        out = dispatch_attention_fn(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


HUNYUANVIDEO15 = FamilySpec(
    name="hunyuanvideo15",
    tasks={"text_to_video": "HunyuanVideo15Pipeline"},
    components={"transformer": ("diffusers", "HunyuanVideo15Transformer3DModel", None),
                "vae": ("diffusers", "AutoencoderKLHunyuanVideo15", None),
                "text_encoder": ("transformers", "Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig"),
                "text_encoder_2": ("transformers", "T5EncoderModel", "T5Config"),
                "guider": ("diffusers", "ClassifierFreeGuidance", None),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("qwen2", "qwen2_5_vl", "text_encoder"), "tokenizer_2": ("t5", "byt5", "text_encoder_2")},
    cfg="separate",  # the guider: guidance_scale != 1 -> a second, separate forward per step (values < 1 refused)
    size_rule=compression_scale, patch="transformer",  # 16 x patch_size 1
    quiet_loggers=("diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5",),
    fp8_prefixes=("transformer_blocks.",),
    needs_mask=True,  # both processors pass a boolean mask (the text streams' padding)
    engine="models.hunyuanvideo15:HunyuanVideo15Engine",
    guidance_hint="HunyuanVideo-1.5 480p: 6.0",
)


class HunyuanVideo15Engine(WanEngine):
    """The HunyuanVideo-1.5 text-to-video family (engine ``hunyuanvideo15``): Wan's video rules (frames ``4k+1``
    from the VAE's temporal factor, ``num_frames``/``fps`` required) with the guider, the tokenizers and the
    refiner's processor of this pipeline."""

    spec = HUNYUANVIDEO15

    def check_input_channels(self, experts: Sequence[str]) -> None:
        """Not Wan's channel rule: HunyuanVideo15Pipeline feeds its transformer the noise latents, the condition
        latents and a mask for text-to-video too (``torch.cat([latents, cond_latents_concat, mask_concat])``:
        ``in_channels`` = 2 x the VAE's ``latent_channels`` + 1, 65 in the 480p checkpoint, 17 in the tiny one), and
        the family has one task, so no checkpoint of another task can meet it (``check_layout`` checks the
        snapshot's classes)."""

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def build_tokenizers(cls, arch: Dict[str, Any], task: Optional[str] = None) -> Dict[str, Any]:
        """A Qwen2-style tokenizer with Qwen2's chat template, trained so that the rendered template's fixed prefix
        is exactly the 108 tokens the pipeline drops, and ByT5's byte tokenizer (:mod:`models.tokenizers`)."""
        from models import tokenizers as T

        tcfg = arch.get("tokenizer") or {}
        tok = T.build_qwen2_chat_tokenizer(cls.corpus(arch), int(tcfg.get("vocab_size", 512)),
                                           template_text=[template_prefix()])
        return {"tokenizer": tok, "tokenizer_2": T.build_byt5_tokenizer(BYT5_TOKENS)}

    @classmethod
    def encoder_config(cls, kind: str, tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
        """The generic consistency (vocabulary, T5 special ids), and the Qwen encoder's pad, bos and eos ids: the
        tokenizer's (as models/qwen_image.py does), not Qwen's 151643/151645 outside a tiny vocabulary, which
        transformers warns about on every load."""
        kw = super().encoder_config(kind, tok, kw)
        if kind == "qwen2":
            kw.setdefault("pad_token_id", tok.pad_token_id)
            # Qwen2.5-VL's bos is <|endoftext|> (its pad), its eos <|im_end|>; neither enters the encoder's forward
            kw.setdefault("bos_token_id", tok.pad_token_id)
            kw.setdefault("eos_token_id", tok.convert_tokens_to_ids("<|im_end|>"))
        return kw

    def temporal_factor(self) -> int:
        """The VAE's temporal compression as the pipeline reads it: ``vae.temporal_compression_ratio``
        (``AutoencoderKLHunyuanVideo15``'s default 4 when the config lacks it)."""
        vae = self.component_config("vae")
        return int(vae.get("temporal_compression_ratio") or signature_default(
            "AutoencoderKLHunyuanVideo15", "temporal_compression_ratio", 4))

    def check_layout(self, path: Any) -> None:
        """The generic layout check, then the snapshot's guider: a disabled one, one that skips guidance on some
        steps (``start``/``stop`` other than 0/1), or one with ``use_original_formulation`` (guidance off only at
        ``guidance_scale`` 0, not 1) makes forward counts the runner does not predict.

        Raises:
            ModelPathError: naming the guider setting and the fix.
        """
        from models.pipelines import ModelPathError

        PipelineEngine.check_layout(self, path)
        f = Path(path) / "guider" / "guider_config.json"
        conf = json.loads(f.read_text()) if f.is_file() else {}
        want = (("start", 0.0), ("stop", 1.0), ("enabled", True), ("use_original_formulation", False))
        bad = {k: conf[k] for k, ok in want if k in conf and conf[k] != ok}
        if bad:
            raise ModelPathError(f"model.path={str(path)!r}: its guider ({f}) sets {bad}: guidance on only some steps "
                                 "(or none, or off at 0 instead of 1) makes forward counts the runner does not "
                                 "predict; fix: a snapshot whose guider has start 0, stop 1, enabled true, "
                                 "use_original_formulation false (the published ones)")

    # ------------------------------------------------------------------------------------------- attention
    def prepare_attention(self) -> None:
        """The token refiner's attention modules (``context_embedder.token_refiner``: diffusers' ``AttnProcessor2_0``,
        outside the dispatcher) get :class:`RefinerDispatchAttnProcessor`; the dual-stream blocks keep their own
        dispatching processor."""
        from models.pipelines import attention_modules, uses_dispatcher

        for _, mod in attention_modules(self.pipe.transformer.context_embedder):
            if not uses_dispatcher(mod):
                mod.set_processor(RefinerDispatchAttnProcessor())

    # ------------------------------------------------------------------------------------------ text length
    def check_config(self) -> None:
        """The video checks, ``model.generation.max_sequence_length`` equal to the pipeline's fixed length, and
        ``batch_size`` > 1 only with ``memory.vae_slicing=true``: diffusers 0.42.1's ``HunyuanVideo15AttnBlock``
        builds its causal mask as ``(B, S, S)``, which SDPA broadcasts against ``(B, 1, S, C)`` queries, so a batch
        of two or more videos fails in the VAE decode, after every denoising step of the batch
        (``tests/test_memory_video_vae.py``; the runner then redoes its items one by one).

        Raises:
            ConfigValueError: naming the key, the value and the fix.
        """
        super().check_config()
        run = self.ctx.run
        if int(run.batch_size) > 1 and not run.memory.vae_slicing:
            raise ConfigValueError(f"batch_size={run.batch_size} on model={self.cfg.name} without memory.vae_slicing: "
                                   "diffusers' HunyuanVideo-1.5 VAE decode fails on a batch of two or more videos "
                                   "(its attention mask, diffusers 0.42.1), after the batch's denoising; fix: "
                                   "memory.vae_slicing=true (decodes one video at a time) or batch_size=1")
        msl = self.cfg.generation.max_sequence_length
        if msl is not None and int(msl) != QWEN_TOKENS:
            raise ConfigValueError(f"model.generation.max_sequence_length={msl}: HunyuanVideo15Pipeline takes no "
                                   f"max_sequence_length and always encodes {QWEN_TOKENS} prompt tokens; fix: "
                                   f"model.generation.max_sequence_length={QWEN_TOKENS}")

    def sequence_limit(self) -> Optional[int]:
        """The pipeline's fixed Qwen length (:data:`QWEN_TOKENS`)."""
        return QWEN_TOKENS

    def token_limit(self, label: str, tok: Any) -> int:
        """What each encoder sees: 1000 prompt tokens (after the 108-token template prefix), 256 glyph bytes."""
        return BYT5_TOKENS if label == "byt5" else QWEN_TOKENS

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Tokens each encoder is given for each prompt: the Qwen tokenizer's tokens of the prompt inside the
        template (the chat markers after it included), the ByT5 bytes of the glyph text the pipeline extracts
        (``extract_glyph_texts``: the quoted parts; 0 without quotes, when the pipeline encodes nothing)."""
        if label != "byt5":
            return [len(ids) - TEMPLATE_TOKENS for ids in tok.apply_chat_template(
                [chat(p) for p in prompts], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]]
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

        glyphs = [extract_glyph_texts(p) for p in prompts]
        return [0 if g is None else len(tok(g, truncation=False)["input_ids"]) for g in glyphs]

    # ----------------------------------------------------------------------------------------------- guidance
    def call_params(self) -> set:
        """The pipeline's ``__call__`` arguments plus ``guidance_scale``, which the engine applies through the
        guider (:meth:`call_kwargs`)."""
        return super().call_params() | {"guidance_scale"}

    def call_kwargs(self, batch: Sequence[Any]) -> Dict[str, Any]:
        """The generic arguments without ``guidance_scale`` and ``max_sequence_length``; the batch's guidance scale
        is set on the pipeline's guider (``guider.new``: a copy with that ``guidance_scale``)."""
        kw = super().call_kwargs(batch)
        kw.pop("max_sequence_length", None)
        gs = kw.pop("guidance_scale", None)
        if gs is not None and self.pipe is not None and not math.isclose(self.pipe.guider.guidance_scale, gs):
            self.pipe.guider = self.pipe.guider.new(guidance_scale=float(gs))
        return kw

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """Wan's ``4k+1`` frame rule, and every row's ``guidance_scale`` set and at least 1: the guider runs two
        forwards for any value other than 1, also below it, where the negative prompt would be pushed toward.

        Raises:
            DatasetError / ConfigValueError: every bad row (file:line) or the bad default.
        """
        super().check_family_rows(rows, path)
        bad = [r for r in rows if r.guidance_scale is None or r.guidance_scale < 1]
        if not bad:
            return
        fix = f"guidance_scale=1 (no guidance) or above ({self.spec.guidance_hint})"
        if all("guidance_scale" not in r.set_fields for r in bad):
            raise ConfigValueError(f"model.generation.guidance_scale={bad[0].guidance_scale}: model={self.cfg.name}'s "
                                   f"guider needs a value of at least 1; fix: model.generation.{fix}")
        raise DatasetError([f"{path}:{r.line}: guidance_scale={r.guidance_scale} is below 1 or unset, which "
                            f"model={self.cfg.name}'s guider would run as guidance away from the prompt; fix: {fix}"
                            for r in bad])

    # Wan's that do not hold here: every dual-stream attention makes ONE dispatcher call although it has
    # ``add_k_proj`` (Wan I2V's makes two), and no context-parallel plan is declared (refused by the base rule)
    site_calls_per_forward = PipelineEngine.site_calls_per_forward
    context_tokens = ContextSplit.context_tokens


def system_message() -> str:
    """HunyuanVideo15Pipeline's fixed system message (the default of ``_get_mllm_prompt_embeds``)."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    return inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default


def template_prefix() -> str:
    """The chat template's fixed prefix as HunyuanVideo15Pipeline renders it (system message, then the user turn's
    start): what its ``crop_start`` of 108 tokens drops."""
    return f"<|im_start|>system\n{system_message()}<|im_end|>\n<|im_start|>user\n"


def chat(prompt: str) -> List[Dict[str, str]]:
    """The messages HunyuanVideo15Pipeline renders for ``prompt`` (its ``format_text_input``)."""
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

    return format_text_input([prompt], system_message())[0]
