"""LTX-2 (``models/ltx2.py``, ``LTX2Pipeline``): the tiny model end to end on CPU with its audio as the MP4's FLAC
stream (evidence, records re-read from the files, resume, repro, ``output.audio=false``), the audio track of
``runner.core.video`` and the MP4 sink, the family's silent rules (32-pixel sizes, 2k+1 / 8k+1 frames, the LTX-2.0
guidance recipe) and the full-size config against the published one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from test_report import _tail, run_module

from runner.core import video

REPO_ROOT = Path(__file__).resolve().parent.parent
ROWS = [{"id": "a", "prompt": "a red fox running through snow", "negative_prompt": "blurry", "seed": 1},
        {"id": "b", "prompt": "waves crashing on a rocky shore", "seed": 2}]


@pytest.fixture(scope="module")
def ltx2_run(tmp_path_factory):
    """``python -m runner model=tiny_ltx2 platform=cpu`` on two rows (one with a negative prompt), audio on."""
    root = tmp_path_factory.mktemp("ltx2")
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    p = run_module("runner", ["model=tiny_ltx2", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}",
                              f"hydra.run.dir={root / 'run'}"], cwd=root)
    assert p.returncode == 0, _tail(p)
    return root


def _items(d: Path):
    return [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_tiny_ltx2_runs_verified_with_audio(ltx2_run):
    """Verified evidence (one forward per step: CFG batched; every attention site of both streams once per
    forward, self and cross roles), and each record's dims and audio as the file decodes them."""
    d = ltx2_run / "run"
    man = json.loads((d / "manifest.json").read_text())
    assert man["status"] == "completed" and man["evidence"]["verdict"] == "verified", man["evidence"]["mismatches"]
    st = man["evidence"]["stages"]["denoise"]
    assert st["denoiser_forwards"] == st["expected_forwards"] == 4 * 2
    layers = st["attention"]["layers"]
    assert {lay["layer"].rsplit(".", 1)[1] for lay in layers} == {
        "attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"}
    assert {lay["layer"]: lay["role"] for lay in layers if lay["layer"].startswith("transformer_blocks.0.")} == {
        f"transformer_blocks.0.{n}": r for n, r in (("attn1", "self"), ("audio_attn1", "self"), ("attn2", "cross"),
                                                  ("audio_attn2", "cross"), ("audio_to_video_attn", "cross"),
                                                  ("video_to_audio_attn", "cross"))}
    for it in _items(d):
        f = d / it["file"]
        frames = video.decode_mp4(f)
        p = it["params"]
        assert frames.shape == (p["num_frames"], p["height"], p["width"], 3) == (9, 32, 64, 3)
        assert video.frames_sha256(frames) == it["frames_sha256"]
        pcm, rate = video.read_audio(f)
        assert rate == p["audio_sample_rate"] == it["audio_sample_rate"] == 16000 and p["audio"] is True
        assert pcm.shape == (it["audio_samples"], it["audio_channels"]) and it["audio_channels"] == 2
        assert video.audio_sha256(pcm) == it["audio_sha256"] and it["audio_codec"] == "flac"
        seconds = p["num_frames"] / p["fps"]  # the pipeline sizes the audio to the video's duration
        assert 0.8 * seconds < it["audio_samples"] / rate < 1.2 * seconds
        assert np.abs(pcm).max() > 0  # not silence
        assert p["fps"] == 24
        assert (p["stg_scale"], p["modality_scale"], p["use_cross_timestep"]) == (0.0, 1.0, False)
        assert p["audio_guidance_scale"] == p["guidance_scale"] == 4.0
    a, b = _items(d)
    assert a["audio_sha256"] != b["audio_sha256"]  # each item's own audio, not one track for all


