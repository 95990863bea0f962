"""Issue #42: the rules of ``models.memory`` (the memory planner's inputs, the offload / quantization records and
the budget it fits) asserted from hand-computed numbers on tiny configs, so that a wrong rule fails a test
(``benchmarks/mutation.py``, group ``core_m_memory``). Pure functions only: nothing here loads a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _helpers import requires_extra
from models import memory as mm
from runner.core import memory as planner
from runner.core.errors import ConfigValueError

GIB = 2 ** 30


def mem(**kw):
    base = dict(offload="none", use_stream=False, blocks_per_group=1, record_stream=False, vae_tiling=False,
                vae_slicing=False, max_gpu_gb=None)
    base.update(kw)
    return SimpleNamespace(**base)


def qcfg(**kw):
    base = {c: None for c in mm.QUANT_COMPONENTS}
    base["gguf_file"] = None
    base.update(kw)
    return SimpleNamespace(**base)


# ------------------------------------------------------------------------------------------------ settings


def test_settings_default_is_inactive_and_each_field_alone_activates():
    s = mm.settings(mem(), "cpu", None)
    assert s == mm.MemorySettings("none", False, 1, False, False, False, None) and not s.active
    assert mm.settings(mem(offload="auto"), "cpu", None).active
    assert mm.settings(mem(vae_tiling=True), "cpu", None).active
    assert mm.settings(mem(vae_slicing=True), "cpu", None).active
    assert mm.settings(mem(max_gpu_gb=8), "cuda", None).active
    # record_stream is optional in older configs: absent reads as False
    m = mem(use_stream=1, blocks_per_group="3", max_gpu_gb="2.5")
    del m.record_stream
    s = mm.settings(m, "cuda", None)
    assert (s.use_stream, s.blocks_per_group, s.record_stream, s.max_gpu_gb) == (True, 3, False, 2.5)
    assert mm.settings(mem(record_stream=True), "cuda", None).record_stream is True


@pytest.mark.parametrize("kind", mm.GPU_KINDS)
def test_offload_plans_and_budgets_are_taken_on_either_gpu_kind(kind):
    s = mm.settings(mem(offload="group_block", max_gpu_gb=mm.MAX_GPU_GB), kind, None)
    assert s.offload == "group_block" and s.max_gpu_gb == mm.MAX_GPU_GB


def test_every_bad_memory_field_is_named_at_once_with_its_fix():
    with pytest.raises(ConfigValueError) as e:
        mm.settings(mem(offload="model", max_gpu_gb=8, blocks_per_group=0), "cpu", None)
    msg = str(e.value)
    assert "memory.offload=model moves weights between the host and a GPU, and this platform is cpu" in msg
    assert "fix: memory.offload=none or auto" in msg
    assert "memory.max_gpu_gb=8.0 budgets GPU memory, and this platform is cpu; fix: memory.max_gpu_gb=null" in msg
    assert "memory.blocks_per_group=0 must be >= 1" in msg
    assert msg.count("; fix") + msg.count(": fix") >= 2 and "must be a finite" not in msg
    assert mm.settings(mem(blocks_per_group=1), "cpu", None).blocks_per_group == 1


@pytest.mark.parametrize("gb", [0, -3, float("inf"), float("nan"), mm.MAX_GPU_GB + 1])
def test_a_budget_outside_0_to_max_is_refused_naming_range_and_fix(gb):
    with pytest.raises(ConfigValueError) as e:
        mm.settings(mem(max_gpu_gb=gb), "cuda", None)
    msg = str(e.value)
    assert f"memory.max_gpu_gb={float(gb)} must be a finite number of GiB in (0, {mm.MAX_GPU_GB}], or null" in msg
    assert "fix: e.g. memory.max_gpu_gb=24" in msg


def test_offload_under_context_parallelism_is_refused_auto_only_on_a_gpu():
    par = SimpleNamespace(mode="ulysses")
    for off, kind in (("model", "cuda"), ("auto", "cuda"), ("auto", "rocm")):
        with pytest.raises(ConfigValueError) as e:
            mm.settings(mem(offload=off), kind, par)
        assert (f"memory.offload={off} under context parallelism (ulysses) is not supported; fix: "
                "memory.offload=none, or parallelism=data") in str(e.value)
    assert mm.settings(mem(offload="auto"), "cpu", par).offload == "auto"
    assert mm.settings(mem(offload="none"), "cuda", par).offload == "none"
    assert mm.settings(mem(offload="model"), "cuda", None).offload == "model"


# ------------------------------------------------------------------------------------------------ quantization


def test_quant_choices_keep_every_component_but_none_and_canonicalize():
    q = qcfg(transformer="INT8", transformer_2="none", text_encoder="float8wo", text_encoder_2=None,
             text_encoder_3="int8wo")
    assert mm.quant_choices(q) == {"transformer": "int8wo", "text_encoder": "float8wo", "text_encoder_3": "int8wo"}


def test_dummy_weights_name_each_checkpoint_only_component():
    mm.check_dummy_methods({"transformer": "int8wo", "text_encoder": "float8wo"})
    with pytest.raises(ConfigValueError) as e:
        mm.check_dummy_methods({"transformer": "nf4", "text_encoder": "int8wo", "text_encoder_2": "gguf"})
    msg = str(e.value)
    assert msg.startswith("model.quantization.transformer=nf4, model.quantization.text_encoder_2=gguf with "
                          "model.load_format=dummy")
    assert "text_encoder=int8wo" not in msg
    assert msg.endswith("with model.load_format=dummy: bitsandbytes and GGUF quantize while a checkpoint loads; fix: "
                        "an embedded model or model.path (a snapshot), or int8wo / float8wo (torchao) for random "
                        "weights")


def test_fitting_lanes_name_each_quantized_component():
    f = mm.Fitting(mem(), qcfg(transformer="int8wo", text_encoder_2="float8wo"), {}, "cpu", None)
    assert f.lanes() == ["model.quantization.transformer=int8wo", "model.quantization.text_encoder_2=float8wo"]
    assert mm.Fitting(mem(), None, {}, "cpu", None).lanes() == []
    assert mm.Fitting(mem(), qcfg(gguf_file="/x.gguf"), {}, "cpu", None).gguf_file == "/x.gguf"
    assert mm.Fitting(mem(), qcfg(), {}, "cpu", None).gguf_file is None


# ------------------------------------------------------------------------------------------------ activations


def test_text_activations_read_t5_and_clip_names_and_clip_seq_to_positions():
    t5 = {"d_model": 8, "d_ff": 20, "num_heads": 2}
    clip = {"hidden_size": 6, "intermediate_size": 10, "num_attention_heads": 3, "max_position_embeddings": 5}
    out = mm.text_activations({"t5": t5, "clip": clip}, batch=2, seq=7, elem=2)
    # B S e (2 H + 3 F) + B heads S^2 (8 + 2 e)
    assert out["t5"] == 2 * 7 * 2 * (2 * 8 + 3 * 20) + 2 * 2 * 49 * 12
    assert out["clip"] == 2 * 5 * 2 * (2 * 6 + 3 * 10) + 2 * 3 * 25 * 12
    # defaults: ff = 4 hidden, one head, the whole sequence
    assert mm.text_activations({"e": {"hidden_size": 4}}, 1, 3, 4)["e"] == 3 * 4 * (8 + 48) + 9 * 16
    # a None entry falls through to the next name
    assert mm.text_activations({"e": {"d_model": None, "hidden_size": 4}}, 1, 3, 4)["e"] == 3 * 4 * (8 + 48) + 9 * 16
    assert mm.text_activations({"e": {}}, 1, 3, 4)["e"] == 9 * 16


def test_denoiser_activations_inner_width_and_mlp_ratio():
    # B S D e (7 + 3 r), D = heads x head_dim
    assert mm.denoiser_activations({"num_attention_heads": 3, "attention_head_dim": 4, "ffn_dim": 36}, 2, 5, 2) == \
        2 * 5 * 12 * 2 * (7 + 3 * 3)
    assert mm.denoiser_activations({"num_attention_heads": 3, "attention_head_dim": 4, "mlp_ratio": 2}, 1, 1, 1) == \
        12 * (7 + 6)
    assert mm.denoiser_activations({}, 1, 1, 1) == 64 * (7 + 12)
    assert mm.denoiser_activations({"ffn_dim": 0, "mlp_ratio": 1.0}, 1, 1, 1) == 64 * 10


# ------------------------------------------------------------------------------------------------ video VAEs

WAN_DEFAULTS = {"base_dim": 96, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "z_dim": 16, "is_residual": False,
                "temperal_downsample": [False, True, True], "patch_size": 1}


def test_wan_decoder_geometry_by_hand():
    g = mm.wan_decoder_geometry({"base_dim": 2, "dim_mult": [1, 2], "num_res_blocks": 1, "z_dim": 4,
                                 "temperal_downsample": [True]})
    # dims [4, 4, 2]; conv_in + mid 4/4 + 16/4; up 0: (4 + 3*4 + 4)/4; up 1: (2 + 3*2); conv_out 2
    assert g == {"cache": 1 + 4 + 5 + 8 + 2, "last_in": 2, "upsampled": 4, "chunk": 2, "patch": 1}
    g = mm.wan_decoder_geometry({"base_dim": 2, "dim_mult": [1, 2], "num_res_blocks": 1, "z_dim": 4,
                                 "temperal_downsample": [True], "is_residual": True})
    assert g["cache"] == 1 + 4 + 5 + 10 + 2 and g["last_in"] == 4
    # three levels, asymmetric temporal upsampling (reversed: [True, False]), decoder_base_dim over base_dim
    g = mm.wan_decoder_geometry({"decoder_base_dim": 1, "base_dim": 7, "dim_mult": [1, 2, 4], "num_res_blocks": 0,
                                 "z_dim": 16, "temperal_downsample": [False, True], "patch_size": 2})
    # dims [4, 4, 2, 1]: 16/16 + 16/16; (4 + 4 + 4)/16; (2 + 2)/4; (1 + 1); 1
    assert g == {"cache": 2 + 0.75 + 1 + 2 + 1, "last_in": 1, "upsampled": 2, "chunk": 2, "patch": 2}


def test_wan_decoder_geometry_defaults_are_wan21s():
    assert mm.wan_decoder_geometry({}) == mm.wan_decoder_geometry(WAN_DEFAULTS)
    assert mm.wan_decoder_geometry({})["chunk"] == 4 and mm.wan_decoder_geometry({})["patch"] == 1


def test_per_block_repeats_a_scalar_and_cuts_a_list():
    assert mm._per_block(None, 2, 3) == [2, 2, 2]
    assert mm._per_block(5, 2, 2) == [5, 5]
    assert mm._per_block([1, 2, 3, 4], 0, 3) == [1, 2, 3]
    assert mm._per_block((True, False), 0, 2) == [True, False]


def test_ltx2_decoder_geometry_by_hand():
    conf = {"decoder_block_out_channels": [8, 16, 32], "decoder_spatio_temporal_scaling": [True, False, True],
            "upsample_factor": [1, 2, 4], "upsample_type": ["spatial", "temporal", "spatiotemporal"],
            "patch_size": 2, "patch_size_t": 3, "out_channels": 5, "decoder_spatial_padding_mode": "zeros",
            "tile_sample_min_height": 64, "tile_sample_stride_height": 48}
    g = mm.ltx2_decoder_geometry(conf)
    # reversed: boc [32, 16, 8], scaling [True, False, True], factor [4, 2, 1]; kinds stay in order
    assert g["channels"] == [32, 8, 8, 8]
    assert g["up"] == [(1, 2), (1, 1), (2, 2)]
    assert g["spatial"] == 2 * 2 * 1 * 2 and g["temporal"] == 3 * 1 * 1 * 2
    assert (g["patch_t"], g["reflect"], g["out_channels"]) == (3, False, 5 * 2 * 2 * 3)
    assert (g["tile"], g["stride"]) == (64 // 8, 48 // 8)
    g = mm.ltx2_decoder_geometry({**conf, "tile_sample_min_height": 70, "tile_sample_stride_height": 60})
    assert (g["tile"], g["stride"]) == (8, 7) and isinstance(g["tile"], int) and isinstance(g["stride"], int)
    g = mm.ltx2_decoder_geometry({**conf, "spatial_compression_ratio": 16, "temporal_compression_ratio": 7,
                                  "decoder_spatial_padding_mode": "replicate"})
    assert (g["spatial"], g["temporal"], g["reflect"], g["tile"], g["stride"]) == (16, 7, True, 4, 3)


def test_ltx2_decoder_geometry_defaults():
    g = mm.ltx2_decoder_geometry({})
    assert g["channels"] == [1024, 512, 256, 128] and g["up"] == [(2, 2)] * 3
    assert (g["spatial"], g["temporal"], g["patch_t"], g["reflect"], g["out_channels"]) == (32, 8, 1, True, 48)
    assert (g["tile"], g["stride"]) == (mm.LTX2_TILE // 32, mm.LTX2_STRIDE // 32)
    assert mm.ltx2_decoder_geometry({"decoder_block_out_channels": [4, 8], "upsample_type": "temporal"})["up"] == \
        [(2, 1), (2, 1)]


def test_hunyuan15_decoder_geometry_by_hand():
    conf = {"block_out_channels": [4, 8, 16, 32], "spatial_compression_ratio": 4, "temporal_compression_ratio": 2,
            "tile_sample_min_height": 32}
    g = mm.hunyuan15_decoder_geometry(conf)
    # reversed [32, 16, 8, 4]; i = 0: s, t; i = 1: s only; i = 2, 3: neither
    assert g["channels"] == [32, 16, 8, 8, 4]
    assert g["up"] == [(2, 2), (1, 2), (1, 1), (1, 1)]
    assert (g["spatial"], g["temporal"], g["patch_t"], g["reflect"]) == (4, 2, 1, True)
    assert (g["tile"], g["stride"]) == (8, 6)
    g = mm.hunyuan15_decoder_geometry({**conf, "upsample_match_channel": False})
    assert g["channels"] == [32, 32, 16, 8, 4]
    # frames double while 2 ** i < the temporal ratio: i = 0, 1, 2 of 8; a tile of 38 px is 9 latents, stride 6
    g = mm.hunyuan15_decoder_geometry({"block_out_channels": [1, 1, 1, 1, 1], "spatial_compression_ratio": 4,
                                       "temporal_compression_ratio": 8, "tile_sample_min_height": 38})
    assert [t for t, _ in g["up"]] == [2, 2, 2, 1, 1] and [s for _, s in g["up"]] == [2, 2, 1, 1, 1]
    assert (g["tile"], g["stride"]) == (9, 6) and isinstance(g["tile"], int)


def test_hunyuan15_decoder_geometry_defaults():
    g = mm.hunyuan15_decoder_geometry({})
    assert g["channels"] == [1024, 1024, 512, 256, 128, 128]
    assert g["up"] == [(2, 2), (2, 2), (1, 2), (1, 2), (1, 1)]
    assert (g["spatial"], g["temporal"], g["tile"], g["stride"]) == (16, 4, 16, 12)


def test_decoder_levels_and_tiles():
    g = {"channels": [9, 5, 3], "up": [(2, 2), (1, 3)]}
    assert mm.decoder_levels(g, 3, 2, 4) == [(9, 3, 2, 4), (5, 5, 4, 8), (3, 5, 12, 24)]
    assert mm._tiles(10, 4, 3) == [4, 4, 4, 1]
    assert mm._tiles(4, 4, 3) == [4, 1]
    assert mm._tiles(3, 4, 3) == [3]


def test_image_vae_decoder_uses_the_full_resolution_upsampler_channels_and_tiles_at_sample_size():
    conf = {"block_out_channels": [3, 5, 7], "sample_size": 16}
    assert mm.decoder_activations(conf, 2, 1, 32, 24, 2, False, False) == planner.decoder_activation(2, 1, 32, 24, 5, 2)
    assert mm.decoder_activations(conf, 2, 1, 32, 24, 2, False, True) == planner.decoder_activation(1, 1, 32, 24, 5, 2)
    assert mm.decoder_activations(conf, 2, 1, 32, 24, 2, True, False) == planner.decoder_activation(2, 1, 16, 16, 5, 2)
    assert mm.decoder_activations({**conf, "sample_size": [8, 4]}, 1, 1, 32, 24, 2, True, False) == \
        planner.decoder_activation(1, 1, 8, 8, 5, 2)
    assert mm.decoder_activations({"block_out_channels": [3, 5, 7]}, 1, 1, 1024, 600, 2, True, False) == \
        planner.decoder_activation(1, 1, 512, 512, 5, 2)
    assert mm.decoder_activations({"block_out_channels": [6]}, 1, 1, 8, 8, 2, False, False) == \
        planner.decoder_activation(1, 1, 8, 8, 6, 2)


def test_wan_vae_decoder_is_the_causal_rule_plus_two_or_five_videos():
    conf = {"base_dim": 2, "dim_mult": [1, 2], "num_res_blocks": 1, "z_dim": 4, "temperal_downsample": [True],
            "patch_size": 2, "tile_sample_min_height": 8}
    video = 3 * 3 * 5 * 12 * 16 * 2  # B 3 F H W e, batch 3
    # cache 20, last_in 2, upsampled 4, chunk 2 (5 frames > 2): at H/p x W/p
    assert mm.decoder_activations(conf, 3, 5, 12, 16, 2, False, False) == \
        planner.causal_decoder_activation(3, 2, 6, 8, 20, 2, 4, 2) + 2 * video
    assert mm.decoder_activations(conf, 3, 5, 12, 16, 2, False, True) == \
        planner.causal_decoder_activation(1, 2, 6, 8, 20, 2, 4, 2) + 2 * video
    assert mm.decoder_activations(conf, 3, 1, 12, 16, 2, False, False) == \
        planner.causal_decoder_activation(3, 1, 6, 8, 20, 2, 4, 2) + 2 * video // 5
    assert mm.decoder_activations(conf, 3, 5, 12, 16, 2, True, False) == \
        planner.causal_decoder_activation(3, 2, 4, 4, 20, 2, 4, 2) + 5 * video
    # the default tile is 256 pixels
    big = {k: v for k, v in conf.items() if k != "tile_sample_min_height"}
    assert mm.decoder_activations(big, 1, 1, 512, 300, 2, True, False) == \
        planner.causal_decoder_activation(1, 1, 128, 128, 20, 2, 4, 2) + 5 * 3 * 512 * 300 * 2
    # the class name picks the whole-video rule (vae_class over the config's _class_name)
    lt = {"decoder_block_out_channels": [4, 8], "patch_size": 1, "patch_size_t": 1}
    whole = mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", lt, 1, 9, 16, 16, 2, False, False)
    assert mm.decoder_activations({**lt, "_class_name": "AutoencoderKLLTX2Video"}, 1, 9, 16, 16, 2, False, False) == whole
    assert mm.decoder_activations(lt, 1, 9, 16, 16, 2, False, False, vae_class="AutoencoderKLLTX2Video") == whole


LTX = {"decoder_block_out_channels": [4, 8], "patch_size": 1, "patch_size_t": 1}  # channels [8, 4, 2], x4, x4


def _ltx(b, t, h, w):
    levels = mm.decoder_levels(mm.ltx2_decoder_geometry(LTX), t, h, w)
    return planner.ltx2_decoder_activation(b, levels[-1], levels[-2], 2, True, 3)


def test_whole_video_decoder_one_call_and_sliced():
    # 9 frames -> 3 latent frames, 16 px -> 4 latents; output level (2, 9, 16, 16); px = 3 x 9 x 16 x 2 per latent px
    px, video = 3 * 9 * 16 * 2, 3 * 9 * 16 * 16 * 2
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", LTX, 2, 9, 16, 16, 2, False, False) == \
        max(_ltx(2, 3, 4, 4), planner.workspace_allowance(2 * 2 * 9 * 16 * 16 * 2))
    assert px * 16 == video
    # sliced: one video at a time, the first held beside the second, and two copies of both at the end
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", LTX, 2, 9, 16, 16, 2, False, True) == \
        max(_ltx(1, 3, 4, 4) + video, 2 * 2 * video + planner.workspace_allowance(2 * 9 * 16 * 16 * 2))
    # tiling that the latents do not exceed changes nothing
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", LTX, 2, 9, 16, 16, 2, True, False) == \
        mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", LTX, 2, 9, 16, 16, 2, False, False)


@pytest.mark.parametrize("slicing", [False, True])
def test_whole_video_decoder_tiled_in_tiled_decodes_order(slicing):
    conf = {**LTX, "tile_sample_min_height": 12, "tile_sample_stride_height": 8}  # tile 3, stride 2 latents
    px, video, batch = 3 * 9 * 16 * 2, 3 * 9 * 16 * 16 * 2, 2
    b = 1 if slicing else batch
    held = (batch - b) * video
    # rows and columns [3, 2]: tiles (3,3), (3,2), (2,3), (2,2), each beside the outputs of those before it
    peak = max(_ltx(b, 3, 3, 3), _ltx(b, 3, 3, 2) + b * px * 9, _ltx(b, 3, 2, 3) + b * px * 15,
               _ltx(b, 3, 2, 2) + b * px * 21)
    end = max(2 * batch * video if slicing else 0, b * px * 25 + 2 * b * video + held)
    want = max(peak + held, end + planner.workspace_allowance(b * 2 * 9 * 12 * 12 * 2))
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, batch, 9, 16, 16, 2, True, slicing) == want
    # only the width above a tile also tiles
    wide = mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, batch, 9, 12, 16, 2, True, slicing)
    assert wide != mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, batch, 9, 12, 16, 2, False,
                                                      slicing)


def test_hunyuan15_whole_video_decoder_reads_the_mid_block_tokens():
    conf = {"block_out_channels": [4, 8], "spatial_compression_ratio": 2, "temporal_compression_ratio": 2}
    g = mm.hunyuan15_decoder_geometry(conf)  # channels [8, 4, 4], up [(2, 2), (1, 1)]
    # 5 frames -> 3 latent frames, 8 px -> 4 latents; output level (4, 5, 8, 8); mid (8, 3 x 4 x 4)
    got = mm.whole_video_decoder_activations("AutoencoderKLHunyuanVideo15", conf, 1, 5, 8, 8, 2, False, False)
    assert mm.decoder_levels(g, 3, 4, 4)[-1] == (4, 5, 8, 8)
    assert got == max(planner.hunyuan15_decoder_activation(1, (4, 5, 8, 8), (8, 48), 2),
                      planner.workspace_allowance(4 * 5 * 64 * 2))
    assert mm.decoder_activations({**conf, "_class_name": "AutoencoderKLHunyuanVideo15"}, 1, 5, 8, 8, 2, False,
                                  False) == got


# ------------------------------------------------------------------------------------------------ fitting

# a 6 GiB denoiser of three 1.5 GiB blocks (largest leaf 0.5 GiB), a 1 GiB encoder, a 0.5 GiB VAE
SIZES = {"transformer": planner.ComponentSize("transformer", 6 * GIB, int(1.5 * GIB), (GIB // 2 * 3,) * 3,
                                              GIB // 2, GIB // 4),
         "text_encoder": planner.ComponentSize("text_encoder", GIB, GIB // 8, (), GIB // 8, GIB // 16),
         "vae": planner.ComponentSize("vae", GIB // 2, GIB // 2, (), GIB // 16, GIB // 16)}
STAGES = [planner.Stage("text", {"text_encoder": GIB // 8}), planner.Stage("denoise", {"transformer": GIB}),
          planner.Stage("decode", {"vae": GIB})]


def fitting(kind="cuda", quant=None, **kw):
    return mm.Fitting(mem(**kw), quant, {}, kind, None)


def test_bound_is_the_budget_capped_at_the_device_and_names_the_device_where_it_binds():
    assert fitting().bound(80 * GIB) == (80 * GIB, "the device's 80.0 GiB")
    assert fitting().bound(None) == (None, "the device's memory")
    assert fitting(max_gpu_gb=8).bound(80 * GIB) == (8 * GIB, None)
    assert fitting(max_gpu_gb=8).bound(None) == (8 * GIB, None)
    assert fitting(max_gpu_gb=1.5).bound(None) == (int(1.5 * GIB), None)
    assert fitting(max_gpu_gb=80).bound(80 * GIB) == (80 * GIB, None)
    assert fitting(max_gpu_gb=100).bound(80 * GIB) == (
        80 * GIB, "the device's 80.0 GiB (memory.max_gpu_gb=100.0 is more than the device has)")


def test_auto_off_a_gpu_takes_none_and_says_why():
    f = fitting("cpu", offload="auto")
    f.choose(SIZES, STAGES, 4, None)
    assert f.plan.offload == "none" and f.plan.peak == 7.5 * GIB + GIB + planner.RESERVE_BYTES
    assert f.why == "memory.offload=auto on platform cpu: no GPU memory to fit, nothing offloaded (none)"
    assert [p.offload for p in f.candidates] == list(planner.OFFLOAD_MODES)
    assert f.bound_name is None and f.budget is None


def test_a_configured_plan_without_budget_runs_where_it_fits_and_is_refused_where_not():
    f = fitting(offload="model")
    f.choose(SIZES, STAGES, 4, None)
    assert f.plan.offload == "model" and f.plan.peak == 7 * GIB + planner.RESERVE_BYTES
    assert f.why == ("memory.offload=model as configured (no memory.max_gpu_gb: nothing to fit against; "
                     "memory.offload=auto with a budget chooses)")
    f = fitting(offload="model")
    f.choose(SIZES, STAGES, 4, 7 * GIB + planner.RESERVE_BYTES)  # exactly its peak: fits
    assert f.plan.offload == "model" and "its peak fits the device's 7.5 GiB" in f.why
    # a configured group_block without a budget streams every block (nothing kept resident)
    f = fitting(offload="group_block")
    f.choose(SIZES, STAGES, 4, 80 * GIB)
    assert f.plan.resident_blocks == 0
    with pytest.raises(planner.MemoryBudgetError) as e:
        fitting(offload="none").choose(SIZES, STAGES, 4, 8 * GIB)
    msg = str(e.value)
    assert "memory.offload=none plans a peak of 9.0 GiB" in msg and "over the device's 8.0 GiB" in msg
    assert "fix: memory.offload=model (the cheapest plan that fits: 7.5 GiB)" in msg


def test_auto_on_a_gpu_fits_the_device_and_keeps_denoiser_blocks_resident_within_it():
    f = fitting(offload="auto")
    f.choose(SIZES, STAGES, 4, 8 * GIB)
    assert f.plan.offload == "model" and f.budget == 8 * GIB and f.bound_name == "the device's 8.0 GiB"
    assert f.why.startswith("auto: model is the fastest plan that fits 8.0 GiB")
    # a budget group_block is filled against: blocks kept resident by the budget, the plan's peak within it
    f = fitting(offload="group_block", max_gpu_gb=8)
    f.choose(SIZES, STAGES, 4, None)
    gb = [p for p in f.candidates if p.offload == "group_block"][0]
    # streamed peak 4.5 GiB, margin 1 GiB: one 1.5 GiB block fits the 2.5 GiB left
    assert f.plan is gb and gb.resident_blocks == 1 and gb.peak == 6 * GIB
    assert gb == planner.keep_resident(planner.plan("group_block", SIZES, STAGES, "transformer", 4, False, 1),
                                       SIZES, "transformer", 4, 8 * GIB)
    assert f.bound_name == "memory.max_gpu_gb=8" and f.why == "memory.offload=group_block (as configured)"


def test_a_budget_no_plan_fits_names_the_budget_and_leaves_out_what_is_set():
    f = fitting(offload="auto", max_gpu_gb=1, vae_slicing=True, quant=qcfg(transformer="int8wo"))
    with pytest.raises(planner.MemoryBudgetError) as e:
        f.choose(SIZES, STAGES, 4, None)
    msg = str(e.value)
    assert "memory.offload=auto: no plan fits memory.max_gpu_gb=1.0" in msg
    assert "memory.vae_slicing=true" not in msg and "model.quantization.transformer=nf4" not in msg
    assert "set memory.vae_tiling=true" in msg and msg.endswith("or raise memory.max_gpu_gb")
    f = fitting(offload="auto", max_gpu_gb=1, vae_tiling=True)
    with pytest.raises(planner.MemoryBudgetError) as e:
        f.choose(SIZES, STAGES, 4, None)
    assert "quantize the largest component" in str(e.value) and "memory.vae_tiling=true" not in str(e.value)


def test_section_records_plan_budget_candidates_and_quantization():
    f = fitting(offload="auto", max_gpu_gb=8, quant=qcfg(text_encoder="int8wo"))
    assert f.section()["offload"] == "auto" and f.section()["planned"] is None
    assert f.section()["budget_gb"] is None
    f.choose(SIZES, STAGES, 4, None)
    s = f.section()
    assert s["offload"] == f.plan.offload and s["why"] == f.why and s["budget_gb"] == 8.0
    assert s["max_gpu_gb"] == 8.0 and s["bound"] == "memory.max_gpu_gb=8"
    assert s["planned"] == f.plan.to_dict() and len(s["candidates"]) == 4
    assert s["candidates"][0] == f.candidates[0].to_dict()
    assert s["reserve_gb"] == 0.5 and s["quantization"] == {"text_encoder": "int8wo"} and s["applied"] == {}


def test_defers_placement_only_under_an_offload_plan():
    assert not fitting().defers() and not fitting(offload="auto").defers()
    assert fitting(offload="model").defers()
    f = fitting(offload="auto")
    f.choose(SIZES, STAGES, 4, 8 * GIB)
    assert f.defers()
    f.choose(SIZES, STAGES, 4, 80 * GIB)
    assert not f.defers()


def test_estimate_exceeded_names_only_the_phases_above_the_plan():
    assert mm.estimate_exceeded({"denoise": 9.5, "text": 9.0, "decode": 3.0}, 9.0) == {"denoise": 9.5}
    assert mm.estimate_exceeded({}, 1.0) == {}


# ------------------------------------------------------------------------------------------------ evidence


class Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        self.out = torch.nn.Linear(2, 3, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def test_group_levels_block_only_for_a_component_with_block_lists():
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2))  # its children are Linears, not lists
    comps = {"transformer": Two(), "text_encoder": flat, "scheduler": object()}
    assert mm.group_levels(comps, "group_block") == {"transformer": "block_level", "text_encoder": "leaf_level"}
    assert mm.group_levels(comps, "group_leaf") == {"transformer": "leaf_level", "text_encoder": "leaf_level"}
    seq = torch.nn.Module()
    seq.layers = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert mm.group_levels({"t": seq}, "group_block") == {"t": "block_level"}


def test_model_offload_probe_counts_a_components_bytes_each_call_it_starts_off_the_device():
    m = Two()  # 2 x (4 + 2) + 6 floats = 18 x 4 bytes, on the CPU
    probe = mm.OffloadProbe()
    probe.watch_models({"transformer": m}, "cuda")
    assert probe.groups == 1
    m(torch.zeros(1, 2))
    m(torch.zeros(1, 2))
    assert (probe.onloads, probe.bytes) == (2, 2 * 18 * 4)
    on_device, here = mm.OffloadProbe(), Two()
    on_device.watch_models({"transformer": here, "vae": Two()}, "cpu")
    here(torch.zeros(1, 2))
    assert (on_device.groups, on_device.onloads, on_device.bytes) == (2, 0, 0)
    sec, bad = mm.offload_evidence(probe, "model", 4)
    assert sec == {"offload": "model", "observed": True, "groups": 1, "onloads": 2, "bytes_onloaded": 144,
                   "bytes_onloaded_per_forward": 36}
    assert bad == []


def test_offload_evidence_flags_a_plan_that_onloaded_nothing():
    assert mm.offload_evidence(None, "model", 3) == ({"offload": "model", "observed": False}, [])
    sec, bad = mm.offload_evidence(mm.OffloadProbe(), "group_leaf", 0)
    assert sec["bytes_onloaded_per_forward"] is None and sec["onloads"] == 0
    assert bad == ["memory.offload=group_leaf: no onload was observed at diffusers' offload hooks"]
    assert mm.offload_evidence(mm.OffloadProbe(), "none", 2)[1] == []
    p = mm.OffloadProbe(onloads=3, bytes=10)
    assert mm.offload_evidence(p, "model", 3)[0]["bytes_onloaded_per_forward"] == 3


def test_a_component_that_claims_quantization_with_0_quantized_linears_is_a_mismatch():
    probe = mm.QuantProbe({"transformer": "int8wo", "vae": "int8wo"})
    m = Two()
    probe.attach({"transformer": m, "vae": "not a module"})
    m(torch.zeros(1, 2))
    sec, bad = probe.section()
    assert sec["transformer"] == {"method": "int8wo", "linears": 3, "quantized_linears": 0,
                                  "calls_by_weight_class": {"Parameter": 3}, "quantized_calls": 0,
                                  "calls_observed": True}
    assert sec["vae"]["linears"] == 0 and sec["vae"]["calls_by_weight_class"] == {}
    assert bad == ["model.quantization.transformer=int8wo: none of its 3 Linears holds a Int8Tensor weight after "
                   "loading"]


@requires_extra("torchao")
def test_quantized_linears_count_their_calls_and_one_dequantized_later_is_named():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    m = Two()
    quantize_(m, Int8WeightOnlyConfig())
    probe = mm.QuantProbe({"transformer": "int8wo"})
    probe.attach({"transformer": m})
    m(torch.zeros(1, 2))
    sec, bad = probe.section()
    assert sec["transformer"]["quantized_linears"] == 3 and sec["transformer"]["quantized_calls"] == 3
    assert sec["transformer"]["calls_by_weight_class"] == {"Int8Tensor": 3} and bad == []
    m.out.weight = torch.nn.Parameter(torch.ones(3, 2))  # dequantized behind the runner
    m(torch.zeros(1, 2))
    sec, bad = probe.section()
    assert sec["transformer"]["quantized_calls"] == 5 and sec["transformer"]["calls_by_weight_class"]["Parameter"] == 1
    assert bad == ["model.quantization.transformer=int8wo: Linears quantized at load ran with another weight: out"]


def test_quantized_calls_of_zero_while_the_linears_ran_is_a_mismatch():
    probe = mm.QuantProbe({"transformer": "int8wo"})
    m = Two()
    probe.attach({"transformer": m})
    probe.quantized["transformer"] = 3  # loaded quantized, as the count at attach records it
    m(torch.zeros(1, 2))
    _, bad = probe.section()
    assert bad == ["model.quantization.transformer=int8wo: its Linears ran 3 times, none with a Int8Tensor weight "
                   "(0 quantized Linears executed)"]


def test_quant_kernels_match_the_methods_signature():
    trace = SimpleNamespace(kernels=["void at::native::gemm", "int4pack_mm_kernel", "Tinygemm_x"] + ["x"] * 3)
    rec = {"method": "int4wo"}
    assert mm.quant_kernels(rec, trace) == [] and rec["kernels"] == ["Tinygemm_x", "int4pack_mm_kernel"]
    rec = {"method": "int4wo"}
    assert mm.quant_kernels(rec, SimpleNamespace(kernels=["gemm"])) == [
        "model.quantization.transformer=int4wo: the profiled denoiser forward ran no kernel matching "
        "'int4pack|tinygemm'"]
    assert rec["kernels"] == []
    many = SimpleNamespace(kernels=[f"int4pack_{i:02d}" for i in range(25)])
    rec = {"method": "int4wo"}
    mm.quant_kernels(rec, many)
    assert len(rec["kernels"]) == 20 and rec["kernels"][0] == "int4pack_00"
    assert mm.quant_kernels(None, trace) == [] and mm.quant_kernels(rec, None) == []
    assert mm.quant_kernels({"method": "int4wo"}, SimpleNamespace(kernels=[])) == []
    assert mm.quant_kernels({"method": "int8wo"}, trace) == []  # no signature of its own


# ------------------------------------------------------------------------------------------------ loading inputs

LIBS = {"transformer": "diffusers", "transformer_2": "diffusers", "text_encoder": "transformers"}


@requires_extra("torchao")
@pytest.mark.parametrize("comp", ["transformer", "transformer_2"])
def test_a_quantized_denoiser_refuses_fused_qkv_and_a_linear_backend_naming_the_component(comp):
    from runner.kernels.registry import SelectionContext

    cpu = SelectionContext(platform_kind="cpu", sm=None, dtype=torch.float32)
    f = mm.Fitting(mem(), qcfg(**{comp: "int8wo"}), LIBS, "cpu", None)
    f.check(cpu, False, False, None)
    f.check(cpu, False, False, "TORCH")
    f.check(cpu, True, False, None)  # int8wo quantizes random weights too
    with pytest.raises(ConfigValueError) as e:
        f.check(cpu, False, True, None)
    assert str(e.value) == (f"optimize.fuse_qkv=true with model.quantization.{comp}=int8wo: fusing concatenates the "
                            "projection weights, which are quantized tensors; fix: optimize.fuse_qkv=false")
    with pytest.raises(ConfigValueError) as e:
        f.check(cpu, False, False, "FP8")
    assert str(e.value) == (f"linear backend FP8 with model.quantization.{comp}=int8wo: both replace the "
                            f"transformer's Linear weights; fix: backend.linear=TORCH (or auto), or "
                            f"model.quantization.{comp}=none")
    enc = mm.Fitting(mem(), qcfg(text_encoder="int8wo"), LIBS, "cpu", None)
    enc.check(cpu, False, True, "FP8")  # a quantized text encoder combines with both


def test_dummy_weights_check_refuses_a_checkpoint_only_method_before_anything_else():
    from runner.kernels.registry import SelectionContext

    f = mm.Fitting(mem(), qcfg(transformer="nf4"), LIBS, "cpu", None)
    with pytest.raises(Exception) as e:
        f.check(SelectionContext(platform_kind="cpu", sm=None, dtype=torch.float32), True, False, None)
    assert "model.quantization.transformer=nf4" in str(e.value)


def test_quant_mapping_skips_gguf_and_on_device_names_int4():
    m = mm.quant_mapping({"text_encoder": "gguf"}, {"text_encoder": "transformers"}, torch.bfloat16)
    assert m == {}
    assert mm.pipeline_quantization({"text_encoder": "gguf"}, {"text_encoder": "transformers"}, torch.bfloat16) is None
    assert mm.on_device_components({"transformer": "int4wo", "text_encoder": "int8wo"}) == ["transformer"]
    assert mm.on_device_components({}) == []


def test_component_sizes_at_the_methods_bits_and_the_files_bytes():
    lin = torch.nn.Linear(4, 4, bias=False)  # 16 float32 = 64 bytes
    sizes = mm.component_sizes({"transformer": lin, "text_encoder": torch.nn.Linear(4, 4, bias=False),
                                "vae": torch.nn.Linear(4, 4, bias=False), "scheduler": object()},
                               {"transformer": "int8wo", "text_encoder": "gguf"}, gguf_bytes=7,
                               file_bytes={"vae": 5})
    assert set(sizes) == {"transformer", "text_encoder", "vae"}
    assert sizes["transformer"] == planner.size_module("transformer", lin, linear_bits=8.0)
    assert sizes["transformer"].weights == 16
    assert sizes["text_encoder"].weights == 7 and sizes["vae"].weights == 5
    assert mm.component_sizes({"vae": lin}, {})["vae"].weights == 64


def test_checkpoint_bytes_sum_a_pre_quantized_components_safetensors(tmp_path):
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "a.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "transformer" / "b.safetensors").write_bytes(b"x" * 5)
    (tmp_path / "transformer" / "c.json").write_bytes(b"x" * 100)
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "a.safetensors").write_bytes(b"x" * 3)
    src = {"kind": "path", "path": str(tmp_path)}
    assert mm.checkpoint_bytes(src, {"transformer": "nunchaku", "text_encoder": "int8wo"}) == {"transformer": 15}
    assert mm.checkpoint_bytes(src, {"vae": "modelopt"}) == {}
    assert mm.checkpoint_bytes({"kind": "hub", "path": str(tmp_path)}, {"transformer": "nunchaku"}) == {}
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text('{"a": 1}')
    (tmp_path / "text_encoder" / "config.json").write_text("{not json")
    assert mm.checkpoint_configs(src, ["vae", "text_encoder", "unet"]) == {"vae": {"a": 1}, "text_encoder": None,
                                                                          "unet": None}
    assert mm.checkpoint_configs({"kind": "hub"}, ["vae"]) == {}


# ------------------------------------------------------------------------------------------------ stage evidence


def test_fitting_evidence_names_resident_blocks_off_the_device():
    f = fitting(offload="group_block")
    f.applied = {"offload": "group_block"}
    f.offload_probe = mm.OffloadProbe(onloads=4, bytes=40, groups=2)
    f.resident, f.device = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], "cpu"
    sec, bad = f.evidence(2)
    assert sec == {"offload": {"offload": "group_block", "observed": True, "groups": 2, "onloads": 4,
                               "bytes_onloaded": 40, "bytes_onloaded_per_forward": 20, "resident_blocks": 2,
                               "resident_on": ["cpu"]}}
    assert bad == []
    for dev in ("cuda", "cuda:0"):
        f.device = dev
        _, bad = f.evidence(2)
        assert bad == [f"memory.offload=group_block: the 2 resident denoiser blocks were on cpu after the run, "
                       f"not {dev}"]
    f.resident = []
    assert "resident_blocks" not in f.evidence(2)[0]["offload"]


def test_fitting_evidence_adds_the_quantization_record_and_its_kernel_mismatch():
    f = fitting(quant=qcfg(transformer="int4wo"))
    m = Two()
    f.quant_probe = mm.QuantProbe(dict(f.choices))
    f.quant_probe.attach({"transformer": m})
    m(torch.zeros(1, 2))
    sec, bad = f.evidence(1, SimpleNamespace(kernels=["gemm"]))
    assert sec["offload"] == {"offload": "none", "observed": False}
    assert sec["quantization"]["transformer"]["linears"] == 3
    assert bad == ["model.quantization.transformer=int4wo: none of its 3 Linears holds a Int4TilePackedTo4dTensor "
                   "weight after loading",
                   "model.quantization.transformer=int4wo: the profiled denoiser forward ran no kernel matching "
                   "'int4pack|tinygemm'"]
    assert "observed_peak_gb" not in sec


def test_fitting_evidence_sets_observed_peaks_beside_the_plan_and_warns_where_the_estimate_is_exceeded(caplog):
    f = fitting(offload="model")
    f.choose(SIZES, STAGES, 4, None)  # planned peak 7.5 GiB
    f.peaks = mm.PhasePeaks()
    f.peaks.peaks = {"text_encode": 2 * GIB, "denoise": 8 * GIB}
    with caplog.at_level("WARNING", logger="models.memory"):
        sec, bad = f.evidence(4)
    assert sec["observed_peak_gb"] == {"text_encode": 2.0, "denoise": 8.0}
    assert sec["planned_peak_gb"] == f.plan.to_dict()["stages_gb"] and sec["estimate_exceeded"] == {"denoise": 8.0}
    assert bad == []
    assert "the memory planner's estimate (7.5 GiB with its reserve) is below the observed peak of denoise 8.0 GiB" \
        in caplog.text
    f.plan = None
    sec, _ = f.evidence(4)
    assert "planned_peak_gb" not in sec and sec["observed_peak_gb"]["denoise"] == 8.0


def test_the_pass_reports_evidence_only_when_something_was_planned_applied_or_measured():
    f = fitting()
    eng = SimpleNamespace(fit=f, probe=None, want_forwards=3)
    p = mm.FittingPass(eng)
    section = {}
    assert p.evidence(section) == [] and section == {}
    eng.fit = None
    assert p.evidence(section) == []
    f.applied = {"offload": "model"}
    f.offload_probe = mm.OffloadProbe()
    eng.fit = f
    assert p.evidence(section) == ["memory.offload=model: no onload was observed at diffusers' offload hooks"]
    assert section["memory"]["offload"]["observed"] is True
    q = fitting(quant=qcfg(transformer="int4wo"))
    q.quant_probe = mm.QuantProbe(dict(q.choices))
    eng.fit, eng.probe = q, SimpleNamespace(trace=SimpleNamespace(kernels=["gemm"]))
    assert p.evidence(section)[-1].endswith("ran no kernel matching 'int4pack|tinygemm'")
    p2 = fitting()
    p2.peaks = mm.PhasePeaks()
    eng.fit = p2
    assert p.evidence(section) == [] and section["memory"]["offload"]["offload"] == "none"


@requires_extra("torchao")
def test_quant_mapping_builds_each_components_librarys_config():
    libs = {"transformer": "diffusers", "text_encoder": "transformers", "text_encoder_2": "transformers"}
    m = mm.quant_mapping({"transformer": "float8wo", "text_encoder": "int8wo", "text_encoder_2": "nunchaku"}, libs,
                         torch.bfloat16)
    assert set(m) == {"transformer", "text_encoder"}  # a pre-quantized checkpoint's config is its own
    assert type(m["transformer"]).__module__.startswith("diffusers")
    assert type(m["text_encoder"]).__module__.startswith("transformers")
    assert type(m["transformer"].quant_type).__name__ == "Float8WeightOnlyConfig"
    assert type(m["text_encoder"].quant_type).__name__ == "Int8WeightOnlyConfig"
    q = mm.pipeline_quantization({"transformer": "float8wo", "text_encoder": "int8wo"}, libs, torch.float16)
    assert type(q).__name__ == "PipelineQuantizationConfig" and set(q.quant_mapping) == {"transformer", "text_encoder"}
    assert type(q.quant_mapping["transformer"]).__module__.startswith("diffusers")
    assert type(q.quant_mapping["text_encoder"]).__module__.startswith("transformers")


def _whole(conf, batch, frames, px_h, tiling=False, slicing=False, cls="AutoencoderKLLTX2Video"):
    return mm.whole_video_decoder_activations(cls, conf, batch, frames, px_h, px_h, 2, tiling, slicing)


def test_whole_video_latent_frames_floor_and_a_patched_decoder():
    # 10 frames are the latent frames of 9: (10 - 1) // 4 + 1 = 3
    assert _whole(LTX, 2, 10, 16) == _whole(LTX, 2, 9, 16)
    # patch 2 x 2, patch_t 2: out_channels 3 x 2 x 2 x 2; spatial 2 x 4 = 8, temporal 2 x 4 = 8
    conf = {"decoder_block_out_channels": [4, 8], "upsample_factor": 2, "patch_size": 2, "patch_size_t": 2}
    g = mm.ltx2_decoder_geometry(conf)
    assert (g["spatial"], g["temporal"], g["out_channels"], g["channels"]) == (8, 8, 24, [8, 4, 2])
    # 17 frames -> 3 latent frames, 32 px -> 4 latents; the last level (2, 9, 16, 16) is the pixels over patch 2
    levels = mm.decoder_levels(g, 3, 4, 4)
    assert levels[-1] == (2, 9, 16, 16)
    peak = planner.ltx2_decoder_activation(2, levels[-1], levels[-2], 2, True, 24)
    # unsliced: the call's peak; the two copies of the video (3 x 17... pixels) are the sliced decode's only
    assert _whole(conf, 2, 17, 32) == peak
    video = 3 * 9 * 2 * 32 * 32 * 2  # per video: 3 x (9 x patch_t) x 32 x 32 x e
    peak1 = planner.ltx2_decoder_activation(1, levels[-1], levels[-2], 2, True, 24)
    assert _whole(conf, 2, 17, 32, slicing=True) == max(peak1 + video, 4 * video + planner.workspace_allowance(
        2 * 9 * 16 * 16 * 2))


def test_whole_video_sliced_holds_the_decoded_videos_and_two_copies_at_the_end():
    px, video = 3 * 9 * 16 * 2, 3 * 9 * 16 * 16 * 2
    assert _whole(LTX, 8, 9, 16, slicing=True) == max(_ltx(1, 3, 4, 4) + 7 * video,
                                                      2 * 8 * video + planner.workspace_allowance(2 * 9 * 256 * 2))
    assert 2 * 8 * video > _ltx(1, 3, 4, 4) + 7 * video  # the end binds here
    assert px * 16 == video


def test_whole_video_tiles_only_above_a_tile_in_either_axis():
    conf = {**LTX, "tile_sample_min_height": 16, "tile_sample_stride_height": 8}  # tile 4, stride 2 latents
    assert _whole(conf, 1, 9, 16, tiling=True) == _whole(conf, 1, 9, 16)  # 4 latents: not above a tile
    wide = mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 16, 20, 2, True, False)
    assert wide != mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 16, 20, 2, False, False)
    tall = mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 20, 16, 2, True, False)
    assert tall != mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 20, 16, 2, False, False)


def test_hunyuan15_whole_video_peak_is_at_the_last_up_block():
    conf = {"block_out_channels": [4, 8], "spatial_compression_ratio": 4, "temporal_compression_ratio": 2,
            "upsample_match_channel": False}
    g = mm.hunyuan15_decoder_geometry(conf)  # reversed [8, 4]; up [(2, 2), (1, 2)]; channels [8, 8, 4]
    levels = mm.decoder_levels(g, 2, 2, 2)
    assert levels == [(8, 2, 2, 2), (8, 3, 4, 4), (4, 3, 8, 8)]
    got = mm.whole_video_decoder_activations("AutoencoderKLHunyuanVideo15", conf, 1, 3, 8, 8, 2, False, False)
    assert got == planner.hunyuan15_decoder_activation(1, (4, 3, 8, 8), (8, 8), 2)


def test_ltx2_geometry_reverses_the_scaling_and_floors_channels():
    g = mm.ltx2_decoder_geometry({"decoder_block_out_channels": [4, 8, 16],
                                  "decoder_spatio_temporal_scaling": [True, False, False]})
    assert g["up"] == [(1, 1), (1, 1), (2, 2)]
    # the default channels under a factor of 1 (the default factor 2 would floor an odd change away)
    assert mm.ltx2_decoder_geometry({"upsample_factor": 1})["channels"] == [1024, 1024, 512, 256]
    g = mm.ltx2_decoder_geometry({"decoder_block_out_channels": [6, 6], "upsample_factor": 4})
    assert g["channels"] == [6, 1, 1] and all(isinstance(c, int) for c in g["channels"])


def test_probes_take_a_module_without_weights_and_a_trace_without_kernels():
    probe = mm.OffloadProbe()
    act = torch.nn.ReLU()
    probe.watch_models({"act": act}, "cuda")
    act(torch.zeros(2))
    assert (probe.onloads, probe.bytes) == (0, 0)
    assert mm.quant_kernels({"method": "int4wo"}, object()) == []


def _torchao_to_tables():
    from torchao.utils import TorchAOBaseTensor

    todo, out = [TorchAOBaseTensor], []
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        t = c.__dict__.get("_ATEN_OP_TABLE", {}).get(c)
        if t is not None and torch.ops.aten.to.dtype_layout in t:
            out.append(t)
    return out


@requires_extra("torchao")
def test_torchao_device_copies_patch_every_subclass_once_from_an_unpatched_process():
    """Whatever patched the tables before (an earlier test, a parent process), they are put back first, so the
    count and the wrapped behaviour are this call's."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    lin = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    quantize_(lin, Int8WeightOnlyConfig())
    op = torch.ops.aten.to.dtype_layout
    tables = _torchao_to_tables()
    for t in tables:
        if getattr(t[op], "_runner_device_copy", False):
            t[op] = t[op].__defaults__[0]  # torchao's own, kept as the wrapper's default
    originals = [t[op] for t in tables]
    assert not any(getattr(f, "_runner_device_copy", False) for f in originals)
    assert mm.torchao_device_copies() == len(tables) >= 1
    assert mm.torchao_device_copies() == 0
    assert all(t[op]._runner_device_copy is True and t[op].__defaults__[0] is o for t, o in zip(tables, originals))
    w = lin.weight
    impl = type(w).__dict__["_ATEN_OP_TABLE"][type(w)][op]
    names = type(w).tensor_data_names
    kw = {"dtype": w.dtype, "layout": w.layout}
    for extra in ({}, {"non_blocking": True}, {"copy": False}, {"memory_format": None}):
        moved = impl(op, (type(w),), (w,), {**kw, **extra, "device": torch.device("meta")})
        assert type(moved) is type(w) and all(getattr(moved, n).device.type == "meta" for n in names), extra
    moved = impl(op, (type(w),), (w,), {"device": "meta"})  # dtype and layout left out: the same
    assert all(getattr(moved, n).device.type == "meta" for n in names)
    assert all(getattr(w, n).device.type == "cpu" for n in names)
    # no device change: torchao's own (which returns self)
    assert impl(op, (type(w),), (w,), {**kw, "device": torch.device("cpu")}) is w
    # any other change, or an unknown keyword, is torchao's own, which asserts on what it does not support
    for other in ({"dtype": torch.float32}, {"layout": torch.sparse_coo}, {"copy": True},
                  {"memory_format": torch.preserve_format}, {"pin_memory": False}):
        with pytest.raises(AssertionError):
            impl(op, (type(w),), (w,), {**kw, **other, "device": torch.device("meta")})


