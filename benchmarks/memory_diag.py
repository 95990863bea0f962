"""Diagnose the memory-lane failures of issue #37 on a CUDA device, one probe at a time, each printing what it saw.

Probes (``--probes``, comma-separated):

* ``ao_offload``: plain diffusers + torchao, no runner: a tiny FLUX transformer quantized with torchao's
  ``Int8WeightOnlyConfig`` (``quantize_``), then ``apply_group_offloading`` (block level; streams on/off), one
  forward; the traceback of any failure. Tells a diffusers/torchao fault from a runner one.
* ``tiny_quant_offload``: the runner on tiny_flux with ``model.quantization.transformer=int8wo
  memory.offload=group_block`` (the failing cuda test), every item failure's traceback printed.
* ``tiny_fuse_offload``: the runner on tiny_flux with ``optimize.fuse_qkv=true memory.offload=group_block``
  (what ``budget24`` plans at FLUX.1-dev scale: group offload under ``experiment=flux_dev_h200``'s fused QKV).
* ``int8_forward``: FLUX.1-dev's transformer (random weights) on the GPU, one 1024^2 forward in bf16 and after
  ``quantize_(Int8WeightOnlyConfig)``, median ms each (torch.cuda events).
* ``int8_lane``: ``benchmarks/memory_lanes.py --lanes int8wo`` at 1 prompt, 2 steps, batch 1 in a subprocess with
  ``faulthandler`` dumping every thread's stack each 45 s (where the time goes when an item does not finish).

    python benchmarks/memory_diag.py --probes ao_offload,tiny_quant_offload --out /tmp/diag
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402


def tiny_flux(device: str = "cuda") -> Any:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
                                  attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                                  pooled_projection_dim=32, axes_dims_rope=[8, 12, 12],
                                  guidance_embeds=True).to(device, torch.bfloat16)


def flux_inputs(c: Any, batch: int, img: int, txt: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(0)
    return dict(hidden_states=torch.randn(batch, img, c.in_channels, device="cuda", dtype=torch.bfloat16, generator=g),
                encoder_hidden_states=torch.randn(batch, txt, c.joint_attention_dim, device="cuda",
                                                  dtype=torch.bfloat16, generator=g),
                pooled_projections=torch.randn(batch, c.pooled_projection_dim, device="cuda", dtype=torch.bfloat16),
                timestep=torch.full((batch,), 0.5, device="cuda", dtype=torch.bfloat16),
                img_ids=torch.zeros(img, 3, device="cuda"), txt_ids=torch.zeros(txt, 3, device="cuda"),
                guidance=torch.full((batch,), 3.5, device="cuda", dtype=torch.bfloat16))


def ao_offload() -> Dict[str, Any]:
    from diffusers.hooks import apply_group_offloading
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    out: Dict[str, Any] = {}
    for where in ("cpu", "cuda"):
        for stream in (True, False):
            key = f"quantized_on_{where}_stream_{stream}"
            try:
                m = tiny_flux(where)
                quantize_(m, Int8WeightOnlyConfig())
                m.to("cpu")
                apply_group_offloading(m, onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                       offload_type="block_level", num_blocks_per_group=1, use_stream=stream)
                with torch.inference_mode():
                    for _ in range(2):
                        y = m(**flux_inputs(m.config, 1, 64, 8)).sample
                out[key] = {"ok": True, "finite": bool(torch.isfinite(y).all())}
            except Exception as e:  # noqa: BLE001 - the probe reports it
                out[key] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(key, json.dumps(out[key])[:3500], flush=True)
    return out


def runner_probe(run_dir: Path, overrides: List[str]) -> Dict[str, Any]:
    """One in-process runner run; every exception raised by ``generate`` printed with its traceback."""
    from models import diffusers_engine
    from runner.app.execute import run as execute
    from runner.core.errors import RunnerError
    sys.path.insert(0, str(ROOT / "tests"))
    from _helpers import compose

    orig = diffusers_engine.DiffusersEngine.generate
    seen: List[str] = []

    def generate(self: Any, batch: Any) -> Any:
        try:
            return orig(self, batch)
        except Exception:
            seen.append(traceback.format_exc()[-4000:])
            raise

    diffusers_engine.DiffusersEngine.generate = generate
    try:
        code = execute(compose(overrides), run_dir, overrides)
    except RunnerError as e:
        return {"refused": f"{type(e).__name__}: {e}"}
    finally:
        diffusers_engine.DiffusersEngine.generate = orig
        torch.cuda.set_per_process_memory_fraction(1.0)
    m = json.loads((run_dir / "manifest.json").read_text())
    for tb in seen[:2]:
        print(tb, flush=True)
    return {"code": code, "status": m["status"], "verdict": m["evidence"]["verdict"],
            "mismatches": m["evidence"]["mismatches"], "tracebacks": seen[:2]}


TINY = ["platform=cuda", "dtype=bfloat16", "model=tiny_flux", "dataset.limit=4", "batch_size=2",
        "model.generation.width=64", "model.generation.height=64", "model.generation.num_inference_steps=3"]


def int8_forward() -> Dict[str, Any]:
    from diffusers import FluxTransformer2DModel
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from common import time_ms

    cfg = {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
           "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
           "axes_dims_rope": [16, 56, 56], "guidance_embeds": True}
    with torch.device("cuda"):
        m = FluxTransformer2DModel(**cfg).to(torch.bfloat16)
    kw = flux_inputs(m.config, 1, 4096, 512)
    res: Dict[str, Any] = {}
    with torch.inference_mode():
        res["bf16_ms"] = round(time_ms(lambda: m(**kw), "cuda", warmup=2, iters=5), 2)
        t0 = time.perf_counter()
        quantize_(m, Int8WeightOnlyConfig())
        torch.cuda.synchronize()
        res["quantize_s"] = round(time.perf_counter() - t0, 2)
        res["weight_class"] = type(m.transformer_blocks[0].ff.net[2].weight).__name__
        t0 = time.perf_counter()
        m(**kw)
        torch.cuda.synchronize()
        res["int8_first_forward_s"] = round(time.perf_counter() - t0, 2)
        if res["int8_first_forward_s"] < 20:
            res["int8_ms"] = round(time_ms(lambda: m(**kw), "cuda", warmup=1, iters=3), 2)
        else:
            res["note"] = "first forward over 20 s: not timed again"
    print(json.dumps(res), flush=True)
    return res


def int8_lane(out: Path) -> Dict[str, Any]:
    code = ("import faulthandler, sys, runpy; faulthandler.dump_traceback_later(45, repeat=True); "
            "sys.argv = ['memory_lanes.py', '--lanes', 'int8wo', '--prompts', '1', '--steps', '2', "
            f"'--batch-size', '1', '--out', {str(out / 'lane')!r}]; "
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'memory_lanes.py')!r}, run_name='__main__')")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    (out / "int8_lane.log").write_text(text)
    print(text[-6000:], flush=True)
    return {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "log": str(out / "int8_lane.log")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--probes", default="ao_offload,tiny_quant_offload,tiny_fuse_offload,int8_forward,int8_lane")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probes: Dict[str, Callable[[], Any]] = {
        "ao_offload": ao_offload,
        "tiny_quant_offload": lambda: runner_probe(out / "tq", [*TINY, "model.quantization.transformer=int8wo",
                                                                "memory.offload=group_block"]),
        "tiny_fuse_offload": lambda: runner_probe(out / "tf", [*TINY, "optimize.fuse_qkv=true",
                                                               "memory.offload=group_block"]),
        "int8_forward": int8_forward,
        "int8_lane": lambda: int8_lane(out),
    }
    doc: Dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    for name in [x for x in args.probes.split(",") if x]:
        print(f"=== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            doc[name] = probes[name]()
        except Exception as e:  # noqa: BLE001 - one probe's failure does not stop the others
            doc[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(doc[name]["traceback"], flush=True)
        doc[name + "_s"] = round(time.perf_counter() - t0, 1)
        (out / "memory_diag.json").write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
