"""Issue 42: each test asserts a rule of a feature on a case where the wrong version of the code gives another answer
(a run that does not crash but is wrong), with expectations computed here by hand or by an independent
implementation (numpy, transformers, diffusers' own offload hooks). Each test names the wrong version it kills.

Areas: conditioning inputs, run identity under quantization, LoRA fusing, the memory planner and the quantization
evidence, metrics, the two-expert schedule, audio reproduction, the gate's metric floor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
from PIL import Image

from _helpers import execute, tiny_clip
from models.toy_shapes.data import draw, quadrant_mask
from runner.core import dataset as ds
from runner.core import media

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "runner" / "data"
TOY = REPO / "models" / "toy_shapes" / "weights"


def _png(path: Path, array: np.ndarray) -> Path:
    Image.fromarray(array).save(path)
    return path


def _row(values: Dict[str, Any], w: int = 64, h: int = 64, rid: str = "x") -> Any:
    return ds.Row(id=rid, prompt="p", negative_prompt=None, seed=1, width=w, height=h, num_inference_steps=4,
                  guidance_scale=None, num_images_per_prompt=1, line=1, values=values, spec=ds.DIFFUSION_ROW)


def _rows(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------- conditioning inputs
def test_an_input_of_the_rows_area_but_another_shape_is_refused(tmp_path):
    """Kills: a size check that compares areas (``w * h``). 32x128 and 128x32 hold the 4,096 pixels of a 64x64
    row; each is refused naming both sizes, and a mask of its image's area but transposed is named too."""
    tall = _png(tmp_path / "tall.png", np.full((128, 32, 3), 200, np.uint8))  # (H, W): 32 wide, 128 high
    wide = _png(tmp_path / "wide.png", np.full((32, 128), 255, np.uint8))
    good = _png(tmp_path / "good.png", draw("red", "circle", "top left"))
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": tall.name})], tmp_path / "rows.jsonl")
    assert "is 32x128, and the row generates 64x64" in str(e.value)
    with pytest.raises(ds.DatasetError) as e:
        media.attach_inputs([_row({"image": tall.name, "mask_image": wide.name}, w=32, h=128)],
                            tmp_path / "rows.jsonl")
    msg = str(e.value)
    assert "field 'mask_image' = 'wide.png' is 128x32, its image 'tall.png' is 32x128" in msg, msg
    # the rule's own case passes: the exact size, also for a non-square row
    assert media.attach_inputs([_row({"image": tall.name}, w=32, h=128)], tmp_path / "rows.jsonl")[0].inputs
    assert media.attach_inputs([_row({"image": good.name})], tmp_path / "rows.jsonl")[0].inputs["image"].width == 64


def test_each_item_of_a_batch_gets_its_own_input_and_mask(tmp_path):
    """Kills: a batch whose call passes one item's input (or mask) for every item. ``call_inputs`` over three items
    with three different inputs gives each item exactly its own file's pixels, in batch order."""
    from diffusers import FluxInpaintPipeline

    from models.conditioning import call_inputs

    arrays = {k: draw(*a) for k, a in {"a": ("red", "circle", "top left"), "b": ("green", "triangle", "bottom left"),
                                         "c": ("blue", "square", "top right")}.items()}
    masks = {"a": quadrant_mask(0, 0), "b": quadrant_mask(32, 0), "c": quadrant_mask(0, 32)}
    items = []
    for k in arrays:
        _png(tmp_path / f"{k}.png", arrays[k]), _png(tmp_path / f"{k}_m.png", masks[k])
        row = media.attach_inputs([_row({"image": f"{k}.png", "mask_image": f"{k}_m.png"}, rid=k)],
                                  tmp_path / "rows.jsonl")[0]
        items.append(ds.Item(row=row, index=0, seed=1))
    import inspect

    params = set(inspect.signature(FluxInpaintPipeline.__call__).parameters)
    kw = call_inputs("inpaint", items, params, FluxInpaintPipeline)
    assert [np.asarray(x).tolist() == arrays[k].tolist() for x, k in zip(kw["image"], arrays)] == [True] * 3
    assert [np.array_equal(np.asarray(x), masks[k]) for x, k in zip(kw["mask_image"], masks)] == [True] * 3
    assert kw["strength"] == 0.6  # FluxInpaintPipeline's default, as the row sets none


