"""Step caching: transformer computations of one denoising step reused at later steps (a lossy lane, opt in with
``cache.method``), through diffusers' own cache hooks (``CacheMixin.enable_cache``), observed and counted.

Methods (``cache.method``; a method is one :class:`CacheMethod` record, :func:`register_cache_method` adds one):

* ``first_block``: ``FirstBlockCacheConfig`` on every transformer block; adaptive; reads ``threshold``.
* ``magcache``: ``MagCacheConfig`` on every transformer block; adaptive; reads ``threshold``, ``max_skip_steps``,
  ``retention_ratio``, ``mag_ratios`` or ``calibrate`` (ratios calibrated for the model by diffusers' calibration
  pass, stored under the cache dir: ``models.cache_calibration``).
* ``taylorseer``: ``TaylorSeerCacheConfig`` on the attention modules (``lite``: blocks and ``proj_out``); fixed;
  reads ``compute_every``, ``warmup_steps``, ``order``, ``lite``.
* ``pab``: ``PyramidAttentionBroadcastConfig`` on the self-attention modules, one state per cache context (CFG
  branch); fixed; reads ``compute_every``, ``warmup_steps``.
* ``dbcache`` / ``dbcache_taylorseer``: cache-dit's DBCache (``cache_dit.enable_cache`` on the pipeline, with
  ``DBCacheConfig`` and, for the second, ``TaylorSeerCalibratorConfig``); adaptive; read ``threshold``,
  ``warmup_steps``, ``fn_compute_blocks``, ``bn_compute_blocks`` (and ``order``). cache-dit runs the blocks
  through their own ``__call__``, so the probe's block hooks observe which ran; its own statistics (cached steps
  per call) are cross-checked against the probe, never used as the count.

*Adaptive* methods decide each step from the model's activations (first_block: the relative change of the first
block's residual against ``threshold``; magcache: the accumulated error of the per-step magnitude ratios
``mag_ratios`` calibrated for a checkpoint), so how often they hit depends on the weights (on random weights,
arbitrarily): the evidence reports their hit rate. *Fixed* methods follow a schedule set by the config alone: the
first ``warmup_steps`` steps are computed, then one step in ``compute_every`` (taylorseer: Taylor-extrapolated
attention outputs in between; pab: the attention output of the last computed step reused), so speed can be measured
independently of the weights and the evidence checks the observed reuse against the schedule.
``cache.schedule=fixed`` (or ``adaptive``) asks for one kind and refuses a method of the other.

Counting (:class:`CacheProbe`): innermost diffusers hooks on every transformer block and every attention module
(registered before the cache's own hooks, so they run only when the real module computes), torch pre-hooks on the
same modules (they run on every call, whether the cache answered or not), and pre/post hooks on the transformer
delimiting its forwards. A block is *computed* in a forward when its own forward ran and every attention module in
it that was called computed too; else *reused* (skipped, predicted or approximated by the cache). A transformer
forward is computed when all its blocks were; else reused. Nothing is read from the config to count.

Not wired: FasterCache (approximates the unconditional branch of CFG models), SeaCache (video adapters),
TextKVCache (not step caching).

``compile=regional`` with a cache: methods whose hooks sit on whole blocks (``taylorseer`` with ``lite``,
``first_block``, ``magcache``) compile each block's forward beneath the hooks, which stay eager and decide around
it; the probe then counts blocks only (a block whose forward ran computed). Attention-level methods (``taylorseer``
without ``lite``, ``pab``) are refused with compile: their hooks would be traced into the compiled blocks.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import math
import sys
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from runner.core.errors import ConfigValueError, RefusedError
from runner.core.schema import CacheConfig
from runner.core.errors import install_fix

#: ``cache.*`` fields a method may read: every field of ``runner.core.schema.CacheConfig`` but ``method`` and
#: ``schedule`` (read off the schema, so a field added there is known here).
CACHE_FIELDS = tuple(f.name for f in dataclasses.fields(CacheConfig) if f.name not in ("method", "schedule"))
SCHEDULES = ("fixed", "adaptive")


class CacheConfigError(ConfigValueError):
    """A ``cache.*`` value is not valid for the chosen method (names the field, the value and the fix)."""


class CacheUnsupportedError(RefusedError):
    """The model (its transformer, its pipeline's forwards per step, or the run's compile mode) cannot run the
    chosen cache method; refused before anything loads, naming the model, the method and the fix."""


@dataclass(frozen=True)
class CacheMethod:
    """Everything the runner knows about one caching method.

    Attributes:
        name: the ``cache.method`` value (canonical spelling).
        schedule: ``fixed`` (which steps reuse is set by the config alone) or ``adaptive`` (decided from the
            activations each step).
        reads: the ``cache.*`` fields (of :data:`CACHE_FIELDS`) it takes; any other one set is refused.
        defaults: values of ``reads`` used when the field is null.
        build: ``(params, steps, probe) -> config``: the object handed to ``apply`` for a pipeline call of
            ``steps`` denoising steps (``probe.step``: the current step index, for hooks that need it).
        check: ``params -> [problem]``: each problem ``(field, why, fix)`` for values out of range.
        needs: ``attention`` (hooks attention modules: the transformer must be a ``CacheMixin``) or ``blocks``
            (hooks transformer blocks: also a block class diffusers' ``TransformerBlockRegistry`` knows).
        per_context: keeps a separate state per ``cache_context`` (``cond``/``uncond``), so it is right with
            several transformer forwards per step (true CFG); False: refused for such rows.
        reused_steps: fixed schedules: ``(params, steps) -> steps reused`` of one pipeline call (per cache context);
            None: not predicted (only "never hit" is checked).
        apply: ``(transformer, config) -> None`` installing it (default: ``transformer.enable_cache(config)``).
        remove: ``(transformer) -> None`` removing it (default: ``transformer.disable_cache()``).
        aliases: other accepted spellings (compared case-insensitively, ``-`` equals ``_``).
        compiles: ``params -> bool``: its hooks sit on whole transformer blocks (or outside them), never inside,
            so it runs with ``compile=regional``: each block's forward is compiled and the hooks, left eager,
            decide around it whether it runs (``models.compile.compile_blocks_under_hooks``).
        on_pipeline: ``apply``/``remove`` take the pipeline, not the transformer (cache-dit wraps the pipeline's
            call to reset its contexts per call).
        supports: ``(transformer_class, pipeline_class) -> why not`` (None: it can run), checked before loading
            instead of the CacheMixin / block-registry check.
        reported_reused: ``target -> forwards`` the library itself reports reused in the last pipeline call (its
            own statistics), cross-checked against what the probe observed; None: nothing to cross-check.
        after_apply: ``transformer -> None`` run after diffusers' ``enable_cache`` (the default ``apply``).
    """

    name: str
    schedule: str
    reads: Tuple[str, ...]
    defaults: Dict[str, Any]
    build: Callable[[Dict[str, Any], int, "CacheProbe"], Any]
    check: Callable[[Dict[str, Any]], List[Tuple[str, str, str]]] = lambda p: []
    needs: str = "attention"
    per_context: bool = True
    reused_steps: Optional[Callable[[Dict[str, Any], int], int]] = None
    apply: Optional[Callable[[torch.nn.Module, Any], None]] = None
    remove: Optional[Callable[[torch.nn.Module], None]] = None
    aliases: Tuple[str, ...] = ()
    compiles: Callable[[Dict[str, Any]], bool] = lambda p: False
    on_pipeline: bool = False
    supports: Optional[Callable[[str, Optional[str]], Optional[str]]] = None
    reported_reused: Optional[Callable[[Any], Optional[int]]] = None
    after_apply: Optional[Callable[[torch.nn.Module], None]] = None


CACHE_METHODS: Dict[str, CacheMethod] = {}


def register_cache_method(method: CacheMethod, *, replace: bool = False) -> None:
    """Add a caching method (selectable as ``cache.method=<name>``).

    Raises:
        ValueError: the name is taken and ``replace`` is False, or ``schedule``/``reads``/``needs`` hold unknown
            values.
    """
    if method.name in CACHE_METHODS and not replace:
        raise ValueError(f"cache method {method.name!r} is already registered; pass replace=True")
    if method.schedule not in SCHEDULES or method.needs not in ("attention", "blocks"):
        raise ValueError(f"cache method {method.name!r}: schedule must be one of {SCHEDULES}, needs attention|blocks")
    unknown = [f for f in (*method.reads, *method.defaults) if f not in CACHE_FIELDS]
    if unknown:
        raise ValueError(f"cache method {method.name!r} reads unknown fields {unknown}; fields: {CACHE_FIELDS}")
    CACHE_METHODS[method.name] = method


def unregister_cache_method(name: str) -> None:
    """Remove a registered method (tests register methods for their own duration)."""
    CACHE_METHODS.pop(name, None)


def _norm(name: Any) -> str:
    return str(name).strip().lower().replace("-", "_")


def method_of(name: Any) -> Optional[CacheMethod]:
    """The method named ``name`` (any accepted spelling); None for ``none``.

    Raises:
        CacheConfigError: no such method, listing the known ones and the closest.
    """
    n = _norm(name)
    if n in ("none", "", "null", "off"):
        return None
    for m in CACHE_METHODS.values():
        if n == _norm(m.name) or n in (_norm(a) for a in m.aliases):
            return m
    known = sorted(CACHE_METHODS)
    close = difflib.get_close_matches(n, known + [a for m in CACHE_METHODS.values() for a in m.aliases], n=1)
    raise CacheConfigError(f"cache.method={name!r} is not a caching method; known: none, {', '.join(known)}"
                           + (f"; did you mean {close[0]!r}?" if close else "") + "; fix: cache.method=none or one "
                           "of those")


@dataclass(frozen=True)
class CacheSettings:
    """The validated cache config of a run: the method, its schedule and every parameter it reads (defaults
    filled in)."""

    method: CacheMethod
    schedule: str
    params: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        """``{method, schedule, params}`` as recorded in item records and the manifest."""
        return {"method": self.method.name, "schedule": self.schedule, "params": dict(self.params)}


def settings(cfg: Any) -> Optional[CacheSettings]:
    """Validate the run's ``cache`` section against its method; None when no cache is configured. ``cfg``: the
    typed run config (``runner.core.schema.RunConfig``; its ``cache`` and ``compile``).

    Raises:
        CacheConfigError: an unknown method, a schedule the method does not have, a field the method does not read,
            or a value out of range (each names ``cache.<field>``, the value and the fix).
        A cache with ``compile=regional`` is refused the same way (not supported yet).
    """
    c = cfg.cache
    m = method_of(c.method)
    if m is None:
        given = [f for f in ("schedule", *CACHE_FIELDS) if getattr(c, f) is not None]
        if given:  # a value nothing reads is refused, not ignored
            v = getattr(c, given[0])
            raise CacheConfigError(f"cache.{given[0]}={v!r} is set, but cache.method={c.method} (no cache) "
                                   "reads no cache field; fix: remove it, or choose a method (a sweep over methods "
                                   "with their own fields: -m 'cache={method:none},{method:taylorseer,compute_every:2}')")
        return None
    if c.schedule is not None and str(c.schedule) != m.schedule:
        other = sorted(n for n, x in CACHE_METHODS.items() if x.schedule == str(c.schedule))
        why = ("decides each step from the activations (its hit rate depends on the weights)"
               if m.schedule == "adaptive" else "follows a schedule set by cache.compute_every/warmup_steps")
        raise CacheConfigError(f"cache.schedule={c.schedule} is not available for cache.method={m.name}, which {why}; "
                               f"fix: cache.schedule={m.schedule} (or null), or cache.method="
                               f"{'|'.join(other) or '<a ' + str(c.schedule) + ' method>'}")
    params: Dict[str, Any] = {}
    for f in CACHE_FIELDS:
        v = getattr(c, f)
        if v is None:
            if f in m.reads:
                params[f] = m.defaults.get(f)
            continue
        if f not in m.reads:
            raise CacheConfigError(f"cache.{f}={v!r} is not read by cache.method={m.name} (it reads: "
                                   f"{', '.join(m.reads) or 'nothing'}); fix: remove cache.{f} (null)")
        params[f] = v
    problems = _check_common(params) + list(m.check(params))
    if problems:
        f, why, fix = problems[0]
        raise CacheConfigError(f"cache.{f}={params.get(f)!r} {why} (cache.method={m.name}); fix: {fix}")
    if str(cfg.compile) != "none" and not m.compiles(params):
        raise CacheConfigError(
            f"cache.method={m.name} with compile={cfg.compile}: its hooks sit on attention modules inside the "
            "transformer blocks, so they would be traced into the compiled blocks; fix: compile=none with this "
            "method, or a block-level method (cache.method=taylorseer with cache.lite=true, first_block, magcache)")
    return CacheSettings(method=m, schedule=m.schedule, params=params)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_common(p: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    """Types and ranges of the shared fields (each method checks its own further rules)."""
    out: List[Tuple[str, str, str]] = []
    if "threshold" in p and (not isinstance(p["threshold"], (int, float)) or isinstance(p["threshold"], bool)
                             or not math.isfinite(p["threshold"]) or p["threshold"] <= 0):
        out.append(("threshold", "must be a finite number > 0", "e.g. cache.threshold=0.05"))
    if "compute_every" in p and (not _is_int(p["compute_every"]) or p["compute_every"] < 2):
        out.append(("compute_every", "must be an integer >= 2 (1 computes every step: nothing is reused)",
                    "cache.compute_every=2 (or cache.method=none)"))
    if "warmup_steps" in p and (not _is_int(p["warmup_steps"]) or p["warmup_steps"] < 1):
        out.append(("warmup_steps", "must be an integer >= 1 (a step must be computed before one can be reused)",
                    "cache.warmup_steps=1"))
    if "max_skip_steps" in p and (not _is_int(p["max_skip_steps"]) or p["max_skip_steps"] < 1):
        out.append(("max_skip_steps", "must be an integer >= 1", "cache.max_skip_steps=3"))
    if "retention_ratio" in p and (not isinstance(p["retention_ratio"], (int, float))
                                   or isinstance(p["retention_ratio"], bool) or not 0 <= p["retention_ratio"] < 1):
        out.append(("retention_ratio", "must be a number in [0, 1) (the share of first steps always computed)",
                    "cache.retention_ratio=0.2"))
    if "order" in p and (not _is_int(p["order"]) or not 0 <= p["order"] <= 3):
        out.append(("order", "must be an integer in 0..3 (Taylor expansion order; 0 reuses the last output)",
                    "cache.order=1"))
    for f in ("lite", "calibrate"):
        if f in p and not isinstance(p[f], bool):
            out.append((f, "must be true or false", f"cache.{f}=false"))
    if "fn_compute_blocks" in p and (not _is_int(p["fn_compute_blocks"]) or p["fn_compute_blocks"] < 1):
        out.append(("fn_compute_blocks", "must be an integer >= 1 (the first blocks decide whether to reuse)",
                    "cache.fn_compute_blocks=1"))
    if "bn_compute_blocks" in p and (not _is_int(p["bn_compute_blocks"]) or p["bn_compute_blocks"] < 0):
        out.append(("bn_compute_blocks", "must be an integer >= 0", "cache.bn_compute_blocks=0"))
    return out


def check_support(s: CacheSettings, transformer_class: str, model: str,
                  pipeline_class: Optional[str] = None) -> None:
    """Refuse, before loading, a model whose transformer cannot run method ``s.method``: not a diffusers
    ``CacheMixin`` (no ``enable_cache``), or, for block methods, without a transformer block class that diffusers'
    ``TransformerBlockRegistry`` describes; a method with its own ``supports`` check (cache-dit's) asks it.

    Raises:
        CacheUnsupportedError: naming the model, the transformer (or pipeline) class, the method and the fix.
    """
    import diffusers
    from diffusers.models.cache_utils import CacheMixin

    cls = getattr(diffusers, str(transformer_class), None)
    fix = "cache.method=none for this model (or a family whose transformer has enable_cache: flux, qwen_image, wan)"
    if s.method.supports is not None:
        why = s.method.supports(str(transformer_class), pipeline_class)
        if why:
            raise CacheUnsupportedError(f"cache.method={s.method.name}: model={model} ({pipeline_class}, "
                                        f"{transformer_class}): {why}")
        return
    if s.method.apply is not None:  # a registered method that installs itself decides for itself
        return
    if cls is None or not issubclass(cls, CacheMixin):
        raise CacheUnsupportedError(f"cache.method={s.method.name}: model={model}'s transformer "
                                    f"({transformer_class}) is not a diffusers CacheMixin, so no diffusers cache "
                                    f"can be enabled on it; fix: {fix}")
    if s.method.needs == "blocks":
        from diffusers.hooks._helpers import TransformerBlockRegistry

        def described(block: type) -> bool:
            try:
                TransformerBlockRegistry.get(block)
            except ValueError:
                return False
            return True

        module = sys.modules.get(cls.__module__)  # the block classes its module defines or imports
        here = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, torch.nn.Module)
                and v is not cls and described(v)] if module else []
        if not here:
            raise CacheUnsupportedError(
                f"cache.method={s.method.name} hooks transformer blocks, and diffusers describes none of "
                f"{transformer_class}'s block classes (TransformerBlockRegistry); fix: cache.method=taylorseer or "
                f"pab (attention-level), or {fix}")


def check_block_counts(s: CacheSettings, blocks: Optional[int], model: str) -> None:
    """Refuse, before loading, a block split the transformer cannot make: cache-dit's DBCache computes the first
    ``fn_compute_blocks`` and the last ``bn_compute_blocks`` of the transformer's blocks (all its block lists in
    order) and asserts each is at most their number (``cache_dit/caching/cache_blocks/pattern_base.py``), which
    failed every item of ``model=toy_shapes cache.method=dbcache`` (5 blocks, the default 8) mid-run.

    Args:
        blocks: the transformer's blocks from its config (``num_layers`` + ``num_single_layers``); None: unknown.

    Raises:
        CacheConfigError: naming the field, the value, the model's blocks and the fix.
    """
    if blocks is None:
        return
    bad = [(k, s.params[k]) for k in ("fn_compute_blocks", "bn_compute_blocks")
           if _is_int(s.params.get(k)) and s.params[k] > blocks]
    if bad:
        raise CacheConfigError("; ".join(
            f"cache.{k}={v} with model={model}: its transformer has {blocks} blocks, and cache.method="
            f"{s.method.name} computes the {'first' if k.startswith('fn') else 'last'} {v} of them; fix: "
            f"cache.{k}={max(1, blocks // 2) if k.startswith('fn') else 0}" for k, v in bad))


def transformer_blocks(conf: Mapping[str, Any]) -> Optional[int]:
    """The transformer's blocks from its config: ``num_layers`` plus ``num_single_layers`` where present (FLUX,
    HiDream); None without ``num_layers``."""
    if not _is_int(conf.get("num_layers")):
        return None
    return int(conf["num_layers"]) + (int(conf["num_single_layers"]) if _is_int(conf.get("num_single_layers")) else 0)


def check_rows_forwards(s: CacheSettings, forwards_per_step: Sequence[Optional[float]], model: str) -> None:
    """Refuse a method that keeps one state for every forward (``per_context=False``: pab) when a row makes several
    transformer forwards per step (true CFG: cond and uncond would share the cached attention), or when the count is
    not known (a generic pipeline).

    Raises:
        CacheUnsupportedError: naming the method, the forwards per step and the fix.
    """
    if s.method.per_context:
        return
    bad = [f for f in forwards_per_step if f is None or f > 1]
    if bad:
        what = "an unknown number of" if bad[0] is None else f"{bad[0]:g}"
        raise CacheUnsupportedError(
            f"cache.method={s.method.name} keeps one cached output per attention module for every forward, and "
            f"model={model} makes {what} transformer forwards per step for some rows (true CFG), whose branches would "
            "then reuse each other's attention; fix: cache.method=taylorseer or first_block (separate state per "
            "cond/uncond branch), or rows without true CFG")


# ---------------------------------------------------------------------------------------------- observation
@functools.lru_cache(maxsize=None)
def _probe_hook_class() -> type:
    """The probe's hook class, built on first use: diffusers.hooks is imported once a run loads, not at startup."""
    from diffusers.hooks import ModelHook

    class _ProbeHook(ModelHook):
        """A diffusers hook registered innermost on a module: its ``pre_forward`` runs only when the module's own
        forward runs (a cache hook registered later wraps it, and skips it when it answers from its cache)."""

        def __init__(self, on_run: Callable[[], None]) -> None:
            super().__init__()
            self.on_run = on_run

        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[Any, Any]:
            self.on_run()
            return args, kwargs

    return _ProbeHook


