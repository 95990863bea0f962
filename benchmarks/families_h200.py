"""SD3.5 Large, Qwen-Image, Wan 2.1 14B, LTX-2 (19B, video with audio), HunyuanVideo-1.5 480p, FLUX.2-dev, FLUX.2
klein 4B and Z-Image at their published workloads, random full-size weights: plain diffusers vs the runner's lossless
settings vs FP8 linear, transformer forward by forward, side by side in one process; then a short run through the
runner per family whose evidence must be verified for ``CUDNN_ATTN`` and ``FP8`` linear.

Per family (``--family sd3|qwen_image|wan|wan22|wan22_ti2v|ltx2|hunyuanvideo15|flux2|flux2_klein|zimage``,
repeatable; Wan 2.2 A14B: steps 2-5 per expert, ``transformer`` and ``transformer_2`` each on the inputs of its own
first forward, as ``experts.<name>``; the first expert's figures also at the top level):

1. One pipeline is built with the family's own builder (``load_format=dummy``: ``PipelineEngine.build_components``,
   seeded, bf16, on the GPU). A 2-step pipeline call at the workload shape captures the transformer's inputs.
2. ``baseline``: the transformer as diffusers builds it (default attention: torch SDPA; eager) — ms per forward.
   Then ``blocks_off`` (:func:`blocks_off`): the output of one more forward with every Linear of the FP8 lane
   returning zeros, against the baseline's; ``output_depends_on_blocks: false`` (bit-identical: the random weights at
   this ``dummy_weight_scale`` make the blocks' updates vanish below bf16 resolution) means the ``vs_baseline``
   figures below cannot show an error in the blocks, and a WARNING is printed.
3. ``lossless``: the same module after the runner's lossless preset applied in place through the engine's own code
   (``optimize`` with ``fuse_qkv`` (not LTX-2's: refused there), ``runner.kernels.attention.install`` of ``CUDNN_ATTN`` on
   every call site, regional ``torch.compile``) — ms per forward, and the max/mean abs difference of its output from the baseline's.
4. ``fp8``: (3) plus ``runner.kernels.linear.install`` of ``FP8`` (row-wise dynamic e4m3) — ms per forward, difference.
   ms per denoising step = ms per forward x forwards per step (the engine's own forward rule,
   ``expected_forwards``, for the workload's row: 2 under a family's unbatched CFG; FLUX.2-dev's guidance embedding,
   klein 4B's distillation and Z-Image's and LTX-2's batched CFG make 1; batched CFG's inputs carry batch 2).
5. MFU = model FLOPs of one forward (``torch.utils.flop_counter.FlopCounterMode``) / time, as a fraction of the bf16
   matmul rate measured in this process.
6. Evidence: ``python -m runner``'s own loop (``runner.app.execute.run``) with ``backend.attention=CUDNN_ATTN
   backend.linear=FP8``, 2 steps, 1 row, eager (the call-site probes observe every call) — the verdict and the
   kernels profiled. A workload's ``evidence`` overrides shorten that run where the published one is long to decode
   (HunyuanVideo-1.5: 33 frames instead of 121; the timed forwards above stay at the published shape).

Also per family: ``speedup_<family>`` (baseline / lossless ms per step) and ``mfu_<family>`` (the lossless MFU).
The text encoder is freed once the transformer's inputs are captured (the timed part runs the transformer alone; for
FLUX.2-dev it frees Mistral's 48 GB before compiling the 32B transformer). ``iters`` timed forwards per setting (FLUX.2-dev:
one step at 1024^2).

Usage: ``python benchmarks/families_h200.py --family sd3 --family wan --out DIR``, then ``--merge DIR/families_*.json
--into benchmarks/results/families_2026_h200.json`` (one H200: ~4 min per family; run
FLUX.2-dev alone, ~6 min, and LTX-2 alone, ~8 min); ``--smoke`` runs the tiny variants on the CPU to check the script. Results:
``DIR/families_<family>.json``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, List, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from common import time_ms  # noqa: E402

WORKLOADS = {  # the workloads (#17): published defaults of each model
    "sd3": dict(model="sd3", prompt="a photo of a lighthouse on a cliff at dusk", negative="blurry",
                scale=0.05, iters=10),
    "qwen_image": dict(model="qwen_image", prompt="a photo of a lighthouse on a cliff at dusk", negative=" ",
                       scale=0.05, iters=5),
    "wan": dict(model="wan", prompt="a lighthouse on a cliff at dusk, waves crashing", negative="blurry",
                scale=0.05, iters=3),
    # LTX-2.0: 768x512, 121 frames at 24 fps, guidance 4.0 (batched CFG: one forward of batch 2 per step), with audio
    "ltx2": dict(model="ltx2", prompt="a lighthouse on a cliff at dusk, waves crashing, seagulls calling",
                 negative="worst quality, inconsistent motion, blurry, jittery, distorted", scale=0.05, iters=3,
                 free_text_encoder=True),  # Gemma 3 12B beside the 19B transformer and its FP8 copy: not on 80 GB
    # issue #31: FLUX.2-dev (32B, guidance-distilled, 1024^2, 50 steps; no negative prompt), klein 4B (4 steps),
    # Z-Image (1024^2, 50 steps, guidance 4 with a negative prompt, batched CFG)
    # flux2 at 1.0 too (2026-12-07: at 0.05 on the H200 blocks_off was bit-identical, as klein's was)
    "flux2": dict(model="flux2", prompt="a photo of a lighthouse on a cliff at dusk", negative=None, scale=1.0,
                  iters=1, free_text_encoder=True, encode_apart_below_gb=120),  # 64 + 48 GB of bf16 weights
    # klein: weights unscaled (1.0). FLUX.2's transformer has no biases, so at 0.05 its modulation gates are ~3.5e-6
    # and the output is bit-identical with the blocks off (blocks_off): every vs_baseline read 0.0, FP8's included.
    # At 1.0 (1024^2, bf16, CPU) the output is finite and the blocks make 3.2% of it (mean abs 0.0149 of 0.461)
    "flux2_klein": dict(model="flux2_klein", prompt="a photo of a lighthouse on a cliff at dusk", negative=None,
                        scale=1.0, iters=5, free_text_encoder=True),
    "zimage": dict(model="zimage", prompt="a photo of a lighthouse on a cliff at dusk", negative="blurry", scale=0.05,
                   iters=5, free_text_encoder=True),
    # 848x480, 121 frames: 31 x 30 x 53 = 49290 video tokens + 1000 + 256 text tokens per forward
    "hunyuanvideo15": dict(model="hunyuanvideo15", prompt='a lighthouse on a cliff at dusk with a sign "OPEN"',
                           negative="blurry", scale=0.05, iters=3, evidence=["model.generation.num_frames=33"]),
    # Wan 2.2 T2V-A14B at 480p: each expert (transformer, transformer_2) timed on its own inputs
    "wan22": dict(model="wan22", prompt="a lighthouse on a cliff at dusk, waves crashing", negative="blurry",
                  scale=0.05, iters=2),
    "wan22_ti2v": dict(model="wan22_ti2v", prompt="a lighthouse on a cliff at dusk, waves crashing",
                       negative="blurry", scale=0.05, iters=3),
}
SMOKE = {"sd3": "tiny_sd3", "qwen_image": "tiny_qwen_image", "wan": "tiny_wan", "wan22": "tiny_wan22",
         "wan22_ti2v": "tiny_wan22_ti2v", "ltx2": "tiny_ltx2", "hunyuanvideo15": "tiny_hunyuanvideo15",
         "flux2": "tiny_flux2", "flux2_klein": "tiny_flux2_klein", "zimage": "tiny_zimage"}


def compose(overrides):
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="bench"):
        return hydra.compose("config", overrides=list(overrides))


def engine_for(cfg: Any, device: str, dtype: torch.dtype) -> Any:
    """The family's engine for ``cfg`` (no weights loaded)."""
    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    plat = detect(str(cfg.platform.name), str(cfg.platform.device))
    return engine_class(str(cfg.model.engine))(StageContext(cfg=cfg, overrides=[], stage="denoise",
                                                             plat=plat, dtype=dtype))


