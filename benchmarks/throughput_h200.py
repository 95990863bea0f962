"""End-to-end cost per 1,000 items on one H200 (issue #41): the runner vs a plain diffusers script written as a user
would, FLUX.1-dev 1024x1024 (28 steps) and Wan 2.2 T2V-A14B 480p (832x480, 81 frames, 40 steps), random full-size
weights (``load_format=dummy``, the same builder and seed on both sides), the same rows and seeds.

Lanes per family (``--lanes``, each written to the results file as soon as it finishes):

* ``baseline``: plain diffusers (:func:`flux_dev_1024.run_baseline`): the pipeline (``FluxPipeline`` /
  ``WanPipeline``) called in a loop over the rows, ``--batch-size`` rows per call, default attention (torch SDPA),
  eager, each output saved in the caller's thread: PNG with PIL (FLUX), MP4 with ``imageio_ffmpeg.write_frames``
  (libx264, yuv420p, its default quality; Wan);
* ``lossless``: the runner (``runner.app.execute.run``, :func:`flux_dev_1024.run_runner`): FLUX
  ``experiment=flux_dev_h200``; Wan 2.2 the lossless settings of ``families_h200.py`` (``CUDNN_ATTN``, fused QKV,
  regional compile, warm-up), its default lossless MP4 (``h264_lossless``) written on writer threads;
* lossy lanes, each the lossless overrides plus: ``fp8`` (``backend.linear=FP8_TORCHAO``), ``int8dq``
  (``model.quantization.transformer=int8dq``, W8A8; FLUX only), ``cache`` (TaylorSeer lite, the fixed schedule of
  ``flux_dev_1024.py``'s ``cache`` variant; FLUX only). Each lossy lane's gate verdict comes from the quality gate on
  toy_shapes with the same lossy overrides (:func:`flux_dev_1024.gate_toy_shapes`), recorded beside its speedup.

Figures: ``s_per_1000_items`` = 1000 x generation-loop seconds / items (first pipeline call to the last file on disk:
text encode + denoise + decode + write; one-time setup, i.e. build/load, warm-up and compile, reported apart as
``setup_s``); ``items_per_gpu_hour`` = 3600 x items / loop seconds; ``speedup_vs_plain`` = baseline s/1000 / lane
s/1000. Top level: ``e2e_speedup_flux``, ``e2e_speedup_wan22`` (the lossless lane's; acceptance: >= 1.3 and >= 1.2),
``speedup_w8a8`` (the ``int8dq`` lane's denoising ms per step (``ms_per_step``: its W8A8 transformer) over the
lossless lane's; acceptance >= 1.15) with ``speedup_w8a8_gate`` (that lane's toy_shapes verdict), ``best_stack`` per family (the fastest lane whose gate passed, lossless counting as passed, with its items per
GPU-hour beside plain diffusers' at the model's default steps), and the device, torch/diffusers versions, commit and
argv of each call. Speedups are computed from the lanes present (also across files after ``--merge``; each lane keeps
the device that measured it).

Usage on one H200 (each call < 10 min; FLUX ~8 min for all its lanes at 16 prompts, Wan 2.2 ~9 min per call with
one lane per call at 2 videos x 40 steps):

    python3 benchmarks/throughput_h200.py --family flux --out /tmp/tp --results $OUT/tp_flux.json
    python3 benchmarks/throughput_h200.py --family flux --lanes int8dq,cache --out /tmp/tp --results $OUT/tp_flux2.json
    python3 benchmarks/throughput_h200.py --family wan22 --lanes baseline --out /tmp/tp --results $OUT/tp_wan_a.json
    python3 benchmarks/throughput_h200.py --family wan22 --lanes lossless --out /tmp/tp --results $OUT/tp_wan_b.json
    python3 benchmarks/throughput_h200.py --family wan22 --lanes fp8 --out /tmp/tp --results $OUT/tp_wan_c.json
    python3 benchmarks/throughput_h200.py --merge tp_flux.json tp_flux2.json tp_wan_a.json tp_wan_b.json \\
        tp_wan_c.json --into benchmarks/results/throughput_h200.json
    python3 benchmarks/throughput_h200.py --smoke --out /tmp/tp    # CPU, tiny_flux + tiny_wan22: checks the script

Results: ``--results`` (default ``DIR/throughput_<family>.json``); committed: ``benchmarks/results/throughput_h200.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from common import prompt_rows, write_jsonl  # noqa: E402
from flux_dev_1024 import compose, fidelity_vs, gate_toy_shapes, run_baseline, run_runner  # noqa: E402

TARGETS = {"e2e_speedup_flux": 1.3, "e2e_speedup_wan22": 1.2, "speedup_w8a8": 1.15}
CACHE = ["cache.method=taylorseer", "cache.lite=true", "cache.compute_every=4", "cache.warmup_steps=3"]
WAN_NEGATIVE = "blurry"
FAMILIES: Dict[str, Dict[str, Any]] = {
    "flux": {
        "what": "FLUX.1-dev 1024x1024, 28 steps",
        "lossless": ["experiment=flux_dev_h200"], "prompts": 16, "batch_size": 4,
        "smoke": ["model=tiny_flux", "platform=cpu", "model.generation.num_inference_steps=4", "compile=none",
                  "optimize.fuse_qkv=true"],
        "lossy": {"fp8": ["backend.linear=FP8_TORCHAO"],
                  "int8dq": ["model.quantization.transformer=int8dq", "optimize.fuse_qkv=false"],
                  "cache": CACHE},
    },
    "wan22": {
        "what": "Wan 2.2 T2V-A14B 832x480, 81 frames, 40 steps",
        "lossless": ["model=wan22", "model.load_format=dummy", "+model.architecture.dummy_weight_scale=0.05",
                     "platform=cuda", "dtype=bfloat16", "backend.attention=CUDNN_ATTN", "compile=regional",
                     "optimize.fuse_qkv=true", "optimize.warmup=true"],
        "prompts": 2, "batch_size": 1,
        "smoke": ["model=tiny_wan22", "platform=cpu", "model.generation.num_inference_steps=4", "compile=none"],
        "lossy": {"fp8": ["backend.linear=FP8_TORCHAO"]},
    },
}
SMOKE_LOSSY = ("int8dq", "cache")  # FP8 needs sm89+: not on the CPU


def save_mp4(fps: int):
    """A saver for :func:`run_baseline`: the ``i``-th video of ``WanPipeline``'s output (``output_type="np"``:
    float frames in [0, 1], (F, H, W, 3)) written as an MP4 the way a user would, with imageio-ffmpeg's own writer
    (libx264, yuv420p, its default quality)."""
    import imageio_ffmpeg
    import numpy as np

    def save(output: Any, i: int, path: Path) -> Path:
        frames = (np.clip(np.asarray(output.frames[i]), 0, 1) * 255).round().astype(np.uint8)
        path = path.with_suffix(".mp4")
        w = imageio_ffmpeg.write_frames(str(path), (frames.shape[2], frames.shape[1]), fps=fps, codec="libx264",
                                        pix_fmt_out="yuv420p", macro_block_size=1, ffmpeg_log_level="error")
        w.send(None)
        for f in frames:
            w.send(np.ascontiguousarray(f))
        w.close()
        return path

    return save


def wan_pipeline(cfg: Any, device: str, dtype: torch.dtype) -> Any:
    """``WanPipeline`` built with the family's own builder (as ``families_h200.py``), ``output_type`` numpy."""
    from omegaconf import OmegaConf

    from families_h200 import engine_for

    eng = engine_for(cfg, device, dtype)
    eng.resolve_source()
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    return eng.pipeline_cls()(**eng.build_components(arch, device=device, dtype=dtype))


