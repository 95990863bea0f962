"""AR stages send every request to one ``LLM.generate`` call by default (vLLM's continuous batching), not one per
call (issue #20); ``model.batch_size`` or a command-line ``batch_size`` set it. Nothing here starts vLLM:
``VLLMEngine.batches`` and ``check_config`` need no engine."""

from __future__ import annotations

import pytest


def _engine(compose, overrides):
    from runner.app.stages import build_engines

    cfg = compose(overrides)
    return build_engines(cfg, overrides)[0], cfg


@pytest.mark.parametrize("overrides,calls,size,source", [
    (["model=tiny_qwen3_moe"], 1, 18, "default: every request in one call"),
    (["model=tiny_qwen3_moe", "model.batch_size=4"], 5, 4, "model.batch_size"),
    (["model=tiny_qwen3_moe", "batch_size=1"], 18, 1, "batch_size (command line)"),
    (["model=tiny_qwen3_moe", "batch_size=1", "model.batch_size=6"], 3, 6, "model.batch_size"),
])
def test_requests_per_generate_call(compose, overrides, calls, size, source):
    engine, cfg = _engine(compose, overrides)
    batches = engine.batches(list(range(18)), cfg.batch_size)
    assert [x for b in batches for x in b] == list(range(18))  # dataset order, nothing lost
    assert engine.call_plan == {"requests_per_call": size, "source": source, "calls": calls} and len(batches) == calls


def test_pipeline_stage_model_batch_size_and_range_check(compose):
    from models.vllm.rows import ARConfigError
    from runner.app.stages import build_engines

    ov = ["model=prompt_expand_flux", "model.stages.expand.model.batch_size=3"]
    cfg = compose(ov)
    expand = build_engines(cfg, ov)[0]
    assert expand.requests_per_call(cfg.batch_size) == (3, "model.stages.expand.model.batch_size")
    engine, _ = _engine(compose, ["model=tiny_qwen3_moe", "model.batch_size=0"])
    with pytest.raises(ARConfigError, match=r"model.batch_size=0 must be >= 1"):
        engine.check_config()
