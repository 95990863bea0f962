"""Sweep summary: a Hydra callback that, when a multirun ends, writes ``sweep.json`` and ``report.html``.

Exit rule of a sweep (documented in docs/provenance.md): the sweep exits 0 when every job either finished with all items
written and evidence verified (``ok``) or was refused at startup because its explicitly selected backend cannot
run on this platform (``refused``, a documented refusal). Any other outcome (bad input, failed items, evidence
mismatch, crash) makes the sweep exit 1. When a job is lossy (``runner.core.lossy``), the quality gate
(``runner.tools.gate``) runs too and writes ``gate.json``; a failing gate (a lossy job below 0.97x the lossless job's
accuracy, or without a lossless job of the same rows) also makes the sweep exit 1.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.core import rundir
from runner.core.artifacts import atomic_write_json

log = logging.getLogger("runner.tools.sweep")

ACCEPTED_OUTCOMES = ("ok", "refused")


def _has_key(cfg: Any, key: str) -> Optional[str]:
    """None when the composed ``cfg`` has ``key`` (dotted; a value, list or open node on the way counts as
    having the rest), else the first dotted prefix of ``key`` that it lacks."""
    from omegaconf import DictConfig

    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        if part not in list(node.keys()):  # keys(), not `in`: a mandatory (???) value is a key too
            return ".".join(parts[:i + 1])
        node = node._get_node(part)  # noqa: SLF001 - omegaconf's accessor, resolves nothing
    return None


def run_dir_in_sweep_problem(argv: Sequence[str]) -> Optional[str]:
    """``hydra.run.dir=X`` (also ``+``/``++``) on a multirun (``-m``/``--multirun``) command line: Hydra does not
    use it (each job's dir is ``hydra.sweep.dir``/``hydra.sweep.subdir``), so the sweep would write somewhere the
    user did not name, without a word (new-user report).

    Returns:
        The message (the override, where the jobs go instead, the fix ``hydra.sweep.dir=X``), or None.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    arg = next((a for a in argv if a.split("=", 1)[0].lstrip("+") == "hydra.run.dir"), None)
    if arg is None:
        return None
    value = arg.split("=", 1)[1] if "=" in arg else ""
    return (f"{arg.split('=', 1)[0]}={value!r} is not used by a sweep (-m/--multirun): each job writes into "
            "hydra.sweep.dir/hydra.sweep.subdir (by default outputs/multirun/<date>/<time>-<pid>/<job number>), so the sweep "
            f"would run somewhere else; nothing was written; fix: hydra.sweep.dir={value or '<dir>'}")


def sweep_override_problem(argv: Sequence[str]) -> Optional[str]:
    """The first override of a multirun (``-m``) that sets a key only some of a swept group's options have
    (``-m model=prompt_expand_flux,tiny_flux model.stages.expand.backend.attention=TORCH_SDPA``: only
    prompt_expand_flux has ``model.stages.expand``). Hydra applies every override to every job, so the job
    without the key fails with "Could not override", and its suggested ``+key`` fails in the job that has it; this
    message says so and what works: one sweep per option, or one experiment preset per option swept as
    ``experiment=a,b``.

    Each option of each swept config group (``group=a,b``; other sweep kinds are left to Hydra) is composed with the
    command line's other group choices (a swept one at its first option). ``hydra.*`` overrides, ``~key`` and
    flags are Hydra's; so is everything when a composition fails.

    Returns:
        The message (the override, the options with and without the key, the fix), or None.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    try:
        from hydra import compose, initialize_config_dir
        from hydra.core.override_parser.overrides_parser import OverridesParser

        from runner.core.paths import CONF_DIR
        from runner.core.schema import register_configs

        register_configs()
        groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
        parser = OverridesParser.create()
        parsed = [(a, parser.parse_override(a)) for a in argv if "=" in a and not a.startswith(("-", "~", "hydra"))]
        swept = [(o.key_or_group, list(o.sweep_string_iterator())) for _, o in parsed
                 if o.key_or_group in groups and o.is_sweep_override()]
        keys = [(a, o.key_or_group) for a, o in parsed if o.key_or_group not in groups and "@" not in o.key_or_group
                and "/" not in o.key_or_group]
        if not swept or not keys:
            return None
        fixed = {o.key_or_group: (list(o.sweep_string_iterator())[0] if o.is_sweep_override() else o.value())
                 for _, o in parsed if o.key_or_group in groups}
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="runner_sweep_check"):
            for group, options in swept:
                cfgs = {v: compose("config", overrides=[f"{g}={x}" for g, x in {**fixed, group: v}.items()])
                        for v in options}
                for arg, key in keys:
                    lacks = {v: _has_key(c, key) for v, c in cfgs.items()}
                    has = [v for v, miss in lacks.items() if miss is None]
                    if has and len(has) < len(options):
                        return _sweep_message(arg.lstrip("+"), key, group, options, has, lacks)
    except Exception:  # noqa: BLE001 - Hydra will report what is wrong with the command line itself
        return None
    return None


def sweep_backend_problem(argv: Sequence[str]) -> Optional[str]:
    """The first backend name of a multirun (``-m backend.attention=TORCH_SDPA,cudnnx``) that names no backend. A
    job's backends are resolved when it starts, so the jobs ahead of the typo would run first (a whole generation
    each) and the sweep then fail half-way (new-user report); typed values and config-group options are checked for
    sweeps too, earlier (``runner.app.console.override_key_problem``). Keys ending in ``backend.<field>`` (also a
    stage's, ``model.stages.<s>.backend.<field>``) with a field of ``runner.kernels.registry``, choice sweeps only.

    Returns:
        ``runner.kernels.registry.normalize``'s message (the key, the value, the closest match, the valid names)
        with "nothing ran", or None.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.override_parser.types import ChoiceSweep

        parser = OverridesParser.create()
        swept = []
        for a in argv:
            key = a.split("=", 1)[0].lstrip("+")
            if "=" in a and not a.startswith(("-", "~")) and key.split(".")[-2:-1] == ["backend"]:
                o = parser.parse_override(a)
                if isinstance(o.value(), ChoiceSweep):
                    swept.append((key, [str(v) for v in o.sweep_string_iterator()]))
    except Exception:  # noqa: BLE001 - Hydra reports a command line it cannot parse, and how
        return None
    if not swept:
        return None
    from runner.kernels import registry

    for key, values in swept:
        field = key.split(".")[-1]
        if field not in registry.BACKENDS:
            continue  # not a backend field: the key check names it
        for v in values:
            try:
                registry.normalize(field, v, where=key)
            except registry.UnknownBackendError as e:
                return (f"{e} (in the sweep {key}={','.join(values)}: its job would be refused when it started, "
                        "after the jobs ahead of it ran; nothing ran)")
    return None


def _sweep_message(arg: str, key: str, group: str, options: Sequence[str], has: Sequence[str],
                   lacks: Dict[str, Optional[str]]) -> str:
    """The message of :func:`sweep_override_problem`."""
    without = [v for v in options if v not in has]
    gaps = ", ".join(f"{group}={v} has no {lacks[v]}" for v in without)
    return (f"{arg}: this sweep runs {group}={','.join(options)}, and {key} exists only in {group}="
            f"{','.join(has)} ({gaps}). Hydra applies every override of a sweep to every job, so the key is "
            f"refused in the {group}={','.join(without)} job, and +{key} (Hydra's hint) is refused in the "
            f"{group}={','.join(has)} job, where the key exists. fix: one sweep per {group} (python -m runner -m "
            f"{group}={','.join(has)} {arg} ...; python -m runner -m {group}={','.join(without)} ...), or one "
            f"experiment preset per {group} that sets its own fields (conf/experiment/<name>.yaml: "
            f"'# @package _global_', defaults: [override /{group}: <option>], then the field) swept as "
            "-m experiment=<name_a>,<name_b>")


def job_dirs(sweep_dir: Path) -> List[Path]:
    """Job dirs of a sweep (those holding ``job_status.json`` or ``manifest.json``), in job-number order."""
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / "job_status.json").exists()
                                                              or (p / "manifest.json").exists())]
    return sorted(dirs, key=lambda p: (0, int(p.name)) if p.name.isdigit() else (1, p.name))