PROBE_HOOK = "runner_cache_probe"


@dataclass
class CacheCounts:
    """Counts of a span of transformer forwards (one pipeline call, or the whole run).

    Attributes:
        forwards_computed / forwards_reused: transformer forwards in which every block computed / at least one block
            was reused (skipped, predicted or approximated by the cache).
        blocks_computed / blocks_reused: block executions summed over those forwards (blocks per forward x forwards).
    """

    forwards_computed: int = 0
    forwards_reused: int = 0
    blocks_computed: int = 0
    blocks_reused: int = 0

    def minus(self, other: "CacheCounts") -> "CacheCounts":
        """The counts since ``other`` (a snapshot of the same probe)."""
        return CacheCounts(self.forwards_computed - other.forwards_computed,
                           self.forwards_reused - other.forwards_reused,
                           self.blocks_computed - other.blocks_computed, self.blocks_reused - other.blocks_reused)

    def to_dict(self) -> Dict[str, int]:
        return {"forwards_computed": self.forwards_computed, "forwards_reused": self.forwards_reused,
                "blocks_computed": self.blocks_computed, "blocks_reused": self.blocks_reused}


class CacheProbe:
    """Counts, per transformer forward, which blocks and attention modules really computed (see the module
    docstring). Install it before the cache: its hooks must be the innermost ones.

    Attributes:
        blocks: ``[(name, module)]`` of every transformer block (the children of the transformer's top-level
            ``nn.ModuleList`` s).
        attention_runs: attention module name -> forwards in which it computed (the evidence expects that many
            calls of its attention backend at its call site).
        counts: totals over every forward so far.
        step: forwards since :meth:`start_call` (the step index of a call with one forward per step).
    """

    def __init__(self, transformer: torch.nn.Module, attention: Sequence[Tuple[str, torch.nn.Module]],
                 observe_attention: bool = True) -> None:
        """``observe_attention=False`` (compiled blocks): no hooks inside the blocks; a block computed when its
        forward ran."""
        self.blocks: List[Tuple[str, torch.nn.Module]] = []
        for name, child in transformer.named_children():
            if isinstance(child, torch.nn.ModuleList):
                self.blocks += [(f"{name}.{i}", b) for i, b in enumerate(child)]
        if not self.blocks:
            raise CacheUnsupportedError(f"{type(transformer).__name__} has no transformer blocks in a ModuleList, so "
                                        "no cache can be observed on it; fix: cache.method=none")
        self.attention: Dict[str, int] = {}  # attention module name -> index of its block
        mods: List[Tuple[str, torch.nn.Module]] = []
        for name, mod in attention if observe_attention else ():
            owner = next((i for i, (bn, _) in enumerate(self.blocks) if name.startswith(bn + ".")), None)
            if owner is not None:
                self.attention[name] = owner
                mods.append((name, mod))
        self.attention_runs: Dict[str, int] = {n: 0 for n in self.attention}
        self.counts = CacheCounts()
        self.step = 0
        self.per_step = 1  # transformer forwards per denoising step of the current call (StepCache.before_call)
        self._ran_blocks: set = set()
        self._called_attn: set = set()
        self._ran_attn: set = set()
        from diffusers.hooks import HookRegistry

        probe = _probe_hook_class()
        for i, (_, block) in enumerate(self.blocks):
            HookRegistry.check_if_exists_or_initialize(block).register_hook(
                probe(lambda _i=i: self._ran_blocks.add(_i)), PROBE_HOOK)
        for name, mod in mods:
            HookRegistry.check_if_exists_or_initialize(mod).register_hook(
                probe(lambda _n=name: self._ran_attn.add(_n)), PROBE_HOOK)
            mod.register_forward_pre_hook(lambda m, a, _n=name: self._called_attn.add(_n))
        transformer.register_forward_pre_hook(self._begin)
        transformer.register_forward_hook(self._end)

    def start_call(self) -> None:
        """A pipeline call begins (step indices restart at 0)."""
        self.step = 0

    def reset(self) -> None:
        """Forget every count (after a compile warm-up call, which is no part of the run)."""
        self.counts = CacheCounts()
        self.attention_runs = {n: 0 for n in self.attention}
        self.step = 0

    def snapshot(self) -> CacheCounts:
        """A copy of the totals, to subtract later (:meth:`CacheCounts.minus`)."""
        return CacheCounts(**self.counts.to_dict())

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        self._ran_blocks.clear()
        self._called_attn.clear()
        self._ran_attn.clear()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        computed = 0
        partial = {self.attention[n] for n in self._called_attn if n not in self._ran_attn}
        for i in range(len(self.blocks)):
            if i in self._ran_blocks and i not in partial:
                computed += 1
        for n in self._ran_attn:
            self.attention_runs[n] += 1
        reused = len(self.blocks) - computed
        c = self.counts
        c.blocks_computed += computed
        c.blocks_reused += reused
        if reused:
            c.forwards_reused += 1
        else:
            c.forwards_computed += 1
        self.step += 1


