"""Media as a field property (issue #39): a row field that declares ``media=Media(...)`` is an input file everywhere
(``runner.core.media`` reads the row's spec, no list of field names). Proven with a test-only family whose spec adds
``control_image`` as ONE ``Field`` and nothing else: a missing file is refused before the model loads, the file's
sha256 (not its path) is in the item identity, the record carries it under ``inputs``, and ``runner.repro`` refuses
the run once the file changed."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runner.core import dataset as ds
from runner.core.media import Media

pytestmark = pytest.mark.cpu

#: The one declaration the family adds.
CONTROL = ds.Field("control_image", str, identity="set", parse=ds.parse_image, media=Media("RGB"), kind="a path")
ARGS = ["dataset=jsonl", "model.engine=flux_control_test", "model.name=tiny_flux_control", "evidence.profile=false",
        "model.generation.num_inference_steps=2"]


@pytest.fixture
def control_family():
    from models.flux import FLUX
    from models.registry import register_family, unregister_family

    register_family(dataclasses.replace(FLUX, name="flux_control_test", row_fields=(CONTROL,)))
    yield
    unregister_family("flux_control_test")


def _png(path: Path, value: int) -> Path:
    Image.fromarray(np.full((64, 64, 3), value, np.uint8)).save(path)
    return path


def _rows(path: Path, control: str) -> Path:
    path.write_text(json.dumps({"id": "a", "prompt": "a red circle", "seed": 3, "width": 64, "height": 64,
                                "control_image": control}) + "\n")
    return path


def test_a_missing_control_image_is_refused_before_loading(control_family, run_job, tmp_path):
    from runner.core.errors import DatasetError

    rows = _rows(tmp_path / "rows.jsonl", "missing.png")
    with pytest.raises(DatasetError) as e:
        run_job([*ARGS, f"dataset.path={rows}"], name="missing")
    assert e.value.problems == [
        f"{rows}:1: field 'control_image' = 'missing.png' does not exist (resolved to {tmp_path / 'missing.png'}); "
        "fix: give the path of an existing file (relative paths start at the dataset file's folder, or at "
        "dataset.media_root when set)"]
    assert not list((tmp_path / "missing").glob("images/*"))


def test_a_control_image_is_hashed_recorded_and_checked_by_repro(control_family, run_job, tmp_path):
    from runner.tools import repro

    ctl = _png(tmp_path / "c.png", 40)
    first = run_job([*ARGS, f"dataset.path={_rows(tmp_path / 'rows.jsonl', 'c.png')}"], name="first")
    assert first.code == 0, first.manifest.get("error")
    (rec,) = first.items
    sha = hashlib.sha256(ctl.read_bytes()).hexdigest()
    assert rec["inputs"]["control_image"]["sha256"] == sha and rec["inputs"]["control_image"]["path"] == str(ctl)
    assert rec["inputs"]["control_image"]["input_mode"] == "RGB" and "control_image" not in rec["params"]

    # the identity holds the bytes, not the path: a copy under another name computes the same item ...
    (tmp_path / "other").mkdir()
    same = (tmp_path / "other" / "renamed.png")
    same.write_bytes(ctl.read_bytes())
    renamed = run_job([*ARGS, f"dataset.path={_rows(tmp_path / 'other' / 'rows.jsonl', 'renamed.png')}"],
                      name="renamed")
    assert renamed.code == 0 and renamed.items[0]["inputs_sha256"] == rec["inputs_sha256"]
    # ... and other bytes under the first name another one
    (tmp_path / "third").mkdir()
    _png(tmp_path / "third" / "c.png", 41)
    changed = run_job([*ARGS, f"dataset.path={_rows(tmp_path / 'third' / 'rows.jsonl', 'c.png')}"], name="changed")
    assert changed.code == 0 and changed.items[0]["inputs_sha256"] != rec["inputs_sha256"]

    repro.check_inputs(first.run_dir)  # unchanged: reproducible
    _png(ctl, 42)
    with pytest.raises(repro.ReproInputError, match=rf"{ctl} \(control_image of item a\): sha256 "):
        repro.check_inputs(first.run_dir)


def test_the_media_tables_are_the_fields_declarations():
    """No second list: the media fields and the tasks that take them are read off the row spec."""
    from runner.core import media

    assert media.media_fields(ds.DIFFUSION_ROW) == {"image": Media("RGB"), "mask_image": Media("L", mask=True),
                                                     "last_image": Media("RGB")}
    spec = ds.DIFFUSION_ROW.extend("x", CONTROL)
    assert list(media.media_fields(spec)) == ["image", "mask_image", "last_image", "control_image"]
    assert ds.task_inputs(ds.DIFFUSION_ROW) == ds.TASK_INPUTS == {
        "image_to_image": {"image": True, "strength": False}, "inpaint": {"image": True, "mask_image": True,
                                                                          "strength": False},
        "edit": {"image": True}, "image_to_video": {"image": True, "last_image": False}}


def test_one_digest_function_reads_inputs_and_records(tmp_path):
    """``media.digests`` gives the same ``{field: sha256}`` from a row's checked inputs and from their records, and
    resume names a media input whose recorded sha256 is not the file's now (the first reason it does not reuse)."""
    from runner.core import media
    from runner.core import resume as rs

    _png(tmp_path / "c.png", 40)
    row = ds.Row(id="a", prompt="p", negative_prompt=None, seed=1, width=64, height=64, num_inference_steps=2,
                 guidance_scale=None, num_images_per_prompt=1, line=1, values={"control_image": "c.png"},
                 spec=ds.DIFFUSION_ROW.extend("x", CONTROL))
    (row,) = media.attach_inputs([row], tmp_path / "rows.jsonl")
    recorded = media.records(row.inputs)
    sha = hashlib.sha256((tmp_path / "c.png").read_bytes()).hexdigest()
    assert media.digests(row.inputs) == media.digests(recorded) == {"control_image": sha}
    item = ds.Item(row=row, index=0, seed=1)
    stale = {"control_image": {**recorded["control_image"], "sha256": "0" * 64}}
    assert rs.why_not_reused({"seed": 1, "inputs": stale}, item, False) == "input control_image changed"
    assert rs.why_not_reused({"seed": 1, "inputs": recorded}, item, False) == "no inputs_sha256 recorded"