@requires_extra("torchao")
def test_torchao_device_copies_patch_nothing_before_torchao_is_imported(monkeypatch):
    import sys

    import torchao.utils  # noqa: F401  (imported, then hidden: the call must not look for it elsewhere)

    monkeypatch.delitem(sys.modules, "torchao.utils")
    assert mm.torchao_device_copies() == 0


def test_quant_probe_skips_a_non_module_before_the_others_and_names_every_weight_class():
    probe = mm.QuantProbe({"vae": "int8wo", "transformer": "nunchaku"})
    m = Two()
    probe.attach({"vae": "not a module", "transformer": m})
    m(torch.zeros(1, 2))
    sec, bad = probe.section()
    assert sec["vae"]["quantized_linears"] == 0 and sec["vae"]["linears"] == 0
    assert sec["transformer"]["linears"] == 3 and sec["transformer"]["quantized_linears"] == 0
    assert bad == ["model.quantization.transformer=nunchaku: none of its 3 Linears holds a "
                   "SVDQW4A4Linear/AWQW4A16Linear weight after loading"]
    probe.quantized["transformer"] = 3  # as if loaded quantized: its Linears then ran with plain weights
    assert probe.section()[1] == ["model.quantization.transformer=nunchaku: its Linears ran 3 times, none with a "
                                  "SVDQW4A4Linear/AWQW4A16Linear weight (0 quantized Linears executed)"]


