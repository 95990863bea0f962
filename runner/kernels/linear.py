"""Linear backends: ``TORCH`` (dense GEMM in the model dtype), ``FP8`` (our dynamic-scaled FP8 GEMM) and
``FP8_TORCHAO`` (torchao's dynamic row-wise float8, the same scheme through torchao's tensor subclass).

``TORCH`` keeps the model's ``nn.Linear`` modules and attaches a call counter (a forward pre-hook that delegates
nothing and changes nothing). ``FP8`` replaces the eligible ``nn.Linear`` modules of the transformer blocks with
:class:`FP8Linear`, which counts its own calls.

FP8 scheme (lossy, never chosen by ``auto``): weights quantized once to ``float8_e4m3fn`` with one scale per
output row; activations quantized per call with one scale per token (row-wise dynamic scaling); GEMM by
``torch._scaled_mm`` with bf16/fp16 output and the bias fused. Scale = amax / 448 (448 is the largest finite
e4m3fn value, OCP FP8 spec). Row-wise scaling needs sm90 (cuBLASLt); sm89 uses per-tensor scales.

``FP8_TORCHAO`` (lossy, never chosen by ``auto``): ``torchao.quantization.quantize_`` with
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` (torchao 0.18) on the same eligible Linears:
the ``nn.Linear`` modules stay, their weights become torchao ``Float8Tensor`` s (e4m3, one scale per output row),
activations are quantized per token at each call (``torchao::choose_scale_float8``) and the GEMM is
``torch._scaled_mm`` (torchao's ``KernelPreference.AUTO`` on sm90). ``set_inductor_config=False``: torchao's
recommended Inductor settings turn on coordinate-descent tuning, which times kernels on the device and would undo
``optimize.deterministic_compile``. A Linear torchao declines (bf16 weights only; shapes not multiples of 16) stays
dense and is listed in ``skipped``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

E4M3_MAX = 448.0


@dataclass
class LinearRecord:
    """Calls observed per implementation for one stage's linear layers.

    Attributes:
        resolved: canonical backend selected (``TORCH`` | ``FP8``).
        modules: number of linear modules under this backend.
        observed: implementation name -> calls (summed over modules).
        skipped: modules left dense under ``FP8`` (shape not a multiple of 16, or outside the transformer blocks).
        excluded: modules owned by another backend field (the routed experts of MoE blocks, owned by the MoE
            backend): neither replaced nor counted here.
    """

    resolved: str
    counting: bool = True
    modules: int = 0
    observed: Dict[str, int] = field(default_factory=dict)
    skipped: List[str] = field(default_factory=list)
    excluded: List[str] = field(default_factory=list)

    def add(self, impl: str, n: int = 1) -> None:
        self.observed[impl] = self.observed.get(impl, 0) + n


def _quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization of a 2-D tensor ``(rows, cols)``: returns ``(x_fp8, scale[rows, 1] fp32)``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


class FP8Linear(nn.Module):
    """Drop-in ``nn.Linear`` replacement computing ``x @ W.T + b`` with FP8 operands.

    Input ``(..., in_features)`` in bf16/fp16, output ``(..., out_features)`` in the input dtype.
    """

    def __init__(self, linear: nn.Linear, record: LinearRecord, device: Optional[str] = None):
        """``device``: where the weight is quantized (the stage's compute device), the result stored where the
        weight is: a weight kept on the host for an offload plan quantizes to the same bytes as one on the device
        (the host's float division and e4m3 rounding are not guaranteed to match the GPU's)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        w_fp8, w_scale = _quantize_rows(w.to(device) if device is not None else w)
        w_fp8, w_scale = w_fp8.to(w.device), w_scale.to(w.device)
        self.register_buffer("weight_fp8", w_fp8)           # (out, in), e4m3
        self.register_buffer("weight_scale", w_scale.t().contiguous())  # (1, out), fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._record = record

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._record.counting:
            self._record.add("FP8")
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        x_fp8, x_scale = _quantize_rows(x2)
        out = torch._scaled_mm(x_fp8, self.weight_fp8.t(), scale_a=x_scale, scale_b=self.weight_scale,
                               bias=self.bias, out_dtype=x.dtype)
        return out.reshape(*shape[:-1], self.out_features)


def _eligible(name: str, mod: nn.Linear, prefixes: Tuple[str, ...]) -> bool:
    return name.startswith(prefixes) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def install(model: nn.Module, backend: str,
            prefixes: Tuple[str, ...] = ("transformer_blocks.", "single_transformer_blocks."),
            observe: bool = True, exclude: Tuple[str, ...] = (), record: Optional[LinearRecord] = None,
            device: Optional[str] = None) -> LinearRecord:
    """Apply linear backend ``backend`` to ``model`` and return the record its calls are counted into.

    Args:
        model: the stage's transformer.
        backend: ``TORCH`` or ``FP8``.
        prefixes: module-name prefixes whose linears FP8 may replace (the transformer blocks; embedders and the
            output projection stay dense, as in common FP8 recipes for DiTs).
        observe: count calls (off under ``torch.compile``, where counters would be traced, not run per call).
        exclude: module-name prefixes of Linears another backend field owns (MoE experts): left as they are,
            uncounted, listed in ``excluded``.
        record: a record of the same backend to count into (a second denoiser of the stage: Wan 2.2's
            ``transformer_2``); its modules add to the record's.
        device: the stage's compute device, where FP8 quantizes each weight (:class:`FP8Linear`).
    """
    rec = record if record is not None else LinearRecord(resolved=backend, counting=observe)
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear]
    if exclude:
        rec.excluded += [n for n, _ in linears if n.startswith(exclude)]
        linears = [(n, m) for n, m in linears if not n.startswith(exclude)]
    if backend == "TORCH":
        for _, m in linears:
            if observe:
                m.register_forward_pre_hook(lambda mod, args, _r=rec: _r.add("TORCH"))
        rec.modules += len(linears)
        return rec
    if backend == "FP8_TORCHAO":
        return _install_torchao(model, rec, linears, prefixes, observe)
    if backend != "FP8":
        raise ValueError(f"unknown linear backend {backend!r}")
    for i in range(len(linears)):
        name, m = linears[i]
        linears[i] = None  # no reference left: each bf16 weight is freed once its FP8 copy replaces it, so the
        parent_name, _, child = name.rpartition(".")  # peak is the model plus one layer, not plus every FP8 copy
        parent = model.get_submodule(parent_name) if parent_name else model
        if _eligible(name, m, prefixes):
            setattr(parent, child, FP8Linear(m, rec, device))
            rec.modules += 1
            del m
        else:
            if observe:
                m.register_forward_pre_hook(lambda mod, args, _r=rec: _r.add("TORCH"))
            rec.skipped.append(name)
    return rec


