"""Where a diffusion stage's weights come from and what they hold, known before anything loads: the weight source
(a local snapshot, a Hub id in the local cache, an embedded model built into the cache on first use, or
``load_format=dummy``), the snapshot's layout and architecture checked against the family's spec and
``model.task``, each component's config and class, the pipeline class and its settings, and the denoisers the
model has. Read from ``model_index.json`` and the components' configs (:mod:`models.snapshot`); no weights load.

:class:`WeightSource` is a part of :class:`models.pipelines.PipelineEngine` (its attributes: ``spec``, ``cfg``,
``ctx``, ``components``, ``pipeline_class``, ``source``, ``task``).
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from models.snapshot import check_snapshot, embedded_target, read_index
from models import snapshot
from runner.core.errors import ConfigValueError
from runner.core.weights import ModelPathError


def family_names() -> List[str]:
    """The registered diffusion families (:func:`models.registry.family_names`), for messages."""
    from models.registry import family_names as names

    return names()


def models_with_task(task: str) -> List[str]:
    """The model options (``conf/model/*.yaml``) whose config sets ``task: <task>`` (``image_to_video``:
    tiny_wan_flf2v, tiny_wan_i2v, wan_i2v), for a refusal's fix; read as YAML text, nothing composed."""
    import yaml

    from runner.core.paths import CONF_DIR

    out = []
    for p in sorted((CONF_DIR / "model").glob("*.yaml")):
        try:
            doc = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except (OSError, ValueError, yaml.YAMLError):  # ValueError: UnicodeDecodeError (not UTF-8)
            continue
        if isinstance(doc, dict) and str(doc.get("task")) == task:
            out.append(p.stem)
    return out


class WeightSource:
    """The weight source and what it holds, for :class:`models.pipelines.PipelineEngine` (see the module doc)."""

    def pipeline_name(self) -> str:
        """The diffusers pipeline class this stage loads: the family's for ``model.task`` (:attr:`task`), else the
        snapshot's ``_class_name``."""
        if self.spec is not None:
            return self.spec.pipeline_for(self.task)
        if self.pipeline_class:
            return self.pipeline_class
        if self.source.get("kind") == "path":
            return str(read_index(Path(self.source["path"])).get("_class_name"))
        raise ModelPathError(f"model={self.cfg.name} (model.engine=diffusers) learns its pipeline from a snapshot; "
                             "fix: set model.path to a diffusers snapshot (embedded and dummy weights need a family: "
                             f"model.engine={'|'.join(family_names())})")

    def pipeline_cls(self) -> type:
        """The diffusers pipeline class object.

        Raises:
            ModelPathError: diffusers has no class of that name (a newer diffusers, or not a diffusers pipeline).
        """
        import diffusers

        name = self.pipeline_name()
        cls = getattr(diffusers, name, None)
        if cls is None:
            raise ModelPathError(f"model.path={self.source.get('path')!r} names pipeline {name!r}, which diffusers "
                                 f"{diffusers.__version__} does not have; fix: a snapshot of a diffusers pipeline, "
                                 "or a diffusers version that has it")
        return cls

    def arch_copy(self) -> Dict[str, Any]:
        """``model.architecture`` of the stage's typed model config, as a fresh copy (callers may change it)."""
        import copy

        return copy.deepcopy(dict(self.ctx.model.architecture or {}))

    def resolve_source(self) -> Dict[str, Any]:
        """Decide where weights come from and validate it, without loading anything: ``model.path`` (a local
        snapshot, or a Hub id resolved in the local Hugging Face cache), an embedded model, or ``dummy``.

        Raises:
            ModelPathError: not a diffusers snapshot, pickle weights only, a layout another pipeline's, or no
                weights configured.
            ConfigValueError: a ``model.architecture`` key the component classes do not take, or one given for a
                snapshot that says otherwise.
        """
        cfg = self.cfg
        if cfg.load_format == "dummy" or (cfg.embedded and not cfg.path):
            self.check_architecture(self.arch_copy())
        if cfg.load_format == "dummy":
            self.source = {"kind": "dummy", "weights_seed": self.arch_copy().get("weights_seed", 0)}
        elif cfg.path:
            from runner.core.weights import resolve_model_path

            path, prov = resolve_model_path(str(cfg.path), cfg.revision)
            self.source = {"kind": "path", "path": str(check_snapshot(str(path)).resolve()), "revision": cfg.revision}
            if prov.get("kind") == "hub":  # the Hub id, the commit the cache holds, where the cache is
                self.source["hub"] = {k: prov[k] for k in ("repo_id", "revision", "requested_revision", "cache_dir")
                                      if k in prov}
            self.check_layout(Path(self.source["path"]))
            given = [o.lstrip("+~").split("=", 1)[0] for o in self.ctx.overrides]
            arch, cli = self.arch_copy(), {}
            for key in given:
                parts = key.split(".")
                if parts[:2] == ["model", "architecture"] and len(parts) == 4 and isinstance(arch.get(parts[2]), dict):
                    cli.setdefault(parts[2], {})[parts[3]] = arch[parts[2]].get(parts[3])
            self.check_architecture_matches_snapshot(cli, Path(self.source["path"]))
        elif cfg.embedded:
            self.source = {"kind": "embedded"}
        else:
            raise ModelPathError(f"model={cfg.name} needs weights: set model.path=/path/to/diffusers/snapshot (or a "
                                 "Hub id in the local cache), or model.load_format=dummy for random weights")
        return self.source

    def check_layout(self, path: Path) -> None:
        """The snapshot's ``model_index.json`` must name a pipeline class ``model.task`` can load from, and each
        component and processor the task's pipeline takes must be there with the class the family expects
        (:meth:`layout_problems`).

        Raises:
            ModelPathError: naming what model=<name> expects for its task and what the snapshot holds, and the fix.
        """
        index = read_index(path)
        found = str(index.get("_class_name"))
        comps = {k: v[1] for k, v in index.items() if isinstance(v, list) and not k.startswith("_") and v[1]}
        have = ", ".join(f"{k}: {v}" for k, v in sorted(comps.items())) or "no components"
        problems = self.layout_problems(path, found, comps)
        if problems:
            from models.registry import family_for_pipeline

            other = family_for_pipeline(found)
            want = self.spec.snapshot_pipeline(self.task) if self.spec is not None else self.pipeline_class
            raise ModelPathError(
                f"model.path={str(path)!r} is not a {want or 'diffusers'} snapshot that model={self.cfg.name} "
                f"(model.task={self.task}) can load: " + "; ".join(problems) + f" (the snapshot: {found} with "
                f"{have}); fix: " + (
                    f"use a model config with model.engine={other} for this snapshot" if other and other !=
                    self.family() else f"point model.path at a {want} snapshot (a checkpoint of model.task="
                    f"{self.task}), or model.task=<the snapshot's task>" if other else
                    "point model.path at a snapshot of this model, or use model.engine=diffusers for "
                    "another transformer-based pipeline"))
        if "transformer" not in comps:
            raise ModelPathError(f"model.path={str(path)!r}: {found} has no transformer ({have}); the runner serves "
                                 "transformer-based pipelines (a UNet pipeline is not one); fix: a DiT snapshot "
                                 "(FLUX.1, SD3.5, Qwen-Image, Wan...)")

    def layout_problems(self, path: Path, found: str, comps: Dict[str, str]) -> List[str]:
        """What a snapshot (``model_index.json``'s ``_class_name`` ``found``, its ``comps``) lacks for
        ``model.task``: a task with a checkpoint of its own (:meth:`models.family.FamilySpec.own_snapshot`: Edit-Plus,
        Wan I2V) needs a snapshot of exactly that pipeline; other tasks load any of the family's base-layout
        snapshots. Every component of :meth:`task_components` and processor of the task must be present."""
        problems = []
        task = self.task
        if self.spec is not None and self.spec.own_snapshot(task):
            classes = [self.spec.tasks[task]]
        elif self.spec is not None:
            classes = [c for t, c in self.spec.tasks.items() if not self.spec.own_snapshot(t)]
        else:
            classes = [self.pipeline_class]
        if self.pipeline_class and found not in classes:
            problems.append(f"pipeline {' or '.join(classes)}, found {found}")
        for comp, (_lib, cls_name, _cfg) in self.task_components(task).items():
            if comp == "scheduler" or (comp not in comps and self.spec is not None and self.spec.optional(comp)):
                continue
            if comp not in comps:
                problems.append(f"component {comp} ({cls_name}) is missing")
            elif comps[comp] != cls_name:
                problems.append(f"{comp} is {comps[comp]}, expected {cls_name}")
            elif not (path / comp).is_dir():
                problems.append(f"folder {comp}/ is missing")
        procs = self.spec.processors_for(task) if self.spec is not None else {}
        problems += [f"processor {comp} is missing" for comp in procs if comp not in comps]
        return problems

    def check_architecture(self, arch: Dict[str, Any], where: str = "model.architecture") -> None:
        """Every key of ``arch`` against the family's component classes, before anything is built.

        Raises:
            ConfigValueError: an unknown or missing key, naming it, the class and the fix.
        """
        import difflib

        from models.base import check_init_keys
        from runner.core.resolve import MisplacedBackendKeyError, backend_field_of, misplaced_backend_message

        if not self.components:
            raise ConfigValueError(f"model={self.cfg.name}: model.engine={self.family()} builds no architecture; "
                                   f"fix: model.path=<snapshot>, or a family engine ({', '.join(family_names())})")
        extras = self.spec.task_components.values() if self.spec is not None else ()
        procs = self.spec.task_processors.values() if self.spec is not None else ()
        known = [*self.components, *self.arch_other, *(c for m in extras for c in m), *(c for m in procs for c in m)]
        if self.spec is not None and self.spec.pipeline_config:
            known.append("pipeline")
        for key in arch:
            if key not in known and backend_field_of(key):
                raise MisplacedBackendKeyError(misplaced_backend_message(f"{where}.{key}", arch[key]))
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                raise ConfigValueError(f"{where}.{key} is not read by the {self.family()} builder" + (
                    f"; did you mean {where}.{close[0]}?" if close else f" (it reads {', '.join(known)})")
                    + " fix: remove or correct it")
        for key, (lib, cls_name, cfg_name) in self.task_components(self.task).items():
            name = cfg_name or cls_name
            if arch.get(key) is None and self.spec is not None and self.spec.optional(key):
                continue  # an expert the model does not have (Wan 2.1: no transformer_2)
            own = list((self.spec.task_components.get(self.task) or {}) if self.spec is not None else ())
            others = models_with_task(self.task) if key in own else []
            if key in own and not any(isinstance(arch.get(k), dict) for k in own) and self.cfg.name not in others:
                # the model's config has none of the task's own components: a model of another task, asked for it
                raise ConfigValueError(
                    f"model.task={self.task}: model={self.cfg.name} does not support it (its architecture has no "
                    f"{', '.join(own)}: a {self.family()} checkpoint of another task); "
                    f"fix: model.task=null (the model's own task)" + (
                        f", or a model that has the task: model={'|'.join(others)}" if others else ""))
            if not isinstance(arch.get(key), dict):
                raise ConfigValueError(f"{where}.{key} is missing (a mapping of {lib}'s {name} arguments); fix: "
                                       f"start from a tiny_* model config of this family")
            check_init_keys(getattr(importlib.import_module(lib), name), list(arch[key]), f"{where}.{key}")
        self.check_processor_keys(arch, where)
        self.check_pipeline_keys(arch.get("pipeline") or {}, where)
        for key in arch.get("tokenizer") or {}:
            if key not in self.arch_other["tokenizer"]:
                raise ConfigValueError(f"{where}.tokenizer.{key} is not read; it takes "
                                       f"{', '.join(self.arch_other['tokenizer'])}; fix: remove or correct it")

    def check_task_components(self, where: str = "model.architecture") -> None:
        """A ``model.architecture`` component or processor that only another task's pipeline builds (a text-to-video
        Wan given an ``image_encoder``) would be ignored by this run's task, so it is refused. Checked for the sources
        whose architecture :meth:`check_architecture` checks (dummy and embedded weights), after the engine's
        :meth:`check_source` (whose rules name the task that fits a checkpoint of another task: Wan's input channels).

        Raises:
            ConfigValueError: naming the key, the tasks that build it, this run's task and the fix.
        """
        if self.spec is None or not (self.cfg.load_format == "dummy" or (self.cfg.embedded and not self.cfg.path)):
            return
        mine = {**self.task_components(self.task), **self.spec.processors_for(self.task)}
        for key in self.arch_copy():
            tasks = sorted(t for t, m in (*self.spec.task_components.items(), *self.spec.task_processors.items())
                           if key in m and key not in mine)
            if tasks:
                raise ConfigValueError(
                    f"{where}.{key} is built only for model.task={'|'.join(tasks)}; this run's task is {self.task} "
                    f"(model={self.cfg.name}), whose pipeline takes no {key}; fix: remove {where}.{key}, or "
                    f"model.task={tasks[0]}")

    def check_pipeline_keys(self, given: Any, where: str = "model.architecture") -> None:
        """``model.architecture.pipeline``: a mapping of the spec's ``pipeline_config`` arguments (the pipeline
        class's settings: WanPipeline's ``boundary_ratio``, ``expand_timesteps``).

        Raises:
            ConfigValueError: not a mapping, or a key the spec does not declare, naming it and the fix.
        """
        takes = tuple(self.spec.pipeline_config) if self.spec is not None else ()
        if not isinstance(given, dict):
            raise ConfigValueError(f"{where}.pipeline={given!r} is not a mapping of {', '.join(takes)}; fix: a "
                                   "mapping (or remove it for the pipeline's defaults)")
        bad = sorted(k for k in given if k not in takes)
        if bad:
            raise ConfigValueError(f"{where}.pipeline.{bad[0]} is not a setting of {self.pipeline_name()} the runner "
                                   f"builds (it takes {', '.join(takes) or 'none'}); fix: remove or correct it")

    def pipeline_settings(self) -> Dict[str, Any]:
        """The spec's ``pipeline_config`` values the pipeline will run with, known before loading: the snapshot's
        ``model_index.json`` for ``model.path``, else ``model.architecture.pipeline``; a value neither gives is the
        pipeline class's ``__init__`` default (what diffusers uses). ``{}`` without a spec."""
        if self.spec is None or not self.spec.pipeline_config:
            return {}
        if not self.source:
            self.resolve_source()
        key = json.dumps(self.source, sort_keys=True, default=str)
        if self._settings[0] != key:  # read once per weight source (records ask per item)
            given = (read_index(Path(self.source["path"])) if self.source.get("kind") == "path"
                     else self.arch_copy().get("pipeline") or {})
            params = inspect.signature(self.pipeline_cls().__init__).parameters
            self._settings = (key, {k: given[k] if k in given else (params[k].default if k in params else None)
                                    for k in self.spec.pipeline_config})
        return dict(self._settings[1])

    def declared_experts(self) -> List[str]:
        """The spec's experts the model has, known before loading: those the snapshot's ``model_index.json`` names
        (a null entry is absent) for ``model.path``, else those ``model.architecture`` builds."""
        names = self.spec.experts if self.spec is not None else ("transformer",)
        if not self.source:
            self.resolve_source()
        if self.source.get("kind") == "path":
            index = read_index(Path(self.source["path"]))
            return [n for n in names if n == names[0] or any(index.get(n) or [])]
        arch = self.arch_copy()
        return [n for n in names if n == names[0] or arch.get(n) is not None]

    def check_processor_keys(self, arch: Dict[str, Any], where: str = "model.architecture") -> None:
        """The keys of the task's processor configs (``model.architecture.<processor>``, optional) against the
        arguments the processor takes (:func:`models.processors.processor_keys`).

        Raises:
            ConfigValueError: an unknown key, naming it, the closest argument and the fix.
        """
        import difflib

        from models.processors import processor_keys

        procs = self.spec.processors_for(self.task) if self.spec is not None else {}
        for comp, (kind, _tok) in procs.items():
            given = arch.get(comp) or {}
            if not isinstance(given, dict):
                raise ConfigValueError(f"{where}.{comp}={given!r} is not a mapping of {kind} processor arguments; "
                                       f"fix: a mapping (or remove it for the defaults)")
            takes = processor_keys(kind)
            for key in given:
                if key not in takes:
                    close = difflib.get_close_matches(key, takes, n=1)
                    raise ConfigValueError(f"{where}.{comp}.{key} is not an argument of the {kind} processor" + (
                        f"; did you mean {where}.{comp}.{close[0]}?" if close else f" (it takes {', '.join(takes)})")
                        + " fix: remove or correct it")

    def check_architecture_matches_snapshot(self, arch: Dict[str, Any], path: Path,
                                            where: str = "model.architecture") -> None:
        """With ``model.path`` the snapshot's component configs decide the architecture; every component value in
        ``arch`` (the keys given on the command line) must be what the snapshot's config says, and every pipeline
        setting (``arch["pipeline"]``) what its ``model_index.json`` says, so a manifest never records an
        architecture override that did not run.

        Raises:
            ConfigValueError: listing each key the snapshot's config lacks or holds another value for, and the fix.
        """
        from models.base import check_init_keys

        problems = []
        norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
        index = read_index(path)
        for key, value in (arch.get("pipeline") or {}).items():  # pipeline settings: model_index.json decides
            if key in index and norm(index[key]) != norm(value):
                problems.append(f"{where}.pipeline.{key}={value!r}: the snapshot's model_index.json says {index[key]!r}")
            elif key not in index:
                problems.append(f"{where}.pipeline.{key}={value!r}: the snapshot's model_index.json does not set it "
                                "(the pipeline's default runs)")
        for comp, given in arch.items():
            fname = {"scheduler": "scheduler_config.json", "guider": "guider_config.json"}.get(comp, "config.json")
            f = path / comp / fname
            if not isinstance(given, dict) or not f.is_file() or comp not in self.components:
                continue
            have = json.loads(f.read_text())
            for key, value in given.items():
                if key not in have:  # a typo is refused; a real argument the file omits cannot be compared
                    lib, cls_name, cfg_name = self.components[comp]
                    check_init_keys(getattr(importlib.import_module(lib), cfg_name or cls_name), [key],
                                    f"{where}.{comp}")
                elif norm(have[key]) != norm(value):
                    problems.append(f"{where}.{comp}.{key}={value!r}: the snapshot's {comp}/{fname} says {have[key]!r}")
        if problems:
            raise ConfigValueError(f"model.path={str(path)!r} decides the architecture, and model.architecture says "
                                   "otherwise:\n  " + "\n  ".join(problems) + "\nfix: remove those overrides (the "
                                   "snapshot's configs are what runs), or point model.path at a snapshot with that "
                                   "architecture, or use load_format=dummy for random weights of any architecture")

    def component_config(self, name: str) -> Dict[str, Any]:
        """The config of pipeline component ``name`` (:func:`models.snapshot.component_config`: the snapshot's
        ``<name>/config.json`` for ``model.path``, else ``model.architecture.<name>``); reads no weights.

        Raises:
            ModelPathError: the snapshot has no readable config for it.
        """
        if not self.source:  # read_rows without prepare (runner.app.execute.DatasetItems.read, benchmarks)
            self.resolve_source()
        return snapshot.component_config(self.source, self.arch_copy() if self.source.get("kind") != "path" else {},
                                         name)

    def weight_bytes(self) -> Optional[int]:
        """Bytes the weights take in ``self.dtype`` once loaded, for a memory check before loading: for
        ``load_format=dummy`` by building the architecture on the meta device (no memory); None otherwise."""
        if self.source.get("kind") != "dummy":
            return None
        comps = self.build_components(self.arch_copy(), device="meta", dtype=self.dtype, task=self.task)
        return sum(p.numel() * p.element_size() for v in comps.values() if isinstance(v, torch.nn.Module)
                   for p in v.parameters())

    def head_dim(self) -> int:
        """Attention head dimension of the transformer (from the architecture or the snapshot's config)."""
        conf = self.component_config("transformer")
        if "attention_head_dim" not in conf:
            raise ModelPathError(f"model={self.cfg.name}: the transformer's config has no attention_head_dim; fix: a "
                                 "complete snapshot (transformer/config.json) of a DiT pipeline")
        return int(conf["attention_head_dim"])

    def snapshot_task(self) -> Optional[str]:
        """``model.task`` when it is a checkpoint of its own (:meth:`models.family.FamilySpec.own_snapshot`), else
        None (the base snapshot serves it)."""
        task = self.task
        return task if self.spec is not None and self.spec.own_snapshot(task) else None

    def embedded_target(self, arch: Dict[str, Any]) -> Path:
        """Where :meth:`embedded_snapshot` keeps the embedded model of ``arch`` (it may not exist yet)."""
        return embedded_target(self.cfg.name, arch, self.cache_dir, task=self.snapshot_task())

    def embedded_snapshot(self, arch: Dict[str, Any]) -> Path:
        """The cache dir of the embedded model, created on first use (:meth:`embedded_snapshot_at`)."""
        return self.embedded_snapshot_at(self.embedded_target(arch), arch, task=self.snapshot_task())

    def hash_weights(self, path: Path) -> Dict[str, Any]:
        """``{"files": {relative path: sha256}, "hashing": {computed, cached, hash_s, bytes_hashed}}`` of the weight
        files the pipeline loads (``runner.core.weights``: only the listed components' files; digests cached by path,
        size and modification time, so a second job on a large snapshot hashes nothing)."""
        from runner.core.weights import hash_snapshot

        files, stats = hash_snapshot(path, self.cache_dir)
        return {"files": files, "hashing": {k: stats[k] for k in ("computed", "cached", "hub_named", "hash_s",
                                                                  "bytes_hashed")}}

    def component_class(self, comp: str) -> str:
        """The class name of component ``comp``: the family's, else the snapshot's ``model_index.json``."""
        if comp in self.components:
            return self.components[comp][1]
        index = read_index(Path(self.source["path"]))
        return str((index.get(comp) or [None, None])[1])

    def transformer_class(self) -> Optional[str]:
        """The transformer's diffusers class: the family's, else the snapshot's ``model_index.json``."""
        return self.component_class("transformer")
