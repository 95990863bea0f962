"""CLIPScore scoring throughput (images/s) on one GPU (issue #33), through the runner's own scorer
(``runner.core.metrics``: torchmetrics' CLIPScore update on a transformers ``CLIPModel``, float32 on a GPU).

The model is CLIP ViT-L/14 built from its published config (``openai/clip-vit-large-patch14`` config.json: text 12
layers x 768, vision 24 layers x 1024, patch 14, 224 px, projection 768, quick_gelu) with seeded random weights,
saved with ``save_pretrained`` (safetensors) beside a ``CLIPProcessor`` (the published image-processor settings: resize
the shortest edge to 224, centre crop 224, CLIP mean/std; a local byte-level BPE tokenizer,
``models.tokenizers.build_clip_tokenizer``, in place of the hub's vocabulary) and loaded back through
``from_pretrained`` (``runner.core.metrics.ClipScorer``), as a run loads ``metrics.models.clip_score``.

Per batch size (default 32 and 64), random ``uint8`` images of ``--image-px`` (default 1024, a FLUX output) with
prompts of ~20 words: one warm-up batch, then ``--iters`` timed batches (CUDA synchronised), reported as
``images_per_s`` (end to end: the processor's resize/normalise on the host, text tokenisation, both towers) and
``model_images_per_s`` (the towers alone on preprocessed tensors), with the peak device memory. Prints one JSON
document (and writes it with ``--out``).

Needs torch, transformers, torchmetrics (and this checkout on ``PYTHONPATH``); about a minute on an H200 (building
and saving the 428M-parameter model is most of it).

Usage (device):  PYTHONPATH=$PWD python benchmarks/clipscore_throughput.py --out $OUT/clipscore_throughput.json
Here (CPU smoke, tiny sizes): PYTHONPATH=$PWD python benchmarks/clipscore_throughput.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

#: ``openai/clip-vit-large-patch14``'s published architecture (its config.json).
VIT_L_14 = {
    "text_config": {"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                    "projection_dim": 768},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": 224, "patch_size": 14, "hidden_act": "quick_gelu",
                      "projection_dim": 768},
    "projection_dim": 768, "logit_scale_init_value": 2.6592,
}
SMOKE = {
    "text_config": {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "max_position_embeddings": 77},
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                      "image_size": 32, "patch_size": 8},
    "projection_dim": 16,
}
WORDS = ("a red fox asleep in fresh snow under a pale winter sky with pine trees and soft morning light on the "
         "frozen lake beside a wooden cabin").split()


def build(path: Path, arch: Dict[str, Any], seed: int = 0) -> float:
    """Build CLIP from ``arch`` with seeded random weights and save it with its processor at ``path``; seconds."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from models.tokenizers import build_clip_tokenizer

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(**arch))
    model.save_pretrained(path, safe_serialization=True)
    px = arch["vision_config"]["image_size"]
    tok = build_clip_tokenizer([" ".join(WORDS)] * 4, min(arch["text_config"]["vocab_size"], 1024))
    CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": px}, crop_size={"height": px, "width": px}),
                  tokenizer=tok).save_pretrained(path)
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(scorer: Any, device: str, batch: int, image_px: int, iters: int, rng: np.random.Generator
            ) -> Dict[str, Any]:
    """Timed CLIPScore batches of ``batch`` images (see the module docstring)."""
    import torch

    images = [rng.integers(0, 256, size=(image_px, image_px, 3), dtype=np.uint8) for _ in range(batch)]
    prompts = [" ".join(rng.choice(WORDS, size=20)) for _ in range(batch)]
    scorer.clip_scores(images, prompts)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        scores = scorer.clip_scores(images, prompts)
    _sync(device)
    e2e = (time.perf_counter() - t0) / iters
    pixel_values = scorer.processor(images=[torch.from_numpy(a).permute(2, 0, 1) for a in images],
                                    return_tensors="pt")["pixel_values"].to(device)
    text = scorer.processor(text=prompts, return_tensors="pt", padding=True)
    ids, mask = text["input_ids"].to(device), text["attention_mask"].to(device)
    with torch.inference_mode():
        scorer.model.get_image_features(pixel_values), scorer.model.get_text_features(ids, mask)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            scorer.model.get_image_features(pixel_values)
            scorer.model.get_text_features(ids, mask)
        _sync(device)
    model_s = (time.perf_counter() - t0) / iters
    out = {"batch": batch, "images_per_s": round(batch / e2e, 2), "batch_s": round(e2e, 4),
           "model_images_per_s": round(batch / model_s, 2), "model_batch_s": round(model_s, 4),
           "scores_finite": bool(np.isfinite(scores).all())}
    if device.startswith("cuda"):
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--image-px", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny CLIP, 64 px, batch 4 and 8, 2 iterations (CPU check)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch
    import torchmetrics
    import transformers

    from runner.core.metrics import ClipScorer

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    arch, batches, px, iters = (SMOKE, [4, 8], 64, 2) if a.smoke else (VIT_L_14, a.batch, a.image_px, a.iters)
    with tempfile.TemporaryDirectory() as tmp:
        build_s = build(Path(tmp) / "clip", arch)
        t0 = time.perf_counter()
        scorer = ClipScorer(Path(tmp) / "clip", device, batch_size=max(batches))
        _sync(device)
        load_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        results = [measure(scorer, device, b, px, iters, rng) for b in batches]
    doc = {"benchmark": "clipscore_throughput", "model": "smoke" if a.smoke else "CLIP ViT-L/14 (random weights)",
           "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "dtype": str(next(scorer.model.parameters()).dtype).replace("torch.", ""), "image_px": px, "iters": iters,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "torchmetrics": torchmetrics.__version__, "build_s": round(build_s, 2), "load_s": round(load_s, 2),
           "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
