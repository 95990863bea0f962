"""The Run object's steps (runner/app/run.py: plan_resume, verdict, finalize, exit_code, evidence_doc, compact) on
the real tiny_flux pipeline, one item of one step each, so the mutation run (benchmarks/mutation.py, group
``run``) can afford them per mutant: the exit code and the manifest's status, counts, evidence, timing and
resume sections of each way a run ends (completed, a failed item, interrupted, an evidence mismatch strict and
not, every item reused), checked against what is on disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Dict, List

import pytest

from runner.core.errors import EvidenceError
from tests._helpers import execute

FAST = ["dataset.limit=2", "model.generation.num_inference_steps=1", "model.generation.width=32",
        "model.generation.height=32"]


def _journal(d: Path) -> List[Dict[str, Any]]:
    return [json.loads(l) for l in (d / "items.jsonl").read_text().splitlines() if l.strip()]


def _manifest(d: Path) -> Dict[str, Any]:
    return json.loads((d / "manifest.json").read_text())


@pytest.fixture(scope="module")
def done(tmp_path_factory):
    run = execute(tmp_path_factory.mktemp("run") / "done", FAST)
    assert run.error is None
    return run


def test_completed_run_exits_0_with_its_counts_timing_and_verified_evidence(done):
    assert done.code == 0
    m = _manifest(done.run_dir)
    assert m["status"] == "completed" and m["ended_at"] >= m["started_at"]
    assert m["counts"] == {"ok": 2, "failed": 0, "reused": 0}
    ev = m["evidence"]
    assert ev["verdict"] == "verified" and ev["enabled"] is True and ev["all_finite"] is True
    assert ev["mismatches"] == [] and ev["pid"] == os.getpid() and ev["device"] == "cpu"
    assert list(ev["stages"]) == ["denoise"]
    t = m["timing"]
    assert t["generate_s"] > 0 and t["loop_s"] >= t["generate_s"] and t["wall_s"] >= t["loop_s"]
    assert t["images_per_s"] == pytest.approx(2 / t["generate_s"], rel=1e-2)  # generate_s is rounded to 3 digits
    assert t["images_per_hour"] == pytest.approx(3600 * 2 / t["loop_s"], rel=1e-2)
    assert t["write_workers"] == 2 and "write" in t["phases_s"]
    assert m["memory"]["host_peak_rss_bytes"] > 0
    recs = _journal(done.run_dir)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert all((done.run_dir / r["file"]).is_file() for r in recs)
    assert m["folder_metadata"] and m["unlisted_files"]["count"] == 0
    assert "resumed_from" not in m


def test_resume_of_a_finished_run_reuses_every_item_and_collects_no_evidence(done, tmp_path):
    d = tmp_path / "again"
    shutil.copytree(done.run_dir, d)
    stale = d / "images" / ".stale.png.tmp123"
    stale.write_bytes(b"half")
    run = execute(d, FAST + [f"run.resume={d}"])
    assert run.error is None and run.code == 0
    m = _manifest(d)
    assert m["status"] == "completed"
    assert m["counts"] == {"ok": 0, "failed": 0, "reused": 2}
    assert m["resumed_from"]["reused_items"] == 2 and m["resumed_from"]["status"] == "completed"
    assert m["resumed_from"]["forced"] is False
    assert m["evidence"]["verdict"] == "not_collected"
    assert m["evidence"]["reason"] == ("every item was reused from an earlier attempt: the evidence of the attempt "
                                       "that wrote each item is in resumed_from.attempts (items_by_attempt names "
                                       "them)")
    first = _manifest(done.run_dir)  # ... and the attempt that wrote them is kept, with its evidence
    assert [(a["run_id"], a["evidence"]["verdict"], a["items"]) for a in m["resumed_from"]["attempts"]] == [
        (first["run_id"], first["evidence"]["verdict"], 2)]
    assert [r["run_id"] for r in _journal(d)] == [first["run_id"]] * 2
    assert not stale.exists(), "a resumed run (no worker) removes the temp files of the earlier one"
    assert [r["key"] for r in _journal(d)] == [r["key"] for r in _journal(done.run_dir)]
    assert m["timing"]["images_per_s"] is None


def test_a_resume_with_a_changed_seed_regenerates_only_with_force(done, tmp_path):
    d = tmp_path / "forced"
    shutil.copytree(done.run_dir, d)
    run = execute(d, FAST + [f"run.resume={d}", "seed=7", "run.force=true"])
    assert run.error is None and run.code == 0
    m = _manifest(d)
    assert m["resumed_from"]["forced"] is True
    assert m["counts"] == {"ok": 2, "failed": 0, "reused": 0}
    recs = _journal(d)
    assert len(recs) == 2 and all(r["status"] == "ok" for r in recs)
    # the journal holds only the current config's records (the earlier seed's ok lines are compacted out)
    assert {r["inputs_sha256"] for r in recs}.isdisjoint({r["inputs_sha256"] for r in _journal(done.run_dir)})


def _fail_second_call(adapter: Any) -> None:
    calls = {"n": 0}

    def hook(mod, args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")

    adapter.pipe.text_encoder.register_forward_pre_hook(hook)


def test_a_failed_item_exits_1_completed_with_failures(tmp_path):
    run = execute(tmp_path / "fail", FAST, on_loaded=_fail_second_call)
    assert run.error is None and run.code == 1
    m = _manifest(run.run_dir)
    assert m["status"] == "completed_with_failures"
    assert m["counts"] == {"ok": 1, "failed": 1, "reused": 0}
    assert [r["status"] for r in _journal(run.run_dir)] == ["ok", "failed"]
    assert m["evidence"]["verdict"] == "verified"


def test_a_signal_stops_the_run_interrupted_with_128_plus_the_signal(tmp_path):
    def on_loaded(adapter):
        def hook(mod, args):
            os.kill(os.getpid(), signal.SIGTERM)

        adapter.denoiser.register_forward_pre_hook(hook)

    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        run = execute(tmp_path / "sig", FAST, on_loaded=on_loaded)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert run.error is None and run.code == 128 + signal.SIGTERM
    m = _manifest(run.run_dir)
    assert m["status"] == "interrupted"
    assert m["counts"] == {"ok": 1, "failed": 0, "reused": 0}


def _other_kernel(adapter: Any) -> None:
    from diffusers.models.attention_dispatch import AttentionBackendName

    adapter.pipe.transformer.transformer_blocks[0].attn.processor._attention_backend = AttentionBackendName._NATIVE_MATH


def test_strict_evidence_mismatch_raises_after_everything_was_written(tmp_path):
    run = execute(tmp_path / "strict", FAST, on_loaded=_other_kernel, catch=(EvidenceError,))
    assert isinstance(run.error, EvidenceError)
    assert "evidence.strict=true" in str(run.error) and "transformer_blocks.0.attn" in str(run.error)
    m = _manifest(run.run_dir)
    assert m["status"] == "evidence_mismatch" and m["evidence"]["verdict"] == "mismatch"
    assert m["counts"] == {"ok": 2, "failed": 0, "reused": 0}
    assert len(_journal(run.run_dir)) == 2


def test_evidence_mismatch_not_strict_is_limited_and_exits_0(tmp_path):
    run = execute(tmp_path / "lax", FAST + ["evidence.strict=false"], on_loaded=_other_kernel)
    assert run.error is None and run.code == 0
    m = _manifest(run.run_dir)
    assert m["status"] == "limited" and m["evidence"]["verdict"] == "mismatch"
    assert m["evidence"]["mismatches"]


def test_evidence_disabled_is_not_collected(tmp_path):
    run = execute(tmp_path / "off", FAST + ["evidence.enabled=false"])
    assert run.code == 0
    ev = _manifest(run.run_dir)["evidence"]
    assert ev == {"enabled": False, "pid": os.getpid(), "device": "cpu", "all_finite": True,
                  "verdict": "not_collected", "mismatches": []}


def test_a_nonfinite_output_is_its_own_verdict(tmp_path):
    def on_loaded(adapter):
        def hook(mod, args, out):
            return out * float("nan")

        adapter.pipe.vae.decoder.register_forward_hook(hook)

    run = execute(tmp_path / "nan", FAST + ["evidence.strict=false"], on_loaded=on_loaded)
    assert run.error is None and run.code == 1
    m = _manifest(run.run_dir)
    assert m["evidence"]["verdict"] == "nonfinite_outputs" and m["evidence"]["all_finite"] is False
    assert m["status"] == "completed_with_failures" and m["counts"] == {"ok": 0, "failed": 2, "reused": 0}
