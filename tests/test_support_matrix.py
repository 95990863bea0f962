"""The support matrix (``runner.tools.support_matrix``, issue #37): every registry value has a row, the committed
page is what the generator writes now, and each cell follows the evidence (synthetic results dirs: a lane that
passed, one that failed, one that was skipped, one refused, one absent)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from runner.tools import support_matrix as sm

ROOT = Path(__file__).resolve().parent.parent


def _rows(page: str) -> dict:
    """``{section heading: [row keys]}`` of the page's tables (first column, backticks stripped)."""
    out, section = {}, None
    for line in page.splitlines():
        if line.startswith("## "):
            section = line[3:]
            out[section] = []
        elif section and re.match(r"^\| `[^`]+` \|", line):
            out[section].append(line.split("`")[1])
    return out


def test_every_registry_value_has_a_row_in_the_committed_page():
    """Every family, backend, quantization method, cache method, offload plan, LoRA mode, task, metric and
    parallelism mode the registries know has a row in docs/support_matrix.md, in its axis's section."""
    from runner.kernels import quantization
    from runner.kernels.registry import BACKENDS
    from models import cache, registry
    from runner.core import schema

    rows = _rows((ROOT / sm.PAGE).read_text())
    want = {
        "Model families": registry.family_names(),
        "Attention backends": list(BACKENDS["attention"]), "Linear backends": list(BACKENDS["linear"]),
        "MoE backends": list(BACKENDS["moe"]), "Weight quantization": list(quantization.METHODS),
        "Step caches": list(cache.CACHE_METHODS), "Offload plans": [m.value for m in schema.OffloadMode],
    }
    for title, values in want.items():
        section = next((s for s in rows if s.startswith(title + " (")), None)
        assert section is not None, f"no section {title!r} in {sm.PAGE}"
        missing = sorted(set(values) - set(rows[section]))
        assert not missing, f"{sm.PAGE}: {title} lacks rows {missing}; fix: {sm.COMMAND}"
    for ax in sm.axes():  # and the generator's own axes cover every value (the page is built from them)
        section = next(s for s in rows if s.startswith(ax.title + " ("))
        assert list(ax.values) == rows[section], ax.key


def test_committed_page_equals_what_the_generator_writes_now(capsys):
    """``--check`` passes on the committed page: it cannot go stale silently."""
    code = sm.main(["--check"])
    assert code == 0, capsys.readouterr().err


# --------------------------------------------------------------------------------------- synthetic evidence


