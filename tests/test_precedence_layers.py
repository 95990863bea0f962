"""Precedence details beside test_precedence.py's layer pairs: the order in which a stage's ``engine_extras`` and the
platform overlay's ``engine_extras`` merge (the overlay's value of a key wins, legacy backend keys included), what
counts as set on the command line, and a run-level value a stage of a multi-stage pipeline refuses.

YAML layers are real YAML presets (``experiment=<name>``) over a copy of ``conf/``, composed by Hydra; hardware is
faked (an sm90 bf16 GPU) so that more than one backend can run.
"""

from __future__ import annotations

import pytest

from runner.kernels import registry as reg
from runner.core.resolve import cli_keys, _set_by

try:
    from _helpers import compose, conf_with_presets, per_role, resolve, stage_info
except ImportError:  # tests/ imported as a package
    from tests._helpers import compose, conf_with_presets, per_role, resolve, stage_info

pytestmark = pytest.mark.cpu

BOTH_EXTRAS = ("model:\n  stages:\n    denoise:\n      engine_extras: {compile_mode: stage, cache_blocks: 2, "
               "attention_backend: sdpa}\n"
               "platform:\n  overlays:\n    tiny_flux:\n      engine_extras: {compile_mode: overlay, "
               "attention_backend: cudnn}\n")


def test_overlay_extras_win_over_the_stages_extras_of_the_same_key(tmp_path):
    conf = conf_with_presets(tmp_path, {"both": BOTH_EXTRAS})
    ov = ["experiment=both"]
    res, extras = resolve(compose(ov, conf), ov)
    assert extras == {"compile_mode": "overlay", "cache_blocks": 2}
    # the legacy key too: the overlay's value is the one the engine_extras layer holds
    a = res["attention"]
    assert (a.layer, a.requested, a.selected) == ("engine_extras", "cudnn", per_role("CUDNN_ATTN"))
    assert a.legacy == {"key": "attention_backend", "value": "cudnn", "normalized": per_role("CUDNN_ATTN"),
                        "used": True}


def test_stage_extras_alone_pass_through(tmp_path):
    conf = conf_with_presets(tmp_path, {"s": "model:\n  stages:\n    denoise:\n      engine_extras: {a: 1, b: 2}\n"})
    ov = ["experiment=s"]
    res, extras = resolve(compose(ov, conf), ov)
    assert extras == {"a": 1, "b": 2}
    assert all(r.legacy is None for r in res.values())


def test_no_extras_anywhere():
    _, extras = resolve(compose([]), [])
    assert extras == {}


# ------------------------------------------------------------------------------------------- what is CLI


def test_cli_keys_leave_out_group_selections():
    assert cli_keys(["backend=fast", "model=tiny_flux", "backend.attention=sdpa", "+model.stages.x.backend.moe=torch",
                     "~seed", "++dtype=bfloat16"]) == ["backend.attention", "model.stages.x.backend.moe", "seed", "dtype"]
    assert cli_keys(["backend=fast"], groups=["model"]) == ["backend"]
    assert cli_keys(["backend@foo=fast"]) == ["backend"]  # a group with a package: a value, not the group's file


@pytest.mark.parametrize("keys,key,set_", [
    (["backend.attention"], "backend.attention", True), (["backend"], "backend.attention", True),
    (["backend.attention.default"], "backend.attention", True), (["backend.attentions"], "backend.attention", False),
    (["model.backend.attention"], "backend.attention", False), ([], "backend.attention", False),
    (["backend.linear", "backend.attention"], "backend.attention", True),
])
def test_set_by(keys, key, set_):
    assert _set_by(keys, key) is set_


def test_a_parent_node_set_on_the_cli_makes_the_value_cli(tmp_path):
    conf = conf_with_presets(tmp_path, {"y": "backend: {attention: sdpa}\n"})
    ov = ["experiment=y", "backend.linear=fp8", "model.stages.denoise={backend: {moe: torch}}"]
    res, _ = resolve(compose(ov, conf), ov, stage_info(fields=("attention", "linear", "moe")))
    assert (res["attention"].layer, res["linear"].layer, res["moe"].layer) == ("yaml_run", "cli_run", "cli_stage")


