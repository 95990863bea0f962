"""Records that say what ran (issue 38, "Records that claim what did not run"; ../shared/cases C27-C31): a value that
does not act is recorded as ignored, never as applied; what ran is recorded per item; an artifact's bytes hold what
determines them and not the batch it ran in.

Real runs on CPU (toy_shapes, tiny_wan22, the toy LoRA library of tests/test_lora.py), with hand-computed
expectations: diffusers' ``get_timesteps`` (16 steps at strength 0.05 run 1, at 0.5 run 8), Wan 2.2's expert switch
(tiny_wan22: ``boundary_ratio`` 0.875 x 1000; its UniPC schedule's first timestep is 999, so 1 step runs only the
high-noise ``transformer``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from PIL import Image

from _helpers import execute

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "runner" / "data"


def _rows(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------- C28: steps actually run
def test_image_to_image_records_the_steps_each_item_ran_beside_the_requested(tmp_path):
    """C28: two rows differing only in strength, 16 steps requested: 0.05 runs 1 denoising step, 0.5 runs 8
    (``16 - int(16 - 16 * s)``). Each record and each PNG's ``parameters`` say so per item (a run-level total, or
    ``num_inference_steps`` alone, cannot tell the two apart), and the evidence's forward count agrees (1 + 8)."""
    src = DATA / "shapes_input_red_circle_top_left.png"
    rows = _rows(tmp_path / "rows.jsonl", [
        {"id": "s005", "prompt": "a blue square in the bottom right on a white background", "image": str(src),
         "strength": 0.05, "seed": 7},
        {"id": "s05", "prompt": "a blue square in the bottom right on a white background", "image": str(src),
         "strength": 0.5, "seed": 7}])
    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl",
                                   f"dataset.path={rows}", "model.generation.num_inference_steps=16"])
    assert r.code == 0, r.error
    recs = {rec["id"]: rec for rec in r.items}
    assert {k: (v["params"]["num_inference_steps"], v["params"]["steps_run"]) for k, v in recs.items()} == {
        "s005": (16, 1), "s05": (16, 8)}
    for rec in recs.values():
        text = json.loads(Image.open(r.run_dir / rec["file"]).text["parameters"])
        assert text["steps_run"] == rec["params"]["steps_run"] and text["num_inference_steps"] == 16
    assert r.manifest["evidence"]["stages"]["denoise"]["denoiser_forwards"] == 9


# ------------------------------------------------------------------------------------- batch composition
def test_png_bytes_do_not_depend_on_the_batch_but_the_record_keeps_it(tmp_path):
    """The same PNG payload (pixels, prompt, seed, params) written from records that differ only in ``batch_size``
    gives identical bytes; ``batch_size`` stays in the record (and metadata.jsonl), and LoRA names stay out of the
    bytes (the adapter is its sha256 and scale)."""
    from models.base import ImageOutput
    from runner.core.sinks import ImageSink, embedded_fields

    img = np.random.default_rng(0).random((8, 8, 3)).astype(np.float32)
    lora = [{"name": "x", "sha256": "a" * 64, "scale": 1.0}]
    shas = []
    for i, (bs, name) in enumerate([(1, "x"), (4, "x"), (4, "y")]):
        out = tmp_path / f"d{i}"
        sink = ImageSink(out, model="toy")
        params = {"width": 8, "height": 8, "batch_size": bs, "lora": [{**lora[0], "name": name}]}
        sink.submit({"id": "a", "key": "a", "prompt": "p", "seed": 1, "params": params}, ImageOutput(img))
        sink.close()
        rec = json.loads((out / "items.jsonl").read_text().splitlines()[0])
        assert rec["params"]["batch_size"] == bs and rec["params"]["lora"][0]["name"] == name  # kept in the record
        text = Image.open(out / rec["file"]).text
        assert "batch_size" not in json.loads(text["parameters"])
        assert json.loads(text["parameters"])["lora"] == [{"sha256": "a" * 64, "scale": 1.0}]
        shas.append(rec["file_sha256"])
    assert len(set(shas)) == 1, shas
    assert "batch_size" not in embedded_fields({"params": {"batch_size": 2}}, None)["parameters"]


