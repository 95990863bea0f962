#!/usr/bin/env bash
# #16 on a CUDA GPU: the reduced-depth FLUX.1-dev architecture (real width, random weights) run, re-run into the same
# dir (every item reused: identity on CUDA), a second run into a dir in use refused, a bad PYTORCH_CUDA_ALLOC_CONF and
# a trtllm request refused before loading. Usage: benchmarks/gpu_reliability.sh OUT_DIR
# Writes OUT_DIR/gpu_reliability.json: per step the exit code, status, counts, evidence verdict, error.
set -u
out=${1:?out dir}; mkdir -p "$out"
M="model=flux model.load_format=dummy platform=cuda model.architecture.transformer.num_layers=2
   model.architecture.transformer.num_single_layers=4 model.architecture.text_encoder_2.num_layers=2
   model.architecture.text_encoder.num_hidden_layers=2 model.generation.width=512 model.generation.height=512
   model.generation.num_inference_steps=3 dataset.limit=4 batch_size=2 backend.attention=CUDNN_ATTN"
step() { tag=$1; shift; start=$SECONDS; "$@" >"$out/$tag.log" 2>&1; echo "$tag rc=$? wall=$((SECONDS - start)) s"; }
step run python -m runner $M hydra.run.dir="$out/g1"
step rerun python -m runner $M hydra.run.dir="$out/g1"
python -m runner $M model.generation.num_inference_steps=30 hydra.run.dir="$out/g2" >"$out/busy.log" 2>&1 &
busy=$!
for _ in $(seq 1 300); do [ -f "$out/g2/manifest.json" ] && break; sleep 0.2; done
step in_use python -m runner $M hydra.run.dir="$out/g2"
wait $busy; echo "busy rc=$?"
step alloc_conf env PYTORCH_CUDA_ALLOC_CONF=garbage python -m runner $M hydra.run.dir="$out/g3"
step trtllm python -m runner $M backend.attention=trtllm hydra.run.dir="$out/g4"
python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
doc = {}
for tag, d in (("run", "g1"), ("rerun", "g1"), ("in_use", None), ("busy", "g2"), ("alloc_conf", "g3"),
               ("trtllm", "g4")):
    m = out / (d or "-") / "manifest.json"
    s = out / (d or "-") / "job_status.json"
    entry = {"log_tail": (out / f"{tag}.log").read_text(errors="replace").strip().splitlines()[-2:]}
    if d and m.exists():
        doc_m = json.loads(m.read_text())
        entry.update(status=doc_m.get("status"), counts=doc_m.get("counts"),
                     verdict=(doc_m.get("evidence") or {}).get("verdict"), identity=(doc_m.get("identity") or {}).get("sha256"))
    if d and s.exists():
        entry["job_status"] = json.loads(s.read_text())
    doc[tag] = entry
(out / "gpu_reliability.json").write_text(json.dumps(doc, indent=1))
for k, v in doc.items():
    print(k, v.get("status"), v.get("counts"), v.get("verdict"), (v.get("job_status") or {}).get("outcome"), v["log_tail"][-1][:200] if v["log_tail"] else "")
PY
