"""One run as an object (:class:`Run`), for every engine and for multi-stage pipelines.

Order matters and is the product's promise: everything that can be checked without weights (config values,
dataset rows, platform, backend selection) is checked for every stage before any stage loads. ``Run()`` reads as
its steps:

1. :meth:`Run.build_stages`: check the run config; the stage graph's engines from the registry (constructors load
   nothing);
2. :meth:`Run.prepare_stages`: every stage's config checks, platform, weight sources and backends resolved (fail
   closed);
3. :meth:`Run.plan_items`: the dataset rows (read once) and items; the resume plan (``runner.core.resume.plan``);
4. :meth:`Run.open_manifest`: the manifest header (``runner.core.provenance``);
5. :meth:`Run.run_stages`: per stage, in graph order, load -> batch -> generate -> sink (durable file, then journal
   line) -> checkpoint (``runner.app.stages.run_stage``); an upstream stage's outputs rewrite the next one's prompts;
6. :meth:`Run.verdict`: evidence of every stage that ran, the model's oracle;
7. :meth:`Run.finalize`: outputs closed and compacted, timing, the final status — on every way the run ends (the
   loop's end, an exception, a first signal; a second signal records it in :meth:`Run.force_exit`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from runner.app import checks
from runner.app.signals import Stop
from runner.app.stages import StageSpec, Timing, build_engines, feed, link_records, run_stage, stage_graph, stop_check
from runner.core import dataset as ds
from runner.core import lossy, provenance, resume, rundir, storage
from runner.core.errors import EvidenceError, StorageError
from runner.core.manifest import Manifest, now_iso, package_versions
from runner.core.platform import detect
from runner.core.sinks import (SINKS, UNLISTED, compact_journal, keep_unlisted, read_journal, recorded_files,
                               write_folder_metadata)

log = logging.getLogger("runner")


def peak_memory(kind: str) -> Dict[str, Any]:
    """Peak memory: device bytes allocated by torch (CUDA) since this run started (:func:`reset_peak_memory`) and the
    process's host peak RSS bytes."""
    import resource

    out: Dict[str, Any] = {"host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if kind in ("cuda", "rocm") and torch.cuda.is_available():
        from models.memory import PhasePeaks  # per-phase peaks reset the allocator's statistic: keep the maximum

        out["device_peak_allocated_bytes"] = max(torch.cuda.max_memory_allocated(), PhasePeaks.overall)
        out["device_peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def reset_peak_memory(kind: str) -> None:
    """Start this run's device peak at the run's start: the allocator's peak statistic and
    ``models.memory.PhasePeaks.overall`` are per process, so a second run in one process (a sweep's lanes, an
    in-process benchmark, a test) recorded the first one's peak as its own (issue #37: every memory lane of one
    ``benchmarks/memory_lanes.py`` process showed the lossless lane's 59.55 GB). The host peak RSS cannot be reset
    (``getrusage``): it stays the process's."""
    if kind in ("cuda", "rocm") and torch.cuda.is_available():
        from models.memory import PhasePeaks

        PhasePeaks.overall = 0
        torch.cuda.reset_peak_memory_stats()


class Run:
    """One run into a run dir this process's run holds (``token``); ``Run(...)()`` returns the exit code.

    The state below is everything the steps share; each step sets what it computes (None/empty before).
    """

    # given
    cfg: DictConfig
    out_dir: Path
    overrides: Sequence[str]
    on_loaded: Optional[Callable[[Any], None]]  # called with the last stage's engine once loaded (tests tamper)
    worker: Optional[Any]  # runner.core.distributed.Worker of a data-parallel / context-parallel rank
    on_exit: Optional[Callable[[int], None]]  # called with the exit code when a second signal ends the process
    token: Optional[str]  # the run dir's lock token this run holds
    dataset: Optional[Any]  # runner.app.execute.DatasetItems the run fills with every item (the merge reads them)
    # 1-2: stages
    t_start: float
    specs: List[StageSpec]
    engines: List[Any]
    plat: Any
    dtype: torch.dtype
    sources: Dict[str, Any]  # stage -> the weights source its prepare() resolved
    # 3-4: items, plan, manifest header
    rows: List[Any]
    data_path: Any
    items: List[Any]  # this process's items (a worker's shard), in dataset order
    plan: resume.ResumePlan
    journal_name: str
    manifest_name: str
    writes: bool  # False: a context group's other ranks compute, its first rank writes
    resolved_cfg: Dict[str, Any]
    backends_doc: Dict[str, Any]
    model_doc: Dict[str, Any]
    sink_cls: Any
    manifest: Manifest
    # 5-7: the loop and its outcome
    stop: Stop
    counts: Dict[str, int]
    timing: Timing
    status: str
    results: Dict[str, Any]  # stage -> models.base.StageResult
    links: Dict[str, Any]  # row id -> the upstream record its prompt was rendered from
    sink: Any
    bar: Any
    metric_set: Optional[Any]  # runner.core.metrics.MetricSet of the checked metrics config (None: no metric)
    raising: bool  # the loop ended with an exception (it goes on after finalize)

    def __init__(self, cfg: DictConfig, out_dir: Path, overrides: Sequence[str] = (),
                 on_loaded: Optional[Callable[[Any], None]] = None, worker: Optional[Any] = None,
                 on_exit: Optional[Callable[[int], None]] = None, token: Optional[str] = None,
                 dataset: Optional[Any] = None) -> None:
        self.cfg, self.out_dir, self.overrides, self.on_loaded = cfg, Path(out_dir), overrides, on_loaded
        self.worker, self.on_exit, self.token, self.dataset = worker, on_exit, token, dataset
        self.counts, self.timing, self.status = {"ok": 0, "failed": 0, "reused": 0}, Timing(), "running"
        self.results, self.links, self.sink, self.bar, self.raising = {}, {}, None, None, False
        self.metric_set = None
        self.plan: Optional[resume.ResumePlan] = None  # plan_items
        self.claims = worker.claims if worker is not None and worker.assign == "claims" else None
        self.batch_of: Dict[str, str] = {}  # claims: item key -> its batch id
        self.in_flight: Dict[str, set] = {}  # claims: batch id -> keys not journaled yet
        self.renewer: Optional[Any] = None
        self.mirror = storage.mirror_of(self.out_dir)  # output.dir=<URL>: the run's remote copy (runner.core.storage)
        self.live: Optional[Any] = None  # runner.app.pool.LiveMerger of a data-parallel worker
        self.loop_t0: Optional[float] = None  # epoch seconds of the first batch (the worker's rate)

    @property
    def final(self) -> Any:
        """The last stage's engine: it writes ``items.jsonl`` and the artifacts."""
        return self.engines[-1]

    def __call__(self) -> int:
        """The run's steps (module docstring). Raises what a step raises (``RunnerError`` subclasses before any
        weight loads; ``EvidenceError`` after everything was written, under strict evidence)."""
        self.t_start = time.perf_counter()
        self.build_stages()
        self.prepare_stages()
        self.plan_items()
        self.open_manifest()
        # From the manifest's first write to its last, every way this run ends records its final status.
        self.stop = Stop(on_force=self.force_exit)
        self.stop.__enter__()
        if self.claims is not None:
            self.claims.attach_stop(self.stop)  # a halt from another thread stops the run as a signal does
        try:
            self.run_stages()
            self.verdict()
        except BaseException as e:
            self.raising = True
            self.status = ("interrupted" if isinstance(e, KeyboardInterrupt) else
                           "storage_error" if isinstance(e, StorageError) else "failed")
            self.manifest.section("error", f"{type(e).__name__}: {e}")
            raise
        finally:
            self.finalize()
        return self.exit_code()

    # ------------------------------------------------------------------------------------- 1-2: stages
    def build_stages(self) -> None:
        """1. The run config checked against the schema; the stage graph; one engine per stage; the dirs checked."""
        checks.check_schema(self.cfg)
        from runner.core.schema import to_typed

        run = to_typed(self.cfg)  # once, after the schema check: the stages' typed model configs and ctx.run
        self.specs = stage_graph(self.cfg, run)
        from runner.core.environment import check_outside

        embedded = any(bool(getattr(s.model, "embedded", False)) for s in self.specs)
        check_outside(self.cfg, self.out_dir, embedded=embedded)
        self.engines = build_engines(self.cfg, self.overrides, specs=self.specs, run=run)

    def prepare_stages(self) -> None:
        """2. Every stage prepared before any stage loads: config checks, tracker, platform, dtype, backends."""
        cfg = self.cfg
        for e in self.engines:
            e.check_config()
        checks.check_run_values(cfg)
        from runner.app.tracking import check as check_tracker

        check_tracker(cfg)  # tracker=mlflow without mlflow: exit 2 now, not after the run
        from runner.core.metrics import check as check_metrics

        self.metric_set = check_metrics(cfg.get("metrics"), self.final.output, data_parallel=self.worker is not None,
                                        floors=cfg.report.get("min_metric_ratio"))
        checks.check_fresh_dir(self.out_dir, self.final.resumable, self.specs[-1].engine)
        checks.apply_cpu_threads(cfg)
        self.plat = detect(cfg.platform.name, cfg.platform.device, tuple(cfg.platform.probes))
        self.dtype = checks.resolve_dtype(cfg.dtype, self.plat.kind)
        reset_peak_memory(self.plat.kind)
        for e in self.engines:
            e.ctx.plat, e.ctx.dtype = self.plat, self.dtype
            e.ctx.parallel = self.worker.layout if self.worker is not None else None
        checks.check_cache_applies(cfg, self.engines)
        self.sources = {e.stage: e.prepare() for e in reversed(self.engines)}

    # ---------------------------------------------------------------------------------- 3: items, plan
    def plan_items(self) -> None:
        """3. Rows read once and checked by every stage; items (a worker's shard of the batches)."""
        cfg, final, worker = self.cfg, self.final, self.worker
        self.rows, self.data_path = final.read_rows()
        for e in self.engines[:-1]:
            e.check_inputs(self.rows, self.data_path)
        items = final.items(self.rows, cfg.seed)
        if self.dataset is not None:
            self.dataset.fill(items)
        self.journal_name, self.manifest_name = "items.jsonl", "manifest.json"
        if self.claims is not None:  # every worker may generate any batch: it pulls them (runner.core.claims)
            self.journal_name, self.manifest_name = worker.journal, worker.manifest
        elif worker is not None and worker.world_size > 1:
            from runner.core.distributed import shard

            # data-parallel groups (every worker, or every context group) share the batches out
            items = shard(final.batches(items, cfg.batch_size), worker.shards, worker.shard_index)
            self.journal_name, self.manifest_name = worker.journal, worker.manifest
        self.items = items
        self.writes = worker is None or worker.writes
        self.plan_resume()

    def plan_resume(self) -> None:
        """3b. The run identity and the resume plan (``runner.core.resume.plan``: refusals before anything loads);
        then what context-parallel ranks share is set up (every startup check passed on this rank)."""
        cfg, final, worker = self.cfg, self.final, self.worker
        self.data_sha = ds.dataset_sha256(self.data_path)
        self.resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
        self.packages = package_versions()
        self.backends_doc = {e.stage: e.backends_section() for e in self.engines}
        self.sink_cls = SINKS[final.output]
        if self.mirror is not None:  # the run at the URL, staged here before the resume plan reads the dir
            self.pulled = self.mirror.pull(recorded_files)
        self.identity = resume.run_identity(
            self.resolved_cfg, str(self.dtype).replace("torch.", ""), self.plat.to_dict(), self.backends_doc,
            self.packages, self.sources[final.stage], output=self.sink_cls.identity(cfg),
            context=worker.layout if worker is not None else None)
        self.plan = resume.plan(
            self.out_dir, items=self.items, identity=self.identity, resumable=final.resumable,
            batches=final.batches(self.items, cfg.batch_size) if final.resumable else [],
            manifest_names=(self.manifest_name, "manifest.json"), resume_dir=cfg.run.resume,
            force=bool(cfg.run.force), config=self.resolved_cfg, dataset_sha=self.data_sha,
            config_keys=self.sink_cls.config_keys)
        if self.plan.prev is not None and worker is None:  # a data-parallel run's owner cleans (claim_run_dir, ray)
            resume.remove_temp_files(self.out_dir)
        self.counts["reused"] = len(self.items) - len(self.plan.todo)
        if self.claims is not None:
            self.open_claims()
        if worker is not None:
            from runner.core.distributed import init_context_groups

            init_context_groups(worker)
        for e in self.engines:
            e.start_parallel()

    def open_claims(self) -> None:
        """3c. ``parallelism.assign=claims``: name the run's batches (``b<i>``, in the order a one-worker run forms
        them), and join the workers' claims run (``runner.core.claims.Claims.open_fleet``: the same identity,
        batches and lease, or refused). A worker's share is what it generates: ``reused`` stays the merge's."""
        from runner.core.claims import batch_id, batches_sha256

        batches = self.final.batches(self.items, self.cfg.batch_size)
        self.batch_of = {it.key: batch_id(i) for i, b in enumerate(batches) for it in b}
        self.claims.open_fleet({"run_sha": self.plan.run_sha, "batches": len(batches),
                                "batches_sha256": batches_sha256(batches), "lease_s": self.claims.lease_s})
        self.claims.reusable_at_start = len(self.items) - len(self.plan.todo)
        self.counts["reused"] = 0

    def pull(self, batches: List[List[Any]]) -> Any:
        """``parallelism.assign=claims``: the batches of ``batches`` this worker claims, as it claims them
        (``runner.core.claims.Claims.pull``); each batch is completed once its records are journaled
        (:meth:`on_record`)."""
        ids = [self.batch_of[b[0].key] for b in batches]

        def flush() -> None:  # before waiting on others: this worker's own batches journaled and completed
            self.sink.drain()

        for b in self.claims.pull(batches, ids, stop=lambda: self.stop.signum is not None, flush=flush):
            self.in_flight[self.batch_of[b[0].key]] = {it.key for it in b}
            yield b

    def after_batch(self, batch: List[Any], seconds: float) -> None:
        """At every batch boundary: the test-only straggler hook (``runner.core.testing``; a no-op in real runs)."""
        from runner.core.testing import slow_worker_delay

        slow_worker_delay(self.worker.rank if self.worker is not None else None, seconds)

    # ----------------------------------------------------------------------------------- 4: the header
    def open_manifest(self) -> None:
        """4. The manifest's header: who holds the dir, the worker, what was resumed, then the provenance
        sections (``runner.core.provenance.header_sections``) and ``environment_ignored`` (library variables set
        that never act under the runner: ``runner.core.environment.IGNORED``)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.manifest = m = Manifest(self.out_dir / self.manifest_name)
        lock = rundir.held(self.out_dir)
        m.section("owner", lock.holder if lock is not None else rundir.holder_record(self.token or ""))
        if lock is not None:  # holder, start, command; a stale lock of a dead run taken over (lock.took_over)
            m.section("lock", lock.record())
            if lock.took_over is not None:
                log.warning("run dir %s: took over the stale lock of %s (that process is gone)", self.out_dir,
                            rundir.describe(lock.took_over))
        if self.mirror is not None:  # the run's URL, and what its start found there
            m.section("storage", {**self.mirror.section(), "pulled": self.pulled})
        if self.worker is not None:
            from runner.core.distributed import worker_record

            # a claims worker's share is known when it ends (final_sections); None until then, also if it dies
            m.section("worker", worker_record(self.worker, len(self.items) if self.claims is None else None))
        prev = self.plan.prev
        if prev is not None and prev.get("merge") and (prev.get("owner") or {}).get("token") == self.token:
            prev = None  # the live manifest of this very run (a worker joining late): nothing was resumed
        if prev is not None:
            renamed = resume.lora_renames(prev, self.sources[self.final.stage])
            if renamed:
                log.info("LoRA adapter(s) renamed since the earlier run, same content (sha256): %s; recorded in "
                         "resumed_from.lora_renamed, their items kept", "; ".join(
                             f"{r['from']['name']} ({r['from']['path']}) -> {r['to']['name']} ({r['to']['path']})"
                             for r in renamed))
            # every earlier attempt's provenance (git, packages, evidence...), oldest first: the reused items carry
            # the run_id of the attempt that wrote them (items_by_attempt, final_sections)
            attempts = provenance.attempts_chain(prev, resume.merged_manifest(self.out_dir, self.manifest_name))
            m.section("resumed_from", {"run_id": prev.get("run_id"), "status": prev.get("status"),
                                       "reused_items": self.counts["reused"], "forced": bool(self.cfg.run.force),
                                       **({"lora_renamed": renamed} if renamed else {}), "attempts": attempts})
        for name, value in provenance.header_sections(
                resolved_cfg=self.resolved_cfg, overrides=self.overrides, packages=self.packages,
                identity=self.identity, run_sha=self.plan.run_sha, platform=self.plat.to_dict(),
                dtype=str(self.dtype).replace("torch.", ""), dataset=self.dataset_doc(), model=self.model_section(),
                backends=self.backends_doc, lossy=self.lossy_section(), pipeline=self.pipeline_section(),
                environment=provenance.library_environment(self.sources.values())):
            m.section(name, value)
        from runner.core.environment import ignored_environment

        ignored = ignored_environment()  # a library variable set that did not act (DIFFUSERS_ATTN_BACKEND)
        if ignored:
            m.section("environment_ignored", ignored)

    def dataset_doc(self) -> Dict[str, Any]:
        """The manifest's ``dataset``: format, path, sha256, rows (and items, for artifact outputs)."""
        doc = {"format": self.cfg.dataset.format, "path": str(Path(self.data_path).resolve()),
               "sha256": self.data_sha, "rows": len(self.rows)}
        if storage.is_url(self.cfg.dataset.path):  # read from object storage: the URL, and the copy that was hashed
            doc.update(path=str(self.cfg.dataset.path), local_copy=str(Path(self.data_path).resolve()))
        if self.final.output != "text":
            doc["items"] = len(self.items)
        return doc

    def model_section(self) -> Dict[str, Any]:
        """The manifest's ``model`` before loading (name, engine, the final stage's weights source)."""
        self.model_doc = {"name": self.cfg.model.name, "engine": self.cfg.model.engine,
                          "source": self.sources[self.final.stage]}
        return self.model_doc

    def lossy_section(self) -> Dict[str, Any]:
        """The manifest's ``lossy``: the lanes that change results by design (``runner.core.lossy.section``)."""
        traits = self.final.lossy_traits()  # e.g. a step cache's schedule (diffusion engines' passes)
        return lossy.section(self.backends_doc, self.resolved_cfg, traits.get("cache_schedule"))

    def pipeline_section(self) -> Optional[Dict[str, Any]]:
        """The manifest's ``pipeline`` of a multi-stage model (stages and what feeds what), else None."""
        if len(self.specs) < 2:
            return None
        first, last = self.specs[0], self.specs[-1]
        return {"stages": [s.name for s in self.specs], "feeds": {
            first.name: {"input": "dataset prompt", "output": f"{first.name}.jsonl"},
            self.final.stage: {"input": last.input, "template": last.template}}}

    # ----------------------------------------------------------------------------------- 5: the stages
    def run_stages(self) -> None:
        """5. Every stage in graph order: the upstream stages (their text rewrites the prompts), then the final
        stage into its sink, the manifest checkpointed after every batch."""
        self.manifest.flush()
        if self.worker is None or self.worker.rank == 0:
            provenance.write_repro(self.out_dir, self.overrides, self.manifest.doc["packages"],
                                   self.manifest.doc["environment"], self.manifest.doc["dataset"])
        from runner.app.console import Progress, loading_bars_off

        loading_bars_off()  # before the first stage loads (runner.app.jobs.run_job deferred it past the checks)
        todo = self.plan.todo
        self.bar = Progress(len(self.items), len(self.items) - len(todo), self.final.unit, self.cfg.model.name,
                            self.worker)
        self.sink = self.open_sink()
        todo = self.run_upstream(todo)
        originals = {it.key: it for it in self.items}  # before an upstream stage rewrote the prompts
        run_sha = self.plan.run_sha
        if self.claims is not None:
            from runner.core.claims import Renewer

            self.renewer = Renewer(self.claims).__enter__()
        self.results[self.final.stage] = run_stage(
            self.final, todo, self.sink, self.cfg, self.stop, self.timing, run_id=self.manifest.doc["run_id"],
            on_loaded=self.on_loaded,
            links=self.links, after_load=self.after_load, checkpoint=self.checkpoint,
            identity=(lambda it: resume.inputs_sha256(run_sha, originals[it.key])) if self.final.resumable else None,
            should_stop=stop_check(self.stop, self.worker), pull=self.pull if self.claims is not None else None,
            after_batch=self.after_batch if self.worker is not None else None)
        if self.claims is not None:  # every batch done (by some worker), unless a signal stopped the pull
            self.claims.finished = self.stop.signum is None

    def open_sink(self) -> Any:
        """The final stage's sink (``runner.core.sinks.SINKS`` by output kind; a rank that only computes gets a
        ``ComputeOnlySink``), counting every record it writes."""
        workers = int(self.cfg.output.write_workers)
        threads = (dict(workers=workers, max_pending=4 * max(1, workers) + self.cfg.batch_size)
                   if self.sink_cls.threaded else {})
        if self.writes:
            return self.sink_cls(self.out_dir, self.journal_name, on_record=self.on_record, **threads,
                                 **self.sink_cls.options(self.cfg))
        from runner.core.sinks import ComputeOnlySink

        return ComputeOnlySink(self.out_dir, on_record=self.on_record)

    def run_upstream(self, todo: List[Any]) -> List[Any]:
        """The stages before the final one, each over the first item of every row still to do; returns ``todo``
        with its prompts rebuilt from the upstream text (``runner.app.stages.feed``)."""
        for e, spec in zip(self.engines[:-1], self.specs):
            if not todo or self.stop.signum is not None:
                break
            firsts = list({it.row.id: it.row for it in todo}.values())
            up_sink = SINKS[e.output](self.out_dir, f"{e.stage}.jsonl")
            try:
                self.results[e.stage] = run_stage(e, e.items_from(firsts), up_sink, self.cfg, self.stop, Timing(),
                                                  run_id=self.manifest.doc["run_id"])
            finally:
                up_sink.close()
                e.close()
                compact_journal(self.out_dir / f"{e.stage}.jsonl")
            self.links = link_records(e.stage, self.results[e.stage].records)
            todo = feed(todo, self.links, self.specs[-1].template)
            self.backends_doc[e.stage] = e.backends_section()
            self.manifest.section("backends", self.backends_doc)
            self.manifest.section("pipeline", {**self.manifest.doc["pipeline"], "links": len(self.links),
                                               e.stage: {"load_s": round(e.load_s, 3), "source": e.source}})
            self.manifest.flush()
        return todo

    def on_record(self, rec: Dict[str, Any]) -> None:
        """A record the sink wrote (ok or failed): counted, and the bar moves; under claims, the batch whose last
        record this is gets completed (``runner.core.claims.Claims.complete``: journaled, so done)."""
        self.counts["ok" if rec["status"] == "ok" else "failed"] += 1
        self.bar.update(1)
        bid = self.batch_of.get(rec.get("key", ""))
        if bid is not None and bid in self.in_flight:
            self.in_flight[bid].discard(rec["key"])
            if not self.in_flight[bid]:
                del self.in_flight[bid]
                self.claims.complete(bid)

    def checkpoint(self) -> None:
        """After every batch: the counts, in the manifest on disk (and at the run's URL, every
        ``runner.core.storage.PUSH_EVERY_S`` seconds); a data-parallel worker's ``progress`` (items done since its
        first batch: its rate in the pool) and ``claims`` share so far, then a live merge step (:meth:`pool_step`)."""
        self.manifest.section("counts", self.counts)
        if self.worker is not None:
            self.progress()
            if self.claims is not None:
                self.manifest.section("claims", self.claims.section())
        self.manifest.flush()
        if self.mirror is not None:
            self.mirror.push()
        self.pool_step()

    def progress(self) -> None:
        """A data-parallel worker's ``progress``: items it ended (ok or failed) since its first batch (epoch
        seconds ``since``) as of ``at`` (its rate in the pool: ``runner.core.distributed.pool_section``)."""
        self.manifest.section("progress", {"done": self.counts["ok"] + self.counts["failed"], "since": self.loop_t0,
                                           "at": time.time()})

    def pool_step(self) -> None:
        """A live merge step of a data-parallel worker (``runner.app.pool.LiveMerger``: the run's manifest.json
        current, the pool's totals on the bar)."""
        if self.live is None and self.worker is not None and self.worker.layout is None and self.writes \
                and self.worker.launcher in ("torchrun", "local") and self.token and self.dataset is not None \
                and self.dataset.filled:
            from runner.app.pool import LiveMerger

            self.live = LiveMerger(self.out_dir, self.dataset.keys(), self.token, self.worker, self.dataset.current())
        merged = self.live.step() if self.live is not None else None
        if merged is not None and self.bar is not None:
            self.bar.pool(merged["pool"])

    def after_load(self, sections: Dict[str, Any]) -> None:
        """The final stage loaded: its load sections (``model`` merged) and resolved backends into the manifest."""
        self.bar.warmed_up()  # loading and the compile warm-up are not in the bar's rate and ETA
        self.loop_t0 = time.time()
        self.manifest.section("model", {**self.model_doc, "source": self.final.source, **sections.pop("model", {})})
        for k, v in sections.items():
            self.manifest.section(k, v)
        self.manifest.section("backends", {**self.backends_doc, self.final.stage: self.final.backends_section()})
        self.manifest.flush()

    # --------------------------------------------------------------------------------------- 6: verdict
    def verdict(self) -> None:
        """6. The status of the loop, the evidence of every stage that ran, the oracle's accuracy, the prompts."""
        m, final = self.manifest, self.final
        if self.stop.signum is not None:
            self.status = "interrupted"  # the signal is recorded: a merged run's exit code is 128 + it
            m.section("interrupt", {"signal": signal.Signals(self.stop.signum).name, "forced": False})
        else:
            self.status = "completed" if self.counts["failed"] == 0 else "completed_with_failures"
        ev = evidence_doc(self.cfg, self.plat, self.engines, self.results)
        m.section("evidence", ev)
        self.sink.drain()
        journal = {r["key"]: r for r in read_journal(self.out_dir / self.journal_name) if "key" in r}
        # the items reused from another journal of the dir (an earlier run's items.unlisted.jsonl, a merged run's
        # items.jsonl read by a worker) have their record there until close_outputs compacts it in
        records = {**self.plan.reuse, **journal} if self.plan is not None and self.claims is None else journal
        # a worker scores what it ran; an interrupted run the items it got to (the rest were never attempted, not
        # missed); a finished run every item, a failed or missing one counting as a miss
        partial = self.claims is not None or self.status == "interrupted"
        mine = [it for it in self.items if it.key in records] if partial else self.items
        acc = final.accuracy(mine, records, self.out_dir) if self.writes else None
        if acc is not None:
            m.section("accuracy", acc)
        prompts = final.prompts_section(list(journal.values()))
        if prompts is not None:
            m.section("prompts", prompts)
        if ev["verdict"] == "mismatch" and self.status != "interrupted":
            self.status = "evidence_mismatch" if self.cfg.evidence.strict else "limited"

    # -------------------------------------------------------------------------------------- 7: finalize
    def finalize(self) -> None:
        """7. Outputs closed (every produced artifact written, also when the loop raised) and the journal
        compacted; then, whatever happened there, the final sections and status; the signal handlers restored.
        An error while closing is raised after the status is written, unless the loop's own error is on its way."""
        closing_error: Optional[BaseException] = None
        try:
            try:
                self.close_outputs()
            except BaseException as e:  # the final status is written all the same, then the error goes on
                closing_error = e
                if self.status not in ("interrupted", "storage_error"):
                    self.status = "storage_error" if isinstance(e, StorageError) else "failed"
                self.manifest.doc.setdefault("error", f"{type(e).__name__}: {e}")
            try:
                self.final_sections()
            finally:
                self.manifest.doc["status"] = self.status
                self.manifest.doc["ended_at"] = now_iso()
                self.attempts_section()
                self.manifest.flush()
                self.push_final()
        finally:
            self.stop.__exit__(None, None, None)
            self.end_claims()
        if closing_error is not None and not self.raising:  # else the error that ended the loop goes on
            raise closing_error

    def attempts_section(self) -> None:
        """The manifest's ``items_by_attempt`` (which attempt wrote the run's items: its run_id, git, evidence
        verdict; ``runner.core.provenance.count_items_by_attempt``) from the journal as it ends, and each
        ``resumed_from.attempts`` entry's ``items``. A rank that writes no journal has none."""
        if self.sink is None or not self.writes:
            return
        try:
            records = read_journal(self.out_dir / self.journal_name)
        except (OSError, ValueError) as e:  # the final status is written all the same
            log.warning("items_by_attempt: could not read %s (%s)", self.out_dir / self.journal_name, e)
            return
        self.manifest.section("items_by_attempt", provenance.count_items_by_attempt(records, self.manifest.doc))

    def push_final(self) -> None:
        """Object storage: the final journal, manifest and folder indexes uploaded to the run's URL (a failure is
        logged: the staging dir has everything, and the next run's pull starts from what the URL holds)."""
        if self.mirror is None:
            return
        try:
            self.mirror.push(force=True)
        except StorageError as e:
            log.error("object storage: the final journal and manifest were not uploaded to %s (%s); the staging dir "
                      "%s holds them", self.mirror.url, e, self.out_dir)
            if self.status in ("completed", "completed_with_failures"):  # the run at the URL is not complete
                self.status = self.manifest.doc["status"] = "storage_error"
                self.manifest.flush()

    def end_claims(self) -> None:
        """Under claims: stop renewing, let go of every batch held but not journaled (a stop signal, an error:
        another worker takes it at once), and mark this worker ended (its manifest is final)."""
        if self.claims is None:
            return
        if self.renewer is not None:
            self.renewer.stop()
        try:
            self.claims.release_all()
            self.claims.end()
        except OSError as e:
            log.warning("claims: could not record this worker's end (%s: %s); the others see it after its lease",
                        type(e).__name__, e)

    def close_outputs(self) -> None:
        """Close the sink, the bar and every engine; compact the journal; the folder indexes and the files of
        the dir that are not this run's items."""
        try:
            if self.sink is not None:
                self.sink.close()
        finally:
            if self.bar is not None:
                self.bar.close()
            for e in self.engines:
                e.close()
        if self.sink is None or not self.writes:
            return
        out_dir, name = self.out_dir, self.journal_name
        before = read_journal(out_dir / name) if self.worker is None else []  # compaction drops some
        if self.claims is None or self.metric_set is not None and self.metric_set.names:
            # a claims worker's journal is not rewritten (the merge already read it; the merged items.jsonl is the
            # compact one), unless metrics score into it
            compact(out_dir, self.items, name, self.final, self.plan.expected, others=self.claims is None)
        self.score_metrics()
        if self.worker is None:  # the folder indexes follow the compacted journal (a merge writes them for workers)
            self.manifest.section("folder_metadata", write_folder_metadata(
                out_dir, read_journal(out_dir / name), self.cfg.model.name, self.manifest.doc["run_id"]))
            unlisted = keep_unlisted(out_dir, name, before)
            if unlisted:
                log.warning("%d file(s) in %s are not items of this run (an earlier run's, e.g. a larger "
                            "dataset.limit); their records are kept in %s", unlisted, out_dir, UNLISTED)
            self.manifest.section("unlisted_files", {"count": unlisted, "journal": UNLISTED})

    def score_metrics(self) -> None:
        """The configured metrics scored into the compacted journal from the written artifacts, on the run's
        device (``runner.core.metrics.score_journal``: reused items keep the scores of the same metric model); the
        manifest's ``metrics`` section. Not after an interruption or an error of the loop."""
        if self.metric_set is None or self.raising or self.status == "interrupted" or not self.metric_set.names:
            return
        from runner.core.metrics import score_journal

        log.info("scoring %s of %s", ", ".join(self.metric_set.names), self.out_dir / self.journal_name)
        self.manifest.section("metrics", score_journal(self.out_dir, self.journal_name, self.metric_set,
                                                       self.plat.device))
        self.manifest.flush()

    def final_sections(self) -> None:
        """The manifest's counts, timing, compile and memory sections (and ``claims``: this worker's share; a
        worker's ``progress`` as it ended)."""
        self.manifest.section("counts", self.counts)
        if self.worker is not None and self.loop_t0 is not None:
            self.progress()
        if self.claims is not None:
            self.manifest.section("worker", {**self.manifest.doc["worker"], "shard_items": self.counts["ok"]
                                             + self.counts["failed"]})
            self.manifest.section("claims", {**self.claims.section(),
                                             "reusable_at_start": getattr(self.claims, "reusable_at_start", None)})
        self.manifest.section("timing", self.timing_section())
        for name, sec in self.final.final_sections().items():  # the engine's features' (compile)
            self.manifest.section(name, sec)
        self.manifest.section("memory", peak_memory(self.plat.kind))

    def timing_section(self) -> Dict[str, Any]:
        """The manifest's ``timing`` (seconds; rates per second of ``generate`` and per hour of the loop)."""
        t, final = self.timing, self.final
        res = self.results.get(final.stage)
        phases = final.timing_phases(t.generate_s)
        write_s = getattr(self.sink, "write_s", 0.0)
        ok = self.counts["ok"]
        rate = {"image": "images", "video": "videos"}.get(final.output, "items")  # images_per_s, ...
        return {
            "wall_s": round(time.perf_counter() - self.t_start, 3), "load_s": round(t.load_s, 3),
            "warmup_s": round(t.warmup_s, 3), "generate_s": round(t.generate_s, 3),
            "write_s": round(write_s, 3), "write_wait_s": round(getattr(self.sink, "wait_s", 0.0), 3),
            "write_workers": int(self.cfg.output.write_workers), "loop_s": round(t.loop_s, 3),
            "phases_s": {k: round(v, 4) for k, v in phases.items()} | {"write": round(write_s, 4)},
            f"{rate}_per_s": round(ok / t.generate_s, 4) if t.generate_s else None,
            f"{rate}_per_hour": round(3600 * ok / t.loop_s, 1) if t.loop_s else None,
            **(final.timing_extra(res, t.generate_s) if res is not None else {})}

    def force_exit(self, signum: int) -> None:
        """A second signal (``Stop``): the final status recorded, then the process ends (``os._exit``)."""
        m = self.manifest
        m.section("counts", self.counts)
        m.section("interrupt", {"signal": signal.Signals(signum).name, "forced": True,
                                "note": "a second signal ended the process without finishing the current "
                                        "batch; a resume regenerates what it did not write"})
        m.doc["status"] = "interrupted"
        m.doc["ended_at"] = now_iso()
        m.flush()
        if self.on_exit is not None:
            self.on_exit(128 + signum)
        rundir.release_all()

    def exit_code(self) -> int:
        """0: every item written and verified; 1: some failed; 128+signal: interrupted.

        Raises:
            EvidenceError: strict evidence found a mismatch (everything was written).
        """
        from runner.app.console import resume_hint, summary_line

        c, w = self.counts, self.worker
        # a worker's share is not the run's total: the merge logs that (runner.app.jobs, runner.app.ray_launcher)
        log.log(logging.INFO if w is None or w.world_size == 1 else logging.DEBUG, "%s",
                summary_line(self.status, c, time.perf_counter() - self.t_start,
                             self.out_dir if self.mirror is None else self.mirror.url,
                             verdict=(self.manifest.doc.get("evidence") or {}).get("verdict"),
                             accuracy=self.manifest.doc.get("accuracy"),
                             by_attempt=self.manifest.doc.get("items_by_attempt")))
        if self.status == "evidence_mismatch":
            raise EvidenceError("evidence contradicts the resolved backends (evidence.strict=true):\n  "
                                         + "\n  ".join(self.manifest.doc["evidence"]["mismatches"]))
        if self.status == "interrupted":
            if w is None or w.world_size == 1:
                log.info("%s", resume_hint(self.out_dir, None if self.mirror is None else self.mirror.url))
            return 128 + (self.stop.signum or signal.SIGINT)
        return 0 if c["failed"] == 0 and self.status != "storage_error" else 1


def evidence_doc(cfg: DictConfig, plat: Any, engines: Sequence[Any], results: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest's ``evidence``: each stage that generated gives its section and mismatches
    (``engine.evidence``); the verdict is ``mismatch`` when any stage contradicts its resolution, else
    ``nonfinite_outputs`` when an output held NaN/inf, else ``limited`` when a stage could not make a check (its
    section's ``checks``), else ``verified``; ``not_collected`` when nothing was generated
    (every item reused) or ``evidence.enabled=false``."""
    ran = [e for e in engines if e.stage in results and results[e.stage].generated]
    nonfinite = sum(r.nonfinite for r in results.values())
    if not ran:
        return {"enabled": cfg.evidence.enabled, "pid": os.getpid(), "device": plat.device, "all_finite": True,
                "verdict": "not_collected", "reason": "every item was reused from an earlier attempt: the evidence "
                "of the attempt that wrote each item is in resumed_from.attempts (items_by_attempt names them)",
                "mismatches": []}
    if not cfg.evidence.enabled:
        return {"enabled": False, "pid": os.getpid(), "device": plat.device, "all_finite": nonfinite == 0,
                "verdict": "not_collected", "mismatches": []}
    stages_doc: Dict[str, Any] = {}
    mismatches: List[str] = []
    for e in ran:
        stages_doc[e.stage], mm = e.evidence(results[e.stage])
        mismatches += mm
    limited = any("limited" in (st.get("checks") or {}).values() for st in stages_doc.values())
    return {"enabled": True, "pid": os.getpid(), "device": plat.device, "stages": stages_doc,
            "all_finite": nonfinite == 0,
            "verdict": "mismatch" if mismatches else ("nonfinite_outputs" if nonfinite else
                                                      "limited" if limited else "verified"),
            "mismatches": mismatches}


def compact(out_dir: Path, items: List[Any], name: str, final: Any, expected: Dict[str, Dict[str, Any]],
            others: bool = True) -> None:
    """Rewrite the journal with the latest record per item, in dataset order (after a resume the file then reads
    exactly like an uninterrupted run's). For a resumable stage, ok records of items reused from another journal
    of the dir (an earlier merged run, other workers) are copied in, so the journal covers all of ``items``; an ok
    record whose ``inputs_sha256`` is not the current run's (an earlier config's output that this run did not get
    to regenerate) is left out, so no journal line claims an artifact the current config did not produce.
    ``others=False`` (a claims worker: its journal holds what it generated, the merge gathers the rest) copies
    nothing in."""
    extra: Dict[str, Dict[str, Any]] = {}
    current = None
    if final.resumable:
        def current(r: Dict[str, Any]) -> bool:
            return r.get("status") != "ok" or r.get("inputs_sha256") == (expected.get(r.get("key")) or {}).get(
                "inputs_sha256")

        for p in sorted(out_dir.glob("items*.jsonl")) if others else ():
            if p.name != name:
                extra.update({r["key"]: r for r in read_journal(p) if r.get("status") == "ok" and current(r)})
    compact_journal(out_dir / name, order=[it.key for it in items], extra=extra, keep=current)


