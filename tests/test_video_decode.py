"""The Wan video decode path (issue #41, ``models/video_decode.py``) on the CPU: the patched decoder's frames are bit
for bit diffusers' (float32 and bfloat16, several latent frames so the causal cache runs, tiled and untiled, the Wan
2.1 VAE and Wan 2.2 TI2V's residual one), each patched convolution sees the tensor ``F.pad(torch.cat(...))`` gives
(values, sizes, strides), the device ``uint8`` rule gives the runner's bytes, and ``benchmarks/decode_wan_h200.py
--smoke`` reports a bit-identical decode as such and a deliberately different one as not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from models import video_decode

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
#: Tiles small enough that the tiny decodes below run ``tiled_decode`` (2 x 3 tiles of 48 x 80 output pixels).
TILES = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
             tile_sample_stride_width=16)


def build(model: str, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    conf = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["architecture"]["vae"]
    torch.manual_seed(0)
    return AutoencoderKLWan(**conf).to(dtype).eval()


def latents(vae, dtype: torch.dtype) -> torch.Tensor:
    """4 latent frames (13 video frames) of 48 x 80 pixels, seeded."""
    scale = 16 if vae.config.patch_size else 8
    return torch.randn(1, vae.config.z_dim, 4, 48 // scale, 80 // scale,
                       generator=torch.Generator().manual_seed(1)).to(dtype)


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return vae.decode(z).sample


@pytest.fixture
def spied(monkeypatch):
    """Every padded input the patched convolutions build, checked against diffusers' ``F.pad(torch.cat(...))`` of the
    same call (values, sizes, strides, dtype), and the calls of diffusers' own forwards (the fallbacks; a causal
    convolution without padding is not counted: the patch leaves those to diffusers). Yields
    ``{"conv": [whether the call had a cache, per fast-path call], "fallback": Counter of class names}``."""
    from collections import Counter

    from diffusers.models.autoencoders import autoencoder_kl_wan as wan

    seen = {"conv": [], "fallback": Counter()}
    real = video_decode.causal_input

    def spy(conv, x, cache_x):
        buf = real(conv, x, cache_x)
        if buf is not None:
            pad = list(conv._padding)
            ref = x
            if cache_x is not None and pad[4] > 0:
                ref = torch.cat([cache_x, x], dim=2)
                pad[4] -= cache_x.shape[2]
            ref = F.pad(ref, pad)
            assert (buf.shape, buf.stride(), buf.dtype) == (ref.shape, ref.stride(), ref.dtype)
            assert torch.equal(buf, ref)
            seen["conv"].append(cache_x is not None)
        return buf

    def counted(cls):
        own = cls.forward

        def forward(self, *args, **kwargs):
            if any(getattr(self, "_padding", (1,))):  # 1x1x1 convolutions have nothing to skip
                seen["fallback"][cls.__name__] += 1
            return own(self, *args, **kwargs)
        monkeypatch.setattr(cls, "forward", forward)

    for cls in (wan.WanCausalConv3d, wan.WanUpsample, wan.WanRMS_norm):
        counted(cls)
    monkeypatch.setattr(video_decode, "causal_input", spy)
    return seen


@pytest.mark.parametrize("model", ["tiny_wan22", "tiny_wan22_ti2v"])
@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_patched_decode_is_bit_identical_to_diffusers(model, tiled, dtype, spied):
    """Patched and unpatched ``vae.decode`` of the same latents give equal tensors (``torch.equal``: every bit,
    NaN-free), through the fast paths (cached and uncached convolutions among the spied calls; diffusers' own
    forward runs only for 1x1x1 convolutions and, in float32, the RMS norm, which has no copy to skip there),
    and ``uninstall`` restores diffusers' forwards."""
    vae = build(model, dtype)
    if tiled:
        vae.enable_tiling(**TILES)
    z = latents(vae, dtype)
    plain = decode(vae, z)
    info = video_decode.install(vae)
    assert info["skipped"] == 0 and all(info["modules"].values()), info
    assert video_decode.install(vae) == info  # idempotent
    spied["fallback"].clear()
    patched = decode(vae, z)
    assert video_decode.uninstall(vae) == sum(info["modules"].values())
    assert plain.shape[2] == 13 and torch.equal(plain, patched)
    assert 0 < (plain.abs() < 1).float().mean()  # not all clamped
    assert True in spied["conv"] and False in spied["conv"]
    assert spied["fallback"]["WanCausalConv3d"] == spied["fallback"]["WanUpsample"] == 0
    assert (spied["fallback"]["WanRMS_norm"] > 0) is (dtype == torch.float32)
    assert not any("forward" in m.__dict__ for m in vae.decoder.modules())


