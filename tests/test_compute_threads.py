"""Decodes outside a thread that lives for them leave no OpenMP pool behind
(backends/compute_threads.py): the passing thread itself, and a server whose load decodes
(its draft model is timed at load) decoding afterwards without sleeping at its barriers."""

from __future__ import annotations

import contextvars
import os
import threading
from pathlib import Path

import httpx
import pytest

from localrun.backends.compute_threads import on_passing_thread
from serving import Server

where = contextvars.ContextVar("where", default="unset")


def test_a_passing_thread_returns_the_value_and_ends():
    ran_on: list[threading.Thread] = []

    def work(a, b=0):
        ran_on.append(threading.current_thread())
        return a + b

    assert on_passing_thread(work, 2, b=3) == 5
    assert ran_on[0] is not threading.current_thread()
    assert not ran_on[0].is_alive()  # its pool, had it decoded, ended with it


def test_a_passing_thread_raises_the_error_here_and_sees_the_callers_context():
    where.set("caller")
    assert on_passing_thread(where.get) == "caller"

    def fail():
        raise ValueError("from the thread")

    with pytest.raises(ValueError, match="from the thread"):
        on_passing_thread(fail)


def voluntary_switches(pid: int) -> int:
    """The voluntary context switches of all of a process's threads: a thread that sleeps
    at a barrier (rather than spinning) switches once per wait."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # a thread that ended between the listing and the read
            continue
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread counters from Linux's /proc")
def test_a_server_that_decoded_at_load_decodes_without_sleeping_at_barriers(smollm2_gguf):
    """`serve --draft` times its draft model at load (and, with a fresh cache folder, flash
    attention too): decodes on the load's thread. With as many threads as cores, a pool
    left on that thread would make the process's OpenMP threads outnumber the CPUs, and
    libgomp would then sleep at each of the hundreds of barriers of a token (measured
    before the fix: ~560 voluntary switches per token on the 1.5B; ~0.1 after)."""
    cores = os.cpu_count() or 2
    server = Server("--model", str(smollm2_gguf), "--draft", str(smollm2_gguf), "--parallel", "1",
                    "--ctx", "512", "--threads", str(cores))
    try:
        ask = {"prompt": "def fibonacci(n):\n", "n_predict": 64, "temperature": 0, "lookup": False,
               "ignore_eos": True}
        assert httpx.post(server.url + "/completion", json={**ask, "n_predict": 4}, timeout=120).status_code == 200
        before = voluntary_switches(server.proc.pid)
        r = httpx.post(server.url + "/completion", json=ask, timeout=120)
        after = voluntary_switches(server.proc.pid)
        assert r.status_code == 200, r.text
        tokens = r.json()["timings"]["predicted_n"]
        assert tokens == 64
        # the HTTP exchange and the event loop's wake-ups are a few dozen switches in all
        assert (after - before) / tokens < 20, server.output()
    finally:
        server.stop()