def test_the_same_item_at_batch_1_and_4_has_equal_bytes_where_its_pixels_are_equal(tmp_path):
    """End to end (toy_shapes, 4 rows): where an item's decoded pixels at batch 4 equal those at batch 1, the files
    are byte-identical; the records keep their ``batch_size`` (1 and 4) and ``batch``."""
    one = execute(tmp_path / "b1", ["model=toy_shapes", "dataset.limit=4", "model.generation.num_inference_steps=2",
                                    "batch_size=1"])
    four = execute(tmp_path / "b4", ["model=toy_shapes", "dataset.limit=4", "model.generation.num_inference_steps=2",
                                     "batch_size=4"])
    assert one.code == four.code == 0
    a, b = {r["key"]: r for r in one.items}, {r["key"]: r for r in four.items}
    same = 0
    for k in a:
        assert a[k]["params"]["batch_size"] == 1 and b[k]["params"]["batch_size"] == 4
        pa = np.asarray(Image.open(one.run_dir / a[k]["file"]).convert("RGB"))
        pb = np.asarray(Image.open(four.run_dir / b[k]["file"]).convert("RGB"))
        if np.array_equal(pa, pb):
            same += 1
            assert a[k]["file_sha256"] == b[k]["file_sha256"], k
    assert same, "no item had equal pixels at both batch sizes: the case does not test the bytes"


# ------------------------------------------------------------------------------------- C29: a no-op mask
def test_inpaint_records_the_pixels_each_mask_repaints_and_warns_of_a_mask_that_selects_none(tmp_path, caplog):
    """C29: two rows differing only in the mask: all black (0 of 64x64 pixels >= 128) and all white (4096). Each
    record says how many pixels its mask repaints; the all-black row is warned about at startup (naming its line),
    and its output is its input byte for byte (the overlay keeps everything outside an empty mask)."""
    src = DATA / "shapes_input_red_circle_top_left.png"
    Image.new("L", (64, 64), 0).save(tmp_path / "black.png")
    Image.new("L", (64, 64), 255).save(tmp_path / "white.png")
    rows = _rows(tmp_path / "rows.jsonl", [
        {"id": "black", "prompt": "a blue square in the bottom right on a white background", "image": str(src),
         "mask_image": "black.png", "seed": 3},
        {"id": "white", "prompt": "a blue square in the bottom right on a white background", "image": str(src),
         "mask_image": "white.png", "seed": 3}])
    with caplog.at_level("WARNING", logger="runner"):
        r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=inpaint", "dataset=jsonl",
                                       f"dataset.path={rows}", "model.generation.num_inference_steps=2"])
    assert r.code == 0, r.error
    recs = {rec["id"]: rec for rec in r.items}
    assert recs["black"]["inputs"]["mask_image"]["repaint_pixels"] == 0
    assert recs["white"]["inputs"]["mask_image"]["repaint_pixels"] == 64 * 64
    assert "repaint_pixels" not in recs["black"]["inputs"]["image"]
    warned = [m for m in caplog.messages if "selects no pixel to repaint" in m]
    assert len(warned) == 1 and f"{rows}:1 (black)" in warned[0] and ":2 (white)" not in warned[0], caplog.messages
    out = np.asarray(Image.open(r.run_dir / recs["black"]["file"]).convert("RGB"))
    assert np.array_equal(out, np.asarray(Image.open(src).convert("RGB")))
    out = np.asarray(Image.open(r.run_dir / recs["white"]["file"]).convert("RGB"))
    assert not np.array_equal(out, np.asarray(Image.open(src).convert("RGB")))


def test_a_mask_given_as_grey_rgb_counts_pixels_by_the_pipelines_binarisation(tmp_path):
    """The count follows the pipeline's threshold (>= 128 of the mask as L), whatever mode the file has: 127 is
    kept, 128 is repainted."""
    from runner.core import media

    a = np.zeros((8, 8, 3), np.uint8)
    a[0, :3] = 128  # 3 pixels at the threshold: repainted
    a[1, :5] = 127  # 5 just below: kept
    Image.fromarray(a).save(tmp_path / "m.png")
    from runner.core.dataset import DIFFUSION_ROW

    mask = DIFFUSION_ROW.by_name["mask_image"].media  # the field's declared kind: a mask, mode L
    inp, why = media.check_input("mask_image", "m.png", tmp_path / "rows.jsonl", None, media.MAX_INPUT_PIXELS, mask)
    assert why is None and inp.repaint_pixels == 3 and inp.record()["repaint_pixels"] == 3
    img, _ = media.check_input("image", "m.png", tmp_path / "rows.jsonl", None, media.MAX_INPUT_PIXELS)
    assert img.repaint_pixels is None and "repaint_pixels" not in img.record()


# ------------------------------------------------------------------------------------- C27: an expert that never runs
def _wan_rows(tmp_path: Path, field: str, values: List[float], **more: Any) -> Path:
    return _rows(tmp_path / f"{field}.jsonl", [{"id": f"v{i}", "prompt": "a red cube", "seed": 5, field: v, **more}
                                               for i, v in enumerate(values)])


@pytest.mark.parametrize("schedule, steps", [([], 1), (["model.architecture.pipeline.boundary_ratio=0.5"], 4)],
                         ids=["1-step", "boundary-0.5"])
