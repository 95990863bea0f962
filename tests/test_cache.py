"""Step caching (issue #18): every method runs on the trained toy_shapes with its reuse counted per item from what
executed; bad cache parameters and unsupported models are refused before loading; a cache that never hits is an
evidence mismatch; lossy runs are labelled; the quality gate passes a working cache and fails a deliberately broken
one (a cache that returns the first step's block outputs for every step)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from _helpers import compose, execute, stale_output_hook
from runner.core.errors import RunnerError

ROWS = 6  # toy_shapes builtin rows for the gate (lossless accuracy 1.0 on these)
METHODS = {  # method -> overrides (fixed methods: their schedule; adaptive: a threshold that hits on toy_shapes)
    "first_block": ["cache.method=first_block", "cache.threshold=0.2"],
    "magcache": ["cache.method=magcache", "cache.mag_ratios=flux"],
    "taylorseer": ["cache.method=taylorseer", "cache.compute_every=2", "cache.warmup_steps=3"],
    "pab": ["cache.method=pab", "cache.compute_every=2"],
}


def _run(path, overrides, limit=ROWS, catch=()):
    return execute(path, ["model=toy_shapes", f"dataset.limit={limit}", *overrides], catch=catch)


@pytest.mark.parametrize("method", list(METHODS))
def test_each_method_records_observed_reuse(tmp_path, method):
    r = _run(tmp_path / method, METHODS[method], limit=2)
    assert r.code == 0, r.manifest.get("evidence")
    m = r.manifest
    ev = m["evidence"]
    assert ev["verdict"] == "verified", ev["mismatches"]
    for rec in r.items:
        c = rec["cache"]
        assert c["method"] == method and c["call_items"] == 1
        assert c["forwards_computed"] + c["forwards_reused"] == rec["params"]["num_inference_steps"] == 16
        assert c["forwards_reused"] > 0 and c["blocks_reused"] > 0 and c["blocks_computed"] > 0, c
        assert c["blocks_computed"] + c["blocks_reused"] == 16 * 5  # toy_shapes: 2 double + 3 single blocks
    sec = ev["stages"]["denoise"]["cache"]
    assert sec["forwards_reused"] == sum(rec["cache"]["forwards_reused"] for rec in r.items)
    assert 0 < sec["forwards_hit_rate"] < 1 and sec["calls"] == 2
    assert ev["stages"]["denoise"]["denoiser_forwards"] == ev["stages"]["denoise"]["expected_forwards"] == 32
    if sec["schedule"] == "fixed":  # the schedule's own rule predicts the reuse that was observed
        assert sec["expected_forwards_reused"] == sec["forwards_reused"]
    # attention sites of reused attention modules ran their backend fewer times than there were forwards
    layers = ev["stages"]["denoise"]["attention"]["layers"]
    assert all(lay["ok"] for lay in layers)
    if method in ("taylorseer", "pab"):
        assert all(lay["calls"] < 32 for lay in layers), layers
    assert m["lossy"] == {"lossy": True, "lanes": [f"cache={method}"],  # an adaptive cache depends on its batch
                          "batch_dependent": [f"cache={method}"] if sec["schedule"] == "adaptive" else []}
    assert m["cache"]["method"] == method and m["cache"]["lossy"] is True


def test_no_cache_keeps_records_identity_and_label(tmp_path):
    from runner.core import resume

    r = _run(tmp_path / "plain", [], limit=1)
    assert r.code == 0 and "cache" not in r.items[0] and "cache" not in r.manifest["evidence"]["stages"]["denoise"]
    assert r.manifest["lossy"] == {"lossy": False, "lanes": [], "batch_dependent": []}
    cfg = r.manifest["config"]
    assert "cache" not in r.manifest["identity"]["config"]  # identities of runs without a cache are unchanged
    old = {k: v for k, v in cfg.items() if k != "cache"}  # a manifest written before the section existed
    assert resume.semantic_diff(old, cfg, None, "x") == []
    on = {**cfg, "cache": {**cfg["cache"], "method": "taylorseer"}}
    assert resume.semantic_diff(cfg, on, None, "x") and resume.cache_config(on)["method"] == "taylorseer"


BAD = [  # (overrides, error class name, words the message must hold)
    (["cache.method=taylorsear"], "CacheConfigError", ["cache.method='taylorsear'", "did you mean 'taylorseer'"]),
    (["cache.method=first_block", "cache.compute_every=2"], "CacheConfigError",
     ["cache.compute_every=2 is not read by cache.method=first_block", "fix:"]),
    (["cache.method=taylorseer", "cache.compute_every=1"], "CacheConfigError",
     ["cache.compute_every=1", ">= 2", "fix: cache.compute_every=2"]),
    (["cache.method=first_block", "cache.threshold=-1"], "CacheConfigError", ["cache.threshold=-1", "> 0"]),
    (["cache.method=first_block", "cache.schedule=fixed"], "CacheConfigError",
     ["cache.schedule=fixed is not available for cache.method=first_block", "taylorseer"]),
    (["cache.method=magcache"], "CacheConfigError", ["cache.mag_ratios=None is required", "cache.mag_ratios=flux"]),
    (["cache.method=taylorseer", "cache.order=7"], "CacheConfigError", ["cache.order=7", "0..3"]),
    (["cache.method=taylorseer", "compile=regional"], "CacheConfigError", ["compile=regional", "compile=none"]),
    (["cache.compute_every=2"], "CacheConfigError", ["cache.compute_every=2 is set, but cache.method=none"]),
]


@pytest.mark.parametrize("overrides,cls,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_cache_config_is_refused_before_loading(tmp_path, overrides, cls, words):
    r = _run(tmp_path / "run", overrides, limit=1, catch=(RunnerError,))
    assert r.error is not None and type(r.error).__name__ == cls, r.error
    assert r.error.exit_code == 2
    for w in words:
        assert w in str(r.error), str(r.error)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_model_without_cache_support_is_refused_before_loading(tmp_path):
    r = execute(tmp_path / "sd3", ["model=tiny_sd3", "cache.method=taylorseer", "dataset.limit=1"],
                catch=(RunnerError,))
    assert type(r.error).__name__ == "CacheUnsupportedError", r.error
    assert "SD3Transformer2DModel" in str(r.error) and "CacheMixin" in str(r.error) and "fix:" in str(r.error)
    assert r.error.outcome == "refused" and not (tmp_path / "sd3" / "manifest.json").exists()


def test_pab_with_true_cfg_rows_runs_per_branch(tmp_path):
    """True CFG (two forwards per step): pab keeps one state per branch (issue #33; it was refused before), each
    branch following the schedule: compute_every=2, warmup 1, 16 steps: 8 reused per branch."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "a red circle in the center on a white background",
                                "negative_prompt": "blue"}) + "\n")
    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset=jsonl", f"dataset.path={rows}",
                                   "model.generation.true_cfg_scale=4", "cache.method=pab"])
    assert r.code == 0, r.manifest.get("evidence")
    c = r.items[0]["cache"]
    assert (c["forwards_reused"], c["forwards_computed"]) == (16, 16), c
    assert r.manifest["evidence"]["stages"]["denoise"]["cache"]["expected_forwards_reused"] == 16


