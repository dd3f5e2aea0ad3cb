"""write_result (lorafleet_ops.docsite.record): the one way every benchmark writes and prints its JSON. A non-finite
float becomes null through the encoding, never by rewriting the text (a key or a string holding "NaN" stays as it
was); what JSON has no type for is written as its text; folders are made; the printed summary is what was asked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet_ops.docsite.record import RECORD_KEY, run_record, write_result

pytestmark = pytest.mark.timeout(120)

keys = st.text(max_size=6)
leaves = st.one_of(st.integers(), st.floats(), st.text(max_size=8), st.none(), st.booleans())
trees = st.recursive(leaves, lambda inner: st.one_of(st.dictionaries(keys, inner, max_size=4),
                                                     st.lists(inner, max_size=4)), max_leaves=16)


def _expected(value):
    """`value` as the file must read back: every non-finite float None, the rest untouched."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _expected(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_expected(item) for item in value]
    return value


@given(st.dictionaries(keys, trees, max_size=5))
def test_what_is_written_reads_back_with_non_finite_floats_as_null(tmp_path_factory, result):
    out = tmp_path_factory.mktemp("w") / "r.json"
    write_result(out, result)
    text = out.read_text()
    assert text.endswith("\n")
    assert json.loads(text) == _expected(result)  # strict JSON: no NaN, Infinity or -Infinity literal parsed back


def test_a_nan_in_a_key_or_a_string_is_kept_and_the_floats_become_null(tmp_path: Path, capsys):
    result = {"NaN": "NaN-shaped text", "ratio": float("nan"), "distance": [float("inf"), -math.inf, 0.5]}
    out = tmp_path / "deep" / "er" / "r.json"  # folders that do not exist yet
    write_result(out, result)
    assert json.loads(out.read_text()) == {"NaN": "NaN-shaped text", "ratio": None, "distance": [None, None, 0.5]}
    assert capsys.readouterr().out == f"written: {out}\n"


def test_a_path_or_a_tuple_is_written_as_json_has_it(tmp_path: Path):
    write_result(tmp_path / "r.json", {"model": tmp_path / "tiny", "shape": (2, 3), 7: "seven"})
    assert json.loads((tmp_path / "r.json").read_text()) == {"model": str(tmp_path / "tiny"), "shape": [2, 3],
                                                             "7": "seven"}


def test_the_summary_asked_for_is_printed_before_the_path(tmp_path: Path, capsys):
    result = {RECORD_KEY: run_record(["bench/x.py"]), "summary": {"p50_s": float("nan"), "rps": 12.5}}
    write_result(tmp_path / "r.json", result, shown=result["summary"])
    printed = capsys.readouterr().out
    summary, written = printed.rsplit("written: ", 1)
    assert json.loads(summary) == {"p50_s": None, "rps": 12.5}
    assert written == f"{tmp_path / 'r.json'}\n"
    assert json.loads((tmp_path / "r.json").read_text())[RECORD_KEY]["command"] == "python bench/x.py"