def test_guidance_scale_2_on_a_low_noise_expert_that_runs_no_step_is_recorded_ignored(tmp_path, schedule, steps):
    """C27: tiny_wan22, two rows differing only in ``guidance_scale_2`` (9.0, 1.5). At 1 step (timestep 999 >= 875)
    or at 4 steps with ``boundary_ratio`` 0.5 (999, 900, 750, 500 >= 500) only ``transformer`` runs: the videos are
    equal, and each record says ``guidance_scale_2: null`` with its value under ``ignored``, the steps per expert
    agreeing with the evidence's own schedule. The default mode refuses the rows (file:line, why, fix)."""
    from runner.core.errors import RunnerError

    rows = _wan_rows(tmp_path, "guidance_scale_2", [9.0, 1.5])
    base = ["model=tiny_wan22", "dataset=jsonl", f"dataset.path={rows}",
            f"model.generation.num_inference_steps={steps}", *schedule]
    r = execute(tmp_path / "refused", base, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2, r
    msg = str(r.error)
    assert f"{rows}:1: field 'guidance_scale_2' = 9.0" in msg and f"{rows}:2: field 'guidance_scale_2' = 1.5" in msg
    assert "transformer_2 (the low-noise expert whose scale it is) runs no step" in msg and "fix:" in msg
    r = execute(tmp_path / "run", [*base, "dataset.on_ignored=record"])
    assert r.code == 0, r.error
    assert r.manifest["evidence"]["verdict"] == "verified"
    ex = r.manifest["evidence"]["stages"]["denoise"]["experts"]
    assert ex["expected_forwards"] == {"transformer": 2 * 2 * steps}  # 2 items, CFG; transformer_2: none
    recs = {rec["id"]: rec for rec in r.items}
    assert recs["v0"]["frames_sha256"] == recs["v1"]["frames_sha256"]
    for rec, v in ((recs["v0"], 9.0), (recs["v1"], 1.5)):
        assert rec["params"]["guidance_scale_2"] is None and rec["params"]["guidance_scale"] == 4.0
        assert rec["params"]["expert_steps"] == {"transformer": steps, "transformer_2": 0}
        assert rec["ignored"]["guidance_scale_2"]["value"] == v
        assert "runs no step" in rec["ignored"]["guidance_scale_2"]["why"]


def test_a_model_default_guidance_scale_2_is_recorded_ignored_where_its_expert_runs_no_step(tmp_path):
    """tiny_wan22's own ``model.generation.guidance_scale_2`` (3.0) is not refused (it applies to rows whose
    low-noise expert runs), but a row at 1 step records it as ignored, from the config key; at 4 steps it applies."""
    r = execute(tmp_path / "run", ["model=tiny_wan22", "dataset=jsonl",
                                   f"dataset.path={_wan_rows(tmp_path, 'num_inference_steps', [1, 4])}"])
    assert r.code == 0, r.error
    recs = {rec["id"]: rec for rec in r.items}
    assert recs["v0"]["params"]["guidance_scale_2"] is None
    assert recs["v0"]["ignored"]["guidance_scale_2"] == {
        "value": 3.0, "from": "model.generation.guidance_scale_2",
        "why": recs["v0"]["ignored"]["guidance_scale_2"]["why"]}
    assert recs["v1"]["params"]["guidance_scale_2"] == 3.0 and "ignored" not in recs["v1"]
    assert recs["v1"]["params"]["expert_steps"] == {"transformer": 2, "transformer_2": 2}


def test_guidance_scale_on_a_high_noise_expert_that_runs_no_step_is_recorded_ignored(tmp_path):
    """The same kind for ``guidance_scale``: with ``boundary_ratio`` 1.0 (boundary 1000 > every timestep) only
    ``transformer_2`` runs, at ``guidance_scale_2`` (2.0); rows differing only in ``guidance_scale`` (5.0, 7.0)
    give equal videos, so each records ``guidance_scale: null`` and the value under ``ignored`` (it reached the
    pipeline only as guidance's switch: two forwards per step); the default mode refuses them."""
    from runner.core.errors import RunnerError

    rows = _wan_rows(tmp_path, "guidance_scale", [5.0, 7.0], guidance_scale_2=2.0)
    base = ["model=tiny_wan22", "dataset=jsonl", f"dataset.path={rows}", "model.generation.num_inference_steps=2",
            "model.architecture.pipeline.boundary_ratio=1.0"]
    r = execute(tmp_path / "refused", base, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2, r
    assert f"{rows}:1: field 'guidance_scale' = 5.0" in str(r.error) and f"{rows}:2:" in str(r.error)
    r = execute(tmp_path / "run", [*base, "dataset.on_ignored=record"])
    assert r.code == 0, r.error
    ex = r.manifest["evidence"]["stages"]["denoise"]["experts"]
    assert ex["expected_forwards"] == {"transformer_2": 2 * 2 * 2}  # 2 items, 2 steps, CFG; transformer: none
    recs = {rec["id"]: rec for rec in r.items}
    assert recs["v0"]["frames_sha256"] == recs["v1"]["frames_sha256"]
    for rec, v in ((recs["v0"], 5.0), (recs["v1"], 7.0)):
        assert rec["params"]["guidance_scale"] is None and rec["params"]["guidance_scale_2"] == 2.0
        assert rec["params"]["expert_steps"] == {"transformer": 0, "transformer_2": 2}
        assert rec["ignored"]["guidance_scale"]["value"] == v and "guidance_scale_2" not in rec["ignored"]


# ------------------------------------------------------------------------------- C30: an adapter that changes nothing
@pytest.mark.parametrize("how", ["fused", "unfused", "per_row"])
def test_an_adapter_whose_lora_b_are_zero_fails_the_evidence_on_every_path(tmp_path, how):
    """C30: one input, one verdict. The toy adapter of tests/test_lora.py with every ``lora_B`` zero changes no
    output; fused it was already exit 3 ("did not change"), and unfused or switched per row it must be too (the hook
    sees its branch run, which is not the same as changing anything). The same adapter with its ``lora_B`` kept
    passes every path (its control: test_lora.py)."""
    from safetensors.torch import load_file, save_file
    from test_lora import MODULES, ROWS, library, run, write_adapter

    from runner.core.errors import EvidenceError

    path = write_adapter(tmp_path / "zero.safetensors", 3)
    save_file({k: (v * 0 if "lora_B" in k else v) for k, v in load_file(str(path)).items()}, str(path),
              metadata={"format": "pt"})
    rows = ROWS[:1]
    extra = {"fused": ["model.lora_fuse=fused"], "unfused": ["model.lora_fuse=unfused"], "per_row": []}[how]
    if how == "per_row":  # two adapter sets (the zero adapter, none): switched between batches
        rows = [{**ROWS[0], "lora": "zero"}, {**ROWS[1], "lora": []}]
    r = run(tmp_path, how, rows, library({"name": "zero", "path": path}), *extra, catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3, (how, r.code)
    ev = r.manifest["evidence"]["stages"]["denoise"]["lora"]
    assert ev["mode"] == ("fused" if how == "fused" else "per_batch")
    if how == "fused":
        assert sorted(ev["fused"]["changed_nothing"]) == sorted(MODULES)
    else:
        assert ev["verdict"] == "mismatch" and "changes nothing" in str(r.error)
        assert ev["changed_nothing"] == [{"set": [["zero", 1.0]], "layers": sorted(MODULES)}]


# ------------------------------------------------------------------------------------- C31: identity by content
@pytest.mark.parametrize("named", [True, False], ids=["name-kept", "default-name"])
def test_a_renamed_adapter_file_is_a_recorded_rename_not_a_conflict_nor_a_regeneration(tmp_path, named):
    """C31: the same adapter file renamed (x.safetensors -> y.safetensors), resumed into the same run dir: no
    refusal, nothing regenerated (the identity holds its sha256 and scale), the manifest records the rename (from ->
    to); with the default name (the file stem: x -> y) as well. A different adapter under the old name regenerates
    every item (and is no conflict either: its sha256 is a new identity)."""
    from test_lora import ROWS, library, run, write_adapter

    x = write_adapter(tmp_path / "x.safetensors", 1)
    entry = {"name": "x"} if named else {}
    first = run(tmp_path, "res", ROWS, library({**entry, "path": x}))
    assert first.code == 0
    files = {r["key"]: (r["file_sha256"], (first.run_dir / r["file"]).stat().st_mtime_ns) for r in first.items}
    y = x.rename(tmp_path / "y.safetensors")
    again = run(tmp_path, "res", ROWS, library({**entry, "path": y}))
    assert again.code == 0 and again.manifest["counts"]["reused"] == 2
    assert {r["key"]: (r["file_sha256"], (again.run_dir / r["file"]).stat().st_mtime_ns) for r in again.items} == files
    sha = _sha(y)
    assert again.manifest["resumed_from"]["lora_renamed"] == [{
        "sha256": sha, "from": {"name": "x", "path": str(x.resolve())},
        "to": {"name": "x" if named else "y", "path": str(y.resolve())}}]
    assert again.manifest["identity"]["sha256"] == first.manifest["identity"]["sha256"]
    write_adapter(y, 7)  # another adapter under the same path and name
    other = run(tmp_path, "res", ROWS, library({**entry, "path": y}))
    assert other.code == 0 and other.manifest["counts"]["reused"] == 0
    assert "lora_renamed" not in other.manifest["resumed_from"]
    assert all(r["params"]["lora"][0]["sha256"] == _sha(y) != sha for r in other.items)
