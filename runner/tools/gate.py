"""Quality gate of lossy lanes: each lossy job (``runner.core.lossy``: a step cache, FP8 linear, lossy attention) is
compared with the lossless job of the same rows.

* **Matching.** Two jobs hold *the same rows* when they ran the same model weights (the manifest's weight-file
  hashes, or the source), the same dataset file (sha256) and ``dataset.limit``, the same run ``seed``, images per
  prompt, generation defaults and dtype. A lossy job is compared with a lossless job (``lossy: false``, outcome
  ``ok``) of the same rows and the same ``batch_size``; among several, the one whose selected backends differ
  least from its own. A lossy lane whose outputs depend on the batch peers (``runner.core.lossy``
  ``batch_dependent``: an adaptive step cache) is ``unmatched`` without a lossless job of its batch size (the
  batch would be measured, not the lane); any other lossy job falls back to a lossless job of another batch size
  (batching alone moves a lossless pixel by at most one level), with a note saying so.
* **Distilled presets.** A job of a few-step distilled preset (``model.distilled``; ``runner.core.lossy``'s
  ``distilled`` section) is compared with the base model's run of the same rows: a lossless job whose rows match
  once the preset's generation fields (``lossy.DISTILLED_FIELDS``: steps, shift, guidance) take the model's own
  values (the section's ``base``), that runs the job's adapters without the preset's (``model.lora`` by path). Its
  items are compared although their ``params`` differ in those fields and in ``lora`` (what the preset changes).
* **Accuracy.** With an oracle (toy_shapes, toy_motion: the manifest's ``accuracy``), the lossy job's accuracy
  per attribute (colour, shape, position or direction) must be at least ``min_ratio`` (default
  :data:`MIN_RATIO`, 0.97) times the lossless job's (an attribute the lossless job gets 0 on passes).
* **Metrics.** With ``min_metric_ratio`` (``{metric: floor}``, e.g. ``clip_score=0.99``), the lossy job's mean
  per-item score of each metric (``runner.core.metrics``: the records' ``metrics``, from the run or
  ``runner.score``) over the items both jobs scored must be at least ``floor`` times the lossless job's (a
  lossless mean <= 0: at least that mean). Item by item, each ratio is reported (``min_item_ratio``, the items
  below the floor); the mean decides. A metric either job did not score fails, naming the ``runner.score`` fix.
* **Fidelity.** PSNR (dB; ``inf``: identical) and SSIM (Gaussian window 11, sigma 1.5) of every item against the
  lossless job's, computed with ``torchmetrics`` (images as RGB in [0, 1]; a video as its decoded frames,
  PSNR over all its pixels, SSIM the mean over frames); reported, and gated only with ``min_psnr_db``.

Verdicts per lossy job: ``pass``; ``fail`` (an attribute below the ratio, a metric mean below its floor, or PSNR
below ``min_psnr_db``);
``unmatched`` (no lossless job of the same rows: fails, add one, e.g. ``cache.method=none``); ``not_run`` (the lossy
job did not finish ``ok``: fails, except a documented refusal, ``skipped``); ``unchecked`` (no oracle and no PSNR
floor: reported, does not fail).

CLI: ``python -m runner.gate <sweep or run dirs...> [--min-ratio 0.97] [--min-psnr-db X]
[--min-metric-ratio clip_score=0.99,...] [--out gate.json]``;
writes ``gate.json`` (default: into the single dir given, else ``./gate.json``; ``gate.cli.json`` where a
``gate.json`` exists already, so the sweep's is never replaced), prints one line per lossy job (each oracle
attribute as ``lossy/lossless (ratio r)``),
exits 0 when no gate fails, 1 when one does, 2 on bad input. A sweep runs it at its end when a job is lossy
(``runner.tools.sweep``), and ``report.html`` shows it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from runner.core import lossy
from runner.core.errors import RunnerError, UserInputError
from runner.tools.report import Job, is_video, load_frames, load_jobs, load_rgb, not_comparable, ssim

MIN_RATIO = 0.97
"""Default floor of lossy accuracy / lossless accuracy, per attribute."""

NOT_ATTRIBUTES = ("oracle", "n", "all", "read")
FAILING = ("fail", "unmatched", "not_run")


def rows_identity(job: Job, base: Optional[Mapping[str, Any]] = None) -> str:
    """sha256 of what makes two jobs' rows the same (see the module docstring); lanes (backends, cache) aside.

    Args:
        base: generation values that replace the job's own (a distilled preset's ``base``: the model's own steps,
            shift and guidance), so the job matches the base model's run. A null ``shift`` counts as unset (a
            manifest written before the field has none).
    """
    m = job.manifest
    cfg = m.get("config") or {}
    src = (m.get("model") or {}).get("source") or {}
    weights = src.get("files") or {k: src.get(k) for k in ("kind", "path", "weights_seed") if k in src}
    gen = dict((cfg.get("model") or {}).get("generation") or {})
    gen.update(base or {})
    if gen.get("shift") is None:
        gen.pop("shift", None)
    doc = {"model": (m.get("model") or {}).get("name"), "weights": weights,
           "dataset": (m.get("dataset") or {}).get("sha256"), "limit": (cfg.get("dataset") or {}).get("limit"),
           "seed": cfg.get("seed"), "num_images_per_prompt": cfg.get("num_images_per_prompt"),
           "generation": gen, "dtype": m.get("dtype")}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def lora_paths(job: Job, without: Sequence[str] = ()) -> List[str]:
    """The paths of the job's ``model.lora`` entries (sorted), without those named in ``without`` (a distilled
    preset's adapters)."""
    entries = ((job.manifest.get("config") or {}).get("model") or {}).get("lora") or []
    return sorted(str(e.get("path")) for e in entries if isinstance(e, Mapping) and e.get("name") not in without)


