"""The GGUF validator rejects malformed files with MalformedGGUFError, and only that.

A small valid file is written with gguf.GGUFWriter; corrupt copies are made by
patching fields whose byte offsets the reader itself reports (`read_header(trace=...)`),
so no offset is a magic number. The same reader reads a prefix of a file (`pull`'s
remote header): too few bytes is a distinct, recoverable NeedMoreBytes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from localrun.model import gguf_header
from localrun.errors import LocalrunError, MalformedModelError, ModelNotFoundError, UnsupportedFormatError
from localrun.model.gguf_check import (ArrayInfo, GGUFHeader, MalformedGGUFError, TensorInfo, check_gguf, is_gguf,
                                 split_part_paths)
from localrun.model.gguf_header import MAX_HEADER_BYTES, SMALL_ARRAY, NeedMoreBytes, read_header, read_header_prefix

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


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes, dict[str, int]]:
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


@pytest.fixture
def reads(monkeypatch) -> dict:
    """A spy on the header reader: every field it reads ((label, end byte) in "fields"), and
    the count of each string array it jumps over element by element ("skipped")."""
    seen: dict = {"fields": [], "skipped": []}
    read, skip = gguf_header._Cursor.read, gguf_header._Cursor._skip_strings

    def spy_read(self, st, what):
        seen["fields"].append((what, self.pos + st.size))
        return read(self, st, what)

    def spy_skip(self, count):
        seen["skipped"].append(count)
        return skip(self, count)

    monkeypatch.setattr(gguf_header._Cursor, "read", spy_read)
    monkeypatch.setattr(gguf_header._Cursor, "_skip_strings", spy_skip)
    return seen


def rejects(path: Path, *words: str) -> MalformedGGUFError:
    with pytest.raises(MalformedGGUFError) as ei:
        check_gguf(path)
    msg = str(ei.value)
    assert "\n" not in msg and str(path) in msg and "at byte" in msg
    assert msg.endswith("download it again")
    for w in words:
        assert w in msg, msg
    return ei.value


# --- the valid file ---------------------------------------------------------

def test_valid_file_summary_matches_what_was_written(valid):
    path, data, offsets = valid
    s = check_gguf(path)
    assert isinstance(s, GGUFHeader)
    assert (s.version, s.n_tensors, s.alignment, s.file_size) == (3, 3, 32, len(data))
    assert s.n_kv == len(s.metadata)
    md = s.metadata
    assert md["general.architecture"] == "llama" and md["general.name"] == "tiny test"
    assert md["llama.context_length"] == 128 and md["test.flag"] is True
    assert md["test.eps"] == 0.5 and md["test.big"] == -(2**40)
    assert md["tokenizer.ggml.tokens"] == TOKENS
    assert md["test.per_layer"] == PER_LAYER
    assert s.value_types["general.name"] == 8 and s.value_types["test.per_layer"] == 9
    # Each entry's bytes, which the writers copy verbatim (quant/gguf_io.py): back to back from byte 24.
    spans = list(s.kv_spans.values())
    assert spans[0][0] == 24 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    start, end = s.kv_spans["general.name"]
    assert data[start:end] == struct.pack("<Q", 12) + b"general.name" + struct.pack("<IQ", 8, 9) + b"tiny test"
    assert s.data_offset == offsets["data"] and s.data_offset % 32 == 0
    assert [t.name for t in s.tensors] == list(TENSORS)
    for t in s.tensors:
        arr, qtype = TENSORS[t.name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        assert t == TensorInfo(t.name, tuple(reversed(arr.shape)), int(qtype), t.offset,
                               arr.size // block * size)
    # Agrees with the gguf package's own reader.
    reader = gguf.GGUFReader(path)
    assert reader.data_offset == s.data_offset
    for mine, theirs in zip(s.tensors, reader.tensors):
        assert s.data_offset + mine.offset == theirs.data_offset
        assert mine.nbytes == theirs.n_bytes and list(mine.shape) == list(theirs.shape)


def test_long_number_arrays_are_summarized(tmp_path):
    """Up to 512 numbers (a value per layer) are kept; longer arrays (token scores) are not."""
    p = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(p, arch="llama")
    w.add_array("test.layers", list(range(512)))
    w.add_array("test.scores", [0.5] * 513)
    w.add_array("test.flags", [True, False] * 300)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    md = check_gguf(p).metadata
    assert md["test.layers"] == list(range(512))
    assert md["test.scores"] == ArrayInfo(gguf.GGUFValueType.FLOAT32, 513)
    assert md["test.flags"] == ArrayInfo(gguf.GGUFValueType.BOOL, 600)


def test_custom_alignment(tmp_path):
    s = check_gguf(write_valid(tmp_path / "a64.gguf", alignment=64))
    assert s.alignment == 64 and s.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in s.tensors)


def test_is_gguf(valid, tmp_path):
    (tmp_path / "x.bin").write_bytes(b"GGML....")
    assert is_gguf(valid[0])
    assert not is_gguf(tmp_path / "x.bin") and not is_gguf(tmp_path / "missing")


def test_error_is_typed_for_the_cli():
    assert issubclass(MalformedGGUFError, MalformedModelError)
    with pytest.raises(ModelNotFoundError):
        check_gguf("/nonexistent/model.gguf")
    e = MalformedGGUFError("m.gguf", "bad magic", 0)
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


# --- header -----------------------------------------------------------------

def test_bad_magic(valid, tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGML" + valid[1][4:])
    assert rejects(p, "magic").offset == 0


@pytest.mark.parametrize("size", [0, 1, 3])
def test_tiny_files(tmp_path, size):
    p = tmp_path / "t.gguf"
    p.write_bytes(b"GGUF"[:size])
    rejects(p)


@pytest.mark.parametrize("version", [1, 99, 0x03000000])
def test_unsupported_version(valid, tmp_path, version):
    _, data, off = valid
    e = rejects(patched(tmp_path, data, off["version"], "<I", version), "version")
    assert e.offset == 4


@pytest.mark.parametrize("label", ["n_tensors", "n_kv"])
@pytest.mark.parametrize("count", [2**40, 2**63, 2**64 - 1, 10_000])
def test_absurd_counts_fail_at_once(valid, tmp_path, reads, label, count):
    _, data, off = valid
    rejects(patched(tmp_path, data, off[label], "<Q", count), "count")
    # at once: refused on the counts alone, before a loop over that many entries reads anything
    assert [what for what, _ in reads["fields"]] == ["version", "tensor count", "kv count"]


# --- truncation -------------------------------------------------------------

def test_truncation_at_every_byte_of_the_header(valid, tmp_path):
    path, data, off = valid
    p = tmp_path / "cut.gguf"
    for n in range(off["data"]):
        p.write_bytes(data[:n])
        with pytest.raises(MalformedGGUFError):
            check_gguf(p)  # any other exception type fails the test here


def test_truncation_inside_the_data_section(valid, tmp_path):
    path, data, off = valid
    s = check_gguf(path)
    p = tmp_path / "cut.gguf"
    for i, t in enumerate(s.tensors):
        for end in (s.data_offset + t.offset, s.data_offset + t.offset + t.nbytes - 1):
            p.write_bytes(data[:end])
            assert t.name not in str(rejects(p, "truncated:", f"tensor #{i}"))  # an index, not file bytes
    # Padding after the last tensor is optional.
    last = s.tensors[-1]
    p.write_bytes(data[:s.data_offset + last.offset + last.nbytes])
    check_gguf(p)


# --- key/value pairs --------------------------------------------------------

def test_string_length_past_eof(valid, tmp_path):
    _, data, off = valid
    at = field(off, "kv", "general.name", data)
    rejects(patched(tmp_path, data, at, "<Q", 2**62), "length")
    value_at = off[label_of(off, at).replace(".key", ".value")]
    rejects(patched(tmp_path, data, value_at, "<Q", 2**62), "length")


def test_string_length_in_a_long_array(tmp_path):
    p = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(p, arch="llama")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(200)])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    assert check_gguf(p).metadata["tokenizer.ggml.tokens"] == ArrayInfo(8, 200)
    data = p.read_bytes()
    last = data.rindex(b"t199") - 8
    rejects(patched(tmp_path, data, last, "<Q", 2**62), "length")
    rejects(patched(tmp_path, data, last, "<Q", len(data) - last - 7), "exceeds")
    for cut, words in ((last - 3, "exceeds"), (last + 6, "truncated:")):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        rejects(tmp_path / "cut.gguf", words)


@pytest.mark.parametrize("bad_type", [13, 2**32 - 1])
def test_invalid_value_type(valid, tmp_path, bad_type):
    _, data, off = valid
    at = off[label_of(off, field(off, "kv", "test.flag", data)).replace(".key", ".type")]
    e = rejects(patched(tmp_path, data, at, "<I", bad_type), "value type")
    assert e.offset == at


def test_invalid_array_element_type_and_length(valid, tmp_path):
    _, data, off = valid
    at = off[label_of(off, field(off, "kv", "tokenizer.ggml.tokens", data)).replace(".key", ".value")]
    rejects(patched(tmp_path, data, at, "<I", 77), "value type")
    rejects(patched(tmp_path, data, at + 4, "<Q", 2**60), "array")


def test_duplicate_key(valid, tmp_path):
    _, data, off = valid
    at = field(off, "kv", "test.eps", data)
    e = rejects(patched(tmp_path, data, at + 8, "8s", b"test.big"[:8]), "duplicate key")
    assert "test.big" not in str(e)  # the key is the file's bytes: named by its index instead


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_bad_alignment(tmp_path, alignment):
    good = write_valid(tmp_path / "a.gguf", alignment=64)
    trace: list = []
    read_header(good, trace)
    off, data = dict(trace), good.read_bytes()
    at = off[label_of(off, field(off, "kv", "general.alignment", data)).replace(".key", ".value")]
    rejects(patched(tmp_path, data, at, "<I", alignment), "alignment")


# --- tensor infos -----------------------------------------------------------

@pytest.mark.parametrize("n_dims", [0, 5, 2**31])
def test_bad_n_dims(valid, tmp_path, n_dims):
    _, data, off = valid
    rejects(patched(tmp_path, data, off["tensor[0].n_dims"], "<I", n_dims), "n_dims")


def test_zero_dim(valid, tmp_path):
    _, data, off = valid
    rejects(patched(tmp_path, data, off["tensor[0].dims"] + 8, "<Q", 0), "shape")


def test_dims_overflowing_int64(valid, tmp_path):
    _, data, off = valid
    # a.weight is 2-D: 8 * 2**61 = 2**64 elements.
    rejects(patched(tmp_path, data, off["tensor[0].dims"] + 8, "<Q", 2**61), "overflows")
    rejects(patched(tmp_path, data, off["tensor[0].dims"], "<Q", 2**63), "overflows")


def test_huge_but_representable_shape_is_past_eof(valid, tmp_path):
    _, data, off = valid
    rejects(patched(tmp_path, data, off["tensor[0].dims"] + 8, "<Q", 2**40), "past the end")


@pytest.mark.parametrize("ggml_type", [4, 31, 1000, 2**32 - 1])
def test_unknown_ggml_type(valid, tmp_path, ggml_type):
    _, data, off = valid
    e = rejects(patched(tmp_path, data, off["tensor[0].type"], "<I", ggml_type), "ggml type")
    assert e.offset == off["tensor[0].type"]


def test_row_not_a_multiple_of_the_block(valid, tmp_path):
    _, data, off = valid
    i = list(TENSORS).index("c.weight")
    rejects(patched(tmp_path, data, off[f"tensor[{i}].dims"], "<Q", 48), "block size")


def test_offset_past_eof_and_misaligned(valid, tmp_path):
    _, data, off = valid
    at = off["tensor[2].offset"]
    rejects(patched(tmp_path, data, at, "<Q", 2**40), "past the end")
    rejects(patched(tmp_path, data, at, "<Q", 2**64 - 32), "past the end")
    e = rejects(patched(tmp_path, data, at, "<Q", 8), "not aligned")
    assert e.offset == at


def test_duplicate_tensor_name(valid, tmp_path):
    _, data, off = valid
    at = off["tensor[1].name"] + 8
    rejects(patched(tmp_path, data, at, "1s", b"a"), "duplicate tensor")


# --- a prefix of a file (pull's remote header) ---------------------------------

def test_every_short_prefix_needs_more_bytes_then_reads_as_the_file(valid):
    """Each cut inside the header asks for more (never an error); enough bytes read exactly
    what the whole file reads, with or without the file's size."""
    path, data, off = valid
    whole = check_gguf(path)
    answers = []
    for n in range(off["data"] + 1):
        try:
            assert read_header_prefix(data[:n], len(data), "remote.gguf") == whole
            answers.append("ok")
        except NeedMoreBytes as more:
            assert n < more.at_least <= off["data"], (n, more.at_least)
            answers.append("more")
    first_ok = answers.index("ok")
    assert set(answers[:first_ok]) == {"more"} and set(answers[first_ok:]) == {"ok"}
    assert first_ok > off["tensor[2].offset"]  # the last field of the last tensor info is needed
    unknown_size = read_header_prefix(data[:off["data"]], None, "remote.gguf")
    assert unknown_size == dataclasses.replace(whole, file_size=None)


