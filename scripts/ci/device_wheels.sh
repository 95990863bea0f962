#!/usr/bin/env bash
# The optional packages the lent GPU machines lack, as wheels carried into a device call (they have no network).
#
#   bash scripts/ci/device_wheels.sh prepare     # here, with PyPI: writes .whl/ .whlb/ .whlv/ (git-ignored locally)
#   source .whl/env.sh                           # on the device, first thing of a call (carry the folders it needs)
#
# Three folders, because one call carries at most 64 MiB with the working tree (~30 MiB):
#   .whl   ~12 MiB  diffusers, Hydra/OmegaConf (+ antlr4, built here: sdist only), torchao, cache-dit, jsonschema
#                   (+ referencing, rpds-py, jsonschema-specifications), ftfy (+ wcwidth), sageattention 1.x
#   .whlb   ~9 MiB  bitsandbytes, repacked with only its CUDA 13.0 and CPU libraries (the wheel ships one per CUDA
#                   version: 43 MiB); the device image has torch 2.11 + CUDA 13.0 (KINDS.md)
#   .whlv  ~29 MiB  imageio-ffmpeg 0.6.0 (its ffmpeg binary; 0.8.x is 68 MiB and would not travel): video tests
#   .whlf  ~14 MiB  flashinfer-python 0.6.12 (vLLM 0.24's pin; JIT: its kernels compile on the device with the image's
#                   nvcc and ninja at first use) + nvidia-ml-py, tabulate, einops (what `import flashinfer.prefill`
#                   needs beyond the image and the vLLM carry's apache-tvm-ffi); flashinfer-cubin (447 MB of
#                   precompiled kernels) does not travel: FLASHINFER_ATTN tests (backend.attention=FLASHINFER_ATTN)
# The image's own torch, transformers, peft, accelerate, torchmetrics, safetensors, attrs, pyyaml are used as they are
# (KINDS.md "Python packages already there"). vLLM travels apart (benchmarks/vllm_h200_wheels.py).
# env.sh installs every carried folder's wheels into /tmp/site (--no-deps: each dependency is listed above) and
# exports PYTHONPATH=/tmp/site:$PWD; a folder not carried is skipped with a line saying so.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PINS=(diffusers==0.42.1 hydra-core==1.3.2 omegaconf==2.3.0 torchao==0.18.0 cache-dit==1.5.3 jsonschema==4.26.0
      jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py ftfy==6.3.1 wcwidth sageattention==1.0.6)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

prepare() {
  mkdir -p .git/info
  for d in .whl .whlb .whlv .whlf; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude
    rm -rf "$d" && mkdir -p "$d"
  done
  python3 -m pip download -q "${PLAT[@]}" -d .whl "${PINS[@]}"
  python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
  python3 -m pip download -q "${PLAT[@]}" -d /tmp/bnb_full bitsandbytes==0.50.2
  python3 - /tmp/bnb_full/bitsandbytes-0.50.2-*.whl .whlb <<'PY'
import base64, hashlib, sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2]) / Path(sys.argv[1]).name
keep = lambda n: not (n.startswith("bitsandbytes/libbitsandbytes_cuda") and "cuda130" not in n)
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zo:
    record, lines = None, []
    for info in zi.infolist():
        if info.filename.endswith(".dist-info/RECORD"):
            record = info.filename
            continue
        if keep(info.filename):
            data = zi.read(info)
            zo.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
    zo.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
print(f"bitsandbytes repacked: {dst} ({dst.stat().st_size / 2**20:.1f} MiB)")
PY
  python3 -m pip download -q "${PLAT[@]}" --platform manylinux2010_x86_64 -d .whlv imageio-ffmpeg==0.6.0
  python3 -m pip download -q "${PLAT[@]}" -d .whlf flashinfer-python==0.6.12 nvidia-ml-py tabulate einops
  cat > .whl/env.sh <<'SH'
# source .whl/env.sh (device): install the carried wheels (scripts/ci/device_wheels.sh) into /tmp/site
for d in .whl .whlb .whlv .whlf; do
  if ls "$d"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
      2>&1 | grep -v "^WARNING: Target directory" || true
  else
    echo "device_wheels: $d not carried (its packages are absent in this call)"
  fi
done
export PYTHONPATH=/tmp/site:$PWD
SH
  du -sh .whl .whlb .whlv .whlf
}

case "${1:-}" in
  prepare) prepare ;;
  *) echo "usage: $0 prepare   (here; on the device: source .whl/env.sh)" >&2; exit 2 ;;
esac
