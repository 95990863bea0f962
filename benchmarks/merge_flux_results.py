"""Merge the results JSONs of several ``benchmarks/flux_dev_1024.py`` invocations (split with ``--variants`` to
fit the device's per-command limit) into one, recomputing ``targets_met``.

    python benchmarks/merge_flux_results.py A.json B.json [--keep-from OLD.json] > benchmarks/results/flux_dev_1024_h200.json

``--keep-from OLD.json``: carry OLD's ``ablation`` over, and its ``notes`` as ``notes_earlier``.

Later files win for top-level keys; ``variants`` are merged by name, and a variant measured in several files keeps
each: the later one under its name, the earlier under ``<name>@<file stem>``. Each speedup was computed against the
baseline of its own invocation (recorded in ``invocations``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv):
    from flux_dev_1024 import LOWER_IS_BETTER, TARGETS

    keep = None
    if "--keep-from" in argv:
        i = argv.index("--keep-from")
        keep = json.loads(Path(argv[i + 1]).read_text())
        argv = argv[:i] + argv[i + 2:]
    paths = argv
    out = {"invocations": []}
    variants = {}
    for p in paths:
        d = json.loads(Path(p).read_text())
        out["invocations"].append({"file": Path(p).name, "command": d.get("command"), "date": d.get("date"),
                                   "baseline_images_per_hour": (d.get("images_per_hour") or {}).get("baseline")})
        for name, v in (d.get("variants") or {}).items():
            if name in variants:
                variants[f"{name}@{Path(paths[paths.index(p) - 1]).stem}"] = variants.pop(name)
            variants[name] = v
        out.update({k: v for k, v in d.items() if k != "variants"})
    out["variants"] = variants
    if keep is not None:
        if "ablation" in keep:
            out["ablation"] = keep["ablation"]
        if "notes" in keep:
            out["notes_earlier"] = keep["notes"]
    out["targets"] = TARGETS
    out["targets_met"] = {k: {"value": out[k], "target": g, "met": (out[k] <= g) if k in LOWER_IS_BETTER
                              else (out[k] >= g)} for k, g in TARGETS.items() if out.get(k) is not None}
    print(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
