"""GPU end to end (issue #23): real runs of the runner on a CUDA GPU, each asserting that the evidence verdict is
``verified`` and that the profiled **device kernel names** match the selected backends' registry signatures
(``runner.kernels.registry.signature``), not only the CPU-side ``aten::`` op names.

Every GPU test is marked ``cuda`` (``sm90`` where the rule asserted is Hopper's), so ``scripts/ci/cuda.sh`` runs them
and ``scripts/ci/cpu.sh`` deselects them; on a machine without a GPU they are skipped with the reason
(``tests/conftest.py``). A backend that cannot run on the GPU at hand (``flash-attn``/``flashinfer`` not installed,
FP8 below sm89, a head_dim a kernel has no instantiation for) is skipped with the registry's own reasons
(``Backend.unmet``); :func:`test_sm90_runs_every_backend_it_must` fails when a backend that must run on a Hopper GPU
with the packages installed here is refused, so those skips cannot hide a regression.

What runs (bf16 unless said):

* the backend matrix: every attention backend wired into diffusers x every linear backend, on ``tiny_flux`` at
  head_dim 64 (SageAttention 1.x has no head_dim-32 kernel) and on the trained ``toy_shapes``;
* ``auto`` (the recorded choice and reason against the registry's ``auto_select`` for this device);
* ``compile=regional`` (a subprocess per run: verified from the kernels alone, no recompilation after the warm-up);
* the negative control: a layer switched to another backend after resolution ends in exit 3 (``evidence_mismatch``);
* the other families in tiny form (tiny_sd3, tiny_qwen_image, tiny_wan, toy_motion; tiny_hidream with
  ``backend.moe`` TRITON, GROUPED_MM, TORCH and auto);
* every step-cache method on toy_shapes, with its reuse counted per item;
* data parallelism: torchrun with 2 ranks sharing one GPU (or one each on a multi-GPU host);
* ``python -m runner.repro`` of a GPU run (PSNR mode).

Device kernel names are told apart from CPU-side op names by the profiled trace itself: in-process runs capture
``DenoiserProbe.trace`` through a wrapper around ``models.denoiser_evidence.build`` (:func:`captured_traces`); subprocess runs
go through ``tests/_gpu_shim.py``, which writes it next to the run. ``GPU_E2E_SUMMARY=<file.jsonl>`` appends one line
per verified run (test, backends, the device kernels matched), for benchmarks/results.

CPU twins (no marker): the same helpers and plumbing on CPU runs (the evidence check, ``auto``'s recorded reason, the
negative control and torchrun through the shim in subprocesses, a step cache, repro in PSNR mode) and the kernel-name
checks on synthetic H200-shaped traces, so that the logic the GPU tests rely on runs on every CPU runner. The torchrun
twin found a runner bug (an embedded snapshot committed by a rank != 0 without its text encoders' weights), fixed in
``models.pipelines.PipelineEngine.embedded_snapshot``; regression tests in tests/test_families.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set

import pytest
import torch

from runner.kernels import registry as reg

try:
    from _helpers import compose
except ImportError:  # tests/ imported as a package
    from tests._helpers import compose

REPO = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().with_name("_gpu_shim.py")
STAGE = "denoise"

GPU = ["platform=cuda", "dtype=bfloat16"]
CPU = ["platform=cpu"]
# tiny_flux with head_dim 64 (2 heads x 64; rope axes summing to 64): every attention kernel has an instantiation for
# it (SageAttention 1.x: 64/96/128, FlashInfer: 64/128/256); the embedded model is built once into the session cache
TINY_FLUX_HD64 = ["model=tiny_flux", "model.architecture.transformer.attention_head_dim=64",
                  "model.architecture.transformer.axes_dims_rope=[16,24,24]"]
MATRIX_MODELS = {
    "tiny_flux_hd64": [*TINY_FLUX_HD64, "dataset.limit=2", "batch_size=2"],
    "toy_shapes": ["model=toy_shapes", "model.generation.num_inference_steps=8", "dataset.limit=2", "batch_size=2"],
}
ATTENTION = reg.wired("attention", "diffusers")  # TORCH_SDPA, CUDNN_ATTN, FLASH_ATTN, SAGE_ATTN, FLASHINFER_ATTN
LINEAR = list(reg.BACKENDS["linear"])  # TORCH, FP8


# ------------------------------------------------------------------------------------------ kernel-name checks


def top_level_alternatives(regex: str) -> List[str]:
    """The alternatives of ``regex`` split at its top-level ``|`` (not inside groups or classes)."""
    out, depth, cls, cur, i = [], 0, False, [], 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            cur.append(regex[i:i + 2])
            i += 2
            continue
        if cls:
            cls = c != "]"
        elif c == "[":
            cls = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            out.append("".join(cur))
            cur = []
            i += 1
            continue
        cur.append(c)
        i += 1
    out.append("".join(cur))
    return out


def names_device_kernels(regex: str) -> bool:
    """The signature can match a device kernel: one of its alternatives is not an ``aten::`` op name (MoE TORCH's
    ``aten::scatter_reduce`` is an op-level signature by design: diffusers' expert loop has no kernel of its own)."""
    return any(not alt.startswith("aten::") for alt in top_level_alternatives(regex))


def matching(regex: str, names: Sequence[str]) -> List[str]:
    pat = re.compile(regex, re.I)
    return sorted(n for n in names if pat.search(n))


def foreign_attention_kernels(device_names: Sequence[str], selected: Set[str]) -> Dict[str, List[str]]:
    """Device kernels of attention backends other than ``selected``: names matching another backend's signature and
    none of the selected ones' (TORCH_SDPA's signature also covers the cuDNN kernel torch's SDPA may pick, so a cuDNN
    kernel is not foreign to TORCH_SDPA; a cuDNN or flash kernel in a SAGE_ATTN run is)."""
    own = [reg.signature("attention", b) for b in selected]
    out = {}
    for name, rec in reg.BACKENDS["attention"].items():
        if name in selected or not rec.signature:
            continue
        hits = [n for n in matching(rec.signature, device_names)
                if not any(s and re.search(s, n, re.I) for s in own)]
        if hits:
            out[name] = hits
    return out


def check_names(field_name: str, backend: str, names: Optional[Sequence[str]], device: str,
                trace: Optional[Dict[str, Dict[str, int]]]) -> List[str]:
    """The names the evidence matched for ``backend`` all match its registry signature, and on a GPU at least one of
    them is a device kernel (from the trace when there is one; else a name that is not an ``aten::`` op). Returns
    the device kernel names matched."""
    sig = reg.signature(field_name, backend)
    assert sig, f"{field_name} {backend} has no profiler signature in the registry"
    assert names, f"no profiled name matched {field_name} {backend}'s signature /{sig}/"
    stray = [n for n in names if not re.search(sig, n, re.I)]
    assert not stray, f"{field_name} {backend}: names listed that do not match /{sig}/: {stray}"
    if trace is not None:
        seen = set(trace["kernels"]) | set(trace["ops"])
        assert set(names) <= seen, f"listed names the profiler did not record: {sorted(set(names) - seen)}"
    if device != "cuda" or not names_device_kernels(sig):
        return []
    if trace is not None:
        dev = [n for n in names if n in trace["kernels"]]
    else:
        dev = [n for n in names if not n.startswith("aten::")]
    assert dev, (f"{field_name} {backend}: only CPU-side ops matched /{sig}/ ({list(names)}); no device kernel of it "
                 f"ran in the profiled forward")
    return dev


def check_evidence(manifest: Dict[str, Any], trace: Optional[Dict[str, Dict[str, int]]], attention: Any,
                   linear: str = "TORCH", moe: Optional[str] = None, device: str = "cuda",
                   status: str = "completed") -> Dict[str, Any]:
    """Assert a run is verified and its kernels match the selected backends' signatures.

    Args:
        manifest: the run's (or a worker's) manifest.
        trace: ``{"kernels": {...}, "ops": {...}}`` of the profiled forward (None: not captured).
        attention: the backend every call site selected, or ``{role: backend}``.
        linear, moe: the selected linear / MoE backend (moe None: the model has no MoE layers).
        device: ``cuda`` (device kernels required) or ``cpu``.

    Returns:
        ``{"stage": the evidence section, "device_kernels": {field: {backend: [names]}}}``.
    """
    ev = manifest["evidence"]
    assert manifest["status"] == status, (manifest["status"], ev.get("mismatches"), manifest.get("error"))
    assert ev["verdict"] == "verified", ev["mismatches"]
    assert ev["mismatches"] == [] and ev["all_finite"] is True
    assert str(ev["device"]).split(":")[0] == device, ev["device"]
    st = ev["stages"][STAGE]
    b = manifest["backends"][STAGE]
    sel = {role: spec["backend"] for role, spec in b["attention"]["selected"].items()}
    if isinstance(attention, dict):
        assert sel == attention, sel
    else:
        assert set(sel.values()) == {attention}, sel
    want = set(sel.values())
    assert b["linear"]["selected"] == linear, b["linear"]
    if moe is not None:
        assert b["moe"]["selected"] == moe, b["moe"]
    # call sites: every attention site ran only its selected backend (compiled: not observed per call)
    assert set(st["attention"]["by_backend"]) == want, st["attention"]["by_backend"]
    for lay in st["attention"]["layers"]:
        assert lay["resolved"] == sel[lay["role"]], lay
        if lay["ok"] is not None:
            assert lay["ok"] and set(lay["observed"]) == {lay["resolved"]} and lay["calls"] > 0, lay
    assert st["linear"]["resolved"] == linear
    # profiled kernels
    k = st["kernels"]
    assert k["profiled"] is True, k
    dev: Dict[str, Dict[str, List[str]]] = {"attention": {}, "linear": {}}
    for name in want:
        dev["attention"][name] = check_names("attention", name, k["attention"].get(name), device, trace)
    dev["linear"][linear] = check_names("linear", linear, k["linear"].get(linear), device, trace)
    if moe is not None:
        assert st["moe"]["resolved"] == moe, st["moe"]
        dev["moe"] = {moe: check_names("moe", moe, k["moe"].get(moe), device, trace)}
        others = {n: v for n, v in k["moe"].items() if n != moe and v}
        assert not others, f"MoE resolved {moe}, but other MoE backends' kernels ran: {others}"
    if device == "cuda" and trace is not None:
        foreign = foreign_attention_kernels(list(trace["kernels"]), want)
        assert not foreign, f"attention resolved {sorted(want)}, but other backends' kernels ran: {foreign}"
    _summary(manifest, sel, linear, moe, dev)
    return {"stage": st, "device_kernels": dev}


def _summary(manifest: Dict[str, Any], sel: Dict[str, str], linear: str, moe: Optional[str],
             dev: Dict[str, Dict[str, List[str]]]) -> None:
    """``GPU_E2E_SUMMARY=<file>``: one JSON line per verified run (for benchmarks/results)."""
    path = os.environ.get("GPU_E2E_SUMMARY")
    if not path:
        return
    st = manifest["evidence"]["stages"][STAGE]
    line = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
            "model": (manifest.get("model") or {}).get("name"), "device": manifest["evidence"].get("device"),
            "device_name": ((manifest.get("platform") or {}).get("probes") or {}).get("device_name"),
            "attention": sel, "linear": linear, "moe": moe, "verdict": manifest["evidence"]["verdict"],
            "denoiser_forwards": st.get("denoiser_forwards"), "device_kernels_matched": dev,
            "compile": manifest.get("compile"), "wall_s": (manifest.get("timing") or {}).get("wall_s"),
            # what ran and at which commit, for the support matrix (runner.tools.support_matrix)
            "overrides": manifest.get("overrides"), "commit": (manifest.get("git") or {}).get("commit"),
            "date": manifest.get("started_at")}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


