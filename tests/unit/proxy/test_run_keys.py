"""Per-run keys (runs/key_check.py, lorafleet.run_key_store): the check of one request, and the directory of digests.

The check is a pure function of the request's Authorization header and the stored digests, so hypothesis drives it
with any header at all: only the run's own key is admitted; anything else is 401, another run's key 403.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lorafleet.run_key_store import RunKeyError, digest, provision, read_key_file, read_keys
from lorafleet.settings import ConfigError
from lorafleet_proxy.auth import PUBLIC_PORT_SCOPE_KEY
from lorafleet_proxy.runs import RunKeyRefused, RunKeys, key_check


def scope(authorization: bytes | None, public: bool = False) -> dict[str, object]:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return {"type": "http", "headers": headers, **({PUBLIC_PORT_SCOPE_KEY: True} if public else {})}


@pytest.fixture
def keyed(tmp_path: Path) -> tuple[RunKeys, dict[str, str]]:
    directory = tmp_path / "keys"
    minted = {run: provision(directory, run) for run in ("a", "b")}
    return RunKeys(str(directory)), minted


def refusal(keys: RunKeys, run: str, authorization: bytes | None, public: bool = False) -> int | None:
    try:
        keys.check(scope(authorization, public), run)
    except RunKeyRefused as exc:
        return exc.status
    return None


def test_only_the_runs_own_key_is_admitted(keyed: tuple[RunKeys, dict[str, str]]) -> None:
    keys, minted = keyed
    assert refusal(keys, "a", f"Bearer {minted['a']}".encode()) is None
    assert refusal(keys, "a", f"bearer  {minted['a']} ".encode()) is None  # the scheme is case-insensitive
    assert refusal(keys, "a", None) == 401
    assert refusal(keys, "a", b"Bearer ") == 401
    assert refusal(keys, "a", f"Basic {minted['a']}".encode()) == 401
    assert refusal(keys, "a", f"Bearer {minted['b']}".encode()) == 403  # another run's key
    assert refusal(keys, "c", f"Bearer {minted['a']}".encode()) == 403  # a run without a key, with another's
    assert refusal(keys, "c", b"Bearer whatever") == 401


def test_refusals_say_what_is_missing(keyed: tuple[RunKeys, dict[str, str]]) -> None:
    keys, minted = keyed
    with pytest.raises(RunKeyRefused, match=r"run 'a' needs its run key: 'Authorization: Bearer <key>'"):
        keys.check(scope(None), "a")
    with pytest.raises(RunKeyRefused, match="another run's, not run 'a'") as forbidden:
        keys.check(scope(f"Bearer {minted['b']}".encode()), "a")
    assert forbidden.value.error_type == "Forbidden"
    with pytest.raises(RunKeyRefused, match="`lorafleet run-key c` makes one") as unknown:
        keys.check(scope(b"Bearer x"), "c")
    assert unknown.value.error_type == "Unauthorized"
    with pytest.raises(RunKeyRefused, match="invalid run key for run 'a'"):
        keys.check(scope(b"Bearer x"), "a")


def bearer_of(header: bytes | None) -> bytes | None:
    """The key a header presents as docs/guides/runs.md#run-keys describes it: `Bearer <key>`, any case of scheme."""
    if header is None or header[:7].lower() != b"bearer ":
        return None
    return header[7:].strip() or None


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=st.one_of(st.none(), st.binary(max_size=80), st.text(max_size=80).map(lambda t: t.encode()),
                        st.tuples(st.sampled_from(["Bearer ", "bearer ", "BEARER  ", "Bearer\t"]),
                                  st.sampled_from(["a", "b"]), st.sampled_from(["", " ", "x"]))),
       run=st.sampled_from(["a", "b", "c"]), public=st.booleans())
def test_any_header_is_admitted_exactly_when_it_is_the_runs_key_or_the_public_port(
        keyed: tuple[RunKeys, dict[str, str]], header: bytes | tuple[str, str, str] | None, run: str,
        public: bool) -> None:
    keys, minted = keyed
    if isinstance(header, tuple):  # a real key of run a or b, perhaps padded or spoiled
        scheme, owner, tail = header
        header = f"{scheme}{minted[owner]}{tail}".encode()
    status = refusal(keys, run, header, public)
    presented = bearer_of(header)
    if public or (run in minted and presented == minted[run].encode()):
        assert status is None
    elif presented in {key.encode() for name, key in minted.items() if name != run}:
        assert status == 403
    else:
        assert status == 401


def test_without_a_directory_nothing_is_checked() -> None:
    keys = RunKeys("")
    assert not keys.enabled and refusal(keys, "a", None) is None


def test_a_key_made_later_is_taken_and_a_directory_turned_bad_keeps_the_last_good_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "keys"
    directory.mkdir()
    keys = RunKeys(str(directory))
    monkeypatch.setattr(key_check, "RELOAD_S", 0.0)
    new = provision(directory, "c")
    assert refusal(keys, "c", f"Bearer {new}".encode()) is None
    (directory / "junk").write_text("not a digest")
    assert refusal(keys, "c", f"Bearer {new}".encode()) is None  # the last good keys
    (directory / "junk").unlink()
    rotated = provision(directory, "c", rotate=True)
    time.sleep(0.01)
    assert refusal(keys, "c", f"Bearer {new}".encode()) == 401
    assert refusal(keys, "c", f"Bearer {rotated}".encode()) is None


def test_the_directory_holds_only_digests_and_bad_entries_are_named(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    key = provision(directory, "run.b_1")
    assert read_keys(directory) == {"run.b_1": digest(key)}
    assert key not in (directory / "run.b_1").read_text()
    (directory / "..data").mkdir()  # a Kubernetes Secret volume's own entries are skipped
    (directory / ".swp").write_text("x")
    assert list(read_keys(directory)) == ["run.b_1"]
    with pytest.raises(RunKeyError, match="already has a key"):
        provision(directory, "run.b_1")
    assert read_keys(directory) == {"run.b_1": digest(key)}  # kept
    for name, content, message in [("bad--name", digest("k"), "not a run name"), ("default", digest("k"), "default"),
                                   ("c", "sha256:xyz", "expected one line")]:
        (directory / name).write_text(content)
        with pytest.raises(RunKeyError, match=message):
            read_keys(directory)
        (directory / name).unlink()
    with pytest.raises(RunKeyError, match="cannot read the run-keys directory"):
        read_keys(tmp_path / "missing")


def test_a_bad_directory_stops_the_proxy_naming_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="RUN_KEYS_DIR: cannot read the run-keys directory"):
        RunKeys(str(tmp_path / "missing"))


def test_the_trainers_key_file(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text("lfr_abc\n")
    assert read_key_file(str(path)) == "lfr_abc" and read_key_file("") == ""
    for content in ("", "two words"):
        path.write_text(content)
        with pytest.raises(ConfigError, match=r"TRAINER_RUN_KEY_FILE: .* must hold one run key"):
            read_key_file(str(path))
    with pytest.raises(ConfigError, match="TRAINER_RUN_KEY_FILE: cannot read"):
        read_key_file(str(tmp_path / "missing"))