# regression: bug: ``backend={attention: cudnn}`` on the command line (a dict value for the node of the ``backend``
# config group, which Hydra merges) was taken for a group selection (``backend=<preset>``, YAML) and dropped from
# the CLI keys: its value was recorded as yaml_run and lost to a YAML stage value.
def test_a_dict_value_for_a_config_groups_node_is_a_cli_value(tmp_path):
    assert cli_keys(["backend={attention: cudnn}", "backend=auto"]) == ["backend"]
    conf = conf_with_presets(tmp_path, {"st": "model:\n  stages:\n    denoise:\n      backend: {attention: sdpa}\n"})
    ov = ["experiment=st", "backend={attention: cudnn}"]
    res, _ = resolve(compose(ov, conf), ov)
    assert (res["attention"].layer, res["attention"].selected) == ("cli_run", per_role("CUDNN_ATTN"))


# =============================================================================================================
# The same contract on config objects built directly (no Hydra compose, a millisecond a case): every layer pair,
# each field's conflicts, per-role specs, engines with their own names. The config holds what Hydra would have
# merged (a CLI value replaces a YAML value at the same key); ``cli`` lists the keys set on the command line.

import warnings  # noqa: E402

from omegaconf import OmegaConf  # noqa: E402

from runner.core.resolve import (LAYERS, BackendConflictWarning, EngineNames, StageConflictError,  # noqa: E402
                            resolve_stage)

try:
    from _helpers import CPU, LAYER_VALUES, ctx
except ImportError:  # tests/ imported as a package
    from tests._helpers import CPU, LAYER_VALUES, ctx

VALUES = LAYER_VALUES
SET = [l for l in LAYERS if l != "auto"]
STAGE_KEY = "model.stages.denoise.backend.{f}"
RUN_KEY = "backend.{f}"
ALL_FIELDS = stage_info(fields=("attention", "linear", "moe"))


def config(layers=None, fld: str = "attention", pipeline=None, **more):
    """``(cfg, cli)`` with ``fld`` set at ``layers`` (``{layer: value}``); ``more``: extra dotted keys."""
    d = {"model": {"name": "tiny_flux", "backend": {}, "stages": {"denoise": {"backend": {}, "engine_extras": {}}}},
         "backend": {}, "platform": {"overlays": {}}}
    if pipeline:
        d["model"]["pipeline"] = list(pipeline)
    cfg = OmegaConf.create(d)
    cli = []
    where = {"yaml_stage": STAGE_KEY, "cli_stage": STAGE_KEY, "yaml_run": RUN_KEY, "cli_run": RUN_KEY,
             "engine_extras": "model.stages.denoise.engine_extras.{f}_backend",
             "platform_overlay": "platform.overlays.tiny_flux.backend.{f}", "model_default": "model.backend.{f}"}
    for layer in reversed(SET):  # lowest first: a CLI value replaces the YAML value at its key
        if layer in (layers or {}):
            key = where[layer].format(f=fld)
            OmegaConf.update(cfg, key, layers[layer], force_add=True)
            if layer.startswith("cli_"):
                cli.append(key)
    for key, value in more.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, force_add=True)
    return cfg, cli


def run(cfg, cli, info=ALL_FIELDS):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res, extras = resolve_stage(cfg, cli, info)
    return res, extras, [w for w in caught if issubclass(w.category, BackendConflictWarning)]


def _canon(fld, value):
    name = reg.normalize(fld, value)
    return per_role(name) if fld == "attention" else name


def _pairs():
    for fld in VALUES:
        for i, top in enumerate(SET):
            yield fld, top, (top,)
            for below in SET[i + 1:]:
                yield fld, top, (top, below)


@pytest.mark.parametrize("fld,winner,layers", list(_pairs()), ids=lambda x: "+".join(x) if isinstance(x, tuple) else x)
def test_every_layer_pair(monkeypatch, fld, winner, layers):
    monkeypatch.setattr(reg, "has_symbol", lambda path: True)  # TRITON needs triton installed
    cfg, cli = config({l: VALUES[fld][l] for l in layers}, fld)
    res, extras, conflicts = run(cfg, cli)
    r = res[fld]
    expected_layer = "cli_stage" if layers == ("cli_stage", "yaml_stage") else winner
    assert (r.stage, r.field, r.layer, r.explicit) == ("denoise", fld, expected_layer, True)
    assert r.requested == VALUES[fld][winner]
    assert r.resolved == r.selected == _canon(fld, VALUES[fld][winner])
    assert r.reason is None
    assert extras == {}  # the legacy key never reaches the engine
    if "engine_extras" in layers:
        used = winner == "engine_extras"
        assert r.legacy == {"key": f"{fld}_backend", "value": VALUES[fld]["engine_extras"],
                            "normalized": _canon(fld, VALUES[fld]["engine_extras"]), "used": used}
        differs = _canon(fld, VALUES[fld]["engine_extras"]) != _canon(fld, VALUES[fld][winner])
        assert len(conflicts) == (0 if used or not differs else 1)
        assert r.warnings == [str(w.message) for w in conflicts]
    else:
        assert r.legacy is None and conflicts == [] and r.warnings == []
    for other in set(VALUES) - {fld}:
        assert (res[other].layer, res[other].explicit, res[other].requested) == ("auto", False, "auto")


