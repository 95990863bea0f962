"""The project's top-level import names are its own.

Our backends once lived in a top-level package ``kernels``, the import name of Hugging Face's ``kernels``
distribution. transformers 5.25 made that distribution a requirement (``Requires-Dist: kernels<0.20,>=0.19.1``), so it
is installed beside every fresh quick start; started in the checkout, ``import kernels`` found our folder first and
``transformers.integrations.hub_kernels`` failed on ``from kernels import CUDAProperties``: every diffusers model
import failed in CI (238 tests). The backends are ``runner.kernels`` now; these tests keep the whole kind away: no
top-level name we ship is another installed distribution's, and none shadows a well-known library's.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

#: Import names of libraries a runner user's environment may hold (the extras, their dependencies, their peers):
#: a top-level package of ours with one of these names would shadow it whenever the checkout is on sys.path.
WELL_KNOWN = {"kernels", "diffusers", "transformers", "vllm", "peft", "torchao", "hydra", "omegaconf", "datasets",
              "accelerate", "safetensors", "huggingface_hub", "tokenizers", "triton", "flash_attn", "xformers",
              "sageattention", "bitsandbytes", "ray", "submitit", "mlflow", "torchmetrics", "fsspec", "s3fs",
              "filelock", "cache_dit", "imageio", "imageio_ffmpeg", "pyarrow", "webdataset", "kernels_hub",
              "flashinfer", "deepspeed", "xfuser", "optimum", "timm", "open_clip", "lightning", "torchtitan",
              "tests", "benchmarks", "scripts", "docs", "src", "utils", "common", "core", "app", "tools"}


def shipped_top_level() -> set:
    """The top-level import names the wheel installs (``[tool.setuptools] packages`` of pyproject.toml)."""
    packages = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return {p.split(".")[0] for p in packages}


def test_no_shipped_name_is_a_well_known_librarys():
    top = shipped_top_level()
    assert "runner" in top
    clash = sorted(top & WELL_KNOWN)
    assert not clash, f"top-level packages {clash} shadow a library of the same import name; move them under runner/"


def test_no_shipped_name_belongs_to_another_installed_distribution():
    """``packages_distributions()`` maps each import name to the distributions that install it: ours must be ours
    alone (two distributions owning one name overwrite each other's files on a plain install)."""
    owners = importlib.metadata.packages_distributions()
    others = {name: sorted(set(owners.get(name, ())) - {"runner"}) for name in shipped_top_level()}
    assert not {k: v for k, v in others.items() if v}, others


def test_the_rule_sees_the_old_layout():
    """The check can fail: the former top-level ``kernels`` package is a clash it names."""
    assert "kernels" in WELL_KNOWN and not re.search(r'"kernels"', (REPO_ROOT / "pyproject.toml").read_text())
    assert not (REPO_ROOT / "kernels" / "__init__.py").exists()


PROBE = """
import importlib.util, json
spec = importlib.util.find_spec("kernels")
import diffusers.utils.import_utils as d
import transformers.utils.import_utils as t
import diffusers.models.attention_dispatch            # imports from `kernels` when the probe says yes
import transformers.integrations.hub_kernels          # likewise
import diffusers.models.transformers.transformer_flux  # what failed in CI: peft loaders -> hub kernels
import runner.kernels.registry
print(json.dumps({"origin": spec.origin if spec else None,
                  "diffusers": d.is_kernels_available(), "transformers": t.is_kernels_available()}))
"""


def test_a_fresh_interpreter_in_the_checkout_imports_the_libraries_and_ours():
    """Started in the repository root (the working directory first on sys.path, as ``python -m runner`` and pytest
    are): diffusers' and transformers' kernels probes and the modules they gate import cleanly, whether or not
    Hugging Face's ``kernels`` is installed, and the name ``kernels`` is never this repository's."""
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out["origin"] is not None:
        assert not Path(out["origin"]).resolve().is_relative_to(REPO_ROOT.resolve()), out
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert out["origin"] is None and out["transformers"] is False
    else:
        assert out["origin"] is not None
