"""Weight quantization records added for issue #41: torchao W8A8 int8 (``int8dq``: dynamic int8 activations), int4
weight-only (``int4wo``, CUDA sm80+, bfloat16), NVFP4 (``nvfp4``, Blackwell only, refused above a batch of 31:
pytorch/ao #4023), and pre-quantized Nunchaku Lite (``nunchaku``) and NVIDIA ModelOpt (``modelopt``) checkpoints.
Real tiny_flux runs on CPU for int8dq (the weight class each Linear ran with, the pixels against the unquantized
run); refusals before loading for the others, each asserted on its fix; the batch rule at 31 and 32, through the
run's own startup; the evidence of replacement modules and of quantized Linears that never ran. The GPU halves are
in ``tests/test_memory_cuda.py`` (int4wo, int8dq, nvfp4 on sm100)."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from _helpers import execute, requires_extra
from runner.kernels import quantization as quant
from runner.kernels import registry as reg
from runner.kernels.registry import SelectionContext

pytestmark = pytest.mark.cpu


@requires_extra("torchao")
def test_w8a8_weights_are_told_from_weight_only_int8_at_call_time():
    import torchao.quantization as tq

    names = {}
    for cfg in ("Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"):
        m = torch.nn.Sequential(torch.nn.Linear(32, 32)).to(torch.bfloat16)
        tq.quantize_(m, getattr(tq, cfg)())
        names[cfg] = quant.weight_class_names(m[0])
    assert names["Int8WeightOnlyConfig"][0] == "Int8Tensor"
    assert names["Int8DynamicActivationInt8WeightConfig"][:2] == ["Int8Tensor+dynamic_act", "Int8Tensor"]
    assert not set(quant.get("int8dq").tensor_classes) & set(names["Int8WeightOnlyConfig"])


#: tiny_flux's Linears that see one row per sample (1 double block, 2 single blocks in conf/model/tiny_flux.yaml)
FLUX_PER_SAMPLE = sorted(
    [f"time_text_embed.{e}.linear_{i}" for e in ("timestep_embedder", "guidance_embedder", "text_embedder")
     for i in (1, 2)] + [f"transformer_blocks.0.{n}.linear" for n in ("norm1", "norm1_context")]
    + [f"single_transformer_blocks.{b}.norm.linear" for b in (0, 1)] + ["norm_out.linear"])


@requires_extra("torchao")
def test_int8dq_runs_verified_on_cpu_every_linear_at_its_w8a8_weight_but_the_per_sample_ones(tmp_path):
    """W8A8 quantizes every Linear of the transformer but the 11 that see one row per sample (torch's int8 GEMM
    refuses 16 rows or fewer on CUDA under compile: issue #41, H100 2026-12-07), which run in the compute dtype
    and are recorded by name with the reason. Kills: a run that quantizes them (FLUX at batch 4 fails every item
    on the GPU), one that keeps others dense (a per-token Linear lost to bf16), a record that names no reason."""
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=2", "batch_size=2",
                                   "model.quantization.transformer=int8dq"])
    assert r.code == 0, r.error
    q = r.manifest["evidence"]["stages"]["denoise"]["memory"]["quantization"]["transformer"]
    assert q["method"] == "int8dq" and q["quantized_linears"] == q["linears"] - len(FLUX_PER_SAMPLE) > 0
    kept = q["kept_dense"]
    assert sorted(kept["names"]) == FLUX_PER_SAMPLE and kept["linears"] == len(FLUX_PER_SAMPLE)
    assert kept["ran_per_token"] == [] and "torch._int_mm" in kept["why"] and "17 rows" in kept["why"]
    # the kept Linears ran with their plain weight (a Parameter), the rest with the W8A8 one
    calls = q["calls_by_weight_class"]
    assert set(calls) == {"Int8Tensor+dynamic_act", "Parameter"} and q["quantized_calls"] == calls[
        "Int8Tensor+dynamic_act"] > calls["Parameter"] > 0
    assert r.manifest["evidence"]["verdict"] == "verified"
    assert "model.quantization.transformer=int8dq" in r.manifest["lossy"]["lanes"]


@requires_extra("torchao")
def test_a_per_sample_linear_the_table_misses_fails_the_evidence(tmp_path, monkeypatch):
    """The planted fault: PER_SAMPLE_LINEARS without FLUX's AdaLN pattern (``norm1``/``norm1_context``): those 2
    Linears are quantized, run with one row per sample, and the evidence names them (exit 3), on the CPU, where
    their GEMM would not have failed: a family the table misses is caught before it reaches a GPU."""
    from runner.core.errors import EvidenceError

    monkeypatch.setattr(quant, "PER_SAMPLE_LINEARS",
                        tuple(p for p in quant.PER_SAMPLE_LINEARS if "norm1" not in p))
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=2", "batch_size=2",
                                   "model.quantization.transformer=int8dq"], catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3
    msg = str(r.error)
    assert "2 quantized Linears ran with one row per sample (at most 2)" in msg, msg
    assert "transformer_blocks.0.norm1.linear, transformer_blocks.0.norm1_context.linear;" in msg
    assert "PER_SAMPLE_LINEARS misses them" in msg


def test_the_planner_sizes_kept_dense_linears_at_their_stored_bits():
    """A component under int8dq: its per-sample Linear (``norm_out.linear``) at 4 bytes per float32 weight, its
    per-token one (``proj_out``) at 1; under int8wo (no row limit) both at 1. Kills: a plan that sizes every Linear
    at the method's bits when some stay dense (FLUX.1-dev: ~27 % of its weights), so the observed peak passes the
    plan."""
    from models.memory import component_sizes

    class Out(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 128, bias=False)

    net = torch.nn.Module()
    net.norm_out, net.proj_out = Out(), torch.nn.Linear(64, 64, bias=False)
    assert quant.kept_dense(quant.get("int8dq"), net) == ["norm_out.linear"]
    assert quant.kept_dense(quant.get("int8wo"), net) == []
    dq = component_sizes({"transformer": net}, {"transformer": "int8dq"})["transformer"].weights
    wo = component_sizes({"transformer": net}, {"transformer": "int8wo"})["transformer"].weights
    assert (dq, wo) == (64 * 128 * 4 + 64 * 64, 64 * 128 + 64 * 64)


@requires_extra("torchao")
def test_under_compile_the_load_time_quantization_is_recorded_without_calls():
    """``compile=regional`` runs no hooks (``observe`` false): the section still says which Linears loading
    quantized and kept dense, with ``calls_observed`` false and no call counted, and no mismatch for the calls it
    could not see; observed, the same module's calls are counted. Kills: a compiled run whose quantization vanishes
    from the manifest (it did before issue #41's fix), and one that blames the unobserved calls."""
    from models.memory import QuantProbe, quantize_built

    class Out(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

    def net():
        torch.manual_seed(0)
        n = torch.nn.Module()
        n.norm_out, n.proj_out = Out(), torch.nn.Linear(16, 16)
        n.forward = lambda x: n.proj_out(x.repeat(1, 8, 1)) + n.norm_out.linear(x)
        quantize_built(n, "int8dq", "diffusers", torch.float32)
        return n

    for observe in (False, True):
        n = net()
        probe = QuantProbe({"transformer": "int8dq"}, observe=observe)
        probe.attach({"transformer": n})
        n(torch.ones(2, 1, 16))
        sec, bad = probe.section()
        q = sec["transformer"]
        assert (q["linears"], q["quantized_linears"], q["kept_dense"]["names"]) == (2, 1, ["norm_out.linear"])
        assert q["calls_observed"] is observe and bad == []
        assert q["calls_by_weight_class"] == ({"Int8Tensor+dynamic_act": 1, "Parameter": 1} if observe else {})


@requires_extra("torchao")
@pytest.mark.slow
def test_every_family_keeps_exactly_its_per_sample_linears_dense_under_int8dq(tmp_path):
    """Every registered family's tiny model (and Wan 2.2 A14B, TI2V-5B with its per-token timesteps) under W8A8
    at batch 2 with CFG: each run verified, so no quantized Linear of any family ran with one row per sample (the
    evidence's row count), and each keeps some Linears dense; every kept one ran per sample but TI2V-5B's time
    embedder (``expand_timesteps``: one timestep per token), recorded as such. A new family whose modulation the
    table misses fails here on the CPU."""
    from test_report import _tail, run_module
    from models.registry import family_names

    models = [f"tiny_{n}" for n in family_names()] + ["tiny_wan22", "tiny_wan22_ti2v"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"id": "a", "prompt": "a red cube", "negative_prompt": "blurry", "seed": 1}\n'
                    '{"id": "b", "prompt": "a blue sphere", "seed": 2}\n')
    p = run_module("runner", ["-m", f"model={','.join(models)}", "model.quantization.transformer=int8dq",
                              "platform=cpu", "dataset=jsonl",
                              "dataset.on_ignored=record", f"dataset.path={rows}", "batch_size=2",
                              "memory.vae_slicing=true", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    seen = {}
    for m in sorted((tmp_path / "sweep").glob("*/manifest.json")):
        man = json.loads(m.read_text())
        seen[man["model"]["name"]] = man
    assert sorted(seen) == sorted(models), _tail(p)
    for name, man in seen.items():
        assert man["evidence"]["verdict"] == "verified", (name, man["evidence"]["mismatches"])
        qs = man["evidence"]["stages"]["denoise"]["memory"]["quantization"]
        for comp, q in qs.items():
            kept = q["kept_dense"]
            assert "ran_per_token" in kept, (name, comp, kept)
            assert 0 < kept["linears"] < q["linears"] and q["quantized_linears"] == q["linears"] - kept["linears"]
            assert kept["ran_per_token"] == (kept["names"] if name == "tiny_wan22_ti2v" else []), (name, comp, kept)


@requires_extra("torchao")
def test_a_w8a8_run_that_got_weight_only_int8_fails_the_evidence(tmp_path, monkeypatch):
    """The planted fault: the int8dq record builds torchao's weight-only config (no activation quantization): its
    Linears never hold a dynamic-activation weight, exit 3."""
    from runner.core.errors import EvidenceError

    monkeypatch.setitem(quant._BUILDERS, "int8dq", quant._BUILDERS["int8wo"])
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=1", "model.quantization.transformer=int8dq"],
                catch=(EvidenceError,))
    assert r.error is not None and r.error.exit_code == 3
    assert "none of its" in str(r.error) and "Int8Tensor+dynamic_act" in str(r.error)


@pytest.mark.parametrize("method, says, fix", [
    pytest.param("int4wo", "needs compute capability >= sm80",
                 "Fix: platform=cuda dtype=bfloat16 on an sm80+ GPU (torchao 0.18's int4 weight-only is tinygemm's "
                 "CUDA GEMM in bfloat16; none of its int4 packings has a CPU kernel), or "
                 "model.quantization.transformer=int8dq / int8wo on this machine",
                 marks=requires_extra("torchao")),  # without torchao the refusal names the package first
    pytest.param("nvfp4", "needs compute capability >= sm100",
                 "Fix: platform=cuda on a Blackwell GPU (sm100: B200/GB200, the FP4 tensor cores NVFP4 needs), or "
                 "model.quantization.transformer=float8wo / int4wo on Hopper", marks=requires_extra("torchao")),
    ("nunchaku", "needs platform cuda, this is cpu",
     "platform=cuda on an NVIDIA GPU that diffusers' Nunchaku Lite loader takes: Turing (sm75) or newer for INT4, "
     "Blackwell (sm100) for NVFP4, not Hopper (sm90)"),
    ("modelopt", "needs platform cuda, this is cpu", "platform=cuda (an NVIDIA GPU"),
])
def test_gpu_only_methods_are_refused_on_cpu_before_loading(tmp_path, method, says, fix):
    """Kills: a record without its platform requirement (it would load and fail inside torchao or diffusers), and
    a refusal that names no way out (the fix is the record's own, with the component's key in it)."""
    from runner.core.errors import RunnerError

    loaded = []
    r = execute(tmp_path / "run", ["model=tiny_flux", "dataset.limit=1", f"model.quantization.transformer={method}"],
                on_loaded=loaded.append, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded
    msg = str(r.error)
    assert f"model.quantization.transformer={method} cannot run here" in msg and says in msg
    assert fix in msg, msg
    assert not (r.run_dir / "images").is_dir() or not list((r.run_dir / "images").iterdir())


def test_nvfp4_is_refused_above_the_batch_it_is_known_to_fail_at(monkeypatch):
    """On a (faked) Blackwell GPU with torchao's NVFP4 config importable: batch_size 31 passes, 32 is refused naming
    the key, the value, the source and the fix; another method at 32 is not."""
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    blackwell = SelectionContext(platform_kind="cuda", sm=100, dtype=torch.bfloat16)
    libs = {"transformer": "diffusers"}
    quant.check({"transformer": "nvfp4"}, libs, blackwell, None, batch_size=31)
    quant.check({"transformer": "int8dq"}, libs, blackwell, None, batch_size=64)
    with pytest.raises(quant.QuantizationError) as e:
        quant.check({"transformer": "nvfp4"}, libs, blackwell, None, batch_size=32)
    msg = str(e.value)
    assert "model.quantization.transformer=nvfp4 with batch_size=32" in msg and "pytorch/ao issue #4023" in msg
    assert "fix: batch_size=31 or less" in msg
    hopper = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16)
    with pytest.raises(quant.QuantizationUnavailableError, match="needs compute capability >= sm100, this device"):
        quant.check({"transformer": "nvfp4"}, libs, hopper, None, batch_size=1)


def test_new_records_plan_their_storage_bits():
    """The planner's bits per weight: int8 8, int4 with a bf16 scale and zero per 128 4.25, NVFP4's e4m3 scale per 16
    4.5 (sources in runner.kernels.quantization's docstring)."""
    assert (quant.get("int8dq").bits, quant.get("int4wo").bits, quant.get("nvfp4").bits) == (8.0, 4 + 32 / 128, 4.5)
    assert quant.normalize("W8A8", "k") == "int8dq" and quant.normalize("int4", "k") == "int4wo"


# ------------------------------------------------------------------------------------------------ int8dq, lossy
SMALL = ["model=tiny_flux", "dataset.limit=2", "model.generation.width=32", "model.generation.height=32",
         "model.generation.num_inference_steps=2", "dtype=bfloat16"]


def _images(run_dir):
    from PIL import Image

    return {p.name: np.asarray(Image.open(p), dtype=np.float32) for p in sorted((run_dir / "images").glob("*.png"))}


@requires_extra("torchao")
def test_int8dq_pixels_differ_from_bf16_a_little_and_the_lane_is_gated(tmp_path):
    """W8A8 on CPU in bfloat16 against the same run unquantized: the pixels change (kills a record whose config
    quantizes nothing: identical images) and stay close (kills one that wrecks the weights: a mean error of
    tens of levels); the lane is lossy, so the gate compares it with the lossless run."""
    from runner.tools.gate import write_gate

    q = execute(tmp_path / "int8dq", [*SMALL, "model.quantization.transformer=int8dq"])
    assert q.code == 0, q.error
    base = execute(tmp_path / "lossless", SMALL)
    assert base.code == 0, base.error
    qi, bi = _images(tmp_path / "int8dq"), _images(tmp_path / "lossless")
    assert qi.keys() == bi.keys() and len(qi) == 2
    assert max(np.abs(qi[k] - bi[k]).max() for k in qi) > 0
    assert max(np.abs(qi[k] - bi[k]).mean() for k in qi) < 8  # intensity levels of 255
    ev = q.manifest["evidence"]["stages"]["denoise"]["memory"]["quantization"]["transformer"]
    assert set(ev["calls_by_weight_class"]) == {"Int8Tensor+dynamic_act", "Parameter"}  # Parameter: kept dense
    assert q.manifest["lossy"]["lanes"] == ["model.quantization.transformer=int8dq"]
    doc = write_gate([tmp_path / "lossless", tmp_path / "int8dq"], tmp_path / "gate.json")
    (entry,) = doc["jobs"]
    assert entry["lanes"] == ["model.quantization.transformer=int8dq"] and entry["lossy_path"].endswith("int8dq")
    assert doc["lossless_jobs"]


def test_each_new_method_is_its_own_run_identity():
    """Kills: an identity that drops the method (a W8A8 run resumed into a weight-only one's outputs)."""
    from runner.core.resume import identity_sha256, run_identity

    ids = set()
    for m in (None, "int8wo", "int8dq", "int4wo", "nvfp4", "nunchaku", "modelopt"):
        cfg = {"model": {"name": "m", "quantization": {"transformer": m}}, "memory": {"vae_tiling": False}}
        ids.add(identity_sha256(run_identity(cfg, "bfloat16", {"kind": "cuda"}, {}, {}, {})))
    assert len(ids) == 7


# ------------------------------------------------------------------------------------------------ nvfp4 batch rule
def _stand_in_nvfp4(monkeypatch):
    """The nvfp4 record as it is (its batch limit) with int8dq's config, evidence and no platform requirement: a
    tiny run that can pass startup on this CPU, so the rule is checked where the run applies it."""
    import dataclasses

    real = quant.get("nvfp4")
    monkeypatch.setitem(quant.METHODS, "nvfp4", dataclasses.replace(
        real, requires=(), tensor_classes=quant.get("int8dq").tensor_classes))
    monkeypatch.setitem(quant._BUILDERS, "nvfp4", quant._BUILDERS["int8dq"])
    return real.max_batch


@requires_extra("torchao")
def test_the_nvfp4_batch_rule_is_applied_at_startup_at_32_and_not_31(tmp_path, monkeypatch):
    """Through the run's own startup (the batch_size the run was given, not a test's argument): batch_size=32 is
    refused before any weight loads, naming the key, the value, pytorch/ao#4023 and the fix; 31 runs. Kills: the
    rule never given the run's batch_size, and an off-by-one (>= 31 or > 32)."""
    from runner.core.errors import RunnerError

    assert _stand_in_nvfp4(monkeypatch) == 31
    loaded = []
    base = ["model=tiny_flux", "dataset.limit=1", "model.generation.width=32", "model.generation.height=32",
            "model.generation.num_inference_steps=1", "model.quantization.transformer=nvfp4"]
    r = execute(tmp_path / "b32", [*base, "batch_size=32"], on_loaded=loaded.append, catch=(RunnerError,))
    assert r.error is not None and r.error.exit_code == 2 and not loaded
    msg = str(r.error)
    assert "model.quantization.transformer=nvfp4 with batch_size=32" in msg and "pytorch/ao issue #4023" in msg
    assert "fix: batch_size=31 or less" in msg
    r = execute(tmp_path / "b31", [*base, "batch_size=31"], on_loaded=loaded.append, catch=(RunnerError,))
    assert r.code == 0 and r.error is None and loaded, r.error


# ------------------------------------------------------------------------------------------------ packages
def test_modelopt_missing_is_refused_naming_its_pip_distribution(monkeypatch):
    """NVIDIA ModelOpt imports as ``modelopt`` and installs as ``nvidia-modelopt``: kills a fix that says
    ``pip install modelopt`` (another project on PyPI). On a GPU the package is the only fix named."""
    from runner.kernels import registry as reg

    real = reg.has_symbol
    monkeypatch.setattr(reg, "has_symbol", lambda path: False if path.startswith("modelopt") else real(path))
    libs = {"transformer": "diffusers"}
    gpu = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16)
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "modelopt"}, libs, gpu, None)
    msg = str(e.value)
    assert "(package `modelopt` is not installed)" in msg
    assert "Fix: pip install nvidia-modelopt, or choose another method" in msg, msg
    cpu = SelectionContext(platform_kind="cpu", dtype=torch.float32)
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "modelopt"}, libs, cpu, None)
    assert "Fix: pip install nvidia-modelopt and platform=cuda (an NVIDIA GPU" in str(e.value), str(e.value)


