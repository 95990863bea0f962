"""Experiment trackers (config group ``tracker``): after a run ends, its manifest is logged as one tracker run.

``tracker=mlflow`` logs through the real ``mlflow`` library (``pip install -e ".[mlflow]"``: ``mlflow-skinny`` is
enough) into ``tracker.uri`` (null: the file store ``mlruns/`` in the working directory the run was started from;
any MLflow tracking URI works, e.g. ``http://host:5000`` or ``sqlite:///mlflow.db`` with the full ``mlflow``):

* params: the model, the dataset (format, path, rows), seed, batch_size, dtype, compile, the backend selected per
  stage and field, the command-line overrides (each value cut to MLflow's 6000 characters);
* metrics: ``counts.*`` (ok, failed, reused), the numeric ``timing.*`` (seconds, items per s/hour, output tokens
  per s), the numeric ``accuracy.*`` of a model with an oracle, ``metrics.<name>.<statistic>`` of per-item quality
  metrics (``runner.core.metrics``);
* tags: ``runner.run_id``, ``runner.status``, ``runner.run_dir``, ``runner.exit_code``, ``mlflow.runName``
  (``tracker.run_name``, null: the run dir's name);
* artifacts: ``manifest.json``, ``items.jsonl`` and the folder indexes ``images/metadata.jsonl`` /
  ``videos/metadata.jsonl`` (not the images themselves).

MLflow 3 refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE=true`` ("maintenance mode"); for a ``file:`` URI
(or a plain path) the runner sets it for the process when it is unset. :func:`check` runs at startup (a missing
``mlflow`` is exit 2 before anything loads); :func:`log_run` after the run's final manifest, and a tracker that
fails there is logged as an error without changing the run's exit code (the run dir has everything).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from runner.core.errors import UserInputError
from runner.core.errors import install_fix

log = logging.getLogger("runner")

MAX_PARAM = 6000  # MLflow's limit on a param value (characters)


class TrackerError(UserInputError, RuntimeError):
    """The chosen tracker cannot be used here (its library is not installed); names the fix. Exit 2 at startup."""


def _uri(cfg: Any) -> str:
    """``tracker.uri``, or the file store ``mlruns/`` in the working directory the run was started from."""
    if cfg.tracker.uri:
        return str(cfg.tracker.uri)
    from runner.core.paths import original_cwd

    return (Path(original_cwd()) / "mlruns").resolve().as_uri()


def check(cfg: Any) -> None:
    """At startup: the tracker's library imports.

    Raises:
        TrackerError: ``tracker=mlflow`` without ``mlflow`` installed.
    """
    if cfg.tracker.name != "mlflow":
        return
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise TrackerError("tracker=mlflow needs the mlflow library, which is not installed; fix: "
                           f"{install_fix('mlflow', 'the skinny client is enough')}, or tracker=none") from None


def _flat(prefix: str, x: Any, out: Dict[str, float]) -> None:
    if isinstance(x, bool):
        return
    if isinstance(x, (int, float)):
        out[prefix] = float(x)
    elif isinstance(x, dict):
        for k, v in x.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)


def params_of(manifest: Dict[str, Any]) -> Dict[str, str]:
    """The MLflow params of a manifest (see the module docstring), values as text cut to :data:`MAX_PARAM`."""
    cfg = manifest.get("config") or {}
    ds = manifest.get("dataset") or {}
    p: Dict[str, Any] = {
        "model": (cfg.get("model") or {}).get("name"), "dataset.format": ds.get("format"),
        "dataset.path": ds.get("path"), "dataset.rows": ds.get("rows"), "seed": cfg.get("seed"),
        "batch_size": cfg.get("batch_size"), "dtype": manifest.get("dtype") or cfg.get("dtype"),
        "compile": cfg.get("compile"), "overrides": " ".join(manifest.get("overrides") or []),
    }
    for stage, fields in (manifest.get("backends") or {}).items():
        for f, r in (fields or {}).items():
            if isinstance(r, dict) and "selected" in r:
                sel = r["selected"]
                p[f"backend.{stage}.{f}"] = sel if isinstance(sel, str) else json.dumps(sel, sort_keys=True)
    return {k: str(v)[:MAX_PARAM] for k, v in p.items() if v is not None}


def metrics_of(manifest: Dict[str, Any]) -> Dict[str, float]:
    """The MLflow metrics of a manifest: numeric ``counts.*``, ``timing.*`` and ``accuracy.*`` leaves, and the
    per-item quality metrics' summary as ``metrics.<name>.<statistic>`` (``mean``, ``p50``... of
    ``metrics.summary``)."""
    out: Dict[str, float] = {}
    for section in ("counts", "timing", "accuracy"):
        _flat(section, manifest.get(section) or {}, out)
    _flat("metrics", (manifest.get("metrics") or {}).get("summary") or {}, out)
    return out


def log_run(cfg: Any, run_dir: Path, exit_code: int) -> Optional[str]:
    """Log the run dir's final ``manifest.json`` to the chosen tracker (``tracker=none``: nothing).

    Returns:
        The tracker's run id (MLflow), or None when nothing was logged.

    Raises:
        Exception: whatever the tracker library raises (the caller logs it; the run's outcome stands).
    """
    if cfg.tracker.name != "mlflow":
        return None
    run_dir = Path(run_dir)
    mpath = run_dir / "manifest.json"
    if not mpath.is_file():
        return None
    manifest = json.loads(mpath.read_text())
    uri = _uri(cfg)
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(str(cfg.tracker.experiment))
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(str(cfg.tracker.experiment))
    tags = {"runner.run_id": str(manifest.get("run_id")), "runner.status": str(manifest.get("status")),
            "runner.run_dir": str(run_dir.resolve()), "runner.exit_code": str(exit_code),
            "mlflow.runName": str(cfg.tracker.run_name or run_dir.name)}
    run = client.create_run(exp_id, tags=tags)
    rid = run.info.run_id
    try:
        from mlflow.entities import Metric, Param

        now = int(time.time() * 1000)
        client.log_batch(rid, metrics=[Metric(k, v, now, 0) for k, v in sorted(metrics_of(manifest).items())],
                         params=[Param(k, v) for k, v in sorted(params_of(manifest).items())])
        for rel in ("manifest.json", "items.jsonl"):
            if (run_dir / rel).is_file():
                client.log_artifact(rid, str(run_dir / rel))
        for folder in ("images", "videos"):
            if (run_dir / folder / "metadata.jsonl").is_file():
                client.log_artifact(rid, str(run_dir / folder / "metadata.jsonl"), artifact_path=folder)
        ok = str(manifest.get("status")) in ("completed", "completed_with_failures")
        client.set_terminated(rid, status="FINISHED" if ok else "FAILED")
    except BaseException:
        client.set_terminated(rid, status="FAILED")
        raise
    log.info("tracker: MLflow run %s in %s (experiment %s)", rid, uri, cfg.tracker.experiment)
    return rid