class StepCache:
    """A configured cache on one loaded transformer: the probe, the method's hooks (rebuilt when a call has another
    step count), the per-call counts, and the evidence.

    Attributes:
        settings: the validated config.
        probe: the observer (:class:`CacheProbe`).
        calls: pipeline calls made; ``expected_reused``: forwards the schedule says are reused (fixed methods whose
            ``reused_steps`` is known and whose forwards per step are known; None otherwise).
    """

    def __init__(self, transformer: torch.nn.Module, s: CacheSettings,
                 attention: Sequence[Tuple[str, torch.nn.Module]], compiled: bool = False,
                 pipeline: Any = None, ratios: Any = None) -> None:
        """Install the probe on ``transformer`` (``attention``: ``(name, module)`` of its attention modules, names
        relative to the transformer; ``compiled``: the blocks' forwards are compiled, so nothing is hooked inside
        them); the method itself is installed by the first :meth:`before_call`. ``pipeline``: the loaded pipeline
        (for methods ``on_pipeline``); ``ratios``: the :class:`models.cache_calibration.RatioStore` of the model
        (``cache.calibrate=true``)."""
        self.transformer = transformer
        self.pipeline = pipeline
        self.settings = s
        self.probe = CacheProbe(transformer, attention, observe_attention=not compiled)
        self.calls = 0
        self.expected_reused: Optional[int] = 0 if s.method.reused_steps is not None else None
        self.ratios = ratios
        self.calibrations: Dict[str, Dict[str, Any]] = {}  # str(steps) -> the calibration record
        self.reported: Optional[int] = 0 if s.method.reported_reused is not None else None
        self.disagreements: List[str] = []
        self._installed: Optional[Tuple[int, int, bool]] = None
        self._before = self.probe.snapshot()

    @property
    def _target(self) -> Any:
        return self.pipeline if self.settings.method.on_pipeline else self.transformer

    def _remove(self) -> None:
        m = self.settings.method
        if m.remove is not None:
            m.remove(self._target)
        else:
            self.transformer.disable_cache()
        self._installed = None

    def _install(self, steps: int, per_step: int, calibrating: bool = False) -> None:
        """The method's hooks for calls of ``steps`` steps and ``per_step`` forwards per step (the calibration
        pass: ``calibrating``, with the method's parameters as configured)."""
        key = (steps, per_step, calibrating)
        if key == self._installed:
            return
        if self._installed is not None:
            self._remove()
        m = self.settings.method
        params = dict(self.settings.params)
        if params.get("calibrate") and not calibrating:
            params["mag_ratios"] = self.calibrations[str(steps)]["ratios"]
        self.probe.per_step = per_step
        config = m.build(params, steps, self.probe)
        (m.apply or (lambda t, c: t.enable_cache(c)))(self._target, config)
        self._installed = key
        if m.after_apply is not None:
            try:
                m.after_apply(self.transformer)
            except BaseException:
                self._remove()
                raise

    def _reset_state(self) -> None:
        reset = getattr(self.transformer, "_reset_stateful_cache", None)
        if callable(reset):
            reset()
        self.probe.start_call()

    def before_call(self, steps: int, per_step: int = 1) -> None:
        """Before a pipeline call of ``steps`` denoising steps of ``per_step`` transformer forwards each:
        (re)install the method for them, reset the cache state (a call never sees another call's cached outputs)
        and mark the counts.

        Raises:
            RuntimeError: ``cache.calibrate=true`` and :meth:`calibrate` did not run for ``steps``.
        """
        if self.settings.params.get("calibrate") and str(steps) not in self.calibrations:
            raise RuntimeError(f"cache.calibrate=true: no calibration for {steps} steps (calibrate() runs first)")
        self._install(steps, per_step)
        self._reset_state()
        self._before = self.probe.snapshot()

    def needs_calibration(self, steps: int) -> bool:
        """``cache.calibrate=true`` and no ratios for ``steps`` yet in this run."""
        return bool(self.settings.params.get("calibrate")) and str(steps) not in self.calibrations

    def calibrate(self, steps: int, per_step: int, run_call: Callable[[], None], items: Sequence[str]) -> None:
        """The ratios for ``steps``: loaded from the store, else measured by diffusers' calibration pass
        (``run_call()``: one pipeline call over ``items`` with the calibrating hooks installed) and stored
        (:func:`models.cache_calibration.calibrate`). The pass's counts, as the probe observed them, go into its
        record (every forward computed) and no further: the probe is reset after it.

        Raises:
            models.cache_calibration.CalibrationError: an invalid stored file, or a pass without usable ratios.
        """
        from models import cache_calibration as cal

        def run_pass() -> Dict[str, List[float]]:
            self._install(steps, per_step, calibrating=True)
            self._reset_state()
            capture = cal.RatioCapture(self.transformer, [b for _, b in self.probe.blocks])
            printed = io.StringIO()  # diffusers prints the ratios "to copy into MagCacheConfig": they are stored
            try:
                with contextlib.redirect_stdout(printed):
                    run_call()
            finally:
                lists = capture.close()
                self._remove()
            return lists

        rec = cal.calibrate(self.ratios, steps, run_pass, {"items": list(items), "seed": 0,
                                                           "forwards_per_step": per_step})
        if rec["source"] == "calibrated":
            rec["observed"] = self.probe.counts.to_dict()  # the pass computed every step: not a cached run
        self.calibrations[str(steps)] = rec
        self.probe.reset()
        self._before = self.probe.snapshot()

    def close(self) -> None:
        """Remove the method's hooks (cache-dit patches the pipeline's class: undone when the engine closes)."""
        if self._installed is not None:
            self._remove()

    def warmed_up(self) -> None:
        """A compile warm-up call ran through the probe (before any method was installed): its counts are dropped."""
        self.probe.reset()
        self._before = self.probe.snapshot()

    def call_failed(self) -> None:
        """A pipeline call raised part-way: what the schedule predicts for the run is no longer known."""
        self.expected_reused = None

    def after_call(self, steps: int, forwards: Optional[int]) -> CacheCounts:
        """After a pipeline call that completed: its counts; adds what a fixed schedule predicts for it.

        Args:
            forwards: transformer forwards the call should make (None: not known).
        """
        self.calls += 1
        got = self.probe.counts.minus(self._before)
        m = self.settings.method
        if m.reported_reused is not None:  # the library's own statistics, against what executed
            rep = m.reported_reused(self._target)
            self.reported = None if rep is None or self.reported is None else self.reported + rep
            if rep is not None and rep != got.forwards_reused:
                self.disagreements.append(f"call {self.calls}: {m.name} reports {rep} forwards reused, the probe "
                                          f"observed {got.forwards_reused}")
        if self.expected_reused is not None:
            if forwards is None or forwards % steps:
                self.expected_reused = None
            else:
                self.expected_reused += m.reused_steps(self.settings.params, steps) * (forwards // steps)
        return got

    def record(self, counts: CacheCounts, items: int) -> Dict[str, Any]:
        """The ``cache`` field of an item record: method, schedule, params, and the counts of the pipeline call the
        item ran in (``call_items``: items in that call, which share the counts); with ``cache.calibrate``, the
        sha256 and source of the ratios its call used (``calibration``)."""
        rec = {**self.settings.to_dict(), **counts.to_dict(), "call_items": items}
        if self.calibrations and self._installed is not None:
            cal = self.calibrations.get(str(self._installed[0]))
            if cal is not None:
                rec["calibration"] = {"sha256": cal["sha256"], "source": cal["source"]}
        return rec

    def evidence(self, stage: str) -> Tuple[Dict[str, Any], List[str]]:
        """``evidence.stages.<stage>.cache`` (totals, hit rates, what the schedule predicts) and its mismatches: the
        cache never hit over the run (configured but not observed), or a fixed schedule's reuse not what was
        observed."""
        c = self.probe.counts
        fw, bl = c.forwards_computed + c.forwards_reused, c.blocks_computed + c.blocks_reused
        doc = {**self.settings.to_dict(), **c.to_dict(),
               "forwards_hit_rate": round(c.forwards_reused / fw, 4) if fw else None,
               "blocks_hit_rate": round(c.blocks_reused / bl, 4) if bl else None,
               "blocks_per_forward": len(self.probe.blocks), "calls": self.calls,
               "expected_forwards_reused": self.expected_reused}
        if self.calibrations:
            doc["calibration"] = dict(self.calibrations)
        if self.reported is not None or self.disagreements:
            doc["library_reported_reused"] = self.reported
        mm: List[str] = [f"stage {stage}, cache: {d}" for d in self.disagreements]
        name = self.settings.method.name
        for steps, cal in self.calibrations.items():
            if (cal.get("observed") or {}).get("forwards_reused"):
                mm.append(f"stage {stage}, cache: the magcache calibration pass of {steps} steps reused "
                          f"{cal['observed']['forwards_reused']} transformer forwards; it must compute every step")
        if fw and c.forwards_reused == 0:
            mm.append(f"stage {stage}, cache: cache.method={name} is configured, but no block or forward was reused "
                      f"in {fw} transformer forwards (the cache never hit); fix: "
                      + ("a larger cache.threshold (its hit rate depends on the weights)"
                         if self.settings.schedule == "adaptive" else "fewer cache.warmup_steps or more steps")
                      + ", or cache.method=none")
        elif self.expected_reused is not None and c.forwards_reused != self.expected_reused:
            mm.append(f"stage {stage}, cache: cache.method={name}'s fixed schedule reuses {self.expected_reused} "
                      f"transformer forwards in this run, observed {c.forwards_reused} reused of {fw}")
        doc["verdict"] = "mismatch" if mm else "observed"
        return doc, mm


# ---------------------------------------------------------------------------------------------- the methods
def _first_block(p: Dict[str, Any], steps: int, probe: CacheProbe) -> Any:
    from diffusers.hooks import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=float(p["threshold"]))


