"""What a model is, for /api/tags, /api/show and /props, read from the file's own
metadata (localrun.model.facts: GGUF header or MLX config.json) so listing models never
loads one; a model that is loaded answers from its engine (which also knows FIM tokens
found by name)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..model.facts import facts
from ..tools import supports_tools


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
    supports_tools: bool = False  # the chat template renders `tools`

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
        """Ollama's list, in its order. Editors read it: Zed offers its agent only to a
        model that lists "tools"; "insert" is fill-in-the-middle."""
        return ["completion"] + ["tools"] * self.supports_tools + ["insert"] * self.has_fim


def describe(name: str, path: str, engine=None, chat_template: str | None = None) -> Description:
    """`chat_template`: the server's --chat-template text, which replaces the model's own."""
    p = Path(path)
    if engine is not None:
        info = engine.info
        return Description(
            name, path, "mlx" if info.backend == "mlx" else "gguf", info.architecture, info.n_params, info.quant,
            info.n_ctx_train, _size(p), p.stat().st_mtime, chat_template or info.chat_template,
            info.fim_prefix_id is not None and info.fim_suffix_id is not None and info.fim_middle_id is not None,
            supports_tools=engine.supports_tools,
        )
    f = facts(p)
    template = chat_template or f.chat_template
    return Description(name, str(p), f.format, f.architecture, f.n_params, f.quant, f.context_length, _size(p),
                       p.stat().st_mtime, template, f.has_fim, f.n_embd, supports_tools(template))


def _size(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    return p.stat().st_size
