"""An AR stage through the runner vs plain ``vllm.LLM.generate`` on the same model, prompts and sampling, in one
process: output tokens per second of the generate calls, and whether the token ids are identical.

1. ``runner.app.execute.run`` with ``model=<model>`` (default ``tiny_qwen3_moe``, the 18 builtin prompts): its manifest's
   ``timing.generate_s`` and the output tokens of its records; its ``llm_kwargs`` (how it built ``vllm.LLM``).
2. The runner's LLM is closed, then a plain ``vllm.LLM(**llm_kwargs)`` generates the same prompts with the same
   ``SamplingParams`` (per row seed, as the records say) in one ``generate`` call, timed the same way (wall clock
   around the call), twice: the first call of the fresh engine (compared with the runner's, also its engine's
   first) and a warm one. Engine start and import are outside both figures.

``runner_overhead`` = runner generate seconds / plain generate seconds (the issue's target: <= 1.03 on a GPU).
Usage: ``python benchmarks/ar_vs_plain_vllm.py --out DIR [--model tiny_qwen3_moe] [overrides...]``
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compose(overrides):
    import hydra

    from runner.core.schema import register_configs

    register_configs()
    with hydra.initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf"), job_name="bench"):
        return hydra.compose("config", overrides=list(overrides))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="tiny_qwen3_moe")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from runner.app.execute import run

    ov = [f"model={a.model}", *a.overrides]
    run_dir = a.out / "runner_run"
    code = run(compose(ov), run_dir, ov)
    man = json.loads((run_dir / "manifest.json").read_text())
    recs = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r.get("status") == "ok"]
    kw = dict(man["model"]["engine"]["llm_kwargs"])
    runner_s = float(man["timing"]["generate_s"])
    tokens = sum(len(r["output_token_ids"]) for r in recs)
    gc.collect()

    import vllm

    llm = vllm.LLM(**kw)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in recs]
    params = [vllm.SamplingParams(**{k: v for k, v in r["sampling"].items() if k != "id"}, seed=r["seed"])
              for r in recs]
    plain_runs = []
    for _ in range(2):  # the first call is the fresh engine's first, like the runner's; the second is warm
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        plain_runs.append(time.perf_counter() - t0)
    plain_s = plain_runs[0]
    same = all(list(o.outputs[0].token_ids) == r["output_token_ids"] for o, r in zip(outs, recs))
    res = {"model": a.model, "overrides": ov, "exit_code": code, "requests": len(recs), "output_tokens": tokens,
           "runner_generate_s": round(runner_s, 4), "plain_generate_s": round(plain_s, 4),
           "runner_tokens_per_s": round(tokens / runner_s, 1), "plain_tokens_per_s": round(tokens / plain_s, 1),
           "runner_overhead": round(runner_s / plain_s, 3), "plain_generate_s_warm": round(plain_runs[1], 4),
           "token_ids_identical": same,
           "generate_calls": man["timing"].get("generate_calls"), "vllm": vllm.__version__, "llm_kwargs": kw}
    (a.out / "ar_vs_plain_vllm.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k != "llm_kwargs"}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
