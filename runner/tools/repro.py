"""Re-run a finished run from its manifest and check that it reproduces, item by item.

``python -m runner.repro <run_dir> [--out NEW_DIR] [--tolerance-db 40]`` runs
``<python> -m runner <the manifest's overrides> hydra.run.dir=NEW_DIR`` (the command ``repro.sh`` holds, with the
library environment variables the original recorded and the Hub cache that resolved its weights, whatever this
shell's ``HF_HOME``: :func:`rerun_environment`) and then compares:

* artifacts, item by item over the original's written items: when the original ran on CPU (deterministic) the
  files must be byte-identical (sha256 of the files on disk); elsewhere PSNR >= ``--tolerance-db`` (dB; default
  40, recorded in the result) and the maximum absolute pixel difference (0..255) is reported. An original file
  that no longer matches the sha256 in its ``items.jsonl`` record is named as modified after the run;
* videos (MP4) by their decoded frames, not their bytes (an encoder or muxer version may change the container
  alone): both files are decoded here and the sha256 of the frames (``frames_sha256``) must be equal on CPU;
  elsewhere every frame's PSNR >= ``--tolerance-db`` (the worst frame is reported). The table's sha256 columns
  then hold the frames' sha256 (``compared: frames``); a recorded ``frames_sha256`` that the original no longer
  decodes to here is a note (another decoder), not a failure;
* a video's audio stream (LTX-2) by its decoded samples: both files' audio is decoded here to 16-bit PCM and its
  sha256 (``audio_sha256``) must be equal on CPU; elsewhere its PSNR (peak 32767) >= ``--tolerance-db``; a video
  with audio on one side only is a mismatch;
* AR records (vLLM stages: ``items.jsonl`` of ``model=tiny_qwen3_moe``, ``expand.jsonl`` of a pipeline), per
  record key: the ``output_token_ids`` must be identical (on every platform; ``--tolerance-db`` applies to images
  only), shown as the sha256 of the token-id list;
* items the re-run made that the original has no record of fail it (``only in the re-run``), except when the
  original was interrupted (its ``status``): it never reached those rows, so they are a note, not compared;
* the ``backends`` section: the selected (and resolved) value of every stage and field must be unchanged;
* the dataset sha256 and, for runs refused at startup, the status and error type. A run that holds no ok item (every
  item failed, or the run was refused at startup) reproduces nothing: that is a failure (exit 1) naming it, even
  when the re-run is refused the same way.

Before anything re-runs, the input files of the original's items (``items.jsonl`` ``inputs``: images, masks of a
conditioning task) and the run's LoRA adapter files (``manifest.json`` ``model.source.lora``) must still hash to their
recorded sha256: a changed or missing input is refused (exit 2) naming the file, the field and the item, or the
adapter (:func:`check_inputs`), since the re-run would compute other outputs.

It prints a per-item table (key, original sha, new sha, equal/PSNR, verdict), writes the comparison to
``NEW_DIR/repro_check.json`` and exits 0 when everything reproduces, 1 on any mismatch, missing item or changed
backend resolution (each named), 2 when ``run_dir`` holds no manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from runner.core import rundir, storage
from runner.core.errors import RunnerError, UserInputError
from runner.core.paths import hydra_quote
from runner.tools.report import PARITY_TOLERANCE_DB, compare_files, fmt_psnr


class ReproInputError(UserInputError, OSError):
    """The run dir to reproduce holds no readable manifest, or ``--out`` already holds a run."""


# Keys whose original value would point the re-run back at the original dir (or resume it).
_DROP_KEYS = ("output.dir", "run.resume", "run.force")


def _sha(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _tokens_sha(ids: Any) -> Optional[str]:
    return None if ids is None else hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def _ar_journals(run_dir: Path) -> List[str]:
    """Journals of the run holding AR records (``output_token_ids``): ``items.jsonl`` of an AR model, the AR
    stage's ``<stage>.jsonl`` of a pipeline."""
    out = []
    for p in sorted(run_dir.glob("*.jsonl")):
        if p.name.startswith("items.") and p.name != "items.jsonl":
            continue
        if any("output_token_ids" in r for r in _items(run_dir, p.name).values()):
            out.append(p.name)
    return out