def summarize(sweep_dir: Path, unrecorded: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The ``sweep.json`` document: one entry per job with its overrides, outcome, exit code and error.

    ``unrecorded``: this process's jobs that wrote no ``job_status.json`` because their dir is another run's
    (:data:`runner.app.jobs.UNRECORDED`, by resolved dir): such a job is reported with its own outcome and overrides
    (a sweep re-run into a sweep dir with other values: every job refused), beside ``dir_holds``, the overrides of the
    run its dir still holds, never as that earlier run."""
    jobs = []
    for d in job_dirs(sweep_dir):
        st = json.loads((d / "job_status.json").read_text()) if (d / "job_status.json").exists() else {}
        man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else {}
        attempt = (unrecorded or {}).get(str(d.resolve()))
        if attempt is not None:
            jobs.append({"dir": d.name, "overrides": attempt.get("overrides"), "outcome": attempt["outcome"],
                         "exit_code": attempt["exit_code"], "status": "not_run", "error": attempt.get("error"),
                         "dir_holds": man.get("overrides")})
            continue
        status = rundir.effective_status(d, man) if man else None  # running with a dead owner: crashed
        outcome = status if status in ("running", "crashed") else st.get("outcome", "unknown")
        jobs.append({"dir": d.name, "overrides": man.get("overrides"), "outcome": outcome,
                     "exit_code": st.get("exit_code"), "status": status, "error": st.get("error")})
    failed = [j for j in jobs if j["outcome"] not in ACCEPTED_OUTCOMES]
    return {"sweep_dir": str(sweep_dir), "jobs": jobs, "exit_code": 1 if failed else 0,
            "rule": "exit 0 iff every job is ok or refused (documented capability refusal at startup) and the quality "
                    "gate of the lossy jobs, if any, passes"}


def gate(sweep_dir: Path, doc: Dict[str, Any], min_metric_ratio: Optional[Dict[str, float]] = None
         ) -> Optional[Dict[str, Any]]:
    """Run the quality gate (``runner.tools.gate``) when a job of the sweep is lossy: writes ``gate.json``, records its
    verdict in ``doc`` (the ``sweep.json`` document) and raises its exit code on failure; None when no job is
    lossy. ``min_metric_ratio``: the floors of per-item metrics (``report.min_metric_ratio``)."""
    from runner.tools.gate import evaluate
    from runner.tools.report import load_jobs

    out = evaluate(load_jobs([sweep_dir]), min_metric_ratio=min_metric_ratio)
    if out["verdict"] == "none":
        return None
    atomic_write_json(sweep_dir / "gate.json", out)
    doc["gate"] = {"verdict": out["verdict"], "file": "gate.json"}
    if out["exit_code"]:
        doc["exit_code"] = 1
    return out


class SweepCallback(Callback):
    """Writes ``sweep.json`` and ``report.html`` into the sweep dir at the end of a multirun, then exits with the
    sweep's exit code (see the module docstring)."""

    def __init__(self, reference: Any = None, min_metric_ratio: Any = None) -> None:
        self.reference = reference
        self.min_metric_ratio = {str(k): float(v) for k, v in dict(min_metric_ratio or {}).items() if v is not None}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        from runner.app.jobs import UNRECORDED

        doc = summarize(sweep_dir, UNRECORDED)
        gated = None
        try:
            gated = gate(sweep_dir, doc, self.min_metric_ratio)
        except Exception as e:  # noqa: BLE001 - recorded; a gate that cannot run fails the sweep
            log.error("the quality gate could not run: %s: %s", type(e).__name__, e)
            doc["gate"], doc["exit_code"] = {"verdict": "error", "error": f"{type(e).__name__}: {e}"}, 1
        atomic_write_json(sweep_dir / "sweep.json", doc)
        try:
            from runner.tools.report import write_report

            report = write_report([sweep_dir], sweep_dir / "report.html", reference=self.reference, gate=gated)
            print(f"runner: sweep report: {report}", flush=True)  # where to look, beside the sweep's exit code
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - the report must not hide the sweep's outcome
            log.error("report.html could not be written: %s", e)
        for j in doc["jobs"]:
            log.info("job %s: %s %s", j["dir"], j["outcome"], j["overrides"])
        if gated is not None:
            log.info("quality gate: %s (%s)", gated["verdict"], sweep_dir / "gate.json")
        if doc["exit_code"]:
            log.error("sweep: %d job(s) failed for a reason other than a documented refusal%s",
                      sum(j["outcome"] not in ACCEPTED_OUTCOMES for j in doc["jobs"]),
                      f"; quality gate: {doc['gate']['verdict']}" if doc.get("gate") else "")
            sys.exit(doc["exit_code"])
