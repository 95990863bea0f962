"""``compile=regional`` on a diffusion stage: the compile functions (regional, and beneath a step cache's hooks),
Inductor's deterministic mode, and the compile pass (:class:`CompilePass`, :mod:`models.passes`) that checks
``optimize.compile_mode``, compiles each denoiser's repeated blocks at install, warms them up before the timed loop
with the persistent compile cache (:mod:`models.compile_cache`) open, and writes the manifest's ``compile`` section
(warm-up seconds, Inductor's deterministic flag, graphs compiled after the warm-up: a recompile, the cache's hits).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, Optional, Sequence

import torch

from models.passes import Pass
from runner.core.errors import ConfigValueError

log = logging.getLogger("runner")


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


#: ``optimize.compile_mode`` -> ``torch.compile(mode=...)``
TORCH_COMPILE_MODES = {"default": "default", "max_autotune_no_cudagraphs": "max-autotune-no-cudagraphs",
                       "max_autotune": "max-autotune", "reduce_overhead": "reduce-overhead"}
CUDAGRAPH_MODES = ("max_autotune", "reduce_overhead")


def compile_regional(model: torch.nn.Module, mode: str = "default") -> Dict[str, Any]:
    """Regional ``torch.compile``: each repeated transformer block compiled on its own (one graph reused by every
    block of a class), the rest eager. diffusers' ``compile_repeated_blocks`` where the model class declares its
    ``_repeated_blocks``; otherwise (SD3's ``SD3Transformer2DModel`` declares none) the class of the blocks in the
    model's top-level ``nn.ModuleList`` children, compiled the same way (``module.compile``).

    Args:
        mode: ``optimize.compile_mode`` (:data:`TORCH_COMPILE_MODES` maps it to torch's ``mode``).

    Returns:
        ``{"blocks": [class names], "via": "compile_repeated_blocks" | "module_lists", "mode"}`` for the manifest.
    """
    kw: Dict[str, Any] = {"fullgraph": False, "dynamic": False}
    if mode != "default":
        kw["mode"] = TORCH_COMPILE_MODES[mode]
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(**kw)
        return {"blocks": list(model._repeated_blocks), "via": "compile_repeated_blocks", "mode": mode}
    names = set()
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                block.compile(**kw)
                names.add(type(block).__name__)
    return {"blocks": sorted(names), "via": "module_lists", "mode": mode}


def compile_blocks_under_hooks(model: torch.nn.Module, mode: str = "default") -> Dict[str, Any]:
    """Regional compile for a step cache: each block of the model's top-level ``nn.ModuleList`` s gets its
    ``forward`` compiled (an instance attribute, ``torch.compile(block.forward)``), so hooks registered on the block
    afterwards (diffusers' ``HookRegistry``, which wraps ``module.forward``) run eagerly around the compiled code
    and can skip it; ``module.compile()`` would compile ``_call_impl`` with the hooks inside. Blocks of a class
    share one compiled graph (dynamo keys on the class's ``forward`` code; parameters are graph inputs).

    Returns:
        ``{"blocks": [class names], "via": "block_forward", "mode"}`` for the manifest.
    """
    kw: Dict[str, Any] = {"fullgraph": False, "dynamic": False}
    if mode != "default":
        kw["mode"] = TORCH_COMPILE_MODES[mode]
    names = set()
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                block.forward = torch.compile(block.forward, **kw)
                names.add(type(block).__name__)
    return {"blocks": sorted(names), "via": "block_forward", "mode": mode}


def compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has produced in this process so far; a rise during the generation loop
    means a recompile (a new shape or a guard failure)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompilePass(Pass):
    """``compile`` and ``optimize.compile_mode|compile_cache|deterministic_compile|warmup`` (:mod:`models.passes`).

    Without a pass that hooks the denoiser's blocks (:meth:`models.passes.Pass.hooks_blocks`: a step cache), the
    repeated blocks of each denoiser are compiled last among the installs (:func:`compile_regional`); with one,
    :class:`CompileBeneathHooksPass` compiles them before that pass installs (:func:`compile_blocks_under_hooks`).
    Under compile the per-call observers are off (:meth:`hides_calls`: compiled code runs no Python hooks).

    Attributes:
        regions: what was compiled (:func:`compile_regional`'s record), None before install.
        compile_cache: the open :class:`models.compile_cache.CompileCache` (``optimize.compile_cache``).
    """

    name = "compile"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.regions: Optional[Dict[str, Any]] = None
        self.compile_cache: Any = None
        self.graphs_before: Optional[int] = None
        self.inductor_deterministic: Optional[bool] = None
        self._scope = contextlib.ExitStack()

    @property
    def mode(self) -> str:
        return str(self.engine.ctx.run.compile)

    def check_config(self) -> None:
        """``optimize.compile_mode``: only with ``compile`` on (a mode nothing reads is refused); the CUDA-graph
        modes are refused (regional compile replays one graph for every block of a class).

        Raises:
            ConfigValueError: naming the field, the value and the fix.
        """
        cfg = self.engine.ctx.run
        if cfg is None:
            return
        mode = str(cfg.optimize.compile_mode)
        if mode == "default":
            return
        if str(cfg.compile) == "none":
            raise ConfigValueError(f"optimize.compile_mode={mode} is set, but compile=none compiles nothing; fix: "
                                   "compile=regional, or optimize.compile_mode=default")
        if mode in CUDAGRAPH_MODES:
            raise ConfigValueError(
                f"optimize.compile_mode={mode} uses CUDA graphs, which compile={cfg.compile} cannot: one graph per "
                "block class is replayed for every block, so each block's output is overwritten by the next replay "
                "(torch: 'accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run', seen "
                "on the H200 with FLUX.1-dev, 2026-12-01); fix: optimize.compile_mode=max_autotune_no_cudagraphs or "
                "default")

    def hides_calls(self) -> bool:
        return self.mode != "none"

    def beneath_hooks(self) -> bool:
        """``compile=regional`` with a pass that hooks the denoiser's blocks: blocks compiled beneath its hooks."""
        return self.mode == "regional" and any(p.hooks_blocks() for p in self.engine.passes)

    def before_load(self) -> None:
        """Before the pipeline loads: Inductor's deterministic mode for everything compiled in this stage
        (``optimize.deterministic_compile``), restored at close."""
        cfg = self.engine.ctx.run
        self._scope.enter_context(deterministic_compile(self.mode != "none" and bool(cfg.optimize.deterministic_compile)))

    def open_cache(self) -> None:
        """Point torch's compile caches at ``<cache_dir>/compile/<key>`` for this stage (:mod:`models.compile_cache`),
        restored at close."""
        from models import compile_cache as cc
        from runner.core.schema import compile_factors

        e = self.engine
        fields = cc.key_fields(
            device=e.device, denoiser=e.denoiser, dtype=e.dtype,
            backends={f: r.selected for f, r in e.resolutions.items()},
            compile_cfg={**compile_factors(e.ctx.run), "engine": type(e).__name__})
        self.compile_cache = cc.CompileCache(cc.cache_root(e.cache_dir), fields).open()
        self._scope.callback(self.compile_cache.close)

    def compile_blocks(self, beneath: bool) -> None:
        """Each denoiser's repeated blocks compiled (beneath a step cache's hooks, or regionally); ``regions.experts``
        names the denoisers when there are several."""
        if self.engine.ctx.run.optimize.compile_cache:
            self.open_cache()
        experts = self.engine.experts()
        how = compile_blocks_under_hooks if beneath else compile_regional
        for _, mod in experts:
            self.regions = how(mod, str(self.engine.ctx.run.optimize.compile_mode))
        if len(experts) > 1 and not beneath:
            self.regions["experts"] = [x for x, _ in experts]

    def install(self, sections: Dict[str, Any]) -> None:
        """Regional compile of each denoiser's repeated blocks, last (without a pass that hooks the blocks)."""
        if self.mode == "regional" and not self.beneath_hooks():
            self.compile_blocks(beneath=False)

    def wants_warmup(self) -> bool:
        return self.mode != "none" and bool(self.engine.ctx.run.optimize.warmup)

    def before_warmup(self, batch: Sequence[Any]) -> None:
        """The warm-up compiles: say why the bar sits still (its ETA starts after it), start the cache's counts."""
        cc = self.compile_cache
        log.info("compile=%s: compiling the denoiser's blocks in a warm-up call before the first batch (%s); the "
                 "progress bar's ETA starts after it", self.mode,
                 f"compile cache {cc.dir}: {'warm, seconds' if cc.existed else 'cold, tens of seconds'}" if cc
                 else "optimize.compile_cache=false: tens of seconds")
        if cc is not None:
            cc.start()

    def after_warmup(self) -> None:
        """The cache's hits over the warm-up; the graphs compiled so far (a rise later is a recompile); Inductor's
        deterministic flag (still set after every block compiled: dynamo re-applies the global per frame)."""
        if self.compile_cache is not None:
            self.compile_cache.stop()
        self.graphs_before = compiled_graphs()
        import torch._inductor.config as inductor_config

        self.inductor_deterministic = getattr(inductor_config, "deterministic", None)

    def final_sections(self) -> Dict[str, Any]:
        """``compile``: warm-up seconds, Inductor's deterministic flag, graphs compiled after the warm-up, and the
        compile cache (``cache``: key, directory, hit/miss as torch counted them over the warm-up)."""
        if self.graphs_before is None:
            return {}
        cfg = self.engine.ctx.run
        return {"compile": {
            "mode": cfg.compile, "compile_mode": str(cfg.optimize.compile_mode), "regions": self.regions,
            "warmup_s": round(self.engine.warmup_s, 3), "inductor_deterministic": self.inductor_deterministic,
            "graphs_compiled_after_warmup": compiled_graphs() - self.graphs_before,
            "cache": self.compile_cache.section() if self.compile_cache is not None else {"enabled": False}}}

    def close(self) -> None:
        self._scope.close()


class CompileBeneathHooksPass(Pass):
    """``compile=regional`` with a pass that hooks the denoiser's blocks (a step cache): the blocks are compiled
    before that pass installs, so its hooks stay eager around the compiled code (:func:`compile_blocks_under_hooks`);
    the rest of compile is :class:`CompilePass`'s."""

    name = "compile_under_cache"

    def install(self, sections: Dict[str, Any]) -> None:
        compile_pass = self.engine.passes["compile"]
        if compile_pass.beneath_hooks():
            compile_pass.compile_blocks(beneath=True)
