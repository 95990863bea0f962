"""Fixed cache schedules (models/cache.py), for the mutation run (benchmarks/mutation.py, group ``cache``): the
runner's prediction of reused steps against diffusers' rules written out here, over a grid of schedules (not only
those whose counts happen to agree with a shifted rule); the diffusers configs the runner builds for them; and the
hit rates of the evidence on a toy_shapes run whose rates have more than four decimals."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from _helpers import execute
from models.cache import CacheProbe, _pab, _pab_reused, _taylorseer, _taylorseer_reused


def _taylorseer_computes(s: int, every: int, warmup: int) -> bool:  # diffusers' TaylorSeer cache_interval rule
    return s < warmup or (s - warmup - 1) % every == 0


def _pab_computes(s: int, every: int, warmup: int) -> bool:  # PAB with the step index as its timestep
    return s < warmup or s % every == 0


GRID = [(every, warmup, steps) for every in (1, 2, 3, 4, 5) for warmup in (0, 1, 2, 3, 6) for steps in (1, 7, 16, 28)]


def test_taylorseer_prediction_is_diffusers_rule():
    for every, warmup, steps in GRID:
        p = {"compute_every": every, "warmup_steps": warmup}
        want = sum(not _taylorseer_computes(s, every, warmup) for s in range(steps))
        assert _taylorseer_reused(p, steps) == want, (every, warmup, steps)


def test_pab_prediction_is_diffusers_rule():
    for every, warmup, steps in GRID:
        p = {"compute_every": every, "warmup_steps": warmup}
        want = sum(not _pab_computes(s, every, warmup) for s in range(steps))
        assert _pab_reused(p, steps) == want, (every, warmup, steps)


@pytest.fixture(scope="module")
def probe():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=8, axes_dims_rope=(2, 2, 4))
    attn = [(n, m) for n, m in model.named_modules() if n.endswith(".attn")]
    return CacheProbe(model, attn)


def test_taylorseer_config(probe):
    cfg = _taylorseer({"compute_every": 3, "warmup_steps": 2, "order": 2, "lite": True}, 16, probe)
    assert (cfg.cache_interval, cfg.disable_cache_before_step, cfg.max_order) == (3, 2, 2)
    assert cfg.use_lite_mode is True and cfg.taylor_factors_dtype == torch.float32
    assert cfg.cache_identifiers == [re.escape(n) for n in probe.attention]
    assert set(probe.attention) == {"transformer_blocks.0.attn", "single_transformer_blocks.0.attn"}
    cfg = _taylorseer({"compute_every": 3, "warmup_steps": 2, "order": 1, "lite": False}, 16, probe)
    assert cfg.use_lite_mode is False and cfg.max_order == 1


def test_pab_config_counts_in_steps(probe):
    cfg = _pab({"compute_every": 3, "warmup_steps": 2}, 16, probe)
    assert cfg.spatial_attention_block_skip_range == 3
    assert cfg.spatial_attention_timestep_skip_range == (1, sys.maxsize)
    probe.step = 7
    assert cfg.current_timestep_callback() == 7
    probe.per_step = 2  # CFG: forward 7 is the uncond forward of step 3
    assert cfg.current_timestep_callback() == 3
    probe.per_step = 1


def test_hit_rates_of_a_schedule_with_repeating_decimals(tmp_path):
    # PAB every 2, warmup 1, 3 steps: steps 0 and 2 compute, step 1 reuses: 1 of 3 forwards
    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset.limit=1", "model.generation.num_inference_steps=3",
                                   "cache.method=pab", "cache.compute_every=2", "cache.warmup_steps=1"])
    assert r.code == 0
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert (sec["forwards_reused"], sec["forwards_computed"]) == (1, 2)
    assert sec["forwards_hit_rate"] == 0.3333
    blocks = sec["blocks_computed"] + sec["blocks_reused"]
    assert blocks == 3 * sec["blocks_per_forward"] and sec["blocks_reused"] > 0
    assert sec["blocks_hit_rate"] == round(sec["blocks_reused"] / blocks, 4)
    assert sec["expected_forwards_reused"] == 1 and sec["verdict"] == "observed" and sec["calls"] == 1


@pytest.mark.parametrize("overrides,fix", [
    (["cache.method=pab", "cache.compute_every=2", "cache.warmup_steps=3"], "fewer cache.warmup_steps or more steps"),
    (["cache.method=first_block", "cache.threshold=1e-9"], "a larger cache.threshold (its hit rate depends on the weights)"),
], ids=["fixed", "adaptive"])
def test_a_cache_that_never_hits_is_a_mismatch_naming_the_fix(tmp_path, overrides, fix):
    from runner.core.errors import EvidenceError

    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset.limit=1", "model.generation.num_inference_steps=3",
                                   *overrides], catch=(EvidenceError,))
    assert isinstance(r.error, EvidenceError)
    name = overrides[0].split("=")[1]
    want = (f"stage denoise, cache: cache.method={name} is configured, but no block or forward was reused in 3 "
            f"transformer forwards (the cache never hit); fix: {fix}, or cache.method=none")
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert sec["verdict"] == "mismatch" and sec["forwards_reused"] == 0
    assert want in r.manifest["evidence"]["mismatches"]


def test_a_cached_stage_whose_items_all_failed_before_any_forward_has_no_hit_rates(tmp_path):
    def on_loaded(adapter):
        def hook(mod, args):
            raise RuntimeError("injected text encoder failure")

        adapter.pipe.text_encoder.register_forward_pre_hook(hook)

    r = execute(tmp_path / "run", ["model=toy_shapes", "dataset.limit=1", "model.generation.num_inference_steps=3",
                                   "cache.method=pab"], on_loaded=on_loaded)
    assert r.error is None and r.code == 1
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert sec["forwards_computed"] == sec["forwards_reused"] == 0
    assert sec["forwards_hit_rate"] is None and sec["blocks_hit_rate"] is None