def test_nunchaku_names_the_kernels_package_and_the_hardware_it_needs(monkeypatch):
    """diffusers' Nunchaku Lite loader needs the Hugging Face ``kernels`` package and a non-Hopper NVIDIA GPU
    (sm75+): each missing part named with its fix; an sm89 GPU with the packages passes the record's check."""
    from runner.kernels import registry as reg

    real = reg.has_symbol
    monkeypatch.setattr(reg, "has_symbol", lambda path: False if path.startswith("kernels") else real(path))
    libs = {"transformer": "diffusers"}
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "nunchaku"}, libs, SelectionContext(platform_kind="cuda", sm=89), None)
    msg = str(e.value)
    assert "(package `kernels` is not installed)" in msg and "Fix: pip install kernels, or" in msg, msg
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "nunchaku"}, libs, SelectionContext(platform_kind="cuda", sm=90), None)
    assert "does not run on sm90" in str(e.value) and "not Hopper (sm90)" in str(e.value)
    quant.check({"transformer": "nunchaku"}, libs, SelectionContext(platform_kind="cuda", sm=89), None)
    with pytest.raises(quant.QuantizationError, match="nunchaku quantizes only diffusers components"):
        quant.check({"text_encoder": "nunchaku"}, {"text_encoder": "transformers"},
                    SelectionContext(platform_kind="cuda", sm=89), None)


