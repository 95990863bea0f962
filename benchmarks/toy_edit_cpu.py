"""toy_edit on CPU: the shipped weights (models/toy_edit/weights) through FluxKontextPipeline (fp32) over the 60
builtin rows and their swapped-input control, scored by the toy_edit oracle.

Usage: python benchmarks/toy_edit_cpu.py [--steps 8] [--out benchmarks/results/toy_edit_cpu_2026-12-02.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from models.toy_edit import data
    from models.toy_edit.train import WEIGHTS, evaluate, load_pipeline

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    pipe = load_pipeline(WEIGHTS, torch.float32, "cpu")
    rows = data.builtin_rows()
    imgs = {r["image"]: data.load_image(r["image"]) for r in rows}
    out = {"device": "cpu", "threads": a.threads, "steps": a.steps, "dtype": "float32",
           "builtin": evaluate(pipe, rows, a.steps, imgs),
           "builtin_swapped": evaluate(pipe, data.swapped_rows(rows), a.steps, imgs), "s": time.time() - t0}
    print(json.dumps(out, indent=1))
    if a.out:
        open(a.out, "w").write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
