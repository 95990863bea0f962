"""Helpers shared by the benchmark scripts: timing and the prompt rows of the canonical workloads."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent


def time_ms(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    """Median milliseconds per call of ``fn`` after ``warmup`` untimed calls (CUDA events on CUDA devices,
    ``time.perf_counter`` elsewhere)."""
    import torch

    for _ in range(warmup):
        fn()
    times: List[float] = []
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def prompt_rows(n: int) -> List[Dict[str, str]]:
    """``n`` dataset rows ``{"id": "p00", "prompt": ...}`` cycling through the built-in FLUX prompts
    (``runner/data/prompts.jsonl``), every row at the model's default size."""
    builtin = [json.loads(x) for x in (ROOT / "runner" / "data" / "prompts.jsonl").read_text().splitlines() if x]
    return [{"id": f"p{i:02d}", "prompt": builtin[i % len(builtin)]["prompt"]} for i in range(n)]


def write_jsonl(path: Path, rows: List[Dict[str, Any]]) -> Path:
    """Write ``rows`` as JSON lines to ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
