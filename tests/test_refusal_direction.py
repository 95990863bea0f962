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


@pytest.mark.parametrize("overrides, task, have, want, fix", [
    # an I2V checkpoint (36 = noise 16 + mask 4 + condition 16) run as text-to-video: WanPipeline feeds z_dim=16
    (["model=tiny_wan_i2v", "model.task=text_to_video"], "text_to_video", 36, 16,
     "fix: model.task=image_to_video (the checkpoint's task) or a checkpoint of model.task=text_to_video "
     "(transformer in_channels=16)"),
    (["model=tiny_wan_flf2v", "model.task=text_to_video"], "text_to_video", 36, 16, "model.task=image_to_video"),
    # the other direction: a 16-channel (text-to-video) transformer under WanImageToVideoPipeline
    (["model=tiny_wan_i2v", "model.architecture.transformer.in_channels=16"], "image_to_video", 16, 36,
     "fix: model.task=text_to_video (the checkpoint's task) or a checkpoint of model.task=image_to_video "
     "(transformer in_channels=36)"),
])
def test_a_denoiser_of_another_tasks_input_channels_is_refused_before_loading(tmp_path, overrides, task, have,
                                                                               want, fix):
    """A Wan transformer whose ``in_channels`` is not what the task's pipeline feeds it (text-to-video: the VAE's
    ``z_dim``; image-to-video: ``z_dim`` + the mask's temporal factor + ``z_dim``) failed every item mid-call
    ("The size of tensor a (36) must match the size of tensor b (16)") and exited 3; it is refused at startup
    (exit 2, nothing loaded), naming the channels and the task that fits."""
    loaded = []
    r = execute(tmp_path / "run", [*overrides, "dataset.limit=1"], on_loaded=loaded.append, catch=(RunnerError,))
    assert isinstance(r.error, ConfigValueError) and r.error.exit_code == 2 and not loaded, r
    msg = str(r.error)
    assert msg.startswith(f"model.task={task}: model={overrides[0][6:]}'s transformer takes in_channels={have}, "
                          f"but "), msg
    assert f"feeds it {want} (" in msg and fix in msg, msg
    assert not list(tmp_path.rglob("*.mp4"))


def test_a_component_only_another_task_builds_is_refused_before_loading(tmp_path):
    """A text-to-video Wan given an ``image_encoder`` (only image-to-video's pipeline builds one) ran and ignored it;
    it is refused at startup (exit 2, nothing loaded), naming the key, the task that builds it and the fix."""
    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_wan", "+model.architecture.image_encoder={hidden_size:32}",
                                   "dataset.limit=1"], on_loaded=loaded.append, catch=(RunnerError,))
    assert isinstance(r.error, ConfigValueError) and r.error.exit_code == 2 and not loaded, r
    assert str(r.error) == ("model.architecture.image_encoder is built only for model.task=image_to_video; this run's "
                            "task is text_to_video (model=tiny_wan), whose pipeline takes no image_encoder; fix: "
                            "remove model.architecture.image_encoder, or model.task=image_to_video")
    assert not list(tmp_path.rglob("*.mp4"))


def _video_configs():
    from pathlib import Path

    import yaml

    from models.registry import engine_class
    from models.wan import WanEngine

    root = Path(__file__).resolve().parent.parent / "conf" / "model"
    out = []
    for f in sorted(root.glob("*.yaml")):
        engine = (yaml.safe_load(f.read_text()) or {}).get("engine")
        if engine and engine != "vllm" and issubclass(engine_class(engine), WanEngine):
            out.append(f.stem)
    return out


@pytest.mark.parametrize("model", _video_configs())
def test_every_shipped_config_of_a_wan_engine_passes_the_channel_rule(compose, model):
    """The channel rule must not refuse a checkpoint in its own task: every shipped config whose engine is Wan's or a
    subclass of it (HunyuanVideo-1.5's pipeline feeds latents + condition + mask for text-to-video: the rule
    refused tiny_hunyuanvideo15 once it was written for Wan alone; CI's family sweep caught it)."""
    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    cfg = compose([f"model={model}", "platform=cpu", "model.load_format=dummy"])
    eng = engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=[], stage="denoise",
                                                      plat=detect("cpu", None), dtype=None))
    eng.resolve_source()
    eng.check_source()


