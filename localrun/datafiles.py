"""The user data folder and the small measurement caches kept in it: one JSON object per
file, a key per thing measured (a model on a machine), newest last, whole or not at all
on disk. A foundation, so that any room may remember what it measured (the llama.cpp
backend its flash-attention timings, speculation its batch drift).

What lives in these caches is worth a few seconds of measuring, never an answer: a file
that cannot be read or written only means measuring again, so errors are logged, not
raised."""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
from pathlib import Path

MAX_ENTRIES = 256  # keys kept per cache file; the oldest go first

log = logging.getLogger(__name__)


def data_dir() -> Path:
    """The user data folder: $LOCALRUN_DATA, else the platform's convention."""
    env = os.environ.get("LOCALRUN_DATA")
    if env:
        return Path(env).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Application Support" / "localrun"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local") / "localrun"
    return Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share") / "localrun"


def cache_path(name: str) -> Path:
    return data_dir() / name


def read_cache(name: str) -> dict:
    """The whole cache, or {} where there is none yet or it is unreadable."""
    try:
        data = json.loads(cache_path(name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember(name: str, entries: dict) -> None:
    """Add or refresh `entries` (key -> JSON value), newest last, keeping MAX_ENTRIES."""
    data = read_cache(name)
    for key, value in entries.items():
        data.pop(key, None)
        data[key] = value
    while len(data) > MAX_ENTRIES:
        data.pop(next(iter(data)))
    out = cache_path(name)
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=0))
        os.replace(tmp, out)  # whole or not at all, even with two processes writing
    except OSError as e:  # the next run measures again; nothing else depends on it
        log.info("could not keep a measurement in %s: %s", out, e)
    finally:
        tmp.unlink(missing_ok=True)
