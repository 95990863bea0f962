"""Test-only hooks. Each reads an environment variable that only the test suite and the benchmarks set; a real run
never sets them (``runner.core.environment`` checks their values when they are set, like every variable it reads).

``RUNNER_TEST_SLOW_WORKER=<rank>:<factor>``: the data-parallel worker of that rank sleeps ``(factor - 1) x`` the
seconds each batch took, at the batch boundary, so it runs ``factor`` times slower than its peers (the straggler of
``benchmarks/fleet_cpu.py``). Any other process, and every rank when unset, is untouched.

:func:`run_processes`: processes racing over the same shared storage (claims), for tests and benchmarks.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, List, Optional, Tuple

SLOW_WORKER = "RUNNER_TEST_SLOW_WORKER"


def parse_slow_worker(value: str) -> Tuple[int, float]:
    """``"<rank>:<factor>"`` -> ``(rank, factor)``.

    Raises:
        ValueError: not two numbers, a rank below 0 or a factor below 1 (the message names the fix).
    """
    try:
        rank_s, factor_s = value.split(":")
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        raise ValueError(f"{SLOW_WORKER}={value!r} is not <rank>:<factor>; fix: e.g. {SLOW_WORKER}=3:4 (rank 3, "
                         "4x slower), or unset it (a test-only hook)") from None
    if rank < 0 or not factor >= 1:
        raise ValueError(f"{SLOW_WORKER}={value!r}: rank must be >= 0 and factor >= 1; fix: e.g. {SLOW_WORKER}=3:4")
    return rank, factor


def slow_worker_delay(rank: Optional[int], batch_s: float) -> float:
    """At a batch boundary of worker ``rank`` (None: not a data-parallel worker): sleep ``(factor - 1) x batch_s``
    seconds when ``RUNNER_TEST_SLOW_WORKER`` names this rank. Returns the seconds slept (0.0 almost always)."""
    value = os.environ.get(SLOW_WORKER)
    if not value or rank is None:
        return 0.0
    slow, factor = parse_slow_worker(value)
    if rank != slow:
        return 0.0
    delay = (factor - 1.0) * batch_s
    time.sleep(delay)
    return delay


def run_processes(target: Callable[..., None], args: Tuple[Any, ...], n: int, timeout_s: float = 600.0) -> List[Any]:
    """Start ``n`` processes (``spawn``: no state inherited) each running ``target(*args, queue)``, which puts one
    result on ``queue``; wait for every result and every process. Returns the results in arrival order. The racing
    claimers of ``tests/test_claims.py`` and ``benchmarks/fleet_cpu.py``.

    Raises:
        queue.Empty: a process gave no result within ``timeout_s``.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=target, args=(*args, q)) for _ in range(n)]
    for p in ps:
        p.start()
    try:
        return [q.get(timeout=timeout_s) for _ in ps]
    finally:
        for p in ps:
            p.join(timeout=60)
