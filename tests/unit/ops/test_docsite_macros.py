"""The benchmark pages' macros (lorafleet_ops.docsite.macros): values, tables and run records rendered from a result
JSON; a field the JSON lacks shows as "not recorded", never a guess; a page naming a missing JSON fails the build.
The build tests run the real mkdocs with the macros plugin as mkdocs.yml configures it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet_ops.docsite.macros import NOT_RECORDED, BenchFileError, Results, format_value, lookup, machine_text
from lorafleet_ops.docsite.record import RECORD_KEY, run_record

RESULT = {
    RECORD_KEY: {"date": "2026-12-04 22:40 UTC", "command": "python bench/x.py --out bench/results/x.json",
                 "machine": {"cores": 2, "cpu": "Xeon", "gpus": [], "load_average_1m": 1.5},
                 "versions": {"python": "3.11.7", "vllm": "0.31.0"},
                 "commit": {"sha": "8b336a4ca97ab66f2e243c8a59edc1e587152d52", "dirty": False}},
    "modes": {"affinity": {"rps": 3945.678, "p50_s": 0.03039, "hits": 0.62},
              "round_robin": {"rps": 1200.0, "p50_s": None}},
    "runs": [{"run": "a", "share": 0.5}, {"run": "b", "share": 0.5}],
}


@pytest.fixture
def results(tmp_path: Path) -> Results:
    (tmp_path / "x.json").write_text(json.dumps(RESULT))
    (tmp_path / "bare.json").write_text(json.dumps({"modes": {}}))
    return Results(tmp_path)


def test_a_value_is_formatted_and_scaled(results: Results):
    assert results.value("x.json", "modes.affinity.rps", "{:,.0f}") == "3,946"
    assert results.value("x.json", "modes.affinity.p50_s", "{:.1f}", 1000) == "30.4"
    assert results.value("x.json", "modes.affinity.hits", "{:.1%}") == "62.0%"
    assert results.value("x.json", "runs.1.run") == "b"
    assert results.value("x.json", ["modes", "affinity", "rps"], "{:.0f}") == "3946"
    assert results.value("x.json", "runs.run=b.share", "{:.0%}") == "50%"
    assert results.value("x.json", "runs.run=c.share") == NOT_RECORDED
    assert format_value({"OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "false"}) == "OMP_NUM_THREADS=2, OMP_PROC_BIND=false"
    assert format_value({}, none="none") == "none" and format_value([1, 2]) == "1, 2" and format_value(True) == "yes"


def test_a_missing_field_is_not_recorded_and_a_null_is_not_a_number(results: Results):
    assert results.value("x.json", "modes.least_loaded.rps", "{:.0f}") == NOT_RECORDED
    assert results.value("x.json", "runs.7.share") == NOT_RECORDED
    assert results.value("x.json", "modes.round_robin.p50_s", "{:.1f}", 1000) == "—"
    assert results.value("x.json", "modes.round_robin.p50_s", none="did not answer") == "did not answer"
    assert results.ratio("x.json", "modes.affinity.rps", "modes.round_robin.rps") == "3.29x"
    assert results.ratio("x.json", "modes.affinity.rps", "modes.least_loaded.rps") == NOT_RECORDED


def test_a_table_has_one_row_per_item_in_the_order_asked(results: Results):
    table = results.table("x.json", "modes", [["mode", "_key"], ["requests/s", "rps", "{:,.1f}"],
                                              ["p50 ms", "p50_s", "{:.2f}", 1000, "none"]],
                          rows=["round_robin", "affinity", "least_loaded"])
    assert table.splitlines() == [
        "| mode | requests/s | p50 ms |",
        "|---|---|---|",
        "| round_robin | 1,200.0 | none |",
        "| affinity | 3,945.7 | 30.39 |",
        f"| least_loaded | {NOT_RECORDED} | {NOT_RECORDED} |",
    ]
    listed = results.table("x.json", "runs", [["#", "_index"], ["run", "run"], ["share", "share", "{:.0%}"]])
    assert listed.splitlines()[2:] == ["| 0 | a | 50% |", "| 1 | b | 50% |"]
    timed = results.table("x.json", "modes", [["mode", "_key"]], where="p50_s")
    assert timed.splitlines()[2:] == ["| affinity |"]  # round_robin's p50 is null, so it is left out


def test_the_run_record_renders_and_each_missing_part_says_not_recorded(results: Results):
    meta = results.meta("x.json")
    assert "| date | 2026-12-04 22:40 UTC |" in meta
    assert "| machine | 2 cores (Xeon), no GPU, load average 1.5 when recorded |" in meta
    assert "| commit | `8b336a4ca97a` |" in meta
    assert "python 3.11.7, vllm 0.31.0" in meta
    assert "`python bench/x.py --out bench/results/x.json`" in meta
    assert results.meta("x.json", "hardware") == "2 cores, no GPU"
    for field in ("date", "machine", "commit", "versions", "command", "hardware"):
        assert results.meta("bare.json", field) == NOT_RECORDED
    with pytest.raises(ValueError, match="one of date"):
        results.meta("x.json", "weather")


def test_a_missing_or_broken_file_is_an_error_never_a_blank(results: Results, tmp_path: Path):
    with pytest.raises(BenchFileError, match=r"nothing\.json does not exist"):
        results.value("nothing.json", "modes")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(BenchFileError, match="not JSON"):
        results.table("broken.json", "modes", [["mode", "_key"]])
    with pytest.raises(BenchFileError, match="not a file under"):
        results.value("../x.json", "modes")


def test_the_record_a_benchmark_writes_is_what_the_page_reads(tmp_path: Path):
    (tmp_path / "now.json").write_text(json.dumps({RECORD_KEY: run_record(["bench/x.py", "--fast"])}))
    results = Results(tmp_path)
    assert results.meta("now.json", "command") == "`python bench/x.py --fast`"
    for field in ("date", "machine", "versions", "commit"):  # this test runs in the project's git checkout
        assert results.meta("now.json", field) != NOT_RECORDED, field
    assert "python" in results.meta("now.json", "versions")


_MISSING_SENTINEL = lookup({}, ["absent"])
keys = st.text(st.characters(codec="ascii", exclude_characters="."), min_size=1, max_size=6)
leaves = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.none(), st.booleans())
trees = st.recursive(leaves, lambda inner: st.one_of(st.dictionaries(keys, inner, max_size=4),
                                                     st.lists(inner, max_size=4)), max_leaves=12)


def _paths(tree, prefix=()):
    yield prefix, tree
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, child in items:
        yield from _paths(child, (*prefix, str(key)))


@given(trees)
def test_every_path_into_a_result_finds_its_value(tree):
    for path, value in _paths(tree):
        assert lookup(tree, list(path)) is value
        if path:
            assert lookup(tree, ".".join(path)) is value


@given(trees, keys)
def test_a_step_past_what_a_result_holds_renders_not_recorded(tree, key):
    for path, value in _paths(tree):
        absent = (str(len(value)) if isinstance(value, list) else
                  key + "~" if isinstance(value, dict) else key)
        if isinstance(value, dict) and absent in value:
            continue
        assert lookup(tree, [*path, absent]) is _MISSING_SENTINEL
        assert format_value(lookup(tree, [*path, absent]), "{:.2f}", 1000) == NOT_RECORDED


# --- the real build: mkdocs + mkdocs-macros, configured as mkdocs.yml configures them ---------------------------

PAGE = """# Example

