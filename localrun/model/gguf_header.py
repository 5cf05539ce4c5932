"""The one GGUF header reader: a whole file, or the first bytes of one, read with limits.

Every GGUF header localrun reads goes through here: the validator (gguf_check.py, which
adds split-model checks), `pull`'s look at a remote file's header (hub.py, from a prefix
fetched with a Range request) and the quantize/convert writers' raw metadata copy
(quant/gguf_io.py). So the value-type table below is the only one in localrun.

Limits, checked before anything loops or allocates on a number read from the file:
every read is bounds-checked against the bytes that remain; a count (kvs, tensors, array
elements) must fit in those bytes at its smallest encoding, so a kv_count of 2**60 fails
at once instead of hanging; arrays nest at most MAX_ARRAY_DEPTH deep; and the header
(everything before the tensor data) may not pass MAX_HEADER_BYTES, which also bounds
every string and the work a hostile header can ask for.

A prefix (`read_header_prefix`) that ends inside the header raises NeedMoreBytes, which
is no error: fetch at least `at_least` bytes and read again. What the prefix does hold is
validated exactly as a file is (against the file's size, when the caller knows it).

An error (MalformedGGUFError) names the file, the field and the byte offset, and never
quotes the file: no magic bytes, no key or tensor names, no string values (a server may
be asked to read any path; its answer must not leak what a non-model file holds).
Numbers of the header (version, counts, shapes) are named only past the GGUF magic.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES

from localrun.errors import LocalrunError, MalformedModelError, ModelNotFoundError, UnsupportedFormatError

__all__ = ["ArrayInfo", "GGUFHeader", "MalformedGGUFError", "NeedMoreBytes", "TensorInfo", "open_regular",
           "read_header", "read_header_prefix"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths; a different layout
MAX_TENSORS = 1 << 20
MAX_KVS = 1 << 20
MAX_HEADER_BYTES = 256 << 20  # a 262k-token vocabulary with scores takes ~8 MiB
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: llama.cpp rejects tensor names of 64 bytes or more
SMALL_ARRAY = 64  # string (and nested) arrays shorter than this are kept whole
# Number arrays up to this long are kept whole: per-layer values (head counts, sliding
# window patterns) for as many layers as llama.cpp allows (LLAMA_MAX_LAYERS).
KEPT_NUMBER_ARRAY = 512
INT64_MAX = (1 << 63) - 1
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.h, enum gguf_type): the only table of them in localrun.
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING", "ARRAY",
              "UINT64", "INT64", "FLOAT64")
STRUCT_CODES = {UINT8: "B", INT8: "b", UINT16: "H", INT16: "h", UINT32: "I", INT32: "i", FLOAT32: "f", BOOL: "B",
                UINT64: "Q", INT64: "q", FLOAT64: "d"}  # the fixed-size types
INTEGER_TYPES = frozenset({UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64})
_SCALAR = {t: struct.Struct("<" + code) for t, code in STRUCT_CODES.items()}
_SIZE = {t: st.size for t, st in _SCALAR.items()}
_MIN_SIZE = {**_SIZE, STRING: 8, ARRAY: 12}  # smallest encoding of one value
_QUANT = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}  # ggml tensor type -> (block, bytes)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class MalformedGGUFError(MalformedModelError):
    """A file that starts like GGUF (or claims to be one) but breaks the format."""

    def __init__(self, path: str, reason: str, offset: int) -> None:
        self.path, self.reason, self.offset = path, reason, offset
        super().__init__(f"{path}: malformed GGUF: {reason} at byte {offset}; "
                         "the file is corrupt or truncated; download it again")

    def __reduce__(self):  # keep it picklable across processes despite the custom __init__
        return type(self), (self.path, self.reason, self.offset)


class NeedMoreBytes(Exception):
    """A prefix ends inside the header: read again with at least `at_least` bytes."""

    def __init__(self, at_least: int) -> None:
        self.at_least = at_least
        super().__init__(f"the GGUF header needs at least {at_least} bytes")


@dataclass(frozen=True)
class ArrayInfo:
    """Stands in for a long array so the header stays cheap (a 262k-token vocab)."""

    type: int  # GGUF value type of the elements
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order, as stored: shape[0] is the innermost dim
    ggml_type: int
    offset: int  # relative to GGUFHeader.data_offset
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int
    file_size: int | None  # None: a prefix of a file whose size the caller did not know
    metadata: dict[str, Any]  # key -> int, float, bool, str, list, or ArrayInfo for a long array
    tensors: tuple[TensorInfo, ...]
    value_types: dict[str, int]  # key -> its GGUF value type (UINT32, STRING, ARRAY, ...)
    kv_spans: dict[str, tuple[int, int]]  # key -> [start, end) of its whole entry (key, type, value)


def open_regular(path: str):
    """Open a regular file for reading; a FIFO, device or folder is refused without blocking
    (opening a FIFO for reading waits for a writer; O_NONBLOCK makes that open return)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsupportedFormatError(f"{path}: not a regular file; a model file is a plain file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_header(path: str | os.PathLike[str], trace: list | None = None, label: str | None = None) -> GGUFHeader:
    """The validated header of a GGUF file (tensor data extents checked against its size).

    `label` names the file in errors (a split part: "<path> (part 2 of 3)"); `trace`
    (tests only) collects (field label, byte offset) pairs."""
    spath = os.fspath(path)
    label = label or spath
    try:
        with open_regular(spath) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:  # mmap refuses empty files; too short for a magic anyway
                raise MalformedGGUFError(label, f"file is only {size} bytes, no GGUF header", 0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, size, size, label, trace))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{label}: no such file") from None
    except LocalrunError:
        raise
    except OSError as e:
        raise UnsupportedFormatError(f"{label}: cannot read the file: {e.strerror or e}") from None


