"""The stages of a run: the stage graph (:func:`stage_graph`), one engine per stage (:func:`build_engines`), and
the one stage loop every stage of every run goes through (:func:`run_stage`: load -> batch -> generate -> sink ->
checkpoint; a failing batch retried item by item, so one bad row fails alone). An upstream stage's text records
rewrite the next stage's prompts (:func:`link_records`, :func:`feed`)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from omegaconf import DictConfig

from runner.app.signals import Stop
from runner.core.errors import ConfigValueError, UserInputError

if TYPE_CHECKING:
    from models.base import StageResult

log = logging.getLogger("runner")


@dataclass
class StageSpec:
    """One node of the run's stage graph: the stage name, its engine (``model.engine`` value), its model config
    (``model``: its family's dataclass, from the typed run config), and, for a stage fed by another, the feeding
    stage and the prompt ``template`` (``{prompt}``, ``{text}``)."""

    name: str
    engine: str
    input: Optional[str] = None
    template: Optional[str] = None
    model: Any = None


def stage_graph(cfg: DictConfig, run: Any = None) -> List[StageSpec]:
    """The run's stages in execution order; the last one writes ``items.jsonl``. ``run``: ``cfg`` as the
    schema's dataclasses (``runner.core.schema.to_typed``; built here when not given), where each stage's typed
    model config comes from (an upstream stage's through its engine's ``stage_model_cfg``, which checks it).

    A single-stage model is one stage named by its engine (``default_stage``: ``denoise``, ``generate``).
    ``model.pipeline`` lists stages; supported shape: one stage with ``input: prompt`` feeding the model's own
    (last) stage, whose ``template`` builds its prompt from the fed text.

    Raises:
        runner.core.errors.UserInputError: naming the stage, the field and the fix.
    """
    from models.registry import engine_class
    from runner.core.schema import to_typed

    run = run if run is not None else to_typed(cfg)
    final = StageSpec(engine_class(cfg.model.engine).default_stage, cfg.model.engine, model=run.model)
    order = list(cfg.model.get("pipeline") or [])
    if not order:
        return [final]
    stages = cfg.model.stages or {}
    for s in order:
        if s not in stages:
            raise UserInputError(f"model.pipeline lists {s!r}, which model.stages does not define; stages: "
                                 f"{', '.join(stages)}")
    if order[-1] != final.name:
        raise UserInputError(f"model.pipeline={order}: the last stage must be the model's {final.name!r} stage")
    if len(order) != 2:
        raise UserInputError(f"model.pipeline={order}: one stage feeding {final.name!r} is supported")
    if cfg.parallelism.mode in ("data", "ulysses", "ring"):  # before the stages' and the launcher's checks
        raise ConfigValueError(f"parallelism={cfg.parallelism.mode} with the multi-stage model={cfg.model.name} "
                               f"(pipeline {order}): its first stage runs on one engine, so multi-device runs are not "
                               "supported yet; fix: parallelism=single")
    s = order[0]
    if (stages[s].input or "prompt") != "prompt":
        raise UserInputError(f"model.stages.{s}.input={stages[s].input!r}: the first stage reads the dataset's "
                             "prompt; fix: input: prompt")
    if stages[final.name].input != s:
        raise UserInputError(f"model.stages.{final.name}.input={stages[final.name].input!r}: it must name the "
                             f"stage that feeds it; fix: model.stages.{final.name}.input={s}")
    template = stages[final.name].template or "{prompt}, {text}"
    try:
        template.format(prompt="", text="")
    except (KeyError, IndexError, ValueError) as e:
        raise UserInputError(f"model.stages.{final.name}.template={template!r} is not a format string over "
                             f"{{prompt}} and {{text}} ({e})") from None
    if "{text}" not in template:  # the stage's output would be computed and never used
        raise UserInputError(f"model.stages.{final.name}.template={template!r} does not use {{text}}, the output of "
                             f"stage {s!r}, so every item would be rendered without it; fix: e.g. "
                             f"model.stages.{final.name}.template='{{prompt}}, {{text}}'")
    up_cls = engine_class(stages[s].engine, where=f"model.stages.{s}.engine")
    up_model = up_cls.stage_model_cfg(run, s)
    final.input, final.template = s, template
    return [StageSpec(s, stages[s].engine, input="prompt", model=up_model), final]


def build_engines(cfg: DictConfig, overrides: Sequence[str], plat: Any = None, dtype: Any = None,
                  specs: Optional[List[StageSpec]] = None, run: Any = None) -> List[Any]:
    """One engine per stage of :func:`stage_graph` (constructors load and check nothing); ``plat``/``dtype`` may be
    filled in later (``engine.ctx.plat``), before ``prepare``. ``run``: ``cfg`` typed (the one ``specs`` were built
    from; built here when not given)."""
    from models.base import StageContext
    from models.registry import engine_class
    from runner.core.schema import to_typed

    run = run if run is not None else to_typed(cfg)  # once: every stage's engine reads the same typed config
    return [engine_class(s.engine)(StageContext(cfg=cfg, overrides=list(overrides), stage=s.name,
                                                 plat=plat, dtype=dtype, run=run,
                                                 model=s.model))
            for s in (specs if specs is not None else stage_graph(cfg, run))]


def link_records(stage: str, records: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """``{row id: link}`` of an upstream stage's text records: the stage, its journal file, the record id, the
    sha256 of its output token ids, its text and the prompt it was given."""
    links: Dict[str, Dict[str, Any]] = {}
    for r in records:
        if r.get("index", 0) != 0:
            continue
        links[r["id"]] = {"stage": stage, "file": f"{stage}.jsonl", "id": r["id"],
                          "output_sha256": hashlib.sha256(json.dumps(r["output_token_ids"]).encode()).hexdigest(),
                          "text": r["text"], "upstream_prompt": r["prompt"]}
    return links


def feed(items: List[Any], links: Dict[str, Dict[str, Any]], template: str) -> List[Any]:
    """The downstream items with their prompts rebuilt from the upstream text (``template``); items whose row
    has no upstream output keep their prompt. Records the downstream prompt in each link."""
    from dataclasses import replace

    rows = {}
    for it in items:
        rows.setdefault(it.row.id, it.row)
    new_rows = {rid: replace(row, prompt=template.format(prompt=row.prompt, text=links[rid]["text"]).strip())
                for rid, row in rows.items() if rid in links}
    out = [replace(it, row=new_rows.get(it.row.id, it.row)) for it in items]
    for it in out:
        if it.row.id in links:
            links[it.row.id]["downstream_prompt"] = it.row.prompt
    return out


# ------------------------------------------------------------------------------------------------ stage loop
@dataclass
class Timing:
    """Seconds a run spent per part (summed over stages): loading, warm-up, inside ``generate``, the batch loop."""

    load_s: float = 0.0
    warmup_s: float = 0.0
    generate_s: float = 0.0
    loop_s: float = 0.0


def generate_isolated(engine: Any, batch: List[Any]) -> Tuple[List[Any], List[List[Any]]]:
    """Generate a batch; when the engine raises, retry its items one by one so that one bad row fails alone.

    Returns:
        ``(outputs, ran)``: one output or exception per item, and the sub-batches whose generation completed.
    """
    try:
        return engine.generate(batch), [batch]
    except Exception as e:  # noqa: BLE001 - recorded per item, never swallowed silently
        if len(batch) == 1:
            return [e], []
        log.warning("batch of %d failed (%s: %s); retrying its items one by one", len(batch), type(e).__name__, e)
        outs: List[Any] = []
        ran: List[List[Any]] = []
        for it in batch:
            o, r = generate_isolated(engine, [it])
            outs.extend(o)
            ran.extend(r)
        return outs, ran


def stop_check(stop: Stop, worker: Optional[Any]) -> Callable[[], bool]:
    """Whether to stop before the next batch: a signal was received (under context parallelism, by any rank of the
    worker's context group, so that all of them stop after the same batch: ``runner.core.distributed.context_group_any``)."""
    from runner.core.distributed import context_group_any

    return lambda: context_group_any(stop.signum is not None, worker)


def run_stage(engine: Any, items: List[Any], sink: Any, cfg: DictConfig, stop: Stop, timing: Timing,
              run_id: Optional[str] = None, on_loaded: Optional[Callable[[Any], None]] = None,
              links: Optional[Dict[str, Any]] = None,
              after_load: Optional[Callable[[Dict[str, Any]], None]] = None,
              checkpoint: Optional[Callable[[], None]] = None,
              identity: Optional[Callable[[Any], str]] = None,
              should_stop: Optional[Callable[[], bool]] = None,
              pull: Optional[Callable[[List[List[Any]]], Iterable[List[Any]]]] = None,
              after_batch: Optional[Callable[[List[Any], float], None]] = None) -> "StageResult":
    """Load ``engine`` and generate ``items`` into ``sink``: batch -> generate -> submit -> checkpoint, until done
    or a stop signal. The same body runs every stage of every run.

    Args:
        run_id: the run's ``run_id`` (its manifest's), recorded in each record: which attempt wrote it (a resume
            keeps the records it reuses as they are, so they name the earlier attempt).
        links: ``{row id: link}`` to the upstream record each item was rendered from (added as ``from``).
        after_load: called with the manifest sections ``engine.load`` returned.
        checkpoint: called after every batch (rewrites the manifest).
        identity: ``item -> inputs_sha256``, recorded in each record with the batch (size, position) it ran in
            (resumable stages: a resume compares both, ``runner.core.resume.reusable``).
        should_stop: asked before each batch (default: a stop signal was received).
        pull: given the batches, yields those this process generates, as it gets them (``parallelism.assign=claims``:
            ``runner.app.run.Run.pull``); default every batch, in order.
        after_batch: called with each batch and the seconds its generation took, once it is submitted.

    Returns:
        What was observed, for the engine's evidence.
    """
    from models.base import StageResult

    result = StageResult()
    if not items or stop.signum is not None:
        return result
    t0 = time.perf_counter()
    sections = engine.load(on_loaded)
    timing.load_s += time.perf_counter() - t0
    stop.rearm()  # in case the engine start installed handlers of its own
    batches = engine.batches(items, cfg.batch_size)
    timing.warmup_s += engine.warmup(batches[0])
    if after_load is not None:
        after_load(sections)
    t_loop = time.perf_counter()
    for batch in (pull(batches) if pull is not None else batches):
        if (should_stop() if should_stop is not None else stop.signum is not None):
            break
        t0 = time.perf_counter()
        outputs, ran = generate_isolated(engine, batch)
        dt = time.perf_counter() - t0
        timing.generate_s += dt
        result.generated = True
        ran_in = {id(i): (len(b), p) for b in ran for p, i in enumerate(b)}
        for pos, (it, out) in enumerate(zip(batch, outputs)):
            size, at = ran_in.get(id(it), (len(batch), pos))
            rec = engine.record(it, out, size, dt / len(batch))
            if run_id is not None:
                rec["run_id"] = run_id
            if identity is not None:
                rec["inputs_sha256"], rec["batch"] = identity(it), {"size": size, "position": at}
            if links and it.row.id in links:
                rec["from"] = links[it.row.id]
            if isinstance(out, BaseException):
                log.error("item %r failed: %s: %s", it.key, type(out).__name__, out)
            sink.submit(rec, out)
        if after_batch is not None:
            after_batch(batch, dt)
        if checkpoint is not None:
            checkpoint()
    sink.drain()
    timing.loop_s += time.perf_counter() - t_loop
    result.records = list(sink.ok_records)
    result.nonfinite = sink.nonfinite
    return result