def test_the_conflict_warning_names_both_values(monkeypatch):
    cfg, cli = config({"cli_run": "sdpa", "engine_extras": "cudnn"})
    res, _, conflicts = run(cfg, cli)
    assert res["attention"].warnings == [
        "stage denoise: engine_extras.attention_backend='cudnn' (normalized CUDNN_ATTN) conflicts with "
        "backend.attention=TORCH_SDPA from layer cli_run; the first-class value wins and the legacy key is dropped"]
    assert len(conflicts) == 1


def test_the_conflict_warning_of_a_per_role_value():
    cfg, cli = config({"yaml_stage": {"per_role": {"joint": {"backend": "sdpa"}}, "default": "cudnn"},
                       "engine_extras": "cudnn"})
    res, _, _ = run(cfg, cli, stage_info(roles=("joint", "cross")))
    assert res["attention"].warnings[0].endswith(
        "conflicts with model.stages.denoise.backend.attention={'joint': 'TORCH_SDPA', 'cross': 'CUDNN_ATTN'} from "
        "layer yaml_stage; the first-class value wins and the legacy key is dropped")


def test_nothing_set_anywhere():
    res, extras, conflicts = run(*config())
    for fld in ("attention", "linear", "moe"):
        r = res[fld]
        assert (r.layer, r.explicit, r.requested, r.legacy, r.warnings) == ("auto", False, "auto", None, [])
    assert res["attention"].resolved == per_role("auto") and res["attention"].selected == per_role("CUDNN_ATTN")
    assert res["attention"].reason == f"joint: {reg.auto_order('attention', ctx())[0][1]}"
    assert (res["linear"].resolved, res["linear"].selected) == ("auto", "TORCH")
    assert res["linear"].reason == "dense GEMM in the model dtype; FP8 is lossy and never chosen by auto"
    assert extras == {} and conflicts == []


def test_none_is_unset_at_every_layer():
    cfg, cli = config({"yaml_stage": None, "yaml_run": None, "platform_overlay": None, "model_default": "sdpa"})
    assert run(cfg, cli)[0]["attention"].layer == "model_default"


def test_explicit_auto_is_kept_and_auto_chooses():
    cfg, cli = config({"cli_run": "AUTO", "model_default": "sdpa"}, "linear")
    r = run(cfg, cli)[0]["linear"]
    assert (r.layer, r.explicit, r.requested, r.resolved, r.selected) == ("cli_run", True, "AUTO", "auto", "TORCH")


def test_the_engine_extras_layer_sits_between_yaml_run_and_the_overlay():
    cfg, cli = config({"engine_extras": "cudnn", "platform_overlay": "sdpa", "model_default": "sdpa"})
    assert run(cfg, cli)[0]["attention"].layer == "engine_extras"
    cfg, cli = config({"yaml_run": "sdpa", "engine_extras": "cudnn"})
    assert run(cfg, cli)[0]["attention"].layer == "yaml_run"


def test_legacy_keys_leave_the_extras_other_keys_stay():
    cfg, cli = config(**{"model__stages__denoise__engine_extras": {"moe_backend": "torch", "linear_backend": "torch",
                                                                   "compile_mode": "max"}})
    res, extras, _ = run(cfg, cli)
    assert extras == {"compile_mode": "max"}
    assert (res["moe"].layer, res["linear"].layer, res["attention"].layer) == ("engine_extras", "engine_extras", "auto")


def test_the_config_is_not_changed_by_resolution():
    cfg, cli = config({"engine_extras": "cudnn"})
    run(cfg, cli)
    assert OmegaConf.select(cfg, "model.stages.denoise.engine_extras.attention_backend") == "cudnn"


