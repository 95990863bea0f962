"""Re-record ``tests/data/golden_artifacts.json``: the artifacts of the two embedded defaults on this machine.

    python scripts/record_golden.py            # runs both defaults, rewrites the JSON
    python scripts/record_golden.py --check    # runs both, prints what differs from the recorded JSON, writes nothing

Re-record only when the machine (the facts :func:`machine_facts` returns) or the torch build changed, never to make
a code change pass: ``tests/test_golden.py`` exists to catch a change that moves a pixel. CPU float results depend
on the torch build, the instruction set its kernels dispatch to and the number of threads a GEMM is split over,
so the JSON records those facts and the test compares hashes only where they hold.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "data" / "golden_artifacts.json"
MODELS = ("toy_shapes", "tiny_flux")
#: /proc/cpuinfo flags that select other CPU kernels for the same float op (oneDNN / MKL / ATen dispatch).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile")


def machine_facts() -> Dict[str, Any]:
    """What the recorded hashes depend on besides the code: the torch build, ATen's CPU capability, the CPU
    flags of :data:`CPU_FLAGS` present, and ``os.cpu_count()`` (the runner's ``platform=cpu`` threads follow it)."""
    import torch

    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_flags": sorted(f for f in CPU_FLAGS if f in flags), "cpu_count": os.cpu_count()}


def hashes(model: str, run_dir: Path) -> Dict[str, Dict[str, str]]:
    """Run ``python -m runner model=<model> platform=cpu`` into ``run_dir``; ``{"files", "pixels"}``:
    ``images/<name>.png`` -> sha256 of the file and of its decoded RGB ``uint8`` array.

    Raises:
        RuntimeError: the run did not exit 0 (its stderr's tail is in the message).
    """
    import numpy as np
    from PIL import Image

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "runner", f"model={model}", "platform=cpu",
                           f"hydra.run.dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"model={model} exited {proc.returncode}: {proc.stderr[-2000:]}")
    pngs = sorted((run_dir / "images").glob("*.png"))
    rel = lambda p: str(p.relative_to(run_dir))  # noqa: E731
    return {"files": {rel(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in pngs},
            "pixels": {rel(p): hashlib.sha256(np.asarray(Image.open(p).convert("RGB")).tobytes()).hexdigest()
                       for p in pngs}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the recorded JSON; write nothing")
    args = ap.parse_args()
    old = json.loads(GOLDEN.read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    new: Dict[str, Any] = {"pixels": {}, "recorded_with": {
        "command": "python scripts/record_golden.py (python -m runner model=<model> platform=cpu)",
        "commit": commit, "machine": machine_facts(),
        "pixels": "sha256 of numpy.asarray(PIL.Image.open(f).convert('RGB')).tobytes()"}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in MODELS:
            got = hashes(model, Path(tmp) / model)
            new[model], new["pixels"][model] = got["files"], got["pixels"]
            diff = [k for k, v in got["pixels"].items() if old["pixels"].get(model, {}).get(k) != v]
            print(f"{model}: {len(got['files'])} images, {len(diff)} pixel hashes differ from the recorded JSON")
    new["recorded_with"]["torch"] = new["recorded_with"]["machine"]["torch"]
    if not args.check:
        GOLDEN.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {GOLDEN.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
