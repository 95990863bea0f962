"""HiDream-I1 family (diffusers ``HiDreamImagePipeline``) on the generic pipeline engine, with stage-scoped MoE
backends.

Components: a sparse DiT (``HiDreamImageTransformer2DModel``: ``num_layers`` dual-stream blocks, then
``num_single_layers`` single-stream blocks, each with a routed mixture of SwiGLU experts on the image stream,
diffusers' ``MOEFeedForwardSwiGLU``), four text encoders (CLIP-L and CLIP-G with projection: pooled embeddings;
T5-XXL; Llama-3.1-8B-Instruct: the hidden states of every layer, ``llama_layers`` picks one per block), the FLUX
VAE (``AutoencoderKL``), a flow scheduler (HiDream-I1-Full: UniPC with flow sigmas, shift 3).

Rules of the pipeline (diffusers 0.42, ``pipeline_hidream_image.py``) the runner declares instead of letting them
apply silently:

* sizes: every requested (width, height) is rescaled to the pixel area ``(default_sample_size *
  vae_scale_factor) ** 2`` (1024^2 for HiDream-I1: ``default_sample_size = 128``), keeping the aspect ratio, and
  rounded down to multiples of ``2 * vae_scale_factor``; a size it would change is refused (:meth:`pipeline_size`);
* guidance: ``guidance_scale > 1`` is classifier-free guidance with the negative prompt ("" without one), batched
  into ONE transformer forward per step (``torch.cat([latents] * 2)``); a negative prompt is used only then;
* sequences: CLIP sees ``min(max_sequence_length, 218)`` tokens (padded to that, so both CLIPs need that many
  positions), T5 ``min(max_sequence_length, tokenizer_3.model_max_length)``, Llama
  ``min(max_sequence_length, tokenizer_4.model_max_length)`` (with its ``<|begin_of_text|>``); the pipeline has
  no ceiling of its own, so a ``max_sequence_length`` a tokenizer would cut silently is refused;
* ``tokenizer_4``: the raw prompt, no chat template; the pipeline sets ``pad_token = eos_token`` (right padding
  with an attention mask).

Attention: diffusers' ``HiDreamAttnProcessor`` calls ``F.scaled_dot_product_attention`` itself;
:class:`HiDreamDispatchAttnProcessor` is the same computation through diffusers' dispatcher, installed on every
attention module after loading (roles ``joint``: dual-stream blocks, ``single``: single-stream blocks), so HiDream
takes the runner's attention backends and per-call-site evidence. diffusers' ``fuse_projections`` does not apply
to ``HiDreamAttention`` (not an ``AttentionModuleMixin``): ``optimize.fuse_qkv`` fuses nothing here (recorded as 0
modules).

MoE (``backend.moe``, :class:`HiDreamExperts`): ``TORCH`` keeps diffusers' own expert loop (``moe_infer``: the
reference), ``TRITON`` computes the routed experts with ``runner.kernels.moe.moe_triton``, ``GROUPED_MM`` with
``runner.kernels.moe.moe_grouped_mm`` (router and shared expert stay diffusers'). Routing: softmax over the routed
experts, top-k, no renormalization (``MoEGate.norm_topk_prob`` is False); diffusers takes the softmax in the
activations' dtype, ``runner.kernels.moe.route`` in fp32 (the same in fp32 runs; in bf16 the routing weights differ by
bf16 rounding).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from runner.kernels.moe import ExpertsLayout
from models import tokenizer_kinds
from models.family import FamilySpec, block_out_scale
from models.pipelines import ModelPathError, PipelineEngine
from runner.core.dataset import DatasetError, Row
from runner.core.errors import ConfigValueError

#: ``HiDreamImagePipeline.__init__``: ``self.default_sample_size = 128`` (latent pixels per side of the target area)
DEFAULT_SAMPLE_SIZE = 128
#: ``HiDreamImagePipeline._get_clip_prompt_embeds``: CLIP prompts are padded/truncated to ``min(msl, 218)`` tokens
CLIP_MAX_TOKENS = 218


class _NoAttentionMapsNotice(logging.Filter):
    """Drops transformers' notice that SDPA returns no attention maps (HiDreamImagePipeline asks Llama for them with
    ``output_attentions=True`` and never uses them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "does not support `output_attentions=True`" not in record.getMessage()