def _results(tmp_path: Path) -> Path:
    """A results dir: SAGE_ATTN on flux passed (summary line), CUDNN_ATTN+FP8 on sd3 failed (log), FLASH_ATTN on
    flux skipped (log), a budget lane refused with exit 2 and an int8wo lane failed (benchmark JSON), a negative
    control that must not count; nothing at all for zimage."""
    d = tmp_path / "benchmarks" / "results"
    d.mkdir(parents=True)
    (d / "gpu_e2e_h200_2030-01-02.jsonl").write_text(json.dumps({
        "test": "tests/test_gpu_e2e.py::test_backend_matrix_verified_with_device_kernels"
                "[tiny_flux_hd64-SAGE_ATTN-TORCH]",
        "model": "tiny_flux", "device_name": "NVIDIA H200", "attention": {"joint": "SAGE_ATTN"}, "linear": "TORCH",
        "moe": None, "verdict": "verified"}) + "\n")
    (d / "cuda_tests_h200_2030-01-02.log").write_text(
        "cuda.sh: 1 device(s); device 0: NVIDIA H200 sm90; torch 2.11.0+cu130, CUDA 13.0\n"
        "..F.s\n"
        "=================================== FAILURES ===================================\n"
        "_ test_family_on_gpu_verified_with_device_kernels[tiny_sd3-CUDNN_ATTN-FP8] _\n"
        "    def test(...):\n"
        "E       AssertionError: cuDNN kernels missing\n"
        "=========================== short test summary info ============================\n"
        "PASSED tests/test_memory_cuda.py::test_lane[tiny_flux-group_leaf]\n"
        "FAILED tests/test_gpu_e2e.py::test_e[cache.method=pab backend.linear=FP8_TORCHAO-tiny_qwen_image]"
        " - RuntimeError: boom\n"
        "SKIPPED [1] tests/test_gpu_e2e.py:376: backend.attention=FLASH_ATTN cannot run on NVIDIA H200 sm90 for "
        "model=tiny_flux (head_dim 64): needs `flash_attn.flash_attn_func` (package `flash-attn` is not installed)\n"
        "1 failed, 3 passed, 1 skipped in 1.0s\n")
    (d / "memory_lanes_h200.json").write_text(json.dumps({
        "device": "NVIDIA H200", "date": "2030-01-03T00:00:00+00:00", "commit": "abcdef1234",
        "lanes": {
            "budget8": {"overrides": ["experiment=flux_dev_h200", "memory.offload=auto", "memory.max_gpu_gb=8"],
                        "exit_code": 2, "refused": "MemoryBudgetError: memory.offload=auto: no plan fits 8 GB"},
            "int8wo": {"overrides": ["model=sd3", "model.quantization.transformer=int8wo"], "exit_code": 3,
                       "status": "evidence_mismatch", "evidence": {"verdict": "mismatch", "mismatches": ["x"]}},
            "budget24": {"overrides": ["experiment=flux_dev_h200", "memory.offload=auto", "memory.max_gpu_gb=24"],
                         "exit_code": 0, "status": "completed", "evidence": {"verdict": "verified"},
                         "memory_plan": {"offload": "group_leaf", "quantization": {"transformer": "float8wo"}}},
            "group_block": {"overrides": ["model=sd3", "memory.offload=group_block"], "exit_code": 0,
                            "status": "completed", "evidence": {"verdict": "verified"}},
            "negative_control": {"overrides": ["model=sd3", "memory.offload=model"], "exit_code": 3},
        }}))
    return d


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sm")
    ev = sm.collect(ROOT, _results(tmp))
    return ev, sm.cells(ROOT, ev)


def test_a_verbose_log_stopped_before_its_summary_still_names_each_outcome(tmp_path):
    """cuda.sh runs pytest -v: a call the device's time limit stopped has no summary, but each finished test's
    line (``<id> PASSED [ 5%]``) counts, without the progress column as its reason; a later FAILED line wins."""
    log = tmp_path / "cuda_tests_h100_2030-01-05.log"
    log.write_text(
        "cuda.sh: 1 device(s); device 0: NVIDIA H100 80GB HBM3 sm90; torch 2.11.0+cu130, CUDA 13.0\n"
        "tests/test_memory_cuda.py::test_lane[tiny_flux-group_leaf] PASSED                  [  1%]\n"
        "tests/test_gpu_e2e.py::test_x[tiny_flux-FLASH_ATTN] SKIPPED (flash-attn missing)   [  2%]\n"
        "tests/test_memory_cuda.py::test_lane[tiny_sd3-group_leaf] FAILED                   [ 50%]\n")
    runs, _ = sm.parse_log(log, "benchmarks/results/" + log.name, sm.Features(ROOT))
    got = {r.detail: (r.status, r.reason, r.platform) for r in runs}
    assert got == {"tests/test_memory_cuda.py::test_lane[tiny_flux-group_leaf]": ("passed", "", "H100"),
                   "tests/test_memory_cuda.py::test_lane[tiny_sd3-group_leaf]": ("failed", "", "H100")}


