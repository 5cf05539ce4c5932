"""Writing a file so that nothing partial ever sits where a finished file belongs.

A rename is atomic but not durable by itself: after a power cut the new name may point
at a file whose bytes never reached the disk (ext4, XFS and APFS may order the rename
before the data). So every finished file is fsynced before its rename, and the folder
holding the new name is fsynced after it (POSIX; Windows cannot open a folder for
fsync, and some file systems refuse it, so there the folder step is skipped).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import Iterator

from localrun.errors import LocalrunError

# A folder fsync that the platform or file system does not support (Windows, some
# network and FUSE file systems) is skipped: the data itself was already synced.
_NO_DIR_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES, errno.EISDIR,
                 getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)}


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a closed file's bytes to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (a rename into it); skipped where folders cannot be synced."""
    if os.name == "nt":
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        if e.errno in _NO_DIR_FSYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_FSYNC:
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync a file, or every file and folder under a folder (a model folder before its rename)."""
    p = Path(path)
    if not p.is_dir():
        fsync_file(p)
        return
    for root, _dirs, files in os.walk(p):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(root)


def replace_durably(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """os.replace(src, dst) with src's bytes on the disk first and the rename after it."""
    fsync_tree(src)
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a hidden temporary path beside `out`; when the block ends without an error
    the file is fsynced and renamed onto `out` (one atomic step, then the folder is
    fsynced), otherwise it is deleted. With overwrite=False an `out` that someone
    created meanwhile is left alone. A full disk or any other OSError becomes a one-line
    error that says nothing was left at `out`."""
    tmp = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    try:
        yield tmp
        if out.exists() and not overwrite:
            raise LocalrunError(f"{out} appeared while this ran; the result is not moved onto it")
        fsync_file(tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise LocalrunError(f"could not write {out}: {e.strerror or e}; nothing was left at {out}") from e
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename
    try:
        fsync_dir(out.parent)
    except OSError as e:  # the file is in place; only the folder entry may not be on the disk yet
        raise LocalrunError(f"wrote {out}, but could not flush its folder to the disk: {e.strerror or e}") from e
