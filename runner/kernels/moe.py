"""MoE backends: ``TORCH`` (reference expert loop), ``TRITON`` (grouped-expert Triton kernels) and ``GROUPED_MM``
(torch's grouped GEMM, one per projection: :func:`moe_grouped_mm`).

Block: a standard top-k routed SwiGLU mixture of experts, as in Qwen3-MoE and Mixtral::

    logits  = x @ gate.weight.T                                   # (T, E)
    probs   = softmax(logits, dim=-1, dtype=float32)              # routing in fp32
    w, ids  = topk(probs, k)                                      # (T, k), (T, k)
    w       = w / w.sum(-1, keepdim=True)   if renormalize        # Qwen3-MoE norm_topk_prob / Mixtral
    y[t]    = sum_j w[t, j] * expert_{ids[t, j]}(x[t])
    expert_e(x) = (silu(x @ w_gate[e].T) * (x @ w_up[e].T)) @ w_down[e].T

Routing convention: Hugging Face transformers ``Qwen3MoeSparseMoeBlock`` (``modeling_qwen3_moe.py``: softmax in
``torch.float`` over all experts, ``torch.topk``, divide by the top-k sum when ``config.norm_topk_prob``) and
``MixtralSparseMoeBlock`` (``modeling_mixtral.py``: same, always renormalized). ``renormalize=False`` keeps the raw
softmax probabilities of the chosen experts (Qwen2-MoE / Qwen1.5-MoE style, ``norm_topk_prob=False``).

Weight layout (the ``nn.Linear`` convention, ``out x in``, stacked over experts):
    * ``w_gate``: ``(E, I, H)`` -- expert ``e``'s gate projection ``H -> I`` (HF ``experts[e].gate_proj.weight``).
    * ``w_up``:   ``(E, I, H)`` -- expert ``e``'s up projection ``H -> I`` (HF ``experts[e].up_proj.weight``).
    * ``w_down``: ``(E, H, I)`` -- expert ``e``'s down projection ``I -> H`` (HF ``experts[e].down_proj.weight``).
with ``H`` = hidden size, ``I`` = expert intermediate size, ``E`` = number of experts.

TRITON implementation (:func:`moe_triton`), in the style of vLLM's ``fused_moe``:
    1. routing in torch (fp32 softmax, top-k, renormalize);
    2. "align": the ``T*k`` token-expert assignments are sorted by expert and each expert's list is padded to a
       multiple of ``BLOCK_M`` with a sentinel (``T*k``), so every ``BLOCK_M`` block of the sorted list belongs to
       exactly one expert (``expert_ids[block]``) -- torch ops, one host sync for the number of blocks;
    3. Triton kernel 1: per (block of assignments, block of I): ``acc_g = A @ w_gate[e].T``,
       ``acc_u = A @ w_up[e].T`` (two fp32 accumulators sharing the A tile), ``h = silu(acc_g) * acc_u`` in fp32,
       stored in the input dtype to ``inter[T*k, I]`` at the assignment's flat index ``t*k + j``;
    4. Triton kernel 2: per (block of assignments, block of H): ``acc = inter[rows] @ w_down[e].T`` in fp32,
       multiplied by the assignment's routing weight (fp32), stored to ``out_k[T*k, H]``;
    5. combine: ``out_k.view(T, k, H).sum(1)`` in fp32, cast to the input dtype (deterministic, no atomics).
    ``H`` and ``I`` are compile-time constants of both kernels (one compile per model shape and block config;
    runtime loop bounds also break ``range`` in Triton 3.6's CPU interpreter); block sizes are all >= 16 (tl.dot).

GROUPED_MM implementation (:func:`moe_grouped_mm`): one sort of the assignments by expert, then one
``torch.nn.functional.grouped_mm`` per projection (gate and up fused into one when they are stored fused) and an
``index_add_`` combine; see the GROUPED_MM section below for what torch runs on each device.

The implementations count nothing themselves; :class:`SwiGLUMoE` counts which one its ``forward`` ran.

Diffusion models' MoE blocks (HiDream-I1) are wired by :func:`install` (bottom of this module): the stage's MoE
backend decides what computes the routed experts of every block, each block's forward records what actually did
(:class:`MoESite`), and :func:`block_parity` checks a kernel against the model's own loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

try:  # triton is optional: importing this module must work on a CPU-only machine without it
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except Exception as _e:  # noqa: BLE001 - a broken install is not an install
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    _TRITON_IMPORT_ERROR = _e

IMPLS = ("TORCH", "TRITON", "GROUPED_MM")


# ------------------------------------------------------------------------------------------------ routing


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing (Qwen3-MoE / Mixtral convention).

    Args:
        router_logits: ``(T, E)``, any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the chosen probabilities by their sum (``norm_topk_prob``).

    Returns:
        ``(weights, ids)``: ``(T, top_k)`` fp32 routing weights and ``(T, top_k)`` int64 expert ids, ordered by
        descending probability.

    Raises:
        ValueError: ``router_logits`` not 2-D, or ``top_k`` outside ``[1, E]``.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be (T, E), got shape {tuple(router_logits.shape)}")
    n_exp = router_logits.shape[1]
    if not 1 <= top_k <= n_exp:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={n_exp}]")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _check_shapes(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> Tuple[int, int, int, int]:
    """Validate the operand shapes; returns ``(T, H, I, E)``."""
    if x.dim() != 2:
        raise ValueError(f"x must be (T, H), got shape {tuple(x.shape)}")
    if w_gate.dim() != 3 or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate and w_up must both be (E, I, H), got {tuple(w_gate.shape)} and "
                         f"{tuple(w_up.shape)}")
    n_exp, inter, hidden = w_gate.shape
    if w_down.shape != (n_exp, hidden, inter):
        raise ValueError(f"w_down must be (E, H, I) = {(n_exp, hidden, inter)}, got {tuple(w_down.shape)}")
    if x.shape[1] != hidden:
        raise ValueError(f"x has hidden size {x.shape[1]}, the expert weights have H={hidden}")
    if router_logits.shape != (x.shape[0], n_exp):
        raise ValueError(f"router_logits must be (T, E) = {(x.shape[0], n_exp)}, got {tuple(router_logits.shape)}")
    return x.shape[0], hidden, inter, n_exp


# ------------------------------------------------------------------------------------------------ TORCH


def moe_reference(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Reference expert loop (the ``TORCH`` backend), as Hugging Face's ``Qwen3MoeSparseMoeBlock`` computes it.

    Routing in fp32 (:func:`route`); the weights are then cast to ``x.dtype`` and every expert's SwiGLU, the
    weighting and the ``index_add_`` combine run in ``x.dtype`` on ``x.device``. Called with fp32 operands (TF32
    off) it is the numerical oracle for the other implementations.

    Args:
        x: ``(T, H)`` tokens, any float dtype, any device.
        router_logits: ``(T, E)`` router logits (``x @ gate.weight.T``).
        w_gate: ``(E, I, H)``; w_up: ``(E, I, H)``; w_down: ``(E, H, I)`` -- same dtype and device as ``x``.
        top_k: experts per token.
        renormalize: renormalize the top-k routing weights to sum to 1.

    Returns:
        ``(T, H)`` in ``x.dtype``.

    Raises:
        ValueError: inconsistent shapes or ``top_k`` outside ``[1, E]``.
    """
    n_tok, hidden, _, n_exp = _check_shapes(x, router_logits, w_gate, w_up, w_down)
    weights, ids = route(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype)
    out = torch.zeros(n_tok, hidden, dtype=x.dtype, device=x.device)
    if n_tok == 0:
        return out
    # (E, k, T) one-hot; experts that no token chose are skipped (one host sync, as in HF's loop).
    expert_mask = F.one_hot(ids, num_classes=n_exp).permute(2, 1, 0)
    hit = torch.nonzero(expert_mask.sum(dim=(1, 2)) > 0).flatten().tolist()
    for e in hit:
        slot, tok = torch.where(expert_mask[e])
        xe = x[tok]
        h = F.silu(xe @ w_gate[e].t()) * (xe @ w_up[e].t())
        ye = (h @ w_down[e].t()) * weights[tok, slot, None]
        out.index_add_(0, tok, ye.to(x.dtype))
    return out


