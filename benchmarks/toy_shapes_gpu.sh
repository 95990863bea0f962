#!/usr/bin/env bash
# Train toy_shapes on the GPU, then measure its accuracy through the runner per attention backend and FP8 linear.
# Usage: benchmarks/toy_shapes_gpu.sh OUT_DIR   (writes OUT_DIR/toy_shapes_weights.tar, train.json, backends.json)
set -u
out=${1:?out}
python -m models.toy_shapes.train --out "$out/w" --report "$out/train.json" 2>&1 | tail -25
tar -C "$out/w" -cf "$out/toy_shapes_weights.tar" .
for b in "TORCH_SDPA" "CUDNN_ATTN" "SAGE_ATTN" "CUDNN_ATTN backend.linear=FP8"; do
  tag=$(echo "$b" | tr ' =.' '___')
  python -m runner model=toy_shapes model.path="$out/w" platform=cuda dtype=bfloat16 num_images_per_prompt=4 \
    batch_size=8 backend.attention=$b hydra.run.dir="$out/runs/$tag" > "$out/runs_$tag.log" 2>&1
  echo "$tag rc=$?"
done
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1]); res = {}
for m in sorted((out / "runs").glob("*/manifest.json")):
    d = json.loads(m.read_text()); a = dict(d.get("accuracy") or {}); a.pop("read", None)
    res[m.parent.name] = {"status": d.get("status"), "verdict": (d.get("evidence") or {}).get("verdict"),
                          "accuracy": a, "kernels": (d.get("evidence") or {}).get("stages", {}).get("denoise", {}).get("kernels", {}).get("attention")}
(out / "backends.json").write_text(json.dumps(res, indent=1)); print(json.dumps(res, indent=1))
PY
rm -rf "$out/w" "$out/runs"
