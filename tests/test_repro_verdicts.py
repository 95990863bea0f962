"""Every verdict of ``runner.tools.repro`` on run dirs laid out as runs leave them (``manifest.json``, ``items.jsonl``,
PNG/MP4 files, AR records): byte equality on CPU originals, the PSNR tolerance elsewhere (at its boundary), an
original file modified after the run, items missing from either side, a changed backend resolution or dataset,
runs refused at startup, AR token ids, and the re-run command.

The end-to-end ``python -m runner.repro`` (a real re-run) is in test_repro_matrix.py and test_issue16.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import pytest

from runner.tools import repro
from runner.core.artifacts import encode_png
from runner.tools.report import compare_images, load_rgb

pytestmark = pytest.mark.cpu

BACKENDS = {"denoise": {"attention": {"resolved": {"joint": {"backend": "auto"}},
                                      "selected": {"joint": {"backend": "TORCH_SDPA"}}},
                        "linear": {"resolved": "auto", "selected": "TORCH"}}}


def _img(seed: int, noise: float = 0.0) -> np.ndarray:
    """A 16x16 image of its own per ``seed``; ``noise`` adds a fixed perturbation (lower PSNR for more noise)."""
    base = np.random.default_rng(seed).random((16, 16, 3), dtype=np.float32)
    pert = np.random.default_rng(1000 + seed).standard_normal(base.shape).astype(np.float32)
    return np.clip(base + noise * pert, 0, 1)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def run_dir(d: Path, items: Dict[str, Any], platform: str = "cpu", status: str = "completed",
            backends: Optional[Dict[str, Any]] = None, dataset_sha: Optional[str] = "d" * 64,
            extra_records: List[Dict[str, Any]] = (), **manifest: Any) -> Path:
    """A run dir: ``items`` maps a key to a float image (written as PNG), to bytes of a file, or to a record."""
    (d / "images").mkdir(parents=True, exist_ok=True)
    recs = []
    for key, v in items.items():
        if isinstance(v, dict):
            recs.append({"key": key, **v})
            continue
        data = encode_png(v) if isinstance(v, np.ndarray) else v
        (d / "images" / f"{key}.png").write_bytes(data)
        recs.append({"key": key, "status": "ok", "file": f"images/{key}.png", "file_sha256": _sha(data)})
    recs += list(extra_records)
    (d / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    doc = {"status": status, "platform": {"kind": platform}, "backends": BACKENDS if backends is None else backends,
           "dataset": {"sha256": dataset_sha}, "git": {"commit": "c" * 40, "dirty": False},
           "packages": {"torch": "2.13"}}
    doc.update(manifest)
    (d / "manifest.json").write_text(json.dumps(doc))
    return d


def pair(tmp_path: Path, a: Dict[str, Any], b: Dict[str, Any], **kw: Any):
    kw_new = kw.pop("new", {})
    return run_dir(tmp_path / "orig", a, **kw), run_dir(tmp_path / "new", b, **{**kw, **kw_new})


def _psnr(a: np.ndarray, b: np.ndarray, tmp_path: Path) -> float:
    pa, pb = tmp_path / "pa.png", tmp_path / "pb.png"
    pa.write_bytes(encode_png(a))
    pb.write_bytes(encode_png(b))
    return compare_images(load_rgb(pa), load_rgb(pb))["psnr_db"]


# -------------------------------------------------------------------------------------------------- CPU: bytes


def test_cpu_rerun_with_the_same_bytes_reproduces(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0), "b": _img(1, 0.1)}, {"a": _img(0), "b": _img(1, 0.1)})
    res = repro.compare(o, n)
    assert res["ok"] and res["problems"] == [] and res["notes"] == []
    assert (res["mode"], res["tolerance_db"], res["platform"]) == ("bytes", None, "cpu")
    assert (res["original"], res["rerun"]) == (str(o), str(n))
    a = res["items"][0]
    assert a == {"key": "a", "original_sha256": _sha(encode_png(_img(0))), "new_sha256": _sha(encode_png(_img(0))),
                 "psnr_db": math.inf, "max_abs_diff": 0, "ok": True, "compared": "bytes", "verdict": "ok"}


def test_cpu_rerun_with_other_bytes_fails_whatever_the_psnr(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.002)})
    res = repro.compare(o, n, tolerance_db=1.0)
    assert not res["ok"] and res["problems"] == ["item 'a': bytes differ"]
    row = res["items"][0]
    assert row["verdict"] == "bytes differ" and row["ok"] is False
    assert row["psnr_db"] > 40 and row["max_abs_diff"] >= 1  # reported, not the criterion


def test_psnr_mode_on_cpu_when_asked(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.002)})
    res = repro.compare(o, n, exact=False)
    assert res["ok"] and res["mode"] == "psnr" and res["tolerance_db"] == 40.0


# ------------------------------------------------------------------------------------------------ GPU: PSNR


@pytest.mark.parametrize("kind", ["cuda", "rocm", "mps"])
def test_non_cpu_runs_compare_by_psnr(tmp_path, kind):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.002)}, platform=kind)
    res = repro.compare(o, n)
    assert res["ok"], res["problems"]
    assert (res["mode"], res["tolerance_db"], res["platform"]) == ("psnr", 40.0, kind)
    assert 40 < res["items"][0]["psnr_db"] < math.inf


def test_psnr_below_the_tolerance_fails_and_says_by_how_much(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.1)}, platform="cuda")
    got = _psnr(_img(0), _img(0, 0.1), tmp_path)
    res = repro.compare(o, n)
    assert not res["ok"]
    assert res["problems"] == [f"item 'a': PSNR {got:.2f} dB < 40 dB"]
    assert res["items"][0]["psnr_db"] == pytest.approx(got)


def test_psnr_tolerance_boundary(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.01)}, platform="cuda")
    got = _psnr(_img(0), _img(0, 0.01), tmp_path)
    assert repro.compare(o, n, tolerance_db=got)["ok"]  # >= tolerance passes
    res = repro.compare(o, n, tolerance_db=got + 1e-6)
    assert not res["ok"] and res["problems"] == [f"item 'a': PSNR {got:.2f} dB < {got + 1e-6:g} dB"]
    assert repro.compare(o, n, tolerance_db=got - 1.0)["tolerance_db"] == got - 1.0


def test_exact_mode_on_a_gpu_run_when_asked(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0, 0.002)}, platform="cuda")
    res = repro.compare(o, n, exact=True)
    assert not res["ok"] and res["mode"] == "bytes" and res["problems"] == ["item 'a': bytes differ"]


def test_psnr_mode_with_images_of_another_size(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": np.zeros((8, 8, 3), np.float32)}, platform="cuda")
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'a': PSNR — dB < 40 dB"]


def test_identical_files_on_a_gpu_run(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, platform="cuda")
    row = repro.compare(o, n)["items"][0]
    assert row["ok"] and row["psnr_db"] == math.inf and row["max_abs_diff"] == 0


# --------------------------------------------------------------------------------------- what can be missing


def test_original_file_modified_after_the_run(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0), "b": _img(1)}, {"a": _img(0), "b": _img(1)})
    (o / "images" / "a.png").write_bytes(encode_png(_img(5)))
    (n / "images" / "a.png").write_bytes(encode_png(_img(5)))  # even when the re-run matches what is there now
    res = repro.compare(o, n)
    assert not res["ok"]
    assert res["problems"] == ["item 'a': original file modified after the run (sha256 differs from items.jsonl)"]


def test_original_file_without_a_recorded_sha_is_taken_as_it_is(tmp_path):
    o, n = pair(tmp_path, {"a": {"status": "ok", "file": "images/a.png"}}, {"a": _img(0)})
    (o / "images" / "a.png").write_bytes(encode_png(_img(0)))
    assert repro.compare(o, n)["ok"]


def test_original_file_missing(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)})
    (o / "images" / "a.png").unlink()
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'a': original file missing; bytes differ"]
    assert res["items"][0]["original_sha256"] is None and res["items"][0]["psnr_db"] is None


def test_item_missing_in_the_rerun(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0), "b": _img(1), "c": _img(2)},
                {"a": _img(0), "b": {"status": "failed", "reason": "nonfinite output"},
                 "c": {"status": "ok", "file": None}})
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'b': missing in re-run (failed: nonfinite output)",
                               "item 'c': missing in re-run (ok: None)"]
    o2, n2 = pair(tmp_path / "2", {"a": _img(0), "b": _img(1)}, {"a": _img(0)})
    assert repro.compare(o2, n2)["problems"] == ["item 'b': missing in re-run"]


def test_items_only_in_the_rerun(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0), "z": _img(9), "f": {"status": "failed"}})
    assert repro.compare(o, n)["problems"] == ["item 'z': only in the re-run"]


def test_failed_items_of_the_original_are_not_compared(tmp_path):
    o, n = pair(tmp_path, {"f": {"status": "failed", "file": None}, "g": {"status": "ok"}, "a": _img(0)},
                {"a": _img(0)})
    res = repro.compare(o, n)
    assert res["ok"] and [r["key"] for r in res["items"]] == ["a"]


def test_nothing_to_compare(tmp_path):
    o, n = pair(tmp_path, {"f": {"status": "failed"}}, {})
    assert repro.compare(o, n)["problems"] == [
        f"{o} holds no ok item to compare (no image file, no AR output); nothing was reproduced"]


def test_rerun_without_a_manifest(tmp_path):
    o = run_dir(tmp_path / "orig", {"a": _img(0)})
    n = tmp_path / "new"
    n.mkdir()
    res = repro.compare(o, n)
    assert res["problems"][0] == f"the re-run wrote no manifest.json in {n}"
    assert "item 'a': missing in re-run" in res["problems"]


# ----------------------------------------------------------------------------------- backends, dataset, status


def test_a_changed_backend_resolution_fails(tmp_path):
    other = json.loads(json.dumps(BACKENDS))
    other["denoise"]["attention"]["selected"]["joint"]["backend"] = "CUDNN_ATTN"
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, new={"backends": other})
    res = repro.compare(o, n)
    assert not res["ok"]
    assert res["problems"] == ['backend resolution changed: denoise.attention selected {"joint": {"backend": '
                               '"TORCH_SDPA"}} -> {"joint": {"backend": "CUDNN_ATTN"}}']


def test_a_changed_resolved_value_fails_too(tmp_path):
    other = json.loads(json.dumps(BACKENDS))
    other["denoise"]["linear"]["resolved"] = "TORCH"
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, new={"backends": other})
    assert repro.compare(o, n)["problems"] == ['backend resolution changed: denoise.linear resolved "auto" -> "TORCH"']


def test_backend_diffs_of_added_stages_and_fields():
    a = {"denoise": {"linear": {"selected": "TORCH", "resolved": "auto"}}}
    b = {"denoise": {"linear": {"selected": "TORCH", "resolved": "auto"}, "moe": {"selected": "TORCH"}},
         "expand": {"attention": {"selected": "FLASH_ATTN"}}}
    assert repro._backend_diffs(a, b) == ['backend resolution changed: denoise.moe selected null -> "TORCH"',
                                          'backend resolution changed: expand.attention selected null -> "FLASH_ATTN"']
    assert repro._backend_diffs(b, b) == [] and repro._backend_diffs({}, {}) == []
    assert repro._backend_diffs({"s": None}, {"s": {"f": None}}) == []


def test_a_changed_dataset_fails(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, new={"dataset_sha": "e" * 64})
    assert repro.compare(o, n)["problems"] == ["dataset changed: sha256 dddddddddddd -> eeeeeeeeeeee"]


def test_an_unrecorded_dataset_hash_is_not_compared(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, new={"dataset_sha": None})
    assert repro.compare(o, n)["ok"]


def test_a_run_refused_at_startup_reproduces_nothing_and_is_not_ok(tmp_path):
    """A refused original holds no ok item: the same refusal again is named, but it is no reproduction (was: ``ok``
    and ``REPRO OK: 0 item(s) reproduced``, exit 0); another refusal is named as such."""
    err = {"error": {"type": "BackendUnavailableError"}}
    o, n = pair(tmp_path, {}, {}, status="refused", **err)
    res = repro.compare(o, n)
    assert not res["ok"] and res["items"] == []
    assert res["problems"] == [f"{o} holds no ok item: the run was refused at startup (BackendUnavailableError), and "
                               "so was the re-run; nothing was reproduced; fix: reproduce a run that generated items"]
    o2, n2 = pair(tmp_path / "2", {}, {"a": {"status": "failed"}}, status="refused", **err,
                  new={"status": "invalid", "error": {"type": "DatasetError"}})
    assert repro.compare(o2, n2)["problems"] == [
        "original was refused (BackendUnavailableError); re-run is invalid (DatasetError)",
        f"{o2} holds no ok item: the run was refused at startup (BackendUnavailableError); nothing was reproduced; "
        "fix: reproduce a run that generated items"]
    o3, n3 = pair(tmp_path / "3", {}, {}, status="invalid", **err, new={"error": {"type": "DatasetError"}})
    assert repro.compare(o3, n3)["problems"][0] == (
        "original was invalid (BackendUnavailableError); re-run is invalid (DatasetError)")


def test_cli_repro_of_a_run_refused_at_startup_fails_saying_so(tmp_path, subprocess_env):
    """A real refusal (memory.offload=model on the CPU), then ``python -m runner.repro`` of it: exit 1, REPRO FAILED
    naming the refusal, ``ok: false`` in repro_check.json (was REPRO OK, exit 0)."""
    import subprocess

    run, out = tmp_path / "refused", tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "runner", "memory.offload=model", "dataset.limit=1", "platform=cpu",
                        f"output.dir={run}"], cwd=tmp_path, env=subprocess_env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 2, (p.stdout + p.stderr)[-3000:]
    r = subprocess.run([sys.executable, "-m", "runner.repro", str(run), "--out", str(out)], cwd=tmp_path,
                       env=subprocess_env, capture_output=True, text=True, timeout=600)
    text = r.stdout + r.stderr
    assert r.returncode == 1 and "REPRO OK" not in text, text[-3000:]
    assert "REPRO FAILED" in text and "holds no ok item: the run was invalid at startup (ConfigValueError)" in text
    assert json.loads((out / "repro_check.json").read_text())["ok"] is False


def test_a_rerun_refused_at_startup_names_its_refusal_alone(tmp_path):
    """The original completed; the re-run was refused (a package gone, a device missing): the one problem is the
    refusal with its type, message and fix and the count of items not compared (was: "the re-run exited 2", each
    backend "-> null" and each item "missing in re-run", the cause only in the re-run's log above)."""
    err = {"type": "QuantizationUnavailableError", "message": "needs torchao. Fix: pip install -e \".[torchao]\""}
    o, n = pair(tmp_path, {"a": _img(0), "b": _img(1), "c": {"status": "failed"}}, {},
                new={"status": "refused", "error": err, "backends": {}})
    res = repro.compare(o, n)
    assert not res["ok"] and res["items"] == [] and res["rerun_refused"] == err
    assert res["problems"] == ["the re-run was refused at startup, so none of the original's 2 ok item(s) was "
                               "compared: QuantizationUnavailableError: needs torchao. Fix: pip install -e "
                               "\".[torchao]\""]
    o2, n2 = pair(tmp_path / "2", {"a": _img(0)}, {}, new={"status": "invalid", "error": {"type": "DatasetError",
                                                                                         "message": "m"}})
    assert repro.compare(o2, n2)["problems"] == ["the re-run was invalid at startup, so none of the original's 1 ok "
                                                 "item(s) was compared: DatasetError: m"]
    o3, n3 = pair(tmp_path / "3", {"a": _img(0)}, {}, new={"status": "interrupted"})  # not a refusal: per item
    assert repro.compare(o3, n3)["problems"] == ["item 'a': missing in re-run"]


def test_cli_repro_whose_rerun_is_refused_leads_with_the_refusal(tmp_path, subprocess_env):
    """A real run, then its re-run refused at startup (its manifest's overrides given memory.offload=model, which
    the CPU refuses, as a re-run on a machine without the original's GPU or package would be): exit 1, REPRO FAILED
    is the refusal alone, not "exited 2" and per-item noise."""
    import subprocess

    run, out = tmp_path / "run", tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "runner", "dataset.limit=1", f"output.dir={run}"], cwd=tmp_path,
                       env=subprocess_env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    doc = json.loads((run / "manifest.json").read_text())
    doc["overrides"] = [*doc["overrides"], "memory.offload=model"]  # what the re-run replays: refused on the CPU
    (run / "manifest.json").write_text(json.dumps(doc))
    r = subprocess.run([sys.executable, "-m", "runner.repro", str(run), "--out", str(out)], cwd=tmp_path,
                       env=subprocess_env, capture_output=True, text=True, timeout=600)
    failed = r.stderr[r.stderr.index("REPRO FAILED:"):].splitlines()[1:]
    assert r.returncode == 1 and [x.strip() for x in failed if x.strip()] == [
        "the re-run was invalid at startup, so none of the original's 1 ok item(s) was compared: ConfigValueError: "
        + json.loads((out / "manifest.json").read_text())["error"]["message"]], r.stderr[-3000:]
    assert "memory.offload" in failed[0] and json.loads((out / "repro_check.json").read_text())["ok"] is False


