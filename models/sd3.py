"""Stable Diffusion 3 / 3.5 family (diffusers ``StableDiffusion3Pipeline``) on the generic pipeline engine.

Three text encoders (CLIP-L and CLIP-G with projection, T5-XXL), an MMDiT transformer (``SD3Transformer2DModel``)
and classifier-free guidance with a negative prompt: ``guidance_scale > 1`` batches the unconditional and the
conditional input into ONE transformer forward per step (``pipeline_stable_diffusion_3.py``:
``latent_model_input = torch.cat([latents] * 2)``), so forwards per call = ``num_inference_steps``.

diffusers 0.42's SD3 attention (``JointAttnProcessor2_0``) calls ``F.scaled_dot_product_attention`` itself, not
diffusers' attention dispatcher; :class:`SD3DispatchAttnProcessor` is the same computation routed through
``dispatch_attention_fn``, installed on every attention module after loading, so SD3 takes the runner's attention
backends and their per-call-site evidence like the dispatcher-era models.

The family is the spec :data:`SD3` on the generic engine (no class of its own); role ``joint`` (every
``Attention`` of the MMDiT).

Conditioning tasks (issue #30) load the text-to-image checkpoint (the same components; no checkpoint of their own).
What each pipeline does to an input's size (diffusers 0.42; the runner must refuse or record it):

============== ================================== ======================================================================
task           pipeline                           input size
============== ================================== ======================================================================
image_to_image StableDiffusion3Img2ImgPipeline    ``image`` resized to the call's ``height`` x ``width`` (aspect ratio
                                                  not kept; ``VaeImageProcessor.preprocess``; default 1024 x 1024 from
                                                  ``default_sample_size``, never the input's size); output: that size;
                                                  ``strength`` runs the last steps by the pipeline's rule
                                                  (:func:`models.conditioning.steps_run`)
inpaint        StableDiffusion3InpaintPipeline    ``image`` and ``mask_image`` resized to ``height`` x ``width``; with
                                                  ``padding_mask_crop`` a region around the mask is cropped, resized
                                                  (``fill``) and the result pasted back (output = the input's size); a
                                                  16-channel transformer blends the noised input latents outside the
                                                  mask each step (a 33-channel one takes mask and masked latents)
============== ================================== ======================================================================
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from models.family import FamilySpec, block_out_scale


class SD3DispatchAttnProcessor:
    """``JointAttnProcessor2_0`` (diffusers 0.42, ``attention_processor.py``) with its attention call routed through
    diffusers' dispatcher (``dispatch_attention_fn(q, k, v, backend=self._attention_backend)``); also handles
    fused projections (``to_qkv``/``to_added_qkv`` after ``fuse_projections``).

    Layout at the dispatcher: ``(batch, seq_len, heads, head_dim)``, image tokens first, then text tokens.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, *args: Any, **kwargs: Any) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        b = hidden_states.shape[0]
        if getattr(attn, "fused_projections", False) and getattr(attn, "to_qkv", None) is not None:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(b, -1, attn.heads, head_dim) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        n_img = hidden_states.shape[1]
        if encoder_hidden_states is not None:
            if getattr(attn, "fused_projections", False) and getattr(attn, "to_added_qkv", None) is not None:
                eq, ek, ev = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
            else:
                eq, ek, ev = (attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
                              attn.add_v_proj(encoder_hidden_states))
            eq, ek, ev = (t.view(b, -1, attn.heads, head_dim) for t in (eq, ek, ev))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat([x, e], dim=1) for x, e in ((query, eq), (key, ek), (value, ev)))
        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            out, enc = out[:, :n_img], out[:, n_img:]
            if not attn.context_pre_only:
                enc = attn.to_add_out(enc)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, enc) if encoder_hidden_states is not None else out


SD3 = FamilySpec(
    name="sd3",
    tasks={"text_to_image": "StableDiffusion3Pipeline", "image_to_image": "StableDiffusion3Img2ImgPipeline",
           "inpaint": "StableDiffusion3InpaintPipeline"},
    components={"transformer": ("diffusers", "SD3Transformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKL", None),
                "text_encoder": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),
                "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),
                "text_encoder_3": ("transformers", "T5EncoderModel", "T5Config"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("clip", "clip_l", "text_encoder"), "tokenizer_2": ("clip", "clip_g", "text_encoder_2"),
                "tokenizer_3": ("t5", "t5", "text_encoder_3")},
    cfg="batched",  # CFG concatenates both branches into one forward per step
    size_rule=block_out_scale, patch="transformer",  # VAE scale factor x patch_size (check_inputs refuses others)
    quiet_loggers=("diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3",),
    max_sequence_length=512,  # StableDiffusion3Pipeline.check_inputs raises above 512
    attention_processor="models.sd3:SD3DispatchAttnProcessor",
    guidance_hint="SD3.5's default is 3.5 to 4.5",
    input_sizing={"image_to_image": "resize", "inpaint": "resize"},
)
