"""The runner loop: validate, resolve, load, generate every item, write artifacts and the manifest.

Order matters and is the product's promise: everything that can be checked without weights (config values,
dataset rows, platform, backend selection) is checked before the model loads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import dataset as ds
from runner import evidence
from runner.artifacts import Journal, atomic_write_bytes, encode_png
from runner.manifest import Manifest, git_state, now_iso, package_versions
from runner.platform import detect

log = logging.getLogger("runner")

REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigValueError(ValueError):
    """A run-level config value is out of range (names the field, the value and the fix)."""


def resolve_dtype(name: str, platform_kind: str) -> torch.dtype:
    """``auto`` -> bfloat16 on GPUs/accelerators, float32 on CPU.

    Raises:
        ConfigValueError: unknown dtype name.
    """
    if name == "auto":
        return torch.float32 if platform_kind == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ConfigValueError(f"dtype={name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def check_run_values(cfg: DictConfig) -> None:
    """Range checks of run-level fields that Hydra's type checks cannot express.

    Raises:
        ConfigValueError: naming the field, the value and the fix.
    """
    if cfg.batch_size < 1:
        raise ConfigValueError(f"batch_size={cfg.batch_size} must be >= 1; fix: batch_size=1")
    if cfg.num_images_per_prompt < 1:
        raise ConfigValueError(f"num_images_per_prompt={cfg.num_images_per_prompt} must be >= 1")
    if cfg.max_pixels < 1:
        raise ConfigValueError(f"max_pixels={cfg.max_pixels} must be >= 1")
    if cfg.compile not in ("none", "regional"):
        raise ConfigValueError(f"compile={cfg.compile!r} is not one of none, regional")
    if cfg.parallelism.mode != "single" or cfg.parallelism.world_size != 1:
        raise ConfigValueError(f"parallelism.mode={cfg.parallelism.mode!r} (world_size={cfg.parallelism.world_size})"
                               " is not implemented yet; fix: parallelism=single")


def make_adapter(cfg: DictConfig, device: str, dtype: torch.dtype):
    """The pipeline adapter named by ``model.adapter``.

    Raises:
        ConfigValueError: unknown adapter.
    """
    if cfg.model.adapter == "flux":
        from models.flux import FluxAdapter

        return FluxAdapter(cfg.model, device, dtype, cache_dir=cfg.cache_dir)
    raise ConfigValueError(f"model.adapter={cfg.model.adapter!r} is not known; fix: flux")


def _user_errors() -> tuple:
    from kernels.attention import AttentionWiringError
    from kernels.registry import BackendError
    from models.flux import ModelPathError
    from runner.platform import PlatformError

    return (ds.DatasetError, ConfigValueError, BackendError, PlatformError, ModelPathError, AttentionWiringError,
            evidence.EvidenceError)


LIBRARY_ENV = ("DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES",
               "TORCH_CUDNN_SDPA_ENABLED", "PYTORCH_CUDA_ALLOC_CONF")


def resolve_backends(cfg: DictConfig, overrides: Sequence[str], adapter: Any, plat: Any, dtype: torch.dtype):
    """Resolve the stage's backends under the precedence contract and check they can run here (no weights load).

    Returns:
        ``({field: FieldResolution}, engine_extras)`` of the adapter's stage.

    Raises:
        kernels.registry.BackendError subclasses, naming the field, the value, the reason and the fix.
    """
    from kernels.registry import SelectionContext
    from runner.resolve import StageInfo, check_placement, cli_keys, resolve_stage

    check_placement(cfg)
    ctx = SelectionContext(platform_kind=plat.kind, sm=plat.sm, dtype=dtype, head_dim=adapter.head_dim(),
                           needs_mask=adapter.needs_mask, sequence_parallel=False)
    info = StageInfo(name=adapter.stage, roles=list(cfg.model.roles), fields=adapter.backend_fields, ctx=ctx)
    resolutions, extras = resolve_stage(cfg, cli_keys(overrides), info)
    from kernels.attention import plan

    for spec in resolutions["attention"].selected.values():  # wiring problems surface now, not after loading
        plan(spec["backend"], plat.sm)
    return resolutions, extras


def install_backends(adapter: Any, resolutions: Dict[str, Any], plat: Any, compile_mode: str = "none",
                     observe: bool = True) -> Dict[str, Any]:
    """Wire the selected attention and linear implementations into the loaded model, with their probes, then
    compile if asked (``regional``: ``torch.compile`` of each repeated transformer block, diffusers'
    ``compile_repeated_blocks``). Compiled runs keep no Python call counters; the profiler gives their evidence.
    ``observe=False`` (``evidence.enabled=false``) installs the same implementations without any probe.

    Raises:
        ConfigValueError: unknown ``compile`` mode.
    """
    from kernels import attention, linear

    if compile_mode not in ("none", "regional"):
        raise ConfigValueError(f"compile={compile_mode!r} is not one of none, regional")
    observe = observe and compile_mode == "none"
    sites = attention.install(adapter.stage, adapter.attention_sites(), resolutions["attention"].selected, plat.sm,
                              observe=observe)
    lin = linear.install(adapter.denoiser, resolutions["linear"].selected, observe=observe)
    if compile_mode == "regional":
        adapter.denoiser.compile_repeated_blocks(fullgraph=False, dynamic=False)
    return {"attention": sites, "linear": lin, "observed": observe}


def expected_forwards(batch: List[ds.Item], true_cfg_scale: float) -> int:
    """Denoiser forwards a FluxPipeline call makes for ``batch``: steps, doubled under true CFG."""
    r = batch[0].row
    return r.num_inference_steps * (2 if r.negative_prompt is not None and true_cfg_scale > 1 else 1)


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (),
        on_loaded: Optional[Callable[[Any], None]] = None) -> int:
    """Execute one run into ``run_dir``. Returns the process exit code (0: every item written and verified).

    Args:
        cfg: the composed run config.
        run_dir: output directory (the Hydra run dir).
        overrides: the CLI overrides (Hydra's task overrides); they decide the CLI precedence layers.
        on_loaded: called with the adapter once the model is loaded and backends are installed (tests use it
            to tamper with the model and check that the evidence notices).

    Raises:
        evidence.EvidenceError: strict evidence found a mismatch (after everything was written).
        dataset.DatasetError, ConfigValueError, PlatformError, ModelPathError and backend selection errors, all
        before any weight loads.
    """
    t_start = time.perf_counter()
    run_dir = Path(run_dir)
    out_dir = Path(cfg.output.dir) if cfg.output.dir else run_dir
    check_run_values(cfg)
    model_defaults = cfg.model.generation
    defaults = dict(width=model_defaults.width, height=model_defaults.height,
                    num_inference_steps=model_defaults.num_inference_steps,
                    guidance_scale=model_defaults.guidance_scale, num_images_per_prompt=cfg.num_images_per_prompt)
    rows, data_path = ds.load_rows(cfg.dataset.format, cfg.dataset.path, defaults=defaults,
                                   size_multiple=cfg.model.size_multiple, max_pixels=cfg.max_pixels,
                                   limit=cfg.dataset.limit)
    items = ds.expand_items(rows, cfg.seed)
    plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
    dtype = resolve_dtype(cfg.dtype, plat.kind)
    adapter = make_adapter(cfg, plat.device, dtype)
    source = adapter.resolve_source()
    resolutions, engine_extras = resolve_backends(cfg, overrides, adapter, plat, dtype)

    out_dir.mkdir(parents=True, exist_ok=True)
    img_dir = out_dir / "images"
    img_dir.mkdir(exist_ok=True)
    manifest = Manifest(out_dir / "manifest.json")
    manifest.section("config", OmegaConf.to_container(cfg, resolve=True))
    manifest.section("overrides", list(overrides))
    manifest.section("git", git_state(REPO_ROOT))
    manifest.section("packages", package_versions())
    manifest.section("platform", plat.to_dict())
    manifest.section("dtype", str(dtype).replace("torch.", ""))
    manifest.section("dataset", {"format": cfg.dataset.format, "path": str(data_path),
                                 "sha256": ds.file_sha256(data_path), "rows": len(rows), "items": len(items)})
    manifest.section("model", {"name": cfg.model.name, "adapter": cfg.model.adapter, "source": source})
    manifest.section("backends", {adapter.stage: {f: r.to_dict() for f, r in resolutions.items()}})
    manifest.section("environment", {k: os.environ[k] for k in LIBRARY_ENV if k in os.environ})
    manifest.flush()

    t0 = time.perf_counter()
    adapter.load()
    load_s = time.perf_counter() - t0
    manifest.section("model", {"name": cfg.model.name, "adapter": cfg.model.adapter, "source": adapter.source,
                               "load_s": round(load_s, 3)})
    probes = install_backends(adapter, resolutions, plat, cfg.compile, observe=cfg.evidence.enabled)
    # Profile the 2nd forward when compiled (the 1st compiles), else the 1st.
    denoiser = evidence.DenoiserProbe(adapter.denoiser, profile=cfg.evidence.enabled and cfg.evidence.profile,
                                      device_kind=plat.kind,
                                      profile_forward=2 if cfg.compile != "none" else 1)
    if on_loaded is not None:
        on_loaded(adapter)
    manifest.flush()
    want_forwards = 0

    counts = {"ok": 0, "failed": 0}
    gen_s = write_s = 0.0
    journal = Journal(out_dir / "items.jsonl")
    status = "running"
    from tqdm import tqdm

    bar = tqdm(total=len(items), unit="img", desc=cfg.model.name, dynamic_ncols=True)
    try:
        for batch in ds.batches(items, cfg.batch_size):
            t0 = time.perf_counter()
            want_forwards += expected_forwards(batch, float(cfg.model.generation.true_cfg_scale))
            images = adapter.generate(batch)
            t1 = time.perf_counter()
            per_item_gen = (t1 - t0) / len(batch)
            gen_s += t1 - t0
            for it, img in zip(batch, images):
                tw = time.perf_counter()
                rec: Dict[str, Any] = {
                    "id": it.row.id, "index": it.index, "key": it.key,
                    "prompt_sha256": hashlib.sha256(it.row.prompt.encode()).hexdigest(),
                    "seed": it.seed,
                    "params": {"width": it.row.width, "height": it.row.height,
                               "num_inference_steps": it.row.num_inference_steps,
                               "guidance_scale": it.row.guidance_scale,
                               "negative_prompt": it.row.negative_prompt, "batch_size": len(batch)},
                }
                if not np.isfinite(img).all():
                    rec.update(status="failed", reason=f"non-finite output ({int((~np.isfinite(img)).sum())} values)",
                               file=None)
                    counts["failed"] += 1
                else:
                    data = encode_png(img)
                    path = img_dir / f"{it.key}.png"
                    atomic_write_bytes(path, data)
                    rec.update(status="ok", file=str(path.relative_to(out_dir)),
                               file_sha256=hashlib.sha256(data).hexdigest())
                    counts["ok"] += 1
                rec["timing"] = {"generate_s": round(per_item_gen, 4),
                                 "write_s": round(time.perf_counter() - tw, 4)}
                journal.append(rec)
                write_s += time.perf_counter() - tw
                bar.update(1)
        status = "completed" if counts["failed"] == 0 else "completed_with_failures"
        if cfg.evidence.enabled:
            ev = evidence.build(adapter.stage, probes, denoiser, want_forwards, finite=counts["failed"] == 0,
                                device=plat.device)
        else:
            ev = {"enabled": False, "pid": os.getpid(), "device": plat.device, "all_finite": counts["failed"] == 0,
                  "verdict": "not_collected", "mismatches": []}
        manifest.section("evidence", ev)
        if ev["verdict"] not in ("verified", "not_collected"):
            status = "evidence_mismatch" if cfg.evidence.strict else "limited"
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        manifest.section("error", f"{type(e).__name__}: {e}")
        raise
    finally:
        bar.close()
        journal.close()
        wall = time.perf_counter() - t_start
        manifest.section("counts", counts)
        manifest.section("timing", {"wall_s": round(wall, 3), "load_s": round(load_s, 3),
                                    "generate_s": round(gen_s, 3), "write_s": round(write_s, 3),
                                    "images_per_s": round(counts["ok"] / gen_s, 4) if gen_s else None})
        manifest.doc["status"] = status
        manifest.doc["ended_at"] = now_iso()
        manifest.flush()
    log.info("run %s: %d ok, %d failed, %.1f s -> %s", status, counts["ok"], counts["failed"],
             time.perf_counter() - t_start, out_dir)
    if status == "evidence_mismatch":
        raise evidence.EvidenceError("evidence contradicts the resolved backends (evidence.strict=true):\n  "
                                     + "\n  ".join(manifest.doc["evidence"]["mismatches"]))
    return 0 if counts["failed"] == 0 else 1


USER_ERRORS = _user_errors()
