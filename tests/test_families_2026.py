"""The 2026 families (issue #31): FLUX.2-dev (``flux2``, Flux2Pipeline), FLUX.2 [klein] (``flux2_klein``,
Flux2KleinPipeline) and Z-Image (``zimage``, ZImagePipeline): their guidance and negative-prompt rules as the
pipelines apply them, the klein ``is_distilled`` switch carried by the snapshot, the text-layer check, token counts
against what the pipelines encode, and the full-size configs against the published component configs. End to end
(verified, resume, repro) in tests/test_families.py's family sweep; geometry in tests/test_family_geometry.py."""

from __future__ import annotations

import inspect

import pytest

from runner.core.dataset import DatasetError
from runner.core.errors import ConfigValueError


def _engine(cfg):
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    return engine_class(cfg.model.engine)(StageContext(
        cfg=cfg, overrides=[], stage="denoise", plat=detect(cfg.platform.name, cfg.platform.device), dtype=torch.float32))


def _item(**row):
    from types import SimpleNamespace

    base = dict(negative_prompt=None, guidance_scale=4.0, num_inference_steps=4)
    return SimpleNamespace(row=SimpleNamespace(**{**base, **row}))


# ------------------------------------------------------------------------------------------------ guidance rules
@pytest.mark.parametrize("guidance,per_step", [(4.0, 2), (1.0, 1), (0.5, 1)])
def test_klein_cfg_is_a_second_forward_above_1(compose, guidance, per_step):
    """Flux2KleinPipeline: ``do_classifier_free_guidance = guidance_scale > 1 and not is_distilled``."""
    eng = _engine(compose(["model=tiny_flux2_klein", "platform=cpu"]))
    assert eng.expected_forwards([_item(guidance_scale=guidance)]) == 4 * per_step


def test_distilled_klein_runs_one_forward_and_ignores_guidance(compose, write_jsonl):
    eng = _engine(compose(["model=tiny_flux2_klein", "platform=cpu", "model.architecture.pipeline.is_distilled=true",
                           "model.generation.guidance_scale=null"]))
    assert eng.is_distilled and eng.expected_forwards([_item(guidance_scale=4.0)]) == 4
    rows = write_jsonl([{"id": "a", "prompt": "x", "guidance_scale": 4.0}])
    eng = _engine(compose(["model=tiny_flux2_klein", "platform=cpu", "model.architecture.pipeline.is_distilled=true",
                           "model.generation.guidance_scale=null", "dataset=jsonl", f"dataset.path={rows}"]))
    with pytest.raises(DatasetError, match="is_distilled=true.*no classifier-free guidance"):
        eng.read_rows()


