"""Declarative family specs (``models.family.FamilySpec``, registered in ``models.registry.FAMILIES``): every
registered family yields a forward count, the size rule reads the snapshot's own VAE config as the pipeline does, the
registry is the one family list, and a spec for a pipeline the project does not ship (diffusers' ``ChromaPipeline``,
tiny random weights, a local T5 tokenizer) runs through the real loop to ``verified``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from models import family as fam
from models.registry import FAMILIES, engine_class, family_names, family_spec, register_family, unregister_family


def _row(neg=None, guidance=None, steps=4):
    return SimpleNamespace(negative_prompt=neg, guidance_scale=guidance, num_inference_steps=steps)


def _engine(cfg):
    import torch

    from models.base import StageContext
    from runner.core.platform import detect

    return engine_class(cfg.model.engine)(StageContext(
        cfg=cfg, overrides=[], stage="denoise", plat=detect(cfg.platform.name, cfg.platform.device), dtype=torch.float32))


@pytest.mark.parametrize("name", family_names())
def test_every_registered_family_yields_an_expected_forward_count(compose, name):
    """A family without a guidance mode cannot be declared, and each mode's count is what its pipeline runs."""
    spec = family_spec(name)
    assert spec.cfg in fam.CFG_MODES and engine_class(name).spec is spec
    eng = _engine(compose([f"model=tiny_{name}", "platform=cpu", "model.generation.true_cfg_scale=4"]))
    per_step = {"true_cfg": 2, "separate": 2, "batched": 1, "none": 1}[spec.cfg]
    item = SimpleNamespace(row=_row(neg="blurry", guidance=5.0))
    assert eng.expected_forwards([item]) == 4 * per_step


def test_forwards_per_step_by_mode():
    assert fam.forwards_per_step("true_cfg", _row(neg="x"), 1.0) == 1  # true_cfg_scale <= 1: off
    assert fam.forwards_per_step("true_cfg", _row(neg=None), 4.0) == 1  # no negative prompt: off
    assert fam.forwards_per_step("true_cfg", _row(neg="x"), 4.0) == 2
    assert fam.forwards_per_step("separate", _row(guidance=1.0), 4.0) == 1
    assert fam.forwards_per_step("separate", _row(guidance=5.0), 4.0) == 2
    assert fam.forwards_per_step("batched", _row(guidance=5.0, neg="x"), 4.0) == 1


def test_a_spec_with_an_unknown_cfg_mode_is_refused():
    with pytest.raises(ValueError, match="cfg='sometimes' is not one of true_cfg, batched, separate, none"):
        fam.FamilySpec(name="x", tasks={"text_to_image": "FluxPipeline"}, components={}, tokenizers={}, cfg="sometimes")
    with pytest.raises(ValueError, match="tasks"):
        fam.FamilySpec(name="x", tasks={"paint": "FluxPipeline"}, components={}, tokenizers={}, cfg="none")


def test_wan_size_rule_reads_the_vae_scale_factor_spatial():
    """Regression: a Wan 2.2-style VAE (``scale_factor_spatial`` 16, patch 2) needs multiples of 32; the old rule
    (``2 ** len(temperal_downsample)`` x patch = 16) let a 48x48 row through, which WanPipeline turned into a
    32x32 video recorded as 48."""
    wan = family_spec("wan")
    vae22 = {"scale_factor_spatial": 16, "scale_factor_temporal": 4, "temperal_downsample": [False, True, True]}
    assert wan.size_need(vae22, {"patch_size": [1, 2, 2]}) == 32
    assert 48 % wan.size_need(vae22, {"patch_size": [1, 2, 2]})  # 48 is refused now
    assert wan.size_need({"temperal_downsample": [False, True, True]}, {"patch_size": [1, 2, 2]}) == 16  # 2.1: default 8


def test_size_rules_of_the_image_families_follow_their_pipelines():
    """FLUX/HiDream: 2 ** (len(block_out_channels) - 1) x 2; SD3: x the transformer's patch_size; Qwen-Image:
    2 ** len(temperal_downsample) x 2."""
    vae = {"block_out_channels": [16, 32]}  # 2 blocks: scale factor 2
    assert family_spec("flux").size_need(vae, {}) == 4
    assert family_spec("hidream").size_need(vae, {}) == 4
    assert family_spec("sd3").size_need(vae, {"patch_size": 4}) == 8
    assert family_spec("qwen_image").size_need({"temperal_downsample": [False, True]}, {}) == 8