# ------------------------------------------------------------------------------------------------ TRITON

if HAS_TRITON:

    @triton.jit
    def _moe_gate_up_silu_kernel(
        x_ptr, wg_ptr, wu_ptr, inter_ptr, sorted_ids_ptr, expert_ids_ptr,
        num_valid, top_k, H: tl.constexpr, I: tl.constexpr,
        stride_xm, stride_xk,
        stride_we, stride_wn, stride_wk,
        stride_im, stride_in,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """inter[a, n] = silu(x[a // k] . w_gate[e, n]) * (x[a // k] . w_up[e, n]) for the BLOCK_M assignments
        ``a`` of block ``program_id(0)`` (all of expert ``e``) and the BLOCK_N columns ``n`` of ``program_id(1)``.
        w_gate/w_up share strides (both (E, I, H))."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(sorted_ids_ptr + offs_m)                   # flat assignment index t*k + j, or sentinel
        row_ok = assign < num_valid
        tok = (assign // top_k).to(tl.int64)                       # token row of x
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk                    # (BM, BK)
        w_off = e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk  # (BK, BN)
        g_ptrs = wg_ptr + w_off
        u_ptrs = wu_ptr + w_off

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = (k0 + offs_k) < H
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g += tl.dot(a, bg)
            acc_u += tl.dot(a, bu)
            a_ptrs += BLOCK_K * stride_xk
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk

        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u                  # silu(g) * u in fp32
        i_ptrs = inter_ptr + assign[:, None].to(tl.int64) * stride_im + offs_n[None, :] * stride_in
        tl.store(i_ptrs, h.to(inter_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _moe_down_kernel(
        inter_ptr, wd_ptr, out_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr,
        num_valid, H: tl.constexpr, I: tl.constexpr,
        stride_im, stride_ik,
        stride_we, stride_wn, stride_wk,
        stride_om, stride_on,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """out_k[a, n] = topk_w[a] * (inter[a] . w_down[e, n]) for the BLOCK_M assignments ``a`` of block
        ``program_id(0)`` (all of expert ``e``) and the BLOCK_N hidden columns ``n`` of ``program_id(1)``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        assign = tl.load(sorted_ids_ptr + offs_m)
        row_ok = assign < num_valid
        rows = assign.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = inter_ptr + rows[:, None] * stride_im + offs_k[None, :] * stride_ik                # (BM, BK)
        b_ptrs = wd_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_ok = (k0 + offs_k) < I
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, b)
            a_ptrs += BLOCK_K * stride_ik
            b_ptrs += BLOCK_K * stride_wk

        wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)     # fp32 routing weight of each assignment
        acc = acc * wt[:, None]
        o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Sort the token-expert assignments by expert and pad each expert's run to a multiple of ``block_m``.

    Args:
        ids: ``(T, k)`` expert ids; assignment ``a = t*k + j`` is ``ids.flatten()[a]``.
        num_experts: E.
        block_m: rows per block of the grouped GEMMs.

    Returns:
        ``(sorted_ids, expert_ids, num_blocks)``: ``sorted_ids`` ``(num_blocks * block_m,)`` int32 assignment
        indices, grouped by expert in ascending expert order (stable: ascending ``a`` within an expert), padded
        with the sentinel ``T*k``; ``expert_ids`` ``(num_blocks,)`` int32, the expert of each block. Experts
        with no assignment get no block.
    """
    flat = ids.flatten()
    num_valid = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)                     # (E,)
    padded = (counts + block_m - 1) // block_m * block_m                     # (E,)
    start_unpadded = torch.cumsum(counts, 0) - counts                        # first sorted position of expert e
    start_padded = torch.cumsum(padded, 0) - padded                          # first padded position of expert e
    order = torch.argsort(flat, stable=True)                                 # sorted position -> assignment
    sorted_exp = flat[order]
    rank = torch.arange(num_valid, device=flat.device) - start_unpadded[sorted_exp]
    dest = start_padded[sorted_exp] + rank
    total = int(padded.sum().item())                                         # host sync: grid size
    sorted_ids = torch.full((total,), num_valid, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    num_blocks = total // block_m
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                         padded // block_m, output_size=num_blocks)
    return sorted_ids, expert_ids, num_blocks


def _pick_blocks(num_valid: int, num_experts: int, hidden: int, inter: int) -> Dict[str, int]:
    """Block sizes (all >= 16 for tl.dot): small BLOCK_M when experts get few rows (decode), 64 otherwise."""
    per_expert = num_valid / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else (32 if per_expert <= 48 else 64)
    return {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def _triton_unavailable_reason(x: torch.Tensor) -> Optional[str]:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"   # Triton's CPU interpreter (debugging only)
    missing = []
    if not (x.is_cuda or interpret):
        missing.append(f"a CUDA/ROCm GPU tensor (got device {x.device.type!r})")
    if not HAS_TRITON:
        missing.append(f"the `triton` package (import failed: {_TRITON_IMPORT_ERROR!r})")
    if not missing:
        return None
    return ("MoE backend TRITON (moe_triton) needs " + " and ".join(missing)
            + "; use backend TORCH (moe_reference) on this device")


def moe_triton(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Grouped-expert Triton MoE (the ``TRITON`` backend); same contract as :func:`moe_reference`.

    Args:
        x: ``(T, H)`` bf16/fp16 CUDA tensor.
        router_logits: ``(T, E)`` any float dtype, same device.
        w_gate: ``(E, I, H)``; w_up: ``(E, I, H)``; w_down: ``(E, H, I)`` -- ``x.dtype``, same device; any
            strides (passed to the kernels).
        top_k: experts per token; renormalize: as :func:`route`.

    Returns:
        ``(T, H)`` in ``x.dtype``. GEMMs accumulate in fp32; the SwiGLU activation ``inter (T*k, I)`` and the
        per-assignment outputs are rounded to ``x.dtype``; the top-k combine sums in fp32.

    Raises:
        RuntimeError: ``x`` is not on a CUDA/ROCm device or ``triton`` is not importable (the message names
            which); ``TRITON_INTERPRET=1`` lifts the device requirement (Triton's CPU interpreter, for debugging).
        TypeError: ``x`` not bf16/fp16, or the weights not in ``x.dtype``.
        ValueError: inconsistent shapes or ``top_k`` outside ``[1, E]``.
    """
    why = _triton_unavailable_reason(x)
    if why:
        raise RuntimeError(why)
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"moe_triton takes bf16/fp16 activations, got {x.dtype}")
    if any(w.dtype != x.dtype for w in (w_gate, w_up, w_down)):
        raise TypeError(f"expert weights must be {x.dtype}, got {w_gate.dtype}/{w_up.dtype}/{w_down.dtype}")
    return moe_triton_stages(x, router_logits, w_gate, w_up, w_down, top_k, renormalize)["out"]


