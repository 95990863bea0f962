"""The sweep report (``runner.tools.report``): a real 3-job CPU sweep through ``python -m runner -m``, then the
report it wrote, its regeneration from the manifests alone, the image metrics, and (when chromium is installed)
the report rendered in a headless browser.

The sweep is shared with tests/test_repro_matrix.py through :func:`cpu_sweep` (one sweep per pytest process).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SWEEP_ARGS = ["backend.attention=TORCH_SDPA,sdpa,CUDNN_ATTN", "dataset.limit=2", "platform=cpu"]
_SWEEPS: Dict[str, Tuple[Path, subprocess.CompletedProcess]] = {}


def subprocess_env() -> Dict[str, str]:
    """This process's environment (with the session's RUNNER_CACHE, set by conftest), offline."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def run_module(module: str, args, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m <module> <args>`` in ``cwd`` (a scratch dir, so nothing lands in the repo's outputs/)."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def cpu_sweep(tmp_path_factory) -> Tuple[Path, subprocess.CompletedProcess]:
    """The 3-job sweep ``backend.attention=TORCH_SDPA,sdpa,CUDNN_ATTN`` on CPU (2 items), run once per process."""
    if "cpu" not in _SWEEPS:
        root = tmp_path_factory.mktemp("cpu_sweep")
        p = run_module("runner", ["-m", *SWEEP_ARGS, f"hydra.sweep.dir={root / 'sweep'}"], cwd=root)
        _SWEEPS["cpu"] = (root / "sweep", p)
    return _SWEEPS["cpu"]


def _tail(p: subprocess.CompletedProcess) -> str:
    return p.stdout[-2000:] + "\n" + p.stderr[-4000:]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    d, p = cpu_sweep(tmp_path_factory)
    assert p.returncode == 0, _tail(p)
    return d


RESOURCE_REF = re.compile(r"""(?:src|href|action|poster|srcset)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*"""
                          r"""(?:https?:)?//|@import""", re.I)


def _parity_row(html: str, job: str) -> Tuple[str, ...]:
    """(items compared, min PSNR, min SSIM, max diff, verdict) of ``job`` in the parity summary table."""
    table = re.search(r'<table class="parity-summary[^"]*">(.*?)</table>', html, re.S).group(1)
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        if cells and cells[0] == job:
            return tuple(cells[1:])
    raise AssertionError(f"job {job} not in the parity table")


@pytest.mark.slow
def test_sweep_exit_code_and_outcomes(sweep):
    doc = json.loads((sweep / "sweep.json").read_text())
    assert [j["outcome"] for j in doc["jobs"]] == ["ok", "ok", "refused"]
    assert doc["exit_code"] == 0  # CUDNN_ATTN on CPU is a documented refusal
    refused = json.loads((sweep / "2" / "manifest.json").read_text())
    assert refused["status"] == "refused" and "CUDNN_ATTN" in refused["error"]["message"]


