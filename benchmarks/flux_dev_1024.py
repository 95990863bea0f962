"""FLUX.1-dev at 1024x1024, 28 steps: plain diffusers vs the runner, side by side in one process on one GPU.

Variants, on identical weights (``load_format=dummy``: the same builder, ``models.flux.build_components``, with
the same seed on the same device) and identical per-row seeds:

(a) ``baseline``: plain diffusers. ``FluxPipeline`` called once per prompt (default attention: torch SDPA, which
    picks FlashAttention-2 on Hopper), each image saved with PIL (``Image.save``, PNG), in the caller's thread.
(b) ``lossless``: the runner (``runner.app.execute.run``) with the preset ``experiment=flux_dev_h200`` (bf16 weights
    and activations; cuDNN attention, regional ``torch.compile``, fused QKV, channels-last VAE, batched rows, PNGs
    encoded on writer threads).
(c) ``fp8``: (b) with ``backend.linear=FP8`` (row-wise dynamic e4m3 scaling, ``torch._scaled_mm``).
(d) ``torchao_fp8``: (b) with ``backend.linear=FP8_TORCHAO`` (torchao's dynamic row-wise float8), beside (c).
(e) ``fp8_attn``: (b) with FP8 linear (``--fp8-linear``; ``auto``: the faster of (c)/(d) measured in this
    invocation, else ``FP8``) and ``backend.attention=SAGE2_ATTN`` (SageAttention 2's sm90 INT8-QK/FP8-PV kernel).
(f) ``cache``: (b) with a fixed-schedule step cache, TaylorSeer lite (``cache.method=taylorseer cache.lite=true``:
    whole blocks skipped, ``proj_out`` Taylor-extrapolated) computing steps ``0..W-1`` and then one step in ``N``
    (``--cache-every N``, ``--cache-warmup W``; 4 and 3: 9 of 28 steps computed, 28/9 = 3.1x fewer transformer
    forwards whatever the weights), compiled beneath the cache's hooks.
(g) ``cache_fp8``: (f) with FP8 linear (and SAGE2_ATTN with ``--cache-fp8-attn``).
(h) ``lossless_<mode>``: (b) with ``optimize.compile_mode=<mode>`` (``max_autotune_no_cudagraphs``; the CUDA-graph
    modes are refused by the runner: ``lossless_reduce_overhead`` failed on the H200 with torch's "output of
    CUDAGraphs overwritten" error, one graph being replayed for every block), deterministic compile kept (the
    max-autotune mode then chooses kernels without timing them, so it may equal ``default``).

Also: ``--second-process`` runs (b) in two fresh runner processes, one after the other, on 4 prompts (one batch):
the first fills the compile cache, the second's warm-up seconds and the cache hits torch counted are reported;
``--gate`` runs the quality gate on toy_shapes (its 96 builtin rows, oracle accuracy per attribute): lossless vs the cache, FP8 (linear + attention)
and cache + FP8 lanes, through ``runner.app.execute`` and ``runner.tools.gate`` (PSNR/SSIM with torchmetrics), and writes
``accuracy_ratio_*`` (the lowest lossy/lossless ratio over the attributes). PSNR/SSIM of every lossy FLUX variant
against (b)'s images are reported too (``fidelity_vs_lossless``).

Measured per variant: ms per denoising step (per image), model FLOPs utilization of the denoising loop (model
FLOPs of one forward counted by ``torch.utils.flop_counter.FlopCounterMode`` at the workload shape, divided by
the time, as a fraction of the bf16 matmul rate measured in this process), per-phase seconds, end-to-end
images/hour of the generation loop, peak device memory, PSNR against (a) per image. Also: host-device syncs
inside the denoising loop of (b) (``torch.cuda.set_sync_debug_mode``), graphs compiled after the warm-up, and
the runner's evidence verdict.

Warm-up and repeat policy: each variant first runs one untimed pipeline call of 2 steps at the workload shape
(for (b)/(c) this is the runner's own ``optimize.warmup``, which also compiles); then every prompt is generated
once and timed. Model building, loading and warm-up are reported apart (``setup_s``) and are not in images/hour.
Baseline phases come from CUDA events recorded by forward hooks on the text encoders, the transformer and the
VAE decoder (no synchronisation is added); the runner's come from its manifest.

Usage:
    python benchmarks/flux_dev_1024.py --out DIR                  # canonical workload (one CUDA GPU, ~7 min)
    python benchmarks/flux_dev_1024.py --smoke --out DIR          # tiny_flux on the CPU: checks the script
    python benchmarks/flux_dev_1024.py --ablation --out DIR       # each optimization alone, at the step level
    python benchmarks/flux_dev_1024.py --prompts 8 --variants baseline,lossless,fp8,torchao_fp8 --second-process \
        --out DIR --results A.json                                 # issue #18, invocation 1 (~6 min on the H200)
    python benchmarks/flux_dev_1024.py --prompts 8 --variants baseline,lossless,fp8_attn,cache,cache_fp8 --gate \
        --fp8-linear FP8 --out DIR --results B.json                # invocation 2
Results: ``DIR/flux_dev_1024.json`` (committed figures: ``benchmarks/results/flux_dev_1024_h200.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from common import prompt_rows, time_ms, write_jsonl  # noqa: E402

TARGETS = {"speedup_lossless": 1.45, "mfu_lossless": 0.80, "psnr_lossless_db": 40.0, "speedup_fp8": 2.3,
           "speedup_cache": 2.5, "speedup_cache_fp8": 3.5, "accuracy_ratio_cache": 0.97, "accuracy_ratio_fp8": 0.97,
           "warmup_second_process_s": 3.0, "runner_overhead": 1.03}  # issue #18 (#7's psnr/overhead kept)
LOWER_IS_BETTER = ("runner_overhead", "warmup_second_process_s")
DEFINITIONS = {
    "speedup_X": "images/hour of variant X / images/hour of the plain diffusers baseline, same invocation",
    "speedup_lossless": "variant lossless (bf16, cuDNN attention, regional compile, fused QKV, batched)",
    "speedup_fp8": "variant fp8_attn: FP8 linear + the FP8/INT8 attention (SAGE2_ATTN)",
    "speedup_fp8_linear": "variant fp8: our FP8 linear (torch._scaled_mm), bf16 cuDNN attention",
    "speedup_torchao_fp8": "variant torchao_fp8: torchao's Float8DynamicActivationFloat8WeightConfig(PerRow)",
    "speedup_cache": "variant cache: TaylorSeer lite fixed schedule, bf16",
    "speedup_cache_fp8": "variant cache_fp8: the same cache with FP8 linear",
    "mfu_lossless": "model FLOPs of a forward / lossless ms per step / measured bf16 matmul rate",
    "accuracy_ratio_X": "toy_shapes gate: min over colour/shape/position of lossy accuracy / lossless accuracy",
    "warmup_second_process_s": "compile warm-up (2-step call at the batch shape, compile cache filled by the "
                               "lossless variant) of a fresh process: manifest compile.warmup_s",
}


# ------------------------------------------------------------------------------------------------ helpers
def compose(overrides: List[str]):
    """The run config exactly as ``python -m runner <overrides>`` composes it."""
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="bench"):
        return hydra.compose("config", overrides=overrides)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()


def matmul_tflops(device: str, m: int, n: int, k: int, repeats: int = 30) -> float:
    """Median TFLOP/s of ``(m,k) @ (k,n)`` in bf16 (fp32 on CPU), timed with CUDA events (2*m*n*k FLOP)."""
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    a = torch.randn(m, k, device=device, dtype=dt)
    b = torch.randn(k, n, device=device, dtype=dt)
    return 2 * m * n * k / (time_ms(lambda: a @ b, device, warmup=5, iters=repeats) / 1e3) / 1e12


class PhaseEvents:
    """Per-call phase times of a diffusers pipeline from events recorded by forward hooks (CUDA events on GPUs,
    host clocks on the CPU); nothing synchronises until :meth:`collect`, after the call returned.

    Phases: ``text_encode`` (first text-encoder pre-hook to last post-hook), ``denoise`` (first transformer
    forward to the last; Wan 2.2 A14B: either expert's), ``vae_decode`` (VAE decoder forward), in seconds.
    """

    def __init__(self, pipe: Any, device: str):
        self.cuda = device.startswith("cuda")
        self.marks: List[tuple] = []
        for phase, mod in (("text_encode", pipe.text_encoder), ("text_encode", getattr(pipe, "text_encoder_2", None)),
                           ("denoise", pipe.transformer), ("denoise", getattr(pipe, "transformer_2", None)),
                           ("vae_decode", pipe.vae.decoder)):
            if not isinstance(mod, torch.nn.Module):  # a pipeline without a second text encoder / expert
                continue
            mod.register_forward_pre_hook(lambda m, a, _p=phase: self._mark(_p, "start"))
            mod.register_forward_hook(lambda m, a, o, _p=phase: self._mark(_p, "end"))

    def _mark(self, phase: str, kind: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        self.marks.append((phase, kind, ev))

    def collect(self) -> Dict[str, float]:
        """Seconds per phase of the marks since the last collect (synchronises)."""
        out: Dict[str, float] = {}
        for phase in ("text_encode", "denoise", "vae_decode"):
            evs = [(k, e) for p, k, e in self.marks if p == phase]
            if not evs:
                continue
            first = next(e for k, e in evs if k == "start")
            last = [e for k, e in evs if k == "end"][-1]
            if self.cuda:
                last.synchronize()
                out[phase] = first.elapsed_time(last) / 1e3
            else:
                out[phase] = last - first
        self.marks = []
        return out


def forward_flops(pipe: Any, prompt: str, height: int, width: int, max_sequence_length: int) -> float:
    """Model FLOPs of one transformer forward (batch 1) at the workload shape, counted by ``FlopCounterMode``
    (matmuls and attention; elementwise work is not counted, as in MFU convention). The inputs are those the
    pipeline itself prepares, captured by a forward pre-hook during a 1-step call."""
    from torch.utils.flop_counter import FlopCounterMode

    captured: Dict[str, Any] = {}

    def grab(mod, args, kwargs):
        if not captured:
            captured.update(kwargs)

    h = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        pipe(prompt=prompt, height=height, width=width, num_inference_steps=1, output_type="latent",
             max_sequence_length=max_sequence_length)
    h.remove()
    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        pipe.transformer(**captured)
    return float(fc.get_total_flops())


# ------------------------------------------------------------------------------------------------ variants
def save_png(output: Any, i: int, path: Path) -> Path:
    """The ``i``-th image of a pipeline output, saved with PIL as a user would (``Image.save``, PNG)."""
    path = path.with_suffix(".png")
    output.images[i].save(path)
    return path


def run_baseline(cfg: Any, items: List[Any], out: Path, device: str, dtype: torch.dtype,
                 count_flops: bool = True, batch_size: int = 1, pipe: Any = None,
                 save: Callable[[Any, int, Path], Path] = save_png, what: Optional[str] = None,
                 subdir: str = "baseline") -> Dict[str, Any]:
    """(a): plain diffusers, the pipeline called in a loop over the rows, ``batch_size`` rows per call (a list of
    prompts and one seeded generator per row), each output saved by ``save(output, index, path_stem)`` (default: PIL
    PNG). ``pipe``: an already built pipeline (default: ``FluxPipeline`` from ``models.flux.build_components``); the
    call takes the row's prompt, negative prompt (where the row has one), size and steps, and the model's
    ``max_sequence_length``, ``guidance_scale``, ``num_frames``, ``guidance_scale_2`` where the pipeline takes them.
    Returns the variant record and ``{key: saved path}``."""
    import inspect

    from omegaconf import OmegaConf

    free(device)
    t0 = time.perf_counter()
    if pipe is None:
        from diffusers import FluxPipeline

        from models.flux import build_components

        arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
        pipe = FluxPipeline(**build_components(arch, device=device, dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    g = cfg.model.generation
    msl = int(g.max_sequence_length)
    takes = set(inspect.signature(type(pipe).__call__).parameters)
    model_kw = {k: g.get(k) for k in ("num_frames", "guidance_scale_2") if k in takes and g.get(k) is not None}

    def call(batch: List[Any], steps: Optional[int] = None, **kw: Any) -> Any:
        r = batch[0].row
        args = dict(prompt=[it.row.prompt for it in batch], height=r.height, width=r.width,
                    num_inference_steps=steps or r.num_inference_steps, guidance_scale=r.guidance_scale,
                    max_sequence_length=msl, **model_kw, **kw)
        if r.negative_prompt is not None and "negative_prompt" in takes:
            args["negative_prompt"] = [it.row.negative_prompt for it in batch]
        with torch.inference_mode():
            return pipe(**args)

    r0 = items[0].row
    flops = forward_flops(pipe, r0.prompt, r0.height, r0.width, msl) if count_flops else None
    call(items[:1], steps=2, generator=torch.Generator("cpu").manual_seed(0))  # warm-up, 2 steps, untimed
    sync(device)
    setup_s = time.perf_counter() - t0
    events = PhaseEvents(pipe, device)
    img_dir = out / subdir
    img_dir.mkdir(parents=True, exist_ok=True)
    phases = {"text_encode": 0.0, "denoise": 0.0, "vae_decode": 0.0, "save": 0.0}
    per_image = []
    files = {}
    t_loop = time.perf_counter()
    for b0 in range(0, len(items), batch_size):
        batch = items[b0:b0 + batch_size]
        t0 = time.perf_counter()
        output = call(batch, generator=[torch.Generator("cpu").manual_seed(it.seed) for it in batch])
        t1 = time.perf_counter()
        for i, it in enumerate(batch):
            files[it.key] = save(output, i, img_dir / it.filename_stem)
        t2 = time.perf_counter()
        ph = events.collect()
        for k, v in ph.items():
            phases[k] += v
        phases["save"] += t2 - t1
        per_image += [round((t2 - t0) / len(batch), 4)] * len(batch)
    loop_s = time.perf_counter() - t_loop
    steps = sum(it.row.num_inference_steps for it in items)
    rec = {
        "what": what or "diffusers FluxPipeline per prompt + PIL save",
        "setup_s": round(setup_s, 2), "loop_s": round(loop_s, 3), "images": len(items), "batch_size": batch_size,
        "images_per_hour": round(3600 * len(items) / loop_s, 1),
        "s_per_image": round(loop_s / len(items), 4), "per_image_s": per_image,
        "phases_s": {k: round(v, 3) for k, v in phases.items()},
        "ms_per_step": round(1e3 * phases["denoise"] / steps, 2),
        "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.startswith("cuda") else None,
        "attention": "torch SDPA default (torch.nn.functional.scaled_dot_product_attention)",
        "flops_per_forward": flops,
    }
    del pipe, events
    return rec, files


def run_runner(name: str, overrides: List[str], out: Path, device: str,
               on_loaded: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
    """(b)/(c): ``runner.app.execute.run`` with ``overrides``; returns the variant record and ``{key: png path}``."""
    from runner.app import execute

    free(device)
    cfg = compose(overrides)
    run_dir = out / name
    t0 = time.perf_counter()
    code = execute.run(cfg, run_dir, overrides, on_loaded=on_loaded)
    wall = time.perf_counter() - t0
    m = json.loads((run_dir / "manifest.json").read_text())
    items = [json.loads(line) for line in (run_dir / "items.jsonl").read_text().splitlines() if line.strip()]
    t = m["timing"]
    ph = t["phases_s"]
    steps = sum(r["params"]["num_inference_steps"] for r in items)
    measured = ph.get("text_encode", 0) + ph.get("denoise", 0) + ph.get("vae_decode", 0) + t["write_wait_s"]
    rec = {
        "overrides": overrides, "exit_code": code, "status": m["status"], "wall_s": round(wall, 2),
        "setup_s": round(t["load_s"] + t["warmup_s"], 2), "load_s": t["load_s"], "warmup_s": t["warmup_s"],
        "loop_s": t["loop_s"], "images": len(items),
        "images_per_hour": t.get("images_per_hour", t.get("videos_per_hour")),  # a video family: videos/hour
        "s_per_image": round(t["loop_s"] / max(1, len(items)), 4),
        "phases_s": ph, "write_thread_s": t["write_s"], "write_wait_s": t["write_wait_s"],
        "ms_per_step": round(1e3 * ph.get("denoise", 0) / steps, 2),
        "runner_overhead": round(t["loop_s"] / measured, 4) if measured else None,
        "peak_memory_gb": round(m["memory"].get("device_peak_allocated_bytes", 0) / 1e9, 2) or None,
        "batch_size": m["config"]["batch_size"], "compile": m.get("compile"), "optimize": m.get("optimize"),
        "backends": {f: v.get("selected") for f, v in m["backends"]["denoise"].items()},
        "evidence": {"verdict": m["evidence"]["verdict"], "mismatches": m["evidence"]["mismatches"],
                     "kernels": (m["evidence"].get("stages", {}).get("denoise", {}).get("kernels", {})
                                 .get("attention"))},
        "run_dir": str(run_dir),
    }
    files = {r["key"]: run_dir / r["file"] for r in items if r.get("status") == "ok"}
    return rec, files


def sync_counter(device: str, batch_index: int = 1) -> tuple:
    """An ``on_loaded`` hook that counts implicit host-device syncs (``torch.cuda.set_sync_debug_mode('warn')``)
    between the first and the last transformer forward of the ``batch_index``-th pipeline call (the 1st call's
    first forward is profiled by the evidence probe, which synchronises on purpose)."""
    state = {"calls": 0, "syncs": None, "on": False}
    caught: List[Any] = []

    def on_loaded(adapter: Any) -> None:
        if not device.startswith("cuda"):
            return
        cm = warnings.catch_warnings(record=True)

        def te_pre(m, a):
            if m is adapter.pipe.text_encoder:
                state["calls"] += 1

        def tr_pre(m, a):
            if state["calls"] == batch_index + 1 and not state["on"] and state["syncs"] is None:
                caught[:] = [cm.__enter__()]
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                state["on"] = True

        def vae_pre(m, a):
            if state["on"]:
                torch.cuda.set_sync_debug_mode(0)
                rec = caught[0]
                state["syncs"] = [str(w.message)[:200] for w in rec
                                  if "called a synchronizing" in str(w.message).lower()]
                cm.__exit__(None, None, None)
                state["on"] = False

        adapter.pipe.text_encoder.register_forward_pre_hook(te_pre)
        adapter.pipe.transformer.register_forward_pre_hook(tr_pre)
        adapter.pipe.vae.decoder.register_forward_pre_hook(vae_pre)

    return on_loaded, state


def psnr_vs(ref: Dict[str, Path], files: Dict[str, Path]) -> Dict[str, Any]:
    """PSNR (dB) of each image against the reference image of the same item: mean, min, per item."""
    from runner.tools.report import load_rgb, psnr

    vals = {k: psnr(load_rgb(ref[k]), load_rgb(p)) for k, p in files.items() if k in ref}
    finite = [v for v in vals.values() if math.isfinite(v)]
    return {"mean_db": round(statistics.mean(finite), 2) if finite else (math.inf if vals else None),
            "min_db": round(min(vals.values()), 2) if vals else None, "items": len(vals),
            "per_item_db": {k: round(v, 2) if math.isfinite(v) else "inf" for k, v in vals.items()}}


def fidelity_vs(ref: Dict[str, Path], files: Dict[str, Path]) -> Dict[str, Any]:
    """PSNR (dB) and SSIM of each image against the reference image of the same item (``runner.tools.gate``'s
    torchmetrics metrics): mean and min of each."""
    from runner.tools.gate import item_metrics

    vals = [item_metrics(p, ref[k]) for k, p in files.items() if k in ref]
    ps = [v["psnr_db"] for v in vals if v.get("psnr_db") is not None]
    ss = [v["ssim"] for v in vals if v.get("ssim") is not None]
    finite = [x for x in ps if math.isfinite(x)]
    return {"items": len(vals),
            "psnr_mean_db": round(statistics.mean(finite), 2) if finite else (math.inf if ps else None),
            "psnr_min_db": round(min(ps), 2) if ps else None,
            "ssim_mean": round(statistics.mean(ss), 5) if ss else None, "ssim_min": round(min(ss), 5) if ss else None}


def second_process(overrides: List[str], out: Path, prompts: Path, n: int) -> Dict[str, Any]:
    """(b) again in two fresh ``python -m runner`` processes, one after the other, on the first ``n`` prompts (one
    batch at the variant's batch size, the shape the warm-up compiles): the first fills the compile cache as a
    runner process does (the in-process run's entries need not match a runner process's: the benchmark's process
    state differs), the second reads it. Returned: the second's warm-up seconds, the cache status torch counted and
    the process's wall time, with the first's record under ``first_process``. Each process's stderr is kept beside
    its run dir (``stderr.log``)."""
    first = _runner_process(overrides, out / "first_process", prompts, n)
    rec = _runner_process(overrides, out / "second_process", prompts, n)
    rec["first_process"] = first
    return rec


def _runner_process(overrides: List[str], run_dir: Path, prompts: Path, n: int) -> Dict[str, Any]:
    import subprocess

    cmd = [sys.executable, "-m", "runner", *overrides, "dataset=jsonl", f"dataset.path={prompts}",
           f"dataset.limit={n}", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    env = dict(__import__("os").environ)
    env["PYTHONPATH"] = str(ROOT) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run(cmd, cwd=str(run_dir.parent), env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "stderr.log").write_text(p.stderr)
    rec: Dict[str, Any] = {"command": " ".join(cmd[1:]), "exit_code": p.returncode, "wall_s": round(wall, 2)}
    mf = run_dir / "manifest.json"
    if not mf.is_file():
        rec["stderr_tail"] = p.stderr[-2000:]
        return rec
    m = json.loads(mf.read_text())
    comp = m.get("compile") or {}
    cache = comp.get("cache") or {}
    t = m.get("timing") or {}
    rec.update({"warmup_s": comp.get("warmup_s"), "cache_status": cache.get("status"),
                "cache_counters": cache.get("counters"), "cache_key": cache.get("key"), "cache_dir": cache.get("dir"),
                "existed_before": cache.get("existed_before"), "load_s": t.get("load_s"),
                "graphs_compiled_after_warmup": comp.get("graphs_compiled_after_warmup"),
                "images": (m.get("counts") or {}).get("ok"), "loop_s": t.get("loop_s"),
                "evidence_verdict": (m.get("evidence") or {}).get("verdict")})
    ph = t.get("phases_s") or {}
    steps = int(m["config"]["model"]["generation"]["num_inference_steps"])
    if rec["warmup_s"] is not None and ph.get("denoise"):  # the warm-up call's own generation, from the loop's rate
        gen = ph.get("text_encode", 0) + ph["denoise"] * 2 / steps + ph.get("vae_decode", 0)
        rec["warmup_generation_estimate_s"] = round(gen, 3)
        rec["warmup_compile_load_s"] = round(rec["warmup_s"] - gen, 3)
    return rec


def gate_toy_shapes(out: Path, lanes: Dict[str, List[str]], platform: str, extra: List[str] = (),
                    reuse_lossless: bool = False) -> Dict[str, Any]:
    """The quality gate on toy_shapes (96 builtin rows with expectations): a lossless job and one job per lossy
    lane (``lanes``: name -> overrides), each through ``runner.app.execute.run`` (compile off: the numerics of the
    lanes, not their speed), then ``runner.tools.gate.evaluate``. Returns per lane the accuracy ratios, PSNR/SSIM and
    verdict, and ``accuracy_ratio`` (min ratio over the attributes). ``extra``: overrides of every job (a CPU check
    on fewer rows: ``dataset.limit=N``); ``reuse_lossless``: a lossless job already complete under ``out/gate`` (an
    earlier call of the same process gating another lane) is read, not run again."""
    from runner.app import execute
    from runner.tools.gate import evaluate
    from runner.tools.report import load_jobs

    root = out / "gate"
    base = ["model=toy_shapes", f"platform={platform}"]
    if platform == "cuda":  # as benchmarks/toy_shapes_gpu.sh: 24 rows x 4 images = 96 items
        base += ["dtype=bfloat16", "num_images_per_prompt=4", "batch_size=8"]
    base += list(extra)
    res: Dict[str, Any] = {"jobs": {}}
    dirs = []
    for name, ov in [("lossless", [])] + list(lanes.items()):
        done = root / name / "manifest.json"
        if name == "lossless" and reuse_lossless and done.is_file() and json.loads(done.read_text()).get(
                "status") == "completed":
            m = json.loads(done.read_text())
            res["jobs"][name] = {"overrides": ov, "reused": True, "evidence": m["evidence"]["verdict"],
                                 "accuracy": {k: v for k, v in (m.get("accuracy") or {}).items() if k != "read"}}
            dirs.append(root / name)
            continue
        free("cuda" if platform == "cuda" else "cpu")
        t0 = time.perf_counter()
        try:
            code = execute.run(compose(base + ov), root / name, base + ov)
        except Exception as e:  # noqa: BLE001 - a lane that cannot run is reported, the others go on
            res["jobs"][name] = {"overrides": ov, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            continue
        m = json.loads((root / name / "manifest.json").read_text())
        res["jobs"][name] = {"overrides": ov, "exit_code": code, "seconds": round(time.perf_counter() - t0, 1),
                             "accuracy": {k: v for k, v in (m.get("accuracy") or {}).items() if k != "read"},
                             "evidence": m["evidence"]["verdict"],
                             "attention_kernels": m["evidence"].get("stages", {}).get("denoise", {})
                             .get("kernels", {}).get("attention")}
        dirs.append(root / name)
    doc = evaluate(load_jobs(dirs))
    res["gate_verdict"] = doc["verdict"]
    for e in doc["jobs"]:
        name = Path(e["lossy_path"]).name
        acc = e.get("accuracy") or {}
        ratios = [a["ratio"] for a in acc.values() if a.get("ratio") is not None]
        res["jobs"].setdefault(name, {}).update({
            "verdict": e["verdict"], "lanes": e.get("lanes"), "reasons": e.get("reasons"),
            "accuracy_ratios": {k: a["ratio"] for k, a in acc.items()}, "psnr_db": e.get("psnr_db"),
            "ssim": e.get("ssim"), "cache_hit_rate": e.get("cache_hit_rate"),
            "accuracy_ratio": min(ratios) if ratios else None})
    return res


# ------------------------------------------------------------------------------------------------ ablation
def ablation(cfg: Any, device: str, dtype: torch.dtype, matmul: float, forwards: int = 5,
             res: Optional[Dict[str, Any]] = None, save: Callable[[], None] = lambda: None) -> Dict[str, Any]:
    """Each optimization alone on the eager TORCH_SDPA transformer, then combined, at the step level:
    median ms of one transformer forward (CUDA events, ``forwards`` timed after 2 warm-ups) with the inputs the
    pipeline prepares at the workload shape; VAE decode and text encoding timed alone; batch 1 vs 4."""
    from diffusers import FluxPipeline
    from omegaconf import OmegaConf

    from runner.kernels import attention as attn_mod
    from models.flux import build_components
    from models.pipelines import fuse_qkv
    from runner.core.platform import detect

    free(device)
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    pipe = FluxPipeline(**build_components(arch, device=device, dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    g = cfg.model.generation
    captured: Dict[str, Any] = {}

    def grab(mod, args, kwargs):
        captured.setdefault("kw", kwargs)

    h = pipe.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    with torch.inference_mode():
        pipe(prompt="a red fox", height=g.height, width=g.width, num_inference_steps=1, output_type="latent",
             max_sequence_length=int(g.max_sequence_length))
    h.remove()
    kw1 = captured["kw"]
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        pipe.transformer(**kw1)
    flops = float(fc.get_total_flops())

    def batched(kw: Dict[str, Any], b: int) -> Dict[str, Any]:
        out = dict(kw)
        for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"):
            if out.get(k) is not None:
                out[k] = out[k].repeat(b, *([1] * (out[k].dim() - 1)))
        return out

    def time_fn(fn: Callable[[], Any], n: int = forwards) -> float:
        with torch.inference_mode():
            return time_ms(fn, device, warmup=2, iters=n)

    def fwd(kw=kw1):
        return lambda: pipe.transformer(**kw)

    plat = detect("cuda", None, ())
    res = {} if res is None else res
    res.update({"policy": f"median of {forwards} forwards after 2 warm-ups, CUDA events",
                "flops_per_forward": flops, "matmul_tflops": matmul})

    ref_out: Dict[str, Any] = {}

    def record(name: str, ms: float, images: int = 1, kw: Optional[Dict[str, Any]] = None) -> None:
        per = ms / images
        res[name] = {"ms_per_step": round(per, 2),
                     "mfu": round(flops / (per / 1e3) / (matmul * 1e12), 4) if flops else None}
        if images == 1:  # output parity vs the eager TORCH_SDPA transformer (the baseline's math), same inputs
            with torch.inference_mode():
                o = pipe.transformer(**(kw or kw1))[0].float()
            if "ref" not in ref_out:
                ref_out["ref"] = o
            r = ref_out["ref"]
            res[name]["max_abs_diff_vs_eager_sdpa"] = float((o - r).abs().max())
            res[name]["rel_l2_err_vs_eager_sdpa"] = float((o - r).norm() / r.norm())
        print(f"  ablation {name:<34} {per:8.2f} ms/step/image {res[name]}", flush=True)
        save()

    def top_kernels(n: int = 25) -> Dict[str, Any]:
        """Device time per kernel over one forward (torch.profiler), the biggest first, in ms."""
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            pipe.transformer(**kw1)
            torch.cuda.synchronize()
        tot: Dict[str, float] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                tot[ev.name] = tot.get(ev.name, 0.0) + ev.device_time_total / 1e3
        total = sum(tot.values())
        top = sorted(tot.items(), key=lambda kv: -kv[1])[:n]
        return {"device_ms_total": round(total, 2), "top_ms": {k[:140]: round(v, 3) for k, v in top}}

    def set_attention(name: str) -> None:
        sites = [("joint", n, m) for n, m in pipe.transformer.named_modules()
                 if m.__class__.__name__ == "FluxAttention"]
        attn_mod.install("denoise", sites, {"joint": {"backend": name}}, plat.sm, observe=False)

    set_attention("TORCH_SDPA")
    record("eager_torch_sdpa", time_fn(fwd()))
    set_attention("CUDNN_ATTN")
    record("eager_cudnn", time_fn(fwd()))
    set_attention("TORCH_SDPA")
    record("eager_torch_sdpa_batch4", time_fn(fwd(batched(kw1, 4))), images=4)
    # VAE alone: channels-last vs not; text encoders: 1 prompt x4 vs 4 prompts batched
    lat = torch.randn(1, 16, g.height // 8, g.width // 8, device=device, dtype=dtype)
    res["vae_decode_ms"] = round(time_fn(lambda: pipe.vae.decode(lat)), 2)
    pipe.vae.to(memory_format=torch.channels_last)
    res["vae_decode_channels_last_ms"] = round(time_fn(lambda: pipe.vae.decode(lat.contiguous(
        memory_format=torch.channels_last))), 2)
    enc = lambda n: pipe.encode_prompt(prompt=["a red fox"] * n, prompt_2=None, device=device,  # noqa: E731
                                       max_sequence_length=int(g.max_sequence_length))
    res["text_encode_x1_ms"] = round(time_fn(lambda: enc(1)), 2)
    res["text_encode_x4_batched_ms_per_prompt"] = round(time_fn(lambda: enc(4)) / 4, 2)
    # fused QKV alone (eager), then compile alone (on the fused model: compile is measured on top of it, both
    # alone vs eager fused, and combined with cuDNN)
    fuse_qkv(pipe.transformer)  # what optimize.fuse_qkv applies
    kw_fused = kw1
    record("eager_fused_qkv", time_fn(fwd(kw_fused)))
    pipe.transformer.compile_repeated_blocks(fullgraph=False, dynamic=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        pipe.transformer(**kw1)
    sync(device)
    res["compile_first_forward_s"] = round(time.perf_counter() - t0, 1)
    record("compiled_fused_torch_sdpa", time_fn(fwd()))
    set_attention("CUDNN_ATTN")
    torch._dynamo.reset()
    pipe.transformer.compile_repeated_blocks(fullgraph=False, dynamic=False)
    record("compiled_fused_cudnn", time_fn(fwd()))
    res["profile_compiled_fused_cudnn"] = top_kernels()
    record("compiled_fused_cudnn_batch4", time_fn(fwd(batched(kw1, 4))), images=4)
    from runner.kernels import linear as lin_mod

    torch._dynamo.reset()
    lin_mod.install(pipe.transformer, "FP8", observe=False)
    pipe.transformer.compile_repeated_blocks(fullgraph=False, dynamic=False)
    record("compiled_fused_cudnn_fp8", time_fn(fwd()))
    res["profile_compiled_fused_cudnn_fp8"] = top_kernels()
    return res


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--variants", default="baseline,lossless,fp8")
    p.add_argument("--smoke", action="store_true", help="tiny_flux on the CPU, small sizes: checks the script")
    p.add_argument("--ablation", action="store_true", help="only the step-level ablation")
    p.add_argument("--batch-size", type=int, default=None, help="override the preset's batch_size for (b), (c)")
    p.add_argument("--results", default=None, help="also write the JSON here")
    p.add_argument("--fp8-linear", default="auto", choices=["auto", "FP8", "FP8_TORCHAO"],
                   help="linear backend of fp8_attn and cache_fp8 (auto: the faster of fp8/torchao_fp8 measured)")
    p.add_argument("--attn", default="SAGE2_ATTN", help="the FP8/INT8 attention backend of fp8_attn")
    p.add_argument("--cache-every", type=int, default=4, help="cache: one step in N computed after the warm-up")
    p.add_argument("--cache-warmup", type=int, default=3, help="cache: first steps always computed")
    p.add_argument("--cache-fp8-attn", action="store_true", help="cache_fp8 also uses --attn")
    p.add_argument("--second-process", action="store_true",
                   help="after lossless: a fresh process with the compile cache filled, its warm-up seconds")
    p.add_argument("--gate", action="store_true", help="toy_shapes quality gate of the cache and FP8 lanes")
    args = p.parse_args()

    from runner.app.checks import resolve_dtype
    from runner.app.stages import build_engines

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(out / "prompts.jsonl", prompt_rows(args.prompts))
    cache_ov = ["cache.method=taylorseer", "cache.lite=true", f"cache.compute_every={args.cache_every}",
                f"cache.warmup_steps={args.cache_warmup}"]
    if args.smoke:
        base = ["model=tiny_flux", "platform=cpu", "model.generation.num_inference_steps=8"]
        lossless = base + ["optimize.fuse_qkv=true", "optimize.vae_channels_last=true", "batch_size=2"]
        if args.second_process:  # the compile cache is what a second process reads
            lossless.append("compile=regional")
        fp8 = tao = None  # FP8 needs sm89+
        cache = base + ["optimize.fuse_qkv=true", "batch_size=2", "compile=none", *cache_ov]
        device = "cpu"
    else:
        base = ["experiment=flux_dev_h200"]
        lossless = list(base)
        fp8 = base + ["backend.linear=FP8"]
        tao = base + ["backend.linear=FP8_TORCHAO"]
        cache = base + cache_ov
        device = "cuda"
    data = ["dataset=jsonl", f"dataset.path={prompts}"]
    if args.batch_size:
        lossless.append(f"batch_size={args.batch_size}")
        fp8 = fp8 and fp8 + [f"batch_size={args.batch_size}"]
        tao = tao and tao + [f"batch_size={args.batch_size}"]
        cache.append(f"batch_size={args.batch_size}")
    cfg = compose(base + data)
    dtype = resolve_dtype("bfloat16" if device == "cuda" else "float32", "cuda" if device == "cuda" else "cpu")
    engine = build_engines(cfg, base + data)[-1]
    items = engine.items(engine.read_rows()[0], cfg.seed)

    results: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python"] + sys.argv),
        "torch": torch.__version__,
        "policy": ("each variant: one untimed 2-step warm-up call at the workload shape (runner: optimize.warmup, "
                   "which also compiles), then every prompt once, timed; setup (build, load, warm-up, compile) "
                   "reported apart and not in images/hour; images/hour = images / generation-loop seconds "
                   "(first pipeline call to last PNG on disk)"),
        "workload": {"prompts": len(items), "width": items[0].row.width, "height": items[0].row.height,
                     "num_inference_steps": items[0].row.num_inference_steps,
                     "guidance_scale": items[0].row.guidance_scale, "dtype": str(dtype)},
        "targets": TARGETS,
        "definitions": DEFINITIONS,
    }
    res_path = out / "flux_dev_1024.json"

    def save() -> None:
        text = json.dumps(results, indent=2, default=str) + "\n"
        res_path.write_text(text)
        if args.results:
            Path(args.results).write_text(text)

    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        results["matmul_tflops"] = round(matmul_tflops(device, 8192, 8192, 8192), 1)
        results["matmul_tflops_flux_linear_shape"] = round(matmul_tflops(device, 4608, 12288, 3072), 1)
        print(f"bf16 matmul 8192^3: {results['matmul_tflops']} TFLOP/s", flush=True)
    else:
        results["matmul_tflops"] = round(matmul_tflops(device, 1024, 1024, 1024, repeats=5), 3)
    save()

    if args.ablation:
        ablation(cfg, device, dtype, matmul=results["matmul_tflops"], res=results.setdefault("ablation", {}),
                 save=save)
        save()
        return 0

    variants: Dict[str, Any] = {}
    files: Dict[str, Dict[str, Path]] = {}
    want = args.variants.split(",")
    if "baseline" in want:
        print("baseline ...", flush=True)
        variants["baseline"], files["baseline"] = run_baseline(cfg, items, out, device, dtype)
        results["flops_per_forward"] = variants["baseline"].pop("flops_per_forward")
        results["variants"] = variants
        save()
    def fp8_linear() -> str:
        if args.fp8_linear != "auto":
            return args.fp8_linear
        got = {n: variants[n]["ms_per_step"] for n in ("fp8", "torchao_fp8") if variants.get(n, {}).get("ms_per_step")}
        pick = min(got, key=got.get) if got else "fp8"
        return {"fp8": "FP8", "torchao_fp8": "FP8_TORCHAO"}[pick]

    def plan(name: str) -> Optional[List[str]]:
        if name == "lossless":
            return lossless
        if name.startswith("lossless_"):  # lossless_max_autotune, lossless_reduce_overhead, ...: compile modes
            mode = name[len("lossless_"):]
            return lossless + [f"optimize.compile_mode={mode}"] if device == "cuda" else None
        if name == "fp8":
            return fp8
        if name == "torchao_fp8":
            return tao
        if name == "cache":
            return cache
        if device != "cuda":
            return None
        if name == "fp8_attn":
            return fp8 and base + [f"backend.linear={fp8_linear()}", f"backend.attention={args.attn}"] + (
                [f"batch_size={args.batch_size}"] if args.batch_size else [])
        if name == "cache_fp8":
            return cache + [f"backend.linear={fp8_linear()}"] + (
                [f"backend.attention={args.attn}"] if args.cache_fp8_attn else [])
        return None

    modes = [w for w in want if w.startswith("lossless_")]
    for name in ("lossless", *modes, "fp8", "torchao_fp8", "fp8_attn", "cache", "cache_fp8"):
        ov = plan(name) if name in want else None
        if ov is None:
            continue
        print(f"{name} ...", flush=True)
        on_loaded, sync_state = sync_counter(device)
        try:
            variants[name], files[name] = run_runner(name, ov + data, out, device, on_loaded=on_loaded)
        except Exception as e:  # noqa: BLE001 - one variant that cannot run (a refused backend) is recorded
            variants[name] = {"overrides": ov, "error": f"{type(e).__name__}: {str(e)[:600]}"}
            print(f"  {name} failed: {variants[name]['error']}", flush=True)
            results["variants"] = variants
            save()
            continue
        if device == "cuda":
            variants[name]["syncs_in_denoising_loop"] = (len(sync_state["syncs"]) if sync_state["syncs"] is not None
                                                         else None)
            variants[name]["sync_messages"] = (sync_state["syncs"] or [])[:5]
        if "baseline" in files:
            variants[name]["psnr_vs_baseline"] = psnr_vs(files["baseline"], files[name])
        if name != "lossless" and "lossless" in files:  # a lossless_<mode> variant: bytes vs default compile
            variants[name]["fidelity_vs_lossless"] = fidelity_vs(files["lossless"], files[name])
        results["variants"] = variants
        save()
        if name == "lossless" and args.second_process:
            print("second process ...", flush=True)
            n = int(variants[name].get("batch_size") or 1)
            results["second_process"] = second_process(ov, out, prompts, n)
            results["warmup_second_process_s"] = results["second_process"].get("warmup_s")
            print(f"  {results['second_process']}", flush=True)
            save()

    if args.gate:
        print("toy_shapes gate ...", flush=True)
        lanes = {"cache": cache_ov}
        if device == "cuda":
            lin = fp8_linear()
            lanes["fp8"] = [f"backend.linear={lin}", f"backend.attention={args.attn}"]
            lanes["cache_fp8"] = cache_ov + [f"backend.linear={lin}"] + (
                [f"backend.attention={args.attn}"] if args.cache_fp8_attn else [])
        results["gate_toy_shapes"] = g = gate_toy_shapes(out, lanes, "cuda" if device == "cuda" else "cpu")
        for lane in lanes:
            results[f"accuracy_ratio_{lane}"] = (g["jobs"].get(lane) or {}).get("accuracy_ratio")
        save()

    # headline figures
    b = variants.get("baseline")
    flops = results.get("flops_per_forward")
    for name, v in variants.items():
        if flops and v.get("ms_per_step"):
            v["mfu"] = round(flops / (v["ms_per_step"] / 1e3) / (results["matmul_tflops"] * 1e12), 4)
            v["tflops_denoise"] = round(flops / (v["ms_per_step"] / 1e3) / 1e12, 1)
    ok = {k: v for k, v in variants.items() if "error" not in v}
    results["ms_per_step"] = {k: v.get("ms_per_step") for k, v in ok.items()}
    results["peak_memory_gb"] = {k: v.get("peak_memory_gb") for k, v in ok.items()}
    results["images_per_hour"] = {k: v.get("images_per_hour") for k, v in ok.items()}
    key_of = {"lossless": "speedup_lossless", "fp8": "speedup_fp8_linear", "torchao_fp8": "speedup_torchao_fp8",
              "fp8_attn": "speedup_fp8", "cache": "speedup_cache", "cache_fp8": "speedup_cache_fp8"}
    for name, key in key_of.items():
        v = ok.get(name)
        if v and b and b.get("images_per_hour"):
            results[key] = round(v["images_per_hour"] / b["images_per_hour"], 3)
            if v.get("psnr_vs_baseline"):
                results[f"psnr_{name}_db"] = v["psnr_vs_baseline"]["mean_db"]
                results[f"psnr_{name}_min_db"] = v["psnr_vs_baseline"]["min_db"]
    if ok.get("fp8") and ok.get("torchao_fp8"):
        a, t = ok["fp8"], ok["torchao_fp8"]
        results["fp8_linear_side_by_side"] = {
            "ms_per_step": {"FP8 (ours)": a.get("ms_per_step"), "FP8_TORCHAO": t.get("ms_per_step")},
            "images_per_hour": {"FP8 (ours)": a.get("images_per_hour"), "FP8_TORCHAO": t.get("images_per_hour")},
            "torchao_over_ours_speed": round(a["ms_per_step"] / t["ms_per_step"], 4)
            if a.get("ms_per_step") and t.get("ms_per_step") else None,
            "faster": "FP8_TORCHAO" if (t.get("ms_per_step") or 1e9) < (a.get("ms_per_step") or 1e9) else "FP8"}
    if "lossless" in ok:
        results["mfu_lossless"] = ok["lossless"].get("mfu")
        results["runner_overhead"] = ok["lossless"].get("runner_overhead")
    met = {}
    for key, goal in TARGETS.items():
        val = results.get(key)
        if val is None:
            continue
        met[key] = {"value": val, "target": goal, "met": (val <= goal) if key in LOWER_IS_BETTER else (val >= goal)}
    results["targets_met"] = met
    save()
    print(json.dumps({k: results.get(k) for k in ("device", "matmul_tflops", "flops_per_forward", "ms_per_step",
                                                   "images_per_hour", "speedup_lossless", "speedup_fp8",
                                                   "speedup_fp8_linear", "speedup_torchao_fp8", "speedup_cache",
                                                   "speedup_cache_fp8", "accuracy_ratio_cache", "accuracy_ratio_fp8",
                                                   "warmup_second_process_s", "mfu_lossless", "runner_overhead",
                                                   "peak_memory_gb", "targets_met")},
                     indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
