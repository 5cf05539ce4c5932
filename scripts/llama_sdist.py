"""What fetch_grammars.py and fetch_templates.py share: files of llama.cpp that tests read,
copied into the test-model cache from the llama-cpp-python sdist of the installed version
(it vendors llama.cpp).

An unpacked copy in ~/.cache/localrun/tools/llama.cpp-<ver>/src is reused, otherwise `pip
download --no-binary :all:` fetches the sdist into a temporary folder. The files land in
${LOCALRUN_TEST_MODELS:-~/.cache/localrun/test-models}/<name>, outside the clone, beside a
marker naming the version they came from; a second run finds them all and downloads nothing.

The fetchers import this module from beside them: run as plain scripts (`python
scripts/fetch_grammars.py`), their own folder is first on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable

PACKAGE = "llama-cpp-python"


@dataclass(frozen=True)
class VendoredFiles:
    """One kind of file that llama.cpp keeps in one folder."""

    name: str  # the cache folder they fill, and what the version picks ("templates")
    title: str  # what the summary line calls them ("chat templates")
    folder: str  # where llama.cpp's tree keeps them ("models/templates")
    wanted: Callable[[str], bool]  # a file name is one of those to copy
    lacks: Callable[[Path], str]  # why a folder does not hold all that is needed; "" when it does


def fetch(files: VendoredFiles) -> int:
    """A fetcher's command: fill the cache folder unless this version filled it already,
    then print the folder."""
    try:
        ver = version(PACKAGE)
    except PackageNotFoundError:
        raise SystemExit(f"{PACKAGE} is not installed; its version picks the {files.name} to fetch")
    dest = cache_dir(files.name)
    marker = dest / f".from-{PACKAGE}-{ver}"
    if marker.exists() and not files.lacks(dest):
        print(dest)
        return 0
    unpacked = Path.home() / ".cache" / "localrun" / "tools" / f"llama.cpp-{ver}" / "src" / files.folder
    n = _copy(files, unpacked, dest) if not files.lacks(unpacked) else _from_sdist(files, ver, dest)
    for old in dest.glob(f".from-{PACKAGE}-*"):
        old.unlink()
    marker.touch()
    print(f"{n} {files.title} from {PACKAGE} {ver} in {dest}", file=sys.stderr)
    print(dest)
    return 0


def cache_dir(name: str) -> Path:
    env = os.environ.get("LOCALRUN_TEST_MODELS")
    base = Path(env) if env else Path.home() / ".cache" / "localrun" / "test-models"
    return base / name


def _copy(files: VendoredFiles, src: Path, dest: Path) -> int:
    reason = files.lacks(src)
    if reason:
        raise SystemExit(reason)
    names = sorted(p.name for p in src.iterdir() if p.is_file() and files.wanted(p.name))
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        tmp = dest / (name + ".part")
        shutil.copyfile(src / name, tmp)
        tmp.replace(dest / name)  # atomic: a reader never sees half a file
    return len(names)


def _from_sdist(files: VendoredFiles, ver: str, dest: Path) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--quiet", "-d", tmp, f"{PACKAGE}=={ver}"],
            check=True,
        )
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if not sdists:
            raise SystemExit(f"pip download of {PACKAGE}=={ver} produced no sdist in {tmp}")
        out = Path(tmp) / files.name
        out.mkdir()
        with tarfile.open(sdists[0]) as tar:
            for m in tar.getmembers():
                name = Path(m.name).name
                # only plain files, flattened: no path in the archive escapes
                if m.isfile() and f"/vendor/llama.cpp/{files.folder}/" in m.name and files.wanted(name):
                    with tar.extractfile(m) as f:
                        (out / name).write_bytes(f.read())
        return _copy(files, out, dest)