def test_a_forward_that_rounds_otherwise_is_caught(monkeypatch):
    """The comparison above sees one rounding moved: the RMS norm's division done in bfloat16 (``x /
    denom.to(bf16)``, what a careless port would write) changes the decoded bits."""
    def sloppy(self, x):
        xf = x.float()
        denom = xf.norm(2.0, 1, keepdim=True).clamp_min(1e-12)
        return (x / denom.to(x.dtype)) * self.scale * self.gamma + self.bias

    vae = build("tiny_wan22", torch.bfloat16)
    z = latents(vae, torch.bfloat16)
    plain = decode(vae, z)
    monkeypatch.setitem(video_decode.FORWARDS, "WanRMS_norm", sloppy)
    video_decode.install(vae)
    assert not torch.equal(plain, decode(vae, z))


def _layouts(x: torch.Tensor):
    """``x`` (B, C, T, H, W) contiguous, as a (B, T, C, H, W) buffer's permuted view (what ``WanResample`` returns),
    and in ``channels_last_3d``."""
    yield "contiguous", x
    yield "permuted", x.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4)
    yield "channels_last_3d", x.contiguous(memory_format=torch.channels_last_3d)


@pytest.mark.parametrize("cached", [0, 1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 3, 5, 6), (2, 1, 1, 1, 7), (1, 3, 2, 1, 1)])
def test_causal_input_is_pad_of_cat_in_every_layout(cached, shape):
    """:func:`causal_input` equals ``F.pad(torch.cat([cache_x, x], 2), padding)`` in values, sizes, strides and dtype
    for each layout pair of ``cache_x`` and ``x`` (ATen's ``suggest_memory_format`` picks the buffer's), including
    size-1 dims where the strides are ambiguous; a 1x1x1 convolution (no padding) keeps diffusers' path."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    conv = WanCausalConv3d(shape[1], 2, 3, padding=1)
    x0 = torch.randn(shape)
    c0 = torch.randn(shape[0], shape[1], cached, *shape[3:])
    for (xn, x) in _layouts(x0):
        for (cn, c) in _layouts(c0) if cached else [("none", None)]:
            buf = video_decode.causal_input(conv, x, c)
            ref = F.pad(torch.cat([c, x], 2) if cached else x, [1, 1, 1, 1, 2 - cached, 0])
            assert buf.stride() == ref.stride() and buf.shape == ref.shape, (xn, cn)
            assert torch.equal(buf, ref), (xn, cn)
    assert video_decode.causal_input(WanCausalConv3d(shape[1], 2, 1), x0, None) is None


def runner_uint8(a: np.ndarray) -> np.ndarray:
    from runner.core.artifacts import to_uint8

    return to_uint8(np.asarray(a, dtype=np.float32))


def test_to_uint8_gives_the_runner_bytes_on_edge_values():
    """Every non-NaN bfloat16 value (what a bf16 decode yields), each rounding boundary ``(k + 0.5) / 255`` in float32
    with 4 neighbours either side, 0, 1, values just out of range and the infinities: the device rule's bytes equal
    ``runner.core.artifacts.to_uint8``'s (the PNG/MP4 bytes and ``frames_sha256``)."""
    bf16 = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16 = bf16[~torch.isnan(bf16)].numpy()
    mid = np.float32((np.arange(255) + 0.5) / 255)
    near = [mid]
    for direction in (np.inf, -np.inf):
        v = mid
        for _ in range(4):
            v = np.nextafter(v, np.float32(direction))
            near.append(v)
    edges = np.array([0.0, -0.0, 1.0, 0.5, 0.5 / 255, 254.5 / 255, -1e-7, 1 + 1e-7, 1.0000001, -0.0000001, 2.0, -5.0,
                      np.inf, -np.inf, np.finfo(np.float32).tiny, np.nextafter(np.float32(1), np.float32(0))],
                     dtype=np.float32)
    values = np.concatenate([bf16, *near, edges]).astype(np.float32)
    ours = video_decode.to_uint8(torch.from_numpy(values)).numpy()
    assert ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, runner_uint8(values))
    # the boundaries really straddle two bytes (a rule rounding half away from zero would fail here)
    assert len(set(ours[len(bf16):len(bf16) + 255 * 9].tolist())) == 256
    # bfloat16 input converts exactly as its float32 widening does
    half = torch.from_numpy(bf16).to(torch.bfloat16)
    np.testing.assert_array_equal(video_decode.to_uint8(half).numpy(), runner_uint8(bf16))