def _compare_tokens(orig_dir: Path, new_dir: Path, name: str) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Per AR record of ``name``: the re-run's ``output_token_ids`` must equal the original's."""
    rows, problems = [], []
    oi, ni = _items(orig_dir, name), _items(new_dir, name)
    label = "" if name == "items.jsonl" else f"{name}:"
    for key, r in oi.items():
        if r.get("status") != "ok" or "output_token_ids" not in r:
            continue
        n = ni.get(key)
        row: Dict[str, Any] = {"key": f"{label}{key}", "original_sha256": _tokens_sha(r["output_token_ids"]),
                               "new_sha256": None, "psnr_db": None, "max_abs_diff": None, "ok": False}
        if n is None or n.get("status") != "ok" or n.get("output_token_ids") is None:
            verdict = "missing in re-run" + (f" ({n.get('status')}: {n.get('reason')})" if n else "")
        else:
            row["new_sha256"] = _tokens_sha(n["output_token_ids"])
            a, b = r["output_token_ids"], n["output_token_ids"]
            if a == b:
                verdict = "ok"
            else:
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                verdict = (f"output_token_ids differ from token {first} ({len(a)} original vs {len(b)} re-run "
                           "tokens)")
        row["ok"] = verdict == "ok"
        row["verdict"] = verdict
        if not row["ok"]:
            problems.append(f"item {row['key']!r}: {verdict}")
        rows.append(row)
    extra = [k for k, n in ni.items() if n.get("status") == "ok" and "output_token_ids" in n and k not in oi]
    problems += [f"item {label}{k!r}: only in the re-run" for k in extra]
    return rows, problems


def _frames_shas(orig_dir: Path, r: Dict[str, Any], new_dir: Path, n: Dict[str, Any]
                 ) -> Tuple[Optional[str], Optional[str], List[str]]:
    """``(original frames sha256, re-run frames sha256, notes)`` of two video records: both files decoded here
    (``runner.core.video``), so the two hashes come from one decoder; a note for each recorded ``frames_sha256`` that its
    file no longer decodes to here (another ffmpeg decodes differently)."""
    from runner.core.video import decode_mp4, frames_sha256

    out: List[Optional[str]] = []
    notes: List[str] = []
    for d, rec, which in ((orig_dir, r, "original"), (new_dir, n, "re-run")):
        try:
            sha = frames_sha256(decode_mp4(d / rec["file"]))
        except (OSError, RuntimeError, ValueError) as e:
            sha = None
            notes.append(f"the {which} video does not decode here ({type(e).__name__}: {e})")
        if sha is not None and rec.get("frames_sha256") and sha != rec["frames_sha256"]:
            notes.append(f"the {which} video decodes here to frames_sha256 {sha[:12]}, its record says "
                         f"{str(rec['frames_sha256'])[:12]} (another decoder)")
        out.append(sha)
    return out[0], out[1], notes


def _compare_audio(orig: Path, new: Path, exact: bool, tolerance_db: float) -> Tuple[Dict[str, Any], List[str]]:
    """The audio streams of two videos, both decoded here (``runner.core.video.read_audio``): ``(row fields, notes)``;
    ``notes`` empty means the audio reproduced (equal samples; off CPU, PSNR >= ``tolerance_db``) or neither file
    has audio."""
    import numpy as np

    from runner.core.video import audio_sha256, read_audio

    try:
        a, b = read_audio(orig), read_audio(new)
    except (OSError, RuntimeError, ValueError) as e:
        return {}, [f"an audio stream does not decode here ({type(e).__name__}: {e})"]
    if a is None and b is None:
        return {}, []
    row = {"original_audio_sha256": audio_sha256(a[0]) if a else None,
           "new_audio_sha256": audio_sha256(b[0]) if b else None, "audio_psnr_db": None}
    if a is None or b is None:
        return row, [f"audio stream only in the {'re-run' if a is None else 'original'}"]
    if row["original_audio_sha256"] == row["new_audio_sha256"] and a[1] == b[1]:
        row["audio_psnr_db"] = float("inf")
        return row, []
    if a[0].shape != b[0].shape or a[1] != b[1]:
        return row, [f"audio differs in length or rate ({a[0].shape} at {a[1]} Hz vs {b[0].shape} at {b[1]} Hz)"]
    mse = float(np.mean((a[0].astype(np.float64) - b[0].astype(np.float64)) ** 2))
    row["audio_psnr_db"] = float("inf") if mse == 0 else 10 * np.log10(32767.0 ** 2 / mse)
    if exact:
        return row, ["decoded audio differs (audio_sha256)"]
    ok = row["audio_psnr_db"] >= tolerance_db
    return row, [] if ok else [f"audio PSNR {fmt_psnr(row['audio_psnr_db'])} dB < {tolerance_db:g} dB"]


def _items(run_dir: Path, name: str = "items.jsonl") -> Dict[str, Dict[str, Any]]:
    from runner.core.sinks import read_journal

    return {r["key"]: r for r in read_journal(run_dir / name) if "key" in r}


def _override_value(override: str) -> Optional[Any]:
    """The value an override sets, as Hydra parses it (None when it does not parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(override).value()
    except Exception:  # noqa: BLE001 - it parsed in the original run; left as it was
        return None


def rerun_command(manifest: Dict[str, Any], new_dir: Path, output: Optional[str] = None) -> List[str]:
    """``python -m runner`` argv of the re-run: the original overrides exactly as the original process received
    them (the manifest's ``overrides`` are Hydra's input lines, the raw argv form), minus those naming the output
    or resume dir; a relative ``dataset.path`` is replaced by the absolute path the manifest recorded, and every
    path the re-run adds is quoted for Hydra's grammar (:func:`hydra_quote`), into ``new_dir``; with ``output`` (an
    object-storage URL) the re-run writes there (``output.dir``), staged in ``new_dir``."""
    args = []
    ds_path = (manifest.get("dataset") or {}).get("path")
    for o in manifest.get("overrides") or []:
        key = o.partition("=")[0].lstrip("+~")
        if key in _DROP_KEYS:
            continue
        if key == "dataset.path" and ds_path:
            val = _override_value(o)
            if isinstance(val, str) and not Path(val).is_absolute() and not storage.is_url(val):
                o = f"{o.split('=', 1)[0]}={hydra_quote(ds_path)}"
        args.append(o)
    cfg = manifest.get("config") or {}
    if output is not None or (cfg.get("output") or {}).get("dir"):
        args.append(f"output.dir={hydra_quote(str(output or new_dir))}")
    if (cfg.get("run") or {}).get("resume"):
        args.append("run.resume=null")
    return [sys.executable, "-m", "runner", *args, f"hydra.run.dir={hydra_quote(str(new_dir))}"]


def rerun_environment(manifest: Dict[str, Any]) -> Dict[str, str]:
    """The variables the re-run gets on top of this shell's: the manifest's ``environment`` (the library
    variables and the Hub cache that resolved the weights, ``runner.core.weights.hub_environment``), so a run
    whose ``model.path`` was a Hub id resolves the same snapshot in a shell without the original ``HF_HOME``. A
    manifest written before the Hub cache was recorded there still names it in ``model.source.hub.cache_dir``:
    that becomes ``HF_HUB_CACHE``."""
    env = {k: str(v) for k, v in (manifest.get("environment") or {}).items()}
    hub = ((manifest.get("model") or {}).get("source") or {}).get("hub") or {}
    if hub.get("cache_dir") and "HF_HUB_CACHE" not in env:
        env["HF_HUB_CACHE"] = str(hub["cache_dir"])
    return env


def _backend_diffs(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    diffs = []
    for stage in sorted(set(a) | set(b)):
        fa, fb = a.get(stage) or {}, b.get(stage) or {}
        for f in sorted(set(fa) | set(fb)):
            for part in ("selected", "resolved"):
                va, vb = (fa.get(f) or {}).get(part), (fb.get(f) or {}).get(part)
                if va != vb:
                    diffs.append(f"backend resolution changed: {stage}.{f} {part} {json.dumps(va)} -> "
                                 f"{json.dumps(vb)}")
    return diffs


def _compare_item(orig_dir: Path, new_dir: Path, key: str, r: Dict[str, Any], n: Optional[Dict[str, Any]],
                  exact: bool, tolerance_db: float) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """One ok item of the original against its re-run record ``n``: ``(row, notes, video_notes)``; ``notes``
    empty means the item reproduced (bytes, decoded frames, or PSNR within ``tolerance_db``)."""
    video_notes: List[str] = []
    video = str(r["file"]).endswith(".mp4")
    row: Dict[str, Any] = {"key": key, "original_sha256": _sha(orig_dir / r["file"]), "new_sha256": None,
                           "psnr_db": None, "max_abs_diff": None, "ok": False,
                           "compared": "frames" if video else "bytes"}
    notes: List[str] = []
    if row["original_sha256"] is None:
        notes.append("original file missing")
    elif r.get("file_sha256") and row["original_sha256"] != r["file_sha256"]:
        notes.append("original file modified after the run (sha256 differs from items.jsonl)")
    if n is None or n.get("status") != "ok" or not n.get("file"):
        notes.append("missing in re-run" + (f" ({n.get('status')}: {n.get('reason')})" if n else ""))
    else:
        row["new_sha256"] = _sha(new_dir / n["file"])
        if video and row["original_sha256"] is not None and row["new_sha256"] is not None:
            row["original_sha256"], row["new_sha256"], note = _frames_shas(orig_dir, r, new_dir, n)
            video_notes += [f"item {key!r}: {x}" for x in note]
        undecodable = video and (row["original_sha256"] is None or row["new_sha256"] is None)
        if undecodable:
            notes.append("a video does not decode here (see notes)")
        equal = row["original_sha256"] is not None and row["original_sha256"] == row["new_sha256"]
        if row["original_sha256"] is not None and row["new_sha256"] is not None and not equal:
            m = compare_files(orig_dir / r["file"], new_dir / n["file"])
            row.update(psnr_db=m["psnr_db"], max_abs_diff=m["max_abs_diff"])
            if video and m.get("error"):  # another frame count or size
                notes.append(m["error"])
        elif equal:
            row.update(psnr_db=float("inf"), max_abs_diff=0)
        if video and not undecodable:
            audio_row, audio_notes = _compare_audio(orig_dir / r["file"], new_dir / n["file"], exact, tolerance_db)
            row.update(audio_row)
            notes += audio_notes
        if undecodable:
            pass
        elif exact and not equal:
            notes.append("decoded frames differ (frames_sha256)" if video else "bytes differ")
        elif not exact and not equal and (row["psnr_db"] is None or row["psnr_db"] < tolerance_db):
            notes.append(f"PSNR {fmt_psnr(row['psnr_db'])} dB < {tolerance_db:g} dB")
    return row, notes, video_notes


def _run_problems(mo: Dict[str, Any], mn: Dict[str, Any], new_dir: Path) -> List[str]:
    """What differs between the two runs as a whole: no re-run manifest, another refusal, other backends, another
    dataset."""
    problems: List[str] = []
    if not mn:
        problems.append(f"the re-run wrote no manifest.json in {new_dir}")
    if mo.get("status") in ("refused", "invalid"):
        eo, en = (mo.get("error") or {}).get("type"), (mn.get("error") or {}).get("type")
        if (mn.get("status"), en) != (mo.get("status"), eo):
            problems.append(f"original was {mo.get('status')} ({eo}); re-run is {mn.get('status')} ({en})")
    problems += _backend_diffs(mo.get("backends") or {}, mn.get("backends") or {})
    da, db = (mo.get("dataset") or {}).get("sha256"), (mn.get("dataset") or {}).get("sha256")
    if da and db and da != db:
        problems.append(f"dataset changed: sha256 {da[:12]} -> {db[:12]}")
    return problems


def _nothing_reproduced(orig_dir: Path, mo: Dict[str, Any], mn: Dict[str, Any]) -> str:
    """The problem of an original with no ok item: nothing was compared, so nothing reproduced (a run refused at
    startup included: its refusal reproducing is named, but is no reproduction)."""
    status = mo.get("status")
    if status in ("refused", "invalid"):
        eo = (mo.get("error") or {}).get("type")
        same = (mn.get("status"), (mn.get("error") or {}).get("type")) == (status, eo)
        also = ", and so was the re-run" if same else ""
        return (f"{orig_dir} holds no ok item: the run was {status} at startup ({eo}){also}; nothing was "
                "reproduced; fix: reproduce a run that generated items")
    return f"{orig_dir} holds no ok item to compare (no image file, no AR output); nothing was reproduced"


def _rerun_refusal(mo: Dict[str, Any], mn: Dict[str, Any], orig_dir: Path) -> Optional[str]:
    """The one problem of a re-run refused (or invalid) at startup when its original was not: the re-run's error
    (type, message and fix, as the run printed it) and how many of the original's items were therefore not compared;
    None otherwise (an original refused the same way is :func:`_nothing_reproduced`'s case)."""
    if mn.get("status") not in ("refused", "invalid") or mo.get("status") in ("refused", "invalid"):
        return None
    err = mn.get("error") or {}
    n = sum(1 for r in _items(orig_dir).values() if r.get("status") == "ok")
    return (f"the re-run was {mn['status']} at startup, so none of the original's {n} ok item(s) was compared: "
            f"{err.get('type')}: {err.get('message')}")


def _provenance_notes(mo: Dict[str, Any], mn: Dict[str, Any]) -> List[str]:
    """Informational: a changed code or library version explains a mismatch but is not one. A resumed original's
    items may have been written by earlier attempts (``resumed_from.attempts``, each with the items it wrote): each
    such attempt's git and packages are compared with the re-run's too, named by its run_id."""
    notes: List[str] = []
    gb, pb = mn.get("git") or {}, mn.get("packages") or {}
    attempts = [a for a in ((mo.get("resumed_from") or {}).get("attempts") or [])
                if isinstance(a, dict) and a.get("items")]
    for label, m in [*((f"attempt {str(a.get('run_id'))[:8]} ({a['items']} items)", a) for a in attempts),
                     ("original", mo)]:
        ga, pa = m.get("git") or {}, m.get("packages") or {}
        if ga.get("commit") != gb.get("commit") or gb.get("dirty"):
            notes.append(f"git: {label} {str(ga.get('commit'))[:12]} (dirty={ga.get('dirty')}), re-run "
                         f"{str(gb.get('commit'))[:12]} (dirty={gb.get('dirty')})")
        if "packages" in m:  # an attempt may keep only their sha256
            prefix = "" if m is mo else f"{label}: "
            notes += [f"{prefix}package {k}: {pa.get(k)} -> {pb.get(k)}" for k in sorted(set(pa) | set(pb))
                      if pa.get(k) != pb.get(k)]
    return notes


def compare(orig_dir: Path, new_dir: Path, tolerance_db: float = PARITY_TOLERANCE_DB,
            exact: Optional[bool] = None) -> Dict[str, Any]:
    """Compare a re-run with its original (see the module docstring).

    Args:
        exact: byte equality (default: when the original ran on CPU) instead of the PSNR tolerance.

    Returns:
        ``{ok, mode, tolerance_db, items: [{key, original_sha256, new_sha256, psnr_db, max_abs_diff, verdict,
        ok}], problems: [text naming each mismatch]}``.
    """
    mo = json.loads((orig_dir / "manifest.json").read_text())
    mn = json.loads((new_dir / "manifest.json").read_text()) if (new_dir / "manifest.json").exists() else {}
    kind = (mo.get("platform") or {}).get("kind")
    exact = (kind == "cpu") if exact is None else exact
    refusal = _rerun_refusal(mo, mn, orig_dir)
    if refusal is not None:  # the cause alone: every item "missing" and every backend "-> null" only follow from it
        return {"ok": False, "mode": "bytes" if exact else "psnr", "tolerance_db": None if exact else tolerance_db,
                "original": str(orig_dir), "rerun": str(new_dir), "platform": kind, "items": [],
                "problems": [refusal], "notes": _provenance_notes(mo, mn), "rerun_refused": mn.get("error")}
    problems = _run_problems(mo, mn, new_dir)
    oi, ni = _items(orig_dir), _items(new_dir)
    rows = []
    video_notes: List[str] = []
    for key, r in oi.items():
        if r.get("status") != "ok" or not r.get("file"):
            continue
        row, notes, vn = _compare_item(orig_dir, new_dir, key, r, ni.get(key), exact, tolerance_db)
        video_notes += vn
        row["ok"] = not notes
        row["verdict"] = "ok" if row["ok"] else "; ".join(notes)
        if notes:
            problems.append(f"item {key!r}: {row['verdict']}")
        rows.append(row)
    for name in _ar_journals(orig_dir):
        tok_rows, tok_problems = _compare_tokens(orig_dir, new_dir, name)
        rows += tok_rows
        problems += tok_problems
    if not rows:
        problems.append(_nothing_reproduced(orig_dir, mo, mn))
    notes = video_notes + _provenance_notes(mo, mn)
    extra = [k for k, n in ni.items() if n.get("status") == "ok" and k not in oi and "output_token_ids" not in n]
    if mo.get("status") == "interrupted":  # a stopped run never reached these rows: nothing of its to compare
        notes += [f"{len(extra)} item(s) the original did not make (it was interrupted), made by the re-run: "
                  f"not compared"] if extra else []
    else:
        problems += [f"item {k!r}: only in the re-run" for k in extra]
    return {"ok": not problems, "mode": "bytes" if exact else "psnr", "tolerance_db": None if exact else tolerance_db,
            "original": str(orig_dir), "rerun": str(new_dir), "platform": kind, "items": rows, "problems": problems, "notes": notes}


def format_table(result: Dict[str, Any]) -> str:
    """The per-item comparison as a plain-text table."""
    head = ("key", "original sha256", "new sha256", "equal/PSNR dB", "max |diff|", "verdict")
    lines = []
    for r in result["items"]:
        eq = ("equal" if r["original_sha256"] and r["original_sha256"] == r["new_sha256"]
              else fmt_psnr(r["psnr_db"]))
        lines.append((r["key"], (r["original_sha256"] or "—")[:16], (r["new_sha256"] or "—")[:16], eq,
                      "—" if r["max_abs_diff"] is None else str(r["max_abs_diff"]), r["verdict"]))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*l) for l in lines)])


