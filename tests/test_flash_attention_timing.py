"""Flash attention chosen by timing both settings on this machine (issue 52,
backends/attention_timing.py): the winner of a reference turn, remembered per model,
machine, thread count and KV type, timed only on a quiet machine, and used by the next
load without timing again."""

from __future__ import annotations

import json

import pytest

from localrun.backends import attention_timing
from localrun.backends.attention import FLASH_ATTN_ENV
from localrun.backends.attention_timing import AttentionTiming, choose, recall, thread_counts
from localrun.backends.llamacpp import LlamaCppBackend
from localrun.hardware import OthersLoad, inference_threads


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_CACHE", str(tmp_path / "data"))
    monkeypatch.delenv(FLASH_ATTN_ENV, raising=False)


def quiet(monkeypatch, busy: float = 0.0):
    monkeypatch.setattr(OthersLoad, "busy_cores", lambda self, wait=False: busy)


def timing(threads, decode_off, decode_on, prompt_off=1.0, prompt_on=1.0):
    return AttentionTiming(threads, {"off": decode_off, "on": decode_on}, {"off": prompt_off, "on": prompt_on})


def test_the_winner_is_the_shorter_reference_turn():
    assert timing(2, 10.0, 9.0).winner() == "on"
    assert timing(2, 9.0, 10.0).winner() == "off"
    assert timing(2, 10.0, 9.9).winner() == "off"  # 1% is noise: the setting earlier releases used
    # decoding 1 ms faster does not pay for reading prompt tokens 2 ms slower
    assert timing(2, 10.0, 9.0, prompt_off=1.0, prompt_on=3.0).winner() == "off"
    text = timing(2, 10.0, 8.0).explain()
    assert "flash attention on" in text and "100.0 tok/s" in text and "125.0 tok/s" in text


def test_a_tie_goes_to_off_for_one_sequence_and_to_on_for_a_server_s_several():
    """Between two timings a few percent apart, one sequence keeps the old setting; a
    context that serves several at once takes "on", whose rows do not depend on which
    other sequences share the step. A setting clearly faster wins either way."""
    tie = timing(2, 10.0, 9.9)
    assert tie.winner(1) == "off" and tie.winner(4) == "on"
    assert "a tie" in tie.explain() and tie.explain(4).startswith("flash attention on")
    assert timing(2, 9.0, 10.0).winner(4) == "off" and timing(2, 10.0, 9.0).winner(1) == "on"
    assert "a tie" not in timing(2, 9.0, 10.0).explain()


def test_thread_counts_cover_one_all_cores_and_the_starting_count():
    assert thread_counts(2, 2) == [1, 2]
    assert thread_counts(3, 8) == [1, 3, 8]
    assert thread_counts(1, 1) == [1]


