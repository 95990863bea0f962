"""Model families on the generic diffusers engine (``models.pipelines``): tiny SD3.5, Qwen-Image, Wan and HiDream-I1
end to end on CPU (evidence, resume, repro, sweep report), and what every snapshot and row is checked against before
loading: the pipeline class and components of the snapshot, the pipeline's call arguments, the families' silent rules
(Wan's 4k+1 frames, sequence ceilings), Hub ids resolved in the local Hugging Face cache. HiDream's own rules and
its MoE backends: tests/test_hidream.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_report import _tail, run_module

from models.registry import family_names
from _helpers import import_extra  # noqa: E402

#: the tiny model of every registered family but FLUX (the default model, covered everywhere else)
FAMILIES = [f"tiny_{name}" for name in family_names() if name != "flux"]


@pytest.fixture(scope="module")
def family_sweep(tmp_path_factory) -> Path:
    """One sweep over the tiny families (2 rows each, TORCH_SDPA, CPU), with negative prompts and guidance so
    that every family's guidance branch runs."""
    root = tmp_path_factory.mktemp("family_sweep")
    rows = root / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "prompt": "a red cube on a table", "negative_prompt": "blurry", "seed": 1},
        {"id": "b", "prompt": "a blue sphere in the sky", "seed": 2}]))
    p = run_module("runner", ["-m", f"model={','.join(FAMILIES)}", "backend.attention=TORCH_SDPA", "platform=cpu",
                              "dataset=jsonl", "dataset.on_ignored=record", f"dataset.path={rows}", f"hydra.sweep.dir={root / 'sweep'}"], cwd=root)
    assert p.returncode == 0, _tail(p)
    return root / "sweep"


def _job(sweep: Path, model: str) -> Path:
    for d in sorted(sweep.iterdir()):
        if (d / "manifest.json").is_file() and json.loads((d / "manifest.json").read_text())["model"]["name"] == model:
            return d
    raise AssertionError(f"no job of {model} in {sweep}")


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILIES)
def test_family_runs_with_verified_evidence(family_sweep, model):
    d = _job(family_sweep, model)
    man = json.loads((d / "manifest.json").read_text())
    assert man["evidence"]["verdict"] == "verified", man["evidence"]["mismatches"]
    st = man["evidence"]["stages"]["denoise"]
    # the family's forward rule was checked against what ran: SD3 batches CFG (1 forward/step), Qwen-Image's true
    # CFG (row a has a negative prompt, true_cfg_scale defaults to 1 -> not applied), Wan's unbatched CFG (2) and
    # HiDream's and LTX-2's batched CFG (1)
    assert st["denoiser_forwards"] == st["expected_forwards"] > 0
    assert st["checks"] == {"forward_count": "verified"}
    # FLUX.2-dev's guidance embedding (1), klein's CFG at the default guidance 4 (2), Z-Image's batched CFG (1),
    # HunyuanVideo-1.5: the guider's separate forward (2)
    per_step = {"tiny_sd3": 1, "tiny_qwen_image": 1, "tiny_wan": 2, "tiny_hidream": 1, "tiny_ltx2": 1,
                "tiny_flux2": 1, "tiny_flux2_klein": 2, "tiny_zimage": 1, "tiny_hunyuanvideo15": 2}[model]
    steps = man["items"]["ok"] if isinstance(man.get("items"), dict) else None
    assert st["expected_forwards"] == per_step * 4 * 2, (st, steps)
    layers = st["attention"]["layers"]
    assert layers and all(l["ok"] and l["observed"] == {"TORCH_SDPA": l["calls"]} and l["calls"] > 0 for l in layers)
    if model in ("tiny_wan", "tiny_ltx2"):  # self- and cross-attention are separate roles
        assert {l["role"] for l in layers} == {"self", "cross"}
    if model == "tiny_hidream":  # dual- and single-stream attention; MoE blocks observed (backend.moe auto: TORCH)
        assert {l["role"] for l in layers} == {"joint", "single"}
        assert st["moe"]["calls"] == {"TORCH": st["moe"]["sites"] * st["denoiser_forwards"]}
    items = [json.loads(x) for x in (d / "items.jsonl").read_text().splitlines()]
    assert [i["status"] for i in items] == ["ok", "ok"]
    for it in items:
        assert (d / it["file"]).is_file()
        assert it["file"].endswith(".mp4" if model in ("tiny_wan", "tiny_ltx2", "tiny_hunyuanvideo15") else ".png")


