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


# -- floors: which rooms may import which ------------------------------------------------

# Every room of the package and its floor. A module imports only from its own floor or
# below, and the rooms' imports form no circle. A module at the localrun/ root must be
# named here: the engine core, the CLI entry, or a foundation every room uses.
FLOORS = {
    # foundations
    "localrun": 0, "localrun.errors": 0, "localrun.hardware": 0, "localrun.textstream": 0, "localrun.ggml": 0,
    "localrun.datafiles": 0,
    # what a model is, how it is prompted, sampled and constrained; the RPC cluster
    "localrun.model": 1, "localrun.prompt": 1, "localrun.sampling": 1, "localrun.grammar": 1,
    "localrun.tools": 1, "localrun.cluster": 1,
    # running, storing and making models; speculation
    "localrun.backends": 2, "localrun.quant": 2, "localrun.store": 2, "localrun.speculation": 2,
    # the engine core
    "localrun.engine": 3, "localrun.generation": 3, "localrun.request": 3, "localrun.slots": 3,
    # what users run
    "localrun.server": 4, "localrun.tui": 4, "localrun.commands": 4, "localrun.cli": 4, "localrun.__main__": 4,
}


def room_of(module: str) -> str | None:
    """The longest FLOORS key that `module` is or lies inside."""
    best = None
    for room in FLOORS:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def floor_violations() -> list[str]:
    modules = list(_modules())
    known = {dotted for _, dotted, _ in modules}
    found, edges = [], {}
    for path, module, is_init in modules:
        where = path.relative_to(ROOT).as_posix()
        home = room_of(module)
        if home is None or (home == "localrun" and module != "localrun"):
            found.append(f"{where}: {module} is in no room (add it to a package, or to FLOORS if it is a foundation)")
            continue
        for line, target, name in _imports(path, module, is_init):
            if not target.startswith("localrun"):
                continue
            full = f"{target}.{name}" if name and f"{target}.{name}" in known else target
            room = room_of(full)
            if room is None or room == home:
                continue
            if FLOORS[room] > FLOORS[home]:
                found.append(f"{where}:{line} imports {full}: floor {FLOORS[room]} ({room}) is above"
                             f" floor {FLOORS[home]} ({home})")
            edges.setdefault(home, {}).setdefault(room, f"{where}:{line}")
    found += [f"a circle of rooms: {' -> '.join(c)}" for c in _circles(edges)]
    return found


def _circles(edges: dict[str, dict[str, str]]) -> list[list[str]]:
    """One circle through each room that starts one, found by depth-first search."""
    circles, done = [], set()

    def visit(room, path):
        if room in path:
            circles.append(path[path.index(room):] + [room])
            return
        if room in done:
            return
        for nxt in sorted(edges.get(room, {})):
            visit(nxt, path + [room])
        done.add(room)

    for room in sorted(edges):
        visit(room, [])
    return circles


def test_rooms_import_down_and_in_no_circle():
    """Floors from foundations up to what users run (FLOORS): no upward import, no circle
    of rooms, no module outside a room."""
    assert floor_violations() == []


def test_nothing_imports_a_room_folder_as_a_top_level_name():
    """backends/, quant/ and tui/ install as localrun.backends etc.; `import backends`
    works only from a checkout's root, and then loads a second copy of the module."""
    import ast

    found = []
    for folder in ("localrun", "backends", "quant", "tui", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] in ("backends", "quant", "tui")]
    assert found == []


def test_the_floor_check_sees_what_it_must(tmp_path, monkeypatch):
    """The checker itself, on a planted tree: an upward import, a circle between two rooms
    of one floor, and a module left at the root."""
    for room in (*ROOMS, "localrun/model", "localrun/prompt"):
        (tmp_path / room).mkdir(parents=True)
        (tmp_path / room / "__init__.py").write_text("")
    (tmp_path / "localrun" / "model" / "m.py").write_text("from localrun.engine import Engine\nfrom ..prompt import p\n")
    (tmp_path / "localrun" / "prompt" / "p.py").write_text("from localrun.model.m import x\n")
    (tmp_path / "localrun" / "engine.py").write_text("")
    (tmp_path / "localrun" / "stray.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert floor_violations() == [
        "localrun/model/m.py:1 imports localrun.engine: floor 3 (localrun.engine) is above floor 1 (localrun.model)",
        "localrun/stray.py: localrun.stray is in no room (add it to a package, or to FLOORS if it is a foundation)",
        "a circle of rooms: localrun.model -> localrun.prompt -> localrun.model",
    ]
