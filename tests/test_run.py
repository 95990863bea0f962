"""End to end on CPU: the real tiny_flux pipeline through ``runner.app.execute.run``, then every claim of the
manifest and of items.jsonl checked against what is on disk (hashes recomputed here, not taken from the code)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILTIN = REPO_ROOT / "runner" / "data" / "prompts.jsonl"


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _derived_seed(run_seed: int, row_id: str) -> int:
    """The documented seed of a row without one: first 8 bytes of sha256("<run_seed>:<row_id>"), 63 bits."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}:{row_id}".encode()).digest()[:8], "big") & ((1 << 63) - 1)


@pytest.fixture(scope="module")
def builtin_run(execute, tmp_path_factory):
    """One default run (builtin prompts, tiny_flux, 128x128, 4 steps) limited to 3 rows."""
    return execute(["dataset.limit=3"], tmp_path_factory.mktemp("builtin") / "run")


def test_run_completes(builtin_run):
    assert builtin_run.code == 0
    m = builtin_run.manifest
    assert m["status"] == "completed"
    assert (m["counts"]["ok"], m["counts"]["failed"]) == (3, 0)


def test_manifest_identity_and_times(builtin_run):
    m = builtin_run.manifest
    assert isinstance(m["run_id"], str) and len(m["run_id"]) >= 8
    started = datetime.fromisoformat(m["started_at"])
    ended = datetime.fromisoformat(m["ended_at"])
    assert started.tzinfo is not None and ended.tzinfo is not None
    assert started <= ended


def test_manifest_config_and_overrides(builtin_run):
    m = builtin_run.manifest
    want = json.loads(json.dumps(OmegaConf.to_container(builtin_run.cfg, resolve=True), default=str))
    assert m["config"] == want
    assert m["config"]["model"]["name"] == "tiny_flux"
    assert m["config"]["dataset"]["limit"] == 3
    assert m["overrides"] == ["platform=cpu", "dataset.limit=3"]


def test_manifest_git(builtin_run):
    git = builtin_run.manifest["git"]
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert git["commit"] == head.stdout.strip()
    assert len(git["commit"]) == 40
    assert isinstance(git["dirty"], bool)


def test_manifest_packages(builtin_run):
    pk = builtin_run.manifest["packages"]
    for name in ("torch", "diffusers", "transformers", "hydra-core"):
        assert pk[name] == importlib.metadata.version(name), name


def test_manifest_platform_and_dtype(builtin_run):
    m = builtin_run.manifest
    assert m["platform"]["kind"] == "cpu"
    assert m["platform"]["device"] == "cpu"
    assert m["platform"]["probes"].get("device_name")
    assert m["dtype"] == "float32"  # dtype=auto on CPU


def test_manifest_dataset(builtin_run):
    d = builtin_run.manifest["dataset"]
    assert d["format"] == "builtin"
    assert Path(d["path"]).resolve() == BUILTIN.resolve()
    assert d["sha256"] == _sha(BUILTIN)
    assert (d["rows"], d["items"]) == (3, 3)


def test_manifest_model_source_hashes(builtin_run):
    model = builtin_run.manifest["model"]
    assert model["name"] == "tiny_flux"
    src = model["source"]
    assert src["kind"] == "embedded"
    snap = Path(src["path"])
    assert (snap / "model_index.json").is_file()
    on_disk = sorted(str(f.relative_to(snap)) for f in snap.rglob("*.safetensors"))
    assert sorted(src["files"]) == on_disk
    for comp in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        assert any(f.startswith(comp + "/") for f in on_disk), comp
    for rel, digest in src["files"].items():
        assert digest == _sha(snap / rel), rel


def test_manifest_timing(builtin_run):
    t = builtin_run.manifest["timing"]
    for key in ("wall_s", "load_s", "generate_s"):
        assert isinstance(t[key], (int, float)) and t[key] >= 0, key
    assert t["generate_s"] > 0
    assert t["wall_s"] >= t["generate_s"]


def test_items_match_files_on_disk(builtin_run):
    run_dir = builtin_run.run_dir
    items = builtin_run.items
    rows = [json.loads(line) for line in BUILTIN.read_text().splitlines() if line.strip()][:3]
    assert [it["key"] for it in items] == [r["id"] for r in rows]
    files = [it["file"] for it in items]
    assert len(set(files)) == len(files) == 3, "one PNG per row"
    assert {str(p.relative_to(run_dir)) for p in (run_dir / "images").glob("*.png")} == set(files)
    for it, row in zip(items, rows):
        assert it["status"] == "ok"
        path = run_dir / it["file"]
        assert it["file_sha256"] == _sha(path)
        assert it["prompt_sha256"] == hashlib.sha256(row["prompt"].encode()).hexdigest()
        assert it["seed"] == _derived_seed(0, row["id"])
        assert (it["params"]["width"], it["params"]["height"], it["params"]["num_inference_steps"]) == (128, 128, 4)
        img = Image.open(io.BytesIO(path.read_bytes()))
        assert img.format == "PNG" and img.size == (128, 128) and img.mode == "RGB"
    assert len({it["file_sha256"] for it in items}) == 3, "different rows gave identical images"