def test_a_completed_run_is_not_compared_by_status(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)}, new={"status": "completed_with_failures",
                                                               "error": {"type": "X"}})
    assert repro.compare(o, n)["ok"]


def test_notes_name_another_commit_and_package_versions(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)},
                new={"git": {"commit": "f" * 40, "dirty": True}, "packages": {"torch": "2.14", "pillow": "11"}})
    res = repro.compare(o, n)
    assert res["ok"]  # notes explain a mismatch; they are not one
    assert res["notes"] == [f"git: original {'c' * 12} (dirty=False), re-run {'f' * 12} (dirty=True)",
                            "package pillow: None -> 11", "package torch: 2.13 -> 2.14"]
    o2, n2 = pair(tmp_path / "2", {"a": _img(0)}, {"a": _img(0)}, new={"git": {"commit": "c" * 40, "dirty": True}})
    assert repro.compare(o2, n2)["notes"] == [f"git: original {'c' * 12} (dirty=False), re-run {'c' * 12} (dirty=True)"]


def test_notes_name_the_earlier_attempts_that_wrote_a_resumed_originals_items(tmp_path):
    """A resumed original whose items an earlier attempt wrote at another commit and torch: the notes name that
    attempt (its run_id and items), not only the last attempt's git and packages; an attempt that wrote none of
    the items is left out. Kills: notes that compare only the manifest's top-level git and packages."""
    attempts = [{"run_id": "a" * 32, "status": "completed", "git": {"commit": "e" * 40, "dirty": False},
                 "packages": {"torch": "2.12"}, "evidence": {"verdict": "verified"}, "items": 1},
                {"run_id": "b" * 32, "status": "interrupted", "git": {"commit": "9" * 40, "dirty": True},
                 "packages": {"torch": "2.11"}, "evidence": {"verdict": "verified"}, "items": 0}]
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)},
                resumed_from={"run_id": "b" * 32, "status": "interrupted", "attempts": attempts})
    assert repro.compare(o, n)["notes"] == [
        f"git: attempt {'a' * 8} (1 items) {'e' * 12} (dirty=False), re-run {'c' * 12} (dirty=False)",
        f"attempt {'a' * 8} (1 items): package torch: 2.12 -> 2.13"]


