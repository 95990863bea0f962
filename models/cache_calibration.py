"""MagCache's magnitude ratios calibrated for the loaded model (``cache.method=magcache cache.calibrate=true``).

MagCache (Ma et al., https://github.com/Zehong-Ma/MagCache; diffusers ``MagCacheConfig``) skips a step while the
accumulated error of the per-step *magnitude ratios* stays under ``cache.threshold``; the ratios are a property of
the checkpoint, the scheduler and the step count: ``ratio[s] = mean over tokens of |r_s| / |r_(s-1)|``, ``r_s`` the
residual ``output - input`` of the transformer's blocks at step ``s`` (``ratio[0] = 1``). FLUX.1's ratios, the only
ones diffusers ships, misjudge another model (on toy_shapes they fail the quality gate).

Calibration is diffusers' own pass: ``MagCacheConfig(calibrate=True)`` computes every step and appends each step's
ratio to its state; the runner reads that list from the hooks' state after the pipeline call
(:class:`RatioCapture`, one list per cache context, ``cond``/``uncond``; the ratios used are their per-step mean),
nothing is re-derived here. It runs before the first batch (``models.diffusers_engine.DiffusersEngine.warmup``), on
the first batch of each step count with a generator of its own (seed 0), its output discarded and its evidence
counters restored: it is no part of the run's items, and is recorded as what it was (every forward computed, as the
probe observed).

Storage (:class:`RatioStore`): ``<cache_dir>/magcache/<key>.json``, ``key`` the first 20 hex digits of the sha256 of
:func:`key_fields` (the weights' digest, the transformer's class and config, the dtype, the scheduler's class and
config) and the step count, written atomically (temp file + ``os.replace``) under a ``filelock`` lock, so that
concurrent processes (data-parallel ranks) calibrate once: the first takes the lock and writes, the others wait and
load. The manifest records per step count the file, the sha256 of its bytes, the key and whether the ratios were
``calibrated`` in this run or ``loaded``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from runner.core.errors import ConfigValueError

KEY_VERSION = 1
"""Bump when the key's fields change meaning (older files are then never read again)."""


class CalibrationError(ConfigValueError):
    """A stored calibration file is unreadable or inconsistent, or a calibration pass observed no usable ratios;
    names the file or the step count and the fix."""


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _module_config(module: Any) -> Optional[Dict[str, Any]]:
    cfg = getattr(module, "config", None)
    return {k: v for k, v in dict(cfg).items() if k != "_name_or_path"} if cfg is not None else None


def key_fields(*, source: Dict[str, Any], transformer: torch.nn.Module, dtype: torch.dtype,
               scheduler: Any) -> Dict[str, Any]:
    """What the ratios of one model depend on (the step count is added per file by :class:`RatioStore`).

    Args:
        source: the engine's ``model.source``: ``files`` (relative path -> sha256 of each weight file) for a
            snapshot or an embedded model; ``kind: dummy`` with ``weights_seed`` for random weights.
        transformer: the denoiser (its class and diffusers ``config``, without ``_name_or_path``).
        dtype: compute dtype.
        scheduler: the pipeline's scheduler (its class and ``config``; None: not known).
    """
    weights = ({"files_sha256": _digest(source["files"])} if source.get("files")
               else {k: source.get(k) for k in ("kind", "weights_seed")})
    return json.loads(json.dumps({
        "key_version": KEY_VERSION, "weights": weights,
        "transformer": {"class": f"{type(transformer).__module__}.{type(transformer).__qualname__}",
                        "config": _module_config(transformer)},
        "dtype": str(dtype).replace("torch.", ""),
        "scheduler": None if scheduler is None else {"class": type(scheduler).__name__,
                                                     "config": _module_config(scheduler)},
    }, sort_keys=True, default=str))


def calibration_root(cache_dir: Optional[str]) -> Path:
    """``<cache_dir>/magcache`` (``cache_dir`` null: ``$RUNNER_CACHE`` or ``~/.cache/runner``)."""
    from runner.core.weights import default_cache_dir

    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "magcache"


def _valid(ratios: Any, steps: int) -> bool:
    return (isinstance(ratios, list) and len(ratios) == steps
            and all(isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in ratios))