def first_output(out: Any) -> torch.Tensor:
    """The transformer's sample from ``return_dict=False`` output: ``out[0]``, a tensor, or (Z-Image) a list of
    per-item tensors, flattened and joined."""
    x = out[0]
    return torch.cat([t.flatten() for t in x]) if isinstance(x, (list, tuple)) else x


def forwards_per_step(eng: Any, w: Dict[str, Any], g: Any) -> int:
    """Transformer forwards per denoising step for the workload's row, by the engine's own forward rule."""
    from types import SimpleNamespace

    row = SimpleNamespace(negative_prompt=w["negative"], guidance_scale=g.guidance_scale, num_inference_steps=1)
    return int(eng.expected_forwards([SimpleNamespace(row=row)]))


def diff(a: torch.Tensor, b: torch.Tensor) -> Dict[str, float]:
    a, b = a.float(), b.float()
    return {"max_abs": float((a - b).abs().max()), "mean_abs": float((a - b).abs().mean()),
            "mean_abs_ref": float(b.abs().mean())}


def blocks_off(tr: torch.nn.Module, prefixes: Any, fwd: Any, ref: torch.Tensor) -> Dict[str, Any]:
    """How much the output depends on the lane FP8 replaces: one eager forward with every ``nn.Linear`` that
    ``runner.kernels.linear.install`` would make FP8 (``prefixes``, in and out features multiples of 16) returning
    zeros (a forward hook: no weight is copied or changed), compared with the baseline output ``ref``.

    ``output_depends_on_blocks`` false (the output bit-identical with the blocks switched off) means no setting's
    ``vs_baseline`` can show an error inside the blocks: its 0.0 is no evidence. Random weights scaled by
    ``dummy_weight_scale`` can do that: FLUX.2's transformer has no biases, so its timestep embedding scales as s^2 and
    its modulation (shift/scale/gate) as s^3; at s=0.05 (klein 4B) every gate is ~3.5e-6, each block's residual update
    rounds away in bf16, and the output is proj_out(norm_out(x_embedder(latents))) alone. ``block_share``:
    ``mean_abs`` of the difference / ``mean_abs_ref`` (the share of the output the blocks make; an FP8 difference
    should be read against it)."""
    hooks = [m.register_forward_hook(lambda mod, a, o: torch.zeros_like(o)) for n, m in tr.named_modules()
             if type(m) is torch.nn.Linear and n.startswith(tuple(prefixes)) and m.in_features % 16 == 0
             and m.out_features % 16 == 0]
    try:
        with torch.inference_mode():
            d = diff(fwd(), ref)
    finally:
        for h in hooks:
            h.remove()
    return {**d, "linears": len(hooks), "block_share": d["mean_abs"] / d["mean_abs_ref"] if d["mean_abs_ref"] else None,
            "output_depends_on_blocks": d["max_abs"] != 0.0}