# ------------------------------------------------------------------------------------------------ AR tokens


def _ar(ids: Optional[List[int]], status: str = "ok") -> Dict[str, Any]:
    return {"status": status, "output_token_ids": ids, "text": "x"}


def test_ar_records_need_identical_token_ids(tmp_path):
    o, n = pair(tmp_path, {"p1": _ar([1, 2, 3]), "p2": _ar([4, 5, 6, 7])},
                {"p1": _ar([1, 2, 3]), "p2": _ar([4, 5, 9, 7])})
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'p2': output_token_ids differ from token 2 (4 original vs 4 re-run tokens)"]
    p1 = res["items"][0]
    sha = hashlib.sha256(json.dumps([1, 2, 3]).encode()).hexdigest()
    assert p1 == {"key": "p1", "original_sha256": sha, "new_sha256": sha, "psnr_db": None, "max_abs_diff": None,
                  "ok": True, "verdict": "ok"}


def test_ar_records_not_ok_in_the_original_are_not_compared(tmp_path):
    o, n = pair(tmp_path, {"bad": _ar([9], "failed"), "plain": {"status": "ok", "text": "x"}, "p": _ar([1, 2])},
                {"p": _ar([1, 2])})
    res = repro.compare(o, n)
    assert res["ok"] and [r["key"] for r in res["items"]] == ["p"]


