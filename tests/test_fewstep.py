"""Few-step distilled presets (issue #41): ``model.generation.shift`` acting on the scheduler with its sigmas read back
and checked, the presets' refusals of unfilled adapter paths, their lossy lane, and the toy preset
``experiment=toy_shapes_fewstep`` (the shipped 2-step adapter ``fewstep2``) gated against the base model's 16-step
run of the same rows through the real loop on CPU.

Gate floor: :data:`MIN_PSNR_DB`, between what the adapter reaches on every one of the 24 builtin captions (min
31.1 dB, mean 38.0 on the CPU) and what the base model reaches at the same 2 steps without it (min 19.7, mean 30.7;
shape 23/24); held-out figures in ``models/toy_shapes/lora/fewstep2.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

try:
    from _helpers import execute, requires_extra
except ImportError:  # tests/ imported as a package
    from tests._helpers import execute, requires_extra

from runner.core.errors import ConfigValueError, EvidenceError
from runner.tools.gate import write_gate

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[1]
FEWSTEP = REPO / "models/toy_shapes/lora/fewstep2.safetensors"
#: The PSNR floor (dB, each item against the base model's 16-step image) the toy preset's gate is run at.
MIN_PSNR_DB = 30.0

needs_adapter = pytest.mark.skipif(not FEWSTEP.is_file(), reason=f"{FEWSTEP.relative_to(REPO)} not trained yet "
                                   "(python -m models.toy_shapes.train_fewstep)")


def _read(run_dir: Path):
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """The 24 builtin captions: the base model (16 steps, its own shift), the preset, and the preset with its adapter
    at scale 0 (the base model at the preset's 2 steps and shift, still labelled the preset)."""
    from _helpers import skip_without_extra

    skip_without_extra("lora")
    if not FEWSTEP.is_file():
        pytest.skip(f"{FEWSTEP.relative_to(REPO)} not trained yet")
    root = tmp_path_factory.mktemp("fewstep")
    runs = {"base": execute(root / "base", ["model=toy_shapes"]),
            "preset": execute(root / "preset", ["model=toy_shapes", "experiment=toy_shapes_fewstep"]),
            "unadapted": execute(root / "unadapted", ["model=toy_shapes", "experiment=toy_shapes_fewstep",
                                                      "model.lora.0.scale=0"])}
    for name, r in runs.items():
        assert r.code == 0, (name, r.error)
    return root, runs


@requires_extra("lora")
@needs_adapter
def test_the_toy_preset_runs_verified_lossy_and_passes_its_gate_against_the_base_16_step_run(toy_runs):
    root, runs = toy_runs
    m = _read(runs["preset"].run_dir)
    assert m["evidence"]["verdict"] == "verified"
    assert m["lossy"]["lossy"] is True and m["lossy"]["lanes"] == ["model.distilled=toy_shapes_fewstep"]
    assert m["lossy"]["distilled"]["base"]["num_inference_steps"] == 16
    assert m["lossy"]["distilled"]["base"]["shift"] is None
    rec = runs["preset"].items[0]
    assert rec["params"]["num_inference_steps"] == 2 and rec["params"]["shift"] == 3.0
    assert rec["scheduler"]["sigmas"] == [1.0, 0.75, 0.0]      # read back from the scheduler after the call
    assert [a["name"] for a in rec["params"]["lora"]] == ["fewstep2"]
    assert m["evidence"]["stages"]["denoise"]["scheduler"]["verdict"] == "verified"
    # the oracle reads every caption's colour, shape and position in 2 steps
    acc, base_acc = m["accuracy"], _read(runs["base"].run_dir)["accuracy"]
    assert acc["n"] == 24 and all(acc[k] >= 0.95 * base_acc[k] for k in ("color", "shape", "position"))
    doc = write_gate([runs["base"].run_dir, runs["preset"].run_dir], root / "gate.json", min_psnr_db=MIN_PSNR_DB)
    (entry,) = doc["jobs"]
    assert entry["verdict"] == "pass", entry["reasons"]
    assert entry["lossless_path"] == str(runs["base"].run_dir)
    assert not any(i.get("note") for i in entry["items"]) and len(entry["items"]) == 24  # every item compared
    assert entry["psnr_db"]["min"] >= MIN_PSNR_DB


@requires_extra("lora")
@needs_adapter
def test_without_its_adapter_the_preset_fails_the_gate_that_it_passes_with_it(toy_runs):
    root, runs = toy_runs
    both = write_gate([runs["base"].run_dir, runs["preset"].run_dir, runs["unadapted"].run_dir], root / "g2.json",
                      min_psnr_db=MIN_PSNR_DB)
    by_path = {e["lossy_path"]: e for e in both["jobs"]}
    adapted, bare = by_path[str(runs["preset"].run_dir)], by_path[str(runs["unadapted"].run_dir)]
    assert adapted["verdict"] == "pass" and bare["verdict"] == "fail" and both["exit_code"] == 1
    assert any("PSNR" in r for r in bare["reasons"])
    assert adapted["psnr_db"]["mean"] >= bare["psnr_db"]["mean"] + 2.0   # dB: the adapter is what closes the gap
    # and the oracle: at 2 steps the base model draws a wrong shape on a builtin caption, the adapter none
    acc = {k: _read(runs[k].run_dir)["accuracy"]["all"] for k in ("base", "preset", "unadapted")}
    assert acc["preset"] == acc["base"] == 1.0 and acc["unadapted"] < 1.0


@requires_extra("lora")
@needs_adapter
def test_the_preset_is_unmatched_without_a_run_of_the_base_model_at_its_own_steps(toy_runs, tmp_path):
    root, runs = toy_runs
    two = execute(tmp_path / "two", ["model=toy_shapes", "model.generation.num_inference_steps=2"])
    doc = write_gate([two.run_dir, runs["preset"].run_dir], tmp_path / "gate.json", min_psnr_db=MIN_PSNR_DB)
    (entry,) = doc["jobs"]
    assert entry["verdict"] == "unmatched" and "num_inference_steps=16" in entry["reasons"][0]


@pytest.mark.parametrize("model,preset,entries", [("wan22", "wan22_lightning_4step", [0, 1]),
                                                 ("qwen_image", "qwen_image_lightning_8step", [0])])
def test_an_unfilled_preset_adapter_is_refused_at_startup_naming_the_entry_and_the_fix(tmp_path, model, preset,
                                                                                      entries):
    r = execute(tmp_path / "r", [f"model={model}", f"experiment={preset}"], catch=(ConfigValueError,))
    assert r.error is not None and r.error.exit_code == 2
    msg = str(r.error)
    for i in entries:
        assert f"model.lora[{i}].path" in msg and f"fix: model.lora.{i}.path=" in msg
    assert f"experiment={preset}" in msg and "lightx2v/" in msg
    assert not (tmp_path / "r" / "items.jsonl").exists()


def test_a_preset_naming_an_adapter_its_library_lacks_is_refused(tmp_path):
    r = execute(tmp_path / "r", ["model=toy_shapes", "experiment=toy_shapes_fewstep",
                                 "model.distilled.adapters=[fewstep3]"],
                catch=(ConfigValueError,))
    assert r.error is not None and r.error.exit_code == 2
    assert "model.distilled.adapters names 'fewstep3'" in str(r.error) and "names: fewstep2" in str(r.error)


def test_the_presets_set_steps_shift_guidance_and_name_their_adapters():
    from _helpers import compose

    wan = compose(["model=wan22", "experiment=wan22_lightning_4step"])
    assert wan.model.name == "wan22"
    g = wan.model.generation
    assert (g.num_inference_steps, g.shift, g.guidance_scale, g.guidance_scale_2) == (4, 5.0, 1.0, None)
    assert [(e.name, e.expert) for e in wan.model.lora] == [("lightning_high", "transformer"),
                                                            ("lightning_low", "transformer_2")]
    assert list(wan.model.distilled.adapters) == ["lightning_high", "lightning_low"]
    qwen = compose(["model=qwen_image", "experiment=qwen_image_lightning_8step"])
    g = qwen.model.generation
    assert (g.num_inference_steps, g.shift, g.true_cfg_scale) == (8, 3.0, 1.0)


# ------------------------------------------------------------------------------------------------ the shift
def test_shift_acts_on_the_scheduler_and_the_sigmas_it_used_are_recorded(tmp_path):
    own = execute(tmp_path / "own", ["model=toy_shapes", "dataset.limit=2", "model.generation.num_inference_steps=2"])
    s3 = execute(tmp_path / "s3", ["model=toy_shapes", "dataset.limit=2", "model.generation.num_inference_steps=2",
                                   "model.generation.shift=3.0"])
    assert own.code == 0 and s3.code == 0
    assert "scheduler" not in own.items[0] and "shift" not in own.items[0]["params"]
    assert s3.items[0]["scheduler"] == {"shift": 3.0, "sigmas": [1.0, 0.75, 0.0]}
    ev = _read(s3.run_dir)["evidence"]["stages"]["denoise"]["scheduler"]
    assert ev["verdict"] == "verified" and ev["class"] == "FlowMatchEulerDiscreteScheduler"
    from PIL import Image

    a = np.asarray(Image.open(own.run_dir / own.items[0]["file"]), dtype=np.int16)
    b = np.asarray(Image.open(s3.run_dir / s3.items[0]["file"]), dtype=np.int16)
    assert np.abs(a - b).max() > 0                                        # another schedule, other pixels
    assert _read(s3.run_dir)["lossy"]["lossy"] is False                  # a shift alone is a setting, not a lane


def test_a_shift_that_did_not_act_is_an_evidence_mismatch(tmp_path):
    def undo(engine):  # the installed scheduler falls back to FLUX's resolution-dependent shift
        engine.pipe.scheduler.register_to_config(use_dynamic_shifting=True)

    r = execute(tmp_path / "r", ["model=toy_shapes", "dataset.limit=1", "model.generation.num_inference_steps=2",
                                 "model.generation.shift=3.0"], on_loaded=undo, catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3
    assert "model.generation.shift=3 did not act" in str(r.error) and "not the evenly spaced [1.0, 0.5]" in str(r.error)


def test_shift_on_wan22_sets_flow_shift_and_moves_the_expert_switch(tmp_path):
    r = execute(tmp_path / "w", ["model=tiny_wan22", "dataset.limit=1", "model.generation.shift=5.0"])
    assert r.code == 0
    rec = r.items[0]
    assert rec["scheduler"]["sigmas"] == pytest.approx([1.0, 0.937578, 0.833611, 0.625936, 0.0], abs=1e-5)
    assert rec["params"]["expert_steps"] == {"transformer": 2, "transformer_2": 2}   # timesteps 999, 937 >= 875
    assert _read(r.run_dir)["evidence"]["stages"]["denoise"]["scheduler"]["kind"] == "flow_sigmas"


@pytest.mark.parametrize("value", [0, -1.0, "nan"])
def test_a_bad_shift_is_refused_naming_the_key_and_the_fix(tmp_path, value):
    r = execute(tmp_path / "r", ["model=toy_shapes", f"model.generation.shift={value}"], catch=(ConfigValueError,))
    assert r.error is not None and r.error.exit_code == 2
    assert "model.generation.shift=" in str(r.error) and "fix: e.g. model.generation.shift=3.0" in str(r.error)


def test_a_scheduler_without_a_flow_shift_takes_none():
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    from models.scheduler_shift import shift_kind, shifted_config

    ddim = dict(DDIMScheduler().config)
    assert shift_kind({"_class_name": "DDIMScheduler", **ddim}) is None
    with pytest.raises(ValueError, match="no flow shift"):
        shifted_config(ddim, 3.0)
    unipc = dict(UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0).config)  # has use_dynamic_shifting too
    assert shifted_config(unipc, 5.0)["flow_shift"] == 5.0
    fm = shifted_config(dict(FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift_terminal=0.02).config),
                        3.0)
    assert (fm["shift"], fm["use_dynamic_shifting"], fm["shift_terminal"]) == (3.0, False, None)


