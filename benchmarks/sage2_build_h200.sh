#!/usr/bin/env bash
# Build SageAttention 2 (its Hopper kernel sageattn_qk_int8_pv_fp8_cuda_sm90: INT8 Q/K, FP8 P/V, wgmma for
# sm_90a) as a wheel on the H200 machine, into $OUT, then check it and time it at the FLUX shape
# (benchmarks/attention_fp8.py: cuDNN bf16 vs SageAttention 2 vs its Triton INT8 path).
#
#   bash benchmarks/sage2_build_h200.sh [SOURCE_TARBALL]
#
# SOURCE_TARBALL: `git archive` of github.com/thu-ml/SageAttention (setup.py, README.md, LICENSE, MANIFEST.in,
# csrc/, sageattention/); default: the newest .whl18/SageAttention-src-*.tar.gz (carry .whl18).
# The device has no network: nothing is downloaded; torch, setuptools, wheel, ninja and nvcc are the image's.
#
# Lean build (default, ~3-6 min with MAX_JOBS=16): only the extensions the sm90 path uses (_qattn_sm90, _fused;
# the sm80/sm89 ones are skipped, and sageattention imports without them), and in the sm90 kernel only the
# instantiations a diffusion transformer calls: not causal, no log-sum-exp, per-thread Q/K quantization (head_dim
# 64 and 128, fp16 and bf16 kept); the others throw at run time. SAGE2_FULL=1 builds everything (much longer).
# Host debug info (-g) and ptxas verbosity are dropped from the flags.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="${1:-$(ls -t "$ROOT"/.whl18/SageAttention-src-*.tar.gz 2>/dev/null | head -1)}"
OUT="${OUT:-/tmp/sage2_out}"
mkdir -p "$OUT"
[ -f "$SRC" ] || { echo "no SageAttention source tarball (carry .whl18 with SageAttention-src-*.tar.gz)"; exit 2; }
WORK=/tmp/sage2_build
rm -rf "$WORK" && mkdir -p "$WORK" && tar -xzf "$SRC" -C "$WORK"
cd "$WORK"/SageAttention
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export PATH="$CUDA_HOME/bin:$PATH"
export LIBRARY_PATH="$CUDA_HOME/lib64/stubs:$CUDA_HOME/lib64:${LIBRARY_PATH:-}"  # -lcuda of _qattn_sm90
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS="${MAX_JOBS:-16}" EXT_PARALLEL="${EXT_PARALLEL:-2}"
nvcc --version | tail -2
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'

SAGE2_FULL="${SAGE2_FULL:-0}" python3 - <<'PY'
import os, re
full = os.environ["SAGE2_FULL"] == "1"
s = open("setup.py").read()
for a, b in (('"-g", ', ''), ('"-Xptxas=-v",', ''),
             ("version='2.2.0'", "version='2.2.0+runner.%s'" % ("full" if full else "lean"))):
    assert a in s, a
    s = s.replace(a, b, 1)
if not full:
    for line in ("    if HAS_SM80 or HAS_SM86 or HAS_SM89 or HAS_SM90 or HAS_SM100 or HAS_SM120 or HAS_SM121:",
                 "    if HAS_SM89 or HAS_SM90 or HAS_SM100 or HAS_SM120 or HAS_SM121:"):
        assert line in s, line
        s = s.replace(line, line.replace(" or HAS_SM90", ""), 1)
open("setup.py", "w").write(s)
if not full:
    h = open("csrc/dispatch_utils.h").read()

    def only(name, var, value, kind):
        global h
        pat = re.compile(r"#define %s\(.*?\n(?:.*\\\n)*.*\n" % name)
        assert pat.search(h), name
        body = ("#define %s(x, %s, ...)  \\\n  if (x == %d) {  \\\n    constexpr %s %s = %s;  \\\n    __VA_ARGS__  \\\n"
                "  } else {  \\\n    throw std::invalid_argument(\"%s: not in this lean SageAttention build "
                "(runner sage2_build_h200.sh; SAGE2_FULL=1 builds it)\");  \\\n  }\n"
                % (name, var, value, kind, var, {"bool": "false", "int": str(value)}[kind], name))
        h = pat.sub(lambda m: body, h, count=1)

    only("DISPATCH_CAUSAL", "IS_CAUSAL", 0, "bool")
    only("DISPATCH_RETURN_LSE", "RETURN_LSE", 0, "bool")
    only("DISPATCH_QK_QUANT_GRAN", "QK_QUANT_GRAN", 3, "int")
    open("csrc/dispatch_utils.h", "w").write(h)
print("patched:", "full build" if full else "lean build (sm90 + fused; non-causal, no lse, per-thread)")
PY

t0=$(date +%s)
python3 -m pip wheel --no-build-isolation --no-deps --no-index -w "$OUT" . > "$OUT/sage2_build.log" 2>&1 || {
  tail -60 "$OUT/sage2_build.log"; echo "BUILD FAILED after $(( $(date +%s) - t0 )) s"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s:"; ls -la "$OUT"/*.whl
rm -rf /tmp/sage2site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sage2site "$OUT"/sageattention-*.whl
cd "$ROOT"
PYTHONPATH="/tmp/sage2site:$ROOT${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/attention_fp8.py --out "$OUT/attention_fp8_h200.json"
