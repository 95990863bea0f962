"""End-to-end evidence on CPU with the real tiny_flux pipeline (``runner.app.execute.run``): the manifest's
``evidence`` and ``backends`` sections, a negative control (a layer switched to another kernel after startup must
be caught), a NaN row, alias spellings giving identical bytes, refusal before load, and a library environment
variable that must not override the runner's choice (case C10)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest

from runner.kernels.registry import BackendUnavailableError
from runner.core.errors import EvidenceError

try:
    from _helpers import REPO_ROOT, compose, execute
except ImportError:  # tests/ imported as a package
    from tests._helpers import REPO_ROOT, compose, execute

pytestmark = pytest.mark.slow


def _attention_layer_names() -> List[str]:
    """Every attention module path of tiny_flux, from its architecture (not from the adapter under test)."""
    tr = compose([]).model.architecture.transformer
    return ([f"transformer_blocks.{i}.attn" for i in range(tr.num_layers)]
            + [f"single_transformer_blocks.{i}.attn" for i in range(tr.num_single_layers)])


def _expected_forwards(items: List[Dict[str, Any]]) -> int:
    """Steps x batches: each item records the size of the batch it was generated in."""
    total = sum(it["params"]["num_inference_steps"] / it["params"]["batch_size"] for it in items)
    assert total == int(total)
    return int(total)


def _layers(manifest: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {l["layer"]: l for l in manifest["evidence"]["stages"]["denoise"]["attention"]["layers"]}


def _mutate_first_block(adapter: Any) -> None:
    """After startup, switch one layer to diffusers' math attention behind the runner's back."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    adapter.pipe.transformer.transformer_blocks[0].attn.processor._attention_backend = AttentionBackendName._NATIVE_MATH


