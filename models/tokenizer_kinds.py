"""The registry of tokenizer kinds: what a :class:`models.family.FamilySpec`'s ``tokenizers`` entry names as its
``kind`` (``clip``, ``t5``, ``qwen2``, ``llama3``, ``gemma``, ``qwen3``, ``mistral3``), as data.

A kind is one :class:`TokenizerKind` record: how its stand-in tokenizer is built locally for embedded and dummy
weights (:mod:`models.tokenizers`), how its text encoder's config is made consistent with that tokenizer
(vocabulary size and special ids), and which length the encoder sees (a CLIP-style encoder its tokenizer's
``model_max_length``, the others ``model.generation.max_sequence_length``). A family with a new kind registers one
record (:func:`register`); the engine and the snapshot builder (:mod:`models.snapshot`) look kinds up here and
name none.

Import-light: :mod:`models.tokenizers` (``tokenizers``, ``transformers``) is imported by the builders when called.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Mapping


@dataclasses.dataclass(frozen=True)
class TokenizerKind:
    """One tokenizer kind.

    Attributes:
        name: the kind as a family spec's ``tokenizers`` entry names it.
        build: ``build(corpus, vocab_size, tokenizer_config) -> tokenizer``: the stand-in tokenizer trained on
            ``corpus`` (``tokenizer_config``: ``model.architecture.tokenizer``, e.g. CLIP's ``clip_max_length``).
        encoder: ``encoder(tokenizer, config kwargs) -> config kwargs``: the text encoder's config arguments made
            consistent with the tokenizer (vocabulary size at least the tokenizer's, its special ids); returns a
            new mapping.
        fixed_length: the encoder sees its tokenizer's ``model_max_length`` (CLIP: 77) whatever
            ``model.generation.max_sequence_length`` says; False: it sees ``max_sequence_length``.
    """

    name: str
    build: Callable[[List[str], int, Mapping[str, Any]], Any]
    encoder: Callable[[Any, Dict[str, Any]], Dict[str, Any]]
    fixed_length: bool = False


#: kind name -> record (:func:`register` adds one).
KINDS: Dict[str, TokenizerKind] = {}


def register(kind: TokenizerKind) -> TokenizerKind:
    """Add ``kind`` to :data:`KINDS` (a kind registered again replaces the earlier record); returns it."""
    KINDS[kind.name] = kind
    return kind


def get(name: str) -> TokenizerKind:
    """The record of kind ``name``.

    Raises:
        ValueError: no such kind; the message lists the registered ones and how to add one.
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer kind {name!r}; registered: {', '.join(sorted(KINDS))}; fix: a family "
                         "with a new kind registers a models.tokenizer_kinds.TokenizerKind record "
                         "(models.tokenizer_kinds.register)") from None


def sized(tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """``kw`` with ``vocab_size`` at least the tokenizer's length (ids it emits must exist in the embedding)."""
    return {**kw, "vocab_size": max(len(tok), int(kw.get("vocab_size", 0)))}


def special_ids(tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`sized`, plus the tokenizer's bos, eos and pad ids (CLIP, Llama 3, Qwen3 configs)."""
    return {**sized(tok, kw), "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id}


def t5_ids(tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`sized`, plus T5's pad and eos ids (the decoder starts at pad, as T5's configs say)."""
    return {**sized(tok, kw), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
            "decoder_start_token_id": tok.pad_token_id}


def gemma_ids(tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """``Gemma3Config`` (a multimodal config): vocabulary and special ids go into its ``text_config``."""
    text = dict(kw.get("text_config") or {})
    text.update(vocab_size=max(len(tok), int(text.get("vocab_size", 0))), pad_token_id=tok.pad_token_id,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return {**kw, "text_config": text}


def mistral3_ids(tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
    """``Mistral3Config``: the vocabulary and special ids live in its ``text_config``; ``[IMG]`` is its image
    token (``image_token_index``)."""
    text = {**dict(kw.get("text_config") or {}), "vocab_size": max(len(tok), int(kw.get("vocab_size", 0))),
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    out = {k: v for k, v in kw.items() if k != "vocab_size"}
    out.update(text_config=text, image_token_index=tok.convert_tokens_to_ids("[IMG]"))
    return out


def _builder(fn: str, clip: bool = False) -> Callable[[List[str], int, Mapping[str, Any]], Any]:
    """A :attr:`TokenizerKind.build` calling :mod:`models.tokenizers`' ``fn(corpus, vocab_size)`` (``clip``: with
    ``model.architecture.tokenizer.clip_max_length``, default 77)."""
    def build(corpus: List[str], vocab: int, tcfg: Mapping[str, Any]) -> Any:
        from models import tokenizers as T

        if clip:
            return T.build_clip_tokenizer(corpus, vocab, int(tcfg.get("clip_max_length", 77)))
        return getattr(T, fn)(corpus, vocab)

    return build


for _kind in (TokenizerKind("clip", _builder("build_clip_tokenizer", clip=True), special_ids, fixed_length=True),
              TokenizerKind("t5", _builder("build_t5_tokenizer"), t5_ids),
              TokenizerKind("qwen2", _builder("build_qwen2_tokenizer"), sized),
              TokenizerKind("llama3", _builder("build_llama3_tokenizer"), special_ids),
              TokenizerKind("gemma", _builder("build_gemma_tokenizer"), gemma_ids),
              TokenizerKind("qwen3", _builder("build_qwen3_tokenizer"), special_ids),
              TokenizerKind("mistral3", _builder("build_mistral3_tokenizer"), mistral3_ids)):
    register(_kind)
