"""Quantize a GGUF model with ggml's own kernels and an importance matrix.

    quantize_gguf("model-f16.gguf", "model-q4_k_m.gguf", "Q4_K_M", imatrix=im)

Each matrix gets the type `recipe.TensorPlanner` picks for the file type and is
quantized by ggml's `ggml_quantize_chunk` (the kernel llama.cpp's quantizer runs),
with that matrix's mean squared activations as per-column weights when an importance
matrix is given. Every KV pair of the source is copied; `general.file_type` is set to
the new type and the importance matrix used is recorded as llama.cpp records it.

Safety: the output is written to a hidden temp file next to OUT and renamed onto OUT
only when complete, so a full disk or an interrupt never leaves a file at OUT; the
source is never the output; a quantized source is refused unless `allow_requantize`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from localrun.errors import BadRequestError, LocalrunError, MalformedModelError, ModelNotFoundError

from . import ggml_lib, gguf_io
from .atomic import atomic_output
from .gguf_io import GGUFOut, kv_entries
from .imatrix_file import ImportanceMatrix
from .recipe import NEEDS_IMATRIX, FileType, TensorPlanner, file_type, is_quantizable

Progress = Callable[[str, int, int], None]  # (what, done, total)

_FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16 (GGMLQuantizationType values)
# Keys the writer derives itself or that describe the source's own quantization.
_SKIP_KEYS = {"general.architecture", "general.file_type", "general.alignment",
              "general.quantization_version",
              "quantize.imatrix.file", "quantize.imatrix.dataset",
              "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"}


@dataclass
class QuantizeResult:
    path: Path
    file_type: str
    size_bytes: int
    n_params: int
    types: dict[str, int] = field(default_factory=dict)  # ggml type name -> tensor count
    fallbacks: list[str] = field(default_factory=list)
    requantized: bool = False

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.size_bytes / max(1, self.n_params)


def open_source(src: Path):
    """The validated summary of a model GGUF; typed errors for missing or broken files."""
    from localrun.model.gguf_check import check_gguf

    if not src.is_file():
        raise ModelNotFoundError(f"no such model file: {src}")
    summary = check_gguf(src)  # bounds-checked: a truncated file fails here, by name
    if summary.metadata.get("general.type") == "imatrix":
        raise BadRequestError(f"{src} is an importance matrix, not a model")
    if "general.architecture" not in summary.metadata:
        raise MalformedModelError(f"{src} has no general.architecture; it is not a model GGUF")
    return summary


def _planner(meta: dict, names: set[str], ft: FileType, has_imatrix: bool) -> TensorPlanner:
    arch = meta["general.architecture"]
    n_layer = int(meta.get(f"{arch}.block_count", 0) or 0)
    n_head = int(meta.get(f"{arch}.attention.head_count", 1) or 1)
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head) or n_head)
    return TensorPlanner(ft, n_layer=n_layer, n_gqa=max(1, n_head // max(1, n_kv)),
                         has_imatrix=has_imatrix, tied_embeddings="output.weight" not in names)


def quantize_gguf(
    src: str | os.PathLike,
    out: str | os.PathLike,
    type_name: str,
    imatrix: ImportanceMatrix | None = None,
    imatrix_path: str | None = None,
    allow_requantize: bool = False,
    overwrite: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
    warn: Callable[[str], None] | None = None,
) -> QuantizeResult:
    """Quantize the GGUF `src` to file type `type_name` at `out`; see the module docstring."""
    from gguf import GGMLQuantizationType as T

    src, out = Path(src).expanduser(), Path(out).expanduser()
    ft = file_type(type_name)
    say = warn or (lambda _m: None)
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise BadRequestError("the output path is the source model; choose another -o path")
    if out.is_dir():
        raise BadRequestError(f"{out} is a folder; -o needs a file path ending in .gguf")
    if out.exists() and not overwrite:
        raise LocalrunError(f"{out} already exists; choose another -o path or pass --force")
    if ft.name in NEEDS_IMATRIX and imatrix is None:
        raise BadRequestError(
            f"{ft.name} needs an importance matrix: pass --imatrix FILE "
            "(made by `localrun imatrix`) or --calibration TEXT_FILE"
        )
    summary = open_source(src)
    meta = summary.metadata
    src_ft = {t.ggml_type for t in summary.tensors if len(t.shape) >= 2}
    requant = bool(src_ft - _FLOAT_TYPES)
    to_float = ft.name in ("F32", "F16", "BF16")  # widening loses nothing: no flag needed
    if requant and not allow_requantize and not to_float:
        raise BadRequestError(
            f"{src.name} is already quantized; quantizing it again loses more quality than "
            "quantizing the F16/BF16/F32 original. Pass --allow-requantize to do it anyway"
        )
    if requant and not to_float:
        say(f"warning: requantizing {src.name}: its weights are already quantized, "
            "so the result is worse than one made from the original")

    names = {t.name for t in summary.tensors}
    planner = _planner(meta, names, ft, imatrix is not None)
    plan = []
    for t in summary.tensors:
        if is_quantizable(t.name, t.shape):
            plan.append((t, planner.choose(t.name, t.shape)))
        else:
            # Norms and biases are tiny and sensitive: kept exactly (as F32 when the
            # source stored them in a quantized type, which only a requantize meets).
            plan.append((t, T(t.ggml_type) if t.ggml_type in _FLOAT_TYPES else T.F32))
    for t, qt in plan:
        if imatrix is not None and ggml_lib.requires_imatrix(int(qt)) and imatrix.mean(t.name) is None:
            raise BadRequestError(
                f"the importance matrix has no entry for '{t.name}', which {qt.name} needs; "
                "it was made for another model"
            )

    result = QuantizeResult(out, ft.name, 0, 0, requantized=requant)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out, overwrite) as tmp:
        mm = np.memmap(src, np.uint8, mode="r")  # numpy owns the mapping: views stay valid
        with open(tmp, "wb") as fp:
            w = GGUFOut(fp, alignment=summary.alignment)
            w.kv("general.architecture", meta["general.architecture"], gguf_io.STRING)
            for key, raw in kv_entries(src):
                if key not in _SKIP_KEYS:
                    w.kv_raw(raw)
            if summary.alignment != 32:
                w.kv("general.alignment", summary.alignment, gguf_io.UINT32)
            w.kv("general.file_type", ft.ftype, gguf_io.UINT32)
            w.kv("general.quantization_version", 2, gguf_io.UINT32)
            if imatrix is not None:
                w.kv("quantize.imatrix.file", str(imatrix_path or "computed"), gguf_io.STRING)
                if imatrix.datasets:
                    w.kv("quantize.imatrix.dataset", imatrix.datasets[-1], gguf_io.STRING)
                w.kv("quantize.imatrix.entries_count", len(imatrix), gguf_io.INT32)
                w.kv("quantize.imatrix.chunks_count", int(imatrix.chunk_count), gguf_io.INT32)
            for t, qt in plan:
                n = int(np.prod(t.shape))
                if int(qt) in _FLOAT_TYPES:
                    nbytes = n * (4 if int(qt) == 0 else 2)
                else:
                    nbytes = (n // t.shape[0]) * ggml_lib.row_size(int(qt), t.shape[0])
                w.tensor(t.name, t.shape, int(qt), nbytes)
                result.types[qt.name] = result.types.get(qt.name, 0) + 1
                result.n_params += n
            w.begin()
            for i, (t, qt) in enumerate(plan):
                if progress:
                    progress(t.name, i, len(plan))
                start = summary.data_offset + t.offset
                raw = np.asarray(mm[start : start + t.nbytes])
                w.write(_convert(t, raw, qt, imatrix, threads))
            if progress:
                progress("done", len(plan), len(plan))
    result.size_bytes = out.stat().st_size
    result.fallbacks = planner.fallbacks
    return result


def _as_f32(t, raw: np.ndarray) -> np.ndarray:
    """Tensor `t` (raw bytes from the file) as float32 in numpy order ([.., ne1, ne0])."""
    from gguf.quants import dequantize

    shape = tuple(reversed(t.shape))
    if t.ggml_type == 0:
        return raw.view(np.float32).reshape(shape)
    if t.ggml_type == 1:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(t.shape[1:]))))
    return np.asarray(dequantize(rows, t.ggml_type), np.float32).reshape(shape)


def _convert(t, raw: np.ndarray, qt, imatrix: ImportanceMatrix | None, threads: int | None) -> np.ndarray:
    """The bytes tensor `t` (raw source bytes) gets as type `qt`."""
    from gguf import GGMLQuantizationType as T

    if int(qt) == t.ggml_type and int(qt) in _FLOAT_TYPES:
        return raw
    w = _as_f32(t, raw)
    if qt == T.F32:
        return np.ascontiguousarray(w)
    if qt == T.F16:
        return w.astype(np.float16)
    if qt == T.BF16:
        from gguf.quants import quantize

        return quantize(w, T.BF16)
    rows = w.reshape(-1, w.shape[-1])
    weights = imatrix.mean(t.name) if imatrix is not None else None
    if weights is not None and weights.shape[-1] != rows.shape[1]:
        raise BadRequestError(
            f"the importance matrix entry for '{t.name}' has {weights.shape[-1]} columns, the "
            f"tensor has {rows.shape[1]}; it was made for another model"
        )
    return ggml_lib.quantize_rows(int(qt), rows, weights, threads)
