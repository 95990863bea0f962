"""Conditioning tasks of issue #30 through the real loop (``runner.app.execute.run``, the engine's own load, call
and evidence) on the tiny CPU snapshots of condfam: SD3 img2img, Qwen-Image-Edit-Plus and Wan 2.1 image-to-video,
each on its builtin rows (``runner/data/prompts.<task>.jsonl``), 2-4 steps, each run to ``verified`` with the
observation that shows its input reached the transformer."""

from __future__ import annotations

import pytest

from models.conditioning import steps_run
from models.qwen_image import edit_sizes

pytestmark = pytest.mark.cpu


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
    assert ic["first"]["channels"] == 36 and ic["first"]["image_tokens"] == 17 and ic["first"]["embeds_match"]
    cross = [x for x in d["attention"]["layers"] if x["role"] == "cross"]
    assert cross and all(x["calls"] == 2 * d["denoiser_forwards"] for x in cross)