def test_a_stage_the_config_does_not_have():
    cfg, cli = config({"cli_run": "sdpa"})
    res, extras, _ = run(cfg, cli, stage_info("refine"))
    assert (res["attention"].layer, res["attention"].stage) == ("cli_run", "refine") and extras == {}


def test_overlay_of_another_model_is_ignored():
    cfg, cli = config(**{"platform__overlays__flux__backend__attention": "sdpa",
                         "platform__overlays__flux__engine_extras": {"x": 1}})
    res, extras, _ = run(cfg, cli)
    assert res["attention"].layer == "auto" and extras == {}


# ---------------------------------------------------------------------------------------- unknown names


@pytest.mark.parametrize("layer,where", [
    ("cli_stage", "model.stages.denoise.backend.attention"), ("yaml_stage", "model.stages.denoise.backend.attention"),
    ("cli_run", "backend.attention"), ("yaml_run", "backend.attention"),
    ("engine_extras", "model.stages.denoise.engine_extras.attention_backend"),
    ("platform_overlay", "platform.overlays.tiny_flux.backend.attention"),
    ("model_default", "model.backend.attention"),
])
def test_an_unknown_name_names_the_key_that_set_it(layer, where):
    cfg, cli = config({layer: "zzqq"})
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    assert str(e.value).startswith(f"{where}='zzqq' is not a known backend; valid names: ")


@pytest.mark.parametrize("layer,where", [("yaml_stage", "model.stages.denoise.backend.linear"),
                                         ("model_default", "model.backend.linear")])
def test_an_unknown_linear_name_names_the_key_that_set_it(layer, where):
    cfg, cli = config({layer: "zzqq"}, "linear")
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    names = ", ".join(sorted(reg.BACKENDS["linear"]))  # every registered linear backend, e.g. FP8, FP8_TORCHAO, TORCH
    assert str(e.value).startswith(f"{where}='zzqq' is not a known backend; valid names: {names}, auto")


def test_an_unknown_losing_stage_value_of_a_field_the_stage_lacks():
    cfg, cli = config({"yaml_stage": "zzqq", "cli_run": "torch"}, "moe")
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli, NO_MOE)
    assert str(e.value).startswith("model.stages.denoise.backend.moe='zzqq' is not a known backend")


def test_an_unknown_legacy_value_is_an_error_even_when_it_loses():
    cfg, cli = config({"cli_run": "sdpa", "engine_extras": "zzqq"})
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    assert str(e.value).startswith("model.stages.denoise.engine_extras.attention_backend='zzqq' is not a known")


# -------------------------------------------------------------------------------------------- availability


@pytest.mark.parametrize("layer,where", [
    ("cli_stage", "model.stages.denoise.backend.linear"), ("yaml_run", "backend.linear"),
    ("engine_extras", "model.stages.denoise.engine_extras.linear_backend"),
    ("platform_overlay", "platform.overlays.tiny_flux.backend.linear"), ("model_default", "model.backend.linear"),
])
def test_an_explicit_backend_that_cannot_run_names_where_it_was_set(layer, where):
    cfg, cli = config({layer: "fp8"}, "linear")
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, stage_info(fields=("attention", "linear"), context=ctx(**CPU)))
    assert str(e.value).startswith(f"{where}=FP8 cannot run here: needs platform cuda, this is cpu; ")
    assert str(e.value).endswith(f". Fix: choose another backend (or `auto`) for {where}.")


def test_an_unwired_backend_is_named_with_the_records_own_reasons():
    cfg, cli = config({"cli_run": "fp8"}, "linear")
    info = stage_info(fields=("attention", "linear"), context=ctx(**CPU))
    info.wired = {"linear": ["TORCH"]}
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, info)
    assert ("needs dtype float16/bfloat16, the model runs in float32; is not wired into the engine of stage "
            "'denoise' (it runs TORCH). Fix:") in str(e.value)


def test_a_wired_runnable_backend_passes():
    cfg, cli = config({"cli_run": "fp8"}, "linear")
    info = stage_info(fields=("attention", "linear"))
    info.wired = {"linear": ["TORCH", "FP8"], "attention": ["TORCH_SDPA"]}
    res = run(cfg, cli, info)[0]
    assert res["linear"].selected == "FP8"
    assert res["attention"].selected == per_role("TORCH_SDPA")  # auto picks among the wired only
    assert res["attention"].reason == "joint: no specialised kernel fits (skipped: CUDNN_ATTN: not wired into this " \
                                      "stage's engine; FLASH_ATTN: not wired into this stage's engine)"


