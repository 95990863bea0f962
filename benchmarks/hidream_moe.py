"""HiDream-I1's MoE backends on a GPU: parity of TRITON against diffusers' expert loop at the model's shape, its
negative control, timing, and the runner's evidence with each ``backend.moe``.

1. Block (HiDream-I1 shape: H=2560, 4 routed experts top-2, expert width 6912, a shared expert; ``--tokens`` tokens,
   default 8192 = one 1024^2 image under guidance): one diffusers ``MOEFeedForwardSwiGLU`` built twice from the
   same seed, fp32 (the oracle: diffusers' loop in fp32, TF32 off) and bf16. Relative L2 error against the oracle
   of: diffusers' loop in bf16 (``TORCH``, for scale), ``TRITON`` in bf16 through the runner's wiring
   (``kernels.moe.routed_forward``), and the NEGATIVE CONTROL, ``TRITON`` with gate and up projections swapped,
   which must fail the tolerance (2e-2, ``benchmarks/moe_parity.py``'s bf16 tolerance). Milliseconds per block
   call for each backend (``kernels.moe.time_block``: router and shared expert included).
2. Runner: ``runner.app.execute.run`` with ``model=hidream model.load_format=dummy`` (full size, random weights scaled by
   0.05 so bf16 activations stay finite), 2 steps, 1 row, eager, for ``backend.moe=TORCH``, ``TRITON`` and ``auto``:
   exit code, verdict, ``evidence.stages.denoise.moe`` (calls per implementation), the profiled MoE kernel names
   (TRITON: ``_moe_gate_up_silu_kernel``/``_moe_down_kernel``), and ``auto``'s recorded reason (its startup timing).

Usage: ``python benchmarks/hidream_moe.py --out DIR`` (one H200; the full model needs ~62 GB in bf16). ``--smoke``
runs it on the CPU at tiny sizes (``model=tiny_hidream``, fp32, ``kernels.moe.moe_reference`` standing in for the
Triton kernel, ``backend.moe=TORCH``/``auto`` only) to check the script. Result: ``DIR/hidream_moe.json``; exit 0
when every parity check passes, the negative control fails, and every runner run is verified.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TOL = 2e-2


def compose(overrides: List[str]) -> Any:
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="bench"):
        return hydra.compose("config", overrides=overrides)


def block_checks(smoke: bool, tokens: int, iters: int) -> Dict[str, Any]:
    """Part 1: parity, negative control and timing on one MoE block of HiDream-I1's shape."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    from kernels import moe
    from models.hidream import HiDreamExperts

    device = "cpu" if smoke else "cuda"
    dim, experts, top_k = (32, 4, 2) if smoke else (2560, 4, 2)
    lo_dtype = torch.float32 if smoke else torch.bfloat16
    kernel = moe.moe_reference if smoke else moe.moe_triton
    kernel_name = "moe_reference (smoke)" if smoke else "TRITON"
    torch.backends.cuda.matmul.allow_tf32 = False
    layout = HiDreamExperts()

    def block(dtype: torch.dtype) -> torch.nn.Module:
        torch.manual_seed(0)
        return MOEFeedForwardSwiGLU(dim, 4 * dim, experts, top_k).to(device=device, dtype=dtype).eval()

    ref_block, lo_block = block(torch.float32), block(lo_dtype)
    torch.manual_seed(1)
    x = torch.randn(1, tokens, dim, device=device)
    with torch.no_grad():
        ref = ref_block(x)
        xl = x.to(lo_dtype)
        torch_lo = lo_block(xl)
        w = layout.stack(lo_block)
        out = moe.routed_forward(lo_block, layout, kernel, w, xl)
        swapped = moe.routed_forward(lo_block, layout, kernel, (w[1], w[0], w[2]), xl)
    rec: Dict[str, Any] = {
        "shape": {"H": dim, "I": lo_block.experts[0].w1.out_features, "E": experts, "top_k": top_k, "T": tokens},
        "dtype": str(lo_dtype).replace("torch.", ""), "tol": TOL, "kernel": kernel_name,
        "torch_rel_err": moe.rel_err(torch_lo, ref), "kernel_rel_err": moe.rel_err(out, ref),
        "negative_control_rel_err": moe.rel_err(swapped, ref),
        "kernel_nan": bool(torch.isnan(out).any())}
    rec["kernel_ok"] = rec["kernel_rel_err"] < TOL and not rec["kernel_nan"]
    rec["negative_control_failed_as_expected"] = rec["negative_control_rel_err"] > TOL
    backends = ["TORCH"] if smoke else ["TORCH", "TRITON"]
    rec["ms_per_call"] = moe.time_block(lo_block, layout, xl, backends, iters=iters, warmup=3)
    if not smoke:
        rec["speedup_triton_over_torch"] = rec["ms_per_call"]["TORCH"] / rec["ms_per_call"]["TRITON"]
    print("block", json.dumps(rec), flush=True)
    return rec


