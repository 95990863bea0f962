"""``optimize.compile_mode`` in a resume: a change of mode refuses the resume (named as ``key: old -> new``) and
changes every item's identity, so no item compiled under one mode is reused under another; ``default`` and an
unset mode (a run written before the key existed) are the same, so such runs still resume and keep their
identities. Configs are the real composed ones (``python -m runner``'s), through ``runner.core.resume``'s public
functions (the end-to-end refusal path is shared with every semantic key: test_reliability.py)."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Dict

import pytest
from omegaconf import OmegaConf

from runner.core import resume as rs

try:
    from _helpers import compose
except ImportError:  # tests/ imported as a package
    from tests._helpers import compose

pytestmark = pytest.mark.cpu

PLATFORM = {"kind": "cpu", "capability": None, "probes": {"device_name": "cpu"}}
PACKAGES = {"torch": "2.13", "diffusers": "0.42"}


@pytest.fixture(scope="module")
def cfg() -> Dict[str, Any]:
    return OmegaConf.to_container(compose(["compile=regional"]), resolve=True)


def _mode(cfg: Dict[str, Any], mode: Any) -> Dict[str, Any]:
    d = copy.deepcopy(cfg)
    if mode is None:
        d["optimize"].pop("compile_mode", None)  # a manifest written before the key existed
    else:
        d["optimize"]["compile_mode"] = mode
    return d


def _identity(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return rs.run_identity(cfg, "float32", PLATFORM, {}, PACKAGES)


def test_composed_default_is_default(cfg):
    assert cfg["optimize"]["compile_mode"] == "default" and rs.compile_mode_of(cfg) is None
    assert rs.compile_mode_of(_mode(cfg, None)) is None
    assert rs.compile_mode_of(_mode(cfg, "max_autotune")) == "max_autotune"


@pytest.mark.parametrize("old,new,line", [
    ("default", "max_autotune_no_cudagraphs", "optimize.compile_mode: 'default' -> 'max_autotune_no_cudagraphs'"),
    ("max_autotune_no_cudagraphs", "default", "optimize.compile_mode: 'max_autotune_no_cudagraphs' -> 'default'"),
    (None, "max_autotune", "optimize.compile_mode: 'default' -> 'max_autotune'"),
    ("max_autotune", "max_autotune_no_cudagraphs",
     "optimize.compile_mode: 'max_autotune' -> 'max_autotune_no_cudagraphs'"),
])
def test_a_changed_compile_mode_refuses_the_resume_naming_both_modes(cfg, old, new, line):
    assert rs.semantic_diff(_mode(cfg, old), _mode(cfg, new), "a" * 64, "a" * 64) == [line]


@pytest.mark.parametrize("old,new", [("default", "default"), (None, "default"), ("default", None),
                                     ("max_autotune", "max_autotune")])
def test_the_same_mode_resumes(cfg, old, new):
    assert rs.semantic_diff(_mode(cfg, old), _mode(cfg, new), "a" * 64, "a" * 64) == []


def test_the_mode_is_in_the_identity_only_when_not_default(cfg):
    base = _identity(_mode(cfg, "default"))
    assert "optimize.compile_mode" not in base["config"]
    assert _identity(_mode(cfg, None)) == base  # identities of runs that never set it are unchanged
    tuned = _identity(_mode(cfg, "max_autotune_no_cudagraphs"))
    assert tuned["config"]["optimize.compile_mode"] == "max_autotune_no_cudagraphs"
    assert {k: v for k, v in tuned["config"].items() if k != "optimize.compile_mode"} == base["config"]
    assert rs.identity_diff(base, tuned) == [
        "config.optimize.compile_mode: None -> 'max_autotune_no_cudagraphs'"]
    assert rs.identity_sha256(_identity(_mode(cfg, "max_autotune"))) != rs.identity_sha256(tuned)


def test_an_item_compiled_under_another_mode_is_not_reused(cfg):
    """A forced resume (``run.force=true``) across a mode change regenerates every item."""
    item = SimpleNamespace(key="a", seed=1, row=SimpleNamespace(id="a", prompt="p", width=64, height=64))
    batches = [[item]]
    old = rs.expected_inputs(rs.identity_sha256(_identity(_mode(cfg, "default"))), batches)
    done = {"a": {"key": "a", "status": "ok", **old["a"]}}
    same = rs.expected_inputs(rs.identity_sha256(_identity(_mode(cfg, None))), batches)
    assert rs.reusable(done, same) == done
    other = rs.expected_inputs(rs.identity_sha256(_identity(_mode(cfg, "max_autotune_no_cudagraphs"))), batches)
    assert rs.reusable(done, other) == {}
    assert rs.regenerate_batches(batches, rs.reusable(done, other)) == [item]