def test_an_unwired_backend_lists_what_the_engine_runs():
    cfg, cli = config({"cli_run": "fp8"}, "linear")
    info = stage_info(fields=("attention", "linear"), context=ctx(**CPU))
    info.wired = {"linear": ["TORCH", "INT8"], "attention": ["TORCH_SDPA", "FLASH_ATTN"]}
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, info)
    assert "is not wired into the engine of stage 'denoise' (it runs TORCH, INT8). Fix:" in str(e.value)
    cfg, cli = config({"cli_run": "cudnn"})
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, info)
    assert "is not wired into the engine of stage 'denoise' (it runs TORCH_SDPA, FLASH_ATTN). Fix:" in str(e.value)


def test_auto_picks_among_the_wired_linear_backends():
    info = stage_info(fields=("attention", "linear"))
    info.wired = {"linear": ["FP8"]}
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(*config(), info)
    assert str(e.value) == "auto found no linear backend: TORCH: not wired into this stage's engine"


def test_auto_reasons_of_every_role():
    r = run(*config(), stage_info(roles=("joint", "cross")))[0]["attention"]
    why = reg.auto_order("attention", ctx())[0][1]
    assert r.reason == f"joint: {why}; cross: {why}"


def test_an_unwired_attention_backend_per_role():
    cfg, cli = config({"cli_run": {"default": "sdpa", "per_role": {"cross": {"backend": "cudnn"}}}})
    info = stage_info(roles=("joint", "cross"), fields=("attention", "linear"), context=ctx(**CPU))
    info.wired = {"attention": ["TORCH_SDPA"]}
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, info)
    assert str(e.value).startswith("backend.attention (role cross)=CUDNN_ATTN cannot run here: needs platform cuda")
    assert "is not wired into the engine of stage 'denoise' (it runs TORCH_SDPA)" in str(e.value)


def test_one_role_names_no_role():
    cfg, cli = config({"cli_run": "cudnn"})
    with pytest.raises(reg.BackendUnavailableError) as e:
        run(cfg, cli, stage_info(fields=("attention", "linear"), context=ctx(**CPU)))
    assert str(e.value).startswith("backend.attention=CUDNN_ATTN cannot run here")


# ----------------------------------------------------------------------------------------- per-role specs


def test_per_role_default_and_override():
    cfg, cli = config({"yaml_run": {"default": "cudnn", "per_role": {"cross": {"backend": "sdpa"}}}})
    r = run(cfg, cli, stage_info(roles=("joint", "cross")))[0]["attention"]
    assert r.resolved == {"joint": {"backend": "CUDNN_ATTN", "quant": None, "skip_softmax": None},
                          "cross": {"backend": "TORCH_SDPA", "quant": None, "skip_softmax": None}}
    assert r.selected == r.resolved and r.reason is None


def test_per_role_auto_default_reason_per_role():
    cfg, cli = config({"cli_run": {"per_role": {"joint": "sdpa"}}})
    r = run(cfg, cli, stage_info(roles=("joint", "cross")))[0]["attention"]
    assert r.resolved["cross"]["backend"] == "auto" and r.selected["cross"]["backend"] == "CUDNN_ATTN"
    assert r.reason == f"cross: {reg.auto_order('attention', ctx())[0][1]}"


def test_per_role_without_per_role_key():
    cfg, cli = config({"cli_run": {"default": "sdpa", "per_role": None}})
    r = run(cfg, cli, stage_info(roles=("joint", "cross")))[0]["attention"]
    assert r.selected == per_role("TORCH_SDPA", ("joint", "cross"))


def test_a_spec_with_quant():
    spec = {"backend": "sage", "quant": {"dtype_qk": "int8"}}
    cfg, cli = config({"cli_run": spec})
    with pytest.raises(reg.BackendUnavailableError):  # no sageattention here, but the spec itself is valid
        run(cfg, cli, stage_info(fields=("attention", "linear")))
    r = _normalized(spec)
    assert r == {"joint": {"backend": "SAGE_ATTN", "quant": {"dtype_qk": "int8"}, "skip_softmax": None}}


def _normalized(value, roles=("joint",)):
    from runner.core.resolve import _normalize_attention

    return _normalize_attention(value, roles, "backend.attention")


