"""Issue #42: the rules of ``models.backend_passes`` asserted function by function on small real inputs, so that a
wrong rule fails a fast test (``benchmarks/mutation.py``, groups ``core_m_backend_passes_*``): which attention
modules dispatch, QKV fusion, the attention / MoE / linear passes on tiny diffusers transformers built on the CPU
from the tiny model configs' architectures (seeded random weights, no pipeline), and the backend selection of the
real family engines composed from ``conf/`` (``platform=cpu``). Nothing here loads a pipeline or runs a stage."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import types
from typing import Any

import pytest
import torch

from models import backend_passes as bp
from models.source import family_names
from runner.core.errors import ConfigValueError


def engine(compose, model: str, *overrides: str, dtype: torch.dtype = torch.float32, parallel: Any = None,
           cls: Any = None):
    """The family engine of ``model=<model>`` on ``platform=cpu`` (stage ``denoise``), nothing loaded."""
    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.platform import detect

    cfg = compose([f"model={model}", "platform=cpu", *overrides])
    ctx = StageContext(cfg=cfg, overrides=list(overrides), stage="denoise", plat=detect("cpu"), dtype=dtype,
                       parallel=parallel)
    return (cls or engine_class(cfg.model.engine))(ctx)


def transformer(e, comp: str = "transformer") -> torch.nn.Module:
    """``comp`` of the engine's family built from the model config's architecture (seed 0, eval mode)."""
    import diffusers

    torch.manual_seed(0)
    return getattr(diffusers, e.components[comp][1])(**dict(e.cfg.architecture[comp])).eval()


def loaded(compose, model: str, *overrides: str, observe: bool = True):
    """The engine with its denoisers in place of a loaded pipeline (``pipe.<expert>``), backends resolved."""
    e = engine(compose, model, *overrides)
    arch = dict(e.cfg.architecture)
    e.pipe = types.SimpleNamespace(**{x: transformer(e, x) for x in e.spec.experts if x in arch})
    e.observe = observe
    e.probes = {"observed": observe}
    e.resolutions, _ = e.resolve_backends()
    return e


def n_linears(model: torch.nn.Module, prefix: str = "") -> int:
    return sum(1 for n, m in model.named_modules() if type(m) is torch.nn.Linear and n.startswith(prefix))


# ------------------------------------------------------------------------------------------ uses_dispatcher
def test_uses_dispatcher_reads_the_processor_class_source(compose):
    flux = transformer(engine(compose, "tiny_flux"))
    sd3 = transformer(engine(compose, "tiny_sd3"))
    assert bp.uses_dispatcher(flux.transformer_blocks[0].attn) is True  # FluxAttnProcessor calls the dispatcher
    assert bp.uses_dispatcher(sd3.transformer_blocks[0].attn) is False  # JointAttnProcessor2_0 calls SDPA itself
    assert bp.uses_dispatcher(torch.nn.Linear(2, 2)) is False  # no processor at all
    mod = torch.nn.Module()
    mod.processor = None
    assert bp.uses_dispatcher(mod) is False
    mod.processor = types.SimpleNamespace()  # a built-in class: its source cannot be read (TypeError)
    assert bp.uses_dispatcher(mod) is False


# ---------------------------------------------------------------------------------------- module_dispatches
def _module(tmp_path, monkeypatch, name: str, body: str):
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def test_module_dispatches_by_the_module_or_the_diffusers_attention_class_it_imports(tmp_path, monkeypatch):
    import diffusers

    assert bp.module_dispatches(diffusers.FluxTransformer2DModel) is True
    assert bp.module_dispatches(diffusers.ChromaTransformer2DModel) is True  # its FluxAttention's module does
    assert bp.module_dispatches(diffusers.SD3Transformer2DModel) is False
    assert bp.module_dispatches(diffusers.HiDreamImageTransformer2DModel) is False
    # a diffusers attention class imported: that module's source counts
    m = _module(tmp_path, monkeypatch, "bpr_flux_user",
                "from diffusers.models.transformers.transformer_flux import FluxAttention\nclass Model:\n    pass\n")
    assert bp.module_dispatches(m.Model) is True
    # a diffusers class imported that is not an attention class: its module's source does not count
    m = _module(tmp_path, monkeypatch, "bpr_model_user",
                "from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel\n"
                "X = 1\nclass Model:\n    pass\n")
    assert bp.module_dispatches(m.Model) is False
    # an attention class from a module outside diffusers does not count, whatever its source says
    _module(tmp_path, monkeypatch, "bpr_own_attn",
            "import torch\nfrom diffusers.models.attention import AttentionModuleMixin\n"
            "class OwnAttention(torch.nn.Module, AttentionModuleMixin):\n"
            "    pass  # calls dispatch_attention_fn\n")
    m = _module(tmp_path, monkeypatch, "bpr_own_user", "from bpr_own_attn import OwnAttention\nclass Model:\n    pass\n")
    assert bp.module_dispatches(m.Model) is False


def test_module_dispatches_reads_on_past_a_module_without_source(monkeypatch):
    """A model module whose source cannot be read (built in memory) that imports FluxAttention still dispatches:
    the unreadable source is skipped, the others are read (each of 20 such modules, whatever the set's order)."""

    from diffusers.models.transformers.transformer_flux import FluxAttention

    for i in range(20):
        name = f"bpr_in_memory_{i}"
        mod = types.ModuleType(name)
        mod.FluxAttention = FluxAttention
        mod.Model = type("Model", (), {"__module__": name})
        monkeypatch.setitem(sys.modules, name, mod)
        assert bp.module_dispatches(mod.Model) is True, i


# ------------------------------------------------------------------------------------- attention_modules
def test_attention_modules_lists_both_eras_in_model_order(compose):
    flux = transformer(engine(compose, "tiny_flux"))
    assert [(n, type(m).__name__) for n, m in bp.attention_modules(flux)] == [
        ("transformer_blocks.0.attn", "FluxAttention"), ("single_transformer_blocks.0.attn", "FluxAttention"),
        ("single_transformer_blocks.1.attn", "FluxAttention")]
    sd3 = transformer(engine(compose, "tiny_sd3"))  # attention_processor.Attention (before the dispatcher)
    assert [(n, type(m).__name__) for n, m in bp.attention_modules(sd3)] == [
        ("transformer_blocks.0.attn", "Attention"), ("transformer_blocks.0.attn2", "Attention"),
        ("transformer_blocks.1.attn", "Attention")]
    assert list(bp.attention_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))) == []