@pytest.mark.slow
def test_distilled_klein_snapshot_carries_is_distilled(run_job):
    """``model.architecture.pipeline.is_distilled=true`` reaches the embedded snapshot's model_index.json and the
    loaded pipeline: with a guidance value the pipeline would otherwise use (its default 4.0), one forward per step
    ran (a second, unconditional forward would be a forward-count mismatch)."""
    r = run_job(["model=tiny_flux2_klein", "model.architecture.pipeline.is_distilled=true",
                 "model.generation.guidance_scale=null", "dataset.limit=1"])
    assert r.code == 0
    st = r.manifest["evidence"]["stages"]["denoise"]
    assert r.manifest["evidence"]["verdict"] == "verified"
    assert st["denoiser_forwards"] == st["expected_forwards"] == 4
    import json
    from pathlib import Path

    index = json.loads((Path(r.manifest["model"]["source"]["path"]) / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2KleinPipeline" and index["is_distilled"] is True


@pytest.mark.parametrize("model", ["tiny_flux2_klein", "tiny_zimage", "tiny_flux2"])
def test_null_guidance_is_refused_where_the_pipeline_would_apply_its_default(compose, model):
    """Klein (4.0: CFG), Z-Image (5.0: CFG) and FLUX.2-dev (its guidance embedding takes a value) would run a
    guidance the record calls null."""
    eng = _engine(compose([f"model={model}", "platform=cpu", "model.generation.guidance_scale=null"]))
    with pytest.raises(ConfigValueError, match="model.generation.guidance_scale=null"):
        eng.read_rows()


@pytest.mark.parametrize("guidance,used", [(0.5, True), (4.0, True), (0.0, False)])
def test_zimage_uses_the_negative_prompt_above_0(compose, write_jsonl, guidance, used):
    """ZImagePipeline: ``do_classifier_free_guidance = guidance_scale > 0`` (not > 1): a negative prompt at 0.5 is
    applied (batched into the one forward per step); at 0 it is ignored and refused by default."""
    rows = write_jsonl([{"id": "a", "prompt": "x", "negative_prompt": "blurry", "guidance_scale": guidance}])
    eng = _engine(compose(["model=tiny_zimage", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]))
    if used:
        got, _ = eng.read_rows()
        assert got[0].negative_prompt == "blurry"
        assert eng.expected_forwards([_item(guidance_scale=guidance, negative_prompt="blurry")]) == 4
    else:
        with pytest.raises(DatasetError, match=r"guidance_scale <= 0 turns classifier-free guidance off"):
            eng.read_rows()


@pytest.mark.parametrize("model,pipeline", [("tiny_flux2", "Flux2Pipeline"), ("tiny_flux2_klein", "Flux2KleinPipeline")])
def test_flux2_negative_prompt_is_ignored(compose, write_jsonl, model, pipeline):
    """Neither FLUX.2 pipeline takes a negative prompt: refused by default (the row named), stripped and recorded
    under ``dataset.on_ignored=record``."""
    assert "negative_prompt" not in inspect.signature(getattr(__import__("diffusers"), pipeline).__call__).parameters
    rows = write_jsonl([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y", "negative_prompt": "blurry"}])
    base = [f"model={model}", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]
    with pytest.raises(DatasetError) as e:
        _engine(compose(base)).read_rows()
    assert len(e.value.problems) == 1 and ":2:" in e.value.problems[0] and pipeline in e.value.problems[0]
    got, _ = _engine(compose([*base, "dataset.on_ignored=record"])).read_rows()
    assert got[1].negative_prompt is None and got[1].ignored["negative_prompt"]["value"] == "blurry"


def test_flux2_without_guidance_embedding_ignores_guidance_scale(compose):
    """FLUX.1's rule on FLUX.2-dev: a transformer without guidance embedding makes guidance_scale inert. The model's
    own default (tiny_flux2's ``guidance_scale: 4.0``) is then recorded as ignored in every row, not applied; the
    same value chosen on the command line is refused (``runner.core.resolve.user_chose``)."""
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    ov = ["model=tiny_flux2", "platform=cpu", "model.architecture.transformer.guidance_embeds=false"]
    eng = _engine(compose(ov))
    assert not eng.guidance_embeds
    rows, _ = eng.read_rows()
    assert rows and all(r.guidance_scale is None and r.ignored["guidance_scale"]["value"] == 4.0 for r in rows)
    chosen = [*ov, "model.generation.guidance_scale=4"]
    cfg = compose(chosen)
    eng = engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=chosen, stage="denoise",
                                                      plat=detect("cpu", "cpu"), dtype=torch.float32))
    with pytest.raises(ConfigValueError, match="guidance_scale=4.0 is ignored.*no guidance embedding"):
        eng.read_rows()


# ------------------------------------------------------------------------------------------- text layers, sizes
@pytest.mark.parametrize("model,key,value,match", [
    ("tiny_flux2", "text_encoder.text_config.num_hidden_layers", 20, r"num_hidden_layers=20.*\(10, 20, 30\)"),
    ("tiny_flux2_klein", "text_encoder.num_hidden_layers", 26, r"num_hidden_layers=26.*\(9, 18, 27\)"),
    ("tiny_flux2", "transformer.joint_attention_dim", 32, r"joint_attention_dim=32.*3 hidden states of 16 \(48\)")])
def test_text_layers_the_pipeline_reads_are_checked_before_loading(compose, model, key, value, match):
    """Flux2Pipeline stacks hidden states 10, 20, 30 and klein 9, 18, 27 (their ``text_encoder_out_layers``
    defaults): an encoder with fewer layers, or a transformer whose context width is not 3 x the hidden size, failed
    at the first prompt (IndexError / shape error); refused at startup now."""
    eng = _engine(compose([f"model={model}", "platform=cpu", f"model.architecture.{key}={value}"]))
    with pytest.raises(ConfigValueError, match=match):
        eng.prepare()


@pytest.mark.parametrize("model", ["tiny_flux2", "tiny_flux2_klein", "tiny_zimage"])
def test_size_rule_is_the_pipelines_own(compose, model):
    """The spec's size need (read from the VAE config before anything loads) equals what the pipeline computes when
    built on those components: ``vae_scale_factor * 2``."""
    from omegaconf import OmegaConf

    cfg = compose([f"model={model}", "platform=cpu"])
    eng = _engine(cfg)
    pipe = eng.pipeline_cls()(**eng.build_components(OmegaConf.to_container(cfg.model.architecture, resolve=True)))
    assert eng.size_need() == pipe.vae_scale_factor * 2 == pipe.image_processor.config.vae_scale_factor


# ------------------------------------------------------------------------------------------------------ tokens
def test_zimage_token_count_is_what_the_pipeline_encodes(compose):
    """The record's Qwen3 token count (chat template, enable_thinking=True) is the caption length ZImagePipeline's
    own ``_encode_prompt`` keeps, below and above ``max_sequence_length``."""
    import diffusers
    import torch
    from omegaconf import OmegaConf

    cfg = compose(["model=tiny_zimage", "platform=cpu", "model.generation.max_sequence_length=24"])
    eng = _engine(cfg)
    comps = eng.build_components(OmegaConf.to_container(cfg.model.architecture, resolve=True))
    pipe = diffusers.ZImagePipeline(**comps)
    prompts = ["a cat", "a very long prompt about a red cube on a blue table next to a green sphere under a lamp"]
    counts = eng.count_tokens("qwen3", comps["tokenizer"], prompts)
    with torch.no_grad():
        embeds = pipe._encode_prompt(list(prompts), device="cpu", max_sequence_length=24)
    assert [e.shape[0] for e in embeds] == [min(c, 24) for c in counts]
    assert counts[1] > 24 > counts[0]


def test_flux2_token_count_includes_the_system_message(compose):
    """Flux2Pipeline wraps the prompt with its system message in the chat template; the record counts those
    tokens, as many as the pipeline's attention mask holds (up to max_sequence_length)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, format_input
    from omegaconf import OmegaConf

    cfg = compose(["model=tiny_flux2", "platform=cpu"])
    eng = _engine(cfg)
    tok = eng.build_tokenizers(OmegaConf.to_container(cfg.model.architecture, resolve=True))["tokenizer"]
    prompts = ["a cat", "a dog on a red sofa"]
    counts = eng.count_tokens("mistral3", tok, prompts)
    mask = tok.apply_chat_template(format_input(prompts, SYSTEM_MESSAGE), add_generation_prompt=False, tokenize=True,
                                   return_dict=True, return_tensors="pt", padding="max_length", truncation=True,
                                   max_length=512)["attention_mask"]
    assert counts == mask.sum(1).tolist()
    assert counts[0] > len(tok("a cat")["input_ids"]) + 10  # the system message is in it


# ----------------------------------------------------------------------------------------- full-size configs
#: the published transformer configs (diffusers scripts/convert_flux2_to_diffusers.py; Z-Image's transformer/config.json)
PUBLISHED = {
    "flux2": {"in_channels": 128, "num_layers": 8, "num_single_layers": 48, "attention_head_dim": 128,
              "num_attention_heads": 48, "joint_attention_dim": 15360},
    "flux2_klein": {"in_channels": 128, "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128,
                    "num_attention_heads": 24, "joint_attention_dim": 7680, "guidance_embeds": False},
    "zimage": {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "cap_feat_dim": 2560},
    "zimage_turbo": {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "cap_feat_dim": 2560},
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_full_size_configs_build_the_published_architecture(compose, model):
    """Each full-size config is accepted by the component classes (every key checked), its transformer holds the
    published values, its text encoder feeds the transformer's context width, and the architecture builds on the
    meta device (no memory) with the parameter count of the published model."""
    import torch
    from omegaconf import OmegaConf

    cfg = compose([f"model={model}", "platform=cpu", "model.load_format=dummy"])
    eng = _engine(cfg)
    eng.resolve_source()
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    assert {k: arch["transformer"][k] for k in PUBLISHED[model]} == PUBLISHED[model]
    eng.check_source()  # size rule, text layers
    comps = eng.build_components(arch, device="meta", dtype=torch.bfloat16)
    billions = {c: sum(p.numel() for p in comps[c].parameters()) / 1e9 for c in ("transformer", "text_encoder")}
    # the published sizes in billions: FLUX.2-dev 32B + Mistral-Small-3.x 24B; klein 4B + Qwen3-4B; Z-Image 6B + Qwen3-4B
    want = {"flux2": (32, 24), "flux2_klein": (4, 4), "zimage": (6, 4), "zimage_turbo": (6, 4)}[model]
    for (comp, got), n in zip(billions.items(), want):
        assert abs(got - n) / n < 0.1, (comp, got, n)


@pytest.mark.parametrize("pipeline,family", [("Flux2Pipeline", "flux2"), ("Flux2KleinPipeline", "flux2_klein"),
                                             ("ZImagePipeline", "zimage")])
def test_a_snapshot_of_the_new_pipelines_names_its_adapter(compose, tmp_path, pipeline, family):
    """A FLUX.2 / Z-Image snapshot given to another family's model config is refused before loading, and the fix
    names the family that serves it (``model.engine=...``), from the registry."""
    import json

    from runner.core.weights import ModelPathError

    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "model_index.json").write_text(json.dumps({"_class_name": pipeline, "transformer": ["diffusers", "X"]}))
    (snap / "transformer").mkdir()
    eng = _engine(compose(["model=tiny_sd3", "platform=cpu", f"model.path={snap}"]))
    with pytest.raises(ModelPathError, match=f"found {pipeline}.*model.engine={family} for this snapshot"):
        eng.resolve_source()