def test_passed_failed_skipped_refused_and_absent_lanes(synthetic):
    ev, cells = synthetic
    c = cells[("attention", "SAGE_ATTN", "flux")]
    assert c.state == "verified" and c.runs[0].date == "2030-01-02" and c.runs[0].commit == "uncommitted"
    c = cells[("attention", "CUDNN_ATTN", "sd3")]
    assert c.state == "failed" and "cuDNN kernels missing" in c.reason
    assert cells[("linear", "FP8", "sd3")].state == "failed"
    c = cells[("attention", "FLASH_ATTN", "flux")]
    assert c.state == "skipped" and "flash-attn" in c.reason
    c = cells[("offload", "auto", "flux")]  # budget24 passed, budget8 met a refusal (exit 2) in the same file
    assert c.state == "verified+refused" and "no plan fits" in c.reason
    assert {(r.commit, r.date) for r in c.runs} == {("abcdef1", "2030-01-03")}  # the file's own commit and date
    assert "family" not in ev.runs[[r.detail for r in ev.runs].index("lanes/budget8")].features  # not the family's
    c = cells[("quantization", "int8wo", "sd3")]
    assert c.state == "failed" and "mismatch" in c.reason
    assert cells[("offload", "group_block", "sd3")].state == "verified"
    c = cells[("offload", "group_leaf", "flux")]  # the plan auto took (JSON) and a PASSED line's test id
    assert c.state == "verified" and {r.file.rsplit("/", 1)[-1] for r in c.runs} == {"memory_lanes_h200.json"}
    assert cells[("quantization", "float8wo", "flux")].state == "verified"
    assert any(r.status == sm.PASSED and r.detail.endswith("test_lane[tiny_flux-group_leaf]") for r in ev.runs)
    assert cells[("offload", "model", "sd3")].state == "not run"  # only a negative control ran it
    assert cells[("attention", "CUDNN_ATTN", "zimage")].state == "not run"  # no result; the CPU refuses it
    assert cells[("attention", "TORCH_SDPA", "zimage")].state == "CPU only"
    assert cells[("family", "zimage", "zimage")].state == "CPU only"
    assert cells[("family", "sd3", "sd3")].state == "verified+failed"  # one log's failure, one JSON's pass
    assert ev.logs[next(iter(ev.logs))]["totals"] == {"failed": 1, "passed": 3, "skipped": 1}
    c = cells[("linear", "FP8_TORCHAO", "qwen_image")]  # a FAILED line whose test id holds a space
    assert c.state == "failed" and c.reason == "RuntimeError: boom"


def test_h100_results_fill_the_sm90_cells_and_other_cards_do_not(tmp_path):
    """H100 and H200 are one column (sm90: the same kernels and refusals); each note names its card. An A100 log
    (sm80) is listed under other GPUs, never in those cells. The test ids are cuda.sh's (tests/test_memory_cuda.py
    names the model and the overrides it ran)."""
    d = tmp_path / "benchmarks" / "results"
    d.mkdir(parents=True)
    (d / "cuda_tests_h100_2030-01-04.log").write_text(
        "cuda.sh: 1 device(s); device 0: NVIDIA H100 80GB HBM3 sm90; torch 2.11.0+cu130, CUDA 13.0\n"
        "PASSED tests/test_memory_cuda.py::test_quantized_transformer_runs_with_quantized_weights"
        "[tiny_flux-model.quantization.transformer=nf4-Params4bit-bitsandbytes]\n"
        "PASSED tests/test_memory_cuda.py::test_quantized_weights_offloaded_keep_the_images"
        "[tiny_flux-model.quantization.transformer=int8wo-memory.offload=group_leaf]\n"
        "2 passed in 1.0s\n")
    (d / "cuda_tests_a100_2030-01-05.log").write_text(
        "cuda.sh: 1 device(s); device 0: NVIDIA A100-SXM4-80GB sm80; torch 2.11.0+cu130, CUDA 13.0\n"
        "FAILED tests/test_memory_cuda.py::test_quantized_transformer_runs_with_quantized_weights"
        "[tiny_flux-model.quantization.transformer=nf4-Params4bit-bitsandbytes] - RuntimeError: sm80\n"
        "1 failed in 1.0s\n")
    ev = sm.collect(ROOT, d)
    cells = sm.cells(ROOT, ev)
    c = cells[("quantization", "nf4", "flux")]
    assert c.state == "verified" and [r.platform for r in c.runs] == ["H100"]  # the newer A100 failure is not read
    assert cells[("quantization", "int8wo", "flux")].state == "verified"
    assert cells[("offload", "group_leaf", "flux")].state == "verified"
    page = sm.render(ROOT, ev)
    assert "verified on the H100 at commit" in page and "| family | CPU | sm90 (H100/H200) |" in page
    assert re.search(r"Results from other GPUs \(A100-SXM4-80GB[^)]*\) are listed", page)


