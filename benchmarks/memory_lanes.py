"""Memory lanes on one H200 (issue #32 part B): FLUX.1-dev at 1024x1024 under memory budgets and with quantized
weights, side by side in one process with the unconstrained lossless runner; Wan 2.1 14B at 480p under 48 GB.

Lanes (each ``runner.app.execute.run`` on the same random weights, ``experiment=flux_dev_h200`` with
``model.load_format=dummy``, the same rows and batch):

* ``lossless``: no budget, everything on the GPU (the reference);
* ``budget24`` / ``budget12`` / ``budget8``: ``memory.offload=auto memory.max_gpu_gb=<N> memory.vae_slicing=true``
  (``budget24_rs``: the same with ``memory.record_stream=true``, measured beside ``budget24``)
  (the planner picks the fastest plan that fits; the manifest records it, the estimate and the observed peaks);
  a plan the planner refuses at this batch is retried at half the batch (recorded);
* ``int8wo`` / ``float8wo``: ``model.quantization.transformer=<method>`` (torchao, through diffusers' quantizer);
  speed and transformer weight bytes vs bf16, PSNR/SSIM vs ``lossless``;
* ``q4``: FLUX.1-dev's transformer loaded with bitsandbytes NF4 through diffusers' ``from_pretrained``
  (``BitsAndBytesConfig``) from a random-weight bf16 snapshot written to ``--scratch``: its weight memory
  (``q4_transformer_gb``) and one 1024^2 forward's time vs bf16 (needs bitsandbytes on the device);
* ``wan48``: ``model=wan`` (Wan 2.1 14B architecture, random weights) at 832x480, 81 frames,
  ``memory.offload=auto memory.max_gpu_gb=48``: the plan taken and the observed peak per stage.

Keys written (``--results``): ``budget24_ratio``, ``budget12_ratio``, ``budget8_ratio`` (lane generate seconds /
lossless generate seconds; the acceptance: <= 1.05, 1.15, 1.3), ``q4_transformer_gb`` (<= 7), per lane the
speed, peak memory, the plan and the evidence verdict.

Default (fits ~8 min of one H200): 8 prompts, 10 steps, batch 8, compile off, Wan 2 steps. The full acceptance
run: ``--prompts 16 --steps 28 --batch-size 16`` (about 15-20 min: run it as two calls, ``--lanes
lossless,budget24,budget12,budget8`` and ``--lanes lossless,int8wo,float8wo,q4,wan48``).

    python benchmarks/memory_lanes.py --out /tmp/mem --results benchmarks/results/memory_lanes_h200.json
    python benchmarks/memory_lanes.py --smoke --out /tmp/mem   # CPU: tiny_flux, checks the script
    python benchmarks/memory_lanes.py --merge call1.json call2.json --into benchmarks/results/memory_lanes_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from common import prompt_rows, write_jsonl  # noqa: E402

LANES = ("lossless", "budget24", "budget12", "budget8", "budget24_rs", "int8wo", "float8wo", "q4", "wan48")


def compose(overrides: List[str]) -> Any:
    """The run config exactly as ``python -m runner <overrides>`` composes it."""
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="mem"):
        return hydra.compose("config", overrides=overrides)


START = time.perf_counter()


def stamp(msg: str) -> None:
    """``[t=<s since start>] msg`` on stdout at once: a call stopped at its limit still shows where its time went."""
    print(f"[t={time.perf_counter() - START:.1f}s] {msg}", flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_lane(name: str, overrides: List[str], out: Path) -> Tuple[Dict[str, Any], Dict[str, Path]]:
    """One runner lane; its record and ``{item key: png}``. A refusal (exit 2) is recorded with its message."""
    from runner.app import execute
    from runner.core.errors import RunnerError

    free()
    run_dir = out / name
    weights: Dict[str, int] = {}

    def sizes(engine: Any) -> None:  # bytes of each component as loaded (quantized tensors: their inner tensors)
        from runner.core.memory import tensor_bytes

        for comp, mod in engine.pipe.components.items():
            if isinstance(mod, torch.nn.Module):
                weights[comp] = sum(tensor_bytes(t) for t in (*mod.parameters(), *mod.buffers()))

    t0 = time.perf_counter()
    stamp(f"{name}: start")
    loaded = lambda engine: (stamp(f"{name}: loaded"), sizes(engine))  # noqa: E731
    try:
        code = execute.run(compose(overrides), run_dir, overrides, on_loaded=loaded)
    except RunnerError as e:
        return {"overrides": overrides, "exit_code": e.exit_code, "refused": f"{type(e).__name__}: {e}"}, {}
    finally:
        free()
    stamp(f"{name}: run returned {code}")
    m = json.loads((run_dir / "manifest.json").read_text())
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    t, st = m["timing"], m["evidence"].get("stages", {}).get("denoise", {})
    rec = {"overrides": overrides, "exit_code": code, "status": m["status"], "wall_s": round(time.perf_counter() - t0, 2),
           "load_s": t["load_s"], "generate_s": t["generate_s"], "phases_s": t["phases_s"], "items": len(items),
           "batch_size": m["config"]["batch_size"], "weights_bytes": weights,
           "peak_memory_gb": round(m["memory"].get("device_peak_allocated_bytes", 0) / 2 ** 30, 3),
           "memory_plan": {k: v for k, v in (m.get("memory_plan") or {}).items() if k != "candidates"},
           "planned_gb": ((m.get("memory_plan") or {}).get("planned") or {}).get("peak_gb"),
           "observed_gb": max((st.get("memory") or {}).get("observed_peak_gb", {}).values(), default=None),
           "memory_evidence": st.get("memory"), "lossy": m["lossy"],
           "evidence": {"verdict": m["evidence"]["verdict"], "mismatches": m["evidence"]["mismatches"]}}
    rec["observed_le_planned"] = (None if rec["planned_gb"] is None or rec["observed_gb"] is None
                                  else rec["observed_gb"] <= rec["planned_gb"])
    rec["items_ok"] = sum(r.get("status") == "ok" for r in items)
    sizes_ran: Dict[str, int] = {}  # a failed batch re-runs its items one by one: sizes below batch_size show it
    for r in items:
        k = str((r.get("batch") or {}).get("size"))
        sizes_ran[k] = sizes_ran.get(k, 0) + 1
    rec["batch_sizes_ran"] = sizes_ran
    return rec, {r["key"]: run_dir / r["file"] for r in items if r.get("status") == "ok"}


def flux_lanes(args: argparse.Namespace, out: Path, base: List[str], want: List[str],
               save: Any = lambda lanes: None) -> Dict[str, Any]:
    """The FLUX lanes of ``want`` (lossless first: the others are compared with it); ``save(lanes)`` after
    each lane (a device time limit keeps what finished)."""
    from flux_dev_1024 import fidelity_vs

    res: Dict[str, Any] = {}
    ref_files: Dict[str, Path] = {}
    budget = ["memory.offload=auto", "memory.vae_slicing=true"]
    spec = {"lossless": [], "budget24": [*budget, "memory.max_gpu_gb=24"],
            "budget12": [*budget, "memory.max_gpu_gb=12"], "budget8": [*budget, "memory.max_gpu_gb=8"],
            "budget24_rs": [*budget, "memory.max_gpu_gb=24", "memory.record_stream=true"],
            "int8wo": ["model.quantization.transformer=int8wo", "optimize.fuse_qkv=false"],
            "float8wo": ["model.quantization.transformer=float8wo", "optimize.fuse_qkv=false"]}
    for name in [n for n in spec if n in want]:
        batch = args.batch_size
        while True:
            rec, files = run_lane(name, [*base, f"batch_size={batch}", *spec[name]], out)
            if rec.get("exit_code") != 2 or batch == 1 or not name.startswith("budget"):
                break
            rec_refused = rec
            batch //= 2
            print(f"{name}: refused at batch {batch * 2} ({rec_refused['refused'][:200]}...); retrying at {batch}")
        res[name] = rec
        if name == "lossless":
            ref_files = files
        elif files and ref_files:
            rec["fidelity_vs_lossless"] = fidelity_vs(ref_files, files)
            stamp(f"{name}: fidelity computed")
        ratio(rec, res.get("lossless", {}))  # now: a call stopped at its limit keeps the finished lanes' ratios
        print(json.dumps({name: {k: rec.get(k) for k in ("exit_code", "generate_s", "peak_memory_gb", "batch_size",
                                                         "items_ok", "planned_gb", "observed_gb")}}), flush=True)
        save(res)
    ref = res.get("lossless", {})
    for name in ("budget24", "budget12", "budget8", "budget24_rs", "int8wo", "float8wo"):
        w, w0 = (res.get(name, {}).get("weights_bytes", {}).get("transformer"),
                 ref.get("weights_bytes", {}).get("transformer"))
        if w and w0:
            res[name]["transformer_weights_vs_bf16"] = round(w / w0, 4)
    return res


def q4_lane(args: argparse.Namespace, out: Path) -> Dict[str, Any]:
    """FLUX.1-dev's transformer in NF4 through diffusers' ``from_pretrained`` (``BitsAndBytesConfig``), from a
    random-weight bf16 snapshot; its weight GiB and a 1024^2 forward beside the bf16 one."""
    from diffusers import BitsAndBytesConfig, FluxTransformer2DModel

    import yaml

    ref = yaml.safe_load((ROOT / "conf" / "model" / "flux.yaml").read_text())["architecture"]["transformer"]
    snap = Path(args.scratch) / "flux_dev_transformer_bf16"
    torch.manual_seed(0)
    with torch.device("cuda"):
        dense = FluxTransformer2DModel(**ref).to(torch.bfloat16)
    with torch.no_grad():
        for p in dense.parameters():
            if p.dim() >= 2:
                p.mul_(0.05)  # experiment=flux_dev_h200's dummy_weight_scale: finite activations in bf16
    bf16_gb = sum(p.numel() * p.element_size() for p in dense.parameters()) / 2 ** 30
    dense_ms = forward_ms(dense)
    t0 = time.perf_counter()
    if not (snap / "config.json").exists():
        dense.save_pretrained(snap)
    save_s = time.perf_counter() - t0
    del dense
    free()
    before = torch.cuda.memory_allocated()
    q = FluxTransformer2DModel.from_pretrained(
        snap, torch_dtype=torch.bfloat16, local_files_only=True,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))
    q4_gb = (torch.cuda.memory_allocated() - before) / 2 ** 30
    classes = sorted({type(getattr(m, "weight", None)).__name__ for m in q.modules() if hasattr(m, "weight")})
    q_ms = forward_ms(q)
    return {"q4_transformer_gb": round(q4_gb, 3), "bf16_transformer_gb": round(bf16_gb, 3),
            "footprint_gb": round(q.get_memory_footprint() / 2 ** 30, 3), "weight_classes": classes,
            "forward_ms_bf16": dense_ms, "forward_ms_nf4": q_ms, "speed_vs_bf16": round(dense_ms / q_ms, 4),
            "snapshot_write_s": round(save_s, 1)}


def forward_ms(model: torch.nn.Module, batch: int = 1) -> float:
    """Median ms of one transformer forward at 1024^2 (4096 image + 512 text tokens), CUDA events."""
    from common import time_ms

    c = model.config
    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(hidden_states=torch.randn(batch, 4096, c.in_channels, device="cuda", dtype=torch.bfloat16, generator=g),
              encoder_hidden_states=torch.randn(batch, 512, c.joint_attention_dim, device="cuda", dtype=torch.bfloat16,
                                                generator=g),
              pooled_projections=torch.randn(batch, c.pooled_projection_dim, device="cuda", dtype=torch.bfloat16),
              timestep=torch.full((batch,), 0.5, device="cuda", dtype=torch.bfloat16),
              img_ids=torch.zeros(4096, 3, device="cuda"), txt_ids=torch.zeros(512, 3, device="cuda"),
              guidance=torch.full((batch,), 3.5, device="cuda", dtype=torch.bfloat16))
    with torch.inference_mode():
        return round(time_ms(lambda: model(**kw), "cuda", warmup=2, iters=5), 2)


def wan_lane(args: argparse.Namespace, out: Path) -> Dict[str, Any]:
    """Wan 2.1 14B (random weights) at 832x480, 81 frames, under a 48 GB budget."""
    rows = write_jsonl(out / "wan_prompts.jsonl", prompt_rows(1))
    ov = ["model=wan", "model.load_format=dummy", "+model.architecture.dummy_weight_scale=0.05", "platform=cuda",
          "dtype=bfloat16", "dataset=jsonl", f"dataset.path={rows}", f"model.generation.num_inference_steps="
          f"{args.wan_steps}", "memory.offload=auto", "memory.max_gpu_gb=48", "memory.vae_slicing=true"]
    rec, _ = run_lane("wan48", ov, out)
    return rec


def ratio(rec: Dict[str, Any], lossless: Dict[str, Any]) -> None:
    """``rec["ratio_vs_lossless"]``: its generate seconds over the lossless lane's (same call), where both ran."""
    g, g0 = rec.get("generate_s"), lossless.get("generate_s")
    if g and g0 and rec is not lossless:
        rec["ratio_vs_lossless"] = round(g / g0, 4)