def batch_size(job: Job) -> Optional[int]:
    """The job's run-level ``batch_size`` (items per pipeline call), from its manifest's config."""
    v = (job.manifest.get("config") or {}).get("batch_size")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


def pick_reference(job: Job, same: Sequence[Job], batch_dependent: Sequence[str]
                   ) -> Tuple[Optional[Job], Optional[str]]:
    """The lossless job that lossy ``job`` is gated against, among ``same`` (lossless jobs of its rows).

    Those of ``job``'s batch size come first; among them, the one whose selected backends differ least from
    ``job``'s (the first on ties). Without one of its batch size: a ``batch_dependent`` job gets none (its output
    depends on its batch peers, so another batch size would be measured with the lane); another lossy job gets the
    closest of the others, with a note.

    Returns:
        ``(reference or None, the reason or note: None when the batch sizes match)``.
    """
    mine, size = _selected(job), batch_size(job)
    at_size = [r for r in same if batch_size(r) == size]

    def closest(cands: Sequence[Job]) -> Job:
        return max(cands, key=lambda r: sum(v == mine.get(k) for k, v in _selected(r).items()))

    if at_size:
        return closest(at_size), None
    others = sorted({str(batch_size(r)) for r in same})
    if batch_dependent:
        return None, (f"{', '.join(batch_dependent)} makes each item depend on its batch peers, and no lossless job "
                      f"of the same rows ran at batch_size={size} (they ran at batch_size={', '.join(others)}); fix: "
                      f"add one (e.g. cache.method=none batch_size={size}) or pass its run dir")
    ref = closest(same)
    return ref, (f"no lossless job of the same rows at batch_size={size}: compared with {ref.label} at "
                 f"batch_size={batch_size(ref)} (batching alone may move a pixel by one level)")


def _selected(job: Job) -> Dict[str, Any]:
    return {f"{st}.{f}": (r or {}).get("selected") for st, fields in (job.manifest.get("backends") or {}).items()
            for f, r in (fields or {}).items()}


def _tensor(a: np.ndarray) -> Any:
    import torch

    t = torch.from_numpy(np.array(a, dtype=np.float32)) / 255.0
    t = t.unsqueeze(0) if t.dim() == 3 else t  # (N, H, W, C)
    return t.permute(0, 3, 1, 2)


