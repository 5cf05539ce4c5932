"""Names and sizes the runtime reads models by: GGUF file types, quant names with their
bits per weight and quality order, KV cache element types, split-file names.

These tables sit in the core because every part reads them: the backends name a
model's quant and check `--kv-cache-type`, the store and `pull` read quant names out of
file names and rank what is installed, the selector prices memory by them. `quant/`
(which writes files of these types) imports them from here, never the other way round.

GGUF names are llama.cpp's (`general.file_type`, `enum llama_ftype`). Bits per weight
are the nominal figures llama.cpp's quantize tool gives for each type (mixed K-quant
types such as Q4_K_M average their per-tensor choices). The quality order follows the
perplexity / KL-divergence deltas published with llama.cpp's quantize tool and the
i-quant pull requests: lower position = closer to the full-precision model. Where two
types are within noise of each other the smaller one is ranked lower, so the selector
never pays more memory for no measurable gain.

MLX models are ranked by bit width (affine quantization, group size 64 by default);
an unquantized f16/bf16 MLX model ranks with GGUF F16.
"""

from __future__ import annotations

import re
from pathlib import Path

from localrun.errors import BadRequestError

# -- GGUF file types -----------------------------------------------------------------

FILE_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4",
}


def file_type_name(file_type: int | None) -> str:
    """The quant name of a `general.file_type` value ("Q4_K_M"), "unknown" when absent."""
    if file_type is None:
        return "unknown"
    return FILE_TYPE_NAMES.get(int(file_type), f"type {file_type}")


# -- quant names: bits and quality ---------------------------------------------------

# Best first. Each entry: (name, nominal bits per weight).
GGUF_QUALITY_ORDER: tuple[tuple[str, float], ...] = (
    ("F32", 32.0),
    ("BF16", 16.0),
    ("F16", 16.0),
    ("Q8_0", 8.5),
    ("Q6_K", 6.56),
    ("Q5_K_M", 5.69),
    ("Q5_1", 6.0),
    ("Q5_K_S", 5.54),
    ("Q5_0", 5.5),
    ("Q4_K_M", 4.89),
    ("Q4_K_S", 4.58),
    ("IQ4_NL", 4.5),
    ("IQ4_XS", 4.25),
    ("MXFP4", 4.25),
    ("Q4_1", 5.0),
    ("Q3_K_L", 4.27),
    ("Q4_0", 4.5),
    ("IQ3_M", 3.66),
    ("Q3_K_M", 3.91),
    ("IQ3_S", 3.44),
    ("IQ3_XS", 3.3),
    ("Q3_K_S", 3.5),
    ("IQ3_XXS", 3.06),
    ("Q2_K", 3.35),
    ("IQ2_M", 2.7),
    ("IQ2_S", 2.5),
    ("Q2_K_S", 2.6),
    ("IQ2_XS", 2.31),
    ("TQ2_0", 2.06),
    ("IQ2_XXS", 2.06),
    ("IQ1_M", 1.75),
    ("TQ1_0", 1.69),
    ("IQ1_S", 1.56),
)

BITS_PER_WEIGHT: dict[str, float] = dict(GGUF_QUALITY_ORDER)
_GGUF_RANK = {name: len(GGUF_QUALITY_ORDER) - i for i, (name, _) in enumerate(GGUF_QUALITY_ORDER)}

# MLX bit widths mapped onto the GGUF scale: an affine 8-bit group-64 quant sits by Q8_0,
# 6-bit by Q6_K, and so on (each carries an f16 scale and bias per 64 weights).
_MLX_EQUIVALENT = {"F32": "F32", "BF16": "BF16", "F16": "F16", "8bit": "Q8_0", "6bit": "Q6_K",
                   "5bit": "Q5_0", "4bit": "Q4_0", "3bit": "Q3_K_S", "2bit": "Q2_K_S"}