def test_cache_that_never_hits_is_an_evidence_mismatch(tmp_path):
    from runner.core.errors import EvidenceError

    r = _run(tmp_path / "run", ["cache.method=first_block", "cache.threshold=1e-9"], limit=1, catch=(EvidenceError,))
    assert isinstance(r.error, EvidenceError) and r.error.exit_code == 3
    m = r.manifest
    assert m["status"] == "evidence_mismatch" and (tmp_path / "run" / "images").is_dir()
    assert any("the cache never hit" in x and "cache.threshold" in x for x in m["evidence"]["mismatches"])
    assert m["evidence"]["stages"]["denoise"]["cache"]["forwards_reused"] == 0


# ------------------------------------------------------------------------------------------------ the quality gate
def _stale_method(name, forever):
    """A deliberately broken cache: every transformer block returns the output of its first call for every later
    step. ``forever``: its state is never reset (not a stateful diffusers hook), so every later pipeline call, of any
    row, gets the first row's step-0 outputs too; else it is reset per call (each image is then its own one-step
    Euler sample: blurred, but its shapes right, so the oracle still reads it)."""
    from diffusers.hooks import HookRegistry

    from models.cache import CacheMethod

    Stale = stale_output_hook(stateful=not forever)

    def blocks(t):
        return [b for _, c in t.named_children() if isinstance(c, torch.nn.ModuleList) for b in c]

    def apply(t, config):
        for b in blocks(t):
            HookRegistry.check_if_exists_or_initialize(b).register_hook(Stale(), name)

    def remove(t):
        for b in blocks(t):
            HookRegistry.check_if_exists_or_initialize(b).remove_hook(name, recurse=False)

    # forever: from the 2nd call on every forward reuses, which the schedule does not predict (not declared)
    return CacheMethod(name, "fixed", (), {}, build=lambda p, steps, probe: None, apply=apply, remove=remove,
                       reused_steps=None if forever else (lambda p, steps: steps - 1))


