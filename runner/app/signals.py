"""Signal handling of a run (:class:`Stop`): the first SIGINT/SIGTERM stops after the current batch, a second one
ends the process at once after the final status is recorded."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable, Dict, Optional

log = logging.getLogger("runner")


class Stop:
    """SIGINT/SIGTERM handling: the first signal asks the loop to stop after the current batch; a second one
    ends the process at once (``os._exit(128 + signal)``), after ``on_force`` recorded the final status (the
    manifest at ``interrupted`` with its end time, ``job_status.json``). Every write is atomic or an fsynced
    journal line, so nothing is left half-written; a resume regenerates what the abandoned batch did not write."""

    def __init__(self, on_force: Optional[Callable[[int], None]] = None) -> None:
        self.signum: Optional[int] = None
        self.on_force = on_force
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> "Stop":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self._force(signum)
        self.signum = signum
        log.warning("%s received: stopping after the current batch (send again to exit now)",
                    signal.Signals(signum).name)

    def _force(self, signum: int) -> None:
        """The second signal: record the final status (a further signal cannot interrupt that), then exit."""
        try:
            for sig in self._old:
                signal.signal(sig, signal.SIG_IGN)
            log.warning("%s received again: exiting now, without finishing the current batch",
                        signal.Signals(signum).name)
            if self.on_force is not None:
                self.on_force(signum)
        except BaseException as e:  # noqa: BLE001 - exit anyway: the process was told twice to end
            try:
                log.error("recording the final status failed: %s: %s", type(e).__name__, e)
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def rearm(self) -> None:
        """Install the handlers again (after an engine start, in case an engine version installs its own)."""
        self.__exit__(None, None, None)
        self.__enter__()
