"""``runner.tools.repro`` (re-run a run from its manifest and compare item by item) and ``runner.tools.matrix`` (the
compatibility matrix from manifests), on the 3-job CPU sweep of tests/test_report.py
(``backend.attention=TORCH_SDPA,sdpa,CUDNN_ATTN``, ``dataset.limit=2``, ``platform=cpu``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from test_report import _tail, cpu_sweep, run_module

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    d, p = cpu_sweep(tmp_path_factory)
    assert p.returncode == 0, _tail(p)
    return d


# ------------------------------------------------------------------------------------------------ repro


def test_repro_of_cpu_run_passes(sweep, tmp_path):
    new = tmp_path / "rerun"
    p = run_module("runner.tools.repro", [sweep / "0", "--out", new], cwd=tmp_path)
    assert p.returncode == 0, _tail(p)
    assert "REPRO OK" in p.stdout and "byte equality" in p.stdout
    check = json.loads((new / "repro_check.json").read_text())
    assert check["ok"] and check["mode"] == "bytes" and check["problems"] == []
    assert [r["verdict"] for r in check["items"]] == ["ok", "ok"]
    assert all(r["original_sha256"] == r["new_sha256"] for r in check["items"])
    new_manifest = json.loads((new / "manifest.json").read_text())
    assert new_manifest["overrides"] == json.loads((sweep / "0" / "manifest.json").read_text())["overrides"]


def test_repro_names_a_tampered_item(sweep, tmp_path):
    from PIL import Image

    orig = tmp_path / "orig"
    shutil.copytree(sweep / "0", orig)
    rec = [json.loads(line) for line in (orig / "items.jsonl").read_text().splitlines()][1]
    path = orig / rec["file"]
    with Image.open(path) as im:  # another valid PNG, same size, different pixels; nothing else updated
        Image.fromarray(255 - np.asarray(im.convert("RGB"))).save(path, format="PNG")
    p = run_module("runner.tools.repro", [orig, "--out", tmp_path / "rerun"], cwd=tmp_path)
    assert p.returncode != 0, _tail(p)
    assert "REPRO FAILED" in p.stderr and f"item {rec['key']!r}" in p.stderr, _tail(p)
    other = [json.loads(line) for line in (orig / "items.jsonl").read_text().splitlines()][0]["key"]
    assert f"item {other!r}" not in p.stderr  # only the tampered item is named


def test_repro_compares_backend_resolution(sweep, tmp_path):
    """A changed resolution fails even with identical pixels (compared from the manifests alone)."""
    from runner.tools.repro import compare

    new = tmp_path / "new"
    shutil.copytree(sweep / "0", new)
    m = json.loads((new / "manifest.json").read_text())
    m["backends"]["denoise"]["linear"]["selected"] = "FP8"
    (new / "manifest.json").write_text(json.dumps(m))
    res = compare(sweep / "0", new)
    assert not res["ok"]
    assert any("denoise.linear selected" in x for x in res["problems"]), res["problems"]
    assert all(r["ok"] for r in res["items"])


# ------------------------------------------------------------------------------------------------ matrix


def _rows(md: str) -> List[Dict[str, str]]:
    lines = [line for line in md.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip().strip("*") for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_matrix_states(sweep, capsys):
    from runner.tools.matrix import main, matrix_table

    md = matrix_table([sweep], grid=["attention=TORCH_SDPA,CUDNN_ATTN,SAGE_ATTN"])
    assert "PSNR >= 40 dB" in md  # the tolerance is stated
    rows = _rows(md)
    by_attn: Dict[str, List[Dict[str, str]]] = {}
    for r in rows:
        by_attn.setdefault(r["attention"], []).append(r)
    # sdpa is an alias of TORCH_SDPA: one row, both jobs
    assert [(r["state"], r["runs"]) for r in by_attn["TORCH_SDPA"]] == [("validated", "0, 1")]
    sdpa = by_attn["TORCH_SDPA"][0]
    assert (sdpa["model"], sdpa["task"], sdpa["dtype"], sdpa["linear"], sdpa["moe"]) == (
        "toy_shapes", "text-to-image", "float32", "auto→TORCH", "n/a")
    assert sdpa["device"].startswith("cpu: ") and sdpa["parallelism"] == "single x1"
    assert [(r["state"], r["runs"]) for r in by_attn["CUDNN_ATTN"]] == [("unsupported", "2")]
    assert "needs platform cuda" in by_attn["CUDNN_ATTN"][0]["notes"]
    assert [r["state"] for r in by_attn["SAGE_ATTN"]] == ["not tested"]
    assert "sdpa" not in by_attn and len(rows) == 3
    # a device axis: nothing ran on an H200, so nothing is claimed there
    rows = _rows(matrix_table([sweep], grid={"attention": ["sdpa"], "device": ["H200"]}))
    assert [(r["attention"], r["device"], r["state"]) for r in rows if r["state"] == "not tested"] == [
        ("TORCH_SDPA", "H200", "not tested")]
    # the CLI prints the same table
    assert main([str(sweep), "--grid", "attention=TORCH_SDPA,CUDNN_ATTN,SAGE_ATTN"]) == 0
    assert _rows(capsys.readouterr().out) == _rows(md)


def test_matrix_parity_outside_tolerance_is_not_validated(sweep, tmp_path):
    from PIL import Image

    from runner.tools.matrix import matrix_table

    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    rec = json.loads((copy / "1" / "items.jsonl").read_text().splitlines()[0])
    path = copy / "1" / rec["file"]
    with Image.open(path) as im:
        Image.fromarray(255 - np.asarray(im.convert("RGB"))).save(path, format="PNG")
    rows = [r for r in _rows(matrix_table([copy])) if r["attention"] == "TORCH_SDPA"]
    assert [r["state"] for r in rows] == ["failed"]
    assert "below 40 dB" in rows[0]["notes"] and rec["key"] in rows[0]["notes"]