@pytest.fixture(scope="module")
def gate_runs(tmp_path_factory):
    from models.cache import register_cache_method, unregister_cache_method

    root = tmp_path_factory.mktemp("gate")
    register_cache_method(_stale_method("stale", forever=True))
    register_cache_method(_stale_method("stale_per_call", forever=False))
    try:
        runs = {name: _run(root / name, ov) for name, ov in (
            ("lossless", []), ("taylorseer", METHODS["taylorseer"]), ("stale", ["cache.method=stale"]),
            ("stale_per_call", ["cache.method=stale_per_call"]))}
    finally:
        unregister_cache_method("stale")
        unregister_cache_method("stale_per_call")
    assert all(r.code == 0 for r in runs.values()), {k: r.manifest.get("evidence") for k, r in runs.items()}
    return root, runs


def test_gate_passes_a_working_cache_and_fails_a_stale_one(gate_runs, capsys):
    from runner.tools import gate

    root, runs = gate_runs
    stale = runs["stale"].manifest
    assert stale["lossy"] == {"lossy": True, "lanes": ["cache=stale"], "batch_dependent": []}  # a fixed schedule
    assert stale["evidence"]["verdict"] == "verified"  # it ran as configured: only the oracle can tell
    assert stale["evidence"]["stages"]["denoise"]["cache"]["forwards_reused"] == ROWS * 16 - 1

    dirs = [runs[k].run_dir for k in ("lossless", "taylorseer", "stale")]
    code = gate.main([*map(str, dirs), "--out", str(root / "gate.json")])
    out = capsys.readouterr().out
    doc = json.loads((root / "gate.json").read_text())
    assert code == 1 and doc["verdict"] == "fail" and doc["exit_code"] == 1, out
    by = {e["lossy_job"]: e for e in doc["jobs"]}
    good, bad = by["taylorseer"], by["stale"]
    assert good["lossless_job"] == bad["lossless_job"] == "lossless"
    assert good["verdict"] == "pass" and all(a["ratio"] >= 0.97 for a in good["accuracy"].values()), good
    assert bad["verdict"] == "fail" and any(a["ratio"] is not None and a["ratio"] < 0.97
                                            for a in bad["accuracy"].values()), bad
    assert good["psnr_db"]["min"] > bad["psnr_db"]["min"] and len(good["items"]) == ROWS
    assert all(0 < i["ssim"] <= 1 for i in good["items"])
    assert "FAIL" in out and "PASS" in out
    ratio = next(iter(good["accuracy"]))  # each attribute's line shows lossy/lossless and the ratio
    assert re.search(rf"{ratio} [\d.]+/[\d.]+ \(ratio {good['accuracy'][ratio]['ratio']}\)", out), out

    # the lossless job alone with the good one passes (exit 0); a lossy job without its lossless job fails
    assert gate.main([str(runs["lossless"].run_dir), str(runs["taylorseer"].run_dir), "--out",
                      str(root / "g2.json")]) == 0
    assert gate.main([str(runs["taylorseer"].run_dir), "--out", str(root / "g3.json")]) == 1
    assert json.loads((root / "g3.json").read_text())["jobs"][0]["verdict"] == "unmatched"


