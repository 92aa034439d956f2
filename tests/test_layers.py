"""The floors of kvseal: every module imports only from its own floor or below (read with ast, every import in a
module counts, inside functions and under TYPE_CHECKING too). A module lower in the house that needs something
from higher up means that thing belongs lower: move it down, don't add an exception. EXCEPTIONS lists the arrows
that still run back up today; each one goes when what it imports moves down, and the list ends empty."""

from __future__ import annotations

import ast
from pathlib import Path

KVSEAL = Path(__file__).resolve().parent.parent / "kvseal"

# bottom to top; a module belongs to the longest prefix named here ("kvseal" itself, its version, names only itself)
FLOORS: list[tuple[str, ...]] = [
    # the ground: errors and their table, limits, memfds, the proto, who calls, sizes
    ("kvseal", "kvseal.errors", "kvseal.limits", "kvseal.memfd", "kvseal.proto", "kvseal.auth", "kvseal.units"),
    ("kvseal.rpc", "kvseal.httpd", "kvseal.sockets"),  # one gRPC method handler, one HTTP handler; socket reads
    ("kvseal.core",),  # pure: layout, seal, store
    ("kvseal.wire", "kvseal.copy"),  # sans-I/O codecs (the lane's, the peer protocol's); byte movers
    ("kvseal.ssd",),
    ("kvseal.engine",),
    ("kvseal.peer", "kvseal.meta"),  # other nodes: fetch, serve, the MetaServer and its announcer
    ("kvseal.server",),  # the engine's process: its listeners and their composition
    ("kvseal.client", "kvseal.vllm", "kvseal.router", "kvseal.testing", "kvseal.inventory"),
    ("kvseal.bench", "kvseal.cli", "kvseal.__main__"),
]

# (importer, imported): arrows that run back up today (none)
EXCEPTIONS: set[tuple[str, str]] = set()


def _module(path: Path) -> str:
    parts = path.relative_to(KVSEAL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    best, floor = -1, -1
    for i, names in enumerate(FLOORS):
        for name in names:
            inside = module.startswith(name + ".") and name != "kvseal"
            if (module == name or inside) and len(name) > best:
                best, floor = len(name), i
    assert floor >= 0, f"{module} is on no floor: add it to FLOORS"
    return floor


def _imports(path: Path, module: str) -> set[str]:
    """What the module at `path` imports from kvseal: modules, or `module.name` where it takes a name from one
    (resolved by _arrows against the modules that exist)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "kvseal" or name.startswith("kvseal.")}


def _arrows() -> dict[tuple[str, str], tuple[int, int]]:
    modules = {_module(p): p for p in KVSEAL.rglob("*.py")}
    arrows = {}
    for module, path in modules.items():
        for imported in _imports(path, module):
            if imported not in modules:
                imported = imported.rpartition(".")[0]  # `from kvseal.x import name`: the module is kvseal.x
            if imported in modules and imported != module:
                arrows[(module, imported)] = (_floor(module), _floor(imported))
    return arrows


def test_every_import_runs_down_or_level() -> None:
    up = {arrow: floors for arrow, floors in _arrows().items() if floors[1] > floors[0]}
    new = {arrow: floors for arrow, floors in up.items() if arrow not in EXCEPTIONS}
    assert not new, "imports that run back up the floors (move what they need down): " + ", ".join(
        f"{a} (floor {fa}) -> {b} (floor {fb})" for (a, b), (fa, fb) in sorted(new.items())
    )
    gone = EXCEPTIONS - set(up)
    assert not gone, f"listed exceptions that no longer exist (delete them from EXCEPTIONS): {sorted(gone)}"


def test_the_checker_sees_relative_and_local_imports(tmp_path: Path) -> None:
    source = (
        "import os\nfrom . import lane\nfrom ..core import layout\n\ndef f():\n    from kvseal.server import serve\n"
    )
    path = tmp_path / "x.py"
    path.write_text(source)
    assert _imports(path, "kvseal.ssd.x") == {"kvseal.ssd.lane", "kvseal.core.layout", "kvseal.server.serve"}
    assert _floor("kvseal.server.serve") > _floor("kvseal.ssd.tier") > _floor("kvseal.core.store")