def summarize(doc: Dict[str, Any]) -> Dict[str, Any]:
    """The top-level keys from ``doc["lanes"]`` (in place): ``budget<N>_ratio``, ``q4_transformer_gb``,
    ``observed_le_planned`` per lane."""
    lanes = doc["lanes"]
    for b in ("24", "12", "8"):
        doc[f"budget{b}_ratio"] = lanes.get(f"budget{b}", {}).get("ratio_vs_lossless")
    doc["q4_transformer_gb"] = lanes.get("q4", {}).get("q4_transformer_gb")
    doc["observed_le_planned"] = {k: v.get("observed_le_planned") for k, v in lanes.items()
                                  if isinstance(v, dict) and "observed_le_planned" in v}
    return doc


def merge(paths: List[Path], into: Path) -> Dict[str, Any]:
    """Lanes of several calls (each ``--results`` of one device call, lossless first in each) into one document:
    a later file's lane replaces an earlier one's; each lane keeps its ratio against its own call's lossless run,
    whose ``generate_s``, source file and device it records (``lossless_generate_s``, ``source``, ``device``).
    Keys of ``into`` that
    no call writes (``lora_lanes.py``'s) are kept."""
    doc: Dict[str, Any] = json.loads(into.read_text()) if into.exists() else {}
    lanes: Dict[str, Any] = dict(doc.get("lanes") or {})
    calls = []
    for p in paths:
        d = json.loads(p.read_text())
        ref = d["lanes"].get("lossless", {})
        for name, rec in d["lanes"].items():
            lanes[name] = {**rec, "source": p.name, "device": d.get("device"),
                           "lossless_generate_s": ref.get("generate_s")}
            if name != "lossless" and "generate_s" in rec:
                ratio(lanes[name], ref)
        calls.append({"source": p.name, "argv": d.get("argv"), "device": d.get("device"), "torch": d.get("torch"),
                      "workload": d.get("workload"), "lanes": sorted(d["lanes"])})
    doc.update(calls=calls, lanes=lanes)
    for k in ("argv", "device", "torch", "workload"):
        doc.pop(k, None)
    summarize(doc)
    into.write_text(json.dumps(doc, indent=1, default=str))
    return doc