class RatioStore:
    """Calibrated ratios of one model on disk, one JSON file per step count.

    Attributes:
        root: the directory (``<cache_dir>/magcache``).
        fields: :func:`key_fields` of the loaded model.
    """

    def __init__(self, root: Path, fields: Dict[str, Any]) -> None:
        self.root = Path(root)
        self.fields = fields

    def key(self, steps: int) -> str:
        """First 20 hex digits of the sha256 of the fields and ``steps``."""
        return _digest({**self.fields, "num_inference_steps": int(steps)})[:20]

    def path(self, steps: int) -> Path:
        """The file of ``steps``' ratios."""
        return self.root / f"{self.key(steps)}.json"

    def lock(self, steps: int) -> Any:
        """A ``filelock.FileLock`` on ``steps``' file (held while checking, calibrating and writing)."""
        import filelock

        self.root.mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(str(self.path(steps)) + ".lock")

    def _record(self, path: Path, doc: Dict[str, Any], source: str) -> Dict[str, Any]:
        return {"steps": doc["num_inference_steps"], "file": str(path), "key": path.stem,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "source": source,
                "ratios": list(doc["ratios"])}

    def load(self, steps: int) -> Optional[Dict[str, Any]]:
        """The stored record of ``steps`` (``source: loaded``), or None when no file exists.

        Raises:
            CalibrationError: the file is not JSON, holds other key fields, or ratios that are not ``steps``
                positive finite numbers (names the file; fix: delete it, the next run calibrates again).
        """
        path = self.path(steps)
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            ok = (doc.get("fields") == self.fields and doc.get("num_inference_steps") == steps
                  and _valid(doc.get("ratios"), steps))
        except (OSError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise CalibrationError(f"cache.calibrate=true: {path} is not a valid MagCache calibration of this model "
                                   f"for {steps} steps; fix: delete it (the next run calibrates again)")
        return self._record(path, doc, "loaded")

    def save(self, steps: int, ratios: List[float], by_context: Dict[str, List[float]],
             conditions: Dict[str, Any]) -> Dict[str, Any]:
        """Write ``steps``' ratios atomically; returns the record (``source: calibrated``).

        Raises:
            CalibrationError: ``ratios`` are not ``steps`` positive finite numbers.
            runner.core.errors.StorageError: the file cannot be written.
        """
        from runner.core.artifacts import atomic_write_json

        if not _valid(ratios, steps):
            raise CalibrationError(f"cache.calibrate=true: the calibration pass of {steps} steps observed the ratios "
                                   f"{ratios}, not {steps} positive finite numbers; fix: cache.mag_ratios=<list> "
                                   "calibrated elsewhere, or another cache.method")
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(steps)
        atomic_write_json(path, {"fields": self.fields, "num_inference_steps": steps, "ratios": ratios,
                                 "ratios_by_context": by_context, "calibration": conditions,
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return self._record(path, json.loads(path.read_text(encoding="utf-8")), "calibrated")


class RatioCapture:
    """Reads diffusers' calibration ratios out of the MagCache hooks' state after every transformer forward.

    diffusers appends each step's ratio to ``MagCacheState.calibration_ratios`` (one state per cache context) and,
    after the last step, replaces that list by a new empty one; the capture keeps a reference to each context's
    non-empty list, so it holds every step's ratio once the call is over.
    """

    def __init__(self, transformer: torch.nn.Module, blocks: List[torch.nn.Module]) -> None:
        """Attach to ``transformer`` (a forward hook); ``blocks``: its transformer blocks, one of which carries
        diffusers' MagCache head hook."""
        from diffusers.hooks import HookRegistry
        from diffusers.hooks.mag_cache import MagCacheHeadHook

        heads = [h for b in blocks for h in HookRegistry.check_if_exists_or_initialize(b).hooks.values()
                 if isinstance(h, MagCacheHeadHook)]
        if len(heads) != 1:
            raise CalibrationError(f"cache.calibrate=true: {len(heads)} MagCache head hooks found on the transformer "
                                   "blocks, expected 1; fix: cache.mag_ratios=<list>, or another cache.method")
        self._manager = heads[0].state_manager
        self.lists: Dict[str, List[float]] = {}
        self._handle = transformer.register_forward_hook(self._after)

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:  # the context the pipeline's cache_context (or the head hook itself) set around this forward
            name, state = self._manager.context.name, self._manager.get_state()
        except ValueError:  # no context: the head hook did not run in this forward
            return
        if state.calibration_ratios:
            self.lists[name] = state.calibration_ratios

    def close(self) -> Dict[str, List[float]]:
        """Detach; returns ``{cache context: [ratio per step]}``."""
        self._handle.remove()
        return {k: [float(x) for x in v] for k, v in self.lists.items()}


def mean_ratios(by_context: Dict[str, List[float]]) -> List[float]:
    """The per-step mean over the cache contexts' ratios (one context: its own); contexts of other lengths are
    left out (the longest length wins)."""
    if not by_context:
        return []
    n = max(len(v) for v in by_context.values())
    rows = [v for v in by_context.values() if len(v) == n]
    return [round(sum(r[s] for r in rows) / len(rows), 6) for s in range(n)]


def calibrate(store: RatioStore, steps: int, run_pass: Callable[[], Dict[str, List[float]]],
              conditions: Dict[str, Any]) -> Dict[str, Any]:
    """The record of ``steps``' ratios: loaded when stored, else ``run_pass()`` (the calibration pass, returning
    :meth:`RatioCapture.close`'s lists) and stored; under the file's lock, so concurrent processes run one pass.

    Raises:
        CalibrationError: see :meth:`RatioStore.load` and :meth:`RatioStore.save`.
    """
    with store.lock(steps):
        rec = store.load(steps)
        if rec is not None:
            return rec
        t0 = time.perf_counter()
        by_context = run_pass()
        seconds = round(time.perf_counter() - t0, 3)
        rec = store.save(steps, mean_ratios(by_context), by_context, {**conditions, "seconds": seconds})
        rec["seconds"] = seconds
        return rec
