"""The error contract (issue #15): one base class, ``runner.core.errors.RunnerError``, carries the exit code, the
job outcome and the fix; every exception class of the project derives from it; the exit code and outcome come from
the exception's attributes; no user mistake ends in a traceback (``python -m runner`` and the other CLIs)."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import EXTRA_MODULES
from runner.core import errors
from runner.core.errors import EvidenceMismatchError, RefusedError, RunnerError, UserInputError

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runner", "models", "kernels")

pytestmark = pytest.mark.cpu


# ------------------------------------------------------------------------------------------ the class scan


def _defined_classes():
    """``(module name, class name, base names as written, nested)`` of every class under runner/, models/,
    runner/kernels/ (read from the source, so a class nobody imports is found too)."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO_ROOT / pkg).rglob("*.py")):
            mod = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__")
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b) for b in node.bases]
                    out.append((mod, node.name, bases, id(node) not in top))
    return out


def test_every_exception_class_derives_from_runner_error():
    """Every class of the project that is an exception derives from RunnerError. A module that imports an optional
    extra's package at its top (``runner.app.slurm_launcher``: submitit) cannot be imported where that extra is
    missing (the quick start's venv): its error classes are then checked on their source (a base that is a
    ``runner.core.errors`` RunnerError), its other classes skipped."""
    found, bad, unimported = set(), [], set()
    for mod, name, bases, nested in _defined_classes():
        looks_like_error = any(b.split(".")[-1].endswith(("Error", "Exception")) for b in bases)
        if nested:
            if looks_like_error:
                bad.append(f"{mod}.{name}: an exception class defined inside a function (define it at module level, "
                           "deriving from runner.core.errors.RunnerError)")
            continue
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as e:  # a module of an optional extra (launcher=slurm: submitit) not installed
            extra = next((x for x, mods in EXTRA_MODULES.items() if str(e.name).split(".")[0] in
                          {m.split(".")[0] for m in mods}), None)
            if extra is None:
                raise
            unimported.add((mod, extra))
            if looks_like_error:  # checked on its source: a base that is one of runner.core.errors' RunnerErrors
                known = [getattr(errors, b.split(".")[-1], None) for b in bases]
                if any(isinstance(k, type) and issubclass(k, RunnerError) for k in known):
                    found.add(name)
                else:
                    bad.append(f"{mod}.{name}{tuple(bases)}: not a runner.core.errors class's subclass (read from "
                               f"the source: the module needs the {extra} extra)")
            continue
        cls = getattr(module, name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            assert not looks_like_error, f"{mod}.{name} has bases {bases} but is not an exception"
            continue
        if issubclass(cls, Warning):  # warnings are not errors (none exist today)
            continue
        found.add(name)
        if not issubclass(cls, RunnerError):
            bad.append(f"{mod}.{name}{tuple(bases)} does not derive from runner.core.errors.RunnerError")
    assert not bad, "\n".join(bad)
    # the scan really saw the classes (it would pass vacuously on an empty walk)
    assert {"DatasetError", "ConfigValueError", "EvidenceError", "MisplacedBackendKeyError", "StageConflictError",
            "PlatformError", "ResumeConflictError", "ARConfigError", "ModelPathError", "VLLMConfigError",
            "BackendError", "UnknownBackendError", "BackendUnavailableError", "BackendSpecError",
            "AttentionWiringError", "RunnerError", "UserInputError", "RefusedError",
            "EvidenceMismatchError"} <= found, found


def test_errors_module_imports_nothing_from_the_project():
    tree = ast.parse((REPO_ROOT / "runner" / "core" / "errors.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        for n in names:
            assert n.split(".")[0] not in PACKAGES, f"runner/core/errors.py imports {n}"


def _cls(path: str):
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


# class -> (outcome, exit code, builtin base kept for callers that catch it)
CONTRACT = {
    "runner.core.dataset.DatasetError": ("invalid", 2, ValueError),
    "runner.core.errors.ConfigValueError": ("invalid", 2, ValueError),
    "runner.core.errors.EvidenceError": ("evidence_mismatch", 3, RuntimeError),
    "runner.core.resolve.MisplacedBackendKeyError": ("invalid", 2, ValueError),
    "runner.core.resolve.StageConflictError": ("invalid", 2, ValueError),
    "runner.core.platform.PlatformError": ("invalid", 2, RuntimeError),
    "runner.core.resume.ResumeConflictError": ("invalid", 2, ValueError),
    "models.vllm.rows.ARConfigError": ("invalid", 2, ValueError),
    "models.flux.ModelPathError": ("invalid", 2, ValueError),
    "models.vllm.names.VLLMConfigError": ("invalid", 2, ValueError),
    "runner.kernels.registry.BackendError": ("invalid", 2, ValueError),
    "runner.kernels.registry.UnknownBackendError": ("invalid", 2, ValueError),
    "runner.kernels.registry.BackendUnavailableError": ("refused", 2, ValueError),
    "runner.kernels.registry.BackendSpecError": ("invalid", 2, ValueError),
    "runner.kernels.attention.AttentionWiringError": ("refused", 2, RuntimeError),
    "runner.tools.report.RunDirError": ("invalid", 2, FileNotFoundError),
    "runner.tools.report.UnknownReferenceError": ("invalid", 2, KeyError),
    "runner.tools.matrix.GridError": ("invalid", 2, ValueError),
    "runner.tools.repro.ReproInputError": ("invalid", 2, OSError),
    "runner.core.environment.EnvironmentVariableError": ("invalid", 2, ValueError),
    "runner.core.environment.OutputPathError": ("invalid", 2, OSError),
}


@pytest.mark.parametrize("path", sorted(CONTRACT))
def test_each_class_carries_its_outcome_and_exit_code(path):
    from runner.app.jobs import EXIT

    outcome, code, builtin = CONTRACT[path]
    cls = _cls(path)
    assert (cls.outcome, cls.exit_code) == (outcome, code)
    assert EXIT[cls.outcome] == cls.exit_code, "job_status outcome and exit code disagree with runner.app.jobs.EXIT"
    assert issubclass(cls, builtin), f"{path} no longer catchable as {builtin.__name__}"
    base = {"refused": RefusedError, "invalid": UserInputError, "evidence_mismatch": EvidenceMismatchError}[outcome]
    assert issubclass(cls, base)


def test_wiring_refusal_is_a_refusal_like_an_unavailable_backend():
    from runner.kernels.attention import AttentionWiringError
    from runner.kernels.registry import BackendUnavailableError

    assert issubclass(AttentionWiringError, BackendUnavailableError)
    assert AttentionWiringError.outcome == BackendUnavailableError.outcome == "refused"


def test_message_is_kept_and_a_separate_fix_is_appended_once():
    assert str(RunnerError("model.path='x' does not exist")) == "model.path='x' does not exist"
    e = UserInputError("dataset.limit=-1 is negative", fix="dataset.limit=null or >= 0")
    assert str(e) == "dataset.limit=-1 is negative; fix: dataset.limit=null or >= 0"
    assert e.fix == "dataset.limit=null or >= 0" and e.args == ("dataset.limit=-1 is negative",)
    e = UserInputError("x=1 is bad; fix: x=2", fix="x=2")
    assert str(e) == "x=1 is bad; fix: x=2", "the fix was appended to a message that already names it"
    assert RunnerError.fix is None and RunnerError("m").fix is None
    from runner.tools.report import UnknownReferenceError

    assert str(UnknownReferenceError("reference='a' names no job")) == "reference='a' names no job"  # not quoted


def test_errors_survive_pickling():
    """Ray ships a worker's exception to the driver by pickling it."""
    import pickle

    from runner.core.dataset import DatasetError

    e = pickle.loads(pickle.dumps(DatasetError(["rows.jsonl:2: field 'prompt' is empty", "rows.jsonl:3: bad"])))
    assert e.problems == ["rows.jsonl:2: field 'prompt' is empty", "rows.jsonl:3: bad"]
    assert str(e).startswith("2 problem(s) in the dataset:")
    e = pickle.loads(pickle.dumps(UserInputError("bad", fix="good")))
    assert str(e) == "bad; fix: good"


# ---------------------------------------------------------------------------------------- run_job outcomes


def _fake_gpu(monkeypatch, sm: int) -> None:
    """A CUDA GPU of compute capability ``sm`` with every optional kernel package installed (nothing loads)."""
    import models.flux as flux
    from runner.kernels import registry as reg
    from runner.app import run as run_module
    from runner.core.platform import PlatformInfo

    monkeypatch.setattr(reg, "has_symbol", lambda path: True)
    monkeypatch.setattr(run_module, "detect", lambda *a, **k: PlatformInfo(kind="cuda", device="cpu",
                                                                         capability=divmod(sm, 10)))

    def no(*a, **k):
        raise AssertionError("the model was created or loaded before the refusal")

    monkeypatch.setattr(flux.FluxEngine, "load_pipeline", no)
    monkeypatch.setattr(flux, "embedded_snapshot", no)


@pytest.mark.parametrize("sm,error_type", [(100, "AttentionWiringError"), (90, "BackendUnavailableError")])
def test_trtllm_request_is_refused_alike_on_blackwell_and_hopper(compose, tmp_path, monkeypatch, sm, error_type):
    """``backend.attention=trtllm`` on FLUX (head_dim 128): on sm100 the registry accepts it and the wiring plan
    refuses it, on sm90 the registry refuses it. Both are the same documented refusal: outcome refused, exit 2."""
    from runner.app.jobs import run_job

    _fake_gpu(monkeypatch, sm)
    ov = ["model=flux", "model.load_format=dummy", "backend.attention=trtllm", "dataset.limit=1"]
    cfg = compose(ov)
    code = run_job(cfg, tmp_path, ov, reraise=True)
    st = json.loads((tmp_path / "job_status.json").read_text())
    assert (code, st["exit_code"], st["outcome"], st["error_type"]) == (2, 2, "refused", error_type), st
    assert "TRTLLM_ATTN" in st["error"]
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["status"] == "refused" and man["error"]["type"] == error_type


class _OddRefusal(RunnerError):
    """Derives from the base alone: the outcome must come from its attributes, not from a list of classes."""

    outcome = "refused"
    exit_code = 2


class _OddMismatch(RunnerError):
    outcome = "evidence_mismatch"
    exit_code = 3


@pytest.mark.parametrize("exc,outcome,code,manifest", [
    (_OddRefusal("backend.linear=X cannot run here"), "refused", 2, "refused"),
    (UserInputError("seed=-1 must be >= 0"), "invalid", 2, "invalid"),
    (_OddMismatch("attention: requested A, B ran"), "evidence_mismatch", 3, None),
])
def test_run_job_takes_outcome_and_exit_code_from_the_exception(compose, tmp_path, monkeypatch, caplog, exc, outcome,
                                                                 code, manifest):
    from runner.app import execute
    from runner.app.jobs import run_job

    def raising(*a, **k):
        raise exc

    monkeypatch.setattr(execute, "run", raising)
    with caplog.at_level("ERROR", logger="runner"):
        got = run_job(compose(["dataset.limit=1"]), tmp_path, [], reraise=True)  # reraise: a crash would raise
    st = json.loads((tmp_path / "job_status.json").read_text())
    assert (got, st["exit_code"], st["outcome"], st["error_type"]) == (code, code, outcome, type(exc).__name__)
    assert f"{type(exc).__name__}: {exc}" in caplog.text
    assert "Traceback" not in caplog.text
    man = tmp_path / "manifest.json"
    if manifest is None:  # a mismatch is found after the run: no startup manifest is made up for it
        assert not man.exists()
    else:
        assert json.loads(man.read_text())["status"] == manifest


def test_run_job_still_reports_a_non_user_error_as_a_crash(compose, tmp_path, monkeypatch):
    from runner.app import execute
    from runner.app.jobs import run_job

    def raising(*a, **k):
        raise ValueError("an internal bug, not a user mistake")

    monkeypatch.setattr(execute, "run", raising)
    with pytest.raises(ValueError):
        run_job(compose(["dataset.limit=1"]), tmp_path, [], reraise=True)
    st = json.loads((tmp_path / "job_status.json").read_text())
    assert (st["exit_code"], st["outcome"]) == (1, "crashed")


# ------------------------------------------------------------------------------------------------ the CLIs


def _no_traceback(p: subprocess.CompletedProcess) -> str:
    text = p.stdout + p.stderr
    assert "Traceback" not in text, text[-3000:]
    return text


def test_cli_user_mistake_exits_2_without_traceback(tmp_path, subprocess_env):
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "runner", "model=tiny_flux", "dataset=jsonl",
                        f"dataset.path={tmp_path / 'nonexistent.jsonl'}", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=600)
    text = _no_traceback(p)
    assert p.returncode == 2, text[-3000:]
    assert "DatasetError: " in text and "nonexistent.jsonl" in text and "fix:" in text
    assert json.loads((run_dir / "job_status.json").read_text())["outcome"] == "invalid"


def test_multirun_user_mistake_is_recorded_without_traceback(tmp_path, subprocess_env):
    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "runner", "-m", "model=tiny_flux", "dataset=jsonl",
                        f"dataset.path={tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}", f"hydra.sweep.dir={sweep}"],
                       cwd=tmp_path, env=subprocess_env, capture_output=True, text=True, timeout=600)
    text = _no_traceback(p)
    assert p.returncode == 1, text[-3000:]  # the sweep rule: an invalid job fails the sweep
    outcomes = [json.loads((sweep / j / "job_status.json").read_text())["outcome"] for j in ("0", "1")]
    assert outcomes == ["invalid", "invalid"]


@pytest.mark.parametrize("module,args,error_type", [
    ("runner.tools.report", ["{empty}"], "RunDirError"),
    ("runner.tools.report", ["{run}", "--reference", "nope"], "UnknownReferenceError"),
    ("runner.tools.matrix", ["{empty}"], "RunDirError"),
    ("runner.tools.matrix", ["{run}", "--grid", "colour=red"], "GridError"),
    ("runner.tools.repro", ["{empty}"], "ReproInputError"),
    ("runner.tools.repro", ["{broken}"], "ReproInputError"),
])
def test_tool_cli_user_mistake_exits_2_with_the_error_named(tmp_path, capsys, module, args, error_type):
    dirs = {k: tmp_path / k for k in ("empty", "run", "broken")}
    for d in dirs.values():
        d.mkdir()
    (dirs["run"] / "job_status.json").write_text(json.dumps({"exit_code": 2, "outcome": "invalid"}))
    (dirs["broken"] / "manifest.json").write_text("{not json")
    main = importlib.import_module(module).main
    assert main([a.format(**dirs) for a in args]) == 2
    err = capsys.readouterr().err
    assert f"{error_type}: " in err and "fix:" in err, err
