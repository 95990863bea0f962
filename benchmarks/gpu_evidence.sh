#!/usr/bin/env bash
# Runner runs on a CUDA GPU with evidence, one per backend choice, on a reduced-depth FLUX.1-dev architecture
# (real width, random weights, load_format=dummy). Usage: benchmarks/gpu_evidence.sh OUT_DIR none|regional
# Optional 3rd argument: a regex; only runs whose tag matches it.
# Writes OUT_DIR/evidence_<compile>.json: per run, the exit code, the backends and evidence sections.
set -u
out=${1:?out dir}; mode=${2:-none}
M="model=flux model.load_format=dummy platform=cuda model.architecture.transformer.num_layers=2
   model.architecture.transformer.num_single_layers=4 model.architecture.text_encoder_2.num_layers=2
   model.architecture.text_encoder.num_hidden_layers=2 model.generation.width=512 model.generation.height=512
   model.generation.num_inference_steps=3 dataset.limit=2 batch_size=2 compile=$mode"
runs=("attn_cudnn backend.attention=CUDNN_ATTN" "attn_sage backend.attention=SAGE_ATTN"
      "linear_fp8 backend.linear=FP8" "auto")
if [ "$mode" = none ]; then
  runs+=("refuse_trtllm backend.attention=trtllm" "refuse_cudnn_fp32 backend.attention=cudnn dtype=float32"
         "refuse_flashinfer backend.attention=flashinfer")
fi
mkdir -p "$out/runs"
for r in "${runs[@]}"; do
  tag=${r%% *}; ov=${r#"$tag"}
  [[ "$tag" =~ ${3:-.} ]] || continue
  d="$out/runs/$mode-$tag"
  start=$SECONDS
  python -m runner $M $ov hydra.run.dir="$d" >"$out/runs/$mode-$tag.log" 2>&1
  echo "$tag rc=$? wall=$((SECONDS - start)) s"
  grep -E "ERROR|Error" "$out/runs/$mode-$tag.log" | tail -2
done
python - "$out" "$mode" <<'PY'
import json, sys, pathlib, re
out, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
summary = {}
for d in sorted((out / "runs").glob(f"{mode}-*")):
    if not d.is_dir():
        continue
    log = (out / "runs" / f"{d.name}.log").read_text(errors="replace")
    m = d / "manifest.json"
    entry = {"log_tail": log.strip().splitlines()[-3:]}
    if m.exists():
        doc = json.loads(m.read_text())
        entry.update(status=doc.get("status"), backends=doc.get("backends"), evidence=doc.get("evidence"),
                     timing=doc.get("timing"), platform=doc.get("platform"))
    summary[d.name] = entry
(out / f"evidence_{mode}.json").write_text(json.dumps(summary, indent=1))
for k, v in summary.items():
    ev = v.get("evidence") or {}
    kern = (ev.get("stages") or {}).get("denoise", {}).get("kernels", {})
    print(k, v.get("status"), ev.get("verdict"), json.dumps({"attention": kern.get("attention"), "launches": kern.get("attention_launches"), "linear": kern.get("linear")})[:600])
PY
