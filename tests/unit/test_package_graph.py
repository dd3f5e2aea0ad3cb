"""The arrows between lorafleet's packages, read from the source (the picture:
docs/concepts/architecture.md#the-packages-and-the-arrows-between-them).

The contract (`lorafleet`, shared/) imports no service and not the operations package; a service imports the contract
and itself, never another service and never the operations package; the operations package (`lorafleet_ops`, ops/)
may import all of them; the testing room (`lorafleet_testing`, tests/support: the fakes, the chaos harness, the stress
driver) may import every package and none imports it, so no image ever needs it. Every import counts, at module level
or inside a function or a `try`, except those under `if TYPE_CHECKING:` (annotations only);
`importlib.import_module("...")` with a literal name counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"lorafleet": REPO / "shared" / "lorafleet", "lorafleet_ops": REPO / "ops" / "lorafleet_ops",
            "lorafleet_proxy": REPO / "services" / "proxy" / "lorafleet_proxy",
            "lorafleet_vllm": REPO / "services" / "vllm" / "lorafleet_vllm",
            "lorafleet_trainer": REPO / "services" / "trainer" / "lorafleet_trainer",
            "lorafleet_testing": REPO / "tests" / "support" / "lorafleet_testing"}
SERVICES = ("lorafleet_proxy", "lorafleet_vllm", "lorafleet_trainer")
PROJECT = set(PACKAGES)
ALLOWED = {"lorafleet": {"lorafleet"},
           "lorafleet_ops": {"lorafleet", "lorafleet_ops", *SERVICES},
           "lorafleet_testing": PROJECT,
           **{service: {"lorafleet", service} for service in SERVICES}}


def imported(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `tree` that runs (not under `if TYPE_CHECKING:`)."""
    skipped = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
               and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module.split(".")[0]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value.split(".")[0]


def violations(package: str, root: Path) -> list[str]:
    """`file:line imports X` for each import of a project package that `package` may not import."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, target in imported(ast.parse(path.read_text(), str(path))):
            if target in PROJECT and target not in ALLOWED[package]:
                found.append(f"{path.relative_to(root.parent)}:{line} imports {target}")
    return found


def test_every_package_is_read() -> None:
    for package, root in PACKAGES.items():
        assert (root / "__init__.py").is_file(), package
    # The graph is not empty: the operations package does import services (the check sees real arrows).
    assert any(target in SERVICES for path in PACKAGES["lorafleet_ops"].rglob("*.py")
               for _, target in imported(ast.parse(path.read_text())))


@pytest.mark.parametrize("package", list(PACKAGES))
def test_each_package_imports_only_what_its_arrows_allow(package: str) -> None:
    assert not violations(package, PACKAGES[package])


PLANTED = {
    "upward import in a function": "def f():\n    from lorafleet_trainer.main import resolve_settings\n",
    "guarded by try/except ImportError": "try:\n    import lorafleet_ops.commands\nexcept ImportError:\n    pass\n",
    "by name": "import importlib\nimportlib.import_module('lorafleet_proxy.app')\n",
}


@pytest.mark.parametrize("source", list(PLANTED.values()), ids=list(PLANTED))
def test_a_planted_upward_import_in_the_contract_is_found(source: str, tmp_path: Path) -> None:
    contract = tmp_path / "lorafleet"
    contract.mkdir()
    (contract / "__init__.py").write_text("")
    (contract / "planted.py").write_text(source)
    assert [line.split(":")[0] for line in violations("lorafleet", contract)] == ["lorafleet/planted.py"]


def test_a_service_importing_operations_or_another_service_is_found(tmp_path: Path) -> None:
    service = tmp_path / "lorafleet_proxy"
    service.mkdir()
    (service / "ok.py").write_text("from lorafleet.settings import ProxySettings\nfrom . import ok\n")
    (service / "bad.py").write_text("from lorafleet_ops.processes import Service\nimport lorafleet_trainer\n")
    (service / "typing_only.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from lorafleet_ops.commands import doctor\n")
    assert violations("lorafleet_proxy", service) == ["lorafleet_proxy/bad.py:1 imports lorafleet_ops",
                                                      "lorafleet_proxy/bad.py:2 imports lorafleet_trainer"]


def test_operations_importing_the_testing_room_is_found(tmp_path: Path) -> None:
    ops = tmp_path / "lorafleet_ops"
    ops.mkdir()
    (ops / "stress.py").write_text("from lorafleet_testing.chaos.judge import check_folder\n")
    assert violations("lorafleet_ops", ops) == ["lorafleet_ops/stress.py:1 imports lorafleet_testing"]


def test_no_image_or_installed_package_needs_the_testing_room() -> None:
    dockerfiles = sorted((REPO / "services").rglob("Dockerfile*"))
    assert dockerfiles
    for dockerfile in dockerfiles:
        copies = [line for line in dockerfile.read_text().splitlines() if line.split()[:1] in (["COPY"], ["ADD"])]
        assert copies and not [line for line in copies if "tests" in line], dockerfile.relative_to(REPO)
    for package, root in PACKAGES.items():
        if package != "lorafleet_testing":
            assert "lorafleet-testing" not in (root.parent / "pyproject.toml").read_text(), package
