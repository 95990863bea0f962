"""Train the toy_shapes few-step LoRA ``fewstep2``: 2 denoising steps at a static scheduler shift that land where the
base model's 16 steps land, the toy equivalent of the distilled few-step adapters (Wan 2.2 Lightning / LightX2V,
Qwen-Image-Lightning) that ``experiment=toy_shapes_fewstep`` runs and gates (``docs/lora.md``, "Distilled presets").

Recipe (trajectory distillation, the base pipeline frozen): the teacher is the base model as ``model=toy_shapes``
runs it (``FluxPipeline``, :data:`TEACHER_STEPS` steps, its own resolution-dependent shift); it maps seeded noise
``e`` ``(n, 64, 16)`` (packed latents of a 64x64 image) and a caption to a latent ``x0``. The student is the same
transformer with a peft LoRA (rank :data:`RANK`, ``lora_alpha`` = rank, on :data:`TARGET_MODULES`, the attention
projections ``all_blue`` adapts), run as the preset runs it: :data:`STEPS` Euler steps over the sigmas of
``FlowMatchEulerDiscreteScheduler`` at the static shift :data:`SHIFT` (``[1, 0.75, 0]``:
``sigma' = s sigma / (1 + (s - 1) sigma)`` on ``linspace(1, 1/steps, steps)``). The loss is the mean squared error
between the student's unrolled few-step output (gradients through every step) and the teacher's ``x0`` from the same
noise. Saved in diffusers' LoRA format (``FluxPipeline.save_lora_weights``) with the peft config as adapter
metadata; no oracle effect (the adapter keeps the caption's colour, shape and position).

Evaluation (held-out seeds, every colour/shape/position combo, through the normal ``FluxPipeline`` call with
``load_lora_weights`` and the preset's scheduler): the oracle's accuracy (``models.toy_shapes.oracle``) and the PSNR
(dB, over all pixels in [0, 1]) against the base model's 16-step image of the same seed, for the base at 16 steps,
the base at :data:`STEPS` steps without the adapter and with it.

Usage (CPU: 0.3 s a step on 2 idle cores, about 10 minutes; the shipped file took 2241 s on a 2-core machine shared
with another job): ``python -m models.toy_shapes.train_fewstep`` writes
``models/toy_shapes/lora/fewstep2.safetensors`` and its report ``fewstep2.json`` beside it (``--out``,
``--report``); smoke (a minute): ``--steps 5 --teacher-seeds 1 --eval-seeds 1``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from models.toy_shapes.train_lora import optimizer_step, save_adapter

REPO = Path(__file__).resolve().parents[2]
RANK = 16
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
MAX_LEN = 16          # conf/model/toy_shapes.yaml model.generation.max_sequence_length
SIZE = 64             # conf/model/toy_shapes.yaml width and height
STEPS = 2             # conf/experiment/toy_shapes_fewstep.yaml model.generation.num_inference_steps
SHIFT = 3.0           # conf/experiment/toy_shapes_fewstep.yaml model.generation.shift
TEACHER_STEPS = 16    # conf/model/toy_shapes.yaml model.generation.num_inference_steps


def load(weights: Path) -> Any:
    """The base ``FluxPipeline`` in float32 on the CPU, progress bar off."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(weights, dtype=torch.float32, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def preset_scheduler(pipe: Any, shift: float = SHIFT) -> Any:
    """The pipeline's ``FlowMatchEulerDiscreteScheduler`` at the static ``shift`` (dynamic shifting and the terminal
    stretch off), as ``model.generation.shift`` installs it (``models.scheduler_shift``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=float(shift),
                                                       use_dynamic_shifting=False, shift_terminal=None)


def noise(n: int, seed: int) -> torch.Tensor:
    """Packed latent noise ``(n, 64, 16)`` of ``n`` 64x64 images (4 latent channels at 16x16, packed 2x2)."""
    from diffusers import FluxPipeline

    g = torch.Generator("cpu").manual_seed(seed)
    z = torch.randn(n, 4, SIZE // 4, SIZE // 4, generator=g)
    return FluxPipeline._pack_latents(z, n, 4, SIZE // 4, SIZE // 4)


def teacher(pipe: Any, caps: Sequence[str], e: torch.Tensor, output_type: str = "latent") -> Any:
    """The base model's :data:`TEACHER_STEPS`-step output from noise ``e``: packed latents ``(n, 64, 16)``, or images
    ``(n, 64, 64, 3)`` in [0, 1] (``output_type="np"``)."""
    out = []
    for i in range(0, len(caps), 60):
        out.append(pipe(prompt=list(caps[i:i + 60]), latents=e[i:i + 60], height=SIZE, width=SIZE,
                        num_inference_steps=TEACHER_STEPS, max_sequence_length=MAX_LEN,
                        output_type=output_type).images)
    return torch.cat(out) if output_type == "latent" else np.concatenate(out)


def sigmas(steps: int = STEPS, shift: float = SHIFT) -> List[float]:
    """The preset scheduler's sigmas (``steps`` + 1 values, the last 0), read from the scheduler itself."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    s = FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=False)
    s.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))  # FluxPipeline's sigmas
    return [float(x) for x in s.sigmas]


