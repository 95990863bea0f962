#!/usr/bin/env bash
# CUDA CI: only the tests marked cuda (sm90/sm100/cards_2 tests carry cuda too; see README.md beside this file).
# Tests whose hardware is absent (another compute capability, too few GPUs) are skipped with the reason.
# Fails at once when this machine has no CUDA device, so a CPU runner never reports a green, all-skipped job.
# Usage: scripts/ci/cuda.sh [extra pytest args]   (PYTHON=/path/to/python to pick the interpreter)
# AR stages (tests/test_ar_cuda.py) need vLLM's CUDA build; on the H200 it is carried as wheels
# (benchmarks/vllm_h200_wheels.py): PYTHON=python3 PYTHONPATH=/tmp/site:$PWD RUNNER_REQUIRE_VLLM=1 scripts/ci/cuda.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python}"
"$PY" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("cuda.sh: no CUDA device is visible (torch.cuda.is_available() is False); run scripts/ci/cpu.sh here")
n = torch.cuda.device_count()
print(f"cuda.sh: {n} device(s); device 0: {torch.cuda.get_device_name(0)} "
      f"sm{''.join(map(str, torch.cuda.get_device_capability(0)))}; torch {torch.__version__}, CUDA {torch.version.cuda}")
import importlib.util
if importlib.util.find_spec("vllm") is None:  # the AR tests (tests/test_ar_cuda.py) skip, or fail with RUNNER_REQUIRE_VLLM=1
    print("cuda.sh: vLLM is not importable: the AR tests skip (H200: benchmarks/vllm_h200_wheels.py, then "
          "PYTHONPATH=/tmp/site:$PWD)")
else:
    import vllm
    print(f"cuda.sh: vLLM {vllm.__version__} ({vllm.__file__})")
PY
# -o addopts: one process (the pyproject's two xdist workers would share the one GPU; the device has no xdist)
# -v: each test's outcome (a skip with its reason) on its own line as it ends, so a call stopped by the device's time
# limit still says what ran; -rp: a PASSED line per test in the summary too (docs/support_matrix.md reads both)
exec "$PY" -m pytest -v -o addopts=-ra -m cuda -rfEsp "$@"
