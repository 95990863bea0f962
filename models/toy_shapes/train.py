"""Train the toy_shapes pipeline (FLUX architecture, small) on procedurally drawn shapes. Reproducible from a seed.

Stages (all on one GPU; a few minutes on an H200):
1. VAE (``AutoencoderKL``, scale factor 4, 4 latent channels): MSE reconstruction + a small KL term, then
   ``scaling_factor``/``shift_factor`` set from the trained latents' statistics (as the FLUX VAE's are).
2. Transformer (``FluxTransformer2DModel``): rectified-flow matching as FLUX uses it: ``x_t = (1 - s) x_0 + s e``,
   target ``e - x_0``, with ``s`` logit-normal (SD3 / FLUX training recipe) and the transformer given ``s``
   (FluxPipeline passes ``timestep / 1000 = sigma``). Text encoders (CLIP-style pooled, T5-style sequence) stay
   frozen at their seeded random initialisation; captions are encoded once.
3. The pipeline is saved with ``save_pretrained`` (safetensors, fp16 to fit the 20 MB budget) and evaluated with
   the oracle through the normal ``FluxPipeline`` call.

Usage: ``python -m models.toy_shapes.train --out models/toy_shapes/weights [--vae-steps 1500 --steps 4000]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


def load_arch() -> dict:
    """The architecture of ``conf/model/toy_shapes.yaml``."""
    from runner.core.paths import CONF_DIR
    from runner.core.schema import yaml_section

    return yaml_section(CONF_DIR / "model/toy_shapes.yaml", "architecture")


def images_tensor(n: int, seed: int, size: int, device: str):
    """``n`` training images as ``(n, 3, size, size)`` floats in [-1, 1] with their captions."""
    from models.toy_shapes.data import samples

    imgs, caps = [], []
    for img, cap, _ in samples(n, seed=seed, size=size):
        imgs.append(img)
        caps.append(cap)
    x = torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    return x.to(device), caps


@torch.no_grad()
def encode_text(pipe, captions, max_len: int, device: str):
    """T5 sequence embeddings ``(n, max_len, d)`` and CLIP pooled ``(n, d_pool)`` of each caption."""
    prompt_embeds, pooled, _ = pipe.encode_prompt(prompt=captions, prompt_2=None, device=device,
                                                  max_sequence_length=max_len)
    return prompt_embeds.float(), pooled.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "models/toy_shapes/weights"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=1500)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--report", default=None, help="write training/eval figures as JSON here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training with TF32 tensor cores: the model is small
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from models.flux import build_components
    from models.toy_shapes.data import caption, combos

    arch = load_arch()
    comps = build_components(arch)
    pipe = FluxPipeline(**comps).to(device)
    vae, tr = pipe.vae, pipe.transformer
    max_len = 16
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "seed": args.seed}

    # ---- 1. VAE
    t0 = time.time()
    x_all, caps_all = images_tensor(20000 if device == "cuda" else 64, args.seed + 1, args.size, device)
    opt = torch.optim.AdamW(vae.parameters(), lr=1e-3, weight_decay=0.0)
    vsched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=args.vae_steps, pct_start=0.05)
    vae.train()
    for step in range(args.vae_steps):
        idx = torch.randint(0, x_all.shape[0], (min(args.batch, x_all.shape[0]),), device=device)
        x = x_all[idx]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=False):
            post = vae.encode(x).latent_dist
            z = post.sample()
            rec = vae.decode(z).sample
        loss = F.mse_loss(rec.float(), x) + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        vsched.step()
        if step % 500 == 0 or step == args.vae_steps - 1:
            print(f"vae step {step} loss {loss.item():.5f}", flush=True)
    vae.eval()
    with torch.no_grad():
        lat = torch.cat([vae.encode(x_all[i:i + 512]).latent_dist.mean for i in range(0, min(4096, len(x_all)), 512)])
    shift, scale = lat.mean().item(), 1.0 / lat.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    report.update(vae_loss=loss.item(), vae_s=time.time() - t0, shift_factor=shift, scaling_factor=scale)

    # ---- 2. transformer (flow matching on packed latents)
    t0 = time.time()
    all_caps = [caption(*c) for c in combos()] + [""]
    cap_index = {c: i for i, c in enumerate(all_caps)}
    pe, pooled = encode_text(pipe, all_caps, max_len, device)
    with torch.no_grad():
        z_all = torch.cat([vae.encode(x_all[i:i + 512]).latent_dist.mean for i in range(0, len(x_all), 512)])
        z_all = (z_all - shift) * scale
    cap_ids = torch.tensor([cap_index[c] for c in caps_all], device=device)
    B, C, H, W = z_all.shape[0], z_all.shape[1], z_all.shape[2], z_all.shape[3]
    img_ids = FluxPipeline._prepare_latent_image_ids(1, H // 2, W // 2, device, torch.float32)
    txt_ids = torch.zeros(max_len, 3, device=device)
    mu = calculate_shift((H // 2) * (W // 2), pipe.scheduler.config.base_image_seq_len,
                         pipe.scheduler.config.max_image_seq_len, pipe.scheduler.config.base_shift,
                         pipe.scheduler.config.max_shift)
    opt = torch.optim.AdamW(tr.parameters(), lr=4e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=4e-4, total_steps=args.steps, pct_start=0.05)
    tr.train()
    for step in range(args.steps):
        idx = torch.randint(0, B, (min(args.batch, B),), device=device)
        x0 = FluxPipeline._pack_latents(z_all[idx], len(idx), C, H, W)
        ci = cap_ids[idx].clone()
        ci[torch.rand(len(idx), device=device) < 0.1] = cap_index[""]  # caption dropout (allows true CFG)
        u = torch.randn(len(idx), device=device)
        s = torch.sigmoid(u)  # logit-normal sigma, then FLUX's resolution-dependent time shift exp(mu)
        s = torch.exp(torch.tensor(mu, device=device)) / (torch.exp(torch.tensor(mu, device=device)) + (1 / s - 1))
        e = torch.randn_like(x0)
        xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * e
        with torch.autocast(device, dtype=torch.bfloat16, enabled=False):
            v = tr(hidden_states=xt, timestep=s, pooled_projections=pooled[ci], encoder_hidden_states=pe[ci],
                   txt_ids=txt_ids, img_ids=img_ids, guidance=None, return_dict=False)[0]
        loss = F.mse_loss(v.float(), e - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 500 == 0 or step == args.steps - 1:
            print(f"flow step {step} loss {loss.item():.5f}", flush=True)
    tr.eval()
    report.update(flow_loss=loss.item(), flow_s=time.time() - t0, steps=args.steps, vae_steps=args.vae_steps)

    # ---- 3. save (fp16) and evaluate through the pipeline with the oracle
    out = Path(args.out)
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True)
    report["weights_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    ev = FluxPipeline.from_pretrained(out, dtype=torch.float32, local_files_only=True).to(device)
    ev.set_progress_bar_config(disable=True)
    from models.toy_shapes.oracle import accuracy, read

    pairs = []
    cs = combos()
    for i in range(0, len(cs), 30):
        chunk = cs[i:i + 30]
        gens = [torch.Generator("cpu").manual_seed(1000 + i + j) for j in range(len(chunk))]
        imgs = ev(prompt=[caption(*c) for c in chunk], height=args.size, width=args.size, num_inference_steps=16,
                  guidance_scale=0.0, generator=gens, max_sequence_length=max_len, output_type="np").images
        pairs += [(read(img), dict(zip(("color", "shape", "position"), c))) for img, c in zip(imgs, chunk)]
    report["eval_accuracy_fp32_16_steps"] = accuracy(pairs)
    print(json.dumps(report, indent=1), flush=True)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
