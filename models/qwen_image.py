"""Qwen-Image family (diffusers ``QwenImagePipeline``) on the generic pipeline engine.

One text encoder, Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``; its last hidden state), fed the prompt inside a
chat template whose first 34 tokens the pipeline drops (``prompt_template_encode_start_idx``); an MMDiT
(``QwenImageTransformer2DModel``) whose joint attention takes a text mask; the Wan-style causal VAE
(``AutoencoderKLQwenImage``). True CFG as FLUX: a negative prompt with ``true_cfg_scale > 1`` makes a second
transformer forward per step (``do_true_cfg = true_cfg_scale > 1 and has_neg_prompt``).

Conditioning tasks (issue #30). ``image_to_image`` and ``inpaint`` load the text-to-image checkpoint (same
components); ``edit`` (``QwenImageEditPlusPipeline``, Qwen-Image-Edit-2509) is a checkpoint of its own: the same
transformer/VAE/text encoder classes plus a ``processor`` (``Qwen2VLProcessor``: the Qwen2 tokenizer with Qwen2-VL's
vision markers and a Qwen2-VL image processor), the reference images entering both the text encoder (as vision
tokens) and the transformer (as VAE latents packed after the target's). What each pipeline does to an input's size
(diffusers 0.42; the runner must refuse or record it):

============== ================================ ========================================================================
task           pipeline                         input size
============== ================================ ========================================================================
image_to_image QwenImageImg2ImgPipeline         ``image`` resized to the call's ``height`` x ``width`` (aspect ratio not
                                                kept; ``VaeImageProcessor.preprocess``); the output is that size
inpaint        QwenImageInpaintPipeline         ``image`` and ``mask_image`` resized to ``height`` x ``width``
                                                (``padding_mask_crop`` instead crops a region around the mask, resizes it
                                                with ``fill`` and pastes the result back: output = the input's size)
edit           QwenImageEditPlusPipeline        each reference (PIL only: it reads ``image.size``) resized twice, aspect
                                                kept: for the VAE to ``calculate_dimensions(1024*1024, w/h)`` (multiples
                                                of 32, so ~1 MP whatever the input), for the text encoder to
                                                ``calculate_dimensions(384*384, w/h)`` then the Qwen2-VL processor's
                                                ``smart_resize`` (multiples of 28 within ``min_pixels``/``max_pixels``);
                                                the output is ``height`` x ``width`` when given (floored to 16), else
                                                ~1 MP at the LAST reference's aspect ratio; batch size 1 only;
                                                ``max_sequence_length`` truncates nothing (only checked <= 1024);
                                                :func:`edit_sizes` computes all of it from the pipeline's own rule
============== ================================ ========================================================================
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from models.family import FamilySpec, temporal_downsample_scale
from models.pipelines import PipelineEngine

#: QwenImagePipeline's prompt template and the tokens of it that it drops (``pipeline_qwenimage.py``, diffusers 0.42)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")
TEMPLATE_DROP = 34
#: QwenImageEditPlusPipeline's prompt template and the tokens of it that it drops (``pipeline_qwenimage_edit_plus.py``,
#: diffusers 0.42: ``prompt_template_encode_start_idx = 64``); the references enter as
#: ``Picture N: <|vision_start|><|image_pad|><|vision_end|>`` before the prompt
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")
EDIT_TEMPLATE_DROP = 64
#: ``tokenizer_max_length``: the most prompt tokens (after the drop) the pipeline tokenizes, and its
#: ``check_inputs`` ceiling on ``max_sequence_length``
QWEN_MAX_SEQUENCE_LENGTH = 1024
#: ``Qwen2_5_VLConfig`` id field (without ``_token_id``) -> the tokenizer's marker it names
VISION_TOKEN_IDS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>",
                    "vision_end": "<|vision_end|>"}


QWEN_IMAGE = FamilySpec(
    name="qwen_image",
    tasks={"text_to_image": "QwenImagePipeline", "image_to_image": "QwenImageImg2ImgPipeline",
           "inpaint": "QwenImageInpaintPipeline", "edit": "QwenImageEditPlusPipeline"},
    multi_image=("edit",),  # QwenImageEditPlusPipeline takes several reference images
    components={"transformer": ("diffusers", "QwenImageTransformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKLQwenImage", None),
                "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("qwen2", "qwen2_5_vl", "text_encoder")},
    cfg="true_cfg",  # do_true_cfg = true_cfg_scale > 1 and has_neg_prompt: a second forward per step
    size_rule=temporal_downsample_scale, patch=2,  # 2 ** len(temperal_downsample) x 2 (2x2 latent packing)
    max_sequence_length=QWEN_MAX_SEQUENCE_LENGTH,
    needs_mask=True,  # the joint attention masks padded text tokens
    engine="models.qwen_image:QwenImageEngine",
    guidance_hint="Qwen-Image's default",
    # edit: Qwen-Image-Edit-2509's own checkpoint, whose processor wraps the tokenizer with a Qwen2-VL image processor
    task_processors={"edit": {"processor": ("qwen2_vl", "tokenizer")}},
    input_sizing={"image_to_image": "resize", "inpaint": "resize", "edit": "area"},
)


def edit_sizes(references: List[Tuple[int, int]], width: Optional[int] = None, height: Optional[int] = None,
               vae_scale: int = 8) -> Dict[str, Any]:
    """What QwenImageEditPlusPipeline (diffusers 0.42) does to the sizes of ``references`` (``(width, height)`` each,
    in call order) for an output of ``width`` x ``height`` (None: the pipeline's own choice), computed with the
    pipeline module's own ``calculate_dimensions`` and area constants (read at call time), so the runner can record or
    refuse them before anything loads.

    Returns:
        ``{"vae": [(w, h)...], "condition": [(w, h)...], "output": (w, h), "image_tokens": n}``: each reference's size
        for the VAE (its latents join the transformer's sequence) and for the text encoder (before the Qwen2-VL
        processor's own ``smart_resize``), the output size, and the transformer's image sequence length (target plus
        references, ``vae_scale * 2`` pixels per token side).
    """
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as mod

    if not references:
        raise ValueError("QwenImageEditPlusPipeline needs at least one reference image")
    vae = [mod.calculate_dimensions(mod.VAE_IMAGE_SIZE, w / h) for w, h in references]
    cond = [mod.calculate_dimensions(mod.CONDITION_IMAGE_SIZE, w / h) for w, h in references]
    last_w, last_h = references[-1]
    auto_w, auto_h = mod.calculate_dimensions(1024 * 1024, last_w / last_h)
    mult = vae_scale * 2
    out = ((width or auto_w) // mult * mult, (height or auto_h) // mult * mult)
    tokens = sum((w // mult) * (h // mult) for w, h in [out, *vae])
    return {"vae": vae, "condition": cond, "output": out, "image_tokens": tokens}


class QwenImageEngine(PipelineEngine):
    """The Qwen-Image family (engine ``qwen_image``): role ``joint`` (``QwenDoubleStreamAttnProcessor2_0``)."""

    spec = QWEN_IMAGE

    @classmethod
    def build_tokenizers(cls, arch: Dict[str, Any], task: Optional[str] = None) -> Dict[str, Any]:
        """A Qwen2-style tokenizer in which the template's fixed text tokenizes as in Qwen's vocabulary (34 tokens
        before the prompt), so the pipeline's drop removes exactly the template. For ``edit``: the Edit-Plus template
        (64 tokens) and Qwen2-VL's vision markers (the processor expands ``<|image_pad|>``).

        Raises:
            ValueError: the built tokenizer splits the template otherwise (a corpus or vocabulary too small).
        """
        from models import tokenizers as T

        edit = task == "edit"
        template, drop = (EDIT_TEMPLATE, EDIT_TEMPLATE_DROP) if edit else (TEMPLATE, TEMPLATE_DROP)
        tcfg = arch.get("tokenizer") or {}
        tok = T.build_qwen2_tokenizer(cls.corpus(arch), int(tcfg.get("vocab_size", 1024)),
                                      template_text=[template.format("")], vision=edit)
        n = len(tok(template.split("{}")[0])["input_ids"])
        if n != drop:
            raise ValueError(f"the built Qwen2 tokenizer splits {cls.spec.tasks[task or 'text_to_image']}'s template "
                             f"prefix into {n} tokens, not {drop}; raise model.architecture.tokenizer.vocab_size")
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
        vocab = tok.get_vocab()
        if "<|image_pad|>" in vocab:  # a vision tokenizer (edit): the encoder finds the image tokens by these ids
            kw.update({f"{name}_token_id": vocab[marker] for name, marker in VISION_TOKEN_IDS.items()})
        return kw

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Prompt tokens the encoder's output keeps: the templated prompt's tokens minus the 34 dropped (``edit``:
        the Edit-Plus template's, minus 64; the references' ``Picture N:`` vision tokens come on top)."""
        template, drop = (EDIT_TEMPLATE, EDIT_TEMPLATE_DROP) if self.task == "edit" else (TEMPLATE, TEMPLATE_DROP)
        return [len(ids) - drop for ids in tok([template.format(p) for p in prompts],
                                               truncation=False, verbose=False)["input_ids"]]

    def token_limit(self, label: str, tok: Any) -> int:
        """``min(1024, max_sequence_length)``: the pipeline tokenizes 1024 + 34 tokens and keeps the first
        ``max_sequence_length`` embeddings. ``edit``: QwenImageEditPlusPipeline truncates nothing (its processor
        call has no ``max_length`` and ``max_sequence_length`` only passes its ``<= 1024`` check), so the limit is
        the tokenizer's ``model_max_length``."""
        if self.task == "edit":
            return int(tok.model_max_length)
        return min(QWEN_MAX_SEQUENCE_LENGTH, int(self.cfg.generation.max_sequence_length))

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[Any, ...]]:
        """The true-CFG rules (:func:`models.family.negative_prompt_ignored`), and ``guidance_scale`` unless the
        transformer is guidance-distilled (``guidance_embeds``)."""
        out: Dict[str, Tuple[Any, ...]] = {}
        if not self.component_config("transformer").get("guidance_embeds", False):
            out["guidance_scale"] = ("its transformer has no guidance embedding (guidance_embeds=false): "
                                     "QwenImagePipeline ignores guidance_scale (true_cfg_scale is its guidance)",
                                     "use model.generation.true_cfg_scale with a negative_prompt")
        return {**out, **super().ignored_fields(rows)}

    def edit_plan(self, row: Any) -> Dict[str, Any]:
        """:func:`edit_sizes` of ``row``'s references (their sizes as checked at startup) for its output size, with
        the pipeline's VAE scale (``2 ** len(temperal_downsample)``: :meth:`size_need` / 2)."""
        refs = row.inputs["image"]
        refs = refs if isinstance(refs, list) else [refs]
        return edit_sizes([(x.width, x.height) for x in refs], row.width, row.height,
                          vae_scale=(self.size_need() or 16) // 2)

    def expected_sequence(self, row: Any) -> int:
        """``edit``: the Edit-Plus transformer's image sequence, target plus every reference's VAE latents at the size
        the pipeline resizes it to (:func:`edit_sizes`' ``image_tokens``)."""
        if self.task != "edit":
            return super().expected_sequence(row)
        return int(self.edit_plan(row)["image_tokens"])

    def input_sizes(self, row: Any) -> Dict[str, Any]:
        """``edit``: the ``area`` rule, each reference's VAE and text-encoder sizes and the output size as
        QwenImageEditPlusPipeline computes them (:func:`edit_sizes`), recorded in the evidence."""
        out = super().input_sizes(row)
        if self.task == "edit":
            plan = self.edit_plan(row)
            out.update(vae=[list(v) for v in plan["vae"]], condition=[list(c) for c in plan["condition"]],
                       output=list(plan["output"]), image_tokens=plan["image_tokens"])
        return out
