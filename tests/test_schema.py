"""The structured schema (``runner/core/schema.py``): closed choices are enums refused at compose time, each model
family has its own schema, every field is documented and read by some code, and enum values stay plain strings
in everything the run writes."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from enum import Enum
from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import _schema_scan as scan
from runner.core import schema

REPO = Path(__file__).resolve().parent.parent
COMPOSE_ERRORS = (HydraException, OmegaConfBaseException)


def _message(e: BaseException) -> str:
    return f"{e}\n{e.__cause__ or ''}"


# ------------------------------------------------------------------------------------------------ enums

BAD_CHOICES = [  # (override, the field as Hydra names it, the valid values)
    ("compile=foo", "compile", ["none", "regional"]),
    ("dtype=float64", "dtype", ["auto", "float32", "bfloat16", "float16"]),
    ("parallelism.mode=pipeline", "parallelism.mode", ["single", "data", "cfg", "ulysses", "ring"]),
    ("launcher.name=k8s", "launcher.name", ["local", "ray", "slurm"]),
    ("dataset.format=xlsx", "dataset.format", ["builtin", "jsonl", "csv", "txt", "parquet", "hf"]),
    ("dataset.extra_fields=drop", "dataset.extra_fields", ["error", "keep"]),
    ("platform.name=tpu", "platform.name", ["auto", "cpu", "cuda", "rocm", "xpu", "npu", "mps"]),
    ("platform.device=tpu", "platform.device", ["auto", "cpu", "cuda"]),
    ("platform.probes=[device_name,gpu_temp]", "platform.probes", ["device_name", "capability", "cudnn"]),
    ("model.load_format=bogus", "model.load_format", ["auto", "dummy"]),
    ("model.oracle=mnist", "model.oracle", ["toy_shapes"]),
]


@pytest.mark.parametrize("override,key,choices", BAD_CHOICES, ids=[b[0] for b in BAD_CHOICES])
def test_bad_choice_is_refused_at_compose_time_naming_the_choices(compose, override, key, choices):
    with pytest.raises(COMPOSE_ERRORS) as e:
        compose([override])
    msg = _message(e.value)
    value = override.split("=", 1)[1].strip("[]").split(",")[-1]
    assert key in msg and repr(value) in msg, msg
    assert all(c in msg for c in choices), msg


def test_ar_model_handed_to_a_diffusion_engine_is_refused_at_startup(compose, tmp_path):
    from runner.core.errors import ConfigValueError
    from runner.app.execute import run

    ov = ["platform=cpu", "model=tiny_qwen3_moe", "model.engine=flux"]
    with pytest.raises(ConfigValueError, match="does not match the schema"):
        run(compose(ov), tmp_path / "run", ov)
    assert not (tmp_path / "run" / "manifest.json").exists() and not (tmp_path / "run" / "images").exists()


def test_cli_bad_choice_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "runner", "compile=foo", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out
    assert "Traceback" not in out, out
    # the runner's message, before Hydra composes (issue #38): key, value, the choices and the fix
    assert ("compile=foo is not a value of compile, which takes: none, regional; fix: compile=<none/regional>"
            in out and "full_key" not in out), out
    assert not (tmp_path / "run" / "manifest.json").exists() and not (tmp_path / "run" / "images").exists(), "a refused config started a run"


def test_choices_behave_as_plain_strings():
    c = schema.Compile.regional
    assert c == "regional" and c != "none" and isinstance(c, str)
    assert str(c) == f"{c}" == "{}".format(c) == "regional" and f"{c:>9}" == " regional"
    assert repr(c) == "'regional'" and f"{c!r}" == "'regional'"
    assert json.dumps({"compile": c}) == '{"compile": "regional"}'
    assert json.dumps({"compile": c}, indent=1) == json.dumps({"compile": "regional"}, indent=1)
    assert {"regional": 1}[c] == 1 and hash(c) == hash("regional")
    assert type(str(c)) is str
    for enum in _choice_enums():  # members are named by their value, so Hydra's "one of [...]" lists the values
        assert all(m.name == m.value for m in enum), enum


def _choice_enums():
    return [v for v in vars(schema).values() if isinstance(v, type) and issubclass(v, Enum) and v is not schema.Choice
            and issubclass(v, schema.Choice)]


def test_no_hand_check_repeats_an_enum():
    """The value lists of the enums are not spelled out again as membership checks in the code."""
    offenders = []
    enums = {tuple(sorted(m.value for m in e)) for e in _choice_enums() if len(e) > 1}
    for root in ("runner", "models", "kernels"):
        for py in (REPO / root).rglob("*.py"):
            if py.name == "schema.py" or py.relative_to(REPO).as_posix() == "runner/core/dataset.py":
                continue  # dataset.load_rows is a function API that also checks its `fmt` argument
            for node in ast.walk(ast.parse(py.read_text())):
                if isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
                    for comp in node.comparators:
                        if isinstance(comp, (ast.Tuple, ast.List, ast.Set)) and all(  # enum values are str
                                isinstance(x, ast.Constant) and isinstance(x.value, str) for x in comp.elts):
                            if tuple(sorted(x.value for x in comp.elts)) in enums:
                                offenders.append(f"{py.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------------ families


@pytest.mark.parametrize("model,override", [
    ("tiny_flux", "model.sampling={max_tokens: 4}"),
    ("toy_shapes", "model.sampling.max_tokens=4"),
    ("tiny_flux", "model.pipeline=[a,b]"),
    ("tiny_qwen3_moe", "model.generation.width=64"),
    ("tiny_qwen3_moe", "model.size_multiple=8"),
    ("tiny_qwen3_moe", "model.oracle=toy_shapes"),
    ("tiny_qwen3_moe", "model.revision=main"),
    ("tiny_qwen3_moe", "model.pipeline=[generate]"),
    ("tiny_qwen3_moe", "model.stages.generate.input=prompt"),  # pipeline-stage keys belong to pipelines
    ("tiny_flux", "model.stages.denoise.template='{text}'"),
    ("prompt_expand_flux", "model.stages.expand.model.generation.width=64"),  # the AR stage model is AR
])
def test_key_of_another_family_is_refused_at_compose_time(compose, model, override):
    with pytest.raises(COMPOSE_ERRORS) as e:
        compose([f"model={model}", override])
    key = override.split("=")[0].split(".")
    msg = _message(e.value)
    assert any(".".join(key[:n]) in msg for n in range(2, len(key) + 1)), msg


def test_appended_key_of_another_family_is_refused_before_the_run(compose, tmp_path):
    """``+model.sampling=...`` passes composition (Hydra's force-add); the run's schema check refuses it with
    the family schema of the model."""
    from runner.app.execute import run
    from runner.core.errors import ConfigValueError

    ov = ["platform=cpu", "dataset.limit=1", f"cache_dir={tmp_path / 'cache'}", "+model.sampling={max_tokens: 4}"]
    try:
        cfg = compose(ov)
    except COMPOSE_ERRORS as e:
        assert "sampling" in _message(e)
        return
    with pytest.raises(ConfigValueError, match="sampling"):
        run(cfg, tmp_path / "run", ov)
    assert not (tmp_path / "run" / "manifest.json").exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("model,family", [("toy_shapes", schema.DiffusionModelConfig),
                                          ("tiny_flux", schema.DiffusionModelConfig),
                                          ("tiny_qwen3_moe", schema.ARModelConfig),
                                          ("prompt_expand_flux", schema.PipelineModelConfig)])
def test_model_family_and_run_level_validation(compose, model, family):
    from runner.app.checks import check_schema

    cfg = compose([f"model={model}"])
    assert OmegaConf.get_type(cfg.model) is family
    plain = OmegaConf.to_container(cfg, resolve=False)
    assert schema.model_schema(plain["model"]) is family
    check_schema(cfg)  # the composed config passes the run's re-validation
    check_schema(OmegaConf.create(plain))  # and so does the same config rebuilt from a dict (Ray workers)


def test_pipeline_composes_its_diffusion_model_and_typed_stage_model(compose):
    m = compose(["model=prompt_expand_flux"]).model
    tiny = compose(["model=tiny_flux"]).model
    # base_pipeline is merged after tiny_flux: it adds the pipeline fields without resetting tiny_flux's values
    for key in ("adapter", "embedded", "path", "load_format", "architecture", "roles", "generation",
                "size_multiple", "builtin_prompts", "oracle", "revision", "backend"):
        assert OmegaConf.to_container(m[key]) == OmegaConf.to_container(tiny[key]) if OmegaConf.is_config(
            m[key]) else m[key] == tiny[key], key
    assert m.name == "prompt_expand_flux" and list(m.pipeline) == ["expand", "denoise"]
    assert OmegaConf.get_type(m.stages.expand) is schema.PipelineStageConfig
    assert OmegaConf.get_type(m.stages.denoise) is schema.PipelineStageConfig
    assert (m.stages.expand.engine, m.stages.expand.input) == ("vllm", "prompt")
    assert (m.stages.denoise.input, m.stages.denoise.template) == ("expand", "{prompt}, {text}")
    sm = m.stages.expand.model
    assert OmegaConf.get_type(sm) is schema.ARModelConfig
    assert sm.name == "tiny_qwen3_moe" and sm.load_format == "dummy" and sm.embedded is True
    assert OmegaConf.to_container(sm.sampling) == {"max_tokens": 8, "temperature": 0.8, "top_p": 0.95}
    assert sm.stages.generate.engine_extras.max_model_len == 256


def test_model_yaml_extends_a_family_schema():
    for y in sorted((REPO / "conf" / "model").glob("*.yaml")):
        defaults = OmegaConf.load(y).get("defaults")
        assert defaults, f"{y.name} has no defaults list"
        names = [d for d in defaults if isinstance(d, str)]
        assert any(n in schema.MODEL_FAMILIES for n in names), f"{y.name}: no base_* schema in {names}"
        assert names[-1] == "_self_", f"{y.name}: _self_ must come last"


# ------------------------------------------------------------------------------------------------ fields


def _schema_classes():
    return [c for c in vars(schema).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
            and c.__module__ == schema.__name__]


def test_every_field_is_documented():
    tree = ast.parse((REPO / "runner" / "core" / "schema.py").read_text())
    missing = []
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in {c.__name__ for c in _schema_classes()}]:
        body = cls.body
        for i, st in enumerate(body):
            if isinstance(st, ast.AnnAssign):
                nxt = body[i + 1] if i + 1 < len(body) else None
                if not (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                        and isinstance(nxt.value.value, str) and nxt.value.value.strip()):
                    missing.append(f"{cls.name}.{st.target.id}")
    assert not missing, f"fields without a docstring under them: {missing}"


def test_every_schema_field_is_read_by_the_code():
    unread = scan.unread_fields(schema)
    assert not unread, (f"schema fields nothing in {', '.join(scan.SCANNED)} reads (a value set there would be "
                        f"silently ignored): {unread}")


def test_the_read_scan_is_not_trivially_satisfied():
    """The scan counts a read only below the field's own parent key, so unrelated attributes of the same name
    do not count, and fields that nothing reads are found."""
    chains = scan.chains_of({"x.py": (
        "def f(cfg, worker, extras):\n"
        "    n = worker.world_size + worker.degree\n"            # not the config's parallelism
        "    g = cfg.model.generation\n"
        "    for key in ('width', 'height'):\n"
        "        g[key]\n"
        "    extras.get('max_model_len')\n"
        "    OmegaConf.select(cfg, f'model.stages.{s}.backend.attention')\n"
        "    stage = cfg.model.stages[name]\n"
        "    stage.template\n"
        "    getattr(cfg.cache, 'threshold')\n")})
    parallelism, generation, stage = {("parallelism",)}, {("generation",)}, {("stages", scan.ANY)}
    assert not scan.is_read(parallelism, "world_size", chains)
    assert not scan.is_read(parallelism, "degree", chains)
    assert scan.is_read(generation, "width", chains) and scan.is_read(generation, "height", chains)
    assert not scan.is_read(generation, "true_cfg_scale", chains)
    assert scan.is_read({("backend",)}, "attention", chains) and not scan.is_read({("backend",)}, "moe", chains)
    assert scan.is_read(stage, "template", chains) and not scan.is_read(stage, "input", chains)
    assert not scan.is_read({("model",)}, "max_model_len", chains)
    assert scan.is_read({("cache",)}, "threshold", chains) and not scan.is_read({("cache",)}, "order", chains)

    # The real code base: fields removed from the schema because nothing read them are found unread again.
    fake = type(sys)("fake_schema")
    vars(fake).update({k: v for k, v in vars(schema).items()})
    vars(fake).update(RunConfig=_RunWithUnread, ParallelismConfig=_ParallelismWithDegree, OutputConfig=_OutputWithFormat)
    assert scan.unread_fields(fake) == ["_OutputWithFormat.jpeg_quality", "_ParallelismWithDegree.degree"]
    # cache-method parameters count as read only through a registered method's ``reads``: with none, they are unread
    no_methods = scan.unread_fields(schema, by_registry={})
    assert "CacheConfig.threshold" in no_methods and "CacheConfig.order" in no_methods
    assert "CacheConfig.method" not in no_methods  # read by name (cfg.cache.method)


@dataclasses.dataclass
class _ParallelismWithDegree(schema.ParallelismConfig):
    degree: int = 1


@dataclasses.dataclass
class _OutputWithFormat(schema.OutputConfig):
    jpeg_quality: int = 95  # (``image_format`` was the example here until #39 made it a read field)


@dataclasses.dataclass
class _RunWithUnread(schema.RunConfig):
    parallelism: _ParallelismWithDegree = dataclasses.field(default_factory=_ParallelismWithDegree)
    output: _OutputWithFormat = dataclasses.field(default_factory=_OutputWithFormat)


# ------------------------------------------------------------------------------------------------ what a run writes


def test_manifest_config_holds_plain_strings_and_resume_sees_no_change(execute, compose, tmp_path):
    from runner.core import resume

    ov = ["dataset.limit=1", "compile=none", "dtype=auto", f"cache_dir={tmp_path / 'cache'}"]
    r = execute(ov, tmp_path / "run")
    assert r.code == 0
    text = (r.run_dir / "manifest.json").read_text()
    cfg = json.loads(text)["config"]
    assert "<" not in json.dumps(cfg) and "Compile." not in text and "DType." not in text
    assert (cfg["compile"], cfg["dtype"], cfg["parallelism"], cfg["dataset"]["format"], cfg["platform"]["name"],
            cfg["platform"]["device"], cfg["launcher"]["name"], cfg["model"]["engine"], cfg["model"]["load_format"]) == (
        "none", "auto", {"mode": "single", "ulysses_degree": 1, "ring_degree": 1, "data": None, "assign": "static",
                         "lease_s": 60.0}, "builtin", "cpu",
        "cpu", "local", "flux", "auto")
    assert cfg["platform"]["probes"] == ["device_name"]
    assert '"compile": "none"' in text and '"engine": "flux"' in text
    # the config as the next run composes it (enum members) compares equal to the manifest's plain strings
    again = OmegaConf.to_container(compose(["platform=cpu", *ov]), resolve=True)
    assert json.dumps(again, sort_keys=True) == json.dumps(cfg, sort_keys=True)
    assert resume.semantic_diff(cfg, again, None, "x") == []
    again["dtype"] = schema.DType.bfloat16
    assert resume.semantic_diff(cfg, again, None, "x") == ["dtype: 'auto' -> 'bfloat16'"]
    # and the resume itself goes through: everything reused
    r2 = execute([*ov, f"run.resume={r.run_dir}"], tmp_path / "unused")  # run.resume names the run dir
    assert r2.code == 0 and r.manifest["counts"]["reused"] == 1


def test_an_ar_engine_on_a_diffusion_model_is_refused_before_anything_loads(compose, tmp_path):
    """``model.engine`` is an open name (engines register at run time), so the family check happens at startup:
    a diffusion model handed to the AR engine no longer matches the AR schema (exit 2, naming a key)."""
    from runner.core.errors import ConfigValueError
    from runner.app.execute import run

    ov = ["platform=cpu", "model.engine=vllm"]
    with pytest.raises(ConfigValueError, match="does not match the schema"):
        run(compose(ov), tmp_path / "run", ov)
    assert not (tmp_path / "run" / "manifest.json").exists() and not (tmp_path / "run" / "images").exists()


# regression: bug: `python -m runner model=base_diffusion` (listed by --help beside the models) ended in a
# traceback (omegaconf MissingMandatoryValue: model.name), exit 1
@pytest.mark.parametrize("base", ["base_diffusion", "base_ar", "base_pipeline"])
def test_a_schema_base_chosen_as_model_is_refused_naming_it(subprocess_env, tmp_path, base):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "runner", f"model={base}", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=dict(subprocess_env, PYTHONPATH=str(repo)), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "Traceback" not in out and "model.name" in out and "no value" in out and "schema base" in out and "fix" in out


# Issue #39: the engine key was called ``adapter`` (a word that means LoRA to this field's users); it is ``engine``.
# The former name is refused naming the new one, run dirs written under the former name keep their identity and
# resume (``runner.core.resume._former_names`` / ``current_names``), and older manifests still read.
def test_the_former_engine_key_is_refused_naming_engine(subprocess_env, tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "runner", "model.adapter=flux", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=dict(subprocess_env, PYTHONPATH=str(repo)), capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "Traceback" not in out and "model.adapter=flux" in out and "fix: model.engine=flux" in out
    assert not (tmp_path / "run" / "images").exists()


@pytest.mark.parametrize("override,fix", [
    ("model.stages.expand.adapter=vllm", "model.stages.expand.engine=vllm"),
    ("model.stages.expand.model.adapter=vllm", "model.stages.expand.model.engine=vllm")])
def test_a_pipeline_stage_s_former_engine_key_is_refused(compose, override, fix):
    from runner.app.checks import check_schema
    from runner.core.errors import ConfigValueError

    check_schema(compose(["model=prompt_expand_flux"]))  # the shipped pipeline passes
    with pytest.raises(ConfigValueError) as e:
        check_schema(compose(["model=prompt_expand_flux", override]))
    assert str(e.value).startswith(override + ":") and f"fix: {fix} " in str(e.value)


def _former(node):
    """A config or identity node as a version before issue #39 wrote it (``engine`` -> ``adapter``), spelled here
    independently of the code under test."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "adapter" and v is None:  # the guard did not exist then
                continue
            out["adapter" if k == "engine" else "model.adapter" if k == "model.engine" else k] = _former(v)
        return out
    return node


def test_a_config_recorded_under_the_former_name_resumes_and_keeps_its_identity(compose):
    from runner.core import resume as rs

    new = OmegaConf.to_container(compose(["model=prompt_expand_flux"]), resolve=True)
    old = _former(new)
    assert old["model"]["adapter"] == "flux" and old["model"]["stages"]["expand"]["adapter"] == "vllm"
    assert old["model"]["stages"]["expand"]["model"]["adapter"] == "vllm" and '"engine":' not in json.dumps(old)
    assert rs.semantic_diff(old, new, None, "x") == []  # the earlier run's config compares equal: it resumes
    changed = json.loads(json.dumps(old).replace('"adapter": "vllm"', '"adapter": "echo"', 1))
    assert rs.semantic_diff(changed, new, None, "x") == [
        "model.stages.expand.engine: 'echo' -> 'vllm'"]  # a real change of a stage's engine still refuses
    ident = rs.run_identity(new, "float32", {"kind": "cpu"}, {}, {})["config"]
    assert ident == _former({k: rs._identity_value(new, k) for k in rs.IDENTITY_KEYS})  # the identity, as then
