"""One record per backend (``runner.kernels.registry.Backend``): every unmet requirement is listed, and an out-of-tree
attention backend registered from this file alone (no edit elsewhere in the repository) is resolved, wired into
diffusers, observed executing and matched by its own profiler signature in a real ``runner.app.execute.run``; a record
whose wiring does not reach its kernel is reported as a mismatch."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch

from runner.kernels import registry as reg
from runner.kernels.registry import Backend, BackendUnavailableError, DiffusersWiring, UnknownBackendError
from runner.core.errors import EvidenceError

try:
    from _helpers import CPU, ctx, execute
except ImportError:  # tests/ imported as a package
    from tests._helpers import CPU, ctx, execute

# ------------------------------------------------------------------------------ every unmet requirement


def test_trtllm_on_cpu_lists_platform_and_compute_capability():
    why = reg.get("attention", "TRTLLM_ATTN").unmet(ctx(**CPU))
    assert why[0] == "needs platform cuda, this is cpu", why
    assert "needs compute capability sm100 or sm103, this device is not a CUDA GPU" in why, why
    assert any("flashinfer" in w for w in why), why  # the package (not installed here)
    assert any("float32" in w for w in why), why  # and the dtype: nothing stops after the first failure
    with pytest.raises(BackendUnavailableError) as e:
        reg.check("attention", "TRTLLM_ATTN", ctx(**CPU))
    assert "platform cuda" in str(e.value) and "sm100 or sm103" in str(e.value)


@pytest.mark.parametrize("fld,name", [(f, n) for f in reg.FIELDS for n, b in reg.BACKENDS[f].items()
                                      if any(getattr(r, "label", "").startswith("sm") for r in b.requires)])
def test_every_gpu_backend_off_cuda_names_platform_and_capability(fld, name):
    why = reg.get(fld, name).unmet(ctx(platform_kind="mps", sm=None, dtype=torch.bfloat16))
    assert "platform" in why[0] and "mps" in why[0], why
    assert any("compute capability" in w and "not a CUDA GPU" in w for w in why), why


def test_unmet_evaluates_every_requirement_of_a_record():
    calls = []

    def req(label: str, ok: bool):
        return reg.Requirement(label, lambda c: calls.append(label) or ([] if ok else [f"{label} unmet"]))

    b = Backend("attention", "TEST_REQS", requires=(req("a", False), req("b", True), req("c", False)))
    assert b.unmet(ctx()) == ["a unmet", "c unmet"]
    assert calls == ["a", "b", "c"]


# -------------------------------------------------------------------------------- registration API


def test_register_refuses_a_name_or_alias_already_taken():
    with pytest.raises(ValueError, match="TORCH_SDPA"):
        reg.register_backend(Backend("attention", "MY_OTHER", aliases=("Torch-SDPA",)))
    with pytest.raises(ValueError, match="auto"):
        reg.register_backend(Backend("attention", "MY_OTHER", aliases=("auto",)))
    assert "MY_OTHER" not in reg.BACKENDS["attention"]


def test_register_refuses_malformed_records():
    with pytest.raises(ValueError, match="platform class"):
        reg.register_backend(Backend("attention", "MY_OTHER", auto={"hopper": (0, "typo")}))
    with pytest.raises(ValueError, match="attention"):
        reg.register_backend(Backend("linear", "MY_OTHER", diffusers=DiffusersWiring("native")))
    with pytest.raises(ValueError, match="field"):
        reg.register_backend(Backend("attn", "MY_OTHER"))
    assert all("MY_OTHER" not in t for t in reg.BACKENDS.values())


def test_register_refuses_to_observe_an_entry_another_backend_owns():
    """The probe's mapping from what executed to a name cannot be taken over: ``native`` is TORCH_SDPA's."""
    with pytest.raises(ValueError, match="native.*TORCH_SDPA"):
        reg.register_backend(Backend("attention", "MY_OTHER",
                                     diffusers=DiffusersWiring("native", observed=("native",))))
    assert reg.observed_name("native") == "TORCH_SDPA"
    assert reg.observed_name("_native_math") == "diffusers:_native_math"


def test_registered_context_adds_and_removes_everything():
    rec = Backend("attention", "MY_CTX", aliases=("my-ctx",), auto={"other": (0, "test backend first")},
                  diffusers=DiffusersWiring("_native_math", observed=("_native_math",)), vllm="CPU_ATTN",
                  signature=r"my_ctx")
    with reg.registered(rec):
        assert reg.normalize("attention", "MY-CTX") == "MY_CTX"
        assert reg.auto_select("attention", ctx(**CPU)) == ("MY_CTX", "test backend first")
        assert "MY_CTX" in reg.wired("attention", "diffusers")
        assert reg.observed_name("_native_math") == "MY_CTX"
        assert reg.vllm_name("attention", "MY_CTX") == "CPU_ATTN"
        assert reg.signature("attention", "MY_CTX") == r"my_ctx"
    with pytest.raises(UnknownBackendError):
        reg.normalize("attention", "my-ctx")
    assert reg.observed_name("_native_math") == "diffusers:_native_math"
    assert reg.auto_select("attention", ctx(**CPU))[0] == "TORCH_SDPA"
    with pytest.raises(KeyError):
        reg.unregister_backend("attention", "MY_CTX")


# ------------------------------------------------------------------------ an out-of-tree backend, end to end

CALLS = {"n": 0}


def my_sdpa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: Optional[float] = None, **_: Any) -> torch.Tensor:
    """Pure-torch attention on the dispatcher layout: query/key/value ``(batch, seq_len, heads, head_dim)`` in,
    the same layout out. The profiler range ``my_sdpa::attention`` is what MY_SDPA's signature matches."""
    CALLS["n"] += 1
    with torch.profiler.record_function("my_sdpa::attention"):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                               is_causal=is_causal, scale=scale)
        return out.transpose(1, 2)


