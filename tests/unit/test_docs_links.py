"""Every `docs/<page>.md[#anchor]` that code, config and the README cite is a page of the site, with that anchor.

mkdocs --strict checks the links between pages; this checks the ones from outside the site: error messages and
doctor hints, comments in compose.yaml, .env.example, the Makefile, the manifests, the Dockerfiles, the tools and CI,
SECURITY.md and README.md. A page must exist under docs/ and be in mkdocs.yml's nav, and an anchor must be an id
that page renders: a heading's slug as mkdocs' toc extension makes it (the same Python-Markdown and extensions as
the site), an explicit `{#id}` or an `<a id>`. And no page under docs/ is left out of the nav.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import markdown
import pytest
from mkdocs.config import load_config
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.utils.meta import get_data

ROOT = Path(__file__).resolve().parents[2]
# What may cite a page: code (with its error messages and doctor hints), configuration, tooling, CI, the top docs.
CITING = ("shared", "services", "tasks", "bench", "tools", "tests", "deploy", "monitoring", ".github", ".ci",
          "compose.yaml", "compose.online.yaml", ".env.example", "Makefile", "SECURITY.md", "README.md")
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache", "node_modules", "results"}
REFERENCE = re.compile(r"(?<![\w./-])docs/(?P<page>[A-Za-z0-9_/-]+\.md)(?:#(?P<anchor>[A-Za-z0-9_-]+))?")
ID = re.compile(r'\bid="([^"]+)"')
SELF = Path(__file__).resolve()  # its examples cite made-up pages on purpose


def site_config(root: Path) -> MkDocsConfig:
    """mkdocs.yml as mkdocs itself loads it: the nav, and the Markdown extensions with their options resolved."""
    return load_config(str(root / "mkdocs.yml"))


def nav_pages(root: Path) -> set[str]:
    """Every page file the nav lists (relative to docs/)."""

    def walk(node: Any) -> Iterator[str]:
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                yield from walk(value)

    return {page for page in walk(site_config(root).nav or []) if page.endswith(".md")}


def page_ids(page: Path, config: MkDocsConfig) -> set[str]:
    """The ids the page renders with the site's own Markdown extensions (front matter left out, as mkdocs does)."""
    body, _ = get_data(page.read_text())
    renderer = markdown.Markdown(extensions=config.markdown_extensions, extension_configs=config.mdx_configs)
    return set(ID.findall(renderer.convert(body)))


def citing_files(root: Path) -> Iterator[Path]:
    for name in CITING:
        path = root / name
        candidates = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
        for candidate in candidates:
            parts = set(candidate.relative_to(root).parts)
            if (candidate.is_file() and candidate != SELF and not parts & SKIPPED_DIRS
                    and not any(part.endswith(".egg-info") for part in parts)):
                yield candidate


def citations(root: Path) -> Iterator[tuple[str, str, str | None]]:
    """(where, page, anchor) for each `docs/<page>.md[#anchor]` in the citing files."""
    for path in citing_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # images, archives
        for number, line in enumerate(text.splitlines(), 1):
            for match in REFERENCE.finditer(line):
                yield f"{path.relative_to(root)}:{number}", match["page"], match["anchor"]


def problems(root: Path) -> list[str]:
    """What is wrong with the citations: a page that does not exist, is not in the nav, or lacks the anchor."""
    config, nav, found = site_config(root), nav_pages(root), []
    ids: dict[str, set[str]] = {}
    for where, page, anchor in citations(root):
        path = root / "docs" / page
        if not path.is_file():
            found.append(f"{where}: docs/{page} does not exist")
        elif page not in nav:
            found.append(f"{where}: docs/{page} is not in mkdocs.yml's nav")
        elif anchor and anchor not in ids.setdefault(page, page_ids(path, config)):
            found.append(f"{where}: docs/{page} has no anchor #{anchor}")
    return found


def pages_outside_nav(root: Path) -> list[str]:
    nav = nav_pages(root)
    return sorted(page for path in (root / "docs").rglob("*.md")
                  if (page := path.relative_to(root / "docs").as_posix()) not in nav)


def test_every_cited_page_and_anchor_exists() -> None:
    assert list(citations(ROOT)), "no citation found: the scan is broken"
    found = problems(ROOT)
    assert not found, "broken documentation citations:\n" + "\n".join(found)


def test_every_page_is_in_the_nav() -> None:
    assert not pages_outside_nav(ROOT), f"pages missing from mkdocs.yml's nav: {pages_outside_nav(ROOT)}"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A small site: one page in the nav with a heading, an explicit id and an inline anchor; one page outside."""
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "docs" / "guides" / "runs.md").write_text(
        "---\ntitle: Runs\n---\n\n# Runs\n\n## Run keys: one per run\n\n## Leases {#lease}\n\n"
        '| a |\n|---|\n| <a id="run_weight"></a>`RUN_WEIGHT` |\n\n```text\n## not a heading\n```\n')
    (tmp_path / "docs" / "orphan.md").write_text("# Orphan\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nmarkdown_extensions:\n  - attr_list\n  - tables\n  - toc:\n      permalink: true\n"
        "  - pymdownx.superfences\n  - pymdownx.emoji:\n"
        "      emoji_index: !!python/name:material.extensions.emoji.twemoji\n"
        "nav:\n  - Guides:\n      - Runs: guides/runs.md\n")
    return tmp_path


def test_the_checks_can_fail(site: Path) -> None:
    good = ["docs/guides/runs.md", "docs/guides/runs.md#run-keys-one-per-run", "docs/guides/runs.md#lease",
            "docs/guides/runs.md#run_weight"]
    bad = ["docs/guides/gone.md", "docs/orphan.md", "docs/guides/runs.md#leases", "docs/guides/runs.md#not-a-heading",
           "docs/guides/runs.md#title"]
    (site / "Makefile").write_text("".join(f"# see {cited}\n" for cited in good + bad))
    assert problems(site) == [
        "Makefile:5: docs/guides/gone.md does not exist",
        "Makefile:6: docs/orphan.md is not in mkdocs.yml's nav",
        "Makefile:7: docs/guides/runs.md has no anchor #leases",
        "Makefile:8: docs/guides/runs.md has no anchor #not-a-heading",
        "Makefile:9: docs/guides/runs.md has no anchor #title",
    ]
    assert pages_outside_nav(site) == ["orphan.md"]


def test_only_page_paths_are_taken_for_citations(site: Path) -> None:
    """A path that merely ends in docs/… (another tree's) or a file that is not Markdown is not a citation."""
    (site / "Makefile").write_text("see vendor/docs/x.md, docs/demo-report.json and (docs/guides/runs.md#lease).\n")
    assert list(citations(site)) == [("Makefile:1", "guides/runs.md", "lease")]