def test_ar_record_missing_from_the_rerun(tmp_path):
    o, n = pair(tmp_path, {"p": _ar([1]), "q": _ar([2]), "r": _ar([3])},
                {"p": _ar([1]), "q": {"status": "failed", "reason": "engine died"}})
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'q': missing in re-run (failed: engine died)", "item 'r': missing in re-run"]
    assert [r["ok"] for r in res["items"]] == [True, False, False]


def test_ar_record_with_null_token_ids(tmp_path):
    o, n = pair(tmp_path, {"p": _ar(None)}, {"p": _ar(None)})
    row = repro.compare(o, n)["items"][0]
    assert row["original_sha256"] is None and row["verdict"] == "missing in re-run (ok: None)"


def test_image_and_token_problems_are_all_listed(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(1)})
    (o / "expand.jsonl").write_text(json.dumps({"key": "r", **_ar([1, 2])}) + "\n")
    (n / "expand.jsonl").write_text(json.dumps({"key": "r", **_ar([1, 3])}) + "\n")
    assert repro.compare(o, n)["problems"] == [
        "item 'a': bytes differ",
        "item 'expand.jsonl:r': output_token_ids differ from token 1 (2 original vs 2 re-run tokens)"]


def test_ar_token_ids_of_another_length(tmp_path):
    o, n = pair(tmp_path, {"p": _ar([1, 2, 3])}, {"p": _ar([1, 2])})
    assert repro.compare(o, n)["problems"] == [
        "item 'p': output_token_ids differ from token 2 (3 original vs 2 re-run tokens)"]


