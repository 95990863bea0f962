"""Train the toy_motion pipeline (Wan 2.1 architecture, small) on procedurally drawn moving shapes. Reproducible
from a seed.

Stages (all on one GPU; a few minutes on an H200):
1. VAE (``AutoencoderKLWan``: causal 3D convolutions, x8 space, x4 time keeping the first frame, 16 latent
   channels): MSE reconstruction + a small KL term, then ``latents_mean``/``latents_std`` (per channel) set from the
   trained latents' statistics. ``WanPipeline`` decodes ``latents * std + mean`` (it divides by ``1 / std``), so the
   transformer learns the standardised latents ``(z - mean) / std``.
2. Transformer (``WanTransformer3DModel``): rectified-flow matching as the pipeline's scheduler reads it
   (``UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)``: ``x0 = x_t - sigma * v``):
   ``x_t = (1 - s) x_0 + s e``, target ``v = e - x_0``, ``s`` logit-normal then shifted by ``flow_shift`` as the
   scheduler's sigmas are, and the transformer given ``timestep = s * num_train_timesteps`` (``WanPipeline`` passes
   the scheduler's timesteps, ``sigma * 1000``). 10 % caption dropout (the empty prompt, which ``WanPipeline``
   encodes as the negative prompt) keeps classifier-free guidance possible. The UMT5 text encoder stays frozen at
   its seeded random initialisation, rounded to fp16 first (as it is shipped); captions are encoded once.
3. The pipeline is saved with ``save_pretrained`` (safetensors, fp16 to fit the 10 MB budget) and evaluated with
   the oracle through the normal ``WanPipeline`` call (every caption, fp32).

Step counts are fixed by ``--vae-steps``/``--steps``; ``--time-limit`` (seconds, optional) is a safety net for a
bounded device session: after 20 steps of a stage, if its projected time exceeds its share, the stage's step count
(and its learning-rate schedule) is lowered once and the report says so (``*_steps`` are the counts that ran: pass
them back to reproduce).

Usage: ``python -m models.toy_motion.train --out models/toy_motion/weights [--vae-steps 2000 --steps 6000]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
MAX_LEN = 16  # model.generation.max_sequence_length: captions are 13 tokens with the end token


def load_arch() -> dict:
    """The architecture of ``conf/model/toy_motion.yaml``."""
    from runner.core.paths import CONF_DIR
    from runner.core.schema import yaml_section

    return yaml_section(CONF_DIR / "model/toy_motion.yaml", "architecture")


def clips_tensor(n: int, seed: int, num_frames: int, size: int, device: str):
    """``n`` training clips as uint8 ``(n, 3, F, size, size)`` on ``device`` with their captions."""
    from models.toy_motion.data import samples

    clips, caps = [], []
    for clip, cap, _ in samples(n, seed=seed, num_frames=num_frames, size=size):
        clips.append(clip)
        caps.append(cap)
    x = torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).contiguous()
    return x.to(device), caps


def to_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 clips to floats in [-1, 1]."""
    return x.float().div(127.5).sub(1.0)


def lr_at(step: int, total: int, peak: float, warm: float = 0.05) -> float:
    """Linear warm-up over ``warm`` of ``total`` steps, then cosine to 0."""
    w = max(1, int(total * warm))
    if step < w:
        return peak * (step + 1) / w
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))


