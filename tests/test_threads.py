"""Default threads that fit the machine's load: the policy on injected measurements, the
load reading, and the llama.cpp backend following it (or an explicit count)."""

from __future__ import annotations

import pytest

from localrun import hardware
from localrun.hardware import BUSY_CORE_SHARE, OthersLoad, fitted_threads


# -- the policy ------------------------------------------------------------------------


def test_an_idle_machine_gets_every_core():
    assert fitted_threads(0.0, cores=8) == 8
    assert fitted_threads(BUSY_CORE_SHARE - 0.01, cores=8) == 8  # a browser's flicker is not a core


def test_each_busy_core_costs_a_thread():
    assert fitted_threads(1.0, cores=2) == 1
    assert fitted_threads(BUSY_CORE_SHARE + 0.01, cores=2) == 1
    assert fitted_threads(2.0, cores=8) == 6
    assert fitted_threads(2.6, cores=8) == 5


def test_never_fewer_than_one_never_more_than_the_cores():
    assert fitted_threads(64.0, cores=2) == 1
    assert fitted_threads(-3.0, cores=4) == 4  # a clock glitch cannot add cores
    assert fitted_threads(0.0) == hardware.inference_threads()
    assert fitted_threads(0.0) <= hardware.inference_threads()


def test_unknown_load_gives_every_core():
    assert fitted_threads(None, cores=4) == 4


# -- the reading -----------------------------------------------------------------------


def test_a_reading_needs_a_window_and_subtracts_our_own_cpu(monkeypatch):
    clock = {"t": 100.0, "busy": 50.0, "own": 10.0}
    monkeypatch.setattr(OthersLoad, "_now", lambda self: (clock["t"], clock["busy"], clock["own"]))
    load = OthersLoad()
    clock.update(t=100.05, busy=50.1, own=10.05)
    assert load.busy_cores() is None  # under LOAD_WINDOW_S: too short to judge
    # two seconds: the CPUs were busy 3.0 s in all, 1.0 s of it ours -> others kept one core
    clock.update(t=102.0, busy=53.0, own=11.0)
    assert load.busy_cores() == pytest.approx(1.0)
    clock.update(t=103.0, busy=54.0, own=12.0)  # all of it ours this time
    assert load.busy_cores() == pytest.approx(0.0)


def test_a_real_reading_is_a_plausible_number():
    load = OthersLoad()
    busy = load.busy_cores(wait=True)
    assert busy is not None and 0.0 <= busy <= hardware.usable_cpus() + 0.5


# -- the backend -----------------------------------------------------------------------


class _Busy:
    """An OthersLoad that reports `cores` busy cores on every reading."""

    cores = 64.0

    def busy_cores(self, wait: bool = False) -> float:
        return self.cores


def test_the_default_follows_the_load_and_an_explicit_count_wins(smollm2_gguf, monkeypatch):
    from localrun.backends import llamacpp
    from localrun.backends.base import BatchEntry

    monkeypatch.setattr(llamacpp, "OthersLoad", _Busy)
    fitted = llamacpp.LlamaCppBackend(smollm2_gguf, n_ctx=64)
    explicit = llamacpp.LlamaCppBackend(smollm2_gguf, n_ctx=64, threads=2)
    try:
        assert fitted.threads == 1  # every core taken: one thread, never zero
        assert explicit.threads == 2
        _Busy.cores = 0.0  # the machine went idle: the next refit takes every core back
        for backend in (fitted, explicit):
            backend._refit_at = 0.0
            backend.decode([BatchEntry(0, [1, 2, 3], 0, 1)])
        assert fitted.threads == hardware.inference_threads()
        assert explicit.threads == 2
    finally:
        fitted.close()
        explicit.close()