def test_ar_missing_and_extra_records(tmp_path):
    o, n = pair(tmp_path, {"p1": _ar([1]), "p2": _ar([2]), "p3": _ar([3]), "skip": _ar([0], "failed")},
                {"p1": _ar([1]), "p2": _ar([2], "failed"), "p3": _ar(None), "p9": _ar([9])})
    assert repro.compare(o, n)["problems"] == ["item 'p2': missing in re-run (failed: None)",
                                               "item 'p3': missing in re-run (ok: None)", "item 'p9': only in the re-run"]


def test_ar_pipeline_stage_journal_is_compared_under_its_name(tmp_path):
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0)})
    (o / "expand.jsonl").write_text(json.dumps({"key": "r", **_ar([1, 2])}) + "\n")
    (n / "expand.jsonl").write_text(json.dumps({"key": "r", **_ar([1, 3])}) + "\n")
    (o / "items.rank0.jsonl").write_text(json.dumps({"key": "w", **_ar([5])}) + "\n")  # a worker's: not compared
    res = repro.compare(o, n)
    assert [r["key"] for r in res["items"]] == ["a", "expand.jsonl:r"]
    assert res["problems"] == ["item 'expand.jsonl:r': output_token_ids differ from token 1 (2 original vs 2 re-run "
                               "tokens)"]
    (n / "expand.jsonl").write_text(json.dumps({"key": "r", **_ar([1, 2])}) + "\n" +
                                    json.dumps({"key": "s", **_ar([4])}) + "\n")
    assert repro.compare(o, n)["problems"] == ["item expand.jsonl:'s': only in the re-run"]