# ------------------------------------------------------------------------------------------------- runs


@contextlib.contextmanager
def captured_traces() -> Iterator[Dict[str, Dict[str, Dict[str, int]]]]:
    """``{stage: {"kernels": {...}, "ops": {...}}}`` of every evidence build inside the block (the profiled
    denoiser forward, device kernels and CPU-side ops apart)."""
    from models import denoiser_evidence as evidence

    traces: Dict[str, Dict[str, Dict[str, int]]] = {}
    real = evidence.build

    def build(stage, probes, denoiser, *args, **kwargs):
        if denoiser is not None and denoiser.trace is not None:
            traces[stage] = {"kernels": dict(denoiser.trace.kernels), "ops": dict(denoiser.trace.ops)}
        return real(stage, probes, denoiser, *args, **kwargs)

    evidence.build = build
    try:
        yield traces
    finally:
        evidence.build = real


@dataclass
class Run:
    """What one run left: its dir, exit code (or the error it raised) and the profiled traces."""

    run_dir: Path
    code: Optional[int]
    error: Optional[BaseException] = None
    traces: Dict[str, Any] = field(default_factory=dict)
    stdout: str = ""

    @property
    def manifest(self) -> Dict[str, Any]:
        return json.loads((self.run_dir / "manifest.json").read_text())

    @property
    def items(self) -> List[Dict[str, Any]]:
        return [json.loads(x) for x in (self.run_dir / "items.jsonl").read_text().splitlines() if x.strip()]

    @property
    def trace(self) -> Optional[Dict[str, Dict[str, int]]]:
        return self.traces.get(STAGE)


