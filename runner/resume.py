"""Resume: reuse the finished items of an earlier run in the same dir, regenerate the rest with the same seeds.

An item counts as finished when its ``items.jsonl`` record says ``ok`` and its artifact exists with the recorded
sha256. Missing or corrupt artifacts are regenerated. A resume whose *semantic* config (what changes the
artifacts: model, backends, dtype, generation sizes, seed, dataset content) differs from the earlier run's is
refused with the differing keys named, unless ``run.force=true``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from runner.errors import UserInputError

SEMANTIC_KEYS = ("model.name", "model.adapter", "model.path", "model.revision", "model.load_format",
                 "model.architecture", "model.generation", "model.backend", "model.stages", "backend", "dtype",
                 "seed", "num_images_per_prompt", "compile", "optimize.fuse_qkv",
                 "optimize.vae_channels_last", "optimize.deterministic_compile")


class ResumeConflictError(UserInputError, ValueError):
    """The run dir holds a run with a different semantic config (names the keys and the fix)."""


def _get(d: Dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _flat(x: Any, prefix: str) -> Dict[str, Any]:
    if isinstance(x, dict):
        out: Dict[str, Any] = {}
        for k, v in x.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out or {prefix: {}}
    return {prefix: x}


def semantic_diff(old_cfg: Dict[str, Any], new_cfg: Dict[str, Any], old_dataset_sha: Optional[str],
                  new_dataset_sha: str) -> List[str]:
    """Dotted keys whose values differ between two resolved configs (plus ``dataset.sha256``), as
    ``"key: old -> new"`` strings."""
    diffs = []
    for key in SEMANTIC_KEYS:
        a, b = _flat(_get(old_cfg, key), key), _flat(_get(new_cfg, key), key)
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                diffs.append(f"{k}: {a.get(k)!r} -> {b.get(k)!r}")
    if old_dataset_sha is not None and old_dataset_sha != new_dataset_sha:
        diffs.append(f"dataset.sha256: {old_dataset_sha[:12]}… -> {new_dataset_sha[:12]}…")
    return diffs


def previous_run(out_dir: Path, names: tuple = ("manifest.json",)) -> Optional[Dict[str, Any]]:
    """The earlier manifest in ``out_dir`` (the first of ``names`` that exists), or None when the dir holds no
    run (or only a run refused before it produced anything)."""
    p = next((out_dir / n for n in names if (out_dir / n).is_file()), None)
    if p is None:
        return None
    doc = json.loads(p.read_text())
    if doc.get("status") in ("refused", "invalid"):  # stopped before any artifact: nothing to resume
        return None
    return doc


def remove_temp_files(out_dir: Path) -> List[str]:
    """Delete temp files (``.<name>.tmp<pid>``) that a killed run left in ``out_dir`` and ``out_dir/images``;
    returns their names. Only names of that pattern are touched."""
    import re

    gone = []
    for d in (out_dir, out_dir / "images"):
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file() and re.fullmatch(r"\..+\.tmp\d+", p.name):
                    p.unlink()
                    gone.append(p.name)
    return gone


def finished(out_dir: Path) -> Dict[str, Dict[str, Any]]:
    """``{item key: record}`` of items whose artifact exists and matches its recorded sha256."""
    from runner.sinks import read_journal

    done: Dict[str, Dict[str, Any]] = {}
    records = [rec for p in sorted(out_dir.glob("items*.jsonl")) for rec in read_journal(p)]  # + workers' journals
    for rec in records:
        if rec.get("status") != "ok" or not rec.get("file"):
            continue
        f = out_dir / rec["file"]
        if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() == rec.get("file_sha256"):
            done[rec["key"]] = rec
        elif rec["key"] in done and not (out_dir / done[rec["key"]]["file"]).is_file():
            done.pop(rec["key"], None)
    return done
