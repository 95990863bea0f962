"""FLUX.1 engine (diffusers ``FluxPipeline``).

Three ways to get weights, one loading path:

* ``model.path``: a local diffusers snapshot (``model_index.json`` + component folders) loaded with
  ``FluxPipeline.from_pretrained``.
* embedded (``tiny_flux``): the architecture in ``model.architecture`` with seeded random weights, created on
  first use into the cache with ``save_pretrained`` (safetensors), then loaded with the same
  ``from_pretrained`` call as a real checkpoint.
* ``model.load_format=dummy``: the architecture with random weights built directly on the device, no files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from models.diffusers_engine import DiffusersEngine
from runner.dataset import BUILTIN_PROMPTS, Item, file_sha256
from runner.errors import ConfigValueError, UserInputError

# Bump when the embedded-model recipe changes, so caches made by an older recipe are not reused.
EMBEDDED_RECIPE = 2


class ModelPathError(UserInputError, ValueError):
    """``model.path`` does not point at a diffusers pipeline snapshot."""


def check_snapshot(path: str) -> Path:
    """Validate a diffusers snapshot directory before anything loads.

    Raises:
        ModelPathError: the path does not exist, has no ``model_index.json`` (not a diffusers layout), or a
            component folder holds pickle weights (``.bin``...) and no ``.safetensors``: never loaded.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"model.path={path!r} does not exist; fix: pass a local diffusers snapshot directory "
                             "(the folder with model_index.json)")
    if not (p / "model_index.json").is_file():
        raise ModelPathError(f"model.path={path!r} has no model_index.json, so it is not a diffusers pipeline layout; "
                             "fix: point at the snapshot root written by save_pretrained / huggingface-cli download")
    from models.base import pickle_only_weights

    try:
        index = json.loads((p / "model_index.json").read_text())
    except ValueError as e:
        raise ModelPathError(f"model.path={path!r}: model_index.json is not valid JSON ({e}); fix: download the "
                             "snapshot again") from None
    for name, spec in index.items():
        pkl = pickle_only_weights(p / name) if isinstance(spec, list) and not name.startswith("_") else None
        if pkl is not None:  # from_pretrained would fail (use_safetensors=True) or, elsewhere, unpickle it
            raise ModelPathError(
                f"model.path={path!r}: {pkl.relative_to(p)} is a pickle checkpoint and {name}/ has no .safetensors "
                "weights; the runner never loads pickle files (unpickling can run code); fix: use a snapshot with "
                "safetensors weights (huggingface-cli download <repo> --include '*.safetensors' '*.json' '*.txt' "
                "'*.model'), or convert it once where you trust the file: load it with diffusers/transformers and "
                "save_pretrained(..., safe_serialization=True)")
    return p


#: The most T5 tokens FluxPipeline encodes: its ``check_inputs`` raises for ``max_sequence_length > 512`` (after the
#: model loaded); the runner refuses it at startup, with the T5 tokenizer's ``model_max_length`` if lower.
FLUX_MAX_SEQUENCE_LENGTH = 512