def run_inprocess(run_dir: Path, overrides: Sequence[str], base: Sequence[str] = GPU) -> Run:
    """Compose ``base + overrides`` as ``python -m runner`` does and run ``runner.app.execute.run`` into ``run_dir``,
    capturing the profiled traces."""
    from runner.app.execute import run

    ov = [*base, *overrides]
    cfg = compose(ov)
    with captured_traces() as traces:
        code = run(cfg, Path(run_dir), ov)
    return Run(Path(run_dir), code, traces=dict(traces))


def shim_env(traces: Optional[Path] = None, swap: Optional[str] = None) -> Dict[str, str]:
    """This process's environment (the session's RUNNER_CACHE), offline, the repository root first on PYTHONPATH,
    and the shim's variables."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPU_E2E_TRACES", "GPU_E2E_SWAP"):
        env.pop(k, None)
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
        env["GPU_E2E_TRACES"] = str(traces)
    if swap is not None:
        env["GPU_E2E_SWAP"] = swap
    return env


def run_shim(run_dir: Path, overrides: Sequence[str], base: Sequence[str] = GPU, swap: Optional[str] = None,
             torchrun: int = 0, timeout: int = 540) -> Run:
    """``python tests/_gpu_shim.py <base + overrides> hydra.run.dir=<run_dir>`` (or under ``torchrun`` with that
    many ranks) in a subprocess; traces read back from ``<run_dir>.traces/<pid>.json`` by the manifest's pid."""
    traces_dir = Path(f"{run_dir}.traces")
    args = [*base, *overrides, f"hydra.run.dir={run_dir}"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
                if torchrun else [sys.executable])
    p = subprocess.run([*launcher, str(SHIM), *args], cwd=run_dir.parent, env=shim_env(traces_dir, swap),
                       capture_output=True, text=True, timeout=timeout)
    out = Run(Path(run_dir), p.returncode, stdout=p.stdout[-4000:] + "\n" + p.stderr[-8000:])
    for f in sorted(traces_dir.glob("*.json")):
        out.traces[f.stem] = json.loads(f.read_text())
    return out


def pid_trace(run: Run, manifest: Dict[str, Any]) -> Optional[Dict[str, Dict[str, int]]]:
    """The trace the shim wrote for the process that wrote ``manifest`` (its evidence's pid)."""
    return (run.traces.get(str(manifest["evidence"].get("pid"))) or {}).get(STAGE)


# ------------------------------------------------------------------------------------------------ fixtures


def _sm() -> int:
    major, minor = torch.cuda.get_device_capability(0)
    return major * 10 + minor


class GpuRuns:
    """In-process GPU runs of this module, each made once (a later test reuses an earlier one's run)."""

    def __init__(self, root: Path):
        self.root = root
        self.runs: Dict[str, Any] = {}

    def run(self, name: str, overrides: Sequence[str]) -> Run:
        """The run ``name`` (made now on first use); a run that raised raises the same error again."""
        if name not in self.runs:
            try:
                self.runs[name] = run_inprocess(self.root / name, overrides)
            except Exception as e:  # noqa: BLE001 - kept for the next test that asks for this run
                self.runs[name] = e
        got = self.runs[name]
        if isinstance(got, Exception):
            raise got
        return got


@pytest.fixture(scope="module")
def gpu(tmp_path_factory) -> GpuRuns:
    return GpuRuns(tmp_path_factory.mktemp("gpu_e2e"))


def require(overrides: Sequence[str], **backends: str) -> None:
    """Skip, with the registry's reasons, when a backend cannot run on this GPU for the model of ``overrides``
    (bf16, the model's head_dim and mask); only ``unmet`` requirements skip: a wiring or kernel failure fails."""
    from models.registry import engine_class

    cfg = compose([*GPU, *overrides])
    tr = cfg.model.architecture.get("transformer") or {}
    head_dim = tr.get("attention_head_dim")
    ctx = reg.SelectionContext(platform_kind="cuda", sm=_sm(), dtype=torch.bfloat16,
                               head_dim=int(head_dim) if head_dim is not None else None,
                               needs_mask=bool(engine_class(str(cfg.model.engine)).needs_mask))
    for fld, name in backends.items():
        why = reg.get(fld, name).unmet(ctx)
        if why:
            pytest.skip(f"backend.{fld}={name} cannot run on {torch.cuda.get_device_name(0)} sm{ctx.sm} for "
                        f"model={cfg.model.name} (head_dim {ctx.head_dim}): " + "; ".join(why))


def need_video() -> None:
    if importlib.util.find_spec("imageio_ffmpeg") is None:
        pytest.skip("video models write MP4 through imageio-ffmpeg's ffmpeg, and imageio-ffmpeg is not installed")


def matrix_overrides(model: str, attention: str, linear: str) -> List[str]:
    return [*MATRIX_MODELS[model], f"backend.attention={attention}", f"backend.linear={linear}"]


def _forwards(st: Dict[str, Any]) -> int:
    assert st["denoiser_forwards"] == st["expected_forwards"] and st["denoiser_forwards"] > 0, st
    return st["denoiser_forwards"]


