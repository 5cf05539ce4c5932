"""The chat app's parts that need no screen: the conversation store, the settings form,
the status line, slash-command parsing, model choice, fitting a long conversation
into the context, and the answer feed and frame pacer between decoding and drawing."""

from __future__ import annotations

import gc
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from localrun.cli import build_parser
from localrun.engine import Timings
from localrun.errors import BadRequestError, ContextExceededError, LocalrunError
from localrun.tui.conversations import (
    Conversation, ConversationStore, data_dir, default_title, export_markdown, to_markdown,
)
from localrun.tui.help import SLASH_COMMANDS, help_text, parse_slash
from localrun.tui.history import when
from localrun.tui.picker import best_model, initial_model
from localrun.tui.session import ChatSession
from localrun.tui.settings import FieldError, form_values, parse_form, settings_from_args
from localrun.tui.status import StatusValues, human_bytes, status_text
from localrun.tui.stream import AnswerFeed, CollectorPause, FramePacer, warm_highlighter


# -- conversations ------------------------------------------------------------------


def test_store_saves_lists_loads_renames_deletes(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    a = store.save(None, "First", "m:Q4", "be kind", msgs)
    time.sleep(0.01)
    b = store.save(None, "Second", "other", "", msgs[:1])
    assert [c.title for c in store.list()] == ["Second", "First"]  # newest first
    assert store.list()[1].n_messages == 2
    conv = store.load(a)
    assert (conv.title, conv.model, conv.system, conv.messages) == ("First", "m:Q4", "be kind", msgs)

    # saving again replaces the messages (a regenerated answer leaves no stale row)
    time.sleep(0.01)
    store.save(a, "First", "m:Q4", "", [msgs[0], {"role": "assistant", "content": "Hey."}])
    assert store.load(a).messages[1]["content"] == "Hey."
    assert [c.id for c in store.list()] == [a, b]
    assert store.last_model() == "m:Q4"

    store.rename(b, "  Renamed ")
    assert store.load(b).title == "Renamed"
    with pytest.raises(LocalrunError, match="cannot be empty"):
        store.rename(b, "   ")
    store.delete(a)
    assert [c.id for c in store.list()] == [b]
    with pytest.raises(LocalrunError, match="does not exist"):
        store.load(a)
    # messages went with their conversation
    db = sqlite3.connect(tmp_path / "c.db")
    assert db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (a,)).fetchone()[0] == 0
    store.close()
    assert [c.title for c in ConversationStore(tmp_path / "c.db").list()] == ["Renamed"]  # persisted


def test_store_in_an_unwritable_place_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(LocalrunError, match="LOCALRUN_DATA"):
        ConversationStore(blocker / "sub" / "c.db")


