"""AR stages through vLLM on a CUDA GPU (the H200: vLLM 0.24.0 carried by ``benchmarks/vllm_h200_wheels.py``):
``tiny_qwen3_moe`` with FLASH_ATTN + Triton MoE verified in prefill and decode, the MoE TORCH refusal, a worker
whose experts were swapped after resolution ending in exit 3, and ``prompt_expand_flux`` with both stages on
the GPU.

Marked ``cuda`` (``scripts/ci/cuda.sh``). Skipped where vLLM does not import, unless ``RUNNER_REQUIRE_VLLM=1``
(then a missing vLLM fails), and where the installed vLLM is not the CUDA build.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.cuda

if os.environ.get("RUNNER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm is not installed (CUDA: benchmarks/vllm_h200_wheels.py; see docs/vllm.md)")


def _vllm_on_cuda() -> bool:
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # noqa: BLE001
        return False


requires_vllm_cuda = pytest.mark.skipif(not _vllm_on_cuda(), reason="the installed vLLM is not the CUDA build (or no "
                                                                    "CUDA device): these tests need vLLM on a GPU")

ROWS = [
    {"id": "seventeen", "prompt_token_ids": list(range(3, 20)), "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    {"id": "fox", "prompt": "a red fox asleep in fresh snow", "max_tokens": 6, "seed": 5, "ignore_eos": True},
    {"id": "ids", "prompt_token_ids": [7, 8, 9, 10, 11], "max_tokens": 5, "ignore_eos": True, "seed": 3},
]
GPU = ["platform=cuda", "model=tiny_qwen3_moe", "dataset=jsonl"]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("ar_cuda_rows") / "rows.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return p


def _run(compose, overrides, run_dir, on_loaded=None):
    """``runner.app.execute.run``; returns (exit code, manifest, error) as the CLI would end (RunnerError.exit_code)."""
    from runner.core.errors import RunnerError
    from runner.app.execute import run

    err = None
    try:
        code = run(compose(overrides), run_dir, overrides, on_loaded=on_loaded)
    except RunnerError as e:
        code, err = e.exit_code, e
    man = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").exists() else {}
    return code, man, err


def swap_experts(stage):
    """Tamper inside the worker after resolution: every MoE layer's experts object becomes another class (a
    subclass, so generation still works); what runs is no longer the resolved TritonExperts."""
    def tamper(model):
        n = 0
        for _name, m in model.named_modules():
            qm = getattr(m, "quant_method", None)
            fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
            if fe is not None:
                fe.__class__ = type("SwappedExperts", (type(fe),), {})
                n += 1
            elif getattr(qm, "experts_cls", None) is not None:
                qm.experts_cls = type("SwappedExperts", (qm.experts_cls,), {})
                n += 1
        return n

    assert stage.adapter.llm.apply_model(tamper)[0] >= 1


@requires_vllm_cuda
def test_flash_attn_and_triton_moe_verified_in_prefill_and_decode(compose, rows_file, tmp_path):
    ov = [*GPU, f"dataset.path={rows_file}", "backend.attention=FLASH_ATTN", "backend.moe=TRITON"]
    code, m, err = _run(compose, ov, tmp_path / "run")
    assert code == 0 and m["evidence"]["verdict"] == "verified", (err, m.get("evidence", {}).get("mismatches"))
    ev = m["evidence"]["stages"]["generate"]
    w = ev["worker"]
    assert w["attention"]["backends"] == ["FLASH_ATTN"]
    assert all(k.endswith("|fa=3") for k in w["attention"]["layers"]), w["attention"]["layers"]  # FA3 on sm90
    assert [e.rsplit(".", 1)[-1] for e in w["moe"]["experts"]] == ["TritonExperts"]
    assert w["config"]["kernel_config"]["moe_backend"] == "triton"
    for phase in ("prefill", "decode"):
        k = ev["profiled_kernels"]["checked"][phase]
        assert k["attention"]["launches"] >= ev["layers"]["attention"], k["attention"]
        assert any("FlashAttnFwdSm90" in n for n in k["attention"]["kernels"]), k["attention"]["kernels"]
        assert k["moe"]["launches"] >= 2 * ev["layers"]["moe"] and "fused_moe_kernel" in k["moe"]["kernels"]
        c = ev["calls"][phase]
        assert c["steps"] >= 1 and c["calls"] == c["expected_calls"]
    req = ev["requests"]
    assert req["seventeen"] == {"prompt_tokens": 17, "prefix_cached_tokens": 0, "prefill_tokens": 17,
                                "prefill_steps": 1, "decode_tokens": 3, "decode_steps": 3}
    assert req["ids"]["prefill_tokens"] == 5 and req["ids"]["decode_steps"] == 4


@requires_vllm_cuda
def test_moe_torch_has_no_vllm_equivalent_and_is_refused(compose, rows_file, tmp_path):
    code, m, err = _run(compose, [*GPU, f"dataset.path={rows_file}", "backend.moe=TORCH"], tmp_path / "run")
    assert code == 2 and type(err).__name__ == "UnknownBackendError"
    assert "never a torch expert loop" in str(err) and not (tmp_path / "run" / "items.jsonl").exists()


@requires_vllm_cuda
def test_swapped_experts_end_in_evidence_mismatch_exit_3(compose, rows_file, tmp_path):
    ov = [*GPU, f"dataset.path={rows_file}", "backend.attention=FLASH_ATTN", "backend.moe=TRITON"]
    code, m, err = _run(compose, ov, tmp_path / "run", on_loaded=swap_experts)
    assert code == 3 and type(err).__name__ == "EvidenceError", err
    assert m["status"] == "evidence_mismatch" and m["evidence"]["verdict"] == "mismatch"
    assert any("SwappedExperts" in x for x in m["evidence"]["mismatches"]), m["evidence"]["mismatches"]


@requires_vllm_cuda
def test_prompt_expand_flux_both_stages_on_the_gpu_verified(compose, tmp_path):
    ov = ["platform=cuda", "model=prompt_expand_flux", "model.stages.expand.backend.attention=FLASH_ATTN",
          "model.stages.expand.backend.moe=TRITON", "dataset.limit=2"]
    code, m, err = _run(compose, ov, tmp_path / "pipe")
    assert code == 0 and m["evidence"]["verdict"] == "verified", (err, m.get("evidence", {}).get("mismatches"))
    assert set(m["evidence"]["stages"]) == {"expand", "denoise"}
    exp = m["evidence"]["stages"]["expand"]
    assert exp["worker"]["attention"]["backends"] == ["FLASH_ATTN"]
    assert exp["profiled_kernels"]["checked"]["decode"]["moe"]["launches"] >= 2
    assert m["counts"]["ok"] == 2
