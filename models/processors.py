"""Processors built locally (there is no model hub here), for the conditioning pipelines of issue #30.

A family declares them in :attr:`models.family.FamilySpec.task_processors` as ``{component: (kind, tokenizer
component or None)}``; :func:`build_processor` builds one from ``model.architecture.<component>`` (the processor
class's own arguments; ``{}`` keeps the published defaults). Kinds:

* ``qwen2_vl``: ``Qwen2VLProcessor`` (QwenImageEditPlusPipeline's ``processor``): the family's Qwen2 tokenizer
  (built with the vision markers, :data:`models.tokenizers.QWEN2_VISION_SPECIALS`) plus a Qwen2-VL image processor
  (``patch_size`` 14, ``merge_size`` 2, ``temporal_patch_size`` 2 must equal the text encoder's vision config: the
  encoder checks that the processor's patches fit its patch embedding). No video processor (the pipeline sends no
  video).
* ``clip_image``: ``CLIPImageProcessor`` (WanImageToVideoPipeline's ``image_processor``): resize the shortest edge
  to ``size.shortest_edge``, center-crop to ``crop_size``, CLIP's mean/std; its crop must equal the image encoder's
  ``image_size``.

transformers 5 without torchvision resolves both image processor classes to their PIL backends
(``Qwen2VLImageProcessorPil``, ``CLIPImageProcessorPil``), which is what is saved and loaded here.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2VLImageTextProcessor(Qwen2VLProcessor):
    """``transformers.Qwen2VLProcessor`` without its video processor slot: transformers 5 builds and loads a
    ``Qwen2VLProcessor`` only with a video processor, which needs torchvision (not installed here: its check of the
    video slot fails without it, even for ``None``). Images and text are processed by Qwen2VLProcessor's own code
    (``<|image_pad|>`` expanded to ``grid_thw.prod() // merge_size**2`` tokens per image); QwenImageEditPlusPipeline
    sends no video. Saved and loaded as this class (``model_index.json``: ``models.processors``)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                 **kwargs: Any) -> None:
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def build_qwen2_vl_processor(cfg: Mapping[str, Any], tokenizer: Any) -> Any:
    """A Qwen2-VL processor (:class:`Qwen2VLImageTextProcessor`) of ``tokenizer`` and a Qwen2-VL image processor of
    arguments ``cfg``.

    Raises:
        ValueError: the tokenizer lacks Qwen2-VL's vision markers (build it with ``vision=True``).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from models.tokenizers import QWEN2_VISION_SPECIALS

    vocab = tokenizer.get_vocab()
    missing = [t for t in QWEN2_VISION_SPECIALS if t not in vocab]
    if missing:
        raise ValueError(f"Qwen2VLProcessor needs the tokenizer's vision markers; {missing} are not in it (fix: "
                         "build_qwen2_tokenizer(..., vision=True))")
    return Qwen2VLImageTextProcessor(image_processor=Qwen2VLImageProcessorPil(**dict(cfg)), tokenizer=tokenizer)


def build_clip_image_processor(cfg: Mapping[str, Any], tokenizer: Any = None) -> Any:
    """A ``CLIPImageProcessor`` (PIL backend) of arguments ``cfg`` (``size``, ``crop_size``...)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(**dict(cfg))


#: processor kind -> builder ``(architecture config, tokenizer or None) -> processor``
PROCESSORS: Dict[str, Callable[[Mapping[str, Any], Any], Any]] = {
    "qwen2_vl": build_qwen2_vl_processor,
    "clip_image": build_clip_image_processor,
}


def build_processor(kind: str, cfg: Optional[Mapping[str, Any]], tokenizer: Any = None) -> Any:
    """The processor of ``kind`` (:data:`PROCESSORS`) from its architecture config ``cfg`` (None: defaults).

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in PROCESSORS:
        raise ValueError(f"unknown processor kind {kind!r}; known: {', '.join(PROCESSORS)}")
    return PROCESSORS[kind](cfg or {}, tokenizer)


def processor_keys(kind: str) -> List[str]:
    """The arguments a processor of ``kind`` takes from ``model.architecture.<component>`` (its image processor's
    ``valid_kwargs``), for refusing a misspelt key before anything is built."""
    if kind == "qwen2_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as cls
    elif kind == "clip_image":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil as cls
    else:
        raise ValueError(f"unknown processor kind {kind!r}; known: {', '.join(PROCESSORS)}")
    return sorted(cls.valid_kwargs.__annotations__)


#: ``model_index.json`` entries whose processor transformers cannot load here -> the local class that loads it
LOCAL_PROCESSORS = {("transformers", "Qwen2VLProcessor"): "Qwen2VLImageTextProcessor"}


def processor_overrides(snapshot: Any) -> Dict[str, Any]:
    """``{component: processor}`` for a snapshot's processors that transformers' own class cannot load without
    torchvision (a published Qwen-Image-Edit-2509 snapshot's ``processor``: ``transformers.Qwen2VLProcessor`` loads
    its video processor too), loaded with the local class (:data:`LOCAL_PROCESSORS`) from the same folder; passed to
    ``from_pretrained`` as component overrides. Empty for every other snapshot."""
    import json
    from pathlib import Path

    root = Path(snapshot)
    index = json.loads((root / "model_index.json").read_text())
    out: Dict[str, Any] = {}
    for comp, entry in index.items():
        local = LOCAL_PROCESSORS.get(tuple(entry)) if isinstance(entry, list) and len(entry) == 2 else None
        if local is not None and (root / comp).is_dir():
            out[comp] = globals()[local].from_pretrained(str(root / comp), local_files_only=True)
    return out
