"""What a model is, read from its files without loading it: one answer for every caller.

`facts(path)` reads a GGUF file's header (validated, every part of a split model) or an
MLX folder (config.json, tokenizer_config.json or chat_template.jinja, the safetensors
headers); `gguf_facts(metadata, tensors)` reads a GGUF header already in hand (`pull`'s
remote header); `mlx_config_facts(config)` a parsed config.json. The store (`localrun
show`, the quant of an unnamed file), the server's /api/tags and /api/show, the quant
selector's memory model and `pull` all take their facts from here.

Where a file leaves a number unsaid, the rule is the runtime's own: llama.cpp for GGUF
(KV heads = heads, head size = embedding / heads, value head size = key head size),
mlx-lm's config reading for MLX. Sliding-window layers follow the file's pattern, else
llama.cpp's default period for the architectures that have one (_SWA_PERIOD).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.errors import MalformedModelError, UnsupportedFormatError
from localrun.model.gguf_header import ArrayInfo, TensorInfo, open_regular

__all__ = ["ModelFacts", "facts", "gguf_facts", "mlx_config_facts", "mlx_quant"]

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS: llama.cpp refuses per-layer values for more layers
MAX_JSON_BYTES = 16 << 20  # config.json, tokenizer_config.json, chat_template.jinja (Gemma-3's: 1.2 MB)
MAX_SAFETENSORS_HEADER = 100_000_000  # the safetensors format's own header limit

# Layer i is a sliding-window layer when (i + 1) % period != 0 (llama.cpp's default
# pattern), for architectures whose GGUF does not store the pattern itself.
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "gpt-oss": 2}
# llama.cpp's FIM keys, then the older names it still reads.
_FIM_KEYS = {"prefix": ("fim_pre", "prefix"), "suffix": ("fim_suf", "suffix"), "middle": ("fim_mid", "middle")}


@dataclass(frozen=True)
class ModelFacts:
    """A model as its files describe it; 0 / None where the files do not say."""

    format: str  # "gguf" | "mlx"
    architecture: str  # general.architecture, or config.json's model_type; "unknown" when absent
    n_params: int  # tensor elements (GGUF: all split parts; MLX: packed quantized weights unpacked)
    quant: str  # the GGUF file type ("Q4_K_M", "unknown" without one), or "4bit" / "F16" / "BF16" / "F32"
    file_type: int | None  # GGUF general.file_type
    context_length: int  # the trained context
    n_layer: int
    n_head: int  # of the first layer
    n_head_kv: int  # of the first layer
    kv_heads: tuple[int, ...]  # per layer (0 for a layer without attention)
    head_dim: int  # key head size
    head_dim_v: int  # value head size
    n_embd: int
    n_ff: int  # the widest feed-forward layer
    n_vocab: int
    sliding_window: int | None
    swa_layers: tuple[bool, ...]  # per layer: sliding-window attention
    fim_prefix_id: int | None
    fim_suffix_id: int | None
    fim_middle_id: int | None
    chat_template: str | None
    pooling_type: int | None  # GGUF {arch}.pooling_type: an embedding model

    @property
    def has_fim(self) -> bool:
        return None not in (self.fim_prefix_id, self.fim_suffix_id, self.fim_middle_id)

    @property
    def has_tools(self) -> bool:
        """The chat template reads the `tools` variable (localrun.tools detects the call
        format; asked only here, so readers of shapes never import it)."""
        if not self.chat_template:
            return False
        from localrun.tools.formats import supports_tools

        return supports_tools(self.chat_template)


def facts(path: str | os.PathLike[str]) -> ModelFacts:
    """The facts of a GGUF file (every split part validated and counted) or an MLX folder."""
    p = Path(path)
    try:
        is_folder = stat.S_ISDIR(os.stat(p).st_mode)
    except OSError:
        is_folder = False  # the GGUF reader names what is wrong with the path
    if is_folder:
        return _mlx_folder_facts(p)
    from localrun.model.gguf_check import check_gguf_parts

    parts = check_gguf_parts(p)
    found = gguf_facts(parts[0].metadata, [t for part in parts for t in part.tensors])
    span = parts[0].kv_spans.get("tokenizer.ggml.tokens")
    if found.has_fim or span is None:
        return found
    # no FIM keys: llama.cpp finds FIM tokens by their text when it loads; so do we
    from localrun.model.fim_names import fim_ids_by_name

    ids = fim_ids_by_name(str(p), span)
    if len(ids) < 3:
        return found
    return dataclasses.replace(found, fim_prefix_id=ids["prefix"], fim_suffix_id=ids["suffix"],
                               fim_middle_id=ids["middle"])


def gguf_facts(metadata: dict[str, Any], tensors: list[TensorInfo] | tuple[TensorInfo, ...]) -> ModelFacts:
    """The facts of a GGUF header: its metadata and the tensor infos of every part at hand."""
    from localrun.model.formats import file_type_name

    arch = _text(metadata.get("general.architecture")) or "unknown"

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    n_layer = _layers(key("block_count"), f"{arch}.block_count")
    n_embd = _int(key("embedding_length"))
    n_head = _per_layer(key("attention.head_count", 1), 1)[0]  # the first layer's
    kv_heads = _per_layer(key("attention.head_count_kv", n_head), n_layer)
    head_dim = _int(key("attention.key_length")) or n_embd // max(1, n_head)
    ff = key("feed_forward_length")
    tokens = metadata.get("tokenizer.ggml.tokens")
    n_vocab = _int(key("vocab_size")) or _count(tokens)
    window = _int(key("attention.sliding_window"))
    file_type = metadata.get("general.file_type")
    file_type = file_type if isinstance(file_type, int) and not isinstance(file_type, bool) else None
    template = _text(metadata.get("tokenizer.chat_template"))
    pooling = key("pooling_type")
    fim = {part: _token_id(metadata, names, n_vocab) for part, names in _FIM_KEYS.items()}
    return ModelFacts(
        format="gguf", architecture=arch, n_params=sum(math.prod(t.shape) for t in tensors),
        quant=file_type_name(file_type), file_type=file_type, context_length=_int(key("context_length")),
        n_layer=n_layer, n_head=n_head, n_head_kv=kv_heads[0] if kv_heads else 0, kv_heads=kv_heads,
        head_dim=head_dim, head_dim_v=_int(key("attention.value_length")) or head_dim, n_embd=n_embd,
        n_ff=max(_per_layer(ff, n_layer), default=0) if ff else 0, n_vocab=n_vocab,
        sliding_window=window or None,
        swa_layers=_gguf_swa(arch, window, key("attention.sliding_window_pattern"), n_layer),
        fim_prefix_id=fim["prefix"], fim_suffix_id=fim["suffix"], fim_middle_id=fim["middle"],
        chat_template=template, pooling_type=_int(pooling) if pooling is not None else None,
    )


def mlx_config_facts(config: dict[str, Any], chat_template: str | None = None, n_params: int = 0) -> ModelFacts:
    """The facts of an MLX model's config.json (a multimodal config's text_config is the
    language model's); the template and parameter count come from the other files."""
    text = config.get("text_config")
    cfg = {**config, **text} if isinstance(text, dict) else config
    n_layer = _layers(cfg.get("num_hidden_layers"), "num_hidden_layers")
    n_embd = _int(cfg.get("hidden_size"))
    n_head = _int(cfg.get("num_attention_heads", 1))
    head_dim = _int(cfg.get("head_dim")) or n_embd // max(1, n_head)
    kv_heads = _per_layer(cfg.get("num_key_value_heads", n_head), n_layer)
    window = _int(cfg.get("sliding_window"))
    layer_types, period = cfg.get("layer_types"), _int(cfg.get("sliding_window_pattern"))
    if isinstance(layer_types, list) and layer_types:
        swa = tuple(t == "sliding_attention" for t in layer_types[:n_layer])
        swa += (False,) * (n_layer - len(swa))
    elif window and period >= 1:
        swa = tuple((i + 1) % period != 0 for i in range(n_layer))
    else:  # a window with no sliding layers (Qwen2's use_sliding_window: false) is no window
        swa, window = (False,) * n_layer, 0
    return ModelFacts(
        format="mlx", architecture=_text(config.get("model_type")) or "unknown", n_params=n_params,
        quant=mlx_quant(config), file_type=None, context_length=_int(cfg.get("max_position_embeddings")),
        n_layer=n_layer, n_head=n_head, n_head_kv=kv_heads[0] if kv_heads else 0, kv_heads=kv_heads,
        head_dim=head_dim, head_dim_v=head_dim, n_embd=n_embd, n_ff=_int(cfg.get("intermediate_size")),
        n_vocab=_int(cfg.get("vocab_size")), sliding_window=window or None, swa_layers=swa,
        fim_prefix_id=None, fim_suffix_id=None, fim_middle_id=None,
        chat_template=chat_template, pooling_type=None,
    )


