"""MoE block (``runner.kernels.moe``): the TORCH reference loop against an independent dense oracle, routing conventions,
the gate/up layout (a swap must show), the module's call counter, the TRITON backend's refusal off GPU, the
align step of the Triton path (pure torch), the Triton kernels themselves where they can run (CUDA, or
Triton's CPU interpreter in a subprocess when triton is installed), and GROUPED_MM (torch's grouped GEMM: its
sort and offsets, the fused gate/up view, parity on CPU in fp32 and bf16 with zero-token experts and top-k > 1,
negative controls that must fail it, and the same on a CUDA GPU with its profiled kernels)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runner.kernels import moe
from runner.kernels.moe import (SwiGLUMoE, align_block_size, fused_gate_up, grouped_experts, moe_grouped_mm, moe_reference,
                         moe_triton, route, sort_by_expert)
from runner.kernels.registry import UnknownBackendError

REPO_ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA_TRITON = torch.cuda.is_available() and moe.HAS_TRITON


def dense_oracle(x, logits, wg, wu, wd, top_k, renormalize):
    """All experts on all tokens, combined with a dense (T, E) routing matrix (zero off the top-k); fp32."""
    probs = torch.softmax(logits.double(), dim=-1)
    vals, idx = probs.topk(top_k, dim=-1)
    if renormalize:
        vals = vals / vals.sum(-1, keepdim=True)
    comb = torch.zeros_like(probs).scatter(1, idx, vals)
    x, wg, wu, wd = x.double(), wg.double(), wu.double(), wd.double()
    h = F.silu(torch.einsum("th,eih->tei", x, wg)) * torch.einsum("th,eih->tei", x, wu)
    return torch.einsum("te,teh->th", comb, torch.einsum("tei,ehi->teh", h, wd)).float()


def make(T, H, I, E, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g) * 2
    wg = torch.randn(E, I, H, generator=g) / H ** 0.5
    wu = torch.randn(E, I, H, generator=g) / H ** 0.5
    wd = torch.randn(E, H, I, generator=g) / I ** 0.5
    return [t.to(dtype) for t in (x, logits, wg, wu, wd)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ------------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("T,H,I,E,k", [(1, 16, 8, 4, 1), (7, 32, 24, 8, 2), (33, 48, 40, 16, 4), (64, 24, 16, 8, 8),
                                       (5, 20, 12, 6, 3)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_matches_dense_oracle(T, H, I, E, k, renormalize):
    x, logits, wg, wu, wd = make(T, H, I, E, seed=T + k)
    out = moe_reference(x, logits, wg, wu, wd, k, renormalize)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_oracle(x, logits, wg, wu, wd, k, renormalize), rtol=1e-5, atol=1e-5)


def test_reference_all_experts_equals_full_softmax_mixture():
    """top_k = E: every expert contributes with its full softmax probability (renormalizing is then a no-op)."""
    x, logits, wg, wu, wd = make(9, 16, 8, 4, seed=3)
    a = moe_reference(x, logits, wg, wu, wd, 4, True)
    b = moe_reference(x, logits, wg, wu, wd, 4, False)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    p = torch.softmax(logits, -1)
    manual = sum(p[:, e:e + 1] * ((F.silu(x @ wg[e].T) * (x @ wu[e].T)) @ wd[e].T) for e in range(4))
    torch.testing.assert_close(a, manual, rtol=1e-5, atol=1e-5)


def test_renormalize_matters():
    x, logits, wg, wu, wd = make(16, 32, 16, 8, seed=1)
    on = moe_reference(x, logits, wg, wu, wd, 2, True)
    off = moe_reference(x, logits, wg, wu, wd, 2, False)
    assert rel(on, off) > 0.1
    # top_k=1 with renormalize: the chosen expert's output with weight exactly 1
    one = moe_reference(x, logits, wg, wu, wd, 1, True)
    e = logits.argmax(-1)
    manual = torch.stack([(F.silu(x[t] @ wg[e[t]].T) * (x[t] @ wu[e[t]].T)) @ wd[e[t]].T for t in range(16)])
    torch.testing.assert_close(one, manual, rtol=1e-5, atol=1e-6)


def test_route_convention():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, -1.0]], dtype=torch.bfloat16)
    w, ids = route(logits, 2, renormalize=False)
    assert w.dtype == torch.float32 and ids.tolist() == [[3, 2], [0, 1]]
    torch.testing.assert_close(w, torch.softmax(logits.float(), -1).gather(1, ids))
    w2, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(w2.sum(-1), torch.ones(2))
    torch.testing.assert_close(w2, w / w.sum(-1, keepdim=True))


def test_swapping_gate_and_up_changes_the_output():
    x, logits, wg, wu, wd = make(12, 32, 16, 8, seed=2)
    ref = dense_oracle(x, logits, wg, wu, wd, 2, True)
    swapped = moe_reference(x, logits, wu, wg, wd, 2, True)
    assert rel(swapped, ref) > 0.1, "a gate/up swap would go unnoticed"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(swapped, ref, rtol=1e-2, atol=1e-2)


def test_reference_keeps_low_precision_dtype():
    x, logits, wg, wu, wd = make(10, 32, 16, 4, seed=4)
    lo = [t.to(torch.bfloat16) for t in (x, wg, wu, wd)]
    out = moe_reference(lo[0], logits, lo[1], lo[2], lo[3], 2, True)
    assert out.dtype == torch.bfloat16
    assert rel(out, dense_oracle(*[t.float() for t in (lo[0], logits, lo[1], lo[2], lo[3])], 2, True)) < 2e-2


def test_reference_rejects_bad_shapes():
    x, logits, wg, wu, wd = make(4, 16, 8, 4)
    with pytest.raises(ValueError, match="w_down"):
        moe_reference(x, logits, wg, wu, wd.transpose(1, 2), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_reference(x, logits, wg, wu, wd, 5, True)
    with pytest.raises(ValueError, match="router_logits"):
        moe_reference(x, logits[:, :3], wg, wu, wd, 2, True)


# ------------------------------------------------------------------------------------------------ module


def test_module_torch_backend_counts_calls_and_matches_reference():
    torch.manual_seed(0)
    m = SwiGLUMoE(32, 16, 8, 2, backend="torch")
    assert m.backend == "TORCH" and m.calls == {"TORCH": 0, "TRITON": 0, "GROUPED_MM": 0}
    assert tuple(m.w_gate.shape) == (8, 16, 32) and tuple(m.w_up.shape) == (8, 16, 32)
    assert tuple(m.w_down.shape) == (8, 32, 16) and tuple(m.gate.weight.shape) == (8, 32) and m.gate.bias is None
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = m(x)
        m(x[0])
        m(x[0])
    assert y.shape == x.shape
    assert m.calls == {"TORCH": 3, "TRITON": 0, "GROUPED_MM": 0}
    x2 = x.reshape(-1, 32)
    with torch.no_grad():
        want = dense_oracle(x2, m.gate(x2), m.w_gate, m.w_up, m.w_down, 2, True)
    torch.testing.assert_close(y.reshape(-1, 32), want, rtol=1e-5, atol=1e-5)


def test_module_backend_names():
    assert SwiGLUMoE(16, 8, 4, 2, backend="fused").backend == "TRITON"
    with pytest.raises(UnknownBackendError):
        SwiGLUMoE(16, 8, 4, 2, backend="cutlass")
    with pytest.raises(ValueError, match="auto"):
        SwiGLUMoE(16, 8, 4, 2, backend="auto")
    with pytest.raises(ValueError, match="top_k"):
        SwiGLUMoE(16, 8, 4, 5)


def test_triton_backend_on_cpu_raises_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    m = SwiGLUMoE(16, 16, 4, 2, backend="TRITON", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as e:
        m(torch.randn(3, 16, dtype=torch.bfloat16))
    msg = str(e.value)
    assert "TRITON" in msg and "CUDA" in msg and "cpu" in msg and "TORCH" in msg
    if not moe.HAS_TRITON:
        assert "triton" in msg
    assert m.calls == {"TORCH": 0, "TRITON": 0, "GROUPED_MM": 0}  # a refused call is not counted
    with pytest.raises(RuntimeError, match="CUDA"):
        moe_triton(*make(3, 16, 16, 4), 2, True)


# ------------------------------------------------------------------------------------------------ align step


@pytest.mark.parametrize("T,E,k,bm", [(1, 8, 2, 16), (7, 4, 3, 16), (100, 8, 2, 32), (257, 16, 4, 64), (3, 64, 8, 16)])
def test_align_block_size_invariants(T, E, k, bm):
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)])
    sorted_ids, expert_ids, nb = align_block_size(ids, E, bm)
    flat = ids.flatten()
    assert sorted_ids.dtype == torch.int32 and expert_ids.dtype == torch.int32
    assert sorted_ids.numel() == nb * bm and expert_ids.numel() == nb
    counts = torch.bincount(flat, minlength=E)
    assert nb == int(((counts + bm - 1) // bm).sum())                        # no empty blocks, minimal padding
    valid = sorted_ids[sorted_ids < T * k].long()
    assert sorted(valid.tolist()) == list(range(T * k))                      # every assignment exactly once
    assert ((sorted_ids == T * k) | (sorted_ids < T * k)).all()              # padding is the sentinel T*k
    blocks = sorted_ids.view(nb, bm).long()
    for b in range(nb):
        row = blocks[b][blocks[b] < T * k]
        assert row.numel() > 0                                               # a block holds at least one row
        assert (flat[row] == expert_ids[b]).all()                            # ...all of the block's expert
    assert (expert_ids[1:] >= expert_ids[:-1]).all()


# ------------------------------------------------------------------------------------------------ Triton


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA_TRITON, reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,I,E,k", [(1, 64, 32, 8, 2), (7, 160, 80, 8, 2), (128, 256, 128, 16, 4),
                                       (300, 512, 384, 64, 8)])
def test_moe_triton_matches_fp32_reference(dtype, T, H, I, E, k):
    x, logits, wg, wu, wd = [t.cuda() for t in make(T, H, I, E, seed=T)]
    lo = [t.to(dtype) for t in (x, wg, wu, wd)]
    hi = [t.float() for t in lo]
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = moe_reference(hi[0], logits, hi[1], hi[2], hi[3], k, True)
    out = moe_triton(lo[0], logits, lo[1], lo[2], lo[3], k, True)
    assert out.dtype == dtype and out.shape == (T, H)
    assert rel(out, ref) < 2e-2
    assert rel(moe_triton(lo[0], logits, lo[2], lo[1], lo[3], k, True), ref) > 2e-2  # swap is caught
    m = SwiGLUMoE(H, I, E, k, backend="TRITON", dtype=dtype, device="cuda")
    with torch.no_grad():
        m(lo[0])
    assert m.calls == {"TORCH": 0, "TRITON": 1, "GROUPED_MM": 0}


_INTERP_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from runner.kernels import moe
    g = torch.Generator().manual_seed(0)
    for T, H, I, E, k in [(1, 48, 40, 4, 2), (21, 80, 48, 4, 2), (40, 64, 32, 8, 3)]:
        x = torch.randn(T, H, generator=g).half()
        logits = torch.randn(T, E, generator=g)
        wg, wu = [(torch.randn(E, I, H, generator=g) / H ** 0.5).half() for _ in range(2)]
        wd = (torch.randn(E, H, I, generator=g) / I ** 0.5).half()
        ref = moe.moe_reference(x.float(), logits, wg.float(), wu.float(), wd.float(), k, True)
        rel = lambda a: ((a.float() - ref).norm() / ref.norm()).item()
        ok, bad = rel(moe.moe_triton(x, logits, wg, wu, wd, k, True)), rel(moe.moe_triton(x, logits, wu, wg, wd, k))
        print(T, H, I, E, k, ok, bad)
        assert ok < 2e-2 and bad > 2e-2, (ok, bad)
    print("INTERPRETER_OK")
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_moe_triton_kernels_in_triton_interpreter():
    """The real kernels, run by Triton's CPU interpreter (fp16: its bf16 tl.dot is unsupported,
    triton-lang/triton#11584); covers masks (H, I not multiples of 64), several experts per block list, padding."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT, str(REPO_ROOT)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "INTERPRETER_OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------------ GROUPED_MM