def changed_inputs(run_dir: Path) -> List[str]:
    """The input files of ``run_dir``'s ok items (``items.jsonl`` ``inputs``: ``runner.core.media``) that are gone or
    no longer hash to their recorded sha256, one line each naming the file, the item and the field. An input read
    from an image cell's bytes (``<bytes ...>``) is covered by the dataset's sha256 instead."""
    out, seen = [], set()
    for key, rec in _items(run_dir).items():
        if rec.get("status") != "ok":
            continue
        for field, v in (rec.get("inputs") or {}).items():
            for i, inp in enumerate(v if isinstance(v, list) else [v]):
                path = str(inp.get("path") or "")
                if not path or path.startswith("<") or (path, inp.get("sha256")) in seen:
                    continue
                seen.add((path, inp.get("sha256")))
                now = _sha(Path(path))
                if now != inp.get("sha256"):
                    name = f"{field}[{i}]" if isinstance(v, list) else field
                    out.append(f"{path} ({name} of item {key}): " + ("is gone" if now is None else
                               f"sha256 {now[:12]}..., the run recorded {str(inp.get('sha256'))[:12]}..."))
    return out


def changed_adapters(run_dir: Path) -> List[str]:
    """The LoRA adapter files of ``run_dir`` (``manifest.json`` ``model.source.lora.adapters``: ``models.lora``) that
    are gone or no longer hash to their recorded sha256, one line each naming the file and the adapter."""
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for a in (((manifest.get("model") or {}).get("source") or {}).get("lora") or {}).get("adapters") or []:
        now = _sha(Path(str(a.get("path"))))
        if now != a.get("sha256"):
            out.append(f"{a.get('path')} (model.lora adapter {a.get('name')!r}): " + (
                "is gone" if now is None else f"sha256 {now[:12]}..., the run recorded {str(a.get('sha256'))[:12]}..."))
    return out