def read_header_prefix(prefix: bytes, file_size: int | None, label: str) -> GGUFHeader:
    """The header from the first bytes of a GGUF file of `file_size` bytes (None: unknown).

    Raises NeedMoreBytes when the prefix ends inside the header, MalformedGGUFError when
    what it holds breaks the format (or the file size it was given)."""
    avail = len(prefix) if file_size is None else min(len(prefix), file_size)
    return _parse(_Cursor(prefix, avail, file_size, label, None))


class _Cursor:
    """A position in the bytes at hand (`avail` of them) of a file of `size` bytes."""

    def __init__(self, buf: Any, avail: int, size: int | None, label: str, trace: list | None) -> None:
        self.buf, self.avail, self.size, self.label, self.trace = buf, avail, size, label, trace
        self.pos = 0
        # Header reads stop here: the end of the file or the header limit, whichever is first.
        self.end = MAX_HEADER_BYTES if size is None else min(size, MAX_HEADER_BYTES)

    def fail(self, reason: str, offset: int | None = None) -> MalformedGGUFError:
        return MalformedGGUFError(self.label, reason, self.pos if offset is None else offset)

    def mark(self, label: str) -> None:
        if self.trace is not None:  # tests use this to find fields to corrupt
            self.trace.append((label, self.pos))

    def left(self) -> int:
        return self.end - self.pos

    def past_end(self, what: str, offset: int) -> MalformedGGUFError:
        """`what` does not fit before the end: of the file, or of the header limit."""
        if self.end == self.size:
            return self.fail(f"{what} exceeds the {self.left()} bytes left", offset)
        return self.fail(f"{what} runs past the {MAX_HEADER_BYTES >> 20} MiB header limit", offset)

    def need(self, n: int, what: str) -> None:
        if n > self.end - self.pos:
            if self.end == self.size:
                raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} left")
            raise self.fail(f"{what} runs past the {MAX_HEADER_BYTES >> 20} MiB header limit")
        if n > self.avail - self.pos:
            raise NeedMoreBytes(self.pos + n)

    def read(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.read(_U64, f"{what} length")
        if n > self.left():
            raise self.past_end(f"{what} length {n}", start)
        self.need(n, what)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def name(self, what: str) -> str:  # keys and tensor names; never put into an error
        start, raw = self.pos, self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", start) from None

    def value_type(self, what: str) -> int:
        start, t = self.pos, self.read(_U32, what)
        if t >= len(TYPE_NAMES):
            raise self.fail(f"{what} {t} is not a GGUF value type (0..12)", start)
        return t

    def value(self, t: int, depth: int = 0) -> Any:
        if t == STRING:
            # Values may be any bytes (tokenizer pieces); keys and tensor names may not.
            return self.raw_string("string").decode("utf-8", errors="replace")
        if t != ARRAY:
            v = self.read(_SCALAR[t], f"{TYPE_NAMES[t]} value")
            return bool(v) if t == BOOL else v
        start = self.pos
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_DEPTH}", start)
        et = self.value_type("array element type")
        count = self.read(_U64, "array length")
        # Each element takes at least _MIN_SIZE bytes, so this bounds every loop below.
        if count > self.left() // _MIN_SIZE[et]:
            raise self.past_end(f"array of {count} {TYPE_NAMES[et]}", start)
        if et in _SIZE:
            return self._numbers(et, count)
        if count < SMALL_ARRAY:
            return [self.value(et, depth + 1) for _ in range(count)]
        if et == STRING:
            self._skip_strings(count)
        else:
            for _ in range(count):
                self.value(et, depth + 1)
        return ArrayInfo(et, count)

    def _numbers(self, et: int, count: int) -> list | ArrayInfo:
        nbytes = count * _SIZE[et]  # known to fit before the end (the count check)
        if count > KEPT_NUMBER_ARRAY:
            self.pos += nbytes  # the bytes need not be at hand: the next read asks for them
            return ArrayInfo(et, count)
        self.need(nbytes, f"array of {TYPE_NAMES[et]}")
        values = list(struct.unpack_from(f"<{count}{STRUCT_CODES[et]}", self.buf, self.pos))
        self.pos += nbytes
        return [bool(v) for v in values] if et == BOOL else values

    def _skip_strings(self, count: int) -> None:
        # The hot loop for a 262k-token vocab: read each length, jump over the bytes.
        buf, pos, end, unpack = self.buf, self.pos, self.end, _U64.unpack_from
        last = min(end, self.avail) - 8  # the last position a length can be read from
        for _ in range(count):
            if pos > last:
                self.pos = pos
                self.need(8, "string length")  # raises: truncated, past the limit, or need more
            (n,) = unpack(buf, pos)
            if n > end - pos - 8:
                self.pos = pos + 8
                raise self.past_end(f"string length {n}", pos)
            pos += 8 + n
        self.pos = pos


