"""Self-contained HTML report of sweeps and runs, built from what they wrote (manifests, ``job_status.json``,
``items.jsonl``, the images and videos) and nothing else.

``report.html`` carries everything inline: CSS, an SVG bar chart and the image thumbnails as base64 ``data:``
URIs (a video's thumbnail is its poster frame: the middle frame, decoded from the MP4), so it opens offline and
can be attached to a ticket. It shows:

* one row per job: overrides, outcome (``job_status.json``) and manifest status, the backend resolution of each
  field (selected implementation, what was requested and at which precedence layer), the evidence verdict,
  wall time (s), per-phase time (s: text encoding, denoising, VAE decode, writing), throughput (images/s) and
  peak memory (device bytes allocated by torch when recorded, else host peak RSS); refused/invalid jobs with
  their error message;
* parity of every job against a reference job (the first job with images, or ``reference``): per item PSNR
  (dB, ``inf`` when identical), SSIM (Wang et al. 2004) and the maximum absolute pixel difference (0..255); for a
  video, the PSNR of its worst frame, the SSIM of that frame and the maximum difference over all frames;
* an image grid of the same items across jobs, and a bar chart of images/s per job;
* per-item quality metrics (``runner.core.metrics``): their mean and quantiles per job, a histogram per job and
  metric, and speed against quality (images/s against the mean score, lossy jobs marked) over the jobs;
* the quality gate of lossy jobs (``runner.tools.gate``, its ``gate.json``): each lossy job (labelled ``lossy`` with its
  lanes in the jobs table: a step cache, FP8 linear, lossy attention) against the lossless job of the same rows;
* per-job details: the backend resolution table, evidence mismatches, failed items.

CLI: ``python -m runner.report <sweep_or_run_dirs...> [--out report.html] [--reference N]``.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import sys
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from runner.core import lossy, rundir
from runner.core.sinks import read_journal
from runner.core.errors import RunnerError, UserInputError

PARITY_TOLERANCE_DB = 40.0
"""Default parity tolerance: an item is within tolerance when its PSNR against the reference is >= this (dB)."""

PHASES = (("text_encode", "text enc."), ("denoise", "denoise"), ("vae_decode", "VAE dec."), ("write", "write"))
FIELDS = ("attention", "linear", "moe")
MAX_GRID_ITEMS = 24
THUMB_PX = 160


class RunDirError(UserInputError, FileNotFoundError):
    """A dir given to the report (or the matrix) is neither a run dir nor a sweep dir holding run dirs."""


class UnknownReferenceError(UserInputError, KeyError):
    """``--reference`` names no job, or a job with no images to compare against."""


# --------------------------------------------------------------------------------------------------------------
# Reading runs


@dataclass
class Job:
    """One run dir as the report sees it.

    Attributes:
        name: the dir name (a sweep's job number, e.g. ``"0"``).
        label: unique display name (``<sweep>/<job>`` when several dirs are reported).
        path: the run dir.
        group: the sweep dir it belongs to (the run dir itself for a standalone run).
        manifest: ``manifest.json`` (``{}`` when absent).
        status: ``job_status.json`` (``{}`` when absent: a plain ``python -m runner`` run that exited 0 has it too).
        items: the records of ``items.jsonl`` in file order.
    """

    name: str
    label: str
    path: Path
    group: Path
    manifest: Dict[str, Any] = field(default_factory=dict)
    status: Dict[str, Any] = field(default_factory=dict)
    items: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        """``job_status.json`` outcome, or one derived from the manifest status when the file is absent. A manifest
        at ``running`` (its run is alive) or ``crashed`` (it ended without a final status, see ``load_jobs``) wins:
        a ``job_status.json`` beside it is an earlier attempt's."""
        st = self.manifest.get("status")
        if st in ("running", "crashed"):
            return st
        if self.status.get("outcome"):
            return self.status["outcome"]
        return {"completed": "ok", "refused": "refused", "invalid": "invalid",
                "completed_with_failures": "failed_items"}.get(st, st or "unknown")

    @property
    def error(self) -> Optional[str]:
        """The recorded error message (refusals, bad input, crashes), if any."""
        err = self.manifest.get("error")
        if isinstance(err, dict):
            err = f"{err.get('type')}: {err.get('message')}"
        return self.status.get("error") or err

    @cached_property
    def ok_items(self) -> Dict[str, Dict[str, Any]]:
        """Item key -> record of every item written (``status: ok`` with a file)."""
        return {r["key"]: r for r in self.items if r.get("status") == "ok" and r.get("file")}

    def image_path(self, key: str) -> Path:
        """The item's artifact file (an image, or a video: :func:`is_video`)."""
        return self.path / self.ok_items[key]["file"]


def is_video(record: Dict[str, Any]) -> bool:
    """The record's artifact is a video (an MP4 of ``runner.core.sinks.MP4Sink``)."""
    return str(record.get("file") or "").endswith(".mp4")


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def read_manifest(run_dir: Path) -> Dict[str, Any]:
    """``run_dir/manifest.json`` (``{}`` when absent), with ``status: running`` replaced by ``crashed`` when the
    run that wrote it is no longer alive (``runner.core.rundir.effective_status``: its process ended without writing a
    final status); the recorded status is kept as ``recorded_status``."""
    doc = _read_json(Path(run_dir) / "manifest.json")
    st = rundir.effective_status(run_dir, doc) if doc else None
    if doc and st != doc.get("status"):
        doc = {**doc, "status": st, "recorded_status": doc.get("status")}
    return doc


def is_run_dir(d: Path) -> bool:
    """A run dir holds ``manifest.json`` or ``job_status.json``."""
    return (d / "manifest.json").exists() or (d / "job_status.json").exists()


def _job_sort_key(p: Path) -> tuple:
    return (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name)


def load_jobs(dirs: Iterable[Path]) -> List[Job]:
    """The jobs of sweep dirs (their run-dir children, in job-number order) and of run dirs, in argument order.

    Raises:
        RunDirError: a dir is neither a run dir nor a sweep dir holding run dirs.
    """
    dirs = [Path(d) for d in dirs]
    found: List[tuple] = []
    for d in dirs:
        if is_run_dir(d):
            found.append((d, d))
            continue
        kids = sorted((p for p in d.iterdir() if p.is_dir() and is_run_dir(p)), key=_job_sort_key) \
            if d.is_dir() else []
        if not kids:
            raise RunDirError(f"{d} is neither a run dir (manifest.json / job_status.json) nor a sweep dir "
                              "holding run dirs; fix: pass a run dir or a sweep dir (outputs/runs/... or "
                              "outputs/multirun/...)")
        found.extend((k, d) for k in kids)
    several = len(dirs) > 1
    jobs: List[Job] = []
    for path, group in found:
        label = path.name if not several or path == group else f"{group.name}/{path.name}"
        if any(j.label == label for j in jobs):  # same names under different parents
            label = f"{label}#{len(jobs)}"
        jobs.append(Job(name=path.name, label=label, path=path, group=group,
                        manifest=read_manifest(path), status=_read_json(path / "job_status.json"),
                        items=read_journal(path / "items.jsonl")))
    return jobs


def pick_reference(jobs: Sequence[Job], reference: Any = None) -> Optional[Job]:
    """The parity reference: the job whose name, label or path is ``reference`` (an int job number works), else
    the first job with written images. None when no job has images.

    Raises:
        UnknownReferenceError: ``reference`` names no job, or a job with no images.
    """
    if reference is not None and str(reference) != "":
        ref = str(reference)
        for j in jobs:
            if ref in (j.name, j.label, str(j.path)):
                if not j.ok_items:
                    raise UnknownReferenceError(f"reference job {ref!r} has no images (outcome {j.outcome}); "
                                                "fix: name a job with written images")
                return j
        raise UnknownReferenceError(f"reference={ref!r} names no job; fix: one of "
                                    f"{', '.join(j.label for j in jobs)}")
    return next((j for j in jobs if j.ok_items), None)


# --------------------------------------------------------------------------------------------------------------
# Image metrics


def load_rgb(path: Path) -> np.ndarray:
    """An image file as a ``uint8`` array of shape (height, width, 3)."""
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 255.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(peak^2 / MSE)``; ``inf`` when the images are identical."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(peak * peak / mse)


def ssim(a: np.ndarray, b: np.ndarray, peak: float = 255.0, win: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (SSIM) of two images (H, W, C) or frame stacks (N, H, W, C), unitless, 1.0 when
    identical; the one implementation of the report's parity and of ``runner.tools.gate`` (torchmetrics'
    ``structural_similarity_index_measure``, in float32).

    float32, not float64: torch has no fast CPU kernel for a grouped float64 convolution (torchmetrics filters the
    five local-statistics maps with one), so a 1024^2 RGB pair took 23 s in float64 on 2 CPU cores against 0.23 s in
    float32 (2026-12-06; 16 FLUX.1-dev images of ``benchmarks/memory_lanes.py``'s int8wo lane took over 2 minutes on
    the H200 host's 16 cores), which made a gate over 1,000 such items take hours. The float32 value differs from
    float64's by ~2e-7 (the local variances ``E[x^2] - mu^2`` lose ~7 significant digits to cancellation at
    ``L = 255``; ``C2 = (0.03 L)^2`` keeps the ratio well conditioned), below the 5 decimals records carry.

    Z. Wang, A. C. Bovik, H. R. Sheikh, E. P. Simoncelli, "Image quality assessment: from error visibility to
    structural similarity", IEEE Trans. Image Processing 13(4):600-612, 2004: per channel, local statistics under
    an 11x11 Gaussian window (sigma 1.5), ``C1 = (0.01 L)^2``, ``C2 = (0.03 L)^2`` with L = ``peak``, averaged
    over the map and the channels (and the frames). Images smaller than the window use the largest odd window
    that fits.

    Raises:
        ValueError: the shapes differ.
    """
    import torch
    from torchmetrics.functional.image import structural_similarity_index_measure

    if a.shape != b.shape:
        raise ValueError(f"SSIM needs equal shapes, got {a.shape} and {b.shape}")
    x = torch.from_numpy(np.asarray(a, dtype=np.float32))
    y = torch.from_numpy(np.asarray(b, dtype=np.float32))
    x, y = (x[None], y[None]) if x.dim() == 3 else (x, y)
    x, y = x.permute(0, 3, 1, 2), y.permute(0, 3, 1, 2)  # (N, C, H, W)
    win = min(win, x.shape[2], x.shape[3])
    win -= (win + 1) % 2  # odd
    return float(structural_similarity_index_measure(x, y, kernel_size=win, sigma=sigma, data_range=peak))


def load_frames(path: Path) -> np.ndarray:
    """A video file's decoded frames (``runner.core.video.decode_mp4``), ``uint8`` (F, H, W, 3)."""
    from runner.core.video import decode_mp4

    return decode_mp4(path)


def compare_videos(a: np.ndarray, b: np.ndarray) -> Dict[str, Any]:
    """``{psnr_db, ssim, max_abs_diff, worst_frame}`` of two ``uint8`` videos (F, H, W, 3), frame by frame:
    ``psnr_db`` of the worst frame (dB, ``inf`` when every frame is identical), ``ssim`` of that frame,
    ``max_abs_diff`` over all frames (0..255), ``worst_frame`` its index; or ``{error}`` when their shapes (frame
    count, size) differ."""
    if a.shape != b.shape:
        return {"psnr_db": None, "ssim": None, "max_abs_diff": None, "error": f"frames {a.shape} vs {b.shape}"}
    if np.array_equal(a, b):
        return {"psnr_db": math.inf, "ssim": 1.0, "max_abs_diff": 0, "worst_frame": None}
    per = [psnr(x, y) for x, y in zip(a, b)]
    k = int(np.argmin(per))
    return {"psnr_db": per[k], "ssim": ssim(a[k], b[k]), "worst_frame": k,
            "max_abs_diff": int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())}