@pytest.mark.slow
def test_report_is_self_contained(sweep):
    html = (sweep / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert not RESOURCE_REF.search(html), RESOURCE_REF.search(html).group(0)
    assert "http://" not in html and "https://" not in html
    assert "<link" not in html.lower()
    from runner.tools.report import SORT_JS  # the one script: inline, the tables' sorting

    assert re.findall(r"<script[^>]*>(.*?)</script>", html, re.S | re.I) == [SORT_JS]
    assert not re.search(r"<script[^>]*\bsrc", html, re.I)
    imgs = re.findall(r'<img [^>]*src="([^"]*)"', html)
    assert len(imgs) == 4 and all(s.startswith("data:image/") for s in imgs)  # 2 items x 2 jobs with images
    assert "<svg" in html and "images/s" in html


@pytest.mark.slow
def test_report_contents(sweep):
    html = (sweep / "report.html").read_text()
    # identical kernels (sdpa is an alias of TORCH_SDPA): bit-identical images
    items, p, s, d, verdict = _parity_row(html, "1")
    assert (items, p, s, d, verdict) == ("2 / 2", "inf", "1.0000", "0", "within")
    # the refused job is listed with its error message
    assert "CUDNN_ATTN cannot run here" in html and ">refused<" in html
    # backend resolution per field with its layer, evidence verdict, phases, memory
    for needle in ("TORCH_SDPA", "requested sdpa", "cli_run", "requested auto", "verified",
                   "text enc. s", "denoise s", "VAE dec. s", "write s", "images/s", "host RSS"):
        assert needle in html, needle


@pytest.mark.slow
def test_report_thumbnails_link_full_size_files_with_seed_and_prompt(sweep):
    """Under each thumbnail its seed and prompt, around it a link (relative to report.html) to the full-size
    file; per job the oracle's accuracy; the first job's wall time flagged as a cold start; sortable tables."""
    html = (sweep / "report.html").read_text()
    links = re.findall(r'<a href="([^"]+)"><img ', html)
    assert len(links) == 4 and all((sweep / h).is_file() and h.endswith(".png") for h in links), links
    rec = json.loads((sweep / "0" / "items.jsonl").read_text().splitlines()[0])
    assert f"seed {rec['seed']} · {rec['prompt'][:40]}" in html
    acc = json.loads((sweep / "0" / "manifest.json").read_text())["accuracy"]
    assert f"all {acc['all']:.3g}" in html and "<th>oracle accuracy</th>" in html
    assert html.count("first job: includes cold-start warm-up") == 1
    assert '<table class="jobs sortable">' in html and '<table class="parity-summary sortable">' in html


def test_not_comparable_items_are_collapsed_with_their_reason():
    from types import SimpleNamespace

    from runner.tools.report import _parity_section

    job = lambda label, name: SimpleNamespace(label=label, outcome="ok", manifest={  # noqa: E731
        "overrides": [], "config": {"model": {"name": name}}})
    a, b = job("0", "tiny_flux"), job("1", "toy_shapes")
    rows = [{"key": "k", "psnr_db": None, "ssim": None, "max_abs_diff": None, "within": None,
             "note": "not comparable (model tiny_flux vs toy_shapes)"}]
    html = _parity_section([a, b], a, {"1": rows}, 40.0)
    nc = re.search(r'<details class="not-comparable">(.*?)</details>', html, re.S).group(1)
    assert "Not comparable (1 items" in nc and "model tiny_flux vs toy_shapes" in nc
    assert '<details class="not-comparable" open' not in html and "Per item" not in html


@pytest.mark.slow
def test_report_regenerates_from_manifests(sweep, tmp_path):
    out = tmp_path / "x.html"
    p = run_module("runner.tools.report", [sweep, "--out", out], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    html = out.read_text()
    assert _parity_row(html, "1") == ("2 / 2", "inf", "1.0000", "0", "within")
    assert not RESOURCE_REF.search(html)
    # reference by job dir name; a run dir works as input too
    p = run_module("runner.tools.report", [sweep / "1", sweep / "0", "--out", tmp_path / "y.html", "--reference", "0"],
                   cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    assert _parity_row((tmp_path / "y.html").read_text(), "1")[1] == "inf"
    p = run_module("runner.tools.report", [sweep, "--reference", "9", "--out", tmp_path / "z.html"], cwd=tmp_path)
    assert p.returncode == 2 and "names no job" in p.stderr


@pytest.mark.slow
def test_unknown_kernel_sweep_exits_1(tmp_path):
    """C09: a bad backend name is bad input, not a documented refusal: the sweep exits 1 (report still written)."""
    p = run_module("runner", ["-m", "backend.attention=no_such_kernel", "platform=cpu", "dataset.limit=1",
                              f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path)
    assert p.returncode == 1, _tail(p)
    doc = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [j["outcome"] for j in doc["jobs"]] == ["invalid"]
    html = (tmp_path / "sweep" / "report.html").read_text()
    assert "no_such_kernel" in html and "is not a known backend" in html


# ------------------------------------------------------------------------------------------------ metrics


def test_image_metrics():
    from runner.tools.report import compare_images, psnr, ssim

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (32, 40, 3), dtype=np.uint8)
    m = compare_images(a, a.copy())
    assert m == {"psnr_db": math.inf, "ssim": 1.0, "max_abs_diff": 0}
    assert ssim(a, a) == pytest.approx(1.0, abs=1e-12)
    b = a.astype(np.int16)
    b[::2] += 1
    b = np.clip(b, 0, 255).astype(np.uint8)
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    assert psnr(a, b) == pytest.approx(10 * math.log10(255 ** 2 / mse))
    m = compare_images(a, b)
    assert m["max_abs_diff"] == 1 and 0.99 < m["ssim"] < 1.0 and m["psnr_db"] > 48
    assert ssim(a, 255 - a) < 0 < ssim(a, b)                      # anti-correlated noise: negative SSIM
    assert ssim(a, b) == pytest.approx(ssim(b, a))                # symmetric
    small = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)       # smaller than the 11x11 window
    assert ssim(small, small) == pytest.approx(1.0)
    assert compare_images(a, a[:16])["psnr_db"] is None           # shape mismatch: no metric, no crash
    # a reference value: torchmetrics 1.x structural_similarity_index_measure (Gaussian 11, sigma 1.5, data_range
    # 255, float64) of this deterministic pair; the report and the gate share this one implementation (they used
    # to disagree: a numpy port matching scikit-image's 0.99726 in the report, torchmetrics in the gate). Computed
    # in float32 (23 s -> 0.23 s for a 1024^2 pair on 2 cores): 2.2e-7 from the float64 value here; sigma 1.0, or a
    # uniform window, moves it by 3e-3
    i, j = np.mgrid[0:48, 0:40]
    x = np.stack([(i * 7 + j * 13) % 256, (i * i + 3 * j) % 256, (5 * i * j) % 256], axis=2).astype(np.uint8)
    y = np.clip(x.astype(int) + (i * j % 5)[..., None] - 2 + (i % 3)[..., None] * 3, 0, 255).astype(np.uint8)
    assert ssim(x, y) == pytest.approx(0.9953440818933998, abs=5e-7)


def test_report_and_gate_give_one_ssim_for_one_pair(tmp_path):
    """The same 64x64 pair through the report's parity metric and the gate's item metric: one SSIM."""
    from PIL import Image

    from runner.tools.gate import item_metrics
    from runner.tools.report import compare_files

    rng = np.random.default_rng(3)
    a = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-20, 21, a.shape), 0, 255).astype(np.uint8)
    pa, pb = tmp_path / "a.png", tmp_path / "b.png"
    Image.fromarray(a).save(pa)
    Image.fromarray(b).save(pb)
    r, g = compare_files(pa, pb), item_metrics(pa, pb)
    assert 0 < r["ssim"] < 1 and round(r["ssim"], 5) == g["ssim"]


