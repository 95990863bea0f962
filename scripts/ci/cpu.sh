#!/usr/bin/env bash
# CPU CI: the whole suite except the tests that need CUDA hardware (markers: see README.md beside this file).
# Tests marked cuda/sm90/sm100/cards_2 are deselected here; run them with cuda.sh on a GPU machine.
# Usage: scripts/ci/cpu.sh [extra pytest args]   (PYTHON=/path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python}"
exec "$PY" -m pytest -q -m "not cuda" "$@"