def test_a_gate_that_failed_is_named_and_an_interrupted_run_is_no_failure(tmp_path):
    """A lossy lane that ran with its evidence verified but failed its quality gate (``benchmarks/cache_quality.py``
    on toy_motion, H100, 2026-12-07: pab's shape accuracy 0.9583 < 0.97) is verified with the gate's reason in its
    note (toy_motion is a Wan-engine model: the `wan` column); a run a signal stopped (exit 143: the device call's time
    limit interrupted taylorseer) is skipped with
    that reason, not failed; a run that exits 1 is still failed."""
    d = tmp_path / "benchmarks" / "results"
    d.mkdir(parents=True)
    job = {"evidence": "verified", "accuracy_ratio": 1.0}
    (d / "cache_quality_h100_2030-01-06.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "gate": {"toy_motion": {"jobs": {
            "lossless": {**job, "overrides": [], "exit_code": 0},
            "pab": {**job, "overrides": ["cache.method=pab"], "exit_code": 0, "verdict": "fail",
                    "reasons": ["shape: accuracy 0.9583 vs lossless 1 (ratio 0.9583, needs >= 0.97)"]},
            "taylorseer": {**job, "overrides": ["cache.method=taylorseer"], "exit_code": 143, "verdict": "not_run",
                           "reasons": ["the lossy job's outcome is interrupted"]},
            "first_block": {**job, "overrides": ["cache.method=first_block"], "exit_code": 0, "verdict": "pass",
                            "reasons": []},
            "dbcache": {**job, "overrides": ["cache.method=dbcache"], "exit_code": 1, "verdict": "not_run"},
        }}}}))
    ev = sm.collect(ROOT, d)
    cells = sm.cells(ROOT, ev)
    c = cells[("cache", "pab", "wan")]
    assert c.state == "verified" and "quality gate failed: shape: accuracy 0.9583" in c.runs[0].reason
    c = cells[("cache", "taylorseer", "wan")]
    assert c.state == "skipped" and "interrupted" in c.reason and "143" in c.reason
    first = cells[("cache", "first_block", "wan")]
    assert first.state == "verified" and first.runs[0].reason == ""
    assert cells[("cache", "dbcache", "wan")].state == "failed"
    page = sm.render(ROOT, ev)
    assert re.search(r"\(gate/toy_motion/jobs/pab\): ran, but its quality gate failed: shape", page)


def test_refusals_come_from_the_registries_checks(synthetic):
    _, cells = synthetic
    c = cells[("attention", "TRTLLM_ATTN", "flux")]  # sm100-only cubins; no diffusers wiring
    assert c.state == "refused" and c.reason
    c = cells[("moe", "TRITON", "flux")]
    assert c.state == "refused" and "backend.moe" in c.reason
    assert cells[("moe", "TRITON", "hidream")].state != "refused"
    c = cells[("attention", "FLASH_ATTN", "ltx2")]  # LTX-2's attention passes a mask
    assert c.state == "refused" and "mask" in c.reason
    c = cells[("task", "image_to_video", "flux")]
    assert c.state == "refused" and "no pipeline" in c.reason
    c = cells[("metric", "temporal_consistency", "flux")]
    assert c.state == "refused" and "video" in c.reason
    assert cells[("parallelism", "cfg", "CPU")].state == "refused"
    # the default mode runs everywhere (it read as refused in every column: its check ran under launcher=ray)
    assert cells[("parallelism", "single", "CPU")].state == "accepted"
    assert cells[("parallelism", "single", "flux")].state != "refused"
    assert cells[("parallelism", "data", "CPU")].state == "accepted"
    assert cells[("offload", "group_leaf", "CPU")].state == "refused"
    assert cells[("quantization", "int8wo", "CPU")].state == "accepted"


