"""LoRA lanes (issue #32 part A): the cost of a fused adapter and of per-row adapter switching, through the runner.

Variants, all ``runner.app.execute.run`` on FLUX.1-dev's architecture (``model=flux model.load_format=dummy``, bf16,
1024x1024, ``--steps`` steps, the same rows and seeds; compile off so the evidence hooks observe the LoRA branches):

* ``base``: no adapter;
* ``fused``: one rank-``--rank`` adapter on every attention projection (``to_q/to_k/to_v/to_out.0`` of the 19 double
  and ``to_q/to_k/to_v`` of the 38 single blocks; random seeded weights saved as a diffusers LoRA file), fused at load
  (``model.lora_fuse=auto``: one adapter set);
* ``one_unfused``: the same adapter, unfused (``model.lora_fuse=unfused``): the per-row lane with a single set;
* ``per_row``: two such adapters, rows alternating between them in batches of ``--batch`` (``lora`` row field),
  switched with ``set_adapters`` between batches.

Figures: per variant the median seconds per image over the items after the first batch (``items.jsonl``
``timing.generate_s``; the first batch carries CUDA/cuDNN start-up), and

* ``lora_fused_overhead = fused / base - 1`` (target <= 0.01),
* ``lora_per_row_overhead = per_row / one_unfused - 1`` (target <= 0.05: switching against a one-adapter run on the
  same unfused path).

Usage: ``python benchmarks/lora_lanes.py --out DIR`` (one H200: about 3 minutes, 4 runs of 5 images at 20 steps
plus building the dummy weights each time; the overheads are per-step ratios, so fewer steps than FLUX's 28 change
no figure); ``--smoke`` runs toy_shapes on the CPU (seconds) to check the script. Results:
``DIR/lora_lanes.json``, and the two keys merged into ``--results`` (default
``benchmarks/results/memory_lanes_h200.json``; not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from common import prompt_rows, write_jsonl  # noqa: E402

TARGETS = {"lora_fused_overhead": 0.01, "lora_per_row_overhead": 0.05}
PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def compose(overrides: List[str]) -> Any:
    """The run config exactly as ``python -m runner <overrides>`` composes it."""
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="bench"):
        return hydra.compose("config", overrides=overrides)


def write_adapter(path: Path, model: List[str], rank: int, seed: int) -> Path:
    """A random LoRA (``lora_A`` ~ N(0, 1/in), ``lora_B`` ~ N(0, 1e-4)) in diffusers naming on every attention
    projection of the model's transformer (its Linears from the meta-device build, ``models.lora.base_linears``)."""
    from safetensors.torch import save_file

    from models.lora import base_linears

    cfg = compose(model)
    linears = base_linears("FluxTransformer2DModel", dict(cfg.model.architecture.transformer))
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out_f, in_f) in linears.items():
        if name.rsplit(".", 1)[-1] in PROJECTIONS[:3] or name.endswith(PROJECTIONS[3]):
            sd[f"transformer.{name}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) / in_f ** 0.5).bfloat16()
            sd[f"transformer.{name}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 1e-2).bfloat16()
    save_file(sd, str(path), metadata={"format": "pt"})
    return path


def run_variant(name: str, overrides: List[str], out: Path, batch: int) -> Dict[str, Any]:
    """One runner run; the median seconds per image after the first batch, the LoRA evidence and the exit code."""
    from runner.app import execute

    run_dir = out / name
    cfg = compose(overrides)
    code = execute.run(cfg, run_dir, overrides)
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    per = [it["timing"]["generate_s"] for it in items[batch:] if it.get("status") == "ok"]
    man = json.loads((run_dir / "manifest.json").read_text())
    ev = (man.get("evidence") or {}).get("stages", {}).get("denoise", {})
    rec = {"overrides": overrides, "exit_code": code,  # both read by runner.tools.support_matrix
           "code": code, "s_per_image": statistics.median(per) if per else None, "images_timed": len(per),
           "lora": ev.get("lora"), "verdict": (man.get("evidence") or {}).get("verdict")}
    print(name, json.dumps({k: rec[k] for k in ("code", "s_per_image", "images_timed", "verdict")}), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="toy_shapes on the CPU, 2 steps: checks the script")
    p.add_argument("--results", default=str(ROOT / "benchmarks/results/memory_lanes_h200.json"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = (["model=toy_shapes", "platform=cpu"] if args.smoke else
             ["model=flux", "model.load_format=dummy", "platform=cuda", "dtype=bfloat16"])
    steps = 2 if args.smoke else args.steps
    a, b = (write_adapter(out / f"{n}.safetensors", model, args.rank, seed) for n, seed in (("a", 1), ("b", 2)))
    rows = prompt_rows(args.prompts)
    mixed = [{**r, "lora": "a" if (i // args.batch) % 2 == 0 else "b"} for i, r in enumerate(rows)]
    common = [*model, "dataset=jsonl", f"model.generation.num_inference_steps={steps}", f"batch_size={args.batch}",
              "evidence.profile=false"]
    plain, per_row_rows = write_jsonl(out / "rows.jsonl", rows), write_jsonl(out / "rows_mixed.jsonl", mixed)
    one = f"model.lora=[{{name: a, path: {a}}}]"
    two = f"model.lora=[{{name: a, path: {a}}},{{name: b, path: {b}}}]"
    variants = {"base": [*common, f"dataset.path={plain}"],
                "fused": [*common, f"dataset.path={plain}", one],
                "one_unfused": [*common, f"dataset.path={plain}", one, "model.lora_fuse=unfused"],
                "per_row": [*common, f"dataset.path={per_row_rows}", two]}
    res = {name: run_variant(name, ov, out, args.batch) for name, ov in variants.items()}
    t = {k: v["s_per_image"] for k, v in res.items()}
    figures = {"lora_fused_overhead": t["fused"] / t["base"] - 1,
               "lora_per_row_overhead": t["per_row"] / t["one_unfused"] - 1}
    doc = {"workload": {"model": model, "size": "model default", "steps": steps, "prompts": args.prompts,
                        "batch": args.batch, "rank": args.rank},
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "cpu",
           "variants": res, **figures, "targets": TARGETS,
           "met": {k: figures[k] <= TARGETS[k] for k in figures}}
    (out / "lora_lanes.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({**figures, "met": doc["met"]}, indent=1))
    if not args.smoke:
        path = Path(args.results)
        merged = json.loads(path.read_text()) if path.is_file() else {}
        merged.update({**figures, "lora_lanes": {k: v for k, v in doc.items() if k != "variants"}})
        path.write_text(json.dumps(merged, indent=1))


if __name__ == "__main__":
    main()