def test_video_uint8_is_the_np_path_then_the_sinks_rule():
    """A decoded batch (B, C, F, H, W) in bfloat16 with values past [-1, 1] and a NaN in item 1: :func:`video_uint8`
    gives item 0 the bytes of ``postprocess_video(output_type="np")`` then ``to_uint8_frames`` (layout (F, H, W, 3),
    same ``frames_sha256``) and the non-finite counts ``VideoOutput.nonfinite`` finds on the float32 frames."""
    from diffusers.video_processor import VideoProcessor

    from models.base import VideoOutput
    from runner.core.video import frames_sha256, to_uint8_frames

    g = torch.Generator().manual_seed(0)
    video = (torch.rand(2, 3, 5, 8, 12, generator=g) * 2.4 - 1.2).to(torch.bfloat16)
    video[1, 0, 2, 3, 4] = float("nan")
    proc = VideoProcessor(vae_scale_factor=8)
    frames, bad = video_decode.video_uint8(video, proc)
    ref = proc.postprocess_video(video, output_type="np")
    want = [VideoOutput(frames=np.asarray(a, dtype=np.float32), fps=16).nonfinite() for a in ref]
    assert bad.tolist() == want == [0, 1]
    assert frames.shape == (2, 5, 8, 12, 3) and frames.is_contiguous() and frames.dtype == torch.uint8
    base = to_uint8_frames(np.asarray(ref[0], dtype=np.float32))
    assert frames_sha256(frames[0].numpy()) == frames_sha256(base)


