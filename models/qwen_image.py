"""Qwen-Image family (diffusers ``QwenImagePipeline``) on the generic pipeline engine.

One text encoder, Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``; its last hidden state), fed the prompt inside a
chat template whose first 34 tokens the pipeline drops (``prompt_template_encode_start_idx``); an MMDiT
(``QwenImageTransformer2DModel``) whose joint attention takes a text mask; the Wan-style causal VAE
(``AutoencoderKLQwenImage``). True CFG as FLUX: a negative prompt with ``true_cfg_scale > 1`` makes a second
transformer forward per step (``do_true_cfg = true_cfg_scale > 1 and has_neg_prompt``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from models.pipelines import PipelineEngine
from runner.core.dataset import Item

#: QwenImagePipeline's prompt template and the tokens of it that it drops (``pipeline_qwenimage.py``, diffusers 0.42)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
TEMPLATE_DROP = 34
#: ``tokenizer_max_length``: the most prompt tokens (after the drop) the pipeline tokenizes, and its
#: ``check_inputs`` ceiling on ``max_sequence_length``
QWEN_MAX_SEQUENCE_LENGTH = 1024


class QwenImageEngine(PipelineEngine):
    """The Qwen-Image family (engine ``qwen_image``): role ``joint`` (``QwenDoubleStreamAttnProcessor2_0``)."""

    pipeline_class = "QwenImagePipeline"
    components = {"transformer": ("diffusers", "QwenImageTransformer2DModel", None),
                  "vae": ("diffusers", "AutoencoderKLQwenImage", None),
                  "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
                  "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)}
    tokenizers_spec = {"tokenizer": ("qwen2", "qwen2_5_vl", "text_encoder")}
    max_sequence_length_limit = QWEN_MAX_SEQUENCE_LENGTH
    backend_fields = ("attention", "linear")
    needs_mask = True  # the joint attention masks padded text tokens

    @classmethod
    def family(cls) -> str:
        return "qwen_image"

    @classmethod
    def build_tokenizers(cls, arch: Dict[str, Any]) -> Dict[str, Any]:
        """A Qwen2-style tokenizer in which the template's fixed text tokenizes as in Qwen's vocabulary (34 tokens
        before the prompt), so the pipeline's drop removes exactly the template.

        Raises:
            ValueError: the built tokenizer splits the template otherwise (a corpus or vocabulary too small).
        """
        from models import tokenizers as T

        tcfg = arch.get("tokenizer") or {}
        tok = T.build_qwen2_tokenizer(cls.corpus(arch), int(tcfg.get("vocab_size", 1024)),
                                      template_text=[TEMPLATE.format("")])
        n = len(tok(TEMPLATE.split("{}")[0])["input_ids"])
        if n != TEMPLATE_DROP:
            raise ValueError(f"the built Qwen2 tokenizer splits QwenImagePipeline's template prefix into {n} tokens, "
                             f"not {TEMPLATE_DROP}; raise model.architecture.tokenizer.vocab_size")
        return {"tokenizer": tok}

    @classmethod
    def encoder_config(cls, kind: str, tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
        """Qwen2.5-VL's text config sized to the tokenizer (vocabulary, pad and end ids)."""
        kw = dict(kw)
        text = dict(kw.get("text_config") or {})
        text["vocab_size"] = max(len(tok), int(text.get("vocab_size", 0)))
        # Qwen2.5-VL's bos is <|endoftext|> (id 151643 in Qwen's vocabulary), its pad too
        text.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id)
        kw["text_config"] = text
        return kw

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Prompt tokens the encoder's output keeps: the templated prompt's tokens minus the 34 dropped."""
        return [len(ids) - TEMPLATE_DROP for ids in tok([TEMPLATE.format(p) for p in prompts],
                                                        truncation=False, verbose=False)["input_ids"]]

    def token_limit(self, label: str, tok: Any) -> int:
        """``min(1024, max_sequence_length)``: the pipeline tokenizes 1024 + 34 tokens and keeps the first
        ``max_sequence_length`` embeddings."""
        return min(QWEN_MAX_SEQUENCE_LENGTH, int(self.cfg.generation.max_sequence_length))

    def size_need(self) -> int:
        """VAE scale factor (2 ** len(temperal_downsample)) x 2 for the 2x2 latent packing (the pipeline resizes
        other sizes with a warning)."""
        vae = self.component_config("vae")
        return 2 ** len(vae.get("temperal_downsample") or [False, True, True]) * 2

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[str, ...]]:
        """``guidance_scale`` unless the transformer is guidance-distilled (``guidance_embeds``); ``negative_prompt``
        unless ``true_cfg_scale`` > 1; ``true_cfg_scale`` > 1 when no row has a negative prompt."""
        out: Dict[str, Tuple[str, ...]] = {}
        if not self.component_config("transformer").get("guidance_embeds", False):
            out["guidance_scale"] = ("its transformer has no guidance embedding (guidance_embeds=false): "
                                     "QwenImagePipeline ignores guidance_scale (true_cfg_scale is its guidance)",
                                     "use model.generation.true_cfg_scale with a negative_prompt")
        tc = float(self.cfg.generation.true_cfg_scale)
        if tc <= 1:
            out["negative_prompt"] = (f"model.generation.true_cfg_scale={tc} <= 1, and QwenImagePipeline uses a "
                                      "negative prompt only under true CFG",
                                      "model.generation.true_cfg_scale=4 (Qwen-Image's default)")
        elif not any(r.negative_prompt is not None for r in rows):
            out["true_cfg_scale"] = ("no row has a negative_prompt, and QwenImagePipeline runs true CFG only with one",
                                     "add negative_prompt to the rows (an empty string works: ' ')")
        return out

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """``true_cfg_scale`` when the row's negative prompt is applied (true CFG), else null."""
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale) if row.negative_prompt is not None
                else None}

    def family_kwargs(self, batch: List[Item]) -> Dict[str, Any]:
        """``true_cfg_scale``: the configured value with negative prompts, else 1 (the pipeline's default is 4, which
        with no negative prompt only warns)."""
        r0 = batch[0].row
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale) if r0.negative_prompt is not None
                else 1.0}

    def expected_forwards(self, batch: List[Item]) -> int:
        """Steps, doubled under true CFG (a negative prompt and ``true_cfg_scale`` > 1)."""
        r = batch[0].row
        true_cfg = r.negative_prompt is not None and float(self.cfg.generation.true_cfg_scale) > 1
        return r.num_inference_steps * (2 if true_cfg else 1)
