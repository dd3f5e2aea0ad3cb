"""The proxy's modules import each other without a circle, the request path imports nothing of the admin plane, and
no module reaches through the fleet to the parts it was given (it asks the fleet by name: `fleet.mark_loaded(...)`).

Read from the source (ast), so the check holds for every module, imported by a test or not. A circle counts whatever
the imports' kind: one through `if TYPE_CHECKING:` is a circle of the design that annotations hide (the cure is a
protocol of the few actions a module needs, as sync.SyncFleet); an import of a package's module from outside it runs
the package's `__init__` first, so it counts as an import of the package too. The other rules read run-time imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorafleet_proxy
import pytest

PACKAGE = Path(lorafleet_proxy.__file__).parent
# The admin plane: broadcasts, their typed bodies, the read-only views, pause elision, the document, the wiring.
ADMIN_PLANE = {"admin", "views", "broadcast", "schemas", "elision", "openapi", "app", "main"}
# What `Fleet` is built with: its own business (the wiring hands them to whoever needs them).
FLEET_PARTS = {"settings", "router", "ledger", "metrics", "transport"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: dict[str, Path], typing_too: bool = False, package_root: Path = PACKAGE) -> set[str]:
    """The package's own `modules` that `path` imports (relative imports resolved): at run time, or with those under
    `if TYPE_CHECKING:` too; an import of `a.b` from outside package `a` imports `a` too."""
    tree = ast.parse(path.read_text())
    importer = module_name(path, package_root)
    here = importer.split(".") if importer else []
    package = here if path.name == "__init__.py" else here[:-1]
    skipped = set() if typing_too else {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                                        and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        target = [*base, *(node.module.split(".") if node.module else [])]
        for alias in node.names:
            candidate = ".".join([*target, alias.name])
            found.add(candidate if candidate in modules else ".".join(target))
    parents = {".".join(name.split(".")[:depth]) for name in found for depth in range(1, name.count(".") + 1)}
    found |= {parent for parent in parents if importer != parent and not importer.startswith(f"{parent}.")}
    return {name for name in found - {importer} if name in modules}


def graph(package: Path, typing_too: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = {module_name(path, package): path for path in package.rglob("*.py")}
    return {name: imports(path, modules, typing_too, package) for name, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The modules that reach themselves through `edges`, each with what it imports."""
    return {name: edges[name] for name in edges if name in reachable(name, edges)}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = graph(PACKAGE)
EVERY_IMPORT = graph(PACKAGE, typing_too=True)


def reachable(start: str, edges: dict[str, set[str]] = GRAPH) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in edges[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def reaches_into_the_fleet(path: Path) -> list[str]:
    """Expressions in `path` such as `fleet.ledger` or `self.fleet.router`: a fleet's part used from outside."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in FLEET_PARTS:
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "fleet") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "fleet"):
                found.append(ast.unparse(node))
    return found


def test_the_graph_is_read() -> None:
    assert "front" in GRAPH["app"] and "errors" in GRAPH["front"], GRAPH  # the check cannot pass on an empty graph
    assert "request" in GRAPH["front"] and "health" in GRAPH["fleet"], GRAPH


def test_no_import_circle_not_even_through_type_checking() -> None:
    found = circles(EVERY_IMPORT)
    assert not found, "modules in an import circle: " + "; ".join(
        f"{name} imports {', '.join(sorted(found[name] & set(found)))}" for name in sorted(found))


PLANTED_CIRCLES = {  # the files of a package -> the modules in a circle
    "run time": ({"fleet.py": "from .health import HealthChecks\n", "health.py": "from .fleet import Fleet\n"},
                 {"fleet", "health"}),
    "annotations only": ({"fleet.py": "from .health import HealthChecks\n",
                          "health.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from .fleet import Fleet\n"}, {"fleet", "health"}),
    "through a package's __init__": ({"ledger.py": "from .runs.confinement import confine_load\n",
                                      "runs/__init__.py": "from .registry import Runs\n", "runs/confinement.py": "",
                                      "runs/registry.py": "from ..ledger import Ledger\n"},
                                     {"ledger", "runs", "runs.registry"}),
    "none: a module imports its own package's siblings": ({"runs/__init__.py": "from .registry import Runs\n",
                                                           "runs/registry.py": "from .names import own_name\n",
                                                           "runs/names.py": ""}, set()),
}


@pytest.mark.parametrize(("files", "circled"), list(PLANTED_CIRCLES.values()), ids=list(PLANTED_CIRCLES))
def test_a_planted_circle_is_found(files: dict[str, str], circled: set[str], tmp_path: Path) -> None:
    for name, source in {"__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(source)
    assert set(circles(graph(tmp_path, typing_too=True))) == circled


def test_the_request_path_imports_nothing_of_the_admin_plane() -> None:
    assert not reachable("front") & ADMIN_PLANE, reachable("front")


def test_no_module_reaches_through_the_fleet_to_its_parts(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def paused(fleet):\n    return fleet.ledger.paused\n")
    assert reaches_into_the_fleet(planted) == ["fleet.ledger"]  # the check sees a reach when there is one
    reached = {name: found for name, path in MODULES.items()
               if name != "fleet" and (found := reaches_into_the_fleet(path))}
    assert not reached, reached
