"""Attention backends wired into diffusers models, with per-call-site observation.

Wiring uses diffusers' own attention dispatcher (``diffusers.models.attention_dispatch``): every attention module
of a diffusers transformer owns a processor whose ``_attention_backend`` names the diffusers backend that
``dispatch_attention_fn`` calls. We set it per module (so roles can differ), exactly as
``ModelMixin.set_attention_backend`` does for a whole model.

Kernels diffusers does not ship (FlashInfer prefill) ride on the ``native`` entry: the observing wrapper we put
around each registered diffusers backend calls our kernel instead when the current call site selected it.

Observation: a forward pre-hook on each attention module marks the current call site (stage, role, layer) in a
context variable; the wrapper around each diffusers backend function records which backend actually ran at that
site. What is recorded is what executed, whatever the configuration said, including a processor changed after
startup or a library default picked up from the environment (``DIFFUSERS_ATTN_BACKEND``).

Tensor layout at the dispatcher: query/key/value ``(batch, seq_len, heads, head_dim)``; output the same.
"""

from __future__ import annotations

import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

# Canonical backend -> diffusers AttentionBackendName value (see ``plan`` for the ones diffusers may not run).
DIFFUSERS_BACKEND = {
    "TORCH_SDPA": "native",
    "CUDNN_ATTN": "_native_cudnn",
    "FLASH_ATTN": "flash",
    "SAGE_ATTN": "sage",
    "FLASHINFER_ATTN": "native",  # carrier: our kernel is called by the observing wrapper
}
# diffusers backend value -> canonical name, for what was observed (others are reported as ``diffusers:<value>``).
OBSERVED_NAME = {"native": "TORCH_SDPA", "_native_cudnn": "CUDNN_ATTN", "flash": "FLASH_ATTN", "_flash_3": "FLASH_ATTN",
                 "sage": "SAGE_ATTN", "flash_4_hub": "FLASH_ATTN"}

_CURRENT: contextvars.ContextVar[Optional["AttentionSite"]] = contextvars.ContextVar("runner_attention_site",
                                                                                    default=None)


class AttentionWiringError(RuntimeError):
    """A selected attention backend could not be wired into the model (raised at startup)."""


@dataclass
class AttentionSite:
    """One attention call site of a stage's model.

    Attributes:
        stage, role, layer: where it is (``layer`` is the module path, e.g. ``transformer_blocks.0.attn``).
        resolved: canonical backend the resolution selected for this site.
        observed: canonical (or ``diffusers:<name>``) backend -> number of calls observed executing here.
    """

    stage: str
    role: str
    layer: str
    resolved: str
    observed: Counter = field(default_factory=Counter)
    custom: Optional[Callable[..., torch.Tensor]] = None
    observing: bool = True


def flashinfer_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                         scale: Optional[float] = None, **_: Any) -> torch.Tensor:
    """FlashInfer single-request prefill, looped over the batch.

    Args:
        query, key, value: ``(batch, seq_len, heads, head_dim)``, fp16/bf16, CUDA; head_dim in {64, 128, 256}.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``(batch, seq_len, heads, head_dim)``.

    Raises:
        ValueError: a mask or dropout was passed (FlashInfer is selected only for mask-free models).
    """
    from flashinfer.prefill import single_prefill_with_kv_cache

    if attn_mask is not None or dropout_p:
        raise ValueError("FLASHINFER_ATTN was called with a mask or dropout it cannot honour")
    outs = [single_prefill_with_kv_cache(query[b], key[b], value[b], causal=is_causal, sm_scale=scale)
            for b in range(query.shape[0])]
    return torch.stack(outs, 0)


def sage_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: Optional[float] = None, **_: Any) -> torch.Tensor:
    """SageAttention ``sageattn`` (1.x Triton: INT8 Q/K per block, FP16 P/V) on the NHD layout.

    Used when diffusers' own ``sage`` backend refuses the installed package (diffusers wants sageattention >= 2.1.1;
    1.0.6 is the pure-Triton release that installs everywhere).

    Args:
        query, key, value: ``(batch, seq_len, heads, head_dim)``, fp16/bf16, CUDA; head_dim in {64, 96, 128}.

    Returns:
        ``(batch, seq_len, heads, head_dim)`` in the query dtype.

    Raises:
        ValueError: a mask or dropout was passed.
    """
    from sageattention import sageattn

    if attn_mask is not None or dropout_p:
        raise ValueError("SAGE_ATTN was called with a mask or dropout it cannot honour")
    out = sageattn(query, key, value, tensor_layout="NHD", is_causal=is_causal, sm_scale=scale)
    return out.to(query.dtype)


def flash4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                     scale: Optional[float] = None, **_: Any) -> torch.Tensor:
    """FlashAttention-4 (``flash_attn.cute.flash_attn_func``, CuTe DSL) for Blackwell (sm100+).

    Args:
        query, key, value: ``(batch, seq_len, heads, head_dim)``, fp16/bf16, CUDA.

    Returns:
        ``(batch, seq_len, heads, head_dim)``.

    Raises:
        ValueError: a mask or dropout was passed.
    """
    from flash_attn.cute import flash_attn_func

    if attn_mask is not None or dropout_p:
        raise ValueError("FLASH_ATTN (FA4) was called with a mask or dropout it cannot honour")
    out = flash_attn_func(query, key, value, softmax_scale=scale, causal=is_causal)
    return out[0] if isinstance(out, tuple) else out


