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

from .base import Backend, BatchEntry, ModelInfo

__all__ = [
    "KV_CACHE_TYPES", "Backend", "BatchEntry", "ModelInfo", "check_kv_cache_type", "detect_format", "open_backend"
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


def open_backend(path: str | Path, **kwargs) -> Backend:
    """Load a model file or folder (Engine.open resolves a store name such as
    org/repo:Q4_K_M to one) on the backend its format needs. kwargs, taken by both backends: n_ctx, n_seq, n_batch, kv_cache_type
    ("f16", "q8_0" or "q4_0": the element type of the KV cache; quantized caches hold
    about 1/2 or 1/4 of f16's bytes per token); llama.cpp's threads, n_gpu_layers and
    workers (MLX refuses any but their default); MLX's trust_remote_code (llama.cpp has
    none: a GGUF holds no code). An unknown keyword is a TypeError on either.
    isolated=True hosts a GGUF that is split over RPC workers in a child process
    (remote.py), so a worker's death fails the calls in flight instead of this process;
    without workers it changes nothing."""
    from localrun.model.paths import model_path_kind

    trust_remote_code = kwargs.pop("trust_remote_code", False)  # a GGUF holds no code to trust
    isolated = kwargs.pop("isolated", False)
    if "kv_cache_type" in kwargs:  # a bad value fails before a model is read
        kwargs["kv_cache_type"] = check_kv_cache_type(kwargs["kv_cache_type"])
    p = Path(path).expanduser()
    if p.exists():
        model_path_kind(p)  # a FIFO, device or socket is refused before anything opens it
    fmt = detect_format(p)
    if fmt == "gguf":
        from localrun.model.gguf_check import check_gguf

        check_gguf(p)  # a malformed file never reaches llama.cpp's parser
        from localrun.cluster import rpc

        if isolated and (kwargs.get("workers") is not None or rpc.active() is not None):
            from .remote import RemoteBackend

            return RemoteBackend(p, **kwargs)
        from .llamacpp import LlamaCppBackend

        return LlamaCppBackend(p, **kwargs)
    from .mlx import MLXBackend

    return MLXBackend(p, trust_remote_code=trust_remote_code, **kwargs)