MY_SDPA = Backend("attention", "MY_SDPA", aliases=("my-sdpa",),
                  diffusers=DiffusersWiring("native", kernel=f"{__name__}:my_sdpa_attention"),  # lazy path
                  signature=r"^my_sdpa::")
# The same names, but wired to TORCH_SDPA's diffusers entry: the kernel is never reached.
MY_SDPA_MISWIRED = Backend("attention", "MY_SDPA", aliases=("my-sdpa",), diffusers=DiffusersWiring("native"),
                           signature=r"^my_sdpa::")


@pytest.fixture
def my_sdpa():
    CALLS["n"] = 0
    with reg.registered(MY_SDPA) as rec:
        yield rec
    assert "MY_SDPA" not in reg.BACKENDS["attention"]


def test_plan_loads_the_lazy_kernel(my_sdpa):
    from runner.kernels.attention import plan

    assert plan("MY_SDPA") == ("native", my_sdpa_attention)


@pytest.mark.slow
def test_out_of_tree_backend_resolved_installed_and_observed(my_sdpa, tmp_path):
    r = execute(tmp_path / "run", ["model=tiny_flux", "backend.attention=my-sdpa", "dataset.limit=2"])
    assert r.code == 0
    m = r.manifest
    att = m["backends"]["denoise"]["attention"]
    assert att["layer"] == "cli_run" and att["explicit"] is True
    assert {s["backend"] for s in att["selected"].values()} == {"MY_SDPA"}
    ev = m["evidence"]
    assert ev["verdict"] == "verified", ev["mismatches"]
    st = ev["stages"]["denoise"]
    fwd = st["denoiser_forwards"]
    assert fwd > 0 and st["attention"]["layers"]
    for layer in st["attention"]["layers"]:
        assert layer["resolved"] == "MY_SDPA" and layer["observed"] == {"MY_SDPA": fwd} and layer["ok"], layer
    assert st["attention"]["by_backend"] == {"MY_SDPA": len(st["attention"]["layers"])}
    assert st["kernels"]["attention"]["MY_SDPA"] == ["my_sdpa::attention"]
    assert st["kernels"]["attention_launches"]["MY_SDPA"] == len(st["attention"]["layers"])
    assert CALLS["n"] == fwd * len(st["attention"]["layers"])  # the test's kernel really ran, every call
    assert all(it["status"] == "ok" for it in r.items) and len(r.items) == 2


@pytest.mark.slow
def test_miswired_record_is_reported_as_a_mismatch(tmp_path):
    """A record naming MY_SDPA whose wiring points at TORCH_SDPA's entry: the probe sees TORCH_SDPA executing and
    the profiler finds no MY_SDPA kernel, so strict evidence fails the run."""
    CALLS["n"] = 0
    with reg.registered(MY_SDPA_MISWIRED):
        r = execute(tmp_path / "run", ["model=tiny_flux", "backend.attention=MY_SDPA", "dataset.limit=2"],
                    catch=(EvidenceError,))
    assert isinstance(r.error, EvidenceError)
    assert CALLS["n"] == 0
    ev = r.manifest["evidence"]
    assert ev["verdict"] == "mismatch"
    text = "\n".join(ev["mismatches"])
    assert "resolved MY_SDPA" in text and "TORCH_SDPA x" in text, text
    assert "no profiled kernel matches MY_SDPA's signature" in text, text
    layers = ev["stages"]["denoise"]["attention"]["layers"]
    assert layers and all(not layer["ok"] and set(layer["observed"]) == {"TORCH_SDPA"} for layer in layers)
    assert r.manifest["status"] == "evidence_mismatch"


def test_cudnn_attention_signature_excludes_cudnn_convolutions():
    """cuDNN's convolution kernels (the VAE's, seen on the H200 in a TORCH_SDPA run, 2026-12-01) carry ``cudnn`` and
    ``fprop`` in their names: CUDNN_ATTN's signature once matched them, so a VAE decode could pass for cuDNN attention
    in the evidence. Its SDPA kernels match; the convolutions match no attention backend."""
    import re

    from runner.kernels import registry as reg

    conv = ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized_bf16_64x64_32x10_nhwc_align8>"
            "(cutlass_tensorop_bf16_s16816fprop_optimized_bf16_64x64_32x10_nhwc_align8::Params)")
    sdpa = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0"
    assert re.search(reg.signature("attention", "CUDNN_ATTN"), sdpa, re.I)
    assert [n for n in reg.BACKENDS["attention"] if re.search(reg.signature("attention", n) or r"$^", conv, re.I)] == []
