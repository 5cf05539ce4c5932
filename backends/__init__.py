"""Backends behind one protocol (`base.Backend`), chosen by what the model path holds:
a `.gguf` file runs on llama.cpp, a folder with `config.json` and safetensors on MLX."""

from __future__ import annotations

from pathlib import Path

from localrun.errors import BadRequestError, ModelNotFoundError, UnsupportedFormatError
from localrun.quant.quant_types import KV_CACHE_TYPES

from .base import Backend, BatchEntry, ModelInfo

__all__ = [
    "KV_CACHE_TYPES", "Backend", "BatchEntry", "ModelInfo", "check_kv_cache_type", "detect_format", "open_backend"
]


def check_kv_cache_type(kv_cache_type: str | None) -> str:
    """The KV cache element type to use ("f16" when None), or a one-line error naming the flag."""
    kind = "f16" if kv_cache_type is None else kv_cache_type
    if kind not in KV_CACHE_TYPES:
        raise BadRequestError(f"--kv-cache-type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}")
    return kind


def detect_format(path: str | Path) -> str:
    """Return "gguf" or "mlx" for a model path, or raise a one-line error saying what was found."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"no model at {p}: give a .gguf file or an MLX model folder")
    if p.is_file():
        from localrun.gguf_check import is_gguf

        if is_gguf(p):
            return "gguf"
        raise UnsupportedFormatError(
            f"{p} is not a GGUF file (no GGUF magic bytes); localrun runs .gguf files and MLX model folders"
        )
    if not p.is_dir():  # a FIFO, socket or device: never opened, it could block the reader
        raise UnsupportedFormatError(f"{p} is neither a file nor a folder; give a .gguf file or an MLX model folder")
    has_config = (p / "config.json").is_file()
    weights = list(p.glob("*.safetensors"))
    ggufs = sorted(p.glob("*.gguf"))
    if has_config and weights:
        return "mlx"
    found = ", ".join(sorted(x.name for x in p.iterdir())[:6]) or "nothing"
    if ggufs:
        raise UnsupportedFormatError(f"{p} is a folder of GGUF files; pass one of them, e.g. {ggufs[0]}")
    missing = "config.json" if not has_config else "*.safetensors weights"
    raise UnsupportedFormatError(f"{p} is not an MLX model folder (missing {missing}; found: {found})")


def open_backend(path: str | Path, **kwargs) -> Backend:
    """Load a model (a path, or a store name such as org/repo:Q4_K_M) on the backend its
    format needs. kwargs: n_ctx, n_seq, n_batch, threads, kv_cache_type ("f16", "q8_0" or
    "q4_0": the element type of the KV cache; quantized caches hold about 1/2 or 1/4 of
    f16's bytes per token)."""
    from localrun.store import resolve_model

    if "kv_cache_type" in kwargs:  # a bad value fails before a model is read
        kwargs["kv_cache_type"] = check_kv_cache_type(kwargs["kv_cache_type"])
    p = resolve_model(str(path))
    fmt = detect_format(p)
    if fmt == "gguf":
        from localrun.gguf_check import check_gguf

        check_gguf(p)  # a malformed file never reaches llama.cpp's parser
        from .llamacpp import LlamaCppBackend

        return LlamaCppBackend(p, **kwargs)
    from .mlx import MLXBackend

    return MLXBackend(p, **kwargs)
