"""Saved conversations: one SQLite file in the user's data folder.

Every exchange is saved as it completes, so yesterday's chat is there even if the app
was closed with Ctrl+Q; `/save TITLE` only names it. A save writes only what changed
(the new messages, a rewritten answer, rows past a shortened end), in one transaction.

Two chat windows may share the file (WAL mode: readers never wait for a writer). Each
conversation carries a version, bumped by every save and rename; a store remembers the
version it last read or wrote, and a save of a conversation that someone else changed
since raises ConversationConflictError instead of overwriting their messages. The check
and the write sit in one BEGIN IMMEDIATE transaction, so no other writer slips between.

    store = ConversationStore.open()              # $LOCALRUN_DATA/conversations.db
    cid = store.save(None, "Colors", "org/repo:Q4_K_M", "", messages)
    store.list()[0].title == "Colors"
    store.load(cid).messages == messages
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from localrun.errors import LocalrunError
from localrun.quant.atomic import fsync_dir, fsync_file
from localrun.store.local import data_dir  # $LOCALRUN_DATA, else the platform's user data folder

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    version INTEGER NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    reasoning TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
"""
BUSY_TIMEOUT_S = 5.0  # how long a save waits for another window's write to finish


class ConversationConflictError(LocalrunError):
    """Another chat window changed the conversation after this one read it; nothing was written."""

    def __init__(self, cid: int, title: str) -> None:
        self.cid, self.title = cid, title
        shown = " ".join(title.split())[:60]  # one line, whatever the title holds
        super().__init__(f"conversation {cid} (“{shown}”) was changed by another chat window since this"
                         " one read it; it was not overwritten")

    def __reduce__(self):
        return type(self), (self.cid, self.title)


@dataclass(frozen=True)
class ConversationSummary:
    id: int
    title: str
    model: str
    updated: float
    n_messages: int


@dataclass
class Conversation:
    id: int | None
    title: str
    model: str = ""
    system: str = ""
    messages: list[dict] = field(default_factory=list)  # {"role", "content"[, "reasoning_content"]}
    updated: float = 0.0
    version: int = 0  # what load() read; save(version=...) refuses to overwrite a newer one


def default_title(messages: list[dict], limit: int = 60) -> str:
    """The first line of the first user message, cut to `limit` characters."""
    for m in messages:
        if m["role"] == "user" and m["content"].strip():
            line = m["content"].strip().splitlines()[0].strip()
            return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"
    return "New chat"


class ConversationStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: dict[int, int] = {}  # conversation id -> the version this store last read or wrote
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # one connection, used from the UI thread only; generation never touches it.
            # isolation_level=None: transactions are opened by hand (BEGIN IMMEDIATE below).
            self._db = sqlite3.connect(path, check_same_thread=False, timeout=BUSY_TIMEOUT_S,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")  # stays 'delete' where WAL cannot work
            self._db.execute("PRAGMA foreign_keys = ON")
            with self._transaction():
                for statement in _SCHEMA.split(";"):  # not executescript: it would COMMIT first
                    if statement.strip():
                        self._db.execute(statement)
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(conversations)")}
                if "version" not in columns:  # a store written before versions existed
                    self._db.execute("ALTER TABLE conversations ADD COLUMN version INTEGER NOT NULL DEFAULT 1")
                if "reasoning" not in {row[1] for row in self._db.execute("PRAGMA table_info(messages)")}:
                    # a store written before thinking was kept apart: its answers have none
                    self._db.execute("ALTER TABLE messages ADD COLUMN reasoning TEXT NOT NULL DEFAULT ''")
        except (OSError, sqlite3.Error) as exc:
            raise LocalrunError(
                f"cannot open the conversation store {path}: {exc}; set LOCALRUN_DATA to a writable folder"
            ) from None

    @classmethod
    def open(cls, folder: Path | None = None) -> "ConversationStore":
        return cls((folder or data_dir()) / "conversations.db")

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _transaction(self, write: bool = True) -> Iterator[None]:
        """A write takes the lock before it reads (BEGIN IMMEDIATE), so a check and the
        write it guards see the same rows: a deferred transaction could read a version
        that another window changes before this one writes. A read gets one snapshot."""
        self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def save(self, cid: int | None, title: str, model: str, system: str, messages: list[dict],
             version: int | None = None) -> int:
        """Create (cid None) or update a conversation; returns its id.

        An update checks that the stored conversation is still the one this caller read:
        `version` when given (Conversation.version from load), else the version this
        store last read or wrote. A conversation changed by someone else since, or one
        this store never read, raises ConversationConflictError and nothing is written.
        A conversation deleted meanwhile is saved again as a new one."""
        now = time.time()
        try:
            with self._transaction():
                row = None if cid is None else self._db.execute(
                    "SELECT version, title FROM conversations WHERE id = ?", (cid,)).fetchone()
                if row is None:
                    cur = self._db.execute(
                        "INSERT INTO conversations (title, model, system, created, updated, version)"
                        " VALUES (?, ?, ?, ?, ?, 1)", (title, model, system, now, now))
                    cid, new_version = int(cur.lastrowid), 1
                    self._append(cid, 0, messages)
                else:
                    expected = version if version is not None else self._seen.get(cid)
                    if expected != row[0]:
                        raise ConversationConflictError(cid, row[1])
                    new_version = row[0] + 1
                    self._db.execute(
                        "UPDATE conversations SET title = ?, model = ?, system = ?, updated = ?, version = ?"
                        " WHERE id = ?", (title, model, system, now, new_version, cid))
                    self._write_changes(cid, messages)
        except sqlite3.Error as exc:
            raise LocalrunError(f"cannot save the conversation to {self.path}: {exc}") from None
        self._seen[cid] = new_version
        return cid

    def known_version(self, cid: int) -> int | None:
        """The version of `cid` this store last read or wrote (None: never); a caller that
        keeps it and passes it to save(version=...) is immune to other reads in between."""
        return self._seen.get(cid)

    def _append(self, cid: int, start: int, messages: list[dict]) -> None:
        self._db.executemany(
            "INSERT INTO messages (conversation_id, position, role, content, reasoning) VALUES (?, ?, ?, ?, ?)",
            [(cid, start + i, *_row(m)) for i, m in enumerate(messages)])

    def _write_changes(self, cid: int, messages: list[dict]) -> None:
        """Rewrite only the rows that differ: an exchange appends two rows, a regenerated
        answer updates one, a shortened conversation drops its tail."""
        stored = self._db.execute(
            "SELECT position, role, content, reasoning FROM messages WHERE conversation_id = ? ORDER BY position",
            (cid,)).fetchall()
        if [r[0] for r in stored] != list(range(len(stored))):  # gaps or doubles (hand edits): start over
            self._db.execute("DELETE FROM messages WHERE conversation_id = ?", (cid,))
            self._append(cid, 0, messages)
            return
        changed = [(*_row(m), cid, i) for i, (m, r) in enumerate(zip(messages, stored)) if _row(m) != tuple(r[1:])]
        self._db.executemany(
            "UPDATE messages SET role = ?, content = ?, reasoning = ? WHERE conversation_id = ? AND position = ?",
            changed)
        self._db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?", (cid, len(messages)))
        self._append(cid, len(stored), messages[len(stored):])

    def list(self) -> list[ConversationSummary]:
        """Most recently updated first."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) FROM conversations c"
            " LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC"
        ).fetchall()
        return [ConversationSummary(int(r[0]), r[1], r[2], float(r[3]), int(r[4])) for r in rows]

    def load(self, cid: int) -> Conversation:
        with self._transaction(write=False):  # one snapshot: the messages belong to the version read
            row = self._db.execute(
                "SELECT title, model, system, updated, version FROM conversations WHERE id = ?", (cid,)).fetchone()
            msgs = [] if row is None else self._db.execute(
                "SELECT role, content, reasoning FROM messages WHERE conversation_id = ? ORDER BY position", (cid,)
            ).fetchall()
        if row is None:
            raise LocalrunError(f"conversation {cid} does not exist (it may have been deleted)")
        self._seen[cid] = int(row[4])
        messages = [{"role": r, "content": c, **({"reasoning_content": t} if t else {})} for r, c, t in msgs]
        return Conversation(cid, row[0], row[1], row[2], messages, float(row[3]), int(row[4]))

    def rename(self, cid: int, title: str) -> None:
        """Set a title. A rename is a change other windows must see: it bumps the version
        (this store keeps up with it only when it had read the version it renamed)."""
        title = title.strip()
        if not title:
            raise LocalrunError("a conversation title cannot be empty")
        with self._transaction():
            row = self._db.execute("SELECT version FROM conversations WHERE id = ?", (cid,)).fetchone()
            if row is None:
                return
            self._db.execute("UPDATE conversations SET title = ?, version = version + 1 WHERE id = ?", (title, cid))
        if self._seen.get(cid) == row[0]:
            self._seen[cid] = row[0] + 1

    def delete(self, cid: int) -> None:
        with self._transaction():
            self._db.execute("DELETE FROM conversations WHERE id = ?", (cid,))
        self._seen.pop(cid, None)

    def last_model(self) -> str | None:
        """The model of the most recently updated conversation (what `chat` reopens)."""
        row = self._db.execute(
            "SELECT model FROM conversations WHERE model != '' ORDER BY updated DESC, id DESC LIMIT 1"
        ).fetchone()
        return row[0] if row else None


def _row(message: dict) -> tuple[str, str, str]:
    """A message's columns: role, content, and the thinking before the answer (a thinking
    model's `reasoning_content`, which the chat shows folded and the template may show)."""
    return message["role"], message["content"], message.get("reasoning_content") or ""


def to_markdown(conv: Conversation) -> str:
    lines = [f"# {conv.title}", ""]
    if conv.model:
        lines += [f"*Model: {conv.model}*", ""]
    if conv.system:
        lines += ["## System", "", conv.system, ""]
    for m in conv.messages:
        lines += [f"## {m['role'].capitalize()}", "", m["content"], ""]
    return "\n".join(lines)


def export_markdown(conv: Conversation, path: Path) -> Path:
    """Write the conversation as Markdown; a temp file renamed into place, never half a file."""
    path = path.expanduser()
    if path.is_dir():
        path = path / f"{_slug(conv.title)}.md"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".export-", suffix=".md")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(to_markdown(conv))
            fsync_file(tmp)  # the bytes on the disk before the name points at them
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise LocalrunError(f"cannot write {path}: {exc.strerror or exc}; choose another path (/export PATH)") from None
    return path


def _slug(title: str) -> str:
    keep = "".join(c.lower() if c.isalnum() else "-" for c in title)
    return "-".join(p for p in keep.split("-") if p)[:60] or "chat"
