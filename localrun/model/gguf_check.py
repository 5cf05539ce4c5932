"""Validate a GGUF model in pure Python before llama.cpp parses it.

llama.cpp's own GGUF parser has had memory-safety bugs, so a corrupt or hostile
file must be caught here, with a typed one-line error, while the process is still
safe. The header is read by localrun.model.gguf_header (bounds-checked reads, counts checked
against the bytes that remain, a header size limit, errors that never quote the file);
this module adds what a model load needs beyond one file's header.

A model split by gguf-split (`name-00001-of-00003.gguf`, ...) is checked as llama.cpp
will open it: the first part names the count (`split.count`), the other parts are
found by llama.cpp's naming rule, and each is read with the same limits.
"""

from __future__ import annotations

import os

from localrun.errors import LocalrunError, MalformedModelError, ModelNotFoundError, UnsupportedFormatError
from localrun.model.gguf_header import (
    MAGIC,
    MAX_TENSORS,
    ArrayInfo,
    GGUFHeader,
    MalformedGGUFError,
    TensorInfo,
    open_regular,
    read_header,
)

__all__ = ["ArrayInfo", "GGUFHeader", "MalformedGGUFError", "TensorInfo", "check_gguf", "check_gguf_parts",
           "is_gguf", "split_part_paths"]

MAX_SPLIT_COUNT = 0xFFFF  # llama.cpp reads split.count as a uint16


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when a regular file starts with the GGUF magic; reads 4 bytes, never raises."""
    try:
        with open_regular(os.fspath(path)) as f:
            return f.read(4) == MAGIC
    except (OSError, LocalrunError):
        return False


def check_gguf(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse and validate the whole container; raise MalformedGGUFError on any flaw.

    For the first part of a split model every other part is validated too, as llama.cpp
    will open them (a one-line error names the part); the header is the first part's."""
    return check_gguf_parts(path)[0]


def check_gguf_parts(path: str | os.PathLike[str]) -> tuple[GGUFHeader, ...]:
    """The validated header of every part of a model, the first part's first (one for a
    model in one file): what check_gguf checks, for a caller that counts every tensor."""
    first = os.fspath(path)
    header = read_header(first)
    return (header, *_check_split_parts(first, header))


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


def _split_field(header: GGUFHeader, key: str, label: str, limit: int = MAX_SPLIT_COUNT) -> int | None:
    """An integer split.* value, None when absent; a non-integer is a malformed file."""
    value = header.metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise MalformedModelError(f"{label}: malformed GGUF: {key} is not an integer 0..{limit};"
                                  " the file is corrupt; download it again")
    return value


def _check_split_parts(first: str, header: GGUFHeader) -> list[GGUFHeader]:
    """Validate parts 2..N of a split model whose first part is `first` (already read);
    their headers, in order (none for a model in one file)."""
    count = _split_field(header, "split.count", first)
    if count is None or count <= 1:
        return []  # one file: nothing else to open
    number = _split_field(header, "split.no", first)
    if number is None:
        raise MalformedModelError(f"{first}: malformed GGUF: split.count without split.no;"
                                  " the file is corrupt; download it again")
    if number != 0:
        raise UnsupportedFormatError(f"{first} is part {number + 1} of a model split in {count}; open its first"
                                     f" part (the file whose name ends in -00001-of-{count:05d}.gguf)")
    parts = []
    for i, part in enumerate(split_part_paths(first, count)[1:], start=1):
        label = f"{part} (part {i + 1} of {count})"
        if not os.path.exists(part):
            raise ModelNotFoundError(f"{label} is missing: a split model loads only with every part beside"
                                     " the first; download the missing part")
        part_header = read_header(part, label=label)
        if _split_field(part_header, "split.no", label) != i:
            raise MalformedModelError(f"{label}: its split.no does not say part {i + 1}; it belongs to another"
                                      " split model or is corrupt; download the parts again")
        if _split_field(part_header, "split.count", label) not in (None, count):
            raise MalformedModelError(f"{label}: its split.count differs from the first part's; it belongs to"
                                      " another split model; download the parts again")
        parts.append(part_header)
    n_tensors = header.n_tensors + sum(p.n_tensors for p in parts)
    expected = _split_field(header, "split.tensors.count", first, limit=MAX_TENSORS * count)
    if expected is not None and expected != n_tensors:
        raise MalformedModelError(f"{first}: the parts hold {n_tensors} tensors, the first part promises"
                                  f" {expected}; a part is from another split model; download the parts again")
    return parts