def _mag_ratios(p: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    r = p.get("mag_ratios")
    if p.get("calibrate") is True:
        return [] if r is None else [
            ("mag_ratios", "is set together with cache.calibrate=true (the ratios would come from two places)",
             "cache.mag_ratios=null to use the ratios calibrated for this model, or cache.calibrate=false")]
    if r is None:
        return [("mag_ratios", "is required: MagCache's per-step magnitude ratios are calibrated per checkpoint",
                 "cache.calibrate=true (calibrated for this model by diffusers' calibration pass, stored under "
                 "cache_dir), cache.mag_ratios=flux (diffusers' FLUX.1 ratios) or a list of ratios, one per step")]
    if isinstance(r, str):
        return [] if r.lower() == "flux" else [("mag_ratios", "names no shipped ratios (known: flux)",
                                                "cache.mag_ratios=flux or a list of floats")]
    ok = isinstance(r, list) and len(r) >= 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     and math.isfinite(x) and x > 0 for x in r)
    return [] if ok else [("mag_ratios", "must be 'flux' or a list of at least 2 positive numbers",
                           "cache.mag_ratios=flux")]


def _magcache(p: Dict[str, Any], steps: int, probe: CacheProbe) -> Any:
    from diffusers.hooks import MagCacheConfig

    r = p["mag_ratios"]
    if r is None and p.get("calibrate"):  # the calibration pass: every step computed, the ratios measured
        return MagCacheConfig(num_inference_steps=int(steps), calibrate=True)
    if isinstance(r, str):
        from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

        r = FLUX_MAG_RATIOS
    return MagCacheConfig(threshold=float(p["threshold"]), max_skip_steps=int(p["max_skip_steps"]),
                          retention_ratio=float(p["retention_ratio"]), num_inference_steps=int(steps),
                          mag_ratios=torch.as_tensor(r, dtype=torch.float32))


