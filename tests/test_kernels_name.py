"""Our top-level package ``kernels`` shares its import name with Hugging Face's ``kernels`` distribution. The
availability probes of diffusers and transformers must not take ours for it (they would then import
``kernels.get_kernel`` and friends, which we do not provide)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(_hf_kernels_installed(), reason="Hugging Face's kernels distribution is installed")

PROBE = """
import importlib.util, json
import diffusers.utils.import_utils as d
import transformers.utils.import_utils as t
import diffusers.models.attention_dispatch            # gates `from kernels import ...` on the probe
import transformers.integrations.hub_kernels          # likewise
spec = importlib.util.find_spec("kernels")
print(json.dumps({"origin": spec.origin if spec else None,
                  "diffusers": d.is_kernels_available(), "transformers": t.is_kernels_available()}))
"""


def test_our_kernels_package_is_the_one_found():
    """The clash is real here: ``import kernels`` finds this repository's package."""
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().parent == (REPO_ROOT / "kernels").resolve()


def test_probes_false_in_process():
    import diffusers.utils.import_utils as d
    import transformers.utils.import_utils as t

    assert d.is_kernels_available() is False
    assert t.is_kernels_available() is False


def test_probes_false_in_fresh_interpreter():
    """A fresh interpreter started in the repository root, where ``kernels/`` is importable from the working
    directory (in process it is found through the installed project); the modules that import Hugging Face's
    ``kernels`` API when the probe says yes import cleanly."""
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["origin"] and Path(out["origin"]).resolve().parent == (REPO_ROOT / "kernels").resolve()
    assert out["diffusers"] is False
    assert out["transformers"] is False
