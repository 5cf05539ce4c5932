"""Which GGML type each tensor of a model gets, for a llama.cpp file type.

A file type such as Q4_K_M is a mixture, not one type: most matrices get the base
type (Q4_K), but the tensors whose errors hurt most get more bits. The rules below
follow the mixtures llama.cpp's quantizer is known for (they are what users expect a
"Q4_K_M" file to be), written as data: for each file type, a base type and per-role
overrides that may depend on the layer's position, the grouped-query ratio and
whether an importance matrix is present.

    plan = TensorPlanner(FILE_TYPES["Q4_K_M"], n_layer=30, n_gqa=3, has_imatrix=False,
                         tied_embeddings=True)
    plan.choose("blk.0.ffn_down.weight", (1536, 576))   # -> GGMLQuantizationType.Q6_K

Shapes are given GGML-style (ne0 = the row length first). A row length the chosen
type's block does not divide falls back to a type with a smaller block, as llama.cpp
does (a 576-wide SmolLM2 matrix cannot be Q4_K, whose blocks hold 256 values; it
becomes Q5_0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from localrun.errors import BadRequestError


@dataclass(frozen=True)
class FileType:
    name: str
    ftype: int  # the `general.file_type` value (llama.cpp's enum llama_ftype)
    base: T  # what an ordinary matrix gets


# Every file type a user picks, with llama.cpp's ftype numbers (localrun/model/formats.py names them).
FILE_TYPES: dict[str, FileType] = {
    f.name: f
    for f in [
        FileType("F32", 0, T.F32), FileType("F16", 1, T.F16), FileType("BF16", 32, T.BF16),
        FileType("Q4_0", 2, T.Q4_0), FileType("Q4_1", 3, T.Q4_1), FileType("Q5_0", 8, T.Q5_0),
        FileType("Q5_1", 9, T.Q5_1), FileType("Q8_0", 7, T.Q8_0),
        FileType("Q2_K", 10, T.Q2_K), FileType("Q2_K_S", 21, T.Q2_K),
        FileType("Q3_K_S", 11, T.Q3_K), FileType("Q3_K_M", 12, T.Q3_K), FileType("Q3_K_L", 13, T.Q3_K),
        FileType("Q4_K_S", 14, T.Q4_K), FileType("Q4_K_M", 15, T.Q4_K),
        FileType("Q5_K_S", 16, T.Q5_K), FileType("Q5_K_M", 17, T.Q5_K), FileType("Q6_K", 18, T.Q6_K),
        FileType("IQ1_S", 24, T.IQ1_S), FileType("IQ1_M", 31, T.IQ1_M),
        FileType("IQ2_XXS", 19, T.IQ2_XXS), FileType("IQ2_XS", 20, T.IQ2_XS),
        FileType("IQ2_S", 28, T.IQ2_XS), FileType("IQ2_M", 29, T.IQ2_S),
        FileType("IQ3_XXS", 23, T.IQ3_XXS), FileType("IQ3_XS", 22, T.IQ3_S),
        FileType("IQ3_S", 26, T.IQ3_S), FileType("IQ3_M", 27, T.IQ3_S),
        FileType("IQ4_NL", 25, T.IQ4_NL), FileType("IQ4_XS", 30, T.IQ4_XS),
    ]
}

# File types whose mixtures are unusable without an importance matrix: llama.cpp
# refuses them too (their base types collapse without per-column weights).
NEEDS_IMATRIX = frozenset({"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S"})

# The very-low-bit family shares one set of protections.
_IQ_LOW = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M"}

# Where a type's block does not divide a row: the next type with a 32-value block.
_FALLBACK = {
    T.IQ1_S: T.IQ4_NL, T.IQ1_M: T.IQ4_NL, T.IQ2_XXS: T.IQ4_NL, T.IQ2_XS: T.IQ4_NL,
    T.IQ2_S: T.IQ4_NL, T.IQ3_XXS: T.IQ4_NL, T.IQ3_S: T.IQ4_NL, T.IQ4_XS: T.IQ4_NL,
    T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
}

_LAYER = re.compile(r"blk\.(\d+)\.")
_ROLE = re.compile(r"(attn_qkv|attn_q|attn_k|attn_v|attn_output|ffn_down|ffn_gate|ffn_up)\.weight$")


def file_type(name: str) -> FileType:
    key = name.upper()
    if key not in FILE_TYPES:
        raise BadRequestError(
            f"unknown quantization type '{name}'; choose one of: {', '.join(FILE_TYPES)}"
        )
    return FILE_TYPES[key]


def block_of(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def is_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Matrices only: 1-D tensors (norms, biases) and norm weights stay as they are."""
    return len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name \
        and "ffn_gate_inp" not in name