def _taylorseer(p: Dict[str, Any], steps: int, probe: CacheProbe) -> Any:
    from diffusers.hooks import TaylorSeerCacheConfig

    import re

    # the attention modules of the blocks by name (diffusers' default patterns, ``^blocks.*attn``, fullmatch no
    # Wan ``attn1``/``attn2``, so on Wan nothing would be cached); lite mode uses diffusers' own patterns
    return TaylorSeerCacheConfig(cache_interval=int(p["compute_every"]),
                                 disable_cache_before_step=int(p["warmup_steps"]),
                                 max_order=int(p["order"]), use_lite_mode=bool(p["lite"]),
                                 taylor_factors_dtype=torch.float32,
                                 cache_identifiers=[re.escape(n) for n in probe.attention] or None)


def _taylorseer_reused(p: Dict[str, Any], steps: int) -> int:
    """diffusers' TaylorSeer rule: step s computes when s < warmup or (s - warmup - 1) % interval == 0."""
    w, n = int(p["warmup_steps"]), int(p["compute_every"])
    return sum(1 for s in range(steps) if not (s < w or (s - w - 1) % n == 0))


def _pab(p: Dict[str, Any], steps: int, probe: CacheProbe) -> Any:
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    # the "timestep" PAB compares is the step index (forwards so far // forwards per step), so the schedule is in
    # steps, not in the scheduler's timestep units: steps 0..warmup-1 lie outside the skip range and compute
    return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=int(p["compute_every"]),
                                           spatial_attention_timestep_skip_range=(int(p["warmup_steps"]) - 1,
                                                                                  sys.maxsize),
                                           current_timestep_callback=lambda: probe.step // probe.per_step)


