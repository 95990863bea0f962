"""``model=flux model.path=<dir>``: a diffusers snapshot written by ``save_pretrained`` loads and runs through the
same code as a downloaded checkpoint; a path that is not a snapshot is refused before anything loads."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from models.flux import ModelPathError

SMALL = ["model.generation.width=128", "model.generation.height=128", "model.generation.num_inference_steps=2",
         "model.generation.max_sequence_length=64", "dataset.limit=2"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_flux_loads_saved_snapshot(run_job, tiny_snapshot):
    r = run_job(["model=flux", f"model.path={tiny_snapshot}", *SMALL], "flux_path")
    assert r.code == 0
    m = r.manifest
    assert m["status"] == "completed" and (m["counts"]["ok"], m["counts"]["failed"]) == (2, 0)
    assert m["config"]["model"]["name"] == "flux"
    src = m["model"]["source"]
    assert src["kind"] == "path"
    assert Path(src["path"]).resolve() == tiny_snapshot.resolve()
    on_disk = sorted(str(f.relative_to(tiny_snapshot)) for f in tiny_snapshot.rglob("*.safetensors"))
    assert on_disk and sorted(src["files"]) == on_disk
    for rel, digest in src["files"].items():
        assert digest == _sha(tiny_snapshot / rel), rel
    for it in r.items:
        assert it["status"] == "ok"
        assert (it["params"]["width"], it["params"]["height"], it["params"]["num_inference_steps"]) == (128, 128, 2)
        assert it["file_sha256"] == _sha(r.run_dir / it["file"])

    # The snapshot holds tiny_flux's weights: loaded from the path, they give tiny_flux's images (the same pixels;
    # the PNG text chunks name the model, flux vs tiny_flux)
    import io

    import numpy as np
    from PIL import Image

    ref = run_job(["model.generation.num_inference_steps=2", "dataset.limit=2"], "tiny_ref")
    assert set(ref.pngs()) == set(r.pngs())
    for key, data in r.pngs().items():
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))),
                              np.asarray(Image.open(io.BytesIO(ref.pngs()[key])))), key


def test_nonexistent_model_path_refused(compose, tmp_path):
    from runner.app.execute import run

    missing = tmp_path / "no" / "such" / "snapshot"
    run_dir = tmp_path / "run"
    ov = ["platform=cpu", "model=flux", f"model.path={missing}", *SMALL]
    with pytest.raises(ModelPathError, match="does not exist"):
        run(compose(ov), run_dir, ov)
    assert not (run_dir / "manifest.json").exists()


def test_dir_without_model_index_refused(compose, tmp_path, tiny_snapshot):
    """A real model folder that is not a pipeline root (the snapshot's ``transformer/``) is refused."""
    from runner.app.execute import run

    component = tiny_snapshot / "transformer"
    assert any(component.glob("*.safetensors")) and not (component / "model_index.json").exists()
    run_dir = tmp_path / "run"
    for path in (component, tmp_path / "empty"):
        path.mkdir(exist_ok=True)
        ov = ["platform=cpu", "model=flux", f"model.path={path}", *SMALL]
        with pytest.raises(ModelPathError, match="model_index.json"):
            run(compose(ov), run_dir, ov)
        assert not (run_dir / "manifest.json").exists()


def test_flux_without_weights_refused(compose, tmp_path):
    """``model=flux`` with neither a path nor ``load_format=dummy`` says what to set, before loading."""
    from runner.app.execute import run

    run_dir = tmp_path / "run"
    ov = ["platform=cpu", "model=flux", *SMALL]
    with pytest.raises(ValueError, match="model.path"):
        run(compose(ov), run_dir, ov)
    assert not (run_dir / "manifest.json").exists()


# regression: bug: with model.path (the default toy_shapes too) model.architecture.* was silently ignored, and the
# manifest recorded e.g. transformer.num_layers=7 for a 2-layer snapshot; a typo (num_layerz) was accepted
@pytest.mark.parametrize("override,named", [
    ("model.architecture.transformer.num_layers=7", "num_layers=7: the snapshot's transformer/config.json says 2"),
    ("+model.architecture.transformer.num_layerz=5", "num_layerz is not a parameter"),
])
def test_architecture_override_that_the_snapshot_contradicts_is_refused(compose, tmp_path, monkeypatch, override,
                                                                        named):
    import models.flux as flux
    from runner.core.errors import ConfigValueError
    from runner.app.execute import run

    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", lambda self: pytest.fail("the model was loaded"))
    ov = ["platform=cpu", "model=toy_shapes", "dataset.limit=1", override]
    with pytest.raises(ConfigValueError, match=named):
        run(compose(ov), tmp_path / "run", ov)