def test_not_comparable_names_the_key_that_differs():
    from types import SimpleNamespace

    from runner.tools.report import item_difference, not_comparable

    r = {"seed": 1, "prompt_sha256": "p", "params": {"width": 64, "height": 64, "batch_size": 1}}
    assert item_difference(r, dict(r, params={**r["params"], "batch_size": 4})) is None
    assert item_difference(r, dict(r, seed=2)) == "seed 1 vs 2"
    assert item_difference(r, dict(r, prompt_sha256="q")) == "prompt"
    assert item_difference(r, dict(r, params={**r["params"], "width": 32})) == "params.width 64 vs 32"
    job = lambda name: SimpleNamespace(manifest={"config": {"model": {"name": name}}})  # noqa: E731
    assert not_comparable(job("tiny_flux"), job("toy_shapes"), r, r) == "not comparable (model tiny_flux vs toy_shapes)"
    assert not_comparable(job("a"), job("a"), r, dict(r, seed=3)) == "not comparable (seed 1 vs 3)"
    assert not_comparable(job("a"), job("a"), r, r) is None


# ------------------------------------------------------------------------------------------------ browser


@pytest.mark.slow
def test_report_renders_in_headless_chromium(sweep, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    from PIL import Image

    shot = tmp_path / "report.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1400,2000",
           (sweep / "report.html").resolve().as_uri()]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, p.stderr[-2000:]
    with Image.open(shot) as im:
        assert im.size == (1400, 2000)
        px = np.asarray(im.convert("RGB"))
    assert px.std() > 10  # not a blank page: text, tables, thumbnails