@pytest.mark.slow
def test_tiny_ltx2_resume_and_repro(ltx2_run, tmp_path):
    """A resume into a copy reuses both items (files unchanged); ``runner.repro`` reruns and finds the decoded
    frames and the decoded audio equal."""
    orig = ltx2_run / "run"
    p = run_module("runner.tools.repro", [orig, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    check = json.loads((tmp_path / "rerun" / "repro_check.json").read_text())
    assert check["ok"] and check["problems"] == []
    by_key = {it["key"]: it for it in _items(orig)}
    for row in check["items"]:
        assert row["original_audio_sha256"] == row["new_audio_sha256"] == by_key[row["key"]]["audio_sha256"]
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy)
    before = {f.name: f.read_bytes() for f in (copy / "videos").glob("*.mp4")}
    overrides = json.loads((orig / "manifest.json").read_text())["overrides"]
    p = run_module("runner", [*[o for o in overrides if not o.startswith("hydra.")], f"run.resume={copy}"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    assert json.loads((copy / "manifest.json").read_text())["resumed_from"]["reused_items"] == 2
    assert {f.name: f.read_bytes() for f in (copy / "videos").glob("*.mp4")} == before


@pytest.mark.slow
def test_audio_false_drops_the_stream_and_is_recorded(ltx2_run, tmp_path):
    """``output.audio=false``: same frames, no audio stream, ``params.audio: false``, no audio fields; the run
    identity changes, so resuming the audio run with it is refused (exit 2)."""
    orig = ltx2_run / "run"
    overrides = [o for o in json.loads((orig / "manifest.json").read_text())["overrides"]
                 if not o.startswith("hydra.")]
    p = run_module("runner", [*overrides, "output.audio=false", f"hydra.run.dir={tmp_path / 'mute'}"], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    with_audio = {it["key"]: it for it in _items(orig)}
    for it in _items(tmp_path / "mute"):
        assert it["params"]["audio"] is False and it["params"]["audio_sample_rate"] is None
        assert not any(k.startswith("audio_") for k in it)
        assert video.audio_stream(tmp_path / "mute" / it["file"]) is None
        assert it["frames_sha256"] == with_audio[it["key"]]["frames_sha256"]
        assert it["inputs_sha256"] != with_audio[it["key"]]["inputs_sha256"]
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy)
    p = run_module("runner", [*overrides, "output.audio=false", f"run.resume={copy}"], cwd=tmp_path)
    assert p.returncode == 2 and "output.audio" in p.stdout + p.stderr, _tail(p)


# ------------------------------------------------------------------------------------------- the audio track


def test_to_pcm16_quantises_clips_and_interleaves():
    x = np.array([[0.0, 0.5, -1.0, 2.0], [1.0, -0.25, np.float32(1 / 32767), -3.0]], dtype=np.float32)
    pcm = video.to_pcm16(x)
    assert pcm.dtype == np.int16 and pcm.shape == (4, 2)
    assert pcm.tolist() == [[0, 32767], [16384, -8192], [-32767, 1], [32767, -32767]]
    with pytest.raises(ValueError, match="NaN"):
        video.to_pcm16(np.array([[np.nan, 0.0]]))
    assert video.audio_sha256(pcm) == __import__("hashlib").sha256(pcm.astype("<i2").tobytes()).hexdigest()


def test_write_video_muxes_lossless_audio_and_none_without(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    pcm = video.to_pcm16(rng.uniform(-0.9, 0.9, (2, 4001)))
    res = video.write_video(tmp_path / "a.mp4", frames, 24, "h264_lossless", audio=pcm, sample_rate=22050)
    f = res["fields"]
    assert (f["audio_sample_rate"], f["audio_samples"], f["audio_channels"], f["audio_codec"]) == (
        22050, 4001, 2, "flac")
    back, rate = video.read_audio(tmp_path / "a.mp4")
    assert rate == 22050 and np.array_equal(back, pcm) and f["audio_sha256"] == video.audio_sha256(pcm)
    assert np.array_equal(video.decode_mp4(tmp_path / "a.mp4"), frames)
    mono = video.to_pcm16(rng.uniform(-0.5, 0.5, (1, 300)))
    video.write_video(tmp_path / "m.mp4", frames, 24, "h264_lossless", audio=mono, sample_rate=8000)
    assert video.audio_stream(tmp_path / "m.mp4")["channels"] == 1
    assert np.array_equal(video.read_audio(tmp_path / "m.mp4")[0], mono)
    res = video.write_video(tmp_path / "s.mp4", frames, 24, "h264_lossless")
    assert video.audio_stream(tmp_path / "s.mp4") is None and "audio_sha256" not in res["fields"]
    assert not list(tmp_path.glob(".*"))  # no temp file (video or PCM) left behind


def test_sink_fails_an_item_whose_audio_rate_is_not_its_record(tmp_path):
    """The MP4 sink checks the decoded audio's sample rate against ``params.audio_sample_rate`` before the rename:
    a mismatch fails the item and leaves no file."""
    from models.base import VideoOutput
    from runner.core.sinks import MP4Sink

    sink = MP4Sink(tmp_path, codec="h264_lossless")
    frames = np.full((3, 32, 32, 3), 0.5, dtype=np.float32)
    audio = np.zeros((2, 100), dtype=np.float32)
    base = {"id": "x", "params": {"width": 32, "height": 32, "num_frames": 3, "fps": 8, "audio_sample_rate": 16000}}
    sink.submit({**base, "key": "ok"}, VideoOutput(frames, audio=audio, sample_rate=16000))
    sink.submit({**base, "key": "bad"}, VideoOutput(frames, audio=audio, sample_rate=8000))
    sink.close()
    recs = {r["key"]: r for r in _items(tmp_path)}
    assert recs["ok"]["status"] == "ok" and recs["ok"]["audio_sample_rate"] == 16000
    assert recs["bad"]["status"] == "failed" and "audio_sample_rate: record 16000, artifact 8000" in recs["bad"]["reason"]
    assert not (tmp_path / "videos" / "bad.mp4").exists()


def test_repro_names_audio_that_differs(tmp_path):
    """Equal frames, other audio: ``runner.repro``'s item comparison fails on the decoded audio alone."""
    from runner.tools import repro

    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    pcm = video.to_pcm16(rng.uniform(-0.5, 0.5, (2, 200)))
    other = pcm.copy()
    other[10, 0] += 1
    video.write_video(tmp_path / "o.mp4", frames, 8, "h264_lossless", audio=pcm, sample_rate=8000)
    video.write_video(tmp_path / "n.mp4", frames, 8, "h264_lossless", audio=other, sample_rate=8000)
    video.write_video(tmp_path / "s.mp4", frames, 8, "h264_lossless")
    row, notes = repro._compare_audio(tmp_path / "o.mp4", tmp_path / "n.mp4", exact=True, tolerance_db=40)
    assert notes == ["decoded audio differs (audio_sha256)"] and row["audio_psnr_db"] > 80
    assert repro._compare_audio(tmp_path / "o.mp4", tmp_path / "n.mp4", exact=False, tolerance_db=40)[1] == []
    assert repro._compare_audio(tmp_path / "o.mp4", tmp_path / "o.mp4", exact=True, tolerance_db=40)[1] == []
    assert repro._compare_audio(tmp_path / "o.mp4", tmp_path / "s.mp4", True, 40)[1] == [
        "audio stream only in the original"]


# ------------------------------------------------------------------------------------------ the family's rules


def _engine(cfg):
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    return engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=[], stage="denoise", plat=detect("cpu", None), dtype=torch.float32))


@pytest.mark.parametrize("frames,ok", [(9, True), (1, True), (11, True), (10, False), (4, False)])
def test_ltx2_frames_must_be_2k_plus_1_for_the_tiny_vae(compose, write_jsonl, frames, ok):
    """The tiny VAE's temporal factor is 2 (read from its config as AutoencoderKLLTX2Video computes it): other
    frame counts are refused, with the nearest valid ones."""
    from runner.core.dataset import DatasetError

    rows = write_jsonl([{"prompt": "a cat", "num_frames": frames}])
    eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]))
    assert eng.temporal_factor() == 2
    if ok:
        assert eng.read_rows()[0][0].num_frames == frames
    else:
        lo = (frames - 1) // 2 * 2 + 1
        with pytest.raises(DatasetError, match=rf"2k\+1.*LTX2Pipeline would round it down.*{lo} or {lo + 2}"):
            eng.read_rows()