@pytest.mark.slow
def test_qwen_image_true_cfg_doubles_the_forwards(run_job, write_jsonl):
    """Qwen-Image's true CFG (a negative prompt and true_cfg_scale > 1): two transformer forwards per step, checked
    against what ran; the record says the scale applied."""
    rows = write_jsonl([{"id": "a", "prompt": "a red cube", "negative_prompt": " ", "seed": 1}])
    r = run_job(["model=tiny_qwen_image", "model.generation.true_cfg_scale=4", "dataset=jsonl",
                 f"dataset.path={rows}"])
    assert r.code == 0
    st = r.manifest["evidence"]["stages"]["denoise"]
    assert r.manifest["evidence"]["verdict"] == "verified"
    assert st["denoiser_forwards"] == st["expected_forwards"] == 2 * 4
    assert r.items[0]["params"]["true_cfg_scale"] == 4.0


def test_true_cfg_scale_on_a_pipeline_without_it_is_refused(compose):
    """SD3 and Wan take no true_cfg_scale (their guidance is guidance_scale): a value > 1 would be silently unused."""
    from runner.core.errors import ConfigValueError

    for model in ("tiny_sd3", "tiny_wan"):
        cfg = compose([f"model={model}", "platform=cpu", "model.generation.true_cfg_scale=4"])
        with pytest.raises(ConfigValueError, match="true_cfg_scale=4.0 is ignored.*takes no true_cfg_scale"):
            _engine(cfg).read_rows()


@pytest.mark.slow
def test_family_sweep_report_lists_every_family(family_sweep):
    html = (family_sweep / "report.html").read_text()
    for model in FAMILIES:
        assert model in html


#: families whose own module reproduces and resumes their run, asserting more than this test does: LTX-2
#: (tests/test_ltx2.py::test_tiny_ltx2_resume_and_repro, the decoded audio too) and HunyuanVideo-1.5
#: (tests/test_hunyuanvideo15.py::test_repro_and_resume, the same checks on a guidance-1 row and a 48x32 one)
REPRO_ELSEWHERE = {"tiny_ltx2", "tiny_hunyuanvideo15"}


def test_repro_elsewhere_is_still_covered():
    """The families left out of :func:`test_family_repro_and_resume` are still reproduced and resumed."""
    here = Path(__file__).parent
    assert REPRO_ELSEWHERE < set(FAMILIES)
    assert "def test_tiny_ltx2_resume_and_repro(" in (here / "test_ltx2.py").read_text()
    assert "def test_repro_and_resume(" in (here / "test_hunyuanvideo15.py").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("model", [m for m in FAMILIES if m not in REPRO_ELSEWHERE])