def _more_bits(i: int, n: int) -> bool:
    """The layers a mixed file type favours: the first and last eighth and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class TensorPlanner:
    ftype: FileType
    n_layer: int
    n_gqa: int = 1  # query heads per KV head
    has_imatrix: bool = False
    tied_embeddings: bool = False  # no output.weight: token_embd doubles as the LM head
    fallbacks: list[str] = field(default_factory=list)  # "name: A -> B" notes for the report

    def choose(self, name: str, shape: tuple[int, ...]) -> T:
        """The GGML type for tensor `name` of GGML shape `shape` (ne0 first)."""
        want = self._mixture(name, shape[0])
        if want in (T.F32, T.F16, T.BF16):
            return want
        return self._fit(name, shape[0], want)

    def _fit(self, name: str, ncols: int, want: T) -> T:
        if ncols % block_of(want) == 0:
            return want
        got = _FALLBACK.get(want, want)
        if ncols % block_of(got):
            got = T.F16  # not even 32 divides the row: keep it unquantized
        self.fallbacks.append(f"{name}: {want.name} -> {got.name} ({ncols} columns)")
        return got

    def _mixture(self, name: str, ncols: int) -> T:
        ft, base = self.ftype.name, self.ftype.base
        if base in (T.F32, T.F16, T.BF16):
            return base
        is_output = name == "output.weight" or (self.tied_embeddings and name == "token_embd.weight")
        if is_output:
            if ncols % block_of(base):
                return T.Q8_0
            if ft in _IQ_LOW or ft == "IQ3_XXS":
                return T.Q5_K
            return base if base == T.Q8_0 else T.Q6_K
        if name == "token_embd.weight":
            return {"IQ2_XXS": T.Q2_K, "IQ2_XS": T.Q2_K, "IQ1_S": T.Q2_K, "IQ1_M": T.Q2_K,
                    "IQ2_S": T.IQ3_S, "IQ2_M": T.IQ3_S, "IQ3_XXS": T.IQ3_S}.get(ft, base)
        m = _ROLE.search(name)
        if not m:
            return base
        role = m.group(1)
        lm = _LAYER.match(name)
        i, n = (int(lm.group(1)) if lm else 0), max(1, self.n_layer)
        rule = _RULES_LOW if ft in _IQ_LOW else _RULES
        pick = rule.get(role)
        got = pick(self, ft, i, n) if pick else None
        return got if got is not None else base


Rule = Callable[[TensorPlanner, str, int, int], "T | None"]


def _attn_v(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    gqa4 = p.n_gqa >= 4
    if ft == "Q2_K":
        return T.Q4_K if gqa4 else T.Q3_K
    if ft == "Q2_K_S":
        return T.Q4_K if gqa4 else None
    if ft == "IQ3_XXS":
        return T.Q4_K if gqa4 else (T.IQ3_XXS if p.has_imatrix else T.IQ3_S)
    if ft in ("IQ3_XS", "IQ3_S"):
        return T.Q4_K if gqa4 else None
    if ft == "IQ3_M":
        return T.Q4_K
    if ft == "Q3_K_M":
        return T.Q5_K if i < 2 else T.Q4_K
    if ft == "Q3_K_L":
        return T.Q5_K
    if ft in ("IQ4_NL", "IQ4_XS"):
        return T.Q5_K if gqa4 else None
    if ft in ("Q4_K_M", "Q5_K_M"):
        return T.Q6_K if _more_bits(i, n) else None
    if ft == "Q4_K_S":
        return T.Q5_K if i < 4 else None
    return None


def _attn_qk(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ft)


def _ffn_down(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    first8 = i < n // 8
    if ft == "Q2_K":
        return T.Q3_K
    if ft == "Q2_K_S":
        return T.Q4_K if first8 else None
    if ft == "IQ3_XXS" and not p.has_imatrix:
        return T.Q4_K if first8 else T.Q3_K
    if ft == "Q3_K_M":
        return T.Q5_K if i < n // 16 else T.Q4_K
    if ft == "IQ3_M":
        return T.Q4_K if first8 else None
    if ft == "Q3_K_L":
        return T.Q5_K
    if ft in ("Q4_K_M", "Q5_K_M"):
        return T.Q6_K if _more_bits(i, n) else None
    if ft in ("IQ4_NL", "IQ4_XS") and not p.has_imatrix:
        return T.Q5_K if first8 else None
    if ft == "Q4_K_S":
        return T.Q5_K if first8 else None
    if ft in ("Q4_0", "Q5_0") and p.has_imatrix and first8:
        # even with an importance matrix the first ffn_down layers go astray at 4/5 bits
        return T.Q4_1 if ft == "Q4_0" else T.Q5_1
    return None


def _attn_output(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K,
            "IQ3_M": T.Q4_K}.get(ft)


def _attn_qkv(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    return {"Q3_K_M": T.Q4_K, "Q3_K_L": T.Q4_K, "IQ3_M": T.Q4_K, "Q4_K_M": T.Q5_K,
            "Q5_K_M": T.Q6_K}.get(ft)


def _ffn_gate_up(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    return T.IQ3_XXS if ft == "IQ3_XS" and n // 8 <= i < 7 * n // 8 else None


def _low_attn_v(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    if p.n_gqa >= 4:
        return T.Q4_K
    return T.IQ3_S if ft in ("IQ2_S", "IQ2_M") else T.Q2_K


def _low_ffn_down(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    if i < n // 8:
        return T.IQ3_S if ft in ("IQ2_S", "IQ2_M") else T.Q2_K
    return None


def _low_attn_output(p: TensorPlanner, ft: str, i: int, n: int) -> T | None:
    return {"IQ1_S": T.IQ2_XXS, "IQ1_M": T.IQ2_XXS, "IQ2_S": T.IQ3_S, "IQ2_M": T.IQ3_S}.get(ft)


_RULES: dict[str, Rule] = {
    "attn_v": _attn_v, "attn_q": _attn_qk, "attn_k": _attn_qk, "ffn_down": _ffn_down,
    "attn_output": _attn_output, "attn_qkv": _attn_qkv, "ffn_gate": _ffn_gate_up,
    "ffn_up": _ffn_gate_up,
}
_RULES_LOW: dict[str, Rule] = {
    "attn_v": _low_attn_v, "ffn_down": _low_ffn_down, "attn_output": _low_attn_output,
}