def compare_files(a: Path, b: Path) -> Dict[str, Any]:
    """:func:`compare_videos` of two MP4 files, :func:`compare_images` of two images."""
    if str(a).endswith(".mp4") or str(b).endswith(".mp4"):
        return compare_videos(load_frames(a), load_frames(b))
    return compare_images(load_rgb(a), load_rgb(b))


def compare_images(a: np.ndarray, b: np.ndarray) -> Dict[str, Any]:
    """``{psnr_db, ssim, max_abs_diff}`` of two uint8 images (max_abs_diff in pixel levels 0..255), or
    ``{error}`` when their shapes differ."""
    if a.shape != b.shape:
        return {"psnr_db": None, "ssim": None, "max_abs_diff": None, "error": f"shape {a.shape} vs {b.shape}"}
    if np.array_equal(a, b):
        return {"psnr_db": math.inf, "ssim": 1.0, "max_abs_diff": 0}
    return {"psnr_db": psnr(a, b), "ssim": ssim(a, b),
            "max_abs_diff": int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())}


def item_difference(r: Dict[str, Any], s: Dict[str, Any]) -> Optional[str]:
    """What makes two item records different requests, named (``seed 1 vs 2``, ``prompt``,
    ``params.width 64 vs 32``: the first of seed, prompt and the generation parameters, batch size aside), or None
    when they describe the same request."""
    if r.get("seed") != s.get("seed"):
        return f"seed {r.get('seed')} vs {s.get('seed')}"
    if r.get("prompt_sha256") != s.get("prompt_sha256"):
        return "prompt"
    p, q = r.get("params") or {}, s.get("params") or {}
    for k in sorted(set(p) | set(q)):
        if k != "batch_size" and json.dumps(p.get(k), sort_keys=True) != json.dumps(q.get(k), sort_keys=True):
            return f"params.{k} {p.get(k, '(none)')} vs {q.get(k, '(none)')}"
    return None


def same_item(r: Dict[str, Any], s: Dict[str, Any]) -> bool:
    """Two item records describe the same request (seed, prompt and generation parameters; batch size aside)."""
    return item_difference(r, s) is None


def model_difference(ref: "Job", job: "Job") -> Optional[str]:
    """``model tiny_flux vs toy_shapes`` when two jobs ran different models (``config.model.name`` of their
    manifests), else None: their items are never comparable, whatever their seeds and prompts."""
    def name(j: "Job") -> Any:
        return (((j.manifest or {}).get("config") or {}).get("model") or {}).get("name")

    a, b = name(ref), name(job)
    return f"model {a} vs {b}" if a != b else None


def not_comparable(ref: "Job", job: "Job", r: Dict[str, Any], s: Dict[str, Any]) -> Optional[str]:
    """The note of an item pair that is not compared (``not comparable (model a vs b)``, ``not comparable (seed
    1 vs 2)``), or None when it is."""
    why = model_difference(ref, job) or item_difference(r, s)
    return f"not comparable ({why})" if why else None


