"""Run identity: run names, qualified adapter names (round trip), run URLs, and the ledger's version-3 format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.adapters import ADAPTER_NAME_PATTERN
from lorafleet.ledger_format import Entry, LedgerFileError, LedgerState, RunRecord, parse, serialize
from lorafleet.runs import DEFAULT_RUN, RunNameError, check_run_name, fleet_url, qualify, run_of, run_url, url_run

RUN = st.from_regex(r"\A[A-Za-z0-9]{1,8}(?:[._-][A-Za-z0-9]{1,6}){0,3}\Z").filter(lambda run: run != DEFAULT_RUN)
NAME = st.from_regex(r"\A[A-Za-z0-9](?:[A-Za-z0-9._]|-(?!-)){0,60}\Z").filter(lambda name: "--" not in name)


@given(run=RUN, name=NAME)
def test_a_qualified_name_splits_back_into_its_run_and_name_and_is_a_valid_adapter_name(run: str, name: str) -> None:
    assert run_of(qualify(run, name)) == (run, name)
    assert ADAPTER_NAME_PATTERN.fullmatch(qualify(run, name))
    assert qualify(DEFAULT_RUN, name) == name and run_of(name) == (DEFAULT_RUN, name)


@pytest.mark.parametrize("bad", ["", "a--b", "-a", "a-", "a b", "x" * 33, "a/b", "a..b"])
def test_run_names_that_would_make_qualified_names_ambiguous_are_refused(bad: str) -> None:
    with pytest.raises(RunNameError):
        check_run_name(bad)


def test_run_urls() -> None:
    assert url_run("http://proxy:8000/runs/lr-sweep.1") == "lr-sweep.1"
    assert url_run("http://proxy:8000/runs/b/") == "b" and url_run("http://proxy:8000") == DEFAULT_RUN
    assert fleet_url("http://proxy:8000/runs/b") == "http://proxy:8000" == fleet_url("http://proxy:8000/")
    assert run_url("http://proxy:8000/", "b") == "http://proxy:8000/runs/b"
    assert url_run(run_url("http://proxy:8000", "b")) == "b" and fleet_url(run_url("http://p:1", "b")) == "http://p:1"
    with pytest.raises(RunNameError):
        run_url("http://proxy:8000", "a--b")
    with pytest.raises(RunNameError):
        url_run("http://proxy:8000/runs/a--b")


def test_ledger_v4_keeps_runs_each_entrys_run_its_store_folder_and_source(tmp_path: Path) -> None:
    store = tmp_path / ".content"
    state = LedgerState(paused=None, runs={"b": RunRecord(1, 2.0, "wait")})
    state.adapters["trl-policy-v1"] = Entry(str(store / "01"), "sha256:01", source=str(tmp_path / "d"))
    state.adapters["b--trl-policy-v1"] = Entry(str(store / "02"), "sha256:02", "b", str(tmp_path / "runs" / "b" / "v1"))
    payload = json.loads(serialize(state))
    assert payload["version"] == 4 and payload["runs"] == {"b": {"max_staleness": 1, "weight": 2.0, "paused": "wait"}}
    assert [(e["name"], e["run"], e["source"]) for e in payload["adapters"]] == [
        ("trl-policy-v1", "default", str(tmp_path / "d")), ("b--trl-policy-v1", "b", str(tmp_path / "runs/b/v1"))]
    restored = parse(serialize(state), tmp_path)
    assert restored.same_as(state) and restored.dropped == []


def test_a_v4_entry_that_is_not_its_contents_store_folder_is_dropped(tmp_path: Path) -> None:
    """The store folder is named by the content: another path, or another folder's name, is refused when read."""
    text = json.dumps({"version": 4, "runs": {}, "adapters": [
        {"name": "ok", "path": str(tmp_path / ".content" / "0a"), "fingerprint": "sha256:0a", "source": ""},
        {"name": "run-folder", "path": str(tmp_path / "runs" / "x"), "fingerprint": "sha256:0b", "source": ""},
        {"name": "other-name", "path": str(tmp_path / ".content" / "0c"), "fingerprint": "sha256:0d", "source": ""},
        {"name": "unknown", "path": str(tmp_path / ".content" / "0e"), "fingerprint": "", "source": ""}]})
    state = parse(text, tmp_path)
    assert list(state.adapters) == ["ok"] and len(state.dropped) == 3
    assert all("is not the content store's folder of fingerprint" in why for why in state.dropped)


@pytest.mark.parametrize("runs", ['{"a--b": {"max_staleness": 1}}', '{"b": {"max_staleness": -1}}',
                                  '{"b": {"max_staleness": 1, "weight": 0}}', '{"b": {"max_staleness": 1, '
                                  '"paused": "maybe"}}', '[]'])
def test_an_unusable_runs_section_makes_the_ledger_unusable(tmp_path: Path, runs: str) -> None:
    with pytest.raises(LedgerFileError):
        parse(f'{{"version": 3, "runs": {runs}, "adapters": []}}', tmp_path)


def test_an_entry_whose_run_does_not_own_its_name_is_dropped(tmp_path: Path) -> None:
    text = json.dumps({"version": 3, "runs": {}, "adapters": [
        {"name": "a--x", "run": "b", "path": str(tmp_path / "x"), "fingerprint": ""},
        {"name": "a--y", "run": "a", "path": str(tmp_path / "runs" / "a" / "y"), "fingerprint": ""}]})
    state = parse(text, tmp_path)
    assert list(state.adapters) == ["a--y"] and state.adapters["a--y"].run == "a" and len(state.dropped) == 1
