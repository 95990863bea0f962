"""Tiny conditioning pipelines of issue #30 built through the project's own component path (seeded random weights
from ``conf/model/*.yaml``, tokenizers and processors built locally, ``save_pretrained`` with safetensors, reloaded
with the task's pipeline class ``from_pretrained``) and run directly on CPU: Qwen-Image-Edit-Plus (several
references), Wan 2.1 image-to-video (I2V and first-last-frame), SD3 and Qwen-Image img2img and inpaint.

Each test observes what reached the transformer (forward pre-hooks) rather than trusting the config: the Edit-Plus
transformer's sequence grows by each reference's latent tokens, the Wan transformer receives the CLIP image embeds,
img2img runs the forwards of the pipeline's own strength rule, and changing an input changes the output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from models import family as fam
from models.conditioning import steps_run
from models.pipelines import embedded_target, missing_weights, read_index
from models.registry import engine_class, family_spec

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parent.parent


def _arch(model: str) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml").architecture,
                                  resolve=True)


def _snapshot(model: str, task: Optional[str]) -> Path:
    """The embedded snapshot of conf/model/<model>.yaml for ``task``, built through the engine's real path into the
    session cache (``RUNNER_CACHE``)."""
    eng = engine_class(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml").engine)
    own = task if eng.spec.own_snapshot(task) else None
    arch = _arch(model)
    return eng.embedded_snapshot_at(embedded_target(model, arch, None, task=own), arch, task=own)


def _load(pipeline: str, path: Path) -> Any:
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(path, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _watch(module: torch.nn.Module) -> List[Dict[str, Any]]:
    """Every forward's keyword tensors' shapes (and the hidden states), recorded by a forward pre-hook."""
    seen: List[Dict[str, Any]] = []

    def hook(_m, args, kwargs):
        seen.append({k: (v.shape if torch.is_tensor(v) else v) for k, v in kwargs.items()})
        seen[-1]["_hidden"] = (kwargs.get("hidden_states") if "hidden_states" in kwargs else args[0]).detach().clone()

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ------------------------------------------------------------------------------------------------ specs
def test_specs_map_the_conditioning_tasks_to_diffusers_pipelines():
    import diffusers

    want = {"sd3": {"image_to_image": "StableDiffusion3Img2ImgPipeline", "inpaint": "StableDiffusion3InpaintPipeline"},
            "qwen_image": {"image_to_image": "QwenImageImg2ImgPipeline", "inpaint": "QwenImageInpaintPipeline",
                           "edit": "QwenImageEditPlusPipeline"},
            "wan": {"image_to_video": "WanImageToVideoPipeline"}}
    for name, tasks in want.items():
        spec = family_spec(name)
        for task, cls in tasks.items():
            assert spec.tasks[task] == cls and hasattr(diffusers, cls)
            assert spec.input_sizing[task] in fam.INPUT_SIZING
    qwen, wan, sd3 = family_spec("qwen_image"), family_spec("wan"), family_spec("sd3")
    # own checkpoints: saved as their task's class; img2img/inpaint reuse the text-to-image snapshot
    assert qwen.snapshot_pipeline("edit") == "QwenImageEditPlusPipeline"
    assert qwen.snapshot_pipeline("inpaint") == "QwenImagePipeline" and not qwen.own_snapshot("image_to_image")
    assert wan.snapshot_pipeline("image_to_video") == "WanImageToVideoPipeline"
    assert sd3.snapshot_pipeline("image_to_image") == "StableDiffusion3Pipeline"
    # task components come after the base ones (same seeded base weights; Wan 2.2's optional second expert
    # transformer_2 among them), the scheduler last
    assert list(wan.components_for("image_to_video")) == ["transformer", "transformer_2", "vae", "text_encoder",
                                                          "image_encoder", "scheduler"]
    assert list(wan.components_for(None)) == list(wan.components)
    assert wan.processors_for("image_to_video") == {"image_processor": ("clip_image", None)}
    assert qwen.processors_for("edit") == {"processor": ("qwen2_vl", "tokenizer")} and qwen.processors_for(None) == {}


def test_a_spec_naming_task_parts_for_a_task_it_does_not_map_is_refused():
    with pytest.raises(ValueError, match="not in its tasks"):
        fam.FamilySpec(name="x", tasks={"text_to_image": "FluxPipeline"}, components={}, tokenizers={}, cfg="none",
                       task_processors={"edit": {"processor": ("qwen2_vl", "tokenizer")}})
    with pytest.raises(ValueError, match="input_sizing"):
        fam.FamilySpec(name="x", tasks={"text_to_image": "FluxPipeline", "inpaint": "FluxInpaintPipeline"},
                       components={}, tokenizers={}, cfg="none", input_sizing={"inpaint": "stretch"})
    with pytest.raises(ValueError, match="base task"):
        fam.FamilySpec(name="x", tasks={"edit": "FluxKontextPipeline"}, components={}, tokenizers={}, cfg="none")


def test_an_own_checkpoint_task_gets_its_own_cache_entry():
    arch = _arch("tiny_qwen_image")
    base = embedded_target("m", arch, "/c")
    assert embedded_target("m", arch, "/c", task=None) == base  # existing caches keep their key
    assert embedded_target("m", arch, "/c", task="edit") != base


# ------------------------------------------------------------------------------------- Qwen-Image-Edit-Plus
@pytest.fixture(scope="module")
def edit_pipe():
    return _load("QwenImageEditPlusPipeline", _snapshot("tiny_qwen_image_edit", "edit"))


def test_edit_plus_snapshot_is_saved_and_reloaded_as_qwen_image_edit_2509(edit_pipe):
    from models.processors import Qwen2VLImageTextProcessor
    from models.qwen_image import EDIT_TEMPLATE, EDIT_TEMPLATE_DROP, VISION_TOKEN_IDS

    path = _snapshot("tiny_qwen_image_edit", "edit")
    index = read_index(path)
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and missing_weights(path) == []
    assert index["processor"] == ["models.processors", "Qwen2VLImageTextProcessor"]
    assert sorted(p.suffix for p in (path / "text_encoder").glob("*.safetensors")) == [".safetensors"]
    assert isinstance(edit_pipe.processor, Qwen2VLImageTextProcessor)
    # the pipeline drops exactly the template's 64 tokens, and the encoder finds the image tokens by their ids
    assert edit_pipe.prompt_template_encode == EDIT_TEMPLATE
    assert edit_pipe.prompt_template_encode_start_idx == EDIT_TEMPLATE_DROP
    tok = edit_pipe.tokenizer
    assert len(tok(EDIT_TEMPLATE.split("{}")[0])["input_ids"]) == EDIT_TEMPLATE_DROP
    for name, marker in VISION_TOKEN_IDS.items():
        assert getattr(edit_pipe.text_encoder.config, f"{name}_token_id") == tok.convert_tokens_to_ids(marker)
    vision, proc = edit_pipe.text_encoder.config.vision_config, edit_pipe.processor.image_processor
    assert (proc.patch_size, proc.merge_size, proc.temporal_patch_size) == (
        vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)


def test_edit_plus_references_reach_the_transformer_and_steer_the_output(edit_pipe, monkeypatch):
    """Each reference adds its latent tokens to the transformer's sequence (sized by the pipeline's own
    ``calculate_dimensions`` area rule, whatever the input's size) and vision tokens to the text; the output has the
    requested size; another reference changes the output. The area constants are shrunk (1024x1024 -> 64x64 for the
    VAE, 384x384 -> 56x56 for the text encoder) so a CPU runs it in seconds: the rule is the pipeline's."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as mod

    monkeypatch.setattr(mod, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(mod, "CONDITION_IMAGE_SIZE", 56 * 56)
    seen = _watch(edit_pipe.transformer)
    refs = [_image(64, 48, 1), _image(40, 80, 2)]

    def run(images):
        out = edit_pipe(image=images, prompt="make it blue", height=32, width=48, num_inference_steps=2,
                        true_cfg_scale=1.0, generator=_gen(), output_type="np", max_sequence_length=64).images
        return out, seen[-1]

    from models.qwen_image import edit_sizes

    one, kw1 = run(refs[:1])
    two, kw2 = run(refs)
    assert one.shape == two.shape == (1, 32, 48, 3) and np.isfinite(one).all()
    sizes1, sizes2 = edit_sizes([refs[0].size], 48, 32), edit_sizes([r.size for r in refs], 48, 32)
    assert sizes2["output"] == (48, 32) and sizes2["vae"] == [(64, 64), (32, 96)]  # aspect kept, multiples of 32
    assert kw1["_hidden"].shape[1] == sizes1["image_tokens"] == 6 + 16
    assert kw2["_hidden"].shape[1] == sizes2["image_tokens"] == 6 + 16 + 12
    assert kw2["encoder_hidden_states"][1] > kw1["encoder_hidden_states"][1]  # the second picture's vision tokens
    other, _ = run([_image(64, 48, 3)])
    assert np.abs(other - one).max() > 1e-3


# ------------------------------------------------------------------------------------------- Wan I2V
@pytest.fixture(scope="module")
def i2v_pipe():
    pytest.importorskip("ftfy", reason="diffusers 0.42's WanImageToVideoPipeline calls ftfy.fix_text unconditionally")
    return _load("WanImageToVideoPipeline", _snapshot("tiny_wan_i2v", "image_to_video"))


def _video(pipe, **kw):
    return pipe(prompt="a red fox", height=32, width=32, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
                generator=_gen(), output_type="np", max_sequence_length=32, **kw).frames


def test_wan_i2v_snapshot_has_the_image_encoder_and_processor(i2v_pipe):
    path = _snapshot("tiny_wan_i2v", "image_to_video")
    index = read_index(path)
    assert index["_class_name"] == "WanImageToVideoPipeline" and missing_weights(path) == []
    assert index["image_encoder"] == ["transformers", "CLIPVisionModelWithProjection"] and index["image_processor"][1].startswith(
        "CLIPImageProcessor")
    cfg = i2v_pipe.transformer.config
    assert cfg.image_dim == i2v_pipe.image_encoder.config.hidden_size and cfg.in_channels == 36
    assert i2v_pipe.image_processor.crop_size["height"] == i2v_pipe.image_encoder.config.image_size


def test_wan_i2v_image_embeds_reach_the_transformer(i2v_pipe):
    enc = i2v_pipe.image_encoder.config
    seen = _watch(i2v_pipe.transformer)
    video = _video(i2v_pipe, image=_image(48, 32, 1))
    assert video.shape == (1, 5, 32, 32, 3) and np.isfinite(video).all()
    tokens = (enc.image_size // enc.patch_size) ** 2 + 1
    assert all(k["encoder_hidden_states_image"] == (1, tokens, enc.hidden_size) for k in seen) and len(seen) == 2
    assert seen[0]["_hidden"].shape[1] == 36  # noise 16 + first-frame mask 4 + condition latents 16
    other = _video(i2v_pipe, image=_image(48, 32, 2))
    assert np.abs(other - video).max() > 1e-3
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):  # last_image needs the FLF2V variant
        _video(i2v_pipe, image=_image(48, 32, 1), last_image=_image(48, 32, 2))


def test_wan_flf2v_takes_first_and_last_frame():
    pytest.importorskip("ftfy", reason="diffusers 0.42's WanImageToVideoPipeline calls ftfy.fix_text unconditionally")
    pipe = _load("WanImageToVideoPipeline", _snapshot("tiny_wan_flf2v", "image_to_video"))
    enc = pipe.image_encoder.config
    seen = _watch(pipe.transformer)
    first, last = _image(32, 32, 1), _image(32, 32, 2)
    video = _video(pipe, image=first, last_image=last)
    tokens = (enc.image_size // enc.patch_size) ** 2 + 1
    assert video.shape == (1, 5, 32, 32, 3)
    assert seen[-1]["encoder_hidden_states_image"] == (2, tokens, enc.hidden_size)  # both frames' embeds
    other = _video(pipe, image=first, last_image=_image(32, 32, 3))
    assert np.abs(other - video).max() > 1e-3


# ------------------------------------------------------------------------------- img2img and inpaint
CASES = [("tiny_sd3", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline", {"guidance_scale": 1.0}),
         ("tiny_qwen_image", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", {"true_cfg_scale": 1.0})]


@pytest.mark.parametrize("model,img2img,inpaint,kw", CASES, ids=[c[0] for c in CASES])
def test_img2img_and_inpaint_load_the_text_to_image_snapshot(model, img2img, inpaint, kw):
    """The base snapshot loads as both task pipelines; img2img runs the forwards of the pipeline's strength rule
    (:func:`models.conditioning.steps_run`), an input of another size is resized to the requested size, and the
    input steers the output."""
    path = _snapshot(model, "image_to_image")
    spec = family_spec(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml").engine)
    assert read_index(path)["_class_name"] == spec.pipeline_class
    pipe = _load(img2img, path)
    seen = _watch(pipe.transformer)
    common = dict(prompt="a red circle", height=32, width=48, num_inference_steps=4, generator=None,
                  output_type="np", max_sequence_length=32, **kw)

    def call(p, **extra):
        return p(**{**common, "generator": _gen(), **extra}).images

    a = call(pipe, image=_image(80, 40, 1), strength=0.5)
    assert a.shape == (1, 32, 48, 3) and len(seen) == 2 == steps_run(4, 0.5)
    call(pipe, image=_image(80, 40, 1), strength=0.3)
    assert len(seen) - 2 == steps_run(4, 0.3) == 2  # the ceiling of 4 * 0.3, not int(1.2)
    b = call(pipe, image=_image(80, 40, 2), strength=0.5)
    assert np.abs(a - b).max() > 1e-3
    ipipe = _load(inpaint, path)
    mask = Image.new("L", (80, 40), 0)
    mask.paste(255, (40, 0, 80, 40))  # the right half is regenerated
    c = call(ipipe, image=_image(80, 40, 1), mask_image=mask, strength=1.0)
    d = call(ipipe, image=_image(80, 40, 2), mask_image=mask, strength=1.0)
    assert c.shape == (1, 32, 48, 3) and np.abs(c - d).max() > 1e-3


# ------------------------------------------------------------------------------------------ engine wiring
def _engine(compose, model: str, task: Optional[str]):
    """The family engine of ``model=<model>`` with ``model.task=<task>`` (None: the model config's own ``task``)."""
    from models.base import StageContext
    from runner.core.platform import detect

    cfg = compose([f"model={model}", "platform=cpu"] + ([f"model.task={task}"] if task is not None else []))
    return engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=[], stage="denoise", plat=detect("cpu", None), dtype=torch.float32))


def test_engine_builds_the_task_snapshot_from_model_task(compose):
    """``model.task`` picks the snapshot: the engine's own ``embedded_snapshot`` builds (or finds) the task's
    checkpoint, and the architecture check requires the task's components and accepts them otherwise."""
    from runner.core.errors import ConfigValueError

    eng = _engine(compose, "tiny_wan_i2v", "image_to_video")
    assert eng.task == "image_to_video" and eng.snapshot_task() == "image_to_video"
    eng.check_architecture(eng.arch_copy())
    path = eng.embedded_snapshot(eng.arch_copy())
    assert path == _snapshot("tiny_wan_i2v", "image_to_video") and read_index(path)["_class_name"] == (
        "WanImageToVideoPipeline")
    arch = {k: v for k, v in eng.arch_copy().items() if k != "image_encoder"}
    with pytest.raises(ConfigValueError, match="image_encoder is missing"):
        eng.check_architecture(arch)
    base = _engine(compose, "tiny_wan_i2v", "text_to_video")  # the base task: base components; a component only
    assert base.task == "text_to_video" and base.snapshot_task() is None  # another task builds is refused
    base.check_architecture(base.arch_copy())
    with pytest.raises(ConfigValueError, match=r"^model\.architecture\.image_encoder is built only for "
                       r"model\.task=image_to_video; this run's task is text_to_video \(model=tiny_wan_i2v\)"):
        base.check_task_components()
    assert base.embedded_target(base.arch_copy()) != eng.embedded_target(eng.arch_copy())
    sd3 = _engine(compose, "tiny_sd3", "inpaint")  # inpaint reuses the text-to-image snapshot
    assert sd3.snapshot_task() is None and sd3.embedded_target(sd3.arch_copy()) == _engine(
        compose, "tiny_sd3", None).embedded_target(sd3.arch_copy())


def test_engine_dummy_weights_build_the_task_components(compose):
    eng = _engine(compose, "tiny_wan_i2v", "image_to_video")
    comps = eng.build_components(eng.arch_copy(), device="meta", task=eng.task)
    assert type(comps["image_encoder"]).__name__ == "CLIPVisionModelWithProjection"
    assert type(comps["image_processor"]).__name__.startswith("CLIPImageProcessor")
    assert "image_encoder" not in eng.build_components(eng.arch_copy(), device="meta")
    edit = _engine(compose, "tiny_qwen_image_edit", "edit")
    toks = edit.tokenizers()["qwen2_5_vl"]
    assert "<|image_pad|>" in toks.get_vocab()  # the edit tokenizer (vision markers), as the snapshot's


def test_a_published_edit_plus_layout_loads_its_processor_without_torchvision(tmp_path):
    """Qwen-Image-Edit-2509 names ``transformers.Qwen2VLProcessor``, which transformers 5 loads only with a video
    processor (torchvision); :func:`models.processors.processor_overrides` loads it with the local class instead."""
    import json
    import shutil

    from models.processors import Qwen2VLImageTextProcessor, processor_overrides

    snap = tmp_path / "edit-2509-layout"
    shutil.copytree(_snapshot("tiny_qwen_image_edit", "edit"), snap)
    index = json.loads((snap / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    (snap / "model_index.json").write_text(json.dumps(index))
    from diffusers import QwenImageEditPlusPipeline

    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(OSError, match="video processor"):
            QwenImageEditPlusPipeline.from_pretrained(snap, local_files_only=True, use_safetensors=True)
    over = processor_overrides(snap)
    assert isinstance(over["processor"], Qwen2VLImageTextProcessor)
    pipe = QwenImageEditPlusPipeline.from_pretrained(snap, local_files_only=True, use_safetensors=True, **over)
    assert pipe.processor is over["processor"]
    assert processor_overrides(_snapshot("tiny_wan_i2v", "image_to_video")) == {}


def test_edit_token_counts_follow_the_edit_template(compose):
    """Under ``edit`` the records count the Edit-Plus template's tokens (64 dropped) and nothing is truncated."""
    edit, t2i = _engine(compose, "tiny_qwen_image_edit", "edit"), _engine(compose, "tiny_qwen_image", None)
    prompt = "make the circle blue " * 20  # longer than max_sequence_length (64)
    rec = edit.prompt_tokens([prompt])[0]["qwen2_5_vl"]
    tok = edit.tokenizers()["qwen2_5_vl"]
    from models.qwen_image import EDIT_TEMPLATE

    assert rec["count"] == len(tok(EDIT_TEMPLATE.format(prompt))["input_ids"]) - 64 and rec["dropped"] == 0
    assert t2i.prompt_tokens([prompt])[0]["qwen2_5_vl"]["dropped"] > 0  # QwenImagePipeline keeps 64


@pytest.mark.parametrize("model,task,billions", [("wan_i2v", "image_to_video", (16.0, 17.5)),
                                                 ("qwen_image_edit", "edit", (20.0, 21.0))])
def test_full_size_task_configs_build_on_meta(compose, model, task, billions):
    """The full-size configs' keys are checked against the component classes and the task's architecture builds on
    the meta device (``load_format=dummy``, no memory): the transformer's size is the published model's."""
    from models.base import StageContext
    from runner.core.platform import detect

    cfg = compose([f"model={model}", "platform=cpu", "model.load_format=dummy", f"model.task={task}"])
    eng = engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=[], stage="denoise",
                                                       plat=detect("cpu", None), dtype=torch.bfloat16))
    assert eng.resolve_source()["kind"] == "dummy"
    comps = eng.build_components(eng.arch_copy(), device="meta", dtype=torch.bfloat16, task=task)
    n = sum(p.numel() for p in comps["transformer"].parameters()) / 1e9
    assert billions[0] < n < billions[1], n
    extra = "image_encoder" if task == "image_to_video" else "processor"
    assert extra in comps


def test_steps_run_is_the_sd3_pipelines_get_timesteps():
    """:func:`models.conditioning.steps_run` against diffusers' own ``get_timesteps`` (on a scheduler whose
    timesteps are set), over a grid of steps and strengths."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Img2ImgPipeline

    pipe = StableDiffusion3Img2ImgPipeline.__new__(StableDiffusion3Img2ImgPipeline)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()
    for steps in (1, 2, 4, 8, 28, 50, 100):
        pipe.scheduler.set_timesteps(steps)
        for strength in (0.05, 0.1, 0.3, 0.45, 0.55, 0.6, 0.9, 1.0):
            _, n = pipe.get_timesteps(steps, strength, "cpu")
            assert steps_run(steps, strength) == n, (steps, strength)
    assert steps_run(100, 0.55) == 56 and steps_run(28, 0.3) == 9


def test_a_misspelt_processor_key_is_refused(compose):
    from runner.core.errors import ConfigValueError

    eng = _engine(compose, "tiny_qwen_image_edit", "edit")
    arch = eng.arch_copy()
    arch["processor"] = {**arch["processor"], "merge_sise": 2}
    with pytest.raises(ConfigValueError, match=r"processor.merge_sise .*did you mean model.architecture.processor."
                                               r"merge_size"):
        eng.check_architecture(arch)
    eng.check_architecture(eng.arch_copy())


def test_edit_sizes_at_the_published_constants():
    """At the pipeline's own constants (1024x1024 for the VAE, 384x384 for the text encoder): every reference is
    ~1 MP whatever its size, and without a width/height the output follows the last reference's aspect ratio."""
    from models.qwen_image import edit_sizes

    got = edit_sizes([(64, 48), (1920, 1080)])
    assert got["vae"] == [(1184, 896), (1376, 768)] and got["condition"] == [(448, 320), (512, 288)]
    assert got["output"] == (1376, 768)
    assert edit_sizes([(64, 48)], 512, 512)["output"] == (512, 512)