class HiDreamDispatchAttnProcessor:
    """``HiDreamAttnProcessor`` (diffusers 0.42, ``transformer_hidream_image.py``) with its attention call routed
    through diffusers' dispatcher (``dispatch_attention_fn(q, k, v, backend=self._attention_backend)``).

    Layout at the dispatcher: ``(batch, seq_len, heads, head_dim)``; dual-stream modules: image tokens first, then
    text tokens. ``hidden_states_masks`` (non-square sizes pad the image tokens) zeroes the keys of padding tokens,
    as diffusers does; no attention mask is passed.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor, hidden_states_masks: Optional[torch.Tensor] = None,
                 encoder_hidden_states: Optional[torch.Tensor] = None, image_rotary_emb: Optional[torch.Tensor] = None,
                 *args: Any, **kwargs: Any) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_hidream_image import apply_rope

        dtype, b = hidden_states.dtype, hidden_states.shape[0]
        query = attn.q_rms_norm(attn.to_q(hidden_states)).to(dtype=dtype)
        key = attn.k_rms_norm(attn.to_k(hidden_states)).to(dtype=dtype)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(b, -1, attn.heads, head_dim) for t in (query, key, value))
        if hidden_states_masks is not None:
            key = key * hidden_states_masks.view(b, -1, 1, 1)
        n_img = query.shape[1]
        if not attn.single:
            qt = attn.q_rms_norm_t(attn.to_q_t(encoder_hidden_states)).to(dtype=dtype)
            kt = attn.k_rms_norm_t(attn.to_k_t(encoder_hidden_states)).to(dtype=dtype)
            vt = attn.to_v_t(encoder_hidden_states)
            qt, kt, vt = (t.view(b, -1, attn.heads, head_dim) for t in (qt, kt, vt))
            query, key, value = torch.cat([query, qt], 1), torch.cat([key, kt], 1), torch.cat([value, vt], 1)
        if query.shape[-1] == image_rotary_emb.shape[-3] * 2:
            query, key = apply_rope(query, key, image_rotary_emb)
        else:
            q1, q2 = query.chunk(2, dim=-1)
            k1, k2 = key.chunk(2, dim=-1)
            q1, k1 = apply_rope(q1, k1, image_rotary_emb)
            query, key = torch.cat([q1, q2], dim=-1), torch.cat([k1, k2], dim=-1)
        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.reshape(b, -1, attn.heads * head_dim).to(query.dtype)
        if not attn.single:
            out_i, out_t = out[:, :n_img], out[:, n_img:]
            return attn.to_out(out_i), attn.to_out_t(out_t)
        return attn.to_out(out)


class HiDreamExperts(ExpertsLayout):
    """``runner.kernels.moe.ExpertsLayout`` of diffusers' ``MOEFeedForwardSwiGLU``: router ``gate`` (``MoEGate``: weight
    ``(E, H)``, ``top_k``, ``norm_topk_prob``), routed ``experts`` (``HiDreamImageFeedForwardSwiGLU``: ``w1`` gate
    ``(I, H)``, ``w3`` up ``(I, H)``, ``w2`` down ``(H, I)``, ``silu(w1 x) * w3 x``), ``shared_experts`` (a dense
    SwiGLU of half the width, added to every token's output)."""

    def experts(self, block: nn.Module) -> Sequence[nn.Module]:
        return list(block.experts)

    def expert_linears(self, block: nn.Module) -> Tuple[str, ...]:
        return ("experts.",)

    def stack(self, block: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate ``w1`` and up ``w3`` packed fused, as the halves of one ``(E, 2I, H)`` tensor (one grouped GEMM
        for both under GROUPED_MM, ``runner.kernels.moe.fused_gate_up``); down ``w2`` as ``(E, H, I)``."""
        with torch.no_grad():
            gate_up = torch.stack([torch.cat([e.w1.weight.detach(), e.w3.weight.detach()]) for e in block.experts])
            inter = block.experts[0].w1.weight.shape[0]
            packed = (gate_up[:, :inter], gate_up[:, inter:],
                      torch.stack([e.w2.weight.detach() for e in block.experts]))
            for i, e in enumerate(block.experts):
                for w, t in zip(("w1", "w3", "w2"), packed):
                    getattr(e, w).weight = nn.Parameter(t[i], requires_grad=False)
        return packed

    def router_logits(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, block.gate.weight)

    def top_k(self, block: nn.Module) -> int:
        return int(block.gate.top_k)

    def renormalize(self, block: nn.Module) -> bool:
        return bool(block.gate.norm_topk_prob) and int(block.gate.top_k) > 1

    def shared(self, block: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        return block.shared_experts(x)


HIDREAM = FamilySpec(
    name="hidream",
    tasks={"text_to_image": "HiDreamImagePipeline"},
    components={"transformer": ("diffusers", "HiDreamImageTransformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKL", None),
                "text_encoder": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),
                "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", "CLIPTextConfig"),
                "text_encoder_3": ("transformers", "T5EncoderModel", "T5Config"),
                "text_encoder_4": ("transformers", "LlamaForCausalLM", "LlamaConfig"),
                "scheduler": ("diffusers", "UniPCMultistepScheduler", None)},
    tokenizers={"tokenizer": ("clip", "clip_l", "text_encoder"), "tokenizer_2": ("clip", "clip_g", "text_encoder_2"),
                "tokenizer_3": ("t5", "t5", "text_encoder_3"), "tokenizer_4": ("llama3", "llama3", "text_encoder_4")},
    cfg="batched",  # guidance batches both branches into one forward (UniPC / flow-match Euler: one eval per step)
    size_rule=block_out_scale, patch=2,  # 2 x vae_scale_factor: latents packed in 2x2 patches
    quiet_loggers=("diffusers.pipelines.hidream_image.pipeline_hidream_image",),
    max_sequence_length=None,  # HiDreamImagePipeline.check_inputs has none; see HiDreamEngine.sequence_limit
    attention_processor="models.hidream:HiDreamDispatchAttnProcessor",
    fp8_prefixes=("double_stream_blocks.", "single_stream_blocks."),
    needs_mask=False,  # padding image tokens are masked by zeroing their keys, no attention mask
    engine="models.hidream:HiDreamEngine",
    guidance_hint="HiDream-I1-Full: 5.0",
)


class HiDreamEngine(PipelineEngine):
    """The HiDream-I1 family (engine ``hidream``): roles ``joint`` (dual-stream attention) and ``single``
    (single-stream attention); backend fields ``attention``, ``linear`` and ``moe`` (the latter only while the
    transformer has routed experts, ``num_routed_experts > 0``)."""

    spec = HIDREAM

    @property
    def backend_fields(self) -> Tuple[str, ...]:  # type: ignore[override]
        """``attention``, ``linear``, and ``moe`` when the transformer has routed experts (its config's
        ``num_routed_experts > 0``; diffusers builds dense SwiGLU feed-forwards otherwise): an explicit MoE backend
        on a HiDream transformer without experts is then refused at startup like on any model without MoE layers."""
        n = int(self.component_config("transformer").get("num_routed_experts", 4) or 0)
        return ("attention", "linear", "moe") if n > 0 else ("attention", "linear")

    # ------------------------------------------------------------------------------------------ attention
    def attention_role(self, layer: str) -> str:
        """``single`` for the single-stream blocks' attention, else ``joint``; a model config listing one role uses
        it for both."""
        roles = [str(r) for r in self.cfg.roles]
        want = "single" if layer.startswith("single_stream_blocks.") else "joint"
        return want if want in roles else roles[0]

    # ------------------------------------------------------------------------------------------------ MoE
    def moe_blocks(self) -> Iterator[Tuple[str, nn.Module]]:
        """Every ``MOEFeedForwardSwiGLU`` of the transformer (``<stream>_blocks.N.block.ff_i``), in order."""
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        for name, mod in self.pipe.transformer.named_modules():
            if isinstance(mod, MOEFeedForwardSwiGLU):
                yield name, mod

    def moe_layout(self) -> HiDreamExperts:
        """:class:`HiDreamExperts`: router, routed experts and shared expert of ``MOEFeedForwardSwiGLU``."""
        return HiDreamExperts()

    def moe_dims(self) -> Tuple[int, int]:
        """``(dim, expert width)``: ``dim = heads x head_dim``; the width as diffusers builds an expert from
        ``hidden_dim = 4 x dim`` (``HiDreamImageFeedForwardSwiGLU``: 2/3 of it, rounded up to a multiple of 256),
        read from one built on the meta device."""
        from diffusers.models.transformers.transformer_hidream_image import HiDreamImageFeedForwardSwiGLU

        conf = self.component_config("transformer")
        dim = int(conf.get("num_attention_heads", 20)) * int(conf.get("attention_head_dim", 128))
        with torch.device("meta"):
            return dim, HiDreamImageFeedForwardSwiGLU(dim, 4 * dim).w1.out_features

    def moe_probe(self) -> Tuple[nn.Module, torch.Tensor, str]:
        """One ``MOEFeedForwardSwiGLU`` of the transformer's shape (``dim = heads x head_dim``, ``hidden_dim = 4 x
        dim`` as the blocks build it) with random weights, and an input ``(1, T, dim)`` with ``T`` the image tokens
        of one double-stream MoE call at the configured size and batch (twice under classifier-free guidance)."""
        from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

        conf = self.component_config("transformer")
        dim = self.moe_dims()[0]
        e, k = int(conf.get("num_routed_experts", 4)), int(conf.get("num_activated_experts", 2))
        g = self.cfg.generation
        w, h = self.pipeline_size(int(g.width), int(g.height))
        f = self.vae_scale_factor() * int(conf.get("patch_size", 2))  # pixels per image token along a side
        cfg_passes = 2 if g.guidance_scale is not None and float(g.guidance_scale) > 1 else 1
        tokens = (w // f) * (h // f) * cfg_passes * int(self.ctx.run.batch_size)
        with torch.device(self.device):  # initialised where it runs (the full-size block is ~0.5 GB in bf16)
            block = MOEFeedForwardSwiGLU(dim, 4 * dim, e, k).to(dtype=self.dtype).eval()
        x = torch.randn(1, tokens, dim, device=self.device, dtype=self.dtype)
        return block, x, (f"HiDream MoE block H={dim}, I={block.experts[0].w1.out_features}, E={e}, top_k={k}, "
                          f"T={tokens} tokens")

    # ------------------------------------------------------------------------------------------ sizes, limits
    def vae_scale_factor(self) -> int:
        """``2 ** (len(vae.block_out_channels) - 1)`` (HiDreamImagePipeline's ``vae_scale_factor``; 8 for the FLUX
        VAE)."""
        return 2 ** (len(self.component_config("vae").get("block_out_channels") or [0] * 4) - 1)

    def pipeline_size(self, width: int, height: int) -> Tuple[int, int]:
        """The (width, height) in pixels HiDreamImagePipeline generates for a requested one: rescaled to the area
        ``(128 * vae_scale_factor) ** 2`` keeping the aspect ratio, rounded down to multiples of ``2 *
        vae_scale_factor``; computed exactly as the pipeline does (float arithmetic included)."""
        division = 2 * self.vae_scale_factor()
        s_max = (DEFAULT_SAMPLE_SIZE * self.vae_scale_factor()) ** 2
        scale = math.sqrt(s_max / (width * height))
        return int(width * scale // division * division), int(height * scale // division * division)

    def check_family_rows(self, rows: List[Row], path: Any) -> None:
        """Every row's (width, height) must be one the pipeline keeps (:meth:`pipeline_size`): it rescales any
        other to its fixed pixel area, and the image would not have the size its record says.

        Raises:
            ConfigValueError: the ``model.generation`` default size is changed (no row sets a size).
            DatasetError: every row whose size is changed (file:line), with the size the pipeline would make.
        """
        side = DEFAULT_SAMPLE_SIZE * self.vae_scale_factor()
        bad = [(r, self.pipeline_size(r.width, r.height)) for r in rows]
        bad = [(r, got) for r, got in bad if got != (r.width, r.height)]
        if not bad:
            return
        why = (f"HiDreamImagePipeline rescales every size to the area {side}x{side} = {side * side} pixels, keeping "
               f"the aspect ratio, in multiples of {self.size_need()}")

        def fix(got: Tuple[int, int], w: str = "width", h: str = "height") -> str:
            keep = got if self.pipeline_size(*got) == got and got[0] > 0 and got[1] > 0 else (side, side)
            return f"{w}={keep[0]} {h}={keep[1]}" + ("" if keep == (side, side) else f" (or {w}={side} {h}={side})")

        if all("width" not in r.set_fields and "height" not in r.set_fields for r, _ in bad):
            r, got = bad[0]
            raise ConfigValueError(
                f"model.generation width x height = {r.width}x{r.height} would become {got[0]}x{got[1]}: {why}; fix: "
                + fix(got, "model.generation.width", "model.generation.height"))
        raise DatasetError([f"{path}:{r.line}: width x height = {r.width}x{r.height} (row {r.id!r}) would become "
                            f"{got[0]}x{got[1]}: {why}, and the image would not have the size recorded; fix: "
                            + fix(got) for r, got in bad])

    def sequence_limit(self) -> Optional[int]:
        """The most ``max_sequence_length`` the pipeline applies as given: the T5 and Llama tokenizers'
        ``model_max_length`` (it silently encodes ``min(max_sequence_length, model_max_length)``)."""
        toks = self.tokenizers()
        lims = [int(toks[lab].model_max_length) for k, lab, _ in self.tokenizers_spec.values()
                if not tokenizer_kinds.get(k).fixed_length
                and getattr(toks[lab], "model_max_length", None) and toks[lab].model_max_length < 10 ** 9]
        return min(lims) if lims else None

    def token_limit(self, label: str, tok: Any) -> int:
        """CLIP-L/CLIP-G: ``min(max_sequence_length, 218)``; T5 and Llama: ``min(max_sequence_length, the
        tokenizer's model_max_length)`` (tokens with the special tokens)."""
        msl = int(self.cfg.generation.max_sequence_length)
        kind = next(k for k, lab, _ in self.tokenizers_spec.values() if lab == label)
        if tokenizer_kinds.get(kind).fixed_length:  # CLIP-L, CLIP-G
            return min(msl, CLIP_MAX_TOKENS)
        m = getattr(tok, "model_max_length", None)
        return min(msl, int(m)) if m and m < 10 ** 9 else msl

    def check_source(self) -> None:
        """Before anything loads: ``max_sequence_length`` at most :meth:`sequence_limit`; both CLIP text models
        have positions for the ``min(max_sequence_length, 218)`` tokens the pipeline pads their prompts to;
        ``model.size_multiple`` a multiple of :meth:`size_need`.

        Raises:
            ConfigValueError: naming the key, the value, the model's limit and the fix.
        """
        g, name = self.cfg.generation, self.cfg.name
        msl = int(g.max_sequence_length)
        limit = self.sequence_limit()
        if limit is not None and msl > limit:
            raise ConfigValueError(
                f"model.generation.max_sequence_length={msl} exceeds {limit}, the model_max_length of model={name}'s "
                f"T5/Llama tokenizers: HiDreamImagePipeline would silently encode min({msl}, {limit}) tokens; fix: "
                f"model.generation.max_sequence_length={limit}")
        clip_len = min(msl, CLIP_MAX_TOKENS)
        for enc in ("text_encoder", "text_encoder_2"):
            pos = self.component_config(enc).get("max_position_embeddings")
            if pos is not None and clip_len > int(pos):
                raise ConfigValueError(
                    f"model.generation.max_sequence_length={msl}: HiDreamImagePipeline pads the CLIP prompts to "
                    f"min({msl}, {CLIP_MAX_TOKENS}) = {clip_len} tokens, but model={name}'s {enc} has "
                    f"{pos} positions (max_position_embeddings) and would fail; fix: "
                    f"model.generation.max_sequence_length={pos}")
        need = self.size_need()
        if self.cfg.size_multiple % need:
            raise ConfigValueError(
                f"model.size_multiple={self.cfg.size_multiple}, but model={name}'s VAE needs widths and heights in "
                f"multiples of {need}: HiDreamImagePipeline would round the others down; fix: "
                f"model.size_multiple={need}")

    def check_layout(self, path: Path) -> None:
        """The generic layout check; HiDream-I1's published snapshots hold no Llama encoder (it is loaded from
        meta-llama/Llama-3.1-8B-Instruct apart), so a missing ``text_encoder_4`` gets that fix.

        Raises:
            ModelPathError: naming what is missing and the fix.
        """
        try:
            super().check_layout(path)
        except ModelPathError as e:
            if "text_encoder_4" not in str(e) and "tokenizer_4" not in str(e):
                raise
            raise ModelPathError(
                f"{e}\nHiDream-I1's snapshots (HiDream-ai/HiDream-I1-Full...) do not ship the Llama encoder: copy "
                "meta-llama/Llama-3.1-8B-Instruct into the snapshot as text_encoder_4/ (LlamaForCausalLM, "
                "safetensors) and tokenizer_4/ (PreTrainedTokenizerFast) and list both in model_index.json "
                '("text_encoder_4": ["transformers", "LlamaForCausalLM"], "tokenizer_4": ["transformers", '
                '"PreTrainedTokenizerFast"])') from None

    # ------------------------------------------------------------------------------------------ rows, calls
    def load_pipeline(self) -> None:
        """The generic loading (the spec's truncation-warning filter included), with transformers' notice that
        SDPA returns no attention maps filtered (the pipeline asks Llama for them and does not use them)."""
        logger = logging.getLogger("transformers.integrations.sdpa_attention")
        if not any(isinstance(f, _NoAttentionMapsNotice) for f in logger.filters):
            logger.addFilter(_NoAttentionMapsNotice())
        super().load_pipeline()