def _parse(r: _Cursor) -> GGUFHeader:
    r.need(4, "magic")
    if bytes(r.buf[:4]) != MAGIC:
        raise r.fail("bad magic (not a GGUF file)", 0)  # never the bytes: they may be a secret
    r.pos = 4
    r.mark("version")
    version = r.read(_U32, "version")
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file)" if swapped in SUPPORTED_VERSIONS else ""
        raise r.fail(f"unsupported version {version}{hint}; only 2 and 3 are read", 4)
    r.mark("n_tensors")
    n_tensors = r.read(_U64, "tensor count")
    r.mark("n_kv")
    n_kv = r.read(_U64, "kv count")
    # Smallest kv: empty key (8) + type (4) + one byte; smallest tensor info: 32 bytes.
    if n_tensors > MAX_TENSORS or n_tensors * 32 > r.left():
        raise r.fail(f"tensor count {n_tensors} is impossible for this file", 8)
    if n_kv > MAX_KVS or n_kv * 13 + n_tensors * 32 > r.left():
        raise r.fail(f"kv count {n_kv} is impossible for this file", 16)
    metadata, value_types, spans = _read_kvs(r, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    tensors = _read_tensor_infos(r, n_tensors, alignment)

    data_offset = r.pos + (-r.pos % alignment)
    r.pos = data_offset
    r.mark("data")
    if r.size is not None:
        if n_tensors and data_offset > r.size:
            raise r.fail(f"truncated: data section starts past the end ({r.size} bytes)", r.size)
        for i, (info, field_at) in enumerate(tensors):
            if data_offset + info.offset + info.nbytes > r.size:
                raise r.fail(f"truncated: tensor #{i} data ({info.nbytes} bytes at data "
                             f"offset {info.offset}) runs past the end ({r.size} bytes)", field_at)
    return GGUFHeader(version, n_tensors, n_kv, alignment, data_offset, r.size, metadata,
                      tuple(info for info, _ in tensors), value_types, spans)


def _read_kvs(r: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, int], dict[str, tuple[int, int]]]:
    metadata: dict[str, Any] = {}
    value_types: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    for i in range(n_kv):
        r.mark(f"kv[{i}].key")
        start = r.pos
        key = r.name("key")
        if key in metadata:
            raise r.fail(f"duplicate key (kv #{i})", start)
        r.mark(f"kv[{i}].type")
        t = r.value_type(f"type of kv #{i}")
        r.mark(f"kv[{i}].value")
        metadata[key], value_types[key] = r.value(t), t
        spans[key] = (start, r.pos)
        if key == "general.alignment":
            a = metadata[key]
            if t not in INTEGER_TYPES or a <= 0 or a & (a - 1):
                raise r.fail("general.alignment is not a positive power of two", start)
    return metadata, value_types, spans