@requires_extra("torchao")
def test_linears_dequantized_after_load_are_named_the_first_five():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    m = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(7)])
    quantize_(m, Int8WeightOnlyConfig())
    probe = mm.QuantProbe({"transformer": "int8wo"})
    probe.attach({"transformer": m})
    for i in range(6):
        m[i].weight = torch.nn.Parameter(torch.ones(2, 2))
    m(torch.zeros(1, 2))
    sec, bad = probe.section()
    assert sec["transformer"]["quantized_linears"] == 7 and sec["transformer"]["quantized_calls"] == 1
    assert bad == ["model.quantization.transformer=int8wo: Linears quantized at load ran with another weight: "
                   "0, 1, 2, 3, 4"]


def test_a_resident_block_sharing_its_group_is_refused_naming_block_and_fix():
    from diffusers.hooks.group_offloading import apply_group_offloading

    m = Two()
    apply_group_offloading(m, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=2)
    with pytest.raises(RuntimeError) as e:
        mm.keep_blocks(m, 1, "cpu")
    assert str(e.value) == ("memory.offload=group_block: block blocks.0 shares its offload group; a resident block "
                            "must be its own group (blocks_per_group=1)")


def test_kept_blocks_leave_lazy_prefetchings_name_set_so_it_sees_no_unexecuted_layer():
    """diffusers' lazy prefetching compares the layers that ran in the first forward against the names it put
    trackers on, and warns about those that did not run: a kept block's name must leave that set with its tracker."""
    from diffusers.hooks import HookRegistry, apply_group_offloading
    from diffusers.hooks.group_offloading import _LAZY_PREFETCH_GROUP_OFFLOADING, LazyPrefetchGroupOffloadingHook

    m = torch.nn.Module()
    m.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    apply_group_offloading(m, onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1)
    lazy = LazyPrefetchGroupOffloadingHook()
    HookRegistry.check_if_exists_or_initialize(m).register_hook(lazy, _LAZY_PREFETCH_GROUP_OFFLOADING)
    assert lazy._layer_execution_tracker_module_names == {"blocks.0", "blocks.1", "blocks.2"}
    assert mm.keep_blocks(m, 2, "cpu") == ["blocks.0", "blocks.1"]
    assert lazy._layer_execution_tracker_module_names == {"blocks.2"}


