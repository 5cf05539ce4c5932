"""Validate a GGUF file in pure Python before llama.cpp parses it.

llama.cpp's own GGUF parser has had memory-safety bugs, so a corrupt or hostile
file must be caught here, with a typed one-line error, while the process is still
safe. Every read is bounds-checked against the file size, and every count read
from the file is checked against the bytes that remain before anything loops or
allocates on it, so a kv_count of 2**60 fails at once instead of hanging.

A model split by gguf-split (`name-00001-of-00003.gguf`, ...) is checked as llama.cpp
will open it: the first part names the count (`split.count`), the other parts are
found by llama.cpp's naming rule, and each is parsed with the same limits.

An error names the file, the field and the byte offset, and never quotes the file:
no magic bytes, no key or tensor names, no string values (a server may be asked to
read any path; its answer must not leak what a non-model file holds). Numbers of the
header (version, counts, shapes) are named only once the file carries the GGUF magic.
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

__all__ = ["ArrayInfo", "GGUFSummary", "MalformedGGUFError", "TensorInfo", "check_gguf", "is_gguf",
           "split_part_paths"]

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # v1 used 32-bit lengths; a different layout
MAX_TENSORS = 1 << 20
MAX_KVS = 1 << 20
MAX_STRING = 1 << 30
MAX_ARRAY_DEPTH = 4
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: llama.cpp rejects tensor names of 64 bytes or more
SMALL_ARRAY = 64  # arrays shorter than this are kept whole in the summary
INT64_MAX = (1 << 63) - 1
DEFAULT_ALIGNMENT = 32
MAX_SPLIT_COUNT = 0xFFFF  # llama.cpp reads split.count as a uint16

# GGUF value types 0..12; STRING and ARRAY have no fixed-size struct.
_STRING, _ARRAY, _BOOL = 8, 9, 7
_SCALAR = {t: struct.Struct(f) for t, f in {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
                                              6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}.items()}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_SIZE = {t: st.size for t, st in _SCALAR.items()}
_MIN_SIZE = {**_SIZE, _STRING: 8, _ARRAY: 12}  # smallest encoding of one value
_TYPE_NAMES = ["UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL",
               "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64"]
_QUANT = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class MalformedGGUFError(MalformedModelError):
    """A file that starts like GGUF (or claims to be one) but breaks the format."""

    def __init__(self, path: str, reason: str, offset: int) -> None:
        self.path, self.reason, self.offset = path, reason, offset
        super().__init__(f"{path}: malformed GGUF: {reason} at byte {offset}; "
                         "the file is corrupt or truncated; download it again")

    def __reduce__(self):  # keep it picklable across processes despite the custom __init__
        return type(self), (self.path, self.reason, self.offset)


@dataclass(frozen=True)
class ArrayInfo:
    """Stands in for a long array so the summary stays cheap (a 262k-token vocab)."""

    type: int  # GGUF value type of the elements
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order, as stored: shape[0] is the innermost dim
    ggml_type: int
    offset: int  # relative to GGUFSummary.data_offset
    nbytes: int


@dataclass(frozen=True)
class GGUFSummary:
    version: int
    n_tensors: int
    n_kv: int
    alignment: int
    data_offset: int
    file_size: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


def _open_regular(path: str):
    """Open a regular file for reading; a FIFO, device or folder is refused without blocking
    (opening a FIFO for reading waits for a writer; O_NONBLOCK makes that open return)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsupportedFormatError(f"{path}: not a regular file; a GGUF model is a plain file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when a regular file starts with the GGUF magic; reads 4 bytes, never raises."""
    try:
        with _open_regular(os.fspath(path)) as f:
            return f.read(4) == MAGIC
    except (OSError, LocalrunError):
        return False


def check_gguf(path: str | os.PathLike[str]) -> GGUFSummary:
    """Parse and validate the whole container; raise MalformedGGUFError on any flaw.

    For the first part of a split model every other part is validated too, as llama.cpp
    will open them (a one-line error names the part); the summary is the first part's."""
    summary = _parse(path)
    _check_split_parts(os.fspath(path), summary)
    return summary


def split_part_paths(first: str | os.PathLike[str], count: int) -> list[str]:
    """The paths llama.cpp opens for a model split into `count` parts, given the first
    (llama_split_prefix / llama_split_path: `<prefix>-%05d-of-%05d.gguf`, numbered from 1).
    A first part whose name does not end that way cannot be loaded: a one-line error."""
    spath = os.fspath(first)
    suffix = f"-{1:05d}-of-{count:05d}.gguf"
    if not spath.endswith(suffix) or len(spath) == len(suffix):
        raise UnsupportedFormatError(
            f"{spath}: its header says it is part 1 of a model split in {count}, but its name does not end in"
            f" {suffix!r}, so llama.cpp cannot find the other parts; keep the names gguf-split gave them")
    prefix = spath[: -len(suffix)]
    return [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def _split_field(summary: GGUFSummary, key: str, label: str, limit: int = MAX_SPLIT_COUNT) -> int | None:
    """An integer split.* value, None when absent; a non-integer is a malformed file."""
    value = summary.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise MalformedModelError(f"{label}: malformed GGUF: {key} is not an integer 0..{limit};"
                                  " the file is corrupt; download it again")
    return value


def _check_split_parts(first: str, summary: GGUFSummary) -> None:
    """Validate parts 2..N of a split model whose first part is `first` (already parsed)."""
    count = _split_field(summary, "split.count", first)
    if count is None or count <= 1:
        return  # one file: nothing else to open
    number = _split_field(summary, "split.no", first)
    if number is None:
        raise MalformedModelError(f"{first}: malformed GGUF: split.count without split.no;"
                                  " the file is corrupt; download it again")
    if number != 0:
        raise UnsupportedFormatError(f"{first} is part {number + 1} of a model split in {count}; open its first"
                                     f" part (the file whose name ends in -00001-of-{count:05d}.gguf)")
    n_tensors = summary.n_tensors
    for i, part in enumerate(split_part_paths(first, count)[1:], start=1):
        label = f"{part} (part {i + 1} of {count})"
        if not os.path.exists(part):
            raise ModelNotFoundError(f"{label} is missing: a split model loads only with every part beside"
                                     " the first; download the missing part")
        part_summary = _parse(part, label=label)
        if _split_field(part_summary, "split.no", label) != i:
            raise MalformedModelError(f"{label}: its split.no does not say part {i + 1}; it belongs to another"
                                      " split model or is corrupt; download the parts again")
        if _split_field(part_summary, "split.count", label) not in (None, count):
            raise MalformedModelError(f"{label}: its split.count differs from the first part's; it belongs to"
                                      " another split model; download the parts again")
        n_tensors += part_summary.n_tensors
    expected = _split_field(summary, "split.tensors.count", first, limit=MAX_TENSORS * count)
    if expected is not None and expected != n_tensors:
        raise MalformedModelError(f"{first}: the parts hold {n_tensors} tensors, the first part promises"
                                  f" {expected}; a part is from another split model; download the parts again")


class _Reader:
    """Cursor over the mapped file; every read checks the end of the file first."""

    def __init__(self, buf: Any, size: int, path: str, trace: list | None) -> None:
        self.buf, self.size, self.path, self.pos, self.trace = buf, size, path, 0, trace

    def fail(self, reason: str, offset: int | None = None) -> MalformedGGUFError:
        return MalformedGGUFError(self.path, reason, self.pos if offset is None else offset)

    def mark(self, label: str) -> None:
        if self.trace is not None:  # tests use this to find fields to corrupt
            self.trace.append((label, self.pos))

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} left")

    def read(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        (v,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return v

    def raw_string(self, what: str) -> bytes:
        start = self.pos
        n = self.read(_U64, f"{what} length")
        if n > MAX_STRING or n > self.size - self.pos:
            raise self.fail(f"{what} length {n} exceeds the {self.size - self.pos} bytes left", start)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def name(self, what: str) -> str:  # keys and tensor names; never put into an error
        start, raw = self.pos, self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", start) from None

    def value_type(self, what: str) -> int:
        start, t = self.pos, self.read(_U32, what)
        if t >= len(_TYPE_NAMES):
            raise self.fail(f"{what} {t} is not a GGUF value type (0..12)", start)
        return t

    def value(self, t: int, depth: int = 0) -> Any:
        if t == _STRING:
            # Values may be any bytes (tokenizer pieces); keys and tensor names may not.
            return self.raw_string("string").decode("utf-8", errors="replace")
        if t != _ARRAY:
            v = self.read(_SCALAR[t], f"{_TYPE_NAMES[t]} value")
            return bool(v) if t == _BOOL else v
        start = self.pos
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested deeper than {MAX_ARRAY_DEPTH}", start)
        et = self.value_type("array element type")
        count = self.read(_U64, "array length")
        # Each element takes at least _MIN_SIZE bytes, so this bounds every loop below.
        if count > (self.size - self.pos) // _MIN_SIZE[et]:
            raise self.fail(f"array of {count} {_TYPE_NAMES[et]} does not fit in the file", start)
        if count < SMALL_ARRAY:
            return [self.value(et, depth + 1) for _ in range(count)]
        if et in _SIZE:
            self.pos += count * _SIZE[et]  # fixed size: already known to fit
        elif et == _STRING:
            self._skip_strings(count)
        else:
            for _ in range(count):
                self.value(et, depth + 1)
        return ArrayInfo(et, count)

    def _skip_strings(self, count: int) -> None:
        # The hot loop for a 262k-token vocab: read each length, jump over the bytes.
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        last = size - 8
        for _ in range(count):
            if pos > last:
                self.pos = pos
                self.need(8, "string length")
            (n,) = unpack(buf, pos)
            if n > size - pos - 8:
                raise self.fail(f"string length {n} exceeds the {size - pos - 8} bytes left", pos)
            pos += 8 + n
        self.pos = pos


def _parse(path: str | os.PathLike[str], trace: list | None = None, label: str | None = None) -> GGUFSummary:
    """The parser; `trace` (tests only) collects (field label, byte offset) pairs;
    `label` names the file in errors (a split part: "<path> (part 2 of 3)")."""
    spath = os.fspath(path)
    label = label or spath
    try:
        with _open_regular(spath) as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:  # mmap refuses empty files; too short for a magic anyway
                raise MalformedGGUFError(label, f"file is only {size} bytes, no GGUF header", 0)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_buffer(_Reader(buf, size, label, trace))
    except FileNotFoundError:
        raise ModelNotFoundError(f"{label}: no such file") from None
    except LocalrunError:
        raise
    except OSError as e:
        raise UnsupportedFormatError(f"{label}: cannot read the file: {e.strerror or e}") from None


def _parse_buffer(r: _Reader) -> GGUFSummary:
    if r.buf[:4] != MAGIC:
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
    if n_tensors > MAX_TENSORS or n_tensors * 32 > r.size - r.pos:
        raise r.fail(f"tensor count {n_tensors} is impossible for this file", 8)
    if n_kv > MAX_KVS or n_kv * 13 + n_tensors * 32 > r.size - r.pos:
        raise r.fail(f"kv count {n_kv} is impossible for this file", 16)

    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        r.mark(f"kv[{i}].key")
        start = r.pos
        key = r.name("key")
        if key in metadata:
            raise r.fail(f"duplicate key (kv #{i})", start)
        r.mark(f"kv[{i}].type")
        t = r.value_type(f"type of kv #{i}")
        r.mark(f"kv[{i}].value")
        metadata[key] = r.value(t)
        if key == "general.alignment":
            a = metadata[key]
            if t not in _INTEGER_TYPES or a <= 0 or a & (a - 1):
                raise r.fail("general.alignment is not a positive power of two", start)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)

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
            raise r.fail(f"{what}: row of {shape[0]} is not a multiple of the block size {block}",
                         r.pos - 4)
        r.mark(f"tensor[{i}].offset")
        offset = r.read(_U64, f"{what} offset")
        if offset % alignment:
            raise r.fail(f"{what}: data offset {offset} is not aligned to {alignment}", r.pos - 8)
        infos.append((TensorInfo(name, shape, gtype, offset, n_elems // block * type_size), r.pos - 8))

    data_offset = r.pos + (-r.pos % alignment)
    r.pos = data_offset
    r.mark("data")
    if n_tensors and data_offset > r.size:
        raise r.fail(f"truncated: data section starts past the end ({r.size} bytes)", r.size)
    for i, (info, field_at) in enumerate(infos):
        if data_offset + info.offset + info.nbytes > r.size:
            raise r.fail(f"truncated: tensor #{i} data ({info.nbytes} bytes at data "
                         f"offset {info.offset}) runs past the end ({r.size} bytes)", field_at)
    return GGUFSummary(version, n_tensors, n_kv, alignment, data_offset, r.size, metadata,
                       tuple(info for info, _ in infos))
