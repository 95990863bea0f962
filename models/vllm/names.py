"""vLLM's backend names for an AR stage: vLLM's own lists of attention/MoE/linear names, their normalization,
which of them vLLM honours where (:func:`cuda_unhonoured`, :data:`CPU_ATTENTION`), and :class:`VLLMNames`, the
stage's name hooks for ``runner.core.resolve``.

Backend selection goes through vLLM's own engine arguments, never the environment (vLLM 0.32 has no
``VLLM_ATTENTION_BACKEND`` variable at all):

* attention: ``attention_config={"backend": NAME}`` (or the top-level ``attention_backend=NAME``; setting both
  raises ``ValueError: attention_backend and attention_config.backend are mutually exclusive``). NAME is a
  member name of ``vllm.v1.attention.backends.registry.AttentionBackendEnum`` (case-insensitive; ``auto``
  means automatic).
* linear / MoE: ``kernel_config={"moe_backend": NAME, "linear_backend": NAME}``; the valid names are the
  ``typing.Literal`` types ``vllm.config.kernel.MoEBackend`` / ``LinearBackend``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from runner.core.errors import UserInputError


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


def importable(mod: str) -> bool:
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
    has_fi = importable("flashinfer")
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
                    f"{vllm_version()} fused_moe/oracle/unquantized.py map_unquantized_backend)")
        return None
    if fld == "linear" and name != "torch":
        try:
            from vllm.model_executor.layers import utils as lu
        except Exception:  # noqa: BLE001
            lu = None
        fi_names = getattr(lu, "_FLASHINFER_BF16_BACKENDS", None) or {}
        if name in fi_names and has_fi:
            return None
        return (f"for unquantized weights vLLM {vllm_version()} ignores linear_backend={name!r} on CUDA (it runs "
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
        from runner.kernels import registry as reg

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
                                      f"{vllm_version()}): {', '.join(self._valid[fld])}; fix: {hint}")

    def check(self, fld: str, name: str, where: str) -> None:
        """Raise ``BackendUnavailableError`` when vLLM would not honour ``name`` here (see the class docstring)."""
        from runner.kernels import registry as reg

        if not self.on_cpu:
            why = cuda_unhonoured(fld, name, self.sm)
            if why:
                raise reg.BackendUnavailableError(f"{where}={name} cannot run here: {why}. Fix: {where}=auto"
                                                  + (" (or FLASH_ATTN)" if fld == "attention" else
                                                     " (or triton)" if fld == "moe" else " (or torch)") + ".")
            return
        why = None
        if fld == "attention" and name not in CPU_ATTENTION:
            why = (f"on CPU vLLM {vllm_version()} runs only {', '.join(CPU_ATTENTION)} for decoder attention and "
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


def vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``), for messages naming the behaviour of that version."""
    import vllm

    return vllm.__version__