def lane_record(rec: Dict[str, Any]) -> Dict[str, Any]:
    """The lane's headline figures from a :func:`run_baseline` / :func:`run_runner` record."""
    n, loop = rec.get("images") or 0, rec.get("loop_s")
    if n and loop:
        rec["items"] = n
        rec["s_per_1000_items"] = round(1000 * loop / n, 3)
        rec["items_per_gpu_hour"] = round(3600 * n / loop, 2)
    return rec


def run_lane(family: str, name: str, spec: Dict[str, Any], ov: List[str], cfg: Any, items: List[Any], out: Path,
             device: str, dtype: torch.dtype, batch: int) -> tuple:
    """One lane: the plain diffusers loop (``baseline``) or the runner with ``ov``; its record and files."""
    if name == "baseline":
        if family == "wan22":
            g = cfg.model.generation
            rec, files = run_baseline(cfg, items, out, device, dtype, count_flops=False, batch_size=batch,
                                      pipe=wan_pipeline(cfg, device, dtype), save=save_mp4(int(g.fps)),
                                      what="diffusers WanPipeline in a loop over the rows + imageio-ffmpeg MP4",
                                      subdir=f"{family}_baseline")
        else:
            rec, files = run_baseline(cfg, items, out, device, dtype, count_flops=False, batch_size=batch,
                                      what="diffusers FluxPipeline in a loop over the rows + PIL PNG",
                                      subdir=f"{family}_baseline")
        rec.pop("flops_per_forward", None)
        return lane_record(rec), files
    rec, files = run_runner(f"{family}_{name}", ov, out, device)
    return lane_record(rec), files