def test_timed_once_then_remembered_per_thread_count(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    quiet(monkeypatch)
    asked = []

    def time_both(counts):
        asked.append(counts)
        return [timing(t, 10.0, 9.0 if t == 2 else 11.0) for t in counts]

    first = choose(str(model), "f16", 2, 2, time_both)
    assert asked == [[1, 2]] and first.threads == 2 and first.winner() == "on"
    again = choose(str(model), "f16", 2, 2, time_both)
    one = choose(str(model), "f16", 1, 2, time_both)  # timed with the others: not timed again
    assert asked == [[1, 2]]
    assert again == first and one.winner() == "off"
    assert choose(str(model), "q8_0", 2, 2, time_both) is not None and len(asked) == 2  # another KV type
    model.write_bytes(b"GGUF, rewritten")  # another file at the same path
    assert recall(str(model), "f16", 2) is None


def test_a_copy_elsewhere_is_the_same_model(tmp_path, monkeypatch):
    """Keyed by the file's bytes, not its path: a model copied into another folder (a
    test's temporary one, a moved store) is not timed again, and adds no entry."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 5000)
    quiet(monkeypatch)
    first = choose(str(model), "f16", 2, 2, lambda counts: [timing(t, 10.0, 8.0) for t in counts])
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(model.read_bytes())
    assert choose(str(copy), "f16", 2, 2, lambda counts: pytest.fail("timed again")) == first
    cache = json.loads(attention_timing.datafiles.cache_path(attention_timing.FILE_NAME).read_text())
    assert len(cache) == 2  # 1 and 2 threads, once


def test_doctor_lists_what_this_machine_timed(tmp_path, monkeypatch, capsys):
    from localrun.commands.store import flash_attention_rows

    assert flash_attention_rows() == [["flash attn", "timed per model at its first load on the CPU (none yet)"]]
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    quiet(monkeypatch)
    choose(str(model), "f16", 2, 2, lambda counts: [timing(t, 10.0, 8.0) for t in counts])
    rows = flash_attention_rows()
    assert [r[1].split(":")[0] for r in rows] == ["m.gguf (kv=f16)"] * 2  # 1 and 2 threads
    assert all("flash attention on" in r[1] for r in rows)
    monkeypatch.setenv(FLASH_ATTN_ENV, "off")
    assert flash_attention_rows() == [["flash attn", f"{FLASH_ATTN_ENV}=off decides for every model"]]


def test_a_busy_machine_is_not_timed(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    quiet(monkeypatch, busy=1.2)
    assert choose(str(model), "f16", 2, 2, lambda counts: pytest.fail("timed on a busy machine")) is None


def test_a_measurement_taken_under_load_is_used_but_not_remembered(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    readings = iter([0.0, 1.5])  # quiet at the start, busy while timing
    monkeypatch.setattr(OthersLoad, "busy_cores", lambda self, wait=False: next(readings))
    got = choose(str(model), "f16", 2, 2, lambda counts: [timing(t, 10.0, 9.0) for t in counts])
    assert got.winner() == "on" and recall(str(model), "f16", 2) is None


@pytest.mark.parametrize("entry", [{"decode_ms": {"off": 1}}, {"decode_ms": "x", "prompt_ms": {}},
                                   {"decode_ms": {"off": 0, "on": 1}, "prompt_ms": {"off": 1, "on": 1}}, 7])
def test_a_damaged_entry_is_timed_again(tmp_path, monkeypatch, entry):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    key = attention_timing.timing_key(str(model), "f16", 2)
    path = attention_timing.datafiles.cache_path(attention_timing.FILE_NAME)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: entry}))
    quiet(monkeypatch)
    got = choose(str(model), "f16", 2, 2, lambda counts: [timing(t, 10.0, 9.0) for t in counts])
    assert got.winner() == "on"


def test_a_real_load_times_both_and_the_next_load_reuses_it(smollm2_gguf, monkeypatch):
    """SmolLM2 on this CPU: the first load times both settings at 1 and all cores (real
    contexts, real decodes), attends with the winner and keeps it; the second load reads
    it and does not time again."""
    quiet(monkeypatch)
    first = LlamaCppBackend(smollm2_gguf, n_ctx=256)
    try:
        measured = first.attention_timing
        assert measured is not None and first.flash_attn == measured.winner()
        assert min(*measured.decode_ms.values(), *measured.prompt_ms.values()) > 0
    finally:
        first.close()
    monkeypatch.setattr(attention_timing, "measure", lambda *a, **k: pytest.fail("timed again"))
    second = LlamaCppBackend(smollm2_gguf, n_ctx=256, threads=first.threads)
    try:
        assert second.attention_timing == measured and second.flash_attn == measured.winner()
    finally:
        second.close()
    saved = json.loads(attention_timing.datafiles.cache_path(attention_timing.FILE_NAME).read_text())
    timed = sorted(int(key.split("|t=")[1].split("|")[0]) for key in saved)
    assert timed == thread_counts(first.threads, inference_threads())


def test_the_environment_still_decides(smollm2_gguf, monkeypatch):
    monkeypatch.setenv(FLASH_ATTN_ENV, "on")
    monkeypatch.setattr(attention_timing, "measure", lambda *a, **k: pytest.fail("timed under an override"))
    backend = LlamaCppBackend(smollm2_gguf, n_ctx=256)
    try:
        assert backend.flash_attn == "on" and backend.attention_timing is None
    finally:
        backend.close()


@pytest.fixture
def gguf(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    return model


def test_a_remembered_tie_is_timed_again_after_a_week_and_a_clear_winner_is_kept(gguf, monkeypatch):
    """A dozen decodes per setting on a machine whose speed moves can call a tie where
    one setting is faster: a tie is taken again once RETIME_TIE_S old; a clear winner
    is kept for good."""
    model, clock, asked = gguf, [1_000_000.0], []
    monkeypatch.setattr(attention_timing.time, "time", lambda: clock[0])
    quiet(monkeypatch)

    def tied_then_on(counts):  # the first timing a tie, the next one "on" clearly faster
        asked.append(counts)
        return [timing(t, 10.0, 9.9 if len(asked) == 1 else 8.0) for t in counts]

    first = choose(str(model), "f16", 2, 2, tied_then_on)
    assert first.tie() and first.measured_at == clock[0] and recall(str(model), "f16", 2).measured_at == clock[0]
    clock[0] += attention_timing.RETIME_TIE_S - 60
    assert choose(str(model), "f16", 2, 2, tied_then_on) == first and len(asked) == 1  # not yet a week
    clock[0] += 120
    again = choose(str(model), "f16", 2, 2, tied_then_on)
    assert len(asked) == 2 and again.winner() == "on" and not again.tie()
    clock[0] += 10 * attention_timing.RETIME_TIE_S
    assert choose(str(model), "f16", 2, 2, lambda counts: pytest.fail("a clear winner timed again")) == again


def test_a_tie_due_again_on_a_busy_machine_still_decides(gguf, monkeypatch):
    """An entry from before timings were dated (no measured_at) is due again; while
    other processes keep a core busy it is not retimed, and the remembered tie decides
    rather than the old rule's blanket off."""
    model = gguf
    key = attention_timing.timing_key(str(model), "f16", 2)
    path = attention_timing.datafiles.cache_path(attention_timing.FILE_NAME)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({key: timing(2, 10.0, 9.9).as_json() | {"measured_at": None}}))
    known = recall(str(model), "f16", 2)
    assert known.tie() and known.measured_at == 0.0 and known.due_again(1.0e9)
    quiet(monkeypatch, busy=1.5)
    got = choose(str(model), "f16", 2, 2, lambda counts: pytest.fail("timed on a busy machine"))
    assert got == known and got.winner(4) == "on"
