"""Persistent compile cache of ``compile=regional`` (``optimize.compile_cache``, on by default with compile).

torch keeps what ``torch.compile`` produced in on-disk caches under one directory, ``TORCHINDUCTOR_CACHE_DIR``:
Inductor's FX-graph cache (the compiled module of each graph, keyed by the graph, its inputs and Inductor's
config), the AOTAutograd cache (the traced joint graph, which points at FX-graph entries) and, beside them,
Triton's kernel cache (``TRITON_CACHE_DIR``: compiled cubins). A process that finds its graphs there loads them
instead of compiling: dynamo still traces the Python (seconds), Inductor and Triton do not run.

Here that directory is ``<cache_dir>/compile/<key>`` (``cache_dir``: the run's ``cache_dir``, else
``$RUNNER_CACHE``, else ``~/.cache/runner``), where ``key`` is a hash of everything a compiled artifact may depend
on beyond the graph itself (:func:`key_fields`): torch, CUDA and Triton versions, Python's minor version, the
device (GPU name and compute capability; on CPU the CPU's vector capability and machine), the denoiser's class and
its config, the compute dtype, the selected backends, the compile mode and the settings that change what is
traced (fused QKV, deterministic compile). torch's own keys already cover the graph; ours keeps a different torch,
GPU or model from ever reading another's entries (torch's FX-graph key does not hash the GPU model, only its
capability through the generated code), and keeps entries of one configuration together (one ``rm -r`` clears it).

Evidence: hits are counted from torch's own counters (``torch._dynamo.utils.counters``: ``inductor``
``fxgraph_cache_hit/miss/bypass`` and ``aot_autograd`` ``autograd_cache_hit/miss/bypass``), read before and after
the compile warm-up; the manifest's ``compile.cache`` says ``hit`` only when torch counted hits and no miss,
``partial`` for both, ``miss`` for misses alone, ``bypass`` when torch declined to cache a graph, ``none`` when
nothing was compiled in the warm-up. Nothing is inferred from the directory's contents.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, Optional

import torch

KEY_VERSION = 1
"""Bump when the key's fields change meaning (old directories are then never read again)."""

_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
             ("inductor", "fxgraph_cache_bypass"), ("aot_autograd", "autograd_cache_hit"),
             ("aot_autograd", "autograd_cache_miss"), ("aot_autograd", "autograd_cache_bypass"))
_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def device_fields(device: str) -> Dict[str, Any]:
    """What of the device a compiled artifact depends on: GPU name and compute capability, or on CPU the vector
    capability Inductor's C++ code is built for and the machine."""
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index
        idx = torch.cuda.current_device() if idx is None else idx
        return {"kind": "cuda", "name": torch.cuda.get_device_name(idx),
                "capability": list(torch.cuda.get_device_capability(idx))}
    cap = None
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older builds
        cap = None
    return {"kind": device.split(":")[0], "cpu_capability": cap, "machine": platform.machine()}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, sort_keys=True, default=str))


