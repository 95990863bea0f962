"""``python -m runner.score <run dir> --metrics clip_score[,...] --model clip_score=<dir>``: score an existing run
dir's artifacts without regenerating them (``runner.core.metrics``), the same numbers a run with
``metrics.names=[...]`` computes from the same files and metric model.

It holds the run dir's lock (``runner.core.rundir.acquire``: a running run, or a second scorer, is refused), scores
every ok item of ``items.jsonl`` that lacks a score of the same metric model (``--rescore``: all), rewrites
``items.jsonl`` and the folder indexes (``images/metadata.jsonl``, ``videos/metadata.jsonl``) atomically, and sets
the manifest's ``metrics`` section: the metrics scored before and now, each model's source and file sha256, the
summary (mean, quantiles), plus ``scored_by`` (``runner.score``, when, device). Exit 0 scored; 2 bad input (not a
run dir, a running run, a metric that cannot run: every problem listed at once).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from runner.core.errors import RunnerError, UserInputError


class ScoreInputError(UserInputError):
    """The run dir or the metrics given to ``runner.score`` cannot be scored (exit 2)."""


def parse_models(values: Sequence[str]) -> Dict[str, str]:
    """``["clip_score=/dir", ...]`` -> ``{"clip_score": "/dir"}``.

    Raises:
        ScoreInputError: an entry without ``=``.
    """
    out: Dict[str, str] = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ScoreInputError(f"--model {v!r} is not NAME=PATH; fix: --model clip_score=/path/to/clip")
        out[name.strip()] = path.strip()
    return out


def as_flags(message: str) -> str:
    """A metrics message of ``runner.core.metrics`` (written for the run config's ``metrics.*`` keys) in this
    command line's terms: ``metrics.models.<name>=<v>`` -> ``--model <name>=<v>``, ``metrics.names`` ->
    ``--metrics``, ``metrics.batch_size`` -> ``--batch-size``."""
    import re

    message = re.sub(r"metrics\.models\.(\w+) is not set", r"no --model \1=<dir> was given", message)
    message = re.sub(r"metrics\.models\.(\w+)=", r"--model \1=", message)
    message = re.sub(r"metrics\.models\.(\w+)", r"--model \1=<dir>", message)
    message = re.sub(r"metrics\.names=\[\.\.\.,(\w+)\]", r"--metrics ...,\1", message)
    message = re.sub(r"\bmetrics\.names\b", "--metrics", message)
    return re.sub(r"\bmetrics\.batch_size=", "--batch-size ", message)


def output_kind(records: Sequence[Dict[str, Any]]) -> str:
    """``video`` when the ok records' files are MP4s, ``image`` for other files, ``text`` without any file."""
    files = [str(r.get("file")) for r in records if r.get("status") == "ok" and r.get("file")]
    if not files:
        return "text"
    return "video" if all(f.endswith(".mp4") for f in files) else "image"


def merged_section(old: Optional[Dict[str, Any]], new: Dict[str, Any], records: List[Dict[str, Any]]
                   ) -> Dict[str, Any]:
    """The manifest's ``metrics`` after scoring ``new``'s names: earlier names kept (their models), the summary of
    every name recomputed from ``records``."""
    from runner.core.metrics import summary

    old = old or {}
    names = list(dict.fromkeys([*(old.get("names") or []), *new["names"]]))
    models = {**(old.get("models") or {}), **new["models"]}
    return {**new, "names": names, "models": models, "summary": summary(records, names)}


def score_dir(run_dir: Path, names: Sequence[str], models: Dict[str, str], device: Optional[str] = None,
              batch_size: int = 32, rescore: bool = False) -> Dict[str, Any]:
    """Score ``run_dir`` (module docstring); returns the manifest's new ``metrics`` section.

    Raises:
        ScoreInputError: not a run dir, a running run, no metric; runner.core.metrics.MetricError: a metric that
            cannot run, an artifact missing or changed (nothing is rewritten); runner.core.rundir.RunDirInUseError:
            another process holds the dir.
    """
    from types import SimpleNamespace

    from runner.core import rundir
    from runner.core.artifacts import atomic_write_json
    from runner.core.manifest import now_iso
    from runner.core.metrics import MetricError, check, score_journal
    from runner.core.sinks import read_journal, write_folder_metadata

    run_dir = Path(run_dir)
    mpath, jpath = run_dir / "manifest.json", run_dir / "items.jsonl"
    if not mpath.is_file() or not jpath.is_file():
        raise ScoreInputError(f"{run_dir} is not a run dir (no manifest.json and items.jsonl); fix: pass the dir a "
                              "run wrote")
    lock = rundir.acquire(run_dir, create=False, own=False)
    try:
        manifest = json.loads(mpath.read_text())
        if manifest.get("status") == "running":
            raise ScoreInputError(f"{run_dir}: manifest status is running (a crashed run); fix: resume it first "
                                  "(run.resume=<dir>) or score a finished run")
        records = read_journal(jpath)
        kind = output_kind(records)
        try:
            ms = check(SimpleNamespace(names=list(names), models=dict(models), batch_size=batch_size), kind)
        except MetricError as e:  # the run config's keys, spelt as this command line's flags
            raise MetricError(as_flags(str(e))) from None
        if ms is None or not ms.names:
            raise ScoreInputError("no metric given; fix: --metrics clip_score --model clip_score=<dir>")
        dev = device or ("cuda" if _cuda() else "cpu")
        from runner.app.console import loading_bars_off

        loading_bars_off()  # python -m runner.score: the metric models load quietly (runner.app.console.quiet_tool)
        new = score_journal(run_dir, "items.jsonl", ms, dev, rescore=rescore)
        records = read_journal(jpath)
        section = merged_section(manifest.get("metrics"), new, records)
        section["scored_by"] = {"tool": "runner.score", "at": now_iso(), "device": dev}
        manifest["metrics"] = section
        manifest["folder_metadata"] = write_folder_metadata(run_dir, records, (manifest.get("model") or {}).get(
            "name"), manifest.get("run_id"))
        atomic_write_json(mpath, manifest)
        return section
    finally:
        rundir.release(lock)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.score",
                                 description="Score an existing run dir's artifacts with per-item metrics.")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--metrics", required=True, help="comma-separated metric names (clip_score, pick_score, ...)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                    help="a metric's model dir or Hub id (repeatable)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rescore", action="store_true", help="score every item again, also those already scored")
    a = ap.parse_args(argv)
    try:
        section = score_dir(a.run_dir, [n.strip() for n in a.metrics.split(",") if n.strip()],
                            parse_models(a.model), a.device, a.batch_size, a.rescore)
    except RunnerError as e:
        print(f"score: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    print(json.dumps({"summary": section["summary"], "scored": section["scored"], "kept": section["kept"]},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
