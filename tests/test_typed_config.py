"""Typed config at the boundary (issue 28): the schema's fields declare what they enter (the resume comparison, the
run identity, the compile-cache key) and those lists are derived from the declarations, byte-identical to the
hand-kept lists they replace; the composed config converts once to the schema's dataclasses (``to_typed``) and
engines get it as ``StageContext.run``; closed choices the JSON Schemas repeat are the schema's enums."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from runner.core import resume as rs
from runner.core import schema

try:
    from _helpers import compose
except ImportError:  # tests/ imported as a package
    from tests._helpers import compose

pytestmark = pytest.mark.cpu

#: The hand-kept lists of runner/core/resume.py and models/diffusers_engine.py before the declarations (d6c0ce0),
#: with model.adapter under its name since issue #39 (model.engine; the identity keeps the former name).
FORMER_SEMANTIC_KEYS = ("model.name", "model.engine", "model.path", "model.revision", "model.load_format",
                        "model.architecture", "model.generation", "model.backend", "model.stages", "backend", "dtype",
                        "seed", "num_images_per_prompt", "compile", "optimize.fuse_qkv",
                        "optimize.vae_channels_last", "optimize.deterministic_compile")
FORMER_IDENTITY_KEYS = tuple(k for k in FORMER_SEMANTIC_KEYS + ("cpu_threads",)
                             if k not in ("seed", "num_images_per_prompt", "backend", "model.backend"))

CFG = {"model": {"name": "m", "engine": "flux", "path": None, "revision": "r1", "load_format": "auto",
                 "architecture": {"transformer": {"num_layers": 1}},
                 "generation": {"width": 64, "height": 32, "num_inference_steps": 4, "guidance_scale": None,
                                "max_sequence_length": 77, "true_cfg_scale": 1.0, "num_frames": None, "fps": None},
                 "backend": {"attention": None, "linear": "FP8", "moe": None},
                 "stages": {"denoise": {"backend": {"attention": "sdpa"}, "engine_extras": {}, "attention": None}}},
       "backend": {"attention": None, "linear": None, "moe": None}, "dtype": "auto", "seed": 3,
       "num_images_per_prompt": 1, "compile": "regional", "cpu_threads": 1,
       "optimize": {"fuse_qkv": True, "vae_channels_last": False, "deterministic_compile": True,
                    "compile_mode": "default", "warmup": True},
       "cache": {"method": "none"}}
PLAT = {"kind": "cpu", "capability": None, "probes": {"device_name": "x"}}
BACKENDS = {"denoise": {"linear": {"selected": "FP8"}}}
PACKAGES = {"torch": "2.13", "python": "3.11"}


def test_declared_keys_are_the_former_hand_kept_lists():
    # + issue 32's LoRA library and fuse choice (the adapters' sha256 enter the identity as model.source.lora)
    assert sorted(rs.SEMANTIC_KEYS) == sorted(FORMER_SEMANTIC_KEYS + ("model.lora", "model.lora_fuse"))
    assert sorted(rs.IDENTITY_KEYS) == sorted(FORMER_IDENTITY_KEYS)
    when_set = ("model.task", "model.quantization", "output.inpaint_overlay", "output.audio",
                "optimize.compile_mode", "cache", "memory.vae_tiling")  # + issue 30's two, 31's one, 32's two
    assert schema.factor_keys(schema.RESUME, when_set=True) == when_set
    assert schema.factor_keys(schema.IDENTITY, when_set=True) == when_set
    assert rs.ROW_DEFAULTS == ("width", "height", "num_inference_steps", "guidance_scale", "guidance_scale_2")
    assert schema.omitted_fields("model.stages", schema.IDENTITY) == ("backend",)
    assert schema.holds_entries("model.stages") and not schema.holds_entries("model.generation")
    assert sorted(schema.factor_keys(schema.COMPILE, when_set=None)) == [
        "compile", "optimize.compile_mode", "optimize.deterministic_compile", "optimize.fuse_qkv"]


def test_identity_and_resume_comparison_are_byte_identical_to_the_hand_kept_ones():
    """sha256s computed by runner/core/resume.py of d6c0ce0 (the hand-kept lists) for the same inputs: run dirs
    written before the declarations keep their identity, so they resume."""
    assert rs.identity_sha256(rs.run_identity(CFG, "float32", PLAT, BACKENDS, PACKAGES)) == (
        "1eff37185dd52dbb973a36e92f6186e20b6278672453f6cb9268c444b163b09a")
    on = copy.deepcopy(CFG)
    on["cache"] = {"method": "taylorseer", "order": 1}
    on["optimize"]["compile_mode"] = "max_autotune_no_cudagraphs"
    assert rs.identity_sha256(rs.run_identity(on, "float32", PLAT, BACKENDS, PACKAGES)) == (
        "143445f749459febb7b478599a06526bcd4e262eeff003c3b6250407a6b73ff8")
    assert rs.semantic_diff(CFG, on, None, "x") == [
        "cache: None -> {'method': 'taylorseer', 'order': 1}",
        "optimize.compile_mode: 'default' -> 'max_autotune_no_cudagraphs'"]


def test_an_omitted_field_stays_out_of_the_identity_and_in_the_resume_comparison():
    moved = copy.deepcopy(CFG)
    moved["model"]["generation"]["width"] = 128  # reaches the bytes through the rows
    moved["model"]["stages"]["denoise"]["backend"]["attention"] = "cudnn"  # through the resolved backends
    ident = rs.run_identity(moved, "float32", PLAT, BACKENDS, PACKAGES)
    assert ident == rs.run_identity(CFG, "float32", PLAT, BACKENDS, PACKAGES)
    assert "width" not in ident["config"]["model.generation"]
    assert ident["config"]["model.stages"] == {"denoise": {"engine_extras": {}, "attention": None}}
    assert sorted(rs.semantic_diff(CFG, moved, None, "x")) == [  # keys in declaration order (stages, generation)
        "model.generation.width: 64 -> 128", "model.stages.denoise.backend.attention: 'sdpa' -> 'cudnn'"]


def test_compile_factors_are_the_former_compile_settings_of_the_key():
    cfg = compose(["model=tiny_flux", "compile=regional", "optimize.fuse_qkv=true",
                   "optimize.compile_mode=max_autotune_no_cudagraphs"])
    former = {"compile": "regional", "compile_mode": "max_autotune_no_cudagraphs", "fuse_qkv": True,
              "deterministic_compile": True}
    for c in (cfg, schema.to_typed(cfg)):
        got = schema.compile_factors(c)
        assert got == former and json.dumps(got, sort_keys=True) == json.dumps(former, sort_keys=True)
        assert type(got["fuse_qkv"]) is bool and type(got["compile_mode"]) is str


def test_every_family_declares_a_shared_field_alike():
    """A field a family redefines (``adapter``, ``stages``) keeps the declaration of the base's field, so the
    derived lists do not depend on the family."""
    families = [schema.ModelConfig, *schema.MODEL_FAMILIES.values()]
    by_name: dict = {}
    for cls in families:
        for f in dataclasses.fields(cls):
            by_name.setdefault(f.name, set()).add(schema.factors_of(f))
    assert {n: d for n, d in by_name.items() if len(d) > 1} == {}


def test_declared_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown factor kind"):
        schema.declared(0, enters=("identiy",))


@pytest.mark.parametrize("model,cls", [("tiny_flux", schema.DiffusionModelConfig),
                                       ("tiny_qwen3_moe", schema.ARModelConfig),
                                       ("prompt_expand_flux", schema.PipelineModelConfig)])
def test_to_typed_builds_the_family_dataclasses(model, cls):
    run = schema.to_typed(compose([f"model={model}"]))
    assert type(run) is schema.RunConfig and type(run.model) is cls
    assert isinstance(run.dataset.format, schema.DatasetFormat) and isinstance(run.compile, schema.Compile)
    assert type(run.optimize) is schema.OptimizeConfig and run.optimize.compile_cache is True
    if cls is schema.PipelineModelConfig:
        assert type(run.model.stages["expand"]) is schema.PipelineStageConfig
        assert type(run.model.stages["expand"].model) is schema.ARModelConfig


def test_stage_context_holds_the_typed_run_config():
    from models.base import StageContext

    cfg = compose(["model=tiny_flux", "batch_size=3"])
    ctx = StageContext(cfg=cfg, overrides=[], stage="denoise", plat=None, dtype=None)
    assert type(ctx.run) is schema.RunConfig and ctx.run.batch_size == 3
    given = schema.to_typed(cfg)
    assert StageContext(cfg=cfg, overrides=[], stage="denoise", plat=None, dtype=None,
                        run=given).run is given


#: The functions of runner.core.resolve an engine hands the composed config to (the precedence layers: which layer
#: set a key is known only there); ``config_layers`` is the vLLM engine's name for that opaque handle.
RESOLVER_HANDOFF = {"check_placement", "resolve_stage", "drop_default_stages"}


def _raw_config_reads(path) -> list:
    """``file:line`` of every place in ``path`` that reads the composed (raw ``DictConfig``) config: an omegaconf
    import, or ``ctx.cfg`` / ``self.config_layers`` anywhere but as the first argument of a resolver hand-off (or
    ``ctx.cfg`` bound to ``self.config_layers``)."""
    import ast

    tree = ast.parse(path.read_text())
    parent = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}

    def handed_off(node) -> bool:
        up = parent.get(node)
        while isinstance(up, ast.IfExp):  # ``drop_default_stages(ctx.cfg, ...) if ... else ctx.cfg``
            node, up = up, parent.get(up)
        if isinstance(up, ast.Call) and up.args and up.args[0] is node:
            f = up.func
            return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in RESOLVER_HANDOFF
        return (isinstance(up, ast.Assign) and len(up.targets) == 1 and isinstance(up.targets[0], ast.Attribute)
                and up.targets[0].attr == "config_layers")

    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "omegaconf" for n in names):
                bad.append(f"{path.name}:{node.lineno}: imports omegaconf")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            raw = node.attr == "cfg" and (isinstance(node.value, ast.Name) and node.value.id == "ctx"
                                          or isinstance(node.value, ast.Attribute) and node.value.attr == "ctx")
            layers = node.attr == "config_layers" and isinstance(node.value, ast.Name) and node.value.id == "self"
            if (raw or layers) and not handed_off(node):
                bad.append(f"{path.name}:{node.lineno}: reads {ast.unparse(node)}")
    return bad


def test_models_read_no_raw_config_outside_the_resolver_handoff():
    """Issue #39: engines read their stage's typed model config (``ctx.model``) and the typed run (``ctx.run``);
    the composed ``DictConfig`` (``ctx.cfg``) only reaches ``runner.core.resolve``, which needs to know which layer set
    a key. A read such as ``ctx.cfg.model.get("pipeline")`` anywhere in models/ fails here."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "models"
    bad = [x for p in sorted(root.rglob("*.py")) for x in _raw_config_reads(p)]
    assert not bad, bad