def test_wan_temporal_factor_reads_scale_factor_temporal(compose):
    """Wan's frame rule uses the VAE config's ``scale_factor_temporal`` (WanPipeline's ``vae_scale_factor_temporal``),
    not the count of ``temperal_downsample`` entries."""
    from omegaconf import open_dict

    cfg = compose(["model=tiny_wan", "platform=cpu"])
    with open_dict(cfg):
        cfg.model.architecture.vae.scale_factor_temporal = 8
    assert _engine(cfg).temporal_factor() == 8
    assert _engine(compose(["model=tiny_wan", "platform=cpu"])).temporal_factor() == 4


def test_messages_list_the_registered_families():
    """Family lists in messages come from the registry: a registered family appears in them."""
    from models.pipelines import family_names as listed

    spec = fam.FamilySpec(name="zz_test_family", tasks={"text_to_image": "FluxPipeline"}, components={},
                          tokenizers={}, cfg="none")
    register_family(spec)
    try:
        assert "zz_test_family" in listed() and listed() == sorted(FAMILIES)
    finally:
        unregister_family("zz_test_family")
    assert "zz_test_family" not in listed()


# ------------------------------------------------------------------------------------------- acceptance: Chroma
CHROMA = fam.FamilySpec(
    name="chroma_test",
    tasks={"text_to_image": "ChromaPipeline"},
    components={"transformer": ("diffusers", "ChromaTransformer2DModel", None),
                "vae": ("diffusers", "AutoencoderKL", None),
                "text_encoder": ("transformers", "T5EncoderModel", "T5Config"),
                "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None)},
    tokenizers={"tokenizer": ("t5", "t5", "text_encoder")},
    cfg="separate",  # ChromaPipeline: guidance_scale > 1 runs a second (negative) transformer forward per step
    size_rule=fam.block_out_scale, patch=2,
    quiet_loggers=("diffusers.pipelines.chroma.pipeline_chroma",),
    max_sequence_length=512,
    needs_mask=True,  # Chroma masks the padded T5 tokens
)

CHROMA_TRANSFORMER = {"patch_size": 1, "in_channels": 16, "out_channels": 16, "num_layers": 1, "num_single_layers": 1,
                      "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 64,
                      "axes_dims_rope": [8, 12, 12], "approximator_num_channels": 16, "approximator_hidden_dim": 32,
                      "approximator_layers": 1}


@pytest.mark.slow
def test_a_registered_spec_of_an_unshipped_pipeline_runs_to_verified(compose, tmp_path):
    """Acceptance: diffusers' ChromaPipeline (not shipped; its transformer's FluxAttention calls the dispatcher)
    declared by one FamilySpec, tiny random weights built from configs, a local T5 tokenizer; the real loop runs it
    with guidance (two forwards per step) to ``verified``, forward count included."""
    from omegaconf import OmegaConf, open_dict

    from runner.app.execute import run

    register_family(CHROMA)
    try:
        cfg = compose(["model=tiny_flux", "platform=cpu", "model.engine=chroma_test", "dataset.limit=1",
                       "backend.attention=TORCH_SDPA", f"cache_dir={tmp_path / 'cache'}"])
        with open_dict(cfg):
            arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
            arch["text_encoder"] = arch.pop("text_encoder_2")
            arch["transformer"] = CHROMA_TRANSFORMER
            cfg.model.architecture = arch
            cfg.model.name = "tiny_chroma"
            cfg.model.generation.guidance_scale = 4.0
            cfg.model.generation.width = cfg.model.generation.height = 64
        code = run(cfg, tmp_path / "run")
        man = json.loads((tmp_path / "run" / "manifest.json").read_text())
        assert code == 0, man.get("error")
        ev = man["evidence"]
        assert ev["verdict"] == "verified", ev["mismatches"]
        st = ev["stages"]["denoise"]
        assert st["checks"]["forward_count"] == "verified"
        assert st["denoiser_forwards"] == st["expected_forwards"] == 2 * 4  # CFG: a second forward per step
        layers = st["attention"]["layers"]
        assert layers and all(l["ok"] and l["observed"] == {"TORCH_SDPA": l["calls"]} for l in layers)
    finally:
        unregister_family("chroma_test")