def test_ar_tokens_apply_on_every_platform(tmp_path):
    o, n = pair(tmp_path, {"p": _ar([1, 2])}, {"p": _ar([1, 3])}, platform="cuda")
    res = repro.compare(o, n, tolerance_db=0.0)
    assert res["problems"] == ["item 'p': output_token_ids differ from token 1 (2 original vs 2 re-run tokens)"]


# ---------------------------------------------------------------------------------------------------- videos


def _video(d: Path, key: str, frames: np.ndarray, frames_sha: Optional[str] = None) -> Dict[str, Any]:
    from runner.core.video import encode_mp4

    (d / "videos").mkdir(parents=True, exist_ok=True)
    p = d / "videos" / f"{key}.mp4"
    encode_mp4(p, frames, 8)
    rec = {"status": "ok", "file": f"videos/{key}.mp4", "file_sha256": _sha(p.read_bytes())}
    if frames_sha:
        rec["frames_sha256"] = frames_sha
    return rec


def _frames(seed: int, n: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (n, 16, 16, 3), dtype=np.uint8)


def test_videos_compare_decoded_frames(tmp_path):
    from runner.core.video import decode_mp4, frames_sha256

    ro, rn = _video(tmp_path / "orig", "v", _frames(0)), _video(tmp_path / "new", "v", _frames(0))
    o, n = pair(tmp_path, {"v": ro}, {"v": rn})
    res = repro.compare(o, n)
    assert res["ok"], res["problems"]
    row = res["items"][0]
    sha = frames_sha256(decode_mp4(o / "videos" / "v.mp4"))
    assert (row["compared"], row["original_sha256"], row["new_sha256"]) == ("frames", sha, sha)


