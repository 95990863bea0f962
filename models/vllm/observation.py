"""What the vLLM worker built and ran (the AR stage's evidence): each layer kind's implementation as built
(:func:`inspect_model`, run inside the worker), the comparison with the request (:func:`mismatches`), the GPU
kernels a named backend must have launched (:func:`check_gpu_kernels`), and per-step scheduler and forward counts
(:class:`StepObserver`).

Written against vLLM 0.32.0 (CPU) and 0.24 (CUDA); vLLM does not always honour an explicit backend choice (on CPU
any attention name other than ``CPU_ATTN`` is replaced by ``CPU_ATTN`` with only an INFO log line), so what the
worker reports is the evidence, never the request.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from models.vllm.names import MOE_EXPERTS


def worker_config(worker: Any) -> Dict[str, Any]:
    """Runs inside the worker (``LLM.collective_rpc``): the kernel and attention config the worker holds."""
    vc = worker.vllm_config
    att = vc.attention_config.backend
    sched = getattr(vc, "scheduler_config", None)
    return {"kernel_config": {"moe_backend": vc.kernel_config.moe_backend,
                              "linear_backend": vc.kernel_config.linear_backend},
            "attention_config": {"backend": getattr(att, "name", att)},
            "device": str(vc.device_config.device), "dtype": str(vc.model_config.dtype).replace("torch.", ""),
            "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
            "enforce_eager": bool(getattr(vc.model_config, "enforce_eager", False))}


def _dispatched_gemm() -> Any:
    """vLLM 0.24's GEMM for unquantized linears (``dispatch_unquantized_gemm()``, no arguments; CUDA:
    ``default_unquantized_gemm`` = ``F.linear``); None where that function takes arguments (0.32) or is absent."""
    import inspect

    try:
        from vllm.model_executor.layers.utils import dispatch_unquantized_gemm
    except ImportError:
        return None
    try:
        if inspect.signature(dispatch_unquantized_gemm).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return dispatch_unquantized_gemm()


def inspect_model(model: Any) -> Dict[str, Any]:
    """Runs inside the worker (``LLM.apply_model``): which implementation each layer kind actually got.

    Returns plain data (strings and counts), safe to ship back from a worker process.
    """
    attn: Dict[str, int] = {}
    moe: Dict[str, int] = {}
    swapped: Dict[str, str] = {}
    linear: Dict[str, int] = {}
    layers: Dict[str, str] = {}

    def bump(d: Dict[str, int], k: str) -> None:
        d[k] = d.get(k, 0) + 1

    def qual(obj: Any) -> str:
        t = obj if isinstance(obj, type) else type(obj)
        return f"{t.__module__}.{t.__qualname__}"

    for name, m in model.named_modules():
        if hasattr(m, "attn_backend") and hasattr(m, "impl"):
            fa = getattr(m.impl, "vllm_flash_attn_version", None)  # FLASH_ATTN's impl: 2, 3 or 4 (GPU)
            key = (f"{m.attn_backend.get_name()}|{qual(m.attn_backend)}|{qual(m.impl)}|isa={getattr(m, 'isa', None)}"
                   + (f"|fa={fa}" if fa is not None else ""))
            bump(attn, key)
            layers.setdefault("attention", name)
            continue
        qm = getattr(m, "quant_method", None)
        if qm is None:
            continue
        if hasattr(qm, "moe_kernel") or hasattr(qm, "experts_cls"):
            # the experts object the kernel calls; vLLM 0.24 builds moe_kernel on the first forward in some paths,
            # so before that the chosen class (experts_cls) is what can be read
            fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
            chosen = getattr(qm, "experts_cls", None)  # what vLLM's MoE oracle selected for this layer
            if fe is None:
                fe = chosen
            elif isinstance(chosen, type) and type(fe) is not chosen:
                swapped[name] = f"{qual(chosen)} -> {qual(fe)}"
            backend = getattr(qm, "unquantized_backend", None)
            key = (f"{getattr(backend, 'name', backend)}|{qual(qm)}|{qual(fe) if fe is not None else None}"
                   f"|isa={getattr(fe, 'isa', None)}|zentorch={getattr(fe, '_use_zentorch', None)}")
            bump(moe, key)
            layers.setdefault("moe", name)
            continue
        gemm = getattr(qm, "_gemm_impl", None)  # vLLM 0.32 binds it at construction; 0.24 dispatches per call
        if gemm is None and type(qm).__name__ == "UnquantizedLinearMethod":
            gemm = _dispatched_gemm()
        cpu_linear = getattr(m, "cpu_linear", None)
        code = getattr(cpu_linear, "__code__", None)
        kernel = None
        if code is not None:  # the CPU GEMM dispatch stores a lambda; its names say which kernel it calls
            names = set(code.co_names)
            kernel = ("zentorch_linear_unary" if "zentorch_linear_unary" in names else
                      "weight_packed_linear_cpu" if "weight_packed_linear_cpu" in names else
                      "onednn_mm" if "onednn_mm" in names else "torch.nn.functional.linear")
        elif cpu_linear is not None:
            kernel = getattr(cpu_linear, "__qualname__", repr(cpu_linear))
        key = f"{qual(qm)}|gemm={getattr(gemm, '__name__', None)}|cpu_kernel={kernel}"
        bump(linear, key)
        layers.setdefault("linear", name)

    def summary(d: Dict[str, int], i: int) -> List[str]:
        return sorted({k.split("|")[i] for k in d})

    return {
        "attention": {"backends": summary(attn, 0), "classes": summary(attn, 1), "impls": summary(attn, 2),
                      "layers": attn},
        "moe": {"backends": summary(moe, 0), "methods": summary(moe, 1), "experts": summary(moe, 2),
                "layers": moe, "swapped": swapped},
        "linear": {"methods": summary(linear, 0), "layers": linear},
        "example_layer": layers,
    }


def mismatches(requested: Mapping[str, str], inspected: Mapping[str, Any]) -> List[str]:
    """What ran differently from what was asked for (empty: consistent).

    Args:
        requested: normalized names (:func:`normalize_backends` / :class:`VLLMNames`); ``auto`` is never a mismatch.
        inspected: :meth:`VLLMAdapter.inspect` output.

    Attention names compare by name (``AttentionBackend.get_name()`` equals the enum name). An explicit MoE name
    must have built the experts class vLLM builds for it (:data:`MOE_EXPERTS`: ``triton`` -> ``TritonExperts``);
    experts of another class are a mismatch, as is "MoE layers exist but none was built". Whatever the request
    (``auto`` too), a layer whose experts object is not of the class vLLM's MoE oracle chose for it
    (``quant_method.experts_cls``: experts swapped after resolution) is a mismatch.
    ``linear_backend`` is not used by vLLM for unquantized layers: ``torch`` (dense, unquantized GEMM) matches
    when every linear layer is ``UnquantizedLinearMethod``; any other explicit linear name is reported.
    """
    out: List[str] = []
    att = requested.get("attention", "auto")
    ran = inspected.get("attention", {}).get("backends", [])
    if att != "auto" and ran != [att]:
        out.append(f"attention: requested {att}, the worker built {', '.join(ran) or 'nothing'}")
    moe = requested.get("moe", "auto")
    experts = [e for e in inspected.get("moe", {}).get("experts", []) if e and e != "None"]
    if moe != "auto" and not experts:
        out.append(f"moe: requested {moe}, the worker built no MoE experts")
    for layer, change in sorted(inspected.get("moe", {}).get("swapped", {}).items()):
        out.append(f"moe: {layer} runs other experts than vLLM's MoE oracle chose for it ({change})")
    if moe == "auto" or not experts:
        pass
    elif moe in MOE_EXPERTS:
        other = [e for e in experts if e.rsplit(".", 1)[-1] not in MOE_EXPERTS[moe]]
        if other:
            out.append(f"moe: requested {moe} (vLLM's {' or '.join(MOE_EXPERTS[moe])}), the worker's MoE layers run "
                       f"{', '.join(other)}")
    lin = requested.get("linear", "auto")
    methods = inspected.get("linear", {}).get("methods", [])
    dense = methods and all(m.endswith(("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")) for m in methods)
    if lin == "torch" and not dense:
        out.append(f"linear: requested torch (dense, unquantized), the layers run {', '.join(methods) or 'nothing'}")
    elif lin not in ("auto", "torch"):
        out.append(f"linear: requested {lin}, but the layers run {', '.join(methods) or 'nothing'}, which do "
                   f"not take a linear_backend for unquantized weights")
    return out


#: Profiler op names of vLLM's CPU kernels per layer kind (seen with torch.profiler on vLLM 0.32.0 CPU:
#: ``models/vllm_notes.md`` 3d). Used to check that the implementation the worker built is the one that ran.
CPU_OPS = {
    "attention": {"CPU_ATTN": "_C::cpu_attention_with_kv_cache"},
    "moe": {"CPU": "_C::cpu_fused_moe"},
    "linear": {"onednn_mm": "_C::onednn_mm", "torch.nn.functional.linear": "aten::linear"},
}


#: vLLM experts class -> the vLLM MoE name whose kernels it launches (the GPU kernel check under ``auto``).
EXPERTS_MOE = {cls: name for name, classes in MOE_EXPERTS.items() for cls in classes}
#: vLLM attention backends without a runner record (so no ``vllm_signature`` in ``runner.kernels.registry``).
VLLM_ONLY_ATTENTION = {"TRITON_ATTN": r"kernel_unified_attention|_fwd_kernel"}


def gpu_kernel_expectations(built: Mapping[str, Any]) -> Dict[str, Tuple[str, Optional[str]]]:
    """What the worker built, per layer kind, and the regex of the device kernels that implementation launches:
    ``{"attention": ("FLASH_ATTN", regex), "moe": ("TritonExperts", regex), "linear": ("torch", regex)}``.

    The regexes are the ``vllm_signature`` of the runner backend with that vLLM name (``runner.kernels.registry``:
    FLASH_ATTN -> vLLM's FA3 ``FlashAttnFwdSm90``; MoE ``triton`` -> ``fused_moe_kernel``; linear ``torch`` ->
    cuBLAS/CUTLASS GEMMs); None when no signature is known (the check then reports it)."""
    from runner.kernels import registry as reg

    def union(sigs: List[Optional[str]]) -> Optional[str]:
        if not sigs or not all(sigs):
            return None
        uniq = list(dict.fromkeys(sigs))
        return uniq[0] if len(uniq) == 1 else "|".join(f"(?:{x})" for x in uniq)

    out: Dict[str, Tuple[str, Optional[str]]] = {}
    backends = built.get("attention", {}).get("backends", [])
    if backends:
        name = "|".join(backends)
        sigs = [reg.vllm_signature("attention", b) or VLLM_ONLY_ATTENTION.get(b) for b in backends]
        out["attention"] = (name, union(sigs))
    experts = [e.rsplit(".", 1)[-1] for e in built.get("moe", {}).get("experts", []) if e and e != "None"]
    if experts:
        names = [EXPERTS_MOE.get(e) for e in experts]
        sigs = [reg.vllm_signature("moe", n) if n else None for n in names]
        out["moe"] = ("|".join(experts), union(sigs))
    methods = built.get("linear", {}).get("methods", [])
    if methods:
        dense = all(m.endswith(("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")) for m in methods)
        out["linear"] = ("torch" if dense else "|".join(m.rsplit(".", 1)[-1] for m in methods),
                         reg.vllm_signature("linear", "torch") if dense else None)
    return out


def check_gpu_kernels(built: Mapping[str, Any], layers: Mapping[str, int],
                      kernels: Mapping[str, Mapping[str, int]]) -> Tuple[Dict[str, Any], List[str]]:
    """Did the profiled steps launch the kernels of what the worker built? Per phase (``prefill``, ``decode``) and
    layer kind: the launches whose name matches :func:`gpu_kernel_expectations`' regex (case-insensitive) must be at
    least one per layer for attention and MoE (FA3: one ``FlashAttnFwdSm90`` per layer and step, the Triton MoE two
    ``fused_moe_kernel`` per layer and step) and at least one for linear (a GEMM).

    Args:
        built: :meth:`VLLMAdapter.inspect`; layers: :attr:`StepObserver.layers`; kernels: :attr:`StepObserver.kernels`.

    Returns:
        ``({phase: {kind: {"built", "signature", "launches", "min", "kernels"}}}, mismatches)``; kernel names are cut
        to 160 characters (FA3's template names run to thousands).
    """
    import re

    want = gpu_kernel_expectations(built)
    checked: Dict[str, Any] = {}
    mm: List[str] = []
    for phase in ("prefill", "decode"):
        got = kernels.get(phase)
        if got is None:
            continue  # phase not profiled (e.g. max_tokens=1: no decode step)
        checked[phase] = {}
        for kind, (what, regex) in want.items():
            need = int(layers.get(kind, 1)) if kind in ("attention", "moe") else 1
            if regex is None:
                mm.append(f"{phase}: {kind} runs {what}, for which no device kernel signature is known")
                checked[phase][kind] = {"built": what, "signature": None, "launches": 0, "min": need, "kernels": {}}
                continue
            pat = re.compile(regex, re.I)
            hits = {n: c for n, c in got.items() if pat.search(n)}
            n = sum(hits.values())
            names: Dict[str, int] = {}
            for k, c in hits.items():
                short = k if len(k) <= 160 else k[:157] + "..."
                names[short] = names.get(short, 0) + c
            checked[phase][kind] = {"built": what, "signature": regex, "launches": n, "min": need, "kernels": names}
            if n < need:
                mm.append(f"{phase}: {kind} ({what}) launched {n} kernels matching {regex!r}, expected >= {need}"
                          + ("" if got else " (the profile holds no device kernels)"))
    return checked, mm


class StepObserver:
    """Watches an in-process vLLM engine step by step: prefill/decode token counts per request (from each
    ``SchedulerOutput``, every step), per-phase call counts of the attention, MoE and linear layers (forward hooks
    in the worker, on the first ``observe_steps`` steps of each phase) and the profiled ops (CPU) and device kernels
    (GPU) of the first prefill and the first decode step.

    A step is ``prefill`` when any request it schedules still has prompt tokens to compute, else ``decode``.
    Per request: ``prompt_tokens``, ``prefix_cached_tokens`` (computed before its first step, from vLLM's prefix
    cache), ``prefill_tokens`` / ``prefill_steps`` (tokens scheduled while the prompt was not yet computed) and
    ``decode_tokens`` / ``decode_steps`` (one token per step after that). For a 17-token prompt and 4 new tokens
    without a prefix-cache hit: prefill 17 tokens in 1 step (which also samples the first token), then 3 decode
    steps of 1 token.

    The layer hooks are removed once ``observe_steps`` steps of both phases were counted: a hooked module takes
    ``nn.Module``'s slow call path, a few microseconds per call, which on a GPU in eager mode (a decode step of a
    48-layer MoE is ~10 ms of kernel launches) would cost several percent of throughput on every step. The
    profiles are read only when :attr:`ops` / :attr:`kernels` are first used (after the generate call), so their
    processing is not part of the stage's generate time.

    Needs the engine core in this process (``VLLMAdapter(in_process=True)``).

    Args:
        profile: run ``torch.profiler`` over the first step of each phase.
        device_kind: ``cpu`` | ``cuda`` | ``rocm``: a GPU adds ``ProfilerActivity.CUDA`` (device kernel names).
        observe_steps: steps of each phase whose layer calls are counted (None: every step).
    """

    def __init__(self, llm: Any, profile: bool = True, device_kind: str = "cpu",
                 observe_steps: Optional[int] = 2) -> None:
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is None or not hasattr(core, "scheduler"):
            raise RuntimeError("StepObserver needs the in-process engine core (VLLMAdapter(in_process=True))")
        self.llm = llm
        self.scheduler = core.scheduler
        self.profile = profile
        self.device_kind = device_kind
        self.observe_steps = observe_steps
        self.phase: Optional[str] = None  # phase of the current step while its layer calls are counted
        self.steps = {"prefill": 0, "decode": 0}  # steps whose layer calls were counted
        self.steps_total = {"prefill": 0, "decode": 0}
        self.calls: Dict[str, Dict[str, int]] = {"prefill": {}, "decode": {}}
        self.layers: Dict[str, int] = {}
        self.requests: Dict[str, Dict[str, int]] = {}
        self._ops: Dict[str, Dict[str, int]] = {}
        self._kernels: Dict[str, Dict[str, int]] = {}
        self._profiled: set = set()
        self._pending: List[Tuple[str, Any]] = []
        self._prof = None
        self._prof_phase: Optional[str] = None
        self._orig = None
        self._handles: List[Any] = []
        #: seconds the observer itself spent inside the engine's steps (what it adds to the generate time)
        self.overhead_s = {"account": 0.0, "profile_start": 0.0, "profile_stop": 0.0}

    # hooks ------------------------------------------------------------------------------------------------
    def _install_hooks(self, model: Any) -> Dict[str, int]:
        from torch import nn

        def counter(kind: str) -> Callable[..., None]:
            def hook(module: Any, args: Any, output: Any) -> None:
                if self.phase is not None:
                    d = self.calls[self.phase]
                    d[kind] = d.get(kind, 0) + 1
            return hook

        layers: Dict[str, int] = {}
        for _name, m in model.named_modules():
            kind = None
            if hasattr(m, "attn_backend") and hasattr(m, "impl"):
                kind = "attention"
            elif type(m).__name__.endswith("SparseMoeBlock"):  # the MoE block (router + experts) of each layer
                kind = "moe"
            elif type(getattr(m, "quant_method", None)).__name__.endswith("LinearMethod"):
                kind = "linear"
            if kind is not None and isinstance(m, nn.Module):
                self._handles.append(m.register_forward_hook(counter(kind)))
                layers[kind] = layers.get(kind, 0) + 1
        return layers

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> StepObserver:
        self.layers = self.llm.apply_model(self._install_hooks)[0]
        self._orig = self.scheduler.schedule
        orig = self._orig

        def schedule(*args: Any, **kwargs: Any) -> Any:
            self._stop_profile()
            out = orig(*args, **kwargs)
            t0 = time.perf_counter()
            self._account(out)
            self.overhead_s["account"] += time.perf_counter() - t0
            return out

        self.scheduler.schedule = schedule
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_profile()
        if self._orig is not None and self.scheduler is not None:
            self.scheduler.schedule = self._orig
            self._orig = None
        self._remove_hooks()
        self.phase = None
        self._collect()
        # drop the engine: an observer kept for the evidence must not keep the model's weights on the device
        self.llm = None
        self.scheduler = None

    # accounting -------------------------------------------------------------------------------------------
    def _account(self, out: Any) -> None:
        if not out.num_scheduled_tokens:
            self.phase = None
            return
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        phase = "decode"
        for rid, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests.get(rid)
            n_prompt = int(getattr(req, "num_prompt_tokens", 0) or 0)
            rec = self.requests.setdefault(rid, {"prompt_tokens": n_prompt, "prefix_cached_tokens": computed.get(rid, 0),
                                                 "prefill_tokens": 0, "prefill_steps": 0, "decode_tokens": 0,
                                                 "decode_steps": 0})
            if computed.get(rid, 0) < n_prompt:
                rec["prefill_tokens"] += int(n)
                rec["prefill_steps"] += 1
                phase = "prefill"
            else:
                rec["decode_tokens"] += int(n)
                rec["decode_steps"] += 1
        self.steps_total[phase] += 1
        if self.observe_steps is None or self.steps[phase] < self.observe_steps:
            self.steps[phase] += 1
            self.phase = phase
        else:
            self.phase = None
            if self._handles and all(self.steps[p] >= self.observe_steps for p in self.steps):
                self._remove_hooks()
        if self.profile and phase not in self._profiled:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU]
            if self.device_kind in ("cuda", "rocm"):
                acts.append(ProfilerActivity.CUDA)
            t0 = time.perf_counter()
            self._profiled.add(phase)
            self._prof = profile(activities=acts)
            self._prof.__enter__()
            self._prof_phase = phase
            self.overhead_s["profile_start"] += time.perf_counter() - t0

    def _stop_profile(self) -> None:
        if self._prof is None:
            return
        t0 = time.perf_counter()
        prof, self._prof = self._prof, None
        if self.device_kind in ("cuda", "rocm"):
            import torch

            torch.cuda.synchronize()  # the step's kernels are in the trace
        prof.__exit__(None, None, None)  # events are parsed later (_collect), outside the generate call
        self._pending.append((self._prof_phase or "unknown", prof))
        self.overhead_s["profile_stop"] += time.perf_counter() - t0

    def _collect(self) -> None:
        """Parse the stopped profiles: CPU-side op names into :attr:`ops`, device kernels into :attr:`kernels`."""
        import torch

        pending, self._pending = self._pending, []
        for phase, prof in pending:
            ops: Dict[str, int] = {}
            kernels: Dict[str, int] = {}
            for ev in prof.events():
                bucket = ops if ev.device_type == torch.autograd.DeviceType.CPU else kernels
                bucket[ev.name] = bucket.get(ev.name, 0) + 1
            self._ops[phase] = ops
            self._kernels[phase] = kernels

    @property
    def ops(self) -> Dict[str, Dict[str, int]]:
        """``{phase: {op name: calls}}`` of the profiled steps (CPU-side ops: ``aten::``, ``_C::``, ``vllm::``)."""
        self._stop_profile()  # a profile opened by the last step of a call ends here (the engine is idle)
        self._collect()
        return self._ops

    @property
    def kernels(self) -> Dict[str, Dict[str, int]]:
        """``{phase: {device kernel name: launches}}`` of the profiled steps (empty on CPU)."""
        self._stop_profile()
        self._collect()
        return self._kernels

    def per_request(self) -> Dict[str, Dict[str, int]]:
        """Counts keyed by the request id ``LLM.generate`` reports (vLLM's internal ids add ``-<hash>``)."""
        return {rid.split("-")[0]: v for rid, v in self.requests.items()}


def decode_steps_ok(decode_steps: int, output_tokens: int, finish_reason: Optional[str], async_sched: bool) -> bool:
    """One decode step per output token after the first (the prefill step samples the first). Under async
    scheduling (vLLM's default on GPUs) a request's next step is scheduled before its last token is sampled: a
    request that stops (EOS / stop string) may have one more decode step, whose token vLLM discards
    (``v1/core/sched`` ``async_tokens_to_discard``); a length-limited one never does (vLLM does not schedule past
    ``max_tokens``)."""
    want = max(0, output_tokens - 1)
    extra = 1 if (async_sched and finish_reason == "stop") else 0
    return want <= decode_steps <= want + extra


def phase_calls(stage: str, obs: StepObserver) -> Tuple[Dict[str, Any], List[str]]:
    """Per phase (prefill, decode): the observed steps and layer calls against one call per layer per step;
    ``(evidence calls section, mismatches)``."""
    calls, mm = {}, []
    for phase in ("prefill", "decode"):
        steps = obs.steps[phase]
        got = obs.calls[phase]
        calls[phase] = {"steps": steps, "steps_total": obs.steps_total[phase], "calls": dict(got),
                        "expected_calls": {k: n * steps for k, n in obs.layers.items()}}
        for kind, n in obs.layers.items():
            if got.get(kind, 0) != n * steps:
                mm.append(f"stage {stage}, {phase}: {kind} layers ran {got.get(kind, 0)} times in {steps} "
                          f"steps, expected {n} layers x {steps}")
    return calls, mm


def cpu_ops_checked(stage: str, built: Mapping[str, Any], obs: StepObserver
                    ) -> Tuple[Dict[str, Dict[str, int]], List[str]]:
    """On CPU: the profiled calls of the op of what the worker built (:data:`CPU_OPS`), at least one per layer
    per phase; ``({phase: {op: calls}}, mismatches)``."""
    kernel = next((k.split("cpu_kernel=")[-1] for k in built["linear"]["layers"]), None)
    want_ops = {"attention": [CPU_OPS["attention"].get(b) for b in built["attention"]["backends"]],
                "moe": [CPU_OPS["moe"].get(b) for b in built["moe"]["backends"]],
                "linear": [CPU_OPS["linear"].get(kernel or "")]}
    found: Dict[str, Dict[str, int]] = {}
    mm: List[str] = []
    for phase, ops in obs.ops.items():
        found[phase] = {}
        for kind, names in want_ops.items():
            for name in names:
                n = ops.get(name, 0) if name else 0
                found[phase][name or f"<no known op for {kind}>"] = n
                if n < obs.layers.get(kind, 1):
                    mm.append(f"stage {stage}, {phase}: profiled {n} calls of {name or 'a known op'} for {kind} "
                              f"({built[kind].get('backends') or built[kind].get('methods')}), expected >= "
                              f"{obs.layers.get(kind, 1)}")
    return found, mm


def request_mismatches(stage: str, records: Sequence[Mapping[str, Any]], async_sched: bool) -> List[str]:
    """Per request (its first output): prefill covered the prompt (``prefill_tokens + prefix_cached_tokens ==
    prompt_tokens``) and the decode steps match the output tokens (:func:`decode_steps_ok`)."""
    mm = []
    for r in records:
        t = r.get("tokens")
        if r["index"] != 0:
            continue
        if not t:
            mm.append(f"stage {stage}, request {r['id']}: no scheduler record")
            continue
        if t["prefill_tokens"] + t["prefix_cached_tokens"] != t["prompt_tokens"] or \
                t["prompt_tokens"] != len(r["prompt_token_ids"]):
            mm.append(f"stage {stage}, request {r['id']}: prefill covered {t['prefill_tokens']} + "
                      f"{t['prefix_cached_tokens']} cached of {len(r['prompt_token_ids'])} prompt tokens")
        if r["sampling"].get("n", 1) == 1 and not decode_steps_ok(t["decode_steps"], len(r["output_token_ids"]),
                                                                  r.get("finish_reason"), async_sched):
            mm.append(f"stage {stage}, request {r['id']}: {t['decode_steps']} decode steps for "
                      f"{len(r['output_token_ids'])} output tokens (expected one per token after the first"
                      + (", plus at most one discarded step after a stop under async scheduling"
                         if async_sched else "") + ")")
    return mm