def test_spec_errors():
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"default": "sdpa", "per_role": {"self": "sdpa"}})
    assert str(e.value) == ("backend.attention.per_role.self: the model has no attention role 'self'; its roles: "
                            "joint")
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"per_role": {"self": "sdpa"}}, ("joint", "cross"))
    assert str(e.value).endswith("its roles: joint, cross")
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"default": "sdpa", "extra": 1})
    assert str(e.value) == "backend.attention: unknown key(s) ['extra']; expected default, per_role"
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"backend": "sdpa", "kernel": "fast", "bits": 4})
    assert str(e.value) == ("backend.attention: unknown key(s) ['bits', 'kernel']; a spec takes backend, quant, "
                            "skip_softmax")
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"quant": {"dtype_qk": "int8"}})
    assert str(e.value) == "backend.attention: a spec needs `backend`"
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized(["sdpa"])
    assert str(e.value) == "backend.attention=['sdpa']: expected a backend name or a spec"
    with pytest.raises(reg.BackendSpecError) as e:
        _normalized({"default": {"backend": "sdpa", "x": 1}})
    assert str(e.value).startswith("backend.attention.default: unknown key(s) ['x']")
    with pytest.raises(reg.UnknownBackendError) as e:
        _normalized({"per_role": {"joint": {"backend": "zzqq"}}})
    assert str(e.value).startswith("backend.attention.per_role.joint.backend='zzqq' is not a known backend")


def test_spec_of_every_role_is_its_own_copy():
    r = _normalized("sdpa", ("joint", "cross"))
    r["joint"]["backend"] = "X"
    assert r["cross"]["backend"] == "TORCH_SDPA"
    d = _normalized({"default": "sdpa"}, ("joint", "cross"))
    d["joint"]["backend"] = "X"
    assert d["cross"]["backend"] == "TORCH_SDPA"


def test_quant_with_auto_needs_a_named_backend():
    cfg, cli = config({"cli_run": {"backend": "auto", "skip_softmax": {"threshold": 0.1}}})
    with pytest.raises(reg.BackendSpecError) as e:
        run(cfg, cli)
    assert str(e.value) == "backend.attention: quant/skip_softmax need a named backend, not auto"
    cfg, cli = config({"cli_run": {"backend": "auto", "quant": {"dtype_qk": "int8"}}})
    with pytest.raises(reg.BackendSpecError) as e:
        run(cfg, cli)
    assert str(e.value) == "backend.attention: quant/skip_softmax need a named backend, not auto"


def test_a_spec_the_backend_does_not_take_is_refused_per_role():
    cfg, cli = config({"cli_run": {"default": "sdpa", "per_role": {"cross": {"backend": "cudnn",
                                                                             "quant": {"bits": 4}}}}})
    with pytest.raises(reg.BackendSpecError) as e:
        run(cfg, cli, stage_info(roles=("joint", "cross")))
    assert str(e.value) == ("backend.attention (role cross).quant.bits: CUDNN_ATTN does not take it (CUDNN_ATTN "
                            "takes: no quant keys)")


# ------------------------------------------------------------------------------- a field the stage lacks


NO_MOE = stage_info(fields=("attention", "linear"), context=ctx())


def test_no_moe_layers_nothing_set():
    r = run(*config(), NO_MOE)[0]["moe"]
    assert (r.selected, r.reason, r.layer) == (None, "not applicable: stage 'denoise' has no MoE layers", "auto")


def test_no_moe_layers_names_the_model():
    info = stage_info(fields=("attention", "linear"))
    info.model = "tiny_flux"
    r = run(*config(), info)[0]["moe"]
    assert r.reason == "not applicable: stage 'denoise' (model=tiny_flux) has no MoE layers"


@pytest.mark.parametrize("layer", ["cli_run", "yaml_run"])
def test_a_run_level_value_the_stage_cannot_honour(layer):
    cfg, cli = config({layer: "torch"}, "moe")
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, NO_MOE)
    assert str(e.value) == (f"backend.moe=TORCH (from {layer}) cannot be honoured: stage 'denoise' has no MoE layers, "
                            "so its engine runs no moe backend; fix: drop backend.moe, or set "
                            "model.stages.denoise.backend.moe=auto")


