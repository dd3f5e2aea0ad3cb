"""The persisted adapter ledger and the proxy's configuration errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lorafleet_proxy import main as proxy_main
from lorafleet_proxy.ledger import Ledger, ledger_path


def test_ledger_round_trip_keeps_load_order(tmp_path: Path) -> None:
    ledger = Ledger(ledger_path(tmp_path), tmp_path)
    ledger.put("trl-policy-v2", str(tmp_path / "b"))
    ledger.put("trl-policy-v1", str(tmp_path / "a"))
    ledger.remove("trl-policy-v2")
    ledger.put("trl-policy-v3", str(tmp_path / "c"))
    payload = json.loads((tmp_path / ".fleet" / "proxy-ledger.json").read_text())
    assert payload == {"version": 1, "adapters": [{"name": "trl-policy-v1", "path": str(tmp_path / "a")},
                                                  {"name": "trl-policy-v3", "path": str(tmp_path / "c")}]}
    assert [p.name for p in (tmp_path / ".fleet").iterdir()] == ["proxy-ledger.json"], "temporary file left behind"
    restored = Ledger(ledger_path(tmp_path), tmp_path)
    restored.restore()
    assert restored.entries() == ledger.entries()


def test_restore_drops_entries_outside_the_root_or_badly_named(tmp_path: Path) -> None:
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "adapters": [
        {"name": "ok-v1", "path": str(tmp_path / "ok")},
        {"name": "escape-v1", "path": "/etc"},
        {"name": "../bad", "path": str(tmp_path / "bad")},
    ]}))
    ledger = Ledger(path, tmp_path)
    ledger.restore()
    assert ledger.entries() == {"ok-v1": str(tmp_path / "ok")}


def test_corrupt_ledger_starts_empty(tmp_path: Path) -> None:
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    ledger = Ledger(path, tmp_path)
    ledger.restore()
    assert len(ledger) == 0


@pytest.mark.parametrize(("env", "named"), [
    ({}, "PROXY_UPSTREAMS / PROXY_UPSTREAM_DNS"),
    ({"PROXY_UPSTREAMS": "not-a-url"}, "PROXY_UPSTREAMS"),
    ({"PROXY_UPSTREAM_DNS": "vllm"}, "PROXY_UPSTREAM_DNS"),
    ({"PROXY_UPSTREAMS": "http://a:1", "PROXY_API_KEY": "k", "PROXY_PUBLIC_PORT": "8000"}, "PROXY_PUBLIC_PORT"),
])
def test_bad_configuration_exits_non_zero_naming_the_variable(
    env: dict[str, str], named: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # no .env
    for key in ("PROXY_UPSTREAMS", "PROXY_UPSTREAM_DNS", "PROXY_API_KEY", "PROXY_PUBLIC_PORT", "PROXY_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        proxy_main.main()
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