# (T, H, I, E, k, dead): ``dead`` experts get a router logit of -1e4, so no token chooses them (empty groups in
# the grouped GEMM, repeated offsets); H and I multiples of 8 (torch's grouped GEMM needs 16-byte row strides).
GMM_CASES = [(1, 16, 8, 4, 1, ()), (7, 32, 24, 8, 2, (0, 5)), (33, 48, 40, 16, 4, (3,)), (64, 24, 16, 8, 8, ()),
             (50, 32, 16, 6, 2, (0, 1, 2, 3)), (5, 40, 24, 6, 3, (5,))]


def gmm_inputs(T, H, I, E, k, dead, dtype=torch.float32):
    x, logits, wg, wu, wd = make(T, H, I, E, seed=T * 10 + k)
    logits[:, list(dead)] = -1e4
    return [t.to(dtype) if t is not logits else t for t in (x, logits, wg, wu, wd)]


@pytest.mark.parametrize("T,H,I,E,k,dead", GMM_CASES)
def test_sort_by_expert_offsets_are_the_cumulative_token_counts(T, H, I, E, k, dead):
    _, logits, *_ = gmm_inputs(T, H, I, E, k, dead)
    _, ids = route(logits, k)
    order, offs = sort_by_expert(ids, E)
    flat = ids.flatten()
    assert order.dtype == torch.int64 and offs.dtype == torch.int32 and offs.shape == (E,)
    assert sorted(order.tolist()) == list(range(T * k))                      # a permutation of the assignments
    assert (flat[order][1:] >= flat[order][:-1]).all()                       # grouped by ascending expert
    assert offs.tolist() == torch.cumsum(torch.bincount(flat, minlength=E), 0).tolist()
    for e in range(E):
        lo = 0 if e == 0 else int(offs[e - 1])
        rows = order[lo:int(offs[e])]
        assert (flat[rows] == e).all() and (rows[1:] > rows[:-1]).all()      # expert e's rows, stable
        assert rows.numel() == 0 or e not in dead                            # dead experts: empty groups


