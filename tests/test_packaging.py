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


# -- which way the imports point -------------------------------------------------------

# each source folder and the package it installs as
ROOMS = {"localrun": "localrun", "backends": "localrun.backends", "quant": "localrun.quant", "tui": "localrun.tui"}


def _modules():
    """(file, dotted module name, is a package __init__) for every source module."""
    for room, package in ROOMS.items():
        for path in sorted((ROOT / room).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(ROOT / room).with_suffix("").parts
            is_init = parts[-1] == "__init__"
            dotted = ".".join(package.split(".") + list(parts[:-1] if is_init else parts))
            yield path, dotted, is_init


def _imports(path: Path, module: str, is_init: bool):
    """(line, imported module, imported name or None) for every import in the file,
    those inside functions too, relative ones made absolute."""
    import ast

    package = module if is_init else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                yield node.lineno, base, alias.name


def _package_of(module: str, known: dict[str, bool]) -> str:
    return module if known.get(module) else module.rpartition(".")[0]


def import_violations() -> list[str]:
    modules = list(_modules())
    known = {dotted: is_init for _, dotted, is_init in modules}  # module -> is a package
    found = []
    for path, module, is_init in modules:
        where = path.relative_to(ROOT).as_posix()
        home = module if is_init else module.rpartition(".")[0]
        for line, target, name in _imports(path, module, is_init):
            if home.startswith("localrun.backends") and target.startswith("localrun.quant"):
                found.append(f"{where}:{line} imports {target}: the backends never depend on quant/")
            if name is None or name.startswith("__") or not name.startswith("_"):
                continue
            source = f"{target}.{name}" if f"{target}.{name}" in known else target  # `from pkg import _module`
            if _package_of(source, known) != home:
                found.append(f"{where}:{line} imports {name} from {target}, another package's private name")
    return found


def test_imports_point_one_way_and_keep_private_names_private():
    """backends/ never imports quant/ (quant/ may use the backends' public names), and no
    module imports a `_name` from another package: what a package keeps private may change
    without notice to anyone outside it."""
    assert import_violations() == []


def test_the_import_check_sees_what_it_must(tmp_path, monkeypatch):
    """The checker itself, on a planted tree: a lazy quant import in a backend, private
    names across packages (by name and as a module); private names inside one package pass."""
    for room in (*ROOMS, "localrun/server"):
        (tmp_path / room).mkdir()
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "backends" / "b.py").write_text("def f():\n    from localrun.quant.selector import x\n")
    (tmp_path / "quant" / "q.py").write_text("from localrun.backends.b import _private\nfrom ._own import _ok\n")
    (tmp_path / "quant" / "_own.py").write_text("_ok = 1\n")
    (tmp_path / "localrun" / "server" / "s.py").write_text("from .routes import _ok\nfrom ..quant import _own\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_violations() == [
        "localrun/server/s.py:2 imports _own from localrun.quant, another package's private name",
        "backends/b.py:2 imports localrun.quant.selector: the backends never depend on quant/",
        "quant/q.py:1 imports _private from localrun.backends.b, another package's private name",
    ]
