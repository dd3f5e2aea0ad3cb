"""Three rules of the code's layout (docs/development/layout.md): no module of the packages is longer than a reader
holds in their head; no two modules share a file name, so a name in a log line, a traceback's last frame or a review
comment points at one file; and benchmarks and tests import the packages as installed, never by editing
`sys.path` (a path edit hides a missing dependency and lets a file import a sibling that packaging cannot see)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 500
PACKAGE_ROOTS = ("services", "shared", "ops")
# Names are unique across everything a traceback can show: the five packages, the testing room and the benchmarks.
NAMED_ROOTS = (*PACKAGE_ROOTS, "tests/support", "bench")
# A package's own file, and each service's entry point (`python -m lorafleet_proxy.main`: the package names it).
SHARED_BY_DESIGN = frozenset({"__init__.py", "main.py"})
PATH_EDIT = re.compile(r"\bsys\.path\s*(\.(insert|append|extend)\s*\(|\[[^\]]*\]\s*=|\s*[+]?=)")


def python_files(*roots: str) -> list[Path]:
    return sorted(path for root in roots for path in (REPO / root).rglob("*.py")
                  if "egg-info" not in str(path) and "__pycache__" not in path.parts)


def test_the_files_are_found() -> None:
    assert len(python_files(*PACKAGE_ROOTS)) > 100 and len(python_files("bench", "tests")) > 100


def test_no_module_is_over_the_limit() -> None:
    long = {str(path.relative_to(REPO)): lines for path in python_files(*PACKAGE_ROOTS)
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: split them by job ({long})"


def clashes(files: list[Path]) -> dict[str, list[str]]:
    """Each file name that more than one of `files` has (those shared by design aside), with the files."""
    holders: dict[str, list[str]] = defaultdict(list)
    for path in files:
        if path.name not in SHARED_BY_DESIGN:
            holders[path.name].append(str(path.relative_to(REPO)))
    return {name: paths for name, paths in holders.items() if len(paths) > 1}


def test_no_two_modules_share_a_name() -> None:
    found = clashes(python_files(*NAMED_ROOTS))
    assert not found, f"modules sharing a name (rename one after its job): {found}"


def test_a_planted_twin_is_found() -> None:
    planted = [REPO / "ops" / "lorafleet_ops" / "x" / "stress.py", REPO / "bench" / "stress.py",
               REPO / "ops" / "lorafleet_ops" / "x" / "__init__.py", REPO / "bench" / "__init__.py"]
    assert clashes(planted) == {"stress.py": ["ops/lorafleet_ops/x/stress.py", "bench/stress.py"]}


def test_no_benchmark_or_test_edits_sys_path() -> None:
    scanned = [path for path in python_files("bench", "tests") if path != Path(__file__).resolve()]  # not its cases
    edits = [f"{path.relative_to(REPO)}:{number}" for path in scanned
             for number, line in enumerate(path.read_text().splitlines(), 1) if PATH_EDIT.search(line)]
    assert not edits, f"sys.path edited (import the installed package instead): {edits}"


@pytest.mark.parametrize("line", ["sys.path.insert(0, str(HERE))", "sys.path.append(x)", "sys.path[:0] = paths",
                                  "sys.path += [here]", "sys.path = [here]", "    sys.path.extend(more)"])
def test_the_path_edit_pattern_sees_each_form(line: str) -> None:
    assert PATH_EDIT.search(line)


@pytest.mark.parametrize("line", ["print(sys.path)", "if here in sys.path:", "paths = list(sys.path)"])
def test_reading_sys_path_is_not_an_edit(line: str) -> None:
    assert not PATH_EDIT.search(line)
