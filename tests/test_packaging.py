"""A built wheel holds one top-level package, `localrun`, with backends/quant/tui inside."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_localrun_package(tmp_path):
    # build from a copy: setuptools' build/ folder in a checkout can hold stale files
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / item, src / item)
    for room in ("localrun", "backends", "quant", "tui"):
        shutil.copytree(ROOT / room, src / room, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("localrun-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"localrun"}
    # every source module of the four rooms, at its installed place, and nothing stale
    rooms = {"localrun": "localrun", "backends": "localrun/backends", "quant": "localrun/quant", "tui": "localrun/tui"}
    expected = {
        f"{dest}/{path.relative_to(ROOT / src).as_posix()}"
        for src, dest in rooms.items()
        for path in (ROOT / src).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert expected <= set(names), expected - set(names)
    assert {n for n in names if n.endswith(".py")} == expected
    assert not any(n.startswith(("tests/", "scripts/", "backends/", "quant/", "tui/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "localrun = localrun.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
