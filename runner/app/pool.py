"""A data-parallel worker's view of the pool: live merge steps between its batches (``runner.core.live_merge``
through ``runner.core.distributed.live_merge``), which keep the run's ``manifest.json`` current while the workers
run and feed the pool's one progress bar (``runner.app.console.Progress.pool``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

log = logging.getLogger("runner")

#: Seconds between a worker's live merge steps (at most one per batch, none closer than this).
MERGE_INTERVAL_S = 1.0


class LiveMerger:
    """The live merge steps of one worker (a torchrun rank or a claims worker; Ray's driver merges at the end).

    Args:
        out_dir: the run dir; keys: every item key of the dataset, dataset order; token: the run's token.
        worker: ``runner.core.distributed.Worker`` (its ``claims`` when it pulls batches).
        current: ``runner.app.execute.DatasetItems.current()`` (which ok records are the current config's).
        interval_s: the least seconds between two steps of this process.
    """

    def __init__(self, out_dir: Path, keys: List[str], token: str, worker: Any,
                 current: Optional[Callable[[List[str]], Any]], interval_s: float = MERGE_INTERVAL_S) -> None:
        from runner.core.live_merge import JournalMerge

        self.out_dir, self.worker, self.current, self.interval_s = Path(out_dir), worker, current, interval_s
        self.jm = JournalMerge(out_dir, keys, token)
        self.cache: Dict[int, Tuple[Any, Any]] = {}
        self.last = float("-inf")
        self.failed = False

    def _workers(self) -> Tuple[int, List[int]]:
        """How many workers the run has, and the ranks seen dead (a claims worker's record not renewed for
        ``lease_s`` on this process's clock, and not ended)."""
        c = self.worker.claims
        if c is None:
            return self.worker.world_size, []
        ws = c.workers()
        dead = [int(w.get("rank", r)) for r, w in enumerate(ws)
                if not w.get("ended") and not c.worker_alive(int(w.get("rank", r)))]
        return max(len(ws), self.worker.world_size), dead

    def step(self) -> Optional[Dict[str, Any]]:
        """A live merge step unless one ran less than ``interval_s`` ago or another process's is running.
        Returns the live manifest, or None. A storage error is logged once, never raised: the final merge reads
        whatever a live step could not."""
        from runner.core.distributed import live_merge

        now = time.monotonic()
        if now - self.last < self.interval_s:
            return None
        self.last = now
        try:
            n, dead = self._workers()
            return live_merge(self.out_dir, self.jm, n, self.worker.launcher, self.current, self.worker.assign,
                              dead, self.cache)
        except OSError as e:
            if not self.failed:
                log.warning("live merge of %s failed (%s: %s); the final merge reads what it could not", self.out_dir,
                            type(e).__name__, e)
            self.failed = True
            return None
