"""A non-editable install runs the main job from any directory (issue #15, packaging).

The wheel is built from a copy of the project's files (``pip wheel --no-deps --no-build-isolation``, so no
download and no stale ``build/`` of the checkout), installed with ``pip install --no-deps --target`` into a
temporary folder, and ``python -m runner`` runs from an empty directory with only that folder on
``PYTHONPATH``: neither the checkout nor an editable install can supply ``conf/`` or the toy weights.
"""

from __future__ import annotations

import glob
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "conf", "runner", "models")
PACKAGES = ("runner", "models")  # runner.kernels ships inside runner


def _build_wheel(tmp: Path) -> Path:
    for mod in ("setuptools", "wheel"):
        try:
            __import__(mod)
        except ImportError:
            pytest.skip(f"building without isolation needs {mod} in this environment")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO_ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            shutil.copy2(p, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("runner-*.whl")
    return wheel


def _expected_files() -> set:
    """What the wheel must hold, from the checkout: every module, every config (under runner/conf), every file
    of the toy weights (configs, safetensors, tokenizers), the builtin datasets."""
    want = set()
    for pkg in PACKAGES:
        want |= {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / pkg).rglob("*.py")}
    want |= {"runner/conf/" + p.relative_to(REPO_ROOT / "conf").as_posix() for p in (REPO_ROOT / "conf").rglob("*.yaml")}
    for toy in ("toy_shapes", "toy_motion", "toy_edit"):
        weights = REPO_ROOT / "models" / toy / "weights"
        want |= {p.relative_to(REPO_ROOT).as_posix() for p in weights.rglob("*") if p.is_file()}
    want |= {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "models/toy_edit/builtin").iterdir()}
    want |= {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "runner" / "data").iterdir() if p.is_file()}
    want |= {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "runner" / "schemas").glob("*.json")}
    return want


def _run(args, cwd: Path, env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_installed_wheel_runs_the_main_job_from_an_empty_directory(tmp_path, subprocess_env):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_expected_files() - names)
    assert not missing, f"the wheel lacks {len(missing)} files: {missing[:10]}"
    for must in ("runner/conf/config.yaml", "runner/conf/model/toy_shapes.yaml", "runner/data/prompts.jsonl",
                 "models/toy_shapes/weights/model_index.json",
                 "models/toy_shapes/weights/transformer/diffusion_pytorch_model.safetensors",
                 "models/toy_shapes/weights/tokenizer/tokenizer.json",
                 "models/toy_shapes/weights/tokenizer_2/tokenizer_config.json"):
        assert must in names
    assert not any(n.startswith(("conf/", "tests/")) for n in names), "conf/ ships inside runner/, tests not at all"

    site = tmp_path / "site"
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    empty = tmp_path / "empty"
    empty.mkdir()
    env = dict(subprocess_env, PYTHONPATH=str(site))  # not the checkout: the test env's PYTHONPATH is replaced

    where = _run([sys.executable, "-c", "import json, runner, models, runner.kernels as k; print(json.dumps("
                  "[m.__file__ for m in (runner, models, k)]))"], empty, env)
    assert where.returncode == 0, where.stderr
    for f in json.loads(where.stdout):
        assert Path(f).resolve().is_relative_to(site.resolve()), f"{f} is not from the installed wheel"

    proc = _run([sys.executable, "-m", "runner"], empty, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (manifest,) = glob.glob(str(empty / "outputs" / "runs" / "*" / "*" / "manifest.json"))
    run_dir = Path(manifest).parent
    m = json.loads(Path(manifest).read_text())
    assert m["status"] == "completed"
    assert Path(m["model"]["source"]["path"]).resolve() == site.resolve() / "models" / "toy_shapes" / "weights"
    assert len(list((run_dir / "images").glob("*.png"))) == 24
    assert m["accuracy"]["all"] == 1.0
    assert m["git"]["commit"] is None and m["git"]["dirty"] is None
    assert "not a git checkout" in m["git"]["note"] and str(site.resolve()) in m["git"]["note"]

    # repro.sh of the installed run: from another directory, into a relative NEW_RUN_DIR, the same images
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rerun = _run(["bash", str(run_dir / "repro.sh"), "again"], elsewhere, dict(env, PYTHONPATH=""))
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    orig = {q.name: q.read_bytes() for q in (run_dir / "images").glob("*.png")}
    new = {q.name: q.read_bytes() for q in (elsewhere / "again" / "images").glob("*.png")}
    assert new == orig