def moe_triton_stages(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                      w_down: torch.Tensor, top_k: int, renormalize: bool = True) -> Dict[str, object]:
    """:func:`moe_triton` keeping every stage, for debugging (``benchmarks/moe_parity.py`` uses it on failure).

    Call :func:`moe_triton` first (or satisfy its checks): this function does not re-check device/dtype.

    Returns:
        dict with ``out`` ``(T, H)``; ``weights`` ``(T, k)`` fp32 and ``ids`` ``(T, k)`` (routing);
        ``sorted_ids`` / ``expert_ids`` / ``num_blocks`` (:func:`align_block_size`); ``inter`` ``(T*k, I)``
        (kernel 1: SwiGLU activation per assignment ``t*k + j``); ``out_k`` ``(T*k, H)`` (kernel 2: routing-weighted
        down projection per assignment); ``cfg`` (block sizes).
    """
    n_tok, hidden, inter, n_exp = _check_shapes(x, router_logits, w_gate, w_up, w_down)
    if n_tok == 0:
        return {"out": torch.empty(0, hidden, dtype=x.dtype, device=x.device)}
    weights, ids = route(router_logits, top_k, renormalize)
    num_valid = n_tok * top_k
    cfg = _pick_blocks(num_valid, n_exp, hidden, inter)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_ids, expert_ids, num_blocks = align_block_size(ids, n_exp, bm)
    topk_w = weights.reshape(-1).contiguous()                                 # (T*k,) fp32

    if w_up.stride() != w_gate.stride():  # kernel 1 reads both with one set of strides
        w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    inter_buf = torch.empty(num_valid, inter, dtype=x.dtype, device=x.device)
    _moe_gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w_gate, w_up, inter_buf, sorted_ids, expert_ids,
        num_valid, top_k, hidden, inter,
        x.stride(0), x.stride(1),
        w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        inter_buf.stride(0), inter_buf.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )

    out_k = torch.empty(num_valid, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        inter_buf, w_down, out_k, topk_w, sorted_ids, expert_ids,
        num_valid, hidden, inter,
        inter_buf.stride(0), inter_buf.stride(1),
        w_down.stride(0), w_down.stride(1), w_down.stride(2),
        out_k.stride(0), out_k.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    out = out_k.view(n_tok, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
    return {"out": out, "weights": weights, "ids": ids, "sorted_ids": sorted_ids, "expert_ids": expert_ids,
            "num_blocks": num_blocks, "inter": inter_buf, "out_k": out_k, "cfg": cfg}


# ------------------------------------------------------------------------------------------------ GROUPED_MM
#
# GROUPED_MM (:func:`moe_grouped_mm`): torch's own grouped GEMM, no kernel of ours. The T*k token-expert
# assignments are sorted by expert once; each projection is then ONE grouped GEMM over all experts (2-D sorted
# tokens x 3-D stacked weights, groups delimited by ``offs``), and the routing-weighted outputs are scattered back
# onto their tokens with ``index_add_``. What torch runs (ATen ``_grouped_mm_cuda``, GroupedBlas.cpp): on a CUDA
# GPU of compute capability 9.x or 10.x with bf16 operands, its CUTLASS grouped GEMM (``bf16bf16_grouped_mm``, a
# ``prepare_grouped_gemm_data`` kernel then the GEMM, no host sync); in every other case (fp16/fp32, other GPUs,
# the CPU) its fallback, one ``mm`` per expert after copying ``offs`` to the host (``_grouped_mm_fallback``,
# GroupedMMUtils.h): correct, not grouped. Row strides must be multiples of 16 bytes (``H`` and ``I`` multiples of
# 8 in bf16; ``check_valid_strides_and_return_transposed``, GroupedMMUtils.h).


def grouped_mm_entry() -> Optional[Callable[..., torch.Tensor]]:
    """torch's grouped GEMM: ``torch.nn.functional.grouped_mm`` (the public name), else ``torch._grouped_mm`` (the
    op it calls, present in torch releases before the public name); None when this torch has neither."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sort the token-expert assignments by expert (one stable sort) and delimit each expert's rows.

    Args:
        ids: ``(T, k)`` int64 expert ids; assignment ``a = t*k + j`` is ``ids.flatten()[a]``.
        num_experts: E.

    Returns:
        ``(order, offs)``: ``order`` ``(T*k,)`` int64, the assignment at each sorted position (ascending expert;
        ascending ``a`` within one expert); ``offs`` ``(E,)`` int32, ``offs[e]`` = the number of assignments to
        experts ``0..e`` (cumulative token counts: expert ``e``'s rows of the sorted list are ``offs[e-1]:offs[e]``,
        none for an expert no token chose; ``offs[-1] = T*k``), the ``offs`` of torch's grouped GEMM. The counts
        come from ``searchsorted`` on the sorted ids, not ``bincount``, which reads its maximum back to the host on
        CUDA: nothing here synchronizes.
    """
    sorted_ids, order = torch.sort(ids.flatten(), stable=True)
    bounds = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)


def fused_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> Optional[torch.Tensor]:
    """The ``(E, 2I, H)`` tensor whose rows ``[:I]`` are ``w_gate`` and ``[I:]`` ``w_up``, when the two ``(E, I, H)``
    operands are the halves of one such tensor in memory (``models.hidream.HiDreamExperts.stack`` packs them so);
    None otherwise. A view, no copy: it lets one grouped GEMM compute both projections. None while torch.compile
    traces (storage offsets are not traceable: the two projections are then two grouped GEMMs)."""
    if torch.compiler.is_compiling():
        return None
    if (w_gate.shape != w_up.shape or w_gate.stride() != w_up.stride() or w_gate.dtype != w_up.dtype
            or w_gate.device != w_up.device or w_gate.dim() != 3):
        return None
    if w_gate.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr():
        return None
    n_exp, inter, hidden = w_gate.shape
    s_e, s_i, s_h = w_gate.stride()
    if s_h != 1 or s_i < hidden or s_e < 2 * inter * s_i:
        return None
    if w_up.storage_offset() - w_gate.storage_offset() != inter * s_i:
        return None
    return w_gate.as_strided((n_exp, 2 * inter, hidden), (s_e, s_i, s_h))


def _check_grouped_operands(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                            hidden: int, inter: int) -> None:
    """dtype and alignment checks of :func:`moe_grouped_mm` (TypeError / ValueError / RuntimeError, see there)."""
    if grouped_mm_entry() is None:
        raise RuntimeError(f"moe_grouped_mm needs torch.nn.functional.grouped_mm or torch._grouped_mm; torch "
                           f"{torch.__version__} has neither. Fix: backend.moe=TORCH (or a newer torch)")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"moe_grouped_mm takes bf16/fp16/fp32 activations, got {x.dtype}")
    if any(w.dtype != x.dtype for w in (w_gate, w_up, w_down)):
        raise TypeError(f"expert weights must be {x.dtype}, got {w_gate.dtype}/{w_up.dtype}/{w_down.dtype}")
    align = 16 // x.element_size()
    if hidden % align or inter % align:
        raise ValueError(f"torch's grouped GEMM needs 16-byte row strides: H={hidden} and I={inter} must be "
                         f"multiples of {align} in {str(x.dtype).replace('torch.', '')}")


