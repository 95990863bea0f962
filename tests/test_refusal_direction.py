"""Refusals that point the right way (issue #38): a task the chosen model does not support says so and names the
models that have it (not "image_encoder is missing, start from a tiny_* config" for a tiny config, not the model
the user already chose), and a quantization whose package is missing gives its ``pip install`` line, as the other
extras' refusals do."""

from __future__ import annotations

import pytest

from _helpers import CPU, ctx, execute  # noqa: E402
from runner.core.errors import ConfigValueError, RunnerError

I2V_MODELS = "model=tiny_wan_flf2v|tiny_wan_i2v|wan_i2v"


def test_a_task_the_model_has_no_component_for_is_not_supported_by_that_model(tmp_path):
    """tiny_wan22_ti2v is a Wan text(-image)-to-video checkpoint without a CLIP image encoder: image_to_video is
    not its task; the refusal names the model, why, and the models that have it."""
    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_wan22_ti2v", "model.task=image_to_video"], on_loaded=loaded.append,
                catch=(RunnerError,))
    assert isinstance(r.error, ConfigValueError) and r.error.exit_code == 2 and not loaded, r
    msg = str(r.error)
    assert msg.startswith("model.task=image_to_video: model=tiny_wan22_ti2v does not support it (its architecture "
                          "has no image_encoder"), msg
    assert msg.endswith(f"fix: model.task=null (the model's own task), or a model that has the task: {I2V_MODELS}")
    assert "tiny_*" not in msg and "is missing" not in msg


def test_a_task_the_family_lacks_suggests_models_that_have_it_not_the_current_one(tmp_path):
    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_video"], catch=(RunnerError,))
    assert isinstance(r.error, ConfigValueError) and r.error.exit_code == 2, r
    msg = str(r.error)
    assert "the flux family has no pipeline for it" in msg, msg
    assert msg.endswith(f"fix: model.task=<one of those>, or a model that has the task ({I2V_MODELS})"), msg
    assert "model=toy_shapes" not in msg


def test_a_quantization_package_that_is_missing_gets_its_pip_install_line(monkeypatch):
    from runner.kernels import quantization as quant
    from runner.kernels import registry as reg

    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(reg, "has_symbol", lambda path: not path.startswith("torchao"))  # the quick start's env
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "int8wo"}, {"transformer": "diffusers"}, ctx(**CPU), None)
    msg = str(e.value)
    assert "(package `torchao` is not installed)" in msg, msg
    assert 'Fix: pip install -e ".[torchao]"  (torchao>=0.18), or choose another method' in msg, msg
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    quant.check({"transformer": "int8wo"}, {"transformer": "diffusers"}, ctx(**CPU), None)  # installed: no refusal