def main() -> int:
    if "--merge" in sys.argv:  # python benchmarks/memory_lanes.py --merge A.json B.json --into RESULT.json
        p = argparse.ArgumentParser()
        p.add_argument("--merge", type=Path, nargs="+", required=True)
        p.add_argument("--into", type=Path, required=True)
        a = p.parse_args()
        d = merge(a.merge, a.into)
        print(json.dumps({k: d[k] for k in ("budget24_ratio", "budget12_ratio", "budget8_ratio",
                                             "q4_transformer_gb", "observed_le_planned")}))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--results", default=None)
    p.add_argument("--lanes", default=",".join(LANES))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compile", default="none", choices=["none", "regional"])
    p.add_argument("--wan-steps", type=int, default=2)
    p.add_argument("--scratch", default="/tmp/memory_lanes")
    p.add_argument("--smoke", action="store_true", help="tiny_flux on the CPU (int8wo lane only): checks the script")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.scratch).mkdir(parents=True, exist_ok=True)
    want = [x for x in args.lanes.split(",") if x]
    rows = write_jsonl(out / "prompts.jsonl", prompt_rows(args.prompts))
    data = ["dataset=jsonl", f"dataset.path={rows}", f"model.generation.num_inference_steps={args.steps}"]
    if args.smoke:
        base = ["model=tiny_flux", "platform=cpu", "model.generation.width=32", "model.generation.height=32", *data]
        want = [w for w in want if w in ("lossless", "int8wo")]
    else:
        base = ["experiment=flux_dev_h200", f"compile={args.compile}", *data]
    doc: Dict[str, Any] = {"argv": sys.argv, "torch": torch.__version__,
                           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                           "workload": {"prompts": args.prompts, "steps": args.steps, "batch_size": args.batch_size,
                                        "compile": args.compile, "full_run": args.prompts >= 16 and args.steps >= 28}}
    def save(lanes: Dict[str, Any]) -> None:
        doc["lanes"] = lanes
        summarize(doc)
        text = json.dumps(doc, indent=1, default=str)
        for path in [out / "memory_lanes.json", *([Path(args.results)] if args.results else [])]:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)

    lanes = flux_lanes(args, out, base, want, save)
    for name, fn in (("q4", q4_lane), ("wan48", wan_lane)):
        if name in want and not args.smoke:
            try:
                lanes[name] = fn(args, out)
            except Exception as e:  # noqa: BLE001 - a lane that cannot run here is recorded, the others go on
                lanes[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            free()
            save(lanes)
    save(lanes)
    print(json.dumps({k: doc[k] for k in ("budget24_ratio", "budget12_ratio", "budget8_ratio", "q4_transformer_gb",
                                          "observed_le_planned")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
