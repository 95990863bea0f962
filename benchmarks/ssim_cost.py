"""What one SSIM of a 1024x1024 RGB pair costs on this machine: the runner's (``runner.tools.report.ssim``, the gate's
and the report's one implementation, torchmetrics in float32) beside torchmetrics in float64 (what it computed before
2026-12-06), side by side in one process, with the difference of the two values.

torchmetrics filters the five local-statistics maps with one grouped convolution, for which torch has no fast CPU
kernel in float64: 16 FLUX.1-dev images of ``benchmarks/memory_lanes.py``'s int8wo lane spent over 2 minutes in
their SSIM on the H200 host (its ``[t=...]`` stamps), and a gate over 1,000 such items would take hours.

    python benchmarks/ssim_cost.py [--size 1024] [--repeat 3] [--results out.json]

Prints seconds per pair (median of ``--repeat``, after one untimed call) for each, their ratio, and ``|float32 - float64|``; ``--results``
also writes them as JSON (``benchmarks/results/ssim_cost_cpu_<date>.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def float64_ssim(a: np.ndarray, b: np.ndarray) -> float:
    """torchmetrics' SSIM of two (H, W, 3) uint8 images in float64, with the runner's settings (Gaussian 11,
    sigma 1.5, data range 255)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    x, y = (torch.from_numpy(np.asarray(v, dtype=np.float64))[None].permute(0, 3, 1, 2) for v in (a, b))
    return float(structural_similarity_index_measure(x, y, kernel_size=11, sigma=1.5, data_range=255.0))


def timed(fn, repeat: int) -> tuple:
    """``(median seconds, value)`` of ``fn()`` over ``repeat`` calls after one untimed call (the first pays the
    imports and oneDNN's set-up: ~3 s)."""
    times, value = [], fn()
    for _ in range(repeat):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def main() -> int:
    from runner.tools.report import ssim

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--results", default=None)
    a = ap.parse_args()
    rng = np.random.default_rng(0)  # an image and a lossy copy of it (noise of +-6 levels)
    x = rng.integers(0, 256, (a.size, a.size, 3)).astype(np.uint8)
    y = np.clip(x.astype(np.int16) + rng.integers(-6, 7, x.shape), 0, 255).astype(np.uint8)
    s32, v32 = timed(lambda: ssim(x, y), a.repeat)
    s64, v64 = timed(lambda: float64_ssim(x, y), a.repeat)
    doc = {"size": [a.size, a.size, 3], "threads": torch.get_num_threads(), "torch": torch.__version__,
           "runner_ssim_s": round(s32, 4), "float64_ssim_s": round(s64, 4), "float64_over_runner": round(s64 / s32, 1),
           "runner_ssim": v32, "float64_ssim": v64, "abs_diff": abs(v32 - v64)}
    print(json.dumps(doc, indent=1))
    if a.results:
        Path(a.results).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
