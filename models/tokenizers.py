"""Tokenizers built locally (there is no model hub here).

Both FLUX text encoders get a byte-level BPE tokenizer trained deterministically on a fixed corpus (the builtin
prompts), wrapped in ``transformers.PreTrainedTokenizerFast`` with the special tokens and post-processing of the
tokenizer it stands in for:

* CLIP-style: ``<|startoftext|> ... <|endoftext|>``, padded with ``<|endoftext|>`` (the CLIP text model pools
  at the first end-of-text token), ``model_max_length`` 77.
* T5-style: ``... </s>``, padded with ``<pad>`` (id 0), ``model_max_length`` 512.

Other families' stand-ins: Qwen2-style (:func:`build_qwen2_tokenizer`, Qwen-Image; with Qwen2's chat template for
HunyuanVideo-1.5), Llama-3-style (:func:`build_llama3_tokenizer`, HiDream-I1's fourth encoder), Gemma-style
(:func:`build_gemma_tokenizer`, LTX-2's Gemma 3 encoder), Qwen3-style with its chat template
(:func:`build_qwen3_tokenizer`, FLUX.2 klein and Z-Image), Mistral-Small-3.1-style with its chat template
(:func:`build_mistral3_tokenizer`, FLUX.2-dev) and ByT5 (:func:`build_byt5_tokenizer`, HunyuanVideo-1.5's glyph
encoder: byte-level, no vocabulary file).

Byte-level BPE covers any UTF-8 text, so unseen words never map to an unknown token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CLIP_SPECIALS = ["<|startoftext|>", "<|endoftext|>"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


def train_bpe(corpus: Iterable[str], vocab_size: int, specials: list[str]) -> Tokenizer:
    """A byte-level BPE tokenizer trained on ``corpus``; ``specials`` take the first ids, in order."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer=trainer)
    return tok