@pytest.mark.parametrize("T,H,I,E,k,dead", GMM_CASES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_mm_matches_the_reference_in_fp32(T, H, I, E, k, dead, renormalize):
    """fp32 on the CPU (torch's per-group fallback computes exactly what the grouped kernel would): equal to the
    reference loop to float rounding, including experts no token chose and top-k up to E."""
    x, logits, wg, wu, wd = gmm_inputs(T, H, I, E, k, dead)
    out = moe_grouped_mm(x, logits, wg, wu, wd, k, renormalize)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, moe_reference(x, logits, wg, wu, wd, k, renormalize), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,I,E,k,dead", GMM_CASES[1:])
def test_grouped_mm_bf16_parity_and_its_negative_controls(T, H, I, E, k, dead):
    """bf16 (the backend's dtype) against the fp32 reference on the same bf16-rounded operands, at the bf16
    tolerance of benchmarks/moe_parity.py (2e-2); the negative controls must fail it: the rows in an unsorted or a
    shifted order (each row then computed by another expert's weights and added to another token) and the gate/up
    projections swapped. A permutation within each expert's rows changes nothing (rows stay with their expert)."""
    x, logits, wg, wu, wd = gmm_inputs(T, H, I, E, k, dead, torch.bfloat16)
    ref = moe_reference(x.float(), logits, wg.float(), wu.float(), wd.float(), k, True)
    out = moe_grouped_mm(x, logits, wg, wu, wd, k, True)
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 2e-2
    weights, ids = route(logits, k)
    order, offs = sort_by_expert(ids, E)
    experts = (wg, wu, wd)
    for wrong in (torch.arange(T * k), order.roll(1)):
        assert rel(grouped_experts(x, weights, wrong, offs, experts, k), ref) > 2e-2
    assert rel(moe_grouped_mm(x, logits, wu, wg, wd, k, True), ref) > 2e-2
    within = order.clone()
    bounds = [0, *offs.tolist()]
    for lo, hi in zip(bounds, bounds[1:]):
        within[lo:hi] = order[lo:hi].flip(0)
    torch.testing.assert_close(grouped_experts(x, weights, within, offs, experts, k).float(), out.float(),
                               rtol=2e-2, atol=2e-2)


def _grouped_mm_ops(fn) -> int:
    """``aten::_grouped_mm`` calls in a CPU profile of ``fn``, which must hold no other MoE backend's signature (the
    runner's evidence would report them as having run)."""
    import re

    from runner.kernels import registry as reg

    with torch.profiler.profile() as prof:
        fn()
    names = [e.key for e in prof.key_averages()]
    assert not [n for n in names for other in ("TORCH", "TRITON") if re.search(reg.signature("moe", other), n, re.I)]
    assert any(re.search(reg.signature("moe", "GROUPED_MM"), n, re.I) for n in names)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_grouped_mm")


def test_fused_gate_up_is_one_grouped_gemm_and_only_true_halves_fuse():
    """Gate and up stored as the halves of one (E, 2I, H) tensor run as ONE grouped GEMM (2 in all, with the down
    projection; profiled), separate tensors as two (3 in all), with the same result. Only the exact halves in
    gate-then-up order fuse: swapped halves or non-adjacent slices do not (fusing them would swap or skip rows)."""
    x, logits, wg, wu, wd = make(20, 32, 16, 4, seed=7)
    packed = torch.cat([wg, wu], dim=1)
    g, u = packed[:, :16], packed[:, 16:]
    fused = fused_gate_up(g, u)
    assert fused is not None and fused.data_ptr() == packed.data_ptr() and torch.equal(fused, packed)
    assert fused_gate_up(wg, wu) is None and fused_gate_up(u, g) is None
    wide = torch.cat([wg, wd.transpose(1, 2)[:, :16], wu], dim=1)            # (E, 3I, H): gate, other, up
    assert fused_gate_up(wide[:, :16], wide[:, 32:]) is None
    assert _grouped_mm_ops(lambda: moe_grouped_mm(x, logits, g, u, wd, 2)) == 2
    assert _grouped_mm_ops(lambda: moe_grouped_mm(x, logits, wg, wu, wd, 2)) == 3
    torch.testing.assert_close(moe_grouped_mm(x, logits, g, u, wd, 2), moe_grouped_mm(x, logits, wg, wu, wd, 2),
                               rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(moe_grouped_mm(x, logits, u, g, wd, 2), moe_grouped_mm(x, logits, wu, wg, wd, 2),
                               rtol=1e-6, atol=1e-6)


def test_grouped_mm_traces_whole_under_torch_compile():
    """torch.compile (the runner compiles with fullgraph=False, where a graph break would cost speed silently) traces
    moe_grouped_mm in one graph, fused gate/up weights included, with the eager result (regression: the fused-view
    check read storage pointers and offsets, which Dynamo cannot trace)."""
    x, logits, wg, wu, wd = [t.bfloat16() for t in make(20, 32, 16, 4, seed=8)]
    packed = torch.cat([wg, wu], dim=1)
    fn = lambda x, logits: moe_grouped_mm(x, logits, packed[:, :16], packed[:, 16:], wd, 2)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, backend="eager", fullgraph=True)(x, logits)
    torch.testing.assert_close(got, fn(x, logits), rtol=0, atol=0)


def test_grouped_mm_edge_cases_and_refusals():
    x, logits, wg, wu, wd = make(6, 16, 8, 4)
    empty = moe_grouped_mm(x[:0], logits[:0], wg, wu, wd, 2)
    assert empty.shape == (0, 16) and empty.dtype == torch.float32
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        moe_grouped_mm(x.double(), logits, wg.double(), wu.double(), wd.double(), 2)
    with pytest.raises(TypeError, match="expert weights must be torch.bfloat16"):
        moe_grouped_mm(x.bfloat16(), logits, wg, wu, wd, 2)
    x, logits, wg, wu, wd = [t.bfloat16() for t in make(6, 20, 8, 4)]
    with pytest.raises(ValueError, match=r"H=20 and I=8 must be multiples of 8 in bfloat16"):
        moe_grouped_mm(x, logits, wg, wu, wd, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_grouped_mm(*make(6, 16, 8, 4), 5)


def test_module_grouped_mm_backend_counts_calls_and_matches_reference():
    torch.manual_seed(0)
    m = SwiGLUMoE(32, 16, 8, 2, backend="grouped-mm")
    assert m.backend == "GROUPED_MM"
    x = torch.randn(3, 32)
    with torch.no_grad():
        y = m(x)
        want = moe_reference(x, m.gate(x), m.w_gate, m.w_up, m.w_down, 2, True)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert m.calls == {"TORCH": 0, "TRITON": 0, "GROUPED_MM": 1}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,H,I,E,k,dead", [(1, 64, 32, 8, 2, ()), (7, 160, 80, 8, 2, (2,)),
                                            (300, 512, 384, 64, 8, (0, 63)), (4096, 2560, 6912, 4, 2, (1,))])
