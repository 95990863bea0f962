"""Attention backends wired into diffusers models, with per-call-site observation.

Wiring uses diffusers' own attention dispatcher (``diffusers.models.attention_dispatch``): every attention module
of a diffusers transformer owns a processor whose ``_attention_backend`` names the diffusers backend that
``dispatch_attention_fn`` calls. We set it per module (so roles can differ), exactly as
``ModelMixin.set_attention_backend`` does for a whole model.

What each backend is wired to comes from its record in ``runner.kernels.registry`` (``Backend.diffusers``, a
``DiffusersWiring``): a diffusers backend value, or a kernel of ours. Kernels diffusers does not ship (FlashInfer
prefill, SageAttention 1.x, FA4 on Blackwell, out-of-tree kernels) ride on the ``native`` entry: the observing
wrapper we put around each registered diffusers backend calls our kernel instead when the current call site
selected it.

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

from runner.kernels.registry import BackendUnavailableError, DiffusersWiring, observed_name

_CURRENT: contextvars.ContextVar[Optional["AttentionSite"]] = contextvars.ContextVar("runner_attention_site",
                                                                                    default=None)


class AttentionWiringError(BackendUnavailableError, RuntimeError):
    """A selected attention backend cannot be wired into this model here (raised at startup, before weights load).

    A refusal exactly like :class:`~runner.kernels.registry.BackendUnavailableError` (outcome ``refused``, exit 2): the
    backend passed the registry's capability checks but has no wiring into diffusers models (``TRTLLM_ATTN``), or
    diffusers' own requirement check refuses the installed package. ``RuntimeError`` stays a base for callers that
    caught it before.
    """


@dataclass
class AttentionSite:
    """One attention call site of a stage's model.

    Attributes:
        stage, role, layer: where it is (``layer`` is the module path, e.g. ``transformer_blocks.0.attn``).
        resolved: canonical backend the resolution selected for this site.
        observed: canonical (or ``diffusers:<name>``) backend -> number of calls observed executing here.
        custom: our kernel attached to this site (None: diffusers' implementation of the processor's backend).
        observing: the probe counts calls here.
        carrier: the diffusers dispatcher entry whose observing wrapper calls ``custom`` instead.
        per_forward: dispatcher calls one denoiser forward makes here (2 for a Wan 2.1 image-to-video cross-attention:
            its text keys and its image keys, ``WanAttnProcessor``'s two ``dispatch_attention_fn`` calls).
        expert: the denoiser component the site belongs to, for a stage with several (Wan 2.2 A14B's
            ``transformer`` and ``transformer_2``): it runs once per forward of that expert; empty: the only one.
    """

    stage: str
    role: str
    layer: str
    resolved: str
    observed: Counter = field(default_factory=Counter)
    custom: Optional[Callable[..., torch.Tensor]] = None
    observing: bool = True
    carrier: str = "native"
    per_forward: int = 1
    expert: str = ""


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
    if attn_mask is not None or dropout_p:
        raise ValueError("SAGE_ATTN was called with a mask or dropout it cannot honour")
    return sage_op(query, key, value, is_causal, scale)


def _sage_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
               scale: Optional[float]) -> torch.Tensor:
    from sageattention import sageattn

    out = sageattn(query, key, value, tensor_layout="NHD", is_causal=is_causal, sm_scale=scale)
    return out.to(query.dtype).contiguous()


def _sage_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
               scale: Optional[float]) -> torch.Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


# Opaque to torch.compile, like SAGE2 below: traced through, sageattn 1.x's Python (per-call mean of K, Triton launch
# grids from shapes) recompiled compiled blocks after the warm-up on the H200 (6 graphs for tiny_flux with FP8,
# tests/test_gpu_e2e.py::test_compile_regional_verified_from_kernels_without_recompiles, 2026-12-01).
sage_op = torch.library.custom_op("runner::sage_attention", _sage_impl, mutates_args=(), device_types="cuda")
sage_op.register_fake(_sage_fake)


def _sage2_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    from sageattention import sageattn_qk_int8_pv_fp8_cuda_sm90

    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))  # its assert
    out = sageattn_qk_int8_pv_fp8_cuda_sm90(query, key, value, tensor_layout="NHD", is_causal=False, sm_scale=scale,
                                            qk_quant_gran="per_thread", pv_accum_dtype="fp32+fp32")
    return out.to(query.dtype).contiguous()


def _sage2_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    # contiguous like the real output (empty_like would copy the strides of a transposed query view)
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


# One opaque op for torch.compile: sageattention's function calls pybind extensions (``_fused``) and
# ``torch.cuda.set_device``, each a graph break inside a compiled block; as a custom op the block stays one graph.
sage2_op = torch.library.custom_op("runner::sage2_sm90_attention", _sage2_impl, mutates_args=(),
                                   device_types="cuda")
sage2_op.register_fake(_sage2_fake)


def sage2_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: Optional[float] = None, return_lse: bool = False, **_: Any) -> torch.Tensor:
    """SageAttention 2 on Hopper, ``sageattn_qk_int8_pv_fp8_cuda_sm90``: Q and K quantized to INT8 per thread
    (K smoothed by its mean over the sequence), P and V in FP8 e4m3 (V scaled per channel), FP32 accumulation of
    P·V (``pv_accum_dtype="fp32+fp32"``), wgmma kernels (``qk_int8_sv_f8_attn_kernel``) built for sm_90a.

    Installed as diffusers' ``_sage_qk_int8_pv_fp8_cuda_sm90`` dispatcher entry (the same function, run as the
    custom op ``runner::sage2_sm90_attention`` so compiled blocks do not break around it).

    Args:
        query, key, value: ``(batch, seq_len, heads, head_dim)``, fp16/bf16, CUDA (sm90); head_dim 64 or 128 (the
            instantiations of the build; others are padded by sageattention up to 128).

    Returns:
        ``(batch, seq_len, heads, head_dim)`` in the query dtype.

    Raises:
        ValueError: a mask, dropout, causal masking or the log-sum-exp was asked for (none is built or wired).
    """
    if attn_mask is not None or dropout_p or is_causal or return_lse:
        raise ValueError("SAGE2_ATTN was called with a mask, dropout, causal masking or return_lse, which it does "
                         "not run")
    return sage2_op(query, key, value, scale)


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


def _diffusers_can(dname: str) -> Optional[str]:
    """None when diffusers can run backend ``dname`` here, else diffusers' reason."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(dname))
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def choose_flash(platform_sm: Optional[int]) -> Optional[DiffusersWiring]:
    """FLASH_ATTN's per-device wiring (``DiffusersWiring.choose``): FA4 (:func:`flash4_attention`) on sm100+, where
    FA2/FA3 wheels do not run and the registry demanded FA4; diffusers' ``_flash_3`` on sm90 when
    ``flash_attn_interface`` (FA3) imports; else None (diffusers' ``flash``, FA2)."""
    from runner.kernels import registry as reg

    if platform_sm is not None and platform_sm >= 100:
        return DiffusersWiring("native", kernel=flash4_attention)
    if platform_sm == 90 and reg.has_symbol("flash_attn_interface:flash_attn_func"):
        return DiffusersWiring("_flash_3")
    return None