def test_int4wo_on_a_gpu_in_float16_is_refused_naming_bfloat16(monkeypatch):
    """torchao's tile-packed int4 tensor asserts bfloat16 weights: refused at startup, not inside torchao."""
    from runner.kernels import registry as reg

    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    libs = {"transformer": "diffusers"}
    with pytest.raises(quant.QuantizationUnavailableError) as e:
        quant.check({"transformer": "int4wo"}, libs, SelectionContext(platform_kind="cuda", sm=90,
                                                                      dtype=torch.float16), None)
    assert "needs dtype bfloat16, the model runs in float16" in str(e.value)
    assert "platform=cuda dtype=bfloat16" in str(e.value)
    quant.check({"transformer": "int4wo"}, libs, SelectionContext(platform_kind="cuda", sm=80, dtype=torch.bfloat16),
                None)


# ------------------------------------------------------------------------------------------------ checkpoints
def _snapshot(root, quantization_config=None):
    (root / "transformer").mkdir(parents=True)
    conf = {"_class_name": "FluxTransformer2DModel"}
    if quantization_config is not None:
        conf["quantization_config"] = quantization_config
    (root / "transformer" / "config.json").write_text(json.dumps(conf))
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    return {"kind": "path", "path": str(root)}


NUNCHAKU_INT4 = {"quant_method": "nunchaku_lite", "svdq_w4a4": {"precision": "int4", "group_size": 64, "rank": 32,
                                                                "targets": ["transformer_blocks.0.attn.to_q"]}}


