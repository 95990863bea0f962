"""``speedup_decode_wan`` (issue #41): the runner's Wan video decode path against diffusers' decode, on Wan 2.1 /
2.2 A14B's VAE (``AutoencoderKLWan``, ``conf/model/wan22.yaml``'s ``architecture.vae``, random weights seeded 0) at
480p and 81 frames (latents [1, 16, 21, 60, 104], seeded), in the dtype the runner's Wan engine gives the VAE (the
run's dtype: ``dtype=auto`` is bfloat16 on a GPU, float32 on the CPU; ``models/pipelines.py`` builds every
component in it).

Two lanes, each from the latents to the ``uint8`` frames (F, H, W, 3) on the host that the MP4 sink encodes:

* ``diffusers``: ``vae.decode`` + ``VideoProcessor.postprocess_video(output_type="np")`` (what ``WanPipeline``
  does with the runner's ``output_type="np"``), then what the runner does with those float32 frames today: the sink's
  non-finite count (``models.base.VideoOutput.nonfinite``) and ``runner.core.video.to_uint8_frames``, on the host;
* ``runner``: ``vae.decode`` with ``models.video_decode.install`` (the bit-identical decoder forwards), then
  ``models.video_decode.video_uint8`` (diffusers' ``postprocess_video(output_type="pt")``, the non-finite count and
  the runner's uint8 rule on the device) and one copy of the ``uint8`` frames to the host.

Printed and written (``--out``, rewritten as each part finishes, so a killed run leaves what it measured): median
ms of each lane and of ``vae.decode`` alone with and without the patch (CUDA events, ``--warmup`` untimed calls,
``--iters`` timed ones), ``speedup_decode_wan`` (diffusers over runner) and ``speedup_vae_decode`` (the decoder
alone), ``after_decode_ms`` (each lane's ms past its decoder: the way to host ``uint8`` frames), the
``frames_sha256`` of both lanes' frames and ``bit_identical`` (equal for every item), whether the decoder's raw
outputs are equal, whether two plain decodes are (the check means nothing if they are not), and the share of
saturated bytes (0 or 255: a comparison of all-saturated frames would prove little).

    source .whl/env.sh && python benchmarks/decode_wan_h200.py --channels-last --out decode_wan_h200.json
    python benchmarks/decode_wan_h200.py --smoke --out /tmp/decode_smoke.json    # tiny shapes on the CPU

``--channels-last`` adds ``vae_decode_channels_last``: the patched decoder in ``channels_last_3d``, reported with
whether its output equals the plain decode (a lossy lane where it does not).

``--smoke``: ``conf/model/tiny_wan22.yaml``'s VAE, latents [1, 16, 3, 4, 6] (9 frames of 32 x 48), float32, on the
CPU. ``--perturb``: the runner lane decodes the latents plus 0.01, a deliberately different decode that must be
reported as not bit-identical (the self-check ``tests/test_video_decode.py`` runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import time_ms  # noqa: E402

#: Latents of Wan 480p x 81 frames: (81 - 1) / 4 + 1 latent frames, 480 / 8 x 832 / 8.
FULL_LATENTS = (1, 16, 21, 60, 104)
SMOKE_LATENTS = (1, 16, 3, 4, 6)


def vae_conf(model: str) -> Dict[str, Any]:
    """``architecture.vae`` of ``conf/model/<model>.yaml``."""
    import yaml

    return dict(yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["architecture"]["vae"])


def build(conf: Dict[str, Any], device: str, dtype: torch.dtype) -> Any:
    """``AutoencoderKLWan(**conf)`` with its seeded random initialisation, in ``dtype`` on ``device``, eval."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**conf).to(device=device, dtype=dtype).eval()


def diffusers_lane(vae: Any, processor: Any, z: torch.Tensor) -> Tuple[List[np.ndarray], List[int]]:
    """Latents -> host ``uint8`` frames per item and non-finite counts, as diffusers then the runner's sink do."""
    from models.base import VideoOutput
    from runner.core.video import to_uint8_frames

    with torch.inference_mode():
        frames = processor.postprocess_video(vae.decode(z).sample, output_type="np")
    arrays = [np.asarray(a, dtype=np.float32) for a in frames]
    bad = [VideoOutput(frames=a, fps=16).nonfinite() for a in arrays]
    return [to_uint8_frames(a) for a in arrays], bad


def runner_lane(vae: Any, processor: Any, z: torch.Tensor) -> Tuple[List[np.ndarray], List[int]]:
    """Latents -> host ``uint8`` frames per item and non-finite counts through ``models.video_decode``
    (the patch must be installed on ``vae``)."""
    from models.video_decode import video_uint8

    with torch.inference_mode():
        frames, bad = video_uint8(vae.decode(z).sample, processor)
    host = frames.cpu().numpy()
    return [host[i] for i in range(host.shape[0])], [int(b) for b in bad.cpu()]


