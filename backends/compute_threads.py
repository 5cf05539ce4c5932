"""Which threads may run llama.cpp's forward passes in a process that hops threads.

llama.cpp's CPU backend here is built with OpenMP (libgomp). A thread that runs a
multi-threaded decode becomes the master of an OpenMP pool of worker threads, and that
pool lives as long as the thread does. libgomp counts the threads of every pool in the
process, and once they outnumber the CPUs it waits at each barrier by sleeping almost at
once (100 spins) instead of spinning for a few milliseconds: every one of the hundreds of
barriers of a token then costs a futex sleep and wake. One persistent thread that decoded
once (a load-time measurement on a server's worker thread, the chat app's answer on
another of its executor's threads) is enough on a 2-core machine: `serve --draft`, whose
draft model was timed on a worker thread, decoded the 1.5B target at 49-51 ms per token
against 38 without it, its decode threads switching context ~560 times per token
instead of ~0.1.

So work that decodes outside a thread that lives for it (the server's scheduler thread,
the CLI's main thread) runs on a passing thread, whose pool ends with it.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args, name: str = "localrun-compute", **kwargs) -> T:
    """`fn(*args, **kwargs)` run on a new thread that ends when it returns (with the
    caller's context variables); returns its value or raises its exception here."""
    outcome: dict[str, object] = {}
    context = contextvars.copy_context()

    def run() -> None:
        try:
            outcome["value"] = context.run(fn, *args, **kwargs)
        except BaseException as exc:  # handed to the caller, who raises it
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
