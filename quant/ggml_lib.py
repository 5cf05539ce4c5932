"""ctypes bindings to the few ggml functions quantization needs.

llama-cpp-python ships libggml-base next to libllama; its exported
`ggml_quantize_chunk` is the very kernel llama.cpp's quantizer runs, and unlike
`llama_model_quantize` it takes an importance matrix as a plain `const float *` (one
weight per input column), so Python can hand one over.

    q = quantize_rows(GGML_TYPE_Q4_K, w_f32_2d, imatrix=None)   # -> bytes-like uint8 array

The eval-callback helpers (`tensor_view`, `op_name`) let the imatrix collector read a
`struct ggml_tensor` handed to `cb_eval`. The struct layout is ggml's public one
(ggml.h); `_check_layout` compares it against values the library reports about a
tensor it made, so a ggml that changed the struct fails loudly instead of reading junk.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from types import SimpleNamespace

import numpy as np

from localrun.errors import BackendUnavailableError, BadRequestError
from localrun.ggml import function
from localrun.hardware import usable_cpus

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` from ggml.h (the fields the imatrix collector reads)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


# name -> (restype, argtypes) of every ggml function this module and the imatrix collector call
_i64, _sz, _P, _int = ctypes.c_int64, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
_FUNCTIONS = {
    "ggml_quantize_chunk": (_sz, [_int, _P, _P, _i64, _i64, _i64, _P]),
    "ggml_quantize_requires_imatrix": (ctypes.c_bool, [_int]),
    "ggml_quantize_init": (None, [_int]),
    "ggml_row_size": (_sz, [_int, _i64]),
    "ggml_blck_size": (_i64, [_int]),
    "ggml_type_name": (ctypes.c_char_p, [_int]),
    "ggml_op_name": (ctypes.c_char_p, [_int]),
    "ggml_nrows": (_i64, [_P]),
    "ggml_nbytes": (_sz, [_P]),
    "ggml_backend_buffer_is_host": (ctypes.c_bool, [_P]),
    "ggml_backend_tensor_get": (None, [_P, _P, _sz, _sz]),
    "ggml_new_tensor_2d": (_P, [_P, _int, _i64, _i64]),
    "ggml_set_name": (_P, [_P, ctypes.c_char_p]),
    "ggml_free": (None, [_P]),
}


@lru_cache(maxsize=1)
def lib() -> SimpleNamespace:
    """ggml's functions with their argument types declared, as attributes (found once, by
    localrun.ggml: the copies libllama uses, so both share ggml's quantization tables)."""
    g = SimpleNamespace(**{name: function(name, res, *args) for name, (res, args) in _FUNCTIONS.items()})
    _check_layout(g)
    return g


def _check_layout(g: SimpleNamespace) -> None:
    """Make a tensor with ggml itself and compare what the struct view reads."""

    class InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    ggml_init = function("ggml_init", ctypes.c_void_p, InitParams)
    ctx = ggml_init(InitParams(1 << 16, None, True))
    try:
        t = g.ggml_new_tensor_2d(ctx, 0, 96, 7)  # F32, 96 x 7
        g.ggml_set_name(t, b"localrun.layout_probe")
        view = GgmlTensor.from_address(t)
        ok = (
            view.type == 0 and list(view.ne) == [96, 7, 1, 1] and view.nb[1] == 96 * 4
            and view.name == b"localrun.layout_probe" and g.ggml_nrows(t) == 7
        )
    finally:
        g.ggml_free(ctx)
    if not ok:
        raise BackendUnavailableError(
            "the installed ggml's tensor struct differs from the one localrun expects; "
            "update localrun or install a matching llama-cpp-python"
        )


def type_name(ggml_type: int) -> str:
    return lib().ggml_type_name(int(ggml_type)).decode()


def op_name(op: int) -> str:
    return lib().ggml_op_name(int(op)).decode()


def block_size(ggml_type: int) -> int:
    return int(lib().ggml_blck_size(int(ggml_type)))


def row_size(ggml_type: int, n_per_row: int) -> int:
    return int(lib().ggml_row_size(int(ggml_type), int(n_per_row)))


def requires_imatrix(ggml_type: int) -> bool:
    return bool(lib().ggml_quantize_requires_imatrix(int(ggml_type)))


def quantize_rows(
    ggml_type: int,
    rows: np.ndarray,
    imatrix: np.ndarray | None = None,
    threads: int | None = None,
) -> np.ndarray:
    """Quantize a float32 [n_rows, n_per_row] matrix; returns the raw GGML blocks.

    `imatrix` is one non-negative importance per column (n_per_row floats), or, for a
    3-D expert stack flattened to rows, [n_mat, n_per_row] with n_rows divisible by
    n_mat. Rows are split across threads (ctypes releases the GIL during the call).
    """
    g = lib()
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2:
        raise BadRequestError(f"quantize_rows needs a 2-D matrix, got shape {rows.shape}")
    n_rows, n_per_row = rows.shape
    if n_per_row % block_size(ggml_type):
        raise BadRequestError(
            f"rows of {n_per_row} values cannot be {type_name(ggml_type)} "
            f"(blocks of {block_size(ggml_type)})"
        )
    mats = None
    if imatrix is not None:
        mats = np.ascontiguousarray(imatrix, dtype=np.float32).reshape(-1, n_per_row)
        if n_rows % mats.shape[0]:
            raise BadRequestError(f"an importance matrix of {mats.shape[0]} slices does not fit {n_rows} rows")
    elif requires_imatrix(ggml_type):
        raise BadRequestError(f"{type_name(ggml_type)} needs an importance matrix")
    g.ggml_quantize_init(int(ggml_type))  # builds i-quant grids once, before threads race
    rsize = row_size(ggml_type, n_per_row)
    out = np.empty(n_rows * rsize, dtype=np.uint8)
    rows_per_mat = n_rows // (mats.shape[0] if mats is not None else 1)

    # Chunks never cross an expert boundary: each slice has its own importance row.
    n_thr = max(1, threads or usable_cpus())
    step = max(1, min(rows_per_mat, -(-n_rows // (n_thr * 4))))
    jobs = []
    for mat_start in range(0, n_rows, rows_per_mat):
        for start in range(mat_start, mat_start + rows_per_mat, step):
            jobs.append((start, min(step, mat_start + rows_per_mat - start)))

    def run(job: tuple[int, int]) -> int:
        start, n = job
        im = None
        if mats is not None:
            im = mats[start // rows_per_mat].ctypes.data
        # ggml_quantize_chunk takes `start` as an element index (a row multiple) and
        # offsets both src and dst from it itself.
        return int(g.ggml_quantize_chunk(
            int(ggml_type), rows.ctypes.data, out.ctypes.data, start * n_per_row, n, n_per_row, im
        ))

    if n_thr == 1 or len(jobs) == 1:
        written = sum(run(j) for j in jobs)
    else:
        with ThreadPoolExecutor(n_thr) as pool:
            written = sum(pool.map(run, jobs))
    if written != out.nbytes:
        raise RuntimeError(f"ggml wrote {written} bytes, expected {out.nbytes}")
    return out