def choose_sage(platform_sm: Optional[int]) -> Optional[DiffusersWiring]:
    """SAGE_ATTN's wiring (``DiffusersWiring.choose``): diffusers' own ``sage`` when its requirement check accepts
    the installed package (it wants sageattention >= 2.1.1), else our :func:`sage_attention` over 1.x as the
    function of diffusers' ``_sage_qk_int8_pv_fp16_triton`` entry."""
    if _diffusers_can("sage") is None:
        return None
    # diffusers' Triton entry, owned by our op (:func:`_own_entry`): sites need no routing hook, so compiled
    # blocks do not break around the call
    return DiffusersWiring("_sage_qk_int8_pv_fp16_triton", kernel=sage_attention)


def plan(name: str, platform_sm: Optional[int] = None) -> Tuple[str, Optional[Callable[..., torch.Tensor]]]:
    """How backend ``name`` is wired, from its registry record: ``(diffusers backend value, our kernel or None)``.
    No weights needed, so the runner calls it at startup.

    Args:
        platform_sm: compute capability (None off CUDA), for the record's per-device ``choose``.

    Raises:
        AttentionWiringError: the record has no diffusers wiring (TRTLLM_ATTN), its kernel does not import, or
        diffusers' own requirement check refuses the installed package for its backend.
    """
    from runner.kernels import registry as reg

    record = reg.get("attention", name)
    if record.diffusers is None:
        # requirement-free fallbacks last: "CUDNN_ATTN, ..., FLASHINFER_ATTN or TORCH_SDPA"
        names = sorted(reg.wired("attention", "diffusers"), key=lambda n: not reg.get("attention", n).requires)
        raise AttentionWiringError(f"{name} is not wired into diffusers models yet; fix: choose "
                                   f"{', '.join(names[:-1])} or {names[-1]}")
    wiring = record.diffusers.for_device(platform_sm)
    if wiring.kernel is not None:
        try:
            return wiring.backend, reg.load_object(wiring.kernel)
        except (ImportError, AttributeError) as e:
            raise AttentionWiringError(f"{name}: its kernel {wiring.kernel!r} does not import: {e}") from None
    why = _diffusers_can(wiring.backend)
    if why:
        raise AttentionWiringError(f"{name}: diffusers refused backend {wiring.backend!r}: {why}")
    return wiring.backend, None


