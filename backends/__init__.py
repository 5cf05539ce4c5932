"""Backends behind one protocol (`base.Backend`), chosen by what the model path holds:
a `.gguf` file runs on llama.cpp (llamacpp.py), a folder with `config.json` and
safetensors on MLX (mlx.py). Both take one set of load options (see `open_backend`).

This folder depends on the core (`localrun.errors`, `localrun.model.formats`, ...) only;
`localrun.quant` may use it, never the reverse (tests/test_packaging.py checks).
"""

from __future__ import annotations

from pathlib import Path

from localrun.errors import ModelNotFoundError, UnsupportedFormatError
from localrun.model.formats import KV_CACHE_TYPES, check_kv_cache_type

from .base import Backend, BackendOptions, BatchEntry, ModelInfo

__all__ = [
    "KV_CACHE_TYPES", "Backend", "BackendOptions", "BatchEntry", "ModelInfo", "check_kv_cache_type", "detect_format",
    "open_backend",
]


def detect_format(path: str | Path) -> str:
    """Return "gguf" or "mlx" for a model path, or raise a one-line error saying what was found."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"no model at {p}: give a .gguf file or an MLX model folder")
    if p.is_file():
        from localrun.model.gguf_check import is_gguf

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


def open_backend(path: str | Path, options: BackendOptions | None = None, isolated: bool = False,
                 **fields) -> Backend:
    """Load a model file or folder (Engine.open resolves a store name such as
    org/repo:Q4_K_M to one) on the backend its format needs, with `options` (or its
    fields as keywords; see BackendOptions: a bad value fails before a model is read, an
    unknown keyword is a TypeError). isolated=True hosts a GGUF that is split over a
    `cluster` of RPC workers in a child process (remote.py), so a worker's death fails
    the calls in flight instead of this process; without a cluster it changes nothing."""
    from localrun.model.paths import model_path_kind

    o = BackendOptions.of(options, **fields)
    p = Path(path).expanduser()
    if p.exists():
        model_path_kind(p)  # a FIFO, device or socket is refused before anything opens it
    fmt = detect_format(p)
    if fmt == "gguf":
        from localrun.model.gguf_check import check_gguf

        check_gguf(p)  # a malformed file never reaches llama.cpp's parser
        if isolated and o.cluster is not None:
            from .remote import RemoteBackend

            return RemoteBackend(p, o)
        from .llamacpp import LlamaCppBackend

        return LlamaCppBackend(p, o)
    from .mlx import MLXBackend

    return MLXBackend(p, o)
