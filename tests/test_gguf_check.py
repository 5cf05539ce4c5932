"""The GGUF validator rejects malformed files with MalformedGGUFError, and only that:
the valid file's summary, then corrupt headers, key/value pairs and tensor infos,
truncation, random byte flips, and real models read quickly (header bytes only).

The valid file and its corrupt copies come from gguf_files.py. A prefix of a file
(`pull`'s remote header) and errors that never quote a file are in
test_gguf_check_untrusted.py; split models in test_gguf_check_split.py.
"""

from __future__ import annotations

import pickle
import random
import struct

import gguf
import pytest

from gguf_files import (  # noqa: F401 - valid_gguf is the fixture `valid`
    PER_LAYER, TENSORS, TOKENS, field, label_of, patched, rejects, valid_gguf, write_valid,
)
from localrun.errors import MalformedModelError, ModelNotFoundError
from localrun.model import gguf_header
from localrun.model.gguf_check import ArrayInfo, GGUFHeader, MalformedGGUFError, TensorInfo, check_gguf, is_gguf
from localrun.model.gguf_header import SMALL_ARRAY, read_header


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
