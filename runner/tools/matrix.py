"""Compatibility matrix from run manifests: which model x task x backends x dtype x parallelism x device was
actually run, and with what result.

``python -m runner.matrix <sweep_or_run_dirs...> [--grid attention=TORCH_SDPA,CUDNN_ATTN,SAGE_ATTN ...]``
prints a Markdown table (:func:`matrix_table` returns the same string). Only manifests count: a state is never
inferred from an import succeeding, from a registry entry, or from a run on another device.

Row key: ``model``, ``task`` (``text-to-image`` for the flux engine), one column per backend field
(``attention``, ``linear``, ``moe``: the requested value, normalised to its canonical name, and the selected
implementation: ``TORCH_SDPA`` when requested and selected agree, ``auto→TORCH`` when ``auto`` chose, ``n/a``
when the stage has no such layers; prefixed ``<stage>:`` when a model has several stages), ``dtype`` (the
resolved compute dtype), ``parallelism`` (``mode xN``) and ``device`` (platform kind, device name from the
platform probes, compute capability). Aliases normalise: ``backend.attention=sdpa`` and ``=TORCH_SDPA`` are one
row (TORCH_SDPA), whose ``runs`` column lists both jobs.

States (per run; a row with several runs shows the worst: failed, unsupported, limited, validated):

* ``validated``: finished (status completed), every item written, evidence verdict ``verified``, outputs finite,
  and, when the run's sweep has a parity reference (the first job with images, or ``--reference``), every
  comparable item within the tolerance: PSNR >= 40 dB (``--tolerance-db``) against the reference.
* ``limited``: finished with a recorded limitation: manifest status ``limited`` (evidence mismatch under
  ``evidence.strict=false``) or evidence not collected (``evidence.enabled=false``, all items reused).
* ``unsupported``: refused at startup with a capability error (manifest status ``refused``); the backend columns
  show what was requested (from the manifest's overrides and config), nothing was selected.
* ``failed``: ran, but a check failed: failed or non-finite items, evidence mismatch, parity below tolerance,
  crash, interruption.
* ``not tested``: a cell of ``--grid`` that no run matches.

Runs stopped for bad input (``invalid``: an unknown backend name, a bad row) say nothing about compatibility;
they are listed under the table, not in it.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from runner.core.errors import RunnerError, UserInputError
from runner.tools.report import (FIELDS, PARITY_TOLERANCE_DB, Job, backend_summary, fmt_psnr, load_jobs, parity,
                           pick_reference)

COLUMNS = ("model", "task", "attention", "linear", "moe", "dtype", "parallelism", "device")
TASKS = {"flux": "text-to-image"}
STATE_ORDER = ("failed", "unsupported", "limited", "validated")


class GridError(UserInputError, ValueError):
    """A ``--grid`` entry that is not ``AXIS=V1,V2`` with AXIS one of the matrix columns."""


def _norm_backend(field: str, value: Any) -> str:
    """Canonical backend name (aliases, case and ``-``/``_`` folded), or the value as given when unknown."""
    if value is None:
        return "auto"
    if not isinstance(value, str):
        return backend_summary(value) or "auto"
    try:
        from runner.kernels.registry import normalize

        return normalize(field, value)
    except Exception:  # noqa: BLE001 - an unknown name is shown as written
        return value


def _override_map(overrides: Sequence[str]) -> Dict[str, str]:
    out = {}
    for o in overrides or []:
        if "=" in o:
            k, v = o.split("=", 1)
            out[k.lstrip("+~")] = v
    return out


def _requested_unresolved(m: Dict[str, Any], field: str) -> str:
    """What a run stopped before resolution asked for ``field``: the CLI overrides first (stage, then run level),
    then the recorded config (stage, run, model default), else ``auto``."""
    ov = _override_map(m.get("overrides") or [])
    for k, v in ov.items():
        if re.fullmatch(rf"model\.stages\.[^.]+\.backend\.{field}", k):
            return _norm_backend(field, v)
    if f"backend.{field}" in ov:
        return _norm_backend(field, ov[f"backend.{field}"])
    cfg = m.get("config") or {}
    model = cfg.get("model") or {}
    for st in (model.get("stages") or {}).values():
        v = ((st or {}).get("backend") or {}).get(field)
        if v is not None:
            return _norm_backend(field, v)
    for v in ((cfg.get("backend") or {}).get(field), (model.get("backend") or {}).get(field)):
        if v is not None:
            return _norm_backend(field, v)
    return "auto"


def _backend_cells(m: Dict[str, Any]) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """Per field: the cell text and the effective backend names (selected, or requested when nothing was)."""
    cells: Dict[str, str] = {}
    eff: Dict[str, List[str]] = {}
    stages = m.get("backends") or {}
    for f in FIELDS:
        parts, names = [], []
        for stage, fields in stages.items():
            r = (fields or {}).get(f)
            if r is None:
                continue
            req = _norm_backend(f, r.get("requested"))
            sel = r.get("selected")
            sel_txt = backend_summary(sel)
            if sel is None:
                txt = "n/a"
            elif req == sel_txt:
                txt = sel_txt
            else:
                txt = f"{req}→{sel_txt}"
            if isinstance(sel, dict):
                names += [v.get("backend") if isinstance(v, dict) else str(v) for v in sel.values()]
            elif sel is not None:
                names.append(str(sel))
            parts.append((stage, txt))
        if not parts:  # never resolved (refused/invalid): what was requested
            req = _requested_unresolved(m, f)
            cells[f], eff[f] = req, [req]
            continue
        cells[f] = parts[0][1] if len(parts) == 1 else "; ".join(f"{s}:{t}" for s, t in parts)
        eff[f] = names
    return cells, eff


def _dtype(m: Dict[str, Any]) -> str:
    if m.get("dtype"):
        return str(m["dtype"])
    d = str((m.get("config") or {}).get("dtype") or "auto")
    if d == "auto":  # the rule of runner.app.checks.resolve_dtype: float32 on CPU, bfloat16 elsewhere
        kind = (m.get("platform") or {}).get("kind")
        return "float32" if kind == "cpu" else ("bfloat16" if kind else "auto")
    return d


def _device(m: Dict[str, Any]) -> str:
    """``kind: device name [sm]`` from the platform probes; every distinct worker device of a merged
    data-parallel manifest."""
    p = m.get("platform") or {}
    if not p or "error" in p:
        return "unknown"
    name = (p.get("probes") or {}).get("device_name") or p.get("device")
    names = sorted({w.get("device_name") for w in m.get("workers") or [] if w.get("device_name")} | {name})
    cap = p.get("capability") or (p.get("probes") or {}).get("capability")
    return f"{p.get('kind')}: {' + '.join(str(n) for n in names)}" + (f" {cap}" if cap else "")


def _all_finite(ev: Dict[str, Any]) -> bool:
    """Outputs finite per the evidence (a merged data-parallel manifest: every worker's evidence). Evidence of
    token outputs only (AR runs) has no ``all_finite``: token ids cannot be non-finite."""
    if "all_finite" in ev:
        return bool(ev["all_finite"])
    if "workers" in ev:
        workers = ev.get("workers") or {}
        return bool(workers) and all((w or {}).get("all_finite", False) for w in workers.values())
    return True


def row_key(job: Job) -> Tuple[Dict[str, str], Dict[str, List[str]]]:
    """The row key of a run (``COLUMNS`` -> text) and, per backend field, its effective backend names."""
    m = job.manifest
    cfg = m.get("config") or {}
    model = (m.get("model") or {}).get("name") or (cfg.get("model") or {}).get("name") or "?"
    mm, cm = m.get("model") or {}, cfg.get("model") or {}
    engine = mm.get("engine") or cm.get("engine") or mm.get("adapter") or cm.get("adapter")  # adapter: before #39
    par = m.get("parallelism") or cfg.get("parallelism") or {}  # the merged data-parallel section wins
    par_txt = f"{par.get('mode', 'single')} x{par.get('world_size', 1)}" + (
        f" ({par['launcher']})" if par.get("launcher") else "")
    cells, eff = _backend_cells(m)
    key = {"model": model, "task": TASKS.get(engine, engine or "?"), **cells, "dtype": _dtype(m),
           "parallelism": par_txt, "device": _device(m)}
    return key, eff


def classify(job: Job, ref: Optional[Job], tolerance_db: float = PARITY_TOLERANCE_DB) -> Tuple[str, str]:
    """``(state, note)`` of one run (see the module docstring); ``state`` None for ``invalid`` runs."""
    m = job.manifest
    status, outcome = m.get("status"), job.outcome
    if outcome == "invalid" or status == "invalid":
        return "invalid", job.error or "invalid input"
    if status == "refused" or outcome == "refused":
        return "unsupported", job.error or "refused at startup"
    ev = m.get("evidence") or {}
    if status == "limited":
        return "limited", "evidence mismatch recorded (evidence.strict=false): " + "; ".join(ev.get("mismatches")
                                                                                           or [])[:200]
    if status != "completed" or outcome not in ("ok", "unknown"):
        return "failed", f"outcome {outcome}, status {status}" + (f": {job.error}" if job.error else "")
    if not _all_finite(ev):
        return "failed", "non-finite outputs"
    if ev.get("verdict") == "not_collected":
        return "limited", "evidence not collected" + (f" ({ev['reason']})" if ev.get("reason") else "")
    if ev.get("verdict") != "verified":
        return "failed", f"evidence verdict {ev.get('verdict')}"
    if ref is None:
        return "validated", "no parity reference"
    if ref is job:
        return "validated", "parity reference"
    rows = parity(ref, job, tolerance_db)
    done = [r for r in rows if r["psnr_db"] is not None]
    bad = [r for r in rows if r["within"] is False]
    if bad:
        worst = ", ".join(f"{r['key']} {fmt_psnr(r['psnr_db']) if r['psnr_db'] is not None else r.get('note')}"
                          for r in bad[:3])
        return "failed", f"parity vs job {ref.label}: {len(bad)} item(s) below {tolerance_db:g} dB ({worst})"
    if not done:
        return "validated", f"parity vs job {ref.label}: no comparable items"
    mn = min(r["psnr_db"] for r in done)
    return "validated", f"parity vs job {ref.label}: min PSNR {fmt_psnr(mn)} dB over {len(done)} item(s)"


def parse_grid(grid: Any) -> Dict[str, List[str]]:
    """``["attention=A,B", "dtype=bfloat16"]`` (or a mapping) -> ``{axis: [values]}``, backend names normalised.

    Raises:
        GridError: an axis that is not a column, or an entry without ``=``.
    """
    items: Iterable[Tuple[str, Any]]
    if isinstance(grid, Mapping):
        items = grid.items()
    else:
        items = []
        for g in grid or []:
            if "=" not in g:
                raise GridError(f"--grid {g!r}: expected AXIS=V1,V2; fix: AXIS one of {', '.join(COLUMNS)}")
            k, v = g.split("=", 1)
            items.append((k.strip(), v.split(",")))
    out: Dict[str, List[str]] = {}
    for k, vals in items:
        k = k.removeprefix("backend.")
        if k not in COLUMNS:
            raise GridError(f"--grid axis {k!r} is not a column; fix: one of {', '.join(COLUMNS)}")
        vals = [vals] if isinstance(vals, str) else list(vals)
        out[k] = list(dict.fromkeys(_norm_backend(k, v.strip()) if k in FIELDS else v.strip()
                                    for v in vals if v.strip()))
    return out


def _matches(key: Dict[str, str], eff: Dict[str, List[str]], axis: str, value: str) -> bool:
    if axis in FIELDS:  # the implementation that ran (or was asked for, when nothing ran)
        names = eff.get(axis) or []
        return bool(names) and all(n == value for n in names)
    if axis == "device":  # "H200" matches "cuda: NVIDIA H200 sm90"
        return value.lower() in key["device"].lower()
    return key[axis].lower() == value.lower()


def _md(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def build_rows(jobs: Sequence[Job], grid: Any = None, reference: Any = None,
               tolerance_db: float = PARITY_TOLERANCE_DB) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Matrix rows (``COLUMNS`` + ``state``, ``runs``, ``notes``) and the notes on runs left out (invalid)."""
    refs: Dict[Path, Optional[Job]] = {}
    for g in dict.fromkeys(j.group for j in jobs):  # parity only within one sweep
        members = [j for j in jobs if j.group == g]
        try:
            refs[g] = pick_reference(members, reference)
        except KeyError:
            refs[g] = pick_reference(members, None)
    rows: Dict[Tuple[str, ...], Dict[str, Any]] = {}
    effs: List[Tuple[Dict[str, str], Dict[str, List[str]]]] = []
    left_out = []
    for j in jobs:
        state, note = classify(j, refs[j.group], tolerance_db)
        if state == "invalid":
            left_out.append(f"job {j.label}: invalid input, not a compatibility result: {note}")
            continue
        key, eff = row_key(j)
        effs.append((key, eff))
        k = tuple(key[c] for c in COLUMNS)
        row = rows.setdefault(k, {**key, "runs": [], "states": [], "notes": []})
        row["runs"].append(j.label)
        row["states"].append(state)
        if note not in row["notes"]:
            row["notes"].append(note)
    out = []
    for row in rows.values():
        st = row.pop("states")
        worst = min(st, key=STATE_ORDER.index)
        if len(set(st)) > 1:
            row["notes"].insert(0, "runs disagree: " + ", ".join(f"{r}={s}" for r, s in zip(row["runs"], st)))
        out.append({**row, "state": worst})
    axes = parse_grid(grid) if grid else {}
    if axes:
        names = list(axes)
        for combo in itertools.product(*(axes[a] for a in names)):
            if any(all(_matches(key, eff, a, v) for a, v in zip(names, combo)) for key, eff in effs):
                continue
            cell = {c: "—" for c in COLUMNS}
            cell.update(dict(zip(names, combo)))
            seen = ", ".join(sorted({key["device"] for key, _ in effs})) or "none"
            out.append({**cell, "state": "not tested", "runs": [],
                        "notes": [f"no run in the given dirs (devices with runs: {seen})"]})
    return out, left_out


def matrix_table(dirs: Sequence[Path], grid: Any = None, reference: Any = None,
                 tolerance_db: float = PARITY_TOLERANCE_DB) -> str:
    """The compatibility matrix of the runs under ``dirs`` as Markdown (see the module docstring).

    Args:
        dirs: sweep dirs (holding job dirs) or run dirs.
        grid: cells that must appear, as ``["attention=A,B", ...]`` or ``{axis: [values]}``; a cell no run matches
            is ``not tested``. Axes: ``COLUMNS``; backend names are normalised, ``device`` matches a substring.
        reference: parity reference job of each sweep (dir name); default: its first job with images.
        tolerance_db: parity tolerance, PSNR (dB) every comparable item must reach against the reference.
    """
    jobs = load_jobs(dirs)
    rows, left_out = build_rows(jobs, grid, reference, tolerance_db)
    head = [*COLUMNS, "state", "runs", "notes"]
    lines = [f"Compatibility matrix of {len(jobs)} run(s) in {', '.join(str(d) for d in dirs)}",
             "",
             f"Parity tolerance: PSNR >= {tolerance_db:g} dB per item against the sweep's reference job (the first "
             "job with images unless --reference is given), over items with the same seed, prompt and parameters.",
             "",
             "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        vals = [r[c] for c in COLUMNS] + [f"**{r['state']}**" if r["state"] == "validated" else r["state"],
                                          ", ".join(r["runs"]) or "—", "; ".join(r["notes"])]
        lines.append("| " + " | ".join(_md(v) for v in vals) + " |")
    lines += ["", "States: validated = completed, evidence verified, outputs finite, parity within tolerance "
              "(when the sweep has a reference); limited = finished with a recorded limitation (status limited, or "
              "evidence not collected); unsupported = refused at startup with a capability error (backends shown as "
              "requested); failed = a check failed; not tested = a --grid cell with no run. Only runs recorded "
              "here count: nothing is inferred from imports or other devices."]
    if left_out:
        lines += ["", "Left out:", *(f"- {_md(x)}" for x in left_out)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.matrix",
                                 description="Print the compatibility matrix (Markdown) of sweeps/runs.")
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep dirs (holding job dirs) or run dirs")
    ap.add_argument("--grid", action="append", default=[], metavar="AXIS=V1,V2",
                    help=f"cells that must appear (repeatable; axes: {', '.join(COLUMNS)}); no run: 'not tested'")
    ap.add_argument("--reference", default=None, help="parity reference job of each sweep (dir name)")
    ap.add_argument("--tolerance-db", type=float, default=PARITY_TOLERANCE_DB,
                    help=f"parity tolerance in dB of PSNR (default {PARITY_TOLERANCE_DB:g})")
    a = ap.parse_args(argv)
    try:
        print(matrix_table(a.dirs, a.grid, a.reference, a.tolerance_db), end="")
    except RunnerError as e:
        print(f"matrix: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, ValueError) as e:
        print(f"matrix: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
