"""Attention and linear backend parity on the FLUX transformer, and attention kernel throughput.

For every attention backend of the registry: refused (with the registry's reasons) or run through a
FLUX-architecture transformer (real width: hidden 3072, 24 heads x head_dim 128; depth reduced by
``--double``/``--single`` to keep the fp32 reference cheap) in bf16, and compared with the same weights run in
fp32 with TORCH_SDPA (TF32 off). FP8 linear is compared the same way. Max abs error is over the transformer's
output (packed latents, 1 x tokens x 64).

Second part: each attention kernel alone at the FLUX 1024^2 shape (B=1, H=24, S=4608, D=128, bf16): max abs error
vs fp32 SDPA and TFLOP/s (4*S^2*D*H flop per call; CUDA events, median of 20 after 5 warm-ups).

Usage: ``python benchmarks/backend_parity.py --out parity.json`` (CUDA; on CPU only TORCH_SDPA runs).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runner.kernels import attention as attn_impl  # noqa: E402
from runner.kernels import linear as lin_impl  # noqa: E402
from runner.kernels import registry as reg  # noqa: E402


def build_transformer(double: int, single: int, seed: int = 0):
    """FLUX.1-dev transformer config with reduced depth, random weights (seeded), fp32, on CPU."""
    from diffusers import FluxTransformer2DModel

    cfg = {  # FLUX.1-dev transformer (shared/reference/flux1_configs.json) with num_layers/num_single_layers reduced
        "patch_size": 1, "in_channels": 64, "num_layers": double, "num_single_layers": single,
        "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
        "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56], "guidance_embeds": True}
    torch.manual_seed(seed)
    return FluxTransformer2DModel(**cfg)


def inputs(device: str, dtype: torch.dtype, res: int = 1024, txt: int = 512, seed: int = 1):
    """Transformer inputs at ``res`` x ``res`` pixels: (res/16)^2 image tokens + ``txt`` text tokens."""
    g = torch.Generator().manual_seed(seed)
    n = (res // 16) ** 2
    side = res // 16
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    return dict(
        hidden_states=torch.randn(1, n, 64, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, txt, 4096, generator=g).to(device, dtype),
        pooled_projections=torch.randn(1, 768, generator=g).to(device, dtype),
        timestep=torch.tensor([0.5]).to(device, dtype),
        img_ids=img_ids.reshape(-1, 3).to(device, dtype),
        txt_ids=torch.zeros(txt, 3).to(device, dtype),
        guidance=torch.tensor([3.5]).to(device, dtype),
        return_dict=False,
    )


def sites(model):
    from diffusers.models.attention import AttentionModuleMixin

    return [("joint", n, m) for n, m in model.named_modules() if isinstance(m, AttentionModuleMixin)]


def model_parity(args, ctx, device):
    base = build_transformer(args.double, args.single)
    ref_model = copy.deepcopy(base).to(device)
    attn_impl.install("ref", sites(ref_model), {"joint": {"backend": "TORCH_SDPA"}})
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with torch.inference_mode():
        ref = ref_model(**inputs(device, torch.float32, args.res))[0].float()
    del ref_model
    results = {"reference": "fp32 TORCH_SDPA, TF32 off", "double_blocks": args.double, "single_blocks": args.single,
               "resolution": args.res, "ref_abs_mean": ref.abs().mean().item(), "attention": {}, "linear": {}}
    bf16 = copy.deepcopy(base).to(device, torch.bfloat16)
    x = inputs(device, torch.bfloat16, args.res)
    for name in reg.BACKENDS["attention"]:
        why = reg.get("attention", name).unmet(ctx)
        if why:
            results["attention"][name] = {"status": "refused", "reasons": why}
            continue
        m = copy.deepcopy(bf16)
        try:
            s = attn_impl.install("parity", sites(m), {"joint": {"backend": name}}, ctx.sm)
            with torch.inference_mode():
                out = m(**x)[0].float()
            observed = sorted({k for site in s for k in site.observed})
            err = (out - ref).abs()
            results["attention"][name] = {"status": "ran", "max_abs_err": err.max().item(),
                                          "mean_abs_err": err.mean().item(), "observed": observed}
        except Exception as e:  # report, do not hide
            results["attention"][name] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        del m
        torch.cuda.empty_cache() if device == "cuda" else None
    for lin in ("TORCH", "FP8"):
        why = reg.get("linear", lin).unmet(ctx)
        if why:
            results["linear"][lin] = {"status": "refused", "reasons": why}
            continue
        m = copy.deepcopy(bf16)
        attn_impl.install("parity", sites(m), {"joint": {"backend": "TORCH_SDPA"}}, ctx.sm)
        rec = lin_impl.install(m, lin)
        with torch.inference_mode():
            out = m(**x)[0].float()
        err = (out - ref).abs()
        results["linear"][lin] = {"status": "ran", "max_abs_err": err.max().item(), "mean_abs_err": err.mean().item(),
                                  "modules": rec.modules, "calls": rec.observed}
        del m
    return results


def kernel_bench(ctx, device):
    """Each attention kernel at the FLUX 1024^2 shape through diffusers' dispatcher (B, S, H, D layout)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    B, H, S, D = 1, 24, 4608, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(device) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    flop = 4 * S * S * D * H * B
    out = {}
    for name in reg.wired("attention", "diffusers"):
        if reg.get("attention", name).unmet(ctx):
            continue
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        try:
            dname, kernel = attn_impl.plan(name, ctx.sm)  # the record's wiring on this device
            fn = (lambda: kernel(qb, kb, vb)) if kernel is not None else (
                lambda: dispatch_attention_fn(qb, kb, vb, backend=dname))
            o = fn().float()
            times = []
            for i in range(25):
                s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s0.record(); fn(); s1.record(); torch.cuda.synchronize()
                if i >= 5:
                    times.append(s0.elapsed_time(s1))
            ms = statistics.median(times)
            out[name] = {"max_abs_err": (o - ref).abs().max().item(), "ms": ms, "tflops": flop / ms / 1e9}
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--double", type=int, default=2)
    p.add_argument("--single", type=int, default=4)
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--out", default="parity.json")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sm = None
    if device == "cuda":
        maj, mnr = torch.cuda.get_device_capability()
        sm = maj * 10 + mnr
    ctx = reg.SelectionContext(platform_kind="cuda" if device == "cuda" else "cpu", sm=sm, dtype=torch.bfloat16,
                               head_dim=128)
    res = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "sm": sm,
           "torch": torch.__version__, "model": model_parity(args, ctx, device)}
    if device == "cuda":
        res["kernels_flux_1024_shape"] = kernel_bench(ctx, device)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
