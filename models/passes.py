"""Engine features as passes: one object owns a feature's checks, its rows and its lifecycle in a run.

The diffusion engine (:class:`models.diffusers_engine.DiffusersEngine`) names no feature: it holds a tuple of pass
classes (``PASSES``), builds one instance of each per engine, and calls every pass in each phase of the run, in
the tuple's order. A feature is one module with its pass class; adding one is a class and an entry in a ``PASSES``
tuple (a family engine may extend its tuple). The shape is diffusers' ``ModelHook`` / ``HookRegistry``
(``diffusers/hooks/hooks.py``: ``initialize_hook`` / ``pre_forward`` / ``post_forward`` / ``reset_state``) one level
up, at the pipeline call, with torchtitan's "each component owns its config" (the pass reads its typed slice of
``engine.ctx.run`` / ``engine.ctx.model`` itself).

Phases, in the loop's order (:mod:`models.base`), each a method with a no-op default:

1. ``check_config()``: the pass's config checks (no I/O, no model configs).
2. ``prepare()``: startup checks that read the model's configs (the weight source is resolved, the backends are
   resolved: ``engine.resolutions``); no weight loads. A family refuses a pass by raising here.
   ``after_resolve()``: checks that need the resolved backends; ``prepare_plan(platform_kind)``: ``--plan``'s.
   ``start()``: collective set-up over every rank (the loop's ``start_parallel``).
3. ``batch_size(requested)``: the batch size the pass allows; ``prepare_rows(rows, path) -> rows``: the validated rows, checked or extended by the pass (its row fields);
   ``batches_planned(batches)``: the batches the engine cut from them.
4. ``before_load()`` before the pipeline loads; ``install(sections)``: on the loaded pipeline, in ``PASSES`` order (the order is the install contract:
   ``models.diffusers_engine.DiffusersEngine.PASSES`` says why); ``sections`` are the manifest sections of the load.
5. ``before_warmup(batch)`` / ``after_warmup()`` around the engine's warm-up call (made when a pass asks for it,
   :meth:`Pass.wants_warmup`); ``prime() -> seconds``: a pass's own runs after the warm-up (a step cache's
   calibration), no part of the run's counts.
6. ``before_call(batch)`` / ``after_call(batch, want)`` around each pipeline call (``want``: the denoiser forwards
   the call should make, None where unknown); ``call_failed()`` when it raised; ``call_args(batch)``: arguments
   the pass adds to the call; ``before_pipe(batch, kwargs)`` / ``after_pipe(batch, kwargs, outputs)`` right
   around the pipeline itself; ``applied_params(row)``: what the pass applied, in the item's ``params``.
7. ``record(item) -> dict``: fields the pass adds to the item's journal record.
8. ``evidence_inputs() -> dict``: keyword arguments of ``models.denoiser_evidence.build`` the pass supplies;
   ``evidence(section) -> mismatches``: the pass's part of the stage's evidence, added to ``section``.
9. ``close()``: always called (also after an error), in reverse order.

Manifest sections a pass owns at the end of the run (``compile``) are :meth:`Pass.final_sections`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple


class Pass:
    """One feature of a diffusion stage (see the module docstring for the phases). ``engine`` is the stage's
    engine: a pass reads the run (``engine.ctx.run``), the model config (``engine.cfg``) and the loaded pipeline
    (``engine.pipe``) from it, and keeps its own state on itself."""

    name: ClassVar[str] = ""
    row_fields: ClassVar[Tuple[Any, ...]] = ()
    """The row fields the pass adds (``runner.core.dataset.Field``): validated, in the item's identity (per the
    field's ``identity``), batching key, ``params`` and resume through the engine's row spec alone."""
    in_plan: ClassVar[bool] = False
    """:meth:`prepare` also runs for ``--plan`` (``runner.tools.plan``: no backends resolved, maybe another
    platform's plan): the pass's checks shape what is planned."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def check_config(self) -> None:
        """Config checks of the pass's own fields (no I/O)."""

    def prepare(self) -> None:
        """Startup checks that read the model's configs; no weight loads."""

    def after_resolve(self) -> None:
        """Startup checks that need the resolved backends (``engine.resolutions``): the memory plan's fitting."""

    def prepare_plan(self, platform_kind: str) -> None:
        """What ``--plan`` needs of the pass for a run on ``platform_kind`` (maybe not this machine's; no backends
        resolved): :meth:`prepare` where :attr:`in_plan`."""
        if self.in_plan:
            self.prepare()

    def start(self) -> None:
        """Collective set-up over every rank of the run (after ``prepare``, before the rows; the loop's
        ``start_parallel``)."""

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        """The run's rows, checked (``DatasetError`` naming file:line) or extended; returned (a new list or the same)."""
        return rows

    def batch_size(self, requested: int) -> int:
        """The batch size the pass lets the engine cut (a pipeline that conditions one call on one input: 1)."""
        return requested

    def batches_planned(self, batches: Sequence[Sequence[Any]]) -> None:
        """The run's batches, as the engine cut them (before loading)."""

    def load_kwargs(self, path: Any) -> Dict[str, Any]:
        """``from_pretrained`` keywords the pass adds when the pipeline loads from the snapshot at ``path``."""
        return {}

    def before_load(self) -> None:
        """Before the pipeline loads (a scope for everything built or compiled in the stage)."""

    def hides_calls(self) -> bool:
        """Under the pass the per-call observers cannot run (compiled code runs no Python hooks)."""
        return False

    def install(self, sections: Dict[str, Any]) -> None:
        """Install on the loaded pipeline; add the pass's manifest sections to ``sections``."""

    def owned_linears(self) -> Tuple[str, ...]:
        """Names (relative to the denoiser) of the Linears the pass owns, which the linear backend leaves alone."""
        return ()

    def expect(self, items: List[Any]) -> List[Any]:
        """The items as the model's oracle should score them (what the pass changes about their expectations)."""
        return items

    def hooks_blocks(self) -> bool:
        """The pass hooks the denoiser's blocks after it is installed (a step cache): a regional compile must then
        compile beneath those hooks, which stay eager."""
        return False

    def wants_warmup(self) -> bool:
        """The pass needs a warm-up call at the first batch's shape before the timed loop."""
        return False

    def before_warmup(self, batch: Sequence[Any]) -> None:
        """Before the warm-up call."""

    def after_warmup(self) -> None:
        """After the warm-up call."""

    def prime(self) -> float:
        """The pass's own runs after the warm-up (no part of the run's counts); returns their seconds."""
        return 0.0

    def before_call(self, batch: Sequence[Any]) -> None:
        """Before one pipeline call over ``batch``."""

    def call_args(self, batch: Sequence[Any]) -> Dict[str, Any]:
        """Pipeline ``__call__`` arguments the pass adds for ``batch`` (its row fields as the pipeline takes them)."""
        return {}

    def applied_params(self, row: Any) -> Dict[str, Any]:
        """Values the pass applies to ``row``'s generation, recorded in the item's ``params`` (``steps_run``: the
        denoising steps the call runs, where fewer than ``num_inference_steps``)."""
        return {}

    def before_pipe(self, batch: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        """Right before the pipeline runs with ``kwargs`` (probes armed)."""

    def after_pipe(self, batch: Sequence[Any], kwargs: Dict[str, Any], outputs: List[Any]) -> List[Any]:
        """Right after the pipeline returned ``outputs`` (one array per item: float32 images, ``uint8`` or float32
        video frames, ``models.pipelines.PipelineEngine.output_arrays``): what the probes saw; the outputs as the
        pass leaves them (an inpaint overlay)."""
        return outputs

    def after_call(self, batch: Sequence[Any], want: Optional[int]) -> None:
        """After one pipeline call over ``batch`` that returned (``want``: its expected denoiser forwards)."""

    def call_failed(self) -> None:
        """A pipeline call raised part-way."""

    def record(self, item: Any) -> Dict[str, Any]:
        """Fields the pass adds to ``item``'s journal record."""
        return {}

    def evidence_inputs(self) -> Dict[str, Any]:
        """Keyword arguments of ``models.denoiser_evidence.build`` that the pass supplies."""
        return {}

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        """Add the pass's evidence to the stage's ``section``; return its mismatches."""
        return []

    def final_sections(self) -> Dict[str, Any]:
        """Manifest sections the pass owns at the end of the run (``{name: section}``)."""
        return {}

    def lossy_traits(self) -> Dict[str, Any]:
        """What the pass's config says about the run's lossy lanes (``models.base.EngineBase.lossy_traits``)."""
        return {}

    def close(self) -> None:
        """Free what the pass holds; always called."""


def row_fields_of(classes: Sequence[Any]) -> Tuple[Any, ...]:
    """The row fields the passes ``classes`` (classes or ``"module:Class"`` paths) add, in pass order; read from the
    classes (a class attribute), so an engine's row spec needs no pass instance."""
    return tuple(f for c in classes for f in (pass_class(c) if isinstance(c, str) else c).row_fields)


def pass_names_with_rows(classes: Sequence[Any]) -> List[str]:
    """The names of the passes ``classes`` that add row fields, in pass order."""
    return [k.name for k in (pass_class(c) if isinstance(c, str) else c for c in classes) if k.row_fields]


def pass_class(path: str) -> type:
    """The pass class at ``"module:Class"`` (imported now: a feature's module may import its library at the top)."""
    import importlib

    mod, _, attr = path.partition(":")
    return getattr(importlib.import_module(mod), attr)


class Passes:
    """The passes of one engine, in install order, with a loop per phase. ``classes``: pass classes or their
    ``"module:Class"`` paths."""

    def __init__(self, engine: Any, classes: Sequence[Any]) -> None:
        classes = [pass_class(c) if isinstance(c, str) else c for c in classes]
        names = [c.name for c in classes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup or "" in names:
            raise ValueError(f"passes need distinct, non-empty names: {names}")
        self.items: Tuple[Pass, ...] = tuple(c(engine) for c in classes)

    def __iter__(self) -> Iterator[Pass]:
        return iter(self.items)

    def __getitem__(self, name: str) -> Pass:
        for p in self.items:
            if p.name == name:
                return p
        raise KeyError(f"no pass {name!r} (passes: {', '.join(p.name for p in self.items)})")

    def get(self, name: str) -> Optional[Pass]:
        """The pass called ``name``, None where the engine has none."""
        return next((p for p in self.items if p.name == name), None)

    def prepare_rows(self, rows: List[Any], path: Any) -> List[Any]:
        for p in self.items:
            rows = p.prepare_rows(rows, path)
        return rows

    def merged(self, phase: str, *args: Any) -> Dict[str, Any]:
        """The dicts every pass's ``phase`` returns, merged in pass order (a later key wins)."""
        out: Dict[str, Any] = {}
        for p in self.items:
            out.update(getattr(p, phase)(*args))
        return out

    def record(self, item: Any) -> Dict[str, Any]:
        return self.merged("record", item)

    def evidence_inputs(self) -> Dict[str, Any]:
        return self.merged("evidence_inputs")

    def evidence(self, section: Dict[str, Any]) -> List[str]:
        return [m for p in self.items for m in p.evidence(section)]

    def final_sections(self) -> Dict[str, Any]:
        return self.merged("final_sections")

    def lossy_traits(self) -> Dict[str, Any]:
        return self.merged("lossy_traits")

    def close(self) -> None:
        """Every pass's ``close``, in reverse order; the first error is raised after all ran."""
        err: Optional[BaseException] = None
        for p in reversed(self.items):
            try:
                p.close()
            except Exception as e:  # noqa: BLE001 - the others still close
                err = err or e
        if err is not None:
            raise err