@pytest.fixture(scope="module")
def tiny_flux_arch():
    from omegaconf import OmegaConf

    from _helpers import compose

    return OmegaConf.to_container(compose(["model=tiny_flux"]).model.architecture, resolve=True)


def _group_hooks(module):
    return [m._diffusers_hook.get_hook("group_offloading") for m in module.modules()
            if getattr(m, "_diffusers_hook", None) is not None
            and m._diffusers_hook.get_hook("group_offloading") is not None]


@pytest.mark.parametrize("per_group", [1, 2])
def test_apply_offload_records_what_it_applied_and_groups_blocks_as_planned(tiny_flux_arch, per_group):
    from diffusers import FluxPipeline

    from models.flux import build_components

    pipe = FluxPipeline(**build_components(tiny_flux_arch))
    n_blocks = len(mm.blocks_in_order(pipe.transformer))
    plan = planner.Plan("group_block", False, per_group, resident_blocks=1 if per_group == 1 else 0)
    applied = mm.apply_offload(pipe, plan, "cpu")
    levels = mm.group_levels(pipe.components, "group_block")
    first = mm.blocks_in_order(pipe.transformer)[0][0]
    assert applied == {"offload": "group_block", "use_stream": False, "blocks_per_group": per_group,
                       "record_stream": False, "levels": levels, "resident_blocks": 1 if per_group == 1 else 0,
                       "resident": [first] if per_group == 1 else []}
    hooks = _group_hooks(pipe.transformer)
    blocks = {id(b) for _, b in mm.blocks_in_order(pipe.transformer)}
    block_groups = {id(h.group): h.group for h in hooks if any(id(m) in blocks for m in h.group.modules)}
    kept = 1 if per_group == 1 else 0
    assert sorted(len(g.modules) for g in block_groups.values()) == sorted(
        [per_group] * ((n_blocks - kept) // per_group) + ([(n_blocks - kept) % per_group] if (n_blocks - kept)
                                                          % per_group else []))
    for h in hooks + _group_hooks(pipe.text_encoder):
        assert h.group.onload_device == torch.device("cpu") and h.group.offload_device == torch.device("cpu")
        assert h.group.stream is None and h.group.record_stream is False
    assert _group_hooks(pipe.vae) and _group_hooks(pipe.text_encoder_2)


