"""Model format conversion (GGUF -> MLX).

Imported lazily so that `import localrun.quant` stays cheap for the CLI; the heavy
dependencies (gguf, mlx, tokenizers) load on first use of a converter.
"""

from __future__ import annotations

__all__ = ["convert_gguf_to_mlx"]


def __getattr__(name: str):
    if name == "convert_gguf_to_mlx":
        from .gguf_to_mlx import convert_gguf_to_mlx

        return convert_gguf_to_mlx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