@pytest.mark.parametrize("layer", ["cli_stage", "yaml_stage"])
def test_a_stage_value_the_stage_cannot_honour(layer):
    cfg, cli = config({layer: "torch"}, "moe")
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, NO_MOE)
    assert str(e.value) == ("model.stages.denoise.backend.moe=TORCH: stage 'denoise' has no MoE layers, so no moe "
                            "backend can run there; fix: remove model.stages.denoise.backend.moe (or set it to auto)")


@pytest.mark.parametrize("layer,where", [("platform_overlay", "platform.overlays.tiny_flux.backend.moe"),
                                         ("model_default", "model.backend.moe"),
                                         ("engine_extras", "model.stages.denoise.engine_extras.moe_backend")])
def test_a_lower_layer_value_the_stage_cannot_honour(layer, where):
    cfg, cli = config({layer: "torch"}, "moe")
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, NO_MOE)
    assert str(e.value) == (f"{where}=TORCH: stage 'denoise' has no MoE layers, so no moe backend can run there; fix: "
                            f"remove {where} (or set it to auto)")


@pytest.mark.parametrize("stage_layer", ["cli_stage", "yaml_stage"])
def test_a_stage_auto_silences_a_run_value(stage_layer):
    cfg, cli = config({stage_layer: "auto", "cli_run": "torch", "model_default": "torch"}, "moe")
    r = run(cfg, cli, NO_MOE)[0]["moe"]
    top = "cli_stage" if stage_layer == "cli_stage" else "cli_run"  # the CLI run value ranks above a YAML stage's
    assert (r.layer, r.selected, r.reason) == (top, None, "not applicable: stage 'denoise' has no MoE layers")


@pytest.mark.parametrize("layer", ["cli_run", "model_default", "platform_overlay"])
def test_auto_at_any_layer_is_fine(layer):
    cfg, cli = config({layer: "auto"}, "moe")
    r = run(cfg, cli, NO_MOE)[0]["moe"]
    assert (r.layer, r.selected) == (layer, None)


def test_fields_after_one_the_stage_lacks_are_still_resolved():
    info = stage_info(fields=("linear", "moe"))
    res = run(*config(), info)[0]
    assert set(res) == {"attention", "linear", "moe"}
    assert (res["attention"].selected, res["linear"].selected) == (None, "TORCH") and res["moe"].selected
    cfg, cli = config({"yaml_stage": "auto"})
    res = run(cfg, cli, info)[0]
    assert set(res) == {"attention", "linear", "moe"} and res["linear"].selected == "TORCH"


def test_no_attention_layers_with_a_per_role_stage_value():
    info = stage_info(fields=("linear",))
    cfg, cli = config({"yaml_stage": {"default": "auto", "per_role": {"joint": "sdpa"}}})
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, info)
    assert str(e.value).startswith("model.stages.denoise.backend.attention=TORCH_SDPA: stage 'denoise' has no "
                                   "attention layers")
    cfg, cli = config({"yaml_stage": {"default": "auto"}, "cli_run": "sdpa"})
    assert run(cfg, cli, info)[0]["attention"].selected is None


# --------------------------------------------------------------------------------- multi-stage pipelines


def test_a_run_level_error_in_a_pipeline_names_the_stage_and_the_per_stage_key():
    cfg, cli = config({"cli_run": "zzqq"}, pipeline=["expand", "denoise"])
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    msg = str(e.value)
    assert msg.startswith("stage 'denoise' of model.pipeline ['expand', 'denoise']: backend.attention='zzqq' is not")
    assert msg.endswith("\n(backend.attention applies to every stage; to set it for one stage only use "
                        "model.stages.<stage>.backend.attention, e.g. model.stages.denoise.backend.attention)")
    assert e.value.__cause__ is None


def test_a_run_level_conflict_in_a_pipeline_keeps_its_type():
    cfg, cli = config({"cli_run": "torch"}, "moe", pipeline=["expand", "denoise"])
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, NO_MOE)
    assert str(e.value).startswith("stage 'denoise' of model.pipeline ['expand', 'denoise']: backend.moe=TORCH (from")
    assert str(e.value).endswith("\n(backend.moe applies to every stage; to set it for one stage only use "
                                 "model.stages.<stage>.backend.moe, e.g. model.stages.denoise.backend.moe)")


def test_a_stage_level_error_in_a_pipeline_is_unchanged():
    cfg, cli = config({"cli_stage": "zzqq"}, pipeline=["expand", "denoise"])
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    assert str(e.value).startswith("model.stages.denoise.backend.attention='zzqq'")


