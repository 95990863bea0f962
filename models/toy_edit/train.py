"""Train the toy_edit pipeline (FLUX.1 Kontext architecture, small) on procedurally drawn edit pairs. Reproducible
from a seed.

Components: the VAE, both text encoders, both tokenizers and the scheduler are toy_shapes' trained/seeded ones
(``models/toy_shapes/weights``), loaded and frozen; only a new ``FluxTransformer2DModel`` (architecture in
``conf/model/toy_edit.yaml``) is trained, with rectified flow as FLUX uses it:
``x_t = (1 - s) x_0 + s e``, target ``e - x_0``, ``s`` logit-normal then shifted by ``exp(mu)`` with ``mu`` from the
target's token count (as the pipeline's dynamic shifting computes it), the transformer given ``s``
(``FluxKontextPipeline`` passes ``timestep / 1000``).

Conditioning exactly as ``FluxKontextPipeline.__call__`` feeds it: the input image goes through the pipeline's own
``prepare_latents`` (``_encode_vae_image``: the VAE posterior's mode, ``(z - shift_factor) * scaling_factor``, packed
2x2), its tokens are concatenated AFTER the noisy target's along the sequence (``torch.cat([latents, image_latents],
dim=1)``), the image ids are the target's ids followed by the reference's (the same grid with first axis 1), and only
the first ``latents.size(1)`` outputs are the prediction (``noise_pred[:, :latents.size(1)]``). ``kontext_forward``
is that call; ``tests/test_toy_edit.py`` checks it against what the real pipeline passes its transformer. The
instruction goes through the frozen encoders (``encode_prompt``: T5 sequence, CLIP pooled), encoded once.

After training the pipeline is saved with ``save_pretrained`` (fp16, safetensors) and evaluated through the real
``FluxKontextPipeline`` (fp32) with the oracle: the 60 builtin rows (their shipped input PNGs), all 540 edits, and the
swapped-input control of each (another row's input, different in every attribute: the kept attributes must fail).

Usage: ``python -m models.toy_edit.train --out /tmp/toy_edit [--steps 6000 --time-limit 240 --report r.json]``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from runner.core.paths import CONF_DIR

REPO = Path(__file__).resolve().parents[2]
TOY_SHAPES = REPO / "models/toy_shapes/weights"
WEIGHTS = REPO / "models/toy_edit/weights"
CONFIG = CONF_DIR / "model" / "toy_edit.yaml"  # conf/ in a checkout, runner/conf in a wheel
MAX_LEN = 16  # model.generation.max_sequence_length: instructions are at most 14 T5 tokens with the end token
SIZE = 64


def load_arch() -> dict:
    """The architecture of ``conf/model/toy_edit.yaml`` (the transformer's config; plain YAML, no interpolation in
    it, so no config library is needed)."""
    import yaml

    return yaml.safe_load(CONFIG.read_text())["architecture"]


def new_transformer(arch: dict):
    """A seeded, freshly initialised ``FluxTransformer2DModel`` of ``arch["transformer"]``."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(int(arch.get("weights_seed", 0)))
    return FluxTransformer2DModel(**arch["transformer"])


def kontext_pipeline(transformer, components: Path = TOY_SHAPES):
    """A ``FluxKontextPipeline`` of ``transformer`` and toy_shapes' VAE, text encoders, tokenizers and scheduler
    (fp32, frozen)."""
    from diffusers import FluxKontextPipeline, FluxPipeline

    src = FluxPipeline.from_pretrained(components, dtype=torch.float32, local_files_only=True)
    for m in (src.vae, src.text_encoder, src.text_encoder_2):
        m.requires_grad_(False).eval()
    return FluxKontextPipeline(scheduler=src.scheduler, vae=src.vae, text_encoder=src.text_encoder,
                               tokenizer=src.tokenizer, text_encoder_2=src.text_encoder_2, tokenizer_2=src.tokenizer_2,
                               transformer=transformer)


def load_pipeline(path: Path = WEIGHTS, dtype=torch.float32, device: str = "cpu"):
    """The shipped (or a saved) toy_edit pipeline through ``FluxKontextPipeline.from_pretrained``."""
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


COPIED = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")


def copy_components(out: Path, components: Path = TOY_SHAPES) -> None:
    """Replace the saved non-transformer folders of ``out`` by toy_shapes' own files, byte for byte (their tensors
    are toy_shapes' fp16 values already; this drops the configs' save-time noise such as ``_name_or_path``)."""
    import shutil

    for c in COPIED:
        shutil.rmtree(out / c, ignore_errors=True)
        shutil.copytree(components / c, out / c)