def _pab_per_context(transformer: torch.nn.Module) -> None:
    """Give each of diffusers' PAB hooks one state per cache context (``cond``/``uncond``): diffusers keeps one
    cached attention output per module, so with CFG the uncond forward would reuse the cond forward's attention. The
    hooks are replaced, same name and place (outside the probe's), by :class:`_PerContextPAB` with their settings."""
    from diffusers.hooks.pyramid_attention_broadcast import PyramidAttentionBroadcastHook

    for mod in transformer.modules():
        registry = getattr(mod, "_diffusers_hook", None)
        for name, hook in list((registry.hooks if registry is not None else {}).items()):
            if type(hook) is PyramidAttentionBroadcastHook:
                registry.remove_hook(name, recurse=False)
                registry.register_hook(_PerContextPAB(hook.timestep_skip_range, hook.block_skip_range,
                                                      hook.current_timestep_callback), name)


@functools.lru_cache(maxsize=None)
def _per_context_pab_class() -> type:
    from diffusers.hooks.hooks import CacheContext, StateManager
    from diffusers.hooks.pyramid_attention_broadcast import (PyramidAttentionBroadcastHook,
                                                             PyramidAttentionBroadcastState)

    class PerContextPAB(PyramidAttentionBroadcastHook):
        """diffusers' ``PyramidAttentionBroadcastHook`` (its rule, unchanged) whose ``state`` is the current cache
        context's (a ``StateManager``, which ``cache_context`` points at the branch; a forward outside any
        context uses ``inference``)."""

        _is_stateful = True

        def __init__(self, *args: Any) -> None:
            self.state_manager = StateManager(PyramidAttentionBroadcastState)
            super().__init__(*args)

        @property
        def state(self) -> Any:
            try:
                return self.state_manager.get_state()
            except ValueError:  # no cache context set around this forward
                self.state_manager.set_context(CacheContext(name="inference"))
                return self.state_manager.get_state()

        @state.setter
        def state(self, value: Any) -> None:  # initialize_hook's single state: the per-context ones replace it
            pass

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            self.state_manager.reset()
            return module

    return PerContextPAB


