"""The entry of one run (:func:`run`): hold the run dir, then :class:`runner.app.run.Run` does the steps. Also the
dataset's items for a data-parallel merge (:class:`DatasetItems`), read once per process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

from omegaconf import DictConfig

from runner.app.run import Run
from runner.app.stages import build_engines
from runner.core import resume, rundir, storage


def run(cfg: DictConfig, run_dir: Path, overrides: Sequence[str] = (),
        on_loaded: Optional[Callable[[Any], None]] = None, worker: Optional[Any] = None,
        on_exit: Optional[Callable[[int], None]] = None, dataset: Optional["DatasetItems"] = None) -> int:
    """Execute one run into ``run_dir``. Returns the process exit code (0: every item written and verified;
    1: some items failed; 128+signal: interrupted).

    Args:
        cfg: the composed run config.
        run_dir: output directory (the Hydra run dir); ``run.resume`` or ``output.dir`` take precedence; when that
            is an object-storage URL (``s3://bucket/prefix``) the run is staged in ``run_dir`` and published to the
            URL (``runner.core.storage``).
        overrides: the CLI overrides (Hydra's task overrides); they decide the CLI precedence layers.
        on_loaded: called with the last stage's engine once its model is loaded and backends are installed
            (tests use it to tamper with the model and check that the evidence notices).
        worker: a data-parallel worker (``runner.core.distributed.Worker``): it generates only its shard and writes
            ``items.rank<r>.jsonl`` and ``manifest.rank<r>.json``; the merge makes the run's files.
        on_exit: called with the exit code when a second signal ends the process at once, after the manifest
            was finalized (``runner.app.jobs`` writes ``job_status.json`` there).
        dataset: filled with every item of the run's dataset as the run reads it (a data-parallel merge on this
            process then needs no second read).

    The run dir is held for the whole call (``runner.core.rundir``): a plain run takes its lock first thing, before
    anything loads or anything in the dir is read or written (re-entrant: ``python -m runner`` took it already);
    a worker belongs to the run that holds it (rank 0, the Ray driver).

    Raises:
        runner.core.errors.RunnerError subclasses: bad input or a refused backend, all before any weight loads;
            ``RunDirInUseError`` when another run holds the dir;
        evidence.EvidenceError: strict evidence found a mismatch (after everything was written).
    """
    out_dir = storage.run_dir(cfg, run_dir)  # a URL's run is staged in the Hydra run dir (runner.core.storage)
    remote = storage.target(cfg)
    if remote is not None:
        storage.check_target(cfg, *remote)
        storage.attach(out_dir, *remote)
    try:
        return _run_in(cfg, out_dir, overrides, on_loaded, worker, on_exit, dataset)
    finally:
        if remote is not None:
            storage.detach(out_dir)


def _run_in(cfg: DictConfig, out_dir: Path, overrides: Sequence[str], on_loaded: Optional[Callable[[Any], None]],
            worker: Optional[Any], on_exit: Optional[Callable[[int], None]], dataset: Optional["DatasetItems"]) -> int:
    """:func:`run` into the local run dir ``out_dir``: held (or joined) for the whole call."""
    joined = rundir.run_token(out_dir) if rundir.held(out_dir) is None else None  # a torchrun rank > 0
    if worker is not None or joined:
        token = rundir.run_token(out_dir) or (rundir.join(out_dir, None) if out_dir.is_dir() else None)
        return Run(cfg, out_dir, overrides, on_loaded, worker, on_exit, token, dataset)()
    lock = rundir.acquire(out_dir, create=not cfg.run.resume,  # a missing run.resume dir is refused below
                          key="run.resume" if cfg.run.resume else "output.dir" if cfg.output.dir else None)
    try:
        return Run(cfg, out_dir, overrides, on_loaded, worker, on_exit, lock.token if lock is not None else None,
                   dataset)()
    finally:
        rundir.release(lock)


@dataclass
class DatasetItems:
    """Every item of the run's dataset, in dataset order, read once per process: by the run itself (``run(...,
    dataset=...)`` fills it) or by :meth:`read` (a Ray driver, which runs no stage). The data-parallel merge takes
    its keys and the ``inputs_sha256`` values an item's record may carry (``runner.core.distributed.merge``)."""

    items: List[Any] = field(default_factory=list)
    filled: bool = False
    batch_count: Optional[int] = None  # how many batches the run forms (read(): the driver's batch ids 0..n-1)

    def fill(self, items: Sequence[Any]) -> None:
        """Keep ``items`` (before any sharding)."""
        self.items, self.filled = list(items), True

    @classmethod
    def read(cls, cfg: DictConfig) -> "DatasetItems":
        """The items of ``cfg``'s dataset, read through the final stage's engine (nothing loads)."""
        engine = build_engines(cfg, [])[-1]
        rows, _ = engine.read_rows()
        out = cls()
        out.fill(engine.items(rows, cfg.seed))
        out.batch_count = len(engine.batches(out.items, cfg.batch_size))  # formed as every worker forms them
        return out

    def keys(self) -> List[str]:
        """Every item key, in dataset order (the merged journal's order)."""
        return [it.key for it in self.items]

    def current(self) -> Callable[[List[str]], Mapping[str, List[str]]]:
        """Given the workers' run identity hashes (their manifests' ``identity.sha256``), the ``inputs_sha256``
        values each item's record may carry to be an output of the current run: a mapping that hashes an item's
        inputs when its key is looked up (a merge step looks up the keys of the records it reads, not all)."""
        by_key = {it.key: it for it in self.items}

        def current(run_shas: List[str]) -> Mapping[str, List[str]]:
            return _InputsOf(by_key, list(dict.fromkeys(run_shas)))

        return current


class _InputsOf(Mapping):
    """Item key -> the ``inputs_sha256`` of the item under each of ``run_shas``, computed on first look-up."""

    def __init__(self, by_key: Dict[str, Any], run_shas: List[str]) -> None:
        self.by_key, self.run_shas, self.done = by_key, run_shas, {}

    def __getitem__(self, key: str) -> List[str]:
        if key not in self.done:
            it = self.by_key[key]  # KeyError: not an item of the dataset
            self.done[key] = [resume.inputs_sha256(s, it) for s in self.run_shas]
        return self.done[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_key)

    def __len__(self) -> int:
        return len(self.by_key)


def dataset_keys(cfg: DictConfig) -> List[str]:
    """Every item key of the run's dataset, in dataset order (:meth:`DatasetItems.keys` of a fresh read)."""
    return DatasetItems.read(cfg).keys()
