"""Train the toy_shapes LoRA ``all_blue``: every shape drawn in blue, whatever colour the caption names, its shape and
position kept. Reproducible from a seed; the base pipeline (``models/toy_shapes/weights``) stays frozen.

Recipe: the base model's flow matching (``models.toy_shapes.train``: ``x_t = (1 - s) x_0 + s e``, target
``e - x_0``, logit-normal ``s`` with FLUX's resolution shift) on images drawn by ``models.toy_shapes.data`` with the
colour replaced by :data:`TARGET` and the original captions; only a peft LoRA (rank :data:`RANK`, ``lora_alpha`` =
rank) on the transformer's attention projections (:data:`TARGET_MODULES`) trains. Saved in diffusers' LoRA format
(``FluxPipeline.save_lora_weights``: ``transformer.<module>.lora_A.weight`` ...) with the peft config as diffusers'
adapter metadata and the oracle effect ``runner.expect = {"color": "blue"}`` (``models.lora.EFFECT_KEY``), then
evaluated through the normal ``FluxPipeline`` call with ``load_lora_weights``: the oracle's ``color`` read as blue at
scale 1, the captions' attributes at scale 0.

Usage (H200, about 2 minutes): ``python -m models.toy_shapes.train_lora`` writes
``models/toy_shapes/lora/all_blue.safetensors`` and its report ``all_blue.json`` beside it (``--out``, ``--report``);
CPU smoke (seconds): ``--steps 2 --images 16 --batch 4 --eval 4``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
#: The colour every shape gets under the adapter (a ``data.COLORS`` name: the oracle reads it).
TARGET = "blue"
RANK = 8
#: The attention projections of FLUX's double-stream (image and text) and single-stream blocks.
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
MAX_LEN = 16  # conf/model/toy_shapes.yaml model.generation.max_sequence_length


def training_images(n: int, seed: int, size: int, device: str) -> Tuple[torch.Tensor, List[str]]:
    """``n`` images ``(n, 3, size, size)`` in [-1, 1], each shape drawn in :data:`TARGET`, with the captions naming
    the colour the base model would draw (``data.samples``' draws, same size jitter)."""
    import random

    from models.toy_shapes.data import caption, combos, draw

    rng = random.Random(seed)
    cs = combos()
    imgs, caps = [], []
    for _ in range(n):
        c, s, p = cs[rng.randrange(len(cs))]
        imgs.append(draw(TARGET, s, p, size, scale=0.36 * rng.uniform(0.8, 1.2)))
        caps.append(caption(c, s, p))
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    return x.to(device), caps


def add_lora(transformer: torch.nn.Module, seed: int) -> Any:
    """A peft LoRA on :data:`TARGET_MODULES` (``lora_B`` zero: the adapter starts as the identity); only its
    parameters train. Returns the ``LoraConfig``."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    torch.manual_seed(seed)
    cfg = LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights=True, target_modules=TARGET_MODULES)
    transformer.add_adapter(cfg)
    return cfg


def latents(pipe: Any, x: torch.Tensor) -> torch.Tensor:
    """VAE latents of ``x`` normalised as FluxPipeline does (``(z - shift) * scale``), ``(n, C, H, W)``."""
    vae = pipe.vae
    with torch.no_grad():
        z = torch.cat([vae.encode(x[i:i + 512]).latent_dist.mean for i in range(0, len(x), 512)])
    return (z - vae.config.shift_factor) * vae.config.scaling_factor


def train(pipe: Any, args: Any, device: str) -> Dict[str, Any]:
    """Flow matching of the LoRA parameters (module docstring); returns the loss and seconds."""
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from models.toy_shapes.train import encode_text

    x_all, caps = training_images(args.images, args.seed + 1, args.size, device)
    uniq = sorted(set(caps))
    pe, pooled = encode_text(pipe, uniq, MAX_LEN, device)
    cap_ids = torch.tensor([uniq.index(c) for c in caps], device=device)
    z_all = latents(pipe, x_all)
    B, C, H, W = z_all.shape
    img_ids = FluxPipeline._prepare_latent_image_ids(1, H // 2, W // 2, device, torch.float32)
    txt_ids = torch.zeros(MAX_LEN, 3, device=device)
    sc = pipe.scheduler.config
    mu = torch.tensor(calculate_shift((H // 2) * (W // 2), sc.base_image_seq_len, sc.max_image_seq_len, sc.base_shift,
                                      sc.max_shift), device=device)
    tr = pipe.transformer
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 2), pct_start=0.05)
    t0, loss = time.time(), torch.zeros(())
    tr.train()
    for step in range(args.steps):
        idx = torch.randint(0, B, (min(args.batch, B),), device=device)
        x0 = FluxPipeline._pack_latents(z_all[idx], len(idx), C, H, W)
        s = torch.sigmoid(torch.randn(len(idx), device=device))
        s = torch.exp(mu) / (torch.exp(mu) + (1 / s - 1))
        e = torch.randn_like(x0)
        xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * e
        v = tr(hidden_states=xt, timestep=s, pooled_projections=pooled[cap_ids[idx]],
               encoder_hidden_states=pe[cap_ids[idx]], txt_ids=txt_ids, img_ids=img_ids, guidance=None,
               return_dict=False)[0]
        loss = F.mse_loss(v.float(), e - x0)
        optimizer_step(loss, params, opt, sched, "lora", step, args.steps, every=250)
    tr.eval()
    return {"loss": loss.item(), "train_s": round(time.time() - t0, 1), "steps": args.steps, "images": args.images,
            "parameters": sum(p.numel() for p in params)}


def optimizer_step(loss: torch.Tensor, params: List[torch.nn.Parameter], opt: Any, sched: Any, name: str, step: int,
                   steps: int, every: int) -> None:
    """One step of the toy adapters' training: backward, gradient norm clipped to 1, optimizer and LR scheduler
    step; the loss printed every ``every`` steps and at the last. Shared by the toy adapters' training scripts."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    if step % every == 0 or step == steps - 1:
        print(f"{name} step {step} loss {loss.item():.5f}", flush=True)


def save_adapter(pipe: Any, cfg: Any, out: Path) -> int:
    """The transformer's peft adapter in diffusers' LoRA format (``FluxPipeline.save_lora_weights``, float32, the
    peft config as adapter metadata); returns the file's bytes. Shared by the toy adapters' training scripts."""
    from diffusers import FluxPipeline
    from peft import get_peft_model_state_dict

    sd = {k: v.detach().to("cpu", torch.float32).contiguous()
          for k, v in get_peft_model_state_dict(pipe.transformer).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.to_dict().items()}
    FluxPipeline.save_lora_weights(out.parent, transformer_lora_layers=sd, weight_name=out.name,
                                   transformer_lora_adapter_metadata=meta)
    return out.stat().st_size


def save(pipe: Any, cfg: Any, out: Path) -> int:
    """The adapter (:func:`save_adapter`) with the oracle effect in its metadata; returns the file's bytes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from models.lora import EFFECT_KEY

    save_adapter(pipe, cfg, out)
    with safe_open(str(out), "pt") as f:
        header = dict(f.metadata() or {})
    save_file(load_file(str(out)), str(out), metadata={**header, EFFECT_KEY: json.dumps({"color": TARGET})})
    return out.stat().st_size


def evaluate(weights: Path, lora_file: Path, n: int, size: int, device: str) -> Dict[str, Any]:
    """The oracle over the first ``n`` combos (16 steps, one seed each) at scale 1 and scale 0, through the normal
    ``FluxPipeline`` call with ``load_lora_weights``: share read as :data:`TARGET`, and the accuracy against the
    captions (scale 0: every attribute; scale 1: shape and position)."""
    from diffusers import FluxPipeline

    from models.toy_shapes.data import caption, combos
    from models.toy_shapes.oracle import accuracy, read

    pipe = FluxPipeline.from_pretrained(weights, dtype=torch.float32, local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_file), adapter_name="all_blue", use_safetensors=True)
    cs = combos()[:n]
    out: Dict[str, Any] = {}
    for scale in (1.0, 0.0):
        pipe.set_adapters(["all_blue"], [scale])
        reads = []
        for i in range(0, len(cs), 30):
            chunk = cs[i:i + 30]
            gens = [torch.Generator("cpu").manual_seed(1000 + i + j) for j in range(len(chunk))]
            imgs = pipe(prompt=[caption(*c) for c in chunk], height=size, width=size, num_inference_steps=16,
                        generator=gens, max_sequence_length=MAX_LEN, output_type="np").images
            reads += [(read(img), dict(zip(("color", "shape", "position"), c))) for img, c in zip(imgs, chunk)]
        out[f"scale_{scale:g}"] = {"target_color": sum(g["color"] == TARGET for g, _ in reads) / len(reads),
                                   "captions": accuracy(reads)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=str(REPO / "models/toy_shapes/weights"))
    p.add_argument("--out", default=str(REPO / "models/toy_shapes/lora/all_blue.safetensors"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--eval", type=int, default=60, help="combos evaluated (60: every colour, shape, position)")
    p.add_argument("--report", default=None, help="training/eval figures as JSON (default: beside --out, .json)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(args.weights, dtype=torch.float32, local_files_only=True).to(device)
    cfg = add_lora(pipe.transformer, args.seed)
    report: Dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "seed": args.seed, "rank": RANK, "target_modules": TARGET_MODULES, "target": TARGET}
    report["train"] = train(pipe, args, device)
    out = Path(args.out)
    report["bytes"] = save(pipe, cfg, out)
    report["eval"] = evaluate(Path(args.weights), out, args.eval, args.size, device)
    print(json.dumps(report, indent=1), flush=True)
    Path(args.report or out.with_suffix(".json")).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
