"""Backend registry: canonical names, aliases, requirements, capability checks and ``auto`` selection.

Three fields are selectable per stage: ``attention``, ``linear`` and ``moe``. Each backend declares what it needs
(platform kind, compute capability, package and the exact symbol, dtypes, head_dim, mask support, sequence
parallelism) and :func:`check` tests those needs against the live platform and the model's shape. An explicit
choice that fails a check raises :class:`BackendUnavailableError` at startup, before weights load; only ``auto``
chooses, and :func:`auto_select` returns the reason with the choice.

Sources of the numeric rules:
  * cuDNN SDPA: head_dim <= 256 and a multiple of 8, fp16/bf16 only (cuDNN frontend SDPA support matrix).
  * FlashInfer prefill: head_dim in {64, 128, 256} (its compiled kernel instantiations).
  * trtllm-gen FMHA (FlashInfer ``trtllm_batch_context_with_kv_cache``): sm100/sm103 cubins, head_dim 128.
  * flash-attn FA2: sm80+, head_dim <= 256; FA3 (``flash_attn_interface``): sm90 only; FA4 (``flash_attn.cute``):
    sm100+. An FA2/FA3 wheel is not FA4 on Blackwell.
  * SageAttention 1.x (Triton): head_dim in {64, 96, 128}, fp16/bf16, sm80+; INT8 Q/K in blocks of 128/64.
  * FP8 GEMM (``torch._scaled_mm``): sm89+ (Ada/Hopper FP8 tensor cores), K and N multiples of 16.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

FIELDS = ("attention", "linear", "moe")
AUTO = "auto"


class BackendError(ValueError):
    """Base class of backend selection errors."""


class UnknownBackendError(BackendError):
    """A backend name that normalizes to no known backend (lists the valid names and the closest match)."""


class BackendUnavailableError(BackendError):
    """An explicitly selected backend cannot run here; the message names each unmet requirement."""


class BackendSpecError(BackendError):
    """A per-role attention spec (``quant``/``skip_softmax``) that the backend does not take, or a bad value."""


@dataclass(frozen=True)
class SelectionContext:
    """What a capability check knows about the place a backend would run.

    Attributes:
        platform_kind: ``cpu`` | ``cuda`` | ``rocm`` | ``xpu`` | ``npu`` | ``mps``.
        sm: compute capability as an integer (90 = sm90), None off CUDA.
        dtype: model compute dtype.
        head_dim: attention head dimension of the stage's model (elements).
        needs_mask: the model's attention path passes a mask (FLUX: no).
        sequence_parallel: the stage shards the sequence across devices.
    """

    platform_kind: str
    sm: Optional[int] = None
    dtype: torch.dtype = torch.float32
    head_dim: Optional[int] = None
    needs_mask: bool = False
    sequence_parallel: bool = False


def has_symbol(path: str) -> bool:
    """True when ``module.sub:attr`` (or a bare module) imports and has the attribute."""
    mod, _, attr = path.partition(":")
    if importlib.util.find_spec(mod.split(".")[0]) is None:
        return False
    try:
        m = importlib.import_module(mod)
    except Exception:  # a broken install is not an install
        return False
    return not attr or hasattr(m, attr)


@dataclass(frozen=True)
class Backend:
    """One selectable implementation.

    Attributes:
        field: ``attention`` | ``linear`` | ``moe``.
        name: canonical spelling stored everywhere (``TORCH_SDPA``).
        aliases: other accepted spellings (normalized: case-insensitive, ``-`` == ``_``).
        platforms: platform kinds it runs on.
        min_sm / sm_allowed: compute capability floor, or the exact set of allowed sm values.
        symbols: ``module:attr`` that must import (the exact entry point the implementation calls).
        dtypes: allowed compute dtypes (None: any).
        head_dims / max_head_dim / head_dim_multiple: head_dim rules (attention).
        supports_mask / supports_sequence_parallel: capability flags.
        quant_keys / skip_softmax_keys: spec keys the backend takes (others are errors).
    """

    field: str
    name: str
    aliases: Tuple[str, ...] = ()
    platforms: Tuple[str, ...] = ("cpu", "cuda", "rocm", "xpu", "npu", "mps")
    min_sm: Optional[int] = None
    sm_allowed: Optional[Tuple[int, ...]] = None
    symbols: Tuple[str, ...] = ()
    symbol_alternatives: Tuple[Tuple[str, ...], ...] = ()
    dtypes: Optional[Tuple[torch.dtype, ...]] = None
    head_dims: Optional[Tuple[int, ...]] = None
    max_head_dim: Optional[int] = None
    head_dim_multiple: Optional[int] = None
    supports_mask: bool = True
    supports_sequence_parallel: bool = True
    quant_keys: Dict[str, Any] = field(default_factory=dict)
    skip_softmax_keys: Tuple[str, ...] = ()
    extra_check: Optional[Callable[["SelectionContext"], List[str]]] = None

    def unmet(self, ctx: SelectionContext) -> List[str]:
        """Every requirement not met in ``ctx``, as human-readable reasons (empty: it can run)."""
        why: List[str] = []
        if ctx.platform_kind not in self.platforms:
            why.append(f"needs platform {'/'.join(self.platforms)}, this is {ctx.platform_kind}")
            return why
        if self.sm_allowed is not None and ctx.sm not in self.sm_allowed:
            why.append(f"needs compute capability {' or '.join(f'sm{s}' for s in self.sm_allowed)}, "
                       f"this device is {'sm%d' % ctx.sm if ctx.sm else 'not a CUDA GPU'}")
        elif self.min_sm is not None and (ctx.sm is None or ctx.sm < self.min_sm):
            why.append(f"needs compute capability >= sm{self.min_sm}, this device is "
                       f"{'sm%d' % ctx.sm if ctx.sm else 'not a CUDA GPU'}")
        for sym in self.symbols:
            if not has_symbol(sym):
                pkg = sym.split(":")[0].split(".")[0]
                why.append(f"needs `{sym.replace(':', '.')}`" + (f" (package `{pkg}` is not installed)"
                                                                  if importlib.util.find_spec(pkg) is None else
                                                                  " (the installed package lacks it)"))
        if self.dtypes is not None and ctx.dtype not in self.dtypes:
            why.append(f"needs dtype {'/'.join(str(d).replace('torch.', '') for d in self.dtypes)}, "
                       f"the model runs in {str(ctx.dtype).replace('torch.', '')}")
        if ctx.head_dim is not None:
            if self.head_dims is not None and ctx.head_dim not in self.head_dims:
                why.append(f"needs head_dim in {set(self.head_dims)}, the model has head_dim {ctx.head_dim}")
            if self.max_head_dim is not None and ctx.head_dim > self.max_head_dim:
                why.append(f"needs head_dim <= {self.max_head_dim}, the model has head_dim {ctx.head_dim}")
            if self.head_dim_multiple and ctx.head_dim % self.head_dim_multiple:
                why.append(f"needs head_dim a multiple of {self.head_dim_multiple}, the model has {ctx.head_dim}")
        if ctx.needs_mask and not self.supports_mask:
            why.append("cannot honour an attention mask, and this model's attention passes one")
        if ctx.sequence_parallel and not self.supports_sequence_parallel:
            why.append("does not support sequence parallelism")
        if self.extra_check is not None:
            why.extend(self.extra_check(ctx))
        return why


_HALF = (torch.float16, torch.bfloat16)


def _flash_check(ctx: SelectionContext) -> List[str]:
    """flash-attn generation must match the GPU: FA4 (flash_attn.cute) on sm100+, FA2/FA3 below."""
    if ctx.sm is not None and ctx.sm >= 100 and not has_symbol("flash_attn.cute:flash_attn_func"):
        return ["on Blackwell (sm100+) needs FA4 `flash_attn.cute.flash_attn_func`; FA2/FA3 wheels are not FA4"]
    if ctx.sm is not None and ctx.sm < 100 and not (has_symbol("flash_attn:flash_attn_func")
                                                    or has_symbol("flash_attn_interface:flash_attn_func")):
        return ["needs `flash_attn.flash_attn_func` (FA2) or `flash_attn_interface.flash_attn_func` (FA3) "
                "(package `flash-attn` is not installed)"]
    return []


BACKENDS: Dict[str, Dict[str, Backend]] = {f: {} for f in FIELDS}


def register(b: Backend) -> Backend:
    """Add a backend to the registry (its canonical name and aliases must be unique within its field)."""
    BACKENDS[b.field][b.name] = b
    return b


register(Backend("attention", "TORCH_SDPA", aliases=("sdpa", "torch", "torch_sdpa", "native")))
register(Backend("attention", "CUDNN_ATTN", aliases=("cudnn", "cudnn_attention"), platforms=("cuda",), min_sm=80,
                 symbols=("torch.nn.attention:SDPBackend",), dtypes=_HALF, max_head_dim=256, head_dim_multiple=8))
register(Backend("attention", "FLASH_ATTN", aliases=("flash", "flash_attention", "fa"), platforms=("cuda",),
                 min_sm=80, dtypes=_HALF, max_head_dim=256, head_dim_multiple=8, supports_mask=False,
                 extra_check=_flash_check))
register(Backend("attention", "SAGE_ATTN", aliases=("sage", "sageattention", "sage_attention"),
                 platforms=("cuda",), min_sm=80, symbols=("sageattention:sageattn",), dtypes=_HALF,
                 head_dims=(64, 96, 128), supports_mask=False,
                 quant_keys={"dtype_qk": ("int8",), "q_block_size": (128,), "k_block_size": (64,)}))
register(Backend("attention", "FLASHINFER_ATTN", aliases=("flashinfer", "flashinfer_attention"),
                 platforms=("cuda",), min_sm=80, symbols=("flashinfer.prefill:single_prefill_with_kv_cache",),
                 dtypes=_HALF, head_dims=(64, 128, 256), supports_mask=False, supports_sequence_parallel=False))
register(Backend("attention", "TRTLLM_ATTN", aliases=("trtllm", "trtllm_gen", "trtllm_attention"),
                 platforms=("cuda",), sm_allowed=(100, 103),
                 symbols=("flashinfer.prefill:trtllm_batch_context_with_kv_cache",), dtypes=_HALF,
                 head_dims=(128,), supports_mask=False, supports_sequence_parallel=False,
                 skip_softmax_keys=("threshold", "target_sparsity", "disabled_until_timestep")))
register(Backend("linear", "TORCH", aliases=("torch", "dense", "bf16")))
register(Backend("linear", "FP8", aliases=("fp8", "fp8_dynamic", "fp8_rowwise"), platforms=("cuda",), min_sm=89,
                 symbols=("torch:_scaled_mm",), dtypes=_HALF))
register(Backend("moe", "TORCH", aliases=("torch", "reference", "loop")))
register(Backend("moe", "TRITON", aliases=("triton", "fused", "grouped"), platforms=("cuda", "rocm"),
                 min_sm=80, symbols=("triton:jit",)))


def _key(s: str) -> str:
    return s.strip().lower().replace("-", "_")


def normalize(field_name: str, value: Any, where: Optional[str] = None) -> str:
    """Canonical spelling of a backend name, or ``auto``.

    Case-insensitive, ``-`` and ``_`` equivalent, aliases accepted: ``normalize("attention", "torch-sdpa")`` ->
    ``"TORCH_SDPA"``.

    Args:
        where: the config key the value came from, for the error message (default ``backend.<field>``).

    Raises:
        UnknownBackendError: listing the valid names and the closest match.
    """
    where = where or f"backend.{field_name}"
    if field_name not in BACKENDS:
        raise UnknownBackendError(f"unknown backend field {field_name!r}; valid fields: {', '.join(FIELDS)}")
    if not isinstance(value, str):
        raise UnknownBackendError(f"{where}={value!r} is not a name")
    k = _key(value)
    if k == AUTO:
        return AUTO
    table: Dict[str, str] = {}
    for b in BACKENDS[field_name].values():
        for a in (b.name, *b.aliases):
            table[_key(a)] = b.name
    if k in table:
        return table[k]
    valid = sorted(BACKENDS[field_name]) + [AUTO]
    close = difflib.get_close_matches(k, list(table), n=1, cutoff=0.4)
    hint = f"; closest match: {table[close[0]]}" if close else ""
    raise UnknownBackendError(f"{where}={value!r} is not a known backend{hint}; "
                              f"valid names: {', '.join(valid)} (aliases: "
                              f"{', '.join(sorted(a for b in BACKENDS[field_name].values() for a in b.aliases))})")


def get(field_name: str, name: str) -> Backend:
    """The registered backend of a canonical name."""
    return BACKENDS[field_name][name]


def check(field_name: str, name: str, ctx: SelectionContext, where: str = "") -> None:
    """Fail closed: raise unless backend ``name`` can run in ``ctx``.

    Raises:
        BackendUnavailableError: naming the backend, where it was requested and every unmet requirement.
    """
    why = get(field_name, name).unmet(ctx)
    if why:
        raise BackendUnavailableError(
            f"{where or 'backend.' + field_name}={name} cannot run here: " + "; ".join(why)
            + f". Fix: choose another backend (or `auto`) for {where or 'backend.' + field_name}.")


# Auto order per platform (first that passes its checks wins). Measured on the H200 at the FLUX 1024 shape:
# cuDNN SDPA 654 TFLOP/s vs FA2 331 (shared/reference/h200_measured.json).
_AUTO_ATTENTION: Dict[str, Sequence[Tuple[str, str]]] = {
    "sm100": (("TRTLLM_ATTN", "trtllm-gen FMHA is the fastest Blackwell datacenter kernel for head_dim 128 without "
                              "masks"), ("CUDNN_ATTN", "cuDNN SDPA supports the shape"),
              ("TORCH_SDPA", "no specialised kernel fits")),
    "sm120": (("CUDNN_ATTN", "cuDNN SDPA supports the shape"), ("FLASHINFER_ATTN", "FlashInfer prefill installed"),
              ("TORCH_SDPA", "no specialised kernel fits")),
    "cuda": (("CUDNN_ATTN", "cuDNN SDPA supports the shape (654 vs 331 TFLOP/s for FA2 at FLUX 1024^2 on H200)"),
             ("FLASH_ATTN", "flash-attn installed and cuDNN does not fit"),
             ("TORCH_SDPA", "no specialised kernel fits")),
    "other": (("TORCH_SDPA", "the only attention backend on this platform"),),
}


def auto_select(field_name: str, ctx: SelectionContext, wired: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """Choose a backend for ``auto`` and say why.

    Args:
        wired: the backends the stage's engine can run (None: all). Auto never picks one outside it.

    Returns:
        ``(canonical_name, reason)``; the reason lists the candidates that were skipped and why.
    """
    if field_name == "attention":
        if ctx.platform_kind == "cuda" and ctx.sm in (100, 103):
            order = _AUTO_ATTENTION["sm100"]
        elif ctx.platform_kind == "cuda" and ctx.sm is not None and ctx.sm >= 120:
            order = _AUTO_ATTENTION["sm120"]
        elif ctx.platform_kind == "cuda":
            order = _AUTO_ATTENTION["cuda"]
        else:
            order = _AUTO_ATTENTION["other"]
    elif field_name == "linear":
        order = (("TORCH", "dense GEMM in the model dtype; FP8 is lossy and never chosen by auto"),)
    else:
        order = (("TRITON", "fused grouped-expert kernel on GPU"), ("TORCH", "reference expert loop"))
    skipped = []
    for name, reason in order:
        if wired is not None and name not in wired:
            skipped.append(f"{name}: not wired into this stage's engine")
            continue
        why = get(field_name, name).unmet(ctx)
        if not why:
            return name, reason + (f" (skipped: {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{name}: {', '.join(why)}")
    raise BackendUnavailableError(f"auto found no {field_name} backend: {'; '.join(skipped)}")


def validate_spec(name: str, spec: Dict[str, Any], where: str) -> None:
    """Validate ``quant`` and ``skip_softmax`` of an attention spec against what backend ``name`` takes.

    Raises:
        BackendSpecError: a key the backend does not take, a value outside its allowed set, or
        ``skip_softmax`` with both/neither of ``threshold`` and ``target_sparsity``.
    """
    b = get("attention", name)
    quant = spec.get("quant") or {}
    for k, v in quant.items():
        if k not in b.quant_keys:
            takes = ", ".join(b.quant_keys) or "no quant keys"
            raise BackendSpecError(f"{where}.quant.{k}: {name} does not take it ({name} takes: {takes})")
        if v not in b.quant_keys[k]:
            raise BackendSpecError(f"{where}.quant.{k}={v!r}: {name} supports {list(b.quant_keys[k])}")
    skip = spec.get("skip_softmax") or {}
    for k in skip:
        if k not in b.skip_softmax_keys:
            takes = ", ".join(b.skip_softmax_keys) or "no skip_softmax keys"
            raise BackendSpecError(f"{where}.skip_softmax.{k}: {name} does not take it ({name} takes: {takes})")
    if skip and (("threshold" in skip) == ("target_sparsity" in skip)):
        raise BackendSpecError(f"{where}.skip_softmax: set exactly one of threshold, target_sparsity")