def decode_only(vae: Any, z: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return vae.decode(z).sample


def timed(doc: Dict[str, Any], key: str, fn: Callable[[], Any], args: Any, save: Callable[[], None]) -> None:
    doc["ms"][key] = round(time_ms(fn, args.device, args.warmup, args.iters), 2)
    print(f"{key}: {doc['ms'][key]} ms", flush=True)
    save()


def compare(doc: Dict[str, Any], vae: Any, processor: Any, z: torch.Tensor, zc: torch.Tensor) -> torch.Tensor:
    """The equality checks: lanes' frames (``frames_sha256``), raw decoder outputs, two plain decodes; returns the
    plain decode."""
    from models import video_decode
    from runner.core.video import frames_sha256

    plain = decode_only(vae, z)
    again = decode_only(vae, z)
    base, base_bad = diffusers_lane(vae, processor, z)
    doc["patch"] = video_decode.install(vae)
    exact = decode_only(vae, zc)
    ours, ours_bad = runner_lane(vae, processor, zc)
    video_decode.uninstall(vae)
    sha_base, sha_ours = [frames_sha256(a) for a in base], [frames_sha256(a) for a in ours]
    u8 = np.stack(base)
    doc["check"] = {
        "plain_repeatable": bool(torch.equal(plain, again)),
        "decoder_output_identical": bool(torch.equal(plain, exact)),
        "frames_sha256": {"diffusers": sha_base, "runner": sha_ours},
        "nonfinite": {"diffusers": base_bad, "runner": ours_bad},
        "saturated_fraction": round(float(((u8 == 0) | (u8 == 255)).mean()), 6),
        "frames_shape": list(u8.shape[1:])}
    doc["bit_identical"] = sha_base == sha_ours and base_bad == ours_bad
    print(f"bit_identical: {doc['bit_identical']}  {json.dumps(doc['check'])}", flush=True)
    return plain


def channels_last_lane(doc: Dict[str, Any], vae: Any, z: torch.Tensor, plain: torch.Tensor, args: Any,
                       save: Callable[[], None]) -> None:
    """``--channels-last``: the patched decoder with its 5-D weights and the latents in ``channels_last_3d`` (the
    layout cuDNN computes in), timed, and whether its output still equals the plain decode: a different layout may
    reduce in another order (the RMS norm's channel sum, the convolution's algorithm), so it is a lossy lane unless
    ``check.channels_last_output_identical`` says otherwise on that GPU."""
    from models import video_decode

    for p in vae.parameters():
        if p.dim() == 5:
            p.data = p.data.contiguous(memory_format=torch.channels_last_3d)
    zl = z.contiguous(memory_format=torch.channels_last_3d)
    video_decode.install(vae)
    doc["check"]["channels_last_output_identical"] = bool(torch.equal(plain, decode_only(vae, zl)))
    save()
    timed(doc, "vae_decode_channels_last", lambda: decode_only(vae, zl), args, save)
    video_decode.uninstall(vae)
    doc["speedup_vae_decode_channels_last"] = round(doc["ms"]["vae_decode_plain"] /
                                                    doc["ms"]["vae_decode_channels_last"], 3)


def main(argv: Any = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON written as each part finishes")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda when available (never with --smoke), else cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu (dtype=auto)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per part (default 1; smoke 0)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per part, median (default 3; smoke 1)")
    ap.add_argument("--perturb", action="store_true", help="the runner lane decodes latents + 0.01 (self-check)")
    ap.add_argument("--channels-last", action="store_true",
                    help="also time the patched decoder in channels_last_3d (a lossy lane unless its output is equal)")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    args.warmup = (0 if args.smoke else 1) if args.warmup is None else args.warmup
    args.iters = (1 if args.smoke else 3) if args.iters is None else args.iters
    import diffusers
    from diffusers.video_processor import VideoProcessor

    from models import video_decode

    model = "tiny_wan22" if args.smoke else "wan22"
    conf, shape = vae_conf(model), SMOKE_LATENTS if args.smoke else FULL_LATENTS
    doc: Dict[str, Any] = {
        "benchmark": "decode_wan", "command": " ".join(["python", "benchmarks/decode_wan_h200.py",
                                                   *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "smoke": args.smoke,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__, "diffusers": diffusers.__version__, "dtype": str(dtype).replace("torch.", ""),
        "cudnn": torch.backends.cudnn.version() if args.device.startswith("cuda") else None,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark), "vae": {"config": f"conf/model/{model}.yaml",
                                                                        **conf},
        "latents": list(shape), "warmup": args.warmup, "iters": args.iters, "perturbed": args.perturb, "ms": {}}

    def save() -> None:
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=2) + "\n")

    t0 = time.perf_counter()
    vae = build(conf, args.device, dtype)
    processor = VideoProcessor(vae_scale_factor=vae.spatial_compression_ratio)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(args.device, dtype)
    zc = z + 0.01 if args.perturb else z
    plain = compare(doc, vae, processor, z, zc)
    save()
    timed(doc, "vae_decode_plain", lambda: decode_only(vae, z), args, save)
    timed(doc, "diffusers", lambda: diffusers_lane(vae, processor, z), args, save)
    video_decode.install(vae)
    timed(doc, "vae_decode_exact", lambda: decode_only(vae, zc), args, save)
    timed(doc, "runner", lambda: runner_lane(vae, processor, zc), args, save)
    video_decode.uninstall(vae)
    ms = doc["ms"]
    doc["speedup_decode_wan"] = round(ms["diffusers"] / ms["runner"], 3)
    doc["speedup_vae_decode"] = round(ms["vae_decode_plain"] / ms["vae_decode_exact"], 3)
    # what each lane spends past the decoder: to host uint8 frames (diffusers: on the host; runner: on the device)
    doc["after_decode_ms"] = {"diffusers": round(ms["diffusers"] - ms["vae_decode_plain"], 2),
                              "runner": round(ms["runner"] - ms["vae_decode_exact"], 2)}
    save()
    if args.channels_last:
        channels_last_lane(doc, vae, z, plain, args, save)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"speedup_decode_wan: {doc['speedup_decode_wan']}  speedup_vae_decode: {doc['speedup_vae_decode']}  "
          f"bit_identical: {doc['bit_identical']}", flush=True)
    return doc


if __name__ == "__main__":
    main()
