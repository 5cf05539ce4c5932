"""A bounded shutdown: SIGTERM or Ctrl+C stops the server within SHUTDOWN_BOUND_S, even
while a step is slow or a worker thread is stuck.

uvicorn's graceful shutdown waits for open streams to end, then runs the lifespan's
cleanup (unloading models), and `asyncio.run` then joins every worker thread. Each of
those can wait on something a request started. So at the signal:
1. every model's scheduler is told to stop (its decode in flight is interrupted, its
   jobs fail, so their streams end at once instead of running to their last token);
2. a watchdog ends the process if it is still alive SHUTDOWN_BOUND_S later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import uvicorn

from .models import ModelManager

log = logging.getLogger("localrun.server")

SHUTDOWN_BOUND_S = 4.0  # the bound is 5 s from the signal to the process's end


class BoundedServer(uvicorn.Server):
    """uvicorn's server, ending generations at the first signal and exiting within a bound."""

    def __init__(self, config: uvicorn.Config, manager: ModelManager) -> None:
        super().__init__(config)
        self.manager = manager
        self._stopping = False

    def handle_exit(self, sig: int, frame) -> None:
        if not self._stopping:
            self._stopping = True
            log.warning("localrun: %s received: ending every generation and unloading models", _name(sig))
            # in a thread: a signal handler must not take locks the interrupted code may hold
            threading.Thread(target=self._stop_models, name="localrun-stop", daemon=True).start()
            threading.Thread(target=_watchdog, args=(SHUTDOWN_BOUND_S,), name="localrun-watchdog", daemon=True).start()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, except that a signal the server has shut down for is not raised again
        afterwards: a SIGTERM or Ctrl+C that ended in a clean shutdown (every model
        unloaded) exits 0, as a service manager expects; the watchdog's exit stays 1."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    def _stop_models(self) -> None:
        for model in list(self.manager.loaded.values()):
            model.scheduler.request_stop()


def _watchdog(bound_s: float) -> None:
    threading.Event().wait(bound_s)
    log.error("localrun: still stopping after %.0f s (a request's work did not end): exiting now", bound_s)
    logging.shutdown()
    os._exit(1)


def _name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
