"""A fixed cache schedule is observed exactly as planned (``models.cache``): per item, the transformer forwards
the schedule reuses, counted by the probe from what executed, equal the step arithmetic of diffusers' rules written
out here by hand (not the runner's own prediction); and a cache that reuses more (or fewer) forwards than its
schedule plans is an evidence mismatch (exit 3) naming both numbers. Real diffusers hooks on the trained toy_shapes
(16 steps per row, 2 double + 3 single blocks)."""

from __future__ import annotations

import dataclasses

import pytest

from _helpers import execute, stale_output_hook
from models.cache import method_of, register_cache_method, unregister_cache_method
from runner.core.errors import EvidenceError

STEPS = 16


def _run(path, overrides, limit=1, catch=()):
    return execute(path, ["model=toy_shapes", f"dataset.limit={limit}", *overrides], catch=catch)


def _pab_computes(s: int, every: int, warmup: int) -> bool:  # PAB with the step index as its timestep
    return s < warmup or s % every == 0


def _taylorseer_computes(s: int, every: int, warmup: int) -> bool:  # diffusers' TaylorSeer cache_interval rule
    return s < warmup or (s - warmup - 1) % every == 0


@pytest.mark.parametrize("method,every,warmup,reused", [
    ("pab", 2, 1, 8),          # computes 0, 2, 4, ..., 14
    ("pab", 3, 2, 9),          # computes 0, 1, 3, 6, 9, 12, 15
    ("taylorseer", 2, 3, 7),   # computes 0, 1, 2, 4, 6, ..., 14
    ("taylorseer", 3, 1, 10),  # computes 0, 2, 5, 8, 11, 14
])
def test_fixed_schedule_reuses_exactly_the_planned_steps(tmp_path, method, every, warmup, reused):
    rule = _pab_computes if method == "pab" else _taylorseer_computes
    assert sum(not rule(s, every, warmup) for s in range(STEPS)) == reused  # the table above is the rule's
    r = _run(tmp_path / "run", [f"cache.method={method}", f"cache.compute_every={every}",
                                f"cache.warmup_steps={warmup}"], limit=2)
    assert r.code == 0, r.manifest.get("evidence")
    for rec in r.items:
        c = rec["cache"]
        assert (c["forwards_reused"], c["forwards_computed"]) == (reused, STEPS - reused), c
        assert c["blocks_computed"] + c["blocks_reused"] == STEPS * 5
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert sec["forwards_reused"] == sec["expected_forwards_reused"] == 2 * reused
    assert sec["forwards_computed"] == 2 * (STEPS - reused) and sec["calls"] == 2
    assert sec["forwards_hit_rate"] == round(reused / STEPS, 4)
    assert sec["verdict"] == "observed"


def _mispredicting(name: str, delta: int):
    """PAB as it runs, declaring a schedule that reuses ``delta`` steps fewer per call than it does."""
    pab = method_of("pab")
    return dataclasses.replace(pab, name=name, aliases=(),
                               reused_steps=lambda p, steps: pab.reused_steps(p, steps) - delta)


@pytest.mark.parametrize("delta,planned", [(1, 7), (-1, 9)], ids=["reuses_more", "reuses_fewer"])
def test_a_cache_that_reuses_other_than_planned_is_a_mismatch(tmp_path, delta, planned):
    name = f"pab_off_{'more' if delta > 0 else 'fewer'}"
    register_cache_method(_mispredicting(name, delta))
    try:
        r = _run(tmp_path / "run", [f"cache.method={name}", "cache.compute_every=2", "cache.warmup_steps=1"],
                 catch=(EvidenceError,))
    finally:
        unregister_cache_method(name)
    assert isinstance(r.error, EvidenceError) and r.error.exit_code == 3
    m = r.manifest
    assert m["status"] == "evidence_mismatch"
    sec = m["evidence"]["stages"]["denoise"]["cache"]
    assert (sec["forwards_reused"], sec["expected_forwards_reused"], sec["verdict"]) == (8, planned, "mismatch")
    assert m["evidence"]["mismatches"] == [
        f"stage denoise, cache: cache.method={name}'s fixed schedule reuses {planned} transformer forwards in this "
        f"run, observed 8 reused of {STEPS}"]


def _one_block_method(name: str):
    """A cache on the last transformer block only: from the 2nd step of a call on, that block returns its step-0
    output (its state reset per call); every other block computes. One block reused per forward."""
    import torch
    from diffusers.hooks import HookRegistry

    from models.cache import CacheMethod

    Stale = stale_output_hook(stateful=True)

    def last(t):
        return [b for _, c in t.named_children() if isinstance(c, torch.nn.ModuleList) for b in c][-1]

    def apply(t, config):
        HookRegistry.check_if_exists_or_initialize(last(t)).register_hook(Stale(), name)

    def remove(t):
        HookRegistry.check_if_exists_or_initialize(last(t)).remove_hook(name, recurse=False)

    return CacheMethod(name, "fixed", (), {}, build=lambda p, steps, probe: None, apply=apply, remove=remove,
                       reused_steps=lambda p, steps: steps - 1)


def test_a_forward_with_one_block_reused_counts_as_reused(tmp_path):
    register_cache_method(_one_block_method("last_block"))
    try:
        r = _run(tmp_path / "run", ["cache.method=last_block"])
    finally:
        unregister_cache_method("last_block")
    assert r.code == 0, r.manifest.get("evidence")
    c = r.items[0]["cache"]
    assert c == {**c, "forwards_reused": STEPS - 1, "forwards_computed": 1, "blocks_reused": STEPS - 1,
                 "blocks_computed": STEPS * 5 - (STEPS - 1)}
    sec = r.manifest["evidence"]["stages"]["denoise"]["cache"]
    assert sec["expected_forwards_reused"] == sec["forwards_reused"] == STEPS - 1 and sec["verdict"] == "observed"
