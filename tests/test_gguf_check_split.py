"""Split models (gguf-split: name-00001-of-00003.gguf, ...): the GGUF validator checks
every part through the first, names a missing, truncated or misnamed part, and refuses
a later part opened alone with the way out.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from gguf.quants import quantize

from gguf_files import Q8, TENSORS, rejects
from localrun.errors import MalformedModelError, ModelNotFoundError, UnsupportedFormatError
from localrun.model.gguf_check import MalformedGGUFError, check_gguf, split_part_paths


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
