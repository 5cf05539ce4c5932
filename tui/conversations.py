"""Saved conversations: one SQLite file in the user's data folder.

Every exchange is saved as it completes, so yesterday's chat is there even if the app
was closed with Ctrl+Q; `/save TITLE` only names it. A conversation is small (a few
hundred messages at most), so saving rewrites its message rows in one transaction:
simple, and a regenerated or cleared answer can never leave stale rows behind.

    store = ConversationStore.open()              # $LOCALRUN_DATA/conversations.db
    cid = store.save(None, "Colors", "org/repo:Q4_K_M", "", messages)
    store.list()[0].title == "Colors"
    store.load(cid).messages == messages
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from localrun.errors import LocalrunError
from localrun.store import data_dir  # $LOCALRUN_DATA, else the platform's user data folder

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    system TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
"""


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
    messages: list[dict] = field(default_factory=list)  # {"role", "content"}
    updated: float = 0.0


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
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # one connection, used from the UI thread only; generation never touches it
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("PRAGMA foreign_keys = ON")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise LocalrunError(
                f"cannot open the conversation store {path}: {exc}; set LOCALRUN_DATA to a writable folder"
            ) from None

    @classmethod
    def open(cls, folder: Path | None = None) -> "ConversationStore":
        return cls((folder or data_dir()) / "conversations.db")

    def close(self) -> None:
        self._db.close()

    def save(self, cid: int | None, title: str, model: str, system: str, messages: list[dict]) -> int:
        """Create (cid None) or overwrite a conversation; returns its id."""
        now = time.time()
        with self._db:  # one transaction: all of it is saved, or none
            if cid is None or not self._exists(cid):
                cur = self._db.execute(
                    "INSERT INTO conversations (title, model, system, created, updated) VALUES (?, ?, ?, ?, ?)",
                    (title, model, system, now, now),
                )
                cid = int(cur.lastrowid)
            else:
                self._db.execute(
                    "UPDATE conversations SET title = ?, model = ?, system = ?, updated = ? WHERE id = ?",
                    (title, model, system, now, cid),
                )
                self._db.execute("DELETE FROM messages WHERE conversation_id = ?", (cid,))
            self._db.executemany(
                "INSERT INTO messages (conversation_id, position, role, content) VALUES (?, ?, ?, ?)",
                [(cid, i, m["role"], m["content"]) for i, m in enumerate(messages)],
            )
        return cid

    def _exists(self, cid: int) -> bool:
        return self._db.execute("SELECT 1 FROM conversations WHERE id = ?", (cid,)).fetchone() is not None

    def list(self) -> list[ConversationSummary]:
        """Most recently updated first."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.model, c.updated, COUNT(m.id) FROM conversations c"
            " LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC"
        ).fetchall()
        return [ConversationSummary(int(r[0]), r[1], r[2], float(r[3]), int(r[4])) for r in rows]

    def load(self, cid: int) -> Conversation:
        row = self._db.execute("SELECT title, model, system, updated FROM conversations WHERE id = ?", (cid,)).fetchone()
        if row is None:
            raise LocalrunError(f"conversation {cid} does not exist (it may have been deleted)")
        msgs = self._db.execute(
            "SELECT role, content FROM messages WHERE conversation_id = ? ORDER BY position", (cid,)
        ).fetchall()
        return Conversation(cid, row[0], row[1], row[2], [{"role": r, "content": c} for r, c in msgs], float(row[3]))

    def rename(self, cid: int, title: str) -> None:
        title = title.strip()
        if not title:
            raise LocalrunError("a conversation title cannot be empty")
        with self._db:
            self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, cid))

    def delete(self, cid: int) -> None:
        with self._db:
            self._db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    def last_model(self) -> str | None:
        """The model of the most recently updated conversation (what `chat` reopens)."""
        row = self._db.execute(
            "SELECT model FROM conversations WHERE model != '' ORDER BY updated DESC, id DESC LIMIT 1"
        ).fetchone()
        return row[0] if row else None


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
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise LocalrunError(f"cannot write {path}: {exc.strerror or exc}; choose another path (/export PATH)") from None
    return path


def _slug(title: str) -> str:
    keep = "".join(c.lower() if c.isalnum() else "-" for c in title)
    return "-".join(p for p in keep.split("-") if p)[:60] or "chat"
