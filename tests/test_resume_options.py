"""``run.resume`` and ``output.dir`` together (``runner.app.checks.check_run_dir_keys``): a run resumes in
``run.resume``'s dir, so an ``output.dir`` naming another dir was ignored without a word (its dir never created).
Both are refused at startup naming both values and the fix, unless they name the same dir."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runner.app.checks import check_run_values
from runner.core.errors import ConfigValueError


def test_a_different_output_dir_beside_run_resume_is_refused_naming_both(compose, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with pytest.raises(ConfigValueError) as e:
        check_run_values(compose([f"run.resume={a}", f"output.dir={b}"]))
    msg = str(e.value)
    assert f"run.resume={str(a)!r}" in msg and f"output.dir={str(b)!r}" in msg and "fix: drop output.dir" in msg
    assert e.value.exit_code == 2
    with pytest.raises(ConfigValueError, match="output.dir='s3://bucket/x'"):
        check_run_values(compose([f"run.resume={a}", "output.dir=s3://bucket/x"]))


def test_the_same_dir_named_twice_is_accepted(compose, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_run_values(compose([f"run.resume={tmp_path / 'a'}", f"output.dir={tmp_path / 'a'}/"]))
    check_run_values(compose([f"run.resume={tmp_path / 'a'}", "output.dir=a"]))  # relative, the same dir
    check_run_values(compose([f"run.resume={tmp_path / 'a'}"]))
    check_run_values(compose([f"output.dir={tmp_path / 'a'}"]))


def test_cli_resume_into_one_dir_with_output_dir_another_is_refused(tmp_path, subprocess_env):
    a, b = tmp_path / "qs", tmp_path / "other"
    first = subprocess.run([sys.executable, "-m", "runner", "dataset.limit=1", f"output.dir={a}"], cwd=tmp_path,
                           env=subprocess_env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    journal = (a / "items.jsonl").read_bytes()
    p = subprocess.run([sys.executable, "-m", "runner", f"run.resume={a}", f"output.dir={b}"], cwd=tmp_path,
                       env=subprocess_env, capture_output=True, text=True, timeout=600)
    text = p.stdout + p.stderr
    assert p.returncode == 2 and "Traceback" not in text, text[-3000:]
    assert f"run.resume={str(a)!r} and output.dir={str(b)!r}" in text, text[-3000:]
    assert not b.exists() and (a / "items.jsonl").read_bytes() == journal