def summarize(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Speedups, gate verdicts and the best stack from ``doc["families"][f]["lanes"]`` (in place)."""
    for fam, fd in doc.get("families", {}).items():
        lanes = fd.get("lanes", {})
        base = lanes.get("baseline", {}).get("s_per_1000_items")
        for name, rec in lanes.items():
            s = rec.get("s_per_1000_items")
            rec.pop("speedup_vs_plain", None)
            if base and s and name != "baseline":
                rec["speedup_vs_plain"] = round(base / s, 4)
        doc[f"e2e_speedup_{fam}"] = lanes.get("lossless", {}).get("speedup_vs_plain")
        if fam == "flux":  # W8A8's denoising step (its transformer) over the bf16 lossless step, at its gate verdict
            m0, m1 = (lanes.get(n, {}).get("ms_per_step") for n in ("lossless", "int8dq"))
            doc["speedup_w8a8"] = round(m0 / m1, 4) if m0 and m1 else None
            doc["speedup_w8a8_gate"] = lanes.get("int8dq", {}).get("gate")
        doc[f"lossy_{fam}"] = {n: {"speedup_vs_plain": r.get("speedup_vs_plain"), "gate": r.get("gate")}
                               for n, r in lanes.items() if n not in ("baseline", "lossless")}
        ok = {n: r for n, r in lanes.items() if n != "baseline" and r.get("s_per_1000_items")
              and (n == "lossless" or r.get("gate") == "pass")}
        best = min(ok, key=lambda n: ok[n]["s_per_1000_items"]) if ok else None
        doc.setdefault("best_stack", {})[fam] = None if best is None else {
            "lane": best, "overrides": ok[best].get("overrides"), "gate": ok[best].get("gate", "lossless"),
            "items_per_gpu_hour": ok[best]["items_per_gpu_hour"],
            "plain_diffusers_items_per_gpu_hour": lanes.get("baseline", {}).get("items_per_gpu_hour"),
            "speedup_vs_plain": ok[best].get("speedup_vs_plain"),
            "steps": fd.get("workload", {}).get("num_inference_steps"),
            "default_steps": fd.get("workload", {}).get("default_steps"),
            "at_default_steps": fd.get("workload", {}).get("num_inference_steps") == fd.get("workload", {}).get(
                "default_steps")}
    doc["targets_met"] = {k: {"value": doc.get(k), "target": v, "met": doc[k] >= v}
                          for k, v in TARGETS.items() if doc.get(k) is not None}
    return doc


def merge(paths: List[Path], into: Path) -> Dict[str, Any]:
    """Partial files (one per device call) into ``into`` (created or updated): per family, a later file's lane
    replaces an earlier one's; each lane keeps its call's device, source, commit and date (the support matrix reads a
    lane's own); the top-level figures are recomputed."""
    doc: Dict[str, Any] = json.loads(into.read_text()) if into.is_file() else {}
    doc.setdefault("about", "benchmarks/throughput_h200.py (module docstring); merged with --merge")
    fams = doc.setdefault("families", {})
    calls = doc.setdefault("calls", [])
    for p in paths:
        d = json.loads(Path(p).read_text())
        calls.append({"source": Path(p).name, **{k: d.get(k) for k in ("argv", "device", "torch", "diffusers",
                                                                          "commit", "date")}})
        for fam, fd in d.get("families", {}).items():
            tgt = fams.setdefault(fam, {"lanes": {}})
            tgt["workload"] = fd.get("workload", tgt.get("workload"))
            for name, rec in fd.get("lanes", {}).items():
                tgt["lanes"][name] = {**rec, "source": Path(p).name, "device": d.get("device"),
                                      "commit": d.get("commit"), "date": d.get("date")}
    summarize(doc)
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001 - a copy without .git
        return None


def main() -> int:
    if "--merge" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--merge", type=Path, nargs="+", required=True)
        p.add_argument("--into", type=Path, required=True)
        a = p.parse_args()
        d = merge(a.merge, a.into)
        print(json.dumps({k: d.get(k) for k in ("e2e_speedup_flux", "e2e_speedup_wan22", "best_stack",
                                                 "targets_met")}, indent=1))
        return 0
    import diffusers

    from runner.app.checks import resolve_dtype
    from runner.app.stages import build_engines

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", action="append", choices=list(FAMILIES))
    p.add_argument("--lanes", default="baseline,lossless,fp8,int8dq,cache")
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None, help="the JSON (default: OUT/throughput_<families>.json)")
    p.add_argument("--prompts", type=int, default=None, help="rows per lane (default: per family, 16 / 2)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per call, both sides (default 4 / 1)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's own)")
    p.add_argument("--no-gate", action="store_true", help="lossy lanes without their toy_shapes gate")
    p.add_argument("--smoke", action="store_true", help="tiny_flux + tiny_wan22 on the CPU: checks the script")
    args = p.parse_args()
    families = args.family or (list(FAMILIES) if args.smoke else None)
    if not families:
        p.error("--family is required (or --smoke, or --merge FILES --into PATH)")
    want = [x for x in args.lanes.split(",") if x]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res_path = Path(args.results) if args.results else out / f"throughput_{'_'.join(families)}.json"
    device = "cpu" if args.smoke else "cuda"
    platform = "cpu" if args.smoke else "cuda"
    doc: Dict[str, Any] = {
        "argv": sys.argv, "command": " ".join(["python"] + sys.argv), "commit": commit(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
        "diffusers": diffusers.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "policy": ("s_per_1000_items = 1000 x generation-loop seconds / items (first pipeline call to the last file "
                   "on disk: text encode + denoise + decode + write); setup_s (build/load, 2-step warm-up, compile) "
                   "apart; speedup_vs_plain = baseline s_per_1000_items / lane s_per_1000_items; same rows, seeds, "
                   "batch size and weights on both sides"),
        "targets": TARGETS, "families": {}}

    def save() -> None:
        summarize(doc)
        text = json.dumps(doc, indent=1, default=str) + "\n"
        for path in {res_path, out / res_path.name}:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    gate_cache: Dict[str, Any] = {}
    for fam in families:
        spec = FAMILIES[fam]
        base = list(spec["smoke"] if args.smoke else spec["lossless"])
        if args.steps:
            base.append(f"model.generation.num_inference_steps={args.steps}")
        batch = args.batch_size or (2 if args.smoke else spec["batch_size"])
        n = args.prompts or (4 if args.smoke else spec["prompts"])
        rows = prompt_rows(n)
        if fam == "wan22":
            rows = [{**r, "negative_prompt": WAN_NEGATIVE} for r in rows]
        data = ["dataset=jsonl", f"dataset.path={write_jsonl(out / f'{fam}_prompts.jsonl', rows)}",
                f"batch_size={batch}"]
        cfg = compose(base + data)
        dtype = resolve_dtype(str(cfg.dtype), platform)
        engine = build_engines(cfg, base + data)[-1]
        items = engine.items(engine.read_rows()[0], cfg.seed)
        default_steps = int(compose([o for o in base if not o.startswith("model.generation.num_inference_steps")])
                            .model.generation.num_inference_steps)
        fd = doc["families"].setdefault(fam, {"lanes": {}})
        fd["workload"] = {"what": spec["what"], "items": len(items), "batch_size": batch,
                          "width": items[0].row.width, "height": items[0].row.height,
                          "num_frames": cfg.model.generation.get("num_frames"),
                          "num_inference_steps": items[0].row.num_inference_steps, "default_steps": default_steps,
                          "dtype": str(dtype), "lossless_overrides": base}
        lossy = {k: v for k, v in spec["lossy"].items() if not args.smoke or k in SMOKE_LOSSY}
        files: Dict[str, Dict[str, Path]] = {}
        for name in ["baseline", "lossless", *lossy]:
            if name not in want:
                continue
            ov = base + lossy.get(name, []) + data
            print(f"[{fam}] {name} ...", flush=True)
            t0 = time.perf_counter()
            try:
                rec, files[name] = run_lane(fam, name, spec, ov, cfg, items, out, device, dtype, batch)
            except Exception as e:  # noqa: BLE001 - a lane that cannot run is recorded, the others go on
                rec = {"overrides": ov, "error": f"{type(e).__name__}: {str(e)[:600]}",
                       "traceback": traceback.format_exc()[-2000:]}
            rec["lane_wall_s"] = round(time.perf_counter() - t0, 1)
            if name in lossy:
                rec["lossy_overrides"] = lossy[name]
                if "lossless" in files and files.get(name):
                    rec["fidelity_vs_lossless"] = fidelity_vs(files["lossless"], files[name]) if fam == "flux" else None
                if not args.no_gate and "error" not in rec:
                    key = " ".join(lossy[name])
                    if key not in gate_cache:  # the same lossy overrides (fp8 in both families) are gated once
                        extra = ["dataset.limit=4"] if args.smoke else []
                        try:
                            g = gate_toy_shapes(out, {name: lossy[name]}, platform, extra=extra, reuse_lossless=True)
                            job = g["jobs"].get(name, {})
                            gate_cache[key] = {"gate": job.get("verdict") or "error", "gate_detail": {
                                k: job.get(k) for k in ("accuracy_ratio", "accuracy_ratios", "psnr_db", "ssim",
                                                        "reasons", "error")}}
                        except Exception as e:  # noqa: BLE001
                            gate_cache[key] = {"gate": "error", "gate_detail": {"error": f"{type(e).__name__}: {e}"}}
                    rec.update(gate_cache[key])
            fd["lanes"][name] = rec
            save()
            print(json.dumps({name: {k: rec.get(k) for k in ("s_per_1000_items", "setup_s", "speedup_vs_plain",
                                                             "gate", "error")}}), flush=True)
    save()
    print(json.dumps({k: doc.get(k) for k in ("e2e_speedup_flux", "e2e_speedup_wan22", "best_stack",
                                             "targets_met")}, indent=1, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
