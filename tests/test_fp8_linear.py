"""The FP8 linear path (``runner.kernels.linear``), on the CPU: ``torch._scaled_mm`` runs there too, so the quantization,
the replacement of the transformer blocks' linears and the call counting are tested without a GPU.

What a user of ``backend.linear=FP8`` sees: the outputs of the replaced layers are close to the dense ones (the
quantization is lossy, a few percent), the layers outside the transformer blocks or with a dimension that is no
multiple of 16 stay dense and are listed as skipped, and the manifest's ``linear`` evidence counts each
implementation's calls.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.kernels import linear as L

pytestmark = pytest.mark.cpu


class Block(nn.Module):
    def __init__(self, d: int = 32, odd: int = 24):
        super().__init__()
        self.to_q = nn.Linear(d, d)
        self.proj = nn.Linear(d, odd, bias=False)  # 24 out features: a multiple of 8, not of 16
        self.back = nn.Linear(odd, d)

    def forward(self, x):
        return self.back(self.proj(self.to_q(x)))


class Model(nn.Module):
    """A DiT-shaped toy: an embedder and an output layer outside the blocks, two transformer blocks."""

    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(16, 32)
        self.transformer_blocks = nn.ModuleList([Block(), Block()])
        self.proj_out = nn.Linear(32, 16)

    def forward(self, x):
        x = self.x_embedder(x)
        for b in self.transformer_blocks:
            x = x + b(x)
        return self.proj_out(x)


def _model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return Model().to(dtype)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_rows_scales_each_row_to_the_e4m3_range():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0 * 3, 1.0, -3.0]])
    q, scale = L._quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    # one scale per row: amax / 448, so the largest magnitude of each row lands on 448
    assert scale[0, 0].item() == pytest.approx(2.0 / 448)
    assert scale[2, 0].item() == pytest.approx(3.0)
    assert q.float()[0].abs().max().item() == 448.0
    assert q.float()[2].abs().max().item() == 448.0
    # an all-zero row gets a tiny positive scale (no division by zero, no NaN), and stays zero
    assert 0 < scale[1, 0].item() <= 1e-12 / 448 * 1.0001
    assert torch.equal(q.float()[1], torch.zeros(3))
    # dequantized values are the originals within e4m3's 3 mantissa bits
    deq = q.float() * scale
    assert torch.allclose(deq, x, rtol=2 ** -3, atol=0)


def test_quantize_rows_saturates_nothing_beyond_448():
    x = torch.randn(64, 48) * 1000
    q, scale = L._quantize_rows(x)
    assert torch.isfinite(q.float()).all()
    assert q.float().abs().max().item() <= 448.0
    # each row's largest magnitude is represented exactly: it lands on 448 x its row's scale
    assert torch.allclose((q.float() * scale).abs().amax(dim=-1), x.abs().amax(dim=-1), rtol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_matches_the_dense_layer_within_the_fp8_error(bias):
    torch.manual_seed(1)
    dense = nn.Linear(64, 32, bias=bias).to(torch.bfloat16)
    rec = L.LinearRecord("FP8")
    fp8 = L.FP8Linear(dense, rec)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    out = fp8(x)
    ref = dense(x)
    assert out.shape == (2, 5, 32) and out.dtype == torch.bfloat16
    assert _rel_err(out, ref) < 0.08  # e4m3 activations and weights: a few percent
    assert (fp8.bias is None) == (not bias)
    if bias:
        assert torch.equal(fp8.bias, dense.bias)  # the bias is kept exactly (fused, not quantized)
        assert not fp8.bias.requires_grad
    assert fp8.weight_fp8.dtype == torch.float8_e4m3fn and fp8.weight_fp8.shape == (32, 64)
    assert fp8.weight_scale.shape == (1, 32)  # one scale per output row, laid out for _scaled_mm's scale_b
    assert (fp8.in_features, fp8.out_features) == (64, 32)
    assert rec.observed == {"FP8": 1}
    fp8(x[0])  # 2-D input: another call, counted
    assert rec.observed == {"FP8": 2}


def test_fp8_linear_uses_the_weights_it_was_built_from():
    torch.manual_seed(2)
    a, b = nn.Linear(32, 16).to(torch.bfloat16), nn.Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    out = L.FP8Linear(a, L.LinearRecord("FP8"))(x)
    assert _rel_err(out, a(x)) < 0.08 and _rel_err(out, b(x)) > 0.5


def test_fp8_linear_not_counting_under_compile():
    dense = nn.Linear(32, 16).to(torch.bfloat16)
    rec = L.LinearRecord("FP8", counting=False)
    L.FP8Linear(dense, rec)(torch.randn(3, 32, dtype=torch.bfloat16))
    assert rec.observed == {}


def test_install_fp8_replaces_only_eligible_block_linears_and_counts_every_call():
    m = _model()
    x = torch.randn(2, 7, 16, dtype=torch.bfloat16)
    ref = m(x)
    rec = L.install(m, "FP8")
    assert rec.resolved == "FP8"
    replaced = sorted(n for n, mod in m.named_modules() if isinstance(mod, L.FP8Linear))
    assert replaced == ["transformer_blocks.0.to_q", "transformer_blocks.1.to_q"]
    assert rec.modules == 2
    # outside the blocks (embedder, output) and 24-wide layers stay dense nn.Linear, listed as skipped
    assert sorted(rec.skipped) == ["proj_out", "transformer_blocks.0.back", "transformer_blocks.0.proj",
                                   "transformer_blocks.1.back", "transformer_blocks.1.proj", "x_embedder"]
    assert type(m.x_embedder) is nn.Linear and type(m.transformer_blocks[0].proj) is nn.Linear
    out = m(x)
    assert _rel_err(out, ref) < 0.1
    # one forward: 2 FP8 calls; the 6 skipped dense layers each counted once as TORCH
    assert rec.observed == {"FP8": 2, "TORCH": 6}
    m(x)
    assert rec.observed == {"FP8": 4, "TORCH": 12}


def test_install_fp8_takes_other_prefixes():
    m = _model()
    rec = L.install(m, "FP8", prefixes=("x_embedder",))
    assert [n for n, mod in m.named_modules() if isinstance(mod, L.FP8Linear)] == ["x_embedder"]
    assert rec.modules == 1 and len(rec.skipped) == 7


def test_install_fp8_replaces_a_top_level_linear():
    m = nn.Sequential(nn.Linear(16, 32))
    rec = L.install(m, "FP8", prefixes=("0",))
    assert isinstance(m[0], L.FP8Linear) and rec.modules == 1 and rec.skipped == []


def test_install_fp8_without_observing_counts_nothing():
    m = _model()
    rec = L.install(m, "FP8", observe=False)
    m(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    assert rec.observed == {} and rec.counting is False and rec.modules == 2


def test_install_torch_counts_calls_and_changes_nothing():
    m = _model()
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    ref = m(x)
    rec = L.install(m, "TORCH")
    assert torch.equal(m(x), ref)  # the counter delegates nothing and changes nothing
    assert rec.modules == 8 and rec.skipped == [] and rec.observed == {"TORCH": 8}
    assert not any(isinstance(mod, L.FP8Linear) for mod in m.modules())


def test_install_torch_without_observing():
    m = _model()
    rec = L.install(m, "TORCH", observe=False)
    m(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    assert rec.observed == {} and rec.modules == 8


@pytest.mark.parametrize("backend", ["TORCH", "FP8"])
def test_install_excludes_modules_another_field_owns(backend):
    m = _model()
    rec = L.install(m, backend, exclude=("transformer_blocks.1.",))
    assert rec.excluded == ["transformer_blocks.1.to_q", "transformer_blocks.1.proj", "transformer_blocks.1.back"]
    assert type(m.transformer_blocks[1].to_q) is nn.Linear  # left as it is
    m(torch.randn(1, 3, 16, dtype=torch.bfloat16))
    if backend == "TORCH":
        assert rec.modules == 5 and rec.observed == {"TORCH": 5}
    else:
        assert rec.modules == 1 and rec.observed == {"FP8": 1, "TORCH": 4}
        assert "transformer_blocks.1.proj" not in rec.skipped


def test_install_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown linear backend 'INT4'"):
        L.install(_model(), "INT4")


def test_eligible_needs_the_prefix_and_both_dimensions_multiples_of_16():
    pre = ("transformer_blocks.",)
    assert L._eligible("transformer_blocks.0.a", nn.Linear(16, 32), pre)
    assert not L._eligible("proj_out", nn.Linear(16, 32), pre)
    assert not L._eligible("transformer_blocks.0.a", nn.Linear(24, 32), pre)
    assert not L._eligible("transformer_blocks.0.a", nn.Linear(32, 24), pre)


def test_record_add_sums_per_implementation():
    rec = L.LinearRecord("TORCH")
    rec.add("TORCH")
    rec.add("TORCH", 3)
    rec.add("FP8", 2)
    assert rec.observed == {"TORCH": 4, "FP8": 2}


def test_install_fp8_frees_each_dense_weight_before_quantizing_the_next(monkeypatch):
    """The install kept every replaced ``nn.Linear`` alive until it returned, so its peak was the model plus every
    FP8 copy (LTX-2 in bf16 on an 80 GB H100: ``OutOfMemoryError`` while loading). When layer k is quantized, the
    dense weights of the layers replaced before it must be gone (``test_memory_cuda.py`` measures the GPU peak)."""
    import gc
    import weakref

    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    refs = [weakref.ref(m.weight) for m in model]
    seen: list = []
    quantize = L._quantize_rows

    def checked(x):
        if x.dim() == 2 and x.shape == (32, 32) and x.dtype == torch.float32:
            k = next(i for i, r in enumerate(refs) if r() is not None and r().data_ptr() == x.data_ptr())
            seen.append((k, [i for i, r in enumerate(refs[:k]) if r() is not None]))
        return quantize(x)

    monkeypatch.setattr(L, "_quantize_rows", checked)
    gc.disable()  # freed by reference counting, not by a collection that might happen to run
    try:
        rec = L.install(model, "FP8", prefixes=("",), observe=False)
    finally:
        gc.enable()
    assert rec.modules == 5 and all(type(m) is L.FP8Linear for m in model)
    assert seen == [(k, []) for k in range(5)], seen  # (layer, earlier dense weights still alive)
    assert all(r() is None for r in refs)
