"""What kind of thing a model path is, from its stat alone (before anything opens it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from localrun.errors import ModelNotFoundError, UnsupportedFormatError


def model_path_kind(path: Path) -> tuple[Path, str]:
    """(path, "file" | "folder") for a path that exists. A FIFO, device or socket is refused
    from its stat alone: opening a FIFO to read its header would wait for a writer forever."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ModelNotFoundError(f"no model at {path}: {exc.strerror or exc}") from None
    if stat.S_ISREG(mode):
        return path, "file"
    if stat.S_ISDIR(mode):
        return path, "folder"
    raise UnsupportedFormatError(
        f"{path} is not a regular file or a folder (a FIFO, device or socket holds no model):"
        " give a .gguf file or an MLX model folder"
    )
