"""SAGE2_ATTN (#18): SageAttention 2's Hopper kernel (INT8 Q/K, FP8 P/V) as an attention backend: its record
(sm90 only, lossy, the profiler signature of its kernels), a clean refusal without the compiled sm90 extension (or
with sageattention 1.x), and the wiring: diffusers' ``_sage_qk_int8_pv_fp8_cuda_sm90`` entry runs our opaque
custom op, observed as SAGE2_ATTN, with no graph break under torch.compile. CPU: a stand-in ``sageattention``
module computes exact attention and the custom op gets a CPU kernel for the test."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from _helpers import ctx, execute
from runner.kernels import registry as reg

KERNELS = [  # demangled names as the CUDA profiler reports them (csrc/qattn/qk_int_sv_f8_cuda_sm90.cu, fused.cu)
    "void qk_int8_sv_f8_attn_kernel<64u, 128u, 128u, 128u, (QuantGranularity)3, (QuantGranularity)3, "
    "__nv_bfloat16, (MaskMode)0, false, true>(CUtensorMap, CUtensorMap, CUtensorMap, float*, float*, float*, "
    "__nv_bfloat16*, float*, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int, "
    "float)",
    "quant_query_per_thread_int8_kernel", "quant_key_per_thread_int8_kernel",
    "void TransposePadPermuteKernel<128u, 64u, true, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, unsigned int)",
    "void MeanScaleKernel<64u, false, __nv_bfloat16>(__nv_bfloat16*, signed char*, float*, float*, float, "
    "unsigned int)",
]


def test_record():
    b = reg.get("attention", "SAGE2_ATTN")
    assert reg.normalize("attention", "sage2") == "SAGE2_ATTN" and b.lossy and not b.auto
    labels = [r.label for r in b.requires]
    assert "platform cuda" in labels and "sm in (90,)" in labels and "no attention mask" in labels
    assert b.diffusers.backend == "_sage_qk_int8_pv_fp8_cuda_sm90"
    assert reg.observed_name("_sage_qk_int8_pv_fp8_cuda_sm90") == "SAGE2_ATTN"
    sig = re.compile(b.signature, re.I)
    assert all(sig.search(k) for k in KERNELS)
    assert not sig.search("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1")
    # its kernels are not FP8 GEMMs: a TORCH linear lane next to it is not contradicted
    fp8 = re.compile(reg.signature("linear", "FP8"), re.I)
    assert not any(fp8.search(k) for k in KERNELS)
    reg.validate_spec("SAGE2_ATTN", {"quant": {"dtype_qk": "int8", "dtype_pv": "fp8_e4m3"}}, "backend.attention")
    from runner.core.lossy import lanes

    sel = {"denoise": {"attention": {"selected": {"joint": {"backend": "SAGE2_ATTN"}}}}}
    assert lanes(sel, {}) == ["denoise.attention.joint=SAGE2_ATTN"]


def test_refused_without_its_sm90_build(monkeypatch):
    b = reg.get("attention", "SAGE2_ATTN")
    # sageattention 1.x: sageattn exists, the sm90 entry point and extension do not
    monkeypatch.setattr(reg, "has_symbol", lambda p: p == "sageattention:sageattn")
    why = b.unmet(ctx(sm=90))
    assert any("sm90_compile" in w and "sage2_build_h200.sh" in w for w in why), why
    monkeypatch.setattr(reg, "has_symbol", lambda p: True)
    assert b.unmet(ctx(sm=90)) == []
    assert any("sm90" in w for w in b.unmet(ctx(sm=100)))  # sm_90a cubins only
    assert any("head_dim" in w for w in b.unmet(ctx(sm=90, head_dim=96)))
    assert any("mask" in w for w in b.unmet(ctx(sm=90, needs_mask=True)))


def test_run_on_cpu_is_refused_before_loading(tmp_path):
    from runner.core.errors import RunnerError

    r = execute(tmp_path / "r", ["model=tiny_flux", "dataset.limit=1", "backend.attention=SAGE2_ATTN"],
                catch=(RunnerError,))
    assert type(r.error).__name__ == "BackendUnavailableError" and "SAGE2_ATTN" in str(r.error), r.error


@pytest.fixture
def fake_sage(monkeypatch):
    """A stand-in ``sageattention`` whose sm90 function is exact attention (NHD), and a CPU kernel for the op."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R

    from runner.kernels import attention as attn

    calls = []

    def sm90(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kw):
        calls.append(kw)
        assert tensor_layout == "NHD" and not is_causal
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             scale=sm_scale)
        return o.transpose(1, 2)

    mod = types.ModuleType("sageattention")
    mod.sageattn_qk_int8_pv_fp8_cuda_sm90 = sm90
    monkeypatch.setitem(sys.modules, "sageattention", mod)
    monkeypatch.setattr(R, "_backends", dict(R._backends))  # restored after the test
    attn.sage2_op.register_kernel("cpu", attn._sage2_impl)
    yield calls