def test_family_repro_and_resume(family_sweep, model, tmp_path):
    orig = _job(family_sweep, model)
    p = run_module("runner.tools.repro", [orig, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    check = json.loads((tmp_path / "rerun" / "repro_check.json").read_text())
    assert check["ok"] and check["problems"] == [], check
    assert [r["verdict"] for r in check["items"]] == ["ok", "ok"]
    # resume into a copy: every item is reused, nothing regenerated
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy)
    before = {f.name: f.read_bytes() for f in copy.rglob("*") if f.suffix in (".png", ".mp4")}
    overrides = json.loads((orig / "manifest.json").read_text())["overrides"]
    p = run_module("runner", [*[o for o in overrides if not o.startswith("hydra.")], f"run.resume={copy}"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    man = json.loads((copy / "manifest.json").read_text())
    assert man["resumed_from"]["reused_items"] == 2
    assert {f.name: f.read_bytes() for f in copy.rglob("*") if f.suffix in (".png", ".mp4")} == before


# ------------------------------------------------------------------------------------------ refusals at startup


def _fake_snapshot(root: Path, class_name: str, comps: dict) -> Path:
    root.mkdir(parents=True)
    index = {"_class_name": class_name, "_diffusers_version": "0.30.0"}
    for comp, (lib, cls) in comps.items():
        index[comp] = [lib, cls]
        (root / comp).mkdir()
        (root / comp / "config.json").write_text("{}")
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def _run_cli(args, tmp_path, env=None):
    from test_report import subprocess_env

    return subprocess.run([sys.executable, "-m", "runner", "platform=cpu", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env or subprocess_env())


@pytest.mark.parametrize("model", ["flux", "tiny_sd3", "tiny_wan"])
def test_snapshot_of_another_pipeline_is_refused_naming_both(model, tmp_path):
    """``model=flux model.path=<an SDXL snapshot>`` crashed with FileNotFoundError; now exit 2 naming the pipeline
    expected and the one found, before anything loads."""
    snap = _fake_snapshot(tmp_path / "sdxl", "StableDiffusionXLPipeline", {
        "unet": ("diffusers", "UNet2DConditionModel"), "vae": ("diffusers", "AutoencoderKL"),
        "text_encoder": ("transformers", "CLIPTextModel"), "text_encoder_2": ("transformers",
                                                                             "CLIPTextModelWithProjection")})
    p = _run_cli([f"model={model}", f"model.path={snap}"], tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "StableDiffusionXLPipeline" in out and "Traceback" not in out
    expected = {"flux": "FluxPipeline", "tiny_sd3": "StableDiffusion3Pipeline", "tiny_wan": "WanPipeline"}[model]
    assert expected in out and "unet: UNet2DConditionModel" in out


def test_snapshot_of_a_known_family_names_the_adapter(tmp_path, tiny_snapshot):
    """A FLUX snapshot given to the SD3 model config: refused, and the fix names model.engine=flux."""
    p = _run_cli(["model=tiny_sd3", f"model.path={tiny_snapshot}"], tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "found FluxPipeline" in out and "model.engine=flux" in out


def test_generic_adapter_refuses_a_transformer_without_the_dispatcher(compose, tmp_path):
    """``model.engine=diffusers`` on an SD3 snapshot: diffusers' SD3 attention does not call the dispatcher (the sd3
    family routes it), so the generic engine refuses any attention backend, naming the model and the class."""
    from models.base import StageContext
    from models.pipelines import PipelineEngine
    from runner.core.errors import ConfigValueError
    from runner.core.platform import detect

    snap = _fake_snapshot(tmp_path / "sd3", "StableDiffusion3Pipeline", {
        "transformer": ("diffusers", "SD3Transformer2DModel"), "vae": ("diffusers", "AutoencoderKL")})
    cfg = compose(["model=tiny_flux", "model.engine=diffusers", f"model.path={snap}", "platform=cpu"])
    import torch

    eng = PipelineEngine(StageContext(cfg=cfg, overrides=[], stage="denoise", plat=detect(cfg.platform.name, cfg.platform.device), dtype=torch.float32))
    eng.resolve_source()
    assert eng.pipeline_name() == "StableDiffusion3Pipeline"
    with pytest.raises(ConfigValueError, match="SD3Transformer2DModel.*does not call diffusers' attention dispatcher"):
        eng.resolve_backends()


@pytest.mark.slow
def test_generic_adapter_runs_a_flux_snapshot(run_job, tiny_snapshot):
    """``model.engine=diffusers``: the pipeline class comes from the snapshot; attention call sites are observed,
    and without a forward-count rule that check (and so the verdict) is ``limited``, never ``verified``; the run
    still completes (exit 0)."""
    r = run_job(["model=tiny_flux", "model.engine=diffusers", f"model.path={tiny_snapshot}", "dataset.limit=1"])
    assert r.code == 0
    st = r.manifest["evidence"]["stages"]["denoise"]
    assert r.manifest["evidence"]["verdict"] == "limited" and r.manifest["status"] == "completed"
    assert st["checks"] == {"forward_count": "limited"}
    assert st["expected_forwards"] is None and st["denoiser_forwards"] == 4
    import_extra("validate", "jsonschema")
    from runner.tools.validate import validate_run_dir

    assert validate_run_dir(r.run_dir) == []  # the manifest schema knows the limited verdict (it did not)


def test_row_field_the_pipeline_does_not_take_is_refused(tmp_path, write_jsonl):
    """``num_frames`` on an image model: FluxPipeline.__call__ has no such argument; refused naming the field, the
    row and the pipeline."""
    rows = write_jsonl([{"prompt": "a cat", "num_frames": 9}])
    p = _run_cli(["model=tiny_flux", "dataset=jsonl", f"dataset.path={rows}"], tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "num_frames=9" in out and "FluxPipeline" in out and f"{rows}:1" in out and "Traceback" not in out


@pytest.mark.parametrize("where", ["row", "default"])
def test_fps_on_an_image_model_is_refused(compose, write_jsonl, where):
    """fps feeds the video sink only: on an image model it was accepted and silently dropped (exit 0)."""
    from runner.core.errors import ConfigValueError

    rows = write_jsonl([{"id": "a", "prompt": "x", **({"fps": 12} if where == "row" else {})}])
    ov = ["model=tiny_sd3", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]
    if where == "default":
        ov.append("model.generation.fps=12")
    with pytest.raises(ConfigValueError, match="fps=12 .*writes images, and fps applies to video output only"):
        _engine(compose(ov)).read_rows()


def test_generic_adapter_refuses_a_video_pipeline(compose, tmp_path):
    """model.engine=diffusers on a Wan snapshot loaded and then failed every item (the pipeline returns frames):
    refused at startup, naming the video family's adapter."""
    from runner.core.errors import ConfigValueError

    snap = _fake_snapshot(tmp_path / "wan", "WanPipeline", {
        "transformer": ("diffusers", "WanTransformer3DModel"), "vae": ("diffusers", "AutoencoderKLWan")})
    cfg = compose(["model=tiny_wan", "model.engine=diffusers", f"model.path={snap}", "platform=cpu",
                   "model.generation.num_frames=null", "model.generation.fps=null"])
    eng = _engine(cfg)
    eng.resolve_source()
    with pytest.raises(ConfigValueError, match="WanPipeline generates video.*model.engine=wan"):
        eng.check_rows([], "rows")


@pytest.mark.parametrize("frames,ok", [(9, True), (13, True), (1, True), (10, False), (8, False), (0, False)])
def test_wan_frames_must_be_4k_plus_1(compose, tmp_path, write_jsonl, frames, ok):
    """WanPipeline rounds num_frames down to 4k+1 with a warning (the video would be shorter than its record);
    the runner refuses it at startup with the nearest valid counts."""
    from runner.core.dataset import DatasetError
    from runner.app.stages import build_engines  # noqa: F401  (the engines the loop builds)

    rows = write_jsonl([{"prompt": "a cat", "num_frames": frames}])
    cfg = compose(["model=tiny_wan", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"])
    eng = _engine(cfg)
    if ok:
        got, _ = eng.read_rows()
        assert got[0].num_frames == frames
    else:
        with pytest.raises(DatasetError, match="num_frames" if frames == 0 else r"4k\+1"):
            eng.read_rows()


def test_wan_frame_fix_stays_within_the_rows_range(compose, tmp_path, write_jsonl):
    """New-user report: num_frames=100000 on Wan was told 'fix: num_frames=99997 or 100001', and 100001 is refused by
    the rows' range (1..100000): the fix offers only counts the rows accept."""
    from runner.core.dataset import MAX_FRAMES, DatasetError

    rows = write_jsonl([{"prompt": "a cat", "num_frames": MAX_FRAMES}, {"prompt": "a dog", "num_frames": 6}])
    eng = _engine(compose(["model=tiny_wan", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]))
    with pytest.raises(DatasetError) as e:
        eng.read_rows()
    assert [p.rsplit("fix: ", 1)[1] for p in e.value.problems] == ["num_frames=99997", "num_frames=5 or 9"]


def _engine(cfg):
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    cls = engine_class(cfg.model.engine)
    return cls(StageContext(cfg=cfg, overrides=[], stage="denoise", plat=detect(cfg.platform.name, cfg.platform.device),
                            dtype=torch.float32))


def test_wan_default_frames_refused_naming_the_config_key(compose):
    from runner.core.errors import ConfigValueError

    cfg = compose(["model=tiny_wan", "platform=cpu", "model.generation.num_frames=10"])
    with pytest.raises(ConfigValueError, match=r"model.generation.num_frames=10 is not 4k\+1.*num_frames=9"):
        _engine(cfg).read_rows()


def test_sd3_negative_prompt_without_guidance_is_ignored_per_row(compose, tmp_path, write_jsonl):
    """SD3 applies a negative prompt only with guidance_scale > 1: a row with guidance 1 and a negative prompt is
    refused (on_ignored=error) naming that row only; with on_ignored=record the other row keeps its prompt."""
    from runner.core.dataset import DatasetError

    rows = write_jsonl([{"id": "g1", "prompt": "a cat", "negative_prompt": "dog", "guidance_scale": 1.0},
                        {"id": "g4", "prompt": "a cat", "negative_prompt": "dog", "guidance_scale": 4.0}])
    base = ["model=tiny_sd3", "platform=cpu", "dataset=jsonl", f"dataset.path={rows}"]
    with pytest.raises(DatasetError) as e:
        _engine(compose(base)).read_rows()
    assert len(e.value.problems) == 1 and ":1:" in e.value.problems[0]
    got, _ = _engine(compose([*base, "dataset.on_ignored=record"])).read_rows()
    assert got[0].negative_prompt is None and got[0].ignored["negative_prompt"]["value"] == "dog"
    assert got[1].negative_prompt == "dog" and not got[1].ignored


@pytest.mark.parametrize("model,limit", [("tiny_sd3", 512), ("tiny_qwen_image", 1024), ("tiny_flux", 512),
                                         ("tiny_wan", 512)])
def test_sequence_ceiling_of_each_pipeline(compose, model, limit):
    from runner.core.errors import ConfigValueError

    cfg = compose([f"model={model}", "platform=cpu", f"model.generation.max_sequence_length={limit + 1}"])
    eng = _engine(cfg)
    with pytest.raises(ConfigValueError, match=f"exceeds {limit}"):
        eng.prepare()


def test_qwen_tokenizer_drops_exactly_the_template():
    """QwenImagePipeline drops the first 34 tokens of its chat template; the locally built Qwen2 tokenizer splits the
    template's fixed text into exactly 34, so the encoder's kept tokens are the prompt's (plus the closing 5)."""
    from models.qwen_image import TEMPLATE, TEMPLATE_DROP, QwenImageEngine

    tok = QwenImageEngine.build_tokenizers({"tokenizer": {"vocab_size": 1024}})["tokenizer"]
    prefix = TEMPLATE.split("{}")[0]
    assert len(tok(prefix)["input_ids"]) == TEMPLATE_DROP
    ids = tok(TEMPLATE.format("a red cube"))["input_ids"]
    assert tok.decode(ids[TEMPLATE_DROP:]).startswith("a red cube")


# ---------------------------------------------------------------------------------------------- Hub ids


@pytest.mark.slow
def test_hub_id_resolves_in_the_local_cache(run_job, tiny_snapshot, tmp_path, monkeypatch):
    """``model.path=<org>/<name>``: resolved in HF_HOME's hub cache (the real layout: blobs, snapshots/<commit>
    symlinks, refs/main), recorded with its commit; absent -> exit 2 naming the cache and the download command."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--runner-test--tiny-flux"
    snap = repo / "snapshots" / commit
    for f in sorted(tiny_snapshot.rglob("*")):
        if f.is_file():
            import hashlib

            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, blob)
            link = snap / f.relative_to(tiny_snapshot)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../" * (len(f.relative_to(tiny_snapshot).parts) + 1)) / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    r = run_job(["model=flux", "model.path=runner-test/tiny-flux", "model.generation.width=128",
                 "model.generation.height=128", "model.generation.num_inference_steps=2",
                 "model.generation.max_sequence_length=64", "dataset.limit=1"])
    assert r.code == 0
    src = r.manifest["model"]["source"]
    assert src["hub"]["repo_id"] == "runner-test/tiny-flux" and src["hub"]["revision"] == commit
    assert src["files"] and all(len(v) == 64 for v in src["files"].values())


def test_hub_id_missing_names_the_cache_and_the_command(tmp_path):
    from test_report import subprocess_env

    env = {**subprocess_env(), "HF_HOME": str(tmp_path / "empty-hf")}
    env.pop("HF_HUB_CACHE", None)
    p = _run_cli(["model=flux", "model.path=runner-test/not-there"], tmp_path, env=env)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "runner-test/not-there" in out and str(tmp_path / "empty-hf") in out and "hf download" in out


@pytest.mark.slow
def test_second_job_takes_weight_digests_from_the_cache(run_job, tiny_snapshot):
    """Weight hashing: the first job computes every digest of the files the pipeline loads, the second takes them
    all from the digest cache (keyed by path, size, mtime), and the manifest says which."""
    a = run_job(["model=tiny_flux", f"model.path={tiny_snapshot}", "dataset.limit=1"])
    b = run_job(["model=tiny_flux", f"model.path={tiny_snapshot}", "dataset.limit=1"])
    ha, hb = a.manifest["model"]["source"]["hashing"], b.manifest["model"]["source"]["hashing"]
    files = sorted(a.manifest["model"]["source"]["files"])
    assert sorted(ha["computed"]) == files or sorted(ha["cached"]) == files  # a session cache may hold them
    assert sorted(hb["cached"]) == files and hb["computed"] == []
    assert a.manifest["model"]["source"]["files"] == b.manifest["model"]["source"]["files"]


@pytest.mark.parametrize("model", [f"tiny_{name}" for name in family_names()])
def test_meta_build_leaves_no_library_tensor_on_meta(model, tmp_path):
    """The memory check builds the architecture on the meta device; classes imported lazily inside that device
    context created their module-level tensors on meta (diffusers' ``mag_cache.FLUX_MAG_RATIOS``), which broke every
    later MagCache run in the process. A fresh process builds each family on meta, then no tensor held by a loaded
    diffusers/transformers module may live on meta."""
    code = f"""
import sys, torch
from omegaconf import OmegaConf
from models.registry import engine_class
cfg = OmegaConf.load("conf/model/{model}.yaml")
eng = engine_class(str(cfg.engine))
eng.build_components(OmegaConf.to_container(cfg.architecture, resolve=True), device="meta", dtype=torch.bfloat16)
bad = [f"{{n}}.{{k}}" for n, m in list(sys.modules.items()) if n.split(".")[0] in ("diffusers", "transformers")
       for k, v in list(vars(m).items()) if isinstance(v, torch.Tensor) and v.device.type == "meta"]
print("META", bad)
sys.exit(1 if bad else 0)
"""
    from test_report import subprocess_env

    repo = Path(__file__).resolve().parent.parent
    env = {**subprocess_env(), "PYTHONPATH": str(repo)}
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]


# ------------------------------------------------------------------------------------------- on a CUDA GPU


# Each family on the GPU with its kernels named in the evidence: tests/test_gpu_e2e.py::test_family_on_gpu_verified_with_device_kernels.


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("fused", [False, True])
def test_sd3_dispatch_processor_matches_diffusers(device, fused):
    """SD3DispatchAttnProcessor (SD3's joint attention through diffusers' dispatcher) against diffusers' own
    JointAttnProcessor2_0 / FusedJointAttnProcessor2_0 on the same weights: the same outputs (fp32 on the CPU,
    within bf16 rounding on the GPU), with a dual-attention block, and with fused QKV projections."""
    import torch
    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention_processor import FusedJointAttnProcessor2_0, JointAttnProcessor2_0

    from models.sd3 import SD3DispatchAttnProcessor

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    tr = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=32,
                               num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=128,
                               pooled_projection_dim=32, out_channels=16, pos_embed_max_size=32,
                               # diffusers' fused processor has no dual-attention path and skips qk_norm (SD3.5's
                               # norm_q/norm_k): compared on a model without them
                               qk_norm=None if fused else "rms_norm",
                               dual_attention_layers=() if fused else (0,)).to(device, dtype).eval()
    g = torch.Generator().manual_seed(1)
    kw = dict(hidden_states=torch.randn(2, 16, 16, 16, generator=g).to(device, dtype),
              encoder_hidden_states=torch.randn(2, 12, 64, generator=g).to(device, dtype),
              pooled_projections=torch.randn(2, 32, generator=g).to(device, dtype),
              timestep=torch.tensor([500.0, 500.0], device=device), return_dict=False)
    with torch.inference_mode():
        if fused:
            for m in tr.modules():
                if hasattr(m, "fuse_projections") and hasattr(m, "to_q"):
                    m.fuse_projections()
        tr.set_attn_processor(FusedJointAttnProcessor2_0() if fused else JointAttnProcessor2_0())
        ref = tr(**kw)[0].float()
        tr.set_attn_processor(SD3DispatchAttnProcessor())
        ours = tr(**kw)[0].float()
    tol = 1e-5 if device == "cpu" else 2e-2
    assert (ours - ref).abs().max() <= tol * ref.abs().max(), float((ours - ref).abs().max())


# --------------------------------------------------------------------------- embedded snapshots under several ranks
def _tiny_flux_arch():
    from omegaconf import OmegaConf

    from _helpers import compose

    return OmegaConf.to_container(compose(["model=tiny_flux", "platform=cpu"]).model.architecture, resolve=True)


def test_embedded_snapshot_missing_weights_is_never_committed(tmp_path, monkeypatch):
    """transformers 5's ``save_pretrained`` writes weights on rank 0 only: a build whose text encoders came out
    without weights (transformers told it is rank 1) raises naming them, and no cache entry exists afterwards (found
    by the torchrun twin of tests/test_gpu_e2e.py: a cold-cache run committed rank 1's copy, 2 times in 3)."""
    mixin = pytest.importorskip("transformers.distributed.mixin")
    from models.flux import embedded_snapshot
    from models.pipelines import embedded_target

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    arch = _tiny_flux_arch()
    with pytest.raises(RuntimeError, match=r"without weights in \['text_encoder', 'text_encoder_2'\]"):
        embedded_snapshot("tiny_flux", arch, str(tmp_path))
    target = embedded_target("tiny_flux", arch, str(tmp_path))
    assert not target.exists() and not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


def test_embedded_snapshot_rebuilds_an_incomplete_entry_and_other_ranks_wait(tmp_path, monkeypatch):
    """An entry without a component's weights (left by an older runner) is rebuilt, not loaded; a process of rank
    != 0 never builds: it returns a complete entry, and without one it waits, then fails naming the wait."""
    from models.flux import embedded_snapshot
    from models.pipelines import missing_weights

    arch = _tiny_flux_arch()
    snap = embedded_snapshot("tiny_flux", arch, str(tmp_path))
    assert missing_weights(snap) == []
    for f in (snap / "text_encoder").glob("*.safetensors"):
        f.unlink()
    assert missing_weights(snap) == ["text_encoder"]
    assert embedded_snapshot("tiny_flux", arch, str(tmp_path)) == snap and missing_weights(snap) == []

    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert embedded_snapshot("tiny_flux", arch, str(tmp_path)) == snap  # complete: rank 1 just returns it
    for f in (snap / "vae").glob("*.safetensors"):
        f.unlink()
    monkeypatch.setenv("RUNNER_SNAPSHOT_WAIT_S", "1")
    with pytest.raises(RuntimeError, match="rank 1 waited 1 s for rank 0"):
        embedded_snapshot("tiny_flux", arch, str(tmp_path))
    assert missing_weights(snap) == ["vae"]  # rank 1 built nothing


def test_a_models_own_default_that_does_not_act_is_recorded_not_refused(compose):
    """Field case: ``model=qwen_image`` refused its own builtin prompts (its YAML's ``true_cfg_scale: 4.0``, the
    model card's value, acts only with a negative prompt; no builtin row has one). The model's default is recorded
    as ignored in every row; the same key chosen by the user (on the command line, even at the same value, or a
    value other than the model's YAML) is refused under ``dataset.on_ignored=error``."""
    import torch

    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.dataset import Row
    from runner.core.errors import ConfigValueError
    from runner.core.platform import detect

    def engine(overrides, **generation):
        cfg = compose(["model=qwen_image", "platform=cpu", "model.load_format=dummy", *overrides])
        for k, v in generation.items():  # as a user's own YAML (an experiment) would set it
            cfg.model.generation[k] = v
        return engine_class(cfg.model.engine)(StageContext(cfg=cfg, overrides=overrides, stage="denoise",
                                                           plat=detect("cpu", "cpu"), dtype=torch.float32))

    rows = [Row(id=f"r{i}", prompt="a lighthouse", negative_prompt=None, seed=i, width=64, height=64,
                num_inference_steps=2, guidance_scale=None, num_images_per_prompt=1, line=i + 1) for i in range(2)]
    out = engine([]).check_ignored(rows, "rows.jsonl")
    assert [r.ignored for r in out] == [{"true_cfg_scale": {"value": 4.0, "why": "no row has a negative_prompt, and "
                                         "QwenImagePipeline runs true CFG only with one",
                                         "from": "model.generation.true_cfg_scale"}}] * 2
    for eng in (engine(["model.generation.true_cfg_scale=4"]), engine([], true_cfg_scale=6.0)):
        with pytest.raises(ConfigValueError, match=r"true_cfg_scale=\d\.0 is ignored by model=qwen_image"):
            eng.check_ignored(rows, "rows.jsonl")
    # with a negative prompt in a row the default acts: nothing ignored, nothing refused
    neg = [rows[0], Row(**{**rows[1].__dict__, "negative_prompt": " "})]
    assert [r.ignored for r in engine([]).check_ignored(neg, "rows.jsonl")] == [None, None]