def test_asking_for_what_was_asked_reaches_the_header(valid):
    """Fetching exactly `at_least` each time ends, never asking for more than the header."""
    assert not issubclass(NeedMoreBytes, LocalrunError)  # an outcome to act on, not an error
    _, data, off = valid
    have, header = 1, None
    while header is None:
        try:
            header = read_header_prefix(data[:have], len(data), "remote.gguf")
        except NeedMoreBytes as more:
            assert more.at_least > have
            have = more.at_least
    assert header.n_tensors == len(TENSORS) and have <= off["data"]


def test_a_prefix_is_checked_against_the_files_size(valid):
    """A header longer than the file, or tensor data past its end: malformed, not 'need more'."""
    _, data, off = valid
    with pytest.raises(MalformedGGUFError, match="truncated"):
        read_header_prefix(data, off["tensor[1].name"], "remote.gguf")
    with pytest.raises(MalformedGGUFError, match=r"tensor #0 data .* runs past the end"):
        read_header_prefix(data, off["data"], "remote.gguf")


def test_a_prefix_keeps_the_limits(valid, tmp_path):
    """An absurd length or count fails at once even when the file's size is unknown: the
    header limit bounds it, so a hostile server cannot make pull fetch forever. A (sparse)
    300 MiB file claiming a 280 MiB string stops at the limit too, not at its size."""
    _, data, off = valid
    value_at = off[label_of(off, field(off, "kv", "general.name", data)).replace(".key", ".value")]
    buf = bytearray(data)
    struct.pack_into("<Q", buf, value_at, MAX_HEADER_BYTES)
    with pytest.raises(MalformedGGUFError, match="header limit") as ei:
        read_header_prefix(bytes(buf), None, "remote.gguf")
    assert ei.value.offset == value_at
    struct.pack_into("<Q", buf, value_at, 1 << 20)  # long but possible: ask for the bytes it needs
    with pytest.raises(NeedMoreBytes) as more:
        read_header_prefix(bytes(buf), None, "remote.gguf")
    assert more.value.at_least == value_at + 8 + (1 << 20)
    buf = bytearray(data)
    struct.pack_into("<Q", buf, off["n_kv"], 2**40)
    with pytest.raises(MalformedGGUFError, match="kv count"):
        read_header_prefix(bytes(buf[:64]), None, "remote.gguf")
    nested = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
    nested += struct.pack("<IQ", 9, 1) * 6 + struct.pack("<IQ", 0, 0)  # arrays of arrays, 6 deep
    with pytest.raises(MalformedGGUFError, match="nested deeper than 4"):
        read_header_prefix(nested, None, "remote.gguf")
    with open(tmp_path / "huge.gguf", "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<IQ", 8, 280 << 20))
        f.truncate(300 << 20)
    rejects(tmp_path / "huge.gguf", "header limit")