def moe_grouped_mm(x: torch.Tensor, router_logits: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, top_k: int, renormalize: bool = True) -> torch.Tensor:
    """Routed experts as grouped GEMMs (the ``GROUPED_MM`` backend); same contract as :func:`moe_reference`.

    Steps: routing (:func:`route`, fp32); :func:`sort_by_expert` (one sort, ``offs``); gather the tokens in sorted
    order; gate and up projections: one grouped GEMM when :func:`fused_gate_up` finds them fused, else two;
    ``silu(gate) * up`` in ``x.dtype``; down projection: one grouped GEMM; each row times its routing weight in fp32
    and ``index_add_`` onto its token in fp32; cast to ``x.dtype``. See the section comment above for what torch
    runs on each device and dtype.

    Args:
        x: ``(T, H)`` bf16 (the fast path on CUDA 9.x/10.x), fp16 or fp32 (torch's per-expert fallback).
        router_logits: ``(T, E)`` any float dtype, same device.
        w_gate: ``(E, I, H)``; w_up: ``(E, I, H)``; w_down: ``(E, H, I)`` -- ``x.dtype``, same device, last dim
            contiguous.
        top_k: experts per token; renormalize: as :func:`route`.

    Returns:
        ``(T, H)`` in ``x.dtype``. The projections and the SwiGLU activation are rounded to ``x.dtype`` (torch's
        grouped GEMM outputs its input dtype), the weighting and the top-k combine run in fp32 (on CUDA the
        ``index_add_`` adds a token's k rows with atomics, in a varying order: differences at fp32 rounding, as in
        diffusers' own ``scatter_reduce_`` combine).

    Raises:
        TypeError: ``x`` not bf16/fp16/fp32, or the weights not in ``x.dtype``.
        ValueError: inconsistent shapes, ``top_k`` outside ``[1, E]``, or ``H``/``I`` not multiples of 16 bytes.
        RuntimeError: this torch has no grouped GEMM.
    """
    n_tok, hidden, inter, n_exp = _check_shapes(x, router_logits, w_gate, w_up, w_down)
    _check_grouped_operands(x, w_gate, w_up, w_down, hidden, inter)
    weights, ids = route(router_logits, top_k, renormalize)
    if n_tok == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    order, offs = sort_by_expert(ids, n_exp)
    return grouped_experts(x, weights, order, offs, (w_gate, w_up, w_down), top_k)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, offs: torch.Tensor,
                    experts: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int) -> torch.Tensor:
    """:func:`moe_grouped_mm` after routing: the SwiGLU experts on the assignments in ``order``, combined.

    Args:
        x: ``(T, H)``; weights: ``(T, k)`` fp32 routing weights; order / offs: :func:`sort_by_expert` of the ids;
        experts: ``(w_gate (E, I, H), w_up (E, I, H), w_down (E, H, I))``; top_k: k.

    Returns:
        ``(T, H)`` in ``x.dtype``: ``out[t] = sum_j weights[t, j] * expert(x[t])`` over the assignments ``t*k + j``,
        each computed by the expert whose ``offs`` range holds its sorted position (so a wrong ``order`` gives
        another function: the parity tests' negative control).
    """
    w_gate, w_up, w_down = experts
    gmm = grouped_mm_entry()
    tok = order // top_k                                                  # token of each sorted row
    xs = x.index_select(0, tok)                                           # (T*k, H), grouped by expert
    fused = fused_gate_up(w_gate, w_up)
    if fused is not None:
        gu = gmm(xs, fused.transpose(-2, -1), offs=offs)                  # (T*k, 2I)
        gate, up = gu[:, :w_gate.shape[1]], gu[:, w_gate.shape[1]:]
    else:
        gate = gmm(xs, w_gate.transpose(-2, -1), offs=offs)               # (T*k, I)
        up = gmm(xs, w_up.transpose(-2, -1), offs=offs)
    y = gmm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=offs)      # (T*k, H)
    w = weights.flatten().index_select(0, order)                          # (T*k,) fp32
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y * w[:, None])                                # fp32 (type promotion)
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------ module