def test_an_unset_shift_leaves_the_run_identity_as_it_was():
    from _helpers import compose
    from omegaconf import OmegaConf

    from runner.core.resume import _identity_value

    cfg = OmegaConf.to_container(compose(["model=toy_shapes"]), resolve=True)
    assert "shift" not in _identity_value(cfg, "model.generation")
    cfg["model"]["generation"]["shift"] = 3.0
    assert _identity_value(cfg, "model.generation")["shift"] == 3.0


@requires_extra("lora")
def test_the_training_script_writes_a_small_adapter_and_its_report(tmp_path, monkeypatch):
    import sys

    from models.toy_shapes import train_fewstep

    out = tmp_path / "lora/fewstep2.safetensors"
    monkeypatch.setattr(sys, "argv", ["train_fewstep", "--steps", "2", "--teacher-seeds", "1", "--eval-seeds", "1",
                                      "--batch", "4", "--out", str(out), "--report", str(tmp_path / "r.json")])
    train_fewstep.main()
    report = json.loads((tmp_path / "r.json").read_text())
    assert out.stat().st_size <= 1 << 20 and report["bytes"] == out.stat().st_size
    assert set(report["eval"]) == {"n", "base_16", "base_2", "adapter_2"}
    assert report["train"]["sigmas"] == [1.0, 0.75, 0.0]