def to_tensor(images: Sequence[np.ndarray], device: str) -> torch.Tensor:
    """uint8 ``(H, W, 3)`` images as ``(n, 3, H, W)`` floats in [-1, 1] (what ``VaeImageProcessor.preprocess``
    makes of them)."""
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float().div(255.0)
    return (x * 2.0 - 1.0).to(device)


@torch.no_grad()
def encode_reference(pipe, x: torch.Tensor):
    """Packed reference tokens and the pipeline's ids, through ``FluxKontextPipeline.prepare_latents``: returns
    ``(image_latents (n, L, 16), img_ids (2L, 3))`` with ``img_ids`` = target ids then reference ids (first axis 1),
    as ``__call__`` concatenates them."""
    n, _, h, w = x.shape
    c = pipe.transformer.config.in_channels // 4
    _, image_latents, latent_ids, image_ids = pipe.prepare_latents(x, n, c, h, w, torch.float32, x.device)
    return image_latents, torch.cat([latent_ids, image_ids], dim=0)


@torch.no_grad()
def encode_target(pipe, x: torch.Tensor) -> torch.Tensor:
    """Packed, normalised target latents ``(n, L, 16)`` (the same encoding as the reference's)."""
    z = pipe._encode_vae_image(x, generator=None)
    return pipe._pack_latents(z, z.shape[0], z.shape[1], z.shape[2], z.shape[3])


def kontext_forward(transformer, x_t, ref, sigma, prompt_embeds, pooled, txt_ids, img_ids):
    """The prediction for ``x_t`` as ``FluxKontextPipeline`` computes it: reference tokens after the target's, the
    output cut to the target's tokens."""
    v = transformer(hidden_states=torch.cat([x_t, ref], dim=1), timestep=sigma, guidance=None,
                    pooled_projections=pooled, encoder_hidden_states=prompt_embeds, txt_ids=txt_ids, img_ids=img_ids,
                    return_dict=False)[0]
    return v[:, : x_t.shape[1]]


