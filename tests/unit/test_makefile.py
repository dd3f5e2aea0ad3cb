"""The Makefile's `.PHONY` names every target it defines, and only those (a phony name with no rule is a typo)."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[2] / "Makefile"
# A rule's first line: `name:` or `name: prerequisites` (not `NAME := value`, not a recipe line, not `$(STAMP):`).
RULE = re.compile(r"^(?P<targets>[A-Za-z0-9_][A-Za-z0-9_.-]*(?:\s+[A-Za-z0-9_][A-Za-z0-9_.-]*)*)\s*:(?![=:])")


def logical_lines(text: str) -> list[str]:
    """The Makefile's lines with backslash continuations joined (recipe lines keep their leading tab)."""
    return re.sub(r"\\\n", " ", text).splitlines()


def targets(text: str) -> set[str]:
    found: set[str] = set()
    for line in logical_lines(text):
        match = RULE.match(line)
        if match:
            found.update(match["targets"].split())
    return found


def phony(text: str) -> set[str]:
    return {name for line in logical_lines(text) if line.startswith(".PHONY:")
            for name in line.removeprefix(".PHONY:").split()}


def test_every_target_is_phony_and_every_phony_name_is_a_target() -> None:
    text = MAKEFILE.read_text()
    defined, declared = targets(text), phony(text)
    assert {"help", "setup", "unit", "train", "bench-runs"} <= defined  # the parser sees the rules
    assert not defined - declared, f"targets missing from .PHONY: {sorted(defined - declared)}"
    assert not declared - defined, f".PHONY names without a rule: {sorted(declared - defined)}"


def test_the_check_can_fail() -> None:
    """A new target left out of .PHONY, and a phony name with no rule, are both seen."""
    text = MAKEFILE.read_text() + "\nbench-unlisted: setup ## a new target\n\t@true\n"
    assert "bench-unlisted" in targets(text) - phony(text)
    text = MAKEFILE.read_text().replace(".PHONY: help", ".PHONY: help helpp", 1)
    assert "helpp" in phony(text) - targets(text)
