"""A benchmark page rendered against a rehearsal's results, strictly, before any GPU minute is spent on them.

`make rehearse-gpu` writes, at CPU sizes, the same JSON files the GPU window will write; the pages that will read
the GPU's files are rendered here against a copy of bench/results with the rehearsal's files laid over it. Every
value the page reads from those files must be there (macros.Results with `strict`), and each of them must be read
(a page section hidden behind `bench_exists` checks nothing): a key renamed in a benchmark fails here, not in the
docs build after the window.

    python -m lorafleet_ops.docsite.page_check PAGE REHEARSAL_FILE... [--committed bench/results]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import jinja2

from lorafleet_ops.docsite.macros import BenchFileError, Results, macro_calls


class ReadingResults(Results):
    """Results that remember which files a page read."""

    def __init__(self, folder: Path, strict: frozenset[str]) -> None:
        super().__init__(folder, strict)
        self.read: set[str] = set()

    def load(self, file: str) -> object:
        self.read.add(file)
        return super().load(file)


def check(page: Path, files: list[Path], committed: Path) -> list[str]:
    """What is wrong with `page` read against `files` laid over `committed` (empty: nothing)."""
    missing = [f"{file} was not written (its step failed?)" for file in files if not file.is_file()]
    if missing:
        return missing
    with tempfile.TemporaryDirectory() as folder:
        shutil.copytree(committed, folder, dirs_exist_ok=True)
        for file in files:
            shutil.copy2(file, Path(folder) / file.name)
        results = ReadingResults(Path(folder), frozenset(file.name for file in files))
        template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(page.read_text())
        try:
            template.render(**macro_calls(results))
        except (BenchFileError, jinja2.TemplateError, ValueError) as error:
            return [f"{page}: {error}"]
    return [f"{page} does not read {file.name}" for file in files if file.name not in results.read]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("files", type=Path, nargs="+", help="the rehearsal's result files, under their page names")
    parser.add_argument("--committed", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    problems = check(args.page, args.files, args.committed)
    for problem in problems:
        print(f"page_check: {problem}", file=sys.stderr)
    if not problems:
        print(f"page_check: {args.page} reads {', '.join(file.name for file in args.files)}: every value present")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