def check_inputs(run_dir: Path) -> None:
    """Refuse to reproduce a run whose input files changed since it ran (the re-run would compute other outputs, and
    comparing them would blame the runner).

    Raises:
        ReproInputError: naming every changed or missing input (row inputs, LoRA adapter files) and the fix
            (exit 2).
    """
    changed = changed_inputs(run_dir) + changed_adapters(run_dir)
    if changed:
        raise ReproInputError(f"{len(changed)} input file(s) of {run_dir} changed since it ran, so a re-run cannot "
                              "reproduce it:\n  " + "\n  ".join(changed) + "\nfix: restore those files (their "
                              "recorded sha256 is in items.jsonl's inputs, an adapter's in manifest.json's model.source.lora), or start a new "
                              "run")


def reproduce(run_dir: Any, new_dir: Any = None, tolerance_db: float = PARITY_TOLERANCE_DB,
              exact: Optional[bool] = None, timeout_s: Optional[float] = None) -> Tuple[int, Dict[str, Any]]:
    """Re-run ``run_dir`` into ``new_dir`` and compare. Returns ``(exit code, comparison)``.

    Either may be an object-storage URL (``s3://bucket/prefix``, ``runner.core.storage``): a URL original is pulled
    into a temporary dir first (its manifest, journals and every object an ok record names, each checked against its
    record's sha256: a missing or different object shows as ``original file missing``) and compared from there; a
    URL ``new_dir`` gets the re-run (``output.dir=<URL>``), staged in a new local dir the comparison reads.

    Raises:
        ReproInputError: ``run_dir`` holds no (readable) manifest.json, ``new_dir`` already holds a run, or an input
            file of the run changed since it ran (:func:`check_inputs`).
        runner.core.errors.ForeignDirError: ``new_dir`` is an existing folder holding files the runner did not write
            (``runner.core.rundir.check_own_dir``).
    """
    if storage.is_url(run_dir) or storage.is_url(new_dir):
        return _reproduce_url(str(run_dir), new_dir, tolerance_db, exact, timeout_s)
    return _reproduce(Path(run_dir), new_dir, tolerance_db, exact, timeout_s)


