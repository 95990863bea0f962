"""Weight quantization methods (``model.quantization.<component>``): one record per method, applied through
diffusers' and transformers' own quantizer configs at ``from_pretrained`` (``PipelineQuantizationConfig(
quant_mapping={component: config})``; a GGUF file through ``from_single_file``).

Every method is lossy by design (weights rounded to fewer bits): a run that sets one is labelled lossy
(``runner.core.lossy``: lane ``model.quantization.<component>=<method>``) and gated against the lossless run
(``runner.tools.gate``). Each record holds

* its requirements (``runner.kernels.registry`` requirement checks: platform, compute capability, the package's entry
  point), evaluated before any weight loads; every unmet one is named;
* how to build the library config (:meth:`WeightQuant.config`, per library: ``diffusers`` or ``transformers``);
* the storage cost the memory planner uses (:attr:`WeightQuant.bits`: bits per ``nn.Linear`` weight element, scales
  included);
* what evidence observes: :attr:`WeightQuant.tensor_classes`, the class names a quantized Linear's weight has when
  it executes (a forward pre-hook reads ``type(module.weight)`` at call time, ``models.memory.QuantProbe``), and
  :attr:`WeightQuant.signature`, a regex over the profiled device kernel names of the quantized matmul /
  dequantization (None where the method leaves no kernel name of its own: torchao's weight-only int8/float8 and
  diffusers' torch GGUF dequantization run as generic elementwise kernels and a dense GEMM, so there the weight
  class at call time is the evidence).

Sources:
  * torchao 0.18 ``Int8WeightOnlyConfig``: int8 weights with one scale per output row (``Int8Tensor``; weight-only
    linear = ``mm(x, int8.to(dtype)) * scale``, ``torchao/quantization/quantize_/workflows/int8/int8_tensor.py``:
    runs on CPU too); ``Float8WeightOnlyConfig``: e4m3 weights, per-row scale (``Float8Tensor``), sm89+.
    ``Int8DynamicActivationInt8WeightConfig`` (W8A8): the same ``Int8Tensor`` weights carrying
    ``act_quant_kwargs`` (each call quantizes the activations to int8 per row and runs an int8 GEMM,
    ``torch._int_mm``: int8 tensor cores, twice bf16's rate on Hopper): :func:`weight_class_names` names it
    ``Int8Tensor+dynamic_act`` so the evidence tells it from weight-only int8. ``Int4WeightOnlyConfig(group_size=128,
    int4_packing_format="tile_packed_to_4d")``: int4 weights with a bf16 scale and zero point per 128
    (``Int4TilePackedTo4dTensor``, tinygemm's ``aten._weight_int4pack_mm``, CUDA sm80+, bfloat16 weights only:
    ``int4_tile_packed_to_4d_tensor.py`` asserts both; 4 + 2*16/128 = 4.25 bits). No torchao 0.18 int4 weight-only
    packing runs on a CPU (tried on a 256x256 bf16 Linear with torch 2.13 CPU): ``plain`` and ``preshuffled`` raise
    ``ImportError: Requires mslk >= 1.0.0`` (mslk: CUDA kernels), ``tile_packed_to_4d`` ``Torch not compiled with
    CUDA enabled``, ``plain_int32`` ``does not support device 'cpu' yet`` (the ``opaque`` CPU packing of earlier
    releases is gone): refused off CUDA at startup.
  * torchao 0.18 ``torchao.prototype.mx_formats.NVFP4DynamicActivationNVFP4WeightConfig``: NVFP4 weights and
    activations (e2m1 with an e4m3 scale per 16, 4 + 8/16 = 4.5 bits; ``NVFP4Tensor``), Blackwell (sm100) only; it
    fails on FLUX at a batch of 32 and more (pytorch/ao issue #4023): refused at startup there
    (:attr:`WeightQuant.max_batch`). Its activation quantization takes mslk's triton kernel by default
    (``use_triton_kernel=True``, an assertion without mslk): built with it only where mslk imports.
  * Pre-quantized checkpoints (:attr:`WeightQuant.checkpoint`: the runner builds no config, the component's
    ``config.json`` carries diffusers' ``quantization_config`` and ``from_pretrained`` applies it):
    diffusers 0.42 ``NunchakuLiteQuantizationConfig`` (``quant_method: nunchaku_lite``; SVDQuant W4A4 and AWQ W4A16
    targets, exported by diffuse-compressor) replaces each target Linear by ``SVDQW4A4Linear`` / ``AWQW4A16Linear``
    (``diffusers/quantizers/nunchaku/utils.py``), whose kernels the Hugging Face ``kernels`` package downloads from
    the Hub repository ``rootonchair/nunchaku-lite-kernels``, only with ``DIFFUSERS_TRUST_REMOTE_KERNELS=true`` (the
    module raises at import otherwise); ``NunchakuLiteQuantizer.validate_environment``: a CUDA GPU, not Hopper
    (sm90 refused), Turing (sm75) or newer for INT4, Blackwell (sm100) for NVFP4. Storage: 4-bit weights with a
    16-bit scale per 64 (INT4) or an e4m3 scale per 16 (NVFP4) and a rank-32 bf16 low-rank branch (FLUX's 3072-wide
    Linears: 0.2 to 0.33 bits per weight), planned at 4.75 bits where the checkpoint's files are not there to size.
    ``NVIDIAModelOptConfig`` (``quant_method: modelopt``, package ``nvidia-modelopt``, imported as ``modelopt``):
    each Linear becomes ModelOpt's ``QuantLinear`` (``modelopt/torch/quantization/nn/modules/quant_linear.py``:
    ``_QuantLinear(QuantLinearConvBase)``, a ``weight_quantizer`` per module; compressed weights are
    ``QTensorWrapper``); a pre-quantized checkpoint is restored through ModelOpt's
    ``enable_huggingface_checkpointing()`` (diffusers' ``check_model_patching`` warns without it), called before
    loading (:attr:`WeightQuant.before_load`). Planned at 8 bits (FP8, the common export) without the files.
  * diffusers 0.42 ``TorchAoConfig`` takes an ``AOBaseConfig`` instance only (``quantization_config.py``
    ``post_init``: a string raises ``TypeError``).
  * bitsandbytes NF4: 4-bit NormalFloat with one absmax per 64 weights, the absmax double-quantized to 8 bits in
    blocks of 256 (Dettmers et al. 2023, QLoRA, sec. 3: 4 + 32/64 bits without, 4 + 8/64 + 32/(64*256) = 4.127 with
    double quantization); CUDA only in the planner's records (bitsandbytes' CPU backend is partial). Kernels:
    ``kgemm_4bit_inference`` (batch-1 GEMV), ``kDequantizeBlockwise`` before a dense GEMM (bitsandbytes
    ``csrc/kernels.cu``).
  * GGUF: diffusers' ``GGUFQuantizationConfig`` + ``from_single_file``; the weights stay in the file's block formats
    (Q4_K: 4.5 bits per weight, ggml ``ggml-quants.h`` block_q4_K = 144 bytes per 256 weights) and are dequantized
    per call by diffusers' torch code (``diffusers/quantizers/gguf/utils.py``: ``dequantize_gguf_tensor``) or, with
    the ``kernels`` package on CUDA, by its ``ggml_dequantize`` kernels. The planner sizes a GGUF component from its
    file's bytes.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from runner.kernels.registry import Requirement, SelectionContext, dtype_in, on_platform, sm_at_least, symbol
from runner.core.errors import RefusedError, UserInputError, install_fix

NONE = "none"


class QuantizationError(UserInputError, ValueError):
    """``model.quantization``: an unknown method, a component the model does not have, a GGUF file missing."""


class QuantizationUnavailableError(RefusedError, QuantizationError):
    """A quantization method that cannot run here; names every unmet requirement of every component at once."""


@dataclass(frozen=True)
class WeightQuant:
    """One weight quantization method.

    Attributes:
        name: canonical spelling (``int8wo``).
        aliases: other accepted spellings (case-insensitive, ``-`` == ``_``).
        requires: ``runner.kernels.registry`` requirements (``ctx -> reasons``), all evaluated.
        bits: storage bits per quantized ``nn.Linear`` weight element, scales included (None: from the file).
        libraries: component libraries it has a config for (``diffusers``, ``transformers``).
        tensor_classes: class names of a quantized weight as seen at call time (evidence).
        signature: regex over profiled GPU kernel names of its matmul / dequantization; None: none of its own.
        needs_file: the weights come from a file (``model.quantization.gguf_file``), not from the snapshot.
        describe: one line for listings and the manifest.
        max_batch: the largest ``batch_size`` it is known to run at (None: no known limit), with
            ``max_batch_source`` (where the failure is reported).
        fix: what makes it run when a requirement is unmet here (the platform, GPU, dtype it needs), worded for
            the refusal (``{where}``: the component's key, e.g. ``model.quantization.transformer``).
        checkpoint: a pre-quantized checkpoint's ``quantization_config.quant_method`` (diffusers), which the
            component's ``config.json`` must declare; the runner builds no config for it (None: quantized here).
        module_classes: class names of the modules it puts in place of ``nn.Linear`` (evidence: a module of one of
            them is a quantized Linear whatever its weight).
        before_load: ``module:callable`` called once before ``from_pretrained`` (ModelOpt's checkpoint restore).
        inspect: ``(quantization_config, ctx) -> reasons`` a pre-quantized checkpoint's own config cannot load here
            for (Nunchaku's NVFP4 targets off Blackwell), each naming its fix.
        quantize_on_device: its quantization itself runs on the GPU only (torchao 0.18's int4 packing,
            ``aten::_convert_weight_to_int4pack``, has no CPU kernel): the component is loaded onto the run's device
            (``from_pretrained(device_map=)``; ``quantize_(device=)`` for built weights), not quantized on the host.
        min_rows: the fewest rows (``M``: elements of the input over ``in_features``) its GEMM takes per call (0: no
            limit), with ``min_rows_source``. The Linears that see one row per sample (:data:`PER_SAMPLE_LINEARS`)
            stay in the compute dtype under such a method (:func:`kept_dense`), recorded with the reason.
    """

    name: str
    aliases: Tuple[str, ...] = ()
    requires: Tuple[Callable[[SelectionContext], List[str]], ...] = ()
    bits: Optional[float] = None
    libraries: Tuple[str, ...] = ("diffusers", "transformers")
    tensor_classes: Tuple[str, ...] = ()
    signature: Optional[str] = None
    needs_file: bool = False
    describe: str = ""
    max_batch: Optional[int] = None
    max_batch_source: str = ""
    fix: str = ""
    checkpoint: Optional[str] = None
    module_classes: Tuple[str, ...] = ()
    before_load: Optional[str] = None
    inspect: Optional[Callable[[Dict[str, Any], SelectionContext], List[str]]] = None
    quantize_on_device: bool = False
    min_rows: int = 0
    min_rows_source: str = ""

    def unmet(self, ctx: SelectionContext) -> List[str]:
        """Every requirement not met in ``ctx`` (empty: it can run)."""
        out: List[str] = []
        for req in self.requires:
            out.extend(req(ctx))
        return out

    def config(self, library: str, dtype: torch.dtype, keep: Sequence[str] = ()) -> Any:
        """The library's quantization config for a component of ``library`` computing in ``dtype``; ``keep``: the
        qualified names of Linears it leaves unconverted (:func:`kept_dense`; the config's
        ``modules_to_not_convert``, which diffusers and transformers match as ``name + "."`` inside a parameter's
        name).

        Raises:
            QuantizationError: the method has no config for that library (GGUF: transformers components), or
                builds none (a pre-quantized checkpoint's method: the checkpoint holds its config).
        """
        if self.checkpoint is not None:
            raise QuantizationError(f"quantization method {self.name} loads a pre-quantized checkpoint; the "
                                    "checkpoint's config.json holds its quantization_config")
        if library not in self.libraries:
            raise QuantizationError(f"quantization method {self.name} has no {library} config (it quantizes "
                                    f"{'/'.join(self.libraries)} components)")
        lib = importlib.import_module(library)
        return _BUILDERS[self.name](lib, dtype, list(keep)) if keep else _BUILDERS[self.name](lib, dtype)


#: Linears of the denoisers that see one row per sample (``M`` = batch, times two under batched CFG): the
#: timestep / guidance / pooled-text embedders and the AdaLN modulation projections, whose input is the per-sample
#: conditioning vector, not the tokens. Regular expressions, each matched in full against a Linear's qualified name
#: in its component. One table for every family (and the generic ``model.engine=diffusers`` adapter): the names
#: differ by family, and no family's per-token Linear matches another's per-sample pattern. Found by counting the
#: rows of every Linear call on each family's tiny model (a method with :attr:`WeightQuant.min_rows` records the
#: rows each Linear ran with: its evidence fails a run in which a quantized Linear ran with one row per sample, and
#: records the kept ones that ran per token, as Wan 2.2 TI2V-5B's time embedder does: ``expand_timesteps``).
#: Per family: FLUX.1 ``time_text_embed.*``, ``*.norm1.linear``, ``*.norm1_context.linear``, the single blocks'
#: ``norm.linear``, ``norm_out.linear``; SD3.5 the same without guidance; FLUX.2 ``time_guidance_embed.*``,
#: ``double_stream_modulation_{img,txt}.linear``, ``single_stream_modulation.linear``; Qwen-Image
#: ``time_text_embed.*``, ``*.img_mod.1``, ``*.txt_mod.1``; Wan 2.1/2.2 ``condition_embedder.time_embedder.*``,
#: ``condition_embedder.time_proj`` (its per-token ``condition_embedder.text_embedder`` is not matched); Z-Image
#: ``t_embedder.*``, ``*.adaLN_modulation.N``; HiDream ``t_embedder.*``, ``p_embedder.*``,
#: ``*.adaLN_modulation.N``; LTX-2 ``time_embed.*``, ``audio_time_embed.*``, ``av_cross_attn_*.*`` (the audio-video
#: cross-attention's scale/shift and gate embedders); HunyuanVideo-1.5 ``time_embed.*``, its blocks' ``norm1.linear``
#: / ``norm1_context.linear``, ``norm_out.linear`` and its text refiner's ``context_embedder.time_text_embed.*`` and
#: ``context_embedder.token_refiner.refiner_blocks.N.norm_out.linear``.
PER_SAMPLE_LINEARS: Tuple[str, ...] = (
    r"(.*\.)?time_text_embed\..*", r"time_guidance_embed\..*", r"(.*\.)?time_embed\..*", r"audio_time_embed\..*",
    r"av_cross_attn_\w+\..*", r"condition_embedder\.time_(embedder\..*|proj)", r"(.*\.)?[tp]_embedder\..*",
    r"(.*\.)?norm1(_context)?\.linear", r"(.*\.)?norm\.linear", r"(.*\.)?norm_out\.linear",
    r".*_modulation(_img|_txt)?\.linear", r"(.*\.)?(img|txt)_mod\.\d+", r"(.*\.)?adaLN_modulation\.\d+",
)


def kept_dense(q: "WeightQuant", module: torch.nn.Module) -> List[str]:
    """The qualified names of ``module``'s Linears that method ``q`` leaves in the compute dtype: where
    :attr:`WeightQuant.min_rows` is set, those matching :data:`PER_SAMPLE_LINEARS` (they see fewer rows than its
    GEMM takes at small batches, and hold a negligible share of the FLOPs: ``M`` = batch); otherwise none."""
    import re

    if not q.min_rows:
        return []
    pat = re.compile("|".join(f"(?:{p})" for p in PER_SAMPLE_LINEARS))
    return [n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear) and pat.fullmatch(n)]


def _torchao(cls_name: str, module: str = "torchao.quantization", **kwargs: Any) -> Callable[..., Any]:
    def build(lib: Any, dtype: torch.dtype, keep: Optional[List[str]] = None) -> Any:
        ao = getattr(importlib.import_module(module), cls_name)(**kwargs)
        return lib.TorchAoConfig(ao, modules_to_not_convert=keep) if keep else lib.TorchAoConfig(ao)
    return build


def _nvfp4(lib: Any, dtype: torch.dtype, keep: Optional[List[str]] = None) -> Any:
    """torchao's NVFP4 config; its activation quantization through mslk's triton kernel only where mslk imports
    (torchao 0.18 asserts on mslk when the kernel is asked for and the shape fits it)."""
    from runner.kernels.registry import has_symbol

    return _torchao("NVFP4DynamicActivationNVFP4WeightConfig", "torchao.prototype.mx_formats",
                    use_triton_kernel=has_symbol("mslk"))(lib, dtype, keep)


def sm_not(*sms: int) -> Requirement:
    """Not on these compute capabilities (a library that refuses them: diffusers' Nunchaku loader on Hopper)."""
    return Requirement(f"sm not in {sms}", lambda ctx: [
        f"does not run on sm{ctx.sm} (its loader refuses {' and '.join(f'sm{s}' for s in sms)})"]
        if ctx.sm in sms else [])


def trusts_remote_kernels() -> bool:
    """Whether diffusers will load a kernel repository that is not a trusted publisher's (its
    ``DIFFUSERS_TRUST_REMOTE_KERNELS``, read when diffusers was imported; the environment where it is not)."""
    import os

    try:
        from diffusers.utils import constants
    except ImportError:
        constants = None
    val = getattr(constants, "DIFFUSERS_TRUST_REMOTE_KERNELS", None)
    if val is None:
        return os.environ.get("DIFFUSERS_TRUST_REMOTE_KERNELS", "").upper() in ("1", "ON", "YES", "TRUE")
    return bool(val)


def _nunchaku_inspect(qc: Dict[str, Any], ctx: SelectionContext) -> List[str]:
    """A Nunchaku Lite checkpoint's ``quantization_config`` against this device and environment (diffusers 0.42
    ``NunchakuLiteQuantizer.validate_environment``; ``quantizers/nunchaku/utils.py`` at import)."""
    out: List[str] = []
    if (qc.get("svdq_w4a4") or {}).get("precision") == "nvfp4" and (ctx.sm or 0) < 100:
        out.append("its svdq_w4a4 targets are NVFP4, which diffusers loads on a Blackwell GPU (sm100+) only, this "
                   f"device is {'sm%d' % ctx.sm if ctx.sm else 'not a CUDA GPU'}; fix: platform=cuda on a Blackwell "
                   "GPU, or an INT4 Nunchaku Lite checkpoint")
    if not trusts_remote_kernels():
        out.append("diffusers loads its kernels (the Hub repository rootonchair/nunchaku-lite-kernels, not a trusted "
                   "kernel publisher's) only with DIFFUSERS_TRUST_REMOTE_KERNELS=true; fix: export "
                   "DIFFUSERS_TRUST_REMOTE_KERNELS=true (with no network, have the kernels in the Hugging Face cache "
                   "first)")
    return out


def _nf4(lib: Any, dtype: torch.dtype) -> Any:
    return lib.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype)


def _gguf(lib: Any, dtype: torch.dtype) -> Any:
    return lib.GGUFQuantizationConfig(compute_dtype=dtype)


_BUILDERS: Dict[str, Callable[..., Any]] = {
    "int8wo": _torchao("Int8WeightOnlyConfig"), "float8wo": _torchao("Float8WeightOnlyConfig"),
    "int8dq": _torchao("Int8DynamicActivationInt8WeightConfig"),
    "int4wo": _torchao("Int4WeightOnlyConfig", group_size=128, int4_packing_format="tile_packed_to_4d"),
    "nvfp4": _nvfp4,
    "nf4": _nf4, "gguf": _gguf}

METHODS: Dict[str, WeightQuant] = {}


def register(q: WeightQuant) -> WeightQuant:
    """Add a method record (its config builder must be in ``_BUILDERS`` under the same name)."""
    METHODS[q.name] = q
    return q


register(WeightQuant(
    "int8wo", aliases=("int8", "int8_weight_only", "torchao_int8"),
    requires=(symbol("torchao.quantization:Int8WeightOnlyConfig"),), bits=8.0, tensor_classes=("Int8Tensor",),
    describe="torchao int8 weight-only (per-row scale), dequantized into the GEMM"))
register(WeightQuant(
    "float8wo", aliases=("fp8wo", "float8_weight_only", "torchao_float8"),
    requires=(on_platform("cuda"), sm_at_least(89), symbol("torchao.quantization:Float8WeightOnlyConfig")),
    bits=8.0, tensor_classes=("Float8Tensor",),
    fix="platform=cuda on an sm89+ GPU (Ada, Hopper, Blackwell: float8 tensor cores)",
    describe="torchao float8 (e4m3) weight-only, per-row scale"))
register(WeightQuant(
    "int8dq", aliases=("w8a8", "int8_dynamic", "int8_dynamic_activation_int8_weight"),
    requires=(symbol("torchao.quantization:Int8DynamicActivationInt8WeightConfig"),), bits=8.0,
    tensor_classes=("Int8Tensor+dynamic_act",), min_rows=17,
    min_rows_source=("torch's int8 GEMM torch._int_mm, which Inductor emits for torchao's W8A8 under torch.compile "
                     "(torchao 0.18's safe_int_mm falls back to a float matmul in eager mode only), raises "
                     "'self.size(0) needs to be greater than 16' on CUDA: FLUX.1-dev at batch 4 failed every item "
                     "on an H100, 2026-12-07, benchmarks/results/throughput_h100_2026-12-07_flux_a.json"),
    describe="torchao W8A8: int8 weights (per-row scale), activations quantized to int8 per call, int8 GEMM"))
register(WeightQuant(
    "int4wo", aliases=("int4", "int4_weight_only", "torchao_int4"),
    requires=(on_platform("cuda"), sm_at_least(80), dtype_in(torch.bfloat16),
              symbol("torchao.quantization:Int4WeightOnlyConfig")),
    bits=4.25, tensor_classes=("Int4TilePackedTo4dTensor",), signature=r"int4pack|tinygemm", quantize_on_device=True,
    fix=("platform=cuda dtype=bfloat16 on an sm80+ GPU (torchao 0.18's int4 weight-only is tinygemm's CUDA GEMM in "
         "bfloat16; none of its int4 packings has a CPU kernel), or {where}=int8dq / int8wo on this machine"),
    describe="torchao int4 weight-only, group 128 (bf16 scale and zero point), tinygemm tile packing"))
register(WeightQuant(
    "nvfp4", aliases=("fp4", "nvfp4_dynamic"),
    requires=(on_platform("cuda"), sm_at_least(100),
              symbol("torchao.prototype.mx_formats:NVFP4DynamicActivationNVFP4WeightConfig")),
    bits=4.5, tensor_classes=("NVFP4Tensor",), max_batch=31,
    max_batch_source="pytorch/ao issue #4023: NVFP4 on FLUX fails at a batch of 32 and more",
    fix=("platform=cuda on a Blackwell GPU (sm100: B200/GB200, the FP4 tensor cores NVFP4 needs), or "
         "{where}=float8wo / int4wo on Hopper"),
    describe="torchao NVFP4 weights and activations (e2m1, e4m3 scale per 16), Blackwell only"))
register(WeightQuant(
    "nf4", aliases=("bnb_nf4", "bnb4", "4bit"),
    requires=(on_platform("cuda"), symbol("bitsandbytes:matmul_4bit")), bits=4.127,
    tensor_classes=("Params4bit",), signature=r"kgemm_4bit|kDequantizeBlockwise|dequantize_blockwise|gemv_4bit",
    fix="platform=cuda (bitsandbytes' 4-bit kernels)",
    describe="bitsandbytes 4-bit NormalFloat, double-quantized absmax (block 64)"))
register(WeightQuant(
    "gguf", aliases=("gguf_file",),
    requires=(symbol("gguf:GGMLQuantizationType"),), libraries=("diffusers",), tensor_classes=("GGUFParameter",),
    needs_file=True,
    describe="a GGUF file's block-quantized weights (e.g. Q4_K), dequantized per call"))
register(WeightQuant(
    "nunchaku", aliases=("nunchaku_lite", "svdquant"),
    requires=(on_platform("cuda"), sm_at_least(75), sm_not(90),
              symbol("diffusers.quantizers.quantization_config:NunchakuLiteQuantizationConfig"),
              symbol("kernels:get_kernel")),
    bits=4.75, libraries=("diffusers",), checkpoint="nunchaku_lite", inspect=_nunchaku_inspect,
    tensor_classes=("SVDQW4A4Linear", "AWQW4A16Linear"), module_classes=("SVDQW4A4Linear", "AWQW4A16Linear"),
    fix=("platform=cuda on an NVIDIA GPU that diffusers' Nunchaku Lite loader takes: Turing (sm75) or newer for "
         "INT4, Blackwell (sm100) for NVFP4, not Hopper (sm90)"),
    describe="a Nunchaku Lite checkpoint (SVDQuant W4A4 / AWQ W4A16), Hugging Face kernels"))
register(WeightQuant(
    "modelopt", aliases=("nvidia_modelopt", "model_opt"),
    requires=(on_platform("cuda"), symbol("diffusers.quantizers.quantization_config:NVIDIAModelOptConfig"),
              symbol("modelopt.torch.opt:enable_huggingface_checkpointing")),
    bits=8.0, libraries=("diffusers",), checkpoint="modelopt",
    tensor_classes=("QuantLinearConvBase", "QTensorWrapper"), module_classes=("QuantLinearConvBase",),
    before_load="modelopt.torch.opt:enable_huggingface_checkpointing",
    fix="platform=cuda (an NVIDIA GPU: ModelOpt's quantized Linears run on CUDA)",
    describe="an NVIDIA ModelOpt checkpoint (FP8 / INT8 / INT4 / NVFP4 quantized Linears)"))


def _key(s: str) -> str:
    return str(s).strip().lower().replace("-", "_")


def normalize(value: Any, where: str) -> str:
    """Canonical method name (or ``none``) of ``value`` set at config key ``where``.

    Raises:
        QuantizationError: an unknown name, listing the valid ones and the closest.
    """
    if value is None or _key(value) in ("none", "", "null", "off"):
        return NONE
    table = {_key(a): q.name for q in METHODS.values() for a in (q.name, *q.aliases)}
    k = _key(value)
    if k in table:
        return table[k]
    close = difflib.get_close_matches(k, list(table), n=1, cutoff=0.4)
    raise QuantizationError(f"{where}={value!r} is not a quantization method"
                            + (f"; closest: {table[close[0]]}" if close else "")
                            + f"; valid: {', '.join([NONE, *METHODS])}; fix: e.g. {where}=int8wo")


def get(name: str) -> WeightQuant:
    """The record of canonical method ``name``."""
    return METHODS[name]


def check(choices: Dict[str, str], libraries: Dict[str, str], ctx: SelectionContext,
          gguf_file: Optional[str], batch_size: Optional[int] = None) -> None:
    """Fail closed on every component's method at once.

    Args:
        choices: component -> canonical method (``none`` entries ignored).
        libraries: component -> its library (``diffusers`` | ``transformers``), the family's components.
        ctx: where it would run.
        gguf_file: ``model.quantization.gguf_file``.
        batch_size: the run's ``batch_size`` (None: not checked), against each method's :attr:`WeightQuant.max_batch`.

    Raises:
        QuantizationError: a component the model does not have, a library the method has no config for, a GGUF
            method without its file (or a file without a GGUF method), two GGUF components, a batch the method is
            known to fail at.
        QuantizationUnavailableError: unmet requirements, each named with its component.
    """
    bad: List[str] = []
    unmet: List[Tuple[str, WeightQuant, List[str]]] = []
    ggufs = [c for c, m in choices.items() if m == "gguf"]
    for comp, method in choices.items():
        if method == NONE:
            continue
        where = f"model.quantization.{comp}={method}"
        if comp not in libraries:
            bad.append(f"{where}: the model has no component {comp!r} (its components: "
                       f"{', '.join(sorted(libraries))})")
            continue
        q = get(method)
        if libraries[comp] not in q.libraries:
            bad.append(f"{where}: {method} quantizes only {'/'.join(q.libraries)} components, {comp} is a "
                       f"{libraries[comp]} model")
        why = q.unmet(ctx)
        if why:
            unmet.append((f"model.quantization.{comp}", q, why))
        if q.max_batch is not None and batch_size is not None and batch_size > q.max_batch:
            bad.append(f"{where} with batch_size={batch_size}: {method} is known to fail above a batch of "
                       f"{q.max_batch} ({q.max_batch_source}); fix: batch_size={q.max_batch} or less, or another "
                       "method")
    if len(ggufs) > 1:
        bad.append(f"model.quantization: gguf on {', '.join(ggufs)}; one gguf_file holds one component")
    if ggufs and not gguf_file:
        bad.append(f"model.quantization.{ggufs[0]}=gguf needs model.quantization.gguf_file=/path/to/file.gguf")
    if gguf_file and not ggufs:
        bad.append(f"model.quantization.gguf_file={gguf_file!r} is set but no component is gguf; fix: "
                   "model.quantization.transformer=gguf, or remove gguf_file")
    if bad:
        raise QuantizationError("; ".join(bad + [_cannot(*u) for u in unmet]))
    if unmet:
        raise unavailable(unmet)


def checkpoint_problems(comp: str, q: WeightQuant, source_kind: str, config: Optional[Dict[str, Any]],
                        ctx: SelectionContext, model: str) -> List[str]:
    """Why a pre-quantized checkpoint's method (:attr:`WeightQuant.checkpoint`) cannot load component ``comp``:
    the weights are no checkpoint (``load_format=dummy``, an embedded model), the component's ``config.json``
    (``config``) declares no such ``quantization_config``, or the checkpoint's own config cannot load here
    (:attr:`WeightQuant.inspect`). Empty: it can."""
    key = f"model.quantization.{comp}={q.name}"
    if source_kind != "path":
        return [f"{key} loads a pre-quantized {q.checkpoint} checkpoint, and model={model} has no checkpoint "
                f"(its weights are {source_kind}); fix: model.path=<a snapshot whose {comp}/config.json declares "
                f"quantization_config.quant_method={q.checkpoint}>, or model.quantization.{comp}=int8dq to quantize "
                "these weights"]
    qc = (config or {}).get("quantization_config") or {}
    have = qc.get("quant_method") if isinstance(qc, dict) else None
    if have != q.checkpoint:
        found = f"quant_method {have!r}" if have else "no quantization_config"
        return [f"{key}: the snapshot's {comp}/config.json declares {found}, so it is not a {q.checkpoint} "
                f"checkpoint; fix: model.path=<a {q.checkpoint} export of the model>, or "
                f"model.quantization.{comp}=none (or int8dq to quantize its weights here)"]
    return [f"{key}: {w}" for w in (q.inspect(qc, ctx) if q.inspect else [])]


def undeclared_checkpoints(configs: Dict[str, Optional[Dict[str, Any]]], choices: Dict[str, str]) -> List[str]:
    """Components whose ``config.json`` declares a pre-quantized checkpoint of a record (diffusers applies its
    ``quantization_config`` whatever the runner asks) while ``model.quantization.<component>`` does not name that
    record: the run would be quantized, and lossy, without its label."""
    by_method = {q.checkpoint: q for q in METHODS.values() if q.checkpoint}
    bad = []
    for comp, conf in configs.items():
        qc = (conf or {}).get("quantization_config")
        rec = by_method.get(qc.get("quant_method")) if isinstance(qc, dict) else None
        if rec is not None and choices.get(comp) != rec.name:
            bad.append(f"model.quantization.{comp}={choices.get(comp, NONE)}: the snapshot's {comp} is a "
                       f"pre-quantized {rec.checkpoint} checkpoint (its config.json's quantization_config), which "
                       f"diffusers applies as it loads; fix: model.quantization.{comp}={rec.name} (the run is then "
                       "labelled lossy and its quantized Linears observed)")
    return bad


def _cannot(key: str, q: WeightQuant, why: Sequence[str]) -> str:
    return f"{key}={q.name} cannot run here: " + "; ".join(why)


def unavailable(unmet: Sequence[Tuple[str, WeightQuant, Sequence[str]]]) -> QuantizationUnavailableError:
    """The refusal of methods whose requirements are unmet (``(key, record, reasons)`` each): every reason, then
    each method's fix: a missing package's install line (``pip install nvidia-modelopt`` for ``modelopt``: the
    distribution's name, :data:`_PIP`), an upgrade of a package that lacks the entry point, and the record's own
    :attr:`WeightQuant.fix` where more than a package is missing (the platform, GPU or dtype it needs); last,
    another method. With several methods each fix is prefixed by its key."""
    fixes = [(f"{key}={q.name}: " if len(unmet) > 1 else "") + f
             for key, q, why in unmet for f in [_fix(key, q, why)] if f]
    other = ("choose another method (model.quantization.<component>=int8wo runs everywhere torchao is installed) "
             "or none.")
    fix = "; ".join(fixes) + ", or " + other if fixes else other[0].upper() + other[1:]
    return QuantizationUnavailableError("; ".join(_cannot(*u) for u in unmet) + ". Fix: " + fix)


def _fix(key: str, q: WeightQuant, why: Sequence[str]) -> str:
    """What makes ``q`` run at ``key``: every part it needs, joined by ``and``."""
    import re

    text = "; ".join(why)
    missing = sorted(set(re.findall(r"package `([\w.-]+)` is not installed", text)))
    # a missing package gets its install line, as the other extras' refusals do (torchao: the runner's extra)
    parts = [install_fix(_INSTALL[p]) if p in _INSTALL else f"pip install {_PIP.get(p, p)}" for p in missing]
    stale = sorted(set(re.findall(r"needs `(\w+)[^`]*` \(the installed package lacks it\)", text)))
    parts += [f"pip install -U {_PIP.get(p, p)}" for p in stale]
    if q.fix and any("package" not in w for w in why):
        parts.append(q.fix.format(where=key))
    return " and ".join(dict.fromkeys(parts))


#: The project's extra that installs a quantization package missing here (``runner.core.requirements.install_fix``).
_INSTALL = {"torchao": "torchao"}
#: The pip distribution of a package whose import name differs (NVIDIA ModelOpt is imported as ``modelopt``).
_PIP = {"modelopt": "nvidia-modelopt"}


def replacement_classes() -> Tuple[str, ...]:
    """Every record's :attr:`WeightQuant.module_classes` (modules a method puts in place of ``nn.Linear``)."""
    return tuple(dict.fromkeys(c for q in METHODS.values() for c in q.module_classes))


def is_quantized_linear_site(module: torch.nn.Module) -> bool:
    """An ``nn.Linear``, or a module of a method's replacement class (Nunchaku's ``SVDQW4A4Linear``): where the
    evidence reads the class a quantized Linear runs with."""
    if isinstance(module, torch.nn.Linear):
        return True
    return bool({c.__name__ for c in type(module).__mro__} & set(replacement_classes()))


def weight_class_names(module: torch.nn.Module) -> Sequence[str]:
    """What a quantized Linear is at call time: the replacement module class it is, if any (Nunchaku's
    ``SVDQW4A4Linear``; ModelOpt's ``QuantLinearConvBase`` while its ``weight_quantizer`` is enabled), then the class
    names in ``type(module.weight).__mro__`` (torchao's W8A8 ``Int8Tensor`` with activation quantization first as
    ``Int8Tensor+dynamic_act``)."""
    names: List[str] = []
    own = [c.__name__ for c in type(module).__mro__]
    quantizer = getattr(module, "weight_quantizer", None)
    if quantizer is None or getattr(quantizer, "is_enabled", True):
        names += [c for c in replacement_classes() if c in own][:1]
    w = getattr(module, "weight", None)
    if w is None:
        return names
    wnames = [c.__name__ for c in type(w).__mro__]
    if getattr(w, "act_quant_kwargs", None) is not None:  # torchao W8A8: activations quantized per call
        wnames.insert(0, f"{wnames[0]}+dynamic_act")
    return names + wnames