def _observing(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def observed(*args: Any, **kwargs: Any) -> torch.Tensor:
        site = _CURRENT.get()
        if site is not None:
            if site.custom is not None and name == site.carrier:
                site.observed[site.resolved] += 1  # a kernel is attached only to sites resolved to its backend
                return site.custom(*args, **kwargs)
            site.observed[observed_name(name)] += 1
        return fn(*args, **kwargs)

    observed.__wrapped__ = fn  # type: ignore[attr-defined]
    observed._runner_observed = True  # type: ignore[attr-defined]
    return observed


def _own_entry(entry: str, kernel: Callable[..., torch.Tensor]) -> None:
    """Make our ``kernel`` the function of diffusers' dispatcher entry ``entry`` (a backend whose wiring names a
    dedicated entry and a kernel: the entry runs the same library function, made opaque to torch.compile). The
    call sites then need no probe to route them (under compile none is installed); the observing wrapper, when
    observation is on, reports the entry as the backend that owns it. Idempotent."""
    from diffusers.models.attention_dispatch import AttentionBackendName
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as R

    name = AttentionBackendName(entry)
    current = R._backends.get(name)
    inner = getattr(current, "__wrapped__", current)
    if getattr(inner, "_runner_kernel", None) is kernel:
        return

    def entry_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
                 return_lse: bool = False, _parallel_config: Any = None, **kw: Any) -> torch.Tensor:
        return kernel(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                      return_lse=return_lse)

    entry_fn._runner_kernel = kernel  # type: ignore[attr-defined]
    R._backends[name] = entry_fn


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
        sites: ``(role, layer_name, module)`` from the model engine.
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
    for role, (dname, custom) in list(plans.items()):
        if custom is not None and dname != "native":  # a dedicated entry: only this backend's sites call it
            _own_entry(dname, custom)
            plans[role] = (dname, None)
    if observe or any(custom is not None for _, custom in plans.values()):
        _patch_dispatcher()
    out: List[AttentionSite] = []
    for role, layer, module in sites:
        dname, custom = plans[role]
        module.processor._attention_backend = AttentionBackendName(dname)
        site = AttentionSite(stage=stage, role=role, layer=layer, resolved=selected[role]["backend"], custom=custom,
                             observing=observe, carrier=dname)
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
