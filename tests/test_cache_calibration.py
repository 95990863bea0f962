"""Issue #33 (part B): MagCache with ratios calibrated for the model (``cache.calibrate=true``: diffusers' calibration
pass before the first batch, stored under the cache dir and loaded by later runs), cache-dit's DBCache (with and
without its TaylorSeer calibrator) counted by the same probe and cross-checked against cache-dit's own statistics,
and PAB with one state per CFG branch. Real diffusers / cache-dit hooks on the trained toy_shapes and toy_motion."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from _helpers import execute
from runner.core.errors import RunnerError
from _helpers import requires_extra  # noqa: E402

ROWS = 6
STEPS = 16


def _run(path, overrides, limit=ROWS, catch=(), model="toy_shapes"):
    return execute(path, [f"model={model}", f"dataset.limit={limit}", *overrides], catch=catch)


MAG = ["cache.method=magcache", "cache.calibrate=true"]


@pytest.fixture(scope="module")
def mag_runs(tmp_path_factory):
    """A lossless run, then two calibrated magcache runs sharing one cache dir: the first calibrates, the second
    loads."""
    root = tmp_path_factory.mktemp("mag")
    cache = [f"cache_dir={root / 'cache'}"]
    runs = {"lossless": _run(root / "lossless", cache),
            "first": _run(root / "first", [*MAG, *cache]),
            "second": _run(root / "second", [*MAG, *cache])}
    assert all(r.code == 0 for r in runs.values()), {k: r.manifest.get("evidence") for k, r in runs.items()}
    return root, runs


def test_calibration_pass_is_stored_then_loaded(mag_runs):
    root, runs = mag_runs
    first = runs["first"].manifest["evidence"]["stages"]["denoise"]["cache"]
    second = runs["second"].manifest["evidence"]["stages"]["denoise"]["cache"]
    a, b = first["calibration"][str(STEPS)], second["calibration"][str(STEPS)]
    assert a["source"] == "calibrated" and b["source"] == "loaded"
    path = root / "cache" / "magcache" / f"{a['key']}.json"
    assert a["file"] == b["file"] == str(path) and path.is_file()
    assert a["sha256"] == b["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    doc = json.loads(path.read_text())
    assert doc["ratios"] == a["ratios"] == b["ratios"] and len(doc["ratios"]) == STEPS
    assert doc["ratios"][0] == 1.0 and len(set(doc["ratios"])) > 2  # diffusers' first step is 1.0, then measured
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS, nearest_interp

    flux = [round(float(x), 6) for x in nearest_interp(FLUX_MAG_RATIOS, STEPS)]
    assert doc["ratios"] != flux  # the model's own, not FLUX.1's
    assert doc["calibration"]["items"] == [runs["first"].items[0]["key"]]  # the first batch (batch_size 1)
    # the pass computed every step, as the probe observed, and none of it is in the run's counts
    assert a["observed"] == {"forwards_computed": STEPS, "forwards_reused": 0, "blocks_computed": STEPS * 5,
                             "blocks_reused": 0}
    for r in (runs["first"], runs["second"]):
        den = r.manifest["evidence"]["stages"]["denoise"]
        assert den["cache"]["forwards_computed"] + den["cache"]["forwards_reused"] == ROWS * STEPS
        assert den["denoiser_forwards"] == den["expected_forwards"] == ROWS * STEPS
        assert r.manifest["evidence"]["verdict"] == "verified", r.manifest["evidence"]["mismatches"]
        assert all(rec["cache"]["calibration"] == {"sha256": a["sha256"], "source": den["cache"]["calibration"][
            str(STEPS)]["source"]} for rec in r.items)
        assert r.manifest["cache"]["calibration"][str(STEPS)]["sha256"] == a["sha256"]
    assert first["forwards_reused"] == second["forwards_reused"] > 0  # same ratios, same decisions


def test_calibrated_magcache_passes_the_gate(mag_runs):
    from runner.tools import gate

    root, runs = mag_runs
    doc = gate.write_gate([runs["lossless"].run_dir, runs["second"].run_dir], root / "gate.json")
    job = doc["jobs"][0]
    assert doc["verdict"] == "pass" and job["verdict"] == "pass", job
    assert all(a["ratio"] >= 0.97 for a in job["accuracy"].values())


def test_calibration_is_keyed_by_steps_and_a_bad_file_is_refused(mag_runs, tmp_path):
    from models.cache_calibration import CalibrationError, RatioStore

    root, runs = mag_runs
    rec = runs["first"].manifest["evidence"]["stages"]["denoise"]["cache"]["calibration"][str(STEPS)]
    fields = json.loads((root / "cache" / "magcache" / f"{rec['key']}.json").read_text())["fields"]
    store = RatioStore(tmp_path, fields)
    assert store.key(STEPS) == rec["key"] and store.key(8) != rec["key"]
    assert RatioStore(tmp_path, {**fields, "dtype": "bfloat16"}).key(STEPS) != rec["key"]
    assert store.load(STEPS) is None
    store.path(STEPS).write_text(json.dumps({"fields": fields, "num_inference_steps": STEPS, "ratios": [1.0] * 3}))
    with pytest.raises(CalibrationError, match="delete it"):
        store.load(STEPS)
    # through a run: the same refusal, naming the file, and no item generated
    bad = tmp_path / "cache"
    (bad / "magcache").mkdir(parents=True)
    (bad / "magcache" / f"{rec['key']}.json").write_text("{not json")
    r = _run(tmp_path / "run", [*MAG, f"cache_dir={bad}"], limit=1, catch=(RunnerError,))
    assert type(r.error).__name__ == "CalibrationError" and r.error.exit_code == 2, r.error
    assert rec["key"] in str(r.error) and "fix: delete it" in str(r.error)


BAD = [
    (["cache.method=magcache", "cache.calibrate=true", "cache.mag_ratios=flux"],
     ["cache.mag_ratios='flux' is set together with cache.calibrate=true", "fix:"]),
    (["cache.method=magcache"], ["cache.calibrate=true", "cache.mag_ratios=flux"]),
    (["cache.method=first_block", "cache.calibrate=true"], ["cache.calibrate=True is not read by cache.method=first_block"]),
    (["cache.method=dbcache", "cache.fn_compute_blocks=0"], ["cache.fn_compute_blocks=0", ">= 1"]),
    (["cache.method=dbcache", "compile=regional"], ["compile=regional"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_calibration_or_dbcache_config_is_refused_before_loading(tmp_path, overrides, words):
    r = _run(tmp_path / "run", overrides, limit=1, catch=(RunnerError,))
    assert type(r.error).__name__ == "CacheConfigError" and r.error.exit_code == 2, r.error
    for w in words:
        assert w in str(r.error), str(r.error)
    assert not (tmp_path / "run" / "manifest.json").exists()


# ------------------------------------------------------------------------------------------------ cache-dit
DB = ["cache.fn_compute_blocks=1", "cache.warmup_steps=4"]


@requires_extra("cache-dit")
@pytest.mark.parametrize("method", ["dbcache", "dbcache_taylorseer"])
def test_cache_dit_reuse_is_observed_and_agrees_with_its_own_statistics(tmp_path, method):
    from diffusers import FluxPipeline

    original = FluxPipeline.__call__
    r = _run(tmp_path / method, [f"cache.method={method}", *DB], limit=2)
    assert r.code == 0, r.manifest.get("evidence")
    assert FluxPipeline.__call__ is original  # cache-dit patches the class's __call__: undone at close
    ev = r.manifest["evidence"]
    assert ev["verdict"] == "verified", ev["mismatches"]
    sec = ev["stages"]["denoise"]["cache"]
    assert sec["forwards_reused"] > 0 and sec["library_reported_reused"] == sec["forwards_reused"]
    for rec in r.items:
        c = rec["cache"]
        assert c["forwards_computed"] + c["forwards_reused"] == STEPS
        assert c["forwards_computed"] >= 4  # cache-dit's warm-up steps always compute
        # fn_compute_blocks=1: the first block always computes, so at most 4 of 5 blocks are reused per forward
        assert c["blocks_computed"] >= STEPS and c["blocks_reused"] <= 4 * c["forwards_reused"]
    assert all(lay["ok"] for lay in ev["stages"]["denoise"]["attention"]["layers"])
    assert r.manifest["lossy"]["batch_dependent"] == [f"cache={method}"]  # adaptive: decided per batch


@requires_extra("cache-dit")
def test_cache_dit_statistics_that_disagree_with_the_probe_are_a_mismatch(tmp_path):
    from models.cache import method_of, register_cache_method, unregister_cache_method
    from runner.core.errors import EvidenceError

    lying = dataclasses.replace(method_of("dbcache"), name="dbcache_lying", aliases=(),
                                reported_reused=lambda pipe: 0)
    register_cache_method(lying)
    try:
        r = _run(tmp_path / "run", ["cache.method=dbcache_lying", *DB], limit=1, catch=(EvidenceError,))
    finally:
        unregister_cache_method("dbcache_lying")
    assert isinstance(r.error, EvidenceError) and r.error.exit_code == 3
    assert any("dbcache_lying reports 0 forwards reused, the probe observed" in m
               for m in r.manifest["evidence"]["mismatches"])


@requires_extra("cache-dit")
def test_cache_dit_refuses_a_pipeline_without_its_block_adapter():
    from models.cache import CacheSettings, CacheUnsupportedError, check_support, method_of

    m = method_of("dbcache")
    s = CacheSettings(method=m, schedule=m.schedule, params=dict(m.defaults))
    check_support(s, "FluxTransformer2DModel", "toy_shapes", "FluxPipeline")
    with pytest.raises(CacheUnsupportedError, match="no block adapter for NoSuchPipeline"):
        check_support(s, "X", "m", "NoSuchPipeline")


# ------------------------------------------------------------------------------------------------ PAB with CFG
def test_pab_keeps_one_state_per_cfg_branch(tmp_path):
    """toy_motion makes two forwards per step (cond, uncond). With one state per branch each follows PAB's rule on
    its own (compute_every=2, warmup 1: steps 0, 2, ..., 14 computed, 8 reused per branch: 16 forwards). diffusers'
    PAB as shipped keeps one state for both: its counter sees cond and uncond calls alternate, so every cond
    forward computes and every uncond forward after step 0 reuses the attention the cond forward just produced
    (15 forwards), which the schedule's evidence catches."""
    from models.cache import method_of, register_cache_method, unregister_cache_method
    from runner.core.errors import EvidenceError

    assert sum(1 for s in range(STEPS) if not (s < 1 or s % 2 == 0)) == 8
    r = _run(tmp_path / "run", ["cache.method=pab"], limit=1, model="toy_motion")
    assert r.code == 0, r.manifest.get("evidence")
    c = r.items[0]["cache"]
    assert (c["forwards_reused"], c["forwards_computed"]) == (2 * 8, 2 * 8), c
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert sec["expected_forwards_reused"] == sec["forwards_reused"] == 16
    assert r.manifest["evidence"]["verdict"] == "verified", r.manifest["evidence"]["mismatches"]

    register_cache_method(dataclasses.replace(method_of("pab"), name="pab_shared", aliases=(), after_apply=None))
    try:
        r = _run(tmp_path / "shared", ["cache.method=pab_shared"], limit=1, model="toy_motion",
                 catch=(EvidenceError,))
    finally:
        unregister_cache_method("pab_shared")
    assert isinstance(r.error, EvidenceError) and r.items[0]["cache"]["forwards_reused"] == 15


def test_calibration_under_regional_compile(tmp_path):
    """With compile=regional the calibration pass runs after the compile warm-up, around the compiled blocks: it
    compiles nothing more, is kept out of compile.warmup_s and of the counts, and computed every step."""
    r = _run(tmp_path / "c", [*MAG, "compile=regional", f"cache_dir={tmp_path / 'cache'}"], limit=1)
    m = r.manifest
    assert r.code == 0 and m["evidence"]["verdict"] == "verified", m["evidence"]["mismatches"]
    assert m["compile"]["graphs_compiled_after_warmup"] == 0
    cal = m["evidence"]["stages"]["denoise"]["cache"]["calibration"][str(STEPS)]
    assert cal["source"] == "calibrated" and cal["observed"]["forwards_reused"] == 0
    assert cal["observed"]["forwards_computed"] == STEPS
    sec = m["evidence"]["stages"]["denoise"]["cache"]
    assert sec["forwards_computed"] + sec["forwards_reused"] == STEPS
    assert m["timing"]["warmup_s"] >= m["compile"]["warmup_s"] + cal["seconds"] - 0.01