def test_a_corrupt_store_is_one_clear_error(tmp_path):
    (tmp_path / "c.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(LocalrunError, match="cannot open the conversation store"):
        ConversationStore(tmp_path / "c.db")


def test_data_dir_honours_localrun_data(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCALRUN_DATA", str(tmp_path))
    assert data_dir() == tmp_path
    assert ConversationStore.open().path == tmp_path / "conversations.db"


def test_default_title_and_markdown_export(tmp_path):
    long = "Explain " + "very " * 30 + "carefully\nsecond line"
    title = default_title([{"role": "system", "content": "x"}, {"role": "user", "content": long}])
    assert len(title) == 60 and title.endswith("…") and "\n" not in title
    assert default_title([]) == "New chat"

    conv = Conversation(1, "Code: a/b?", "m", "Be brief.", [{"role": "user", "content": "Q"},
                                                           {"role": "assistant", "content": "```py\nx = 1\n```"}])
    md = to_markdown(conv)
    assert md.startswith("# Code: a/b?\n") and "## System\n\nBe brief." in md and "```py\nx = 1\n```" in md
    out = export_markdown(conv, tmp_path)  # a folder: the file is named after the title
    assert out == tmp_path / "code-a-b.md" and out.read_text(encoding="utf-8") == md
    assert [p.name for p in tmp_path.iterdir()] == ["code-a-b.md"]  # no temp file left
    with pytest.raises(LocalrunError, match="cannot write"):
        export_markdown(conv, out / "inside-a-file.md")


def test_when_reads_like_a_person():
    now = time.mktime((2026, 11, 30, 15, 0, 0, 0, 0, -1))
    assert when(now - 3600, now) == "14:00"
    assert when(now - 86400, now).startswith("yesterday ")
    assert when(now - 5 * 86400, now) == "2026-11-25"


# -- settings -------------------------------------------------------------------------


def chat_args(*flags):
    return build_parser().parse_args(["chat", "model.gguf", *flags])


def test_settings_round_trip_through_the_form():
    s = settings_from_args(chat_args("--temperature", "0.2", "--top-k", "7", "--seed", "3", "--max-tokens", "50",
                                     "--logit-bias", "15=-2", "--logit-bias", " Paris=-5",
                                     "--samplers", "top_k;temperature", "--no-lookup"))
    values = form_values(s)
    assert values["temperature"] == "0.2" and values["top_k"] == "7" and values["logit_bias"] == '15=-2, " Paris"=-5'
    back = parse_form(values, lookup=False, system="sys", grammar_kind="gbnf")
    assert back.sampling == s.sampling
    assert (back.max_tokens, back.lookup, back.system) == (50, False, "sys")
    # empty seed and max tokens mean "random" and "no limit"
    values.update(seed="", max_tokens="")
    back = parse_form(values, True, "", "gbnf")
    assert back.sampling.seed is None and back.max_tokens is None


@pytest.mark.parametrize(
    "field, text, message",
    [
        ("top_p", "1.5", "top_p must be in (0, 1]"),
        ("top_k", "many", "top_k must be an integer, got 'many'"),
        ("temperature", "-1", "temperature must be >= 0"),
        ("mirostat", "3", "mirostat must be 0 (off), 1 or 2"),
        ("samplers", "top_k;bogus", "unknown sampler 'bogus'"),
        ("logit_bias", "15:-2", "logit bias takes ID=BIAS"),
        ("dry_sequence_breakers", "[1, 2]", "JSON list of strings"),
        ("max_tokens", "0", "max_tokens must be at least 1"),
    ],
)
def test_form_rejects_bad_values_naming_the_field(field, text, message):
    values = form_values(settings_from_args(chat_args()))
    values[field] = text
    with pytest.raises(FieldError, match=None) as err:
        parse_form(values, True, "", "gbnf")
    assert message in str(err.value)
    assert err.value.field == field


def test_grammar_files_are_checked_when_set(tmp_path):
    values = form_values(settings_from_args(chat_args()))
    good = tmp_path / "g.gbnf"
    good.write_text('root ::= "a" | "b"\n')
    assert parse_form({**values, "grammar_path": str(good)}, True, "", "gbnf").grammar is not None
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}}')
    assert parse_form({**values, "grammar_path": str(schema)}, True, "", "json-schema").grammar is not None
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= (\n")
    with pytest.raises(FieldError) as err:
        parse_form({**values, "grammar_path": str(bad)}, True, "", "gbnf")
    assert err.value.field == "grammar_path" and str(err.value).startswith("bad.gbnf:")
    with pytest.raises(FieldError, match="cannot read the grammar file"):
        parse_form({**values, "grammar_path": str(tmp_path / "missing.gbnf")}, True, "", "gbnf")


def test_bad_chat_flags_fail_before_the_model_loads():
    with pytest.raises(BadRequestError, match="top_p"):
        settings_from_args(chat_args("--top-p", "2"))
    with pytest.raises(BadRequestError, match="--max-tokens must be at least 1"):
        settings_from_args(chat_args("--max-tokens", "0"))


# -- status line, commands, model choice ----------------------------------------------


def test_status_text_shows_what_the_engine_does():
    t = Timings(prompt_tokens=20, ttft_ms=41.4, generated_tokens=11, decode_tokens=10, decode_ms=125.0,
                drafted=8, accepted=5)
    v = StatusValues("org/repo", "Q4_K_M", "", t, True, 31, 4096, 310 << 20)
    assert status_text(v) == "repo:Q4_K_M │ TTFT 41 ms │ 80.0 tok/s │ draft 62% │ ctx 31/4096 │ mem 310 MB"
    v.lookup = False  # no draft figure when lookup is off
    assert "draft" not in status_text(v)
    v.model, v.quant = "org/repo:Q4_K_M", "Q4_K_M"  # the quant is not repeated
    assert status_text(v).startswith("repo:Q4_K_M │")  # and the org is left out
    assert status_text(StatusValues(state="loading…")) == "no model (Ctrl+O) │ loading…"
    assert [human_bytes(n) for n in (512, 1536, 98362432, 5 << 30)] == ["512 B", "1.5 KB", "94 MB", "5.0 GB"]


def test_slash_parsing_and_help_cover_every_command():
    assert parse_slash("/system  be brief ") == ("system", "be brief")
    assert parse_slash("/MODEL") == ("model", "")
    assert parse_slash("hello /model") is None
    assert parse_slash("//not a command") is None
    from localrun.tui.app import ChatApp

    for command, _, _ in SLASH_COMMANDS:  # every documented command has a handler
        assert callable(getattr(ChatApp, "slash_" + command[1:]))
        assert command in help_text()


@dataclass
class FakeModel:
    name: str
    path: Path
    size_bytes: int


def test_best_model_prefers_gpu_fit_then_size():
    models = [FakeModel("big", Path("big"), 9 << 30), FakeModel("gpu", Path("gpu"), 4 << 30),
              FakeModel("huge", Path("huge"), 90 << 30), FakeModel("gpu-small", Path("gpu-small"), 1 << 30)]
    verdicts = {"big": "CPU", "gpu": "Full GPU", "huge": "Won't fit", "gpu-small": "Full GPU"}
    assert best_model(models, lambda p: verdicts[str(p)]).name == "gpu"
    assert best_model(models[:1] + models[2:3], lambda p: verdicts[str(p)]).name == "big"
    assert best_model(models[2:3], lambda p: verdicts[str(p)]) is None


def test_initial_model_is_the_last_used_one_when_installed(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    models = [FakeModel("a", tmp_path / "a.gguf", 1), FakeModel("b", tmp_path / "b.gguf", 2)]
    args = SimpleNamespace(model=None, ctx=None)
    assert initial_model(args, store, lambda: models, lambda p, n_ctx: "CPU") == (tmp_path / "b.gguf", "b")  # largest
    store.save(None, "t", "a", "", [{"role": "user", "content": "x"}])
    assert initial_model(args, store, lambda: models, lambda p, n_ctx: "CPU") == (tmp_path / "a.gguf", "a")
    assert initial_model(args, store, lambda: [], lambda p, n_ctx: "CPU") is None  # the app opens the picker


# -- fitting the conversation into the context ----------------------------------------


def test_fit_prompt_drops_oldest_turns_then_refuses(llama_engine):
    session = ChatSession()
    session.engine = llama_engine  # n_ctx 1024
    turn = "tell me about the sea " * 25  # ~150 tokens
    messages = []
    for i in range(8):
        messages += [{"role": "user", "content": f"{i}: {turn}"}, {"role": "assistant", "content": turn}]
    messages.append({"role": "user", "content": "last question"})
    tokens, dropped = session.fit_prompt(messages, "system text", reserve=200)
    assert len(tokens) + 200 <= llama_engine.n_ctx
    assert dropped > 0 and dropped % 2 == 0  # whole turns: the kept part starts with a user message
    assert tokens == llama_engine.chat_prompt([{"role": "system", "content": "system text"}] + messages[dropped:])
    # nothing to drop when it fits
    assert session.fit_prompt(messages[-3:], "", 200)[1] == 0
    with pytest.raises(ContextExceededError, match="shorten it, or restart with a larger --ctx"):
        session.fit_prompt([{"role": "user", "content": "word " * 2000}], "", 100)


# -- answer feed and frame pacing ------------------------------------------------------


def test_feed_hands_over_every_piece_once_in_order_with_the_latest_timings():
    feed = AnswerFeed()
    t1, t2 = Timings(generated_tokens=1), Timings(generated_tokens=2)
    feed.put("Hel", t1)
    feed.put("", t2, ["call"])
    batch = feed.take()
    assert batch.pieces == [("Hel", None), ("", ["call"])] and batch.timings is t2
    empty = feed.take()
    assert empty.pieces == [] and empty.timings is None  # not the same pieces again
    feed.put("lo", t1)
    assert feed.take().pieces == [("lo", None)]


def test_feed_loses_and_repeats_nothing_while_a_thread_puts_and_another_takes():
    import threading

    feed, taken, n = AnswerFeed(), [], 20000
    producer = threading.Thread(target=lambda: [feed.put(f"{i},", Timings(generated_tokens=i)) for i in range(n)])
    producer.start()
    while producer.is_alive():
        taken.extend(text for text, _ in feed.take().pieces)
    producer.join()
    last = feed.take()
    taken.extend(text for text, _ in last.pieces)
    assert "".join(taken) == "".join(f"{i}," for i in range(n))


def test_pacer_keeps_the_frame_rate_and_backs_off_when_drawing_gets_expensive():
    p = FramePacer(hz=10, max_share=0.1)
    assert p.due(0.0, 0.0)  # the first frame at once
    p.drawn(0.0, 0.0)
    assert not p.due(0.05, 0.0)  # under 1/10 s since the last frame
    assert p.due(0.1, 0.0)  # cheap frames come at the frame rate
    assert not p.due(0.1, 0.05)  # the UI thread used 50 ms of CPU in 100 ms: over 10%
    assert not p.due(0.49, 0.05)
    assert p.due(0.5, 0.05)  # 50 ms in 500 ms is 10%
    p.drawn(0.5, 0.05)
    assert not p.due(0.55, 0.05) and p.due(0.65, 0.06)  # counted from the last frame, not from the start


def test_pacer_shows_the_answer_every_max_gap_however_busy_the_ui_thread_is():
    """Input, layout or a test's pilot keep the event loop's thread busy too: the share rule
    thins frames out, but never holds the answer (and its status line) back for longer."""
    p = FramePacer(hz=10, max_share=0.03, max_gap=0.5)
    p.drawn(0.0, 0.0)
    assert not p.due(0.3, 0.3)  # the UI thread was busy the whole time: over its share
    assert p.due(0.5, 0.5)  # but half a second has passed
    p.drawn(0.5, 0.5)
    assert not p.due(0.9, 0.9) and p.due(1.0, 1.0)


def test_collector_pause_hides_existing_objects_from_full_collections_until_released():
    pause = CollectorPause()
    before = gc.get_freeze_count()
    assert before == 0
    pause.hold()
    try:
        assert gc.get_freeze_count() > 0  # what existed is out of the collector's walk
        frozen = gc.get_freeze_count()
        pause.hold()  # a second hold changes nothing (and needs no second release)
        assert gc.get_freeze_count() == frozen
    finally:
        pause.release()
    assert gc.get_freeze_count() == 0  # handed back: their garbage is collectable again
    pause.release()
    assert gc.get_freeze_count() == 0


def test_warming_the_highlighter_compiles_a_languages_rules_before_any_answer_needs_them():
    from pygments.lexers.python import PythonLexer

    if "_tokens" in PythonLexer.__dict__:
        del PythonLexer._tokens  # compiled by an earlier test: start from a cold lexer
    warm_highlighter(("python",))
    assert "_tokens" in PythonLexer.__dict__


@pytest.mark.parametrize("hz, share", [(0, 0.1), (-5, 0.1), (10, 0), (10, 1.5)])
def test_pacer_rejects_a_rate_or_share_that_cannot_work(hz, share):
    with pytest.raises(ValueError, match="frame rate must be > 0"):
        FramePacer(hz=hz, max_share=share)