_IMPL_FN = {"TORCH": moe_reference, "TRITON": moe_triton, "GROUPED_MM": moe_grouped_mm}


class SwiGLUMoE(nn.Module):
    """Top-k routed SwiGLU MoE block with a selectable backend and a per-implementation call counter.

    Args:
        hidden_size: H; intermediate_size: I (per expert); num_experts: E; top_k: experts per token.
        backend: ``"TORCH"`` (:func:`moe_reference`), ``"TRITON"`` (:func:`moe_triton`) or ``"GROUPED_MM"``
            (:func:`moe_grouped_mm`); registry aliases (``torch``, ``fused``, ``grouped_mm``, ...) are accepted
            through :func:`runner.kernels.registry.normalize`.
        renormalize: renormalize the top-k routing weights (Qwen3-MoE ``norm_topk_prob``; Mixtral: always).
        dtype / device: of the parameters.

    Parameters:
        gate: ``nn.Linear(H, E, bias=False)``, the router (weight ``(E, H)``).
        w_gate: ``(E, I, H)``; w_up: ``(E, I, H)``; w_down: ``(E, H, I)`` (see the module docstring).

    Attributes:
        calls: ``{"TORCH": n, "TRITON": m, "GROUPED_MM": g}``, forward calls per implementation that actually
            ran.

    Forward: ``x`` ``(..., H)`` -> ``(..., H)`` in ``x.dtype``; the router runs in the parameters' dtype.

    Raises:
        runner.kernels.registry.UnknownBackendError: an unknown backend name (at construction).
        RuntimeError: backend ``TRITON`` called on a CPU tensor or without ``triton`` (at forward; the runner's
            registry check refuses it earlier, at startup).
        TypeError / ValueError: backend ``GROUPED_MM`` on a dtype or sizes it does not take (at forward; see
            :func:`moe_grouped_mm`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 backend: str = "TORCH", renormalize: bool = True, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None):
        super().__init__()
        from runner.kernels import registry as reg

        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.backend = reg.normalize("moe", backend)
        if self.backend not in _IMPL_FN:
            raise ValueError(f"SwiGLUMoE needs a concrete backend ({', '.join(IMPLS)}), got {backend!r}; resolve "
                             f"`auto` with runner.kernels.registry.auto_select first")
        kw = {"dtype": dtype, "device": device}
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.calls: Dict[str, int] = {name: 0 for name in IMPLS}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert (kaiming-uniform bound 1/sqrt(fan_in))."""
        for w, fan_in in ((self.w_gate, self.hidden_size), (self.w_up, self.hidden_size),
                          (self.w_down, self.intermediate_size)):
            bound = fan_in ** -0.5
            nn.init.uniform_(w, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        logits = self.gate(x2)
        fn = _IMPL_FN[self.backend]
        y = fn(x2, logits, self.w_gate, self.w_up, self.w_down, self.top_k, self.renormalize)
        self.calls[self.backend] += 1  # counted after it ran: a raising call is not a call
        return y.reshape(shape)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, backend={self.backend}, "
                f"renormalize={self.renormalize}")