def _reproduce_url(run_dir: str, new_dir: Any, tolerance_db: float, exact: Optional[bool],
                   timeout_s: Optional[float]) -> Tuple[int, Dict[str, Any]]:
    """:func:`reproduce` where the original or the re-run is at a URL (its docstring)."""
    import shutil
    import tempfile

    pulled = None
    output = str(new_dir) if storage.is_url(new_dir) else None
    if output is not None:
        fs, root = storage.filesystem(output, "--out")
        storage.check_access(fs, root, output, "--out")
        if fs.exists(f"{root}/manifest.json"):
            raise ReproInputError(f"{output} already holds a run; fix: choose a new --out")
        new_dir = rundir.new_dir(Path("outputs/repro"))  # the re-run's staging dir
    try:
        if storage.is_url(run_dir):
            pulled = Path(tempfile.mkdtemp(prefix="runner-repro-"))
            from runner.core.sinks import recorded_files

            counts = storage.RunMirror(pulled, run_dir, "run_dir").pull(recorded_files)
            print(f"repro: pulled {run_dir} into {pulled} ({counts['objects']} object(s) verified, "
                  f"{counts['objects_missing']} missing or different)", flush=True)
        return _reproduce(pulled or Path(run_dir), new_dir, tolerance_db, exact, timeout_s, output, run_dir)
    finally:
        if pulled is not None:
            shutil.rmtree(pulled, ignore_errors=True)