def train(pipe: Any, args: Any) -> Tuple[Any, Dict[str, Any]]:
    """Distil the LoRA (module docstring); returns the peft config and the figures."""
    from peft import LoraConfig

    from models.toy_shapes.data import caption, combos
    from models.toy_shapes.train import encode_text

    cs = combos()
    caps = [caption(*c) for c in cs] * args.teacher_seeds
    e = noise(len(caps), args.seed + 1)
    t0 = time.time()
    with torch.no_grad():
        x0 = teacher(pipe, caps, e)
    teacher_s = time.time() - t0
    uniq = sorted(set(caps))
    with torch.no_grad():
        pe, pooled = encode_text(pipe, uniq, MAX_LEN, "cpu")
    cap_ids = torch.tensor([uniq.index(c) for c in caps])
    from diffusers import FluxPipeline

    img_ids = FluxPipeline._prepare_latent_image_ids(1, SIZE // 8, SIZE // 8, "cpu", torch.float32)
    txt_ids = torch.zeros(MAX_LEN, 3)
    tr = pipe.transformer
    tr.requires_grad_(False)
    torch.manual_seed(args.seed)
    cfg = LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights=True, target_modules=TARGET_MODULES)
    tr.add_adapter(cfg)
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(args.steps, 40),
                                                pct_start=0.05)
    sig = sigmas()
    g = torch.Generator("cpu").manual_seed(args.seed + 2)
    t0, loss = time.time(), torch.zeros(())
    tr.train()
    for step in range(args.steps):
        idx = torch.randint(0, len(caps), (min(args.batch, len(caps)),), generator=g)
        x = e[idx]
        for s, s_next in zip(sig[:-1], sig[1:]):  # FlowMatchEulerDiscreteScheduler.step: x + (s_next - s) v
            v = tr(hidden_states=x, timestep=torch.full((len(idx),), s), pooled_projections=pooled[cap_ids[idx]],
                   encoder_hidden_states=pe[cap_ids[idx]], txt_ids=txt_ids, img_ids=img_ids, guidance=None,
                   return_dict=False)[0]
            x = x + (s_next - s) * v
        loss = F.mse_loss(x, x0[idx])
        optimizer_step(loss, params, opt, sched, "fewstep", step, args.steps, every=50)
    tr.eval()
    return cfg, {"loss": loss.item(), "train_s": round(time.time() - t0, 1), "teacher_s": round(teacher_s, 1),
                 "steps": args.steps, "batch": args.batch, "samples": len(caps), "sigmas": sig,
                 "parameters": sum(p.numel() for p in params)}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two image stacks in [0, 1] over all their pixels."""
    return round(float(10 * np.log10(1.0 / max(float(((a - b) ** 2).mean()), 1e-12))), 3)


def evaluate(weights: Path, lora_file: Path, seeds: int, seed0: int) -> Dict[str, Any]:
    """Oracle accuracy and PSNR against the 16-step base of the same noise (module docstring), over every combo
    times ``seeds`` noise draws not used in training."""
    from models.toy_shapes.data import caption, combos
    from models.toy_shapes.oracle import accuracy, read

    pipe = load(weights)
    cs = combos() * seeds
    caps = [caption(*c) for c in cs]
    expect = [dict(zip(("color", "shape", "position"), c)) for c in cs]
    e = noise(len(caps), seed0)
    ref = teacher(pipe, caps, e, "np")
    own = pipe.scheduler

    def few(scale: float) -> np.ndarray:
        pipe.scheduler = preset_scheduler(pipe)
        if scale:
            pipe.set_adapters(["fewstep2"], [scale])
        out = np.concatenate([pipe(prompt=caps[i:i + 60], latents=e[i:i + 60], height=SIZE, width=SIZE,
                                   num_inference_steps=STEPS, max_sequence_length=MAX_LEN, output_type="np").images
                              for i in range(0, len(caps), 60)])
        pipe.scheduler = own
        return out

    base_few = few(0.0)
    pipe.load_lora_weights(str(lora_file), adapter_name="fewstep2", use_safetensors=True)
    adapted = few(1.0)

    def score(imgs: np.ndarray) -> Dict[str, Any]:
        return {"oracle": accuracy([(read(im), x) for im, x in zip(imgs, expect)]),
                "psnr_db_vs_base16": psnr(imgs, ref)}

    return {"n": len(caps), "base_16": score(ref), f"base_{STEPS}": score(base_few),
            f"adapter_{STEPS}": score(adapted)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=str(REPO / "models/toy_shapes/weights"))
    p.add_argument("--out", default=str(REPO / "models/toy_shapes/lora/fewstep2.safetensors"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--teacher-seeds", type=int, default=16, help="noise draws per combo the teacher renders")
    p.add_argument("--eval-seeds", type=int, default=3, help="held-out noise draws per combo evaluated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--report", default=None, help="training/eval figures as JSON (default: beside --out, .json)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    pipe = load(Path(args.weights))
    cfg, figures = train(pipe, args)
    out = Path(args.out)
    report: Dict[str, Any] = {"device": "cpu", "seed": args.seed, "rank": RANK, "target_modules": TARGET_MODULES,
                              "steps": STEPS, "shift": SHIFT, "teacher_steps": TEACHER_STEPS, "train": figures}
    report["bytes"] = save_adapter(pipe, cfg, out)
    report["eval"] = evaluate(Path(args.weights), out, args.eval_seeds, args.seed + 1000)
    print(json.dumps(report, indent=1), flush=True)
    Path(args.report or out.with_suffix(".json")).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