def test_apply_offload_none_moves_the_pipeline_and_records_the_plan(tiny_flux_arch):
    from diffusers import FluxPipeline

    from models.flux import build_components

    pipe = FluxPipeline(**build_components(tiny_flux_arch))
    assert mm.apply_offload(pipe, planner.Plan("none", True, 3, record_stream=True), "meta") == {
        "offload": "none", "use_stream": True, "blocks_per_group": 3, "record_stream": True}
    assert next(pipe.transformer.parameters()).device.type == "meta"
    assert not _group_hooks(pipe.transformer)


PATCHED = {"decoder_block_out_channels": [4, 8], "upsample_factor": 2, "patch_size": 2, "patch_size_t": 2}


def test_whole_video_a_latent_size_equal_to_the_tile_is_not_tiled():
    # patched: spatial 8, so a 32 px tile is 4 latents; the end copies bind here, so tiling would show
    conf = {**PATCHED, "tile_sample_min_height": 32, "tile_sample_stride_height": 16}
    for hh, ww in ((32, 16), (16, 32), (32, 32)):
        tiled = mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 2, 17, hh, ww, 2, True, True)
        assert tiled == mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 2, 17, hh, ww, 2, False,
                                                           True), (hh, ww)


def test_whole_video_tiled_peak_is_the_largest_tile_call_beside_the_tiles_before():
    conf = {"decoder_block_out_channels": [64, 128], "patch_size": 1, "patch_size_t": 1,
            "tile_sample_min_height": 12, "tile_sample_stride_height": 8}  # channels [128, 64, 32]; tile 3, stride 2
    g = mm.ltx2_decoder_geometry(conf)
    px = 3 * 9 * 16 * 2

    def call(th, tw):
        lv = mm.decoder_levels(g, 3, th, tw)
        return planner.ltx2_decoder_activation(1, lv[-1], lv[-2], 2, True, 3)

    peak = max(call(3, 3), call(3, 2) + px * 9, call(2, 3) + px * 15, call(2, 2) + px * 21)
    end = px * 25 + 2 * px * 16
    assert peak > end  # the calls bind: a wrong call or a wrong sum of the tiles before shows
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 16, 16, 2, True, False) == \
        max(peak, end + planner.workspace_allowance(32 * 9 * 12 * 12 * 2))


