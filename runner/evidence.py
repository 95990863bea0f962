"""Evidence that the resolved kernels executed: call-site counts, profiler kernel names, and the verdict.

Two independent observations:

* **Calls** (Python level, every forward): each attention call site records which backend the diffusers
  dispatcher actually ran (``kernels.attention``); each linear implementation counts its calls
  (``kernels.linear``); a hook on the denoiser counts its forwards.
* **Kernels** (profiler): one denoiser forward (one denoising step) of the first batch runs under
  ``torch.profiler``; the names of the device kernels (CPU: the ``aten::`` ops) are matched against per-backend
  signatures. This also works under ``torch.compile``, where Python counters do not run per call.

Verdict: ``verified`` when every site ran only its resolved backend, once per denoiser forward, each selected
backend's signature matched a profiled kernel, and all outputs were finite. ``mismatch`` when an observed
implementation differs from the resolved one (``evidence.strict=true``: the run ends with
:class:`EvidenceError`, exit 3, naming the layer and what ran instead; ``strict=false``: status ``limited``).
``nonfinite_outputs`` when the backends matched but some outputs were NaN/inf: those rows are failed, the others
written, and the run exits 1.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from runner.errors import EvidenceMismatchError

# Backend -> regex over profiled names (aten op names on CPU, device kernel names on GPUs). Sources: kernel names
# seen in torch.profiler traces (cuDNN frontend SDPA "cudnn_generated_fort_native_sdpa_*"; flash-attn
# "flash_fwd_kernel"; SageAttention's Triton "_attn_fwd" and "quant_per_block_int8_kernel"; cuBLASLt/CUTLASS FP8
# GEMMs carry "e4m3" in their names, and torch 2.11's cuBLASLt picks "nvjet_sm90_qqtst_..._ovscale_..." for
# row-wise scaled FP8 on the H200, seen there 2026-11-29).
SIGNATURES: Dict[str, Dict[str, str]] = {
    "attention": {
        "TORCH_SDPA": r"aten::_scaled_dot_product_(flash_attention_for_cpu|attention_math|efficient_attention|"
                      r"flash_attention|cudnn_attention)|fmha|flash_fwd|cudnn.*sdpa|sdpa.*cudnn",
        "CUDNN_ATTN": r"aten::_scaled_dot_product_cudnn_attention|cudnn.*(sdpa|fprop)|sdpa.*cudnn|fmha.*cudnn",
        "FLASH_ATTN": r"flash_fwd|flash_attn|FlashAttn",
        "SAGE_ATTN": r"_attn_fwd|quant_per_block|sageattn|qk_int8",
        "FLASHINFER_ATTN": r"flashinfer|SinglePrefill|BatchPrefill|PrefillWithKVCache",
    },
    "linear": {
        "TORCH": r"aten::(addmm|mm|bmm|linear)\b|gemm|cutlass|nvjet|xmma",
        "FP8": r"aten::_scaled_mm|e4m3|fp8|f8f8|nvjet_sm\d+_qq",
    },
}


class EvidenceError(EvidenceMismatchError, RuntimeError):
    """The run's evidence contradicts its resolution (strict mode); names the layer and what ran instead."""


@dataclass
class KernelTrace:
    """Names seen while profiling one denoiser forward.

    Attributes:
        ops: CPU-side op names (``aten::...``) with call counts.
        kernels: device kernel names with call counts (empty on CPU).
    """

    ops: Dict[str, int] = field(default_factory=dict)
    kernels: Dict[str, int] = field(default_factory=dict)

    def match(self, regex: str) -> List[str]:
        """Distinct names (kernels first, then ops) that match ``regex`` (case-insensitive)."""
        pat = re.compile(regex, re.I)
        return sorted({n for n in self.kernels if pat.search(n)}) + sorted({n for n in self.ops if pat.search(n)})

    def calls(self, names: List[str]) -> int:
        """Largest call count among ``names`` in the profiled forward (one kernel launch per attention call)."""
        return max([self.kernels.get(n, 0) or self.ops.get(n, 0) for n in names], default=0)


class DenoiserProbe:
    """Counts denoiser forwards and profiles the first one (one denoising step) with ``torch.profiler``."""

    def __init__(self, model: torch.nn.Module, profile: bool, device_kind: str, profile_forward: int = 1):
        self.forwards = 0
        self.profile_forward = profile_forward
        self.trace: Optional[KernelTrace] = None
        self._prof = None
        self._profile = profile
        self._device_kind = device_kind
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.forwards += 1
        if self._profile and self.trace is None and self._prof is None and self.forwards >= self.profile_forward:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self._device_kind in ("cuda", "rocm"):
                acts.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=acts)
            self._prof.__enter__()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._prof is None:
            return
        if self._device_kind in ("cuda", "rocm"):
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        trace = KernelTrace()
        for ev in prof.events():
            bucket = trace.kernels if ev.device_type != torch.autograd.DeviceType.CPU else trace.ops
            bucket[ev.name] = bucket.get(ev.name, 0) + 1
        self.trace = trace


