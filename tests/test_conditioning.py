"""Conditioning inputs from dataset rows (issue 30): ``model.task`` per family spec, the ``image`` / ``mask_image`` /
``strength`` row fields, every bad input refused before any weight loads, inputs in the item identity (resume,
repro), the strength forward rule and the Kontext reference tokens observed, the inpaint overlay.

Runs the real toy_shapes (FLUX img2img / inpaint pipelines) and tiny_flux (FluxKontextPipeline) on CPU."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _helpers import import_extra, skip_without_extra  # noqa: E402
from _helpers import execute
from models.conditioning import steps_run
from models.toy_shapes.data import conditioning_inputs, draw, quadrant_mask
from runner.core import dataset as ds
from runner.core import media
from runner.core.dataset import DatasetError
from runner.core.errors import RunnerError

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "runner" / "data"


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-12))


def _png(path: Path, array: np.ndarray) -> Path:
    Image.fromarray(array).save(path)
    return path


def _rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(tmp_path: Path, overrides) -> RunnerError:
    """A run that must stop at startup: exit 2, no weights loaded (``on_loaded`` never called), nothing written."""
    loaded = []
    r = execute(tmp_path / "run", list(overrides), on_loaded=lambda e: loaded.append(e),
                catch=(RunnerError,))
    assert r.error is not None, "the run was not refused"
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()] if (tmp_path / "run").exists() else []
    assert r.error.exit_code == 2 and not loaded and not written, (r.error, written)
    return r.error


# ------------------------------------------------------------------------------------------- tasks and specs
def test_family_specs_map_each_task_to_a_pipeline_that_takes_its_fields():
    import inspect

    import diffusers

    from models.family import TASKS
    from models.registry import family_names, family_spec
    from runner.core import dataset as ds

    want = {"flux": {"image_to_image": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline",
                     "edit": "FluxKontextPipeline"},
            "sd3": {"image_to_image": "StableDiffusion3Img2ImgPipeline", "inpaint": "StableDiffusion3InpaintPipeline"},
            "qwen_image": {"image_to_image": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline",
                           "edit": "QwenImageEditPlusPipeline"},
            "wan": {"image_to_video": "WanImageToVideoPipeline"}}
    for fam, tasks in want.items():
        assert {k: v for k, v in family_spec(fam).tasks.items() if k in tasks} == tasks
    for fam in family_names():
        for task, cls in family_spec(fam).tasks.items():
            assert task in TASKS
            params = inspect.signature(getattr(diffusers, cls).__call__).parameters
            missing = [f for f in ds.TASK_INPUTS.get(task, {}) if f not in params]
            assert not missing, (fam, task, cls, missing)
    assert family_spec("qwen_image").multi_image == ("edit",) and family_spec("flux").multi_image == ()


def test_a_task_the_family_lacks_is_refused_naming_its_tasks(tmp_path):
    err = _refused(tmp_path, ["model=toy_shapes", "model.task=image_to_video"])
    msg = str(err)
    assert "model.task=image_to_video" in msg and "flux" in msg
    for task, cls in (("image_to_image", "FluxImg2ImgPipeline"), ("inpaint", "FluxInpaintPipeline"),
                      ("edit", "FluxKontextPipeline")):
        assert f"{task} ({cls})" in msg, msg


def test_strength_rule_is_diffusers_get_timesteps():
    class Sched:
        order = 1

    # diffusers' own get_timesteps on a 16-step schedule is the oracle of our rule
    from diffusers import FluxImg2ImgPipeline

    for n, s in ((16, 0.125), (16, 0.25), (16, 0.5), (16, 0.75), (16, 1.0), (28, 0.6), (4, 0.3), (7, 0.01)):
        pipe = FluxImg2ImgPipeline.__new__(FluxImg2ImgPipeline)
        sched = Sched()
        sched.timesteps = list(range(n))
        pipe.scheduler = sched
        _, steps = FluxImg2ImgPipeline.get_timesteps(pipe, n, s, "cpu")
        assert steps_run(n, s) == steps, (n, s)


# ------------------------------------------------------------------------------------------- row fields
def test_a_text_row_with_an_image_is_refused_naming_the_task_that_takes_it(tmp_path):
    rows = _rows(tmp_path / "rows.jsonl", [{"id": "a", "prompt": "a red circle in the top left on a white background",
                                            "image": str(DATA / "shapes_input_red_circle_top_left.png")}])
    msg = str(_refused(tmp_path, ["model=toy_shapes", "dataset=jsonl", f"dataset.path={rows}"]))
    assert f"{rows}:1: field 'image'" in msg and "model.task=text_to_image" in msg
    assert "fix: remove it from the row, or model.task=image_to_image" in msg


def test_missing_required_inputs_and_a_bad_strength_are_each_named(tmp_path):
    img = str(DATA / "shapes_input_red_circle_top_left.png")
    rows = _rows(tmp_path / "rows.jsonl", [
        {"id": "no-mask", "prompt": "a blue square", "image": img},
        {"id": "no-image", "prompt": "a blue square", "mask_image": str(DATA / "shapes_mask_bottom_right.png")},
        {"id": "strong", "prompt": "a blue square", "image": img, "mask_image": str(DATA / "shapes_mask_top_right.png"),
         "strength": 1.5},
        {"id": "list", "prompt": "a blue square", "image": [img, img], "mask_image": img}])
    err = _refused(tmp_path, ["model=toy_shapes", "model.task=inpaint", "dataset=jsonl", f"dataset.path={rows}"])
    p = err.problems
    assert any(x.startswith(f"{rows}:1: field 'mask_image' is missing") for x in p), p
    assert any(x.startswith(f"{rows}:2: field 'image' is missing") for x in p), p
    assert any(x.startswith(f"{rows}:3: field 'strength' = 1.5 must be in (0, 1]") for x in p), p
    assert any(x.startswith(f"{rows}:4: field 'image' is a list of 2 paths") for x in p), p


def _bomb_png(path: Path, w: int, h: int) -> Path:
    """A PNG whose header declares ``w`` x ``h`` (grey, 8-bit) with a token IDAT: decoding it would take w*h bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def _bad_inputs(d: Path) -> list:
    """Rows of a toy_shapes inpaint run (64x64), one bad input class each (the last row is good), with the words
    each problem must say."""
    good = _png(d / "good.png", draw("red", "circle", "top left"))
    mask = _png(d / "mask.png", quadrant_mask(32, 32))
    (d / "notes.png").write_text("not an image")
    _png(d / "full.png", np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    (d / "cut.png").write_bytes((d / "full.png").read_bytes()[:3000])
    rgba = np.dstack([draw("red", "circle", "top left"), np.full((64, 64), 128, np.uint8)])
    _png(d / "rgba.png", rgba)
    Image.fromarray(draw("red", "circle", "top left")).convert("CMYK").save(d / "cmyk.jpg")
    Image.fromarray(np.full((64, 64), 40000, np.uint16)).save(d / "deep.png")
    _png(d / "small.png", draw("red", "circle", "top left", size=32))
    _png(d / "small_mask.png", quadrant_mask(16, 16, size=32))
    _png(d / "colour_mask.png", draw("red", "circle", "top left"))
    _bomb_png(d / "bomb.png", 10000, 10000)
    cases = [("missing.png", "mask.png", ["field 'image' = 'missing.png' does not exist"]),
             ("https://example.com/x.png", "mask.png", ["is a URL", "download it first"]),
             ("notes.png", "mask.png", ["field 'image' = 'notes.png' is not an image"]),
             ("bomb.png", "mask.png", ["declares 10000x10000 = 100000000 pixels", str(media.MAX_INPUT_PIXELS)]),
             ("cut.png", "mask.png", ["field 'image' = 'cut.png' is corrupt"]),
             ("rgba.png", "mask.png", ["has mode RGBA with 4096 transparent pixel(s)", "alpha_composite"]),
             ("cmyk.jpg", "mask.png", ["has mode CMYK"]),
             ("deep.png", "mask.png", ["has mode I;16"]),
             ("good.png", "small_mask.png", ["field 'mask_image' = 'small_mask.png' is 32x32, its image 'good.png' "
                                             "is 64x64"]),
             ("small.png", "small_mask.png", ["field 'image' = 'small.png' is 32x32, and the row generates 64x64",
                                              "fix: resize the file to 64x64, or set width=32 and height=32"]),
             ("good.png", "colour_mask.png", ["field 'mask_image' = 'colour_mask.png' is a colour image"]),
             (str(good), str(mask), None)]
    return cases


def test_every_bad_input_is_listed_at_once_before_loading(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    cases = _bad_inputs(d)
    rows = _rows(d / "rows.jsonl", [{"id": f"r{i}", "prompt": "a blue square in the bottom right on a white "
                                     "background", "image": img, "mask_image": m} for i, (img, m, _) in
                                    enumerate(cases)])
    err = _refused(tmp_path, ["model=toy_shapes", "model.task=inpaint", "dataset=jsonl", f"dataset.path={rows}"])
    assert isinstance(err, DatasetError)
    for line, (_img, _m, words) in enumerate(cases, 1):
        mine = [p for p in err.problems if p.startswith(f"{rows}:{line}:")]
        if words is None:
            assert not mine, mine
            continue
        assert mine, (line, err.problems)
        for w in words:
            assert any(w in p for p in mine), (line, w, mine)
        assert all("fix:" in p for p in mine), mine
    assert len(err.problems) == sum(1 for c in cases if c[2]) + 1  # small.png: the image and its mask, both named


def test_media_root_and_lossless_conversions_are_recorded(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    rgb = draw("green", "square", "center")
    _png(root / "grey.png", rgb[..., 1])
    _png(root / "opaque.png", np.dstack([rgb, np.full((64, 64), 255, np.uint8)]))
    Image.fromarray(rgb).convert("P").save(root / "pal.png")
    rows = [ds.Row(id=n, prompt="p", negative_prompt=None, seed=None, width=64, height=64, num_inference_steps=4,
                   guidance_scale=None, num_images_per_prompt=1, line=i, values={"image": n},
                   spec=ds.DIFFUSION_ROW) for i, n in enumerate(("grey.png", "opaque.png", "pal.png"), 1)]
    got = media.attach_inputs(rows, tmp_path / "elsewhere" / "rows.jsonl", media_root=str(root))
    conv = {r.id: (r.inputs["image"].mode, r.inputs["image"].conversion) for r in got}
    assert conv == {"grey.png": ("L", media.MODE_RULES[("L", "RGB")]),
                    "opaque.png": ("RGBA", media.MODE_RULES[("RGBA", "RGB")]),
                    "pal.png": ("P", media.MODE_RULES[("P", "RGB")])}
    assert np.array_equal(np.asarray(media.load_input(got[1].inputs["image"])), rgb)  # alpha 255: dropped exactly
    assert got[0].inputs["image"].path == str(root / "grey.png")


def test_input_bytes_not_paths_enter_the_identity_and_the_batch_key(tmp_path):
    from runner.core.resume import inputs_sha256

    a = _png(tmp_path / "a.png", draw("red", "circle", "top left"))
    shutil.copy(a, tmp_path / "renamed.png")
    _png(tmp_path / "other.png", draw("blue", "circle", "top left"))

    def item(name, w=64):
        r = ds.Row(id="x", prompt="p", negative_prompt=None, seed=1, width=w, height=64, num_inference_steps=4,
                   guidance_scale=None, num_images_per_prompt=1, line=1, values={"image": name}, spec=ds.DIFFUSION_ROW)
        return ds.Item(row=media.attach_inputs([r], tmp_path / "rows.jsonl")[0], index=0, seed=1)

    same, renamed, other = item("a.png"), item("renamed.png"), item("other.png")
    assert inputs_sha256("run", same) == inputs_sha256("run", renamed) != inputs_sha256("run", other)
    assert same.shape_key == other.shape_key  # one input shape: one batch
    plain = ds.Item(row=ds.Row(id="x", prompt="p", negative_prompt=None, seed=1, width=64, height=64,
                               num_inference_steps=4, guidance_scale=None, num_images_per_prompt=1, line=1,
                               spec=ds.DIFFUSION_ROW), index=0, seed=1)
    assert plain.shape_key != same.shape_key and len(ds.batches([plain, same, other], 4)) == 2


# ------------------------------------------------------------------------------------------- runs
def test_builtin_inputs_are_the_data_modules_drawings():
    from models.toy_shapes.data import wan480_inputs

    for name, a in {**conditioning_inputs(), **wan480_inputs()}.items():
        assert np.array_equal(np.asarray(Image.open(DATA / f"{name}.png")), a), name


def test_full_size_wan_i2v_takes_its_builtin_rows_at_its_size(tmp_path, subprocess_env):
    """New-user report: ``model=wan_i2v`` refused its builtin rows (the tiny model's 32x32 first frames against its
    832x480: the runner never resizes an input). Its rows now carry 832x480 frames: the plan reads them, the
    largest batch is 832x480."""
    import json as _json

    from _helpers import cli

    p = cli(["model=wan_i2v", "model.load_format=dummy", "platform=cuda", "--plan", "--device-gb=139.8", "--json"],
            subprocess_env, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    b = _json.loads(p.stdout)["batch"]
    assert (b["width"], b["height"], b["rows"]) == (832, 480, 2), b


def test_inpaint_keeps_every_pixel_outside_the_mask(tmp_path):
    """One batch of the three builtin rows (one input shape): each output equals ITS input outside its mask (a
    wrong pairing of input to row, or the overlay skipped, fails), and differs from it inside."""
    r = execute(tmp_path / "on", ["model=toy_shapes", "model.task=inpaint", "batch_size=3"])
    assert r.code == 0, r.error
    m = r.manifest
    assert m["evidence"]["verdict"] == "verified"
    assert m["evidence"]["stages"]["denoise"]["conditioning"]["pipeline"] == "FluxInpaintPipeline"
    meta = [json.loads(x) for x in (r.run_dir / "images" / "metadata.jsonl").read_text().splitlines()]
    assert len(r.items) == 3 and {it["batch"]["size"] for it in r.items} == {3}
    for rec, line in zip(r.items, meta):
        out = np.asarray(Image.open(r.run_dir / rec["file"]).convert("RGB"))
        src = np.asarray(Image.open(rec["inputs"]["image"]["path"]).convert("RGB"))
        inside = np.asarray(Image.open(rec["inputs"]["mask_image"]["path"])) >= 128
        assert np.array_equal(out[~inside], src[~inside]), rec["key"]
        assert not np.array_equal(out[inside], src[inside]), rec["key"]
        assert rec["params"]["inpaint_overlay"] is True and rec["params"]["strength"] == 1.0
        text = Image.open(r.run_dir / rec["file"]).text
        assert json.loads(text["inputs"]) == {"image": rec["inputs"]["image"]["sha256"],
                                              "mask_image": rec["inputs"]["mask_image"]["sha256"]}
        assert line["input_file_name"] == rec["inputs"]["image"]["path"]
    from runner.tools.validate import problems, validate_run_dir

    skip_without_extra("validate")  # the pixels were checked above; the published item schema needs jsonschema
    assert validate_run_dir(r.run_dir) == []  # items.jsonl's inputs by the published item schema
    assert problems({**r.items[0], "inputs": {"image": {"path": "x"}}}, "item")  # sha256, size, modes required
    from runner.tools import report

    assert report.main([str(r.run_dir), "--out", str(tmp_path / "report.html")]) == 0
    html = (tmp_path / "report.html").read_text()
    assert html.count('class="inputs"') == 3 and html.count('alt="mask_image"') == 3  # inputs beside outputs
    # off: the outside went through the VAE, and the record says so
    off = execute(tmp_path / "off", ["model=toy_shapes", "model.task=inpaint", "batch_size=3", "dataset.limit=1",
                                     "output.inpaint_overlay=false"])
    rec = off.items[0]
    out = np.asarray(Image.open(off.run_dir / rec["file"]).convert("RGB"))
    src = np.asarray(Image.open(rec["inputs"]["image"]["path"]).convert("RGB"))
    inside = np.asarray(Image.open(rec["inputs"]["mask_image"]["path"])) >= 128
    assert rec["params"]["inpaint_overlay"] is False and not np.array_equal(out[~inside], src[~inside])
    assert rec["inputs_sha256"] != r.items[0]["inputs_sha256"]


def test_image_to_image_departs_from_the_input_as_strength_rises(tmp_path):
    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_image"])
    assert r.code == 0, r.error
    ev = r.manifest["evidence"]
    strengths = [rec["params"]["strength"] for rec in r.items]
    assert strengths == sorted(strengths) and len(strengths) == 5
    # observed forwards = the pipeline's own rule per item (16 steps: 2 + 4 + 8 + 12 + 16); a strength not passed
    # to the pipeline (its default 0.6 instead) or a wrong rule would not add up
    want = sum(steps_run(16, s) for s in strengths)
    assert want == 42 and ev["stages"]["denoise"]["denoiser_forwards"] == 42 and ev["verdict"] == "verified"
    first = ev["stages"]["denoise"]["conditioning"]["first_latents"]
    assert ev["stages"]["denoise"]["checks"]["first_latents"] == first["verdict"] == "verified", first
    assert first["without_input"][0] > 3 * first["statistic"][0]  # the statistic separates input from no input
    src = np.asarray(Image.open(DATA / "shapes_input_red_circle_top_left.png").convert("RGB"))
    psnr = [_psnr(np.asarray(Image.open(r.run_dir / rec["file"]).convert("RGB")), src) for rec in r.items]
    assert all(a > b for a, b in zip(psnr, psnr[1:])), psnr
    assert psnr[0] > 20 > psnr[-1], psnr


def test_flux_kontext_edit_carries_the_reference_tokens(tmp_path):
    ref = _png(tmp_path / "ref.png", draw("red", "circle", "top left", size=128))
    rows = _rows(tmp_path / "rows.jsonl", [{"id": "a", "prompt": "make it blue", "image": ref.name},
                                           {"id": "b", "prompt": "move it to the bottom right", "image": ref.name}])
    r = execute(tmp_path / "run", ["model=tiny_flux", "model.task=edit", "dataset=jsonl", f"dataset.path={rows}",
                                   "batch_size=2"])
    assert r.code == 0, r.error
    st = r.manifest["evidence"]["stages"]["denoise"]
    assert r.manifest["evidence"]["verdict"] == "verified" and st["conditioning"]["pipeline"] == "FluxKontextPipeline"
    # 128x128 at 16 px per packed token: 64 target + 64 reference tokens at the first forward
    assert st["conditioning"]["sequence"] == {"calls": 1, "observed_first": 128, "expected_first": 128,
                                              "verdict": "verified"}
    assert [Image.open(r.run_dir / rec["file"]).size for rec in r.items] == [(128, 128)] * 2


def test_resume_regenerates_the_item_whose_input_changed_and_repro_refuses(tmp_path):
    from runner.tools import repro

    d = tmp_path / "in"
    d.mkdir()
    names = {"a": ("red", "circle", "top left"), "b": ("green", "triangle", "bottom left"),
             "c": ("blue", "square", "top right")}
    for k, attrs in names.items():
        _png(d / f"{k}.png", draw(*attrs))
    rows = _rows(d / "rows.jsonl", [{"id": k, "prompt": "a yellow circle in the center on a white background",
                                     "image": f"{k}.png", "strength": 0.5} for k in names])
    over = ["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl", f"dataset.path={rows}"]
    first = execute(tmp_path / "run", over)
    assert first.code == 0, first.error
    before = {rec["key"]: rec for rec in first.items}
    _png(d / "b.png", draw("yellow", "square", "bottom right"))
    again = execute(tmp_path / "run", over)
    assert again.code == 0, again.error
    assert (again.manifest["counts"]["ok"], again.manifest["counts"]["reused"]) == (1, 2)
    after = {rec["key"]: rec for rec in again.items}
    assert after["b"]["inputs"]["image"]["sha256"] != before["b"]["inputs"]["image"]["sha256"]
    assert after["b"]["file_sha256"] != before["b"]["file_sha256"]
    assert all(after[k]["file_sha256"] == before[k]["file_sha256"] for k in ("a", "c"))
    code, res = repro.reproduce(tmp_path / "run", tmp_path / "repro_ok")  # inputs as recorded: byte-identical
    assert code == 0 and res["mode"] == "bytes" and len(res["items"]) == 3, res["problems"]
    _png(d / "c.png", draw("red", "triangle", "center"))
    with pytest.raises(repro.ReproInputError) as e:
        repro.reproduce(tmp_path / "run", tmp_path / "repro")
    assert str(d / "c.png") in str(e.value) and "image of item c" in str(e.value) and e.value.exit_code == 2
    assert not (tmp_path / "repro").exists()


def test_a_parquet_image_column_is_read_through_dataset_columns(tmp_path):
    """A Hugging Face ``Image`` cell (``{bytes, path}``) mapped to ``image``: hashed by its bytes, the same identity
    of input as the file with those bytes."""
    pa = import_extra("export", "pyarrow")
    import io

    import pyarrow.parquet as pq

    buf = io.BytesIO()
    Image.fromarray(draw("red", "circle", "top left")).save(buf, format="PNG")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a blue square in the bottom right on a white background"],
                             "picture": [{"bytes": buf.getvalue(), "path": "red.png"}], "strength": [0.25]}), path)
    r = execute(tmp_path / "run", ["model=toy_shapes", "model.task=image_to_image", "dataset=parquet",
                                   f"dataset.path={path}", "dataset.columns={image: picture}"])
    assert r.code == 0, r.error
    rec = r.items[0]
    import hashlib

    assert rec["inputs"]["image"]["sha256"] == hashlib.sha256(buf.getvalue()).hexdigest()
    assert r.manifest["evidence"]["stages"]["denoise"]["denoiser_forwards"] == steps_run(16, 0.25) == 4
    meta = json.loads((r.run_dir / "images" / "metadata.jsonl").read_text().splitlines()[0])
    assert meta["input_file_name"] is None and meta["inputs"] == {"image": rec["inputs"]["image"]["sha256"]}


def test_first_latents_are_the_inputs_noised_and_a_swap_is_seen():
    """The observation behind ``evidence...conditioning.first_latents``, on the real toy_shapes FluxImg2ImgPipeline:
    the latents at the first forward of a batch of two are each item's own input noised (statistic ~1); checked
    against the inputs swapped, both items fail."""
    import torch
    from diffusers import FluxImg2ImgPipeline

    from models.conditioning import SequenceProbe, first_latents_check

    pipe = FluxImg2ImgPipeline.from_pretrained(REPO / "models/toy_shapes/weights", local_files_only=True,
                                               dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    probe = SequenceProbe(pipe.transformer)
    probe.arm(keep=True)
    imgs = [Image.open(DATA / f"{n}.png").convert("RGB") for n in ("shapes_input_red_circle_top_left",
                                                                    "shapes_input_blue_square_top_right")]
    with torch.inference_mode():
        pipe(prompt=["a green triangle in the center on a white background"] * 2, image=imgs, strength=0.25,
             num_inference_steps=16, height=64, width=64, max_sequence_length=16, output_type="np",
             generator=[torch.Generator().manual_seed(s) for s in (1, 2)])
    own = first_latents_check(pipe, imgs, probe.hidden, probe.timestep, 64, 64)
    swapped = first_latents_check(pipe, imgs[::-1], probe.hidden, probe.timestep, 64, 64)
    assert own["verdict"] == "verified", own
    assert swapped["verdict"] == "mismatch" and all(s > 1.25 > o > 0.75 for s, o in zip(swapped["statistic"],
                                                                                 own["statistic"])), swapped
    assert 0 < own["sigma"] < 0.5  # strength 0.25: a quarter of the schedule left, after FLUX's shift


def test_a_video_familys_refusal_names_its_own_task_and_a_cache_with_strength_is_refused(tmp_path):
    img = str(DATA / "shapes_input_red_circle_top_left.png")
    rows = _rows(tmp_path / "rows.jsonl", [{"id": "a", "prompt": "a cat", "image": img}])
    msg = str(_refused(tmp_path / "wan", ["model=tiny_wan", "dataset=jsonl", f"dataset.path={rows}"]))
    assert "model.task=text_to_video" in msg and "or model.task=image_to_video (tasks that take image" in msg, msg
    msg = str(_refused(tmp_path / "cache", ["model=toy_shapes", "model.task=image_to_image",
                                            "cache.method=first_block"]))
    assert "cache.method=first_block with model.task=image_to_image" in msg and "fix: cache.method=none" in msg