def test_gate_psnr_floor_catches_what_the_oracle_does_not(gate_runs):
    """A cache stale within each call keeps toy_shapes' shapes (the oracle reads 1.0) but not the pixels: the
    accuracy gate passes it, a PSNR floor fails it while the working cache stays above."""
    from runner.tools import gate
    from runner.tools.report import load_jobs

    root, runs = gate_runs
    jobs = load_jobs([runs[k].run_dir for k in ("lossless", "taylorseer", "stale_per_call")])
    assert runs["stale_per_call"].manifest["evidence"]["stages"]["denoise"]["cache"]["forwards_reused"] == ROWS * 15
    by = {e["lossy_job"]: e for e in gate.evaluate(jobs)["jobs"]}
    assert by["stale_per_call"]["verdict"] == "pass"  # the oracle alone cannot tell
    floor = by["taylorseer"]["psnr_db"]["min"] - 1
    assert by["stale_per_call"]["psnr_db"]["min"] < floor
    doc = gate.evaluate(jobs, min_psnr_db=floor)
    by = {e["lossy_job"]: e for e in doc["jobs"]}
    assert by["stale_per_call"]["verdict"] == "fail" and by["taylorseer"]["verdict"] == "pass"
    assert doc["exit_code"] == 1 and any("PSNR" in r for r in by["stale_per_call"]["reasons"])


def test_report_labels_lossy_jobs_and_shows_the_gate(gate_runs, tmp_path):
    from runner.tools import gate
    from runner.tools.report import write_report

    root, runs = gate_runs
    dirs = [runs[k].run_dir for k in ("lossless", "taylorseer", "stale")]
    doc = gate.write_gate(dirs, tmp_path / "gate.json")
    html = write_report(dirs, tmp_path / "report.html", gate=doc).read_text()
    assert "Quality gate of lossy jobs" in html and "cache=stale" in html and "cache=taylorseer" in html
    assert html.count(">lossy<") == 2  # the two cached jobs carry the label, the lossless one does not
    gate_html = html[html.index("Quality gate of lossy jobs"):html.index("<h2>Parity")]
    assert ">fail<" in gate_html and ">pass<" in gate_html


@pytest.fixture(scope="module")
def batch_runs(tmp_path_factory):
    """toy_shapes at batch 1 and 4, lossless and with the adaptive first_block cache; taylorseer (fixed) at 4."""
    root = tmp_path_factory.mktemp("batch")
    runs = {name: _run(root / name, ov) for name, ov in (
        ("lossless_b1", ["batch_size=1"]), ("lossless_b4", ["batch_size=4"]),
        ("first_block_b1", ["batch_size=1", *METHODS["first_block"]]),
        ("first_block_b4", ["batch_size=4", *METHODS["first_block"]]),
        ("taylorseer_b4", ["batch_size=4", *METHODS["taylorseer"]]))}
    assert all(r.code == 0 for r in runs.values()), {k: r.manifest.get("evidence") for k, r in runs.items()}
    return root, runs


def _max_diff(a, b) -> int:
    import numpy as np
    from PIL import Image

    return max(int(np.abs(np.asarray(Image.open(x), np.int16) - np.asarray(Image.open(y), np.int16)).max())
               for x, y in zip(sorted((a / "images").glob("*.png")), sorted((b / "images").glob("*.png"))))