CUSTOM_KERNELS: Dict[str, Callable[..., torch.Tensor]] = {"FLASHINFER_ATTN": flashinfer_attention,
                                                          "SAGE_ATTN": sage_attention}


def _diffusers_can(dname: str) -> Optional[str]:
    """None when diffusers can run backend ``dname`` here, else diffusers' reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(dname))
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def plan(name: str, platform_sm: Optional[int] = None) -> Tuple[str, Optional[Callable[..., torch.Tensor]]]:
    """How backend ``name`` is wired: ``(diffusers backend value, our kernel or None)``. No weights needed, so the
    runner calls it at startup.

    Raises:
        AttentionWiringError: no wiring exists (TRTLLM_ATTN) or diffusers refuses the installed package.
    """
    if name not in DIFFUSERS_BACKEND:
        raise AttentionWiringError(f"{name} is not wired into diffusers models yet; fix: choose CUDNN_ATTN, "
                                   "FLASH_ATTN, SAGE_ATTN, FLASHINFER_ATTN or TORCH_SDPA")
    dname = DIFFUSERS_BACKEND[name]
    if name == "FLASH_ATTN" and platform_sm is not None and platform_sm >= 100:
        return "native", flash4_attention  # FA2/FA3 wheels do not run Blackwell; the registry demanded FA4
    if name == "FLASH_ATTN" and platform_sm == 90:
        from kernels.registry import has_symbol

        if has_symbol("flash_attn_interface:flash_attn_func"):
            dname = "_flash_3"
    if name == "SAGE_ATTN":
        if _diffusers_can("sage") is None:
            return "sage", None
        return "native", sage_attention
    if name in CUSTOM_KERNELS:
        return dname, CUSTOM_KERNELS[name]
    why = _diffusers_can(dname)
    if why:
        raise AttentionWiringError(f"{name}: diffusers refused backend {dname!r}: {why}")
    return dname, None


def _observing(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def observed(*args: Any, **kwargs: Any) -> torch.Tensor:
        site = _CURRENT.get()
        if site is not None:
            if site.custom is not None and name == "native":
                site.observed[_custom_name(site)] += 1
                return site.custom(*args, **kwargs)
            site.observed[OBSERVED_NAME.get(name, f"diffusers:{name}")] += 1
        return fn(*args, **kwargs)

    observed.__wrapped__ = fn  # type: ignore[attr-defined]
    observed._runner_observed = True  # type: ignore[attr-defined]
    return observed


def _custom_name(site: AttentionSite) -> str:
    return site.resolved  # a kernel of ours is attached to a site only for the backend resolved there


def _patch_dispatcher() -> None:
    """Wrap every registered diffusers attention backend once (idempotent)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R

    for name, fn in list(R._backends.items()):
        if not getattr(fn, "_runner_observed", False):
            R._backends[name] = _observing(getattr(name, "value", str(name)), fn)


def install(stage: str, sites: Iterable[Tuple[str, str, torch.nn.Module]],
            selected: Dict[str, Dict[str, Any]], platform_sm: Optional[int] = None,
            observe: bool = True) -> List[AttentionSite]:
    """Point every attention module at its role's selected backend and attach the call-site probe.

    Args:
        stage: stage name for the records.
        sites: ``(role, layer_name, module)`` from the model adapter.
        selected: ``{role: {backend, quant, skip_softmax}}`` from resolution.
        platform_sm: compute capability (picks FA3 over FA2 on sm90 when ``flash_attn_interface`` exists).
        observe: attach the call-site probes. Off under ``torch.compile`` (Python counters would be traced into
            the graph, not run per call); the profiler's kernel evidence covers compiled runs.

    Returns:
        One :class:`AttentionSite` per module, in model order.

    Raises:
        AttentionWiringError: a backend that has no wiring into diffusers models (TRTLLM_ATTN), or diffusers'
        own requirement check refused it.
    """
    from diffusers.models.attention_dispatch import AttentionBackendName

    plans = {role: plan(spec["backend"], platform_sm) for role, spec in selected.items()}
    if observe or any(custom is not None for _, custom in plans.values()):
        _patch_dispatcher()
    out: List[AttentionSite] = []
    for role, layer, module in sites:
        dname, custom = plans[role]
        module.processor._attention_backend = AttentionBackendName(dname)
        site = AttentionSite(stage=stage, role=role, layer=layer, resolved=selected[role]["backend"], custom=custom,
                             observing=observe)
        if observe or site.custom is not None:
            module.register_forward_pre_hook(_enter(site))
            module.register_forward_hook(_exit)
        out.append(site)
    return out


def _enter(site: AttentionSite) -> Callable:
    def hook(module: torch.nn.Module, args: Any) -> None:
        module._runner_token = _CURRENT.set(site)

    return hook


def _exit(module: torch.nn.Module, args: Any, output: Any) -> None:
    token = getattr(module, "_runner_token", None)
    if token is not None:
        _CURRENT.reset(token)
        module._runner_token = None
