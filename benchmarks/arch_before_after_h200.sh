#!/usr/bin/env bash
# Issue #28 acceptance on the H200: FLUX.1-dev 1024^2, 28 steps, random weights, variants baseline / lossless /
# torchao_fp8 of benchmarks/flux_dev_1024.py, for the tree before the restructure (a `git archive` of it in .before/)
# and for this tree, one after the other in one device call; (The second-process warm-up of issue #29 is its own call: --variants lossless --second-process.)
# Each tree gets its own compile cache (RUNNER_CACHE), so neither reads the other's compiled graphs.
#
# Here:   git archive <before-commit> --prefix=.before/ | tar x      # and the wheels the H200 lacks in .whlbench/:
#         pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#           --platform any -d .whlbench hydra-core==1.3.2 omegaconf==2.3.0 diffusers==0.42.1 torchao==0.18.0 \
#           torchmetrics==1.9.0 lightning-utilities==0.15.3; pip wheel --no-deps -w .whlbench antlr4-python3-runtime==4.9.3
# Device: run(carry=[".before", ".whlbench"], command="bash benchmarks/arch_before_after_h200.sh")
set -u
: "${OUT:?set OUT to the output folder of the device call}"
wheels=${WHEELS:-.whlbench}  # or .whl (the device wheels of .whl/env.sh, torchmetrics + lightning-utilities among them)
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheels"/*.whl 2>&1 | tail -2
variants=${VARIANTS:-baseline,lossless,torchao_fp8}
prompts=${PROMPTS:-4}
(cd .before && RUNNER_CACHE=/tmp/cache_before PYTHONPATH=/tmp/site:$PWD timeout ${LANE_TIMEOUT:-280} python3 benchmarks/flux_dev_1024.py \
   --prompts "$prompts" --variants "$variants" --out /tmp/before --results "$OUT/flux_before.json") > "$OUT/before.log" 2>&1
echo "before: rc=$?"
RUNNER_CACHE=/tmp/cache_after PYTHONPATH=/tmp/site:$PWD timeout ${LANE_TIMEOUT:-280} python3 benchmarks/flux_dev_1024.py \
   --prompts "$prompts" --variants "$variants" --out /tmp/after --results "$OUT/flux_after.json" \
   > "$OUT/after.log" 2>&1
echo "after: rc=$?"
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {}
for tree in ("before", "after"):
    p = out / f"flux_{tree}.json"
    rows[tree] = json.loads(p.read_text()).get("ms_per_step", {}) if p.is_file() else {}
for v in sorted(set(rows["before"]) | set(rows["after"])):
    b, a = rows["before"].get(v), rows["after"].get(v)
    ratio = round(a / b, 4) if a and b else None
    print(f"{v:14s} before {b} ms/step  after {a} ms/step  after/before {ratio}")
PY