# ---------------------------------------------------------------------------------------------- fuse_qkv
def _numel(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_fuse_qkv_fuses_every_module_and_deletes_what_each_fused_linear_replaces(compose):
    flux = transformer(engine(compose, "tiny_flux"))
    n_params, lin = _numel(flux), n_linears(flux)
    assert bp.fuse_qkv(flux) == 3
    joint, single = flux.transformer_blocks[0].attn, flux.single_transformer_blocks[0].attn
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        assert getattr(joint, name, None) is None, name
    assert isinstance(joint.to_qkv, torch.nn.Linear) and isinstance(joint.to_added_qkv, torch.nn.Linear)
    assert getattr(single, "to_q", None) is None and isinstance(single.to_qkv, torch.nn.Linear)
    assert getattr(single, "to_added_qkv", None) is None
    assert _numel(flux) == n_params  # the unfused weights freed: no parameter held twice
    assert n_linears(flux) == lin - (6 - 2) - 2 * (3 - 1)  # joint: 6 -> 2 Linears; each single: 3 -> 1
    assert bp.fuse_qkv(flux) == 0  # already fused: nothing again


def test_fuse_qkv_cross_attention_keeps_its_query(compose):
    """Wan 2.1 I2V's cross-attention: k|v fused into ``to_kv`` (``to_q`` stays), the image keys into
    ``to_added_kv``; its self-attention into ``to_qkv``."""
    wan = transformer(engine(compose, "tiny_wan_i2v"))
    n_params = _numel(wan)
    n_blocks = len(wan.blocks)
    assert bp.fuse_qkv(wan) == 2 * n_blocks
    self_attn, cross = wan.blocks[0].attn1, wan.blocks[0].attn2
    assert isinstance(self_attn.to_qkv, torch.nn.Linear)
    assert [getattr(self_attn, n, None) for n in ("to_q", "to_k", "to_v")] == [None, None, None]
    assert isinstance(cross.to_kv, torch.nn.Linear) and isinstance(cross.to_q, torch.nn.Linear)
    assert isinstance(cross.to_added_kv, torch.nn.Linear)
    assert [getattr(cross, n, None) for n in ("to_k", "to_v", "add_k_proj", "add_v_proj")] == [None] * 4
    assert _numel(wan) == n_params


def test_fuse_qkv_skips_modules_that_cannot_fuse(compose):
    flux = transformer(engine(compose, "tiny_flux"))
    flux.transformer_blocks[0].attn._supports_qkv_fusion = False  # the first: the modules after it still fuse
    assert bp.fuse_qkv(flux) == 2
    kept = flux.transformer_blocks[0].attn
    assert isinstance(kept.to_q, torch.nn.Linear) and getattr(kept, "to_qkv", None) is None
    assert isinstance(flux.single_transformer_blocks[1].attn.to_qkv, torch.nn.Linear)
    sd3 = transformer(engine(compose, "tiny_sd3"))  # attention_processor.Attention: not fused here
    before = [n for n, _ in sd3.named_modules()]
    assert bp.fuse_qkv(sd3) == 0 and [n for n, _ in sd3.named_modules()] == before


# ----------------------------------------------------------------------------------------- AttentionPass
def test_attention_pass_installs_one_probe_per_site_with_its_role(compose):
    e = loaded(compose, "tiny_flux")
    bp.AttentionPass(e).install({})
    sites = e.probes["attention"]
    assert [(s.stage, s.role, s.layer, s.resolved, s.per_forward, s.expert, s.observing) for s in sites] == [
        ("denoise", "joint", "transformer_blocks.0.attn", "TORCH_SDPA", 1, "", True),
        ("denoise", "joint", "single_transformer_blocks.0.attn", "TORCH_SDPA", 1, "", True),
        ("denoise", "joint", "single_transformer_blocks.1.attn", "TORCH_SDPA", 1, "", True)]
    assert str(e.pipe.transformer.transformer_blocks[0].attn.processor._attention_backend.value) == "native"
    e = loaded(compose, "tiny_flux", observe=False)
    bp.AttentionPass(e).install({})
    assert [s.observing for s in e.probes["attention"]] == [False] * 3


def test_attention_pass_hands_the_platform_sm_and_the_layer_to_their_rules(compose, monkeypatch):
    """The wiring is planned (at resolution and at install) for the platform's compute capability (FA3 over FA2 on sm90), and the family's
    calls-per-forward rule gets each site's layer name and module."""
    import dataclasses

    from models.flux import FluxEngine
    from runner.kernels import attention

    class ByLayer(FluxEngine):
        def site_calls_per_forward(self, layer: str, module: Any) -> int:
            return 3 if layer.startswith("single_") and module is not None else 1

    e = engine(compose, "tiny_flux", cls=ByLayer)
    e.ctx.plat = dataclasses.replace(e.ctx.plat, capability=(9, 0))
    e.pipe = types.SimpleNamespace(transformer=transformer(e))
    e.observe, e.probes = True, {}
    planned, real = [], attention.plan
    monkeypatch.setattr(attention, "plan", lambda name, sm=None: planned.append((name, sm)) or real(name, sm))
    e.resolutions, _ = e.resolve_backends()
    assert planned == [("TORCH_SDPA", 90)]  # the resolution checks the wiring at startup, for this sm
    bp.AttentionPass(e).install({})
    assert planned == [("TORCH_SDPA", 90)] * 2
    assert [s.per_forward for s in e.probes["attention"]] == [1, 3, 3]


def test_attention_pass_takes_the_family_calls_per_forward(compose):
    """Wan 2.1 I2V: each cross-attention with image keys makes two dispatcher calls per forward."""
    e = loaded(compose, "tiny_wan_i2v")
    bp.AttentionPass(e).install({})
    got = [(s.layer, s.role, s.per_forward, s.expert) for s in e.probes["attention"]]
    n = len(e.pipe.transformer.blocks)
    assert got == [x for i in range(n) for x in ((f"blocks.{i}.attn1", "self", 1, ""),
                                                  (f"blocks.{i}.attn2", "cross", 2, ""))]


def test_attention_pass_names_the_expert_of_each_site(compose):
    """Wan 2.2 A14B: the second expert's sites are prefixed with its component and belong to it."""
    e = loaded(compose, "tiny_wan22")
    bp.AttentionPass(e).install({})
    got = [(s.layer, s.expert, s.per_forward) for s in e.probes["attention"]]
    n = len(e.pipe.transformer.blocks)
    one = [f"blocks.{i}.attn{j}" for i in range(n) for j in (1, 2)]
    assert got == [(x, "transformer", 1) for x in one] + [(f"transformer_2.{x}", "transformer_2", 1) for x in one]


# ---------------------------------------------------------------------------------------------- MoePass
def test_moe_pass_does_nothing_without_moe_layers(compose):
    e = loaded(compose, "tiny_flux")
    p = bp.MoePass(e)
    assert p.owned_linears() == ()
    p.install({})
    assert "moe" not in e.probes and p.owned_linears() == ()


def test_moe_pass_installs_on_every_moe_block_and_owns_the_routed_experts(compose):
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    e = loaded(compose, "tiny_hidream")
    blocks = [n for n, m in e.pipe.transformer.named_modules() if isinstance(m, MOEFeedForwardSwiGLU)]
    assert len(blocks) == 4  # 2 double-stream (image stream) + 2 single-stream blocks
    p = bp.MoePass(e)
    p.install({})
    assert e.probes["moe"]["resolved"] == "TORCH"
    sites = e.probes["moe"]["sites"]
    assert [(s.layer, s.resolved, s.experts, s.top_k, s.counting) for s in sites] == [
        (b, "TORCH", 4, 2, True) for b in blocks]
    assert p.owned_linears() == tuple(f"{b}.experts." for b in blocks)
    e = loaded(compose, "tiny_hidream", observe=False)
    bp.MoePass(e).install({})
    assert [s.counting for s in e.probes["moe"]["sites"]] == [False] * 4


def test_moe_pass_owns_what_the_layout_names_in_each_block(compose):
    """The owned Linears are the layout's names read from each block (here one prefix per routed expert)."""
    from models.hidream import HiDreamEngine, HiDreamExperts

    class PerExpert(HiDreamExperts):
        def expert_linears(self, block: torch.nn.Module):
            return tuple(f"experts.{i}." for i in range(len(block.experts)))

    class Engine(HiDreamEngine):
        def moe_layout(self):
            return PerExpert()

    e = engine(compose, "tiny_hidream", cls=Engine)
    e.pipe = types.SimpleNamespace(transformer=transformer(e))
    e.observe, e.probes = True, {}
    e.resolutions, _ = e.resolve_backends()
    p = bp.MoePass(e)
    p.install({})
    blocks = [s.layer for s in e.probes["moe"]["sites"]]
    assert p.owned_linears() == tuple(f"{b}.experts.{i}." for b in blocks for i in range(4))


# ------------------------------------------------------------------------------------------- LinearPass
def test_linear_pass_leaves_the_moe_experts_to_the_moe_backend(compose):
    e = loaded(compose, "tiny_hidream")
    model = e.pipe.transformer
    total = n_linears(model)
    experts = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear and ".experts." in n]
    assert len(experts) == 4 * 4 * 3  # 4 MoE blocks x 4 experts x (w1, w2, w3)
    e.passes["moe"].install({})
    e.passes["linear"].install({})
    rec = e.probes["linear"]
    assert (rec.resolved, rec.modules, rec.counting) == ("TORCH", total - len(experts), True)
    assert sorted(rec.excluded) == sorted(experts)
    assert "expert_linears" not in e.probes  # one denoiser