def test_guidance_scale_null_is_refused(compose):
    """Without a guidance_scale the pipeline would apply its own (LTX-2.3) defaults while the record says null."""
    from runner.core.errors import ConfigValueError

    eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "model.generation.guidance_scale=null"]))
    with pytest.raises(ConfigValueError, match="guidance_scale=null.*fix: model.generation.guidance_scale=4.0"):
        eng.read_rows()


def test_ltx2_sizes_are_multiples_of_32(compose):
    """LTX2Pipeline.check_inputs refuses sizes off 32 whatever the VAE's factor: the size need is lcm(32, ...)."""
    from runner.core.errors import ConfigValueError

    eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "model.size_multiple=16"]))
    assert eng.size_need() == 32
    with pytest.raises(ConfigValueError, match="model.size_multiple=16.*multiples of 32"):
        eng.resolve_source()
        eng.check_source()


def test_fuse_qkv_is_refused_before_loading(compose):
    """LTX2AudioVideoAttnProcessor never reads a fused projection: optimize.fuse_qkv=true is refused at startup."""
    from runner.core.errors import ConfigValueError

    with pytest.raises(ConfigValueError, match="optimize.fuse_qkv=true.*fix: optimize.fuse_qkv=false"):
        _engine(compose(["model=tiny_ltx2", "platform=cpu", "optimize.fuse_qkv=true"])).check_config()
    _engine(compose(["model=tiny_ltx2", "platform=cpu"])).check_config()


def test_a_backend_the_audio_head_size_cannot_take_is_refused(compose):
    """The audio stream attends at ``audio_attention_head_dim``, the video at ``attention_head_dim`` (tiny: 8 both):
    a backend that takes only the video's head size is refused before loading, naming the audio head size."""
    from runner.kernels import registry as reg
    from runner.kernels.registry import Backend, DiffusersWiring, head_dim_multiple_of

    rec = Backend("attention", "HEAD8_ATTN", requires=(head_dim_multiple_of(8),),
                  diffusers=DiffusersWiring("_native_math", observed=("_native_math",)), signature=r"head8")
    with reg.registered(rec):
        eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "backend.attention=HEAD8_ATTN",
                               "model.architecture.transformer.audio_attention_head_dim=4"]))
        eng.resolve_source()
        with pytest.raises(reg.BackendUnavailableError, match=r"HEAD8_ATTN.*audio_attention_head_dim 4.*multiple of 8"):
            eng.resolve_backends()
        eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "backend.attention=HEAD8_ATTN"]))
        eng.resolve_source()
        assert eng.resolve_backends()[0]["attention"].selected


