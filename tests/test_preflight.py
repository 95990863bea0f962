"""A row-level refusal comes before the libraries load and leaves no run dir (issue #38): a missing input file is
refused by ``runner.app.preflight`` before torch, diffusers, transformers or vLLM is imported, with the engine's own
message; a refused run in its default dir removes that dir (74 dirs after an afternoon of trying, 45 refusals), a
dir the user named keeps its ``job_status.json``/``manifest.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from _helpers import compose, execute  # noqa: E402
from runner.core.errors import DatasetError, RunnerError

REPO = Path(__file__).resolve().parent.parent


def _rows(tmp_path: Path, image: str) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "a red circle", "image": image}) + "\n"
                    + json.dumps({"id": "b", "prompt": "a blue square", "image": "sub/also_missing.png"}) + "\n")
    return rows


def test_missing_input_is_refused_before_any_library_import_and_leaves_no_run_dir(subprocess_env, tmp_path):
    rows = _rows(tmp_path, "missing.png")
    env = {k: v for k, v in subprocess_env.items() if k != "RUNNER_VERBOSE"}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", "model.task=image_to_image",
                        "dataset=jsonl", f"dataset.path={rows}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert (f"{rows}:1: field 'image' = 'missing.png' does not exist (resolved to {tmp_path / 'missing.png'}); fix: "
            "give the path of an existing file") in out, out[-3000:]
    assert f"{rows}:2: field 'image' = 'sub/also_missing.png' does not exist" in out  # every row at once
    imported = {x.rsplit("|", 1)[-1].strip() for x in p.stderr.splitlines() if x.startswith("import time:")}
    assert not imported & {"torch", "diffusers", "transformers", "vllm", "PIL"}, imported & {"torch", "diffusers"}
    assert "hydra" in imported  # the importtime listing was read
    runs = tmp_path / "outputs" / "runs"
    assert not list(runs.glob("*/*")) and not list(runs.glob("*")), list(runs.rglob("*"))


def test_a_named_run_dir_keeps_the_refusal_record(subprocess_env, tmp_path):
    rows = _rows(tmp_path, "missing.png")
    run = tmp_path / "named"
    p = subprocess.run([sys.executable, "-m", "runner", "model.task=image_to_image", "dataset=jsonl",
                        f"dataset.path={rows}", f"hydra.run.dir={run}"], cwd=tmp_path, env=subprocess_env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    status = json.loads((run / "job_status.json").read_text())
    assert status["outcome"] == "invalid" and status["error_type"] == "DatasetError"
    assert json.loads((run / "manifest.json").read_text())["status"] == "invalid"


def test_the_early_message_is_the_engines_own(tmp_path):
    """The same rows through the engine's check (in-process, no preflight) give the same problems, so the early
    refusal is the engine's refusal moved forward, not a second rule."""
    from runner.app.preflight import missing_inputs

    rows = _rows(tmp_path, str(tmp_path / "missing.png"))
    over = ["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl", f"dataset.path={rows}"]
    early = missing_inputs(compose(over))
    r = execute(tmp_path / "run", over, catch=(RunnerError,))
    assert isinstance(r.error, DatasetError), r
    assert len(early) == 2 and early == list(r.error.problems), (early, r.error.problems)


def test_rows_whose_files_exist_or_tasks_without_inputs_pass_the_early_check(tmp_path):
    from PIL import Image

    from runner.app.preflight import missing_inputs

    Image.new("RGB", (64, 64), "white").save(tmp_path / "there.png")
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (64, 64), "white").save(tmp_path / "sub" / "also_missing.png")
    rows = _rows(tmp_path, "there.png")
    assert missing_inputs(compose(["model=toy_shapes", "model.task=image_to_image", "dataset=jsonl",
                                   f"dataset.path={rows}"])) == []
    rows = _rows(tmp_path / "sub", "nope.png")  # rows.jsonl in sub/: 'nope.png' missing, sub/sub/... missing too
    assert missing_inputs(compose(["model=toy_shapes", "dataset=jsonl", f"dataset.path={rows}"])) == []  # task null
    assert len(missing_inputs(compose(["model=toy_shapes", "model.task=inpaint", "dataset=jsonl",
                                       f"dataset.path={rows}", "dataset.limit=1"]))) == 1  # the limit's rows only
    assert os.path.isfile(REPO / "benchmarks" / "refusal_time.py")


def test_an_engine_refusal_in_the_default_dir_leaves_no_dir_either(subprocess_env, tmp_path):
    """Not only the early row check: any startup refusal (here the model's task check, after the engine loaded its
    modules) of a run in its default dir leaves nothing under outputs/runs."""
    p = subprocess.run([sys.executable, "-m", "runner", "model.task=image_to_video"], cwd=tmp_path, env=subprocess_env,
                       capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and "the flux family has no pipeline for it" in out, out[-3000:]
    assert "its run dir" in out and "is removed" in out
    assert not list((tmp_path / "outputs" / "runs").rglob("*")), list((tmp_path / "outputs").rglob("*"))
