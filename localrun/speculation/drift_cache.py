"""A model's batch drift (drift.BatchDrift), remembered between runs.

Measuring the drift costs the first speculative steps their speed (each is decoded
again one row at a time), which a one-shot `localrun run` would pay on every answer.
The drift is a property of the model file and of the kernels that run it, so it is
kept per (backend, its version, KV cache type, flash attention on or off, the model's
bytes: datafiles.file_identity, so a copy elsewhere is the same model) in `batch-drift.json` in the cache folder (datafiles.cache_dir). A cache that cannot be read or written only
means measuring again: it never stops an answer.
"""

from __future__ import annotations

from importlib import metadata

from .drift import BatchDrift
from .. import datafiles

FILE_NAME = "batch-drift.json"

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
    identity = datafiles.file_identity(path)
    if identity is None:
        return None
    kv = getattr(backend, "kv_cache_type", None) or "f16"
    fa = getattr(backend, "flash_attn", None) or "-"  # another attention kernel drifts otherwise
    return f"{info.backend}|{_version(info.backend)}|kv={kv}|fa={fa}|{identity}"


def recall(backend) -> BatchDrift:
    """The drift measured for this model before, else a fresh one to measure."""
    key = drift_key(backend)
    worst = datafiles.read_cache(FILE_NAME).get(key) if key else None
    if isinstance(worst, (int, float)) and worst >= 0:
        return BatchDrift.known(float(worst))
    return BatchDrift()


def remember(backend, drift: BatchDrift) -> None:
    """Keep a finished measurement for the next run of this model."""
    key = drift_key(backend)
    if key is None or drift.calibrating:
        return
    datafiles.remember(FILE_NAME, {key: drift.worst})
