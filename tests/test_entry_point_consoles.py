"""Every entry point's console is the runner's own (issue #38): ``python -m runner`` on toy_shapes (plain, and with
each installed extra doing its work: torchao's int8 weight-only, a LoRA adapter through peft, cache-dit's DBCache,
the MLflow tracker; the Ray launcher, torchrun and vLLM runs are tests/test_console.py's, which check the same),
``runner.score``, ``runner.gate``, ``runner.report``, ``runner.repro``, ``runner.export`` (parquet and
webdataset), ``runner.validate``, ``runner.matrix`` and ``python -m runner ... --plan``, each in a fresh
subprocess with the console's defaults, print no library warning and no traceback line. An extra that is not
installed drops its run (the quick start's environment); ``.ci/run`` installs them all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest

from _helpers import cli, console_lines, library_noise, missing_extra, skip_without_extra, tiny_clip  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ADAPTER = REPO / "models" / "toy_shapes" / "lora" / "all_blue.safetensors"

#: ``python -m runner`` runs: (extra needed or None, overrides beyond toy_shapes' two captions).
#: The plain run (no extra) is :func:`plain_run`'s, which the tools' test reads too.
RUNS: Dict[str, tuple] = {
    "torchao_int8wo": ("torchao", ["model.quantization.transformer=int8wo"]),
    "lora": ("lora", [f"model.lora=[{{path:{ADAPTER}}}]"]),
    # toy_shapes has 5 double-stream blocks: DBCache's default Fn_compute_blocks=8 fails every item (not refused at
    # startup: see the report of issue #38), so the first 2 blocks decide
    "cache_dit": ("cache-dit", ["cache.method=dbcache", "cache.fn_compute_blocks=2"]),
    # the tracker logs the finished run into mlruns/ of the working dir (the test's tmp_path)
    "mlflow": ("mlflow", ["tracker=mlflow"]),
}


def _noise(text: str) -> List[str]:
    return library_noise(text)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, runner_cache):
    """One plain toy_shapes run (2 items, no extra): its console is checked, and the tools read its dir.
    ``(run dir, console)``."""
    import os

    root = tmp_path_factory.mktemp("entry_points")
    p = cli(["dataset.limit=2", f"hydra.run.dir={root / 'run'}"], dict(os.environ, PYTHONUNBUFFERED="1"), root)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return root / "run", p.stdout + p.stderr


@pytest.fixture(scope="module")
def run_dir(plain_run) -> Path:
    """The plain run's dir, which the tools read."""
    return plain_run[0]


def test_runner_console_of_a_plain_run_has_no_library_line(plain_run):
    out = plain_run[1]
    assert not _noise(out), _noise(out)
    assert any("run completed: 2 ok" in x for x in console_lines(out)), out[-2000:]


@pytest.mark.parametrize("name", list(RUNS))
def test_runner_console_with_each_installed_extra_has_no_library_line(name, subprocess_env, tmp_path):
    extra, overrides = RUNS[name]
    if extra:
        skip_without_extra(extra)
    p = cli(["dataset.limit=2", *overrides, f"hydra.run.dir={tmp_path / 'run'}"], subprocess_env, tmp_path)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert not _noise(out), _noise(out)
    assert any("run completed: 2 ok" in x for x in console_lines(out)), out[-2000:]


def _tool(module: str, args: List[str], cwd: Path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for k in ("RUNNER_VERBOSE", "KINETO_LOG_LEVEL", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL",
              "VLLM_CONFIGURE_LOGGING"):
        env.pop(k, None)  # the defaults under test
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_tool_consoles_have_no_library_line(run_dir, tmp_path):
    """score (a tiny CLIP, and the refusal without a model, whose fix names --model), gate, report, repro, export
    (parquet where the export extra is installed, else the in-toto statement) on one run dir."""
    clip = tiny_clip(tmp_path / "clip")
    outs = {}
    p = _tool("runner.score", [run_dir, "--metrics", "clip_score"], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "fix: --model clip_score=<path>" in p.stderr and "metrics.models" not in p.stderr, p.stderr
    outs["score refusal"] = p
    outs["score"] = _tool("runner.score", [run_dir, "--metrics", "clip_score", "--model", f"clip_score={clip}"],
                          tmp_path)
    outs["report"] = _tool("runner.report", [run_dir, "--out", tmp_path / "report.html"], tmp_path)
    outs["gate"] = _tool("runner.gate", [run_dir], tmp_path)
    outs["repro"] = _tool("runner.repro", [run_dir, "--out", tmp_path / "repro"], tmp_path)
    fmt = "parquet" if missing_extra("export") is None else "in-toto"
    outs["export"] = _tool("runner.export", [run_dir, "--format", fmt, "--out", tmp_path / "export"], tmp_path)
    if missing_extra("export") is None:
        outs["export webdataset"] = _tool("runner.export", [run_dir, "--format", "webdataset", "--out",
                                                            tmp_path / "wds"], tmp_path)
    if missing_extra("validate") is None:
        outs["validate"] = _tool("runner.validate", [run_dir], tmp_path)
    outs["matrix"] = _tool("runner.matrix", [run_dir], tmp_path)
    # the support matrix's check of the committed page (it imports every registry: torchao's where installed)
    outs["support_matrix"] = _tool("runner.support_matrix", ["--check", "--root", REPO], tmp_path)
    # plan mode (`--plan`): the memory plan of the composed run, nothing loaded
    outs["plan"] = _tool("runner", ["dataset.limit=2", "memory.offload=auto", "platform=cpu", "--plan"], tmp_path)
    for name, p in outs.items():
        out = p.stdout + p.stderr
        if name != "score refusal":
            assert p.returncode == 0, f"{name}: {out[-3000:]}"
        assert not _noise(out), (name, _noise(out))
    assert "clip_score" in json.loads(outs["score"].stdout)["summary"]
    assert "plan: none" in outs["plan"].stdout and "validated" in outs["matrix"].stdout  # each did its work
    assert "validate" not in outs or f"{run_dir}: valid" in outs["validate"].stdout