def test_linear_pass_counts_each_expert_into_one_record(compose):
    e = loaded(compose, "tiny_wan22", observe=False)
    n1, n2 = n_linears(e.pipe.transformer), n_linears(e.pipe.transformer_2)
    bp.LinearPass(e).install({})
    rec = e.probes["linear"]
    assert (rec.modules, rec.counting, rec.excluded) == (n1 + n2, False, [])
    assert e.probes["expert_linears"] == {"transformer": n1, "transformer_2": n2}


def test_linear_pass_replaces_only_the_family_blocks_under_fp8(compose):
    """FP8 replaces the Linears under the family's ``fp8_prefixes`` (Wan: ``blocks.``), the others stay dense."""
    e = loaded(compose, "tiny_wan22")
    n1, n2 = n_linears(e.pipe.transformer, "blocks."), n_linears(e.pipe.transformer_2, "blocks.")
    other = n_linears(e.pipe.transformer) - n1 + n_linears(e.pipe.transformer_2) - n2
    e.resolutions["linear"].selected = "FP8"
    bp.LinearPass(e).install({})
    rec = e.probes["linear"]
    assert n1 > 0 and (rec.resolved, rec.modules, len(rec.skipped)) == ("FP8", n1 + n2, other)
    assert e.probes["expert_linears"] == {"transformer": n1, "transformer_2": n2}
    assert type(e.pipe.transformer_2.blocks[0].attn1.to_q).__name__ == "FP8Linear"


