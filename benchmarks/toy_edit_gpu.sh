#!/usr/bin/env bash
# Train toy_edit on the H200 (models/toy_edit/train.py: a FluxTransformer2DModel on edit pairs, toy_shapes' VAE and
# text encoders frozen), then evaluate through the real FluxKontextPipeline (fp32; 28/16/8 steps) with the oracle:
# the 60 builtin rows, all 540 edits, and the swapped-input control of each.
# Here:   mkdir -p .cache/whl && cp /work/main/.whlbench/{antlr4,diffusers,hydra,omegaconf}* .cache/whl/   (cp312
#         wheels the H200 image lacks: diffusers 0.42.1, omegaconf 2.3.0, antlr4 4.9.3, hydra-core 1.3.2; .cache/ is
#         git-ignored)
# Device: run(carry=[".cache/whl"], command="bash benchmarks/toy_edit_gpu.sh [TRAIN ARGS...]"). The tool sends the
#         session's own checkout, not a helper's worktree: from a worktree, copy it (git archive HEAD, plus .cache/whl)
#         into a git-ignored folder of that checkout, carry the folder and cd into it first. The 2026-12-02 report:
#         run(carry=[".cache/toyedit2_carry"], command="cd .cache/toyedit2_carry && TIME_LIMIT=210 bash
#         benchmarks/toy_edit_gpu.sh --steps 20000 --batch 256"): 247 s wall, 4172 steps in 202 s (50 ms/step).
# Writes $OUT/train.json (the report), $OUT/train.log, $OUT/toy_edit_weights.tar (the saved pipeline, fp16);
# install: tar -C models/toy_edit/weights -xf toy_edit_weights.tar; cp train.json
# benchmarks/results/toy_edit_train_h200_<date>.json. TIME_LIMIT (seconds, default 240) bounds the training loop.
set -u
: "${OUT:?set OUT to the output folder of the device call}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .cache/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
set -o pipefail
python3 -m models.toy_edit.train --out /tmp/toy_edit_w --report "$OUT/train.json" --time-limit "${TIME_LIMIT:-240}" \
  "$@" 2>&1 | tee "$OUT/train.log" | grep -v '^ ' | grep -v Warning
echo "train rc=$?"
tar -C /tmp/toy_edit_w -cf "$OUT/toy_edit_weights.tar" . && ls -la "$OUT"
python3 - "$OUT/train.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for k, v in r.get("eval_fp32", {}).items():
    print(f"{k:28s} n={v['n']} color={v['color']:.3f} shape={v['shape']:.3f} position={v['position']:.3f} "
          f"instructed={v['instructed']:.3f} kept={v['kept']:.3f} all={v['all']:.3f}"
          + (f"  vs_given_input all={v['vs_given_input']['all']:.3f}" if "vs_given_input" in v else ""))
print({k: r.get(k) for k in ("steps", "steps_planned", "ms_per_step", "flow_loss_last10", "flow_s", "eval_s",
                             "weights_bytes")})
PY