def runner_runs(smoke: bool, out: Path) -> List[Dict[str, Any]]:
    """Part 2: the runner's own loop with each MoE backend; evidence must be verified."""
    from runner.app.execute import run
    from runner.core.errors import EvidenceError

    base = (["model=tiny_hidream", "platform=cpu"] if smoke else
            ["model=hidream", "model.load_format=dummy", "platform=cuda", "+model.architecture.dummy_weight_scale=0.05"])
    rows = out / "hidream_rows.jsonl"
    rows.write_text(json.dumps({"id": "e0", "prompt": "a lighthouse on a cliff at dusk", "negative_prompt": "blurry"})
                    + "\n")
    recs = []
    for moe_backend in (["TORCH", "auto"] if smoke else ["TORCH", "TRITON", "auto"]):
        ov = [*base, "dataset=jsonl", f"dataset.path={rows}", "model.generation.num_inference_steps=2",
              f"backend.moe={moe_backend}", "compile=none"]
        run_dir = out / f"run_moe_{moe_backend}"
        t0 = time.perf_counter()
        try:
            code, err = run(compose(ov), run_dir, ov), None
        except EvidenceError as e:
            code, err = 3, str(e)
        man = json.loads((run_dir / "manifest.json").read_text())
        st = man["evidence"]["stages"]["denoise"]
        rec = {"overrides": ov, "exit_code": code, "error": err, "verdict": man["evidence"]["verdict"],
               "mismatches": man["evidence"]["mismatches"], "backend": man["backends"]["denoise"]["moe"],
               "moe_calls": st.get("moe", {}).get("calls"), "moe_sites": st.get("moe", {}).get("sites"),
               "moe_kernels": st.get("kernels", {}).get("moe"), "denoiser_forwards": st["denoiser_forwards"],
               "run_s": round(time.perf_counter() - t0, 1)}
        print("runner", moe_backend, rec["verdict"], rec["moe_calls"], rec["moe_kernels"], flush=True)
        recs.append(rec)
        if not smoke:
            torch.cuda.empty_cache()
    return recs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, to check the script")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per block call (default 8192; smoke 512)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--skip-runner", action="store_true", help="part 1 only")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    res: Dict[str, Any] = {"started": datetime.now(timezone.utc).isoformat(), "smoke": args.smoke,
                           "torch": torch.__version__, "host": platform.node(),
                           "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke
                           else "cpu"}
    res["block"] = block_checks(args.smoke, args.tokens or (512 if args.smoke else 8192), args.iters)
    res["runner"] = [] if args.skip_runner else runner_runs(args.smoke, args.out)
    res["ok"] = (res["block"]["kernel_ok"] and res["block"]["negative_control_failed_as_expected"]
                 and all(r["exit_code"] == 0 and r["verdict"] == "verified" for r in res["runner"]))
    (args.out / "hidream_moe.json").write_text(json.dumps(res, indent=1))
    print("ok" if res["ok"] else "FAILED", args.out / "hidream_moe.json")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