def test_moe_grouped_mm_matches_fp32_reference_on_gpu(T, H, I, E, k, dead):
    """bf16 on the GPU (torch's CUTLASS grouped GEMM on compute capability 9.x/10.x) against the fp32 reference
    (TF32 off) on the same bf16 operands, incl. experts no token chose; the negative controls (unsorted rows,
    gate/up swapped) fail; the profiled step carries GROUPED_MM's signature in its device kernels (the registry's
    evidence regex, checked where the kernels run) and none of TORCH's."""
    from runner.kernels import registry as reg

    x, logits, wg, wu, wd = [t.cuda() for t in gmm_inputs(T, H, I, E, k, dead, torch.bfloat16)]
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = moe_reference(x.float(), logits, wg.float(), wu.float(), wd.float(), k, True)
    packed = torch.cat([wg, wu], dim=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = moe_grouped_mm(x, logits, packed[:, :I], packed[:, I:], wd, k, True)
        torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and rel(out, ref) < 2e-2, rel(out, ref)
    assert rel(moe_grouped_mm(x, logits, wg, wu, wd, k, True), ref) < 2e-2
    weights, ids = route(logits, k)
    order, offs = sort_by_expert(ids, E)
    assert rel(grouped_experts(x, weights, torch.arange(T * k, device="cuda"), offs, (wg, wu, wd), k), ref) > 2e-2
    assert rel(moe_grouped_mm(x, logits, wu, wg, wd, k, True), ref) > 2e-2
    import re

    kernels = {e.name for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU}
    sig = re.compile(reg.signature("moe", "GROUPED_MM"), re.I)
    assert any(sig.search(n) for n in kernels), sorted(kernels)  # a device kernel, not only the op
    everything = {e.name for e in prof.events()}
    assert not any(re.search(reg.signature("moe", other), n, re.I) for other in ("TORCH", "TRITON") for n in everything)