def test_wan_geometry_halves_to_whole_channels_and_the_chunk_is_a_power_of_two():
    g = mm.wan_decoder_geometry({"base_dim": 1, "dim_mult": [1, 3], "num_res_blocks": 0, "z_dim": 4,
                                 "temperal_downsample": [False]})
    # dims [3, 3, 1]: 4/4 + 12/4; up 0: (3 + 3)/4; up 1: 3 // 2 = 1 in, (1 + 1); conv_out 1
    assert g == {"cache": 1 + 3 + 1.5 + 2 + 1, "last_in": 1, "upsampled": 3, "chunk": 1, "patch": 1}
    assert isinstance(g["last_in"], int)
    assert mm.wan_decoder_geometry({"temperal_downsample": [True, True, True]})["chunk"] == 8


def test_meta_components_build_at_the_dtype_skip_the_scheduler_and_restore_the_default():
    conf = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 8}
    classes = {"scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", None),
               "text_encoder": ("transformers", "CLIPTextModel", "CLIPTextConfig")}
    before = torch.get_default_dtype()
    out = mm.meta_components(classes, lambda comp: conf, torch.bfloat16)
    assert list(out) == ["text_encoder"] and torch.get_default_dtype() == before
    p = next(out["text_encoder"].parameters())
    assert p.device.type == "meta" and p.dtype == torch.bfloat16
    out = mm.meta_components(classes, lambda comp: conf, torch.int8)  # not a float: built in float32
    assert next(out["text_encoder"].parameters()).dtype == torch.float32