def item_metrics(a: Path, b: Path) -> Dict[str, Any]:
    """``{psnr_db, ssim}`` of two artifacts (images, or MP4 videos decoded to frames), via ``torchmetrics``;
    ``{error}`` when their shapes differ. PSNR in dB over every pixel (``inf`` when identical); SSIM averaged
    over frames."""
    from torchmetrics.functional.image import peak_signal_noise_ratio

    video = str(a).endswith(".mp4") or str(b).endswith(".mp4")
    x, y = (load_frames(a), load_frames(b)) if video else (load_rgb(a), load_rgb(b))
    if x.shape != y.shape:
        return {"psnr_db": None, "ssim": None, "error": f"shape {x.shape} vs {y.shape}"}
    if np.array_equal(x, y):
        return {"psnr_db": math.inf, "ssim": 1.0}
    tx, ty = _tensor(x), _tensor(y)
    return {"psnr_db": round(float(peak_signal_noise_ratio(tx, ty, data_range=1.0)), 3),
            "ssim": round(ssim(x, y), 5)}  # the report's SSIM (one implementation: torchmetrics')


def accuracy_ratios(lossy_acc: Optional[Dict[str, Any]], ref_acc: Optional[Dict[str, Any]], min_ratio: float
                    ) -> Optional[Dict[str, Dict[str, Any]]]:
    """Per oracle attribute: ``{lossy, lossless, ratio, pass}``; None when either job has no accuracy section."""
    if not lossy_acc or not ref_acc:
        return None
    out: Dict[str, Dict[str, Any]] = {}
    for k, ref in ref_acc.items():
        if k in NOT_ATTRIBUTES or not isinstance(ref, (int, float)) or isinstance(ref, bool):
            continue
        got = lossy_acc.get(k)
        got = float(got) if isinstance(got, (int, float)) else 0.0
        ratio = got / ref if ref else None
        out[k] = {"lossy": got, "lossless": float(ref), "ratio": None if ratio is None else round(ratio, 4),
                  "pass": got >= ref if ratio is None else ratio >= min_ratio}
    return out


def _scores(rec: Dict[str, Any], name: str) -> Optional[float]:
    v = (rec.get("metrics") or {}).get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def metric_ratios(job: Job, ref: Job, floors: Mapping[str, float]) -> Optional[Dict[str, Dict[str, Any]]]:
    """Per metric of ``floors``: ``{lossy, lossless (means over the items both jobs scored), ratio, floor,
    min_item_ratio, items, items_below (keys whose own ratio is below the floor), pass}``, or ``{error, pass:
    False}`` when the jobs share no scored item; None without floors (module docstring)."""
    if not floors:
        return None
    out: Dict[str, Dict[str, Any]] = {}
    mine = job.ok_items
    for name, floor in floors.items():
        pairs = [(k, _scores(mine[k], name), _scores(r, name)) for k, r in ref.ok_items.items() if k in mine]
        pairs = [(k, a, b) for k, a, b in pairs if a is not None and b is not None]
        if not pairs:
            out[name] = {"floor": floor, "pass": False, "error": (
                f"{name} is not scored in both jobs; fix: python -m runner.score <run dir> --metrics {name} "
                f"--model {name}=<dir> on {job.path} and {ref.path}")}
            continue
        a, b = float(np.mean([p[1] for p in pairs])), float(np.mean([p[2] for p in pairs]))
        item = {k: x / y for k, x, y in pairs if y > 0}
        ratio = a / b if b > 0 else None
        out[name] = {"lossy": round(a, 5), "lossless": round(b, 5), "ratio": None if ratio is None else round(ratio, 5),
                     "floor": floor, "items": len(pairs),
                     "min_item_ratio": round(min(item.values()), 5) if item else None,
                     "items_below": sorted(k for k, r in item.items() if r < floor),
                     "pass": a >= b if ratio is None else ratio >= floor}
    return out


