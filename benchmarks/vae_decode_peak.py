"""Peak memory of diffusers' ``AutoencoderKLWan.decode`` (0.42.1) with random weights, per VAE config and shape:
the allocator's peak above the weights and latents (the whole decode, and per decoder call as
``models.memory.PhasePeaks`` reads it), and, with ``--tensors``, the peak bytes of live tensor storages (a
``TorchDispatchMode``: what the allocator holds minus library workspaces such as cuDNN's).

Usage: ``python benchmarks/vae_decode_peak.py [--device cpu|cuda] [--out FILE]``. On the CPU (no allocator
statistics: the tensor storages only) small shapes, a batch of 2 with and without slicing, and tiling with a 64^2
tile (``benchmarks/results/vae_decode_peak_cpu_2026-12-06.json``, 2 cores, about 5 minutes); on a GPU the committed
observations' workloads, Wan 2.1 14B at 832x480x81 and Wan 2.2 TI2V-5B at 1280x704x121, plus a smaller size, a batch
of 2 with and without slicing, and tiling (not run yet: the session that wrote it had no device time left). Each row
carries the planner's estimate (``models.memory.decoder_activations``). Evidence for
``runner.core.memory.causal_decoder_activation``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

#: ``architecture.vae`` of conf/model/wan.yaml and conf/model/wan22_ti2v.yaml (latents_mean/std left out).
CONFS = {
    "wan": dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                temperal_downsample=[False, True, True]),
    "wan22_ti2v": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                       attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                       out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4),
}


def build(name, device, dtype=torch.bfloat16):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**CONFS[name]).to(device=device, dtype=dtype).eval()


def latent(vae, batch, frames, height, width, device):
    sf = 16 if vae.config.patch_size else 8
    return torch.randn(batch, vae.config.z_dim, (frames - 1) // 4 + 1, height // sf, width // sf,
                       dtype=torch.bfloat16, device=device)


def decode_peak(vae, z, slicing=False, tiling=False, tensors=False, tile=None):
    """``{"alloc": bytes, "per_call": bytes, "tensors": bytes}`` above what was allocated before the decode."""
    vae.enable_slicing() if slicing else vae.disable_slicing()
    if tiling:
        vae.enable_tiling(*((tile, tile, tile * 3 // 4, tile * 3 // 4) if tile else ()))
    else:
        vae.disable_tiling()
    cuda = z.is_cuda
    out = {}
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        calls = []
        h1 = vae.decoder.register_forward_pre_hook(lambda m, a: torch.cuda.reset_peak_memory_stats())
        h2 = vae.decoder.register_forward_hook(lambda m, a, o: calls.append(torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()
        peak = 0
        with torch.no_grad():
            # the whole decode: the max of the per-call peaks and what follows the last call
            y = vae.decode(z, return_dict=False)[0]
        torch.cuda.synchronize()
        h1.remove()
        h2.remove()
        peak = max(calls + [torch.cuda.max_memory_allocated()])
        out.update(alloc=peak - base, per_call=max(calls) - base, calls=len(calls), out_shape=list(y.shape),
                   out_bytes=y.numel() * y.element_size())
        del y
    if tensors or not cuda:
        ex = {p.untyped_storage().data_ptr() for p in list(vae.parameters()) + list(vae.buffers())}
        ex.add(z.untyped_storage().data_ptr())
        from runner.core.memory import LiveBytes

        m = LiveBytes(ex)
        with torch.no_grad(), m:
            y = vae.decode(z, return_dict=False)[0]
        out.update(tensors=m.peak, out_shape=list(y.shape), out_bytes=y.numel() * y.element_size())
        del y
    return out


CPU_CASES = [  # name, batch, frames, height, width, slicing, tiling (the tile, or 0 for none), tensors
    ("wan", 1, 9, 64, 64, False, 0, True),
    ("wan", 1, 13, 128, 64, False, 0, True),
    ("wan", 2, 9, 64, 64, False, 0, True),
    ("wan", 2, 9, 64, 64, True, 0, True),
    ("wan", 1, 5, 128, 128, False, 64, True),
    ("wan22_ti2v", 1, 9, 64, 64, False, 0, True),
    ("wan22_ti2v", 1, 9, 128, 128, False, 0, True),
    ("wan22_ti2v", 2, 9, 64, 64, False, 0, True),
    ("wan22_ti2v", 2, 9, 64, 64, True, 0, True),
    ("wan22_ti2v", 1, 5, 128, 128, False, 64, True),
]
GPU_CASES = [  # name, batch, frames, height, width, slicing, tiling, tensors
    ("wan", 1, 81, 480, 832, False, False, True),
    ("wan", 1, 81, 480, 832, False, False, False),
    ("wan", 1, 81, 240, 416, False, False, False),
    ("wan", 2, 81, 480, 832, False, False, False),
    ("wan", 2, 81, 480, 832, True, False, False),
    ("wan", 1, 81, 480, 832, False, True, False),
    ("wan22_ti2v", 1, 121, 704, 1280, False, False, True),
    ("wan22_ti2v", 1, 121, 704, 1280, False, False, False),
    ("wan22_ti2v", 1, 121, 352, 640, False, False, False),
    ("wan22_ti2v", 1, 121, 704, 1280, False, True, False),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows, vaes = [], {}
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from models.memory import decoder_activations

    for name, b, f, h, w, sl, ti, tens in (GPU_CASES if a.device == "cuda" else CPU_CASES):
        vae = vaes.get(name) or vaes.setdefault(name, build(name, a.device))
        z = latent(vae, b, f, h, w, a.device)
        t = time.time()
        tile = ti if not isinstance(ti, bool) and ti else None
        r = decode_peak(vae, z, sl, bool(ti), tens, tile)
        conf = dict(CONFS[name], **({"tile_sample_min_height": tile} if tile else {}))
        est = decoder_activations(conf, b, f, h, w, 2, bool(ti), sl)
        r.update(vae=name, batch=b, frames=f, height=h, width=w, slicing=sl, tiling=ti, estimate=est,
                 estimate_over_measured=round(est / r.get("alloc", r.get("tensors")), 3), s=round(time.time() - t, 2))
        rows.append(r)
        print(json.dumps(r), flush=True)
        del z
        if a.device == "cuda":
            torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
           "torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
           "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None, "rows": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