def test_apply_offload_streams_records_only_with_a_stream_and_keeps_blocks_only_at_block_level(tiny_flux_arch):
    from diffusers import FluxPipeline

    from models.flux import build_components

    pipe = FluxPipeline(**build_components(tiny_flux_arch))
    applied = mm.apply_offload(pipe, planner.Plan("group_leaf", False, 1, record_stream=True, resident_blocks=1),
                               "cpu")
    assert applied["record_stream"] is False and applied["resident"] == [] and applied["resident_blocks"] == 0
    assert set(applied["levels"].values()) == {"leaf_level"}
    assert all(h.group.record_stream is False for h in _group_hooks(pipe.transformer))
    pipe = FluxPipeline(**build_components(tiny_flux_arch))
    assert mm.apply_offload(pipe, planner.Plan("none", False, 1, record_stream=True), "cpu")["record_stream"] is False


def test_apply_offload_model_is_diffusers_model_cpu_offload(tiny_flux_arch):
    from diffusers import FluxPipeline

    from models.flux import build_components

    pipe = FluxPipeline(**build_components(tiny_flux_arch))
    try:
        applied = mm.apply_offload(pipe, planner.Plan("model", False, 1), "cpu")
    except Exception as e:  # diffusers' model offload may want an accelerator: it was still called, not group offload
        assert "group" not in str(e).lower(), e
        assert not _group_hooks(pipe.transformer)
        return
    assert applied == {"offload": "model", "use_stream": False, "blocks_per_group": 1, "record_stream": False}
    assert not _group_hooks(pipe.transformer)