def compare(job: Job, ref: Job, min_ratio: float = MIN_RATIO, min_psnr_db: Optional[float] = None,
            min_metric_ratio: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """The gate of lossy ``job`` against lossless ``ref`` (same rows): per-attribute accuracy ratios, per-metric
    ratios (:func:`metric_ratios`), per-item PSNR and SSIM, the verdict and its reasons."""
    items: List[Dict[str, Any]] = []
    mine = job.ok_items
    changed = (*lossy.DISTILLED_FIELDS, "lora") if lossy.of_manifest(job.manifest).get("distilled") else ()
    for key, r in ref.ok_items.items():
        row: Dict[str, Any] = {"key": key}
        why = ("missing in the lossy job" if key not in mine
               else not_comparable(ref, job, _without(r, changed), _without(mine[key], changed)))
        if why:
            row["note"] = why
        else:
            row.update(item_metrics(job.image_path(key), ref.image_path(key)))
        items.append(row)
    acc = accuracy_ratios(job.manifest.get("accuracy"), ref.manifest.get("accuracy"), min_ratio)
    mets = metric_ratios(job, ref, min_metric_ratio or {})
    vals = [i for i in items if i.get("psnr_db") is not None]
    psnr = [i["psnr_db"] for i in vals]
    ssim = [i["ssim"] for i in vals]
    reasons = []
    if acc is not None:
        reasons += [f"{k}: accuracy {a['lossy']:.4g} vs lossless {a['lossless']:.4g} (ratio {a['ratio']}, needs >= "
                    f"{min_ratio:g})" for k, a in acc.items() if not a["pass"]]
    if min_psnr_db is not None:
        low = [i for i in vals if i["psnr_db"] < min_psnr_db]
        reasons += [f"{i['key']}: PSNR {i['psnr_db']:.2f} dB < {min_psnr_db:g}" for i in low]
        reasons += [f"{i['key']}: {i['note']}" for i in items if i.get("note")]
    reasons += [f"{k}: {m['error']}" if "error" in m else
                f"{k}: mean {m['lossy']:.5g} vs lossless {m['lossless']:.5g} (ratio {m['ratio']}, needs >= "
                f"{m['floor']:g})" for k, m in (mets or {}).items() if not m["pass"]]
    checked = acc is not None or min_psnr_db is not None or bool(mets)
    verdict = "fail" if reasons else ("pass" if checked else "unchecked")
    lanes = lossy.of_manifest(job.manifest)["lanes"]
    cache = (((job.manifest.get("evidence") or {}).get("stages") or {}).get("denoise") or {}).get("cache")
    return {"lossy_job": job.label, "lossless_job": ref.label, "lossy_path": str(job.path),
            "lossless_path": str(ref.path), "lanes": lanes, "verdict": verdict, "reasons": reasons,
            "accuracy": acc, "min_ratio": min_ratio, "metrics": mets,
            "psnr_db": {"min": min(psnr), "mean": round(float(np.mean(psnr)), 3) if all(map(math.isfinite, psnr))
                        else math.inf} if psnr else None,
            "ssim": {"min": min(ssim), "mean": round(float(np.mean(ssim)), 5)} if ssim else None,
            "cache_hit_rate": (cache or {}).get("forwards_hit_rate"), "items": items}


def _without(rec: Dict[str, Any], params: Sequence[str]) -> Dict[str, Any]:
    """An item record without the ``params`` a distilled preset changes (compared as the same request)."""
    if not params:
        return rec
    return {**rec, "params": {k: v for k, v in (rec.get("params") or {}).items() if k not in params}}


def evaluate(jobs: Sequence[Job], min_ratio: float = MIN_RATIO, min_psnr_db: Optional[float] = None,
             min_metric_ratio: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """The gate of every lossy job among ``jobs`` (see the module docstring).

    Returns:
        The ``gate.json`` document: ``{min_ratio, min_psnr_db, min_metric_ratio, jobs: [one entry per lossy job],
        verdict, exit_code, lossless_jobs}``; ``verdict`` is ``fail`` when any entry fails, ``pass`` otherwise
        (``none`` when no job is lossy). A compared entry carries ``batch_size`` (``{lossy, lossless}``) and, when they differ, ``note``.
    """
    labels = {j.label: lossy.of_manifest(j.manifest) for j in jobs if j.manifest}
    lossless = [j for j in jobs if j.manifest and not labels[j.label]["lossy"] and j.outcome == "ok"]
    keys = {j.label: rows_identity(j) for j in jobs if j.manifest}
    entries: List[Dict[str, Any]] = []
    for j in jobs:
        if not j.manifest or not labels[j.label]["lossy"]:
            continue
        base = {"lossy_job": j.label, "lossy_path": str(j.path), "lanes": labels[j.label]["lanes"]}
        if j.outcome != "ok":
            v = "skipped" if j.outcome == "refused" else "not_run"
            entries.append({**base, "verdict": v, "reasons": [f"the lossy job's outcome is {j.outcome}"]})
            continue
        distilled = labels[j.label].get("distilled")
        if distilled:  # the base model's run: the model's own steps/shift/guidance, without the preset's adapters
            mine = rows_identity(j, distilled.get("base") or {})
            adapters = lora_paths(j, distilled.get("adapters") or ())
            same = [r for r in lossless if keys[r.label] == mine and lora_paths(r) == adapters]
        else:
            same = [r for r in lossless if keys[r.label] == keys[j.label]]
        if not same and distilled:
            entries.append({**base, "verdict": "unmatched", "reasons": [
                f"no lossless run of the base model on the same rows (model.distilled={distilled.get('preset')}: "
                f"the model's own {', '.join(f'{k}={v}' for k, v in (distilled.get('base') or {}).items())}, "
                "without the preset's adapters); fix: run the same rows without the experiment and pass its run dir"]})
            continue
        if not same:
            entries.append({**base, "verdict": "unmatched", "reasons": [
                "no lossless job of the same rows (model weights, dataset, limit, seed, generation, dtype); fix: add "
                "one to the sweep (e.g. cache.method=none, backend.linear=TORCH) or pass its run dir"]})
            continue
        ref, why = pick_reference(j, same, labels[j.label]["batch_dependent"])
        if ref is None:
            entries.append({**base, "verdict": "unmatched", "reasons": [why]})
            continue
        entry = compare(j, ref, min_ratio, min_psnr_db, min_metric_ratio)
        entries.append({**entry, "batch_size": {"lossy": batch_size(j), "lossless": batch_size(ref)},
                        **({"note": why} if why else {})})
    failed = [e for e in entries if e["verdict"] in FAILING]
    verdict = "none" if not entries else ("fail" if failed else "pass")
    return {"min_ratio": min_ratio, "min_psnr_db": min_psnr_db, "min_metric_ratio": dict(min_metric_ratio or {}),
            "verdict": verdict, "exit_code": 1 if failed else 0,
            "lossless_jobs": [j.label for j in lossless], "jobs": entries,
            "metrics": "torchmetrics peak_signal_noise_ratio / structural_similarity_index_measure (data_range 1)"}


def write_gate(dirs: Sequence[Path], out: Path, min_ratio: float = MIN_RATIO,
               min_psnr_db: Optional[float] = None, min_metric_ratio: Optional[Mapping[str, float]] = None
               ) -> Dict[str, Any]:
    """Evaluate the jobs of ``dirs`` (sweep or run dirs) and write ``out`` (JSON, atomically).

    Raises:
        runner.tools.report.RunDirError: a dir is neither a run dir nor a sweep dir.
    """
    from runner.core.artifacts import atomic_write_json

    doc = evaluate(load_jobs(dirs), min_ratio, min_psnr_db, min_metric_ratio)
    atomic_write_json(Path(out), doc)
    return doc


def _line(e: Dict[str, Any]) -> str:
    acc = e.get("accuracy") or {}
    parts = [f"{e['verdict'].upper():9s} {e['lossy_job']} [{', '.join(e['lanes'])}]"]
    if e.get("lossless_job"):
        parts.append(f"vs {e['lossless_job']}")
    if acc:
        parts.append(" ".join(f"{k} {a['lossy']:.3g}/{a['lossless']:.3g} (ratio {a['ratio']})"
                              for k, a in acc.items()))
    for k, m in (e.get("metrics") or {}).items():
        parts.append(f"{k} {m['error']}" if "error" in m else
                     f"{k} {m['lossy']:.4g}/{m['lossless']:.4g} (ratio {m['ratio']}, min item {m['min_item_ratio']})")
    if e.get("psnr_db"):
        parts.append(f"PSNR min {e['psnr_db']['min']} dB, SSIM min {e['ssim']['min']}")
    if e.get("cache_hit_rate") is not None:
        parts.append(f"cache hit rate {e['cache_hit_rate']}")
    notes = [*(e.get("reasons") or []), *([f"note: {e['note']}"] if e.get("note") else [])]
    return " · ".join(parts) + "".join(f"\n          {r}" for r in notes)


class GateInputError(UserInputError):
    """A gate option that cannot be read (exit 2)."""


def parse_metric_ratios(text: Optional[str]) -> Dict[str, float]:
    """``"clip_score=0.99,pick_score=0.98"`` -> ``{"clip_score": 0.99, "pick_score": 0.98}``.

    Raises:
        GateInputError: an entry that is not ``NAME=R``, an unknown metric (``runner.core.metrics.REGISTRY``) or a
            ratio that is not a positive number (``runner.core.metrics.floor_problems``).
    """
    from runner.core.metrics import floor_problems

    out: Dict[str, Any] = {}
    for part in [p.strip() for p in (text or "").split(",") if p.strip()]:
        name, _, val = part.partition("=")
        out[name.strip()] = val.strip()
    bad = floor_problems(out, "--min-metric-ratio")
    if bad:
        raise GateInputError("; ".join(bad).replace("--min-metric-ratio.clip_score=0.99", "--min-metric-ratio "
                                                                                  "clip_score=0.99"))
    return {k: float(v) for k, v in out.items()}


def default_out(dirs: Sequence[Path]) -> Path:
    """Where a hand-run gate writes without ``--out``: ``gate.json`` in the single dir given (else the current
    dir), unless one is there already (a sweep's own, which its report reads): then ``gate.cli.json`` beside it,
    so a hand-run with other thresholds never replaces the sweep's record."""
    out = dirs[0] / "gate.json" if len(dirs) == 1 else Path("gate.json")
    return out.with_name("gate.cli.json") if out.exists() else out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runner.gate",
                                 description="Compare each lossy job with the lossless job of the same rows.")
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep dirs (holding job dirs) or run dirs")
    ap.add_argument("--min-ratio", type=float, default=MIN_RATIO,
                    help=f"lossy / lossless oracle accuracy floor per attribute (default {MIN_RATIO})")
    ap.add_argument("--min-psnr-db", type=float, default=None, help="also fail items below this PSNR (dB)")
    ap.add_argument("--min-metric-ratio", default=None, metavar="NAME=R[,NAME=R]",
                    help="lossy / lossless mean per-item metric floor, e.g. clip_score=0.99 (runner.score first)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output path, overwritten if it exists (default: gate.json in the single dir given, else "
                         "./gate.json; where that file exists already, e.g. the sweep's own, gate.cli.json beside it)")
    a = ap.parse_args(argv)
    out = a.out or default_out(a.dirs)
    try:
        floors = parse_metric_ratios(a.min_metric_ratio)
        doc = write_gate(a.dirs, out, a.min_ratio, a.min_psnr_db, floors)
    except RunnerError as e:
        print(f"gate: {type(e).__name__}: {e}", file=sys.stderr)
        return e.exit_code
    for e in doc["jobs"]:
        print(_line(e))
    if not doc["jobs"]:
        print("no lossy job: nothing to gate")
    print(f"gate: {doc['verdict']} -> {out}")
    return int(doc["exit_code"])


if __name__ == "__main__":
    sys.exit(main())
