"""Weight quantization records added for issue #41: torchao W8A8 int8 (``int8dq``: dynamic int8 activations), int4
weight-only (``int4wo``, CUDA sm80+) and NVFP4 (``nvfp4``, Blackwell only, refused above a batch of 31: pytorch/ao
#4023). Real tiny_flux runs on CPU for int8dq (the weight class each Linear ran with, the int8 GEMM the linear
evidence accepts); refusals before loading for the others; the batch rule on a faked Blackwell context."""

from __future__ import annotations

import pytest
import torch

from _helpers import execute, requires_extra
from runner.kernels import quantization as quant
from runner.kernels import registry as reg
from runner.kernels.registry import SelectionContext

pytestmark = pytest.mark.cpu


@requires_extra("torchao")
def test_w8a8_weights_are_told_from_weight_only_int8_at_call_time():
    import torchao.quantization as tq

    names = {}
    for cfg in ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"):
        m = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16)
        tq.quantize_(m, getattr(tq, cfg)())
        names[cfg] = quant.weight_class_names(m[0])
    assert names["Int8WeightOnlyConfig"][0] == "Int8Tensor"
    assert names["Int8DynamicActivationInt8WeightConfig"][:2] == ["Int8Tensor+dynamic_act", "Int8Tensor"]
    assert not set(quant.get("int8dq").tensor_classes) & set(names["Int8WeightOnlyConfig"])


@requires_extra("torchao")
def test_int8dq_runs_verified_on_cpu_every_linear_at_its_w8a8_weight(tmp_path):
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=2", "model.quantization.transformer=int8dq"])
    assert r.code == 0, r.error
    q = r.manifest["evidence"]["stages"]["denoise"]["memory"]["quantization"]["transformer"]
    assert q["method"] == "int8dq" and q["quantized_linears"] == q["linears"] > 0
    assert set(q["calls_by_weight_class"]) == {"Int8Tensor+dynamic_act"} and q["quantized_calls"] > 0
    assert r.manifest["evidence"]["verdict"] == "verified"
    assert "model.quantization.transformer=int8dq" in r.manifest["lossy"]["lanes"]


@requires_extra("torchao")
def test_a_w8a8_run_that_got_weight_only_int8_fails_the_evidence(tmp_path, monkeypatch):
    """The planted fault: the int8dq record builds torchao's weight-only config (no activation quantization): its
    Linears never hold a dynamic-activation weight, exit 3."""
    from runner.core.errors import EvidenceError

    monkeypatch.setitem(quant._BUILDERS, "int8dq", quant._BUILDERS["int8wo"])
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=1", "model.quantization.transformer=int8dq"],
                catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3
    assert "none of its" in str(r.error) and "Int8Tensor+dynamic_act" in str(r.error)


@pytest.mark.parametrize("method, says", [
    ("int4wo", "needs compute capability >= sm80"),
    ("nvfp4", "needs compute capability >= sm100"),
])
def test_gpu_only_methods_are_refused_on_cpu_before_loading(tmp_path, method, says):
    from runner.core.errors import RunnerError

    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=1", f"model.quantization.transformer={method}"],
                on_loaded=loaded.append, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded
    assert f"model.quantization.transformer={method} cannot run here" in str(r.error) and says in str(r.error)
    assert "Fix:" in str(r.error)


def test_nvfp4_is_refused_above_the_batch_it_is_known_to_fail_at(monkeypatch):
    """On a (faked) Blackwell GPU with torchao's NVFP4 config importable: batch_size 31 passes, 32 is refused naming
    the key, the value, the source and the fix; another method at 32 is not."""
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    blackwell = SelectionContext(platform_kind="cuda", sm=100, dtype=torch.bfloat16)
    libs = {"transformer": "diffusers"}
    quant.check({"transformer": "nvfp4"}, libs, blackwell, None, batch_size=31)
    quant.check({"transformer": "int8dq"}, libs, blackwell, None, batch_size=64)
    with pytest.raises(quant.QuantizationError) as e:
        quant.check({"transformer": "nvfp4"}, libs, blackwell, None, batch_size=32)
    msg = str(e.value)
    assert "model.quantization.transformer=nvfp4 with batch_size=32" in msg and "pytorch/ao issue #4023" in msg
    assert "fix: batch_size=31 or less" in msg
    hopper = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16)
    with pytest.raises(quant.QuantizationUnavailableError, match="needs compute capability >= sm100, this device"):
        quant.check({"transformer": "nvfp4"}, libs, hopper, None, batch_size=1)


def test_new_records_plan_their_storage_bits():
    """The planner's bits per weight: int8 8, int4 with a bf16 scale and zero per 128 4.25, NVFP4's e4m3 scale per 16
    4.5 (sources in runner.kernels.quantization's docstring)."""
    assert (quant.get("int8dq").bits, quant.get("int4wo").bits, quant.get("nvfp4").bits) == (8.0, 4 + 32 / 128, 4.5)
    assert quant.normalize("W8A8", "k") == "int8dq" and quant.normalize("int4", "k") == "int4wo"