def test_linear_pass_quantizes_on_the_stage_device(compose, monkeypatch):
    from runner.kernels import linear

    e = loaded(compose, "tiny_flux")
    seen, real = [], linear.install
    monkeypatch.setattr(linear, "install", lambda *a, **k: seen.append(k["device"]) or real(*a, **k))
    bp.LinearPass(e).install({})
    assert seen == ["cpu"] == [e.device]


# ------------------------------------------------------------------------------ BackendSelection.resolve
def test_resolve_backends_on_cpu(compose):
    e = engine(compose, "tiny_flux")
    res, extras = e.resolve_backends()
    assert extras == {}
    assert res["attention"].selected == {"joint": {"backend": "TORCH_SDPA", "quant": None, "skip_softmax": None}}
    assert res["linear"].selected == "TORCH" and res["moe"].selected is None
    e.resolutions = res
    assert e.backends_section() == {f: r.to_dict() for f, r in res.items()}
    assert set(e.backends_section()) == {"attention", "linear", "moe"}
    assert e.backends_section()["linear"]["selected"] == "TORCH"


def test_resolve_backends_checks_against_the_model_shape_and_platform(compose):
    """The selection context carries the platform, dtype, head_dim (tiny_flux 32) and the mask (Z-Image passes
    one): an explicit FlashInfer names each unmet requirement."""
    from runner.kernels.registry import BackendUnavailableError

    with pytest.raises(BackendUnavailableError) as err:
        engine(compose, "tiny_flux", "backend.attention=FLASHINFER_ATTN").resolve_backends()
    msg = str(err.value)
    for part in ("needs platform cuda, this is cpu", "this device is not a CUDA GPU", "the model runs in float32",
                 "the model has head_dim 32"):
        assert part in msg, part
    assert "mask" not in msg and "sequence parallelism" not in msg
    with pytest.raises(BackendUnavailableError) as err:
        engine(compose, "tiny_zimage", "backend.attention=FLASHINFER_ATTN").resolve_backends()
    assert "cannot honour an attention mask" in str(err.value)
    with pytest.raises(BackendUnavailableError) as err:
        engine(compose, "tiny_flux", "backend.attention=FLASHINFER_ATTN", dtype=torch.bfloat16).resolve_backends()
    assert "dtype" not in str(err.value)
    import dataclasses

    e = engine(compose, "tiny_flux", "backend.attention=FLASHINFER_ATTN")
    e.ctx.plat = dataclasses.replace(e.ctx.plat, capability=(9, 0))  # the platform's sm reaches the checks
    with pytest.raises(BackendUnavailableError) as err:
        e.resolve_backends()
    assert "needs platform cuda, this is cpu" in str(err.value) and "compute capability" not in str(err.value)
    with pytest.raises(BackendUnavailableError, match=r"is not wired into the engine of stage 'denoise' \(it runs "
                                                      r"TORCH_SDPA, .*FLASHINFER_ATTN\)"):
        engine(compose, "tiny_flux", "backend.attention=TRTLLM_ATTN").resolve_backends()