def test_an_i2v_checkpoint_as_text_to_video_exits_2_on_the_command_line(tmp_path):
    """The report's command: ``model=tiny_wan_i2v model.task=text_to_video`` exits 2 with the refusal, no
    traceback, no video (it exited 3 after every item failed)."""
    from _helpers import run_module

    p = run_module("runner", ["platform=cpu", "model=tiny_wan_i2v", "model.task=text_to_video", "dataset.limit=2",
                              f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "in_channels=36" in out and "fix: model.task=image_to_video" in out, out[-3000:]
    assert "Traceback" not in out and not list(tmp_path.rglob("*.mp4"))


@pytest.mark.parametrize("overrides, key, fix", [
    (["model=toy_motion", "model.generation.fps=0"], "model.generation.fps=0 ", "fix: model.generation.fps=1"),
    (["model=toy_motion", "model.generation.num_frames=-3"], "model.generation.num_frames=-3 ",
     "fix: model.generation.num_frames=1"),
    (["model=toy_motion", "model.generation.fps=100001"], "model.generation.fps=100001 ",
     "fix: model.generation.fps=100000"),
    (["model=tiny_wan22", "model.generation.guidance_scale_2=-1"], "model.generation.guidance_scale_2=-1.0 ",
     "fix: model.generation.guidance_scale_2=3.0"),
])
def test_a_bad_generation_default_is_blamed_on_its_config_key_not_a_row(tmp_path, overrides, key, fix):
    """A ``model.generation.<field>`` value that breaks the row field's rule was reported as a row of the packaged
    rows file (``runner/data/motion.jsonl:1: field 'fps' = 0 must be a positive integer``, for a row that sets no
    fps, and no fix); it is the config key's: refused before anything loads (exit 2), naming the key and a fix."""
    loaded = []
    r = execute(tmp_path / "run", [*overrides, "dataset.limit=1"], on_loaded=loaded.append, catch=(RunnerError,))
    assert isinstance(r.error, ConfigValueError) and r.error.exit_code == 2 and not loaded, r
    msg = str(r.error)
    assert msg.startswith(key) and msg.endswith(fix), msg
    assert ".jsonl" not in msg and "field '" not in msg, msg


def test_a_rows_own_bad_value_is_still_blamed_on_its_row(tmp_path, write_jsonl):
    """The other side of the rule: a row that sets ``fps=0`` itself is named by file:line (with a fix), and a valid
    ``model.generation.fps`` default is not blamed for it."""
    from runner.core.dataset import DatasetError

    rows = write_jsonl([{"id": "a", "prompt": "a red ball moving right"},
                        {"id": "b", "prompt": "a red ball moving left", "fps": 0}])
    r = execute(tmp_path / "run", ["model=toy_motion", "dataset=jsonl", f"dataset.path={rows}"],
                catch=(RunnerError,))
    assert isinstance(r.error, DatasetError) and r.error.exit_code == 2, r
    assert str(r.error).strip().endswith(f"{rows}:2: field 'fps' = 0 must be an integer from 1 to 100000; fix: "
                                         "use e.g. 1"), str(r.error)
    assert "model.generation" not in str(r.error)


def test_a_bad_fps_default_exits_2_naming_the_key_on_the_command_line(tmp_path):
    """The report's command: ``model=toy_motion model.generation.fps=0`` names the key and the fix, exit 2."""
    from _helpers import run_module

    p = run_module("runner", ["platform=cpu", "model=toy_motion", "model.generation.fps=0", "dataset.limit=1",
                              f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "model.generation.fps=0 must be" in out and "fix: model.generation.fps=1" in out, out[-3000:]
    assert "motion.jsonl" not in out and "Traceback" not in out
