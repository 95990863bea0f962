"""Shared fixtures: Hydra composition over ``conf/``, one embedded-model cache per session, and a helper that
runs the real pipeline (``runner.app.execute.run``) into a temporary run dir and reads back what it wrote."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
# shared/ sits beside the project's root (CI lays a copy there); RUNNER_SHARED_DIR points elsewhere.
SHARED_DIR = Path(os.environ.get("RUNNER_SHARED_DIR", REPO_ROOT.parent / "shared"))
CASES_DIR = SHARED_DIR / "cases"


@pytest.fixture
def case_file() -> Callable[[str], Path]:
    """``case_file(name)``: path of a case in ``shared/cases``; skips when shared/ is not beside the checkout."""

    def _case(name: str) -> Path:
        path = CASES_DIR / name
        if not path.is_file():
            pytest.skip(f"{path} not found (shared/ must sit beside the repo, or set RUNNER_SHARED_DIR)")
        return path

    return _case


@pytest.fixture
def write_jsonl(tmp_path) -> Callable[..., Path]:
    """``write_jsonl(rows, name="rows.jsonl")``: one JSON object per line, in ``tmp_path``."""

    def _write(rows: Iterable[Dict[str, Any]], name: str = "rows.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path

    return _write


@pytest.fixture(scope="session", autouse=True)
def runner_cache(tmp_path_factory) -> Path:
    """One embedded-model cache for the whole session (in-process runs and subprocesses both read
    ``RUNNER_CACHE``), so tiny_flux is created once and never lands in the user's ~/.cache. Also puts the repo
    root first on ``PYTHONPATH``, for every subprocess the tests start."""
    cache = tmp_path_factory.mktemp("runner_cache")
    with pytest.MonkeyPatch.context() as mp:
        # ``python -m runner`` subprocesses import the checkout under test, not whatever ``runner`` the environment
        # has installed (an editable install of another checkout, a wheel): the repo root goes first on their path
        mp.setenv("PYTHONPATH", os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
        mp.setenv("RUNNER_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield cache


def with_test_model(overrides: Iterable[str]) -> List[str]:
    """Most tests exercise the loop on ``tiny_flux`` (random weights, 128 px, the 18 builtin prompts); the trained
    default ``toy_shapes`` has its own tests (test_toy_shapes.py). An explicit ``model=`` wins."""
    overrides = list(overrides)
    if not any(o.split("=")[0].lstrip("+~") == "model" for o in overrides):
        overrides.insert(0, "model=tiny_flux")
    return overrides


@pytest.fixture(scope="session")
def compose() -> Callable[..., Any]:
    """``compose(overrides, return_hydra_config=False)``: the run config as ``python -m runner`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from runner.core.schema import register_configs

    register_configs()

    def _compose(overrides: Iterable[str] = (), return_hydra_config: bool = False, test_model: bool = True):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="test"):
            return hydra_compose("config", overrides=with_test_model(overrides) if test_model else list(overrides),
                                 return_hydra_config=return_hydra_config)

    return _compose


@dataclass
class RunResult:
    """What one run left in its run dir."""

    run_dir: Path
    code: int
    overrides: List[str]
    cfg: Any = None

    @property
    def manifest(self) -> Dict[str, Any]:
        return json.loads((self.run_dir / "manifest.json").read_text())

    @property
    def items(self) -> List[Dict[str, Any]]:
        lines = (self.run_dir / "items.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def pngs(self) -> Dict[str, bytes]:
        """Item key -> PNG bytes on disk, for every ok row of items.jsonl."""
        return {it["key"]: (self.run_dir / it["file"]).read_bytes() for it in self.items if it["status"] == "ok"}


@pytest.fixture(scope="session")
def execute(compose) -> Callable[..., RunResult]:
    """``execute(overrides, run_dir)``: compose (on ``platform=cpu``) and run the real pipeline into ``run_dir``."""
    from runner.app.execute import run

    def _execute(overrides: Iterable[str], run_dir: Path) -> RunResult:
        overrides = ["platform=cpu", *overrides]
        cfg = compose(overrides)
        code = run(cfg, run_dir, overrides)
        return RunResult(run_dir=Path(run_dir), code=code, overrides=overrides, cfg=cfg)

    return _execute


@pytest.fixture
def run_job(execute, tmp_path) -> Callable[..., RunResult]:
    """``run_job(overrides, name=None)``: ``execute`` into ``tmp_path/<name>`` (a new dir per call)."""
    counter = iter(range(1000))

    def _run(overrides: Iterable[str] = (), name: Optional[str] = None) -> RunResult:
        return execute(overrides, tmp_path / (name or f"run{next(counter)}"))

    return _run


@pytest.fixture(scope="session")
def tiny_snapshot(compose, runner_cache, tmp_path_factory) -> Path:
    """The tiny_flux pipeline written by ``save_pretrained`` to a plain directory: a diffusers snapshot as a
    user would download one, for ``model=flux model.path=<dir>``."""
    from diffusers import FluxPipeline
    from omegaconf import OmegaConf

    from models.flux import embedded_snapshot

    cfg = compose([])
    arch = OmegaConf.to_container(cfg.model.architecture, resolve=True)
    src = embedded_snapshot(cfg.model.name, arch, None)
    dst = tmp_path_factory.mktemp("snapshot") / "tiny-flux-snapshot"
    pipe = FluxPipeline.from_pretrained(src, local_files_only=True)
    pipe.save_pretrained(dst, safe_serialization=True)
    return dst


@pytest.fixture
def subprocess_env(runner_cache) -> Dict[str, str]:
    """Environment for ``python -m runner`` subprocesses: the session cache, offline, the repo root first on
    ``PYTHONPATH`` (:func:`runner_cache`)."""
    env = dict(os.environ)
    env.update(RUNNER_CACHE=str(runner_cache), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    return env


#: The ``compile=regional`` run :func:`cold_compile` makes (tests/test_compile_cache.py reruns it warm).
COLD_COMPILE_ARGS = ["model=tiny_flux", "dataset.limit=2", "batch_size=2", "compile=regional", "evidence.profile=false"]


@pytest.fixture(scope="session")
def cold_compile(runner_cache, tmp_path_factory):
    """One cold ``compile=regional`` process (tiny_flux, 2 items), shared by the tests that read it (the compile
    cache's miss in tests/test_compile_cache.py, the warm-up console in tests/test_console.py): a cold CPU compile
    takes most of a minute. ``(output, run_dir, cache_dir)``; the run must exit 0."""
    from _helpers import cli

    tmp = tmp_path_factory.mktemp("cold_compile")
    env = dict(os.environ, RUNNER_CACHE=str(runner_cache), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    cache, run_dir = tmp / "cache", tmp / "cold"
    p = cli([*COLD_COMPILE_ARGS, f"cache_dir={cache}", f"hydra.run.dir={run_dir}"], env, tmp, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p.stdout + p.stderr, run_dir, cache


# ------------------------------------------------------------------------------------- hardware markers
# Tests state their hardware needs with markers; a CI job selects with -m (scripts/ci/). A test collected on the
# wrong hardware is skipped with the reason, never silently passed.
HARDWARE_MARKERS = {"cpu": "runs on a CPU alone; never skipped", "cuda": "needs a CUDA device",
                    "sm90": "needs a compute capability 9.x GPU (Hopper: H100/H200); implies cuda",
                    "sm100": "needs a compute capability 10.x GPU (Blackwell B200/GB200); implies cuda",
                    "cards_2": "needs at least 2 CUDA devices; implies cuda"}


def pytest_configure(config):
    for name, doc in HARDWARE_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def _cuda_facts():
    try:
        import torch
    except ImportError:
        return 0, None, "no torch"
    if not torch.cuda.is_available():
        return 0, None, "no CUDA device"
    return torch.cuda.device_count(), tuple(torch.cuda.get_device_capability(0)), torch.cuda.get_device_name(0)


@pytest.hookimpl(tryfirst=True)  # before pytest's -m deselection, so sm90/sm100/cards_2 count as cuda
def pytest_collection_modifyitems(config, items):
    facts = None
    for item in items:
        marks = {m.name for m in item.iter_markers()} & set(HARDWARE_MARKERS)
        if not marks - {"cpu"}:
            continue
        if marks & {"sm90", "sm100", "cards_2"} and "cuda" not in marks:
            item.add_marker(pytest.mark.cuda)
        facts = facts or _cuda_facts()
        n, cap, name = facts
        here = f"{name} sm{cap[0]}{cap[1]}" if cap else name
        if n == 0:
            reason = "needs a CUDA device; none is visible on this machine (torch.cuda.is_available() is False)"
        elif "sm90" in marks and cap[0] != 9:
            reason = f"needs sm90 (Hopper); device 0 is {here}"
        elif "sm100" in marks and cap[0] != 10:
            reason = f"needs sm100 (Blackwell); device 0 is {here}"
        elif "cards_2" in marks and n < 2:
            reason = f"needs 2 CUDA devices; {n} visible"
        else:
            continue
        item.add_marker(pytest.mark.skip(reason=reason))


# ------------------------------------------------------------------------------------- unmarked extras
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed because an optional extra is missing here, without ``requires_extra`` /
    ``skip_without_extra`` (tests/_helpers.py): its report says so and how to mark it. The quick start's
    environment (README.md) has no extra, and CI runs these files there (.ci/run); the failure stays a failure."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.failed or call.excinfo is None:
        return
    from _helpers import EXTRA_MODULES, missing_extra

    text = str(call.excinfo.value)
    for extra, modules in EXTRA_MODULES.items():
        if missing_extra(extra) and any(m.split(".")[0] in text or m.upper() in text for m in modules):
            report.sections.append(("unmarked optional extra", (
                f"{item.nodeid} failed where the {extra} extra is not installed ({text[:200]!r}); a test of an "
                f"extra skips naming it: decorate it with @requires_extra({extra!r}) or call "
                f"skip_without_extra({extra!r}) in the helper it runs through (tests/_helpers.py)")))
