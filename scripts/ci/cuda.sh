#!/usr/bin/env bash
# CUDA CI: only the tests marked cuda (sm90/sm100/cards_2 tests carry cuda too; see README.md beside this file).
# Tests whose hardware is absent (another compute capability, too few GPUs) are skipped with the reason.
# Fails at once when this machine has no CUDA device, so a CPU runner never reports a green, all-skipped job.
# Usage: scripts/ci/cuda.sh [extra pytest args]   (PYTHON=/path/to/python to pick the interpreter)
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
PY
exec "$PY" -m pytest -q -m cuda -rs "$@"
