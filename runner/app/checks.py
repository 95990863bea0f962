"""Checks of the composed run config that need no engine and no weights: the schema (keys Hydra's ``+`` let
through, Hydra's instantiate keys), run-level value ranges, the compute dtype, and the run-level rules that hold
across stages (a dir a non-resuming stage would mix into, a step cache without a diffusion stage, ``cpu_threads``).
Each refusal names the key, the value and the fix (exit 2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from runner.core.errors import ConfigValueError

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

    check_renamed_keys(cfg)
    check_distilled_paths(cfg)
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


def check_distilled_paths(cfg: DictConfig) -> None:
    """A few-step distilled preset (``model.distilled``, ``experiment=wan22_lightning_4step`` ...) leaves its adapter
    files for the user to fill in (``path: ???``); each unfilled one is refused here, at startup before any weight
    loads, naming the entry, the preset, where the files are published (``model.distilled.source``) and the override
    that fills it in. Also refused: a preset naming an adapter that ``model.lora`` lacks.

    Raises:
        ConfigValueError: every unfilled or unknown adapter of the preset at once (exit 2).
    """
    model = cfg.get("model")
    d = model.get("distilled") if isinstance(model, DictConfig) else None
    if not isinstance(d, DictConfig) or d.get("preset") in (None, ""):
        return
    preset, wanted = d.preset, [str(a) for a in (d.get("adapters") or [])]
    entries = list(model.get("lora") or [])
    names = [e.get("name") if not OmegaConf.is_missing(e, "name") else None for e in entries]
    src = f" (published: {d.source})" if d.get("source") else ""
    problems = []
    for a in wanted:
        if a not in names:
            problems.append(f"model.distilled.adapters names {a!r}, which no model.lora entry is (names: "
                            f"{', '.join(map(str, names)) or 'none'}); fix: add {{name: {a}, path: <file>}} to "
                            "model.lora, or drop it from model.distilled.adapters")
            continue
        i = names.index(a)
        if OmegaConf.is_missing(entries[i], "path"):
            expert = entries[i].get("expert")
            problems.append(f"model.lora[{i}].path ({a}{', expert ' + str(expert) if expert else ''}) is not set: "
                            f"experiment={preset} needs the distilled adapter file, which you supply{src}; fix: "
                            f"model.lora.{i}.path=/path/to/{a}.safetensors")
    if not wanted:
        problems.append(f"model.distilled.preset={preset} names no adapter (model.distilled.adapters is empty); fix: "
                        "list the model.lora entries (by name) that are the preset's distilled adapters")
    if problems:
        raise ConfigValueError("; ".join(problems))


def check_renamed_keys(cfg: DictConfig) -> None:
    """Refuse a key the schema renamed, naming its new name: ``model.adapter`` (and a pipeline stage's ``adapter``,
    and its stage model's) is ``engine`` since issue #39 (``adapter`` means a LoRA to this field's users). The schema
    keeps the old name as a guard that must stay null, so this message comes instead of Hydra's "key not in struct".

    Raises:
        ConfigValueError: every renamed key set, with its value and the fix (the command line and the model YAML).
    """
    model = cfg.model
    bad = [f"model.adapter={model.adapter}"] if model.get("adapter") is not None else []
    for sname, stage in (model.get("stages") or {}).items():
        if stage.get("adapter") is not None:
            bad.append(f"model.stages.{sname}.adapter={stage.adapter}")
        sub = stage.get("model")
        if sub is not None and sub.get("adapter") is not None:
            bad.append(f"model.stages.{sname}.model.adapter={sub.adapter}")
    if bad:
        fixes = [b.replace("adapter=", "engine=") for b in bad]
        raise ConfigValueError(
            f"{', '.join(bad)}: the model's engine is called engine since issue #39 (adapter means a LoRA adapter); "
            f"fix: {' '.join(fixes)} on the command line, or 'engine: <name>' instead of 'adapter: <name>' in the "
            "model YAML")


def check_run_values(cfg: DictConfig) -> None:
    """Range checks of run-level fields that Hydra's type checks cannot express (a model's own fields are checked
    by its engine's ``check_config``).

    Raises:
        ConfigValueError: naming the field, the value and the fix.
    """
    check_run_dir_keys(cfg)
    if cfg.batch_size < 1:
        raise ConfigValueError(f"batch_size={cfg.batch_size} must be >= 1; fix: batch_size=1")
    if cfg.dataset.limit is not None and cfg.dataset.limit < 1:
        raise ConfigValueError(f"dataset.limit={cfg.dataset.limit} must be >= 1; fix: dataset.limit=<a row count>, "
                               "or dataset.limit=null for every row")
    if cfg.num_images_per_prompt < 1:
        raise ConfigValueError(f"num_images_per_prompt={cfg.num_images_per_prompt} must be >= 1; fix: "
                               "num_images_per_prompt=1")
    if cfg.max_pixels < 1:
        raise ConfigValueError(f"max_pixels={cfg.max_pixels} must be >= 1; fix: max_pixels=<width x height at most>, "
                               "e.g. max_pixels=4194304")
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
    assign = str(cfg.parallelism.get("assign", "static"))
    if assign == "claims" and mode != "data":
        raise ConfigValueError(f"parallelism.assign=claims with parallelism={mode}: claims hand out the batches of "
                               "parallelism=data only; fix: parallelism=data, or parallelism.assign=static")
    if cfg.launcher.name == "slurm" and mode != "data":
        raise ConfigValueError(f"launcher=slurm with parallelism={mode}: the SLURM launcher submits an array of "
                               "data-parallel workers; fix: add parallelism=data (or launcher=local)")
    if cfg.launcher.name == "ray" and mode == "single":  # context modes: layout() says torchrun runs those
        raise ConfigValueError("launcher=ray with parallelism=single: the Ray launcher runs an actor pool of "
                               "data-parallel workers, and a single run would run in this process, not on Ray; fix: "
                               "add parallelism=data (or launcher=local)")
    if assign == "claims" and not float(cfg.parallelism.lease_s) > 0:
        raise ConfigValueError(f"parallelism.lease_s={cfg.parallelism.lease_s} must be > 0 seconds (how long a claim "
                               "lives without renewal); fix: parallelism.lease_s=60")
    if mode == "data" and tw is None and cfg.launcher.name not in ("ray", "slurm") and assign != "claims":
        raise ConfigValueError("parallelism=data needs workers; fix: launch with `torchrun --nproc-per-node N -m runner "
                               "parallelism=data`, add launcher=ray (or launcher=slurm), or start any number of "
                               "`python -m runner parallelism=data parallelism.assign=claims hydra.run.dir=<shared "
                               "dir>` workers")
    lay = layout(cfg, tw.world_size if tw is not None else None)  # context modes: degrees x data = world size
    if lay is not None and cfg.evidence.enabled and not cfg.evidence.profile:
        raise ConfigValueError(f"parallelism={mode} with evidence.profile=false: only the profiler sees the collectives "
                               "that prove each sequence was split and exchanged; fix: evidence.profile=true (or "
                               "evidence.enabled=false to run without evidence)")


def check_run_dir_keys(cfg: DictConfig) -> None:
    """``run.resume`` and ``output.dir`` both given must name the same run dir: the run goes where ``run.resume``
    points, so a different ``output.dir`` would be ignored without a word (its dir never created).

    Raises:
        ConfigValueError: naming both values and the fix.
    """
    from runner.core import storage

    resume, out = OmegaConf.select(cfg, "run.resume"), OmegaConf.select(cfg, "output.dir")  # a partial config too
    if not resume or not out:
        return

    def where(v: Any) -> str:
        return str(v).rstrip("/") if storage.is_url(v) else str(storage.local_path(str(v)).resolve())

    if where(resume) != where(out):
        raise ConfigValueError(f"run.resume={str(resume)!r} and output.dir={str(out)!r} name two different run dirs: "
                               f"run.resume continues the run in {resume} and output.dir would be ignored; fix: "
                               f"drop output.dir to resume {resume}, or drop run.resume for a run in {out}")


def check_fresh_dir(out_dir: Path, resumable: bool, engine: str) -> None:
    """A stage that does not resume refuses a dir that already holds a run (its records would mix with this run's).

    Raises:
        runner.core.resume.ResumeConflictError: naming the files found and the fix.
    """
    from runner.core.resume import ResumeConflictError

    if resumable:
        return
    from runner.core.resume import previous_run

    # a manifest of a run refused at startup (status refused/invalid: nothing produced) is not a run: the corrected
    # command goes into the same dir, as a resumable stage's does (resume.previous_run)
    held = [n for n in ("manifest.json", "items.jsonl") if (out_dir / n).exists()
            and (n != "manifest.json" or previous_run(out_dir) is not None)]
    if held:
        raise ResumeConflictError(
            f"{out_dir} already holds a run ({', '.join(held)}); {engine} runs do not resume and "
            "would mix two runs' records; fix: run into a new dir (hydra.run.dir=<new dir> or "
            "output.dir=<new dir>)")


def apply_cpu_threads(cfg: DictConfig) -> None:
    """``cpu_threads``: torch's intra-op thread count (null: torch's default).

    Raises:
        ConfigValueError: a value below 1.
    """
    if cfg.cpu_threads is not None:
        if cfg.cpu_threads < 1:
            raise ConfigValueError(f"cpu_threads={cfg.cpu_threads} must be >= 1; fix: cpu_threads=<threads>, or "
                                   "cpu_threads=null for torch's default")
        torch.set_num_threads(int(cfg.cpu_threads))


def check_cache_applies(cfg: DictConfig, engines: Sequence[Any]) -> None:
    """A step cache (``cache.method``) needs a stage whose engine applies it (a diffusion transformer's steps).

    Raises:
        ConfigValueError: naming ``cache.method``, the model and the fix.
    """
    cache_cfg = cfg.get("cache")
    if cache_cfg is not None and str(cache_cfg.method).strip().lower() not in ("none", "", "null", "off") and not any(
            getattr(e, "applies_cache", False) for e in engines):
        raise ConfigValueError(f"cache.method={cache_cfg.method}: model={cfg.model.name} has no diffusion stage, and "
                               "step caching applies to a diffusion transformer's denoising steps only; fix: "
                               "cache.method=none")
