"""Wan 2.2 (issue #31 part B) on CPU: the A14B layout's two experts (``transformer`` / ``transformer_2`` switched at
``boundary_ratio``) probed and checked step by step, ``guidance_scale_2``, the TI2V-5B layout (one transformer,
per-token timesteps, a VAE of spatial factor 16 whose widths and heights are multiples of 32), resume and repro of
both tiny variants, and a run whose switch is tampered with ending as an evidence mismatch (exit 3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _helpers import requires_extra  # noqa: E402
from test_report import _tail, run_module


def _stage(r):
    return r.manifest["evidence"]["stages"]["denoise"]


def _snapshot(model: str) -> Path:
    """The embedded snapshot of ``model`` (built into the session cache on first use)."""
    from omegaconf import OmegaConf

    from models.pipelines import embedded_target
    from models.registry import engine_class

    cfg = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / f"{model}.yaml")
    arch = OmegaConf.to_container(cfg.architecture, resolve=True)
    return engine_class(cfg.engine).embedded_snapshot_at(embedded_target(model, arch, None), arch)


def test_both_experts_are_probed_and_run_at_the_steps_boundary_ratio_gives(run_job):
    """tiny_wan22 (4 steps: timesteps 999, 900, 750, 500; boundary 0.875 x 1000 = 875): ``transformer`` computes
    steps 0-1 and ``transformer_2`` steps 2-3, two forwards each (CFG); every attention site of each expert ran once
    per forward of its own expert, the linear layers of both are counted, both experts' first forwards profiled,
    and the record says the low-noise guidance applied."""
    r = run_job(["model=tiny_wan22", "dataset.limit=1"])
    assert r.code == 0
    assert r.manifest["evidence"]["verdict"] == "verified", r.manifest["evidence"]["mismatches"]
    st = _stage(r)
    assert st["checks"] == {"forward_count": "verified", "expert_schedule": "verified"}
    assert st["expert_forwards"] == {"transformer": 4, "transformer_2": 4} and st["denoiser_forwards"] == 8
    ex = st["experts"]
    assert ex["boundary_ratio"] == 0.875 and ex["expected_forwards"] == {"transformer": 4, "transformer_2": 4}
    steps = ex["first"]["steps"]
    assert [s["timestep"] for s in steps] == [999.0, 900.0, 750.0, 500.0]
    assert [s["observed"] for s in steps] == [["transformer"]] * 2 + [["transformer_2"]] * 2
    assert ex["first"]["switch_step"] == {"expected": 2, "observed": 2}
    layers = {l["layer"]: l for l in st["attention"]["layers"]}
    second = [k for k in layers if k.startswith("transformer_2.")]
    assert len(second) == len(layers) // 2 == 4  # 2 blocks x (attn1, attn2) per expert
    assert all(l["ok"] and l["calls"] == 4 for l in layers.values())
    assert st["linear"]["modules"] == 2 * 26 and st["linear"]["observed"]["TORCH"] == 26 * 8
    assert st["kernels"]["profiled_experts"] == ["transformer", "transformer_2"]
    assert st["kernels"]["attention_launches"] == {"TORCH_SDPA": 8}  # 4 sites in each expert's profiled forward
    assert r.items[0]["params"]["guidance_scale_2"] == 3.0 and r.items[0]["params"]["guidance_scale"] == 4.0
    files = r.manifest["model"]["source"]["files"]  # both experts' weights are hashed
    assert any(f.startswith("transformer_2/") for f in files) and any(f.startswith("transformer/") for f in files)


@pytest.mark.parametrize("tamper", ["boundary", "swap"])
def test_a_switch_at_another_step_is_an_evidence_mismatch(tmp_path, tamper):
    """Negative: after loading, the pipeline is made to switch elsewhere (its ``boundary_ratio`` set to 0.7, so
    step 2 at timestep 750 stays on ``transformer``), or its low-noise expert replaced by the high-noise one (the
    watched ``transformer_2`` never runs): the evidence names the step and the expert, exit 3."""
    from _helpers import execute
    from runner.core.errors import RunnerError

    def hook(eng):
        if tamper == "boundary":
            eng.pipe.register_to_config(boundary_ratio=0.7)
        else:
            eng.pipe.transformer_2 = eng.pipe.transformer

    r = execute(tmp_path / "run", ["model=tiny_wan22", "dataset.limit=1"], on_loaded=hook, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 3, r
    msg = str(r.error)
    assert "step 2 (timestep 750) ran transformer at timestep 750.0, expected transformer_2" in msg, msg
    man = json.loads((r.run_dir / "manifest.json").read_text())
    st = man["evidence"]["stages"]["denoise"]
    assert st["checks"]["expert_schedule"] == "mismatch" and man["evidence"]["verdict"] == "mismatch"
    want = {"boundary": {"transformer": 6, "transformer_2": 2}, "swap": {"transformer": 8, "transformer_2": 0}}
    assert st["expert_forwards"] == want[tamper]


def test_guidance_scale_2_reaches_the_low_noise_expert(tmp_path):
    """``guidance_scale_2`` is passed to the pipeline: equal to ``guidance_scale`` it gives the bytes of a run that
    leaves it unset (WanPipeline's default), another value other bytes."""
    from _helpers import execute

    def video(name, extra):
        r = execute(tmp_path / name, ["model=tiny_wan22", "dataset.limit=1", *extra])
        assert r.code == 0
        return next((tmp_path / name).rglob("*.mp4")).read_bytes()

    same = video("same", ["model.generation.guidance_scale_2=4.0"])
    assert video("unset", ["model.generation.guidance_scale_2=null"]) == same
    assert video("other", ["model.generation.guidance_scale_2=1.5"]) != same


@pytest.mark.parametrize("model, overrides, why", [
    ("tiny_wan", ["model.generation.guidance_scale_2=3"], "has one expert (no boundary_ratio)"),
    ("tiny_flux", ["model.generation.guidance_scale_2=3"], "has no second expert to apply it to"),
    ("tiny_wan22", ["dataset=jsonl", "dataset.path={rows}"], "guidance_scale <= 1 turns classifier-free guidance off"),
    ("tiny_wan22", ["cache.method=first_block", "cache.threshold=0.2"], "switches between 2 denoisers"),
    pytest.param("tiny_wan22", ["model.lora=[{{path: /nonexistent/a.safetensors, scale: 1.0}}]"],
                 "has 2 denoisers (transformer, transformer_2; each runs its own steps), and the entry names none",
                 marks=requires_extra("lora")),
    pytest.param("tiny_wan22", ["model.quantization.transformer_2=int8wo", "optimize.fuse_qkv=true"],
                 "optimize.fuse_qkv=true with model.quantization.transformer_2=int8wo", marks=requires_extra("torchao")),
])
def test_what_cannot_apply_to_two_experts_is_refused_at_startup(tmp_path, write_jsonl, model, overrides, why):
    """Refused before loading (exit 2), naming the field and why: ``guidance_scale_2`` on a one-expert model or in a
    row without CFG, a step cache on a model that switches experts, a LoRA entry that names no expert there
    (diffusers would load it into ``transformer`` alone), and QKV fusion with the second expert quantized."""
    from _helpers import execute
    from runner.core.errors import RunnerError

    rows = write_jsonl([{"id": "a", "prompt": "a red cube", "guidance_scale": 1.0, "guidance_scale_2": 3.0}])
    loaded = []
    r = execute(tmp_path / "run", [f"model={model}", *[o.format(rows=rows) for o in overrides]],
                on_loaded=loaded.append, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded, r
    assert why in str(r.error) and "fix:" in str(r.error), str(r.error)


def test_ti2v_runs_verified_with_per_token_timesteps_and_32_pixel_geometry(run_job):
    """tiny_wan22_ti2v: one transformer (no expert section), WanPipeline's ``expand_timesteps`` from the snapshot,
    a 64x64 row written as 64x64 frames (the 16x VAE with patch 2: 2x2 tokens)."""
    from runner.core.video import decode_mp4

    r = run_job(["model=tiny_wan22_ti2v", "dataset.limit=1"])
    assert r.code == 0 and r.manifest["evidence"]["verdict"] == "verified", r.manifest["evidence"]["mismatches"]
    st = _stage(r)
    assert "experts" not in st and st["checks"] == {"forward_count": "verified"}
    assert st["denoiser_forwards"] == 2 * 2
    assert json.loads((Path(r.manifest["model"]["source"]["path"]) / "model_index.json").read_text())[
        "expand_timesteps"] is True
    frames = decode_mp4(next(r.run_dir.rglob("*.mp4")))
    assert frames.shape[:3] == (5, 64, 64), frames.shape


@pytest.mark.parametrize("args", [["model=tiny_wan22_ti2v"], ["model=tiny_wan", "model.path={snap}"]])
def test_c21_a_16x_vae_refuses_48_pixels_naming_32_end_to_end(tmp_path, args):
    """Case C21 through ``python -m runner``: a row of 48x48 on a Wan 2.2 TI2V-style snapshot (``scale_factor_spatial``
    16, patch 2) is refused at startup naming 32, whether the model config says so (tiny_wan22_ti2v) or the snapshot
    does under a Wan 2.1 config (model.size_multiple=16 refused); nothing is written (WanPipeline would have made a
    32x32 video recorded as 48)."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "a red cube", "width": 48, "height": 48}) + "\n")
    snap = _snapshot("tiny_wan22_ti2v")
    p = run_module("runner", ["platform=cpu", *[a.format(snap=snap) for a in args], "dataset=jsonl",
                              f"dataset.path={rows}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 2, _tail(p)
    assert "multiple of 32" in out or "multiples of 32" in out, _tail(p)
    assert "Traceback" not in out and not list(tmp_path.rglob("*.mp4"))


def test_frames_follow_the_ti2v_snapshot_vae_temporal_factor(compose):
    """``num_frames`` is checked against the snapshot VAE's ``scale_factor_temporal`` (4: 7 frames refused naming 5
    or 9), read from ``vae/config.json`` of the TI2V snapshot."""
    from models.registry import engine_class
    from runner.core.errors import ConfigValueError

    from test_families import _engine

    snap = _snapshot("tiny_wan22_ti2v")
    assert json.loads((snap / "vae" / "config.json").read_text())["scale_factor_temporal"] == 4
    eng = _engine(compose(["model=tiny_wan22_ti2v", "platform=cpu", f"model.path={snap}",
                           "model.generation.num_frames=7"]))
    assert isinstance(eng, engine_class("wan")) and eng.temporal_factor() == 4
    with pytest.raises(ConfigValueError, match=r"num_frames=7 is not 4k\+1.*num_frames=5"):
        eng.read_rows()


def test_a_two_expert_snapshot_loads_under_a_wan_21_config(run_job):
    """A Wan 2.2 A14B snapshot (``transformer_2`` in its ``model_index.json``) given as ``model.path`` to a Wan 2.1
    config: the snapshot decides, both experts load and are observed (it used to be refused)."""
    r = run_job(["model=tiny_wan", f"model.path={_snapshot('tiny_wan22')}", "dataset.limit=1",
                 "model.generation.width=32", "model.generation.height=32", "model.generation.num_frames=5"])
    assert r.code == 0 and r.manifest["evidence"]["verdict"] == "verified", r.manifest["evidence"]["mismatches"]
    assert _stage(r)["expert_forwards"] == {"transformer": 4, "transformer_2": 4}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_wan22", "tiny_wan22_ti2v"])
def test_repro_and_resume(tmp_path, model):
    """Each tiny Wan 2.2 variant: ``runner.repro`` reproduces the run (REPRO OK), and a resume into a copy reuses
    every item without regenerating."""
    run = tmp_path / "run"
    p = run_module("runner", ["platform=cpu", f"model={model}", "dataset.limit=2", f"hydra.run.dir={run}"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    p = run_module("runner.tools.repro", [run, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    check = json.loads((tmp_path / "rerun" / "repro_check.json").read_text())
    assert check["ok"] and check["problems"] == [] and [r["verdict"] for r in check["items"]] == ["ok", "ok"], check
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = {f.name: f.read_bytes() for f in copy.rglob("*.mp4")}
    overrides = json.loads((run / "manifest.json").read_text())["overrides"]
    p = run_module("runner", [*[o for o in overrides if not o.startswith("hydra.")], f"run.resume={copy}"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    assert json.loads((copy / "manifest.json").read_text())["resumed_from"]["reused_items"] == 2
    assert {f.name: f.read_bytes() for f in copy.rglob("*.mp4")} == before and len(before) == 2


@pytest.mark.parametrize("model, experts, params", [("wan22", ("transformer", "transformer_2"), (14.2e9, 14.4e9)),
                                                    ("wan22_ti2v", ("transformer",), (4.9e9, 5.1e9))])
def test_full_size_configs_are_the_published_ones(compose, model, experts, params):
    """conf/model/wan22.yaml and wan22_ti2v.yaml carry models/reference/families_configs.json's entries (each with
    a source), and build on the meta device: two 14B experts (A14B), one 5B transformer (TI2V-5B) whose VAE needs
    multiples of 32; the pipeline settings are the published ones."""
    import torch
    from omegaconf import OmegaConf

    from test_families import _engine

    root = Path(__file__).resolve().parents[1]
    ref = json.loads((root / "models" / "reference" / "families_configs.json").read_text())[model]
    arch = OmegaConf.to_container(OmegaConf.load(root / "conf" / "model" / f"{model}.yaml"))["architecture"]
    for comp in (*experts, "vae", "pipeline"):
        assert arch[comp] == ref[comp] and comp in ref["sources"], comp
    assert {k: v for k, v in arch["text_encoder"].items() if k != "relative_attention_num_buckets"} == \
        ref["text_encoder"]
    eng = _engine(compose([f"model={model}", "platform=cpu", "model.load_format=dummy"]))
    eng.resolve_source()
    assert eng.declared_experts() == list(experts)
    comps = eng.build_components(eng.arch_copy(), device="meta", dtype=torch.bfloat16)
    for e in experts:
        assert params[0] < sum(p.numel() for p in comps[e].parameters()) < params[1], e
    assert "transformer_2" in comps if len(experts) > 1 else "transformer_2" not in comps
    want = {"wan22": (16, {"boundary_ratio": 0.875, "expand_timesteps": False}),
            "wan22_ti2v": (32, {"boundary_ratio": None, "expand_timesteps": True})}[model]
    assert (eng.size_need(), eng.pipeline_settings()) == want


GPU_LANES = [("TORCH_SDPA", "TORCH"), ("CUDNN_ATTN", "FP8")]


@pytest.mark.cuda
@pytest.mark.parametrize("attention,linear", GPU_LANES, ids=[f"{a}-{b}" for a, b in GPU_LANES])
@pytest.mark.parametrize("model", ["tiny_wan22", "tiny_wan22_ti2v"])
def test_wan22_on_gpu_verified_with_device_kernels(tmp_path_factory, model, attention, linear):
    """tiny_wan22 and tiny_wan22_ti2v in bf16 on the GPU with each lane: verified, the device kernels of the selected
    backends in the profiled forwards (A14B: both experts' first forwards), every attention site of an expert run
    once per forward of that expert, and the switch at the step ``boundary_ratio`` gives."""
    from test_gpu_e2e import GpuRuns, check_evidence, need_video, require

    need_video()
    ov = [f"model={model}", "dataset.limit=1", f"backend.attention={attention}", f"backend.linear={linear}"]
    require(ov, attention=attention, linear=linear)
    r = GpuRuns(tmp_path_factory.mktemp("wan22_gpu")).run(f"{model}-{attention}-{linear}", ov)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    st = check_evidence(r.manifest, r.trace, attention, linear)["stage"]
    per = st.get("expert_forwards") or {"transformer": st["denoiser_forwards"]}
    for lay in st["attention"]["layers"]:
        own = "transformer_2" if lay["layer"].startswith("transformer_2.") else "transformer"
        assert lay["observed"] == {attention: per[own]}, lay
    if model == "tiny_wan22":
        assert per == {"transformer": 4, "transformer_2": 4} and st["checks"]["expert_schedule"] == "verified"
        assert st["experts"]["first"]["switch_step"] == {"expected": 2, "observed": 2}
        assert st["kernels"]["profiled_experts"] == ["transformer", "transformer_2"]


def test_ulysses_splits_both_experts(tmp_path):
    """``parallelism=ulysses`` on 2 CPU ranks (gloo): context parallelism is enabled on both experts; each rank's
    profiled forwards (one per expert) hold 4 all-to-alls per self-attention site of both experts, and each rank's
    evidence, expert schedule included, is verified."""
    import subprocess
    import sys

    from test_report import subprocess_env

    d = tmp_path / "u2"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "runner",
                        "platform=cpu", "model=tiny_wan22", "dataset.limit=1", "parallelism=ulysses",
                        f"hydra.run.dir={d}"], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                       timeout=500)
    assert p.returncode == 0, _tail(p)
    m = json.loads((d / "manifest.json").read_text())
    assert m["status"] == "completed" and len(m["evidence"]["workers"]) == 2
    for ev in m["evidence"]["workers"].values():
        st = ev["stages"]["denoise"]
        self_sites = [l for l in st["attention"]["layers"] if l["layer"].endswith("attn1")]
        assert len(self_sites) == 4 and any(l["layer"].startswith("transformer_2.") for l in self_sites)
        coll = st["kernels"]["collectives"]["all_to_all"]
        assert coll["expected_at_least"] == 4 * 4 and coll["calls"] >= 16, coll
        assert ev["verdict"] == "verified" and st["checks"]["expert_schedule"] == "verified", ev["mismatches"]


def test_a_pipeline_setting_the_snapshot_contradicts_is_refused(tmp_path):
    """With ``model.path`` the snapshot's ``model_index.json`` decides ``boundary_ratio``: an override saying
    otherwise is refused before loading (exit 2), naming both values (else the manifest would record a switch that
    did not run)."""
    from _helpers import execute
    from runner.core.errors import RunnerError

    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_wan22", f"model.path={_snapshot('tiny_wan22')}",
                                   "model.architecture.pipeline.boundary_ratio=0.5"], on_loaded=loaded.append,
                catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded, r
    assert "model.architecture.pipeline.boundary_ratio=0.5: the snapshot's model_index.json says 0.875" in str(r.error)
