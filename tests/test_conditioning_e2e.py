"""Conditioning tasks of issue #30 through the real loop (``runner.app.execute.run``, the engine's own load, call
and evidence) on the tiny CPU snapshots of condfam: SD3 img2img, Qwen-Image-Edit-Plus and Wan 2.1 image-to-video,
each on its builtin rows (``runner/data/prompts.<task>.jsonl``), 2-4 steps, each run to ``verified`` with the
observation that shows its input reached the transformer."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.conditioning import steps_run
from models.qwen_image import edit_sizes

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent


def _denoise(r):
    ev = r.manifest["evidence"]
    assert r.code == 0 and ev["verdict"] == "verified", (r.code, ev.get("mismatches"))
    return ev["stages"]["denoise"]


def test_sd3_img2img_runs_the_forwards_of_each_rows_strength(run_job):
    """``model=tiny_sd3 model.task=image_to_image``: StableDiffusion3Img2ImgPipeline loads the text-to-image
    snapshot; the denoiser forwards observed are the pipeline's own strength rule summed over the rows."""
    r = run_job(["model=tiny_sd3", "model.task=image_to_image"])
    d = _denoise(r)
    assert d["conditioning"]["pipeline"] == "StableDiffusion3Img2ImgPipeline"
    strengths = [it["params"]["strength"] if "params" in it else it.get("strength") for it in r.items]
    assert d["denoiser_forwards"] == sum(steps_run(4, s) for s in (0.5, 1.0)) == 6, strengths
    assert d["checks"]["forward_count"] == "verified"
    assert d["conditioning"]["input_sizing"]["rule"] == "resize"


def test_qwen_image_edit_plus_holds_the_reference_tokens_edit_sizes_predicts(run_job):
    """``model=tiny_qwen_image_edit`` (task edit): the Edit-Plus transformer's first input holds the target's and
    every reference's tokens at the size ``edit_sizes`` computes (1 and 2 references); batch_size=2 runs one item
    per call, recorded."""
    r = run_job(["model=tiny_qwen_image_edit", "batch_size=2"])
    d = _denoise(r)
    cond = d["conditioning"]
    assert cond["pipeline"] == "QwenImageEditPlusPipeline" and d["checks"]["reference_tokens"] == "verified"
    one = edit_sizes([(64, 64)], 64, 64)["image_tokens"]
    assert cond["sequence"] == {"calls": 2, "observed_first": one, "expected_first": one, "verdict": "verified"}
    assert cond["input_sizing"]["rule"] == "area" and cond["input_sizing"]["vae"] == [[1024, 1024]]
    assert cond["batching"]["requested"] == 2 and cond["batching"]["applied"] == 1
    assert all(it["batch_size"] == 1 for it in r.items if "batch_size" in it)


def test_wan_i2v_image_condition_reaches_the_transformer(run_job):
    """``model=tiny_wan_i2v`` (task image_to_video): the hook sees 36 input channels (noise + mask + condition
    latents) and CLIP image embeds equal to the pipeline's own encoding of each item's input; two dispatcher calls
    per cross-attention forward (text and image keys) verified."""
    r = run_job(["model=tiny_wan_i2v"])
    d = _denoise(r)
    ic = d["conditioning"]["image_condition"]
    assert d["checks"]["image_condition"] == "verified" and ic["calls"] == 2
    assert ic["first"]["channels"] == 36 and ic["first"]["image_embeds"] == [1, 17, 32] and ic["first"]["embeds_match"]
    cross = [x for x in d["attention"]["layers"] if x["role"] == "cross"]
    assert cross and all(x["calls"] == 2 * d["denoiser_forwards"] for x in cross)


@pytest.mark.parametrize("model,task", [("tiny_sd3", "inpaint"), ("tiny_qwen_image", "image_to_image"),
                                        ("tiny_qwen_image", "inpaint")])
def test_sd3_and_qwen_image_strength_tasks_run_verified(run_job, model, task):
    """SD3 inpaint and Qwen-Image img2img / inpaint load the text-to-image snapshot as the task's pipeline and run
    their builtin rows (strengths 1.0 and 0.5 of 4 steps) to ``verified``: forwards 4 + 2."""
    from models.registry import family_spec

    r = run_job([f"model={model}", f"model.task={task}"])
    d = _denoise(r)
    assert d["conditioning"]["pipeline"] == family_spec(r.cfg.model.engine).tasks[task]
    assert d["denoiser_forwards"] == sum(steps_run(4, s) for s in (0.5, 1.0)) == 6  # the builtin rows' strengths


def test_wan_first_last_frame_embeds_both_images(run_job, tmp_path):
    """``model=tiny_wan_flf2v`` with ``last_image``: the FLF2V transformer gets the CLIP embeds of both frames
    (2 x 17 tokens), equal to the pipeline's own encoding of this row's two inputs."""
    import json

    data = REPO / "runner" / "data"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "circle-to-triangle", "prompt": "the red circle turns into a green triangle",
                                "image": str(data / "shapes32_input_red_circle_top_left.png"),
                                "last_image": str(data / "shapes32_input_green_triangle_bottom_left.png")}) + "\n")
    r = run_job(["model=tiny_wan_flf2v", "dataset=jsonl", f"dataset.path={rows}"])
    ic = _denoise(r)["conditioning"]["image_condition"]
    assert ic["verdict"] == "verified" and ic["first"]["image_embeds"] == [2, 17, 32] and ic["first"]["embeds_match"]


