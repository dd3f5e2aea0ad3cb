"""docs/development/layout.md's listing names every module of the five packages and every file of bench/ and tools/.

The listing is the page's `## The listing` section, up to the next `## ` heading or the end. Inside it each entry
starts at the line's first column with a path (`shared/`, `ops/lorafleet_ops/commands/`, `bench/`, ...) and goes on in
the indented lines below it. A module is named when the entry for its folder (the entry with the longest path its
own path starts with) holds its name as a word (`settings`, `doctor/fleet_checks`), its file name (`runs_bench.py`) or
its path; a file that is not Python only by its file name (`engine.sh`), a folder of bench/ by its name (`results/`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("shared/lorafleet", "ops/lorafleet_ops", "services/proxy/lorafleet_proxy", "services/vllm/lorafleet_vllm",
            "services/trainer/lorafleet_trainer")
FOLDERS = ("bench", "tools")
SKIPPED = {"__pycache__", "__init__.py"}


LAYOUT_PAGE = REPO / "docs" / "development" / "layout.md"


def layout_section(page: str) -> str:
    match = re.search(r"^## The listing\n(?P<body>.*?)(?=^## |\Z)", page, re.M | re.S)
    assert match, f"{LAYOUT_PAGE.relative_to(REPO)} has no `## The listing` section"
    return match["body"]


def entries(section: str) -> dict[str, str]:
    """Entry path (its first word, e.g. `ops/lorafleet_ops/commands/`) -> the entry's whole text."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in section.splitlines():
        if not line.strip() or line.startswith("```"):
            continue
        if line[0].isspace():
            if current is not None:
                current.append(line)
            continue
        current = found.setdefault(line.split()[0], [])
        current.append(line)
    return {path: "\n".join(lines) for path, lines in found.items()}


def entry_for(path: str, table: dict[str, str]) -> tuple[str, str] | None:
    """The entry for `path`: the one with the longest path that `path` starts with."""
    owners = [key for key in table if key.endswith("/") and path.startswith(key)]
    if not owners:
        return None
    key = max(owners, key=len)
    return key, table[key]


def named(path: str, table: dict[str, str]) -> bool:
    found = entry_for(path, table)
    if found is None:
        return False
    key, text = found
    file = Path(path)
    relative = path.removeprefix(key).removesuffix("/")
    names = {path, relative, file.name}
    if file.suffix == ".py":
        names |= {relative.removesuffix(".py"), file.stem}
    for package in PACKAGES:  # a module of a subpackage may be named from the package (`doctor/fleet_checks`)
        if path.startswith(package + "/"):
            names.add(path.removeprefix(package + "/").removesuffix(".py"))
    return any(re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w-]|\.\w)", text) for name in names)


def required() -> list[str]:
    """Every module (no `__init__.py`) of the four packages, every file of bench/ and tools/, bench/'s folders."""
    paths: list[str] = []
    for package in PACKAGES:
        for module in sorted((REPO / package).rglob("*.py")):
            if not SKIPPED & set(module.relative_to(REPO).parts):
                paths.append(module.relative_to(REPO).as_posix())
    for folder in FOLDERS:
        for child in sorted((REPO / folder).iterdir()):
            if child.name in SKIPPED or child.name.startswith("."):
                continue
            paths.append(child.relative_to(REPO).as_posix() + ("/" if child.is_dir() else ""))
    return paths


LAYOUT = entries(layout_section(LAYOUT_PAGE.read_text()))


@pytest.mark.parametrize("path", required())
def test_the_layout_page_names(path: str) -> None:
    page = LAYOUT_PAGE.relative_to(REPO)
    assert named(path, LAYOUT), f"{page}'s listing does not name {path} (in the entry for its folder)"


def test_the_check_can_fail() -> None:
    """A module is found in its own folder's entry only, as a whole word."""
    table = entries("```\nshared/  lorafleet: settings, run_state\nservices/trainer/  lorafleet_trainer: main\n"
                    "bench/  proxy_bench.py (make bench)\n```\n")
    assert named("shared/lorafleet/settings.py", table)
    assert not named("shared/lorafleet/main.py", table)  # named, but in another folder's entry
    assert not named("shared/lorafleet/run.py", table)  # `run_state` is not `run`
    assert named("bench/proxy_bench.py", table) and not named("bench/soak.py", table)
    assert not named("tools/engine.sh", table)  # no entry for tools/
