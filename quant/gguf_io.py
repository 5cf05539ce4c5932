"""Fast GGUF plumbing for rewriting a model: copy its metadata verbatim, stream tensors.

gguf's GGUFReader decodes every metadata value into numpy parts, ~7 s for a 49k-token
vocabulary with its merges; a quantizer only has to copy those bytes. `kv_entries`
returns each key with the raw bytes of its entry (key, type, value), located by
localrun's one GGUF header reader (localrun.model.gguf_header: bounds-checked, with limits),
and `GGUFOut` writes a GGUF v3 from such raw entries plus new typed values, then the
tensor infos and the tensor data, one tensor at a time.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

from localrun.model.gguf_header import ARRAY, BOOL, FLOAT32, INT32, STRING, UINT32, open_regular, read_header

__all__ = ["ARRAY", "BOOL", "FLOAT32", "GGUFOut", "INT32", "STRING", "UINT32", "encode_kv", "kv_entries"]

_U8, _U32, _I32, _U64, _F32 = (struct.Struct(f) for f in ("<B", "<I", "<i", "<Q", "<f"))


def kv_entries(path: str | os.PathLike) -> list[tuple[str, bytes]]:
    """[(key, raw entry bytes)] in file order; a malformed file raises MalformedGGUFError."""
    spans = read_header(path).kv_spans
    if not spans:
        return []
    first, last = min(s for s, _ in spans.values()), max(e for _, e in spans.values())
    with open_regular(os.fspath(path)) as f:
        f.seek(first)
        block = f.read(last - first)  # the kv section is contiguous: one read
    return [(key, block[start - first:end - first]) for key, (start, end) in spans.items()]


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U64.pack(len(b)) + b


def encode_kv(key: str, value, vtype: int) -> bytes:
    """One metadata entry: STRING, UINT32, INT32, FLOAT32, BOOL or ARRAY of strings."""
    head = _string(key) + _U32.pack(vtype)
    if vtype == STRING:
        return head + _string(value)
    if vtype == UINT32:
        return head + _U32.pack(int(value))
    if vtype == INT32:
        return head + _I32.pack(int(value))
    if vtype == FLOAT32:
        return head + _F32.pack(float(value))
    if vtype == BOOL:
        return head + _U8.pack(1 if value else 0)
    if vtype == ARRAY:  # of strings
        return head + _U32.pack(STRING) + _U64.pack(len(value)) + b"".join(_string(v) for v in value)
    raise ValueError(f"cannot encode GGUF value type {vtype}")


@dataclass
class _Info:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the row length
    ggml_type: int
    nbytes: int


class GGUFOut:
    """Write a GGUF v3: `kv`, `tensor`, then `begin()` and `write()` per tensor in order."""

    def __init__(self, fp: BinaryIO, alignment: int = 32) -> None:
        self.fp, self.alignment = fp, alignment
        self.kvs: list[bytes] = []
        self.infos: list[_Info] = []
        self._next = 0

    def kv_raw(self, entry: bytes) -> None:
        self.kvs.append(entry)

    def kv(self, key: str, value, vtype: int) -> None:
        self.kvs.append(encode_kv(key, value, vtype))

    def tensor(self, name: str, ne: tuple[int, ...], ggml_type: int, nbytes: int) -> None:
        self.infos.append(_Info(name, tuple(int(d) for d in ne), int(ggml_type), int(nbytes)))

    def _pad(self, n: int) -> int:
        return (n + self.alignment - 1) // self.alignment * self.alignment

    def begin(self) -> None:
        f = self.fp
        f.write(b"GGUF" + _U32.pack(3) + _U64.pack(len(self.infos)) + _U64.pack(len(self.kvs)))
        for e in self.kvs:
            f.write(e)
        offset = 0
        for t in self.infos:
            f.write(_string(t.name) + _U32.pack(len(t.ne)) + b"".join(_U64.pack(d) for d in t.ne))
            f.write(_U32.pack(t.ggml_type) + _U64.pack(offset))
            offset += self._pad(t.nbytes)
        here = f.tell()
        f.write(b"\0" * (self._pad(here) - here))

    def write(self, data) -> None:
        """The next tensor's bytes (a numpy array or bytes), padded to the alignment."""
        t = self.infos[self._next]
        view = memoryview(data).cast("B")
        if view.nbytes != t.nbytes:
            raise ValueError(f"tensor {t.name}: {view.nbytes} bytes, planned {t.nbytes}")
        self.fp.write(view)
        self.fp.write(b"\0" * (self._pad(t.nbytes) - t.nbytes))
        self._next += 1
