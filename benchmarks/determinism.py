"""Are the runner's artifacts a function of (weights, row, seed) alone? Checks, in one process:

* weights: the ``load_format=dummy`` builder run on every visible GPU (and twice on the first) gives bitwise equal
  parameters (float64 sum and sum of squares of every parameter, per component);
* run-to-run: the same rows twice (``A`` and ``B``) give the same PNG bytes;
* batch peers: the first row generated with other rows in its batch (``C``) gives the same bytes as in ``A``.

Usage: ``python benchmarks/determinism.py --out DIR [--prompts 4] [overrides ...]`` (default overrides:
``experiment=flux_dev_h200``). Writes ``DIR/determinism.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def checksums(arch, device, dtype):
    import torch

    from models.flux import build_components

    comps = build_components(arch, device=device, dtype=dtype)
    out = {}
    for k in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        s = s2 = 0.0
        for p in comps[k].parameters():
            x = p.detach().double()
            s += float(x.sum())
            s2 += float((x * x).sum())
        out[k] = [s, s2]
    del comps
    torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--sets", default="A,B,C,D", help="which runs (A, B: the same rows; C: row 0 with other peers; "
                   "D: row 0 at position 1)")
    p.add_argument("--no-weights", action="store_true", help="skip the weight checksums")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    import torch
    from omegaconf import OmegaConf

    from common import prompt_rows, write_jsonl
    from flux_dev_1024 import compose, free
    from runner.app import execute

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ov = args.overrides or ["experiment=flux_dev_h200"]
    rows = prompt_rows(2 * args.prompts)
    res = {"overrides": ov}
    cfg = compose(ov)
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    devs = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"]
    if not args.no_weights:
        sums = {d: checksums(arch, d, dtype) for d in devs}
        sums[devs[0] + " again"] = checksums(arch, devs[0], dtype)
        first = sums[devs[0]]
        res["weights_equal"] = {d: s == first for d, s in sums.items()}
        res["weights_checksums"] = sums
        print(json.dumps(res["weights_equal"]), flush=True)
    sets = {"A": rows[:args.prompts], "B": rows[:args.prompts], "C": [rows[0]] + rows[args.prompts:2 * args.prompts - 1],
            "D": [rows[args.prompts], rows[0]] + rows[args.prompts + 1:2 * args.prompts - 1]}
    sets = {k: v for k, v in sets.items() if k in args.sets.split(",")}
    shas = {}
    for name, rs in sets.items():
        free(devs[0])
        f = write_jsonl(out / f"{name}.jsonl", rs)
        o = ov + ["dataset=jsonl", f"dataset.path={f}", f"batch_size={args.prompts}"]
        execute.run(compose(o), out / name, o)
        shas[name] = {r["key"]: r.get("file_sha256") for r in map(json.loads, (out / name / "items.jsonl").read_text()
                                                                   .splitlines())}
        print(name, shas[name], flush=True)
    from runner.tools.report import load_rgb, psnr

    k0 = rows[0]["id"]

    def cmp(a: str, b: str, keys) -> dict:
        return {k: {"identical": shas[a][k] == shas[b][k],
                    "psnr_db": round(psnr(load_rgb(out / a / "images" / f"{k}.png"),
                                          load_rgb(out / b / "images" / f"{k}.png")), 2)} for k in keys}

    res["shas"] = shas
    if "B" in shas:
        res["run_to_run_A_vs_B"] = cmp("A", "B", shas["A"])
    if "C" in shas:
        res["row0_other_peers_same_position_A_vs_C"] = cmp("A", "C", [k0])
    if "D" in shas:
        res["row0_position_1_A_vs_D"] = cmp("A", "D", [k0])
    (out / "determinism.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("weights_checksums",)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
