"""docsite.page_check: a page read against a rehearsal's result files fails on a key it reads that the files lack,
and on a file it never reads; committed results keep their lenient rendering."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lorafleet_ops.docsite.page_check import check, main

pytestmark = pytest.mark.timeout(60)
PAGE = """{% if bench_exists("bench-x.json") %}p50 {{ bench_value("bench-x.json", "publish.p50") }},
old {{ bench_value("old.json", "gone", none="n/a") }}{% endif %}"""


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path, Path]:
    committed, rehearsal = tmp_path / "committed", tmp_path / "rehearsal"
    committed.mkdir()
    rehearsal.mkdir()
    (committed / "old.json").write_text("{}")  # an older result without the key: "n/a", as on the site
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    return page, committed, rehearsal


def test_a_page_that_reads_every_key_it_names_passes(folders: tuple[Path, Path, Path]) -> None:
    page, committed, rehearsal = folders
    (rehearsal / "bench-x.json").write_text(json.dumps({"publish": {"p50": 0.2}}))
    assert check(page, [rehearsal / "bench-x.json"], committed) == []
    assert main([str(page), str(rehearsal / "bench-x.json"), "--committed", str(committed)]) == 0


def test_a_key_the_rehearsal_lacks_fails_naming_it(folders: tuple[Path, Path, Path]) -> None:
    page, committed, rehearsal = folders
    (rehearsal / "bench-x.json").write_text(json.dumps({"publish": {"median": 0.2}}))  # renamed in the benchmark
    [problem] = check(page, [rehearsal / "bench-x.json"], committed)
    assert "bench-x.json has no 'publish.p50'" in problem


def test_a_file_the_page_never_reads_fails(folders: tuple[Path, Path, Path]) -> None:
    page, committed, rehearsal = folders
    (rehearsal / "bench-x.json").write_text(json.dumps({"publish": {"p50": 0.2}}))
    (rehearsal / "bench-y.json").write_text("{}")
    assert check(page, [rehearsal / "bench-x.json", rehearsal / "bench-y.json"], committed) == [
        f"{page} does not read bench-y.json"]


def test_a_file_the_rehearsal_did_not_write_is_named(folders: tuple[Path, Path, Path]) -> None:
    page, committed, rehearsal = folders
    assert check(page, [rehearsal / "bench-x.json"], committed) == [
        f"{rehearsal / 'bench-x.json'} was not written (its step failed?)"]
