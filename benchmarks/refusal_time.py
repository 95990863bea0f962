"""How long a row-level refusal takes (issue #38: target <= 3 s on a 2-core CPU machine): ``python -m runner
model.task=image_to_image dataset=jsonl`` with a row whose ``image`` does not exist, from a fresh process in an empty
folder (the default run dir, as a newcomer runs it), ``--repeat`` times; prints each wall time, the median, the exit
code, the CPU seconds each took (user + system: what a loaded machine does not inflate), whether
torch/diffusers were imported (``-X importtime``) and whether a run dir was left behind.

    python benchmarks/refusal_time.py [--repeat 5] [--checkout /path/to/another/checkout] [--results out.json]

``--results`` also writes the figures as JSON (``benchmarks/results/refusal_time_cpu_<date>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--checkout", type=Path, default=REPO, help="the checkout to time (default: this one)")
    ap.add_argument("--results", type=Path, default=None, help="also write the figures to this JSON file")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(a.checkout), *filter(None, [os.environ.get("PYTHONPATH")])]))
    times, cpu, codes = [], [], set()
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        rows.write_text(json.dumps({"id": "a", "prompt": "a red circle", "image": "missing.png"}) + "\n")
        args = [sys.executable, "-m", "runner", "model.task=image_to_image", "dataset=jsonl", f"dataset.path={rows}"]
        for _ in range(a.repeat):
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            p = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # CPU seconds: what the load average does not inflate
            cpu.append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
            codes.add(p.returncode)
            assert "does not exist" in p.stderr + p.stdout, (p.stdout + p.stderr)[-2000:]
        left = [str(d) for d in (Path(tmp) / "outputs" / "runs").glob("*/*")]  # after the timed runs
        p = subprocess.run([sys.executable, "-X", "importtime", *args[1:]], cwd=tmp, env=env, capture_output=True,
                           text=True)
        names = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
        imported = sorted(names & {"torch", "diffusers", "transformers", "vllm"})
    load = os.getloadavg()[0]
    print("wall s:", " ".join(f"{t:.2f}" for t in times), "| CPU s:", " ".join(f"{t:.2f}" for t in cpu))
    print(f"median {statistics.median(times):.2f} s over {len(times)} runs; exit codes {sorted(codes)}; "
          f"imported: {imported or 'none of torch/diffusers/transformers/vllm'}; "
          f"run dirs left: {len(left)}; load average {load:.1f} on {os.cpu_count()} cores")
    if a.results is not None:
        doc = {"benchmark": "refusal_time", "command": " ".join(["python -m runner", *args[3:]]),
               "target_s": 3.0, "wall_s": [round(t, 3) for t in times], "median_s": round(statistics.median(times), 3),
               "min_s": round(min(times), 3),
               "cpu_s": [round(t, 3) for t in cpu], "median_cpu_s": round(statistics.median(cpu), 3), "exit_codes": sorted(codes), "heavy_imports": imported,
               "run_dirs_left": len(left), "load_average_1m": round(load, 2), "cpu_count": os.cpu_count(),
               "python": sys.version.split()[0], "checkout": str(a.checkout)}
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