def test_videos_with_other_frames(tmp_path):
    ro = _video(tmp_path / "orig", "v", _frames(0))
    rn = _video(tmp_path / "new", "v", _frames(0)[[0, 2, 1]])
    o, n = pair(tmp_path, {"v": ro}, {"v": rn})
    assert repro.compare(o, n)["problems"] == ["item 'v': decoded frames differ (frames_sha256)"]
    psnr = repro.compare(o, n, exact=False)
    assert psnr["problems"][0].startswith("item 'v': PSNR ") and psnr["items"][0]["psnr_db"] < 40


def test_videos_with_another_frame_count(tmp_path):
    ro = _video(tmp_path / "orig", "v", _frames(0, 3))
    rn = _video(tmp_path / "new", "v", _frames(0, 4))
    o, n = pair(tmp_path, {"v": ro}, {"v": rn}, platform="cuda")
    assert repro.compare(o, n)["problems"] == [
        "item 'v': frames (3, 16, 16, 3) vs (4, 16, 16, 3); PSNR — dB < 40 dB"]


def test_video_that_does_not_decode(tmp_path):
    ro = _video(tmp_path / "orig", "v", _frames(0))
    (tmp_path / "new" / "videos").mkdir(parents=True)
    (tmp_path / "new" / "videos" / "v.mp4").write_bytes(b"not a video")
    o, n = pair(tmp_path, {"v": ro}, {"v": {"status": "ok", "file": "videos/v.mp4"}})
    res = repro.compare(o, n)
    assert res["problems"] == ["item 'v': a video does not decode here (see notes)"]
    assert len(res["notes"]) == 1 and res["notes"][0].startswith("item 'v': the re-run video does not decode here (")


def test_notes_of_every_video_are_kept(tmp_path):
    ro = {k: _video(tmp_path / "orig", k, _frames(i), frames_sha="0" * 64) for i, k in enumerate("vw")}
    rn = {k: _video(tmp_path / "new", k, _frames(i)) for i, k in enumerate("vw")}
    o, n = pair(tmp_path, ro, rn)
    notes = repro.compare(o, n)["notes"]
    assert [x.split(":")[0] for x in notes] == ["item 'v'", "item 'w'"]


def test_a_recorded_frames_sha_from_another_decoder_is_a_note(tmp_path):
    ro = _video(tmp_path / "orig", "v", _frames(0), frames_sha="0" * 64)
    rn = _video(tmp_path / "new", "v", _frames(0))
    o, n = pair(tmp_path, {"v": ro}, {"v": rn})
    res = repro.compare(o, n)
    assert res["ok"]
    assert len(res["notes"]) == 1 and "the original video decodes here to frames_sha256" in res["notes"][0]
    assert res["notes"][0].endswith(f"its record says {'0' * 12} (another decoder)")


# --------------------------------------------------------------------------------------------- re-run command