FIRST_BLOCK = re.compile(r"(?<![\w.])transformer_blocks\.0\.attn")


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The default run (backend auto -> TORCH_SDPA on CPU), two rows, batch_size 1."""
    run = execute(tmp_path_factory.mktemp("evidence") / "baseline", ["dataset.limit=2"])
    assert run.code == 0
    return run


# ---------------------------------------------------------------------------------------- default run


def test_default_run_evidence_every_layer(baseline):
    m, items = baseline.manifest, baseline.items
    assert m["status"] == "completed"
    ev = m["evidence"]
    st = ev["stages"]["denoise"]
    forwards = _expected_forwards(items)
    assert forwards == 2 * 4  # 2 rows x 4 steps (tiny_flux default), one row per batch
    assert st["denoiser_forwards"] == st["expected_forwards"] == forwards
    layers = _layers(m)
    assert sorted(layers) == sorted(_attention_layer_names())
    for name, l in layers.items():
        assert l["resolved"] == "TORCH_SDPA", name
        assert l["observed"] == {"TORCH_SDPA": forwards}, name
        assert l["calls"] == forwards and l["ok"] is True, name
    assert st["attention"]["by_backend"] == {"TORCH_SDPA": len(layers)}


def test_default_run_evidence_linear(baseline):
    st = baseline.manifest["evidence"]["stages"]["denoise"]
    lin = st["linear"]
    forwards = st["denoiser_forwards"]
    assert lin["resolved"] == "TORCH"
    assert lin["modules"] > 0
    assert set(lin["observed"]) == {"TORCH"}
    assert lin["observed"]["TORCH"] == lin["modules"] * forwards


def test_default_run_profiler_names(baseline):
    k = baseline.manifest["evidence"]["stages"]["denoise"]["kernels"]
    assert k["profiled"] is True
    names = k["attention"]["TORCH_SDPA"]
    assert any(n.startswith("aten::_scaled_dot_product") for n in names), names
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, names
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert k["linear"]["TORCH"] and any(n in ("aten::addmm", "aten::linear", "aten::mm") for n in k["linear"]["TORCH"])


def test_default_run_verdict_and_backends_section(baseline):
    m = baseline.manifest
    assert m["evidence"]["verdict"] == "verified"
    assert m["evidence"]["mismatches"] == []
    assert m["evidence"]["all_finite"] is True
    b = m["backends"]["denoise"]
    for fld in ("attention", "linear", "moe"):
        for key in ("requested", "layer", "resolved", "selected"):
            assert key in b[fld], (fld, key)
    a = b["attention"]
    assert (a["requested"], a["layer"], a["explicit"]) == ("auto", "auto", False)
    assert a["resolved"] == {"joint": {"backend": "auto", "quant": None, "skip_softmax": None}}
    assert a["selected"]["joint"]["backend"] == "TORCH_SDPA" and a["reason"]
    assert (b["linear"]["resolved"], b["linear"]["selected"]) == ("auto", "TORCH")
    assert b["moe"]["selected"] is None  # FLUX has no MoE layers
    assert "environment" in m


def test_items_all_written(baseline):
    items = baseline.items
    assert len(items) == 2 and all(it["status"] == "ok" for it in items)
    for it in items:
        assert (baseline.run_dir / it["file"]).is_file()


def test_forwards_are_steps_times_batches_not_items(tmp_path):
    run = execute(tmp_path / "b2", ["dataset.limit=3", "batch_size=2"])
    assert run.code == 0
    items, m = run.items, run.manifest
    assert len(items) == 3
    forwards = _expected_forwards(items)
    assert forwards < 3 * 4  # at least one batch held two rows
    st = m["evidence"]["stages"]["denoise"]
    assert st["denoiser_forwards"] == forwards
    for l in _layers(m).values():
        assert l["observed"] == {"TORCH_SDPA": forwards}
    assert m["evidence"]["verdict"] == "verified"


# ----------------------------------------------------------------------------------- negative control


def test_negative_control_strict_names_the_layer(tmp_path):
    run = execute(tmp_path / "neg", ["dataset.limit=2"], on_loaded=_mutate_first_block, catch=(EvidenceError,))
    assert isinstance(run.error, EvidenceError), "a layer that ran another kernel went unnoticed"
    msg = str(run.error)
    assert FIRST_BLOCK.search(msg), msg
    assert "_native_math" in msg, msg
    m = run.manifest
    assert m["status"] == "evidence_mismatch"
    assert m["evidence"]["verdict"] == "mismatch"
    layers = _layers(m)
    forwards = m["evidence"]["stages"]["denoise"]["denoiser_forwards"]
    bad = layers["transformer_blocks.0.attn"]
    assert bad["ok"] is False and bad["observed"] == {"diffusers:_native_math": forwards}
    for name, l in layers.items():
        if name != "transformer_blocks.0.attn":
            assert l["ok"] is True and l["observed"] == {"TORCH_SDPA": forwards}, name
    # the per-layer mismatch names only the tampered layer
    per_layer = [x for x in m["evidence"]["mismatches"] if "layer " in x]
    assert len(per_layer) == 1 and FIRST_BLOCK.search(per_layer[0])
    assert not any("single_transformer_blocks" in x for x in m["evidence"]["mismatches"])
    # everything was still written before the error
    assert all(it["status"] == "ok" for it in run.items) and len(run.items) == 2


def test_negative_control_same_run_without_mutation_passes(tmp_path):
    run = execute(tmp_path / "ctl", ["dataset.limit=2"], on_loaded=lambda adapter: None)
    assert run.code == 0
    assert run.manifest["status"] == "completed"
    assert run.manifest["evidence"]["verdict"] == "verified"


def test_negative_control_not_strict_is_limited(tmp_path):
    run = execute(tmp_path / "neg2", ["dataset.limit=2", "evidence.strict=false"], on_loaded=_mutate_first_block)
    assert run.error is None and run.code is not None  # returned normally
    m = run.manifest
    assert m["status"] == "limited"
    assert m["evidence"]["verdict"] == "mismatch"
    assert any(FIRST_BLOCK.search(x) for x in m["evidence"]["mismatches"])
    assert len(run.items) == 2 and all(it["status"] == "ok" for it in run.items)


# -------------------------------------------------------------------------------------------- NaN row


def _nan_on_second_decode(adapter: Any) -> None:
    calls = {"n": 0}

    def hook(module, args, output):
        calls["n"] += 1
        if calls["n"] == 2:
            return output * float("nan")
        return None

    adapter.pipe.vae.decoder.register_forward_hook(hook)


def _check_nan_row(run) -> None:
    items = run.items
    assert len(items) == 3
    bad = items[1]
    assert bad["status"] == "failed"
    assert bad.get("file") is None and not bad.get("file_sha256")
    assert bad.get("reason") and "finite" in bad["reason"]
    for it in (items[0], items[2]):
        assert it["status"] == "ok" and (run.run_dir / it["file"]).is_file()
    pngs = sorted(p.name for p in (run.run_dir / "images").glob("*.png"))
    assert pngs == sorted(Path(items[i]["file"]).name for i in (0, 2))
    assert f"{bad['key']}.png" not in pngs
    m = run.manifest
    assert m["evidence"]["all_finite"] is False
    assert (m["counts"]["ok"], m["counts"]["failed"]) == (2, 1)


def test_nan_row_not_strict(tmp_path):
    run = execute(tmp_path / "nan", ["dataset.limit=3", "batch_size=1", "evidence.strict=false"],
                  on_loaded=_nan_on_second_decode)
    assert run.error is None
    assert run.code == 1
    _check_nan_row(run)


def test_nan_row_strict_still_records_everything(tmp_path):
    run = execute(tmp_path / "nan", ["dataset.limit=3", "batch_size=1"], on_loaded=_nan_on_second_decode,
                  catch=(EvidenceError,))
    assert run.code == 1 or run.error is not None  # never a success
    _check_nan_row(run)


# regression: bug: with evidence.strict=true (the default) a non-finite row makes run() 
def test_nan_row_strict_returns_1(tmp_path):
    run = execute(tmp_path / "nan", ["dataset.limit=3", "batch_size=1"], on_loaded=_nan_on_second_decode,
                  catch=(EvidenceError,))
    assert run.error is None, str(run.error)
    assert run.code == 1
    assert run.manifest["status"] == "completed_with_failures"


# --------------------------------------------------------------------------------- aliases, refusal


def test_alias_and_canonical_name_give_identical_bytes(tmp_path):
    a = execute(tmp_path / "alias", ["dataset.limit=2", "backend.attention=sdpa"])
    b = execute(tmp_path / "canon", ["dataset.limit=2", "backend.attention=TORCH_SDPA"])
    assert a.code == b.code == 0
    ha = [(it["key"], it["file_sha256"]) for it in a.items]
    hb = [(it["key"], it["file_sha256"]) for it in b.items]
    assert len(ha) == 2 and ha == hb
    for it in a.items:
        assert (a.run_dir / it["file"]).read_bytes() == (b.run_dir / it["file"]).read_bytes()
    ba, bb = a.manifest["backends"]["denoise"]["attention"], b.manifest["backends"]["denoise"]["attention"]
    assert (ba["requested"], bb["requested"]) == ("sdpa", "TORCH_SDPA")
    assert ba["layer"] == bb["layer"] == "cli_run"
    assert ba["resolved"] == bb["resolved"] and ba["selected"] == bb["selected"]


def test_cudnn_on_cpu_refused_before_the_model_loads(tmp_path, monkeypatch):
    import models.flux as flux

    def loaded(*a, **k):
        raise AssertionError("the model was loaded before the backend was refused")

    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", loaded)
    monkeypatch.setattr(flux, "embedded_snapshot", loaded)
    run_dir = tmp_path / "cudnn"
    t0 = time.perf_counter()
    run = execute(run_dir, ["backend.attention=cudnn"], catch=(BackendUnavailableError,))
    seconds = time.perf_counter() - t0
    assert isinstance(run.error, BackendUnavailableError)
    assert "CUDNN_ATTN" in str(run.error) and "cpu" in str(run.error)
    assert not (run_dir / "items.jsonl").exists() and not (run_dir / "manifest.json").exists()
    assert seconds < 10, f"refusal took {seconds:.1f} s"


# ------------------------------------------------------------------------------------------------- C10


@pytest.mark.parametrize("cli", [["backend.attention=TORCH_SDPA"], []], ids=["cli_TORCH_SDPA", "auto"])
def test_c10_library_env_var_does_not_override_the_runner(tmp_path, cli):
    run_dir = tmp_path / "c10"
    env = dict(os.environ, DIFFUSERS_ATTN_BACKEND="_native_math", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "runner", "model=tiny_flux", "platform=cpu", *cli, "dataset.limit=1", f"hydra.run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["status"] == "completed"
    assert m["environment"].get("DIFFUSERS_ATTN_BACKEND") == "_native_math"
    # the value did not act: recorded as ignored, with why and the fix, and said on the console (not silently)
    why = m["environment_ignored"]["DIFFUSERS_ATTN_BACKEND"]
    assert why.startswith("DIFFUSERS_ATTN_BACKEND='_native_math' is ignored: ") and \
        "fix: backend.attention=<name>" in why, why
    assert sum(why in line for line in (p.stdout + p.stderr).splitlines()) == 1, p.stdout + p.stderr
    layers = _layers(m)
    forwards = m["evidence"]["stages"]["denoise"]["denoiser_forwards"]
    assert sorted(layers) == sorted(_attention_layer_names())
    for name, l in layers.items():
        assert l["observed"] == {"TORCH_SDPA": forwards}, name
    names = m["evidence"]["stages"]["denoise"]["kernels"]["attention"]["TORCH_SDPA"]
    assert "aten::_scaled_dot_product_attention_math" not in names, names
    assert m["evidence"]["verdict"] == "verified"
    assert m["backends"]["denoise"]["attention"]["selected"]["joint"]["backend"] == "TORCH_SDPA"