def bench_family(family: str, smoke: bool, out: Path, evidence: Sequence[str] = (), encode_apart: bool = False
                 ) -> Dict[str, Any]:
    from omegaconf import OmegaConf
    from torch.utils.flop_counter import FlopCounterMode

    from runner.kernels import attention, linear
    from models.compile import compile_regional

    w = WORKLOADS[family]
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    model = SMOKE[family] if smoke else w["model"]
    ov = [f"model={model}", f"platform={'cpu' if smoke else 'cuda'}", f"dtype={'float32' if smoke else 'bfloat16'}"]
    if not smoke:
        ov += ["model.load_format=dummy", f"+model.architecture.dummy_weight_scale={w['scale']}"]
    cfg = compose(ov)
    eng = engine_for(cfg, device, dtype)
    eng.resolve_source()
    g = cfg.model.generation
    rec: Dict[str, Any] = {"family": family, "model": model, "device": torch.cuda.get_device_name() if device == "cuda"
                           else "cpu", "torch": torch.__version__, "width": g.width, "height": g.height,
                           "num_inference_steps": g.num_inference_steps, "num_frames": g.get("num_frames"),
                           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    t0 = time.perf_counter()
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    pcls = eng.pipeline_cls()
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30 if device == "cuda" else None
    apart = encode_apart or bool(total_gb and total_gb < w.get("encode_apart_below_gb", 0))
    prompt_embeds = None
    if apart:  # the text encoder alone first (the others on the meta device), then everything but it
        others = [c for c in type(eng).components if c not in ("text_encoder", "scheduler")]
        enc = pcls(**eng.build_components(arch, device=device, dtype=dtype, on_meta=others))
        with torch.inference_mode():
            prompt_embeds = enc.encode_prompt(prompt=w["prompt"], device=device,
                                              max_sequence_length=int(g.max_sequence_length))[0]
        del enc
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        pipe = pcls(**eng.build_components(arch, device=device, dtype=dtype, on_meta=["text_encoder"]))
        pipe.text_encoder = None
        rec["encode_apart"] = (f"the prompt encoded by the text encoder alone, then freed: the card's "
                               f"{total_gb:.0f} GiB cannot hold every component" if total_gb else "asked")
    else:
        pipe = pcls(**eng.build_components(arch, device=device, dtype=dtype))
    pipe.set_progress_bar_config(disable=True)
    rec["build_s"] = round(time.perf_counter() - t0, 1)

    # the inputs of each expert's first forward at the workload shape, prepared by the pipeline itself (Wan 2.2 A14B:
    # 2 steps at flow_shift 3 are timesteps 999 and 750, one per expert around the boundary 875)
    experts = [(n, getattr(pipe, n)) for n in ("transformer", "transformer_2")
               if isinstance(getattr(pipe, n, None), torch.nn.Module)]
    captured: Dict[str, Dict[str, Any]] = {n: {} for n, _ in experts}
    args: Dict[str, list] = {n: [] for n, _ in experts}  # ZImagePipeline calls its transformer with positional inputs
    seen: set = set()

    def grab(name):
        def hook(mod, a, kwargs):
            if name not in seen:
                seen.add(name)
                captured[name].update(kwargs)
                args[name].extend(a)
        return hook

    hooks = [m.register_forward_pre_hook(grab(n), with_kwargs=True) for n, m in experts]
    call = dict(prompt=w["prompt"], height=g.height, width=g.width, num_inference_steps=2, output_type="latent")
    if prompt_embeds is not None:
        call.pop("prompt")
        call["prompt_embeds"] = prompt_embeds
    if g.get("num_frames"):
        call["num_frames"] = g.num_frames
    takes = set(inspect.signature(type(pipe).__call__).parameters)  # the pipeline's own arguments
    if g.guidance_scale is not None and "guidance_scale" in takes:  # the workload's guidance (Z-Image: CFG batched
        call["guidance_scale"] = g.guidance_scale  # into the captured forward; HunyuanVideo-1.5's is its guider's)
    if "max_sequence_length" in eng.call_params():
        call["max_sequence_length"] = int(g.max_sequence_length)
    if family == "ltx2":  # the runner's call: frame rate, the LTX-2.0 guidance recipe, CFG on (batch 2 per forward)
        from models.ltx2 import LTX2_0_GUIDANCE

        call.update(frame_rate=float(g.fps), guidance_scale=g.guidance_scale, audio_guidance_scale=g.guidance_scale,
                    negative_prompt=w["negative"], **LTX2_0_GUIDANCE)
    with torch.inference_mode():
        pipe(**call)
    for h in hooks:
        h.remove()
    missing = [n for n, _ in experts if n not in seen]
    if missing:
        raise RuntimeError(f"the 2-step call ran no forward of {missing}")
    rec["forwards_per_step"] = forwards_per_step(eng, w, g)
    if w.get("free_text_encoder"):  # the timed part is the transformer alone
        pipe.text_encoder = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    refs, flops = {}, {}
    for n, tr in experts:
        with torch.inference_mode(), FlopCounterMode(display=False) as fc:
            refs[n] = first_output(tr(*args[n], **captured[n]))
        flops[n] = float(fc.get_total_flops())
    rec["forward_tflop"] = round(flops["transformer"] / 1e12, 3)
    mm = 1024 if smoke else 8192  # the smoke run checks the script, not the CPU's matmul rate
    a = torch.randn(mm, mm, device=device, dtype=dtype)
    peak = 2 * mm ** 3 / (time_ms(lambda: a @ a, device, warmup=5, iters=20) / 1e3) / 1e12
    del a
    rec["matmul_tflops"] = round(peak, 1)
    iters = 2 if smoke else w["iters"]
    per_expert: Dict[str, Dict[str, Any]] = {n: {} for n, _ in experts}

    def timed(name: str) -> None:
        for n, tr in experts:
            with torch.inference_mode():
                ms = time_ms(lambda: tr(*args[n], **captured[n]), device, warmup=2, iters=iters)
                outp = first_output(tr(*args[n], **captured[n]))
            per_expert[n][name] = {"ms_per_forward": round(ms, 2), "mfu": round(flops[n] / (ms / 1e3) / 1e12 / peak, 3),
                                   "vs_baseline": diff(outp, refs[n])}
            print(family, n, name, per_expert[n][name], flush=True)
        rec[name] = per_expert["transformer"][name]
        save(out, family, {**rec, "partial": f"ended after {name}", "experts": per_expert})  # kept if killed later

    timed("baseline")
    # can the comparisons below see the blocks at all? (a bit-identical output with the blocks off: they cannot)
    prefixes = type(eng).fp8_prefixes
    for n, tr in experts:
        off = blocks_off(tr, prefixes, lambda: first_output(tr(*args[n], **captured[n])), refs[n])
        per_expert[n]["blocks_off"] = off
        print(family, n, "blocks_off", off, flush=True)
        if not off["output_depends_on_blocks"]:
            print(f"WARNING {family} {n}: the output is bit-identical with every FP8-lane Linear returning zeros "
                  f"(dummy_weight_scale {w['scale'] if not smoke else 'none'}): vs_baseline cannot show an error in "
                  "the blocks", flush=True)
    rec["blocks_off"] = per_expert["transformer"]["blocks_off"]
    rec["output_depends_on_blocks"] = all(pe["blocks_off"]["output_depends_on_blocks"] for pe in per_expert.values())
    # the runner's lossless preset, applied in place by the runner's own code (every install on each expert)
    eng.pipe = pipe
    eng.prepare_attention()  # SD3: diffusers' processors replaced by the dispatching one (same math)
    fuse = family != "ltx2"  # LTX-2's processor reads no fused projection (refused: LTX2Engine.check_config)
    rec["optimize"] = eng.optimize(OmegaConf.create({"fuse_qkv": fuse, "vae_channels_last": False}))
    att = "TORCH_SDPA" if smoke else "CUDNN_ATTN"
    roles = [str(r) for r in cfg.model.roles]
    attention.install("denoise", eng.attention_sites(), {r: {"backend": att} for r in roles},
                      None if smoke else torch.cuda.get_device_capability()[0] * 10, observe=False)
    if not smoke:
        for _, tr in experts:
            compile_regional(tr)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for n, tr in experts:
            tr(*args[n], **captured[n])
    rec["compile_s"] = round(time.perf_counter() - t0, 1)
    timed("lossless")
    torch._dynamo.reset()  # the lossless graphs hold the bf16 weights: freed before the FP8 copies are made
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    fp8 = None
    for _, tr in experts:
        fp8 = linear.install(tr, "FP8", prefixes=type(engine_for(cfg, device, dtype)).fp8_prefixes, observe=False,
                             record=fp8)
    rec["fp8_modules"] = fp8.modules
    torch._dynamo.reset()
    if not smoke:
        for _, tr in experts:
            compile_regional(tr)
    with torch.inference_mode():
        for n, tr in experts:
            tr(*args[n], **captured[n])
    timed("fp8")
    per_step = rec["forwards_per_step"]
    for pe in per_expert.values():
        for k in ("baseline", "lossless", "fp8"):
            pe[k]["ms_per_step"] = round(pe[k]["ms_per_forward"] * per_step, 2)
        pe["speedup_lossless"] = round(pe["baseline"]["ms_per_forward"] / pe["lossless"]["ms_per_forward"], 3)
        pe["speedup_fp8"] = round(pe["baseline"]["ms_per_forward"] / pe["fp8"]["ms_per_forward"], 3)
    rec["speedup_lossless"] = per_expert["transformer"]["speedup_lossless"]
    rec["speedup_fp8"] = per_expert["transformer"]["speedup_fp8"]
    rec[f"speedup_{family}"], rec[f"mfu_{family}"] = rec["speedup_lossless"], rec["lossless"]["mfu"]
    if len(experts) > 1:
        rec["experts"] = per_expert
    del pipe, experts, captured, args, refs, eng, tr  # tr: the last expert (its weights stay alive otherwise)
    gc.collect()
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()

    # evidence through the runner's own loop
    from runner.app.execute import run

    rows = out / f"{family}_rows.jsonl"
    row = {"id": "e0", "prompt": w["prompt"], **({"negative_prompt": w["negative"]} if w["negative"] else {})}
    rows.write_text(json.dumps(row) + "\n")
    ev_ov = [*ov, "dataset=jsonl", f"dataset.path={rows}", "model.generation.num_inference_steps=2",
             "dataset.on_ignored=record",
             f"backend.attention={att}", f"backend.linear={'TORCH' if smoke else 'FP8'}", "compile=none",
             *w.get("evidence", []), *evidence]
    run_dir = out / f"{family}_evidence_run"
    t0 = time.perf_counter()
    code = run(compose(ev_ov), run_dir, ev_ov)
    man = json.loads((run_dir / "manifest.json").read_text())
    st = man["evidence"]["stages"]["denoise"]
    rec["evidence"] = {"exit_code": code, "overrides": ev_ov, "verdict": man["evidence"]["verdict"],
                       "mismatches": man["evidence"]["mismatches"], "denoiser_forwards": st["denoiser_forwards"],
                       "expected_forwards": st["expected_forwards"], "checks": st.get("checks"),
                       "expert_forwards": st.get("expert_forwards"),
                       "expert_switch": (st.get("experts") or {}).get("first", {}).get("switch_step"),
                       "attention_by_backend": st["attention"]["by_backend"], "linear": st.get("linear"),
                       "kernels": {k: st.get("kernels", {}).get(k) for k in ("attention", "linear")},
                       "run_s": round(time.perf_counter() - t0, 1)}
    first = json.loads((run_dir / "items.jsonl").read_text().splitlines()[0])
    if any(k.startswith("audio_") for k in first):  # LTX-2: the audio stream as written and decoded back
        rec["evidence"]["audio"] = {k: v for k, v in first.items() if k.startswith("audio_")}
    print(family, "evidence", rec["evidence"]["verdict"], rec["evidence"]["kernels"], flush=True)
    return rec


def save(out: Path, family: str, rec: Dict[str, Any]) -> None:
    """Write ``out/families_<family>.json`` (written after each timed setting, so a call stopped at its time limit
    keeps the figures it measured, marked ``partial``)."""
    (out / f"families_{family}.json").write_text(json.dumps(rec, indent=1, default=str))


def merge(files: List[Path], into: Path) -> Dict[str, Any]:
    """Merge per-family records (``families_<family>.json``) into ``into`` (created or updated in place): the records
    under ``families``, and per family at the top level ``speedup_<family>``, ``mfu_<family>``, ``speedup_fp8_<family>``
    and ``device_<family>`` (the card that measured it). A partial record (a call stopped before its last setting) or a
    failed one is kept under ``families`` with its ``partial`` / ``error`` and gives no top-level figure; a family
    measured again replaces its earlier record."""
    doc = json.loads(into.read_text()) if into.is_file() else {}
    doc.setdefault("about", "benchmarks/families_h200.py per family (module docstring); merged with --merge")
    fams = doc.setdefault("families", {})
    for f in files:
        rec = json.loads(Path(f).read_text())
        fam = rec["family"]
        fams[fam] = rec
        for k in ("speedup", "mfu", "speedup_fp8", "device"):
            doc.pop(f"{k}_{fam}", None)
        if "error" in rec or "partial" in rec:
            continue
        doc[f"speedup_{fam}"] = rec.get(f"speedup_{fam}")
        doc[f"mfu_{fam}"] = rec.get(f"mfu_{fam}")
        doc[f"speedup_fp8_{fam}"] = rec.get("speedup_fp8")
        doc[f"device_{fam}"] = rec.get("device")
    into.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    return doc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", action="append", choices=list(WORKLOADS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--encode-apart", action="store_true",
                    help="encode the prompt with the text encoder alone, then build the rest (automatic for FLUX.2-dev "
                         "on a card under 120 GiB)")
    ap.add_argument("--evidence", action="append", default=[],
                    help="an override added to the evidence run (memory.offload=auto on a card the model does not fit)")
    ap.add_argument("--merge", type=Path, nargs="+", help="families_<family>.json files to merge into --into")
    ap.add_argument("--into", type=Path, help="the merged result (benchmarks/results/families_2026_h200.json)")
    a = ap.parse_args()
    if a.merge:
        if not a.into:
            ap.error("--merge needs --into PATH")
        merge(a.merge, a.into)
        return 0
    if not a.family or not a.out:
        ap.error("--family and --out are required (or --merge FILES --into PATH)")
    a.out.mkdir(parents=True, exist_ok=True)
    for fam in a.family:
        try:
            rec = bench_family(fam, a.smoke, a.out, a.evidence, a.encode_apart)
        except Exception as e:  # one family failing must not lose the others' figures
            import traceback

            traceback.print_exc()
            kept = a.out / f"families_{fam}.json"  # the figures measured before the failure stay
            rec = {**(json.loads(kept.read_text()) if kept.is_file() else {}), "family": fam,
                   "error": f"{type(e).__name__}: {e}"}
        save(a.out, fam, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
