"""FP8_TORCHAO (#18): torchao's dynamic row-wise float8 as a linear backend: its record (requirements, lossy,
signature), a clean refusal where torchao or the GPU is missing, and the install on the transformer blocks'
Linears with its calls counted (CPU: torchao's own hardware assertion is bypassed for the install test only; the
registry still refuses the backend on CPU)."""

from __future__ import annotations

import re

import pytest
import torch

from _helpers import ctx, execute
from runner.kernels import registry as reg
from _helpers import import_extra  # noqa: E402


def test_record_names_requirements_signature_and_lossy():
    b = reg.get("linear", "FP8_TORCHAO")
    assert reg.normalize("linear", "torchao") == "FP8_TORCHAO" and b.lossy and not b.auto
    labels = [r.label for r in b.requires]
    assert "platform cuda" in labels and "sm >= 89" in labels and "dtype bfloat16" in labels
    assert any("torchao.quantization" in x for x in labels)
    sig = re.compile(b.signature, re.I)
    for name in ("torchao::choose_scale_float8", "aten::_scaled_mm",
                 "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT"):
        assert sig.search(name), name
    assert not sig.search("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN")  # a bf16 GEMM
    from runner.core.lossy import lanes

    assert lanes({"denoise": {"linear": {"selected": "FP8_TORCHAO"}}}, {}) == ["denoise.linear=FP8_TORCHAO"]


def test_refused_without_torchao_or_gpu(monkeypatch):
    monkeypatch.setattr(reg, "has_symbol", lambda path: not path.startswith("torchao"))
    why = reg.get("linear", "FP8_TORCHAO").unmet(ctx(sm=90))
    assert any("torchao.quantization" in w for w in why), why
    why = reg.get("linear", "FP8_TORCHAO").unmet(ctx(platform_kind="cpu", sm=None, dtype=torch.float32))
    assert any("platform cuda" in w for w in why) and any("bfloat16" in w for w in why)
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    assert reg.get("linear", "FP8_TORCHAO").unmet(ctx(sm=90)) == []
    assert reg.get("linear", "FP8_TORCHAO").unmet(ctx(sm=89)) == []
    assert reg.get("linear", "FP8_TORCHAO").unmet(ctx(sm=80))  # no FP8 tensor cores


def test_run_on_cpu_is_refused_before_loading(tmp_path):
    from runner.core.errors import RunnerError

    r = execute(tmp_path / "r", ["model=tiny_flux", "dataset.limit=1", "backend.linear=FP8_TORCHAO"],
                catch=(RunnerError,))
    assert type(r.error).__name__ == "BackendUnavailableError" and "FP8_TORCHAO" in str(r.error), r.error
    assert "platform cuda" in str(r.error)


def test_install_quantizes_the_block_linears_and_counts_calls(monkeypatch):
    import_extra("torchao", "torchao.quantization")
    import torchao.quantization.quant_api as qa

    from runner.kernels import linear

    monkeypatch.setattr(qa, "_check_hardware_support", lambda g: None)  # CPU: torchao asserts a GPU

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ff = torch.nn.Linear(32, 64)
            self.odd = torch.nn.Linear(64, 30)  # not a multiple of 16: stays dense

        def forward(self, x):
            return self.odd(torch.nn.functional.gelu(self.ff(x)))

    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList([Block(), Block()])
    model.proj_out = torch.nn.Linear(30, 16)  # outside the blocks: stays dense
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def fwd(m):
        return m.proj_out(m.transformer_blocks[0](x) + m.transformer_blocks[1](x))

    ref = fwd(model)
    rec = linear.install(model, "FP8_TORCHAO")
    assert rec.resolved == "FP8_TORCHAO" and rec.modules == 2
    assert sorted(rec.skipped) == ["proj_out", "transformer_blocks.0.odd", "transformer_blocks.1.odd"]
    assert "Float8" in type(model.transformer_blocks[0].ff.weight).__name__
    assert type(model.proj_out.weight).__name__ == "Parameter"
    out = fwd(model)
    assert rec.observed == {"FP8_TORCHAO": 2, "TORCH": 3}
    assert torch.isfinite(out).all() and (out.float() - ref.float()).abs().max() < 0.25  # lossy, not wrong
    with torch.profiler.profile() as prof:
        model.transformer_blocks[0](x)
    names = {e.name for e in prof.events()}
    assert reg.signature("linear", "FP8_TORCHAO") and any(
        re.search(reg.signature("linear", "FP8_TORCHAO"), n) for n in names), sorted(names)
