"""A model's batch drift (drift.BatchDrift), remembered between runs.

Measuring the drift costs the first speculative steps their speed (each is decoded
again one row at a time), which a one-shot `localrun run` would pay on every answer.
The drift is a property of the model file and of the kernels that run it, so it is
kept per (backend, its version, KV cache type, flash attention on or off, the model's real
path, size and mtime)
in `batch-drift.json` in the data folder. A cache that cannot be read or written only
means measuring again: it never stops an answer.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from importlib import metadata
from pathlib import Path

from .drift import BatchDrift
from ..store.local import data_dir

FILE_NAME = "batch-drift.json"
MAX_ENTRIES = 256  # models remembered; the oldest entries go first

log = logging.getLogger(__name__)

_PACKAGES = {"llama.cpp": "llama_cpp_python", "mlx": "mlx"}


def _version(backend_name: str) -> str:
    try:
        return metadata.version(_PACKAGES.get(backend_name, backend_name))
    except metadata.PackageNotFoundError:
        return "unknown"


def drift_key(backend) -> str | None:
    """The key of this backend's model, or None for one without a model on disk."""
    info = getattr(backend, "info", None)
    path = getattr(info, "path", None)
    if not path:
        return None
    try:
        real = Path(path).resolve()
        st = real.stat()
    except OSError:
        return None
    kv = getattr(backend, "kv_cache_type", None) or "f16"
    fa = getattr(backend, "flash_attn", None) or "-"  # another attention kernel drifts otherwise
    return f"{info.backend}|{_version(info.backend)}|kv={kv}|fa={fa}|{real}|{st.st_size}|{st.st_mtime_ns}"


def _path() -> Path:
    return data_dir() / FILE_NAME


def _read() -> dict:
    try:
        data = json.loads(_path().read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}
    return data if isinstance(data, dict) else {}


def recall(backend) -> BatchDrift:
    """The drift measured for this model before, else a fresh one to measure."""
    key = drift_key(backend)
    worst = _read().get(key) if key else None
    if isinstance(worst, (int, float)) and worst >= 0:
        return BatchDrift.known(float(worst))
    return BatchDrift()


def remember(backend, drift: BatchDrift) -> None:
    """Keep a finished measurement for the next run of this model."""
    key = drift_key(backend)
    if key is None or drift.calibrating:
        return
    data = _read()
    data.pop(key, None)
    data[key] = drift.worst  # newest last: the oldest are dropped when the file is full
    while len(data) > MAX_ENTRIES:
        data.pop(next(iter(data)))
    out = _path()
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=0))
        os.replace(tmp, out)  # whole or not at all, even with two processes writing
    except OSError as e:  # the next run measures again; nothing else depends on it
        log.info("could not keep the batch drift in %s: %s", out, e)
    finally:
        tmp.unlink(missing_ok=True)