def _PerContextPAB(*args: Any) -> Any:
    return _per_context_pab_class()(*args)


def _pab_reused(p: Dict[str, Any], steps: int) -> int:
    """diffusers' PAB rule with the step index as its timestep: step s computes when s < warmup or s % N == 0."""
    w, n = int(p["warmup_steps"]), int(p["compute_every"])
    return sum(1 for s in range(steps) if not (s < w or s % n == 0))


register_cache_method(CacheMethod(
    "first_block", "adaptive", ("threshold",), {"threshold": 0.05}, _first_block, needs="blocks",
    aliases=("fbc", "first_block_cache", "firstblock"), compiles=lambda p: True))
register_cache_method(CacheMethod(
    "magcache", "adaptive", ("threshold", "max_skip_steps", "retention_ratio", "mag_ratios", "calibrate"),
    {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2, "mag_ratios": None, "calibrate": False},
    _magcache,
    check=_mag_ratios, needs="blocks", aliases=("mag_cache", "mag"), compiles=lambda p: True))
register_cache_method(CacheMethod(
    "taylorseer", "fixed", ("compute_every", "warmup_steps", "order", "lite"),
    {"compute_every": 5, "warmup_steps": 3, "order": 1, "lite": False}, _taylorseer,
    reused_steps=_taylorseer_reused, aliases=("taylorseer_cache", "taylor_seer", "taylor"),
    compiles=lambda p: bool(p["lite"])))
register_cache_method(CacheMethod(
    "pab", "fixed", ("compute_every", "warmup_steps"), {"compute_every": 2, "warmup_steps": 1}, _pab,
    reused_steps=_pab_reused, aliases=("pyramid_attention_broadcast",), after_apply=_pab_per_context))


# ---------------------------------------------------------------------------------------------- cache-dit
def _cache_dit_supports(transformer_class: str, pipeline_class: Optional[str]) -> Optional[str]:
    """Why cache-dit cannot run on this pipeline (None: it can): not installed, or no block adapter of its own
    for the pipeline class (``cache_dit.supported_pipelines()``: class-name prefixes)."""
    try:
        import cache_dit
    except ImportError:
        return (f"cache-dit is not installed; fix: {install_fix('cache-dit')}, or a diffusers "
                "method (cache.method=first_block|magcache|taylorseer|pab)")
    _, names = cache_dit.supported_pipelines()
    if pipeline_class is None or not any(str(pipeline_class).startswith(n) for n in names):
        return (f"cache-dit has no block adapter for {pipeline_class}; fix: a diffusers method "
                "(cache.method=first_block|magcache|taylorseer|pab), or cache.method=none")
    return None


def _dbcache(p: Dict[str, Any], steps: int, probe: CacheProbe) -> Any:
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    # one cache context per branch when a step makes several forwards (CFG): cache-dit's enable_separate_cfg
    config = DBCacheConfig(Fn_compute_blocks=int(p["fn_compute_blocks"]), Bn_compute_blocks=int(p["bn_compute_blocks"]),
                           residual_diff_threshold=float(p["threshold"]), max_warmup_steps=int(p["warmup_steps"]),
                           num_inference_steps=int(steps), enable_separate_cfg=probe.per_step > 1)
    calibrator = TaylorSeerCalibratorConfig(taylorseer_order=int(p["order"])) if "order" in p else None
    return config, calibrator


