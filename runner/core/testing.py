"""Test-only hooks. Each reads an environment variable that only the test suite and the benchmarks set; a real run
never sets them (``runner.core.environment`` checks their values when they are set, like every variable it reads).

``RUNNER_TEST_SLOW_WORKER=<rank>:<factor>``: the data-parallel worker of that rank sleeps ``(factor - 1) x`` the
seconds each batch took, at the batch boundary, so it runs ``factor`` times slower than its peers (the straggler of
``benchmarks/fleet_cpu.py``). Any other process, and every rank when unset, is untouched.

``RUNNER_TEST_PUBLISH_PAUSE=<file>``: object storage (``runner.core.storage.RunMirror.publish``) stops after the
first artifact's temp object is uploaded and before it is verified and moved to its final key: it writes the
artifact's run-dir-relative name into ``<file>`` and sleeps (``tests/test_storage.py`` kills the process there).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional, Tuple

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


PUBLISH_PAUSE = "RUNNER_TEST_PUBLISH_PAUSE"
_paused = False


def publish_pause(rel: str, seconds: float = 600.0) -> None:
    """Object storage, between a temp object's upload and its publication: when ``RUNNER_TEST_PUBLISH_PAUSE``
    names a file, the first call of the process writes ``rel`` there and sleeps ``seconds`` (the test kills the
    process meanwhile); later calls and unset runs return at once."""
    global _paused
    path = os.environ.get(PUBLISH_PAUSE)
    if not path or _paused:
        return
    _paused = True
    with open(path, "w", encoding="utf-8") as f:
        f.write(rel)
    time.sleep(seconds)


def s3_server() -> Any:
    """Test-only: moto's S3 server (``moto[server]``, the ``s3-server`` extra) on a free loopback port, in a thread
    of this process, started; ``.endpoint`` is its URL, ``.stop()`` ends it. Every request is served under one lock:
    moto checks ``If-None-Match``/``If-Match`` and then stores the object in two steps, where S3 makes a conditional
    write atomic; serialized, moto's server keeps S3's guarantee (``tests/test_storage.py``,
    ``benchmarks/object_storage_cpu.py``)."""
    import logging
    import threading

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class SerializedMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:
            app, lock = DomainDispatcherApplication(create_backend_app), threading.Lock()

            def serialized(environ: Any, start_response: Any) -> Any:
                with lock:
                    return list(app(environ, start_response))

            self._server = make_server(self._ip_address, self._port, serialized, True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = SerializedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    server.endpoint = f"http://{host}:{port}"
    return server
