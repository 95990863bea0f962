"""Every option of every config group composes through Hydra's compose API into the structured schema, and a
typo or a value of the wrong type fails at compose time, before anything is imported or loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.core import schema

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

# Options the foundation promises; any further YAML found in conf/<group>/ is composed as well.
REQUIRED = {
    "model": {"flux", "flux_schnell", "tiny_flux"},
    "platform": {"auto", "cpu", "cuda", "rocm", "xpu", "npu", "mps"},
    "backend": {"auto"},
    "parallelism": {"single"},
    "dataset": {"builtin", "jsonl", "csv", "txt"},
}
SCHEMA = {
    "model": schema.ModelConfig,  # each option: the family schema its YAML names first (model_family)
    "platform": schema.PlatformConfig,
    "backend": schema.BackendConfig,
    "parallelism": schema.ParallelismConfig,
    "dataset": schema.DatasetConfig,
}
NEEDS_PATH = {"jsonl", "csv", "txt"}


def model_family(option: str) -> type:
    """The family schema ``conf/model/<option>.yaml`` extends: the ``base_*`` entry of its defaults list, or the
    family of the model it extends."""
    defaults = [d for d in OmegaConf.load(CONF_DIR / "model" / f"{option}.yaml").get("defaults", [])
                if isinstance(d, str) and d != "_self_" and "@" not in d]
    bases = [schema.MODEL_FAMILIES[d] for d in defaults if d in schema.MODEL_FAMILIES]
    assert bases, f"conf/model/{option}.yaml lists no family schema (base_diffusion, base_ar, base_pipeline) in its defaults"
    return bases[-1]


def _options(group: str) -> set[str]:
    return {p.stem for p in (CONF_DIR / group).glob("*.yaml")}


GROUP_OPTIONS = [(g, o) for g in REQUIRED for o in sorted(REQUIRED[g] | _options(g))]


def _group_overrides(group: str, option: str) -> list[str]:
    ov = [f"{group}={option}"]
    if group == "dataset" and option in NEEDS_PATH:
        ov.append(f"dataset.path=/data/prompts.{option}")
    return ov


def _assert_arrives(want, got, where):
    """Every value ``want`` sets is in ``got``: lists and leaves equal; mappings may gain keys from the schema's
    defaults (a stage the YAML names gets the StageConfig fields it does not set)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {got!r} is not a mapping"
        for k, v in want.items():
            assert k in got, f"{where}.{k} was dropped"
            _assert_arrives(v, got[k], f"{where}.{k}")
    else:
        assert got == want, f"{where}={got!r}, YAML says {want!r}"


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes(compose, group, option):
    cfg = compose(_group_overrides(group, option), return_hydra_config=True)
    assert cfg.hydra.runtime.choices[group] == option
    node = cfg[group]
    want = model_family(option) if group == "model" else SCHEMA[group]
    assert OmegaConf.get_type(node) is want, f"{group}={option} is not validated by {want}"
    # Every value the option's YAML sets arrives in the composed config (nothing dropped by the schema merge).
    yaml = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    for key in yaml:
        if key == "defaults" or OmegaConf.is_missing(yaml, key):
            continue
        want = yaml[key]
        got = node[key]
        if OmegaConf.is_config(want):
            _assert_arrives(OmegaConf.to_container(want, resolve=True), OmegaConf.to_container(got, resolve=True),
                            f"{group}={option}: {key}")
        else:
            assert got == want, f"{group}={option}: {key}={got!r}, YAML says {want!r}"
    OmegaConf.to_container(cfg, resolve=False)  # the whole tree is well formed


@pytest.mark.parametrize("option", sorted(REQUIRED["model"]))
def test_model_options(compose, option):
    m = compose([f"model={option}"]).model
    assert m.name == option
    assert m.engine == "flux"
    assert m.size_multiple == 16
    assert "joint" in m.roles
    if option == "tiny_flux":
        assert m.embedded is True and m.path is None
        assert (m.generation.width, m.generation.height, m.generation.num_inference_steps) == (128, 128, 4)
    else:
        assert m.embedded is False and m.path is None and m.load_format == "auto"
        assert m.architecture.transformer.num_layers == 19 and m.architecture.transformer.num_single_layers == 38
        assert m.architecture.transformer.guidance_embeds is (option == "flux")


@pytest.mark.parametrize("option", sorted(REQUIRED["platform"]))
def test_platform_options(compose, option):
    p = compose([f"platform={option}"]).platform
    assert p.name == option
    assert p.device == {"auto": "auto", "rocm": "cuda"}.get(option, option)
    assert "device_name" in p.probes