def test_a_run_level_error_of_a_one_stage_model_is_unchanged():
    cfg, cli = config({"cli_run": "zzqq"}, pipeline=["denoise"])
    with pytest.raises(reg.UnknownBackendError) as e:
        run(cfg, cli)
    assert str(e.value).startswith("backend.attention='zzqq'")


# ------------------------------------------------------------------------------- an engine's own names


class VllmLike(EngineNames):
    """An engine that owns its backend names (like vLLM's), per field; some of them unknown to the registry
    (XFORMERS, CUTLASS); FLASHINFER only on GPUs."""

    engine = "vllm"
    NAMES = {"attention": ("FLASH_ATTN", "FLASHINFER", "XFORMERS"), "linear": ("TORCH",), "moe": ("TRITON", "CUTLASS")}

    def __init__(self):
        self.checked = []

    def canonical(self, fld, value, where):
        if str(value).lower() == "auto":
            return "auto"
        if str(value).upper() not in self.NAMES[fld]:
            raise reg.UnknownBackendError(f"{where}={value!r} is not a vLLM {fld} backend")
        return str(value).upper()

    def check(self, fld, name, where):
        self.checked.append((fld, name, where))
        if name == "FLASHINFER":
            raise reg.BackendUnavailableError(f"{where}={name}: no GPU")

    def auto(self, fld):
        return {"attention": ("FLASH_ATTN", "vLLM's default"), "linear": ("TORCH", "dense"),
                "moe": ("TRITON", "fused")}[fld], "chosen by vLLM"


def test_an_engines_own_names_resolve_through_the_same_layers():
    names = VllmLike()
    info = stage_info(fields=("attention", "linear", "moe"))
    info.names = names
    cfg, cli = config({"yaml_stage": "flash_attn", "model_default": "xformers"})
    res = run(cfg, cli, info)[0]
    a = res["attention"]
    assert (a.layer, a.resolved, a.selected, a.reason) == ("yaml_stage", "FLASH_ATTN", "FLASH_ATTN", None)
    assert names.checked == [("attention", "FLASH_ATTN", "model.stages.denoise.backend.attention")]
    assert (res["moe"].resolved, res["moe"].selected, res["moe"].reason) == ("auto", ("TRITON", "fused"),
                                                                              "chosen by vLLM")
    cfg, cli = config({"cli_run": "flashinfer"})
    with pytest.raises(reg.BackendUnavailableError, match="backend.attention=FLASHINFER: no GPU"):
        run(cfg, cli, info)
    cfg, cli = config({"cli_run": "sdpa"})
    with pytest.raises(reg.UnknownBackendError, match="backend.attention='sdpa' is not a vLLM attention backend"):
        run(cfg, cli, info)
    cfg, cli = config({"cli_run": "cutlass"}, "moe")
    assert run(cfg, cli, info)[0]["moe"].selected == "CUTLASS"


def test_an_engines_own_names_for_a_legacy_key():
    info = stage_info(fields=("attention", "linear", "moe"))
    info.names = VllmLike()
    cfg, cli = config({"cli_run": "xformers", "engine_extras": "flashinfer"})
    r = run(cfg, cli, info)[0]["attention"]
    assert r.legacy == {"key": "attention_backend", "value": "flashinfer", "normalized": "FLASHINFER", "used": False}
    assert r.warnings[0].startswith("stage denoise: engine_extras.attention_backend='flashinfer' (normalized "
                                    "FLASHINFER) conflicts with backend.attention=XFORMERS from layer cli_run")


def test_an_engines_own_names_for_a_field_the_stage_lacks():
    info = stage_info(fields=("attention", "linear"))
    info.names = VllmLike()
    cfg, cli = config({"yaml_stage": "cutlass", "cli_run": "triton"}, "moe")
    with pytest.raises(StageConflictError) as e:
        run(cfg, cli, info)
    assert str(e.value).startswith("model.stages.denoise.backend.moe=CUTLASS: stage 'denoise' has no MoE layers")


def test_the_engine_names_interface_is_abstract():
    e = EngineNames()
    for call in (lambda: e.canonical("attention", "x", "w"), lambda: e.check("attention", "x", "w"),
                 lambda: e.auto("attention")):
        with pytest.raises(NotImplementedError):
            call()