def test_a_checkpoint_method_needs_a_checkpoint_of_its_kind(tmp_path, monkeypatch):
    """Before anything loads: no checkpoint (an embedded model), a snapshot whose config declares no such
    quantization_config, a Nunchaku NVFP4 checkpoint off Blackwell, diffusers' remote-kernel opt-in unset: each
    refused naming the fix. Kills: loading a plain snapshot under a checkpoint label (a lossless run labelled
    quantized, or diffusers failing mid-load)."""
    from models.memory import check_checkpoints

    comps = ["transformer", "vae"]
    sm89 = SelectionContext(platform_kind="cuda", sm=89, dtype=torch.bfloat16)
    monkeypatch.setattr(quant, "trusts_remote_kernels", lambda: True)
    with pytest.raises(quant.QuantizationError) as e:
        check_checkpoints({"transformer": "nunchaku"}, {"kind": "embedded"}, comps, sm89, "tiny_flux")
    assert "model=tiny_flux has no checkpoint (its weights are embedded)" in str(e.value)
    assert "fix: model.path=<a snapshot whose transformer/config.json declares quantization_config.quant_method=" \
           "nunchaku_lite>" in str(e.value)
    plain = _snapshot(tmp_path / "plain")
    with pytest.raises(quant.QuantizationError) as e:
        check_checkpoints({"transformer": "modelopt"}, plain, comps, sm89, "flux")
    assert "transformer/config.json declares no quantization_config, so it is not a modelopt checkpoint" in str(e.value)
    assert "fix: model.path=<a modelopt export of the model>" in str(e.value)
    good = _snapshot(tmp_path / "int4", NUNCHAKU_INT4)
    check_checkpoints({"transformer": "nunchaku"}, good, comps, sm89, "flux")
    fp4 = _snapshot(tmp_path / "fp4", {**NUNCHAKU_INT4, "svdq_w4a4": {**NUNCHAKU_INT4["svdq_w4a4"],
                                                                       "precision": "nvfp4", "group_size": 16}})
    with pytest.raises(quant.QuantizationError, match="NVFP4, which diffusers loads on a Blackwell GPU"):
        check_checkpoints({"transformer": "nunchaku"}, fp4, comps, sm89, "flux")
    check_checkpoints({"transformer": "nunchaku"}, fp4, comps, SelectionContext(platform_kind="cuda", sm=100), "flux")
    monkeypatch.setattr(quant, "trusts_remote_kernels", lambda: False)
    with pytest.raises(quant.QuantizationError) as e:
        check_checkpoints({"transformer": "nunchaku"}, good, comps, sm89, "flux")
    assert "fix: export DIFFUSERS_TRUST_REMOTE_KERNELS=true" in str(e.value)


