"""A small valid GGUF file and corrupt copies of it, for the GGUF validator's tests
(test_gguf_check.py, test_gguf_check_split.py, test_gguf_check_untrusted.py).

A small valid file is written with gguf.GGUFWriter; corrupt copies are made by
patching fields whose byte offsets the reader itself reports (`read_header(trace=...)`),
so no offset is a magic number.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from localrun.model.gguf_check import MalformedGGUFError, check_gguf
from localrun.model.gguf_header import read_header

Q8 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16
F32 = gguf.GGMLQuantizationType.F32

TOKENS = ["<s>", "</s>", "hello", "wörld"]
PER_LAYER = [float(i) / 2 for i in range(100)]  # a number array of <= 512: kept whole (per-layer values)
RNG = np.random.default_rng(0)
TENSORS = {  # name -> (numpy array as written, ggml type)
    "a.weight": (RNG.standard_normal((3, 8)).astype(np.float32), F32),
    "b.weight": (RNG.standard_normal((5,)).astype(np.float16), F16),
    "c.weight": (RNG.standard_normal((2, 64)).astype(np.float32), Q8),
}


def write_valid(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_name("tiny test")
    w.add_context_length(128)
    w.add_bool("test.flag", True)
    w.add_float32("test.eps", 0.5)
    w.add_int64("test.big", -(2**40))
    w.add_array("tokenizer.ggml.tokens", TOKENS)
    w.add_array("test.per_layer", PER_LAYER)
    for name, (arr, qtype) in TENSORS.items():
        w.add_tensor(name, quantize(arr, Q8) if qtype == Q8 else arr, raw_dtype=Q8 if qtype == Q8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", name="valid")  # imported by name into the test modules
def valid_gguf(tmp_path_factory) -> tuple[Path, bytes, dict[str, int]]:
    """The valid file, its bytes, and label -> byte offset of every parsed field."""
    path = write_valid(tmp_path_factory.mktemp("gguf") / "valid.gguf")
    trace: list[tuple[str, int]] = []
    read_header(path, trace)
    return path, path.read_bytes(), dict(trace)


def field(offsets: dict[str, int], kind: str, key_or_tensor: str, data: bytes) -> int:
    """Offset of a kv's/tensor's field, found by reading the name at each candidate."""
    for label, at in offsets.items():
        if label.endswith(".key" if kind == "kv" else ".name"):
            (n,) = struct.unpack_from("<Q", data, at)
            if data[at + 8:at + 8 + n].decode() == key_or_tensor:
                return at
    raise KeyError(key_or_tensor)


def label_of(offsets: dict[str, int], at: int) -> str:
    return next(label for label, off in offsets.items() if off == at)


def patched(tmp_path: Path, data: bytes, at: int, fmt: str, value) -> Path:
    buf = bytearray(data)
    struct.pack_into(fmt, buf, at, value)
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(buf))
    return p



def rejects(path: Path, *words: str) -> MalformedGGUFError:
    with pytest.raises(MalformedGGUFError) as ei:
        check_gguf(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg and "at byte" in msg
    assert msg.endswith("download it again")
    for w in words:
        assert w in msg, msg
    return ei.value

