"""The generated reference pages (docs/reference) are what `lorafleet docs-reference` writes from the code now.

The check must also fail where it should: a new setting, metric, route, make target or CLI option each makes the
page it belongs to stale, and only that page (the real generator functions, on a copy of the repository's pages).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lorafleet_proxy.app as proxy_app
import markdown
import pytest
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import SECTIONS, StackSettings, TrainerSettings
from lorafleet_ops.commands import cli
from lorafleet_ops.docsite import reference
from lorafleet_ops.docsite.reference import REFERENCE_DIR, cell, env_default, make_targets, settings_rows, stale_pages
from lorafleet_proxy.metrics import Metrics
from prometheus_client import Counter
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def copy_root(tmp_path: Path) -> Path:
    """A repository root holding a copy of the committed pages and the Makefile, to make stale on purpose."""
    shutil.copytree(ROOT / REFERENCE_DIR, tmp_path / REFERENCE_DIR)
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


def test_committed_pages_are_what_the_code_gives_now() -> None:
    stale = stale_pages(ROOT)
    assert not stale, f"out of date: {', '.join(map(str, stale))}; run `make docs-reference` and commit the pages"


def test_the_copy_starts_current(copy_root: Path) -> None:
    """The stale checks below start from a copy that is current: each finding is the change's."""
    assert stale_pages(copy_root) == []


