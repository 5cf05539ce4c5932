"""Fast GGUF plumbing for rewriting a model: copy its metadata verbatim, stream tensors.

gguf's GGUFReader decodes every metadata value into numpy parts, ~7 s for a 49k-token
vocabulary with its merges; a quantizer only has to copy those bytes. `kv_entries`
returns each key with the raw bytes of its entry (key, type, value) by walking the
lengths, and `GGUFOut` writes a GGUF v3 from such raw entries plus new typed values,
then the tensor infos and the tensor data, one tensor at a time.

Only call `kv_entries` on a file `localrun.gguf_check.check_gguf` accepted: it does the
bounds checks; this walker trusts the lengths.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

_U8, _U32, _I32, _U64, _F32 = (struct.Struct(f) for f in ("<B", "<I", "<i", "<Q", "<f"))
STRING, ARRAY, BOOL, UINT32, INT32, FLOAT32 = 8, 9, 7, 4, 5, 6
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def kv_entries(path: str | os.PathLike) -> list[tuple[str, bytes]]:
    """[(key, raw entry bytes)] in file order."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        (n_kv,) = _U64.unpack_from(buf, 16)
        pos, out = 24, []
        for _ in range(n_kv):
            start = pos
            (klen,) = _U64.unpack_from(buf, pos)
            key = bytes(buf[pos + 8 : pos + 8 + klen]).decode("utf-8")
            pos += 8 + klen
            (vtype,) = _U32.unpack_from(buf, pos)
            pos = _skip_value(buf, pos + 4, vtype)
            out.append((key, bytes(buf[start:pos])))
        return out


def _skip_value(buf, pos: int, vtype: int) -> int:
    if vtype in _FIXED:
        return pos + _FIXED[vtype]
    if vtype == STRING:
        return pos + 8 + _U64.unpack_from(buf, pos)[0]
    if vtype == ARRAY:
        (et,) = _U32.unpack_from(buf, pos)
        (count,) = _U64.unpack_from(buf, pos + 4)
        pos += 12
        if et in _FIXED:
            return pos + count * _FIXED[et]
        unpack = _U64.unpack_from
        for _ in range(count):
            if et == STRING:
                pos += 8 + unpack(buf, pos)[0]
            else:
                pos = _skip_value(buf, pos, et)
        return pos
    raise ValueError(f"unknown GGUF value type {vtype}")


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
