"""Peak memory of diffusers' video VAE decoders (0.42.1) with random weights, per VAE config and shape:
``AutoencoderKLWan.decode`` (Wan 2.1, Wan 2.2 TI2V-5B), ``AutoencoderKLLTX2Video.decode`` (LTX-2) and
``AutoencoderKLHunyuanVideo15.decode`` (HunyuanVideo-1.5): the allocator's peak above the weights and latents (the
whole decode, and per decoder call as ``models.memory.PhasePeaks`` reads it), and, with ``--tensors``, the peak bytes
of live tensor storages (a ``TorchDispatchMode``: what the allocator holds minus library workspaces such as cuDNN's).

Usage: ``python benchmarks/vae_decode_peak.py [--device cpu|cuda] [--family wan|ltx2|hunyuanvideo15 ...] [--out
FILE]``. On the CPU (no allocator statistics: the tensor storages only) small shapes, a batch of 2 with and without
slicing, and tiling with small tiles (``benchmarks/results/vae_decode_peak_cpu_2026-12-06.json``: Wan, 2 cores, about
5 minutes; ``benchmarks/results/vae_decode_peak_cpu_ltx2_hunyuan_2026-12-06.json``: LTX-2 and HunyuanVideo-1.5 with
their full-size configs, ``--family ltx2 --family hunyuanvideo15``); on a GPU the committed observations' workloads,
Wan 2.1 14B at 832x480x81 and Wan 2.2 TI2V-5B at 1280x704x121, LTX-2 at 768x512x121 and HunyuanVideo-1.5 at
848x480x121 (the models' defaults), plus smaller sizes, a batch of 2 with and without slicing, and tiling (not run
yet when the rule was set: no device time; a device without diffusers needs its 0.42.1 wheel installed first).
A decode that fails is a row with its ``error`` (HunyuanVideo-1.5 unsliced at batch 2 fails in diffusers 0.42.1; its
untiled 848x480x121 is planned at 83.4 GiB of activations, past an 80 GB H100). Each row carries the planner's
estimate (``models.memory.decoder_activations``); the JSON records its ``command``. Evidence for
``runner.core.memory.causal_decoder_activation``, ``ltx2_decoder_activation`` and ``hunyuan15_decoder_activation``.
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


#: The VAE class of each config name (``models/<family>.py``'s component).
CLASSES = {"wan": "AutoencoderKLWan", "wan22_ti2v": "AutoencoderKLWan", "ltx2": "AutoencoderKLLTX2Video",
           "hunyuanvideo15": "AutoencoderKLHunyuanVideo15"}


def model_vae_conf(model):
    """``architecture.vae`` of ``conf/model/<model>.yaml`` (the full-size published config)."""
    import yaml

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "conf", "model", f"{model}.yaml")
    with open(path) as fh:
        conf = yaml.safe_load(fh)["architecture"]["vae"]
    return {k: v for k, v in conf.items() if k not in ("latents_mean", "latents_std")}


def conf_of(name):
    return CONFS[name] if name in CONFS else model_vae_conf(name)


def build(name, device, dtype=torch.bfloat16):
    """The VAE with random weights; LTX-2's and HunyuanVideo-1.5's without their encoder (their decode never runs
    it; Wan's ``clear_cache`` counts the encoder's convs)."""
    import diffusers

    torch.manual_seed(0)
    vae = getattr(diffusers, CLASSES[name])(**conf_of(name))
    if CLASSES[name] != "AutoencoderKLWan":
        vae.encoder = None
    return vae.to(device=device, dtype=dtype).eval()


def ratios(vae):
    """``(spatial, temporal)`` compression: pixels and frames per latent one."""
    if hasattr(vae, "spatial_compression_ratio"):
        return int(vae.spatial_compression_ratio), int(vae.temporal_compression_ratio)
    return (16 if vae.config.patch_size else 8), 4


def latent(vae, batch, frames, height, width, device):
    sf, tf = ratios(vae)
    ch = vae.config.z_dim if hasattr(vae.config, "z_dim") else vae.config.latent_channels
    return torch.randn(batch, ch, (frames - 1) // tf + 1, height // sf, width // sf, dtype=torch.bfloat16,
                       device=device)


def enable_tiling(vae, tile=None):
    """``vae.enable_tiling()``, with a smaller ``tile`` (pixels) where given: Wan's and LTX-2's step 3/4 and 7/8
    and 1/2 of it, HunyuanVideo-1.5's latent tile set to match (its ``enable_tiling`` keeps the latent one
    otherwise)."""
    cls = type(vae).__name__
    if not tile:
        vae.enable_tiling()
    elif cls == "AutoencoderKLLTX2Video":
        vae.enable_tiling(tile_sample_min_height=tile, tile_sample_min_width=tile, tile_sample_stride_height=tile // 2,
                          tile_sample_stride_width=tile // 2)
    elif cls == "AutoencoderKLHunyuanVideo15":
        sf = ratios(vae)[0]
        vae.enable_tiling(tile, tile, tile // sf, tile // sf)
    else:
        vae.enable_tiling(tile, tile, tile * 3 // 4, tile * 3 // 4)


def decode_peak(vae, z, slicing=False, tiling=False, tensors=False, tile=None):
    """``{"alloc": bytes, "per_call": bytes, "tensors": bytes}`` above what was allocated before the decode."""
    vae.enable_slicing() if slicing else vae.disable_slicing()
    if tiling:
        enable_tiling(vae, tile)
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
    ("ltx2", 1, 9, 64, 64, False, 0, True),  # 2 x 2 x 2 latents (32x spatial, 8x temporal)
    ("ltx2", 1, 9, 128, 64, False, 0, True),
    ("ltx2", 1, 17, 64, 64, False, 0, True),
    ("ltx2", 1, 9, 128, 128, False, 0, True),
    ("ltx2", 2, 9, 64, 64, False, 0, True),
    ("ltx2", 2, 9, 64, 64, True, 0, True),
    ("ltx2", 1, 9, 192, 192, False, 128, True),  # 128^2 tiles every 64 (a tile of 1 latent fails: reflect pad)
    ("hunyuanvideo15", 1, 9, 64, 64, False, 0, True),  # 3 x 4 x 4 latents (16x spatial, 4x temporal)
    ("hunyuanvideo15", 1, 9, 128, 64, False, 0, True),
    ("hunyuanvideo15", 1, 13, 64, 64, False, 0, True),
    ("hunyuanvideo15", 2, 9, 64, 64, False, 0, True),  # fails in diffusers 0.42.1 (the attention mask's batch)
    ("hunyuanvideo15", 2, 9, 64, 64, True, 0, True),
    ("hunyuanvideo15", 1, 9, 128, 128, False, 64, True),
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
    ("ltx2", 1, 121, 512, 768, False, False, True),
    ("ltx2", 2, 121, 512, 768, False, False, False),
    ("ltx2", 2, 121, 512, 768, True, False, False),
    ("ltx2", 1, 121, 512, 768, False, True, False),
    ("hunyuanvideo15", 1, 33, 480, 848, False, False, True),
    ("hunyuanvideo15", 1, 61, 480, 848, False, False, False),
    ("hunyuanvideo15", 1, 121, 480, 848, False, True, False),
    ("hunyuanvideo15", 1, 121, 480, 848, False, False, False),  # about 83 GiB: past an 80 GB H100
]


def case_row(vaes, case, device):
    """One case measured, with the planner's estimate; a decode that fails (out of memory, diffusers' own error)
    is a row with its ``error``."""
    from models.memory import decoder_activations

    name, b, f, h, w, sl, ti, tens = case
    vae = vaes.get(name) or vaes.setdefault(name, build(name, device))
    z = latent(vae, b, f, h, w, device)
    t = time.time()
    tile = ti if not isinstance(ti, bool) and ti else None
    r = dict(vae=name, batch=b, frames=f, height=h, width=w, slicing=sl, tiling=ti)
    try:
        r.update(decode_peak(vae, z, sl, bool(ti), tens, tile))
    except (RuntimeError, torch.OutOfMemoryError) as e:
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    over = {"tile_sample_min_height": tile, "tile_sample_stride_height": tile // 2} if tile else {}
    est = decoder_activations(dict(conf_of(name), **over), b, f, h, w, 2, bool(ti), sl, CLASSES[name])
    measured = r.get("alloc", r.get("tensors"))
    r.update(estimate=est, estimate_over_measured=round(est / measured, 3) if measured else None,
             s=round(time.time() - t, 2))
    del z
    if device == "cuda":
        torch.cuda.empty_cache()
    return r


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--family", action="append", default=None,
                    help="wan (both Wan VAEs), ltx2, hunyuanvideo15; repeatable (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows, vaes = [], {}
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    fams = set(a.family or ("wan", "ltx2", "hunyuanvideo15"))
    for case in (GPU_CASES if a.device == "cuda" else CPU_CASES):
        if ("wan" if CLASSES[case[0]] == "AutoencoderKLWan" else case[0]) not in fams:
            continue
        rows.append(case_row(vaes, case, a.device))
        print(json.dumps(rows[-1]), flush=True)
    res = {"command": "python " + " ".join([os.path.relpath(__file__)] + list(argv if argv is not None
                                                                              else sys.argv[1:])),
           "device": torch.cuda.get_device_name(0) if a.device == "cuda" else a.device,
           "torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
           "cudnn": torch.backends.cudnn.version() if a.device == "cuda" else None, "rows": rows}
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