def test_rerun_command_drops_the_output_and_resume_overrides(tmp_path):
    man = {"overrides": ["model=tiny_flux", "output.dir=/old/out", "+run.resume=/old", "~run.force", "seed=3",
                         "dataset=jsonl", "dataset.path=rows.jsonl"],
           "dataset": {"path": "/abs/where it was/rows.jsonl"},
           "config": {"output": {"dir": "/old/out"}, "run": {"resume": "/old"}}}
    new = tmp_path / "new (1)"
    assert repro.rerun_command(man, new) == [
        sys.executable, "-m", "runner", "model=tiny_flux", "seed=3", "dataset=jsonl",
        "dataset.path='/abs/where it was/rows.jsonl'", f"output.dir='{new}'", "run.resume=null",
        f"hydra.run.dir='{new}'"]


def test_rerun_command_keeps_an_absolute_dataset_path_as_written(tmp_path):
    man = {"overrides": ["dataset.path=/data/rows.jsonl"], "dataset": {"path": "/data/rows.jsonl"}, "config": {}}
    assert repro.rerun_command(man, tmp_path)[3:] == ["dataset.path=/data/rows.jsonl", f"hydra.run.dir='{tmp_path}'"]
    eq = {"overrides": ["dataset.path='data/a=b.jsonl'"], "dataset": {"path": "/abs/data/a=b.jsonl"}}
    assert repro.rerun_command(eq, tmp_path)[3] == "dataset.path='/abs/data/a=b.jsonl'"
    bare = {"overrides": ["dataset.path=rows.jsonl"]}
    assert repro.rerun_command(bare, tmp_path)[3] == "dataset.path=rows.jsonl"  # nothing recorded to replace it
    assert repro.rerun_command({}, tmp_path) == [sys.executable, "-m", "runner", f"hydra.run.dir='{tmp_path}'"]


def test_repro_of_a_sweep_dir_reproduces_each_job(tmp_path, subprocess_env):
    """``python -m runner.repro <sweep dir>``: every job (a subdir with a manifest) is re-run into ``<out>/<job>``
    and compared; one verdict per job, exit 0 when all reproduce."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    env = dict(subprocess_env, PYTHONPATH=str(repo) + os.pathsep + subprocess_env.get("PYTHONPATH", ""))
    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "runner", "-m", "seed=1,2", "dataset.limit=1",
                        f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [j.name for j in repro.sweep_jobs(sweep)] == ["0", "1"] and repro.sweep_jobs(sweep / "0") == []
    out = tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "runner.repro", str(sweep), "--out", str(out)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert p.stdout.count("REPRO OK: 1 item(s) reproduced") == 2, p.stdout
    assert f"repro of sweep {sweep}: 2 of 2 job(s) reproduced -> {out}" in p.stdout
    for job in ("0", "1"):
        assert json.loads((out / job / "repro_check.json").read_text())["ok"] is True


def test_an_interrupted_original_is_compared_on_the_items_it_made(tmp_path):
    # field case: a run stopped by Ctrl-C after 20 of 24 items; its repro made all 24 and said REPRO FAILED for
    # the 4 rows the original never reached
    o, n = pair(tmp_path, {"a": _img(0)}, {"a": _img(0), "z": _img(9), "y": _img(8)}, status="interrupted",
                new={"status": "completed"})
    res = repro.compare(o, n)
    assert res["ok"] and res["problems"] == [] and [r["key"] for r in res["items"]] == ["a"]
    assert "2 item(s) the original did not make (it was interrupted), made by the re-run: not compared" in res["notes"]
    # what the original did make is still compared
    o2, n2 = pair(tmp_path / "2", {"a": _img(0)}, {"a": _img(1), "z": _img(9)}, status="interrupted",
                  new={"status": "completed"})
    assert repro.compare(o2, n2)["problems"] == ["item 'a': bytes differ"]
    # a completed original with the same extra item fails as before
    o3, n3 = pair(tmp_path / "3", {"a": _img(0)}, {"a": _img(0), "z": _img(9)})
    assert repro.compare(o3, n3)["problems"] == ["item 'z': only in the re-run"]