# A quant token inside a file name: "Qwen2.5-7B-Instruct-Q4_K_M.gguf",
# "model.q8_0.gguf", "Llama-3-8B-UD-Q4_K_XL-00001-of-00002.gguf", "x-IQ2_XXS.gguf".
_QUANT_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])((?:UD-)?(?:IQ[1-4]_(?:XXS|XS|NL|S|M)|Q[2-8]_K(?:_(?:XL|S|M|L))?"
    r"|Q[4-8]_[01](?:_[48]_[48])?|TQ[12]_0|MXFP4|BF16|F16|FP16|F32))(?![A-Za-z0-9])",
    re.IGNORECASE,
)
SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


def split_parts(first: Path) -> list[Path] | None:
    """All parts of a split GGUF given its first part; None when a part is missing."""
    m = SPLIT_SUFFIX.search(first.name)
    if not m:
        return [first]
    total = int(m.group(2))
    stem = first.name[: m.start()]
    parts = [first.with_name(f"{stem}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)]
    return parts if all(p.exists() for p in parts) else None


def quant_from_filename(filename: str) -> str | None:
    """The quant a GGUF file name announces (upper case; FP16 -> F16), or None.

    The last match wins: "Q4_K_M" in "Llama-3-8B-Q4_K_M.gguf"; a repo name earlier in the
    file name ("...-F16-...") is less specific than the suffix the quantizer wrote.
    """
    stem = SPLIT_SUFFIX.sub(".gguf", filename.rsplit("/", 1)[-1])
    matches = _QUANT_TOKEN.findall(stem)
    if not matches:
        return None
    name = matches[-1].upper()
    return "F16" if name == "FP16" else name


def base_quant(name: str) -> str:
    """The llama.cpp type a marketing name stands for: "UD-Q4_K_XL" -> "Q4_K_M"."""
    n = name.upper().removeprefix("UD-")
    if n.endswith("_XL"):  # dynamic "XL" mixes are K_M mixes with some tensors kept wider
        n = n[:-3] + "_M"
    if re.fullmatch(r"Q4_0_[48]_[48]", n):  # ARM-repacked Q4_0 variants
        n = "Q4_0"
    return n


def quality_rank(quant: str) -> float:
    """Higher is better. Unknown names rank by the bits their name suggests, else last."""
    q = quant.strip()
    if q in _MLX_EQUIVALENT:
        return _GGUF_RANK[_MLX_EQUIVALENT[q]] - 0.5  # an MLX quant just below its GGUF peer
    exact = q.upper()
    if exact in _GGUF_RANK:
        return float(_GGUF_RANK[exact])
    base = base_quant(exact)
    if base in _GGUF_RANK:
        # A "_XL" mix keeps more tensors wide than its base: a little above it.
        return _GGUF_RANK[base] + (0.25 if exact.endswith("_XL") else 0.0)
    return 0.0


def bits_per_weight(quant: str) -> float | None:
    q = quant.strip()
    if q.endswith("bit") and q[:-3].isdigit():
        return int(q[:-3]) + 32 / 64  # f16 scale + f16 bias per group of 64
    return BITS_PER_WEIGHT.get(base_quant(q))


# -- KV cache element types ----------------------------------------------------------

# Bytes per element: a q8_0 block is 32 int8 + one f16 scale, a q4_0 block 32 nibbles +
# one f16 scale.
KV_CACHE_BYTES: dict[str, float] = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
KV_CACHE_TYPES = tuple(KV_CACHE_BYTES)


def check_kv_cache_type(kv_cache_type: str | None) -> str:
    """The KV cache element type to use ("f16" when None), or a one-line error naming the flag."""
    kind = "f16" if kv_cache_type is None else kv_cache_type
    if kind not in KV_CACHE_TYPES:
        raise BadRequestError(f"--kv-cache-type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}")
    return kind


def kv_bytes_per_element(kv_type: str) -> float:
    return KV_CACHE_BYTES[check_kv_cache_type(kv_type)]
