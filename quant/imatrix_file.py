"""Importance matrices on disk, in llama.cpp's imatrix GGUF layout.

An importance matrix holds, for every weight matrix the model multiplies activations
by, the sum over calibration tokens of each input column's squared activation, and
how many token rows went into that sum. llama.cpp's tools write and read it as a GGUF:

    general.type        = "imatrix"
    imatrix.datasets    = [calibration file names]
    imatrix.chunk_count = chunks processed
    imatrix.chunk_size  = tokens per chunk
    <weight>.in_sum2    F32, ne = [n_cols, n_mat]   (sum of x^2 per column)
    <weight>.counts     F32, ne = [1, n_mat]        (token rows summed)

(n_mat is 1 except for stacked expert matrices.) A quantizer weighs column j of a
matrix by in_sum2[j] / counts: the mean squared activation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from localrun.errors import LocalrunError, MalformedModelError, ModelNotFoundError

from .atomic import atomic_output

SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"


@dataclass
class ImportanceMatrix:
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n_mat, n_cols] float64
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [n_mat] float64
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def add(self, name: str, sq_sum: np.ndarray, rows: int, mat: int = 0, n_mat: int = 1) -> None:
        """Accumulate `sq_sum` (per-column sum of squares over `rows` token rows)."""
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, sq_sum.shape[-1]), np.float64)
            self.counts[name] = np.zeros(n_mat, np.float64)
        self.sums[name][mat] += sq_sum
        self.counts[name][mat] += rows

    def mean(self, name: str) -> np.ndarray | None:
        """Mean squared activation per column ([n_mat, n_cols] float32), or None if unseen."""
        if name not in self.sums:
            return None
        c = self.counts[name]
        if not np.all(c > 0):
            return None  # an expert never routed to: quantize it without weights
        return (self.sums[name] / c[:, None]).astype(np.float32)

    def __len__(self) -> int:
        return len(self.sums)


def save_imatrix(im: ImportanceMatrix, path: str | os.PathLike) -> Path:
    """Write `im` as an imatrix GGUF (temp file + rename: never a half-written file)."""
    import gguf

    path = Path(path).expanduser()
    if not im.sums:
        raise LocalrunError("the importance matrix is empty: no weight matrix saw a calibration token")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        # GGUFWriter insists on an architecture key; an imatrix file has none, so the
        # writer's automatic key is dropped before anything is written.
        w = gguf.GGUFWriter(tmp, arch="")
        w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(im.datasets) or ["unknown"])
        w.add_uint32("imatrix.chunk_count", int(im.chunk_count))
        w.add_uint32("imatrix.chunk_size", int(im.chunk_size))
        for name in sorted(im.sums):  # a stable order, as llama.cpp writes it
            w.add_tensor(name + SUM_SUFFIX, im.sums[name].astype(np.float32))
            w.add_tensor(name + COUNT_SUFFIX, im.counts[name].astype(np.float32).reshape(-1, 1))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path


def load_imatrix(path: str | os.PathLike) -> ImportanceMatrix:
    """Read an imatrix GGUF written by localrun or by llama.cpp's `llama-imatrix`."""
    import gguf

    from localrun.model.gguf_check import check_gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelNotFoundError(f"no such importance matrix file: {path}")
    summary = check_gguf(path)  # typed error for a truncated or corrupt file
    if summary.metadata.get("general.type") != "imatrix":
        hint = " (it is a model; make one with: localrun imatrix MODEL --calibration FILE -o OUT)" \
            if summary.metadata.get("general.architecture") else ""
        raise MalformedModelError(f"{path} is not an imatrix GGUF{hint}")
    reader = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    im = ImportanceMatrix(
        datasets=list(meta.get("imatrix.datasets") or []),
        chunk_count=int(meta.get("imatrix.chunk_count", 0)),
        chunk_size=int(meta.get("imatrix.chunk_size", 0)),
    )
    tensors = {t.name: t for t in reader.tensors}
    for tname, t in tensors.items():
        if not tname.endswith(SUM_SUFFIX):
            continue
        name = tname[: -len(SUM_SUFFIX)]
        c = tensors.get(name + COUNT_SUFFIX)
        if c is None:
            raise MalformedModelError(f"{path}: '{tname}' has no matching '{name}{COUNT_SUFFIX}'")
        if t.tensor_type != gguf.GGMLQuantizationType.F32 or c.tensor_type != gguf.GGMLQuantizationType.F32:
            raise MalformedModelError(f"{path}: the sums and counts of '{name}' must be F32")
        counts = np.asarray(c.data, np.float64).reshape(-1)
        sums = np.asarray(t.data, np.float64).reshape(len(counts), -1)
        im.sums[name], im.counts[name] = sums, counts
    if not im.sums:
        raise MalformedModelError(f"{path} holds no '*{SUM_SUFFIX}' tensors; it is not an importance matrix")
    return im


def uniform_like(im: ImportanceMatrix) -> ImportanceMatrix:
    """The same matrices with every column weighted equally (a control for tests)."""
    out = ImportanceMatrix(datasets=["uniform"], chunk_count=im.chunk_count, chunk_size=im.chunk_size)
    for name, s in im.sums.items():
        out.sums[name] = np.ones_like(s)
        out.counts[name] = np.ones_like(im.counts[name])
    return out
