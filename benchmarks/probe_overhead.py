"""Cost of the evidence probes: the same pipeline with probes on and off, measured side by side in one process.

Two copies of the pipeline are loaded from the same snapshot; one gets the backends installed with call-site
probes (attention site markers, dispatcher observer, linear call counters, denoiser forward counter), the other
the same backends without probes. Runs alternate (on, off, on, off, ...) to cancel drift; the figure is the
ratio of median seconds per image, on/off (1.00 = free).

Usage: ``python benchmarks/probe_overhead.py [--model tiny_flux] [--repeats 7] [overrides...]``
The embedded tiny model is the worst case: the least compute per Python-level probe call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=flux model.load_format=dummy")
    args = p.parse_args()

    import hydra
    import torch

    from models.denoiser_evidence import DenoiserProbe
    from runner.app.checks import resolve_dtype
    from runner.app.stages import build_engines
    from runner.core.platform import detect
    from runner.core.schema import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    with hydra.initialize_config_dir(version_base="1.3", config_dir=conf):
        cfg = hydra.compose("config", overrides=args.overrides)
    plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
    dtype = resolve_dtype(cfg.dtype, plat.kind)
    g = cfg.model.generation
    from omegaconf import OmegaConf

    OmegaConf.update(cfg, "dataset.limit", cfg.batch_size)  # one batch of the configured dataset
    adapters = {}
    for mode in ("on", "off"):
        OmegaConf.update(cfg, "evidence.enabled", mode == "on")
        a = build_engines(cfg, args.overrides, plat, dtype)[-1]  # the engine as the run loop drives it
        a.prepare()
        batch = a.items(a.read_rows()[0], cfg.seed)
        a.load()
        if mode == "on":
            DenoiserProbe(a.denoiser, profile=False, device_kind=plat.kind)
        a.generate(batch)  # warm-up
        adapters[mode] = a
    times = {"on": [], "off": []}
    for _ in range(args.repeats):
        for mode in ("on", "off"):
            if plat.kind in ("cuda", "rocm"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            adapters[mode].generate(batch)
            if plat.kind in ("cuda", "rocm"):
                torch.cuda.synchronize()
            times[mode].append((time.perf_counter() - t0) / len(batch))
    med = {m: statistics.median(t) for m, t in times.items()}
    result = {"model": cfg.model.name, "device": plat.device, "batch": len(batch),
              "steps": g.num_inference_steps, "repeats": args.repeats,
              "s_per_image_median": med, "ratio_on_over_off": med["on"] / med["off"],
              "policy": "1 warm-up per mode, then alternating on/off runs; median seconds per image"}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
