"""``tracker=mlflow`` (issue #20): a finished run is logged through the real ``mlflow`` library into a file store
(``mlruns/``): params, metrics, tags and the manifest/items/metadata artifacts, read back with ``MlflowClient``;
a missing ``mlflow`` is refused at startup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import import_extra  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def _client(uri: str):
    import_extra("mlflow", "mlflow")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def test_mlflow_logs_params_metrics_tags_and_artifacts(compose, tmp_path):
    import_extra("mlflow", "mlflow")
    from runner.app.jobs import run_job

    store = (tmp_path / "store").as_uri()
    ov = ["platform=cpu", "model=toy_shapes", "dataset.limit=2", "tracker=mlflow", f"tracker.uri={store}",
          "tracker.experiment=issue20", "tracker.run_name=first"]
    run_dir = tmp_path / "run"
    assert run_job(compose(ov), run_dir, ov, reraise=True) == 0
    m = json.loads((run_dir / "manifest.json").read_text())
    c = _client(store)
    exp = c.get_experiment_by_name("issue20")
    (run,) = c.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    assert run.data.tags["runner.run_id"] == m["run_id"] and run.data.tags["runner.status"] == "completed"
    assert run.data.tags["runner.exit_code"] == "0" and run.data.tags["runner.run_dir"] == str(run_dir.resolve())
    p = run.data.params
    assert (p["model"], p["dataset.format"], p["seed"], p["batch_size"]) == ("toy_shapes", "builtin", "0", "1")
    assert p["backend.denoise.linear"] == "TORCH" and "tracker=mlflow" in p["overrides"]
    mt = run.data.metrics
    assert mt["counts.ok"] == 2 and mt["counts.failed"] == 0 and mt["timing.wall_s"] > 0
    assert mt["accuracy.all"] == m["accuracy"]["all"] == 1.0 and mt["accuracy.color"] == 1.0
    arts = {a.path for a in c.list_artifacts(run.info.run_id)} | {a.path for a in c.list_artifacts(run.info.run_id, "images")}
    assert {"manifest.json", "items.jsonl", "images/metadata.jsonl"} <= arts
    local = Path(c.download_artifacts(run.info.run_id, "manifest.json", str(tmp_path / "dl")))
    assert json.loads(local.read_text())["run_id"] == m["run_id"]


def test_default_store_is_mlruns_in_the_working_directory(subprocess_env, tmp_path):
    import_extra("mlflow", "mlflow")
    env = dict(subprocess_env, PYTHONPATH=str(REPO))
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    p = subprocess.run([sys.executable, "-m", "runner", "tracker=mlflow", "dataset.limit=1",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    c = _client((tmp_path / "mlruns").as_uri())
    (run,) = c.search_runs([c.get_experiment_by_name("runner").experiment_id])
    assert run.data.metrics["counts.ok"] == 1 and run.info.run_name == "run"


def test_missing_mlflow_is_refused_at_startup(compose, tmp_path, monkeypatch):
    from runner.app.execute import run
    from runner.app.tracking import TrackerError

    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow -> ImportError
    ov = ["platform=cpu", "model=toy_shapes", "dataset.limit=1", "tracker=mlflow"]
    with pytest.raises(TrackerError, match=r'fix: pip install -e "\.\[mlflow\]"  \(mlflow-skinny>=2\.10; the skinny '
                       r"client is enough\), or tracker=none"):
        run(compose(ov), tmp_path / "run", ov)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_the_documented_mlflow_ui_path_names_the_server_extra_and_the_file_store_switch():
    """``mlflow ui`` needs the full ``mlflow`` (``mlflow-skinny`` has no server) and, on MLflow 3, the file store
    switch: the command docs/outputs.md gives carries both, and the extra it names installs the full package."""
    import re
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    repo = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [Requirement(r).name for r in extras["mlflow-ui"]] == ["mlflow"]
    page = re.sub(r"\s+", " ", (repo / "docs" / "outputs.md").read_text())
    assert "`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri mlruns`" in page
    assert 'pip install -e ".[mlflow-ui]"' in page