def test_an_adaptive_cache_is_a_batch_dependent_lane_and_is_gated_at_its_batch_size(batch_runs):
    """Issue 29: an adaptive step cache decides per pipeline call from the whole batch, so an image depends on its
    batch peers (first_block at batch 1 vs 4 differs by far more than the lossless pair, which differs by at most
    one level). The manifest's ``lossy.batch_dependent`` says so (a fixed schedule is not), and the gate compares
    such a job only with the lossless job of its batch size: unmatched without one, naming the sizes; a fixed lane
    falls back to another batch size with a note."""
    from runner.tools import gate
    from runner.tools.report import load_jobs

    root, runs = batch_runs
    d = {k: r.run_dir for k, r in runs.items()}
    assert _max_diff(d["lossless_b1"], d["lossless_b4"]) <= 1
    assert _max_diff(d["first_block_b1"], d["first_block_b4"]) > 1  # the peers change the cache's decisions
    assert runs["first_block_b4"].manifest["lossy"]["batch_dependent"] == ["cache=first_block"]
    assert runs["taylorseer_b4"].manifest["lossy"]["batch_dependent"] == []
    assert runs["lossless_b4"].manifest["lossy"] == {"lossy": False, "lanes": [], "batch_dependent": []}

    doc = gate.evaluate(load_jobs([d["lossless_b1"], d["first_block_b4"], d["taylorseer_b4"]]))
    by = {e["lossy_job"]: e for e in doc["jobs"]}
    assert by["first_block_b4"]["verdict"] == "unmatched" and doc["exit_code"] == 1
    why = by["first_block_b4"]["reasons"][0]
    assert "cache=first_block makes each item depend on its batch peers" in why
    assert "batch_size=4" in why and "batch_size=1" in why
    ts = by["taylorseer_b4"]
    assert ts["lossless_job"] == "lossless_b1" and ts["batch_size"] == {"lossy": 4, "lossless": 1}
    assert "no lossless job of the same rows at batch_size=4" in ts["note"]

    # with a lossless job of each batch size, each lossy job gets the one of its own, whatever the order
    doc = gate.evaluate(load_jobs([d["lossless_b1"], d["lossless_b4"], d["first_block_b4"], d["first_block_b1"]]))
    by = {e["lossy_job"]: e for e in doc["jobs"]}
    assert by["first_block_b4"]["lossless_job"] == "lossless_b4" and "note" not in by["first_block_b4"]
    assert by["first_block_b1"]["lossless_job"] == "lossless_b1"
    assert by["first_block_b4"]["batch_size"] == {"lossy": 4, "lossless": 4}


def test_batch_dependence_of_an_older_manifest_is_read_from_its_evidence():
    """A manifest whose ``lossy`` section predates ``batch_dependent`` gets it from the schedule its evidence
    (or config) records."""
    from runner.core.lossy import of_manifest

    old = {"lossy": {"lossy": True, "lanes": ["cache=first_block"]}, "config": {"cache": {"method": "first_block"}},
           "evidence": {"stages": {"denoise": {"cache": {"method": "first_block", "schedule": "adaptive"}}}}}
    assert of_manifest(old)["batch_dependent"] == ["cache=first_block"]
    old["evidence"]["stages"]["denoise"]["cache"]["schedule"] = "fixed"
    assert of_manifest(old)["batch_dependent"] == []
    assert of_manifest({"config": {"cache": {"method": "magcache", "schedule": "adaptive"}}})["batch_dependent"] == [
        "cache=magcache"]
    assert of_manifest({"lossy": {"lossy": True, "lanes": ["x"], "batch_dependent": ["x"]}})["batch_dependent"] == ["x"]


def test_lossy_lanes_of_backends():
    from runner.core.lossy import lanes

    sel = {"denoise": {"attention": {"selected": {"joint": {"backend": "SAGE_ATTN", "quant": None,
                                                            "skip_softmax": None}}},
                       "linear": {"selected": "FP8"}, "moe": {"selected": None}}}
    assert lanes(sel, {"cache": {"method": "none"}}) == ["denoise.attention.joint=SAGE_ATTN", "denoise.linear=FP8"]
    exact = {"denoise": {"attention": {"selected": {"joint": {"backend": "CUDNN_ATTN"}}}, "linear": {"selected": "TORCH"}}}
    assert lanes(exact, {}) == []
    quant = {"gen": {"attention": {"selected": {"decoder": {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 1}}}}}}
    assert lanes(quant, {"cache": {"method": "pab"}}) == ["cache=pab", "gen.attention.decoder=TRTLLM_ATTN+skip_softmax"]


