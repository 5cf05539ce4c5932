"""The conversation store shared by several chat windows: WAL mode, saves that write only
what changed, and a version check so a second window never silently overwrites a
conversation someone else changed after it was read."""

from __future__ import annotations

import pickle
import sqlite3

import pytest

from localrun.errors import LocalrunError
from localrun.tui.conversations import ConversationConflictError, ConversationStore

HI = {"role": "user", "content": "Hi"}
HELLO = {"role": "assistant", "content": "Hello!"}


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def rows(path, cid: int) -> list[tuple]:
    """(row id, position, role, content) of a conversation's messages, read by a third connection."""
    with sqlite3.connect(path) as db:
        return db.execute("SELECT id, position, role, content FROM messages WHERE conversation_id = ?"
                          " ORDER BY position", (cid,)).fetchall()


def test_the_store_runs_in_wal_mode(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    with sqlite3.connect(tmp_path / "c.db") as other:  # WAL is a property of the file: every opener sees it
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_save_writes_only_what_changed(tmp_path):
    path = tmp_path / "c.db"
    store = ConversationStore(path)
    cid = store.save(None, "t", "m", "", [HI, HELLO])
    store.save(None, "later", "m", "", [HI])  # rows after cid's: a re-insert could not reuse cid's row ids
    first = rows(path, cid)

    store.save(cid, "t", "m", "", [HI, HELLO, msg("user", "More?"), msg("assistant", "Yes.")])
    after_append = rows(path, cid)
    assert after_append[:2] == first  # the old rows were kept (same row ids), not deleted and re-inserted
    assert [r[3] for r in after_append] == ["Hi", "Hello!", "More?", "Yes."]

    store.save(cid, "t", "m", "", [HI, HELLO, msg("user", "More?"), msg("assistant", "No.")])  # regenerated
    after_regen = rows(path, cid)
    assert after_regen[:3] == after_append[:3] and after_regen[3][0] == after_append[3][0]
    assert after_regen[3][3] == "No."

    store.save(cid, "t", "m", "", [HI])  # cleared back to the question
    assert rows(path, cid) == first[:1]
    assert store.load(cid).messages == [HI]


def test_a_second_window_with_a_stale_copy_gets_a_conflict_and_nothing_is_lost(tmp_path):
    path = tmp_path / "c.db"
    one, two = ConversationStore(path), ConversationStore(path)  # two chat windows, one file
    cid = one.save(None, "Colors", "m", "", [msg("user", "Name a color."), msg("assistant", "Blue.")])

    seen_by_two = two.load(cid)  # window two opens the conversation
    one_msgs = seen_by_two.messages + [msg("user", "Another?"), msg("assistant", "Red.")]
    one.save(cid, "Colors", "m", "", one_msgs)  # window one goes on chatting

    two_msgs = seen_by_two.messages + [msg("user", "A fruit?"), msg("assistant", "Apple.")]
    with pytest.raises(ConversationConflictError) as ei:
        two.save(cid, "Colors", "m", "", two_msgs)  # window two's copy is stale
    assert isinstance(ei.value, LocalrunError)
    text = str(ei.value)
    assert "\n" not in text and "another chat window" in text and "Colors" in text and "not overwritten" in text
    assert one.load(cid).messages == one_msgs and two.load(cid).messages == one_msgs  # window one's answer stands

    # having read the new version, window two may save on top of it
    two.save(cid, "Colors", "m", "", one_msgs + [msg("user", "A fruit?")])
    assert [m["content"] for m in one.load(cid).messages][-1] == "A fruit?"


def test_an_explicit_version_is_checked_too(tmp_path):
    """A caller that keeps Conversation.version (the chat app) is checked against it, even
    when the same store has read a newer version since (a history list opened meanwhile)."""
    path = tmp_path / "c.db"
    one, two = ConversationStore(path), ConversationStore(path)
    cid = one.save(None, "t", "m", "", [HI])
    mine = one.load(cid)
    assert one.known_version(cid) == mine.version and two.known_version(cid) is None
    two.load(cid)
    two.save(cid, "t", "m", "", [HI, HELLO])
    one.load(cid)  # e.g. the history list shows the title: the store's own memory moves on
    with pytest.raises(ConversationConflictError):
        one.save(cid, "t", "m", "", [HI, msg("assistant", "Hey.")], version=mine.version)
    assert one.load(cid).messages == [HI, HELLO]


def test_a_rename_elsewhere_is_a_change_and_a_delete_saves_anew(tmp_path):
    path = tmp_path / "c.db"
    one, two = ConversationStore(path), ConversationStore(path)
    cid = one.save(None, "t", "m", "", [HI])
    two.load(cid)
    one.rename(cid, "Renamed")
    one.save(cid, "Renamed", "m", "", [HI, HELLO])  # the renaming window itself goes on
    with pytest.raises(ConversationConflictError):
        two.save(cid, "t", "m", "", [HI, msg("assistant", "Other.")])
    assert one.load(cid).title == "Renamed"

    two.load(cid)
    one.delete(cid)
    new = two.save(cid, "Renamed", "m", "", [HI, HELLO])  # deleted meanwhile: kept as a new conversation
    assert two.load(new).messages == [HI, HELLO]


def test_a_store_never_overwrites_a_conversation_it_never_read(tmp_path):
    path = tmp_path / "c.db"
    cid = ConversationStore(path).save(None, "t", "m", "", [HI, HELLO])
    with pytest.raises(ConversationConflictError):
        ConversationStore(path).save(cid, "t", "m", "", [HI])
    assert ConversationStore(path).load(cid).messages == [HI, HELLO]


def test_a_store_written_before_versions_opens_and_saves(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the schema as it was: no version column
        db.executescript("""
            CREATE TABLE conversations (id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
                system TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
            CREATE TABLE messages (id INTEGER PRIMARY KEY, conversation_id INTEGER NOT NULL
                REFERENCES conversations(id) ON DELETE CASCADE, position INTEGER NOT NULL, role TEXT NOT NULL,
                content TEXT NOT NULL);
            INSERT INTO conversations VALUES (7, 'old', 'm', '', 1.0, 1.0);
            INSERT INTO messages (conversation_id, position, role, content) VALUES (7, 0, 'user', 'Hi');
        """)
    store = ConversationStore(path)
    conv = store.load(7)
    assert conv.messages == [HI] and conv.version == 1
    store.save(7, "old", "m", "", [HI, HELLO])
    assert store.load(7).messages == [HI, HELLO]


def test_a_thinking_models_thinking_is_kept_with_its_answer(tmp_path):
    """The thinking before an answer (`reasoning_content`) is saved and loaded with it, a
    regenerated answer's new thinking replaces the old in place, and an answer without
    thinking loads without the key (a store from before thinking was kept apart opens:
    test_a_store_written_before_versions_opens_and_saves)."""
    path = tmp_path / "c.db"
    store = ConversationStore(path)
    thought = dict(HELLO, reasoning_content="The user greets me; greet back.")
    cid = store.save(None, "t", "m", "", [HI, thought])
    assert store.load(cid).messages == [HI, thought]
    before = rows(path, cid)
    rethought = dict(HELLO, reasoning_content="A short greeting will do.")
    store.save(cid, "t", "m", "", [HI, rethought])
    assert rows(path, cid) == before  # same rows, same content: only the thinking changed
    assert store.load(cid).messages == [HI, rethought]
    store.save(cid, "t", "m", "", [HI, HELLO])
    assert store.load(cid).messages == [HI, HELLO]


def test_conflict_error_survives_pickling():
    e = ConversationConflictError(3, "Line one\nline two")
    assert "\n" not in str(e) and str(pickle.loads(pickle.dumps(e))) == str(e)


def test_an_export_is_synced_before_its_rename(tmp_path, monkeypatch):
    import os

    from localrun.tui.conversations import Conversation, export_markdown

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), real_replace(a, b))[1])
    out = export_markdown(Conversation(1, "Colors", messages=[HI]), tmp_path / "c.md")
    ino = out.stat().st_ino
    assert events[:2] == [("fsync", ino), ("replace", ino)] and events[2] == ("fsync", tmp_path.stat().st_ino)
