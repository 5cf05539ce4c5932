"""A recorder of fsyncs and renames, for the tests that a finished file reaches the disk
before its name does (quantize, convert, pull)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def record_syncs(monkeypatch) -> list[tuple]:
    """Record fsyncs (of a file or a folder, by inode) and renames, in order."""
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(src).stat().st_ino, Path(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events
