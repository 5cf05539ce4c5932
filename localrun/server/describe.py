"""What a model is, for /api/tags, /api/show and /props, read from the file's own
metadata (GGUF header or MLX config.json) so listing models never loads one; a model
that is loaded answers from its engine (which also knows FIM tokens found by name)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UnsupportedFormatError
from ..gguf_check import ArrayInfo, check_gguf
from ..quant.catalog import file_type_name


@dataclass
class Description:
    name: str
    path: str
    format: str  # "gguf" | "mlx"
    architecture: str
    n_params: int
    quant: str
    context_length: int
    size_bytes: int
    modified: float
    chat_template: str | None
    has_fim: bool
    embedding_length: int = 0

    @property
    def modified_at(self) -> str:
        return datetime.fromtimestamp(self.modified, timezone.utc).isoformat().replace("+00:00", "Z")

    @property
    def digest(self) -> str:
        """A stable id of this file's identity (path, size, mtime); not a content hash,
        which would mean reading gigabytes to list models."""
        ident = f"{os.path.realpath(self.path)}:{self.size_bytes}:{self.modified}"
        return hashlib.sha256(ident.encode()).hexdigest()

    @property
    def parameter_size(self) -> str:
        n = self.n_params
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        return f"{n / 1e6:.0f}M" if n else "unknown"

    def details(self) -> dict:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.architecture,
            "families": [self.architecture],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quant,
        }

    def capabilities(self) -> list[str]:
        return ["completion", "insert"] if self.has_fim else ["completion"]


def describe(name: str, path: str, engine=None) -> Description:
    p = Path(path)
    if engine is not None:
        info = engine.info
        return Description(
            name, path, "mlx" if info.backend == "mlx" else "gguf", info.architecture, info.n_params, info.quant,
            info.n_ctx_train, _size(p), p.stat().st_mtime, info.chat_template,
            info.fim_prefix_id is not None and info.fim_suffix_id is not None and info.fim_middle_id is not None,
        )
    if p.is_dir():
        return _describe_mlx(name, p)
    return _describe_gguf(name, p)


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    return p.stat().st_size


def _describe_gguf(name: str, p: Path) -> Description:
    meta = check_gguf(p).metadata
    arch = str(meta.get("general.architecture", "unknown"))
    ftype = meta.get("general.file_type")
    n_params = meta.get("general.parameter_count") or 0
    template = meta.get("tokenizer.chat_template")
    fim = all(meta.get(f"tokenizer.ggml.fim_{k}_token_id") is not None for k in ("pre", "suf", "mid"))
    return Description(
        name, str(p), "gguf", arch, int(n_params) if not isinstance(n_params, ArrayInfo) else 0,
        file_type_name(ftype) if isinstance(ftype, int) else "unknown",
        int(meta.get(f"{arch}.context_length") or 0), p.stat().st_size, p.stat().st_mtime,
        template if isinstance(template, str) else None, fim,
        int(meta.get(f"{arch}.embedding_length") or 0),
    )


def _describe_mlx(name: str, p: Path) -> Description:
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        raise UnsupportedFormatError(f"{name} is a folder without a readable config.json, not an MLX model") from None
    text = cfg.get("text_config", cfg)
    q = cfg.get("quantization")
    quant = f"{q['bits']}bit" if isinstance(q, dict) and "bits" in q else str(cfg.get("torch_dtype", "F16")).upper()
    template = None
    try:
        template = json.loads((p / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):  # no readable tokenizer_config.json: a model without a template
        pass
    return Description(
        name, str(p), "mlx", str(text.get("model_type", cfg.get("model_type", "unknown"))), 0, quant,
        int(text.get("max_position_embeddings") or 0), _size(p), p.stat().st_mtime,
        template if isinstance(template, str) else None, False, int(text.get("hidden_size") or 0),
    )
