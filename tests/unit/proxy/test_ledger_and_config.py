"""The persisted adapter ledger and the proxy's configuration errors."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import pytest
from lorafleet.ledger_format import Entry, fingerprint, read
from lorafleet_proxy import main as proxy_main
from lorafleet_proxy.ledger import Ledger, LedgerWriteError, ledger_path
from lorafleet_testing.fakes import weights_file
from test_membership import publish, stored


def _put(ledger: Ledger, name: str, path: str) -> None:
    state = ledger.state()
    state.adapters.pop(name, None)
    state.adapters[name] = Entry(path)
    ledger.commit(state)


def _migrated(root: Path, source: Path, run: str = "default") -> Entry:
    """What restoring an older ledger makes of an entry at `source`: its files copied into the content store."""
    digest = fingerprint(source)
    return Entry(str(root / ".content" / digest.removeprefix("sha256:")), digest, run, str(source))


def test_ledger_round_trip_keeps_load_order_fingerprints_and_pause(tmp_path: Path) -> None:
    ledger = Ledger(ledger_path(tmp_path), tmp_path)
    a, b, c = (stored(tmp_path, name, name.encode()) for name in ("a-v1", "b-v1", "c-v1"))
    state = ledger.state()
    for name, one in (("trl-policy-v2", b), ("trl-policy-v1", a), ("trl-policy-v3", c)):
        state.adapters[name] = Entry(one.path, one.fingerprint, source=str(tmp_path / "runs" / name))
    del state.adapters["trl-policy-v2"]
    state.paused = "keep"
    ledger.commit(state)
    payload = json.loads((tmp_path / ".fleet" / "proxy-ledger.json").read_text())
    assert payload == {"version": 4, "paused": "keep", "runs": {}, "adapters": [
        {"name": name, "run": "default", "path": one.path, "fingerprint": one.fingerprint,
         "source": str(tmp_path / "runs" / name)} for name, one in (("trl-policy-v1", a), ("trl-policy-v3", c))]}
    assert [p.name for p in (tmp_path / ".fleet").iterdir()] == ["proxy-ledger.json"], "temporary file left behind"
    restored = Ledger(ledger_path(tmp_path), tmp_path)
    restored.restore()
    assert restored.entries() == ledger.entries() and restored.paused == "keep"


def test_restore_drops_entries_outside_the_root_or_badly_named(tmp_path: Path) -> None:
    ok = publish(tmp_path / "ok", b"weights")
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 1, "adapters": [
        {"name": "ok-v1", "path": str(ok)},
        {"name": "escape-v1", "path": "/etc"},
        {"name": "../bad", "path": str(tmp_path / "bad")},
    ]}))
    ledger = Ledger(path, tmp_path)
    ledger.restore()
    assert ledger.entries() == {"ok-v1": _migrated(tmp_path, ok)}
    assert ledger.paused is None and not ledger.rebuilding


def test_restore_drops_a_named_runs_entry_outside_its_own_folder(tmp_path: Path) -> None:
    """A named run loads only from runs/<run>/: an entry of run b that names run a's folder, the default run's, a
    sibling `bb`, or a symlink in b's folder into a's is dropped, saying why; b's own and the default run's stay."""
    for folder in ("a/.vllm_lora/v1", "b/.vllm_lora/v1", "bb/v1", "run1/v1"):
        publish(tmp_path / "runs" / folder, folder.encode())
    (tmp_path / "runs" / "b" / "link").symlink_to(tmp_path / "runs" / "a" / ".vllm_lora" / "v1")
    runs = tmp_path / "runs"
    kept = {"b--own": (runs / "b" / ".vllm_lora" / "v1", "b"), "default-v1": (runs / "a" / ".vllm_lora" / "v1",
                                                                               "default")}
    refused = {"b--other-run": runs / "a" / ".vllm_lora" / "v1", "b--default-run": runs / "run1" / "v1",
               "b--sibling": runs / "bb" / "v1", "b--symlink": runs / "b" / "link",
               "b--dotdot": runs / "b" / ".." / "a"}
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 3, "paused": None, "runs": {"b": {"max_staleness": 1}}, "adapters": [
        *({"name": name, "run": run, "path": str(where), "fingerprint": ""} for name, (where, run) in kept.items()),
        *({"name": name, "run": "b", "path": str(where), "fingerprint": ""} for name, where in refused.items())]}))
    ledger = Ledger(path, tmp_path)
    ledger.restore()
    assert ledger.entries() == {name: _migrated(tmp_path, where, run) for name, (where, run) in kept.items()}
    assert not ledger.rebuilding
    migrated = read(path, tmp_path)  # written back as version 4, without what was dropped
    assert migrated is not None and migrated.dropped == [] and migrated.adapters == ledger.entries()


def test_a_version_3_ledger_names_what_was_dropped(tmp_path: Path) -> None:
    """Reading a version-3 file (the doctor's view) drops an entry of run b outside b's folder, saying why."""
    publish(tmp_path / "runs" / "a" / "v1", b"a")
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": 3, "paused": None, "runs": {"b": {"max_staleness": 1}}, "adapters": [
        {"name": "b--other-run", "run": "b", "path": str(tmp_path / "runs" / "a" / "v1"), "fingerprint": ""}]}))
    state = read(path, tmp_path)
    assert state is not None and state.adapters == {}
    assert len(state.dropped) == 1 and f"outside its folder {tmp_path / 'runs' / 'b'}/" in state.dropped[0]


@pytest.mark.parametrize("content", ["{not json", '{"version": 9, "adapters": []}', '{"version": 2, "adapters": {}}',
                                     '{"version": 2, "paused": "maybe", "adapters": []}', "[]"])
def test_unusable_ledger_is_rebuilt_not_taken_for_empty(tmp_path: Path, content: str) -> None:
    path = ledger_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    ledger = Ledger(path, tmp_path)
    ledger.restore()
    assert ledger.rebuilding and ledger.unreadable_reason


def test_commit_is_durable_and_a_failed_write_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    ledger = Ledger(ledger_path(tmp_path), tmp_path)
    _put(ledger, "a-v1", str(tmp_path / "a"))
    assert len(synced) == 2, "the file and its directory must both be fsynced"

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(LedgerWriteError, match="No space left on device"):
        _put(ledger, "b-v1", str(tmp_path / "b"))
    assert list(ledger.entries()) == ["a-v1"], "memory changed although the write failed"
    assert [p.name for p in (tmp_path / ".fleet").iterdir()] == ["proxy-ledger.json"]


def test_fingerprint_follows_config_and_weights_only(tmp_path: Path) -> None:
    adapter = tmp_path / "v1"
    assert fingerprint(adapter) == "", "an invisible adapter has no fingerprint"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(weights_file(b"weights-1"))
    first = fingerprint(adapter)
    (adapter / "README.md").write_text("docs do not count")
    assert fingerprint(adapter) == first and first.startswith("sha256:")
    (adapter / "adapter_model.safetensors").write_bytes(weights_file(b"weights-2"))
    assert fingerprint(adapter) != first


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


def test_the_mmap_threshold_is_pinned_where_the_c_library_is_glibc() -> None:
    """main.py pins glibc's mmap threshold at start (it says why); the CI's and the images' C library is glibc."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: the proxy only warns")
    assert proxy_main.fix_mmap_threshold() is True