@pytest.fixture(scope="module")
def img2img_first_latents():
    """The first forward's latents of a real toy_shapes FluxImg2ImgPipeline call over two items (CPU, 4 steps)."""
    from diffusers import FluxImg2ImgPipeline

    from models.conditioning import SequenceProbe

    pipe = FluxImg2ImgPipeline.from_pretrained(TOY, local_files_only=True, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    probe = SequenceProbe(pipe.transformer)
    probe.arm(keep=True)
    imgs = [Image.open(DATA / f"{n}.png").convert("RGB") for n in ("shapes_input_red_circle_top_left",
                                                                    "shapes_input_blue_square_top_right",
                                                                    "shapes_input_green_triangle_bottom_left")]
    with torch.inference_mode():
        pipe(prompt=["a green triangle in the center on a white background"] * 2, image=imgs[:2], strength=0.25,
             num_inference_steps=16, height=64, width=64, max_sequence_length=16, output_type="np",
             generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    return pipe, imgs, probe.hidden, probe.timestep


def test_first_latents_check_fails_a_batch_where_only_one_item_has_its_own_input(img2img_first_latents):
    """Kills: a first-latents verdict that looks at one item of the batch (or at any). Item 0 checked against its
    own input, item 1 against a third image: item 0's statistic is ~1, item 1's is not, and the verdict is mismatch;
    the same with the wrong input on item 0."""
    from models.conditioning import first_latents_check

    pipe, imgs, hidden, t = img2img_first_latents
    own = first_latents_check(pipe, imgs[:2], hidden, t, 64, 64)
    lo, hi = own["range"]
    assert own["verdict"] == "verified" and all(lo <= s <= hi for s in own["statistic"]), own
    for wrong in ([imgs[0], imgs[2]], [imgs[2], imgs[1]]):
        half = first_latents_check(pipe, wrong, hidden, t, 64, 64)
        inside = [lo <= s <= hi for s in half["statistic"]]
        assert sorted(inside) == [False, True] and half["verdict"] == "mismatch", half


def test_an_input_changed_after_the_startup_check_fails_its_item_alone(tmp_path):
    """Kills: an input read again at generation without checking it against the sha256 recorded at startup. The
    file of row b is replaced after the weights loaded: b fails with the reason, a and c are generated, and b's
    record does not claim the new bytes."""
    d = tmp_path / "in"
    d.mkdir()
    for k, attrs in {"a": ("red", "circle", "top left"), "b": ("green", "triangle", "bottom left"),
                     "c": ("blue", "square", "top right")}.items():
        _png(d / f"{k}.png", draw(*attrs))
    rows = _rows(d / "rows.jsonl", [{"id": k, "prompt": "a yellow circle in the center on a white background",
                                     "image": f"{k}.png", "strength": 0.25} for k in "abc"])

    def swap(_engine):
        _png(d / "b.png", draw("yellow", "square", "bottom right"))

    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl",
                                   f"dataset.path={rows}", "batch_size=3"], on_loaded=swap)
    status = {rec["key"]: rec["status"] for rec in r.items}
    assert status == {"a": "ok", "b": "failed", "c": "ok"}, status
    b = next(rec for rec in r.items if rec["key"] == "b")
    assert "changed since the startup check" in b["reason"] and str(d / "b.png") in b["reason"], b["reason"]
    # the direct rule: the recorded input loads while unchanged and is refused once changed
    row = media.attach_inputs([_row({"image": "a.png"})], d / "rows.jsonl")[0]
    assert np.array_equal(np.asarray(media.load_input(row.inputs["image"])), draw("red", "circle", "top left"))
    _png(d / "a.png", draw("red", "circle", "top right"))
    with pytest.raises(media.InputChangedError, match="changed since the startup check"):
        media.load_input(row.inputs["image"])
    (d / "a.png").unlink()
    with pytest.raises(media.InputChangedError, match="cannot be read any more"):
        media.load_input(row.inputs["image"])


def test_a_changed_mask_changes_the_item_identity_and_resume_regenerates_it(tmp_path):
    """Kills: an item identity (``inputs_sha256``) that holds the image's bytes but not the mask's. Two items that
    differ only in the mask's bytes have different identities (a renamed mask of the same bytes has the same);
    end to end, a resume after one row's mask changed regenerates that row and reuses the other."""
    from runner.core.resume import inputs_sha256

    _png(tmp_path / "img.png", draw("red", "circle", "top left"))
    _png(tmp_path / "m1.png", quadrant_mask(0, 0))
    shutil.copy(tmp_path / "m1.png", tmp_path / "m1_renamed.png")
    _png(tmp_path / "m2.png", quadrant_mask(32, 32))

    def ident(mask):
        row = media.attach_inputs([_row({"image": "img.png", "mask_image": mask})], tmp_path / "rows.jsonl")[0]
        return inputs_sha256("run", ds.Item(row=row, index=0, seed=1))

    assert ident("m1.png") == ident("m1_renamed.png") != ident("m2.png")

    d = tmp_path / "in"
    d.mkdir()
    for k, (x, y) in {"a": (0, 0), "b": (32, 0)}.items():
        _png(d / f"{k}.png", draw("green", "square", "center"))
        _png(d / f"{k}_mask.png", quadrant_mask(x, y))
    rows = _rows(d / "rows.jsonl", [{"id": k, "prompt": "a red circle in the center on a white background",
                                     "image": f"{k}.png", "mask_image": f"{k}_mask.png"} for k in "ab"])
    over = ["model=toy_shapes", "model.task=inpaint", "dataset=jsonl", f"dataset.path={rows}",
            "model.generation.num_inference_steps=4"]
    first = execute(tmp_path / "run", over)
    assert first.code == 0, first.error
    before = {rec["key"]: rec for rec in first.items}
    _png(d / "b_mask.png", quadrant_mask(0, 32))
    again = execute(tmp_path / "run", over)
    assert again.code == 0, again.error
    assert (again.manifest["counts"]["ok"], again.manifest["counts"]["reused"]) == (1, 1)
    after = {rec["key"]: rec for rec in again.items}
    assert after["a"]["file_sha256"] == before["a"]["file_sha256"]
    assert after["b"]["inputs"]["mask_image"]["sha256"] != before["b"]["inputs"]["mask_image"]["sha256"]
    out = np.asarray(Image.open(again.run_dir / after["b"]["file"]).convert("RGB"))
    keep = quadrant_mask(0, 32) < 128  # the overlay keeps the input outside the NEW mask
    assert np.array_equal(out[keep], draw("green", "square", "center")[keep])