def test_resolve_backends_under_context_parallelism(compose):
    from runner.core.distributed import Layout
    from runner.kernels.registry import BackendUnavailableError

    ulysses, ring = Layout("ulysses", 1, 1, 2), Layout("ring", 1, 2, 1)
    res, _ = engine(compose, "tiny_flux", parallel=ulysses).resolve_backends()
    assert res["attention"].selected["joint"]["backend"] == "TORCH_SDPA"  # Ulysses runs on native
    with pytest.raises(BackendUnavailableError, match="ring attention merges per-chunk results"):
        engine(compose, "tiny_flux", parallel=ring).resolve_backends()
    with pytest.raises(BackendUnavailableError, match="does not support sequence parallelism"):
        engine(compose, "tiny_flux", "backend.attention=FLASHINFER_ATTN", parallel=ulysses).resolve_backends()


def test_resolve_backends_moe_field_and_auto_measurement(compose):
    from runner.core.resolve import StageConflictError

    with pytest.raises(StageConflictError, match=r"backend.moe=TRITON .*stage 'denoise' \(model=tiny_flux\) has no "
                                                 "MoE layers"):
        engine(compose, "tiny_flux", "backend.moe=TRITON").resolve_backends()
    res, _ = engine(compose, "tiny_hidream").resolve_backends()  # auto on CPU: TORCH alone, nothing timed
    assert res["moe"].selected == "TORCH"
    assert res["moe"].reason.startswith("the only MoE backend that can run here: ")
    assert "the model runs in float32" in res["moe"].reason  # TRITON skipped for the dtype too
    res, _ = engine(compose, "tiny_hidream", dtype=torch.bfloat16).resolve_backends()
    assert "the model runs in" not in res["moe"].reason and "needs platform cuda/rocm, this is cpu" in res["moe"].reason
    res, _ = engine(compose, "tiny_hidream", "backend.moe=TORCH").resolve_backends()  # explicit: not measured
    assert res["moe"].selected == "TORCH" and not (res["moe"].reason or "").startswith("the only MoE backend")


def test_resolve_backends_offers_only_the_moe_backends_wired_into_diffusers(compose):
    from runner.kernels import registry as reg
    from runner.kernels.registry import Backend, BackendUnavailableError

    # no DiffusersMoEWiring (a CUDA one, so that the refusal lists every reason, the wiring's included)
    with reg.registered(Backend("moe", "BPR_UNWIRED", requires=(reg.on_platform("cuda"),))):
        with pytest.raises(BackendUnavailableError, match=r"backend.moe=BPR_UNWIRED cannot run here: needs platform "
                                                          r"cuda, this is cpu; is not wired into the engine of stage "
                                                          r"'denoise' \(it runs TORCH, TRITON, GROUPED_MM\)"):
            engine(compose, "tiny_hidream", "backend.moe=BPR_UNWIRED").resolve_backends()


