"""A tiny Qwen3-MoE checkpoint built locally (there is no model hub here), for autoregressive stages and tests.

The directory is a standard Hugging Face layout that ``vllm.LLM(model=dir)`` and ``transformers`` load as-is:

* ``config.json``: ``Qwen3MoeConfig`` (``model_type: qwen3_moe``, architecture ``Qwen3MoeForCausalLM``).
* ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE tokenizer trained deterministically on the
  builtin prompts (``runner/data/prompts.jsonl``) with Qwen-style special tokens; ``AutoTokenizer`` loads it.
* ``model.safetensors`` (``weights="seeded"``): random weights drawn under ``torch.manual_seed(weights_seed)``
  by ``Qwen3MoeForCausalLM(config)`` and written with ``save_pretrained`` (per-expert tensor names
  ``mlp.experts.<i>.{gate,up,down}_proj.weight``, the layout real Qwen3-MoE checkpoints use), so
  ``load_format="auto"`` loads real files. ``weights="none"`` writes no weights: load it with
  ``load_format="dummy"``.

The directory name carries a hash of the architecture, the recipe version and the transformers version, so a
changed recipe never reuses a stale directory; creation writes to a temp dir and renames it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

# Bump when the recipe changes (tokenizer training, config fields, weight init).
RECIPE = 1

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: Default architecture: 2 layers, hidden 128, 4 query heads / 2 KV heads of head_dim 32, 8 experts (top-2) of
#: intermediate size 64. ``vocab_size`` is the tokenizer's size (the BPE trainer's target; the model's
#: embedding rows are ``max(len(tokenizer), vocab_size)``).
ARCH: Dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 512,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "weights_seed": 0,
}


def build_tokenizer(vocab_size: int = 512, corpus_path: Optional[Path] = None):
    """Byte-level BPE tokenizer (``PreTrainedTokenizerFast``) trained on the builtin prompts.

    ``<|endoftext|>`` is both EOS and PAD (as in Qwen3 base models); no BOS is added (``add_bos_token`` false).
    Ids 0..2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
    """
    from transformers import PreTrainedTokenizerFast

    from models.tokenizers import corpus_from, train_bpe
    from runner.core.dataset import BUILTIN_PROMPTS

    corpus = corpus_from(Path(corpus_path) if corpus_path else BUILTIN_PROMPTS)
    tok = train_bpe(corpus, vocab_size, SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], pad_token=SPECIALS[0],
                                   additional_special_tokens=SPECIALS[1:], model_max_length=int(ARCH[
                                       "max_position_embeddings"]))


def make_config(arch: Dict[str, Any], tokenizer) -> Any:
    """``Qwen3MoeConfig`` for ``arch`` with the tokenizer's vocabulary size and EOS/PAD ids."""
    from transformers import Qwen3MoeConfig

    kw = {k: v for k, v in arch.items() if k != "weights_seed"}
    kw["vocab_size"] = max(len(tokenizer), int(kw.get("vocab_size", 0)))
    eos = tokenizer.convert_tokens_to_ids(SPECIALS[0])
    cfg = Qwen3MoeConfig(**kw, eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def _write(target: Path, arch: Dict[str, Any], weights: str, dtype: str) -> None:
    import torch
    from transformers import Qwen3MoeForCausalLM

    tok = build_tokenizer(int(arch.get("vocab_size", 512)))
    cfg = make_config(arch, tok)
    tok.save_pretrained(target)
    if weights == "seeded":
        torch.manual_seed(int(arch.get("weights_seed", 0)))
        model = Qwen3MoeForCausalLM(cfg).to(getattr(torch, dtype))
        model.save_pretrained(target, safe_serialization=True)
    else:
        cfg.dtype = dtype
        cfg.save_pretrained(target)


def build(root: Optional[str] = None, arch: Optional[Dict[str, Any]] = None, weights: str = "seeded",
          dtype: str = "float32") -> Path:
    """Return the directory of a tiny Qwen3-MoE model, creating it on first use.

    Args:
        root: parent directory (default ``$RUNNER_CACHE`` or ``~/.cache/runner``).
        arch: overrides of :data:`ARCH` (merged over the defaults).
        weights: ``seeded`` (write ``model.safetensors``; loads with ``load_format="auto"``) or ``none``
            (config and tokenizer only; load with ``load_format="dummy"``).
        dtype: dtype the weights are stored in (``float32`` | ``bfloat16`` | ``float16``); also the config's
            ``dtype``, which vLLM's ``dtype="auto"`` follows.

    Returns:
        The model directory (``config.json``, tokenizer files, and ``model.safetensors`` when seeded).
    """
    import transformers

    if weights not in ("seeded", "none"):
        raise ValueError(f"weights={weights!r} is not one of seeded, none")
    full = {**ARCH, **(arch or {})}
    key = hashlib.sha256(json.dumps({"arch": full, "weights": weights, "dtype": dtype, "recipe": RECIPE,
                                     "transformers": transformers.__version__}, sort_keys=True).encode()
                         ).hexdigest()[:12]
    base = Path(root or os.environ.get("RUNNER_CACHE", "~/.cache/runner")).expanduser()
    target = base / f"tiny_qwen3_moe-{key}"
    if (target / "config.json").is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _write(tmp, full, weights, dtype)
    try:
        os.rename(tmp, target)
    except OSError:  # another process created it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Build a tiny Qwen3-MoE model directory and print its path.")
    p.add_argument("--root", default=None)
    p.add_argument("--weights", default="seeded", choices=("seeded", "none"))
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    print(build(a.root, weights=a.weights, dtype=a.dtype))