def mlx_quant(config: dict[str, Any]) -> str:
    """"4bit" etc. from config.json's quantization block, else the weights' dtype."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    if isinstance(q, dict) and q.get("bits"):
        return f"{q['bits']}bit"
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    return {"bfloat16": "BF16", "float32": "F32"}.get(dtype, "F16")


# -- MLX folders ------------------------------------------------------------------------


def _mlx_folder_facts(folder: Path) -> ModelFacts:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise UnsupportedFormatError(f"{folder} has no config.json, so it is not an MLX model folder;"
                                     " give a .gguf file or an MLX model folder")
    config = _json_file(config_path)
    if not isinstance(config, dict):
        raise MalformedModelError(f"{config_path} is not a JSON object; the model folder is corrupt")
    quant = mlx_quant(config)
    bits = int(quant[:-3]) if quant.endswith("bit") and quant[:-3].isdigit() else None
    return mlx_config_facts(config, _mlx_template(folder), _safetensors_params(folder, bits))


def _mlx_template(folder: Path) -> str | None:
    """chat_template.jinja when the folder has one (newer transformers write it there),
    else tokenizer_config.json's chat_template (a list of named templates: "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return _small_file(jinja).decode("utf-8", errors="replace")
    tok_cfg = folder / "tokenizer_config.json"
    if not tok_cfg.exists():
        return None
    tokenizer_config = _json_file(tok_cfg)
    template = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _safetensors_params(folder: Path, bits: int | None) -> int:
    """Parameter count from the safetensors headers (packed quantized weights unpacked)."""
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open_regular(str(f)) as fh:
            raw = fh.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= MAX_SAFETENSORS_HEADER:
                raise MalformedModelError(f"{f}: not a safetensors file (its header length is impossible);"
                                          " download the model again")
            try:
                header = json.loads(fh.read(n))
                for name, t in header.items():
                    if name == "__metadata__" or name.endswith((".scales", ".biases")):
                        continue
                    count = math.prod(int(d) for d in t["shape"])
                    total += count * 32 // bits if bits and t["dtype"] == "U32" else count
            except (ValueError, TypeError, KeyError, AttributeError):
                raise MalformedModelError(f"{f}: its safetensors header is corrupt; download the model again") from None
    return total


