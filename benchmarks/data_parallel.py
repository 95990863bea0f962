"""Data-parallel scaling on one host: the same workload on 1 GPU, then on N GPUs with torchrun, in one lease.

Runs ``python -m runner <overrides>`` on GPU 0 alone, then ``torchrun --nproc-per-node N -m runner
parallelism=data <overrides>``, both on the same prompts file, and compares:

* throughput: images/hour of the generation loop (the N-GPU run's: every worker's images over the slowest
  worker's loop, from the merged manifest), and end-to-end (process start to exit, load and compile included);
* artifacts: sha256 of every PNG, item by item (identical when every GPU computes the same per-row math);
* the merged manifest: one entry per worker with its device and evidence verdict.

Usage: ``python benchmarks/data_parallel.py --out DIR [--gpus 2] [--prompts 16] [overrides ...]``
(default overrides: ``experiment=flux_dev_h200``). Results: ``DIR/data_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import prompt_rows, write_jsonl  # noqa: E402


def _run(cmd, env, log: Path) -> tuple:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = args.overrides or ["experiment=flux_dev_h200"]
    prompts = write_jsonl(out / "prompts.jsonl", prompt_rows(args.prompts))
    common = overrides + ["dataset=jsonl", f"dataset.path={prompts}"]
    env = dict(os.environ)
    res = {"command": " ".join(["python"] + sys.argv), "overrides": common, "gpus": args.gpus}

    one = out / "gpu1"
    env1 = dict(env, CUDA_VISIBLE_DEVICES="0")
    code1, wall1 = _run([sys.executable, "-m", "runner", *common, f"output.dir={one}"], env1, out / "gpu1.log")
    many = out / f"gpu{args.gpus}"
    code2, wall2 = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={args.gpus}", "-m", "runner", *common, "parallelism=data",
                         f"output.dir={many}"], env, out / f"gpu{args.gpus}.log")
    res["exit_codes"] = {"gpu1": code1, f"gpu{args.gpus}": code2}
    m1 = json.loads((one / "manifest.json").read_text())
    m2 = json.loads((many / "manifest.json").read_text())
    i1 = {r["key"]: r for r in map(json.loads, (one / "items.jsonl").read_text().splitlines()) if r.get("status") == "ok"}
    i2 = {r["key"]: r for r in map(json.loads, (many / "items.jsonl").read_text().splitlines()) if r.get("status") == "ok"}
    same = [k for k in i1 if k in i2 and i1[k]["file_sha256"] == i2[k]["file_sha256"]]
    res["artifacts"] = {"items_1gpu": len(i1), f"items_{args.gpus}gpu": len(i2), "identical": len(same),
                        "differing": sorted(set(i1) ^ set(i2) | {k for k in i1 if k in i2 and k not in same})}
    if len(same) != len(i1) and i1:
        from runner.tools.report import load_rgb, psnr

        res["artifacts"]["psnr_db_of_differing"] = {k: round(psnr(load_rgb(one / i1[k]["file"]),
                                                                  load_rgb(many / i2[k]["file"])), 2)
                                                    for k in i1 if k in i2 and k not in same}
    t1, t2 = m1["timing"], m2["timing"]
    res["gpu1"] = {"images_per_hour": t1["images_per_hour"], "loop_s": t1["loop_s"], "load_s": t1["load_s"],
                   "warmup_s": t1["warmup_s"], "process_wall_s": round(wall1, 1), "device": m1["platform"]["device"],
                   "evidence": m1["evidence"]["verdict"], "status": m1["status"]}
    res[f"gpu{args.gpus}"] = {"images_per_hour": t2["images_per_hour"], "loop_s": t2["loop_s"],
                             "process_wall_s": round(wall2, 1), "status": m2["status"],
                             "workers": [{k: w.get(k) for k in ("rank", "device", "device_name", "shard_items",
                                                                  "status", "evidence_verdict", "timing")}
                                         for w in m2["workers"]],
                             "evidence": m2["evidence"]["verdict"]}
    res["speedup_loop"] = round(t2["images_per_hour"] / t1["images_per_hour"], 3) if t1["images_per_hour"] else None
    res["speedup_end_to_end"] = round(wall1 / wall2, 3)
    res["target_speedup"] = 1.9
    (out / "data_parallel.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=1))
    return 0 if code1 == code2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