def torchao_config() -> object:
    """torchao's config for ``FP8_TORCHAO``: dynamic row-wise float8 activations and weights (e4m3)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

    return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)


def _is_torchao_float8(t: torch.Tensor) -> bool:
    return "Float8" in type(t).__name__


def _install_torchao(model: nn.Module, rec: LinearRecord, linears: List[Tuple[str, nn.Linear]],
                     prefixes: Tuple[str, ...], observe: bool) -> LinearRecord:
    """``FP8_TORCHAO``: torchao's ``quantize_`` on the eligible Linears (see the module docstring); each module
    counts its calls as ``FP8_TORCHAO`` when torchao converted its weight, else ``TORCH`` (listed in ``skipped``)."""
    from torchao.quantization import quantize_

    want = {name for name, m in linears if _eligible(name, m, prefixes) and m.weight.dtype == torch.bfloat16}
    if want:
        quantize_(model, torchao_config(), filter_fn=lambda mod, fqn: fqn in want)
    for name, m in linears:
        if name in want and _is_torchao_float8(m.weight):
            impl = "FP8_TORCHAO"
            rec.modules += 1
        else:
            impl = "TORCH"
            rec.skipped.append(name)
        if observe:
            m.register_forward_pre_hook(lambda mod, args, _r=rec, _i=impl: _r.add(_i))
    return rec
