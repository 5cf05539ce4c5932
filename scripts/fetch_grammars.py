#!/usr/bin/env python3
"""Copy llama.cpp's example grammars (grammars/*.gbnf) into the test-model cache, where
tests/test_grammar.py compiles every one of them.

    python scripts/fetch_grammars.py     # prints the folder it filled

The files come from the llama-cpp-python sdist of the installed version (it vendors
llama.cpp): an unpacked copy in ~/.cache/localrun/tools/llama.cpp-<ver>/src is reused,
otherwise `pip download --no-binary :all:` fetches the sdist into a temporary folder.
They land in ${LOCALRUN_TEST_MODELS:-~/.cache/localrun/test-models}/grammars, outside the
clone. A second run finds them all and downloads nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE = "llama-cpp-python"


def grammars_dir() -> Path:
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    base = Path(env) if env else Path.home() / ".cache" / "localrun" / "test-models"
    return base / "grammars"


def _copy(src: Path, dest: Path) -> int:
    files = sorted(src.glob("*.gbnf"))
    if not files:
        raise SystemExit(f"no .gbnf files in {src}")
    dest.mkdir(parents=True, exist_ok=True)
    for f in files:
        tmp = dest / (f.name + ".part")
        shutil.copyfile(f, tmp)
        tmp.replace(dest / f.name)  # atomic: a reader never sees half a file
    return len(files)


def _from_sdist(ver: str, dest: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "-d", tmp, f"{PACKAGE}=={ver}"],
            check=True,
        )
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise SystemExit(f"pip download of {PACKAGE}=={ver} produced no sdist in {tmp}")
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers()
                       if m.isfile() and "/vendor/llama.cpp/grammars/" in m.name and m.name.endswith(".gbnf")]
            out = Path(tmp) / "grammars"
            out.mkdir()
            for m in members:  # only plain files, flattened: no path in the archive escapes
                with tar.extractfile(m) as f:
                    (out / Path(m.name).name).write_bytes(f.read())
        return _copy(out, dest)


def main() -> int:
    try:
        ver = version(PACKAGE)
    except PackageNotFoundError:
        raise SystemExit(f"{PACKAGE} is not installed; its version picks the grammars to fetch")
    dest = grammars_dir()
    marker = dest / f".from-{PACKAGE}-{ver}"
    if marker.exists() and any(dest.glob("*.gbnf")):
        print(dest)
        return 0
    unpacked = Path.home() / ".cache" / "localrun" / "tools" / f"llama.cpp-{ver}" / "src" / "grammars"
    n = _copy(unpacked, dest) if any(unpacked.glob("*.gbnf")) else _from_sdist(ver, dest)
    for old in dest.glob(f".from-{PACKAGE}-*"):
        old.unlink()
    marker.touch()
    print(f"{n} grammars from {PACKAGE} {ver} in {dest}", file=sys.stderr)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