def mu_of(pipe, seq_len: int) -> float:
    """The pipeline's dynamic-shift ``mu`` for ``seq_len`` target tokens (``calculate_shift`` on its scheduler)."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import calculate_shift

    c = pipe.scheduler.config
    return calculate_shift(seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                           c.get("base_shift", 0.5), c.get("max_shift", 1.15))


def edit(pipe, prompts: List[str], images: List[np.ndarray], steps: int, seed: int = 1000,
         batch: int = 64) -> List[np.ndarray]:
    """Outputs of the real ``FluxKontextPipeline`` call for each (prompt, input image): uint8 ``(64, 64, 3)``.
    ``max_area`` = the image's area and ``_auto_resize=False`` keep 64x64 (the pipeline's defaults would resize the
    output to 1024^2 and the reference to a preferred Kontext resolution); one generator per row, seeded
    ``seed + row``."""
    from PIL import Image

    out: List[np.ndarray] = []
    for i in range(0, len(prompts), batch):
        p, im = prompts[i:i + batch], images[i:i + batch]
        gens = [torch.Generator("cpu").manual_seed(seed + i + j) for j in range(len(p))]
        res = pipe(image=[Image.fromarray(a) for a in im], prompt=p, height=SIZE, width=SIZE, max_area=SIZE * SIZE,
                   _auto_resize=False, num_inference_steps=steps, generator=gens, max_sequence_length=MAX_LEN,
                   output_type="np").images
        out += [np.clip(np.round(r * 255.0), 0, 255).astype(np.uint8) for r in res]
    return out


def evaluate(pipe, rows: List[dict], steps: int, images: Optional[Dict[str, np.ndarray]] = None,
             seed: int = 1000) -> Dict[str, object]:
    """The oracle's accuracy over ``rows`` (``data.builtin_rows`` style: prompt, input, expect) through ``edit``;
    input images from ``images`` by ``image`` name, else drawn from ``input``."""
    from models.toy_edit import data, oracle

    ins = [images[r["image"]] if images is not None else data.render(r["input"]) for r in rows]
    outs = edit(pipe, [r["prompt"] for r in rows], ins, steps, seed)
    got = [oracle.read(o) for o in outs]
    res = oracle.accuracy((g, r["prompt"], r["expect"]) for g, r in zip(got, rows))
    # the same outputs against what the input they were given implies (equal to ``expect`` unless swapped)
    implied = [data.apply(r["input"], *data.parse(r["prompt"])) for r in rows]
    if any(i != r["expect"] for i, r in zip(implied, rows)):
        res["vs_given_input"] = oracle.accuracy((g, r["prompt"], i) for g, r, i in zip(got, rows, implied))
    return res


def all_rows() -> List[dict]:
    """Every one of the 540 edits as a row (fixed size), in ``data.edits()`` order."""
    from models.toy_edit import data

    return [{"id": f"e{n:03d}", "prompt": data.instruction(a, v), "input": src, "expect": data.apply(src, a, v),
             "image": data.image_name(src)} for n, (src, a, v) in enumerate(data.edits())]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The training command line (``python -m models.toy_edit.train --help``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(WEIGHTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--pairs", type=int, default=40000, help="training pairs drawn (a pool resampled each step)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the training loop: at step 40 (timing steps 10-40) the step count (and its "
                        "schedule) is lowered once to fit; the report says so (steps_planned)")
    p.add_argument("--eval-steps", default="28,16,8", help="inference steps of the evaluations (first: the main)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the training forward (CUDA)")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--eval-rows", type=int, default=None, help="evaluate only the first N rows of each set (smoke)")
    p.add_argument("--report", default=None, help="write training/eval figures as JSON here")
    return p.parse_args(argv)


def encode_pairs(pipe, args: argparse.Namespace, device: str, report: dict) -> dict:
    """The edit pairs, encoded once with the pipeline's own encoders: ``{"ref", "x0", "ins", "pe", "pooled",
    "txt_ids", "img_ids", "mu"}`` (figures added to ``report``)."""
    from models.toy_edit import data

    t0 = time.time()
    srcs, tgts, ins = [], [], []
    index = {s: i for i, s in enumerate(data.instructions())}
    for a, b, ins_text, _, _ in data.pairs(args.pairs, seed=args.seed + 1):
        srcs.append(a)
        tgts.append(b)
        ins.append(index[ins_text])
    refs, x0s = [], []
    for i in range(0, len(srcs), 1024):
        ref, img_ids = encode_reference(pipe, to_tensor(srcs[i:i + 1024], device))
        refs.append(ref)
        x0s.append(encode_target(pipe, to_tensor(tgts[i:i + 1024], device)))
    ref_all, x0_all = torch.cat(refs), torch.cat(x0s)
    with torch.no_grad():
        pe, pooled, txt_ids = pipe.encode_prompt(prompt=data.instructions(), prompt_2=None, device=device,
                                                 max_sequence_length=MAX_LEN)
    n_tok = x0_all.shape[1]
    mu = mu_of(pipe, n_tok)
    report.update(pairs=len(srcs), data_s=time.time() - t0, tokens={"target": n_tok, "reference": ref_all.shape[1],
                                                                    "text": MAX_LEN}, mu=mu)
    print(f"data: {len(srcs)} pairs, {n_tok}+{ref_all.shape[1]} image tokens, mu {mu:.4f}, "
          f"{time.time() - t0:.1f}s", flush=True)
    return {"ref": ref_all, "x0": x0_all, "ins": torch.tensor(ins, device=device), "pe": pe.float(),
            "pooled": pooled.float(), "txt_ids": txt_ids, "img_ids": img_ids, "mu": mu}


def lr_schedule(lr: float, steps: int, warm: int, step: int) -> float:
    """Linear warm-up over ``warm`` steps, then cosine decay to 5 % of ``lr`` at ``steps``."""
    if step < warm:
        return lr * (step + 1) / warm
    f = (step - warm) / max(1, steps - warm)
    return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, f))))


def flow_step(tr, opt, enc: dict, args: argparse.Namespace, amp, device: str) -> torch.Tensor:
    """One rectified-flow step on a random batch of ``enc`` (noisy target | reference tokens); returns the loss."""
    idx = torch.randint(0, enc["ref"].shape[0], (args.batch,), device=device)
    x0, ref, ii = enc["x0"][idx], enc["ref"][idx], enc["ins"][idx]
    exp_mu = math.exp(enc["mu"])
    s = torch.sigmoid(torch.randn(args.batch, device=device))
    s = exp_mu / (exp_mu + (1 / s - 1))  # FLUX's time shift of a logit-normal sigma
    e = torch.randn_like(x0)
    xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * e
    with amp:
        v = kontext_forward(tr, xt, ref, s, enc["pe"][ii], enc["pooled"][ii], enc["txt_ids"], enc["img_ids"])
    loss = F.mse_loss(v.float(), e - x0)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
    opt.step()
    return loss


def train(tr, enc: dict, args: argparse.Namespace, device: str, report: dict):
    """The transformer trained by rectified flow (AdamW, warm-up + cosine, EMA 0.999); ``--time-limit`` lowers the
    step count once at step 40. Returns the EMA copy (figures added to ``report``)."""
    t0 = time.time()
    tr.train()
    ema = copy.deepcopy(tr).requires_grad_(False)
    opt = torch.optim.AdamW(tr.parameters(), lr=args.lr, weight_decay=0.01)
    steps, warm = args.steps, max(1, int(0.03 * args.steps))
    # fp32 (TF32 matmuls) by default: bf16 autocast hit CUBLAS_STATUS_EXECUTION_FAILED in the backward on the H200
    # (torch 2.11, batch 512), as toy_shapes' training keeps autocast off
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda" and args.bf16)
    step, losses, marks = 0, [], {}
    ema_params, train_params = list(ema.parameters()), list(tr.parameters())
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_schedule(args.lr, steps, warm, step)
        loss = flow_step(tr, opt, enc, args, amp, device)
        with torch.no_grad():
            d = min(0.999, (1 + step) / (10 + step))
            torch._foreach_lerp_(ema_params, train_params, 1 - d)
        losses.append(loss.item() if step % 50 == 0 or step == steps - 1 else None)
        step += 1
        if step in (10, 40) and args.time_limit:
            if device == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.time()
        if step == 40 and args.time_limit:
            per = (marks[40] - marks[10]) / 30
            fit = 40 + int((args.time_limit - (marks[40] - t0)) / per)
            if fit < steps:
                report["steps_planned"] = steps
                steps = max(min(60, steps), fit)
                warm = min(warm, max(1, int(0.03 * steps)))
            report["ms_per_step"] = per * 1000
            print(f"calibrated: {per * 1000:.1f} ms/step -> {steps} steps", flush=True)
        if step % 500 == 0 or step == steps:
            print(f"flow step {step} loss {loss.item():.5f} lr {lr_schedule(args.lr, steps, warm, step - 1):.2e} "
                  f"{time.time() - t0:.0f}s", flush=True)
    tail = [x for x in losses if x is not None][-10:]
    report.update(steps=steps, batch=args.batch, lr=args.lr, bf16_autocast=bool(args.bf16 and device == "cuda"),
                  flow_loss_last10=float(np.mean(tail)), flow_s=time.time() - t0, ema_decay=0.999)
    return ema


def evaluate_saved(out: Path, args: argparse.Namespace, device: str) -> dict:
    """The saved weights through FluxKontextPipeline with the oracle: the builtin rows and their swapped-input
    control at each ``--eval-steps``, all 540 edits at the first."""
    from models.toy_edit import data

    ev = load_pipeline(out, torch.float32, device)
    rows = data.builtin_rows()
    shipped = {r["image"]: data.load_image(r["image"]) for r in rows}
    full = all_rows()
    sw_rows, sw_full = data.swapped_rows(rows), data.swapped_rows(full)
    if args.eval_rows:
        rows, sw_rows, full, sw_full = (x[:args.eval_rows] for x in (rows, sw_rows, full, sw_full))
    ev_steps = [int(x) for x in args.eval_steps.split(",")]
    res: dict = {}
    for n_steps in ev_steps:
        res[f"builtin_{n_steps}_steps"] = evaluate(ev, rows, n_steps, shipped)
        res[f"builtin_swapped_{n_steps}_steps"] = evaluate(ev, sw_rows, n_steps, shipped)
    res[f"all540_{ev_steps[0]}_steps"] = evaluate(ev, full, ev_steps[0])
    res[f"all540_swapped_{ev_steps[0]}_steps"] = evaluate(ev, sw_full, ev_steps[0])
    return res


def main(argv: Optional[List[str]] = None) -> dict:
    """Train, save (fp16, the EMA weights, toy_shapes' other components copied) and evaluate; returns the report."""
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    arch = load_arch()
    tr = new_transformer(arch)
    pipe = kontext_pipeline(tr).to(device)
    pipe.set_progress_bar_config(disable=True)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "seed": args.seed,
                    "architecture": arch["transformer"], "components_from": "models/toy_shapes/weights",
                    "params": {"transformer": sum(x.numel() for x in tr.parameters())}}
    enc = encode_pairs(pipe, args, device, report)
    ema = train(tr, enc, args, device, report)
    pipe.register_modules(transformer=ema.eval())
    out = Path(args.out)
    pipe.to(torch.float16).save_pretrained(out, safe_serialization=True)
    copy_components(out)
    report["weights_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if not args.no_eval:
        t0 = time.time()
        report["eval_fp32"] = evaluate_saved(out, args, device)
        report["eval_s"] = time.time() - t0
    print(json.dumps(report, indent=1), flush=True)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
