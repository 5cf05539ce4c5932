"""Untrusted input to the GGUF validator: a prefix of a file (`pull`'s remote header),
where too few bytes is a distinct, recoverable NeedMoreBytes and the header limit holds
against a hostile server; and errors that never quote the file (a secret named by a
request, keys and values) nor block on a FIFO.

The valid file and its corrupt copies come from gguf_files.py.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import gguf
import pytest

from gguf_files import (  # noqa: F401 - valid_gguf is the fixture `valid`
    TENSORS, field, label_of, patched, rejects, valid_gguf,
)
from localrun.errors import LocalrunError, UnsupportedFormatError
from localrun.model.gguf_check import MalformedGGUFError, check_gguf, is_gguf
from localrun.model.gguf_header import MAX_HEADER_BYTES, NeedMoreBytes, read_header, read_header_prefix


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