# ------------------------------------------------------------------------------------ diffusers MoE blocks
#
# A diffusion model's MoE block (HiDream-I1: diffusers' ``MOEFeedForwardSwiGLU``) computes
#     y = routed(x) + shared(x)
# where ``routed`` is this module's routed SwiGLU mixture (router logits, top-k, a SwiGLU per expert) and ``shared``
# an optional dense expert every token runs. The MoE backend of the stage decides what computes ``routed``: the
# model's own expert loop (``TORCH``, the reference) or a kernel with :func:`moe_reference`'s contract (``TRITON``,
# ``GROUPED_MM``).
# Which one each block actually ran is observed per call (:class:`MoESite`), never assumed from the configuration.


class ExpertsLayout:
    """Where a model family's MoE block keeps the parts of :func:`moe_reference`'s contract; one subclass per family
    (``models.hidream.HiDreamExperts``). Every method takes the block (the ``nn.Module`` whose forward is the MoE
    layer, a "call site").

    Shapes: ``H`` hidden size, ``I`` expert intermediate size, ``E`` routed experts, ``T`` tokens.
    """

    def experts(self, block: nn.Module) -> Sequence[nn.Module]:
        """The routed expert modules, whose forwards are the model's own expert loop (observed by hooks)."""
        raise NotImplementedError

    def expert_linears(self, block: nn.Module) -> Tuple[str, ...]:
        """Module-name prefixes, relative to the block, of the routed experts' Linears (owned by the MoE backend,
        so the linear backend neither replaces nor counts them)."""
        raise NotImplementedError

    def stack(self, block: nn.Module) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(w_gate (E, I, H), w_up (E, I, H), w_down (E, H, I))`` of the routed experts, packed once; the experts'
        own Linears are re-pointed at views of them (no second copy in memory). ``w_gate`` and ``w_up`` may be the
        two halves ``[:, :I]`` / ``[:, I:]`` of one ``(E, 2I, H)`` tensor (:func:`fused_gate_up`), which lets
        GROUPED_MM compute both with one grouped GEMM."""
        raise NotImplementedError

    def router_logits(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``(T, E)`` router logits of tokens ``x (T, H)`` (in ``x.dtype``)."""
        raise NotImplementedError

    def top_k(self, block: nn.Module) -> int:
        """Experts per token."""
        raise NotImplementedError

    def renormalize(self, block: nn.Module) -> bool:
        """Whether the top-k routing weights are renormalized to sum to 1."""
        raise NotImplementedError

    def shared(self, block: nn.Module, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared expert's output for ``x (..., H)`` (same shape), or None when the block has none."""
        return None


@dataclass
class MoESite:
    """One MoE call site of a denoiser and what executed there (manifest ``evidence.stages.<stage>.moe``).

    Attributes:
        layer: module name of the block in the denoiser.
        resolved: the canonical MoE backend selected for the stage.
        experts: E; top_k: experts per token.
        counting: per-call counters run (off under ``torch.compile``, where Python hooks do not run per call).
        observed: implementation -> forwards of the block in which it computed the routed experts (``TORCH``: the
            model's own expert modules ran; a kernel's backend name: that kernel ran; ``unobserved``: the block ran
            and neither did).
    """

    layer: str
    resolved: str
    experts: int
    top_k: int
    counting: bool = True
    observed: Dict[str, int] = field(default_factory=dict)
    _ran: Optional[set] = None

    def mark(self, impl: str) -> None:
        """Record that ``impl`` computed the routed experts during the current forward of the block."""
        if self.counting and self._ran is not None:
            self._ran.add(impl)


def routed_forward(block: nn.Module, layout: ExpertsLayout, kernel: Callable[..., torch.Tensor],
                   weights: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The block's output with the routed experts computed by ``kernel`` (:func:`moe_reference`'s contract) on
    ``weights = (w_gate, w_up, w_down)``: ``kernel(x2, router_logits(x2), *weights, top_k, renormalize)`` plus the
    shared expert. ``x`` is ``(..., H)``; the result has its shape and dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = kernel(x2, layout.router_logits(block, x2), *weights, layout.top_k(block), layout.renormalize(block))
    y = y.reshape(shape).to(x.dtype)
    s = layout.shared(block, x)
    return y if s is None else y + s


def _moe_kernel(name: str) -> Optional[Callable[..., torch.Tensor]]:
    """The routed-expert kernel of MoE backend ``name`` (None: the model's own expert loop).

    Raises:
        ValueError: the backend has no diffusers wiring (``DiffusersMoEWiring``).
    """
    from runner.kernels import registry as reg

    wiring = reg.get("moe", name).diffusers
    if wiring is None:
        raise ValueError(f"MoE backend {name} is not wired into diffusers models (its record has no "
                         "DiffusersMoEWiring)")
    return reg.load_object(wiring.kernel) if wiring.kernel is not None else None


def use_kernel(block: nn.Module, layout: ExpertsLayout, name: str, site: Optional[MoESite] = None) -> None:
    """Make ``block`` compute its routed experts with MoE backend ``name``'s kernel (nothing to do for a backend
    whose wiring is the model's own loop): the expert weights are packed once (:meth:`ExpertsLayout.stack`) and the
    block's ``forward`` becomes :func:`routed_forward`, marking ``site`` with ``name`` after each kernel call."""
    kernel = _moe_kernel(name)
    if kernel is None:
        if "forward" in vars(block):  # back to the class's forward (the model's own loop)
            del block.forward
        return
    weights = layout.stack(block)

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = routed_forward(block, layout, kernel, weights, x)
        if site is not None:
            site.mark(name)  # after it ran: a raising call is not a call
        return y

    block.forward = forward


def install(blocks: Iterable[Tuple[str, nn.Module]], layout: ExpertsLayout, backend: str,
            observe: bool = True) -> List[MoESite]:
    """Wire MoE backend ``backend`` into every MoE block of a denoiser and observe what each block runs.

    Args:
        blocks: ``(layer name, block)`` of every MoE call site.
        layout: the family's :class:`ExpertsLayout`.
        backend: canonical MoE backend (``TORCH``: the model's own loop; ``TRITON``: :func:`moe_triton`;
            ``GROUPED_MM``: :func:`moe_grouped_mm`; or any registered backend with ``DiffusersMoEWiring``).
        observe: attach the per-call observers (off under ``torch.compile``).

    Returns:
        One :class:`MoESite` per block, in order; their ``observed`` fill as the blocks run. A block's forward
        counts once per implementation that computed its routed experts: the model's own loop is seen through
        forward hooks on its expert modules (reported as the backend whose wiring is the model's loop, ``TORCH``),
        a kernel through the wrapper that called it.

    Raises:
        ValueError: ``backend`` is not wired into diffusers models.
    """
    from runner.kernels import registry as reg

    own = next((b.name for b in reg.BACKENDS["moe"].values()
                if b.diffusers is not None and b.diffusers.kernel is None), "TORCH")
    sites = []
    for name, block in blocks:
        site = MoESite(layer=name, resolved=backend, experts=len(layout.experts(block)), top_k=layout.top_k(block),
                       counting=observe)
        use_kernel(block, layout, backend, site)
        if observe:
            def pre(mod: nn.Module, args: Any, _s: MoESite = site) -> None:
                _s._ran = set()

            def post(mod: nn.Module, args: Any, out: Any, _s: MoESite = site) -> None:
                ran, _s._ran = _s._ran or {"unobserved"}, None
                for impl in ran:
                    _s.observed[impl] = _s.observed.get(impl, 0) + 1

            block.register_forward_pre_hook(pre)
            block.register_forward_hook(post)
            for expert in layout.experts(block):
                expert.register_forward_pre_hook(lambda mod, args, _s=site: _s.mark(own))
        sites.append(site)
    return sites


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_2 / ||ref||_2`` over the whole tensor, in fp64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@torch.no_grad()
def block_parity(block: nn.Module, layout: ExpertsLayout, x: torch.Tensor,
                 kernel: Callable[..., torch.Tensor] = moe_reference, swap_gate_up: bool = False) -> float:
    """Relative error (:func:`rel_err`) of the block computed with ``kernel`` against the model's own forward of the
    same block on ``x (..., H)`` (diffusers' expert loop: the reference), the block left as it was.

    ``swap_gate_up`` gives the kernel ``w_up`` as the gate projection and ``w_gate`` as the up projection: the
    negative control (``silu(up) * gate`` is another function), which a parity check must fail.
    """
    saved = vars(block).get("forward")
    if saved is not None:
        del block.forward
    try:
        ref = block(x)
        wg, wu, wd = layout.stack(block)
        out = routed_forward(block, layout, kernel, (wu, wg, wd) if swap_gate_up else (wg, wu, wd), x)
    finally:
        if saved is not None:
            block.forward = saved
    return rel_err(out, ref)


@torch.no_grad()
def time_block(block: nn.Module, layout: ExpertsLayout, x: torch.Tensor, backends: Sequence[str],
               iters: int = 5, warmup: int = 2) -> Dict[str, float]:
    """Milliseconds per call of ``block`` on ``x (..., H)`` with each MoE backend in ``backends`` (median of
    ``iters`` after ``warmup`` calls; the router and the shared expert included, as they run in the model; CUDA
    synchronized around each call). The block is left computing with the model's own loop."""
    import statistics
    import time

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    out: Dict[str, float] = {}
    for name in backends:
        use_kernel(block, layout, name)
        times = []
        for i in range(warmup + iters):
            sync()
            t0 = time.perf_counter()
            block(x)
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    if "forward" in vars(block):
        del block.forward
    return out


def auto_candidates(ctx: Any) -> List[str]:
    """The MoE backends ``auto`` may choose on a diffusers stage in ``ctx`` (a ``runner.kernels.registry.SelectionContext``),
    in auto order: ranked for its platform class (``runner.kernels.registry.auto_order``), wired into diffusers models, and
    every requirement met. ``models.diffusers_engine.DiffusersEngine.choose_moe_by_measurement`` times them when
    there are two or more."""
    from runner.kernels import registry as reg

    wired = reg.wired("moe", "diffusers")
    return [n for n, _ in reg.auto_order("moe", ctx) if n in wired and not reg.get("moe", n).unmet(ctx)]


def time_candidates(block: nn.Module, layout: ExpertsLayout, x: torch.Tensor, names: Sequence[str],
                    iters: int = 5, warmup: int = 2) -> Tuple[Dict[str, float], Dict[str, str]]:
    """``auto``'s measurement: :func:`time_block` of each backend in ``names`` on ``block`` and ``x (..., H)``.

    Returns:
        ``(times, failed)``: milliseconds per call of each backend that ran, and ``"<exception type>: <message>"``
        of each that raised (a candidate that cannot run here is not chosen; the caller records why).
    """
    times: Dict[str, float] = {}
    failed: Dict[str, str] = {}
    for name in names:
        try:
            times.update(time_block(block, layout, x, [name], iters=iters, warmup=warmup))
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is not chosen
            failed[name] = f"{type(e).__name__}: {e}"
    return times, failed
