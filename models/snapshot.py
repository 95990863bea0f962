"""Snapshot and component building for the diffusion families: what :class:`models.pipelines.PipelineEngine` needs
to build a family's pipeline without a download (embedded and dummy weights) and to read a snapshot without loading
its weights.

* :class:`ComponentBuilder`: a family's components built from ``model.architecture`` (random weights seeded by
  ``weights_seed``), its tokenizers (kinds of :mod:`models.tokenizer_kinds`) and processors, and the embedded
  snapshot saved once into the cache (:meth:`ComponentBuilder.embedded_snapshot_at`, under a file lock, complete or
  absent). Class-level only: it reads the class attributes it declares (``spec``, ``components``,
  ``tokenizers_spec``, ``pipeline_class``), which the engine takes from the family spec; a family whose building
  differs overrides a classmethod (Qwen-Image's templated tokenizer, FLUX.2's and Z-Image's components).
* snapshot reading: :func:`read_index`, :func:`check_snapshot`, :func:`component_config`,
  :func:`snapshot_tokenizers`; the cache: :func:`embedded_target`, :func:`missing_weights`,
  :func:`snapshot_complete`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Collection, Dict, List, Optional, Tuple

import torch

from models import tokenizer_kinds
from models.family import FamilySpec
from runner.core.dataset import BUILTIN_PROMPTS
from runner.core.weights import ModelPathError

# Bump when the embedded-model recipe changes, so caches made by an older recipe are not reused.
EMBEDDED_RECIPE = 2


def read_index(path: Path) -> Dict[str, Any]:
    """A snapshot's ``model_index.json``.

    Raises:
        ModelPathError: missing or not JSON, naming the path and the fix.
    """
    f = path / "model_index.json"
    if not f.is_file():
        raise ModelPathError(f"model.path={str(path)!r} has no model_index.json, so it is not a diffusers pipeline "
                             "layout; fix: point at the snapshot root written by save_pretrained / hf download")
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise ModelPathError(f"model.path={str(path)!r}: model_index.json is not valid JSON ({e}); fix: download the "
                             "snapshot again") from None


def check_snapshot(path: str) -> Path:
    """Validate a diffusers snapshot directory before anything loads.

    Raises:
        ModelPathError: the path does not exist, has no ``model_index.json`` (not a diffusers layout), or a
            component folder holds pickle weights (``.bin``...) and no ``.safetensors``: never loaded.
    """
    from models.base import pickle_only_weights

    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"model.path={path!r} does not exist; fix: pass a local diffusers snapshot directory "
                             "(the folder with model_index.json)")
    index = read_index(p)
    for name, spec in index.items():
        pkl = pickle_only_weights(p / name) if isinstance(spec, list) and not name.startswith("_") else None
        if pkl is not None:  # from_pretrained would fail (use_safetensors=True) or, elsewhere, unpickle it
            raise ModelPathError(
                f"model.path={path!r}: {pkl.relative_to(p)} is a pickle checkpoint and {name}/ has no .safetensors "
                "weights; the runner never loads pickle files (unpickling can run code); fix: use a snapshot with "
                "safetensors weights (hf download <repo> --include '*.safetensors' '*.json' '*.txt' "
                "'*.model'), or convert it once where you trust the file: load it with diffusers/transformers and "
                "save_pretrained(..., safe_serialization=True)")
    return p


def missing_weights(snapshot: Path) -> List[str]:
    """Components of a saved pipeline ``snapshot`` whose ``model_index.json`` class is a ``torch.nn.Module`` and
    whose folder holds no ``*.safetensors`` file (missing folder included), sorted; empty when every model component
    has its weights. A component class that cannot be imported counts as a model."""
    snapshot = Path(snapshot)
    index = json.loads((snapshot / "model_index.json").read_text())
    missing = []
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or len(spec) != 2 or None in spec:
            continue
        try:
            is_model = issubclass(getattr(importlib.import_module(spec[0]), spec[1]), torch.nn.Module)
        except (ImportError, AttributeError, TypeError):
            is_model = True
        if is_model and not any((snapshot / name).glob("*.safetensors")):
            missing.append(name)
    return sorted(missing)


def snapshot_complete(snapshot: Path) -> bool:
    """``snapshot`` has its ``model_index.json`` and every model component its weights (:func:`missing_weights`)."""
    snapshot = Path(snapshot)
    return (snapshot / "model_index.json").is_file() and not missing_weights(snapshot)


def embedded_target(name: str, arch: Dict[str, Any], cache_dir: Optional[str], task: Optional[str] = None) -> Path:
    """Where an embedded model of ``arch`` is kept in the cache (it may not exist yet): the name plus a hash of
    the architecture, the recipe version and the diffusers version, so a change never reuses stale weights; a
    ``task`` with a checkpoint of its own (an edit or image-to-video snapshot) is part of the hash."""
    import diffusers

    root = Path(cache_dir or os.environ.get("RUNNER_CACHE", "~/.cache/runner")).expanduser()
    what = {"arch": arch, "recipe": EMBEDDED_RECIPE, "diffusers": diffusers.__version__}
    if task is not None:
        what["task"] = task
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
    return root / f"{name}-{key}"



def component_config(source: Dict[str, Any], arch: Dict[str, Any], name: str) -> Dict[str, Any]:
    """The config of pipeline component ``name``: the snapshot's ``<name>/config.json`` for a ``model.path``
    ``source`` (``{"kind": "path", "path": ...}``), else ``arch[name]`` (``model.architecture.<name>``); reads no
    weights.

    Raises:
        ModelPathError: the snapshot has no readable config for it.
    """
    if source.get("kind") == "path":
        f = Path(source["path"]) / name / ("scheduler_config.json" if name == "scheduler" else "config.json")
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise ModelPathError(f"model.path={source['path']!r}: {f.relative_to(source['path'])} "
                                 f"cannot be read ({e}); fix: point at a complete diffusers snapshot") from None
    return dict(arch[name])


def snapshot_tokenizers(path: Path, tokenizers_spec: Dict[str, Tuple[str, str, str]], pipeline: str
                        ) -> Dict[str, Any]:
    """``{tokenizer component: tokenizer}`` of a snapshot (the components of ``tokenizers_spec``), loaded with the
    classes its ``model_index.json`` names (as ``from_pretrained`` loads them); no weights load. ``pipeline``: the
    pipeline's name, for messages.

    Raises:
        ModelPathError: a tokenizer the pipeline needs is missing or cannot be read.
    """
    import transformers

    index = read_index(path)
    out: Dict[str, Any] = {}
    for sub in tokenizers_spec:
        entry = index.get(sub) or [None, None]
        if entry[1] is None or not (path / sub).is_dir():
            raise ModelPathError(f"model.path={str(path)!r} has no {sub} (model_index.json / {sub}/), which "
                                 f"{pipeline} needs; fix: point at a complete snapshot")
        cls = getattr(transformers, str(entry[1]), None) or transformers.AutoTokenizer
        try:
            vocab = sorted(set((getattr(cls, "vocab_files_names", None) or {}).values()))
        except ImportError:  # a dummy class (PixtralProcessor without torchvision): from_pretrained says so below
            vocab = []
        if vocab and not any((path / sub / f).is_file() for f in vocab):  # transformers would make one up (T5: 104
            raise ModelPathError(  # tokens of specials and extra ids), so the run would encode with no vocabulary
                f"model.path={str(path)!r}: {sub}/ has none of a {entry[1]}'s vocabulary files ({', '.join(vocab)}); "
                "fix: re-download the snapshot's tokenizer files")
        try:
            out[sub] = cls.from_pretrained(str(path / sub), local_files_only=True)
        except ImportError as e:  # a processor transformers declares unusable here (PixtralProcessor: torchvision)
            raise ModelPathError(f"model.path={str(path)!r}: {sub}/ is a {entry[1]}, which transformers cannot "
                                 f"load in this environment ({str(e).strip().splitlines()[0]}); fix: install the "
                                 "library it names (torchvision for PixtralProcessor)") from None
        except (OSError, ValueError) as e:
            raise ModelPathError(f"model.path={str(path)!r}: {sub}/ cannot be read as a {entry[1]} ({e}); fix: "
                                 "re-download the snapshot's tokenizer files") from None
    return out


class ComponentBuilder:
    """A family's pipeline components built locally, as classmethods over the class attributes below (the engine
    class, :class:`models.pipelines.PipelineEngine`, takes them from its :class:`models.family.FamilySpec`):

    * ``spec``: the family spec (None: ``model.engine=diffusers``, which builds nothing);
    * ``pipeline_class``: the diffusers pipeline class name of the generation task;
    * ``components``: ``{component: (library, model class, config class or None)}`` built in this order from
      ``model.architecture.<component>`` (a ``transformers`` model as ``Model(Config(**kw))``, a diffusers one as
      ``Model(**kw)``);
    * ``tokenizers_spec``: ``{tokenizer component: (kind, encoder label, text encoder component)}``, kinds of
      :mod:`models.tokenizer_kinds`.
    """

    spec: ClassVar[Optional[FamilySpec]] = None
    pipeline_class: ClassVar[Optional[str]] = None
    components: ClassVar[Dict[str, Tuple[str, str, Optional[str]]]] = {}
    tokenizers_spec: ClassVar[Dict[str, Tuple[str, str, str]]] = {}

    @classmethod
    def task_components(cls, task: Optional[str]) -> Dict[str, Tuple[str, str, Optional[str]]]:
        """The model components built for ``task`` (:meth:`models.family.FamilySpec.components_for`)."""
        return cls.spec.components_for(task) if cls.spec is not None else dict(cls.components)

    @classmethod
    def corpus(cls, arch: Dict[str, Any]) -> List[str]:
        """Training text of locally built tokenizers: the builtin prompts, or the toy corpus named in
        ``model.architecture.tokenizer.corpus``."""
        from models.tokenizers import corpus_from

        name = (arch.get("tokenizer") or {}).get("corpus")
        if name == "toy_shapes":
            from models.toy_shapes.data import caption, combos

            return [caption(*c) for c in combos()]
        if name == "toy_motion":
            from models.toy_motion.data import captions

            return captions()
        return corpus_from(BUILTIN_PROMPTS)

    @classmethod
    def build_tokenizers(cls, arch: Dict[str, Any], task: Optional[str] = None) -> Dict[str, Any]:
        """``{tokenizer component: tokenizer}`` built locally from ``model.architecture.tokenizer`` (vocab size,
        corpus, CLIP length), as :meth:`build_components` gives them to the pipeline; builds no model. ``task``
        (a family's conditioning task) lets a family build them for that task's pipeline (Qwen-Image's edit)."""
        tcfg = arch.get("tokenizer") or {}
        corpus, vocab = cls.corpus(arch), int(tcfg.get("vocab_size", 512))
        return {comp: tokenizer_kinds.get(kind).build(corpus, vocab, tcfg)
                for comp, (kind, _label, _enc) in cls.tokenizers_spec.items()}

    @classmethod
    def encoder_config(cls, kind: str, tok: Any, kw: Dict[str, Any]) -> Dict[str, Any]:
        """A text encoder's config arguments made consistent with its tokenizer (vocabulary and special ids): the
        kind's record (:attr:`models.tokenizer_kinds.TokenizerKind.encoder`)."""
        return tokenizer_kinds.get(kind).encoder(tok, dict(kw))

    @classmethod
    def build_components(cls, arch: Dict[str, Any], device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32, task: Optional[str] = None,
                         on_meta: Collection[str] = ()) -> Dict[str, Any]:
        """Every component of the family from ``arch`` with random weights seeded by ``arch['weights_seed']``
        (models built in ``components`` order after one ``torch.manual_seed``), plus the tokenizers; for a
        conditioning ``task`` also its task components (after the base ones, so the base weights are unchanged)
        and processors (:meth:`models.family.FamilySpec.components_for` / ``processors_for``). ``on_meta``: components
        built on the meta device instead (no memory, no random numbers drawn, so the others' weights differ from a
        whole build's), for a caller that cannot hold every component at once (``benchmarks/families_h200.py``:
        FLUX.2-dev's encoder, then its transformer, on an 80 GB card).

        Returns:
            ``{component: object}``, the keyword arguments of the pipeline class.
        """
        toks = cls.build_tokenizers(arch, task) if task is not None else cls.build_tokenizers(arch)
        kinds = {enc: (kind, toks[comp]) for comp, (kind, _l, enc) in cls.tokenizers_spec.items()}
        # classes resolved (and diffusers' hooks imported) before the device context: a module imported lazily
        # inside ``torch.device("meta")`` would create its module-level tensors there (diffusers' mag_cache
        # FLUX_MAG_RATIOS became a meta tensor for the rest of the process)
        import diffusers.hooks  # noqa: F401

        classes = {comp: (getattr(importlib.import_module(lib), cls_name),
                          getattr(importlib.import_module(lib), cfg_name) if cfg_name else None)
                   for comp, (lib, cls_name, cfg_name) in cls.task_components(task).items() if comp != "scheduler"
                   and not (arch.get(comp) is None and cls.spec is not None and cls.spec.optional(comp))}
        torch.manual_seed(int(arch.get("weights_seed", 0)))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
        built: Dict[str, Any] = {}
        try:
            for comp, (model_cls, config_cls) in classes.items():
                with torch.device("meta" if comp in on_meta else device):
                    kw = dict(arch[comp])
                    if config_cls is not None:
                        if comp in kinds:
                            kw = cls.encoder_config(kinds[comp][0], kinds[comp][1], kw)
                        built[comp] = model_cls(config_cls(**kw))
                    else:
                        built[comp] = model_cls(**kw)
        finally:
            torch.set_default_dtype(prev)
        for m in built.values():
            if isinstance(m, torch.nn.Module):  # a guider (HunyuanVideo-1.5's ClassifierFreeGuidance) is not one
                m.eval()  # constructed modules start in train mode: dropout would be live (from_pretrained sets eval)
        scale = float(arch.get("dummy_weight_scale", 1.0))
        if scale != 1.0 and str(device) != "meta":  # keeps activations of deep random transformers finite in bf16
            experts = cls.spec.experts if cls.spec is not None else ("transformer",)
            with torch.no_grad():
                for p in (p for e in experts if e in built for p in built[e].parameters()):
                    if p.dim() >= 2:
                        p.mul_(scale)
        if "scheduler" in cls.components:
            lib, cls_name, _ = cls.components["scheduler"]
            built["scheduler"] = getattr(importlib.import_module(lib), cls_name)(**arch["scheduler"])
        return {**built, **toks, **cls.build_processors(arch, toks, task), **dict(arch.get("pipeline") or {})}

    @classmethod
    def build_processors(cls, arch: Dict[str, Any], toks: Dict[str, Any], task: Optional[str]) -> Dict[str, Any]:
        """``{processor component: processor}`` of ``task`` (:attr:`models.family.FamilySpec.task_processors`),
        built locally from ``model.architecture.<component>`` and the tokenizer it wraps."""
        from models.processors import build_processor

        procs = cls.spec.processors_for(task) if cls.spec is not None else {}
        return {comp: build_processor(kind, arch.get(comp), toks.get(tok) if tok else None)
                for comp, (kind, tok) in procs.items()}

    @classmethod
    def embedded_snapshot_at(cls, target: Path, arch: Dict[str, Any], task: Optional[str] = None) -> Path:
        """The family's embedded model of ``arch`` at ``target`` (:func:`embedded_target`), created
        (``save_pretrained``, safetensors) on first use.

        Built once however many processes ask: under ``<target>.lock`` (``filelock``), by the process of rank 0 when
        a ``torch.distributed`` group is initialized (transformers' ``save_pretrained`` writes weights on rank 0
        only, so another rank's copy would lack the text encoders), or by whichever process holds the lock without
        one; the others wait until the snapshot is complete. Written to a temp dir, checked complete (every
        component with a ``config.json`` holds a ``*.safetensors``) and renamed into place, so a killed or partial
        build never becomes the cache entry. ``task``: a conditioning task with a checkpoint of its own
        (:meth:`build_snapshot`).

        Raises:
            RuntimeError: the build came out incomplete (naming the components without weights), or a rank waited
                more than ``RUNNER_SNAPSHOT_WAIT_S`` seconds (default 900) for rank 0 to build it.
        """
        import time

        import filelock

        if snapshot_complete(target):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        dist = torch.distributed
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        wait_s = float(os.environ.get("RUNNER_SNAPSHOT_WAIT_S", "900"))
        deadline = time.monotonic() + wait_s
        while True:
            with filelock.FileLock(str(target.parent / f".{target.name}.lock")):
                if snapshot_complete(target):
                    return target
                if rank == 0:
                    return (cls.build_snapshot(arch, target, task=task) if task is not None else
                            cls.build_snapshot(arch, target))
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank} waited {wait_s:.0f} s for rank 0 to build the embedded model at "
                                   f"{target}; set RUNNER_SNAPSHOT_WAIT_S to wait longer")
            time.sleep(0.5)

    @classmethod
    def build_snapshot(cls, arch: Dict[str, Any], target: Path, task: Optional[str] = None) -> Path:
        """Build, save and commit the embedded snapshot (the caller holds the lock); see
        :meth:`embedded_snapshot_at`. Saved as the pipeline class of ``task``'s checkpoint
        (:meth:`models.family.FamilySpec.snapshot_pipeline`: QwenImageEditPlusPipeline for Qwen-Image's ``edit``,
        WanImageToVideoPipeline for Wan's ``image_to_video``), else the family's base pipeline class.

        Raises:
            RuntimeError: ``save_pretrained`` left a model component without weights.
        """
        import diffusers
        import shutil

        tmp = target.parent / f".{target.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        name = cls.spec.snapshot_pipeline(task) if cls.spec is not None else cls.pipeline_class
        comps = cls.build_components(arch, task=task) if task is not None else cls.build_components(arch)
        pipe = getattr(diffusers, str(name))(**comps)
        pipe.save_pretrained(tmp, safe_serialization=True)
        missing = missing_weights(tmp)
        if missing:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"the embedded {target.name} snapshot came out without weights in {missing} (not "
                               "committed to the cache); save_pretrained skipped them (a process of rank != 0?)")
        if target.exists():  # an incomplete entry of an older runner: replace it
            shutil.rmtree(target)
        os.rename(tmp, target)
        return target