# --- errors never quote the file ---------------------------------------------

def test_a_non_gguf_file_is_refused_without_echoing_its_bytes(tmp_path):
    """`/api/show {"model": "~/.ssh/id_ed25519"}` must not answer with the key's first bytes."""
    secret = tmp_path / "id_ed25519"
    secret.write_bytes(b"SECRETKEY-0123456789abcdef" * 8)
    e = rejects(secret, "bad magic", "not a GGUF file")
    for leak in ("SECR", "SECRETKEY", repr(b"SECR"), "0123"):
        assert leak not in str(e), str(e)
    assert not is_gguf(secret)
    with pytest.raises(MalformedGGUFError) as ei:  # the same bytes as a remote file's prefix
        read_header_prefix(secret.read_bytes(), None, "org/repo/model.gguf (remote)")
    assert str(ei.value).startswith("org/repo/model.gguf (remote): malformed GGUF: bad magic")
    assert "SECR" not in str(ei.value) and "0123" not in str(ei.value)


def test_string_and_type_errors_do_not_echo_keys_or_values(tmp_path):
    p = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(p, arch="llama")
    w.add_string("secret.token", "hunter2")
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    data = p.read_bytes()
    trace: list = []
    read_header(p, trace)
    off = dict(trace)
    type_at = off[label_of(off, field(off, "kv", "secret.token", data)).replace(".key", ".type")]
    e = rejects(patched(tmp_path, data, type_at, "<I", 99), "value type")
    assert "secret.token" not in str(e)

    w = gguf.GGUFWriter(p, arch="llama")
    w.add_string("general.alignment", "hunter2")  # a string where a number belongs: refused, not quoted
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    e = rejects(p, "general.alignment")
    assert "hunter2" not in str(e)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer: a request naming one must not hang a thread."""
    import threading

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    outcome: dict = {}

    def check() -> None:
        try:
            check_gguf(fifo)
        except Exception as exc:  # noqa: BLE001 - the test looks at the type below
            outcome["error"] = exc
        outcome["gguf"] = is_gguf(fifo)

    t = threading.Thread(target=check, daemon=True)
    t.start()
    t.join(5)
    if t.is_alive():  # unblock the reader so the test process can end, then fail
        with open(fifo, "wb"):
            pass  # opening the write end is what releases the blocked reader
        t.join(5)
        pytest.fail("check_gguf blocked on a FIFO")
    assert isinstance(outcome["error"], UnsupportedFormatError) and "not a regular file" in str(outcome["error"])
    assert outcome["gguf"] is False


# --- split models (gguf-split: name-00001-of-00003.gguf, ...) ---------------------

def write_split(folder: Path, stem: str = "model") -> list[Path]:
    """A model split one tensor per part, as gguf-split writes it (split.no/count/tensors.count)."""
    w = gguf.GGUFWriter(folder / f"{stem}.gguf", arch="llama", split_max_tensors=1)
    w.add_name("split test")
    for name, (arr, qtype) in TENSORS.items():
        w.add_tensor(name, quantize(arr, Q8) if qtype == Q8 else arr, raw_dtype=Q8 if qtype == Q8 else None)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    parts = [folder / f"{stem}-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    assert all(p.is_file() for p in parts)
    return parts


@pytest.fixture
def split(tmp_path) -> list[Path]:
    return write_split(tmp_path)


def test_split_model_passes_and_parts_are_where_llama_cpp_looks(split):
    import ctypes

    import llama_cpp

    s = check_gguf(split[0])
    assert (s.metadata["split.no"], s.metadata["split.count"], s.metadata["split.tensors.count"]) == (0, 3, 3)
    assert [t.name for t in s.tensors] == ["a.weight"]  # the summary is the first part's
    assert split_part_paths(split[0], 3) == [str(p) for p in split]
    prefix = str(split[0])[: -len("-00001-of-00003.gguf")]
    for i, part in enumerate(split):  # llama.cpp's own naming rule gives the same paths
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_split_path(buf, len(buf), prefix.encode(), i, 3)
        assert buf.value[:n].decode() == str(part)


def test_a_missing_part_is_named(split):
    split[1].unlink()
    with pytest.raises(ModelNotFoundError) as ei:
        check_gguf(split[0])
    msg = str(ei.value)
    assert "\n" not in msg and str(split[1]) in msg and "part 2 of 3" in msg and "missing" in msg


def test_a_truncated_part_is_named(split):
    data = split[2].read_bytes()
    split[2].write_bytes(data[: len(data) - 40])
    e = rejects(split[2], "truncated")  # the part on its own
    with pytest.raises(MalformedGGUFError) as ei:
        check_gguf(split[0])  # and through the first part, as a load would
    msg = str(ei.value)
    assert f"{split[2]} (part 3 of 3)" in msg and "truncated" in msg and "\n" not in msg
    assert e.offset == ei.value.offset


def test_bad_magic_in_part_two_is_named_without_its_bytes(split):
    data = split[1].read_bytes()
    split[1].write_bytes(b"SECR" + data[4:])
    with pytest.raises(MalformedGGUFError) as ei:
        check_gguf(split[0])
    msg = str(ei.value)
    assert f"{split[1]} (part 2 of 3)" in msg and "bad magic" in msg and "SECR" not in msg


def test_a_later_part_alone_is_refused_with_the_way_out(split):
    with pytest.raises(UnsupportedFormatError, match=r"part 2 of a model split in 3; open its first part"):
        check_gguf(split[1])


def test_a_part_under_the_wrong_name_is_refused(split):
    split[1].write_bytes(split[2].read_bytes())  # part 3's bytes under part 2's name
    with pytest.raises(MalformedModelError, match=r"part 2 of 3\): its split.no does not say part 2"):
        check_gguf(split[0])


def test_a_renamed_first_part_cannot_find_its_parts(split, tmp_path):
    renamed = tmp_path / "model.gguf"
    split[0].rename(renamed)
    with pytest.raises(UnsupportedFormatError, match=r"does not end in '-00001-of-00003.gguf'"):
        check_gguf(renamed)


# --- random corruption ------------------------------------------------------

def test_random_byte_flips_pass_or_raise_malformed(valid, tmp_path):
    path, data, off = valid
    rng = random.Random(20240601)
    header_end = off["data"]
    p = tmp_path / "flip.gguf"
    outcomes = {"ok": 0, "malformed": 0}
    for i in range(300):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            # Mostly the header region: flips in tensor data are always valid.
            at = rng.randrange(header_end if rng.random() < 0.9 else len(buf))
            buf[at] = rng.choice([buf[at] ^ (1 << rng.randrange(8)), rng.randrange(256), 0xFF])
        if rng.random() < 0.2:
            del buf[rng.randrange(len(buf)):]
        p.write_bytes(bytes(buf))
        try:
            check_gguf(p)
            outcomes["ok"] += 1
        except MalformedGGUFError:
            outcomes["malformed"] += 1
        # any other exception propagates and fails the test, naming the mutant
    assert outcomes["malformed"] > 100, outcomes


# --- real models ------------------------------------------------------------

@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma3_gguf"])
def test_real_models_pass_quickly(request, reads, model):
    path = request.getfixturevalue(model)
    s = check_gguf(path)
    assert s.n_tensors == len(s.tensors) > 100 and s.n_kv == len(s.metadata)
    assert isinstance(s.metadata["general.architecture"], str)
    tokens = s.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, ArrayInfo) and tokens.count > 40_000
    # quickly: the vocabulary is jumped over in the tight loop, one length at a time, and
    # the field reads are bounded by the header's fields (at most 8 a tensor info, a kv at
    # most 3 and the elements of an array kept whole), not by its tens of thousands of tokens
    assert tokens.count in reads["skipped"]
    assert len(reads["fields"]) <= 3 + 8 * s.n_tensors + (3 + SMALL_ARRAY) * s.n_kv < tokens.count
    # and only header bytes are read: none of the tensor data (the mmap pages in what is read)
    assert max(end for _, end in reads["fields"]) <= s.data_offset < s.file_size // 10
    end = max(s.data_offset + t.offset + t.nbytes for t in s.tensors)
    assert end <= s.file_size and s.file_size - end < s.alignment
