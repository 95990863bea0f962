"""The quick start's test command passes without the optional extras (issue #38): every extra of
``pyproject.toml`` whose tests need it is in ``tests/_helpers.EXTRA_MODULES`` (so its tests can skip naming it),
and the skip reason names the extra and its ``pip install`` line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import _helpers
from _helpers import EXTRA_MODULES, extra_test_files, missing_extra, requires_extra, skip_without_extra

REPO = Path(__file__).resolve().parent.parent
#: Extras no CPU test needs: the test tooling itself, CUDA vLLM, the MLflow UI server, mutation testing.
NOT_TESTED = {"test", "vllm", "mlflow-ui", "mutation"}


def test_every_extra_is_known_to_the_skip_helper():
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras - NOT_TESTED == set(EXTRA_MODULES), (extras - NOT_TESTED) ^ set(EXTRA_MODULES)


def test_a_missing_extra_skips_naming_it_and_its_install_line(monkeypatch):
    monkeypatch.setitem(EXTRA_MODULES, "fake-extra", ("json", "no_such_module_for_runner_tests"))
    monkeypatch.delenv("RUNNER_REQUIRE_EXTRAS", raising=False)
    want = ('needs the fake-extra extra (no_such_module_for_runner_tests is not installed); fix: pip install -e '
            '".[fake-extra]"')
    assert missing_extra("fake-extra") == want
    mark = requires_extra("fake-extra")
    assert mark.args == (True,) and mark.kwargs["reason"] == want
    with pytest.raises(pytest.skip.Exception, match=r"needs the fake-extra extra"):
        skip_without_extra("fake-extra")
    monkeypatch.setitem(EXTRA_MODULES, "fake-extra", ("json",))
    assert missing_extra("fake-extra") is None and requires_extra("fake-extra").args == (False,)


def test_ci_requires_the_extras_it_installed(monkeypatch):
    """``RUNNER_REQUIRE_EXTRAS=1`` (``.ci/run``'s full pass): a missing extra does not skip (the test runs and fails
    on it), so an extra that did not install is not a silent skip."""
    monkeypatch.setitem(EXTRA_MODULES, "fake-extra", ("no_such_module_for_runner_tests",))
    monkeypatch.setenv("RUNNER_REQUIRE_EXTRAS", "1")
    assert requires_extra("fake-extra").args == (False,)
    skip_without_extra("fake-extra")  # no skip
    assert "RUNNER_REQUIRE_EXTRAS=1" in (REPO / ".ci" / "run").read_text()


def test_the_quick_start_pass_runs_every_file_that_names_an_extra():
    files = {p.name for p in extra_test_files()}
    assert {"test_lora.py", "test_cache_calibration.py", "test_validate.py", "test_tracking.py", "test_scale.py",
            "test_outputs.py", "test_fp8_torchao.py", "test_wan22.py", "test_registry_requirements.py",
            "test_entry_point_consoles.py"} <= files
    assert "test_toy_shapes.py" not in files and _helpers.REPO_ROOT == REPO