# --------------------------------------------------------------------------------- the backend matrix (GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("linear", LINEAR)
@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("model", list(MATRIX_MODELS))
def test_backend_matrix_verified_with_device_kernels(gpu, model, attention, linear):
    """Each attention backend x each linear backend, bf16: exit 0, every call site ran its backend once per denoiser
    forward, every eligible linear module its linear backend, and the profiled forward's device kernels match both
    signatures (cuDNN's ``cudnn_generated_fort_native_sdpa_*``, SageAttention's ``_attn_fwd``, cuBLASLt's
    ``nvjet_*``, FP8 ``nvjet_sm90_qq*``/``e4m3`` GEMMs), with no other attention backend's kernel in it."""
    ov = matrix_overrides(model, attention, linear)
    require(ov, attention=attention, linear=linear)
    r = gpu.run(f"{model}-{attention}-{linear}", ov)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    m = r.manifest
    st = check_evidence(m, r.trace, attention, linear)["stage"]
    fwd = _forwards(st)
    for lay in st["attention"]["layers"]:
        assert lay["observed"] == {attention: fwd}, lay
    lin = st["linear"]
    assert lin["modules"] > 0 and lin["observed"][linear] >= lin["modules"] * fwd, lin
    assert set(lin["observed"]) <= {linear, "TORCH"}, lin  # lossy lanes leave the ineligible Linears dense
    if linear == "TORCH":
        assert set(lin["observed"]) == {"TORCH"}
    lossy = reg.is_lossy("attention", attention) or reg.is_lossy("linear", linear)
    assert m["lossy"]["lossy"] is lossy, m["lossy"]
    assert all(it["status"] == "ok" for it in r.items) and len(r.items) == 2


# --------------------------------------------------------------------------------------------------- auto


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.sm90])])
def test_auto_records_the_choice_and_the_reason(gpu, tmp_path, device):
    """``auto`` everywhere: the recorded choice and reason are the registry's ``auto_select`` for this device (sm90:
    CUDNN_ATTN, first in Hopper's order and fitting the shape; CPU: TORCH_SDPA, the only one), linear TORCH (FP8 is
    lossy and never chosen), and the run verifies with the chosen backend's kernels."""
    from models.registry import engine_class

    base = GPU if device == "cuda" else CPU
    ov = [*TINY_FLUX_HD64, "dataset.limit=1", "model.generation.num_inference_steps=2"]
    r = gpu.run("auto", ov) if device == "cuda" else run_inprocess(tmp_path / "auto", ov, base=CPU)
    assert r.code == 0
    m = r.manifest
    cfg = compose([*base, *ov])
    ctx = reg.SelectionContext(platform_kind=device, sm=_sm() if device == "cuda" else None,
                               dtype=torch.bfloat16 if device == "cuda" else torch.float32, head_dim=64,
                               needs_mask=engine_class(str(cfg.model.engine)).needs_mask)
    want, why = reg.auto_select("attention", ctx, reg.wired("attention", "diffusers"))
    assert want == ("CUDNN_ATTN" if device == "cuda" else "TORCH_SDPA")
    a = m["backends"][STAGE]["attention"]
    assert (a["requested"], a["layer"], a["explicit"]) == ("auto", "auto", False)
    assert a["selected"] == {"joint": {"backend": want, "quant": None, "skip_softmax": None}}
    assert a["reason"] == f"joint: {why}", a["reason"]
    if device == "cuda":
        assert "cuDNN SDPA supports the shape" in a["reason"]
    lin = m["backends"][STAGE]["linear"]
    assert (lin["layer"], lin["selected"]) == ("auto", "TORCH")
    assert lin["reason"] == reg.auto_select("linear", ctx)[1] and "never chosen by auto" in lin["reason"]
    check_evidence(m, r.trace, want, "TORCH", device=device)


# --------------------------------------------------------------------------------------- compile=regional


@pytest.mark.cuda
@pytest.mark.parametrize("attention,linear", [("CUDNN_ATTN", "TORCH"), ("SAGE_ATTN", "FP8")])
def test_compile_regional_verified_from_kernels_without_recompiles(tmp_path, attention, linear):
    """``compile=regional`` (one process per run: a fresh dynamo): the per-call counters are off under compile, so
    the verdict rests on the profiled kernels, which must match the backends' signatures as in eager mode; two rows
    of one shape after the warm-up compile nothing more (``compile.graphs_compiled_after_warmup == 0``)."""
    ov = [*TINY_FLUX_HD64, "dataset.limit=2", "batch_size=1", "compile=regional",
          f"backend.attention={attention}", f"backend.linear={linear}"]
    require(ov, attention=attention, linear=linear)
    r = run_shim(tmp_path / "run", ov)
    assert r.code == 0, r.stdout
    m = r.manifest
    trace = pid_trace(r, m)
    assert trace is not None, f"the shim wrote no trace for pid {m['evidence'].get('pid')}: {list(r.traces)}"
    st = check_evidence(m, trace, attention, linear)["stage"]
    assert all(lay["ok"] is None and lay["calls"] is None for lay in st["attention"]["layers"])  # not observed
    comp = m["compile"]
    assert comp["mode"] == "regional" and comp["regions"]["blocks"], comp
    assert comp["warmup_s"] > 0
    assert comp["graphs_compiled_after_warmup"] == 0, comp  # no recompilation in the generation loop
    assert len(r.items) == 2 and all(it["status"] == "ok" for it in r.items)


# --------------------------------------------------------------------------------------- negative control