@pytest.mark.parametrize("option", sorted(REQUIRED["dataset"]))
def test_dataset_options(compose, option):
    extra = [f"dataset.path=my.{option}"] if option in NEEDS_PATH else []
    d = compose([f"dataset={option}", *extra, "dataset.limit=3"]).dataset
    assert d.format == option
    assert d.path == (f"my.{option}" if option in NEEDS_PATH else None)
    assert d.limit == 3


def test_defaults(compose):
    cfg = compose([], return_hydra_config=True, test_model=False)
    choices = cfg.hydra.runtime.choices
    assert {g: choices[g] for g in REQUIRED} == {"model": "toy_shapes", "platform": "auto", "backend": "auto",
                                                  "parallelism": "single", "dataset": "builtin"}
    assert OmegaConf.get_type(cfg) is schema.RunConfig
    assert (cfg.seed, cfg.batch_size, cfg.num_images_per_prompt, cfg.dtype) == (0, 1, 1, "auto")
    assert cfg.parallelism.mode == "single"


def test_override_examples_compose(compose):
    """The override examples of docs/configuration.md compose to what they say."""
    cfg = compose(["dataset=jsonl", "dataset.path=my.jsonl", "batch_size=4", "seed=7"])
    assert (cfg.dataset.format, cfg.dataset.path, cfg.batch_size, cfg.seed) == ("jsonl", "my.jsonl", 4, 7)
    cfg = compose(["model=flux", "model.path=/snap"])
    assert (cfg.model.name, cfg.model.path) == ("flux", "/snap")
    cfg = compose(["model=flux", "model.load_format=dummy", "platform=cuda"])
    assert (cfg.model.load_format, cfg.platform.name, cfg.platform.device) == ("dummy", "cuda", "cuda")


TYPOS = [
    "model.nme=x",                # unknown key
    "model.generation.widht=64",  # unknown nested key
    "batch_size=abc",             # wrong type
    "seed=1.5",                   # float for an int
    "model.generation.width=abc",
    "dataset.limit=many",
    "model=no_such_model",        # unknown group option
    "platform=no_such_platform",
]


@pytest.mark.parametrize("override", TYPOS)
def test_typo_fails_at_compose_time(compose, override):
    with pytest.raises((HydraException, OmegaConfBaseException)) as exc:
        compose([override])
        pytest.fail(f"{override!r} composed without error")
    key = override.split("=")[0].lstrip("+")
    assert key in str(exc.value) or key in str(exc.value.__cause__), str(exc.value)


@pytest.mark.parametrize("override", ["+model.nme=x", "+nme=x", "+dataset.pth=x"])
def test_appended_unknown_key_is_refused(compose, tmp_path, override):
    """``+key=value`` asks Hydra to add a key; Hydra adds it with ``OmegaConf.update(force_add=True)``, which
    passes structured-config nodes, so composition alone may accept a key the schema does not have. Such a
    typo must still never run: refused at compose time, or by the run before it writes or loads anything."""
    from runner.app.execute import run

    key = override.split("=")[0].lstrip("+").split(".")[-1]
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    try:
        cfg = compose(["platform=cpu", "dataset.limit=1", f"cache_dir={cache}", override])
    except (HydraException, OmegaConfBaseException) as e:
        assert key in str(e) or key in str(e.__cause__), str(e)
        return
    with pytest.raises(Exception) as exc:
        run(cfg, run_dir, [override])
        pytest.fail(f"{override!r} was accepted: the run completed into {run_dir}")
    assert key in str(exc.value), f"the error does not name {key!r}: {exc.value}"
    assert not (run_dir / "manifest.json").exists(), "refused only after the run had started"
    assert not cache.exists(), "refused only after the model was created/loaded"


@pytest.mark.parametrize("override", [
    "dataset.limit=-1", "num_images_per_prompt=0", "max_pixels=0", "cpu_threads=0", "batch_size=0",
    "model.generation.num_inference_steps=0", "model.generation.max_sequence_length=0",
    "model.generation.guidance_scale=-3", "model.generation.true_cfg_scale=-1"])
def test_each_value_refusal_names_the_key_the_value_and_a_fix(compose, override):
    """The README's promise for bad input: the field, the value and the fix (a new user met five of these without a
    fix). Run-level values are checked by ``check_run_values``, a model's by its engine's ``check_config``."""
    from runner.app.checks import apply_cpu_threads, check_run_values
    from runner.app.stages import build_engines
    from runner.core.errors import ConfigValueError

    cfg = compose(["model=tiny_flux", override])
    with pytest.raises(ConfigValueError) as e:
        check_run_values(cfg)
        apply_cpu_threads(cfg)
        for eng in build_engines(cfg, [override]):
            eng.check_config()
    msg = str(e.value)
    key, value = override.split("=")
    assert msg.startswith(f"{key}={value}") or msg.startswith(f"{key}={float(value)}"), msg
    assert "; fix: " in msg and msg.split("; fix: ")[1].strip(), msg
