"""Precedence details beside test_precedence.py's layer pairs: the order in which a stage's ``engine_extras`` and the
platform overlay's ``engine_extras`` merge (the overlay's value of a key wins, legacy backend keys included), what
counts as set on the command line, and a run-level value a stage of a multi-stage pipeline refuses.

YAML layers are real YAML presets (``experiment=<name>``) over a copy of ``conf/``, composed by Hydra; hardware is
faked (an sm90 bf16 GPU) so that more than one backend can run.
"""

from __future__ import annotations

import pytest

from kernels import registry as reg
from runner.resolve import cli_keys, _set_by

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