def build(stage: str, probes: Dict[str, Any], denoiser: DenoiserProbe, expected_forwards: Optional[int],
          finite: bool,
          device: str) -> Dict[str, Any]:
    """Assemble the manifest's ``evidence`` section and its verdict.

    Args:
        stage: stage name.
        probes: ``{"attention": [AttentionSite], "linear": LinearRecord}`` from ``runner.execute.install_backends``.
        denoiser: the forward counter/profiler.
        expected_forwards: denoiser forwards the run should have made (sum over batches of steps x CFG passes);
            None when a pipeline call raised part-way, so the total cannot be predicted.
        finite: every generated output was finite.
        device: the worker's device string.

    Returns:
        The section: ``{pid, device, stages: {stage: {attention, linear, kernels}}, all_finite, verdict,
        mismatches}``.
    """
    trace = denoiser.trace
    mismatches: List[str] = []
    fwd = denoiser.forwards
    if expected_forwards is not None and fwd != expected_forwards:
        mismatches.append(f"stage {stage}: the denoiser ran {fwd} forwards, expected {expected_forwards}")
    layers = []
    by_backend: Dict[str, int] = {}
    observing = probes.get("observed", True)
    for site in probes["attention"]:
        by_backend[site.resolved] = by_backend.get(site.resolved, 0) + 1
        if not observing:  # compiled: per-call counters do not run; kernel evidence below
            layers.append({"role": site.role, "layer": site.layer, "resolved": site.resolved, "calls": None,
                           "observed": None, "ok": None})
            continue
        observed = dict(site.observed)
        calls = sum(observed.values())
        ok = set(observed) <= {site.resolved} and calls == fwd
        if not ok:
            other = {k: v for k, v in observed.items() if k != site.resolved}
            ran = ", ".join(f"{k} x{v}" for k, v in other.items()) if other else "nothing else"
            mismatches.append(f"stage {stage}, role {site.role}, layer {site.layer}: resolved {site.resolved}, "
                              f"observed {observed.get(site.resolved, 0)} calls of it in {fwd} forwards; ran "
                              f"instead: {ran}")
        layers.append({"role": site.role, "layer": site.layer, "resolved": site.resolved, "calls": calls,
                       "observed": observed, "ok": ok})
    lin = probes["linear"]
    lin_entry = {"resolved": lin.resolved, "modules": lin.modules, "observed": dict(lin.observed),
                 "skipped_modules": len(lin.skipped)}
    if observing and lin.observed.get(lin.resolved, 0) < lin.modules * fwd:
        mismatches.append(f"stage {stage}, linear: resolved {lin.resolved} on {lin.modules} modules, observed "
                          f"{lin.observed.get(lin.resolved, 0)} calls in {fwd} forwards ({lin.observed})")
    if lin.resolved == "TORCH" and any(k != "TORCH" for k in lin.observed):
        mismatches.append(f"stage {stage}, linear: resolved TORCH, observed {lin.observed}")
    kernels: Dict[str, Any] = {"profiled": trace is not None}
    if trace is not None:
        matched = {}
        launches = {}
        for b, n_sites in by_backend.items():
            names = trace.match(SIGNATURES["attention"].get(b, r"$^"))
            matched[b] = names
            launches[b] = trace.calls(names)
            if not names:
                mismatches.append(f"stage {stage}, attention: no profiled kernel matches {b}'s signature "
                                  f"/{SIGNATURES['attention'].get(b)}/")
            elif len(by_backend) == 1 and launches[b] < n_sites:
                mismatches.append(f"stage {stage}, attention: {b} kernels launched {launches[b]} times in the profiled "
                                  f"forward, but {n_sites} call sites resolved to it")
        lin_names = trace.match(SIGNATURES["linear"][lin.resolved])
        if not lin_names:
            mismatches.append(f"stage {stage}, linear: no profiled kernel matches {lin.resolved}")
        if lin.resolved == "TORCH" and trace.match(SIGNATURES["linear"]["FP8"]):
            mismatches.append(f"stage {stage}, linear: resolved TORCH but FP8 GEMMs ran: "
                              f"{trace.match(SIGNATURES['linear']['FP8'])}")
        top = sorted(trace.kernels.items(), key=lambda kv: -kv[1])[:40]
        kernels.update(attention=matched, attention_launches=launches, linear={lin.resolved: lin_names},
                       top_device_kernels=dict(top),
                       device_kernels=len(trace.kernels), ops=len(trace.ops))
    verdict = "mismatch" if mismatches else ("nonfinite_outputs" if not finite else "verified")
    return {
        "pid": os.getpid(), "device": device,
        "stages": {stage: {"denoiser_forwards": fwd, "expected_forwards": expected_forwards,
                           "attention": {"by_backend": by_backend, "layers": layers}, "linear": lin_entry,
                           "kernels": kernels}},
        "all_finite": finite,
        "verdict": verdict,
        "mismatches": mismatches,
    }