def test_ltx2_scale_and_ratios_follow_the_vae_config():
    from models.ltx2 import ltx2_scale, vae_ratios

    assert vae_ratios({"patch_size": 4, "patch_size_t": 1, "spatio_temporal_scaling": [True] * 3}) == (32, 8)
    assert vae_ratios({"spatial_compression_ratio": 64, "temporal_compression_ratio": 4}) == (64, 4)
    assert ltx2_scale({"patch_size": 1, "patch_size_t": 1, "spatio_temporal_scaling": [True]}, {}, 1) == 32
    assert ltx2_scale({"spatial_compression_ratio": 64}, {}, 1) == 64


def test_gemma_tokenizer_prepends_bos_and_pads_left_in_the_pipeline():
    """The ``gemma`` kind: Gemma's special ids (<pad> 0, <eos> 1, <bos> 2), <bos> first, nothing appended."""
    from models.ltx2 import LTX2Engine

    tok = LTX2Engine.build_tokenizers({"tokenizer": {"vocab_size": 512}})["tokenizer"]
    assert [tok.pad_token_id, tok.eos_token_id, tok.bos_token_id] == [0, 1, 2]
    ids = tok("a red fox")["input_ids"]
    assert ids[0] == 2 and 1 not in ids and tok.decode(ids[1:]).strip() == "a red fox"


def test_negative_prompt_without_guidance_is_ignored(compose, write_jsonl):
    """CFG is batched and on only with guidance_scale > 1: a negative prompt with guidance 1 would be unused."""
    from runner.core.dataset import DatasetError

    rows = write_jsonl([{"prompt": "a cat", "negative_prompt": "blurry", "guidance_scale": 1.0},
                        {"prompt": "a dog", "negative_prompt": "blurry"}])
    eng = _engine(compose(["model=tiny_ltx2", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]))
    with pytest.raises(DatasetError, match=r"rows.jsonl:1: field 'negative_prompt'.*LTX2Pipeline uses the negative") as e:
        eng.read_rows()
    assert "rows.jsonl:2" not in str(e.value)


def test_full_size_config_is_the_published_one():
    """conf/model/ltx2.yaml carries models/reference/families_configs.json's "ltx2" entry (with sources) and builds,
    on the meta device, LTX-2's 19B audio-video transformer and Gemma 3 12B."""
    import torch
    from omegaconf import OmegaConf

    from models.ltx2 import LTX2Engine, vae_ratios

    ref = json.loads((REPO_ROOT / "models" / "reference" / "families_configs.json").read_text())["ltx2"]
    conf = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "model" / "ltx2.yaml"))
    arch = conf["architecture"]
    for comp in LTX2Engine.components:
        assert arch[comp] == {k: v for k, v in ref[comp].items() if k != "class"}, comp
        assert comp in ref["sources"]
    assert ref["scheduler"]["class"] == LTX2Engine.components["scheduler"][1]
    assert conf["generation"] == ref["generation"]
    assert vae_ratios(arch["vae"]) == (32, 8) and (conf["generation"]["num_frames"] - 1) % 8 == 0
    comps = LTX2Engine.build_components(arch, device="meta", dtype=torch.bfloat16)
    n = {k: sum(p.numel() for p in v.parameters()) for k, v in comps.items() if isinstance(v, torch.nn.Module)}
    assert 18.8e9 < n["transformer"] < 19.0e9 and 12.1e9 < n["text_encoder"] < 12.3e9, n


def test_audio_enters_the_identity_only_while_off():
    """``output.audio`` keeps every earlier run's identity (absent or true: no key), and ``false`` changes it."""
    import copy

    from test_typed_config import BACKENDS, CFG, PACKAGES, PLAT

    from runner.core import resume as rs

    def ident(cfg):
        return rs.run_identity(cfg, "float32", PLAT, BACKENDS, PACKAGES)

    on, off = copy.deepcopy(CFG), copy.deepcopy(CFG)
    on["output"], off["output"] = {"audio": True}, {"audio": False}
    assert ident(on) == ident(CFG)
    assert ident(off) != ident(CFG) and ident(off)["config"]["output.audio"] is False
    # the refusal names the value (a False once showed as 'default' -> 'default')
    assert rs.semantic_diff(on, off, None, "x") == ["output.audio: 'default' -> False"]