def test_refusals_join_with_semicolons_and_name_the_plan_command():
    with pytest.raises(ConfigValueError) as e:
        mm.settings(mem(offload="model", max_gpu_gb=8), "cpu", None)
    assert str(e.value) == (
        "memory.offload=model moves weights between the host and a GPU, and this platform is cpu; fix: "
        "memory.offload=none or auto (or platform=cuda); to see the plan a GPU would get: python -m runner <the same "
        "overrides, platform=cuda> --plan; memory.max_gpu_gb=8.0 budgets GPU memory, and this platform is cpu; fix: "
        "memory.max_gpu_gb=null; to see the plan a GPU would get under it: python -m runner <the same overrides, "
        "platform=cuda> --plan")
    with pytest.raises(ConfigValueError) as e:
        mm.settings(mem(max_gpu_gb=-1), "cuda", None)
    assert str(e.value) == (f"memory.max_gpu_gb=-1.0 must be a finite number of GiB in (0, {mm.MAX_GPU_GB}], or null "
                            "(no budget); fix: e.g. memory.max_gpu_gb=24")
    with pytest.raises(Exception) as e:
        mm.quant_choices(qcfg(text_encoder="nf5"))
    assert "model.quantization.text_encoder" in str(e.value)


def test_sizes_skip_a_leading_non_module_and_decoders_pass_their_settings_on():
    lin = torch.nn.Linear(4, 4, bias=False)
    assert set(mm.component_sizes({"scheduler": object(), "vae": lin}, {})) == {"vae"}
    # two block_out_channels: the second is the full-resolution upsampler's
    assert mm.decoder_activations({"block_out_channels": [3, 5]}, 1, 1, 8, 8, 2, False, False) == \
        planner.decoder_activation(1, 1, 8, 8, 5, 2)
    # Wan at an odd size: whole latents per patch
    conf = {"base_dim": 2, "dim_mult": [1, 2], "num_res_blocks": 1, "z_dim": 4, "temperal_downsample": [True],
            "patch_size": 2}
    assert mm.decoder_activations(conf, 1, 1, 13, 11, 2, False, False) == \
        planner.causal_decoder_activation(1, 1, 6, 5, 20, 2, 4, 2) + 2 * 3 * 13 * 11 * 2
    tiled = {**LTX, "tile_sample_min_height": 12, "tile_sample_stride_height": 8}
    for tiling, slicing in ((True, False), (False, True), (True, True)):
        assert mm.decoder_activations({**tiled, "_class_name": "AutoencoderKLLTX2Video"}, 2, 9, 16, 16, 2, tiling,
                                      slicing) == _whole(tiled, 2, 9, 16, tiling, slicing)
    assert _whole(tiled, 2, 9, 16, True, False) != _whole(tiled, 2, 9, 16, False, False)
    assert _whole(tiled, 2, 9, 16, False, True) != _whole(tiled, 2, 9, 16, False, False)


def test_whole_video_tiles_of_one_size_peak_at_the_last_beside_all_before():
    conf = {"decoder_block_out_channels": [64, 128], "patch_size": 1, "patch_size_t": 1,
            "tile_sample_min_height": 8, "tile_sample_stride_height": 8}  # tile = stride = 2 latents: 4 tiles of 2 x 2
    g = mm.ltx2_decoder_geometry(conf)
    px = 3 * 9 * 16 * 2
    lv = mm.decoder_levels(g, 3, 2, 2)
    call = planner.ltx2_decoder_activation(1, lv[-1], lv[-2], 2, True, 3)
    peak, end = call + 3 * px * 4, px * 16 + 2 * px * 16
    assert peak > end
    assert mm.whole_video_decoder_activations("AutoencoderKLLTX2Video", conf, 1, 9, 16, 16, 2, True, False) == \
        max(peak, end + planner.workspace_allowance(32 * 9 * 8 * 8 * 2))