def test_resolve_backends_passes_the_moe_dims(compose):
    """GROUPED_MM needs H and I multiples of 8: with the tiny HiDream's (32, 256) it is not refused for its dims;
    a HiDream of head_dim 18 (H = 36) is."""
    from runner.kernels.registry import BackendUnavailableError

    def why(*ov: str) -> str:
        with pytest.raises(BackendUnavailableError) as err:
            engine(compose, "tiny_hidream", "backend.moe=GROUPED_MM", *ov).resolve_backends()
        return str(err.value)

    assert "intermediate sizes" not in why()
    assert "the model has H=36" in why("model.architecture.transformer.attention_head_dim=18",
                                       "model.architecture.transformer.axes_dims_rope=[10,4,4]")


def test_resolve_backends_reads_the_stages_of_a_pipeline_model(compose):
    from runner.core.resolve import MisplacedBackendKeyError

    res, _ = engine(compose, "prompt_expand_flux").resolve_backends()  # model.stages.expand is a stage of it
    assert res["linear"].selected == "TORCH"
    with pytest.raises(MisplacedBackendKeyError, match="model prompt_expand_flux has no stage 'expand'"):
        engine(compose, "prompt_expand_flux", "model.pipeline=[denoise]").resolve_backends()


def test_resolve_backends_refuses_engine_extras_the_engine_does_not_read(compose):
    from runner.core.resolve import MisplacedBackendKeyError

    with pytest.raises(MisplacedBackendKeyError) as err:
        engine(compose, "tiny_flux", "+model.stages.denoise.engine_extras.attn_backend=sdpa").resolve_backends()
    assert str(err.value) == ("model.stages.denoise.engine_extras.attn_backend is not read: the 'denoise' stage's "
                              "engine (diffusers) takes no engine_extras; did you mean the legacy key "
                              "'attention_backend'?")
    with pytest.raises(MisplacedBackendKeyError) as err:
        engine(compose, "tiny_flux", "+model.stages.denoise.engine_extras.zzz=1",
               "+model.stages.denoise.engine_extras.yyy=1").resolve_backends()
    assert str(err.value) == ("model.stages.denoise.engine_extras.yyy is not read: the 'denoise' stage's engine "
                              "(diffusers) takes no engine_extras; fix: remove it")


# ------------------------------------------------------------------- BackendSelection.choose_moe_by_measurement
#: TRITON is a candidate only where ``triton`` imports (torch's CUDA wheels bring it; the quick start's CPU wheel does
#: not): on this CPU it then fails its measurement, named in the reason; without it, it is not a candidate at all.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _triton_failed(pattern: str = r"\(RuntimeError: .*\)", sep: str = ", ") -> str:
    """The reason's fragment for TRITON's failed measurement where triton is installed, else nothing."""
    return f"TRITON failed {pattern}{sep}" if HAS_TRITON else ""


def _small_hidream(cls_base: Any, bad_input: bool = False) -> Any:
    class Small(cls_base):
        def pipeline_size(self, width: int, height: int):  # 8 x 8 tokens a call (x2 for CFG): a fast measurement
            return 16, 16

        def moe_probe(self):
            block, x, shape = super().moe_probe()
            self.drawn = getattr(self, "drawn", []) + [x.clone()]
            return (block, torch.cat([x, x[..., :1]], -1) if bad_input else x, shape)

    return Small


def test_choose_moe_by_measurement_times_every_candidate(compose):
    from models.hidream import HiDreamEngine
    from runner.kernels.registry import SelectionContext

    e = engine(compose, "tiny_hidream", dtype=torch.bfloat16, cls=_small_hidream(HiDreamEngine))
    res, _ = e.resolve_backends()
    gpu = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16, head_dim=16, moe_dims=e.moe_dims())
    state = torch.random.get_rng_state()
    e.choose_moe_by_measurement(res["moe"], gpu)
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe's seed does not touch the run's RNG
    m = re.fullmatch(r"measured at startup on cpu \(HiDream MoE block H=32, I=256, E=4, top_k=2, T=128 tokens, "
                     r"bfloat16, median of 5 calls after 2 warm-up calls, router and shared expert included\): "
                     r"(\w+) ([\d.]+) ms, (\w+) ([\d.]+) ms" + (", TRITON failed \\(RuntimeError: .*\\)" if HAS_TRITON
                                                                  else "") + r"; (\w+) is the fastest",
                     res["moe"].reason)
    assert m is not None, res["moe"].reason
    assert {m[1], m[3]} == {"TORCH", "GROUPED_MM"} and float(m[2]) <= float(m[4])  # fastest first
    assert m[5] == m[1] == res["moe"].selected
    torch.manual_seed(0)  # the probe is drawn from seed 0: the same block and input at every startup
    e.moe_probe()
    assert len(e.drawn) == 2 and torch.equal(e.drawn[0], e.drawn[1])