class Budget:
    """A stage's step count, lowered once when it would overrun ``seconds``: the time per step is measured over
    steps 10-60 (after warm-up: cuDNN autotuning, allocator growth)."""

    def __init__(self, steps: int, seconds: float | None, start: int = 10, probe: int = 60) -> None:
        self.steps, self.planned, self.seconds, self.start, self.probe = steps, steps, seconds, start, probe
        self.t0, self.t_start = time.time(), None

    def check(self, step: int, sync) -> None:
        if self.seconds is None or self.steps <= self.probe or step not in (self.start, self.probe):
            return
        sync()
        if step == self.start:
            self.t_start = time.time()
            return
        per = (time.time() - self.t_start) / (self.probe - self.start)
        fit = int((self.seconds - (time.time() - self.t0)) / per) + self.probe
        if fit < self.steps:
            self.steps = max(self.probe + 1, fit // 100 * 100)
            print(f"time limit: {per * 1000:.1f} ms/step, steps lowered {self.planned} -> {self.steps}", flush=True)


@torch.no_grad()
def encode_text(pipe, captions, device: str) -> torch.Tensor:
    """UMT5 sequence embeddings ``(n, MAX_LEN, d)`` of each caption, zero-padded as ``WanPipeline`` does."""
    pe, _ = pipe.encode_prompt(prompt=captions, do_classifier_free_guidance=False, max_sequence_length=MAX_LEN,
                               device=device)
    return pe.float()


@torch.no_grad()
def evaluate(path: Path, device: str, num_frames: int, size: int, steps: int, guidance: float,
             seed: int = 1000) -> dict:
    """Oracle accuracy of every caption generated through ``WanPipeline`` (fp32), one seeded generator each."""
    from diffusers import WanPipeline

    from models.toy_motion.data import caption, combos
    from models.toy_motion.oracle import ATTRS, accuracy, read

    ev = WanPipeline.from_pretrained(path, dtype=torch.float32, local_files_only=True).to(device)
    ev.set_progress_bar_config(disable=True)
    pairs, cs = [], combos()
    for i in range(0, len(cs), 24):
        chunk = cs[i:i + 24]
        gens = [torch.Generator("cpu").manual_seed(seed + i + j) for j in range(len(chunk))]
        vids = ev(prompt=[caption(*c) for c in chunk], height=size, width=size, num_frames=num_frames,
                  num_inference_steps=steps, guidance_scale=guidance, generator=gens, max_sequence_length=MAX_LEN,
                  output_type="np").frames
        pairs += [(read(v), dict(zip(ATTRS, c))) for v, c in zip(vids, chunk)]
    return accuracy(pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "models/toy_motion/weights"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clips", type=int, default=None, help="training clips (default 8000 on a GPU, 32 on CPU)")
    p.add_argument("--vae-steps", type=int, default=2000)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for both training stages (VAE 40 %%, transformer the rest); see the module doc")
    p.add_argument("--eval-steps", type=int, default=16)
    p.add_argument("--eval-guidance", type=float, nargs="*", default=[1.0, 3.0])
    p.add_argument("--init", default=None, help="fine-tune this saved snapshot instead of seeded random weights")
    p.add_argument("--vae-lr", type=float, default=2e-3, help="the VAE stage's peak learning rate")
    p.add_argument("--lr", type=float, default=4e-4, help="the transformer stage's peak learning rate")
    p.add_argument("--report", default=None, help="write training/eval figures as JSON here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training with TF32 tensor cores: the model is small
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True  # a handful of conv shapes (the VAE's causal chunks)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    from diffusers import WanPipeline

    from models.toy_motion.data import captions
    from models.wan import WanEngine

    t_start = time.time()
    arch = load_arch()
    if args.init:  # fine-tune a saved snapshot (fp16 on disk, trained in fp32 as from scratch)
        pipe = WanPipeline.from_pretrained(args.init, torch_dtype=torch.float32, local_files_only=True).to(device)
    else:
        comps = WanEngine.build_components(arch)
        with torch.no_grad():  # the text encoder ships in fp16: train against exactly those weights
            for prm in comps["text_encoder"].parameters():
                prm.copy_(prm.half().float())
        pipe = WanPipeline(**comps).to(device)
    vae, tr = pipe.vae, pipe.transformer
    pipe.text_encoder.requires_grad_(False)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "seed": args.seed,
                    "init": args.init, "vae_lr": args.vae_lr, "lr": args.lr,
                    "frames": args.frames, "size": args.size,
                    "params": {k: sum(q.numel() for q in m.parameters()) for k, m in
                               (("transformer", tr), ("vae", vae), ("text_encoder", pipe.text_encoder))}}

    # ---- 0. data
    t0 = time.time()
    n_clips = args.clips or (8000 if device == "cuda" else 32)
    x_all, caps_all = clips_tensor(n_clips, args.seed + 1, args.frames, args.size, device)
    report.update(clips=n_clips, data_s=time.time() - t0)
    print(f"data: {n_clips} clips {tuple(x_all.shape)} in {time.time() - t0:.1f}s", flush=True)

    # ---- 1. VAE
    t0 = time.time()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    bud = Budget(args.vae_steps, None if args.time_limit is None else 0.45 * args.time_limit)
    amp = contextlib.nullcontext()  # bf16 autocast measured slower here (159 vs 133 ms/step): fp32 with TF32 matmuls
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    vae.train()
    step, losses = 0, []
    while step < bud.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, bud.steps, args.vae_lr)
        idx = torch.randint(0, x_all.shape[0], (min(args.vae_batch, x_all.shape[0]),), device=device)
        x = to_float(x_all[idx])
        with amp:
            post = vae.encode(x).latent_dist
            rec = vae.decode(post.sample()).sample
        # the shape covers a few % of the white frame: its pixels weigh 10x, or the VAE learns a white video
        weight = 1.0 + 9.0 * (x.amin(dim=1, keepdim=True) < 0.8).float()
        mse = F.mse_loss(rec.float(), x)
        loss = (weight * (rec.float() - x) ** 2).mean() + 1e-6 * post.kl().float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        losses.append(mse.item()) if step % 10 == 0 or step >= bud.steps - 20 else None
        if step % 250 == 0 or step == bud.steps - 1:
            print(f"vae step {step}/{bud.steps} mse {mse.item():.5f} ({time.time() - t0:.0f}s)", flush=True)
        step += 1
        bud.check(step, sync)
    vae.eval()
    vae.requires_grad_(False)
    with torch.no_grad():
        z_all = torch.cat([vae.encode(to_float(x_all[i:i + 128])).latent_dist.mean
                           for i in range(0, len(x_all), 128)])  # (n, C, f, h, w)
    mean = z_all.mean(dim=(0, 2, 3, 4))
    std = z_all.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=[round(float(v), 6) for v in mean],
                           latents_std=[round(float(v), 6) for v in std])
    mean_t = torch.tensor(vae.config.latents_mean, device=device).view(1, -1, 1, 1, 1)
    std_t = torch.tensor(vae.config.latents_std, device=device).view(1, -1, 1, 1, 1)
    z_all = (z_all - mean_t) / std_t
    with torch.no_grad():  # the oracle on reconstructions of every drawn combination (an upper bound for stage 2)
        from models.toy_motion.data import combos, draw
        from models.toy_motion.oracle import ATTRS, accuracy, read

        clean = torch.from_numpy(np.stack([draw(*c, num_frames=args.frames, size=args.size) for c in combos()]))
        clean = to_float(clean.permute(0, 4, 1, 2, 3).to(device))
        rec = vae.decode(vae.encode(clean).latent_dist.mean).sample
        rec = ((rec.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 4, 1).cpu().numpy()
        report["vae_reconstruction_accuracy"] = accuracy([(read(r), dict(zip(ATTRS, c)))
                                                          for r, c in zip(rec, combos())])
    print("vae reconstruction accuracy", report["vae_reconstruction_accuracy"], flush=True)
    report.update(vae_mse=float(np.mean(losses[-20:])), vae_s=time.time() - t0, vae_steps=bud.steps,
                  vae_steps_planned=bud.planned, latent_shape=list(z_all.shape[1:]),
                  latents_mean=vae.config.latents_mean, latents_std=vae.config.latents_std)

    # ---- 2. transformer (flow matching on standardised latents)
    t0 = time.time()
    all_caps = captions() + [""]
    cap_index = {c: i for i, c in enumerate(all_caps)}
    pe = encode_text(pipe, all_caps, device)
    cap_ids = torch.tensor([cap_index[c] for c in caps_all], device=device)
    shift = float(pipe.scheduler.config.flow_shift)
    n_train = float(pipe.scheduler.config.num_train_timesteps)
    # the text encoder stays frozen: encode_text runs under no_grad (the shipped text encoder is bit-identical to its
    # fp16-rounded seeded init; an earlier comment here said it trained, it never received gradients)
    opt = torch.optim.AdamW(tr.parameters(), lr=args.lr, weight_decay=0.01)
    left = None if args.time_limit is None else max(30.0, args.time_limit - (time.time() - t_start))
    bud = Budget(args.steps, left)
    tr.train()
    step, losses = 0, []
    B = z_all.shape[0]
    while step < bud.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, bud.steps, args.lr)
        idx = torch.randint(0, B, (min(args.batch, B),), device=device)
        x0 = z_all[idx]
        ci = cap_ids[idx].clone()
        ci[torch.rand(len(idx), device=device) < 0.1] = cap_index[""]  # caption dropout (allows CFG)
        s = torch.sigmoid(torch.randn(len(idx), device=device))  # logit-normal, then the scheduler's flow shift
        s = shift * s / (1 + (shift - 1) * s)
        e = torch.randn_like(x0)
        sv = s.view(-1, 1, 1, 1, 1)
        xt = (1 - sv) * x0 + sv * e
        v = tr(hidden_states=xt, timestep=s * n_train, encoder_hidden_states=pe[ci], return_dict=False)[0]
        loss = F.mse_loss(v.float(), e - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        losses.append(loss.item()) if step % 10 == 0 or step >= bud.steps - 50 else None
        if step % 500 == 0 or step == bud.steps - 1:
            print(f"flow step {step}/{bud.steps} loss {loss.item():.5f} ({time.time() - t0:.0f}s)", flush=True)
        step += 1
        bud.check(step, sync)
    tr.eval()
    report.update(flow_loss=float(np.mean(losses[-50:])), flow_s=time.time() - t0, steps=bud.steps,
                  steps_planned=bud.planned, train_s=time.time() - t_start)

    # ---- 3. save (fp16) and evaluate through the pipeline with the oracle
    out = Path(args.out)
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True)
    report["weights_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(json.dumps(report), flush=True)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))
    for g in args.eval_guidance:
        t0 = time.time()
        key = f"eval_accuracy_fp32_{args.eval_steps}_steps_guidance_{g:g}"
        report[key] = evaluate(out, device, args.frames, args.size, args.eval_steps, g)
        report[key]["s"] = round(time.time() - t0, 2)
        print(key, report[key], flush=True)
        if args.report:
            Path(args.report).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()
