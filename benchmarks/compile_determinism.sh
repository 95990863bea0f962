#!/usr/bin/env bash
# Inductor's on-device autotuning vs artifact reproducibility, side by side on one GPU: the same 4 rows in 4 fresh
# processes, each with its own empty Inductor cache; two with optimize.deterministic_compile=false, two with true.
# Prints whether each pair made identical PNGs and the denoising ms/step of each process.
# Usage: benchmarks/compile_determinism.sh OUT [overrides...]   (default overrides: experiment=flux_dev_h200)
set -uo pipefail
out=$1; shift; mkdir -p "$out"
ov=("${@:-experiment=flux_dev_h200}")
i=0
for det in false false true true; do
  i=$((i + 1))
  TORCHINDUCTOR_CACHE_DIR="$out/inductor$i" python benchmarks/determinism.py --out "$out/p$i" --prompts 4 --sets A \
    --no-weights "${ov[@]}" "optimize.deterministic_compile=$det" > "$out/p$i.log" 2>&1 || echo "process $i failed"
done
python - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
res = {}
for i in range(1, 5):
    d = json.loads((out / f"p{i}" / "determinism.json").read_text())
    m = json.loads((out / f"p{i}" / "A" / "manifest.json").read_text())
    steps = 4 * m["config"]["model"]["generation"]["num_inference_steps"]
    res[i] = {"deterministic_compile": m["config"]["optimize"]["deterministic_compile"], "shas": d["shas"]["A"],
              "ms_per_step": round(1e3 * m["timing"]["phases_s"]["denoise"] / steps, 2),
              "warmup_s": m["timing"]["warmup_s"], "compile": m.get("compile")}
summary = {"autotuned_processes_identical": res[1]["shas"] == res[2]["shas"],
           "deterministic_processes_identical": res[3]["shas"] == res[4]["shas"],
           "ms_per_step": {i: (r["deterministic_compile"], r["ms_per_step"]) for i, r in res.items()},
           "warmup_s": {i: r["warmup_s"] for i, r in res.items()}}
(out / "compile_determinism.json").write_text(json.dumps({"summary": summary, "processes": res}, indent=2))
print(json.dumps(summary, indent=1))
PY
