"""Install what benchmarks/toy_motion_gpu.sh brought back: the weights, the training report, and the trained VAE's
latent statistics in conf/model/toy_motion.yaml (so the config documents the snapshot it loads).

Usage: python benchmarks/toy_motion_install.py OUT_DIR [--date 2026-12-01]
  OUT_DIR holds toy_motion_weights.tar (or the folder w/ of an interrupted run) and train.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--date", default="2026-12-01")
    a = p.parse_args()
    src = Path(a.out_dir)
    dst = REPO / "models/toy_motion/weights"
    shutil.rmtree(dst, ignore_errors=True)
    if (src / "toy_motion_weights.tar").is_file():
        dst.mkdir(parents=True)
        with tarfile.open(src / "toy_motion_weights.tar") as t:
            t.extractall(dst, filter="data")
    else:
        shutil.copytree(src / "w", dst)
    report = json.loads((src / "train.json").read_text())
    (REPO / f"benchmarks/results/toy_motion_train_h200_{a.date}.json").write_text(json.dumps(report, indent=1) + "\n")
    vae = json.loads((dst / "vae/config.json").read_text())
    yaml = REPO / "conf/model/toy_motion.yaml"
    text = yaml.read_text()
    for key in ("latents_mean", "latents_std"):
        vals = [repr(float(v)) for v in vae[key]]
        pad = "\n" + " " * (8 + len(key) + 3)  # under the first value (the key is indented by 8)
        body = ("," + pad).join(", ".join(vals[i:i + 8]) for i in range(0, len(vals), 8))
        text, n = re.subn(rf"{key}: \[[^\]]*\]", f"{key}: [{body}]", text)
        assert n == 1, key
    yaml.write_text(text)
    total = sum(f.stat().st_size for f in dst.rglob("*") if f.is_file())
    print(f"weights: {total} bytes in {dst}; report: {sorted(k for k in report if k.startswith('eval'))}")


if __name__ == "__main__":
    main()
