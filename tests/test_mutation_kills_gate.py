"""The quality gate (runner/tools/gate.py) on run dirs written here: a manifest, items.jsonl and the PNGs, as the
runner writes them (the fields the gate reads), so the mutation run (benchmarks/mutation.py, group ``gate``) can
afford every rule per mutant: which jobs hold the same rows, which lossless job a lossy job is paired with when
several exist (batch size first, then the closest backends), the accuracy ratio against ``--min-ratio`` given on
the command line, PSNR against ``--min-psnr-db``, the verdicts, the exit code and where the file is written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import pytest
from PIL import Image

from runner.tools import gate
from runner.tools.report import load_jobs

KEYS = ("a", "b")


def _png(path: Path, value: int, noise: int = 0) -> None:
    arr = np.full((16, 16, 3), value, dtype=np.uint8)
    if noise:
        arr[::2, ::2] = np.clip(int(value) + noise, 0, 255)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)


def job(root: Path, name: str, *, lossy: bool = False, lanes=(), dependent=(), batch: Any = 1,
        acc: Optional[Dict[str, Any]] = None, attention: str = "TORCH_SDPA", linear: str = "TORCH",
        noise: int = 0, status: str = "completed", outcome: Optional[str] = None, seed: int = 0,
        model: str = "toy_shapes", dtype: str = "float32", keys=KEYS, item_seed: int = 1) -> Path:
    d = root / name
    (d / "images").mkdir(parents=True)
    m = {"status": status, "dtype": dtype,
         "config": {"batch_size": batch, "seed": seed, "num_images_per_prompt": 1, "dataset": {"limit": 2},
                    "model": {"name": model, "generation": {"width": 16}}},
         "model": {"name": model, "source": {"kind": "embedded", "path": "/w", "weights_seed": 0}},
         "dataset": {"sha256": "d" * 64},
         "backends": {"denoise": {"attention": {"selected": attention}, "linear": {"selected": linear}}},
         "lossy": {"lossy": lossy, "lanes": list(lanes), "batch_dependent": list(dependent)}}
    if acc is not None:
        m["accuracy"] = acc
    (d / "manifest.json").write_text(json.dumps(m))
    if outcome is not None:
        (d / "job_status.json").write_text(json.dumps({"outcome": outcome}))
    recs = []
    for i, k in enumerate(keys):
        _png(d / "images" / f"{k}.png", 40 * (i + 1), noise)
        recs.append({"key": k, "status": "ok", "file": f"images/{k}.png", "seed": item_seed + i,
                     "prompt_sha256": k * 8, "params": {"width": 16, "batch_size": batch}})
    (d / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def jobs_of(*dirs: Path):
    return {j.path.name: j for j in load_jobs(list(dirs))}


ACC = {"oracle": "toy_shapes", "n": 2, "all": 0.5, "read": 2, "color": 1.0, "shape": 0.5, "position": 0.0}


# ------------------------------------------------------------------------------------------ same rows


@pytest.mark.parametrize("change", [dict(seed=1), dict(model="tiny_flux"), dict(dtype="bfloat16")])
def test_rows_identity_differs_with_what_makes_other_rows(tmp_path, change):
    a, b = job(tmp_path, "a"), job(tmp_path, "b", **change)
    j = jobs_of(a, b)
    assert gate.rows_identity(j["a"]) != gate.rows_identity(j["b"])


def test_rows_identity_ignores_lanes_backends_and_batch_size(tmp_path):
    a = job(tmp_path, "a")
    b = job(tmp_path, "b", lossy=True, lanes=["cache"], attention="FLASH", batch=4)
    j = jobs_of(a, b)
    assert gate.rows_identity(j["a"]) == gate.rows_identity(j["b"])


@pytest.mark.parametrize("field,value", [("dataset", {"sha256": "e" * 64}), ("config.dataset", {"limit": 3}),
                                         ("config.num_images_per_prompt", 2), ("config.model", {"name": "toy_shapes",
                                          "generation": {"width": 32}}),
                                         ("model", {"name": "toy_shapes", "source": {"kind": "embedded",
                                                    "path": "/w", "weights_seed": 1}}),
                                         ("model", {"name": "toy_shapes", "source": {"files": {"x": "1"}}})])
def test_rows_identity_covers_each_field(tmp_path, field, value):
    a, b = job(tmp_path, "a"), job(tmp_path, "b")
    m = json.loads((b / "manifest.json").read_text())
    doc = m
    *parents, last = field.split(".")
    for p in parents:
        doc = doc[p]
    doc[last] = value
    (b / "manifest.json").write_text(json.dumps(m))
    j = jobs_of(a, b)
    assert gate.rows_identity(j["a"]) != gate.rows_identity(j["b"])


@pytest.mark.parametrize("value,want", [(4, 4), (True, None), ("4", None), (None, None)])
def test_batch_size_is_the_configs_integer(tmp_path, value, want):
    assert gate.batch_size(jobs_of(job(tmp_path, "a", batch=value))["a"]) == want


# ------------------------------------------------------------------------------------------- pairing


def test_pairing_prefers_the_lossless_job_of_the_same_batch_size(tmp_path):
    j = jobs_of(job(tmp_path, "bs1"), job(tmp_path, "bs4", batch=4),
                job(tmp_path, "lossy", lossy=True, lanes=["fp8"], batch=4))
    ref, why = gate.pick_reference(j["lossy"], [j["bs1"], j["bs4"]], [])
    assert ref is j["bs4"] and why is None


def test_pairing_among_several_of_the_batch_size_takes_the_closest_backends(tmp_path):
    j = jobs_of(job(tmp_path, "far", attention="X", linear="Y"), job(tmp_path, "near", attention="FLASH"),
                job(tmp_path, "lossy", lossy=True, lanes=["fp8"], attention="FLASH", linear="FP8"))
    ref, why = gate.pick_reference(j["lossy"], [j["far"], j["near"]], [])
    assert ref is j["near"] and why is None
    ref, _ = gate.pick_reference(j["lossy"], [j["near"], j["far"]], [])
    assert ref is j["near"]


def test_pairing_ties_go_to_the_first(tmp_path):
    j = jobs_of(job(tmp_path, "one"), job(tmp_path, "two"), job(tmp_path, "lossy", lossy=True, lanes=["fp8"]))
    assert gate.pick_reference(j["lossy"], [j["one"], j["two"]], [])[0] is j["one"]
    assert gate.pick_reference(j["lossy"], [j["two"], j["one"]], [])[0] is j["two"]


def test_batch_dependent_lane_without_its_batch_size_is_unmatched(tmp_path):
    j = jobs_of(job(tmp_path, "bs1"), job(tmp_path, "bs2", batch=2),
                job(tmp_path, "lossy", lossy=True, lanes=["cache"], dependent=["cache.method=first_block"], batch=4))
    ref, why = gate.pick_reference(j["lossy"], [j["bs1"], j["bs2"]], ["cache.method=first_block"])
    assert ref is None
    assert why == ("cache.method=first_block makes each item depend on its batch peers, and no lossless job of the "
                   "same rows ran at batch_size=4 (they ran at batch_size=1, 2); fix: add one (e.g. "
                   "cache.method=none batch_size=4) or pass its run dir")


def test_other_lossy_lane_falls_back_to_another_batch_size_with_a_note(tmp_path):
    j = jobs_of(job(tmp_path, "far", batch=1, attention="X"), job(tmp_path, "near", batch=2),
                job(tmp_path, "lossy", lossy=True, lanes=["fp8"], batch=4))
    ref, why = gate.pick_reference(j["lossy"], [j["far"], j["near"]], [])
    assert ref is j["near"]
    assert why == ("no lossless job of the same rows at batch_size=4: compared with near at batch_size=2 (batching "
                   "alone may move a pixel by one level)")


# ---------------------------------------------------------------------------------------- accuracy


def test_accuracy_ratios_per_attribute():
    got = gate.accuracy_ratios({"color": 0.97, "shape": 0.4, "position": 0.0, "flag": True},
                               {**ACC, "flag": True, "note": "x"}, 0.97)
    assert got == {"color": {"lossy": 0.97, "lossless": 1.0, "ratio": 0.97, "pass": True},
                   "shape": {"lossy": 0.4, "lossless": 0.5, "ratio": 0.8, "pass": False},
                   "position": {"lossy": 0.0, "lossless": 0.0, "ratio": None, "pass": True}}


def test_accuracy_ratio_of_a_missing_attribute_is_zero_and_none_without_sections():
    assert gate.accuracy_ratios({"shape": "?"}, {"shape": 0.5}, 0.5) == {
        "shape": {"lossy": 0.0, "lossless": 0.5, "ratio": 0.0, "pass": False}}
    assert gate.accuracy_ratios(None, ACC, 0.97) is None
    assert gate.accuracy_ratios(ACC, {}, 0.97) is None
    assert gate.accuracy_ratios({"color": 0.96}, {"color": 1.0}, 0.96)["color"]["pass"] is True
    assert gate.accuracy_ratios({"color": 1}, {"color": 1}, 0.97)["color"] == {
        "lossy": 1.0, "lossless": 1.0, "ratio": 1.0, "pass": True}


def test_accuracy_ratio_is_rounded_to_four_digits():
    assert gate.accuracy_ratios({"c": 1.0}, {"c": 3.0}, 0.1)["c"]["ratio"] == 0.3333


# -------------------------------------------------------------------------------------- compare, psnr


def test_identical_artifacts_pass_with_infinite_psnr(tmp_path):
    j = jobs_of(job(tmp_path, "ref", acc=ACC), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], acc=ACC))
    e = gate.compare(j["lossy"], j["ref"])
    assert e["verdict"] == "pass" and e["reasons"] == []
    assert e["psnr_db"] == {"min": math.inf, "mean": math.inf}
    assert e["ssim"] == {"min": 1.0, "mean": 1.0}
    assert [i["key"] for i in e["items"]] == list(KEYS)
    assert e["lanes"] == ["fp8"] and e["lossy_job"] == "lossy" and e["lossless_job"] == "ref"
    assert e["min_ratio"] == gate.MIN_RATIO and e["cache_hit_rate"] is None


def test_psnr_floor_fails_a_noisy_lossy_job_and_names_the_items(tmp_path):
    j = jobs_of(job(tmp_path, "ref"), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], noise=60))
    e = gate.compare(j["lossy"], j["ref"])
    assert e["verdict"] == "unchecked" and e["reasons"] == []
    low = e["psnr_db"]["min"]
    assert math.isfinite(low) and 0 < e["ssim"]["min"] < 1
    assert e["psnr_db"]["mean"] == round(float(np.mean([i["psnr_db"] for i in e["items"]])), 3)
    assert e["ssim"]["mean"] == round(float(np.mean([i["ssim"] for i in e["items"]])), 5)
    assert e["psnr_db"]["min"] == min(i["psnr_db"] for i in e["items"])
    e = gate.compare(j["lossy"], j["ref"], min_psnr_db=low + 0.01)
    assert e["verdict"] == "fail" and any(r.startswith("a: PSNR") or r.startswith("b: PSNR") for r in e["reasons"])
    assert gate.compare(j["lossy"], j["ref"], min_psnr_db=low)["verdict"] == "pass"


def test_missing_and_not_comparable_items_are_noted_and_fail_under_a_psnr_floor(tmp_path):
    j = jobs_of(job(tmp_path, "ref"), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], keys=("a",)),
                job(tmp_path, "seeded", lossy=True, lanes=["fp8"], item_seed=5))
    e = gate.compare(j["lossy"], j["ref"])
    assert e["items"][1] == {"key": "b", "note": "missing in the lossy job"}
    assert e["verdict"] == "unchecked"
    e = gate.compare(j["lossy"], j["ref"], min_psnr_db=10)
    assert e["verdict"] == "fail" and e["reasons"] == ["b: missing in the lossy job"]
    e = gate.compare(j["seeded"], j["ref"])
    assert e["items"][0]["note"] == "not comparable (seed 1 vs 5)" and e["psnr_db"] is None and e["ssim"] is None


def test_a_shape_difference_is_an_item_error(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    _png(a, 10)
    Image.fromarray(np.zeros((8, 16, 3), dtype=np.uint8)).save(b)
    assert gate.item_metrics(a, b) == {"psnr_db": None, "ssim": None, "error": "shape (16, 16, 3) vs (8, 16, 3)"}


def test_accuracy_below_the_ratio_fails_naming_the_attribute(tmp_path):
    low = {**ACC, "shape": 0.25}
    j = jobs_of(job(tmp_path, "ref", acc=ACC), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], acc=low))
    e = gate.compare(j["lossy"], j["ref"])
    assert e["verdict"] == "fail"
    assert e["reasons"] == ["shape: accuracy 0.25 vs lossless 0.5 (ratio 0.5, needs >= 0.97)"]
    assert gate.compare(j["lossy"], j["ref"], min_ratio=0.5)["verdict"] == "pass"


# ------------------------------------------------------------------------------------------ evaluate


def test_evaluate_verdicts_of_each_kind_of_lossy_job(tmp_path):
    dirs = [job(tmp_path, "ref", acc=ACC), job(tmp_path, "ok", lossy=True, lanes=["fp8"], acc=ACC),
            job(tmp_path, "refused", lossy=True, lanes=["fp8"], status="refused", outcome="refused"),
            job(tmp_path, "crashed", lossy=True, lanes=["fp8"], status="failed", outcome="failed"),
            job(tmp_path, "other", lossy=True, lanes=["fp8"], seed=9),
            job(tmp_path, "failing_ref", status="failed", outcome="failed", seed=9)]
    doc = gate.evaluate(load_jobs(dirs))
    v = {e["lossy_job"]: e for e in doc["jobs"]}
    assert list(v) == ["ok", "refused", "crashed", "other"]
    assert v["ok"]["verdict"] == "pass" and v["ok"]["batch_size"] == {"lossy": 1, "lossless": 1}
    assert "note" not in v["ok"]
    assert v["refused"]["verdict"] == "skipped" and v["refused"]["reasons"] == [
        "the lossy job's outcome is refused"]
    assert v["crashed"]["verdict"] == "not_run"
    assert v["other"]["verdict"] == "unmatched" and "no lossless job of the same rows" in v["other"]["reasons"][0]
    assert doc["lossless_jobs"] == ["ref"]
    assert doc["verdict"] == "fail" and doc["exit_code"] == 1
    assert doc["min_ratio"] == gate.MIN_RATIO and doc["min_psnr_db"] is None


def test_evaluate_passes_and_notes_another_batch_size(tmp_path):
    dirs = [job(tmp_path, "ref", acc=ACC), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], acc=ACC, batch=2),
            job(tmp_path, "skip", lossy=True, lanes=["fp8"], status="refused", outcome="refused")]
    doc = gate.evaluate(load_jobs(dirs))
    assert doc["verdict"] == "pass" and doc["exit_code"] == 0
    e = doc["jobs"][0]
    assert e["batch_size"] == {"lossy": 2, "lossless": 1} and e["note"].startswith("no lossless job of the same")


def test_evaluate_unmatched_batch_dependent_and_no_lossy_job(tmp_path):
    dirs = [job(tmp_path, "ref"), job(tmp_path, "fb", lossy=True, lanes=["cache"], dependent=["first_block"],
                                      batch=2)]
    doc = gate.evaluate(load_jobs(dirs))
    assert doc["jobs"][0]["verdict"] == "unmatched" and "first_block makes" in doc["jobs"][0]["reasons"][0]
    assert doc["exit_code"] == 1
    none = gate.evaluate(load_jobs([job(tmp_path, "only")]))
    assert none["verdict"] == "none" and none["jobs"] == [] and none["exit_code"] == 0


# ------------------------------------------------------------------------------------------- the CLI


def test_min_ratio_from_the_command_line_decides_the_exit_code(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    job(sweep, "0", acc=ACC)
    job(sweep, "1", lossy=True, lanes=["fp8"], acc={**ACC, "color": 0.9})
    assert gate.main([str(sweep)]) == 1
    out = capsys.readouterr().out
    assert "FAIL      1 [fp8] · vs 0 · color 0.9/1 (ratio 0.9)" in out
    assert "color: accuracy 0.9 vs lossless 1 (ratio 0.9, needs >= 0.97)" in out
    first = json.loads((sweep / "gate.json").read_text())
    assert first["min_ratio"] == 0.97 and first["verdict"] == "fail"
    assert gate.main([str(sweep), "--min-ratio", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "PASS      1 [fp8]" in out and f"gate: pass -> {sweep / 'gate.cli.json'}" in out
    assert json.loads((sweep / "gate.cli.json").read_text())["min_ratio"] == 0.9
    assert json.loads((sweep / "gate.json").read_text()) == first, "a hand-run never replaces the sweep's gate.json"


def test_min_psnr_db_and_out_from_the_command_line(tmp_path, capsys):
    ref, noisy = job(tmp_path, "ref"), job(tmp_path, "noisy", lossy=True, lanes=["fp8"], noise=60)
    out = tmp_path / "g.json"
    assert gate.main([str(ref), str(noisy), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "UNCHECKED noisy [fp8] · vs ref · PSNR min" in text
    assert gate.main([str(ref), str(noisy), "--min-psnr-db", "1000", "--out", str(out)]) == 1
    assert json.loads(out.read_text())["min_psnr_db"] == 1000.0


def test_bad_dir_exits_2_and_no_lossy_job_says_so(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gate.main([str(empty)]) == 2
    assert "gate: RunDirError:" in capsys.readouterr().err
    assert gate.main([str(job(tmp_path, "plain"))]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "no lossy job: nothing to gate"


def test_default_out(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert gate.default_out([a]) == a / "gate.json"
    assert gate.default_out([a, b]) == Path("gate.json")
    (a / "gate.json").write_text("{}")
    assert gate.default_out([a]) == a / "gate.cli.json"
    monkeypatch.chdir(tmp_path)
    Path("gate.json").write_text("{}")
    assert gate.default_out([a, b]) == Path("gate.cli.json")


def test_line_shows_cache_hit_rate_and_notes():
    e = {"verdict": "pass", "lossy_job": "j", "lanes": ["cache"], "lossless_job": "r", "accuracy": None,
         "psnr_db": None, "cache_hit_rate": 0.5, "reasons": ["x"], "note": "n"}
    assert gate._line(e) == "PASS      j [cache] · vs r · cache hit rate 0.5\n          x\n          note: n"


def test_psnr_and_ssim_values_are_those_of_rgb_in_0_1(tmp_path):
    from runner.tools.report import load_rgb, ssim

    j = jobs_of(job(tmp_path, "ref"), job(tmp_path, "lossy", lossy=True, lanes=["fp8"], noise=60))
    e = gate.compare(j["lossy"], j["ref"])
    for it in e["items"]:
        x = load_rgb(j["lossy"].image_path(it["key"])).astype(np.float64) / 255
        y = load_rgb(j["ref"].image_path(it["key"])).astype(np.float64) / 255
        assert it["psnr_db"] == pytest.approx(10 * math.log10(1 / np.mean((x - y) ** 2)), abs=1e-3)
        assert isinstance(it["psnr_db"], float) and round(it["psnr_db"], 3) == it["psnr_db"]
        assert round(it["ssim"], 5) == it["ssim"]
        assert it["ssim"] == round(ssim(load_rgb(j["lossy"].image_path(it["key"])),
                                        load_rgb(j["ref"].image_path(it["key"]))), 5)


def test_help_names_every_option_and_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as e:
        gate.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: python -m runner.gate [-h] [--min-ratio MIN_RATIO] [--min-psnr-db MIN_PSNR_DB] "
                          "[--min-metric-ratio NAME=R[,NAME=R]] [--out OUT] dirs [dirs ...]")
    for text in ("[dirs ...] Compare each lossy job with the lossless job of the same rows. positional arguments:",
                 "dirs sweep dirs (holding job dirs) or run dirs",
                 "--min-ratio MIN_RATIO lossy / lossless oracle accuracy floor per attribute (default 0.97)",
                 "--min-psnr-db MIN_PSNR_DB also fail items below this PSNR (dB)",
                 "--min-metric-ratio NAME=R[,NAME=R] lossy / lossless mean per-item metric floor, e.g. "
                 "clip_score=0.99 (runner.score first)",
                 "--out OUT output path, overwritten if it exists (default: gate.json in the single dir given, else "
                 "./gate.json; where that file exists already, e.g. the sweep's own, gate.cli.json beside it)"):
        assert text in out, text


def test_rows_identity_reads_weight_files_kind_and_path(tmp_path):
    def with_source(name, source):
        d = job(tmp_path, name)
        m = json.loads((d / "manifest.json").read_text())
        m["model"]["source"] = source
        (d / "manifest.json").write_text(json.dumps(m))
        return d

    base = {"kind": "embedded", "path": "/w", "weights_seed": 0}
    j = jobs_of(with_source("f1", {**base, "files": {"a": "1"}}), with_source("f2", {**base, "files": {"a": "2"}}),
                with_source("kind", {**base, "kind": "hub"}), with_source("path", {**base, "path": "/v"}),
                with_source("base", base))
    ids = {k: gate.rows_identity(v) for k, v in j.items()}
    assert len(set(ids.values())) == 5, ids


def test_rows_identity_is_independent_of_the_key_order_of_recorded_dicts(tmp_path):
    a, b = job(tmp_path, "a"), job(tmp_path, "b")
    m = json.loads((b / "manifest.json").read_text())
    m["config"]["model"]["generation"] = {"height": 16, "width": 16}
    (b / "manifest.json").write_text(json.dumps(m))
    m = json.loads((a / "manifest.json").read_text())
    m["config"]["model"]["generation"] = {"width": 16, "height": 16}
    (a / "manifest.json").write_text(json.dumps(m))
    j = jobs_of(a, b)
    assert gate.rows_identity(j["a"]) == gate.rows_identity(j["b"])


def test_compare_records_paths_cache_hit_rate_and_every_reason(tmp_path):
    ref = job(tmp_path, "ref", acc=ACC)
    lossy = job(tmp_path, "lossy", lossy=True, lanes=["cache", "fp8"], acc={**ACC, "color": 0.5}, noise=60)
    m = json.loads((lossy / "manifest.json").read_text())
    m["evidence"] = {"stages": {"denoise": {"cache": {"forwards_hit_rate": 0.375}}}}
    (lossy / "manifest.json").write_text(json.dumps(m))
    j = jobs_of(ref, lossy)
    e = gate.compare(j["lossy"], j["ref"], min_psnr_db=1000)
    assert e["lossy_path"] == str(lossy) and e["lossless_path"] == str(ref)
    assert e["cache_hit_rate"] == 0.375
    assert e["reasons"][0] == "color: accuracy 0.5 vs lossless 1 (ratio 0.5, needs >= 0.97)"
    assert len(e["reasons"]) == 3 and all(": PSNR " in r for r in e["reasons"][1:])
    assert gate._line(e).splitlines()[0] == (
        f"FAIL      lossy [cache, fp8] · vs ref · color 0.5/1 (ratio 0.5) shape 0.5/0.5 (ratio 1.0) position 0/0 "
        f"(ratio None) · PSNR min {e['psnr_db']['min']} dB, SSIM min {e['ssim']['min']} · cache hit rate 0.375")


def test_evaluate_goes_on_after_an_unmatched_or_unpaired_job(tmp_path):
    dirs = [job(tmp_path, "ref", acc=ACC),
            job(tmp_path, "other", lossy=True, lanes=["fp8"], seed=9),
            job(tmp_path, "fb", lossy=True, lanes=["cache"], dependent=["a", "b"], batch=2),
            job(tmp_path, "ok", lossy=True, lanes=["fp8"], acc=ACC),
            job(tmp_path, "bad", lossy=True, lanes=["fp8"], status="failed", outcome="failed")]
    doc = gate.evaluate(load_jobs(dirs))
    v = {e["lossy_job"]: e for e in doc["jobs"]}
    assert list(v) == ["other", "fb", "ok", "bad"]
    assert v["other"] == {"lossy_job": "other", "lossy_path": str(dirs[1]), "lanes": ["fp8"], "verdict": "unmatched",
                          "reasons": ["no lossless job of the same rows (model weights, dataset, limit, seed, "
                                      "generation, dtype); fix: add one to the sweep (e.g. cache.method=none, "
                                      "backend.linear=TORCH) or pass its run dir"]}
    assert v["fb"]["verdict"] == "unmatched" and v["fb"]["reasons"][0].startswith("a, b makes each item depend")
    assert v["fb"]["lossy_path"] == str(dirs[2]) and v["fb"]["lanes"] == ["cache"]
    assert v["ok"]["verdict"] == "pass"
    assert v["bad"] == {"lossy_job": "bad", "lossy_path": str(dirs[4]), "lanes": ["fp8"], "verdict": "not_run",
                        "reasons": ["the lossy job's outcome is failed"]}
    assert doc["metrics"] == ("torchmetrics peak_signal_noise_ratio / structural_similarity_index_measure "
                              "(data_range 1)")


def _mp4(path: Path, value: int, noise: int = 0) -> None:
    from runner.core import video

    frames = np.full((3, 16, 16, 3), value, np.uint8)
    if noise:
        frames[:, ::2, ::2] = np.clip(int(value) + noise, 0, 255)
    path.parent.mkdir(parents=True, exist_ok=True)
    video.write_video(path, frames, 8.0, "h264_lossless")


def test_videos_are_compared_over_their_decoded_frames(tmp_path):
    from runner.tools.report import load_frames, ssim

    a, b, c = tmp_path / "a.mp4", tmp_path / "b.mp4", tmp_path / "c.png"
    _mp4(a, 40)
    _mp4(b, 40, noise=60)
    assert gate.item_metrics(a, a) == {"psnr_db": math.inf, "ssim": 1.0}
    got = gate.item_metrics(b, a)
    x, y = (load_frames(p).astype(np.float64) / 255 for p in (b, a))
    assert got["psnr_db"] == pytest.approx(10 * math.log10(1 / np.mean((x - y) ** 2)), abs=1e-3)
    assert got["ssim"] == round(ssim(load_frames(b), load_frames(a)), 5)
    _png(c, 40)
    # one MP4 of the pair: both are decoded as videos (an image is one frame)
    assert gate.item_metrics(a, c)["error"] == "shape (3, 16, 16, 3) vs (1, 16, 16, 3)"
    assert gate.item_metrics(c, a)["error"] == "shape (1, 16, 16, 3) vs (3, 16, 16, 3)"


def test_psnr_and_ssim_means_over_items_of_different_quality(tmp_path):
    ref = job(tmp_path, "ref")
    lossy = job(tmp_path, "lossy", lossy=True, lanes=["fp8"], noise=60)
    _png(lossy / "images" / "b.png", 80, noise=23)  # a mean of 4 decimals (22.7525)
    j = jobs_of(ref, lossy)
    e = gate.compare(j["lossy"], j["ref"])
    psnr = [i["psnr_db"] for i in e["items"]]
    ssim = [i["ssim"] for i in e["items"]]
    assert psnr[0] != psnr[1] and ssim[0] != ssim[1]
    assert e["psnr_db"] == {"min": min(psnr), "mean": round(float(np.mean(psnr)), 3)}
    assert e["ssim"] == {"min": min(ssim), "mean": round(float(np.mean(ssim)), 5)}