def test_skip_never_hides_an_earlier_pass_and_newest_result_wins():
    old = sm.Run("a.jsonl", "t", "flux", {}, "H200", sm.PASSED, date="2030-01-01", order=1)
    skip = sm.Run("b.log", "t", "flux", {}, "H200", sm.SKIPPED, "not installed", date="2030-01-05", order=5)
    assert sm.decide([old, skip], None, None).state == "verified"
    fail = sm.Run("c.log", "t", "flux", {}, "H200", sm.FAILED, "boom", date="2030-01-03", order=3)
    c = sm.decide([old, skip, fail], None, None)
    assert c.state == "failed" and c.reason == "boom"
    same = sm.Run("d.jsonl", "t", "flux", {}, "H200", sm.PASSED, date="2030-01-03", order=3)
    assert sm.decide([old, fail, same], None, None).state == "verified+failed"
    assert sm.decide([], "needs sm100", None).state == "refused"
    assert sm.decide([], None, "needs cuda").state == "not run"
    assert sm.decide([], None, None).state == "CPU only"


def test_a_new_cache_method_without_a_gpu_result_shows_up_as_cpu_only(tmp_path):
    from models import cache

    base = cache.CACHE_METHODS["pab"]
    new = cache.CacheMethod("toy_new_cache", base.schedule, base.reads, dict(base.defaults), base.build,
                            apply=lambda t, c: None, remove=lambda t: None)
    cache.register_cache_method(new)
    try:
        (tmp_path / "results").mkdir()
        ev = sm.collect(ROOT, tmp_path / "results")
        cells = sm.cells(ROOT, ev)
        assert cells[("cache", "toy_new_cache", "flux")].state == "CPU only"
        page = sm.render(ROOT, ev)
        assert "| `toy_new_cache` | accepted | CPU only |" in page
    finally:
        cache.unregister_cache_method("toy_new_cache")


def test_provenance_falls_back_to_the_previous_page_in_a_shallow_clone(tmp_path):
    prev = "| `benchmarks/results/x_h200.json` | `1234567` | 2030-02-03 | 4 |\n"
    p = sm.Provenance(ROOT, prev)
    p.shallow = True
    assert p.of("benchmarks/results/x_h200.json")[:2] == ("1234567", "2030-02-03")
    assert p.of("benchmarks/results/y_h200_2030-03-04.json")[:2] == ("uncommitted", "2030-03-04")
    real = sm.Provenance(ROOT)
    if not real.shallow:  # the commit that added a committed result file, and the date in its name
        commit, date, _ = real.of("benchmarks/results/gpu_e2e_h200_2026-12-01.jsonl")
        assert re.fullmatch(r"[0-9a-f]{7}", commit) and date == "2026-12-01"


def test_check_mode_reports_a_stale_page(tmp_path, capsys):
    d = tmp_path / "results"
    d.mkdir()
    out = tmp_path / "page.md"
    assert sm.main(["--results", str(d), "--out", str(out)]) == 0
    assert sm.main(["--results", str(d), "--out", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("CPU only", "verified", 1))
    assert sm.main(["--results", str(d), "--out", str(out), "--check"]) == 1
    assert "is stale" in capsys.readouterr().err
    (d / "broken.jsonl").write_text("not json\n")
    assert sm.main(["--results", str(d), "--out", str(out), "--print"]) == 2
    err = capsys.readouterr().err
    assert "SupportMatrixError: " in err and "broken.jsonl:1: not JSON" in err and "fix:" in err