NEGATIVE = {  # device -> (resolved backend, diffusers entry switched to after resolution, what the probe reports)
    "cpu": ("TORCH_SDPA", "_native_math", "diffusers:_native_math"),
    "cuda": ("CUDNN_ATTN", "native", "TORCH_SDPA"),
}
SWAPPED = "transformer_blocks.0.attn"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_backend_swapped_after_resolution_exits_3(tmp_path, device):
    """The negative control through the real CLI (``tests/_gpu_shim.py`` = ``python -m runner`` plus a hook): after
    the backends were resolved and installed, one layer is switched to another dispatcher entry. The run writes
    every item, then ends with exit 3: ``job_status.json`` outcome ``evidence_mismatch``, the manifest's verdict
    ``mismatch`` naming that layer, what was resolved and what ran instead; every other layer is still ok."""
    resolved, entry, ran = NEGATIVE[device]
    ov = ["model=tiny_flux", "dataset.limit=1", "model.generation.num_inference_steps=2",
          f"backend.attention={resolved}"]
    if device == "cuda":
        require(ov, attention=resolved)
    r = run_shim(tmp_path / "neg", ov, base=GPU if device == "cuda" else CPU, swap=f"{SWAPPED}={entry}")
    assert r.code == 3, r.stdout
    assert "EvidenceError" in r.stdout, r.stdout
    status = json.loads((r.run_dir / "job_status.json").read_text())
    assert (status["exit_code"], status["outcome"], status["error_type"]) == (3, "evidence_mismatch",
                                                                              "EvidenceError"), status
    m = r.manifest
    ev = m["evidence"]
    assert m["status"] == "evidence_mismatch" and ev["verdict"] == "mismatch"
    st = ev["stages"][STAGE]
    fwd = st["denoiser_forwards"]
    layers = {lay["layer"]: lay for lay in st["attention"]["layers"]}
    assert layers[SWAPPED]["ok"] is False and layers[SWAPPED]["observed"] == {ran: fwd}, layers[SWAPPED]
    assert all(lay["ok"] and lay["observed"] == {resolved: fwd} for name, lay in layers.items() if name != SWAPPED)
    per_layer = [x for x in ev["mismatches"] if "layer " in x]
    assert len(per_layer) == 1, ev["mismatches"]
    assert re.search(r"(?<![\w.])transformer_blocks\.0\.attn", per_layer[0]) and f"resolved {resolved}" in per_layer[0]
    assert ran in per_layer[0], per_layer[0]
    assert len(r.items) == 1 and r.items[0]["status"] == "ok"  # written before the error
    # the hook really changed nothing but that layer: the trace of the same process was captured
    assert pid_trace(r, m) is not None


# ------------------------------------------------------------------------------------------ other families

FAMILY_LANES = [("TORCH_SDPA", "TORCH"), ("CUDNN_ATTN", "FP8")]
FAMILIES = {  # model -> (overrides, writes video)
    "tiny_sd3": (["model=tiny_sd3", "dataset.limit=1"], False),
    "tiny_qwen_image": (["model=tiny_qwen_image", "dataset.limit=1"], False),
    "tiny_wan": (["model=tiny_wan", "dataset.limit=1"], True),
    "tiny_ltx2": (["model=tiny_ltx2", "dataset.limit=1"], True),  # video with its FLAC audio stream
    "tiny_hunyuanvideo15": (["model=tiny_hunyuanvideo15", "dataset.limit=1"], True),
    "toy_motion": (["model=toy_motion", "dataset.limit=1", "model.generation.num_inference_steps=8"], True),
    # issue #31: FLUX.2-dev (guidance embedding), klein base (CFG: 2 forwards per step), Z-Image (batched CFG)
    "tiny_flux2": (["model=tiny_flux2", "dataset.limit=1"], False),
    "tiny_flux2_klein": (["model=tiny_flux2_klein", "dataset.limit=1"], False),
    "tiny_zimage": (["model=tiny_zimage", "dataset.limit=1"], False),
}


@pytest.mark.cuda
@pytest.mark.parametrize("attention,linear", FAMILY_LANES, ids=[f"{a}-{b}" for a, b in FAMILY_LANES])
@pytest.mark.parametrize("model", list(FAMILIES))
def test_family_on_gpu_verified_with_device_kernels(gpu, model, attention, linear):
    """SD3.5, Qwen-Image (its joint attention passes a mask), Wan (self- and cross-attention roles, unbatched CFG:
    2 forwards per step), LTX-2 (video and audio streams, batched CFG; its audio decodes to the recorded samples) and
    the trained toy_motion, tiny, bf16: verified, forwards as the family's rule says, and
    the device kernels of the selected attention and linear backends in the profiled forward."""
    overrides, video = FAMILIES[model]
    if video:
        need_video()
    ov = [*overrides, f"backend.attention={attention}", f"backend.linear={linear}"]
    require(ov, attention=attention, linear=linear)
    r = gpu.run(f"{model}-{attention}-{linear}", ov)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    st = check_evidence(r.manifest, r.trace, attention, linear)["stage"]
    fwd = _forwards(st)
    assert all(lay["observed"] == {attention: fwd} for lay in st["attention"]["layers"])
    if model in ("tiny_wan", "toy_motion", "tiny_ltx2"):
        assert {lay["role"] for lay in st["attention"]["layers"]} == {"self", "cross"}
    assert r.items[0]["status"] == "ok" and r.items[0]["file"].endswith(".mp4" if video else ".png")
    if model == "tiny_ltx2":  # the audio written on the GPU decodes to its recorded samples
        from runner.core.video import audio_sha256, read_audio

        pcm, rate = read_audio(r.run_dir / r.items[0]["file"])
        assert audio_sha256(pcm) == r.items[0]["audio_sha256"] and rate == r.items[0]["params"]["audio_sample_rate"]


HIDREAM = ["model=tiny_hidream", "dataset.limit=1", "backend.attention=CUDNN_ATTN"]


@pytest.mark.cuda
@pytest.mark.parametrize("moe", ["TRITON", "GROUPED_MM", "TORCH"])
def test_hidream_moe_backend_on_gpu(gpu, moe):
    """tiny_hidream (routed SwiGLU experts in every block) with each MoE backend: every MoE block computed its routed
    experts with the selected implementation once per forward, and the profiled forward holds its kernels (TRITON:
    ``_moe_gate_up_silu_kernel``/``_moe_down_kernel``; GROUPED_MM: torch's CUTLASS grouped GEMM, its
    ``prepare_grouped_gemm_data`` setup kernel; TORCH: diffusers' loop, whose signature is the
    ``aten::scatter_reduce_`` op) and none of the others'."""
    ov = [*HIDREAM, f"backend.moe={moe}"]
    require(ov, attention="CUDNN_ATTN", moe=moe)
    r = gpu.run(f"tiny_hidream-{moe}", ov)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    st = check_evidence(r.manifest, r.trace, "CUDNN_ATTN", "TORCH", moe=moe)["stage"]
    fwd = _forwards(st)
    sec = st["moe"]
    assert sec["sites"] == 4 and sec["calls"] == {moe: 4 * fwd}, sec  # 2 dual- + 2 single-stream MoE blocks
    assert all(lay["ok"] and lay["observed"] == {moe: fwd} for lay in sec["layers"])
    assert {lay["role"] for lay in st["attention"]["layers"]} == {"joint", "single"}