def test_a_new_setting_makes_the_settings_page_stale(copy_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    knob = FieldInfo(annotation=int, default=3, description="A knob added after the pages were written.")
    monkeypatch.setitem(TrainerSettings.model_fields, "docs_probe_knob", knob)
    assert stale_pages(copy_root) == [REFERENCE_DIR / "settings.md"]
    assert "| <a id=\"docs_probe_knob\"></a>`DOCS_PROBE_KNOB` | integer | `3` |" in reference.settings_page()


def test_a_new_metric_makes_the_metrics_page_stale(copy_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = Metrics.__init__

    def with_one_more(self: Metrics) -> None:
        original(self)
        Counter("lorafleet_proxy_docs_probe", "A metric added after the pages were written.", ["kind"],
                registry=self.registry)

    monkeypatch.setattr(Metrics, "__init__", with_one_more)
    assert stale_pages(copy_root) == [REFERENCE_DIR / "metrics.md"]
    assert "| `lorafleet_proxy_docs_probe_total` | counter | `kind` |" in reference.metrics_page()


def test_a_new_route_makes_the_openapi_document_stale(copy_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    factory: Callable[..., FastAPI] = proxy_app.create_app

    async def probe() -> dict[str, str]:
        return {}

    def with_one_more(*args: Any, **kwargs: Any) -> FastAPI:
        app = factory(*args, **kwargs)
        app.add_api_route("/docs-probe", probe, methods=["GET"])
        return app

    monkeypatch.setattr(proxy_app, "create_app", with_one_more)
    assert stale_pages(copy_root) == [REFERENCE_DIR / "openapi.json"]
    assert '"/docs-probe"' in reference.openapi_document()


def test_a_new_make_target_makes_the_make_page_stale(copy_root: Path) -> None:
    makefile = copy_root / "Makefile"
    makefile.write_text(makefile.read_text() + "\ndocs-probe: setup ## A target added after the pages were written\n")
    assert stale_pages(copy_root) == [REFERENCE_DIR / "make.md"]


def test_a_new_cli_option_makes_the_cli_page_stale(copy_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = cli.build_parser

    def with_one_more() -> argparse.ArgumentParser:
        parser = build()
        status = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
        status.choices["status"].add_argument("--docs-probe", help="an option added after the pages were written")
        return parser

    monkeypatch.setattr(cli, "build_parser", with_one_more)
    assert stale_pages(copy_root) == [REFERENCE_DIR / "cli.md"]
    assert "| `--docs-probe DOCS_PROBE` |  | an option added after the pages were written |" in reference.cli_page()


def test_cli_check_names_the_stale_page_and_writing_fixes_it(
    copy_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = copy_root / REFERENCE_DIR / "make.md"
    page.write_text(page.read_text() + "edited by hand\n")
    assert cli.main(["docs-reference", "--check", "--root", str(copy_root)]) == 1
    assert "stale: docs/reference/make.md" in capsys.readouterr().err
    assert cli.main(["docs-reference", "--root", str(copy_root)]) == 0
    assert capsys.readouterr().out == "wrote docs/reference/make.md\n"
    assert cli.main(["docs-reference", "--check", "--root", str(copy_root)]) == 0


def test_cli_refuses_a_folder_that_is_not_the_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["docs-reference", "--check", "--root", str(tmp_path)]) == 2
    assert "not the repository root" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_pages_do_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's own settings never show: defaults are the schema's (the proxy app is built from them too)."""
    pages = reference.generate(ROOT)
    monkeypatch.setenv("PROXY_PORT", "9999")
    monkeypatch.setenv("PROXY_ROUTING", "round_robin")
    monkeypatch.setenv("RUN_KEYS_DIR", "/somewhere/else")
    assert reference.generate(ROOT) == pages
    assert not any(str(ROOT) in text for text in pages.values())


def test_every_setting_has_a_row_type_default_and_description() -> None:
    rows = settings_rows()
    assert sorted(variable for _, variable, *_ in rows) == sorted(name.upper() for name in StackSettings.model_fields)
    for name, field in StackSettings.model_fields.items():
        assert field.description, f"field {name} has no description (the docs come from it)"
    by_name = {variable: (section, kind, default) for section, variable, kind, default, _ in rows}
    assert by_name["MAX_STALENESS"] == ("common", "integer ≥ 0", "4")
    assert by_name["PROXY_PORT"][1:] == ("integer ≥ 1, ≤ 65535", "8000")
    assert by_name["PROXY_ROUTING"][1] == "one of `affinity`, `least_loaded`, `round_robin`"
    assert by_name["VLLM_EXTRA_ARGS"][0] == "replica" and by_name["VLLM_EXTRA_ARGS"][2] == ""
    assert by_name["TRAINER_GPUS"][0] == "trainer" and by_name["PROXY_UPSTREAM_TOKEN"][0] == "replica"
    order = [key for key, _ in SECTIONS]  # one table per section, in this order: each section's rows together
    assert [section for section, *_ in rows] == sorted((section for section, *_ in rows), key=order.index)
    assert list(dict.fromkeys(section for section, *_ in rows)) == order


def test_defaults_are_rendered_as_env_values() -> None:
    fields = StackSettings.model_fields
    assert env_default(fields["adapter_root"]) == "/adapters"
    assert env_default(fields["gradient_checkpointing"]) == "false"
    assert env_default(fields["lora_rank"]) == "1"
    # Every rendered default, read back from the environment, gives the schema's default value.
    rendered = {variable.lower(): default for _, variable, _, default, _ in settings_rows() if default}
    assert StackSettings(_env_file=None, **rendered).model_dump() == StackSettings(_env_file=None).model_dump()


def test_make_targets_are_what_make_help_lists() -> None:
    """The page's parse of the `## ` comments gives make help's own list (read here; the generator never runs make)."""
    shown = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout
    listed = [(match[1], match[2]) for match in re.finditer(r"^  \x1b\[1m(\S+)\s*\x1b\[0m (.*)$", shown, re.M)]
    assert listed and make_targets((ROOT / "Makefile").read_text()) == listed


target_names = st.from_regex(r"[a-z][a-z-]{0,15}", fullmatch=True)
help_texts = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip)


@given(st.lists(st.tuples(target_names, st.one_of(st.none(), help_texts)), max_size=8))
def test_make_target_parser_keeps_the_commented_rules_in_order(rules: list[tuple[str, str | None]]) -> None:
    lines = [f"{name}: setup ## {text}" if text is not None else f"{name}: setup" for name, text in rules]
    text = "\n".join(["VAR := 1  ## not a target", *lines, "\techo '## a recipe line'"])
    # awk -F':.*## ' splits at the longest match: the help is what follows the line's last "## ".
    expected = [(name, help_.rsplit("## ", 1)[-1]) for name, help_ in rules if help_ is not None]
    assert make_targets(text) == expected


@given(st.text(st.characters(min_codepoint=9, max_codepoint=126)))
def test_a_cell_never_breaks_its_table_row(text: str) -> None:
    """Whatever a description holds (pipes, backslashes, line breaks), its row keeps its cells."""
    row = markdown.markdown(f"| a | b |\n|---|---|\n| {cell(text)} | end |\n", extensions=["tables"])
    cells = re.findall(r"<td>(.*?)</td>", row.split("<tbody>")[1], re.S)
    assert len(cells) == 2 and cells[1] == "end"