def _small_file(path: Path) -> bytes:
    with open_regular(str(path)) as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_JSON_BYTES:
            raise MalformedModelError(f"{path} is {size} bytes, more than the {MAX_JSON_BYTES >> 20} MiB"
                                      " a model's config file takes; the model folder is corrupt")
        return f.read()


def _json_file(path: Path) -> Any:
    try:
        return json.loads(_small_file(path))
    except ValueError:
        raise MalformedModelError(f"{path} is not valid JSON; the model folder is corrupt") from None


# -- small readers of header values -------------------------------------------------------


def _int(value: Any) -> int:
    """A number from a header or config; 0 for anything else (a string, an array)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0
    return int(value)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _count(tokens: Any) -> int:
    if isinstance(tokens, ArrayInfo):
        return tokens.count
    return len(tokens) if isinstance(tokens, list) else 0


def _layers(value: Any, key: str) -> int:
    n = _int(value)
    if n > MAX_LAYERS:
        raise MalformedModelError(f"{key} says {n} layers; llama.cpp and mlx-lm load at most {MAX_LAYERS}")
    return max(0, n)


def _per_layer(value: Any, n: int) -> tuple[int, ...]:
    """A value per layer from a scalar (the same for every layer) or an array (padded with
    its last value, as llama.cpp fills a short per-layer array)."""
    if isinstance(value, list):
        vals = [_int(v) for v in value][:n]
        return tuple(vals + [vals[-1] if vals else 0] * (n - len(vals)))
    return (_int(value),) * n


def _gguf_swa(arch: str, window: int, pattern: Any, n_layer: int) -> tuple[bool, ...]:
    if isinstance(pattern, list):
        return tuple(bool(v) for v in _per_layer([int(bool(p)) for p in pattern], n_layer))
    if window:
        period = _int(pattern) if _int(pattern) > 0 else _SWA_PERIOD.get(arch, 0)
        return tuple(period > 1 and (i + 1) % period != 0 for i in range(n_layer))
    return (False,) * n_layer


def _token_id(metadata: dict[str, Any], names: tuple[str, ...], n_vocab: int) -> int | None:
    """A special token id from the first key that holds one inside the vocabulary."""
    for name in names:
        tid = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if isinstance(tid, int) and not isinstance(tid, bool) and 0 <= tid and (not n_vocab or tid < n_vocab):
            return tid
    return None

