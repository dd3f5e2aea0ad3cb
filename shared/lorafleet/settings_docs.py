"""The settings documentation, rendered from the schema so that the README cannot drift from the code.

`lorafleet settings-table` prints the Markdown table the README embeds between its
`<!-- settings-table:start -->` / `<!-- settings-table:end -->` markers; tests/unit/test_settings_docs.py
fails when the two differ. `env_default` is also how tests compare `.env.example` with the schema.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic.fields import FieldInfo

from lorafleet.settings import Settings, env_name

TABLE_START = "<!-- settings-table:start -->"
TABLE_END = "<!-- settings-table:end -->"


def env_default(field: FieldInfo) -> str:
    """The field's default written as the environment value that sets it (what `.env` would contain)."""
    value = field.get_default(call_default_factory=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, Path):
        return str(value)
    return "" if value is None else str(value)


def settings_rows() -> list[tuple[str, str, str]]:
    """(environment variable, default, description) for every field, in schema order."""
    return [
        (env_name(name), env_default(field), field.description or "")
        for name, field in Settings.model_fields.items()
    ]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    """The Markdown table of every setting: variable, default, one-line description."""
    lines = ["| Variable | Default | Description |", "|---|---|---|"]
    for variable, default, description in settings_rows():
        shown = f"`{_cell(default)}`" if default else "*(empty)*"
        lines.append(f"| `{variable}` | {shown} | {_cell(description)} |")
    return "\n".join(lines) + "\n"