@pytest.mark.cuda
def test_hidream_moe_auto_measures_on_gpu(gpu):
    """``backend.moe=auto`` where TRITON, GROUPED_MM and TORCH can all run: each is timed at startup on the model's
    MoE block shape on this GPU, the fastest is selected, the timings are the recorded reason, and the run verifies
    with the selected backend's kernels."""
    require(HIDREAM, attention="CUDNN_ATTN", moe="TRITON")
    require(HIDREAM, moe="GROUPED_MM")
    r = gpu.run("tiny_hidream-auto", HIDREAM)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    b = r.manifest["backends"][STAGE]["moe"]
    assert (b["layer"], b["resolved"]) == ("auto", "auto") and b["selected"] in ("TRITON", "GROUPED_MM", "TORCH"), b
    reason = b["reason"]
    assert reason.startswith("measured at startup on cuda"), reason
    times = {n: float(re.search(rf"\b{n} ([0-9.]+) ms", reason).group(1)) for n in ("TRITON", "GROUPED_MM", "TORCH")}
    assert b["selected"] == min(times, key=times.get) and reason.endswith(f"; {b['selected']} is the fastest")
    check_evidence(r.manifest, r.trace, "CUDNN_ATTN", "TORCH", moe=b["selected"])


# ---------------------------------------------------------------------------------------------- step caching

CACHE_METHODS = {  # method -> overrides (fixed: their schedule; adaptive: a threshold that hits on toy_shapes)
    "first_block": ["cache.method=first_block", "cache.threshold=0.2"],
    "magcache": ["cache.method=magcache", "cache.calibrate=true"],  # ratios calibrated for toy_shapes (issue #33)
    "taylorseer": ["cache.method=taylorseer", "cache.compute_every=2", "cache.warmup_steps=3"],
    "pab": ["cache.method=pab", "cache.compute_every=2"],
    "dbcache": ["cache.method=dbcache", "cache.fn_compute_blocks=1", "cache.warmup_steps=4"],  # cache-dit
    "dbcache_taylorseer": ["cache.method=dbcache_taylorseer", "cache.fn_compute_blocks=1", "cache.warmup_steps=4"],
}


@pytest.mark.parametrize("method,device", [*[pytest.param(m, "cuda", marks=pytest.mark.cuda) for m in CACHE_METHODS],
                                           ("taylorseer", "cpu")])
def test_step_cache_counts_reuse(gpu, tmp_path, method, device):
    """Each step-cache method on toy_shapes (16 steps; cuDNN attention on the GPU): blocks and forwards reused were
    counted from what executed (fixed schedules: exactly as the schedule predicts), the cache hit, attention sites
    ran their backend only in the forwards in which their module computed, and the kernels verify (the CPU twin:
    one fixed method, TORCH_SDPA, CPU ops)."""
    attention = "CUDNN_ATTN" if device == "cuda" else "TORCH_SDPA"
    ov = ["model=toy_shapes", "dataset.limit=1", f"backend.attention={attention}", *CACHE_METHODS[method]]
    if device == "cuda":
        require(ov, attention=attention)
        r = gpu.run(f"cache-{method}", ov)
    else:
        r = run_inprocess(tmp_path / "cache", ov, base=CPU)
    assert r.code == 0, r.manifest.get("evidence", {}).get("mismatches")
    m = r.manifest
    st = check_evidence(m, r.trace, attention, device=device)["stage"]
    assert _forwards(st) == 16
    c = r.items[0]["cache"]
    assert c["method"] == method and c["call_items"] == 1
    assert c["forwards_computed"] + c["forwards_reused"] == 16
    assert c["forwards_reused"] > 0 and c["blocks_reused"] > 0 and c["blocks_computed"] > 0, c
    assert c["blocks_computed"] + c["blocks_reused"] == 16 * 5  # toy_shapes: 2 double + 3 single blocks
    sec = st["cache"]
    assert sec["forwards_reused"] == c["forwards_reused"] and sec["calls"] == 1
    if sec["schedule"] == "fixed":
        assert sec["expected_forwards_reused"] == sec["forwards_reused"], sec
    if method in ("taylorseer", "pab"):  # attention modules answered from the cache ran their kernel less often
        assert all(lay["calls"] < 16 for lay in st["attention"]["layers"]), st["attention"]["layers"]
    assert m["lossy"] == {"lossy": True, "lanes": [f"cache={method}"],
                          "batch_dependent": [f"cache={method}"] if sec["schedule"] == "adaptive" else []}


# ----------------------------------------------------------------------------------------- data parallelism


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_data_parallel_two_ranks(tmp_path, device):
    """``torchrun --nproc-per-node 2 -m runner parallelism=data`` (through the shim): on one GPU both ranks share
    it, on more each takes its own (``LOCAL_RANK``). The merged manifest lists both workers, in different processes,
    each verified with the device kernels of the selected backends in its own profiled forward (the CPU twin: the
    same plumbing with CPU ops)."""
    attention = "CUDNN_ATTN" if device == "cuda" else "TORCH_SDPA"
    ov = ["model=tiny_flux", "parallelism=data", "dataset.limit=4", "model.generation.num_inference_steps=2",
          f"backend.attention={attention}"]
    if device == "cuda":
        require(ov, attention=attention)
    ov.append(f"cache_dir={tmp_path / 'cold_cache'}")  # both ranks find no embedded model: rank 0 builds it once
    d = tmp_path / "dp"
    r = run_shim(d, ov, base=GPU if device == "cuda" else CPU, torchrun=2)
    assert r.code == 0, r.stdout
    m = r.manifest
    assert m["status"] == "completed" and m["evidence"]["verdict"] == "verified", m["evidence"]["mismatches"]
    assert (m["parallelism"]["mode"], m["parallelism"]["world_size"], m["parallelism"]["launcher"]) == (
        "data", 2, "torchrun")
    ws = m["workers"]
    assert [w["rank"] for w in ws] == [0, 1] and len({w["pid"] for w in ws}) == 2
    assert all(w["status"] == "completed" and w["evidence_verdict"] == "verified" for w in ws), ws
    assert all(str(w["device"]).split(":")[0] == device for w in ws), ws
    if device == "cuda" and torch.cuda.device_count() == 1:
        assert {w["device"] for w in ws} == {"cuda:0"}  # two ranks on one GPU
    assert sum(w["shard_items"] for w in ws) == 4 and m["counts"]["ok"] == 4
    for rank in (0, 1):
        wm = json.loads((d / f"manifest.rank{rank}.json").read_text())
        trace = pid_trace(r, wm)
        assert trace is not None, f"rank {rank}: no trace for pid {wm['evidence'].get('pid')} ({list(r.traces)})"
        check_evidence(wm, trace, attention, device=device)