def _module():
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    return FluxAttention(query_dim=64, heads=2, dim_head=32, bias=True, out_bias=True)


@pytest.mark.parametrize("observe", [True, False])
def test_wired_as_the_dispatcher_entry_and_observed(fake_sage, observe):
    from runner.kernels import attention as attn

    m = _module()
    x = torch.randn(1, 16, 64)
    ref = m(x)  # diffusers' native attention
    sites = attn.install("denoise", [("joint", "attn", m)], {"joint": {"backend": "SAGE2_ATTN"}}, platform_sm=90,
                         observe=observe)
    assert str(m.processor._attention_backend.value) == "_sage_qk_int8_pv_fp8_cuda_sm90"
    assert sites[0].custom is None and sites[0].carrier == "_sage_qk_int8_pv_fp8_cuda_sm90"
    out = m(x)
    assert len(fake_sage) == 1 and fake_sage[0] == {"qk_quant_gran": "per_thread", "pv_accum_dtype": "fp32+fp32"}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert dict(sites[0].observed) == ({"SAGE2_ATTN": 1} if observe else {})


def test_compiled_module_has_no_graph_break_at_the_kernel(fake_sage):
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runner.kernels import attention as attn

    m = _module()
    attn.install("denoise", [("joint", "attn", m)], {"joint": {"backend": "SAGE2_ATTN"}}, platform_sm=90,
                 observe=False)
    x = torch.randn(1, 16, 64)
    eager = m(x)
    torch._dynamo.reset()
    counters.clear()
    m.compile(fullgraph=True, dynamic=False)  # fullgraph: any break raises
    with torch.no_grad():
        out = m(x)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    assert not counters["graph_break"]
    torch._dynamo.reset()


@pytest.fixture
def fake_sage1(monkeypatch):
    """A stand-in ``sageattention`` 1.x (``sageattn`` only: exact attention on NHD) and a CPU kernel for the op."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R

    from runner.kernels import attention as attn

    calls = []

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kw):
        calls.append(tensor_layout)
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=is_causal, scale=sm_scale)
        return o.transpose(1, 2)

    mod = types.ModuleType("sageattention")
    mod.sageattn = sageattn
    monkeypatch.setitem(sys.modules, "sageattention", mod)
    monkeypatch.setattr(R, "_backends", dict(R._backends))
    attn.sage_op.register_kernel("cpu", attn._sage_impl)
    yield calls


def test_sage1_is_one_opaque_op_under_compile(fake_sage1):
    """SAGE_ATTN over sageattention 1.x runs as the custom op ``runner::sage_attention``: exact on the stand-in,
    observed, and a compiled attention module has no graph break (traced through, sageattn's Python recompiled
    compiled blocks after the warm-up on the H200)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from runner.kernels import attention as attn

    m = _module()
    x = torch.randn(1, 16, 64)
    ref = m(x)
    sites = attn.install("denoise", [("joint", "attn", m)], {"joint": {"backend": "SAGE_ATTN"}}, platform_sm=90,
                         observe=False)
    # our kernel as diffusers' Triton entry (its own "sage" wants sageattention >= 2.1.1): no routing hook
    assert sites[0].custom is None and sites[0].carrier == "_sage_qk_int8_pv_fp16_triton"
    eager = m(x)
    torch.testing.assert_close(eager, ref, rtol=1e-5, atol=1e-5)
    assert fake_sage1 == ["NHD"]
    torch._dynamo.reset()
    counters.clear()
    m.compile(fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = m(x)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    assert not counters["graph_break"] and fake_sage1 == ["NHD", "NHD"]
    torch._dynamo.reset()