def build_clip_tokenizer(corpus: Iterable[str], vocab_size: int, max_length: int = 77) -> PreTrainedTokenizerFast:
    """CLIP-style tokenizer: ids 0/1 are ``<|startoftext|>``/``<|endoftext|>``; pad = end-of-text."""
    tok = train_bpe(corpus, vocab_size, CLIP_SPECIALS)
    bos, eos = (tok.token_to_id(t) for t in CLIP_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLIP_SPECIALS[0]} $A {CLIP_SPECIALS[1]}",
        special_tokens=[(CLIP_SPECIALS[0], bos), (CLIP_SPECIALS[1], eos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=CLIP_SPECIALS[0], eos_token=CLIP_SPECIALS[1],
                                   pad_token=CLIP_SPECIALS[1], unk_token=CLIP_SPECIALS[1],
                                   model_max_length=max_length)


def build_t5_tokenizer(corpus: Iterable[str], vocab_size: int, max_length: int = 512) -> PreTrainedTokenizerFast:
    """T5-style tokenizer: ``<pad>`` = 0, ``</s>`` = 1 appended to every sequence, ``<unk>`` = 2."""
    tok = train_bpe(corpus, vocab_size, T5_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=max_length)


def corpus_from(path: Path) -> list[str]:
    """Training text for the tokenizers: the ``prompt`` of every line of a JSONL file."""
    import json

    return [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


#: Qwen2's pre-tokenizer split pattern (``tokenizer.json`` of the Qwen2/Qwen2.5 tokenizers).
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Qwen2-VL's vision markers (special tokens of the Qwen2.5-VL tokenizer; ``Qwen2VLProcessor`` expands
#: ``<|image_pad|>`` into one token per merged image patch, the text encoder's config names their ids)
QWEN2_VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen2_tokenizer(corpus: Iterable[str], vocab_size: int, max_length: int = 32768,
                          template_text: Iterable[str] = (), vision: bool = False,
                          extra_specials: Iterable[str] = ()) -> PreTrainedTokenizerFast:
    """Qwen2-style tokenizer: Qwen2's split pattern then byte-level BPE, no BOS/EOS added, ``<|endoftext|>`` as pad
    (Qwen2.5-VL's), chat markers ``<|im_start|>``/``<|im_end|>`` as special tokens. ``template_text`` (a prompt
    template's fixed text) is weighted in training so that each of its words is one token, as in Qwen's vocabulary:
    pipelines that drop a template's first N tokens (QwenImagePipeline drops 34) then drop exactly the template.
    ``vision`` adds Qwen2-VL's vision markers (:data:`QWEN2_VISION_SPECIALS`) as special tokens after the chat
    markers (for ``Qwen2VLProcessor``: image inputs of QwenImageEditPlusPipeline); ``extra_specials`` come after
    those (Qwen3's thinking markers).
    """
    specials = QWEN2_SPECIALS + (QWEN2_VISION_SPECIALS if vision else []) + list(extra_specials)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=__import__("tokenizers").Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) + [t for t in template_text for _ in range(50)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None, model_max_length=max_length,
                                   additional_special_tokens=specials[1:])


#: Llama 3's pre-tokenizer split pattern (``tokenizer.json`` of Meta-Llama-3.x: numbers in groups of up to 3 digits).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


def build_llama3_tokenizer(corpus: Iterable[str], vocab_size: int,
                           max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Llama-3.1-Instruct-style tokenizer: Llama 3's split pattern then byte-level BPE; ``<|begin_of_text|>``
    prepended to every sequence (Llama 3's post-processor; nothing appended), ``eos_token`` ``<|eot_id|>`` (the
    Instruct tokenizer's), no pad token of its own (``HiDreamImagePipeline`` sets ``pad_token = eos_token``; so does
    this builder), ``model_max_length`` 131072 (Llama 3.1's context). No chat template: HiDreamImagePipeline feeds
    the raw prompt. The special tokens take the first ids (Llama 3 puts them at 128000+)."""
    import tokenizers as tk

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=tk.Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus), trainer=trainer)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|eot_id|>",
                                   pad_token="<|eot_id|>", unk_token=None, model_max_length=max_length,
                                   additional_special_tokens=LLAMA3_SPECIALS[1:])


#: Gemma's special tokens in its id order (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3: the Gemma 3
#: tokenizer's ``special_tokens_map.json`` and ``Gemma3TextConfig``'s pad/eos/bos defaults).
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build_gemma_tokenizer(corpus: Iterable[str], vocab_size: int,
                          max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Gemma-3-style tokenizer: byte-level BPE with Gemma's special ids (:data:`GEMMA_SPECIALS`), ``<bos>``
    prepended to every sequence (Gemma's post-processor; nothing appended), ``<pad>`` as pad token,
    ``model_max_length`` 131072 (Gemma 3's context). No chat template: ``LTX2Pipeline`` tokenizes the raw prompt
    (left-padded to ``max_sequence_length``); only its prompt enhancement, which the runner does not run, applies one.
    """
    tok = train_bpe(corpus, vocab_size, GEMMA_SPECIALS)
    bos = GEMMA_SPECIALS[2]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token=bos,
                                   unk_token="<unk>", model_max_length=max_length)
#: Qwen3's chat template reduced to the messages diffusers' Qwen3-encoding pipelines send (one user message, a
#: generation prompt; ``Flux2KleinPipeline`` passes ``enable_thinking=False``, ``ZImagePipeline`` ``True``): the same
#: text as Qwen3's own template (``tokenizer_config.json`` of Qwen/Qwen3-4B) for those messages, without its tool and
#: reasoning branches.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
#: Qwen3's thinking markers (added special tokens of the Qwen3 tokenizer, after the ChatML markers)
QWEN3_THINK_SPECIALS = ["<think>", "</think>"]


def build_qwen3_tokenizer(corpus: Iterable[str], vocab_size: int,
                          max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Qwen3-style tokenizer: the Qwen2 one (:func:`build_qwen2_tokenizer`: same split pattern, byte-level BPE, no
    BOS/EOS added, ``<|endoftext|>`` pad, ``<|im_end|>`` end) plus Qwen3's ``<think>``/``</think>`` and its chat template
    (:data:`QWEN3_CHAT_TEMPLATE`); ``model_max_length`` 131072 (Z-Image's ``tokenizer_config.json``). What
    ``Flux2KleinPipeline`` and ``ZImagePipeline`` call: ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True, enable_thinking=...)``, then the tokenizer on that text."""
    tok = build_qwen2_tokenizer(corpus, vocab_size, max_length=max_length, extra_specials=QWEN3_THINK_SPECIALS)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


#: Mistral-Small-3.1's special tokens the text path of ``Flux2Pipeline`` meets, in the order of their ids in the
#: Tekken vocabulary (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``[INST]`` 3, ``[/INST]`` 4, ...; ``[IMG]`` 10, ``<pad>`` 11,
#: ``[SYSTEM_PROMPT]`` 17); here they take the first ids in this order.
MISTRAL3_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                     "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
#: Mistral-Small-3.1's chat template reduced to the conversations ``Flux2Pipeline`` builds (diffusers'
#: ``flux2.pipeline_flux2.format_input``: a system message and a user message, each content a list of
#: ``{"type": "text"|"image"}`` blocks): ``<s>[SYSTEM_PROMPT]system[/SYSTEM_PROMPT][INST]prompt[/INST]``, an image
#: block as ``[IMG]`` (the processor expands it), an assistant message closed by ``</s>``.
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['content'] is string %}"
    "{%- set blocks = [{'type': 'text', 'text': message['content']}] %}{%- else %}"
    "{%- set blocks = message['content'] %}{%- endif %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- endif %}"
    "{%- for block in blocks %}{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}"
    "{%- endif %}{%- endfor %}{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[/INST]' }}{%- else %}{{- eos_token }}{%- endif %}{%- endfor %}")


def build_mistral3_tokenizer(corpus: Iterable[str], vocab_size: int,
                             max_length: int = 131072) -> PreTrainedTokenizerFast:
    """Mistral-Small-3.1-style tokenizer for ``Flux2Pipeline``'s ``tokenizer``: byte-level BPE, the special tokens of
    :data:`MISTRAL3_SPECIALS` first, ``<pad>`` pad, nothing added outside the chat template
    (:data:`MISTRAL3_CHAT_TEMPLATE`, which writes ``<s>``), ``model_max_length`` 131072 (Mistral-Small-3.1's
    context).

    The published FLUX.2-dev snapshot's ``tokenizer`` is a ``PixtralProcessor`` (this tokenizer plus Pixtral's image
    processor); transformers declares that class unusable without torchvision (not installed here), so the tiny
    variant saves the tokenizer alone: ``Flux2Pipeline``'s text path calls only ``apply_chat_template(...,
    tokenize=True, return_dict=True, padding="max_length", truncation=True, max_length=...)``, which the tokenizer
    implements with the same arguments."""
    tok = train_bpe(corpus, vocab_size, MISTRAL3_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=max_length,
                                   additional_special_tokens=MISTRAL3_SPECIALS[3:], chat_template=MISTRAL3_CHAT_TEMPLATE)


def chat_prompt_lengths(tok, prompts: Iterable[str], **template_kwargs) -> list[int]:
    """Tokens each prompt becomes in the pipelines that wrap it in the tokenizer's chat template as one user message
    with a generation prompt (``Flux2KleinPipeline``, ``ZImagePipeline``: ``apply_chat_template([{"role": "user",
    "content": prompt}], tokenize=False, add_generation_prompt=True, **template_kwargs)``, then the tokenizer on that
    text), untruncated: what their ``max_length=max_sequence_length`` truncation is applied to."""
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                     **template_kwargs) for p in prompts]
    return [len(ids) for ids in tok(texts, truncation=False, verbose=False)["input_ids"]]
#: Qwen2's chat template for text-only messages (``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then
#: ``<|im_start|>assistant\n`` with ``add_generation_prompt``), what the Qwen2.5-VL tokenizer renders for string
#: contents with an explicit system message (HunyuanVideo15Pipeline's ``apply_chat_template`` call); image/video
#: content parts and the default system message of Qwen's full template are not needed there.
QWEN2_CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                       "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
                       "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def build_qwen2_chat_tokenizer(corpus: Iterable[str], vocab_size: int, template_text: Iterable[str] = ()
                               ) -> PreTrainedTokenizerFast:
    """:func:`build_qwen2_tokenizer` with :data:`QWEN2_CHAT_TEMPLATE` as its ``chat_template`` (saved with the
    tokenizer as ``chat_template.jinja``). ``template_text``: the rendered template's fixed prefix, so that the
    pipeline's fixed crop (HunyuanVideo15Pipeline drops the first 108 tokens) drops exactly it."""
    tok = build_qwen2_tokenizer(corpus, vocab_size, template_text=template_text)
    tok.chat_template = QWEN2_CHAT_TEMPLATE
    return tok


def build_byt5_tokenizer(max_length: int = 256) -> Any:
    """``transformers.ByT5Tokenizer`` (bytes + 3 specials ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 + 125 extra ids: 384
    tokens, ``</s>`` appended), built without files as google/byt5-small's is. The Glyph-SDXL-v2 colour and font
    tokens HunyuanVideo-1.5 adds (scripts/convert_hunyuan_video1_5_to_diffusers.py ``add_special_token``) are not
    added: their names come from annotation files that are not here."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer(model_max_length=max_length)