def parity(ref: Job, job: Job, tolerance_db: float = PARITY_TOLERANCE_DB) -> List[Dict[str, Any]]:
    """Per-item parity of ``job`` against ``ref`` over the reference's written items.

    Returns:
        One dict per reference item: ``key``, ``psnr_db`` (dB, ``inf`` if identical), ``ssim``, ``max_abs_diff``
        (0..255), ``within`` (PSNR >= ``tolerance_db``) and ``note`` for items missing or not comparable (another
        model, seed, prompt or size, named by :func:`not_comparable`: no metric, ``within`` None).
    """
    out = []
    mine = job.ok_items
    for key, r in ref.ok_items.items():
        row: Dict[str, Any] = {"key": key, "psnr_db": None, "ssim": None, "max_abs_diff": None, "within": None}
        if key not in mine:
            row.update(note="missing", within=False)
        elif not_comparable(ref, job, r, mine[key]):
            row.update(note=not_comparable(ref, job, r, mine[key]))
        else:
            m = compare_files(ref.image_path(key), job.image_path(key))
            row.update(m)
            row["within"] = m["psnr_db"] is not None and m["psnr_db"] >= tolerance_db
            if m.get("error"):
                row["note"] = m.pop("error")
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------------------------
# Summaries of manifest sections


def backend_summary(sel: Any) -> Optional[str]:
    """A selected/resolved backend value as text: a name, or ``role:name`` pairs when roles differ; None if n/a."""
    if sel is None:
        return None
    if isinstance(sel, dict):
        names = {r: (v.get("backend") if isinstance(v, dict) else v) for r, v in sel.items()}
        extras = {r: {k: x for k, x in v.items() if k != "backend" and x is not None}
                  for r, v in sel.items() if isinstance(v, dict)}
        extra = "".join(f" {r}[{', '.join(f'{k}={x}' for k, x in e.items())}]" for r, e in extras.items() if e)
        uniq = set(names.values())
        base = next(iter(uniq)) if len(uniq) == 1 else ", ".join(f"{r}:{n}" for r, n in names.items())
        return f"{base}{extra}"
    return str(sel)


def backend_fields(m: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """field -> one entry per stage: ``{stage, requested, layer, selected, resolved, reason}`` from the manifest's
    ``backends`` section (empty for runs refused before resolution)."""
    out: Dict[str, List[Dict[str, Any]]] = {f: [] for f in FIELDS}
    for stage, fields in (m.get("backends") or {}).items():
        for f, r in (fields or {}).items():
            out.setdefault(f, []).append({"stage": stage, "requested": r.get("requested"), "layer": r.get("layer"),
                                          "selected": backend_summary(r.get("selected")),
                                          "resolved": backend_summary(r.get("resolved")),
                                          "reason": r.get("reason"), "warnings": r.get("warnings") or []})
    return out


def memory_summary(m: Dict[str, Any]) -> Optional[Tuple[str, str]]:
    """``(MiB, what)``: peak device memory allocated by torch when recorded, else host peak RSS; None if neither."""
    mem = m.get("memory") or {}
    if mem.get("device_peak_allocated_bytes") is not None:
        return f"{mem['device_peak_allocated_bytes'] / 2**20:,.0f} MiB", "device allocated"
    if mem.get("host_peak_rss_bytes") is not None:
        return f"{mem['host_peak_rss_bytes'] / 2**20:,.0f} MiB", "host RSS"
    return None


def device_summary(m: Dict[str, Any]) -> str:
    """``kind: device name [sm]`` from the manifest's platform section."""
    p = m.get("platform") or {}
    if not p or "error" in p:
        return "unknown"
    name = (p.get("probes") or {}).get("device_name") or p.get("device")
    cap = p.get("capability")
    return f"{p.get('kind')}: {name}" + (f" {cap}" if cap else "")


# --------------------------------------------------------------------------------------------------------------
# HTML

CSS = """
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#1d2330;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dce3;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
.meta{color:#5b6475;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0 10px;font-size:12.5px}
th,td{border:1px solid #d8dce3;padding:4px 7px;text-align:left;vertical-align:top}
th{background:#f2f4f7;font-weight:600;white-space:nowrap}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.jobs{width:100%;table-layout:auto}
table.jobs td.ovr{min-width:160px;max-width:300px;overflow-wrap:anywhere}
table.jobs td.acc{min-width:120px;max-width:220px}
table.jobs th{white-space:normal}
table.jobs .badge{white-space:normal}table.jobs td.num .badge{display:block;margin-top:2px;text-align:left}
.scroll{overflow-x:auto;max-width:100%}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.sub{display:block;color:#5b6475;font-size:11.5px}
.err{color:#9b1c1c;font-size:12px;overflow-wrap:anywhere;display:block}
.badge{display:inline-block;padding:1px 7px;border-radius:9px;font-size:11.5px;font-weight:600;white-space:nowrap}
.ok{background:#dcf3e3;color:#17602d}.bad{background:#fbe0e0;color:#9b1c1c}
.warn{background:#fdf0d5;color:#7a4b00}.info{background:#e4ebf7;color:#1f4a8a}
.grid{display:grid;gap:10px;align-items:start}
.grid .cell{border:1px solid #d8dce3;border-radius:4px;padding:4px;text-align:center;font-size:11.5px;background:#fafbfc}
.grid .head{font-weight:600;font-size:12px;text-align:center;align-self:end;overflow-wrap:anywhere}
.grid .key{font-weight:600;font-size:12px;align-self:center;overflow-wrap:anywhere}
.grid img{display:block;margin:0 auto 3px;max-width:100%;height:auto}
.grid .empty{color:#8a93a3;padding:20px 0}
details{margin:6px 0 14px}summary{cursor:pointer;font-weight:600}
.card{border:1px solid #d8dce3;border-radius:6px;padding:8px 12px;margin:10px 0}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
"""

_OUTCOME_CLASS = {"ok": "ok", "refused": "info", "invalid": "bad", "failed_items": "bad", "evidence_mismatch": "bad",
                  "crashed": "bad", "interrupted": "warn", "unknown": "warn"}
_VERDICT_CLASS = {"verified": "ok", "not_collected": "warn", "mismatch": "bad"}
_GATE_CLASS = {"pass": "ok", "fail": "bad", "unmatched": "bad", "not_run": "bad", "skipped": "info",
               "unchecked": "warn", "none": "info"}


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _badge(text: Any, cls: str) -> str:
    return f'<span class="badge {cls}">{_e(text)}</span>'


def _num(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def fmt_psnr(x: Optional[float]) -> str:
    """PSNR as text in dB (``inf`` when identical)."""
    return "—" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}")


def _thumb(path: Path, px: int = THUMB_PX, num_frames: Optional[int] = None) -> str:
    """A JPEG preview (longest side ``px`` pixels, quality 90) as a ``data:`` URI; of a video (``.mp4``), its
    poster frame (``runner.core.video.poster``: the middle of ``num_frames``). Parity metrics are computed on the
    full-size files, never on previews."""
    from PIL import Image

    if str(path).endswith(".mp4"):
        from runner.core.video import poster

        im = Image.fromarray(poster(path, num_frames))
    else:
        with Image.open(path) as f:
            im = f.convert("RGB")
    im.thumbnail((px, px))
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _input_thumbs(rec: Dict[str, Any]) -> str:
    """A conditioned item's input files (``inputs``: image, mask, references) as small previews before its output,
    each titled with its field, path and sha256; an input that is gone or no file (an image cell's bytes) is named,
    not shown."""
    out = []
    for field, v in (rec.get("inputs") or {}).items():
        for inp in v if isinstance(v, list) else [v]:
            p = Path(str(inp.get("path") or ""))
            title = _e(f"input {field}: {inp.get('path')} (sha256 {str(inp.get('sha256'))[:12]}...)")
            if p.is_file():
                out.append(f'<img class="input" style="width:48%" alt="{_e(field)}" title="{title}" '
                           f'src="{_thumb(p, THUMB_PX // 2)}">')
            else:
                out.append(f'<span class="sub" title="{title}">{_e(field)}: not a file here</span>')
    return (f'<div class="inputs">{"".join(out)}<span class="sub">input{"s" if len(out) > 1 else ""} → output'
            '</span></div>') if out else ""


def throughput(m: Dict[str, Any]) -> Tuple[Optional[float], str]:
    """``(value, unit)`` of a manifest's generation throughput: ``images/s``, ``videos/s`` or ``items/s``
    (``timing.<unit>_per_s``); ``(None, "images/s")`` when none was recorded."""
    t = m.get("timing") or {}
    for unit in ("images", "videos", "items"):
        if t.get(f"{unit}_per_s") is not None:
            return t[f"{unit}_per_s"], f"{unit}/s"
    return None, "images/s"


def _common_overrides(jobs: Sequence[Job]) -> List[str]:
    lists = [j.manifest.get("overrides") or [] for j in jobs if j.manifest]
    if not lists:
        return []
    return [o for o in lists[0] if all(o in lst for lst in lists[1:])]


def _bar_chart(jobs: Sequence[Job]) -> str:
    """Inline SVG: a horizontal bar of images/s (videos/s of video jobs) per job (jobs without throughput are
    labelled, no bar)."""
    label_w, bar_w, row_h, top = 150, 520, 26, 24
    rates = [(j, *throughput(j.manifest)) for j in jobs]
    vals = [(j, v) for j, v, _ in rates]
    units = " · ".join(dict.fromkeys(u for _, v, u in rates if v is not None)) or "images/s"
    vmax = max([v for _, v in vals if v] or [1.0])
    h = top + row_h * len(vals) + 26
    parts = [f'<svg width="{label_w + bar_w + 110}" height="{h}" role="img" '
             f'aria-label="images per second per job">',
             f'<text x="{label_w}" y="14" font-size="12" fill="#5b6475">{units} (generation time only: text '
             f'encoding + denoising + VAE decode)</text>']
    for i, (j, v, unit) in enumerate(rates):
        y = top + i * row_h
        parts.append(f'<text x="{label_w - 8}" y="{y + 16}" font-size="12" text-anchor="end">'
                     f'{_e(j.label[:22])}</text>')
        if v:
            w = max(1.0, bar_w * v / vmax)
            parts.append(f'<rect x="{label_w}" y="{y + 4}" width="{w:.1f}" height="{row_h - 8}" fill="#4a78c2">'
                         f'<title>{_e(j.label)}: {v:.4g} {unit}</title></rect>')
            parts.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 16}" font-size="12">{v:.3g}</text>')
        else:
            parts.append(f'<text x="{label_w + 4}" y="{y + 16}" font-size="12" fill="#8a93a3">'
                         f'{_e(j.outcome)} (no throughput)</text>')
    axis_y = top + row_h * len(vals) + 2
    parts.append(f'<line x1="{label_w}" y1="{top}" x2="{label_w}" y2="{axis_y}" stroke="#5b6475"/>')
    parts.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + bar_w}" y2="{axis_y}" stroke="#5b6475"/>')
    for frac in (0, 0.5, 1):
        x = label_w + bar_w * frac
        parts.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#5b6475"/>')
        parts.append(f'<text x="{x:.1f}" y="{axis_y + 17}" font-size="11" text-anchor="middle" fill="#5b6475">'
                     f'{vmax * frac:.3g}</text>')
    parts.append("</svg>")
    return "".join(parts)