def test_the_raw_config_scan_sees_each_kind_of_read(tmp_path):
    """The scan above on code that reads the composed config each way it could (and hands it off as allowed)."""
    src = tmp_path / "m.py"
    src.write_text("from omegaconf import OmegaConf\n"
                   "def f(self, e, ctx):\n"
                   "    a = e.ctx.cfg.model.get('pipeline')\n"
                   "    b = ctx.cfg\n"
                   "    c = self.config_layers.model\n"
                   "    resolve_stage(self.ctx.cfg, keys, info)\n"
                   "    check_placement(x, ctx.cfg)\n"
                   "    self.config_layers = drop_default_stages(ctx.cfg, ['g']) if s else ctx.cfg\n"
                   "    check_placement(self.config_layers, stages=[])\n")
    assert sorted(int(x.split(":")[1]) for x in _raw_config_reads(src)) == [1, 3, 4, 5, 7]


@pytest.mark.parametrize("model", ["tiny_flux", "tiny_wan22", "prompt_expand_flux", "tiny_qwen3_moe"])
def test_every_engine_holds_its_stage_model_as_the_family_dataclass(model):
    """What an engine reads its model settings from (``cfg`` / ``model_cfg``) is the stage's dataclass, never a
    ``DictConfig``: the runner's own stage graph and engine builder, every stage of a pipeline."""
    from omegaconf import OmegaConf

    from runner.app.stages import build_engines

    cfg = compose([f"model={model}"])
    engines = build_engines(cfg, [])
    for e in engines:
        held = e.model_cfg
        assert dataclasses.is_dataclass(held) and not OmegaConf.is_config(held), (e.stage, type(held))
        assert held is e.ctx.model and getattr(e, "cfg", held) is held
    assert [type(e.model_cfg).__name__ for e in engines] == (
        ["ARModelConfig", "PipelineModelConfig"] if model == "prompt_expand_flux" else
        ["ARModelConfig"] if model == "tiny_qwen3_moe" else ["DiffusionModelConfig"])


def test_the_published_json_schemas_list_the_schema_enums():
    """The JSON Schema copies in runner/schemas/ list each closed choice as the config schema's enum does; a value
    added to the enum and not to the file fails here (``runner.validate`` itself takes the enum's values)."""
    from runner.tools import validate

    for name, enums in schema.JSON_SCHEMA_ENUMS.items():
        published = json.loads((validate.SCHEMA_DIR / validate.SCHEMAS[name]).read_text())
        served = validate.schema(name)
        for pointer, choice in enums.items():
            node, node2 = published, served
            for part in pointer.strip("/").split("/"):
                node, node2 = node[part], node2[part]
            assert node["enum"] == [c.value for c in choice] == node2["enum"], (name, pointer)


def test_dataset_format_names_are_the_schema_enum():
    from runner.core import dataset as ds

    assert ds.FORMATS == tuple(f.value for f in schema.DatasetFormat)
    assert ds.EXTRA_FIELDS == tuple(f.value for f in schema.ExtraFields)