def test_choose_moe_by_measurement_records_every_failed_candidate(compose):
    """A HiDream of H = 36: GROUPED_MM (a candidate by the selection context given) raises for its row strides,
    TRITON for the CPU tensor; both are skipped, each named with its error, TORCH is chosen."""
    from models.hidream import HiDreamEngine
    from runner.kernels.registry import SelectionContext

    e = engine(compose, "tiny_hidream", "model.architecture.transformer.attention_head_dim=18",
               "model.architecture.transformer.axes_dims_rope=[10,4,4]", dtype=torch.bfloat16,
               cls=_small_hidream(HiDreamEngine))
    res, _ = e.resolve_backends()
    gpu = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16, head_dim=18, moe_dims=(32, 256))
    e.choose_moe_by_measurement(res["moe"], gpu)
    assert res["moe"].selected == "TORCH"
    assert re.fullmatch(r"measured at startup on cpu \(HiDream MoE block H=36, .*\): TORCH [\d.]+ ms, "
                        + _triton_failed(r"\(RuntimeError: MoE backend TRITON .*? on this device\)")
                        + r"GROUPED_MM failed \(ValueError: torch's grouped GEMM needs 16-byte row strides: H=36 and "
                        r"I=256 must be multiples of 8 in bfloat16\); TORCH is the fastest", res["moe"].reason), (
        res["moe"].reason)


def test_choose_moe_by_measurement_times_two_candidates(compose):
    """fp16 on sm80: TRITON and TORCH can run (GROUPED_MM cannot): two candidates are timed too."""
    from models.hidream import HiDreamEngine
    from runner.kernels.registry import SelectionContext

    e = engine(compose, "tiny_hidream", dtype=torch.float16, cls=_small_hidream(HiDreamEngine))
    res, _ = e.resolve_backends()
    gpu = SelectionContext(platform_kind="cuda", sm=80, dtype=torch.float16, head_dim=16, moe_dims=(32, 256))
    e.choose_moe_by_measurement(res["moe"], gpu)
    assert res["moe"].selected == "TORCH"
    if HAS_TRITON:
        assert re.fullmatch(r"measured at startup on cpu \(.*, float16, .*\): TORCH [\d.]+ ms, TRITON failed "
                            r"\(RuntimeError: .*\); TORCH is the fastest", res["moe"].reason), res["moe"].reason
    else:  # TORCH alone can run: nothing to time
        assert res["moe"].reason.startswith("the only MoE backend that can run here: "), res["moe"].reason


def test_choose_moe_by_measurement_with_one_candidate_or_under_data_parallelism(compose):
    from models.hidream import HiDreamEngine
    from runner.kernels.registry import SelectionContext

    gpu = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16, head_dim=16, moe_dims=(32, 256))
    e = engine(compose, "tiny_hidream", "parallelism=data", dtype=torch.bfloat16, cls=_small_hidream(HiDreamEngine))
    res, _ = e.resolve_backends()
    before = res["moe"].reason
    e.choose_moe_by_measurement(res["moe"], gpu)
    assert res["moe"].selected == "TORCH"
    ranked = "TRITON, GROUPED_MM, TORCH" if HAS_TRITON else "GROUPED_MM, TORCH"
    assert res["moe"].reason == (f"ranked first of {ranked} (not timed: under parallelism=data every worker must "
                                 f"select the same backend): {before}")
    cpu = SelectionContext(platform_kind="cpu", sm=None, dtype=torch.float32)
    res["moe"].reason = "x"
    e.choose_moe_by_measurement(res["moe"], cpu)
    assert res["moe"].reason == "the only MoE backend that can run here: x" and res["moe"].selected == "TORCH"


