"""Denoiser evidence rules called directly (models/denoiser_evidence.py), for the mutation run
(benchmarks/mutation.py, group ``evidence_all``): the forward-count check's four outcomes, and where a profiled
forward's device time went (GPU kernel milliseconds: the total and the 25 longest kernels, names cut at 160)."""

from __future__ import annotations

from models import denoiser_evidence as ev


def test_forward_count_check():
    assert ev.forward_count_check(4, 4, rule=False) == "limited"
    assert ev.forward_count_check(4, None, rule=True) == "not_checked"
    assert ev.forward_count_check(4, 4, rule=True) == "verified"
    assert ev.forward_count_check(3, 4, rule=True) == "mismatch"
    assert ev.forward_count_check(4, None, rule=False) == "limited"


def test_device_time_of_the_profiled_forward():
    long = "k" * 200
    ms = {f"gemm_{i:02d}": float(i) + 0.12345 for i in range(30)}
    ms[long] = 100.00019  # a total of 538.70369: 3 and 4 decimals differ
    trace = ev.KernelTrace(ops={"aten::_scaled_dot_product_flash_attention_for_cpu": 2, "aten::addmm": 3},
                           kernels={"gemm_00": 1}, kernel_ms=ms)
    mm = []
    k = ev._kernel_calls("denoise", trace, {"TORCH_SDPA": 2}, "TORCH", None, mm)
    assert k["device_ms_total"] == round(sum(ms.values()), 3)
    top = k["top_device_ms"]
    assert list(top) == [long[:160]] + [f"gemm_{i:02d}" for i in range(29, 5, -1)]
    assert top[long[:160]] == 100.0 and top["gemm_29"] == 29.123
    none = ev._kernel_calls("denoise", ev.KernelTrace(ops=dict(trace.ops)), {"TORCH_SDPA": 2}, "TORCH", None, [])
    assert "device_ms_total" not in none and "top_device_ms" not in none