def test_a_prequantized_snapshot_the_config_does_not_name_is_refused(tmp_path):
    """diffusers applies a checkpoint's quantization_config whatever the runner asks: a ModelOpt or Nunchaku
    snapshot run with model.quantization.transformer=none would be lossy with no lossy label. Kills: trusting
    the config's none."""
    from models.memory import check_checkpoints

    snap = _snapshot(tmp_path / "mo", {"quant_method": "modelopt", "quant_type": "FP8"})
    ctx = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16)
    with pytest.raises(quant.QuantizationError) as e:
        check_checkpoints({}, snap, ["transformer", "vae"], ctx, "flux")
    assert "model.quantization.transformer=none: the snapshot's transformer is a pre-quantized modelopt checkpoint" \
           in str(e.value) and "fix: model.quantization.transformer=modelopt" in str(e.value)
    check_checkpoints({"transformer": "modelopt"}, snap, ["transformer", "vae"], ctx, "flux")
    check_checkpoints({}, _snapshot(tmp_path / "plain"), ["transformer", "vae"], ctx, "flux")


@requires_extra("torchao")  # the int8wo text encoder beside it builds torchao's config
def test_checkpoint_methods_build_no_config_and_modelopt_restores_before_loading(tmp_path, monkeypatch):
    """The checkpoint's own quantization_config loads it: the runner passes none (diffusers' Nunchaku config
    without targets raises); ModelOpt's enable_huggingface_checkpointing runs once before from_pretrained; a
    checkpoint component is planned at its files' bytes."""
    from models.memory import before_loading, checkpoint_bytes, component_sizes, quant_mapping

    libs = {"transformer": "diffusers", "text_encoder": "transformers"}
    assert quant_mapping({"transformer": "nunchaku"}, libs, torch.bfloat16) == {}
    assert set(quant_mapping({"transformer": "modelopt", "text_encoder": "int8wo"}, libs, torch.bfloat16)) == {
        "text_encoder"}
    with pytest.raises(quant.QuantizationError, match="loads a pre-quantized checkpoint"):
        quant.get("modelopt").config("diffusers", torch.bfloat16)
    calls = []
    for name in ("modelopt", "modelopt.torch", "modelopt.torch.opt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["modelopt.torch.opt"].enable_huggingface_checkpointing = lambda: calls.append(1)
    assert before_loading({"transformer": "modelopt", "text_encoder": "int8wo"}) == [
        "modelopt.torch.opt:enable_huggingface_checkpointing"] and calls == [1]
    assert before_loading({"transformer": "int8wo"}) == [] and calls == [1]
    snap = _snapshot(tmp_path / "mo", {"quant_method": "modelopt"})
    (tmp_path / "mo" / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 3000)
    files = checkpoint_bytes(snap, {"transformer": "modelopt"})
    assert files == {"transformer": 3000} and checkpoint_bytes(snap, {"transformer": "int8wo"}) == {}
    net = torch.nn.Sequential(torch.nn.Linear(64, 64))
    size = component_sizes({"transformer": net}, {"transformer": "modelopt"}, None, files)["transformer"]
    assert size.weights == 3000
    at_bits = component_sizes({"transformer": net}, {"transformer": "modelopt"}, None, {})["transformer"]
    assert at_bits.weights == component_sizes({"transformer": net}, {"transformer": "int8wo"})["transformer"].weights


# ------------------------------------------------------------------------------------------------ evidence
class SVDQW4A4Linear(torch.nn.Module):
    """Stands in for diffusers' Nunchaku module of this name (``qweight``, no ``weight``; not an nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.qweight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.int8), requires_grad=False)

    def forward(self, x):
        return x


class QuantLinearConvBase(torch.nn.Linear):
    """Stands in for ModelOpt's quantized Linear base (a subclass of nn.Linear with a ``weight_quantizer``)."""

    def __init__(self, enabled):
        super().__init__(8, 8)
        self.weight_quantizer = types.SimpleNamespace(is_enabled=enabled)


def test_replacement_modules_are_observed_and_a_quantizer_turned_off_is_not(tmp_path):
    """Nunchaku replaces Linears by modules that are no nn.Linear: the probe watches them (kills a probe that
    looks at nn.Linear only: 0 quantized Linears, a false mismatch); a ModelOpt QuantLinear whose weight
    quantizer is off computes in full precision: not counted as quantized (a mismatch, kills counting the class
    alone)."""
    from models.memory import QuantProbe

    net = torch.nn.Sequential(SVDQW4A4Linear(), torch.nn.Linear(8, 8))
    probe = QuantProbe({"transformer": "nunchaku"})
    probe.attach({"transformer": net})
    net(torch.ones(1, 8))
    sec, bad = probe.section()
    assert sec["transformer"]["linears"] == 2 and sec["transformer"]["quantized_linears"] == 1 and not bad
    assert sec["transformer"]["calls_by_weight_class"] == {"SVDQW4A4Linear": 1, "Parameter": 1}
    for enabled, want in ((True, 1), (False, 0)):
        net = torch.nn.Sequential(QuantLinearConvBase(enabled))
        probe = QuantProbe({"transformer": "modelopt"})
        probe.attach({"transformer": net})
        net(torch.ones(1, 8))
        sec, bad = probe.section()
        assert sec["transformer"]["quantized_calls"] == want and bool(bad) == (not enabled), (sec, bad)


@requires_extra("torchao")
def test_quantized_linears_that_never_run_are_a_mismatch():
    """A component whose quantized Linear sits off the forward path while a plain one runs: it ran 0 quantized
    Linears. Kills: evidence that counts Linears quantized at load and never asks what executed."""
    from models.memory import QuantProbe, quantize_built

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(16, 16)
            self.used = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.used(x)

    net = Net()
    quantize_built(net.unused, "int8dq", "diffusers", torch.float32)
    probe = QuantProbe({"transformer": "int8dq"})
    probe.attach({"transformer": net})
    net(torch.ones(2, 16))
    sec, bad = probe.section()
    assert sec["transformer"]["quantized_linears"] == 1 and sec["transformer"]["quantized_calls"] == 0
    assert bad == ["model.quantization.transformer=int8dq: its Linears ran 1 times, none with a "
                   "Int8Tensor+dynamic_act weight (0 quantized Linears executed)"], bad


@requires_extra("torchao")
def test_a_method_that_quantizes_on_the_device_loads_its_component_there(tmp_path, monkeypatch):
    """Regression (H100 2026-12-06: int4wo failed at loading, ``_convert_weight_to_int4pack`` has no CPU kernel and
    diffusers' quantizer ran on the CPU without a device map): a ``quantize_on_device`` method's component is loaded
    apart with ``device_map`` on the run's device. Stand-in on the CPU: int8wo flagged so. The flagged run's
    transformer carries diffusers' device map and the other components none; the unflagged run's transformer none
    (kills a flag that is never read); the images are the same (kills a component loaded with another config)."""
    import dataclasses

    base = [*SMALL, "model.quantization.transformer=int8wo"]
    plain, flagged = [], []
    r0 = execute(tmp_path / "plain", base, on_loaded=plain.append)
    assert r0.code == 0, r0.error
    monkeypatch.setitem(quant.METHODS, "int8wo", dataclasses.replace(quant.METHODS["int8wo"], quantize_on_device=True))
    r1 = execute(tmp_path / "flagged", base, on_loaded=flagged.append)
    assert r1.code == 0, r1.error
    assert getattr(plain[0].pipe.transformer, "hf_device_map", None) is None
    assert flagged[0].pipe.transformer.hf_device_map == {"": torch.device("cpu")}
    assert getattr(flagged[0].pipe.vae, "hf_device_map", None) is None
    q = r1.manifest["evidence"]["stages"]["denoise"]["memory"]["quantization"]["transformer"]
    assert q["method"] == "int8wo" and q["quantized_linears"] == q["linears"] > 0
    a, b = _images(tmp_path / "plain"), _images(tmp_path / "flagged")
    assert a.keys() == b.keys() and len(a) == 2 and all(np.array_equal(a[k], b[k]) for k in a)
