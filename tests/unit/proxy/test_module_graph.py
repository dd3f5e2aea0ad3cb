"""The proxy's modules import each other without a circle, the request path imports nothing of the admin plane, and
no module reaches through the fleet to the parts it was given (it asks the fleet by name: `fleet.mark_loaded(...)`).

Read from the source (ast), so the check holds for every module, imported by a test or not. Imports under
`if TYPE_CHECKING:` are annotations only and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lorafleet_proxy

PACKAGE = Path(lorafleet_proxy.__file__).parent
# The admin plane: broadcasts, their typed bodies, the read-only views, pause elision, the document, the wiring.
ADMIN_PLANE = {"admin", "views", "broadcast", "schemas", "elision", "openapi", "app", "main"}
# What `Fleet` is built with: its own business (the wiring hands them to whoever needs them).
FLEET_PARTS = {"settings", "router", "ledger", "metrics", "transport"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """The package's own modules `path` imports at run time (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    here = module_name(path).split(".") if module_name(path) else []
    package = here if path.name == "__init__.py" else here[:-1]
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        target = [*base, *(node.module.split(".") if node.module else [])]
        for alias in node.names:
            candidate = ".".join([*target, alias.name])
            found.add(candidate if candidate in MODULES else ".".join(target))
    return {name for name in found if name in MODULES}


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
GRAPH = {name: runtime_imports(path) for name, path in MODULES.items()}


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in GRAPH[todo.pop()]:
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


def test_no_import_circle() -> None:
    circles = [name for name in MODULES if name in reachable(name)]
    assert not circles, {name: GRAPH[name] for name in circles}


def test_the_request_path_imports_nothing_of_the_admin_plane() -> None:
    assert not reachable("front") & ADMIN_PLANE, reachable("front")


def test_no_module_reaches_through_the_fleet_to_its_parts(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def paused(fleet):\n    return fleet.ledger.paused\n")
    assert reaches_into_the_fleet(planted) == ["fleet.ledger"]  # the check sees a reach when there is one
    reached = {name: found for name, path in MODULES.items()
               if name != "fleet" and (found := reaches_into_the_fleet(path))}
    assert not reached, reached
