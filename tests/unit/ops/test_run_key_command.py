"""`lorafleet run-key NAME`: the key shown once (or written 0600 for its trainer), only its hash kept, an existing
key never replaced by accident, clear exits naming what is wrong; and it runs on the standard library alone, as
`make train RUN=b` runs it on a host without lorafleet installed."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from lorafleet.run_key_store import KEY_PREFIX, digest, read_keys
from lorafleet_ops.commands.cli import main

SHARED = Path(__file__).resolve().parents[3] / "shared"
OPS = SHARED.parent / "ops"


def test_the_key_is_printed_once_and_only_its_hash_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    assert main(["run-key", "b", "--dir", str(tmp_path)]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith(KEY_PREFIX) and len(key) > 40
    assert read_keys(tmp_path) == {"b": digest(key)}
    assert key not in (tmp_path / "b").read_text()
    assert main(["run-key", "b", "--dir", str(tmp_path)]) == 2  # kept: a second trainer cannot lock the first out
    assert "already has a key" in capsys.readouterr().err and read_keys(tmp_path) == {"b": digest(key)}
    assert main(["run-key", "b", "--dir", str(tmp_path), "--rotate"]) == 0
    rotated = capsys.readouterr().out.strip()
    assert rotated != key and read_keys(tmp_path) == {"b": digest(rotated)}


def test_a_key_file_is_private_and_the_key_is_not_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) \
        -> None:
    key_file = tmp_path / "keys" / "b.key"
    assert main(["run-key", "b", "--dir", str(tmp_path / "hashes"), "--key-file", str(key_file)]) == 0
    key = key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert key not in capsys.readouterr().out
    assert read_keys(tmp_path / "hashes") == {"b": digest(key)}


@pytest.mark.parametrize(("argv", "message"), [
    (["run-key", "b"], "RUN_KEYS_DIR: not set"),
    (["run-key", "bad--name", "--dir", "."], "invalid run name"),
    (["run-key", "default", "--dir", "."], "the default run has no key"),
    (["run-key", "run1", "--dir", "."], "'run1' is the fleet's RUN_NAME, the default run's folder runs/run1/"),
    (["run-key", "b", "--dir", ".", "--run-name", "b"], "'b' is the fleet's RUN_NAME"),
    (["run-key", "b", "--dir", ".", "--run-name", "b", "--rotate"], "'b' is the fleet's RUN_NAME"),
])
def test_bad_input_exits_2_naming_it_and_writes_nothing(argv: list[str], message: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RUN_KEYS_DIR", raising=False)
    monkeypatch.delenv("RUN_NAME", raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_no_key_is_named_for_the_fleets_run_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A key named like RUN_NAME would let a named run load from the default run's folder: refused, whether RUN_NAME
    comes from the environment or from the stack's .env through make (which passes it as --run-name)."""
    monkeypatch.setenv("RUN_NAME", "b")
    assert main(["run-key", "b", "--dir", str(tmp_path)]) == 2 and not (tmp_path / "b").exists()
    assert "RUN_NAME" in capsys.readouterr().err
    assert main(["run-key", "run1", "--dir", str(tmp_path)]) == 0 and (tmp_path / "run1").exists()
    for target in ("train", "run-key"):
        dry = subprocess.run(["make", "-n", target, "RUN=c", "CPU=1"], cwd=SHARED.parent, capture_output=True,
                             text=True, timeout=30, check=True, env={**os.environ, "RUN_NAME": "stack"}).stdout
        assert "-m lorafleet_ops.commands.run_key c --dir run-keys/hashes" in dry and "--run-name stack" in dry, dry


def test_it_runs_on_the_standard_library_alone(tmp_path: Path) -> None:
    """`python -S` (no site-packages), only shared/ and ops/ on the path: no pydantic, no installed lorafleet (what
    `make train` has)."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{SHARED}:{OPS}", "RUN_KEYS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-S", "-m", "lorafleet_ops.commands.run_key", "b"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert read_keys(tmp_path) == {"b": digest(done.stdout.strip())}
