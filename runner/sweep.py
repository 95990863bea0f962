"""Sweep summary: a Hydra callback that, when a multirun ends, writes ``sweep.json`` and ``report.html``.

Exit rule of a sweep (documented in the README): the sweep exits 0 when every job either finished with all items
written and evidence verified (``ok``) or was refused at startup because its explicitly selected backend cannot
run on this platform (``refused``, a documented refusal). Any other outcome (bad input, failed items, evidence
mismatch, crash) makes the sweep exit 1.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner import rundir
from runner.artifacts import atomic_write_json

log = logging.getLogger("runner.sweep")

ACCEPTED_OUTCOMES = ("ok", "refused")


def job_dirs(sweep_dir: Path) -> List[Path]:
    """Job dirs of a sweep (those holding ``job_status.json`` or ``manifest.json``), in job-number order."""
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / "job_status.json").exists()
                                                              or (p / "manifest.json").exists())]
    return sorted(dirs, key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))


def summarize(sweep_dir: Path) -> Dict[str, Any]:
    """The ``sweep.json`` document: one entry per job with its overrides, outcome, exit code and error."""
    jobs = []
    for d in job_dirs(sweep_dir):
        st = json.loads((d / "job_status.json").read_text()) if (d / "job_status.json").exists() else {}
        man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        status = rundir.effective_status(d, man) if man else None  # running with a dead owner: crashed
        outcome = status if status in ("running", "crashed") else st.get("outcome", "unknown")
        jobs.append({"dir": d.name, "overrides": man.get("overrides"), "outcome": outcome,
                     "exit_code": st.get("exit_code"), "status": status, "error": st.get("error")})
    failed = [j for j in jobs if j["outcome"] not in ACCEPTED_OUTCOMES]
    return {"sweep_dir": str(sweep_dir), "jobs": jobs, "exit_code": 1 if failed else 0,
            "rule": "exit 0 iff every job is ok or refused (documented capability refusal at startup)"}


class SweepCallback(Callback):
    """Writes ``sweep.json`` and ``report.html`` into the sweep dir at the end of a multirun, then exits with the
    sweep's exit code (see the module docstring)."""

    def __init__(self, reference: Any = None) -> None:
        self.reference = reference

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        doc = summarize(sweep_dir)
        atomic_write_json(sweep_dir / "sweep.json", doc)
        try:
            from runner.report import write_report

            report = write_report([sweep_dir], sweep_dir / "report.html", reference=self.reference)
            print(f"runner: sweep report: {report}", flush=True)  # where to look, beside the sweep's exit code
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - the report must not hide the sweep's outcome
            log.error("report.html could not be written: %s", e)
        for j in doc["jobs"]:
            log.info("job %s: %s %s", j["dir"], j["outcome"], j["overrides"])
        if doc["exit_code"]:
            log.error("sweep: %d job(s) failed for a reason other than a documented refusal",
                      sum(j["outcome"] not in ACCEPTED_OUTCOMES for j in doc["jobs"]))
            sys.exit(doc["exit_code"])
