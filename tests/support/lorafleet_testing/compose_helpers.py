"""Shared pieces of the static compose/Dockerfile checks (parsers, tool lookup, runner types)."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet_testing import REPO

COMPOSE_FILE = REPO / "compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
# `NAME=value` (set) or `# NAME=value` (documented default) in .env.example.
ENV_ENTRY = re.compile(r"^(?P<commented># ?)?(?P<name>[A-Z][A-Z0-9_]*)=(?P<value>.*)$")
# `${NAME}`, `${NAME:-default}`, `${NAME:?message}`, ... in compose.yaml (`$${...}` is an escaped literal).
COMPOSE_VAR = re.compile(r"(?<!\$)\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<op>:?[-?+])?(?P<arg>[^}]*)\}")
REQUIRED_SECRET_VALUE = "test-secret-value"


@dataclass(frozen=True)
class EnvEntry:
    name: str
    value: str
    commented: bool
    explanation: str


def parse_env_example(text: str) -> dict[str, EnvEntry]:
    """Entries of .env.example with the comment line right above each (its one-line explanation)."""
    entries: dict[str, EnvEntry] = {}
    previous = ""
    for line in text.splitlines():
        match = ENV_ENTRY.match(line)
        if match:
            explanation = previous[1:].strip() if previous.startswith("#") and not ENV_ENTRY.match(previous) else ""
            entries[match["name"]] = EnvEntry(match["name"], match["value"], bool(match["commented"]), explanation)
        previous = line
    return entries


def required_compose_vars() -> set[str]:
    """Variables compose.yaml declares required with `${NAME:?message}` / `${NAME?message}`."""
    return {m["name"] for m in COMPOSE_VAR.finditer(COMPOSE_FILE.read_text()) if (m["op"] or "").endswith("?")}


@dataclass(frozen=True)
class ComposeResult:
    returncode: int
    stdout: str
    stderr: str


ComposeRunner = Callable[..., ComposeResult]

EnvFileMaker = Callable[..., Path]
RenderFn = Callable[..., dict[str, Any]]


def tool(name: str) -> str:
    """A CLI installed in the same environment as pytest (hadolint, check-jsonschema)."""
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert path, f"{name} is not installed: run make setup"
    return path