# ---------------------------------------------------------------------------------------------------- repro


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_repro_of_a_run_in_psnr_mode(gpu, tmp_path, device):
    """``python -m runner.repro <run> --out <new>`` of a finished run: the re-run (a new process, the manifest's
    overrides) verifies with the same backends and every item reproduces within the PSNR tolerance (the default mode
    off CPU; ``--psnr`` asks for it on CPU)."""
    if device == "cuda":
        ov = matrix_overrides("tiny_flux_hd64", "CUDNN_ATTN", "TORCH")
        require(ov, attention="CUDNN_ATTN")
        orig = gpu.run("tiny_flux_hd64-CUDNN_ATTN-TORCH", ov)
        attention, extra = "CUDNN_ATTN", []
    else:
        orig = run_inprocess(tmp_path / "orig", ["model=tiny_flux", "dataset.limit=2",
                                                 "model.generation.num_inference_steps=2"], base=CPU)
        attention, extra = "TORCH_SDPA", ["--psnr"]
    assert orig.code == 0
    new = tmp_path / "rerun"
    p = subprocess.run([sys.executable, "-m", "runner.repro", str(orig.run_dir), "--out", str(new), *extra],
                       cwd=tmp_path, env=shim_env(), capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check = json.loads((new / "repro_check.json").read_text())
    assert check["ok"] and check["problems"] == [], check
    assert (check["mode"], check["platform"]) == ("psnr", device) and check["tolerance_db"] > 0, check
    assert len(check["items"]) == len(orig.items) and all(it["verdict"] == "ok" for it in check["items"]), check
    rm = json.loads((new / "manifest.json").read_text())
    assert rm["backends"][STAGE]["attention"]["selected"] == orig.manifest["backends"][STAGE]["attention"]["selected"]
    check_evidence(rm, None, attention, device=device)  # no trace of the re-run: device names told by their form


# -------------------------------------------------------------------------------------------- sm90 coverage


@pytest.mark.sm90
def test_sm90_runs_every_backend_it_must():
    """On a Hopper GPU in bf16 at head_dim 64 the registry accepts every backend that must run here, with the packages
    this environment has (flash-attn, flashinfer, sageattention, triton where installed), and wires each attention
    backend into diffusers; TRTLLM_ATTN is refused naming sm100. So the matrix's skips (registry reasons) are only
    the packages that are absent."""
    from runner.kernels.attention import plan

    sm = _sm()
    ctx = reg.SelectionContext(platform_kind="cuda", sm=sm, dtype=torch.bfloat16, head_dim=64)
    must = [("attention", "TORCH_SDPA"), ("attention", "CUDNN_ATTN"), ("linear", "TORCH"), ("linear", "FP8"),
            ("moe", "TORCH"), ("moe", "GROUPED_MM")]
    optional = {("attention", "SAGE_ATTN"): "sageattention", ("attention", "FLASHINFER_ATTN"): "flashinfer",
                ("moe", "TRITON"): "triton"}
    must += [k for k, pkg in optional.items() if importlib.util.find_spec(pkg) is not None]
    if importlib.util.find_spec("flash_attn") or importlib.util.find_spec("flash_attn_interface"):
        must.append(("attention", "FLASH_ATTN"))
    refused = {f"{f}.{n}": reg.get(f, n).unmet(ctx) for f, n in must if reg.get(f, n).unmet(ctx)}
    assert not refused, refused
    for f, n in must:
        if f == "attention":
            plan(n, sm)  # raises AttentionWiringError when it cannot be wired into diffusers here
    assert any("sm100" in w for w in reg.get("attention", "TRTLLM_ATTN").unmet(ctx))
    wired = set(reg.wired("attention", "diffusers"))
    assert {n for f, n in must if f == "attention"} <= wired


# ------------------------------------------------------------------------------- helper logic on CPU (twins)


def test_cpu_twin_evidence_check_of_an_inprocess_run(tmp_path):
    """check_evidence on a CPU run of tiny_flux: the captured trace holds every name the manifest matched, and the
    CPU-side ops are the names on CPU (no device kernel required there)."""
    r = run_inprocess(tmp_path / "cpu", ["model=tiny_flux", "dataset.limit=1", "model.generation.num_inference_steps=2",
                                        "backend.attention=TORCH_SDPA", "backend.linear=TORCH"], base=CPU)
    assert r.code == 0 and r.trace is not None and r.trace["kernels"] == {}
    out = check_evidence(r.manifest, r.trace, "TORCH_SDPA", "TORCH", device="cpu")
    assert out["device_kernels"] == {"attention": {"TORCH_SDPA": []}, "linear": {"TORCH": []}}
    names = r.manifest["evidence"]["stages"][STAGE]["kernels"]["attention"]["TORCH_SDPA"]
    assert set(names) <= set(r.trace["ops"])
    with pytest.raises(AssertionError, match="no device kernel"):  # these names judged as a GPU run's: CPU ops only
        check_names("attention", "TORCH_SDPA", names, "cuda", r.trace)
    with pytest.raises(AssertionError, match="no device kernel"):  # without a trace: aten:: names are ops
        check_names("attention", "TORCH_SDPA", names, "cuda", None)


def test_signature_alternatives_tell_device_signatures_from_op_signatures():
    for name in ATTENTION:
        assert names_device_kernels(reg.signature("attention", name)), name
    assert all(names_device_kernels(reg.signature("linear", n)) for n in ("TORCH", "FP8"))
    assert names_device_kernels(reg.signature("moe", "TRITON"))
    assert not names_device_kernels(reg.signature("moe", "TORCH"))  # diffusers' loop: an op-level signature
    assert top_level_alternatives(r"aten::x_(a|b)|c\|d|[|]e") == ["aten::x_(a|b)", r"c\|d", "[|]e"]


# device kernel names seen on the H200 (benchmarks/results/*h200*.json)
CUDNN_K = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0"
FLASH_K = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, "
           "cutlass::bfloat16_t>>")
