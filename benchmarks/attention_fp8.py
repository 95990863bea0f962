"""Attention kernels alone at the FLUX.1-dev 1024x1024 shape (24 heads, 4096 image + 512 text tokens, head_dim
128, bf16): cuDNN SDPA (the lossless lane's kernel) vs SageAttention 2's Hopper kernel (SAGE2_ATTN: INT8 Q/K, FP8
P/V, ``sageattn_qk_int8_pv_fp8_cuda_sm90`` through the runner's custom op) vs SageAttention's Triton INT8 Q/K +
FP16 P/V kernel (the SAGE_ATTN 1.x path), and FlashAttention-2 through SDPA for reference.

Per kernel: median ms (CUDA events via ``triton.testing.do_bench``), TFLOP/s counted as ``4 * B * H * S^2 * D``
(QK^T and PV), and the error of its output against an fp32 math reference (relative L2, min cosine similarity
per row); profiler kernel names of one call (what the run's evidence matches). Kernels that are not installed are
reported as skipped with the reason.

    python benchmarks/attention_fp8.py --out attention_fp8_h200.json [--batch 1,4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def flops(b: int, h: int, s: int, d: int) -> float:
    return 4.0 * b * h * s * s * d


def kernels_of(fn: Callable[[], Any]) -> Dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: Dict[str, int] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.name[:200]] = out.get(ev.name[:200], 0) + 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch", default="1,4")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--seq", type=int, default=4608)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args()
    from triton.testing import do_bench

    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = "cuda"
    res: Dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                           "shape": {"heads": a.heads, "seq": a.seq, "head_dim": a.head_dim, "layout": "NHD"},
                           "policy": "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms)", "results": {}}
    try:
        import sageattention

        res["sageattention"] = getattr(sageattention, "__version__", None) or _dist_version("sageattention")
    except ImportError as e:
        res["sageattention"] = f"not importable: {e}"

    def sdpa(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        return run

    def sage2(q, k, v):
        from runner.kernels.attention import sage2_attention

        return sage2_attention(q, k, v)

    def sage_triton(q, k, v):
        from sageattention import sageattn_qk_int8_pv_fp16_triton

        return sageattn_qk_int8_pv_fp16_triton(q, k, v, tensor_layout="NHD")

    cands = {"CUDNN_ATTN (bf16)": sdpa(SDPBackend.CUDNN_ATTENTION), "FLASH (FA2 via SDPA, bf16)":
             sdpa(SDPBackend.FLASH_ATTENTION), "SAGE2_ATTN (int8 QK, fp8 PV, sm90)": sage2,
             "SAGE triton (int8 QK, fp16 PV)": sage_triton}
    for b in [int(x) for x in a.batch.split(",")]:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, a.seq, a.heads, a.head_dim, device=dev, dtype=torch.bfloat16) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[:1].float().transpose(1, 2), k[:1].float().transpose(1, 2), v[:1].float().transpose(1, 2)
        ).transpose(1, 2)
        fl = flops(b, a.heads, a.seq, a.head_dim)
        for name, fn in cands.items():
            key = f"{name} @ batch {b}"
            try:
                out = fn(q, k, v)
                torch.cuda.synchronize()
                ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=100)
                o = out[:1].float()
                cos = torch.nn.functional.cosine_similarity(o.reshape(-1, a.head_dim), ref.reshape(-1, a.head_dim),
                                                            dim=-1)
                res["results"][key] = {
                    "ms": round(ms, 4), "tflops": round(fl / (ms / 1e3) / 1e12, 1),
                    "rel_l2_vs_fp32": round(float((o - ref).norm() / ref.norm()), 5),
                    "min_cosine_vs_fp32": round(float(cos.min()), 5),
                    "kernels": kernels_of(lambda: fn(q, k, v)) if b == 1 else None}
            except Exception as e:  # noqa: BLE001 - a missing kernel is reported, not fatal
                res["results"][key] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, {k2: v2 for k2, v2 in res["results"][key].items() if k2 != "kernels"}, flush=True)
        del q, k, v, ref
    base = {k: v for k, v in res["results"].items() if k.startswith("CUDNN_ATTN") and "ms" in v}
    for key, v in res["results"].items():
        b = key.rsplit(" ", 1)[-1]
        ref_ms = next((x["ms"] for kk, x in base.items() if kk.endswith(f" {b}")), None)
        if "ms" in v and ref_ms:
            v["speedup_vs_cudnn"] = round(ref_ms / v["ms"], 3)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def _dist_version(name: str):
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