def test_wan_flf2v_default_run_gives_both_frames(run_job):
    """``python -m runner model=tiny_wan_flf2v`` on its builtin rows (each with a ``last_image``) runs verified; it
    used to read the one-image rows, and every item failed inside the transformer (a reshape of 17 CLIP tokens into
    34)."""
    r = run_job(["model=tiny_wan_flf2v"])
    ic = _denoise(r)["conditioning"]["image_condition"]
    assert ic["first"]["image_embeds"] == [2, 17, 32] and ic["first"]["embeds_match"]
    assert [it["status"] for it in r.items] == ["ok", "ok"]


TRIANGLE = "shapes32_input_green_triangle_bottom_left.png"


@pytest.mark.parametrize("model,last,bad", [("tiny_wan_flf2v", [None, TRIANGLE], (1, None)),
                                            ("tiny_wan_i2v", [None, TRIANGLE], (2, TRIANGLE))])
def test_wan_rows_the_image_embedder_cannot_take_are_refused_at_startup(run_job, tmp_path, model, last, bad):
    """A first-last-frame transformer (``pos_embed_seq_len``) needs ``last_image`` in every row, a one-image I2V
    transformer (``image_dim``, no ``pos_embed_seq_len``) takes none: the row that breaks it (and only it) is refused
    at startup, by line, with the fix, and nothing is generated (either would fail in every item it reached)."""
    import json

    from runner.core.errors import DatasetError

    data = REPO / "runner" / "data"
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "a shape moves",
                                        "image": str(data / "shapes32_input_red_circle_top_left.png"),
                                        **({"last_image": str(data / x)} if x else {})}) + "\n"
                            for i, x in enumerate(last)))
    with pytest.raises(DatasetError) as e:
        run_job([f"model={model}", "dataset=jsonl", f"dataset.path={rows}"], name="refused")
    line, value = bad
    assert [p.split(": ", 2)[:2] for p in e.value.problems] == [
        [f"{rows}:{line}", f"last_image={str(data / value) if value else None!r}"]]
    assert "fix: " in e.value.problems[0]
    assert not list((tmp_path / "refused").rglob("*.mp4"))  # nothing generated


def _embedded(model: str, task):
    """The embedded snapshot of conf/model/<model>.yaml (for ``task`` where it has a checkpoint of its own), built by
    the engine's own path into the session cache."""
    from omegaconf import OmegaConf

    from models.pipelines import embedded_target
    from models.registry import engine_class

    cfg = OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml")
    eng = engine_class(cfg.engine)
    arch = OmegaConf.to_container(cfg.architecture, resolve=True)
    own = task if eng.spec.own_snapshot(task) else None
    return eng.embedded_snapshot_at(embedded_target(model, arch, None, task=own), arch, task=own)


def test_a_base_snapshot_for_an_own_checkpoint_task_is_refused_naming_what_it_lacks(tmp_path):
    """``model.task=image_to_video`` on a Wan text-to-video snapshot: refused at startup (exit 2, nothing loaded),
    naming the pipeline class the task needs, the missing image encoder and processor, and the fix."""
    from _helpers import execute
    from runner.core.errors import RunnerError

    t2v = _embedded("tiny_wan", "text_to_video")
    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_wan_i2v", f"model.path={t2v}"], on_loaded=loaded.append,
                catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded, r
    msg = str(r.error)
    assert "model.task=image_to_video" in msg and "pipeline WanImageToVideoPipeline, found WanPipeline" in msg, msg
    assert "component image_encoder (CLIPVisionModelWithProjection) is missing" in msg, msg
    assert "processor image_processor is missing" in msg and "fix:" in msg, msg


def test_the_i2v_check_tells_the_items_own_input_from_another(tmp_path):
    """:func:`models.conditioning.image_condition_check` on the real tiny Wan I2V pipeline: the embeds the hook saw
    match the item's own input and not another image (what a swapped or dropped input would show)."""
    import numpy as np
    import torch
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from models.conditioning import ImageConditionProbe, image_condition_check

    pipe = WanImageToVideoPipeline.from_pretrained(_embedded("tiny_wan_i2v", "image_to_video"),
                                                   local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    probe = ImageConditionProbe(pipe.transformer)
    a = Image.open(REPO / "runner/data/shapes32_input_red_circle_top_left.png").convert("RGB")
    b = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8))
    probe.arm()
    pipe(prompt="a circle", image=a, height=32, width=32, num_frames=5, num_inference_steps=1, guidance_scale=1.0,
         max_sequence_length=32, generator=torch.Generator().manual_seed(0), output_type="np")
    own = image_condition_check(pipe, {"image": a}, probe, "own")
    other = image_condition_check(pipe, {"image": b}, probe, "swapped")
    assert own["verdict"] == "verified" and own["embeds_match"] and own["channels"] == 36, own
    assert other["verdict"] == "mismatch" and other["embeds_match"] is False, other


def test_area_sized_references_of_any_size_are_taken_resize_inputs_refused(tmp_path):
    """``input_sizing: area`` (Edit-Plus sizes each reference itself; its sizes are recorded): a 80x48 reference for a
    64x64 row is taken; under ``resize`` (every other task) the same row is refused naming the size and the fix."""
    from PIL import Image

    from runner.core import dataset as ds
    from runner.core import media

    Image.new("RGB", (80, 48), (200, 30, 30)).save(tmp_path / "wide.png")
    row = ds.Row(id="wide", prompt="p", negative_prompt=None, seed=None, width=64, height=64, num_inference_steps=2,
                 guidance_scale=None, num_images_per_prompt=1, line=1, values={"image": "wide.png"},
                 spec=ds.DIFFUSION_ROW)
    (got,) = media.attach_inputs([row], tmp_path / "rows.jsonl", any_size=True)
    assert (got.inputs["image"].width, got.inputs["image"].height) == (80, 48)
    with pytest.raises(ds.DatasetError, match="is 80x48, and the row generates 64x64.*fix: resize the file"):
        media.attach_inputs([row], tmp_path / "rows.jsonl")
