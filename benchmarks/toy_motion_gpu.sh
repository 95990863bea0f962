#!/usr/bin/env bash
# Train toy_motion on the GPU (models/toy_motion/train.py: VAE, then flow-matching transformer, then the oracle's
# accuracy through WanPipeline for every caption).
# Usage: benchmarks/toy_motion_gpu.sh OUT_DIR [TRAIN ARGS...]   (writes OUT_DIR/toy_motion_weights.tar, train.json,
# train.log; install them with benchmarks/toy_motion_install.py OUT_DIR)
# TIME_LIMIT (seconds, default 330) bounds both training stages for a metered device session (see train.py).
set -u
out=${1:?out}
mkdir -p "$out"
python -m models.toy_motion.train --out "$out/w" --report "$out/train.json" --time-limit "${TIME_LIMIT:-330}" \
  "${@:2}" > "$out/train.log" 2>&1
echo "train rc=$?"
grep -v '^ ' "$out/train.log" | tail -40
tar -C "$out/w" -cf "$out/toy_motion_weights.tar" . && rm -rf "$out/w"
ls -la "$out"