def test_frames_arrays_are_the_np_path_bytes_and_a_nonfinite_item_stays_float():
    """A pipeline's ``output_type="pt"`` batch (B, F, C, H, W) in bfloat16, values outside [0, 1] and a NaN in item 1:
    :func:`frames_arrays` gives item 0 as ``uint8`` (F, H, W, 3) with the bytes ``output_type="np"`` + the sinks' rule
    give (``frames_sha256`` equal), and item 1 as its float32 frames with the NaN kept, which the sink refuses
    naming the count as before (``VideoOutput.nonfinite``)."""
    from models.base import VideoOutput
    from runner.core.video import frames_sha256, to_uint8_frames

    g = torch.Generator().manual_seed(1)
    pt = (torch.rand(2, 4, 3, 6, 10, generator=g) * 1.4 - 0.2).to(torch.bfloat16)
    pt[1, 2, 0, 1, 3] = float("nan")
    got = video_decode.frames_arrays(pt)
    np_path = pt.permute(0, 1, 3, 4, 2).float().numpy()  # what postprocess_video's "np" branch hands the engine
    assert got[0].dtype == np.uint8 and got[0].shape == (4, 6, 10, 3)
    assert frames_sha256(got[0]) == frames_sha256(to_uint8_frames(np_path[0]))
    assert got[1].dtype == np.float32 and got[1].shape == (4, 6, 10, 3)
    np.testing.assert_array_equal(got[1], np_path[1])  # NaN in place (assert_array_equal treats NaN == NaN)
    assert [VideoOutput(frames=a, fps=16).nonfinite() for a in got] == [0, 1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_wan_h200", ROOT / "benchmarks" / "decode_wan_h200.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("perturb", [False, True], ids=["same", "perturbed"])
def test_the_benchmark_smoke_reports_what_it_compared(tmp_path, perturb):
    """``benchmarks/decode_wan_h200.py --smoke``: its JSON has every lane's ms, both speedups as the ratio of the
    recorded ms (diffusers over runner), the frames' sha256 per lane and ``bit_identical``: True for the patched
    decode, False when the runner lane decodes different latents (``--perturb``), which the sha256 and the raw
    decoder outputs both show; ``--channels-last`` adds its lane."""
    out = tmp_path / "decode.json"
    _bench().main(["--smoke", "--out", str(out)] + (["--perturb"] if perturb else ["--channels-last"]))
    doc = json.loads(out.read_text())
    ms = doc["ms"]
    lanes = {"vae_decode_plain", "vae_decode_exact", "diffusers", "runner"}
    assert set(ms) == (lanes if perturb else lanes | {"vae_decode_channels_last"}) and min(ms.values()) > 0
    if not perturb:  # the channels_last_3d lane: timed, and its equality to the plain decode recorded
        assert isinstance(doc["check"]["channels_last_output_identical"], bool)
        assert doc["speedup_vae_decode_channels_last"] == pytest.approx(
            ms["vae_decode_plain"] / ms["vae_decode_channels_last"], rel=1e-2)
    assert doc["speedup_decode_wan"] == pytest.approx(ms["diffusers"] / ms["runner"], rel=1e-2)
    assert doc["speedup_vae_decode"] == pytest.approx(ms["vae_decode_plain"] / ms["vae_decode_exact"], rel=1e-2)
    assert doc["after_decode_ms"]["diffusers"] == pytest.approx(ms["diffusers"] - ms["vae_decode_plain"], abs=0.02)
    check = doc["check"]
    assert check["plain_repeatable"] and check["frames_shape"] == [9, 32, 48, 3]
    assert check["saturated_fraction"] < 0.5
    shas = check["frames_sha256"]
    assert len(shas["diffusers"]) == len(shas["runner"]) == 1
    assert all(len(s) == 64 and int(s, 16) >= 0 for s in shas["diffusers"] + shas["runner"])
    assert doc["bit_identical"] is (not perturb)
    assert (shas["diffusers"] == shas["runner"]) is (not perturb)
    assert check["decoder_output_identical"] is (not perturb)
    assert doc["perturbed"] is perturb and doc["device"] == "cpu" and doc["latents"] == [1, 16, 3, 4, 6]
    assert doc["patch"]["modules"]["WanCausalConv3d"] > 0


# ------------------------------------------------------------------------------------- the run's decode path
def _frames(run, item):
    return np.load(run.run_dir / item["file"].replace(".mp4", ".frames.npz"))["frames"]


@pytest.fixture(scope="module")
def wan_runs(tmp_path_factory):
    """tiny_wan, 5 frames (2 latent frames: the causal cache runs), the fast decode (default) and diffusers'."""
    from _helpers import execute

    args = ["model=tiny_wan", "dataset.limit=2", "model.generation.num_inference_steps=2", "output.video_frames=true",
            "model.generation.num_frames=5"]
    root = tmp_path_factory.mktemp("fastdecode")
    return (execute(root / "fast", args), execute(root / "plain", args + ["optimize.fast_vae_decode=false"]))


def test_a_wan_run_decodes_with_the_fast_path_and_the_same_bytes(wan_runs):
    """The default Wan run installs the decode path, observes its modules' fast calls (not just the patch), and
    writes frames equal byte for byte to diffusers' decode (``optimize.fast_vae_decode=false``)."""
    fast, plain = wan_runs
    for run in wan_runs:
        assert run.code == 0 and run.manifest["evidence"]["verdict"] == "verified", run.manifest["evidence"]
    sec = fast.manifest["vae_decode"]
    assert sec["fast"] is True and sec["skipped"] == 0
    assert all(n > 0 for n in sec["modules"].values()), sec  # each kind of module patched
    calls = sec["fast_calls"]
    assert calls["WanCausalConv3d"] > 0 and calls["WanUpsample"] > 0  # observed running, not only patched
    assert calls["WanRMS_norm"] == 0  # float32 on the CPU: the norm keeps diffusers' forward (fast only for bf16)
    assert plain.manifest["vae_decode"] == {"fast": False, "why": "optimize.fast_vae_decode=false"}
    assert len(fast.items) == len(plain.items) == 2
    for a, b in zip(fast.items, plain.items):
        assert a["status"] == b["status"] == "ok" and a["key"] == b["key"]
        fa, fb = _frames(fast, a), _frames(plain, b)
        assert fa.shape == fb.shape and fa.shape[0] == 5 and np.array_equal(fa, fb)
        assert a["frames_sha256"] == b["frames_sha256"] and len(a["frames_sha256"]) == 64
    assert not np.array_equal(_frames(fast, fast.items[0]), _frames(fast, fast.items[1]))  # two different videos


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_video_run_writes_the_frames_of_diffusers_np_output(tmp_path, platform):
    """The engine calls a video pipeline with ``output_type="pt"`` and converts the frames to ``uint8`` where they
    were decoded (on the GPU: there); what it writes must be what ``output_type="np"`` and the sinks' host rule
    give. The loaded pipeline is wrapped: each call the run makes is made again with ``output_type="np"`` and fresh
    generators of the same seeds, and the written frames of every item equal those of the second call."""
    if platform == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is visible on this machine (torch.cuda.is_available() is False)")
    from _helpers import execute
    from runner.core.video import to_uint8_frames

    seen = []

    def on_loaded(engine):
        pipe = engine.pipe
        call = type(pipe).__call__

        class Twice(type(pipe)):
            def __call__(self, *a, **kw):
                out = call(self, *a, **kw)
                if kw.get("output_type") == "pt":
                    gens = [torch.Generator(device="cpu").manual_seed(g.initial_seed()) for g in kw["generator"]]
                    again = call(self, *a, **{**kw, "generator": gens, "output_type": "np"})
                    seen.append((kw["output_type"], list(again.frames)))
                return out

        pipe.__class__ = Twice

    args = ["model=tiny_wan", "dataset.limit=2", "batch_size=2", "output.video_frames=true", f"platform={platform}",
            "model.generation.num_inference_steps=2", "model.generation.num_frames=5",
            "evidence.strict=false"]  # the second call's forwards are not the run's
    run = execute(tmp_path / "run", args, on_loaded=on_loaded)
    assert run.code == 0 and [r["status"] for r in run.items] == ["ok", "ok"]
    assert [t for t, _ in seen] == ["pt"] and len(seen[0][1]) == 2  # one call of both items, made with "pt"
    for item, ref in zip(run.items, seen[0][1]):
        assert np.array_equal(_frames(run, item), to_uint8_frames(np.asarray(ref, dtype=np.float32)))


def test_the_fast_decode_is_recorded_as_ignored_on_another_vae(tmp_path):
    from _helpers import execute

    run = execute(tmp_path / "flux", ["model=tiny_flux", "dataset.limit=1", "model.generation.num_inference_steps=2"])
    assert run.code == 0
    sec = run.manifest["vae_decode"]
    assert sec["fast"] is False and "AutoencoderKL has no fast decode path" in sec["ignored"]


def test_a_decode_path_that_never_runs_is_a_mismatch():
    """The evidence counts the fast calls, not the patch: installed but never taking its path (every call fell back)
    after a pipeline call is a mismatch; before any call it is none."""
    from types import SimpleNamespace

    vae = build("tiny_wan", torch.float32)
    engine = SimpleNamespace(ctx=SimpleNamespace(run=SimpleNamespace(optimize=SimpleNamespace(fast_vae_decode=True))),
                             pipe=SimpleNamespace(vae=vae))
    p = video_decode.FastDecodePass(engine)
    p.install({})
    section = {}
    assert p.evidence(section) == [] and section["vae_decode"]["pipeline_calls"] == 0
    p.after_call([], None)
    assert p.evidence({}) == ["optimize.fast_vae_decode: the Wan decode path was installed but no patched module "
                              "took its fast path"]
    with torch.no_grad():
        vae.decode(torch.randn(1, vae.config.z_dim, 2, 4, 6))
    assert p.evidence({}) == []
    p.close()
    assert video_decode.fast_calls(vae) == {k: 0 for k in video_decode.FORWARDS}
    assert all("forward" not in m.__dict__ for m in vae.decoder.modules())


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["tiny_wan22", "tiny_wan22_ti2v"])
@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiled"])
def test_the_patched_decode_is_bit_identical_on_the_gpu(model, tiled):
    """On the GPU in bfloat16 (the dtype the runner gives a Wan VAE there): patched and unpatched decodes equal bit
    for bit (cuDNN is given inputs of equal sizes, strides and dtype), every kind of patched module taking its fast
    path, and the device uint8 bytes equal to the runner's host rule on the plain decode's float32 frames."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is visible on this machine (torch.cuda.is_available() is False)")
    from diffusers.video_processor import VideoProcessor

    from runner.core.artifacts import to_uint8 as host_uint8

    vae = build(model, torch.bfloat16).to("cuda")
    if tiled:
        vae.enable_tiling(**TILES)
    z = latents(vae, torch.bfloat16).to("cuda")
    plain = decode(vae, z)
    again = decode(vae, z)
    assert torch.equal(plain, again)  # the check means something: the plain decode is deterministic here
    video_decode.install(vae)
    patched = decode(vae, z)
    calls = video_decode.fast_calls(vae)
    video_decode.uninstall(vae)
    assert torch.equal(plain, patched)
    assert all(n > 0 for n in calls.values()), calls
    proc = VideoProcessor(vae_scale_factor=8)
    frames, nonfinite = video_decode.video_uint8(patched, proc)
    host = proc.postprocess_video(plain, output_type="np")  # (B, F, H, W, C) float32 on the host
    assert nonfinite.tolist() == [0] and np.array_equal(frames.cpu().numpy(), host_uint8(host))


@pytest.mark.cuda
def test_a_wan_run_on_the_gpu_writes_the_plain_decodes_bytes(tmp_path):
    """tiny_wan on the GPU (bfloat16): the default run (fast decode) and ``optimize.fast_vae_decode=false`` write the
    same frames, the fast run's RMS norms (bfloat16) and convolutions observed on their fast paths."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is visible on this machine (torch.cuda.is_available() is False)")
    from _helpers import execute

    args = ["model=tiny_wan", "platform=cuda", "dataset.limit=2", "model.generation.num_inference_steps=2",
            "output.video_frames=true", "model.generation.num_frames=5"]
    fast = execute(tmp_path / "fast", args)
    plain = execute(tmp_path / "plain", args + ["optimize.fast_vae_decode=false"])
    for run in (fast, plain):
        assert run.code == 0 and run.manifest["evidence"]["verdict"] == "verified", run.manifest["evidence"]
    calls = fast.manifest["vae_decode"]["fast_calls"]
    assert calls["WanRMS_norm"] > 0 and calls["WanCausalConv3d"] > 0, calls
    for a, b in zip(fast.items, plain.items):
        assert a["frames_sha256"] == b["frames_sha256"]
        assert np.array_equal(_frames(fast, a), _frames(plain, b))