{{ bench_meta("x.json") }}

Affinity served {{ bench_value("x.json", "modes.affinity.rps", "{:,.0f}") }} requests/s,
{{ bench_ratio("x.json", "modes.affinity.rps", "modes.round_robin.rps") }} round robin's;
least_loaded: {{ bench_value("x.json", "modes.least_loaded.rps") }}.

{{ bench_table("x.json", "runs", [["run", "run"], ["share", "share", "{:.0%}"]]) }}
"""


def _build(tmp_path: Path, page: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "x.json").write_text(json.dumps(RESULT))
    (tmp_path / "docs" / "index.md").write_text(page)
    config = {"site_name": "t", "docs_dir": "docs", "strict": True, "theme": {"name": "mkdocs"},
              "markdown_extensions": ["tables"],
              "plugins": [{"macros": {"modules": ["lorafleet_ops.docsite.macros"], "on_error_fail": True,
                                      "on_undefined": "strict"}}]}
    (tmp_path / "mkdocs.yml").write_text(json.dumps(config))  # JSON is YAML
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(tmp_path / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)


def test_a_page_renders_its_figures_from_the_json_at_build_time(tmp_path: Path):
    built = _build(tmp_path, PAGE)
    assert built.returncode == 0, built.stderr
    html = (tmp_path / "site" / "index.html").read_text()
    assert "Affinity served 3,946 requests/s" in html and "3.29x round robin" in html
    assert f"least_loaded: {NOT_RECORDED}." in html
    assert "<td>2026-12-04 22:40 UTC</td>" in html and "<td>50%</td>" in html


def test_a_page_naming_a_missing_json_fails_the_build(tmp_path: Path):
    built = _build(tmp_path, PAGE + '\n{{ bench_value("gone.json", "modes") }}\n')
    assert built.returncode != 0
    assert "gone.json does not exist" in built.stderr + built.stdout


def test_a_page_asks_whether_a_result_exists_before_naming_it(results: Results, tmp_path: Path):
    assert results.exists("x.json")
    assert not results.exists("bench-gpu-sync.json")
    with pytest.raises(BenchFileError, match="not a file under"):
        results.exists("../x.json")


def test_the_gpu_driver_shows_beside_the_cards():
    machine = {"cores": 16, "gpus": ["NVIDIA H100 80GB HBM3"], "gpu_driver": "580.65.06"}
    assert machine_text(machine) == "16 cores, 1 x NVIDIA H100 80GB HBM3, NVIDIA driver 580.65.06"


GUARDED = """# GPU

{% if bench_exists("x.json") %}Measured: {{ bench_value("x.json", "modes.affinity.rps", "{:,.0f}") }}.
{% else %}Not yet measured.{% endif %}
{% if bench_exists("gone.json") %}{{ bench_value("gone.json", "modes") }}{% else %}gone: not yet measured.{% endif %}
"""


def test_a_guarded_page_builds_with_and_without_its_json(tmp_path: Path):
    built = _build(tmp_path, GUARDED)
    assert built.returncode == 0, built.stderr
    html = (tmp_path / "site" / "index.html").read_text()
    assert "Measured: 3,946." in html and "gone: not yet measured." in html