#: The jobs table's columns after job, overrides and outcome: what a user looks for first (the evidence verdict, the
#: oracle's accuracy) comes before the backends, times and memory, so that it is on screen at 1400 px whatever the
#: other columns hold.
JOB_COLUMNS = ("evidence", "oracle accuracy", *FIELDS, "wall s", *(f"{lbl} s" for _, lbl in PHASES), "images/s",
               "peak memory", "metrics (mean)")


def _jobs_table(jobs: Sequence[Job], common: Sequence[str]) -> str:
    head = "<tr><th>job</th><th>overrides</th><th>outcome / status</th>" + "".join(
        f"<th>{c}</th>" for c in JOB_COLUMNS) + "</tr>"
    rows = []
    for n_job, j in enumerate(jobs):
        m = j.manifest
        ovr = [o for o in (m.get("overrides") or []) if o not in common]
        cells = [f"<td><b>{_e(j.label)}</b></td>",
                 '<td class="ovr mono">' + ("<br>".join(_e(o).replace("=", "=<wbr>") for o in ovr)
                                            or "<i>(common only)</i>") + "</td>"]
        oc = _badge(j.outcome, _OUTCOME_CLASS.get(j.outcome, "warn"))
        st = f'<span class="sub">status: {_e(m.get("status", "—"))}</span>' + _lossy_note(m)
        cells.append(f"<td>{oc}{st}</td>")
        bf = backend_fields(m)
        if not any(bf.values()) and not m.get("timing"):  # stopped before resolution: the error fills the row
            cells.append(f'<td colspan="{len(JOB_COLUMNS)}"><span class="err">{_e(j.error or "no record")}</span></td>')
            rows.append("<tr>" + "".join(cells) + "</tr>")
            continue
        if j.error:
            cells[-1] = f'<td>{oc}{st}<span class="err">{_e(j.error)}</span></td>'
        ev = m.get("evidence") or {}
        if ev:
            v = ev.get("verdict", "—")
            fin = "" if ev.get("all_finite", True) else '<span class="sub">non-finite outputs</span>'
            by = attempts_summary(m)  # a resumed job: the verdict covers only what this attempt wrote
            fin += f'<span class="sub">{_e(by)}</span>' if by else ""
            cells.append(f"<td>{_badge(v, _VERDICT_CLASS.get(v, 'warn'))}{fin}</td>")
        else:
            cells.append("<td>—</td>")
        cells.append(f'<td class="acc">{_e(accuracy_summary(m) or "—")}</td>')
        cells.extend(_backend_cells(bf))
        t = m.get("timing") or {}
        ph = t.get("phases_s") or {}
        cells.append(f'<td class="num">{_num(t.get("wall_s"), "{:.2f}")}{warmup_note(m, first=n_job == 0)}</td>')
        cells.extend(f'<td class="num">{_num(ph.get(k))}</td>' for k, _ in PHASES)
        rate, unit = throughput(m)
        sub = f'<span class="sub">{unit}</span>' if unit != "images/s" and rate is not None else ""
        cells.append(f'<td class="num">{_num(rate, "{:.3f}")}{sub}</td>')
        mem = memory_summary(m)
        cells.append(f'<td class="num">{_e(mem[0])}<span class="sub">{_e(mem[1])}</span></td>' if mem
                     else '<td class="num">—</td>')
        cells.append(f"<td>{_e(metrics_summary(m) or '—')}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table class="jobs sortable">{head}{"".join(rows)}</table></div>'


def _backend_cells(bf: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """One cell per backend field (:data:`FIELDS`): the selected implementation per stage, what was requested and
    the precedence layer that set it."""
    cells = []
    for f in FIELDS:
        entries = bf.get(f) or []
        if not entries:
            cells.append("<td>—</td>")
            continue
        txt = []
        for en in entries:
            stage = f"{en['stage']}: " if len(entries) > 1 else ""
            txt.append(f"{_e(stage)}<b>{_e(en['selected'] or 'n/a')}</b>"
                       f'<span class="sub">requested {_e(en["requested"])} · {_e(en["layer"])}</span>')
        cells.append("<td>" + "".join(txt) + "</td>")
    return cells


def accuracy_summary(m: Dict[str, Any]) -> Optional[str]:
    """The oracle's accuracy of a job (``runner.app.console.accuracy_summary`` of the manifest's ``accuracy``: the
    phrase the run's last console line carries too); None without an oracle."""
    from runner.app.console import accuracy_summary as phrase

    return phrase(m.get("accuracy") or {})


def attempts_summary(m: Dict[str, Any]) -> Optional[str]:
    """Which attempts wrote a resumed job's items (``runner.app.console.attempts_summary`` of the manifest's
    ``items_by_attempt``: the phrase the run's last console line carries too); None when this attempt wrote them
    all."""
    from runner.app.console import attempts_summary as phrase

    by = m.get("items_by_attempt")
    return phrase(by) if isinstance(by, list) else None


def metric_stats(m: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The manifest's per-item metric summary (``metrics.summary``: name -> {n, mean, p10...}) of scored names."""
    return {k: v for k, v in ((m.get("metrics") or {}).get("summary") or {}).items()
            if isinstance(v, dict) and v.get("n")}


def metrics_summary(m: Dict[str, Any]) -> Optional[str]:
    """The job's per-item metrics (``runner.core.metrics``): ``clip_score 31.2 (p10 28.1 · p90 33.9, n 24)``; None
    when nothing was scored."""
    stats = metric_stats(m)
    if not stats:
        return None
    return " · ".join(f"{k} {v['mean']:.4g} (p10 {v.get('p10', v['mean']):.4g} · p90 {v.get('p90', v['mean']):.4g}, "
                      f"n {v['n']})" for k, v in stats.items())


def _histogram(name: str, values: Sequence[float], bins: int = 10) -> str:
    """Inline SVG: the histogram of one metric's per-item scores of a job (``bins`` equal-width bins)."""
    w, h, top, left = 320, 110, 16, 30
    counts, edges = np.histogram(np.asarray(values, dtype=np.float64), bins=bins)
    cmax = max(int(counts.max()), 1)
    bw = w / bins
    parts = [f'<svg width="{left + w + 10}" height="{top + h + 30}" role="img" aria-label="histogram of {_e(name)}">',
             f'<text x="{left}" y="12" font-size="12" fill="#5b6475">{_e(name)}: {len(values)} items</text>']
    for i, c in enumerate(counts):
        bh = h * int(c) / cmax
        parts.append(f'<rect x="{left + i * bw:.1f}" y="{top + h - bh:.1f}" width="{bw - 1:.1f}" height="{bh:.1f}" '
                     f'fill="#4a78c2"><title>{edges[i]:.4g} .. {edges[i + 1]:.4g}: {int(c)}</title></rect>')
    parts.append(f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#5b6475"/>')
    for x, v in ((left, edges[0]), (left + w, edges[-1])):
        parts.append(f'<text x="{x}" y="{top + h + 14}" font-size="11" text-anchor="middle" fill="#5b6475">'
                     f'{v:.4g}</text>')
    parts.append(f'<text x="{left - 4}" y="{top + 10}" font-size="11" text-anchor="end" fill="#5b6475">{cmax}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _metric_histograms(j: "Job") -> str:
    """Per metric the job scored: the histogram of its items' scores (the records' ``metrics``)."""
    names = list(metric_stats(j.manifest))
    out = []
    for n in names:
        vals = [float(r["metrics"][n]) for r in j.ok_items.values() if (r.get("metrics") or {}).get(n) is not None]
        if vals:
            out.append(_histogram(n, vals))
    return "<p><b>per-item metrics</b></p>" + "".join(out) if out else ""


def _speed_quality(jobs: Sequence["Job"]) -> str:
    """Inline SVG per metric: each job as a point at (throughput, mean score), lossy jobs in orange, labelled; the
    lanes of a sweep side by side (a lossless reference among them)."""
    names = list(dict.fromkeys(n for j in jobs for n in metric_stats(j.manifest)))
    if not names:
        return "<p>No job was scored with a per-item metric (<code>metrics.names=[clip_score]</code> or " \
               "<code>python -m runner.score</code>).</p>"
    out = []
    for n in names:
        pts = [(j, throughput(j.manifest)[0], metric_stats(j.manifest).get(n, {}).get("mean")) for j in jobs]
        pts = [(j, x, y) for j, x, y in pts if x is not None and y is not None]
        if pts:
            out.append(_scatter(n, pts))
    return "".join(out) or "<p>No scored job recorded a throughput.</p>"


def axis_range(values: Sequence[float], from_zero: bool = False) -> Tuple[float, float]:
    """``(lo, hi)`` of a plot axis over ``values``: never empty, whatever they are. Distinct values get 5 % of their
    span either side (``from_zero``: the axis starts at 0, as a rate's does); values that are all equal (or equal
    but for rounding, a span below 1e-9 of their magnitude) get 5 % of their magnitude either side, 1 when they are
    0 (a rate's axis then stays at 0 .. 1)."""
    lo, hi = min(values), max(values)
    if from_zero:
        lo = min(lo, 0.0)
    scale = max(abs(lo), abs(hi))
    if hi - lo <= 1e-9 * scale or hi == lo:
        pad = 0.05 * scale if scale > 0 else 1.0
        return (0.0, max(hi, 0.0) + pad) if from_zero and lo >= 0 else (lo - pad, hi + pad)
    margin = 0.05 * (hi - lo)
    return (lo if from_zero and lo == 0 else lo - margin), hi + margin


def tick_labels(lo: float, hi: float) -> Tuple[str, str]:
    """The two end labels of an axis, with as many significant digits (3 to 12) as it takes to tell them apart."""
    for digits in range(3, 13):
        a, b = f"{lo:.{digits}g}", f"{hi:.{digits}g}"
        if a != b:
            return a, b
    return f"{lo!r}", f"{hi!r}"


def _scatter(name: str, pts: Sequence[Tuple["Job", float, float]]) -> str:
    w, h, left, top = 460, 220, 60, 20
    xs, ys = [p[1] for p in pts], [p[2] for p in pts]
    x0, x1 = axis_range(xs, from_zero=True)
    y0, y1 = axis_range(ys)
    same = f" (every job: {ys[0]:.5g})" if len(ys) > 1 and max(ys) - min(ys) <= 1e-9 * max(map(abs, ys)) else ""
    parts = [f'<svg width="{left + w + 140}" height="{top + h + 40}" role="img" aria-label="speed against {_e(name)}">',
             f'<text x="{left}" y="12" font-size="12" fill="#5b6475">{_e(name)} (mean) against images/s{same}</text>',
             f'<line x1="{left}" y1="{top + h}" x2="{left + w}" y2="{top + h}" stroke="#5b6475"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + h}" stroke="#5b6475"/>']
    for v, frac in zip(tick_labels(x0, x1), (0, 1)):
        parts.append(f'<text class="xtick" x="{left + w * frac:.1f}" y="{top + h + 14}" font-size="11" '
                     f'text-anchor="middle" fill="#5b6475">{v}</text>')
    for v, frac in zip(tick_labels(y0, y1), (0, 1)):
        parts.append(f'<text class="ytick" x="{left - 4}" y="{top + h - h * frac:.1f}" font-size="11" '
                     f'text-anchor="end" fill="#5b6475">{v}</text>')
    for j, x, y in pts:
        cx = left + w * (x - x0) / (x1 - x0)
        cy = top + h - h * (y - y0) / (y1 - y0)
        colour = "#d9822b" if lossy.of_manifest(j.manifest)["lossy"] else "#4a78c2"
        parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="{colour}"><title>{_e(j.label)}: {x:.4g} '
                     f'images/s, {name} {y:.5g}</title></circle>'
                     f'<text x="{cx + 8:.1f}" y="{cy + 4:.1f}" font-size="11">{_e(j.label[:22])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def warmup_note(m: Dict[str, Any], first: bool) -> str:
    """Under the wall time: the job's warm-up seconds (``timing.warmup_s``) and, for the sweep's first job, a flag:
    it pays what later jobs of the same process reuse (a cold compile cache, the first load of the weights), so
    its wall time is not comparable with theirs."""
    w = (m.get("timing") or {}).get("warmup_s")
    note = f'<span class="sub">warm-up {w:.2f} s</span>' if isinstance(w, (int, float)) and w > 0 else ""
    if first:
        note += _badge("first job: includes cold-start warm-up", "warn")
    return note


def _lossy_note(m: Dict[str, Any]) -> str:
    """A ``lossy`` badge with the lossy lanes of a job (``runner.core.lossy``), or nothing for a lossless one."""
    if not m:
        return ""
    lab = lossy.of_manifest(m)
    if not lab["lossy"]:
        return ""
    return f'<br>{_badge("lossy", "warn")}<span class="sub mono">{_e(", ".join(lab["lanes"]))}</span>'


def _gate_section(jobs: Sequence[Job], gate: Optional[Dict[str, Any]]) -> str:
    """The quality gate of the lossy jobs (``runner.tools.gate``: ``gate.json``)."""
    lossy_jobs = [j for j in jobs if j.manifest and lossy.of_manifest(j.manifest)["lossy"]]
    if gate is None:
        if not lossy_jobs:
            return "<p>No job is lossy (no step cache, FP8 linear or lossy attention): nothing to gate.</p>"
        return ("<p>Lossy jobs: " + ", ".join(_e(j.label) for j in lossy_jobs) + ". Not gated yet: run "
                "<code>python -m runner.gate &lt;dir&gt;</code>, then regenerate this report.</p>")
    out = [f"<p>Each lossy job against the lossless job of the same rows: oracle accuracy per attribute must stay "
           f"≥ {gate.get('min_ratio')}× the lossless job's; PSNR (dB) and SSIM per item via torchmetrics"
           + (f", PSNR ≥ {gate['min_psnr_db']} dB required" if gate.get("min_psnr_db") is not None else
              " (reported)") + f". Verdict: {_badge(gate.get('verdict'), _GATE_CLASS.get(gate.get('verdict'), 'warn'))}"
           "</p>",
           "<table><tr><th>lossy job</th><th>lanes</th><th>lossless job</th><th>accuracy lossy / lossless (ratio)"
           "</th><th>metrics lossy / lossless (ratio)</th><th>min PSNR dB</th><th>min SSIM</th><th>cache hit rate</th>"
           "<th>verdict</th></tr>"]
    for e in gate.get("jobs") or []:
        acc = e.get("accuracy") or {}
        acc_txt = "<br>".join(f"{_e(k)}: {a['lossy']:.3g} / {a['lossless']:.3g} ({a['ratio']})" for k, a in acc.items())
        met_txt = "<br>".join(_e(f"{k}: not scored") if "error" in mt else _e(
            f"{k}: {mt['lossy']:.4g} / {mt['lossless']:.4g} ({mt['ratio']}; floor {mt['floor']:g}, min item "
            f"{mt['min_item_ratio']})") for k, mt in (e.get("metrics") or {}).items())
        why = "".join(f'<span class="sub">{_e(r)}</span>' for r in e.get("reasons") or [])
        out.append(f"<tr><td><b>{_e(e.get('lossy_job'))}</b></td><td class=mono>{_e(', '.join(e.get('lanes') or []))}"
                   f"</td><td>{_e(e.get('lossless_job') or '—')}</td><td>{acc_txt or '—'}</td>"
                   f"<td>{met_txt or '—'}</td>"
                   f"<td class=num>{fmt_psnr((e.get('psnr_db') or {}).get('min'))}</td>"
                   f"<td class=num>{_num((e.get('ssim') or {}).get('min'), '{:.4f}')}</td>"
                   f"<td class=num>{_num(e.get('cache_hit_rate'), '{:.3f}')}</td>"
                   f"<td>{_badge(e.get('verdict'), _GATE_CLASS.get(e.get('verdict'), 'warn'))}{why}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _parity_section(jobs: Sequence[Job], ref: Optional[Job], par: Dict[str, List[Dict[str, Any]]],
                    tolerance_db: float) -> str:
    if ref is None:
        return "<p>No job wrote images, so there is no parity reference.</p>"
    others = [j for j in jobs if j is not ref]
    if not others:  # a single run: nothing to compare, and no empty table saying so
        return (f"<p>One job (<b>{_e(ref.label)}</b>): parity compares the items of several jobs with a reference "
                "job's. Give more run dirs or a sweep dir (<code>python -m runner.report &lt;run dir&gt; "
                "&lt;other run dir&gt;</code>, <code>--reference</code> picks the reference).</p>")
    ovr = " ".join(ref.manifest.get("overrides") or [])
    out = [f"<p>Reference: job <b>{_e(ref.label)}</b>{f' ({_e(ovr)})' if ovr else ''}. "
           f"PSNR in dB (<code>inf</code>: identical pixels), SSIM of Wang et al. 2004 (11x11 Gaussian window, "
           f"σ 1.5, per RGB channel, 1.0: identical), max |Δ| in pixel levels (0..255). Within tolerance: "
           f"PSNR ≥ {tolerance_db:g} dB. Only items with the same seed, prompt and parameters are compared.</p>"]
    summary = ["<tr><th>job</th><th>items compared</th><th>min PSNR dB</th><th>min SSIM</th><th>max |Δ|</th>"
               "<th>verdict</th></tr>"]
    detail = ["<tr><th>job</th><th>item</th><th>PSNR dB</th><th>SSIM</th><th>max |Δ|</th><th>verdict</th></tr>"]
    nc: List[str] = []  # not comparable items: collapsed, each with the key that differs
    for j in jobs:
        if j is ref:
            continue
        rows = par.get(j.label)
        if rows is None:
            summary.append(f"<tr><td>{_e(j.label)}</td><td colspan=5><i>no images ({_e(j.outcome)})</i></td></tr>")
            continue
        done = [r for r in rows if r["psnr_db"] is not None]
        if done:
            mn_p = min(r["psnr_db"] for r in done)
            mn_s = min(r["ssim"] for r in done)
            mx_d = max(r["max_abs_diff"] for r in done)
        missing = [r for r in rows if r.get("note") == "missing"]
        outside = [r for r in rows if r["within"] is False and r.get("note") != "missing"]
        verdict = "".join([_badge(f"{len(outside)} outside", "bad") if outside else "",
                           _badge(f"{len(missing)} missing", "bad") if missing else ""]) or (
            _badge("within", "ok") if done else _badge("not comparable", "warn"))
        summary.append(f"<tr><td>{_e(j.label)}</td><td class=num>{len(done)} / {len(rows)}</td>"
                       f"<td class=num>{fmt_psnr(mn_p) if done else '—'}</td>"
                       f"<td class=num>{_num(mn_s, '{:.4f}') if done else '—'}</td>"
                       f"<td class=num>{mx_d if done else '—'}</td><td>{verdict}</td></tr>")
        for r in rows:
            if str(r.get("note", "")).startswith("not comparable"):
                nc.append(f"<tr><td>{_e(j.label)}</td><td class=mono>{_e(r['key'])}</td><td>{_e(r['note'])}</td></tr>")
                continue
            v = (_badge(r["note"], "warn" if r["within"] is None else "bad") if r.get("note")
                 else _badge("within", "ok") if r["within"] else _badge("outside", "bad"))
            detail.append(f"<tr><td>{_e(j.label)}</td><td class=mono>{_e(r['key'])}</td>"
                          f"<td class=num>{fmt_psnr(r['psnr_db'])}</td><td class=num>{_num(r['ssim'], '{:.4f}')}</td>"
                          f"<td class=num>{'—' if r['max_abs_diff'] is None else r['max_abs_diff']}</td>"
                          f"<td>{v}</td></tr>")
    out.append(f'<table class="parity-summary sortable">{"".join(summary)}</table>')
    if len(detail) > 1:
        opened = " open" if len(detail) <= 61 else ""
        out.append(f'<details{opened}><summary>Per item ({len(detail) - 1} rows)</summary>'
                   f'<table class="parity sortable">{"".join(detail)}</table></details>')
    if nc:
        out.append(f'<details class="not-comparable"><summary>Not comparable ({len(nc)} items: another model, seed, '
                   'prompt or parameter, named per item)</summary><table class="parity sortable"><tr><th>job</th>'
                   f'<th>item</th><th>why</th></tr>{"".join(nc)}</table></details>')
    return "".join(out)


def _href(path: Path, base: Optional[Path]) -> str:
    """A link to the full-size file: relative to the report's dir ``base`` (the report moves with its sweep dir),
    else a ``file://`` URI."""
    import os
    from urllib.parse import quote

    if base is not None:
        return quote(os.path.relpath(Path(path).resolve(), Path(base).resolve()).replace(os.sep, "/"))
    return Path(path).resolve().as_uri()


def _short(prompt: Any, n: int = 80) -> str:
    text = " ".join(str(prompt or "").split())
    return text if len(text) <= n else text[:n - 1] + "…"


def _image_grid(jobs: Sequence[Job], ref: Optional[Job], par: Dict[str, List[Dict[str, Any]]],
                base: Optional[Path] = None) -> str:
    """Thumbnails (item x job), each a link to its full-size file, with its parity to the reference, its seed and
    its prompt."""
    with_images = [j for j in jobs if j.ok_items]
    if not with_images:
        return "<p>No images.</p>"
    keys: List[str] = []
    for j in ([ref] if ref else []) + with_images:
        keys.extend(k for k in j.ok_items if k not in keys)
    shown = keys[:MAX_GRID_ITEMS]
    note = (f"<p class=meta>Showing the first {len(shown)} of {len(keys)} items.</p>" if len(keys) > len(shown)
            else "")
    cols = f"minmax(90px,140px) repeat({len(with_images)}, minmax(120px, {THUMB_PX + 12}px))"
    cells = ['<div class="head"></div>']
    cells += [f'<div class="head">{_e(j.label)}{" (reference)" if j is ref else ""}</div>' for j in with_images]
    for k in shown:
        cells.append(f'<div class="key mono">{_e(k)}</div>')
        for j in with_images:
            if k not in j.ok_items:
                cells.append('<div class="cell empty">—</div>')
                continue
            cap = ""
            if j is not ref:
                r = next((r for r in par.get(j.label, []) if r["key"] == k), None)
                if r and r["psnr_db"] is not None:
                    cap = f"PSNR {fmt_psnr(r['psnr_db'])} dB · SSIM {r['ssim']:.3f}"
            else:
                cap = "reference"
            rec = j.ok_items[k]
            href = _e(_href(j.image_path(k), base))
            what = f'<span class="sub">seed {_e(rec.get("seed"))} · {_e(_short(rec.get("prompt")))}</span>'
            if is_video(rec):
                n = rec.get("num_frames")
                pos = f"frame {n // 2 + 1} of {n}" if n else "first frame"
                fps = f" at {rec['fps']:g} fps" if isinstance(rec.get("fps"), (int, float)) else ""
                cells.append(f'<div class="cell video"><a href="{href}"><img class="poster" alt="{_e(k)} / job '
                             f'{_e(j.label)}: poster, {pos}" title="{_e(rec["file"])}: poster, {pos}{fps}" '
                             f'src="{_thumb(j.image_path(k), num_frames=n)}"></a>'
                             f'<span class="sub">video · {_e(pos)}{_e(fps)}</span>{_e(cap)}{what}</div>')
                continue
            cells.append(f'<div class="cell">{_input_thumbs(rec)}<a href="{href}"><img alt="{_e(k)} / job '
                         f'{_e(j.label)}" title="{_e(rec.get("file"))}" src="{_thumb(j.image_path(k))}"></a>'
                         f'{_e(cap)}{what}</div>')
    return f'{note}<div class="grid" style="grid-template-columns:{cols}">{"".join(cells)}</div>'


def _details(j: Job) -> str:
    m = j.manifest
    parts = [f'<div class="card" id="job-{_e(j.label)}"><h3>Job {_e(j.label)} '
             f'{_badge(j.outcome, _OUTCOME_CLASS.get(j.outcome, "warn"))}</h3>',
             f'<div class="meta mono">{_e(j.path)}</div>',
             f'<p>overrides: <code>{_e(" ".join(m.get("overrides") or []))}</code><br>'
             f'device: {_e(device_summary(m))} · dtype: {_e(m.get("dtype", (m.get("config") or {}).get("dtype")))}'
             f' · model: {_e((m.get("model") or {}).get("name") or ((m.get("config") or {}).get("model") or {}).get("name"))}'
             f' · counts: {_e(json.dumps(m.get("counts")) if m.get("counts") else "—")}</p>']
    if j.error:
        parts.append(f'<p class="err">{_e(j.error)}</p>')
    if m.get("pool"):  # a data-parallel run's pool (live while it runs: runner.core.distributed.live_merge)
        from runner.app.console import pool_summary

        parts.append(f'<p class="mono">{_e(pool_summary(m["pool"]))}</p>')
    rows = []
    for f, entries in backend_fields(m).items():
        for en in entries:
            warn = "<br>".join(_e(w) for w in en["warnings"])
            rows.append(f"<tr><td>{_e(en['stage'])}</td><td>{_e(f)}</td><td class=mono>{_e(en['requested'])}</td>"
                        f"<td>{_e(en['layer'])}</td><td class=mono>{_e(en['resolved'])}</td>"
                        f"<td class=mono><b>{_e(en['selected'] or 'n/a')}</b></td><td>{_e(en['reason'] or '')}"
                        f"{'<br>' + warn if warn else ''}</td></tr>")
    if rows:
        parts.append("<table><tr><th>stage</th><th>field</th><th>requested</th><th>layer</th><th>resolved</th>"
                     "<th>selected</th><th>reason / warnings</th></tr>" + "".join(rows) + "</table>")
    ev = m.get("evidence") or {}
    if ev.get("mismatches"):
        parts.append("<p><b>evidence mismatches</b></p><ul>"
                     + "".join(f"<li>{_e(x)}</li>" for x in ev["mismatches"]) + "</ul>")
    parts.append(_metric_histograms(j))
    failed = [r for r in j.items if r.get("status") == "failed"]
    if failed:
        parts.append("<p><b>failed items</b></p><ul>"
                     + "".join(f"<li><code>{_e(r.get('key'))}</code>: {_e(r.get('reason'))}</li>" for r in failed)
                     + "</ul>")
    parts.append("</div>")
    return "".join(parts)


def render(jobs: Sequence[Job], reference: Any = None, tolerance_db: float = PARITY_TOLERANCE_DB,
           sources: Sequence[Path] = (), gate: Optional[Dict[str, Any]] = None, base: Optional[Path] = None) -> str:
    """The report as one HTML document (no external resources); ``gate``: the quality gate's document
    (``runner.tools.gate``), shown when given; ``base``: the dir the report is written to (links to the full-size
    files are relative to it). Tables of class ``sortable`` sort by a column when its header is clicked
    (:data:`SORT_JS`)."""
    ref = pick_reference(jobs, reference)
    par = {j.label: parity(ref, j, tolerance_db) for j in jobs if ref is not None and j is not ref and j.ok_items}
    common = _common_overrides(jobs)
    counts: Dict[str, int] = {}
    for j in jobs:
        counts[j.outcome] = counts.get(j.outcome, 0) + 1
    devices = sorted({device_summary(j.manifest) for j in jobs if j.manifest})
    commits = sorted({str(((j.manifest.get("git") or {}).get("commit") or "")[:12]) for j in jobs if j.manifest} - {""})
    title = "runner report: " + ", ".join(Path(s).name or str(s) for s in sources) if sources else "runner report"
    body = [
        f"<h1>{_e(title)}</h1>",
        f'<div class="meta">generated {_e(datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))} from '
        f'{_e(", ".join(str(s) for s in sources))} · {len(jobs)} job(s): '
        + ", ".join(f"{n} {_e(k)}" for k, n in counts.items())
        + f" · device: {_e('; '.join(devices) or '—')} · git: {_e(', '.join(commits) or '—')}</div>",
        f'<p class="meta">common overrides: <code>{_e(" ".join(common) or "—")}</code>. Times in seconds '
        "(wall: the whole job incl. model load; phases: text encoding, denoising, VAE decode, writing PNGs). "
        "Backend cells: the implementation selected, then what was requested and the precedence layer that set "
        "it.</p>",
        "<h2>Jobs</h2>", _jobs_table(jobs, common),
        "<h2>Throughput</h2>", _bar_chart(jobs),
        "<h2>Speed and quality</h2>", _speed_quality(jobs),
        "<h2>Quality gate of lossy jobs</h2>", _gate_section(jobs, gate),
        "<h2>Parity</h2>", _parity_section(jobs, ref, par, tolerance_db),
        "<h2>Images and videos (poster frames)</h2>" if any(is_video(r) for j in jobs for r in j.ok_items.values())
        else "<h2>Images</h2>", _image_grid(jobs, ref, par, base),
        "<h2>Job details</h2>", "".join(_details(j) for j in jobs),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>" + "\n".join(body)
            + f"<script>{SORT_JS}</script></body></html>\n")


#: Click a header cell of a ``table.sortable`` to sort its rows by that column (numbers numerically, ``—`` last;
#: again to reverse). Inline, like the CSS: the report has no external resources.
SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function (t) {
  var head = t.rows[0];
  Array.prototype.forEach.call(head.cells, function (th, col) {
    th.style.cursor = 'pointer'; th.title = 'sort by this column';
    th.addEventListener('click', function () {
      var asc = th.dataset.asc !== '1'; th.dataset.asc = asc ? '1' : '0';
      var rows = Array.prototype.slice.call(t.rows, 1);
      var key = function (r) { var c = r.cells[col]; var s = c ? c.textContent.trim() : '';
        var x = parseFloat(s); return isNaN(x) ? (s === '—' || s === '' ? null : s) : x; };
      rows.sort(function (a, b) { var x = key(a), y = key(b);
        if (x === null) return 1; if (y === null) return -1;
        var d = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === 'number' ? -1 : 1);
        return asc ? d : -d; });
      rows.forEach(function (r) { t.tBodies[0] ? t.tBodies[0].appendChild(r) : t.appendChild(r); });
    });
  });
});
"""


def write_report(dirs: List[Path], out: Path, reference: Optional[str] = None,
                 tolerance_db: float = PARITY_TOLERANCE_DB, gate: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``out`` (a self-contained HTML file) for the jobs of ``dirs`` (sweep dirs or run dirs).

    Args:
        reference: parity reference job (dir name, label or path; an int job number works); default: the first
            job with images.
        tolerance_db: PSNR (dB) at or above which an item counts as within parity tolerance.
        gate: the quality gate's document (``runner.tools.gate``); default: the ``gate.json`` of the first of ``dirs``
            that holds one.

    Returns:
        ``out``.
    """
    jobs = load_jobs(dirs)
    if gate is None:
        found = next((Path(d) / "gate.json" for d in dirs if (Path(d) / "gate.json").is_file()), None)
        gate = (_read_json(found) or None) if found is not None else None
    doc = render(jobs, reference=reference, tolerance_db=tolerance_db, sources=[Path(d) for d in dirs], gate=gate,
                 base=Path(out).parent)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from runner.core.artifacts import atomic_write_bytes

    atomic_write_bytes(out, doc.encode("utf-8"))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.report",
                                 description="Regenerate the HTML report of sweeps/runs from their manifests.")
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep dirs (holding job dirs) or run dirs")
    ap.add_argument("--out", type=Path, default=None,
                    help="output file (default: report.html in the single dir given, else ./report.html)")
    ap.add_argument("--reference", default=None, help="parity reference job (dir name); default: first with images")
    ap.add_argument("--tolerance-db", type=float, default=PARITY_TOLERANCE_DB,
                    help=f"parity tolerance: PSNR >= this many dB (default {PARITY_TOLERANCE_DB:g})")
    a = ap.parse_args(argv)
    out = a.out or (a.dirs[0] / "report.html" if len(a.dirs) == 1 else Path("report.html"))
    try:
        path = write_report(a.dirs, out, reference=a.reference, tolerance_db=a.tolerance_db)
    except RunnerError as e:
        print(f"report: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    except (FileNotFoundError, KeyError) as e:
        print(f"report: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
