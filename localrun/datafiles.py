"""The user data folder, and the cache folder with the small measurement caches: one JSON
object per file, a key per thing measured (a model on a machine), newest last, whole or
not at all on disk. A foundation, so that any room may remember what it measured (the
llama.cpp backend its flash-attention timings, speculation its batch drift).

The measurements are a cache, not the user's data: they live apart from the
conversations and models, so that a run with a private data folder (a test, a second
profile) still finds what this machine measured instead of timing every model again.

What lives in these caches is worth a few seconds of measuring, never an answer: a file
that cannot be read or written only means measuring again, so errors are logged, not
raised."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import sys
from pathlib import Path

MAX_ENTRIES = 256  # keys kept per cache file; the oldest go first
IDENTITY_SPAN = 1 << 20  # bytes hashed at each end of a model file for its identity

log = logging.getLogger(__name__)


def data_dir() -> Path:
    """The user data folder: $LOCALRUN_DATA, else the platform's convention."""
    return _platform_folder("LOCALRUN_DATA", "Application Support", "XDG_DATA_HOME", ".local/share")


def cache_dir() -> Path:
    """The measurement caches' folder: $LOCALRUN_CACHE, else the platform's cache folder."""
    return _platform_folder("LOCALRUN_CACHE", "Caches", "XDG_CACHE_HOME", ".cache", mine="measured")


def _platform_folder(env: str, mac: str, xdg: str, xdg_default: str, mine: str = "") -> Path:
    """$env, else localrun's folder (and its `mine` subfolder) in ~/Library/`mac` on a
    Mac, %LOCALAPPDATA% on Windows, $`xdg` or ~/`xdg_default` elsewhere."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        base = home / "Library" / mac
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
        mine = mine and "cache"
    else:
        base = Path(os.environ.get(xdg) or home / xdg_default)
    return base / "localrun" / mine if mine else base / "localrun"


def cache_path(name: str) -> Path:
    return cache_dir() / name


def file_identity(path: str | os.PathLike[str]) -> str | None:
    """What a measurement of a model is keyed by: its size and a hash of the first and
    last IDENTITY_SPAN bytes of its file (for an MLX folder, of each file in it). Not
    its path or mtime: a copy in another folder (a test's temporary one, a moved store)
    is the same model, measured once, and its key does not pile up a new entry per copy.
    A GGUF's first MiB holds its header (every tensor's type and shape), so any other
    quantization or architecture reads as another model. None where it cannot be read."""
    try:
        real = Path(path).resolve()
        files = sorted(f for f in real.iterdir() if f.is_file()) if real.is_dir() else [real]
        h = hashlib.sha256()
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.name if real.is_dir() else ''}|{size}|".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(IDENTITY_SPAN))
                if size > 2 * IDENTITY_SPAN:
                    fh.seek(size - IDENTITY_SPAN)
                    h.update(fh.read(IDENTITY_SPAN))
    except OSError:
        return None
    return h.hexdigest()[:32]


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