#: model.architecture of an embedded / dummy FLUX: component -> (library, class it builds), and the other keys
ARCH_COMPONENTS = {"transformer": ("diffusers", "FluxTransformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
                   "text_encoder": ("transformers", "CLIPTextConfig"), "text_encoder_2": ("transformers", "T5Config"),
                   "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
ARCH_OTHER = {"weights_seed": None, "dummy_weight_scale": None,
              "tokenizer": ("corpus", "vocab_size", "clip_max_length")}


def check_architecture(arch: Dict[str, Any], where: str = "model.architecture") -> None:
    """Every key of ``arch`` against what :func:`build_components` passes it to (the component classes' config
    signatures), before anything is built.

    Raises:
        ConfigValueError: an unknown or missing key, naming it, the class and the fix.
    """
    import difflib
    import importlib

    from models.base import check_init_keys

    from runner.resolve import MisplacedBackendKeyError, backend_field_of, misplaced_backend_message

    known = [*ARCH_COMPONENTS, *ARCH_OTHER]
    for key in arch:
        if key not in known and backend_field_of(key):
            raise MisplacedBackendKeyError(misplaced_backend_message(f"{where}.{key}", arch[key]))
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigValueError(f"{where}.{key} is not read by the FLUX builder" + (
                f"; did you mean {where}.{close[0]}?" if close else f" (it reads {', '.join(known)})")
                + " fix: remove or correct it")
    for key, (lib, cls_name) in ARCH_COMPONENTS.items():
        if not isinstance(arch.get(key), dict):
            raise ConfigValueError(f"{where}.{key} is missing (a mapping of {lib}'s {cls_name} arguments); fix: "
                                   f"start from conf/model/tiny_flux.yaml")
        check_init_keys(getattr(importlib.import_module(lib), cls_name), list(arch[key]), f"{where}.{key}")
    tok = arch.get("tokenizer") or {}
    for key in tok:
        if key not in ARCH_OTHER["tokenizer"]:
            raise ConfigValueError(f"{where}.tokenizer.{key} is not read; it takes "
                                   f"{', '.join(ARCH_OTHER['tokenizer'])}; fix: remove or correct it")


def build_tokenizers(arch: Dict[str, Any]) -> Tuple[Any, Any]:
    """The CLIP-style and T5-style tokenizers of an architecture built by the runner (embedded or dummy), as
    :func:`build_components` gives them to the pipeline; builds no model."""
    from models.tokenizers import build_clip_tokenizer, build_t5_tokenizer, corpus_from

    tcfg = arch.get("tokenizer", {})
    if tcfg.get("corpus") == "toy_shapes":
        from models.toy_shapes.data import caption, combos

        corpus = [caption(*c) for c in combos()]
    else:
        corpus = corpus_from(BUILTIN_PROMPTS)
    vocab = int(tcfg.get("vocab_size", 512))
    return build_clip_tokenizer(corpus, vocab, int(tcfg.get("clip_max_length", 77))), build_t5_tokenizer(corpus, vocab)


def snapshot_tokenizers(path: Path) -> Dict[str, Any]:
    """``{"clip": tokenizer, "t5": tokenizer_2}`` of a diffusers snapshot, loaded from its tokenizer folders with the
    classes its ``model_index.json`` names (as ``FluxPipeline.from_pretrained`` loads them); no weights load.

    Raises:
        ModelPathError: a tokenizer the pipeline needs is missing or cannot be read.
    """
    import transformers

    index = json.loads((path / "model_index.json").read_text())
    out: Dict[str, Any] = {}
    for enc, sub in (("clip", "tokenizer"), ("t5", "tokenizer_2")):
        entry = index.get(sub) or [None, None]
        if entry[1] is None or not (path / sub).is_dir():
            raise ModelPathError(f"model.path={str(path)!r} has no {sub} (model_index.json / {sub}/), which "
                                 "FluxPipeline needs; fix: point at a complete FLUX snapshot")
        cls = getattr(transformers, str(entry[1]), None) or transformers.AutoTokenizer
        try:
            out[enc] = cls.from_pretrained(str(path / sub), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelPathError(f"model.path={str(path)!r}: {sub}/ cannot be read as a {entry[1]} ({e}); fix: "
                                 "re-download the snapshot's tokenizer files") from None
    return out


#: snapshot folder -> its config file (diffusers' layout)
_COMPONENT_CONFIG = {"transformer": "config.json", "vae": "config.json", "text_encoder": "config.json",
                     "text_encoder_2": "config.json", "scheduler": "scheduler_config.json"}


def check_architecture_matches_snapshot(arch: Dict[str, Any], path: Path, where: str = "model.architecture") -> None:
    """With ``model.path`` the snapshot's component configs decide the architecture; every component value in
    ``arch`` (the keys given on the command line) must be what the snapshot's config says, so a manifest never
    records an architecture override that did not run (``model.architecture.transformer.num_layers=7`` on a
    2-layer snapshot was accepted and recorded).

    Raises:
        ConfigValueError: listing each key the snapshot's config lacks or holds another value for, and the fix.
    """
    problems = []
    for comp, fname in _COMPONENT_CONFIG.items():
        given = arch.get(comp)
        f = path / comp / fname
        if not isinstance(given, dict) or not f.is_file():
            continue
        have = json.loads(f.read_text())
        for key, value in given.items():
            norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
            if key not in have:  # a typo is refused; a real argument the snapshot's file omits cannot be compared
                lib, cls_name = ARCH_COMPONENTS[comp]
                import importlib

                from models.base import check_init_keys

                check_init_keys(getattr(importlib.import_module(lib), cls_name), [key], f"{where}.{comp}")
            elif norm(have[key]) != norm(value):
                problems.append(f"{where}.{comp}.{key}={value!r}: the snapshot's {comp}/{fname} says {have[key]!r}")
    if problems:
        raise ConfigValueError(f"model.path={str(path)!r} decides the architecture, and model.architecture says "
                               "otherwise:\n  " + "\n  ".join(problems) + "\nfix: remove those overrides (the "
                               "snapshot's configs are what runs), or point model.path at a snapshot with that "
                               "architecture, or use load_format=dummy for random weights of any architecture")


def build_components(arch: Dict[str, Any], device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    """Instantiate every FLUX component from ``arch`` with random weights seeded by ``arch['weights_seed']``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = build_tokenizers(arch)
    clip_kw = dict(arch["text_encoder"])
    clip_kw["vocab_size"] = max(len(tokenizer), int(clip_kw.get("vocab_size", 0)))
    clip_kw.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    t5_kw = dict(arch["text_encoder_2"])
    t5_kw["vocab_size"] = max(len(tokenizer_2), int(t5_kw.get("vocab_size", 0)))
    t5_kw.update(pad_token_id=tokenizer_2.pad_token_id, eos_token_id=tokenizer_2.eos_token_id,
                 decoder_start_token_id=tokenizer_2.pad_token_id)
    sched_kw = dict(arch["scheduler"])

    torch.manual_seed(int(arch.get("weights_seed", 0)))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel(**arch["transformer"])
            vae = AutoencoderKL(**arch["vae"])
            text_encoder = CLIPTextModel(CLIPTextConfig(**clip_kw))
            text_encoder_2 = T5EncoderModel(T5Config(**t5_kw))
    finally:
        torch.set_default_dtype(prev)
    for m in (transformer, vae, text_encoder, text_encoder_2):
        m.eval()  # constructed modules start in train mode: dropout would be live (from_pretrained sets eval)
    scale = float(arch.get("dummy_weight_scale", 1.0))
    if scale != 1.0 and str(device) != "meta":  # keeps activations of deep random transformers finite in bf16
        with torch.no_grad():
            for p in transformer.parameters():
                if p.dim() >= 2:
                    p.mul_(scale)
    return dict(transformer=transformer, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                tokenizer=tokenizer, tokenizer_2=tokenizer_2,
                scheduler=FlowMatchEulerDiscreteScheduler(**sched_kw))


def embedded_target(name: str, arch: Dict[str, Any], cache_dir: Optional[str]) -> Path:
    """Where :func:`embedded_snapshot` keeps the embedded model of ``arch`` (it may not exist yet)."""
    import diffusers

    root = Path(cache_dir or os.environ.get("RUNNER_CACHE", "~/.cache/runner")).expanduser()
    key = hashlib.sha256(json.dumps({"arch": arch, "recipe": EMBEDDED_RECIPE, "diffusers": diffusers.__version__},
                                    sort_keys=True).encode()).hexdigest()[:12]
    return root / f"{name}-{key}"


def embedded_snapshot(name: str, arch: Dict[str, Any], cache_dir: Optional[str]) -> Path:
    """Return the cache dir of an embedded model, creating it (``save_pretrained``, safetensors) on first use.

    The dir name carries a hash of the architecture and the recipe version, so a config change never reuses
    stale weights. Creation writes to a temp dir and renames it, so a killed first run leaves no half-written
    snapshot behind.
    """
    from diffusers import FluxPipeline

    target = embedded_target(name, arch, cache_dir)
    root = target.parent
    if (target / "model_index.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{target.name}.tmp{os.getpid()}"
    pipe = FluxPipeline(**build_components(arch))
    pipe.save_pretrained(tmp, safe_serialization=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process created it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


class _TruncationFilter(logging.Filter):
    """Drops diffusers' "The following part of your input was truncated ..." records (see
    ``diffusers/pipelines/flux/pipeline_flux.py``), which print the whole dropped text on every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("The following part of your input was truncated")


def _quiet_truncation_warnings() -> None:
    """Install :class:`_TruncationFilter` once on the FLUX pipeline's logger."""
    logger = logging.getLogger("diffusers.pipelines.flux.pipeline_flux")
    if not any(isinstance(f, _TruncationFilter) for f in logger.filters):
        logger.addFilter(_TruncationFilter())


class FluxEngine(DiffusersEngine):
    """The FLUX.1 family on diffusers' ``FluxPipeline`` (engine ``flux``; the loop's protocol comes from
    :class:`models.diffusers_engine.DiffusersEngine`, this class holds the model knowledge).

    The transformer's attention modules (``FluxAttention``) are the call sites of the model's single attention
    role, ``joint`` (text and image tokens attend jointly in double- and single-stream blocks). A pipeline call
    makes ``num_inference_steps`` transformer forwards, twice that under true CFG (a negative prompt with
    ``true_cfg_scale`` > 1).
    """

    backend_fields = ("attention", "linear")  # no MoE layers in FLUX.1
    needs_mask = False  # FluxAttnProcessor passes attention_mask=None on the text-to-image path

    # ----------------------------------------------------------------------------------------------- loading
    def resolve_source(self) -> Dict[str, Any]:
        """Decide where weights come from and validate it, without loading anything.

        Raises:
            ModelPathError: ``model.path`` is not a diffusers snapshot (or holds pickle weights only), or a
                non-embedded model has no path and no ``load_format=dummy``.
            ConfigValueError: a ``model.architecture`` key the component classes do not take.
        """
        cfg = self.cfg
        if cfg.load_format == "dummy" or (cfg.embedded and not cfg.path):
            from omegaconf import OmegaConf

            check_architecture(OmegaConf.to_container(cfg.architecture, resolve=True)
                               if not isinstance(cfg.architecture, dict) else cfg.architecture)
        if cfg.load_format == "dummy":
            self.source = {"kind": "dummy", "weights_seed": cfg.architecture.get("weights_seed", 0)}
        elif cfg.path:
            self.source = {"kind": "path", "path": str(check_snapshot(cfg.path).resolve()), "revision": cfg.revision}
            from omegaconf import OmegaConf

            arch = (OmegaConf.to_container(cfg.architecture, resolve=True)
                    if not isinstance(cfg.architecture, dict) else cfg.architecture)
            # the model file's architecture is the one a dummy/embedded build uses; keys set on the command line
            # for a snapshot must be what the snapshot holds
            given = [o.lstrip("+~").split("=", 1)[0] for o in self.ctx.overrides]
            cli = {}
            for key in given:
                parts = key.split(".")
                if parts[:2] == ["model", "architecture"] and len(parts) == 4 and isinstance(arch.get(parts[2]), dict):
                    cli.setdefault(parts[2], {})[parts[3]] = arch[parts[2]].get(parts[3])
            check_architecture_matches_snapshot(cli, Path(self.source["path"]))
        elif cfg.embedded:
            self.source = {"kind": "embedded"}
        else:
            raise ModelPathError(f"model={cfg.name} needs weights: set model.path=/path/to/diffusers/snapshot, "
                             "or model.load_format=dummy for random weights")
        return self.source

    def weight_bytes(self) -> Optional[int]:
        """Bytes the weights take in ``self.dtype`` once loaded, for a memory check before loading: for
        ``load_format=dummy`` by building the architecture on the meta device (no memory); None otherwise."""
        if self.source.get("kind") != "dummy":
            return None
        from omegaconf import OmegaConf

        arch = OmegaConf.to_container(self.cfg.architecture, resolve=True)
        comps = build_components(arch, device="meta", dtype=self.dtype)
        return sum(p.numel() * p.element_size() for k in ("transformer", "vae", "text_encoder", "text_encoder_2")
                   for p in comps[k].parameters())

    def head_dim(self) -> int:
        """Attention head dimension of the transformer (from the architecture or the snapshot's config)."""
        return int(self.component_config("transformer")["attention_head_dim"])

    def _arch(self) -> Dict[str, Any]:
        from omegaconf import OmegaConf

        arch = self.cfg.architecture
        return arch if isinstance(arch, dict) else OmegaConf.to_container(arch, resolve=True)

    def component_config(self, name: str) -> Dict[str, Any]:
        """The config of pipeline component ``name`` (``transformer``, ``vae``): the snapshot's
        ``<name>/config.json`` for ``model.path``, else ``model.architecture.<name>``; reads no weights.

        Raises:
            ModelPathError: the snapshot has no readable config for it.
        """
        if not self.source:  # read_rows without prepare (runner.execute.dataset_keys, benchmarks)
            self.resolve_source()
        if self.source.get("kind") == "path":
            f = Path(self.source["path"]) / name / "config.json"
            try:
                return json.loads(f.read_text())
            except (OSError, ValueError) as e:
                raise ModelPathError(f"model.path={self.source['path']!r}: {name}/config.json cannot be read ({e}); "
                                     "fix: point at a complete diffusers snapshot") from None
        return dict(self._arch()[name])

    @property
    def guidance_embeds(self) -> bool:
        """The transformer takes a guidance value (FLUX.1-dev's distilled guidance embedding): its config's
        ``guidance_embeds`` (diffusers' ``FluxTransformer2DModel`` default when absent). FluxPipeline passes
        ``guidance_scale`` to the transformer only then."""
        import inspect

        from diffusers import FluxTransformer2DModel

        default = inspect.signature(FluxTransformer2DModel.__init__).parameters["guidance_embeds"].default
        return bool(self.component_config("transformer").get("guidance_embeds", default))

    def tokenizers(self) -> Dict[str, Any]:
        """``{"clip": tokenizer, "t5": tokenizer_2}`` as the pipeline uses them, without loading weights: the
        snapshot's tokenizer folders (``model.path``, or an embedded model already in the cache), else built from
        the architecture exactly as :func:`build_components` builds them; the loaded pipeline's own once loaded."""
        if getattr(self, "_toks", None) is None:
            if not self.source:
                self.resolve_source()
            kind = self.source.get("kind")
            target = embedded_target(self.cfg.name, self._arch(), self.cache_dir) if kind == "embedded" else None
            if kind == "path":
                self._toks = snapshot_tokenizers(Path(self.source["path"]))
            elif target is not None and (target / "model_index.json").is_file():
                self._toks = snapshot_tokenizers(target)
            else:
                clip, t5 = build_tokenizers(self._arch())
                self._toks = {"clip": clip, "t5": t5}
            self._token_cache: Dict[str, Dict[str, Dict[str, int]]] = {}
        return self._toks

    def sequence_limit(self) -> int:
        """The most T5 tokens ``model.generation.max_sequence_length`` may ask for: FluxPipeline's 512, or the T5
        tokenizer's ``model_max_length`` if lower."""
        t5_max = getattr(self.tokenizers()["t5"], "model_max_length", None) or FLUX_MAX_SEQUENCE_LENGTH
        return int(min(FLUX_MAX_SEQUENCE_LENGTH, t5_max))

    def check_source(self) -> None:
        """What the model's configs and tokenizers decide, checked before anything loads:

        * ``model.generation.max_sequence_length`` at most :meth:`sequence_limit` (FluxPipeline would raise after
          the model loaded);
        * ``model.size_multiple`` a multiple of what FluxPipeline needs (VAE scale factor x 2 for the 2x2 latent
          packing): otherwise it would round a width or height down and write an image of another size than the
          record says.

        Raises:
            ConfigValueError: naming the key, the value, the model's limit and the fix.
        """
        g = self.cfg.generation
        limit = self.sequence_limit()
        if g.max_sequence_length > limit:
            raise ConfigValueError(
                f"model.generation.max_sequence_length={g.max_sequence_length} exceeds {limit}, the most T5 tokens "
                f"model={self.cfg.name} encodes (FluxPipeline refuses max_sequence_length > "
                f"{FLUX_MAX_SEQUENCE_LENGTH}; the T5 tokenizer's model_max_length is "
                f"{getattr(self.tokenizers()['t5'], 'model_max_length', None)}); fix: "
                f"model.generation.max_sequence_length={limit}")
        blocks = self.component_config("vae").get("block_out_channels") or [0] * 4
        need = 2 ** (len(blocks) - 1) * 2
        if self.cfg.size_multiple % need:
            raise ConfigValueError(
                f"model.size_multiple={self.cfg.size_multiple}, but model={self.cfg.name}'s VAE (scale factor "
                f"{need // 2}) and 2x2 latent packing need widths and heights in multiples of {need}: FluxPipeline "
                f"would round the others down; fix: model.size_multiple={need}")

    def ignored_fields(self, rows: Any) -> Dict[str, Tuple[str, str]]:
        """What FluxPipeline ignores here: ``guidance_scale`` when the transformer has no guidance embedding;
        ``negative_prompt`` unless ``true_cfg_scale`` > 1 (its true-CFG rule); ``true_cfg_scale`` > 1 when no row
        has a negative prompt."""
        g = self.cfg.generation
        out: Dict[str, Tuple[str, str]] = {}
        if not self.guidance_embeds:
            out["guidance_scale"] = (
                "its transformer has no guidance embedding (transformer config guidance_embeds=false), so FluxPipeline "
                "passes no guidance and every value gives the same image",
                "use a model with guidance embeddings (e.g. model=flux)")
        tc = float(g.true_cfg_scale)
        if tc <= 1:
            out["negative_prompt"] = (
                f"model.generation.true_cfg_scale={tc} <= 1, and FluxPipeline uses a negative prompt only under true "
                "CFG (true_cfg_scale > 1)", "model.generation.true_cfg_scale=4 to apply it (twice the transformer "
                                             "forwards per step)")
        elif not any(r.negative_prompt is not None for r in rows):
            out["true_cfg_scale"] = (
                "no row has a negative_prompt, and FluxPipeline runs true CFG only with one",
                "add negative_prompt to the rows")
        return out

    def check_rows(self, rows: List[Any], path: Any) -> None:
        """Rows without a guidance value on a model that takes one are refused (``model.generation.guidance_scale:
        null`` is for models without guidance embedding); rows' ``expect`` attributes are checked against the
        model's oracle (``model.oracle``).

        Raises:
            ConfigValueError: a guidance value is missing, naming ``model.generation.guidance_scale``.
        """
        if any(r.guidance_scale is None for r in rows) and self.guidance_embeds:
            raise ConfigValueError(
                f"model.generation.guidance_scale=null, but model={self.cfg.name}'s transformer takes a guidance value "
                "(transformer config guidance_embeds=true); fix: model.generation.guidance_scale=3.5 (FLUX.1-dev's "
                "default), or a guidance_scale in every row")
        if self.cfg.oracle == "toy_shapes":
            from models.toy_shapes.oracle import check_expectations

            check_expectations(rows, path)

    def prompt_tokens(self, prompts: Any) -> List[Dict[str, Dict[str, int]]]:
        """Per prompt: ``{"clip": {...}, "t5": {...}}`` with ``count`` (tokens with the special tokens, untruncated),
        ``limit`` (CLIP: the tokenizer's ``model_max_length``, FluxPipeline's ``tokenizer_max_length``; T5:
        ``model.generation.max_sequence_length``) and ``dropped`` (tokens past the limit: the encoder never sees
        them)."""
        toks = self.tokenizers()
        limits = {"clip": int(toks["clip"].model_max_length), "t5": int(self.cfg.generation.max_sequence_length)}
        todo = sorted({p for p in prompts if p not in self._token_cache})
        if todo:
            counts = {enc: [len(ids) for ids in toks[enc](todo, truncation=False, verbose=False)["input_ids"]]
                      for enc in ("clip", "t5")}
            for i, p in enumerate(todo):
                self._token_cache[p] = {enc: {"count": counts[enc][i], "limit": limits[enc],
                                              "dropped": max(0, counts[enc][i] - limits[enc])} for enc in limits}
        return [self._token_cache[p] for p in prompts]

    def _truncation_fix(self, counts: Dict[str, Dict[str, int]]) -> str:
        limit, msl = self.sequence_limit(), int(self.cfg.generation.max_sequence_length)
        if counts.get("t5", {}).get("dropped") and msl < limit:
            return (f" (CLIP takes {counts['clip']['limit']} tokens), raise model.generation.max_sequence_length "
                    f"(now {msl}, at most {limit})")
        return ""

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """``true_cfg_scale`` when the row's negative prompt is applied (true CFG), else null."""
        return {"true_cfg_scale": float(self.cfg.generation.true_cfg_scale) if row.negative_prompt is not None
                else None}

    def load_pipeline(self) -> None:
        """Build the pipeline on ``self.device`` in ``self.dtype``; records weight-file hashes in ``source``.
        diffusers' per-call truncation warning (the whole dropped text: 4.4 MB of console for one 2-million-character
        prompt) is filtered out: every record carries its ``tokens`` per encoder and the run logs the count."""
        from diffusers import FluxPipeline

        _quiet_truncation_warnings()

        arch = self._arch()
        kind = self.source["kind"]
        if kind == "dummy":
            self.pipe = FluxPipeline(**build_components(arch, device=self.device, dtype=self.dtype))
        else:
            path = Path(self.source["path"]) if kind == "path" else embedded_snapshot(self.cfg.name, arch, self.cache_dir)
            self.source["path"] = str(path)
            self.source["files"] = {str(f.relative_to(path)): file_sha256(f)
                                    for f in sorted(path.rglob("*.safetensors"))}
            self.pipe = FluxPipeline.from_pretrained(path, dtype=self.dtype, local_files_only=True,
                                                     use_safetensors=True)  # never fall back to pickle
            self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        self._toks = {"clip": self.pipe.tokenizer, "t5": self.pipe.tokenizer_2}  # records count with the loaded ones
        self._token_cache = {}
        self._time_phases()

    def _time_phases(self) -> None:
        """Accumulate wall seconds of text encoding and VAE decoding via forward hooks on those modules (with a
        device sync at their boundaries only, never inside the denoising loop). Denoising time is the pipeline
        call minus these (``phase_seconds``)."""
        import time

        self.phase_s: Dict[str, float] = {"text_encode": 0.0, "vae_decode": 0.0}
        sync = torch.cuda.synchronize if str(self.device).startswith("cuda") else (lambda: None)
        for phase, mods in (("text_encode", (self.pipe.text_encoder, self.pipe.text_encoder_2)),
                            ("vae_decode", (self.pipe.vae.decoder,))):
            for mod in mods:
                if mod is None:
                    continue
                start: Dict[str, float] = {}

                def pre(m, a, _s=start):
                    sync()
                    _s["t"] = time.perf_counter()

                def post(m, a, o, _s=start, _p=phase):
                    sync()
                    self.phase_s[_p] += time.perf_counter() - _s.pop("t", time.perf_counter())

                mod.register_forward_pre_hook(pre)
                mod.register_forward_hook(post)

    @property
    def denoiser(self) -> torch.nn.Module:
        """The stage's denoising model (``FluxTransformer2DModel``)."""
        return self.pipe.transformer

    # ------------------------------------------------------------------------------------------- attention
    def attention_sites(self) -> Iterator[Tuple[str, str, Any]]:
        """Yield ``(role, layer_name, attention_module)`` for every attention call site of the transformer."""
        from diffusers.models.attention import AttentionModuleMixin

        for name, mod in self.pipe.transformer.named_modules():
            if isinstance(mod, AttentionModuleMixin):
                yield "joint", name, mod

    # ------------------------------------------------------------------------------------------ speed
    def optimize(self, opts: Any) -> Dict[str, Any]:
        """Apply the math-preserving speed settings of ``optimize`` (``runner.schema.OptimizeConfig``) to the
        loaded pipeline, before backends are installed (so FP8 linear sees the fused projections).

        ``fuse_qkv``: diffusers' ``AttentionModuleMixin.fuse_projections`` per attention module (q|k|v weights
        concatenated into one ``to_qkv`` Linear, 3072 -> 9216 for FLUX.1; the text stream's ``add_{q,k,v}_proj``
        into ``to_added_qkv``); the unfused Linears are then deleted, which frees their copy of the weights and
        keeps linear evidence exact (no module that never runs). ``vae_channels_last``: the VAE's parameters in
        NHWC layout (``torch.channels_last``); measured slower on the H200 with torch 2.11 (127.9 vs 86.7 ms per
        1024x1024 decode, ``benchmarks/results/flux_dev_1024_h200.json`` ablation), so off by default.

        Returns:
            What was applied, for the manifest: ``{"fuse_qkv": {"modules": n} | False, "vae_channels_last": bool}``.
        """
        from diffusers.models.attention import AttentionModuleMixin

        applied: Dict[str, Any] = {"fuse_qkv": False, "vae_channels_last": False}
        if opts.fuse_qkv:
            n = 0
            for mod in self.pipe.transformer.modules():
                if isinstance(mod, AttentionModuleMixin) and mod._supports_qkv_fusion and not mod.fused_projections:
                    mod.fuse_projections()
                    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
                        if getattr(mod, name, None) is not None:
                            delattr(mod, name)
                    n += 1
            applied["fuse_qkv"] = {"modules": n}
        if opts.vae_channels_last:
            self.pipe.vae.to(memory_format=torch.channels_last)
            applied["vae_channels_last"] = True
        return applied

    def warmup_call(self, batch: List[Item], steps: int = 2) -> None:
        """One pipeline call of ``steps`` denoising steps at ``batch``'s shape and size, output discarded, so that
        ``torch.compile`` (static shapes) compiles before the timed loop; the phase timers are reset after it.
        Uses its own generator, so no row's noise changes."""
        r0 = batch[0].row
        with torch.inference_mode():
            self.pipe(prompt=[it.row.prompt for it in batch], height=r0.height, width=r0.width,
                      num_inference_steps=steps, **self._guidance(r0),
                      generator=torch.Generator(device="cpu").manual_seed(0),
                      max_sequence_length=int(self.cfg.generation.max_sequence_length), output_type="np")
        for k in self.phase_s:
            self.phase_s[k] = 0.0

    # ------------------------------------------------------------------------------------------ generation
    def expected_forwards(self, batch: List[Item]) -> int:
        """Transformer forwards one ``FluxPipeline`` call makes for ``batch``: steps, doubled under true CFG."""
        r = batch[0].row
        true_cfg = float(self.cfg.generation.true_cfg_scale)
        return r.num_inference_steps * (2 if r.negative_prompt is not None and true_cfg > 1 else 1)

    def accuracy(self, items: List[Item], records: Dict[str, Dict[str, Any]], out_dir: Path
                 ) -> Optional[Dict[str, Any]]:
        """Share of items whose image matches the row's ``expect``, read back by the model's oracle
        (``model.oracle``); None when the model has no oracle or no row carries expectations."""
        if not self.cfg.oracle or not any(it.row.expect for it in items):
            return None
        if self.cfg.oracle != "toy_shapes":
            raise ConfigValueError(f"model.oracle={self.cfg.oracle!r} is not known; fix: toy_shapes or null")
        from models.toy_shapes.oracle import accuracy_section

        return accuracy_section(items, records, out_dir)

    @staticmethod
    def _guidance(row: Any) -> Dict[str, Any]:
        """``guidance_scale`` for the pipeline call, left out when the model takes none (row value None)."""
        return {} if row.guidance_scale is None else {"guidance_scale": row.guidance_scale}

    def call(self, batch: List[Item]) -> List[np.ndarray]:
        """Generate one image per item; all items share ``shape_key``.

        Returns:
            One float32 array per item, layout HWC, values in [0, 1] (NaN/inf preserved for the finite check).
        """
        r0 = batch[0].row
        gens = [torch.Generator(device="cpu").manual_seed(it.seed) for it in batch]
        kwargs: Dict[str, Any] = self._guidance(r0)
        if r0.negative_prompt is not None:
            kwargs.update(negative_prompt=[it.row.negative_prompt for it in batch],
                          true_cfg_scale=float(self.cfg.generation.true_cfg_scale))
        with torch.inference_mode():
            out = self.pipe(prompt=[it.row.prompt for it in batch], height=r0.height, width=r0.width,
                            num_inference_steps=r0.num_inference_steps,
                            generator=gens, max_sequence_length=int(self.cfg.generation.max_sequence_length),
                            output_type="np", **kwargs)
        return [np.asarray(img, dtype=np.float32) for img in out.images]
