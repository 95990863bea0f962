"""Issue #42: the rules of ``models.source.WeightSource`` (where a stage's weights come from and what the snapshot
must hold) asserted on the real family engines (composed tiny model configs, ``platform=cpu``) and small
hand-written snapshot folders, so that a wrong rule fails a test (``benchmarks/mutation.py``, groups
``core_m_source_*``). Nothing here loads weights or builds a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch

from models import source as src
from models.registry import engine_class
from runner.core.errors import ConfigValueError
from runner.core.weights import ModelPathError


def engine(compose, model: str, *overrides: str, cli: Optional[list] = None, dtype: torch.dtype = torch.float32):
    """The engine of ``model=<model>`` (its family's, or ``model.engine=diffusers``) composed with ``overrides``;
    ``cli``: the command-line overrides the stage context records (default: ``overrides``)."""
    from models.base import StageContext
    from runner.core.platform import detect

    cfg = compose([f"model={model}", "platform=cpu", *overrides])
    ctx = StageContext(cfg=cfg, overrides=list(overrides if cli is None else cli), stage="denoise",
                       plat=detect("cpu", None), dtype=dtype)
    return engine_class(cfg.model.engine)(ctx)


def write_snapshot(root: Path, index, files=None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps(index))
    for rel, doc in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return root


FLUX_INDEX = {"_class_name": "FluxPipeline", "_diffusers_version": "0.35.0",
              "transformer": ["diffusers", "FluxTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
              "text_encoder": ["transformers", "CLIPTextModel"], "text_encoder_2": ["transformers", "T5EncoderModel"],
              "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "T5TokenizerFast"],
              "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}


def flux_snapshot(root: Path, index=None, skip=()) -> Path:
    """A FLUX snapshot layout: ``model_index.json`` and a folder with a ``config.json`` per component (no weights)."""
    index = dict(FLUX_INDEX if index is None else index)
    files = {f"{c}/config.json": {"c": c} for c in index if not c.startswith("_") and c not in skip}
    return write_snapshot(root, index, files)


# ------------------------------------------------------------------------------------------------ models_with_task


def test_models_with_task_reads_each_model_config_sorted_and_skips_unreadable_ones(tmp_path, monkeypatch):
    import runner.core.paths as paths

    d = tmp_path / "model"
    d.mkdir()
    (d / "b.yaml").write_text("task: edit\n")
    (d / "a.yaml").write_text("name: a\ntask: edit\n")
    (d / "c.yaml").write_text("task: text_to_image\n")
    (d / "d.yaml").write_text("task: [edit\n")  # not YAML
    (d / "e.yaml").write_text("- task\n- edit\n")  # not a mapping
    (d / "f.yaml").write_text("")  # empty
    (d / "g.yml").write_text("task: edit\n")  # not a .yaml file
    (d / "h.yaml").write_text("task: 5\n")
    (d / "i.yaml").write_bytes("task: edit\nname: caf\u00e9\n".encode("latin-1"))  # not UTF-8: skipped
    monkeypatch.setattr(paths, "CONF_DIR", tmp_path)
    assert src.models_with_task("edit") == ["a", "b"]
    assert src.models_with_task("5") == ["h"]
    assert src.models_with_task("inpaint") == []


def test_models_with_task_of_the_repository_configs():
    assert src.models_with_task("image_to_video") == ["tiny_wan_flf2v", "tiny_wan_i2v", "wan_i2v"]


def test_family_names_are_the_registry_families():
    names = src.family_names()
    assert names == sorted(names) and {"flux", "wan", "sd3"} <= set(names) and "diffusers" not in names


# ------------------------------------------------------------------------------------------------ pipeline name


def test_pipeline_name_is_the_family_pipeline_of_the_task(compose):
    assert engine(compose, "tiny_flux").pipeline_name() == "FluxPipeline"
    assert engine(compose, "tiny_flux", "model.task=edit").pipeline_name() == "FluxKontextPipeline"
    assert engine(compose, "tiny_flux").pipeline_cls().__name__ == "FluxPipeline"


def test_pipeline_name_without_a_family_comes_from_the_snapshot(compose, tmp_path):
    eng = engine(compose, "tiny_flux", "model.engine=diffusers")
    assert eng.spec is None
    with pytest.raises(ModelPathError) as e:
        eng.pipeline_name()  # embedded weights, no family: nothing names the pipeline
    assert str(e.value) == ("model=tiny_flux (model.engine=diffusers) learns its pipeline from a snapshot; fix: set "
                            "model.path to a diffusers snapshot (embedded and dummy weights need a family: "
                            f"model.engine={'|'.join(src.family_names())})")
    s = write_snapshot(tmp_path / "s", {"_class_name": "SD3Pipeline"})
    eng.source = {"kind": "path", "path": str(s)}
    assert eng.pipeline_name() == "SD3Pipeline"
    eng.pipeline_class = "FluxPipeline"  # a class the engine knows wins over the snapshot's
    assert eng.pipeline_name() == "FluxPipeline"
    eng.pipeline_class = None
    write_snapshot(s, {"_class_name": "NoSuchPipelineXyz"})
    with pytest.raises(ModelPathError) as e:
        eng.pipeline_cls()
    import diffusers

    assert str(e.value) == (f"model.path={str(s)!r} names pipeline 'NoSuchPipelineXyz', which diffusers "
                            f"{diffusers.__version__} does not have; fix: a snapshot of a diffusers pipeline, or a "
                            "diffusers version that has it")


def test_arch_copy_is_a_deep_copy(compose):
    eng = engine(compose, "tiny_flux")
    a = eng.arch_copy()
    assert a["transformer"]["num_layers"] == 1 and a["weights_seed"] == 0
    a["transformer"]["num_layers"] = 7
    assert eng.arch_copy()["transformer"]["num_layers"] == 1


# ------------------------------------------------------------------------------------------------ resolve_source


def test_resolve_source_dummy_embedded_and_none(compose):
    eng = engine(compose, "tiny_flux", "model.load_format=dummy", "model.architecture.weights_seed=5")
    assert eng.resolve_source() == {"kind": "dummy", "weights_seed": 5} and eng.source["kind"] == "dummy"
    assert engine(compose, "tiny_flux", "model.load_format=dummy").resolve_source() == {"kind": "dummy",
                                                                                       "weights_seed": 0}
    assert engine(compose, "tiny_flux").resolve_source() == {"kind": "embedded"}
    with pytest.raises(ModelPathError) as e:
        engine(compose, "tiny_flux", "model.embedded=false").resolve_source()
    assert str(e.value) == ("model=tiny_flux needs weights: set model.path=/path/to/diffusers/snapshot (or a Hub id "
                            "in the local cache), or model.load_format=dummy for random weights")


def test_resolve_source_checks_the_architecture_of_dummy_and_embedded_weights(compose):
    for ov in ("model.load_format=dummy", "model.embedded=true", "model.load_format=dummy model.embedded=false"):
        with pytest.raises(ConfigValueError, match="model.architecture.transformr is not read"):
            engine(compose, "tiny_flux", *ov.split(), "+model.architecture.transformr={}").resolve_source()


def test_resolve_source_of_a_local_snapshot(compose, tmp_path):
    s = flux_snapshot(tmp_path / "s")
    eng = engine(compose, "tiny_flux", f"model.path={s}")
    got = eng.resolve_source()
    assert got == {"kind": "path", "path": str(s.resolve()), "revision": None} and "hub" not in got
    # the snapshot decides the architecture: a command-line value it contradicts is refused, one it agrees with is not
    (s / "transformer" / "config.json").write_text(json.dumps({"num_layers": 1, "attention_head_dim": 32}))
    assert engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=1"
                  ).resolve_source()["kind"] == "path"
    with pytest.raises(ConfigValueError) as e:
        engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=3").resolve_source()
    assert "model.architecture.transformer.num_layers=3: the snapshot's transformer/config.json says 1" in str(e.value)
    # an override the context does not record as given on the command line is not compared
    assert engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=3",
                  cli=[]).resolve_source()["kind"] == "path"
    with pytest.raises(ConfigValueError, match="num_layers=3"):  # a "++" prefix is the same key
        engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=3",
               cli=[f"model.path={s}", "++model.architecture.transformer.num_layers=3"]).resolve_source()
    with pytest.raises(ConfigValueError, match="num_layers=3"):
        engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=3",
               cli=["~model.architecture.transformer.num_layers=3"]).resolve_source()
    with pytest.raises(ModelPathError, match="has no model_index.json"):
        engine(compose, "tiny_flux", f"model.path={tmp_path}").resolve_source()


# ------------------------------------------------------------------------------------------------ layout


def test_layout_problems_name_each_missing_or_wrong_component(compose, tmp_path):
    eng = engine(compose, "tiny_flux")
    s = flux_snapshot(tmp_path / "s")
    comps = {k: v[1] for k, v in FLUX_INDEX.items() if not k.startswith("_")}
    assert eng.layout_problems(s, "FluxPipeline", comps) == []
    # any base-layout pipeline of the family is fine for text_to_image; the edit task needs its own? no: Kontext
    # shares the base layout (not an own snapshot), so every non-own class is accepted
    assert eng.layout_problems(s, "FluxKontextPipeline", comps) == []
    assert eng.layout_problems(s, "SD3Pipeline", comps)[0].startswith("pipeline FluxPipeline or ")
    wrong = dict(comps, vae="AutoencoderKLWan")
    assert eng.layout_problems(s, "FluxPipeline", wrong) == ["vae is AutoencoderKLWan, expected AutoencoderKL"]
    less = {k: v for k, v in comps.items() if k != "text_encoder_2"}
    assert eng.layout_problems(s, "FluxPipeline", less) == ["component text_encoder_2 (T5EncoderModel) is missing"]
    no_sched = {k: v for k, v in comps.items() if k != "scheduler"}
    assert eng.layout_problems(s, "FluxPipeline", no_sched) == []  # the scheduler is not checked
    t = flux_snapshot(tmp_path / "t", skip=("vae",))
    assert eng.layout_problems(t, "FluxPipeline", comps) == ["folder vae/ is missing"]


def test_layout_problems_of_a_task_with_its_own_snapshot(compose, tmp_path):
    eng = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    assert eng.task == "image_to_video"
    probs = eng.layout_problems(tmp_path, "WanPipeline", {})
    assert probs[0] == "pipeline WanImageToVideoPipeline, found WanPipeline"
    base = engine(compose, "tiny_wan")
    assert base.layout_problems(tmp_path, "WanImageToVideoPipeline", {})[0] == (
        "pipeline WanPipeline, found WanImageToVideoPipeline")
    # Wan's second expert is optional: its absence is no problem, a wrong class is
    comps = {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan", "text_encoder": "UMT5EncoderModel",
             "tokenizer": "T5TokenizerFast", "scheduler": "UniPCMultistepScheduler"}
    s = write_snapshot(tmp_path / "w", {}, {f"{c}/config.json": "{}" for c in comps})
    assert base.layout_problems(s, "WanPipeline", comps) == []
    assert base.layout_problems(s, "WanPipeline", dict(comps, transformer_2="X")) == [
        "transformer_2 is X, expected WanTransformer3DModel"]
    # an absent optional expert is skipped, and the components after it are still checked
    assert base.layout_problems(s, "WanPipeline", dict(comps, vae="X")) == ["vae is X, expected AutoencoderKLWan"]
    # the task's own components: image_to_video needs the image encoder
    eng = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    assert eng.layout_problems(s, "WanImageToVideoPipeline", comps) == [
        "component image_encoder (CLIPVisionModelWithProjection) is missing", "processor image_processor is missing"]
    # several problems, each named (joined by "; " in check_layout's message)
    with pytest.raises(ModelPathError) as e:
        eng.check_layout(write_snapshot(tmp_path / "w2", {"_class_name": "WanImageToVideoPipeline",
                                                          **{c: ["x", v] for c, v in comps.items() if c != "vae"}},
                                        {f"{c}/config.json": "{}" for c in comps}))
    assert ("can load: component vae (AutoencoderKLWan) is missing; component image_encoder "
            "(CLIPVisionModelWithProjection) is missing; processor image_processor is missing (the snapshot: "
            "WanImageToVideoPipeline with ") in str(e.value)


def test_layout_problems_of_a_task_with_processors(compose, tmp_path):
    eng = engine(compose, "tiny_qwen_image_edit")
    assert eng.task == "edit"
    comps = {"transformer": "QwenImageTransformer2DModel", "vae": "AutoencoderKLQwenImage",
             "text_encoder": "Qwen2_5_VLForConditionalGeneration", "tokenizer": "Qwen2Tokenizer",
             "scheduler": "FlowMatchEulerDiscreteScheduler"}
    s = write_snapshot(tmp_path / "q", {}, {f"{c}/config.json": "{}" for c in comps})
    assert eng.layout_problems(s, "QwenImageEditPlusPipeline", comps) == ["processor processor is missing"]
    assert eng.layout_problems(s, "QwenImageEditPlusPipeline", dict(comps, processor="Qwen2VLProcessor")) == []


def test_check_layout_message_and_the_transformer_rule(compose, tmp_path):
    eng = engine(compose, "tiny_flux")
    eng.check_layout(flux_snapshot(tmp_path / "ok"))
    bad = flux_snapshot(tmp_path / "bad", index=dict(FLUX_INDEX, vae=["diffusers", "AutoencoderKLWan"],
                                                     _extra=["diffusers", "Odd"]))
    with pytest.raises(ModelPathError) as e:
        eng.check_layout(bad)
    msg = str(e.value)
    assert msg.startswith(f"model.path={str(bad)!r} is not a FluxPipeline snapshot that model=tiny_flux "
                          "(model.task=text_to_image) can load: vae is AutoencoderKLWan, expected AutoencoderKL")
    assert "(the snapshot: FluxPipeline with scheduler: FlowMatchEulerDiscreteScheduler, text_encoder:" in msg
    assert "_extra" not in msg and "Odd" not in msg  # a private key is not a component
    assert msg.endswith("fix: point model.path at a FluxPipeline snapshot (a checkpoint of model.task=text_to_image), "
                        "or model.task=<the snapshot's task>")
    odd = flux_snapshot(tmp_path / "odd", index=dict(FLUX_INDEX, _class_name="MysteryPipeline"))
    with pytest.raises(ModelPathError) as e:
        eng.check_layout(odd)  # a pipeline no family has
    assert "found MysteryPipeline" in str(e.value) and str(e.value).endswith(
        "fix: point model.path at a snapshot of this model, or use model.engine=diffusers for another "
        "transformer-based pipeline")
    sd3 = flux_snapshot(tmp_path / "sd3", index=dict(FLUX_INDEX, _class_name="StableDiffusion3Pipeline"))
    with pytest.raises(ModelPathError) as e:
        eng.check_layout(sd3)
    assert "fix: use a model config with model.engine=sd3 for this snapshot" in str(e.value)
    kontext = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    w = write_snapshot(tmp_path / "wan", {"_class_name": "WanPipeline"})
    with pytest.raises(ModelPathError) as e:
        kontext.check_layout(w)
    assert ("fix: point model.path at a WanImageToVideoPipeline snapshot (a checkpoint of model.task=image_to_video)"
            in str(e.value)) and "with no components)" in str(e.value)
    # model.engine=diffusers checks no family layout, only that there is a transformer
    dif = engine(compose, "tiny_flux", "model.engine=diffusers")
    dif.check_layout(flux_snapshot(tmp_path / "d"))
    dif.pipeline_class = "FluxPipeline"  # an engine without a family that names its pipeline class
    with pytest.raises(ModelPathError) as e:
        dif.check_layout(sd3)
    assert str(e.value).startswith(f"model.path={str(sd3)!r} is not a FluxPipeline snapshot that model=tiny_flux "
                                   "(model.task=text_to_image) can load: pipeline FluxPipeline, found "
                                   "StableDiffusion3Pipeline")
    dif.pipeline_class = None
    unet = write_snapshot(tmp_path / "unet", {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "U"],
                                              "vae": ["diffusers", "AutoencoderKL"], "x": [None, None]})
    with pytest.raises(ModelPathError) as e:
        dif.check_layout(unet)
    assert str(e.value) == (f"model.path={str(unet)!r}: StableDiffusionPipeline has no transformer (unet: U, vae: "
                            "AutoencoderKL); the runner serves transformer-based pipelines (a UNet pipeline is not "
                            "one); fix: a DiT snapshot (FLUX.1, SD3.5, Qwen-Image, Wan...)")


# ------------------------------------------------------------------------------------------------ architecture


def test_check_architecture_names_the_unknown_key_and_the_closest(compose):
    eng = engine(compose, "tiny_flux")
    arch = eng.arch_copy()
    eng.check_architecture(arch)
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture(dict(arch, vea={}))
    assert str(e.value) == ("model.architecture.vea is not read by the flux builder; did you mean "
                            "model.architecture.vae? fix: remove or correct it")
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture(dict(arch, zzzzzz={}), where="w")
    assert str(e.value).startswith("w.zzzzzz is not read by the flux builder (it reads transformer, vae, ")
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture({k: v for k, v in arch.items() if k != "vae"})
    assert str(e.value) == ("model.architecture.vae is missing (a mapping of diffusers's AutoencoderKL arguments); "
                            "fix: start from a tiny_* model config of this family")
    with pytest.raises(ConfigValueError, match="model.architecture.text_encoder is missing .*transformers's "
                                               "CLIPTextConfig"):
        eng.check_architecture(dict(arch, text_encoder=None))
    with pytest.raises(ConfigValueError, match="num_layerz"):
        eng.check_architecture(dict(arch, transformer=dict(arch["transformer"], num_layerz=1)))
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture(dict(arch, tokenizer={"vocab_size": 8, "vocab": 1}))
    assert str(e.value) == (f"model.architecture.tokenizer.vocab is not read; it takes "
                            f"{', '.join(eng.arch_other['tokenizer'])}; fix: remove or correct it")
    assert "vocab_size" in eng.arch_other["tokenizer"]
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture(dict(arch, pipeline={}))  # flux declares no pipeline settings: no such key
    assert str(e.value).startswith("model.architecture.pipeline is not read by the flux builder")


def test_check_architecture_a_backend_key_is_named_where_it_belongs(compose):
    from runner.core.resolve import MisplacedBackendKeyError, misplaced_backend_message

    eng = engine(compose, "tiny_flux")
    arch = eng.arch_copy()
    with pytest.raises(MisplacedBackendKeyError) as e:
        eng.check_architecture(dict(arch, attn_backend="sdpa"), where="w")
    assert str(e.value) == misplaced_backend_message("w.attn_backend", "sdpa")
    # a key that is a component name is no misplaced backend key, whatever it looks like
    eng.check_architecture(dict(arch, tokenizer={"vocab_size": 8}))


def test_check_architecture_of_an_optional_expert_and_of_a_task(compose):
    wan = engine(compose, "tiny_wan")
    arch = wan.arch_copy()
    assert arch.get("transformer_2") is None
    wan.check_architecture(arch)  # Wan 2.1: no second expert, fine
    wan.check_architecture(dict(arch, pipeline={"boundary_ratio": 0.5}))
    with pytest.raises(ConfigValueError, match="transformer_2"):
        wan.check_architecture(dict(arch, transformer_2={"num_layerz": 1}))
    # tiny_wan asked for image_to_video: its architecture has none of the task's own components
    i2v = engine(compose, "tiny_wan", "model.task=image_to_video")
    with pytest.raises(ConfigValueError) as e:
        i2v.check_architecture(i2v.arch_copy())
    assert str(e.value) == ("model.task=image_to_video: model=tiny_wan does not support it (its architecture has no "
                            "image_encoder: a wan checkpoint of another task); fix: model.task=null (the model's own "
                            "task), or a model that has the task: model=tiny_wan_flf2v|tiny_wan_i2v|wan_i2v")
    engine(compose, "tiny_wan_i2v", "model.task=image_to_video").check_architecture(
        engine(compose, "tiny_wan_i2v").arch_copy())
    # a component or processor only another task builds is refused: the text_to_video pipeline would ignore it
    i2v_arch = engine(compose, "tiny_wan_i2v").arch_copy()
    wan.check_architecture(dict(arch, image_encoder=i2v_arch["image_encoder"], image_processor={}))  # known keys
    wan.check_task_components()
    for key, value in (("image_encoder", "{hidden_size:32}"), ("image_processor", "{}")):
        t2v = engine(compose, "tiny_wan", f"+model.architecture.{key}={value}")
        with pytest.raises(ConfigValueError) as e:
            t2v.check_task_components(where="w")
        assert str(e.value) == (f"w.{key} is built only for model.task=image_to_video; this run's task is "
                                f"text_to_video (model=tiny_wan), whose pipeline takes no {key}; fix: remove "
                                f"w.{key}, or model.task=image_to_video")
        engine(compose, "tiny_wan", "model.load_format=auto", "model.path=/x",
               f"+model.architecture.{key}={value}").check_task_components()  # a snapshot's configs decide
    engine(compose, "tiny_wan_i2v").check_task_components()  # its own task builds them
    i2v = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    with pytest.raises(ConfigValueError, match="image_encoder"):  # checked where the task builds it
        i2v.check_architecture(dict(i2v_arch, image_encoder=dict(i2v_arch["image_encoder"], hidden_sise=1)))


def test_check_architecture_checks_the_processor_and_pipeline_keys(compose):
    eng = engine(compose, "tiny_qwen_image_edit")
    arch = eng.arch_copy()
    eng.check_architecture(arch)
    with pytest.raises(ConfigValueError, match=r"^w\.processor\.max_pixel is not an argument"):
        eng.check_architecture(dict(arch, processor={"max_pixel": 1}), where="w")
    wan = engine(compose, "tiny_wan")
    with pytest.raises(ConfigValueError, match="w.pipeline.zeta is not a setting of WanPipeline"):
        wan.check_architecture(dict(wan.arch_copy(), pipeline={"zeta": 1}), where="w")


def test_check_architecture_without_components(compose):
    eng = engine(compose, "tiny_flux", "model.engine=diffusers")
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture({})
    assert str(e.value) == ("model=tiny_flux: model.engine=diffusers builds no architecture; fix: "
                            f"model.path=<snapshot>, or a family engine ({', '.join(src.family_names())})")


def test_check_pipeline_keys(compose):
    wan = engine(compose, "tiny_wan")
    wan.check_pipeline_keys({"boundary_ratio": 0.5, "expand_timesteps": False})
    wan.check_pipeline_keys({})
    with pytest.raises(ConfigValueError) as e:
        wan.check_pipeline_keys([1], where="w")
    assert str(e.value) == ("w.pipeline=[1] is not a mapping of boundary_ratio, expand_timesteps; fix: a mapping (or "
                            "remove it for the pipeline's defaults)")
    engine(compose, "tiny_flux", "model.engine=diffusers").check_pipeline_keys({})  # no family: nothing to check
    with pytest.raises(ConfigValueError) as e:
        wan.check_pipeline_keys({"zeta": 1, "beta": 2, "boundary_ratio": 1})
    assert str(e.value).startswith("model.architecture.pipeline.beta is not a setting of WanPipeline the runner "
                                   "builds (it takes boundary_ratio, expand_timesteps)")
    with pytest.raises(ConfigValueError, match=r"\(it takes none\)"):
        engine(compose, "tiny_flux").check_pipeline_keys({"a": 1})


def test_check_architecture_matches_snapshot(compose, tmp_path):
    eng = engine(compose, "tiny_flux")
    s = write_snapshot(tmp_path / "s", dict(FLUX_INDEX, boundary=[1, 2]),
                       {"transformer/config.json": {"num_layers": 1, "axes_dims_rope": [8, 12, 12]},
                        "scheduler/scheduler_config.json": {"shift": 3.0}, "scheduler/config.json": {"shift": 9.0}})
    ok = {"transformer": {"num_layers": 1, "axes_dims_rope": (8, 12, 12), "num_attention_heads": 2},
          "scheduler": {"shift": 3.0}, "vae": {"x": 1}, "weights_seed": 3, "pipeline": {"boundary": (1, 2)}}
    eng.check_architecture_matches_snapshot(ok, s)  # tuples equal lists; a key the file omits but the class takes
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture_matches_snapshot({"transformer": {"num_layers": 2, "axes_dims_rope": [8, 12, 13]},
                                                 "scheduler": {"shift": 9.0},
                                                 "pipeline": {"boundary": [1, 3], "other": 1}}, s, where="w")
    msg = str(e.value)
    assert msg.startswith(f"model.path={str(s)!r} decides the architecture, and model.architecture says otherwise:"
                          "\n  w.pipeline.boundary=[1, 3]: the snapshot's model_index.json says [1, 2]\n  "
                          "w.pipeline.other=1: the snapshot's model_index.json does not set it (the pipeline's "
                          "default runs)\n  w.transformer.num_layers=2: the snapshot's transformer/config.json says 1"
                          "\n  w.transformer.axes_dims_rope=[8, 12, 13]: the snapshot's transformer/config.json says "
                          "[8, 12, 12]\n  w.scheduler.shift=9.0: the snapshot's scheduler/scheduler_config.json says "
                          "3.0\nfix: remove those overrides (the snapshot's configs are what runs), or point model.path "
                          "at a snapshot with that architecture, or use load_format=dummy for random weights of any "
                          "architecture")
    with pytest.raises(ConfigValueError) as e:
        eng.check_architecture_matches_snapshot({"transformer": {"num_layerz": 1}}, s, where="w")
    assert str(e.value).startswith("w.transformer.num_layerz is not a parameter of diffusers.FluxTransformer2DModel")
    # a value that is not a component (weights_seed) or a component without a config file is skipped, not the end
    with pytest.raises(ConfigValueError, match="transformer.num_layers=2"):
        eng.check_architecture_matches_snapshot({"weights_seed": 3, "vae": {"x": 1}, "transformer": {"num_layers": 2}}, s)
    # a component the family does not build is not compared
    (s / "extra").mkdir()
    (s / "extra" / "config.json").write_text('{"a": 1}')
    eng.check_architecture_matches_snapshot({"extra": {"a": 2}}, s)


def test_check_architecture_matches_snapshot_reads_the_guider_config(compose, tmp_path):
    eng = engine(compose, "tiny_flux")
    eng.components = dict(eng.components, guider=("diffusers", "ClassifierFreeGuidance", None))
    s = write_snapshot(tmp_path / "s", FLUX_INDEX, {"guider/guider_config.json": {"guidance_scale": 5.0},
                                                    "guider/config.json": {"guidance_scale": 1.0}})
    eng.check_architecture_matches_snapshot({"guider": {"guidance_scale": 5.0}}, s)
    with pytest.raises(ConfigValueError, match="guider/guider_config.json says 5.0"):
        eng.check_architecture_matches_snapshot({"guider": {"guidance_scale": 1.0}}, s)


# ------------------------------------------------------------------------------------------------ settings, experts


def test_pipeline_settings_from_the_snapshot_or_the_architecture(compose, tmp_path):
    import inspect

    from diffusers import WanPipeline

    default = inspect.signature(WanPipeline.__init__).parameters["expand_timesteps"].default
    wan = engine(compose, "tiny_wan", "+model.architecture.pipeline.boundary_ratio=0.25")
    assert wan.pipeline_settings() == {"boundary_ratio": 0.25, "expand_timesteps": default}
    assert wan.source == {"kind": "embedded"}
    s = write_snapshot(tmp_path / "s", {"_class_name": "WanPipeline", "boundary_ratio": 0.75})
    wan.source = {"kind": "path", "path": str(s)}
    assert wan.pipeline_settings() == {"boundary_ratio": 0.75, "expand_timesteps": default}
    write_snapshot(s, {"_class_name": "WanPipeline", "boundary_ratio": 0.5})
    assert wan.pipeline_settings()["boundary_ratio"] == 0.75  # read once per weight source
    wan.source = {"kind": "path", "path": str(s), "revision": None}
    assert wan.pipeline_settings()["boundary_ratio"] == 0.5  # another source: read again
    wan.source = {"kind": "embedded"}
    got = wan.pipeline_settings()
    got["boundary_ratio"] = 9
    assert wan.pipeline_settings()["boundary_ratio"] == 0.25  # a fresh dict each time
    flux = engine(compose, "tiny_flux")
    assert flux.pipeline_settings() == {} and flux.source == {}  # no settings: the source is not even resolved
    dif = engine(compose, "tiny_flux", "model.engine=diffusers")
    assert dif.pipeline_settings() == {} and dif.source == {}


def test_pipeline_settings_a_setting_the_pipeline_class_does_not_take_is_none(compose):
    import dataclasses

    wan = engine(compose, "tiny_wan", "+model.architecture.pipeline.boundary_ratio=0.25")
    wan.spec = dataclasses.replace(wan.spec, pipeline_config=("boundary_ratio", "not_an_init_argument"))
    assert wan.pipeline_settings() == {"boundary_ratio": 0.25, "not_an_init_argument": None}


def test_declared_experts(compose, tmp_path):
    wan = engine(compose, "tiny_wan")
    assert wan.declared_experts() == ["transformer"] and wan.source == {"kind": "embedded"}
    wan22 = engine(compose, "tiny_wan22")
    assert wan22.declared_experts() == ["transformer", "transformer_2"]
    s = write_snapshot(tmp_path / "s", {"transformer_2": [None, None]})
    wan22.source = {"kind": "path", "path": str(s)}
    assert wan22.declared_experts() == ["transformer"]  # the first expert always; a null entry is absent
    write_snapshot(s, {"transformer_2": ["diffusers", "WanTransformer3DModel"]})
    assert wan22.declared_experts() == ["transformer", "transformer_2"]
    flux = engine(compose, "tiny_flux", "model.engine=diffusers")
    flux.source = {"kind": "embedded"}
    assert flux.declared_experts() == ["transformer"]


def test_check_processor_keys(compose):
    eng = engine(compose, "tiny_qwen_image_edit")
    procs = eng.spec.processors_for(eng.task)
    assert procs, "the edit task has a processor"
    comp = next(iter(procs))
    eng.check_processor_keys({})
    with pytest.raises(ConfigValueError) as e:
        eng.check_processor_keys({comp: 3})
    assert str(e.value).startswith(f"model.architecture.{comp}=3 is not a mapping of ")
    with pytest.raises(ConfigValueError) as e:
        eng.check_processor_keys({comp: {"zzzzzzzz": 1}}, where="w")
    assert str(e.value).startswith(f"w.{comp}.zzzzzzzz is not an argument of the ") and "(it takes " in str(e.value)
    with pytest.raises(ConfigValueError) as e:
        eng.check_processor_keys({comp: {"max_pixel": 1}})
    assert str(e.value) == (f"model.architecture.{comp}.max_pixel is not an argument of the qwen2_vl processor; did "
                            f"you mean model.architecture.{comp}.max_pixels? fix: remove or correct it")
    eng.check_processor_keys({comp: {"max_pixels": 1}})
    # without a family there are no processors to check
    assert engine(compose, "tiny_flux", "model.engine=diffusers").check_processor_keys({"processor": 3}) is None


# ------------------------------------------------------------------------------------------------ components


def test_component_config_head_dim_and_classes(compose, tmp_path):
    eng = engine(compose, "tiny_flux")
    assert eng.component_config("transformer")["num_layers"] == 1 and eng.source == {"kind": "embedded"}
    assert eng.head_dim() == 32
    s = write_snapshot(tmp_path / "s", dict(FLUX_INDEX, tokenizer=["transformers", "CLIPTokenizerFast"]),
                       {"transformer/config.json": {"attention_head_dim": 64}})
    eng.source = {"kind": "path", "path": str(s)}
    assert eng.component_config("transformer") == {"attention_head_dim": 64} and eng.head_dim() == 64
    assert eng.component_class("transformer") == "FluxTransformer2DModel" == eng.transformer_class()
    assert eng.component_class("tokenizer") == "CLIPTokenizerFast"
    assert eng.component_class("nothing") == "None"
    (s / "transformer" / "config.json").write_text("{}")
    with pytest.raises(ModelPathError) as e:
        eng.head_dim()
    assert str(e.value) == ("model=tiny_flux: the transformer's config has no attention_head_dim; fix: a complete "
                            "snapshot (transformer/config.json) of a DiT pipeline")
    dif = engine(compose, "tiny_flux", "model.engine=diffusers")
    dif.source = {"kind": "path", "path": str(s)}
    assert dif.transformer_class() == "FluxTransformer2DModel"


def test_weight_bytes_of_dummy_weights_only(compose):
    eng = engine(compose, "tiny_flux", "model.load_format=dummy")
    eng.resolve_source()
    comps = eng.build_components(eng.arch_copy(), device="meta", dtype=torch.float32)
    want = sum(p.numel() * 4 for v in comps.values() if isinstance(v, torch.nn.Module) for p in v.parameters())
    assert want > 0 and eng.weight_bytes() == want
    assert engine(compose, "tiny_flux").weight_bytes() is None
    # a task's own components count: Wan's image_to_video adds the image encoder
    i2v = engine(compose, "tiny_wan_i2v", "model.load_format=dummy", "model.task=image_to_video")
    i2v.resolve_source()
    arch = i2v.arch_copy()

    def total(task):
        comps = i2v.build_components(arch, device="meta", dtype=torch.float32, task=task)
        return sum(p.numel() * 4 for v in comps.values() if isinstance(v, torch.nn.Module) for p in v.parameters())

    assert i2v.weight_bytes() == total("image_to_video") > total(None)
    half = engine(compose, "tiny_wan_i2v", "model.load_format=dummy", "model.task=image_to_video",
                  dtype=torch.bfloat16)
    half.resolve_source()
    assert half.weight_bytes() * 2 == total("image_to_video")  # 2 bytes a parameter


def test_snapshot_task_and_embedded_target(compose, tmp_path):
    from models.snapshot import embedded_target

    i2v = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    assert i2v.snapshot_task() == "image_to_video"
    arch = i2v.arch_copy()
    assert i2v.embedded_target(arch) == embedded_target("tiny_wan_i2v", arch, i2v.cache_dir, task="image_to_video")
    flux = engine(compose, "tiny_flux", "model.task=edit")
    assert flux.snapshot_task() is None
    assert flux.embedded_target(arch) == embedded_target("tiny_flux", arch, flux.cache_dir)
    flux.cache_dir = str(tmp_path / "cache")
    assert flux.embedded_target(arch).parent == tmp_path / "cache"


def test_hash_weights_digests_the_component_weights_and_reports_the_hashing(compose, tmp_path):
    import hashlib

    eng = engine(compose, "tiny_flux")
    eng.cache_dir = str(tmp_path / "cache")
    s = write_snapshot(tmp_path / "s", {"_class_name": "FluxPipeline", "vae": ["diffusers", "AutoencoderKL"]},
                       {"vae/model.safetensors": "abc", "extra/model.safetensors": "zzz"})
    got = eng.hash_weights(s)
    assert got["files"] == {"vae/model.safetensors": hashlib.sha256(b"abc").hexdigest()}
    assert set(got["hashing"]) == {"computed", "cached", "hub_named", "hash_s", "bytes_hashed"}
    assert (got["hashing"]["computed"], got["hashing"]["cached"], got["hashing"]["bytes_hashed"]) == (
        ["vae/model.safetensors"], [], 3)
    again = eng.hash_weights(s)  # digests cached in the engine's cache dir
    assert again["files"] == got["files"] and (again["hashing"]["computed"], again["hashing"]["cached"]) == (
        [], ["vae/model.safetensors"])
    assert (tmp_path / "cache" / "weight_digests.json").is_file()


def test_embedded_snapshot_is_built_at_the_target_as_the_task_pipeline(compose, tmp_path):
    from models.snapshot import missing_weights, read_index

    eng = engine(compose, "tiny_wan_i2v", "model.task=image_to_video")
    eng.cache_dir = str(tmp_path)
    arch = eng.arch_copy()
    path = eng.embedded_snapshot(arch)
    assert path == eng.embedded_target(arch) and path.parent == tmp_path
    assert read_index(path)["_class_name"] == "WanImageToVideoPipeline" and missing_weights(path) == []
    assert "image_encoder" in read_index(path)


def test_resolve_source_of_a_hub_id_in_the_local_cache(compose, tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--runner-test--tiny-flux"
    snap = flux_snapshot(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    got = engine(compose, "tiny_flux", "model.path=runner-test/tiny-flux").resolve_source()
    assert got["kind"] == "path" and got["path"] == str(snap.resolve()) and got["revision"] is None
    assert got["hub"]["repo_id"] == "runner-test/tiny-flux" and got["hub"]["revision"] == commit
    assert set(got["hub"]) <= {"repo_id", "revision", "requested_revision", "cache_dir"} and "path" not in got["hub"]


def test_resolve_source_details(compose, tmp_path):
    # without a weights_seed the dummy source records 0
    assert engine(compose, "tiny_flux", "model.load_format=dummy", "~model.architecture.weights_seed"
                  ).resolve_source() == {"kind": "dummy", "weights_seed": 0}
    s = flux_snapshot(tmp_path / "s")
    # with model.path the architecture is the snapshot's: a key no builder reads is not checked against the family
    assert engine(compose, "tiny_flux", f"model.path={s}", "+model.architecture.transformr={}"
                  ).resolve_source()["kind"] == "path"
    (s / "transformer" / "config.json").write_text(json.dumps({"num_layers": 1, "attention_head_dim": 32}))
    # two keys of one component are both compared
    with pytest.raises(ConfigValueError) as e:
        engine(compose, "tiny_flux", f"model.path={s}", "model.architecture.transformer.num_layers=1",
               "model.architecture.transformer.attention_head_dim=16").resolve_source()
    assert "attention_head_dim=16: the snapshot's transformer/config.json says 32" in str(e.value)
    assert "num_layers" not in str(e.value)