SAGE_K = ["_attn_fwd", "quant_per_block_int8_kernel"]
NVJET = "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_bias_TNT"
NVJET_FP8 = "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT"


def _synthetic(attention: str, kernels: Sequence[str], ops: Sequence[str], linear: str = "TORCH"):
    """A manifest as a verified GPU run writes it, with the attention/linear names the evidence would have matched
    from a trace of ``kernels`` (device) and ``ops`` (CPU side)."""
    from models.denoiser_evidence import KernelTrace

    t = KernelTrace(ops={o: 1 for o in ops}, kernels={k: 1 for k in kernels})
    st = {"denoiser_forwards": 1, "expected_forwards": 1,
          "attention": {"by_backend": {attention: 1}, "layers": [
              {"role": "joint", "layer": "transformer_blocks.0.attn", "resolved": attention, "calls": 1,
               "observed": {attention: 1}, "ok": True}]},
          "linear": {"resolved": linear, "modules": 1, "observed": {linear: 1}},
          "kernels": {"profiled": True, "attention": {attention: t.match(reg.signature("attention", attention))},
                      "linear": {linear: t.match(reg.signature("linear", linear))}}}
    m = {"status": "completed", "evidence": {"verdict": "verified", "mismatches": [], "all_finite": True,
                                             "device": "cuda:0", "stages": {STAGE: st}},
         "backends": {STAGE: {"attention": {"selected": {"joint": {"backend": attention}}},
                              "linear": {"selected": linear}, "moe": {"selected": None}}}}
    return m, {"kernels": dict(t.kernels), "ops": dict(t.ops)}


@pytest.mark.parametrize("attention,kernels,ops,linear,problem", [
    ("CUDNN_ATTN", [CUDNN_K, NVJET], ["aten::_scaled_dot_product_cudnn_attention", "aten::addmm"], "TORCH", None),
    ("TORCH_SDPA", [CUDNN_K, NVJET], ["aten::_scaled_dot_product_cudnn_attention", "aten::addmm"], "TORCH", None),
    ("TORCH_SDPA", [FLASH_K, NVJET], ["aten::_scaled_dot_product_flash_attention", "aten::addmm"], "TORCH", None),
    ("SAGE_ATTN", [*SAGE_K, NVJET_FP8, NVJET], ["aten::_scaled_mm", "aten::addmm"], "FP8", None),
    # a cuDNN kernel in a SAGE run: another backend's kernel ran
    ("SAGE_ATTN", [*SAGE_K, CUDNN_K, NVJET], ["aten::addmm"], "TORCH", "other backends' kernels ran"),
    # torch's flash kernel in a CUDNN_ATTN run (the op-level name matched, the kernel was not cuDNN's)
    ("CUDNN_ATTN", [FLASH_K, NVJET], ["aten::_scaled_dot_product_cudnn_attention", "aten::addmm"], "TORCH",
     "no device kernel"),
    # FP8 resolved, only the op recorded: no FP8 GEMM kernel ran on the device
    ("CUDNN_ATTN", [CUDNN_K, NVJET], ["aten::_scaled_mm", "aten::addmm"], "FP8", "no device kernel"),
    # the inductor record_function label of a user Triton kernel is a CPU-side name, not a device kernel
    ("SAGE_ATTN", [NVJET], ["_attn_fwd_2", "quant_per_block_int8_kernel_0", "aten::addmm"], "TORCH",
     "no device kernel"),
], ids=["cudnn", "sdpa-on-cudnn", "sdpa-on-flash", "sage-fp8", "sage-with-cudnn", "cudnn-op-only-flash-kernel",
        "fp8-op-only", "sage-inductor-labels-only"])
def test_kernel_checks_on_synthetic_traces(attention, kernels, ops, linear, problem):
    """check_evidence's device-kernel rules on traces shaped like the H200's: accepted when a device kernel of each
    selected backend ran and no other attention backend's did; refused naming why otherwise."""
    m, trace = _synthetic(attention, kernels, ops, linear)
    if problem is None:
        out = check_evidence(m, trace, attention, linear)
        assert out["device_kernels"]["attention"][attention]
    else:
        with pytest.raises(AssertionError, match=problem):
            check_evidence(m, trace, attention, linear)


def test_shim_writes_traces_and_swaps(tmp_path, monkeypatch):
    """tests/_gpu_shim.py's pieces in this process: a trace file per pid merged per stage, and the swap of one
    attention module's dispatcher entry."""
    import types

    sys.path.insert(0, str(SHIM.parent))
    try:
        import _gpu_shim as shim
    finally:
        sys.path.remove(str(SHIM.parent))
    t = types.SimpleNamespace(kernels={"k": 2}, ops={"aten::x": 1})
    p = shim.write_trace(str(tmp_path), "a", t)
    shim.write_trace(str(tmp_path), "b", t)
    assert Path(p).name == f"{os.getpid()}.json"
    assert json.loads(Path(p).read_text()) == {s: {"kernels": {"k": 2}, "ops": {"aten::x": 1}} for s in "ab"}
    from diffusers.models.attention_dispatch import AttentionBackendName

    proc = types.SimpleNamespace(_attention_backend=AttentionBackendName.NATIVE)
    attn = torch.nn.Module()
    attn.processor = proc
    den = torch.nn.Module()
    den.add_module("blocks", torch.nn.ModuleList([attn]))
    shim.swap_attention(types.SimpleNamespace(denoiser=den), "blocks.0", "_native_math")
    assert proc._attention_backend == AttentionBackendName._NATIVE_MATH
