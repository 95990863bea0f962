"""The precedence contract of ``runner.core.resolve``: which layer wins, what is recorded, legacy ``engine_extras``,
explicit ``auto``, per-stage values, misplaced keys, stage conflicts and per-role specs.

YAML layers are real YAML: a copy of ``conf/`` with ``experiment/<name>.yaml`` presets (``experiment=<name>``),
merged by Hydra before the CLI overrides. CLI layers are the compose overrides, which are also what resolution
is told came from the command line (Hydra's task overrides). Hardware is faked (an sm90 bf16 GPU by default)
so that more than one attention and linear backend can run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from omegaconf import open_dict

from runner.kernels import registry as reg
from runner.kernels.registry import BackendSpecError
from runner.core.resolve import (LAYERS, BackendConflictWarning, MisplacedBackendKeyError, StageConflictError,
                            check_placement)

try:
    from _helpers import CPU, LAYER_VALUES, compose, conf_with_presets, ctx, execute, per_role, resolve, stage_info
except ImportError:  # tests/ imported as a package
    from tests._helpers import CPU, LAYER_VALUES, compose, conf_with_presets, ctx, execute, per_role, resolve, stage_info

VALUES = {f: LAYER_VALUES[f] for f in ("attention", "linear")}  # moe: tests/test_hidream.py
SET_LAYERS = [l for l in LAYERS if l != "auto"]


def _yaml(layers: Dict[str, str], fld: str) -> str:
    """Preset YAML setting ``fld`` at the given YAML layers (stage values for stage ``denoise``)."""
    out = []
    if "yaml_run" in layers:
        out.append(f"backend:\n  {fld}: {layers['yaml_run']}\n")
    model = []
    if "model_default" in layers:
        model.append(f"  backend:\n    {fld}: {layers['model_default']}\n")
    stage = []
    if "yaml_stage" in layers:
        stage.append(f"      backend:\n        {fld}: {layers['yaml_stage']}\n")
    if "engine_extras" in layers:
        stage.append(f"      engine_extras:\n        {fld}_backend: {layers['engine_extras']}\n")
    if stage:
        model.append("  stages:\n    denoise:\n" + "".join(stage))
    if model:
        out.append("model:\n" + "".join(model))
    if "platform_overlay" in layers:
        out.append(f"platform:\n  overlays:\n    tiny_flux:\n      backend:\n        {fld}: "
                   f"{layers['platform_overlay']}\n")
    return "".join(out)


def _compose_layers(tmp_path: Path, fld: str, layers: Sequence[str]) -> Tuple[object, List[str]]:
    """Compose a config where exactly ``layers`` set ``fld`` (to ``VALUES[fld][layer]``)."""
    vals = {l: VALUES[fld][l] for l in layers}
    yaml_layers = {l: v for l, v in vals.items() if not l.startswith("cli_")}
    overrides = []
    if yaml_layers:
        conf = conf_with_presets(tmp_path, {"layers": _yaml(yaml_layers, fld)})
        overrides.append("experiment=layers")
    else:
        conf = None
    if "cli_run" in vals:
        overrides.append(f"backend.{fld}={vals['cli_run']}")
    if "cli_stage" in vals:
        overrides.append(f"model.stages.denoise.backend.{fld}={vals['cli_stage']}")
    return compose(overrides, conf), overrides


def _canonical(fld: str, value: str):
    name = reg.normalize(fld, value)
    return per_role(name) if fld == "attention" else name


def _combos():
    for fld in VALUES:
        for i, top in enumerate(SET_LAYERS):
            below = SET_LAYERS[i + 1:]
            yield fld, top, (top,)
            for other in below:
                yield fld, top, (top, other)
            if len(below) > 1:
                yield fld, top, (top, *below)


@pytest.mark.parametrize("fld,winner,layers", list(_combos()),
                         ids=lambda x: "+".join(x) if isinstance(x, tuple) else str(x))
def test_each_layer_wins_over_every_layer_below(tmp_path, fld, winner, layers):
    cfg, overrides = _compose_layers(tmp_path, fld, layers)
    (res, _extras), caught = resolve(cfg, overrides, record=True)
    r = res[fld]
    assert r.layer == winner, f"{layers}: {r.layer} won"
    assert r.explicit is True
    assert r.requested == VALUES[fld][winner]
    assert r.resolved == _canonical(fld, VALUES[fld][winner])
    expected_selected = _canonical(fld, VALUES[fld][winner])
    assert r.selected == expected_selected
    # the legacy key is recorded and flagged only when it lost to a different value
    conflicts = [w for w in caught if issubclass(w.category, BackendConflictWarning)]
    if "engine_extras" in layers:
        assert r.legacy["used"] is (winner == "engine_extras")
        lost_and_differs = winner != "engine_extras" and (
            reg.normalize(fld, VALUES[fld]["engine_extras"]) != reg.normalize(fld, VALUES[fld][winner]))
        assert len(conflicts) == (1 if lost_and_differs else 0), [str(w.message) for w in conflicts]
    else:
        assert r.legacy is None and not conflicts


@pytest.mark.parametrize("fld", list(VALUES))
def test_nothing_set_is_auto(fld):
    (res, _), caught = resolve(compose([]), [], record=True)
    r = res[fld]
    assert (r.layer, r.explicit, r.requested) == ("auto", False, "auto")
    assert r.resolved == (per_role("auto") if fld == "attention" else "auto")
    assert r.reason
    assert r.selected == (per_role("CUDNN_ATTN") if fld == "attention" else "TORCH")
    assert not caught


def test_layers_constant_is_the_documented_order():
    assert LAYERS == ("cli_stage", "cli_run", "yaml_stage", "yaml_run", "engine_extras", "platform_overlay",
                      "model_default", "auto")


@pytest.mark.parametrize("prefix", ["", "++"])
def test_cli_prefixes_still_count_as_cli(prefix):
    ov = [f"{prefix}backend.attention=sdpa", f"{prefix}model.stages.denoise.backend.linear=fp8"]
    res, _ = resolve(compose(ov), ov)
    assert res["attention"].layer == "cli_run"
    assert res["linear"].layer == "cli_stage"


# regression: bug: a CLI override that sets the stage's backend as a dict 
def test_cli_dict_override_of_a_stage_backend_is_cli_stage():
    ov = ["model.stages.denoise.backend={attention:cudnn}", "backend.attention=sdpa"]
    res, _ = resolve(compose(ov), ov)
    assert res["attention"].layer == "cli_stage"
    assert res["attention"].resolved == per_role("CUDNN_ATTN")


# ------------------------------------------------------------------------------------------------- C01


C01 = "backend:\n  attention: CUDNN_ATTN\n"


@pytest.mark.parametrize("order", ["preset_first", "cli_first"])
def test_c01_cli_beats_preset(tmp_path, order):
    conf = conf_with_presets(tmp_path, {"c01": C01})
    ov = ["experiment=c01", "backend.attention=TORCH_SDPA"]
    if order == "cli_first":
        ov.reverse()
    cfg = compose(ov, conf)
    for c in (ctx(), ctx(**CPU)):  # on a GPU where cuDNN could run, and on CPU where it could not
        res, _ = resolve(cfg, ov, stage_info(context=c))
        r = res["attention"]
        assert (r.layer, r.requested) == ("cli_run", "TORCH_SDPA")
        assert r.resolved == per_role("TORCH_SDPA") and r.selected == per_role("TORCH_SDPA")


def test_c01_preset_alone_is_yaml_run(tmp_path):
    conf = conf_with_presets(tmp_path, {"c01": C01})
    ov = ["experiment=c01"]
    res, _ = resolve(compose(ov, conf), ov)
    assert (res["attention"].layer, res["attention"].selected) == ("yaml_run", per_role("CUDNN_ATTN"))


@pytest.mark.slow
def test_c01_end_to_end_manifest_names_the_cli(tmp_path):
    conf = conf_with_presets(tmp_path, {"c01": C01})
    run = execute(tmp_path / "run", ["experiment=c01", "backend.attention=TORCH_SDPA", "dataset.limit=1"],
                  config_dir=conf)
    assert run.code == 0
    att = run.manifest["backends"]["denoise"]["attention"]
    assert att["layer"] == "cli_run" and att["requested"] == "TORCH_SDPA"
    assert att["selected"]["joint"]["backend"] == "TORCH_SDPA"
    layers = run.manifest["evidence"]["stages"]["denoise"]["attention"]["layers"]
    assert layers and all(set(l["observed"]) == {"TORCH_SDPA"} for l in layers)


# ------------------------------------------------------------------------------------------ C02, legacy


def _c02(tmp_path, legacy: str, first_class: str = "TORCH_SDPA"):
    conf = conf_with_presets(tmp_path, {"c02": (
        "model:\n  stages:\n    denoise:\n"
        f"      backend: {{attention: {first_class}}}\n"
        f"      engine_extras: {{attention_backend: {legacy}, num_blocks_cached: 4}}\n")})
    ov = ["experiment=c02"]
    return resolve(compose(ov, conf), ov, record=True)


@pytest.mark.parametrize("legacy", ["torch-sdpa", "sdpa", "TORCH_SDPA", "Native"])
def test_c02_equivalent_legacy_spelling_gives_no_warning(tmp_path, legacy):
    (res, extras), caught = _c02(tmp_path, legacy)
    r = res["attention"]
    assert not [w for w in caught if issubclass(w.category, BackendConflictWarning)]
    assert r.warnings == []
    assert r.layer == "yaml_stage" and r.selected == per_role("TORCH_SDPA")
    assert r.legacy == {"key": "attention_backend", "value": legacy, "normalized": per_role("TORCH_SDPA"),
                        "used": False}
    assert "attention_backend" not in extras and extras["num_blocks_cached"] == 4


def test_c02_different_legacy_value_warns_once_and_first_class_wins(tmp_path):
    (res, extras), caught = _c02(tmp_path, "cudnn")
    conflicts = [w for w in caught if issubclass(w.category, BackendConflictWarning)]
    assert len(conflicts) == 1
    msg = str(conflicts[0].message)
    assert "attention_backend" in msg and "cudnn" in msg and "TORCH_SDPA" in msg
    r = res["attention"]
    assert r.warnings == [msg]
    assert r.layer == "yaml_stage" and r.resolved == per_role("TORCH_SDPA") and r.selected == per_role("TORCH_SDPA")
    assert r.legacy["used"] is False and r.legacy["normalized"] == per_role("CUDNN_ATTN")
    assert "attention_backend" not in extras


def test_c02_with_pytest_warns(tmp_path):
    conf = conf_with_presets(tmp_path, {"c02": (
        "model:\n  stages:\n    denoise:\n      backend: {attention: TORCH_SDPA}\n"
        "      engine_extras: {attention_backend: cudnn}\n")})
    ov = ["experiment=c02"]
    with pytest.warns(BackendConflictWarning, match="conflicts"):
        resolve(compose(ov, conf), ov)


def test_legacy_key_alone_is_used_as_engine_extras_layer(tmp_path):
    conf = conf_with_presets(tmp_path, {"leg": (
        "model:\n  stages:\n    denoise:\n      engine_extras: {attention_backend: cudnn, linear_backend: fp8}\n")})
    ov = ["experiment=leg"]
    (res, extras), caught = resolve(compose(ov, conf), ov, record=True)
    assert not caught
    assert (res["attention"].layer, res["attention"].selected) == ("engine_extras", per_role("CUDNN_ATTN"))
    assert (res["linear"].layer, res["linear"].selected) == ("engine_extras", "FP8")
    assert res["attention"].legacy["used"] is True
    assert extras == {}


def test_unknown_legacy_value_is_an_error_even_when_it_loses(tmp_path):
    conf = conf_with_presets(tmp_path, {"leg": (
        "model:\n  stages:\n    denoise:\n      engine_extras: {attention_backend: cudnnn}\n")})
    ov = ["experiment=leg", "backend.attention=sdpa"]
    with pytest.raises(reg.UnknownBackendError, match="cudnnn"):
        resolve(compose(ov, conf), ov)


TYPO_PLACES = {
    "yaml_stage": ("model:\n  stages:\n    denoise:\n      backend: {attention: cudnnn}\n",
                   "model.stages.denoise.backend.attention"),
    "engine_extras": ("model:\n  stages:\n    denoise:\n      engine_extras: {attention_backend: cudnnn}\n",
                      "engine_extras.attention_backend"),
    "platform_overlay": ("platform:\n  overlays:\n    tiny_flux:\n      backend: {attention: cudnnn}\n",
                         "platform.overlays.tiny_flux.backend.attention"),
    "model_default": ("model:\n  backend: {attention: cudnnn}\n", "model.backend.attention"),
}


def test_unknown_name_at_run_level_names_backend_attention(tmp_path):
    conf = conf_with_presets(tmp_path, {"t": "backend: {attention: cudnnn}\n"})
    with pytest.raises(reg.UnknownBackendError, match=r"backend\.attention='cudnnn'.*closest match: CUDNN_ATTN"):
        resolve(compose(["experiment=t"], conf), ["experiment=t"])


# regression: bug: an unknown backend name is always reported as backend.<field>=..., 
@pytest.mark.parametrize("place", list(TYPO_PLACES))
def test_unknown_name_error_names_the_key_that_set_it(tmp_path, place):
    body, where = TYPO_PLACES[place]
    conf = conf_with_presets(tmp_path, {"t": body})
    with pytest.raises(reg.UnknownBackendError) as e:
        resolve(compose(["experiment=t"], conf), ["experiment=t"])
    assert where in str(e.value), str(e.value)


def test_overlay_engine_extras_merged_then_removed(tmp_path):
    conf = conf_with_presets(tmp_path, {"ovl": (
        "model:\n  stages:\n    denoise:\n      engine_extras: {cache_blocks: 2}\n"
        "platform:\n  overlays:\n    tiny_flux:\n"
        "      engine_extras: {attention_backend: cudnn, moe_backend: torch, compile_mode: max}\n")})
    ov = ["experiment=ovl"]
    cfg = compose(ov, conf)
    info = stage_info(fields=("attention", "linear", "moe"))
    res, extras = resolve(cfg, ov, info)
    assert (res["attention"].layer, res["attention"].selected) == ("engine_extras", per_role("CUDNN_ATTN"))
    assert (res["moe"].layer, res["moe"].selected) == ("engine_extras", "TORCH")
    # other extras survive, from the stage and from the overlay; the legacy keys cannot re-enter
    assert extras == {"cache_blocks": 2, "compile_mode": "max"}
    # the config itself is untouched, and resolving again gives the same answer (nothing was consumed twice)
    assert cfg.platform.overlays.tiny_flux.engine_extras.attention_backend == "cudnn"
    res2, extras2 = resolve(cfg, ov, info)
    assert extras2 == extras and res2["attention"].selected == res["attention"].selected


def test_overlay_legacy_key_loses_to_first_class_with_one_warning(tmp_path):
    conf = conf_with_presets(tmp_path, {"ovl": (
        "platform:\n  overlays:\n    tiny_flux:\n      engine_extras: {attention_backend: cudnn, keep: 1}\n")})
    ov = ["experiment=ovl", "backend.attention=sdpa"]
    (res, extras), caught = resolve(compose(ov, conf), ov, record=True)
    assert len([w for w in caught if issubclass(w.category, BackendConflictWarning)]) == 1
    assert (res["attention"].layer, res["attention"].selected) == ("cli_run", per_role("TORCH_SDPA"))
    assert extras == {"keep": 1}


# ---------------------------------------------------------------------------------------------- auto


def test_explicit_auto_is_kept_over_model_default(tmp_path):
    conf = conf_with_presets(tmp_path, {"md": "model:\n  backend: {attention: TORCH_SDPA, linear: fp8}\n"})
    ov = ["experiment=md", "backend.attention=auto", "backend.linear=AUTO"]
    res, _ = resolve(compose(ov, conf), ov)
    a = res["attention"]
    assert (a.layer, a.explicit, a.requested) == ("cli_run", True, "auto")
    assert a.resolved == per_role("auto")
    assert a.selected == per_role("CUDNN_ATTN")  # auto's choice on sm90 bf16, not the model default TORCH_SDPA
    assert a.reason and "joint" in a.reason
    lin = res["linear"]
    assert (lin.layer, lin.explicit, lin.resolved, lin.selected) == ("cli_run", True, "auto", "TORCH")
    assert lin.reason


def test_explicit_auto_in_yaml_is_kept(tmp_path):
    conf = conf_with_presets(tmp_path, {"a": "backend: {attention: auto}\nmodel:\n  backend: {attention: sdpa}\n"})
    ov = ["experiment=a"]
    res, _ = resolve(compose(ov, conf), ov)
    a = res["attention"]
    assert (a.layer, a.explicit, a.resolved) == ("yaml_run", True, per_role("auto"))
    assert a.selected == per_role("CUDNN_ATTN")


def test_stage_auto_beats_run_value(tmp_path):
    ov = ["backend.attention=sdpa", "model.stages.denoise.backend.attention=auto"]
    res, _ = resolve(compose(ov), ov)
    a = res["attention"]
    assert (a.layer, a.resolved, a.selected) == ("cli_stage", per_role("auto"), per_role("CUDNN_ATTN"))


def test_model_default_used_when_nothing_else(tmp_path):
    conf = conf_with_presets(tmp_path, {"md": "model:\n  backend: {attention: sdpa}\n"})
    ov = ["experiment=md"]
    res, _ = resolve(compose(ov, conf), ov)
    assert (res["attention"].layer, res["attention"].selected) == ("model_default", per_role("TORCH_SDPA"))


def test_overlay_for_another_model_is_ignored(tmp_path):
    conf = conf_with_presets(tmp_path, {"o": "platform:\n  overlays:\n    flux:\n      backend: {attention: sdpa}\n"})
    ov = ["experiment=o"]
    res, _ = resolve(compose(ov, conf), ov)
    assert res["attention"].layer == "auto"


# ------------------------------------------------------------------------------------------- per stage


TWO_STAGES = ("backend: {attention: sdpa}\n"
              "model:\n  stages:\n"
              "    denoise:\n      backend: {attention: CUDNN_ATTN}\n"
              "    refine:\n      backend: {attention: torch-sdpa, linear: fp8}\n")


def test_different_values_per_stage(tmp_path):
    conf = conf_with_presets(tmp_path, {"two": TWO_STAGES})
    ov = ["experiment=two"]
    cfg = compose(ov, conf)
    assert set(cfg.model.stages) == {"denoise", "refine"}
    d, _ = resolve(cfg, ov, stage_info("denoise"))
    r, _ = resolve(cfg, ov, stage_info("refine"))
    assert (d["attention"].layer, d["attention"].selected) == ("yaml_stage", per_role("CUDNN_ATTN"))
    assert (r["attention"].layer, r["attention"].selected) == ("yaml_stage", per_role("TORCH_SDPA"))
    assert (d["linear"].layer, d["linear"].selected) == ("auto", "TORCH")
    assert (r["linear"].layer, r["linear"].selected) == ("yaml_stage", "FP8")
    assert d["attention"].stage == "denoise" and r["attention"].stage == "refine"


def test_cli_stage_override_touches_only_its_stage(tmp_path):
    conf = conf_with_presets(tmp_path, {"two": TWO_STAGES})
    ov = ["experiment=two", "model.stages.refine.backend.attention=cudnn", "model.stages.denoise.backend.linear=fp8"]
    cfg = compose(ov, conf)
    d, _ = resolve(cfg, ov, stage_info("denoise"))
    r, _ = resolve(cfg, ov, stage_info("refine"))
    assert (d["attention"].layer, d["attention"].selected) == ("yaml_stage", per_role("CUDNN_ATTN"))
    assert (r["attention"].layer, r["attention"].selected) == ("cli_stage", per_role("CUDNN_ATTN"))
    assert (d["linear"].layer, d["linear"].selected) == ("cli_stage", "FP8")
    assert (r["linear"].layer, r["linear"].selected) == ("yaml_stage", "FP8")


def test_stage_added_on_the_config_object():
    """The same, with the second stage added to the composed config in code (``open_dict``)."""
    from runner.core.schema import BackendConfig, StageConfig

    cfg = compose([])
    with open_dict(cfg):
        cfg.model.stages.refine = StageConfig(backend=BackendConfig(attention="cudnn"))
    cfg.model.stages.denoise.backend.attention = "sdpa"
    d, _ = resolve(cfg, [], stage_info("denoise"))
    r, _ = resolve(cfg, [], stage_info("refine"))
    assert d["attention"].selected == per_role("TORCH_SDPA")
    assert r["attention"].selected == per_role("CUDNN_ATTN")


def test_run_level_cli_beats_yaml_stage_values_of_every_stage(tmp_path):
    conf = conf_with_presets(tmp_path, {"two": TWO_STAGES})
    ov = ["experiment=two", "backend.attention=cudnn"]
    cfg = compose(ov, conf)
    for s in ("denoise", "refine"):
        res, _ = resolve(cfg, ov, stage_info(s))
        assert (res["attention"].layer, res["attention"].selected) == ("cli_run", per_role("CUDNN_ATTN"))


# regression: bug: a backend under a stage the model's adapter does not have 
def test_backend_under_unknown_stage_is_rejected(tmp_path):
    from runner.app.stages import build_engines
    from runner.core.platform import detect

    conf = conf_with_presets(tmp_path, {"typo": "model:\n  stages:\n    denoize:\n      backend: {attention: cudnn}\n"})
    ov = ["platform=cpu", "experiment=typo"]
    cfg = compose(ov, conf)
    engine = build_engines(cfg, ov, detect("cpu", "cpu"), torch.float32)[-1]
    engine.resolve_source()
    with pytest.raises(reg.BackendError, match="denoize"):
        engine.resolve_backends()


# -------------------------------------------------------------------------------------- misplaced keys


@pytest.mark.parametrize("override,where,belongs", [
    ("model.attention=cudnn", "model.attention", "model.backend.attention"),
    ("model.linear=fp8", "model.linear", "model.backend.linear"),
    ("+model.architecture.attention_backend=cudnn", "model.architecture.attention_backend", "model.stages"),
    ("+model.architecture.attention=cudnn", "model.architecture.attention", "model.backend"),
    ("model.stages.denoise.attention=cudnn", "model.stages.denoise.attention",
     "model.stages.denoise.backend.attention"),
    ("model.stages.denoise.moe=torch", "model.stages.denoise.moe", "model.stages.denoise.backend.moe"),
    ("+model.stages.denoise.engine_extras.attention=cudnn", "model.stages.denoise.engine_extras.attention",
     "model.stages.denoise.backend.attention"),
    ("+platform.overlays.tiny_flux.attention=cudnn", "platform.overlays.tiny_flux.attention", "backend"),
    ("+platform.overlays.tiny_flux.linear_backend=fp8", "platform.overlays.tiny_flux.linear_backend", "backend"),
])
def test_misplaced_key_says_where_it_belongs(override, where, belongs):
    cfg = compose([override])
    with pytest.raises(MisplacedBackendKeyError) as e:
        check_placement(cfg)
    msg = str(e.value)
    assert where in msg and belongs in msg, msg


def test_misplaced_key_in_yaml_preset(tmp_path):
    conf = conf_with_presets(tmp_path, {"bad": "platform:\n  overlays:\n    tiny_flux:\n      attention: cudnn\n"})
    with pytest.raises(MisplacedBackendKeyError, match="platform.overlays.tiny_flux.attention"):
        check_placement(compose(["experiment=bad"], conf))


def test_misplaced_key_is_refused_by_the_runner_before_anything_is_written(tmp_path):
    run = execute(tmp_path / "run", ["model.stages.denoise.attention=cudnn"], catch=(MisplacedBackendKeyError,))
    assert isinstance(run.error, MisplacedBackendKeyError)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_well_placed_keys_pass_placement(tmp_path):
    conf = conf_with_presets(tmp_path, {"ok": (
        "backend: {attention: sdpa}\nmodel:\n  backend: {attention: sdpa}\n  stages:\n    denoise:\n"
        "      backend: {attention: sdpa}\n      engine_extras: {attention_backend: sdpa, other: 1}\n"
        "platform:\n  overlays:\n    tiny_flux:\n      backend: {attention: sdpa}\n      engine_extras: {x: 1}\n")})
    check_placement(compose(["experiment=ok"], conf))  # does not raise


# regression: bug: an unknown field inside a platform overlay's backend 
def test_unknown_field_in_overlay_backend_is_misplaced():
    with pytest.raises(MisplacedBackendKeyError, match="attn"):
        check_placement(compose(["+platform.overlays.tiny_flux.backend.attn=cudnn"]))


# regression: bug: a first-class field name in a platform overlay's engine_extras 
def test_first_class_name_in_overlay_engine_extras_is_misplaced():
    with pytest.raises(MisplacedBackendKeyError, match="engine_extras.attention"):
        check_placement(compose(["+platform.overlays.tiny_flux.engine_extras.attention=cudnn"]))


# ------------------------------------------------------------------------------------- stage conflicts


NO_MOE = stage_info(fields=("attention", "linear"))


@pytest.mark.parametrize("value", ["torch", "TRITON", "reference"])
def test_run_level_moe_on_stage_without_moe_is_a_conflict(value):
    ov = [f"backend.moe={value}"]
    with pytest.raises(StageConflictError) as e:
        resolve(compose(ov), ov, NO_MOE)
    assert "'denoise'" in str(e.value) and "moe" in str(e.value)
    assert "model.stages.denoise.backend.moe=auto" in str(e.value)  # the fix


def test_run_level_moe_from_yaml_is_a_conflict_too(tmp_path):
    conf = conf_with_presets(tmp_path, {"m": "backend: {moe: torch}\n"})
    with pytest.raises(StageConflictError, match="denoise"):
        resolve(compose(["experiment=m"], conf), ["experiment=m"], NO_MOE)


def test_stage_moe_auto_on_cli_silences_the_conflict():
    ov = ["backend.moe=torch", "model.stages.denoise.backend.moe=auto"]
    res, _ = resolve(compose(ov), ov, NO_MOE)
    assert res["moe"].selected is None and "not applicable" in res["moe"].reason
    assert res["moe"].layer == "cli_stage"


def test_stage_moe_auto_in_yaml_silences_a_yaml_run_value(tmp_path):
    conf = conf_with_presets(tmp_path, {"m": "backend: {moe: torch}\n"
                                             "model:\n  stages:\n    denoise:\n      backend: {moe: auto}\n"})
    ov = ["experiment=m"]
    res, _ = resolve(compose(ov, conf), ov, NO_MOE)
    assert res["moe"].selected is None


# regression: bug: a stage that sets moe=auto in YAML still gets StageConflictError for 
def test_stage_moe_auto_in_yaml_silences_a_cli_run_value(tmp_path):
    conf = conf_with_presets(tmp_path, {"m": "model:\n  stages:\n    denoise:\n      backend: {moe: auto}\n"})
    ov = ["experiment=m", "backend.moe=torch"]
    res, _ = resolve(compose(ov, conf), ov, NO_MOE)
    assert res["moe"].selected is None


def test_stage_level_moe_on_stage_without_moe_is_a_conflict():
    ov = ["model.stages.denoise.backend.moe=torch"]
    with pytest.raises(StageConflictError, match="denoise"):
        resolve(compose(ov), ov, NO_MOE)


def test_run_level_moe_auto_is_fine_and_moe_stage_takes_the_value():
    ov = ["backend.moe=auto"]
    res, _ = resolve(compose(ov), ov, NO_MOE)
    assert res["moe"].selected is None
    ov = ["backend.moe=torch"]
    res, _ = resolve(compose(ov), ov, stage_info(fields=("attention", "linear", "moe")))
    assert (res["moe"].layer, res["moe"].selected) == ("cli_run", "TORCH")


# -------------------------------------------------------------------------------------- per-role specs


def test_per_role_spec_works():
    ov = ["backend.attention={default:sdpa,per_role:{joint:{backend:sdpa}}}"]
    res, _ = resolve(compose(ov), ov)
    a = res["attention"]
    assert a.layer == "cli_run"
    assert a.resolved == per_role("TORCH_SDPA") and a.selected == per_role("TORCH_SDPA")


def test_per_role_spec_with_two_roles_uses_default_for_the_other():
    ov = ["backend.attention={default:cudnn,per_role:{joint:{backend:sdpa}}}"]
    res, _ = resolve(compose(ov), ov, stage_info(roles=("joint", "cross")))
    a = res["attention"]
    assert a.selected["joint"]["backend"] == "TORCH_SDPA"
    assert a.selected["cross"]["backend"] == "CUDNN_ATTN"


def test_per_role_default_auto_selects_per_role():
    ov = ["backend.attention={per_role:{joint:{backend:sdpa}}}"]
    res, _ = resolve(compose(ov), ov, stage_info(roles=("joint", "cross")))
    a = res["attention"]
    assert a.resolved["cross"]["backend"] == "auto" and a.selected["cross"]["backend"] == "CUDNN_ATTN"
    assert a.selected["joint"]["backend"] == "TORCH_SDPA"
    assert "cross" in a.reason


def test_per_role_unknown_role_errors_naming_it():
    ov = ["backend.attention={default:sdpa,per_role:{self_attn:{backend:sdpa}}}"]
    with pytest.raises(BackendSpecError) as e:
        resolve(compose(ov), ov)
    assert "self_attn" in str(e.value) and "joint" in str(e.value)


def test_per_role_unknown_spec_key_errors():
    ov = ["backend.attention={default:sdpa,per_role:{joint:{backend:sdpa,kernel:fast}}}"]
    with pytest.raises(BackendSpecError, match="kernel"):
        resolve(compose(ov), ov)


def test_per_role_unavailable_backend_names_the_role():
    ov = ["backend.attention={default:sdpa,per_role:{joint:{backend:cudnn}}}"]
    with pytest.raises(reg.BackendUnavailableError) as e:
        resolve(compose(ov), ov, stage_info(roles=("joint", "cross"), context=ctx(**CPU)))
    assert "joint" in str(e.value)