def _quiet_cache_dit() -> None:
    """cache-dit logs its configuration at INFO on loggers of its own (not propagated): warnings only."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("cache_dit"):
            logging.getLogger(name).setLevel(logging.WARNING)


def _cache_dit_apply(pipe: Any, config: Any) -> None:
    import cache_dit

    _quiet_cache_dit()
    cache_dit.enable_cache(pipe, cache_config=config[0], calibrator_config=config[1])
    _quiet_cache_dit()


def _cache_dit_remove(pipe: Any) -> None:
    import cache_dit

    _quiet_cache_dit()
    cache_dit.disable_cache(pipe)


def _cache_dit_reported(pipe: Any) -> Optional[int]:
    """Forwards cache-dit's own statistics say were cached in the last call: its cached steps (and, with separate
    CFG, its CFG-branch cached steps), one per forward, over every cache context of the transformer."""
    import cache_dit

    steps: set = set()
    cfg: set = set()
    for st in cache_dit.summary(pipe, logging=False):
        steps |= set(st.cached_steps or ())
        cfg |= set(st.cfg_cached_steps or ())
    return len(steps) + len(cfg)


_DBCACHE = dict(schedule="adaptive", build=_dbcache, needs="blocks", apply=_cache_dit_apply, remove=_cache_dit_remove,
                on_pipeline=True, supports=_cache_dit_supports, reported_reused=_cache_dit_reported)
_DBCACHE_DEFAULTS = {"threshold": 0.08, "warmup_steps": 8, "fn_compute_blocks": 8, "bn_compute_blocks": 0}
register_cache_method(CacheMethod(
    "dbcache", reads=tuple(_DBCACHE_DEFAULTS), defaults=dict(_DBCACHE_DEFAULTS),
    aliases=("db_cache", "cache_dit", "cache_dit_dbcache"), **_DBCACHE))
register_cache_method(CacheMethod(
    "dbcache_taylorseer", reads=(*_DBCACHE_DEFAULTS, "order"), defaults={**_DBCACHE_DEFAULTS, "order": 1},
    aliases=("dbcache+taylorseer", "taylorseer_dbcache", "cache_dit_taylorseer"), **_DBCACHE))


# ------------------------------------------------------------------------------------------------- the pass
from models.passes import Pass  # noqa: E402


class StepCachePass(Pass):
    """``cache.*`` on a diffusion stage (:mod:`models.passes`): the settings checked at config time, the model and
    the rows checked before loading, :class:`StepCache` installed on the denoiser (after the backends: its hooks
    wrap the modules as they will run), each call's counts in its items' records, the evidence, and the hooks
    removed at close. The engine provides ``transformer_class()``, ``pipeline_name()``, ``component_config()``,
    ``declared_experts()``, ``task``, ``expected_forwards(batch)``, ``step_forwards(batch)``,
    ``warmup_call(batch, steps)`` and ``uncounted()``.

    Attributes:
        settings: the validated :class:`CacheSettings` (None: no cache).
        step_cache: the installed :class:`StepCache` once loaded with a cache.
    """

    name = "cache"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.settings: Optional[CacheSettings] = None
        self.step_cache: Optional[StepCache] = None
        self.records: Dict[str, Dict[str, Any]] = {}  # item key -> its record's ``cache`` field
        self.first_batches: Dict[int, Any] = {}  # steps -> the first batch of that step count (calibration)

    def check_config(self) -> None:
        """``cache.*`` against its method (:func:`settings`); a cache under context parallelism, or with a task
        whose pipeline runs part of the schedule (``strength``), is refused.

        Raises:
            CacheConfigError / ConfigValueError: naming the field, the value and the fix.
        """
        from models import conditioning

        e = self.engine
        self.settings = settings(e.ctx.run) if e.ctx.run is not None else None
        s = self.settings
        if s is None:
            return
        if e.ctx.parallel is not None:
            raise ConfigValueError(f"cache.method={s.method.name} with parallelism={e.ctx.parallel.mode}: a step cache "
                                   "under context parallelism is not supported yet (its reuse decisions would differ "
                                   "per rank); fix: cache.method=none, or parallelism=data/single")
        if e.task in conditioning.STRENGTH_TASKS:
            raise ConfigValueError(
                f"cache.method={s.method.name} with model.task={e.task}: a step cache's schedule counts "
                "num_inference_steps, and the pipeline runs only the last strength x steps of it; not supported yet; "
                "fix: cache.method=none")

    def prepare(self) -> None:
        """The method against the denoiser class and its block counts (:func:`check_support`,
        :func:`check_block_counts`); a model with several denoisers is refused.

        Raises:
            CacheUnsupportedError / ConfigValueError: naming the model and the fix.
        """
        s, e = self.settings, self.engine
        if s is None:
            return
        check_support(s, str(e.transformer_class()), e.model_cfg.name, e.pipeline_name())
        conf = e.component_config("transformer")
        if conf is not None:
            check_block_counts(s, transformer_blocks(conf), e.model_cfg.name)
        experts = e.declared_experts()
        if len(experts) > 1:
            raise ConfigValueError(
                f"cache.method={s.method.name} with model={e.model_cfg.name}, whose pipeline switches between "
                f"{len(experts)} denoisers ({', '.join(experts)}): a step cache's reuse spans steps that different "
                "experts compute; not supported yet; fix: cache.method=none")

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """Every row's transformer forwards per step must be what the method's schedule takes
        (:func:`check_rows_forwards`)."""
        if self.settings is None:
            return rows
        from runner.core import dataset as ds

        per_step = []
        for r in rows:
            want = self.engine.expected_forwards([ds.Item(row=r, index=0, seed=0)])
            per_step.append(None if want is None else want / r.num_inference_steps)
        check_rows_forwards(self.settings, per_step, self.engine.model_cfg.name)
        return rows

    def batches_planned(self, batches: Sequence[Sequence[Any]]) -> None:
        """The first batch of each step count, for the calibration pass (``cache.calibrate``, :meth:`prime`)."""
        self.first_batches = {}
        for b in batches:
            self.first_batches.setdefault(b[0].row.num_inference_steps, b)

    def install(self, sections: Dict[str, Any]) -> None:
        """:class:`StepCache` on the denoiser (its probe; the method itself at the first call), and the manifest's
        ``cache`` section."""
        if self.settings is None:
            return
        e = self.engine
        ratios = None
        if self.settings.params.get("calibrate"):
            from models import cache_calibration as cal

            ratios = cal.RatioStore(cal.calibration_root(e.cache_dir), cal.key_fields(
                source=e.source, transformer=e.denoiser, dtype=e.dtype,
                scheduler=getattr(e.pipe, "scheduler", None)))
        self.step_cache = StepCache(e.denoiser, self.settings, [(layer, mod) for _, layer, mod in e.attention_sites()],
                                    compiled=str(e.ctx.run.compile) == "regional", pipeline=e.pipe, ratios=ratios)
        sections["cache"] = {**self.settings.to_dict(), "lossy": True, "blocks": len(self.step_cache.probe.blocks),
                             "attention_modules": len(self.step_cache.probe.attention)}
        if ratios is not None:  # filled by the calibration in prime, before the manifest gets this section
            sections["cache"]["calibration"] = self.step_cache.calibrations

    def hooks_blocks(self) -> bool:
        return self.settings is not None

    def lossy_traits(self) -> Dict[str, Any]:
        """``cache_schedule``: an adaptive cache makes each item depend on its batch peers."""
        return {"cache_schedule": self.settings.schedule} if self.settings is not None else {}

    def after_warmup(self) -> None:
        """The warm-up call's counts are dropped (it ran before any method was installed)."""
        if self.step_cache is not None:
            self.step_cache.warmed_up()

    def prime(self) -> float:
        """``cache.calibrate=true``: the ratios for each step count of the run (:meth:`StepCache.calibrate`),
        measured where none are stored by a warm-up call of all the steps on the first batch of that count, with
        every evidence counter restored after it (the pass is no part of the run). Returns its seconds."""
        sc = self.step_cache
        if sc is None or not sc.settings.params.get("calibrate"):
            return 0.0
        import time

        e = self.engine
        t0 = time.perf_counter()
        for steps, batch in sorted(self.first_batches.items()):
            if sc.needs_calibration(steps):
                with e.uncounted():
                    sc.calibrate(steps, e.step_forwards(batch),
                                 lambda b=batch, n=steps: e.warmup_call(b, steps=n), [it.key for it in batch])
        return time.perf_counter() - t0

    def before_call(self, batch: Sequence[Any]) -> None:
        if self.step_cache is not None:
            self.step_cache.before_call(batch[0].row.num_inference_steps, self.engine.step_forwards(batch))

    def call_failed(self) -> None:
        if self.step_cache is not None:
            self.step_cache.call_failed()

    def after_call(self, batch: Sequence[Any], want: Optional[int]) -> None:
        """What the cache did in this call, observed; shared by the call's items."""
        if self.step_cache is not None:
            counts = self.step_cache.after_call(batch[0].row.num_inference_steps, want)
            for it in batch:
                self.records[it.key] = self.step_cache.record(counts, len(batch))

    def record(self, item: Any) -> Dict[str, Any]:
        """``cache``: method, schedule, params and the forwards and blocks computed and reused in the item's call."""
        rec = self.records.pop(item.key, None)
        return {"cache": rec} if rec is not None else {}

    def evidence_inputs(self) -> Dict[str, Any]:
        """``cache``: the cache's evidence section and mismatches, and what its probe observed, for
        ``models.denoiser_evidence.build``."""
        if self.step_cache is None:
            return {}
        section, mm = self.step_cache.evidence(self.engine.stage)
        probe = self.step_cache.probe
        return {"cache": {"section": section, "mismatches": mm, "attention_runs": dict(probe.attention_runs),
                          "forwards_computed": probe.counts.forwards_computed}}

    def close(self) -> None:
        if self.step_cache is not None:
            self.step_cache.close()