def _read_tensor_infos(r: _Cursor, n_tensors: int, alignment: int) -> list[tuple[TensorInfo, int]]:
    """(info, offset of its data-offset field) per tensor: a data error points at the field."""
    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        r.mark(f"tensor[{i}].name")
        start = r.pos
        name = r.name("tensor name")
        what = f"tensor #{i}"
        if len(name.encode()) >= MAX_NAME:
            raise r.fail(f"{what}: name is {MAX_NAME} bytes or longer", start)
        if name in names:
            raise r.fail(f"duplicate {what}", start)
        names.add(name)
        r.mark(f"tensor[{i}].n_dims")
        n_dims = r.read(_U32, f"{what} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"{what}: n_dims {n_dims} is not 1..{MAX_DIMS}", r.pos - 4)
        r.mark(f"tensor[{i}].dims")
        shape = tuple(r.read(_U64, f"{what} dims") for _ in range(n_dims))
        n_elems = math.prod(shape)  # a Python int: cannot overflow, so compare with int64
        if 0 in shape or n_elems > INT64_MAX:
            raise r.fail(f"{what}: shape {shape} is empty or overflows int64", r.pos - 8 * n_dims)
        r.mark(f"tensor[{i}].type")
        gtype = r.read(_U32, f"{what} type")
        if gtype not in _QUANT:
            raise r.fail(f"{what}: unknown ggml type {gtype}", r.pos - 4)
        block, type_size = _QUANT[gtype]
        if shape[0] % block:  # ggml quantizes whole rows, as llama.cpp checks
            raise r.fail(f"{what}: row of {shape[0]} is not a multiple of the block size {block}", r.pos - 4)
        r.mark(f"tensor[{i}].offset")
        offset = r.read(_U64, f"{what} offset")
        if offset % alignment:
            raise r.fail(f"{what}: data offset {offset} is not aligned to {alignment}", r.pos - 8)
        infos.append((TensorInfo(name, shape, gtype, offset, n_elems // block * type_size), r.pos - 8))
    return infos
