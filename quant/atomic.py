"""Writing a file so that nothing partial ever sits where a finished file belongs."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator

from localrun.errors import LocalrunError


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a hidden temporary path beside `out`; when the block ends without an error
    the file is renamed onto `out` (one atomic step), otherwise it is deleted. With
    overwrite=False an `out` that someone created meanwhile is left alone. A full disk
    or any other OSError becomes a one-line error that says nothing was left at `out`."""
    tmp = out.with_name(f".{out.name}.partial-{secrets.token_hex(4)}")
    try:
        yield tmp
        if out.exists() and not overwrite:
            raise LocalrunError(f"{out} appeared while this ran; the result is not moved onto it")
        os.replace(tmp, out)
    except OSError as e:
        raise LocalrunError(f"could not write {out}: {e.strerror or e}; nothing was left at {out}") from e
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename
