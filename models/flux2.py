"""FLUX.2 families (diffusers ``Flux2Pipeline``: FLUX.2-dev; ``Flux2KleinPipeline``: FLUX.2 [klein]) on the generic
pipeline engine.

Both: ``Flux2Transformer2DModel`` (double-stream blocks ``transformer_blocks.N.attn``, ``Flux2Attention``; single-stream
blocks ``single_transformer_blocks.N.attn``, ``Flux2ParallelSelfAttention``; both processors call diffusers'
``dispatch_attention_fn``, so attention backends are selected and observed per call site; one role, ``joint``), the
``AutoencoderKLFlux2`` VAE (``vae_scale_factor = 2 ** (len(block_out_channels) - 1)``, latents packed 2x2: sizes are
multiples of ``vae_scale_factor * 2``; the pipelines' ``check_inputs`` only warn and then floor other sizes, so the
runner refuses them), and a text encoder whose hidden states at ``text_encoder_out_layers`` are stacked into the
transformer's context (``joint_attention_dim = len(layers) * hidden_size``; the text is padded to
``max_sequence_length``, no mask reaches the transformer).

=================== ==================================== ================================================================
family              pipeline (diffusers 0.42)            text encoder, guidance
=================== ==================================== ================================================================
``flux2``           ``Flux2Pipeline`` (FLUX.2-dev)       Mistral-Small-3.x (``Mistral3ForConditionalGeneration``, hidden
                                                         states 10, 20, 30) fed a system message and the prompt through
                                                         the tokenizer's chat template; guidance-distilled: the call's
                                                         ``guidance_scale`` enters the transformer's guidance embedding,
                                                         ONE forward per step, no negative prompt (``__call__`` takes none)
``flux2_klein``     ``Flux2KleinPipeline`` (klein 4B/9B) Qwen3 (``Qwen3ForCausalLM``, hidden states 9, 18, 27) fed the
                                                         prompt through Qwen3's chat template (``enable_thinking=False``);
                                                         no guidance embedding; ``guidance_scale > 1`` runs real CFG with an
                                                         empty negative prompt as a SECOND forward per step, unless the
                                                         pipeline config says ``is_distilled`` (the step-distilled klein
                                                         4B/9B: one forward, ``guidance_scale`` ignored)
=================== ==================================== ================================================================
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from models.family import FamilySpec, block_out_scale
from models.flux import FluxEngine
from models.pipelines import PipelineEngine
from runner.core.errors import ConfigValueError

_TRANSFORMER = ("diffusers", "Flux2Transformer2DModel", None)
_VAE = ("diffusers", "AutoencoderKLFlux2", None)
_SCHEDULER = ("diffusers", "FlowMatchEulerDiscreteScheduler", None)

FLUX2 = FamilySpec(
    name="flux2",
    tasks={"text_to_image": "Flux2Pipeline"},
    components={"transformer": _TRANSFORMER, "vae": _VAE,
                "text_encoder": ("transformers", "Mistral3ForConditionalGeneration", "Mistral3Config"),
                "scheduler": _SCHEDULER},
    tokenizers={"tokenizer": ("mistral3", "mistral3", "text_encoder")},
    cfg="none",  # guidance-distilled: guidance_scale enters the guidance embedding; one forward per step
    size_rule=block_out_scale, patch=2,  # Flux2Pipeline: vae_scale_factor * 2 (2x2 latent packing)
    quiet_loggers=("diffusers.pipelines.flux2.pipeline_flux2",),
    needs_mask=False,  # Flux2AttnProcessor gets attention_mask=None on the text-to-image path
    engine="models.flux2:Flux2Engine",
    guidance_hint="FLUX.2-dev: 4.0",
)

FLUX2_KLEIN = FamilySpec(
    name="flux2_klein",
    tasks={"text_to_image": "Flux2KleinPipeline"},
    components={"transformer": _TRANSFORMER, "vae": _VAE,
                "text_encoder": ("transformers", "Qwen3ForCausalLM", "Qwen3Config"),
                "scheduler": _SCHEDULER},
    tokenizers={"tokenizer": ("qwen3", "qwen3", "text_encoder")},
    cfg="separate",  # do_classifier_free_guidance = guidance_scale > 1 and not is_distilled: a second forward
    size_rule=block_out_scale, patch=2,
    quiet_loggers=("diffusers.pipelines.flux2.pipeline_flux2_klein",),
    needs_mask=False,
    engine="models.flux2:Flux2KleinEngine",
    guidance_hint="FLUX.2 klein base: 4.0",
    pipeline_config=("is_distilled",),  # Flux2KleinPipeline.__init__'s setting (model.architecture.pipeline)
)


def text_layer_problems(pipeline_cls: type, encoder: Dict[str, Any], transformer: Dict[str, Any]) -> List[str]:
    """What makes a FLUX.2 pipeline fail at its first prompt: the text encoder (config ``encoder``; Mistral3's in its
    ``text_config``) has fewer hidden layers than the highest of the pipeline's ``text_encoder_out_layers`` (read from
    its ``__call__`` default), or the transformer's ``joint_attention_dim`` is not ``len(layers) * hidden_size`` (the
    stacked hidden states)."""
    layers = inspect.signature(pipeline_cls.__call__).parameters["text_encoder_out_layers"].default
    text = encoder.get("text_config") or encoder
    n, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    out = []
    if n is not None and int(n) < max(layers):
        out.append(f"text_encoder num_hidden_layers={n}, and {pipeline_cls.__name__} reads hidden states "
                   f"{tuple(layers)} (at least {max(layers)} layers)")
    joint = transformer.get("joint_attention_dim")
    if hidden is not None and joint is not None and int(joint) != len(layers) * int(hidden):
        out.append(f"transformer joint_attention_dim={joint}, and {pipeline_cls.__name__} stacks {len(layers)} "
                   f"hidden states of {hidden} ({len(layers) * int(hidden)})")
    return out


class Flux2TextMixin:
    """What FLUX.2-dev and klein share: the text-layer check before loading (:func:`text_layer_problems`) and the
    negative prompt their ``__call__`` does not take."""

    def negative_prompt_rule(self) -> Tuple[str, str]:
        """``(why, fix)`` of a row's ``negative_prompt`` (an ignored field: refused by default, stripped and recorded
        under ``dataset.on_ignored=record``): neither pipeline takes one."""
        why = {"flux2": "Flux2Pipeline takes no negative prompt (guidance-distilled: guidance_scale feeds its guidance "
                        "embedding, there is no unconditional branch)",
               "flux2_klein": "Flux2KleinPipeline takes no negative prompt (its CFG's unconditional branch is the empty "
                              "prompt)"}[self.family()]
        return why, "remove negative_prompt from the rows"

    def check_text_layers(self) -> None:
        """Raises:
            ConfigValueError: naming the configs that disagree and the fix.
        """
        problems = text_layer_problems(self.pipeline_cls(), self.component_config("text_encoder"),
                                       self.component_config("transformer"))
        if problems:
            raise ConfigValueError(f"model={self.cfg.name}: " + "; ".join(problems) + "; the pipeline would fail at "
                                   "the first prompt; fix: model.architecture.text_encoder / transformer consistent "
                                   "with it (see conf/model/tiny_flux2*.yaml)")


class Flux2Engine(Flux2TextMixin, FluxEngine):
    """FLUX.2-dev (engine ``flux2``): FLUX.1's guidance-embedding rules (:class:`models.flux.FluxEngine`: a model
    whose transformer takes guidance refuses ``guidance_scale: null``, one without ignores it), the Mistral chat
    template's tokens counted, one forward per step."""

    spec = FLUX2
    guidance_default: ClassVar[str] = "4.0 (Flux2Pipeline's default)"

    def check_source(self) -> None:
        """The base checks, then the text layers (:func:`text_layer_problems`)."""
        super().check_source()
        self.check_text_layers()

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[Any, ...]]:
        """FLUX.1's guidance rules (:meth:`models.flux.FluxEngine.ignored_fields`) and the negative prompt
        (:meth:`Flux2TextMixin.negative_prompt_rule`)."""
        return {**super().ignored_fields(rows), "negative_prompt": self.negative_prompt_rule()}

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Tokens the pipeline's conversation becomes per prompt (diffusers' ``format_input`` with Flux2Pipeline's
        system message, through the tokenizer's chat template), untruncated: the system message counts against
        ``max_sequence_length``."""
        from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input

        ids = tok.apply_chat_template(format_input(list(prompts), SYSTEM_MESSAGE), add_generation_prompt=False,
                                      tokenize=True, return_dict=True)["input_ids"]
        return [len(i) for i in ids]


class Flux2KleinEngine(Flux2TextMixin, PipelineEngine):
    """FLUX.2 [klein] (engine ``flux2_klein``): CFG as a second forward when ``guidance_scale > 1``, off for a
    step-distilled checkpoint (``is_distilled`` in the pipeline config: the snapshot's ``model_index.json``, or
    ``model.architecture.pipeline.is_distilled`` for embedded and dummy weights)."""

    spec = FLUX2_KLEIN
    arch_other: ClassVar[Dict[str, Any]] = {**PipelineEngine.arch_other, "pipeline": ("is_distilled",)}

    @classmethod
    def build_components(cls, arch: Dict[str, Any], device: Any = "cpu", dtype: Any = None,
                         task: Optional[str] = None) -> Dict[str, Any]:
        """The components, plus the pipeline's own ``is_distilled`` (``model.architecture.pipeline``), which the
        pipeline registers in its config and ``save_pretrained`` writes to ``model_index.json``."""
        import torch

        comps = super().build_components(arch, device=device, dtype=dtype or torch.float32, task=task)
        return {**comps, "is_distilled": bool((arch.get("pipeline") or {}).get("is_distilled", False))}

    @property
    def is_distilled(self) -> bool:
        """The pipeline config's ``is_distilled``: the snapshot's ``model_index.json`` with ``model.path``, else
        ``model.architecture.pipeline.is_distilled`` (Flux2KleinPipeline's default False)."""
        from pathlib import Path

        from models.pipelines import read_index

        if not self.source:
            self.resolve_source()
        if self.source.get("kind") == "path":
            return bool(read_index(Path(self.source["path"])).get("is_distilled", False))
        return bool((self.arch_copy().get("pipeline") or {}).get("is_distilled", False))

    def check_source(self) -> None:
        """The base checks, then the text layers (:func:`text_layer_problems`)."""
        super().check_source()
        self.check_text_layers()

    def count_tokens(self, label: str, tok: Any, prompts: List[str]) -> List[int]:
        """Tokens of the prompt in Qwen3's chat template with ``enable_thinking=False`` (what the pipeline
        truncates at ``max_sequence_length``)."""
        from models.tokenizers import chat_prompt_lengths

        return chat_prompt_lengths(tok, prompts, enable_thinking=False)

    def expected_forwards(self, batch: Sequence[Any]) -> Optional[int]:
        """Steps x (2 with ``guidance_scale > 1``, else 1); a distilled checkpoint runs 1 per step whatever the
        guidance."""
        if self.is_distilled:
            return int(batch[0].row.num_inference_steps)
        return super().expected_forwards(batch)

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[Any, ...]]:
        """The base rules with the negative prompt always ignored (:meth:`Flux2TextMixin.negative_prompt_rule`); on a
        distilled checkpoint also ``guidance_scale`` (the pipeline runs no CFG and only warns)."""
        out = {**super().ignored_fields(rows), "negative_prompt": self.negative_prompt_rule()}
        if self.is_distilled:
            out["guidance_scale"] = ("its pipeline config says is_distilled=true: Flux2KleinPipeline runs no "
                                     "classifier-free guidance, whatever guidance_scale", "guidance_scale: null")
        return out

    def check_family_rows(self, rows: List[Any], path: Any) -> None:
        """A row without a guidance value on a non-distilled klein is refused: the pipeline would apply its default
        (4.0: CFG on, a second forward per step) while the record says null.

        Raises:
            ConfigValueError: naming ``model.generation.guidance_scale`` and the fix.
        """
        if not self.is_distilled and any(r.guidance_scale is None for r in rows):
            raise ConfigValueError(
                f"model.generation.guidance_scale=null, but model={self.cfg.name} is not step-distilled "
                "(is_distilled=false): Flux2KleinPipeline would apply its default 4.0 (CFG, two forwards per step) "
                "unrecorded; fix: model.generation.guidance_scale=4.0 (or 1.0 for no CFG), or a guidance_scale in "
                "every row")