def test_block_level_cache_runs_under_regional_compile(tmp_path):
    """taylorseer lite (hooks on whole blocks and proj_out) with compile=regional: each block's forward is compiled
    beneath the hooks, which stay eager; the fixed schedule is observed as configured and nothing recompiles."""
    r = _run(tmp_path / "c", ["cache.method=taylorseer", "cache.lite=true", "cache.compute_every=4",
                              "cache.warmup_steps=3", "compile=regional"], limit=2)
    m = r.manifest
    assert r.code == 0 and m["evidence"]["verdict"] == "verified", m["evidence"]["mismatches"]
    assert m["compile"]["regions"]["via"] == "block_forward" and m["compile"]["graphs_compiled_after_warmup"] == 0
    sec = m["evidence"]["stages"]["denoise"]["cache"]
    # the warm-up call is no part of the counts: 2 items x 16 steps, steps 0-2 and 4, 8, 12 computed
    assert sec["forwards_computed"] + sec["forwards_reused"] == 32
    assert sec["forwards_reused"] == sec["expected_forwards_reused"] == 20
    assert m["accuracy"]["all"] == 1.0


def test_attention_level_cache_is_refused_with_compile(tmp_path):
    r = _run(tmp_path / "p", ["cache.method=pab", "compile=regional"], limit=1, catch=(RunnerError,))
    assert type(r.error).__name__ == "CacheConfigError" and "cache.lite=true" in str(r.error), r.error


def test_hand_run_gate_never_replaces_a_sweeps_gate_json(tmp_path):
    """A sweep's gate.json (which its report reads) stays: a hand-run without --out writes gate.cli.json beside
    it; without one it writes gate.json; --out is taken as given."""
    from runner.tools.gate import default_out

    assert default_out([tmp_path]) == tmp_path / "gate.json"
    (tmp_path / "gate.json").write_text("{}")
    assert default_out([tmp_path]) == tmp_path / "gate.cli.json"
    assert default_out([tmp_path, tmp_path / "b"]) == Path("gate.json")


def test_a_dbcache_block_split_the_transformer_cannot_make_is_refused_before_loading(tmp_path):
    """cache-dit asserts ``Fn_compute_blocks`` / ``Bn_compute_blocks`` <= the transformer's blocks mid-run: on
    toy_shapes (2 + 3 blocks) the default 8 failed every item, then the process crashed. Refused at startup, exit
    2, naming the field, the value, the blocks and a fix that runs; a split within the blocks is accepted."""
    from models.cache import check_block_counts, settings, transformer_blocks

    assert transformer_blocks({"num_layers": 2, "num_single_layers": 3}) == 5
    assert transformer_blocks({"num_layers": 40}) == 40 and transformer_blocks({}) is None
    cfg = compose(["model=toy_shapes", "cache.method=dbcache"])
    s = settings(cfg)
    with pytest.raises(RunnerError) as e:
        check_block_counts(s, 5, "toy_shapes")
    assert e.value.exit_code == 2
    assert "cache.fn_compute_blocks=8 with model=toy_shapes: its transformer has 5 blocks" in str(e.value)
    assert "fix: cache.fn_compute_blocks=2" in str(e.value)
    check_block_counts(settings(compose(["model=toy_shapes", "cache.method=dbcache", "cache.fn_compute_blocks=5",
                                         "cache.bn_compute_blocks=5"])), 5, "toy_shapes")  # the bound itself
    with pytest.raises(RunnerError, match="cache.bn_compute_blocks=6 .* fix: cache.bn_compute_blocks=0"):
        check_block_counts(settings(compose(["model=toy_shapes", "cache.method=dbcache",
                                             "cache.fn_compute_blocks=2", "cache.bn_compute_blocks=6"])), 5, "x")