def test_choose_moe_by_measurement_refuses_when_no_candidate_runs(compose):
    from models.hidream import HiDreamEngine
    from runner.kernels.registry import BackendUnavailableError, SelectionContext

    e = engine(compose, "tiny_hidream", dtype=torch.bfloat16, cls=_small_hidream(HiDreamEngine, bad_input=True))
    res, _ = e.resolve_backends()
    gpu = SelectionContext(platform_kind="cuda", sm=90, dtype=torch.bfloat16, head_dim=16, moe_dims=(32, 256))
    with pytest.raises(BackendUnavailableError) as err:
        e.choose_moe_by_measurement(res["moe"], gpu)
    assert re.fullmatch(r"auto found no MoE backend that runs the model's MoE block here: "
                        + ("TRITON: RuntimeError: .*; " if HAS_TRITON else "")
                        + r"GROUPED_MM: \w+: .*; TORCH: \w+: .*", str(err.value)), str(err.value)


# --------------------------------------------------------------------------------- BackendSelection defaults
def test_a_family_without_moe_layers_declares_none(compose):
    e = engine(compose, "tiny_flux")
    assert list(e.moe_blocks()) == [] and e.moe_dims() is None
    with pytest.raises(NotImplementedError, match="^FluxEngine has no MoE layers$"):
        e.moe_layout()
    with pytest.raises(NotImplementedError, match="^FluxEngine has no MoE layers$"):
        e.moe_probe()


# ------------------------------------------------------------------------------------------ AttentionSites
def test_prepare_attention_installs_the_spec_processor_on_every_module(compose):
    from models.sd3 import SD3DispatchAttnProcessor

    e = loaded(compose, "tiny_sd3")
    assert e.dispatches() is True  # decided by the spec before loading
    e.prepare_attention()
    procs = [type(m.processor) for _, m in bp.attention_modules(e.pipe.transformer)]
    assert procs == [SD3DispatchAttnProcessor] * 3
    assert len({id(m.processor) for _, m in bp.attention_modules(e.pipe.transformer)}) == 3  # one each
    e = loaded(compose, "tiny_flux")  # no spec processor: left as built
    before = [m.processor for _, m in bp.attention_modules(e.pipe.transformer)]
    e.prepare_attention()
    assert [m.processor for _, m in bp.attention_modules(e.pipe.transformer)] == before


def test_attention_sites_refuse_a_processor_that_does_not_dispatch(compose):
    e = loaded(compose, "tiny_sd3")  # JointAttnProcessor2_0 as built: no dispatcher
    with pytest.raises(ConfigValueError) as err:
        list(e.attention_sites())
    msg = str(err.value)
    assert msg.startswith("model=tiny_sd3: attention module transformer_blocks.0.attn (JointAttnProcessor2_0) does "
                          "not call diffusers' attention dispatcher, so its backend can be neither selected nor "
                          "observed; fix: a model family whose transformer uses the dispatcher (")
    assert "flux, " in msg and "wan" in msg
    e.prepare_attention()
    assert [(r, n) for r, n, _ in e.attention_sites()] == [
        ("joint", "transformer_blocks.0.attn"), ("joint", "transformer_blocks.0.attn2"),
        ("joint", "transformer_blocks.1.attn")]


def test_attention_roles_by_the_spec_suffixes_else_the_first_role(compose):
    e = loaded(compose, "tiny_wan22")
    sites = [(r, n) for r, n, _ in e.attention_sites()]
    assert sites[:2] == [("self", "blocks.0.attn1"), ("cross", "blocks.0.attn2")]
    assert ("cross", "transformer_2.blocks.0.attn2") in sites and len(sites) == 4 * len(e.pipe.transformer.blocks)
    assert e.attention_role("blocks.3.attn2") == "cross" and e.attention_role("blocks.3.attn1") == "self"
    e = engine(compose, "tiny_wan", "model.roles=[cross,self]")
    assert e.attention_role("blocks.0.attn1") == "self"
    e.spec = None  # a spec-less engine (model.engine=diffusers): the model's first role
    assert e.attention_role("blocks.0.attn1") == "cross"


def test_dispatches_and_the_refusal_of_a_non_dispatching_transformer(compose, monkeypatch):
    e = engine(compose, "tiny_flux")
    assert e.dispatches() is True
    monkeypatch.setitem(e.components, "transformer", ("diffusers", "SD3Transformer2DModel", None))
    assert e.dispatches() is False
    with pytest.raises(ConfigValueError) as err:
        e.resolve_backends()
    assert str(err.value).startswith(
        "model=tiny_flux: its transformer (SD3Transformer2DModel) does not call diffusers' attention dispatcher, so no "
        "attention backend can be selected or observed in it; fix: a model family whose transformer uses the "
        "dispatcher (")
    assert str(err.value).endswith(f"dispatcher ({', '.join(family_names())})") and "flux, " in str(err.value)
    monkeypatch.setitem(e.components, "transformer", ("diffusers", "NoSuchTransformer", None))
    assert e.dispatches() is False