def key_fields(*, device: str, denoiser: torch.nn.Module, dtype: torch.dtype, backends: Dict[str, Any],
               compile_cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The fields hashed into the cache key (recorded in the manifest next to it).

    Args:
        device: the torch device string of the process.
        denoiser: the module whose blocks are compiled (its class and diffusers ``config``; weights' values are
            not part of a compiled graph).
        dtype: compute dtype.
        backends: the selected backends of the stage (``{field: selected}``).
        compile_cfg: ``{compile, compile_mode, fuse_qkv, deterministic_compile, ...}``: settings that change what
            is traced or how it is compiled.
    """
    cfg = getattr(denoiser, "config", None)
    cfg = {k: v for k, v in dict(cfg).items() if k != "_name_or_path"} if cfg is not None else None  # not a path
    return _jsonable({
        "key_version": KEY_VERSION, "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _version("triton"), "diffusers": _version("diffusers"), "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "device": device_fields(device),
        "model": {"class": f"{type(denoiser).__module__}.{type(denoiser).__qualname__}",
                  "config": cfg},
        "dtype": str(dtype).replace("torch.", ""), "backends": backends, "compile": compile_cfg,
    })


def cache_key(fields: Dict[str, Any]) -> str:
    """First 20 hex digits of the sha256 of ``fields`` (canonical JSON)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def cache_root(cache_dir: Optional[str]) -> Path:
    """``<cache_dir>/compile`` (``cache_dir`` null: ``$RUNNER_CACHE`` or ``~/.cache/runner``)."""
    from runner.core.weights import default_cache_dir

    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "compile"


def counters() -> Dict[str, int]:
    """torch's compile-cache counters of this process (``inductor.fxgraph_cache_hit`` ...)."""
    from torch._dynamo.utils import counters as c

    return {f"{grp}.{name}": int(c[grp][name]) for grp, name in _COUNTERS}


def _clear_inductor_caches() -> None:
    """Forget the cache paths Inductor memoized (so the next compile reads the new ``TORCHINDUCTOR_CACHE_DIR``)."""
    try:
        from torch._inductor.utils import clear_caches
    except ImportError:
        return
    clear_caches()


class CompileCache:
    """The compile cache of one stage: points torch's caches at ``<root>/<key>`` for the process (restored by
    :meth:`close`), and reads torch's counters around the warm-up.

    Attributes:
        fields / key / dir: what was hashed, the key, the directory.
        existed: the directory held entries before this process (a cold start shows False).
    """

    def __init__(self, root: Path, fields: Dict[str, Any]) -> None:
        self.fields = fields
        self.key = cache_key(fields)
        self.dir = Path(root) / self.key
        self.existed = self.dir.is_dir() and any(self.dir.iterdir())
        self._saved_env: Dict[str, Optional[str]] = {}
        self._saved_cfg: Dict[str, Any] = {}
        self._before: Optional[Dict[str, int]] = None
        self._after: Optional[Dict[str, int]] = None
        self.seconds: Optional[float] = None
        self.active = False

    def open(self) -> "CompileCache":
        """Point torch's caches here (env vars read by Inductor and Triton at each compile) and make sure the
        local caches are on (``fx_graph_cache``, ``autograd_cache``)."""
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "key.json").write_text(json.dumps(self.fields, indent=1, sort_keys=True) + "\n")
        self._saved_env = {k: os.environ.get(k) for k in _ENV}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.dir)
        os.environ["TRITON_CACHE_DIR"] = str(self.dir / "triton")
        self._saved_cfg = {"fx_graph_cache": inductor_config.fx_graph_cache,
                           "enable_autograd_cache": getattr(functorch_config, "enable_autograd_cache", None)}
        inductor_config.fx_graph_cache = True
        if self._saved_cfg["enable_autograd_cache"] is not None:
            functorch_config.enable_autograd_cache = True
        _clear_inductor_caches()
        self.active = True
        return self

    def start(self) -> None:
        """Mark the counters before the compile warm-up."""
        self._before = counters()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        """Mark the counters after the compile warm-up."""
        if self._before is not None:
            self._after = counters()
            self.seconds = time.perf_counter() - self._t0

    def observed(self) -> Dict[str, int]:
        """Counter deltas over the warm-up (``{}`` before :meth:`stop`)."""
        if self._before is None or self._after is None:
            return {}
        return {k: self._after[k] - self._before[k] for k in self._before}

    def status(self) -> str:
        """``hit`` | ``partial`` | ``miss`` | ``bypass`` | ``none`` | ``not_measured`` from the observed counters."""
        d = self.observed()
        if not d:
            return "not_measured"
        hits = d["inductor.fxgraph_cache_hit"] + d["aot_autograd.autograd_cache_hit"]
        misses = d["inductor.fxgraph_cache_miss"] + d["aot_autograd.autograd_cache_miss"]
        bypass = d["inductor.fxgraph_cache_bypass"] + d["aot_autograd.autograd_cache_bypass"]
        if hits and not misses:
            return "hit"
        if hits and misses:
            return "partial"
        if misses:
            return "miss"
        return "bypass" if bypass else "none"

    def section(self) -> Dict[str, Any]:
        """The manifest's ``compile.cache``."""
        return {"enabled": True, "dir": str(self.dir), "key": self.key, "key_fields": self.fields,
                "existed_before": self.existed, "status": self.status(), "counters": self.observed(),
                "warmup_s": None if self.seconds is None else round(self.seconds, 3)}

    def close(self) -> None:
        """Restore the environment and the cache flags."""
        if not self.active:
            return
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        inductor_config.fx_graph_cache = self._saved_cfg["fx_graph_cache"]
        if self._saved_cfg["enable_autograd_cache"] is not None:
            functorch_config.enable_autograd_cache = self._saved_cfg["enable_autograd_cache"]
        _clear_inductor_caches()
        self.active = False
