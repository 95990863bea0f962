"""Evidence that the resolved kernels executed: call-site counts, profiler kernel names, and the verdict.

Two independent observations:

* **Calls** (Python level, every forward): each attention call site records which backend the diffusers
  dispatcher actually ran (``runner.kernels.attention``); each linear implementation counts its calls
  (``runner.kernels.linear``); each MoE block records which implementation computed its routed experts
  (``runner.kernels.moe.install``: the model's own expert modules ran, or our kernel did); a hook on the denoiser counts
  its forwards.
* **Kernels** (profiler): one denoiser forward (one denoising step) of the first batch runs under
  ``torch.profiler``; the names of the device kernels (CPU: the ``aten::`` ops) are matched against per-backend
  signatures (``Backend.signature`` of each record in ``runner.kernels.registry``). This also works under
  ``torch.compile``, where Python counters do not run per call.

With a step cache (``cache.method``, ``models.cache``) an attention module or a block may be answered from the
cache: each call site must then have run its backend once per forward in which its module computed (observed by
the cache's own probe), and the cache's section (forwards and blocks computed and reused, hit rates) adds its own
mismatches: a configured cache that never hit, or a fixed schedule whose observed reuse differs from its rule.

Verdict: ``verified`` when every site ran only its resolved backend, once per denoiser forward, each selected
backend's signature matched a profiled kernel, and all outputs were finite. ``mismatch`` when an observed
implementation differs from the resolved one (``evidence.strict=true``: the run ends with
:class:`EvidenceError`, exit 3, naming the layer and what ran instead; ``strict=false``: status ``limited``).
``nonfinite_outputs`` when the backends matched but some outputs were NaN/inf: those rows are failed, the others
written, and the run exits 1. ``limited`` when nothing mismatched but a check could not be made (``checks``: the
forward count of an engine without a forward rule, ``model.engine=diffusers``); the run's status is unchanged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from runner.kernels import registry as reg
from runner.core.errors import EvidenceError  # noqa: F401  (re-exported: raised for this evidence's mismatches)


@dataclass
class KernelTrace:
    """Names seen while profiling one denoiser forward.

    Attributes:
        ops: CPU-side op names (``aten::...``) with call counts.
        kernels: device kernel names with call counts (empty on CPU).
    """

    ops: Dict[str, int] = field(default_factory=dict)
    kernels: Dict[str, int] = field(default_factory=dict)
    kernel_ms: Dict[str, float] = field(default_factory=dict)
    """Device milliseconds per kernel name over the profiled forward (GPUs)."""

    def match(self, regex: str) -> List[str]:
        """Distinct names (kernels first, then ops) that match ``regex`` (case-insensitive)."""
        pat = re.compile(regex, re.I)
        return sorted({n for n in self.kernels if pat.search(n)}) + sorted({n for n in self.ops if pat.search(n)})

    def calls(self, names: List[str]) -> int:
        """Largest call count among ``names`` in the profiled forward (one kernel launch per attention call)."""
        return max([self.kernels.get(n, 0) or self.ops.get(n, 0) for n in names], default=0)


class DenoiserProbe:
    """Counts denoiser forwards and profiles the first one (one denoising step) with ``torch.profiler``.

    ``model`` is the denoiser, or ``{component: module}`` of a stage's several denoisers (Wan 2.2 A14B's two
    experts): forwards are then also counted per expert (:attr:`by_expert`), each forward's expert and timestep is
    logged (:attr:`log`: ``(expert, timestep)``, the timestep a one-element tensor of the ``timestep`` argument,
    read at evidence time so no device sync happens in the loop), and the first forward of each expert is profiled
    into one trace (:attr:`profiled`: the experts it holds).
    """

    def __init__(self, model: Any, profile: bool, device_kind: str, profile_forward: int = 1):
        experts = dict(model) if isinstance(model, dict) else {"transformer": model}
        self.forwards = 0
        self.by_expert: Dict[str, int] = {e: 0 for e in experts}
        self.log: List[Tuple[str, Any]] = []
        self.profiled: List[str] = []
        self.profile_forward = profile_forward
        self.trace: Optional[KernelTrace] = None
        self._prof = None
        self._prof_expert: Optional[str] = None
        self._profile = profile
        self._device_kind = device_kind
        self._several = len(experts) > 1
        for name, mod in experts.items():
            mod.register_forward_pre_hook(lambda m, a, k, _e=name: self._pre(_e, k), with_kwargs=True)
            mod.register_forward_hook(lambda m, a, o, _e=name: self._post(_e))

    def _pre(self, expert: str, kwargs: Dict[str, Any]) -> None:
        self.forwards += 1
        self.by_expert[expert] += 1
        if self._several:
            t = kwargs.get("timestep")
            self.log.append((expert, t.detach().reshape(-1)[:1].clone() if isinstance(t, torch.Tensor) else t))
        if (self._profile and expert not in self.profiled and self._prof is None
                and self.by_expert[expert] >= self.profile_forward):
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self._device_kind in ("cuda", "rocm"):
                acts.append(ProfilerActivity.CUDA)
            self._prof, self._prof_expert = profile(activities=acts), expert
            self._prof.__enter__()

    def _post(self, expert: str) -> None:
        if self._prof is None or self._prof_expert != expert:
            return
        if self._device_kind in ("cuda", "rocm"):
            torch.cuda.synchronize()
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        trace = self.trace or KernelTrace()
        for ev in prof.events():
            device = ev.device_type != torch.autograd.DeviceType.CPU
            bucket = trace.kernels if device else trace.ops
            bucket[ev.name] = bucket.get(ev.name, 0) + 1
            if device:
                trace.kernel_ms[ev.name] = trace.kernel_ms.get(ev.name, 0.0) + ev.device_time_total / 1e3
        self.trace = trace
        self.profiled.append(expert)

    def timesteps(self, start: int = 0, end: Optional[int] = None) -> List[Tuple[str, Optional[float]]]:
        """``(expert, timestep)`` of the logged forwards ``start:end``, the timesteps as floats (None: not a
        tensor)."""
        return [(e, float(t.float().item()) if isinstance(t, torch.Tensor) else None) for e, t in self.log[start:end]]


def build(stage: str, probes: Dict[str, Any], denoiser: DenoiserProbe, expected_forwards: Optional[int],
          finite: bool,
          device: str, cache: Optional[Dict[str, Any]] = None,
          collectives: Optional[Dict[str, Tuple[str, int]]] = None, forward_rule: bool = True) -> Dict[str, Any]:
    """Assemble the manifest's ``evidence`` section and its verdict.

    Args:
        stage: stage name.
        probes: ``{"attention": [AttentionSite], "linear": LinearRecord}`` from ``models.diffusers_engine.DiffusersEngine.load``,
            and ``"moe": {"resolved": name, "sites": [runner.kernels.moe.MoESite]}`` for a stage with MoE layers.
        denoiser: the forward counter/profiler.
        expected_forwards: denoiser forwards the run should have made (sum over batches of steps x CFG passes);
            None when a pipeline call raised part-way, so the total cannot be predicted. A step cache does not
            change it: the cache methods skip blocks or attention inside the denoiser, never its call.
        finite: every generated output was finite.
        device: the worker's device string.
        forward_rule: the engine predicts its forward count (False: the check is ``limited`` and so is the verdict
            when nothing mismatches; :func:`forward_count_check`).
        With several denoisers (``denoiser.by_expert``: Wan 2.2's two experts) each attention site must have run
        once per forward of its own expert (``AttentionSite.expert``), the linear layers at least
        ``probes["expert_linears"][expert]`` calls per forward of each expert, and the kernel signatures are matched
        against the sites of the experts the trace profiled.
        cache: with a step cache (``models.cache.StepCache``): ``{"section": its evidence, "mismatches": [...],
            "attention_runs": {layer: forwards in which that attention module computed}, "forwards_computed": n}``.
            An attention site must then have run its backend once per forward in which its module computed (not
            once per forward), and linear layers at least once per module per fully computed forward.
        collectives: under context parallelism, ``{kind: (regex, least calls)}`` of the collectives one denoiser
            forward must run (``all_to_all`` for Ulysses, ``all_gather`` for ring attention): the profiled forward
            must show at least that many calls of a matching op or kernel, else it is a mismatch (a run configured
            for context parallelism in which none ran computed every sequence whole, or not at all).

    Returns:
        The section: ``{pid, device, stages: {stage: {attention, linear, kernels[, moe]}}, all_finite, verdict,
        mismatches}``.
    """
    trace = denoiser.trace
    mismatches: List[str] = []
    fwd = denoiser.forwards
    if expected_forwards is not None and fwd != expected_forwards:
        mismatches.append(f"stage {stage}: the denoiser ran {fwd} forwards, expected {expected_forwards}")
    observing = probes.get("observed", True)
    by_expert = getattr(denoiser, "by_expert", None) or {}  # a stand-in probe may not count per expert
    per_expert = by_expert if len(by_expert) > 1 else None
    layers, by_backend = _attention_calls(stage, probes["attention"], observing, fwd, cache, mismatches, per_expert)
    lin = probes["linear"]
    full = cache["forwards_computed"] if cache is not None else fwd  # forwards in which every module ran
    need = (sum(n * per_expert.get(e, 0) for e, n in probes.get("expert_linears", {}).items()) if per_expert
            else lin.modules * full)
    lin_entry = _linear_calls(stage, lin, observing, fwd, full, cache is not None, mismatches, need)
    moe = probes.get("moe")
    moe_entry = _moe_calls(stage, moe, full, observing, mismatches) if moe is not None else None
    kernels: Dict[str, Any] = {"profiled": trace is not None}
    if trace is not None:
        profiled = by_backend if per_expert is None else _sites_by_backend(
            s for s in probes["attention"] if s.expert in denoiser.profiled)
        kernels.update(_kernel_calls(stage, trace, profiled, lin.resolved, moe, mismatches))
        if collectives:
            kernels["collectives"] = _collective_calls(stage, trace, collectives, mismatches)
    if cache is not None:
        mismatches += list(cache.get("mismatches") or [])
    checks = {"forward_count": forward_count_check(fwd, expected_forwards, forward_rule)}
    verdict = "mismatch" if mismatches else ("nonfinite_outputs" if not finite else
                                             "limited" if "limited" in checks.values() else "verified")
    section = {"denoiser_forwards": fwd, "expected_forwards": expected_forwards, "checks": checks,
               "attention": {"by_backend": by_backend, "layers": layers}, "linear": lin_entry, "kernels": kernels}
    if cache is not None:
        section["cache"] = cache["section"]
    if moe_entry is not None:
        section["moe"] = moe_entry
    if per_expert is not None:
        section["expert_forwards"] = dict(per_expert)
        kernels["profiled_experts"] = list(denoiser.profiled)
    return {
        "pid": os.getpid(), "device": device,
        "stages": {stage: section},
        "all_finite": finite,
        "verdict": verdict,
        "mismatches": mismatches,
    }


def _sites_by_backend(sites: Any) -> Dict[str, int]:
    """Call sites per resolved backend."""
    out: Dict[str, int] = {}
    for site in sites:
        out[site.resolved] = out.get(site.resolved, 0) + 1
    return out


def _attention_calls(stage: str, sites: Any, observing: bool, fwd: int, cache: Optional[Dict[str, Any]],
                     mismatches: List[str], per_expert: Optional[Dict[str, int]] = None
                     ) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """Per attention call site: the backend calls observed against once per forward in which it computed (with
    several experts: per forward of the site's expert; mismatches appended); returns ``(layers, call sites per
    resolved backend)``."""
    layers = []
    sites = list(sites)
    by_backend = _sites_by_backend(sites)
    for site in sites:
        if not observing:  # compiled: per-call counters do not run; kernel evidence below
            layers.append({"role": site.role, "layer": site.layer, "resolved": site.resolved, "calls": None,
                           "observed": None, "ok": None})
            continue
        observed = dict(site.observed)
        calls = sum(observed.values())
        own = per_expert.get(site.expert, 0) if per_expert else fwd  # forwards of the site's own expert
        runs = (cache or {}).get("attention_runs", {}).get(site.layer, own)  # forwards in which it computed
        ok = set(observed) <= {site.resolved} and calls == runs * getattr(site, "per_forward", 1)
        if not ok:
            other = {k: v for k, v in observed.items() if k != site.resolved}
            ran = ", ".join(f"{k} x{v}" for k, v in other.items()) if other else "nothing else"
            where = (f"{fwd} forwards" if runs == fwd else f"the {runs} forwards of its expert {site.expert}"
                     if per_expert else f"the {runs} of {fwd} forwards in which it computed")
            if getattr(site, "per_forward", 1) != 1:
                where += f" (expected {site.per_forward} per forward)"
            mismatches.append(f"stage {stage}, role {site.role}, layer {site.layer}: resolved {site.resolved}, "
                              f"observed {observed.get(site.resolved, 0)} calls of it in {where}; ran "
                              f"instead: {ran}")
        layers.append({"role": site.role, "layer": site.layer, "resolved": site.resolved, "calls": calls,
                       "observed": observed, "ok": ok})
    return layers, by_backend


def _linear_calls(stage: str, lin: Any, observing: bool, fwd: int, full: int, cached: bool,
                  mismatches: List[str], need: Optional[int] = None) -> Dict[str, Any]:
    """The linear entry: calls of the resolved backend, at least ``need`` (default one per module per fully
    computed forward; several experts: each expert's modules per forward of it; mismatches appended)."""
    need = lin.modules * full if need is None else need
    lin_entry = {"resolved": lin.resolved, "modules": lin.modules, "observed": dict(lin.observed),
                 "skipped_modules": len(lin.skipped)}
    if getattr(lin, "excluded", None):
        lin_entry["moe_owned_modules"] = len(lin.excluded)
    if observing and lin.observed.get(lin.resolved, 0) < need:
        mismatches.append(f"stage {stage}, linear: resolved {lin.resolved} on {lin.modules} modules, observed "
                          f"{lin.observed.get(lin.resolved, 0)} calls in {fwd} forwards"
                          + (f" ({full} fully computed)" if cached else "") + f" ({lin.observed})")
    if lin.resolved == "TORCH" and any(k != "TORCH" for k in lin.observed):
        mismatches.append(f"stage {stage}, linear: resolved TORCH, observed {lin.observed}")
    return lin_entry


def _kernel_calls(stage: str, trace: KernelTrace, by_backend: Dict[str, int], lin_resolved: str, moe: Any,
                  mismatches: List[str]) -> Dict[str, Any]:
    """The profiled forward's kernels against each selected backend's signature (mismatches appended)."""
    kernels: Dict[str, Any] = {}
    matched = {}
    launches = {}
    for b, n_sites in by_backend.items():
        sig = reg.signature("attention", b)
        names = trace.match(sig or r"$^")
        matched[b] = names
        launches[b] = trace.calls(names)
        if not names:
            mismatches.append(f"stage {stage}, attention: no profiled kernel matches {b}'s signature "
                              f"/{sig}/")
        elif len(by_backend) == 1 and launches[b] < n_sites:
            mismatches.append(f"stage {stage}, attention: {b} kernels launched {launches[b]} times in the profiled "
                              f"forward, but {n_sites} call sites resolved to it")
    attn_names = {n for names in matched.values() for n in names}  # an FP8 attention's kernels are not GEMMs
    lin_names = [n for n in trace.match(reg.signature("linear", lin_resolved) or r"$^") if n not in attn_names]
    if not lin_names:
        mismatches.append(f"stage {stage}, linear: no profiled kernel matches {lin_resolved}")
    fp8 = reg.signature("linear", "FP8")
    fp8_ran = [n for n in trace.match(fp8) if n not in attn_names] if fp8 else []
    if lin_resolved == "TORCH" and fp8_ran:
        mismatches.append(f"stage {stage}, linear: resolved TORCH but FP8 GEMMs ran: {fp8_ran}")
    if moe is not None and moe["sites"]:
        kernels["moe"] = _moe_kernels(stage, moe["resolved"], trace, mismatches)
    top = sorted(trace.kernels.items(), key=lambda kv: -kv[1])[:40]
    by_ms = sorted(trace.kernel_ms.items(), key=lambda kv: -kv[1])[:25]
    if by_ms:  # where the profiled step's device time went (a target missed says why from this)
        kernels["device_ms_total"] = round(sum(trace.kernel_ms.values()), 3)
        kernels["top_device_ms"] = {k[:160]: round(v, 3) for k, v in by_ms}
    kernels.update(attention=matched, attention_launches=launches, linear={lin_resolved: lin_names},
                   top_device_kernels=dict(top),
                   device_kernels=len(trace.kernels), ops=len(trace.ops))
    return kernels


def _collective_calls(stage: str, trace: KernelTrace, collectives: Dict[str, Tuple[str, int]],
                      mismatches: List[str]) -> Dict[str, Any]:
    """Context parallelism's collectives in the profiled forward: at least the expected calls of each kind
    (mismatches appended)."""
    seen: Dict[str, Any] = {}
    for kind, (regex, least) in collectives.items():
        names = trace.match(regex)
        calls = trace.calls(names)
        seen[kind] = {"names": {n: trace.kernels.get(n, 0) or trace.ops.get(n, 0) for n in names},
                      "calls": calls, "expected_at_least": least}
        if calls < least:
            mismatches.append(f"stage {stage}, context parallelism: {calls} {kind} collective calls in the "
                              f"profiled forward, expected at least {least} (matching /{regex}/); the "
                              "sequence was not split and exchanged as configured")
    return seen


def forward_count_check(forwards: int, expected: Optional[int], rule: bool) -> str:
    """The forward-count check's status: ``limited`` when the engine has no forward rule (``model.engine=diffusers``
    on a pipeline no family describes: the count cannot be checked, so it is never ``verified``); ``not_checked``
    when a pipeline call raised part-way (the total is not predictable); else ``verified`` or ``mismatch``."""
    if not rule:
        return "limited"
    if expected is None:
        return "not_checked"
    return "verified" if forwards == expected else "mismatch"


def _moe_calls(stage: str, moe: Dict[str, Any], fwd: int, observing: bool, mismatches: List[str]) -> Dict[str, Any]:
    """``evidence.stages.<stage>.moe`` from the MoE call sites (``runner.kernels.moe.MoESite``): per layer the forwards
    in which each implementation computed its routed experts; every site must have run only the resolved backend,
    once per denoiser forward (mismatches appended)."""
    resolved, sites = moe["resolved"], moe["sites"]
    layers, totals = [], {}
    for site in sites:
        if not observing:
            layers.append({"layer": site.layer, "resolved": resolved, "calls": None, "observed": None, "ok": None})
            continue
        observed = dict(site.observed)
        calls = sum(observed.values())
        ok = set(observed) <= {resolved} and observed.get(resolved, 0) == fwd
        if not ok:
            other = {k: v for k, v in observed.items() if k != resolved}
            ran = ", ".join(f"{k} x{v}" for k, v in other.items()) if other else "nothing else"
            mismatches.append(f"stage {stage}, MoE layer {site.layer}: resolved {resolved}, observed "
                              f"{observed.get(resolved, 0)} calls of it in {fwd} forwards; ran instead: {ran}")
        for k, v in observed.items():
            totals[k] = totals.get(k, 0) + v
        layers.append({"layer": site.layer, "resolved": resolved, "experts": site.experts, "top_k": site.top_k,
                       "calls": calls, "observed": observed, "ok": ok})
    return {"resolved": resolved, "sites": len(sites), "calls": totals if observing else None, "layers": layers}


def _moe_kernels(stage: str, resolved: str, trace: KernelTrace, mismatches: List[str]) -> Dict[str, Any]:
    """The profiled names matching each MoE backend's signature: the resolved one's must be there, and no other
    MoE backend's (its experts ran another implementation)."""
    out = {}
    for name, b in reg.BACKENDS["moe"].items():
        if b.signature is None:
            continue
        names = trace.match(b.signature)
        out[name] = names
        if name == resolved and not names:
            mismatches.append(f"stage {stage}, MoE: no profiled kernel matches {name}'s signature /{b.signature}/")
        elif name != resolved and names:
            mismatches.append(f"stage {stage}, MoE: resolved {resolved}, but {name}'s kernels ran: {names}")
    return out


def expert_schedule(stage: str, calls: List[Dict[str, Any]], rule: str) -> Tuple[Dict[str, Any], List[str]]:
    """Which expert ran at which step of each pipeline call, against the step's expected expert (Wan 2.2 A14B:
    ``transformer`` at timesteps >= ``boundary_ratio * num_train_timesteps``, ``transformer_2`` below; diffusers'
    ``WanPipeline.__call__``).

    Args:
        calls: per pipeline call ``{"item": key, "expected": [(timestep, expert)] per step, "observed":
            [(expert, timestep)] per denoiser forward (:meth:`DenoiserProbe.timesteps`), "per_step": forwards per
            step}``.
        rule: the switch rule in words, for the section and the messages.

    Returns:
        ``(section, mismatches)``: the section holds the rule, the calls checked, per expert the forwards expected,
        the first call's steps (``timestep``, ``expected``, ``observed`` experts) with its ``switch_step`` expected and
        observed (the first step on a later expert; None: none), and the verdict. A call whose forwards do not make
        its steps, or a step run (wholly or partly) by another expert than expected, or at another timestep (more
        than 0.5 apart), is a mismatch.
    """
    mismatches: List[str] = []
    expected_forwards: Dict[str, int] = {}
    first: Optional[Dict[str, Any]] = None
    for call in calls:
        steps, k, seen = call["expected"], int(call["per_step"]), call["observed"]
        for _t, e in steps:
            expected_forwards[e] = expected_forwards.get(e, 0) + k
        ran = [seen[i * k:(i + 1) * k] for i in range(len(steps))]
        rows = [{"timestep": t, "expected": e, "observed": sorted({x for x, _ in r}),
                 "observed_timestep": r[0][1] if r else None} for (t, e), r in zip(steps, ran)]
        if len(seen) != k * len(steps):
            mismatches.append(f"stage {stage}: item {call['item']}: the experts ran {len(seen)} forwards, expected "
                              f"{len(steps)} steps x {k}")
        for i, r in enumerate(rows):
            bad_t = r["observed_timestep"] is not None and abs(r["observed_timestep"] - r["timestep"]) > 0.5
            if r["observed"] != [r["expected"]] or bad_t:
                mismatches.append(f"stage {stage}: item {call['item']}: step {i} (timestep {r['timestep']:g}) ran "
                                  f"{'+'.join(r['observed']) or 'nothing'} at timestep {r['observed_timestep']}, "
                                  f"expected {r['expected']} ({rule})")
        if first is None:
            first = {"item": call["item"], "steps": rows, "switch_step": {
                "expected": next((i for i, (_t, e) in enumerate(steps) if e != steps[0][1]), None),
                "observed": next((i for i, r in enumerate(rows) if r["observed"] != rows[0]["observed"]), None)}}
    verdict = "mismatch" if mismatches else "not_observed" if not calls else "verified"
    return {"rule": rule, "calls": len(calls), "expected_forwards": expected_forwards, "first": first,
            "verdict": verdict}, mismatches


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402


class ExpertsPass(Pass):
    """Several denoisers in one pipeline (Wan 2.2 A14B, :mod:`models.passes`): which expert ran at which step of
    each call, read from the denoiser probe's log around every pipeline call, against the family's rule (the
    engine's ``expected_experts(row)`` and ``expert_rule()``, :func:`expert_schedule`): ``experts`` and the check
    ``expert_schedule`` in the stage's evidence; a step run by another expert is a mismatch (exit 3 under
    ``evidence.strict``). Nothing with one denoiser."""

    name = "experts"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.calls: List[Tuple[Any, List[Tuple[str, Optional[float]]]]] = []  # (first item, (expert, t)s)
        self._start = 0

    def before_pipe(self, batch: Any, kwargs: Dict[str, Any]) -> None:
        probe = self.engine.probe
        self._start = len(probe.log) if probe is not None else 0

    def after_pipe(self, batch: Any, kwargs: Dict[str, Any], outputs: List[Any]) -> List[Any]:
        e = self.engine
        if e.probe is not None and len(e.experts()) > 1:  # the experts' forwards of this call, as floats
            self.calls.append((batch[0], e.probe.timesteps(self._start)))
            del e.probe.log[self._start:]
        return outputs

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        e = self.engine
        if len(e.experts()) <= 1:
            return []
        calls = [{"item": it.key, "expected": e.expected_experts(it.row), "observed": seen,
                  "per_step": e.expected_forwards([it]) // max(1, it.row.num_inference_steps)}
                 for it, seen in self.calls]
        sec, mismatches = expert_schedule(e.stage, calls, e.expert_rule())
        section["experts"] = {"experts": [x for x, _ in e.experts()], **e.pipeline_settings(), **sec}
        section.setdefault("checks", {})["expert_schedule"] = sec["verdict"]
        return mismatches
