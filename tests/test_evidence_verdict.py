"""The evidence verdict (``models.denoiser_evidence.build``), branch by branch, on the CPU in a second.

Each test runs a small denoiser-shaped module under the real forward counter and profiler
(:class:`models.denoiser_evidence.DenoiserProbe`: a CPU profiler trace of aten ops), with the call-site records the engine
fills (:class:`runner.kernels.attention.AttentionSite`, the linear record of :func:`runner.kernels.linear.install`,
:class:`runner.kernels.moe.MoESite`) set to what a probe would have observed, and checks what the manifest's ``evidence``
section says: the verdict and the message naming the stage, layer and what ran instead. Every mismatch branch has a
test that takes it and one at its boundary that does not.

End-to-end runs of the whole pipeline (a layer switched to another kernel behind the runner's back) are in
test_evidence.py.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from runner.kernels import linear as L
from runner.kernels.attention import AttentionSite
from runner.kernels.moe import MoESite
from models.context_parallel import COLLECTIVES
from models import denoiser_evidence as ev

pytestmark = pytest.mark.cpu

SDPA_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"


class Toy(nn.Module):
    """One forward = ``attn`` SDPA calls, ``marks`` named profiler ranges (stand-ins for collectives or MoE
    kernels, which a CPU profile records by name), an optional scatter_reduce (the TORCH MoE combine), the linear."""

    def __init__(self, attn: int = 2, marks: Optional[Dict[str, int]] = None, scatter: bool = False,
                 fp8: bool = False, linear: bool = True):
        super().__init__()
        self.attn, self.marks, self.scatter = attn, dict(marks or {}), scatter
        self.linear = linear
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        if fp8:
            self.lin = L.FP8Linear(nn.Linear(16, 16).to(torch.bfloat16), L.LinearRecord("FP8", counting=False))

    def forward(self, x):
        q = x.reshape(1, 2, 2, 8).float()
        for _ in range(self.attn):
            F.scaled_dot_product_attention(q, q, q)
        for name, n in self.marks.items():
            for _ in range(n):
                with record_function(name):
                    pass
        if self.scatter:
            torch.zeros(4).scatter_reduce(0, torch.tensor([0, 1]), torch.ones(2), "sum")
        if not self.linear:
            return x
        return self.lin(x.to(self.lin.bias.dtype if self.lin.bias is not None else x.dtype))


def site(layer: str, resolved: str = "TORCH_SDPA", role: str = "joint", **observed: int) -> AttentionSite:
    return AttentionSite(stage="denoise", role=role, layer=layer, resolved=resolved, observed=Counter(observed))


def linear_record(resolved: str = "TORCH", modules: int = 4, **observed: int) -> L.LinearRecord:
    return L.LinearRecord(resolved=resolved, modules=modules, observed=dict(observed))


def probe(forwards: int = 2, profile: bool = False, model: Optional[nn.Module] = None,
          profile_forward: int = 1) -> ev.DenoiserProbe:
    """A real DenoiserProbe on ``model`` (default :class:`Toy`) after ``forwards`` forwards."""
    model = model if model is not None else Toy()
    p = ev.DenoiserProbe(model, profile=profile, device_kind="cpu", profile_forward=profile_forward)
    for _ in range(forwards):
        model(torch.randn(2, 16))
    return p


def build(sites: List[AttentionSite], lin: L.LinearRecord, den: ev.DenoiserProbe, expected: Optional[int] = 2,
          finite: bool = True, observed: Optional[bool] = None, **kw: Any) -> Dict[str, Any]:
    probes: Dict[str, Any] = {"attention": sites, "linear": lin}
    if observed is not None:
        probes["observed"] = observed
    if "moe" in kw:
        probes["moe"] = kw.pop("moe")
    return ev.build("denoise", probes, den, expected, finite, "cpu", **kw)


def two_sites(**observed: int) -> List[AttentionSite]:
    obs = observed or {"TORCH_SDPA": 2}
    return [site("transformer_blocks.0.attn", **obs), site("transformer_blocks.1.attn", **obs)]


# ------------------------------------------------------------------------------------------- verified


def test_every_layer_once_per_forward_is_verified():
    out = build(two_sites(), linear_record(TORCH=8), probe())
    assert out["verdict"] == "verified" and out["mismatches"] == []
    assert out["all_finite"] is True and out["device"] == "cpu" and out["pid"] == os.getpid()
    st = out["stages"]["denoise"]
    assert st["denoiser_forwards"] == 2 and st["expected_forwards"] == 2
    assert st["attention"]["by_backend"] == {"TORCH_SDPA": 2}
    assert st["attention"]["layers"] == [
        {"role": "joint", "layer": "transformer_blocks.0.attn", "resolved": "TORCH_SDPA", "calls": 2,
         "observed": {"TORCH_SDPA": 2}, "ok": True},
        {"role": "joint", "layer": "transformer_blocks.1.attn", "resolved": "TORCH_SDPA", "calls": 2,
         "observed": {"TORCH_SDPA": 2}, "ok": True}]
    assert st["linear"] == {"resolved": "TORCH", "modules": 4, "observed": {"TORCH": 8}, "skipped_modules": 0}
    assert st["kernels"] == {"profiled": False}
    assert "cache" not in st and "moe" not in st


def test_by_backend_counts_sites_per_resolved_backend():
    sites = [site("a", "TORCH_SDPA", TORCH_SDPA=2), site("b", "CUDNN_ATTN", CUDNN_ATTN=2),
             site("c", "TORCH_SDPA", TORCH_SDPA=2)]
    out = build(sites, linear_record(TORCH=8), probe())
    assert out["stages"]["denoise"]["attention"]["by_backend"] == {"TORCH_SDPA": 2, "CUDNN_ATTN": 1}
    assert out["verdict"] == "verified"


def test_linear_entry_counts_skipped_and_moe_owned_modules():
    lin = linear_record("FP8", modules=2, FP8=4, TORCH=6)
    lin.skipped = ["proj_out", "x_embedder", "norm.linear"]
    lin.excluded = ["blocks.0.experts.0"]
    st = build(two_sites(), lin, probe())["stages"]["denoise"]
    assert st["linear"]["skipped_modules"] == 3 and st["linear"]["moe_owned_modules"] == 1


def test_no_moe_owned_key_without_excluded_modules():
    st = build(two_sites(), linear_record(TORCH=8), probe())["stages"]["denoise"]
    assert "moe_owned_modules" not in st["linear"]


# ------------------------------------------------------------------------------------------ forward count


def test_fewer_denoiser_forwards_than_expected_is_a_mismatch():
    out = build(two_sites(), linear_record(TORCH=8), probe(), expected=3)
    assert out["verdict"] == "mismatch"
    assert out["mismatches"] == ["stage denoise: the denoiser ran 2 forwards, expected 3"]


def test_more_denoiser_forwards_than_expected_is_a_mismatch():
    out = build(two_sites(), linear_record(TORCH=8), probe(), expected=1)
    assert "stage denoise: the denoiser ran 2 forwards, expected 1" in out["mismatches"]


def test_unknown_expected_forwards_skips_the_forward_check():
    out = build(two_sites(), linear_record(TORCH=8), probe(), expected=None)
    assert out["verdict"] == "verified"
    assert out["stages"]["denoise"]["expected_forwards"] is None


# ----------------------------------------------------------------------------------------- attention sites


def test_a_layer_that_ran_another_backend_is_named_with_what_ran():
    sites = [site("transformer_blocks.0.attn", TORCH_SDPA=1, **{"diffusers:_native_math": 1}),
             site("transformer_blocks.1.attn", TORCH_SDPA=2)]
    out = build(sites, linear_record(TORCH=8), probe())
    assert out["verdict"] == "mismatch"
    assert out["mismatches"] == [
        "stage denoise, role joint, layer transformer_blocks.0.attn: resolved TORCH_SDPA, observed 1 calls of it "
        "in 2 forwards; ran instead: diffusers:_native_math x1"]
    layers = out["stages"]["denoise"]["attention"]["layers"]
    assert [l["ok"] for l in layers] == [False, True]
    assert layers[0]["calls"] == 2 and layers[0]["observed"] == {"TORCH_SDPA": 1, "diffusers:_native_math": 1}


def test_a_layer_that_ran_only_another_backend():
    out = build([site("blocks.0.attn", CUDNN_ATTN=2)], linear_record(TORCH=8), probe())
    assert out["mismatches"] == ["stage denoise, role joint, layer blocks.0.attn: resolved TORCH_SDPA, observed 0 "
                                 "calls of it in 2 forwards; ran instead: CUDNN_ATTN x2"]


def test_a_layer_that_ran_once_in_two_forwards_ran_nothing_else():
    out = build([site("blocks.0.attn", TORCH_SDPA=1)], linear_record(TORCH=8), probe())
    assert out["mismatches"] == ["stage denoise, role joint, layer blocks.0.attn: resolved TORCH_SDPA, observed 1 "
                                 "calls of it in 2 forwards; ran instead: nothing else"]


def test_a_layer_that_ran_twice_per_forward_is_a_mismatch():
    out = build([site("blocks.0.attn", TORCH_SDPA=4)], linear_record(TORCH=8), probe())
    assert out["verdict"] == "mismatch"
    assert "observed 4 calls of it in 2 forwards" in out["mismatches"][0]


def test_a_layer_that_never_ran():
    out = build([site("blocks.0.attn")], linear_record(TORCH=8), probe())
    assert out["mismatches"] == ["stage denoise, role joint, layer blocks.0.attn: resolved TORCH_SDPA, observed 0 "
                                 "calls of it in 2 forwards; ran instead: nothing else"]
    assert out["stages"]["denoise"]["attention"]["layers"][0]["calls"] == 0


def test_role_is_named_in_the_message():
    out = build([site("blocks.0.attn", role="cross", TORCH_SDPA=1)], linear_record(TORCH=8), probe())
    assert out["mismatches"][0].startswith("stage denoise, role cross, layer blocks.0.attn:")


def test_compiled_stage_skips_call_counts_and_records_none():
    # under torch.compile the per-call counters do not run: no call-level verdict, kernels decide
    out = build([site("blocks.0.attn")], linear_record(), probe(), observed=False)
    assert out["verdict"] == "verified"
    assert out["stages"]["denoise"]["attention"]["layers"] == [
        {"role": "joint", "layer": "blocks.0.attn", "resolved": "TORCH_SDPA", "calls": None, "observed": None,
         "ok": None}]
    assert out["stages"]["denoise"]["attention"]["by_backend"] == {"TORCH_SDPA": 1}


def test_observed_stage_with_explicit_flag_checks_calls():
    out = build([site("blocks.0.attn")], linear_record(TORCH=8), probe(), observed=True)
    assert out["verdict"] == "mismatch"


# ----------------------------------------------------------------------------------------------- step cache


def _cache(runs: Dict[str, int], computed: int = 2, mismatches=(), section=None) -> Dict[str, Any]:
    return {"section": section or {"method": "fbcache", "hit_rate": 0.5}, "mismatches": list(mismatches),
            "attention_runs": runs, "forwards_computed": computed}


def test_cache_a_layer_runs_once_per_forward_in_which_it_computed():
    sites = [site("blocks.0.attn", TORCH_SDPA=2), site("blocks.1.attn", TORCH_SDPA=1)]
    out = build(sites, linear_record(TORCH=4), probe(), cache=_cache({"blocks.1.attn": 1}, computed=1))
    assert out["verdict"] == "verified", out["mismatches"]
    assert out["stages"]["denoise"]["cache"] == {"method": "fbcache", "hit_rate": 0.5}


def test_cache_a_layer_that_ran_in_a_reused_forward_is_a_mismatch():
    sites = [site("blocks.1.attn", TORCH_SDPA=2)]
    out = build(sites, linear_record(TORCH=8), probe(), cache=_cache({"blocks.1.attn": 1}))
    assert out["mismatches"] == ["stage denoise, role joint, layer blocks.1.attn: resolved TORCH_SDPA, observed 2 "
                                 "calls of it in the 1 of 2 forwards in which it computed; ran instead: nothing else"]


def test_cache_linear_needs_every_module_once_per_fully_computed_forward():
    den = probe()
    ok = build(two_sites(), linear_record(TORCH=4), den, cache=_cache({}, computed=1))
    assert ok["verdict"] == "verified"
    bad = build(two_sites(), linear_record(TORCH=3), den, cache=_cache({}, computed=1))
    assert bad["mismatches"] == ["stage denoise, linear: resolved TORCH on 4 modules, observed 3 calls in 2 forwards "
                                 "(1 fully computed) ({'TORCH': 3})"]


def test_cache_mismatches_are_added_to_the_verdict():
    out = build(two_sites(), linear_record(TORCH=8), probe(),
                cache=_cache({}, mismatches=["cache fbcache: configured but never hit"]))
    assert out["verdict"] == "mismatch"
    assert out["mismatches"] == ["cache fbcache: configured but never hit"]


def test_cache_without_mismatch_list():
    c = _cache({})
    c["mismatches"] = None
    out = build(two_sites(), linear_record(TORCH=8), probe(), cache=c)
    assert out["verdict"] == "verified"


# --------------------------------------------------------------------------------------------- linear calls


def test_linear_calls_at_modules_times_forwards_are_enough():
    assert build(two_sites(), linear_record(TORCH=8), probe())["verdict"] == "verified"
    assert build(two_sites(), linear_record(TORCH=9), probe())["verdict"] == "verified"


def test_linear_calls_short_by_one_is_a_mismatch():
    out = build(two_sites(), linear_record(TORCH=7), probe())
    assert out["mismatches"] == ["stage denoise, linear: resolved TORCH on 4 modules, observed 7 calls in 2 forwards "
                                 "({'TORCH': 7})"]


def test_linear_fp8_counted_as_torch_is_short():
    out = build(two_sites(), linear_record("FP8", modules=2, TORCH=4), probe())
    assert out["mismatches"] == ["stage denoise, linear: resolved FP8 on 2 modules, observed 0 calls in 2 forwards "
                                 "({'TORCH': 4})"]


def test_linear_resolved_torch_but_fp8_calls_observed():
    out = build(two_sites(), linear_record(TORCH=8, FP8=2), probe())
    assert out["mismatches"] == ["stage denoise, linear: resolved TORCH, observed {'TORCH': 8, 'FP8': 2}"]


def test_linear_fp8_with_dense_skipped_layers_is_fine():
    out = build(two_sites(), linear_record("FP8", modules=2, FP8=4, TORCH=6), probe())
    assert out["verdict"] == "verified"


def test_linear_not_checked_when_compiled():
    out = build(two_sites(), linear_record(TORCH=0), probe(), observed=False)
    assert out["verdict"] == "verified"


# --------------------------------------------------------------------------------------------- profiled kernels


def test_profiled_forward_matches_signatures():
    den = probe(profile=True)
    out = build(two_sites(), linear_record(TORCH=8), den)
    assert out["verdict"] == "verified", out["mismatches"]
    k = out["stages"]["denoise"]["kernels"]
    assert k["profiled"] is True
    assert SDPA_CPU in k["attention"]["TORCH_SDPA"]
    assert k["attention_launches"] == {"TORCH_SDPA": 2}
    assert set(k["linear"]["TORCH"]) >= {"aten::addmm", "aten::linear"}
    assert k["device_kernels"] == 0 and k["top_device_kernels"] == {} and k["ops"] == len(den.trace.ops)
    assert "collectives" not in k and "moe" not in k


def test_profiled_forward_without_the_resolved_backends_kernel():
    sites = [site("a", "CUDNN_ATTN", CUDNN_ATTN=2)]
    out = build(sites, linear_record(TORCH=8), probe(profile=True))
    assert out["verdict"] == "mismatch"
    sig = ev.reg.signature("attention", "CUDNN_ATTN")
    assert out["mismatches"] == [f"stage denoise, attention: no profiled kernel matches CUDNN_ATTN's signature /{sig}/"]
    assert out["stages"]["denoise"]["kernels"]["attention"] == {"CUDNN_ATTN": []}


def test_a_backend_without_a_signature_never_matches():
    with ev.reg.registered(ev.reg.Backend("attention", "NOSIG_ATTN", diffusers=ev.reg.DiffusersWiring("native"))):
        out = build([site("a", "NOSIG_ATTN", NOSIG_ATTN=2)], linear_record(TORCH=8), probe(profile=True))
    assert out["mismatches"] == ["stage denoise, attention: no profiled kernel matches NOSIG_ATTN's signature /None/"]


def test_fewer_attention_launches_than_call_sites():
    sites = [site(f"blocks.{i}.attn", TORCH_SDPA=2) for i in range(3)]
    out = build(sites, linear_record(TORCH=8), probe(profile=True))  # 2 SDPA calls per forward
    assert out["mismatches"] == ["stage denoise, attention: TORCH_SDPA kernels launched 2 times in the profiled "
                                 "forward, but 3 call sites resolved to it"]


def test_as_many_launches_as_call_sites():
    den = probe(profile=True, model=Toy(attn=3))
    sites = [site(f"blocks.{i}.attn", TORCH_SDPA=2) for i in range(3)]
    assert build(sites, linear_record(TORCH=8), den)["verdict"] == "verified"


def test_launch_count_not_compared_with_two_backends():
    sites = [site(f"blocks.{i}.attn", TORCH_SDPA=2) for i in range(3)] + [site("x", "CUDNN_ATTN", CUDNN_ATTN=2)]
    out = build(sites, linear_record(TORCH=8), probe(profile=True))
    assert not any("launched" in m for m in out["mismatches"])
    assert any("no profiled kernel matches CUDNN_ATTN" in m for m in out["mismatches"])


def test_profiled_forward_without_any_gemm():
    out = build(two_sites(), linear_record(modules=0), probe(profile=True, model=Toy(linear=False)))
    assert out["mismatches"] == ["stage denoise, linear: no profiled kernel matches TORCH"]
    assert out["stages"]["denoise"]["kernels"]["linear"] == {"TORCH": []}


def test_fp8_gemms_under_a_torch_resolution():
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True, model=Toy(fp8=True)))
    assert out["verdict"] == "mismatch"
    assert "stage denoise, linear: resolved TORCH but FP8 GEMMs ran: ['aten::_scaled_mm']" in out["mismatches"]


def test_fp8_gemms_under_an_fp8_resolution():
    out = build(two_sites(), linear_record("FP8", modules=1, FP8=2), probe(profile=True, model=Toy(fp8=True)))
    assert out["verdict"] == "verified", out["mismatches"]
    assert out["stages"]["denoise"]["kernels"]["linear"] == {"FP8": ["aten::_scaled_mm"]}


def test_profile_of_a_later_forward():
    den = probe(forwards=3, profile=True, profile_forward=2)
    assert den.forwards == 3 and den.trace is not None
    assert den.trace.ops.get(SDPA_CPU) == 2  # one forward profiled, not two


def test_probe_profiles_nothing_before_its_forward_or_when_off():
    assert probe(forwards=1, profile=True, profile_forward=2).trace is None
    off = probe(forwards=2, profile=False)
    assert off.forwards == 2 and off.trace is None


def test_probe_profiles_exactly_one_forward():
    den = probe(forwards=2, profile=True)
    assert den.trace.ops[SDPA_CPU] == 2 and den.trace.ops["aten::addmm"] == 1
    assert den.trace.kernels == {}


# ------------------------------------------------------------------------------------------------ collectives


def test_collectives_missing_under_context_parallelism():
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True),
                collectives={"all_to_all": (COLLECTIVES["all_to_all"], 2)})
    assert out["verdict"] == "mismatch"
    assert out["mismatches"] == [
        f"stage denoise, context parallelism: 0 all_to_all collective calls in the profiled forward, expected at "
        f"least 2 (matching /{COLLECTIVES['all_to_all']}/); the sequence was not split and exchanged as configured"]
    assert out["stages"]["denoise"]["kernels"]["collectives"] == {
        "all_to_all": {"names": {}, "calls": 0, "expected_at_least": 2}}


def test_collectives_at_least_as_many_as_expected():
    den = probe(profile=True, model=Toy(marks={"all_to_all": 2, "all_gather": 3}))
    out = build(two_sites(), linear_record(TORCH=8), den,
                collectives={"all_to_all": (COLLECTIVES["all_to_all"], 2),
                             "all_gather": (COLLECTIVES["all_gather"], 2)})
    assert out["verdict"] == "verified", out["mismatches"]
    seen = out["stages"]["denoise"]["kernels"]["collectives"]
    assert seen["all_to_all"] == {"names": {"all_to_all": 2}, "calls": 2, "expected_at_least": 2}
    assert seen["all_gather"]["calls"] == 3


def test_collectives_one_short():
    den = probe(profile=True, model=Toy(marks={"all_gather": 1}))
    out = build(two_sites(), linear_record(TORCH=8), den, collectives={"all_gather": (COLLECTIVES["all_gather"], 2)})
    assert len(out["mismatches"]) == 1 and "1 all_gather collective calls" in out["mismatches"][0]


# -------------------------------------------------------------------------------------------------- verdicts


def test_nonfinite_outputs_when_backends_matched():
    out = build(two_sites(), linear_record(TORCH=8), probe(), finite=False)
    assert out["verdict"] == "nonfinite_outputs" and out["all_finite"] is False


def test_mismatch_wins_over_nonfinite():
    out = build(two_sites(), linear_record(TORCH=8), probe(), expected=3, finite=False)
    assert out["verdict"] == "mismatch"


def test_every_mismatch_is_listed_not_only_the_first():
    sites = [site("a", CUDNN_ATTN=2), site("b", TORCH_SDPA=1)]
    out = build(sites, linear_record(TORCH=7, FP8=1), probe(), expected=3)
    assert len(out["mismatches"]) == 5  # forwards, two layers, linear short, FP8 under TORCH


# ------------------------------------------------------------------------------------------------------- MoE


def moe_site(layer: str = "blocks.0.moe", resolved: str = "TORCH", counting: bool = True, **observed: int):
    return MoESite(layer=layer, resolved=resolved, experts=8, top_k=2, counting=counting, observed=dict(observed))


def test_moe_each_block_once_per_forward_with_the_resolved_backend():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2), moe_site("blocks.1.moe", TORCH=2)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(), moe=moe)
    assert out["verdict"] == "verified"
    assert out["stages"]["denoise"]["moe"] == {
        "resolved": "TORCH", "sites": 2, "calls": {"TORCH": 4},
        "layers": [{"layer": "blocks.0.moe", "resolved": "TORCH", "experts": 8, "top_k": 2, "calls": 2,
                    "observed": {"TORCH": 2}, "ok": True},
                   {"layer": "blocks.1.moe", "resolved": "TORCH", "experts": 8, "top_k": 2, "calls": 2,
                    "observed": {"TORCH": 2}, "ok": True}]}


def test_moe_block_that_ran_another_implementation():
    moe = {"resolved": "TRITON", "sites": [moe_site(resolved="TRITON", TORCH=2)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(), moe=moe)
    assert out["mismatches"] == ["stage denoise, MoE layer blocks.0.moe: resolved TRITON, observed 0 calls of it in "
                                 "2 forwards; ran instead: TORCH x2"]
    assert out["stages"]["denoise"]["moe"]["layers"][0]["ok"] is False


def test_moe_block_short_of_forwards_ran_nothing_else():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=1)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(), moe=moe)
    assert out["mismatches"] == ["stage denoise, MoE layer blocks.0.moe: resolved TORCH, observed 1 calls of it in 2 "
                                 "forwards; ran instead: nothing else"]


def test_moe_block_over_forwards():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=3)]}
    assert build(two_sites(), linear_record(TORCH=8), probe(), moe=moe)["verdict"] == "mismatch"


def test_moe_counts_against_fully_computed_forwards_under_a_cache():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=1)]}
    out = build(two_sites(), linear_record(TORCH=4), probe(), moe=moe, cache=_cache({}, computed=1))
    assert not any("MoE" in m for m in out["mismatches"])


def test_moe_compiled_records_none():
    moe = {"resolved": "TORCH", "sites": [moe_site()]}
    out = build(two_sites(), linear_record(), probe(), moe=moe, observed=False)
    assert out["verdict"] == "verified"
    assert out["stages"]["denoise"]["moe"] == {
        "resolved": "TORCH", "sites": 1, "calls": None,
        "layers": [{"layer": "blocks.0.moe", "resolved": "TORCH", "calls": None, "observed": None, "ok": None}]}


def test_moe_kernels_resolved_signature_found():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True, model=Toy(scatter=True)), moe=moe)
    assert out["verdict"] == "verified", out["mismatches"]
    assert out["stages"]["denoise"]["kernels"]["moe"] == {"TORCH": ["aten::scatter_reduce"], "TRITON": [],
                                                          "GROUPED_MM": []}


@pytest.mark.parametrize("scatter", [False, True])
def test_moe_kernels_grouped_mm(scatter):
    """GROUPED_MM resolved: its op in the profile verifies it; diffusers' loop's scatter_reduce in the same profile
    (its experts ran the TORCH loop somewhere) is a mismatch naming TORCH."""
    moe = {"resolved": "GROUPED_MM", "sites": [moe_site(resolved="GROUPED_MM", GROUPED_MM=2)]}
    model = Toy(marks={"aten::_grouped_mm": 2}, scatter=scatter)
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True, model=model), moe=moe)
    assert out["stages"]["denoise"]["kernels"]["moe"]["GROUPED_MM"] == ["aten::_grouped_mm"]
    if scatter:
        assert out["mismatches"] == ["stage denoise, MoE: resolved GROUPED_MM, but TORCH's kernels ran: "
                                     "['aten::scatter_reduce']"]
    else:
        assert out["verdict"] == "verified", out["mismatches"]


def test_moe_kernels_resolved_signature_missing():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True), moe=moe)
    assert out["mismatches"] == ["stage denoise, MoE: no profiled kernel matches TORCH's signature "
                                 "/aten::scatter_reduce/"]


def test_moe_kernels_of_another_backend_ran():
    moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2)]}
    den = probe(profile=True, model=Toy(scatter=True, marks={"_moe_gate_up_silu_kernel": 1}))
    out = build(two_sites(), linear_record(TORCH=8), den, moe=moe)
    assert out["mismatches"] == ["stage denoise, MoE: resolved TORCH, but TRITON's kernels ran: "
                                 "['_moe_gate_up_silu_kernel']"]


def test_moe_kernels_not_checked_without_sites():
    out = build(two_sites(), linear_record(TORCH=8), probe(profile=True), moe={"resolved": "TORCH", "sites": []})
    assert out["verdict"] == "verified"
    assert "moe" not in out["stages"]["denoise"]["kernels"]
    assert out["stages"]["denoise"]["moe"]["sites"] == 0


def test_moe_backend_without_signature_is_not_profiled():
    with ev.reg.registered(ev.reg.Backend("moe", "NOSIG_MOE")):
        moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2)]}
        out = build(two_sites(), linear_record(TORCH=8), probe(profile=True, model=Toy(scatter=True)), moe=moe)
    assert "NOSIG_MOE" not in out["stages"]["denoise"]["kernels"]["moe"]


# ------------------------------------------------------------------------------------------------ KernelTrace


def test_trace_match_lists_kernels_first_then_ops_sorted_case_insensitive():
    t = ev.KernelTrace(ops={"aten::b_Flash": 1, "aten::a_flash": 2, "aten::mm": 1},
                       kernels={"z_flash_kernel": 3, "FLASH_fwd": 1})
    assert t.match("flash") == ["FLASH_fwd", "z_flash_kernel", "aten::a_flash", "aten::b_Flash"]
    assert t.match(r"^mm$") == []
    assert t.match(r"aten::mm") == ["aten::mm"]


def test_trace_calls_is_the_largest_count_kernels_before_ops():
    t = ev.KernelTrace(ops={"x": 5, "y": 2}, kernels={"x": 3, "k": 4})
    assert t.calls(["x"]) == 3  # the device kernel's count, not the op's
    assert t.calls(["y", "k"]) == 4
    assert t.calls(["y"]) == 2
    assert t.calls([]) == 0
    assert t.calls(["absent"]) == 0


# ------------------------------------------------------------------------------------------------- boundaries


def test_compiled_stage_records_every_layer():
    sites = [site("blocks.0.attn"), site("blocks.1.attn", "CUDNN_ATTN")]
    layers = build(sites, linear_record(), probe(), observed=False)["stages"]["denoise"]["attention"]["layers"]
    assert [(l["layer"], l["calls"]) for l in layers] == [("blocks.0.attn", None), ("blocks.1.attn", None)]


def test_a_layer_that_ran_two_other_backends():
    out = build([site("blocks.0.attn", CUDNN_ATTN=1, FLASH_ATTN=1)], linear_record(TORCH=8), probe())
    assert out["mismatches"][0].endswith("ran instead: CUDNN_ATTN x1, FLASH_ATTN x1")


def test_one_linear_module_that_never_ran_in_one_forward():
    out = build([site("a", TORCH_SDPA=1)], linear_record(modules=1), probe(forwards=1), expected=1)
    assert out["mismatches"] == ["stage denoise, linear: resolved TORCH on 1 modules, observed 0 calls in 1 forwards "
                                 "({})"]


def test_no_forward_at_all():
    # every row failed before denoising: nothing ran, nothing was expected to
    moe = {"resolved": "TORCH", "sites": [moe_site()]}
    out = build([site("a")], linear_record(), probe(forwards=0), expected=0, moe=moe)
    assert out["verdict"] == "verified", out["mismatches"]
    assert out["stages"]["denoise"]["moe"]["layers"][0]["ok"] is True


def test_a_linear_record_without_moe_owned_modules():
    from types import SimpleNamespace

    lin = SimpleNamespace(resolved="TORCH", modules=4, observed={"TORCH": 8}, skipped=[])  # no ``excluded``
    st = build(two_sites(), lin, probe())["stages"]["denoise"]
    assert st["linear"] == {"resolved": "TORCH", "modules": 4, "observed": {"TORCH": 8}, "skipped_modules": 0}


def test_moe_block_that_never_ran_in_one_forward():
    moe = {"resolved": "TORCH", "sites": [moe_site()]}
    out = build([site("a", TORCH_SDPA=1)], linear_record(modules=1, TORCH=1), probe(forwards=1), expected=1, moe=moe)
    assert out["mismatches"] == ["stage denoise, MoE layer blocks.0.moe: resolved TORCH, observed 0 calls of it in 1 "
                                 "forwards; ran instead: nothing else"]


def test_moe_block_that_ran_two_other_implementations():
    moe = {"resolved": "TORCH", "sites": [moe_site(TRITON=1, unobserved=1)]}
    out = build(two_sites(), linear_record(TORCH=8), probe(), moe=moe)
    assert out["mismatches"][0].endswith("ran instead: TRITON x1, unobserved x1")
    assert out["stages"]["denoise"]["moe"]["calls"] == {"TRITON": 1, "unobserved": 1}


def test_moe_compiled_records_every_block():
    moe = {"resolved": "TORCH", "sites": [moe_site(), moe_site("blocks.1.moe")]}
    layers = build(two_sites(), linear_record(), probe(), moe=moe, observed=False)["stages"]["denoise"]["moe"]["layers"]
    assert [l["layer"] for l in layers] == ["blocks.0.moe", "blocks.1.moe"]


def test_moe_kernels_of_every_backend_with_a_signature():
    first = ev.reg.Backend("moe", "NOSIG_MOE")
    second = ev.reg.Backend("moe", "SIG_MOE", signature=r"aten::zeros")
    with ev.reg.registered(first), ev.reg.registered(second):
        moe = {"resolved": "TORCH", "sites": [moe_site(TORCH=2)]}
        out = build(two_sites(), linear_record(TORCH=8), probe(profile=True, model=Toy(scatter=True)), moe=moe)
    assert out["stages"]["denoise"]["kernels"]["moe"] == {"TORCH": ["aten::scatter_reduce"], "TRITON": [],
                                                          "GROUPED_MM": [], "SIG_MOE": ["aten::zeros"]}
    assert out["mismatches"] == ["stage denoise, MoE: resolved TORCH, but SIG_MOE's kernels ran: ['aten::zeros']"]


def _gpu_trace(den: ev.DenoiserProbe, kernels: dict) -> ev.DenoiserProbe:
    """The probe with a device-kernel trace as a GPU profile records it (kernel names and launch counts)."""
    den.trace = ev.KernelTrace(ops={SDPA_CPU: 2, "aten::addmm": 1}, kernels=dict(kernels))
    return den


def test_top_device_kernels_are_the_40_most_launched():
    kernels = {f"kernel_{i:02d}": i for i in range(1, 46)}
    out = build(two_sites(), linear_record(TORCH=8), _gpu_trace(probe(), kernels))
    k = out["stages"]["denoise"]["kernels"]
    assert list(k["top_device_kernels"].items()) == [(f"kernel_{i:02d}", i) for i in range(45, 5, -1)]
    assert k["device_kernels"] == 45 and k["ops"] == 2


def test_top_device_kernels_ties_keep_the_trace_order():
    out = build(two_sites(), linear_record(TORCH=8), _gpu_trace(probe(), {"z": 1, "a": 2, "m": 1}))
    assert list(out["stages"]["denoise"]["kernels"]["top_device_kernels"]) == ["a", "z", "m"]


def test_collectives_counted_from_device_kernels():
    den = _gpu_trace(probe(), {"ncclDevKernel_SendRecv": 4, "flash_fwd": 2})
    out = build(two_sites(), linear_record(TORCH=8), den, collectives={"all_to_all": (COLLECTIVES["all_to_all"], 4)})
    assert out["stages"]["denoise"]["kernels"]["collectives"]["all_to_all"] == {
        "names": {"ncclDevKernel_SendRecv": 4}, "calls": 4, "expected_at_least": 4}
    assert not any("context parallelism" in m for m in out["mismatches"])


class Growing(Toy):
    """Forward n runs n SDPA calls: the trace tells which forward was profiled."""

    def forward(self, x):
        self.attn += 1
        return super().forward(x)


@pytest.mark.parametrize("profile_forward", [1, 2, 3])
def test_the_profiled_forward_is_the_one_asked_for(profile_forward):
    den = probe(forwards=3, profile=True, model=Growing(attn=0), profile_forward=profile_forward)
    assert den.forwards == 3 and den.trace.ops[SDPA_CPU] == profile_forward


def test_no_profile_before_the_forward_asked_for():
    den = probe(forwards=2, profile=True, model=Growing(attn=0), profile_forward=3)
    assert den.trace is None and den.forwards == 2


class _Seen(Toy):
    """Records, during its forward, what the probe's profiler records (its activities)."""

    seen: list

    def forward(self, x):
        prof = self.probe._prof
        self.seen.append(None if prof is None else sorted(str(a) for a in prof.activities))
        return super().forward(x)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the profiler warns that CUDA activity has no device here
@pytest.mark.parametrize("kind,device", [("cuda", True), ("rocm", True), ("cpu", False), ("xpu", False)])
def test_on_a_gpu_the_probe_records_the_device_and_waits_for_it(monkeypatch, kind, device):
    """On a CUDA/ROCm device the profiler also records device activity, and the probe synchronizes the device before
    it stops the profiler (kernels still queued would be missing from the trace). This machine has no GPU: the
    synchronize call is recorded instead of run, and the profiler is asked for CUDA activity all the same."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(a))
    model = _Seen()
    model.seen = []
    model.probe = ev.DenoiserProbe(model, profile=True, device_kind=kind)
    model(torch.randn(2, 16))
    model(torch.randn(2, 16))
    want = ["ProfilerActivity.CPU", "ProfilerActivity.CUDA"] if device else ["ProfilerActivity.CPU"]
    assert model.seen == [want, None]  # the first forward only is profiled
    assert len(syncs) == (1 if device else 0)
    assert model.probe.trace.ops[SDPA_CPU] == 2