def _reproduce(run_dir: Path, new_dir: Optional[Path], tolerance_db: float, exact: Optional[bool],
               timeout_s: Optional[float], output: Optional[str] = None,
               original: Optional[str] = None) -> Tuple[int, Dict[str, Any]]:
    """:func:`reproduce` of a local run dir (``output``: the re-run's URL, staged in ``new_dir``; ``original``: the
    URL ``run_dir`` was pulled from), named by their URLs in the result."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "manifest.json").exists():
        raise ReproInputError(f"{run_dir} holds no manifest.json; fix: pass the dir of a run (it holds "
                              "manifest.json)")
    try:
        manifest = json.loads((run_dir / "manifest.json").read_text())
    except ValueError as e:
        raise ReproInputError(f"{run_dir / 'manifest.json'} is not valid JSON ({e}); fix: pass a run dir "
                              "whose manifest is intact") from None
    status = rundir.effective_status(run_dir, manifest)
    if status == "running":
        raise ReproInputError(f"{run_dir} is still running ({rundir.describe((manifest.get('owner') or {}))}); "
                              "fix: reproduce it once it has ended")
    if new_dir is None:
        new_dir = rundir.new_dir(Path("outputs/repro"))  # created exclusively: never another re-run's dir
    new_dir = Path(new_dir).resolve()
    if (new_dir / "manifest.json").exists():
        raise ReproInputError(f"{new_dir} already holds a run; fix: choose a new --out")
    rundir.check_own_dir(new_dir, "--out")  # a user's folder: refused now (else repro_check.json lands there)
    check_inputs(run_dir)
    cmd = rerun_command(manifest, new_dir, output)
    env = {**os.environ, **rerun_environment(manifest)}
    import shlex

    cwd = manifest.get("cwd")  # where the original ran: relative paths in its overrides resolve as they did
    cwd = cwd if cwd and Path(cwd).is_dir() else None
    print("repro:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, env=env, timeout=timeout_s, cwd=cwd)
    result = compare(run_dir, new_dir, tolerance_db, exact)
    result["original"], result["rerun"] = original or result["original"], output or result["rerun"]
    if status == "crashed":
        result["notes"].insert(0, f"original status: crashed (its manifest says running but {run_dir} is held by "
                                  "no process: it ended without a final status); its finished items are compared")
    orig_code = 0 if manifest.get("status") == "completed" else None
    result["rerun_exit_code"] = p.returncode
    if orig_code == 0 and p.returncode != 0 and "rerun_refused" not in result:  # (a refusal names its exit)
        result["problems"].insert(0, f"the re-run exited {p.returncode} (the original completed)")
        result["ok"] = False
    if new_dir.is_dir():
        from runner.core.artifacts import atomic_write_json

        atomic_write_json(new_dir / "repro_check.json", result)
    return (0 if result["ok"] else 1), result


def sweep_jobs(sweep_dir: Path) -> List[Path]:
    """The job dirs of a sweep dir (its subdirs that hold a run's ``manifest.json``, in job order); empty when
    ``sweep_dir`` is a run dir itself or holds no job."""
    d = Path(sweep_dir)
    if (d / "manifest.json").exists() or not d.is_dir():
        return []
    jobs = [p for p in d.iterdir() if p.is_dir() and (p / "manifest.json").exists()]
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def _print_result(res: Dict[str, Any]) -> None:
    crit = "byte equality" if res["mode"] == "bytes" else f"PSNR >= {res['tolerance_db']:g} dB"
    print(f"\nrepro of {res['original']} -> {res['rerun']} (platform {res['platform']}; criterion: {crit})")
    print(format_table(res))
    if res.get("notes"):
        print("\nnotes (not failures):", *res["notes"], sep="\n  ")
    if res["problems"]:
        print("\nREPRO FAILED:", *res["problems"], sep="\n  ", file=sys.stderr)
    else:
        print(f"\nREPRO OK: {len(res['items'])} item(s) reproduced, backend resolution unchanged")


def _path_or_url(value: str) -> Any:
    """A command-line dir: an object-storage URL as given, else a local path."""
    return value if storage.is_url(value) else storage.local_path(value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.repro",
                                 description="Re-run a run from its manifest and compare the artifacts item by item.")
    ap.add_argument("run_dir", type=_path_or_url, help="a run dir, or a sweep dir (each of its jobs is reproduced), or "
                                                        "the URL of a run on object storage (s3://bucket/prefix)")
    ap.add_argument("--out", type=_path_or_url, default=None,
                    help="new run dir or object-storage URL (default: outputs/repro/<date>_<time>, as repro.sh)")
    ap.add_argument("--tolerance-db", type=float, default=PARITY_TOLERANCE_DB,
                    help="PSNR tolerance in dB for runs not on CPU (default %(default)g)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--exact", dest="exact", action="store_true", default=None,
                      help="require byte-identical files (default on CPU)")
    mode.add_argument("--psnr", dest="exact", action="store_false", help="use the PSNR tolerance even on CPU")
    a = ap.parse_args(argv)
    jobs = [] if storage.is_url(a.run_dir) else sweep_jobs(a.run_dir)  # a sweep dir: each job into <out>/<job>, one verdict per job, the worst exit code
    out = a.out if a.out is not None or not jobs else rundir.new_dir(Path("outputs/repro"))
    codes = []
    for run_dir, new_dir in ([(j, Path(out) / j.name) for j in jobs] if jobs else [(a.run_dir, out)]):
        try:
            code, res = reproduce(run_dir, new_dir, a.tolerance_db, a.exact)
        except RunnerError as e:
            print(f"repro: {type(e).__name__}: {e}", file=sys.stderr)
            return e.exit_code
        except (FileNotFoundError, FileExistsError) as e:
            print(f"repro: {e}", file=sys.stderr)
            return 2
        _print_result(res)
        codes.append(code)
    if jobs:
        print(f"\nrepro of sweep {a.run_dir}: {codes.count(0)} of {len(jobs)} job(s) reproduced -> {out}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
