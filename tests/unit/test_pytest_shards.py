"""tools/pytest_shards.sh runs one pytest command as side-by-side processes (`make integration`): every test runs in
exactly one shard, a module's tests stay together, the exit status is the suite's, and a bad shard count is refused
naming the setting. Real pytest and pytest-split on a throwaway suite."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "pytest_shards.sh"
MODULES = {"test_a.py": 3, "test_b.py": 2, "test_c.py": 4}


def write_suite(folder: Path, failing: str | None = None, sleep_s: float = 0) -> Path:
    """Three modules whose tests log their node id and their process, `failing` (a node id) failing, each test
    sleeping `sleep_s` after it logged."""
    folder.mkdir()
    (folder / "conftest.py").write_text(
        "import os, time\n"
        "def pytest_runtest_call(item):\n"
        f"    with open({str(folder / 'ran.log')!r}, 'a') as log:\n"
        "        log.write(f'{item.nodeid} {os.getpid()}\\n')\n"
        f"    time.sleep({sleep_s})\n")
    for module, count in MODULES.items():
        body = [f"def test_{i}():\n    assert {f'{module}::test_{i}' != failing}\n" for i in range(count)]
        (folder / module).write_text("\n".join(body))
    return folder


def shards_command(count: str, suite: Path, tmp_path: Path, *extra: str) -> tuple[list[str], dict[str, str]]:
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({f"{module}::test_{i}": 1.0 for module, n in MODULES.items() for i in range(n)}))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_split.plugin",
               "--rootdir", str(suite), str(suite), *extra]
    # Only pytest-split among the venv's plugins: each shard starts in a second, not ten (schemathesis, hypothesis).
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return ["bash", str(SCRIPT), count, str(durations), str(tmp_path / "logs"), "--", *command], env


def shards(count: str, suite: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command, env = shards_command(count, suite, tmp_path, *extra)
    return subprocess.run(command, cwd=suite, env=env, capture_output=True, text=True, timeout=120)


def ran(suite: Path) -> list[tuple[str, str]]:
    log = suite / "ran.log"
    return [tuple(line.split()) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("count", ["1", "2", "3"])
def test_every_test_runs_once_and_a_module_stays_in_one_process(tmp_path: Path, count: str) -> None:
    suite = write_suite(tmp_path / "suite")
    done = shards(count, suite, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    records = ran(suite)
    assert sorted(node for node, _ in records) == sorted(f"{m}::test_{i}" for m, n in MODULES.items() for i in range(n))
    processes = {module: {pid for node, pid in records if node.startswith(module)} for module in MODULES}
    assert len({pid for _, pid in records}) == int(count)
    # Contiguous chunks of equal time: with 9 tests a module is cut at most at a chunk's edge, never scattered.
    assert sum(len(pids) for pids in processes.values()) <= len(MODULES) + int(count) - 1, processes
    if count != "1":
        assert "integration shard 2 of" in done.stdout and (tmp_path / "logs" / "shard-2.log").is_file()


@pytest.mark.parametrize("failing", ["test_a.py::test_0", "test_c.py::test_3"])
def test_a_failure_in_any_shard_fails_the_run_and_its_report_is_printed(tmp_path: Path, failing: str) -> None:
    suite = write_suite(tmp_path / "suite", failing=failing)
    done = shards("2", suite, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(rf"FAILED {re.escape(failing)}", done.stdout), done.stdout
    assert len(ran(suite)) == sum(MODULES.values())  # the other shard ran on to its end


def test_a_shard_left_without_tests_is_not_a_failure_but_no_tests_at_all_is(tmp_path: Path) -> None:
    suite = write_suite(tmp_path / "suite")
    one_test = shards("2", suite, tmp_path, "-k", "test_a and test_0")
    assert one_test.returncode == 0, one_test.stdout + one_test.stderr
    assert [node for node, _ in ran(suite)] == ["test_a.py::test_0"]
    none = shards("2", suite, tmp_path, "-k", "no_such_test")
    assert none.returncode == 5, none.stdout + none.stderr


@pytest.mark.parametrize("count", ["0", "two", "", "-1"])
def test_a_bad_shard_count_is_refused_naming_the_setting(tmp_path: Path, count: str) -> None:
    suite = write_suite(tmp_path / "suite")
    done = shards(count, suite, tmp_path)
    assert done.returncode == 2
    assert "INTEGRATION_SHARDS" in done.stderr and not (suite / "ran.log").exists()


@pytest.mark.timeout(300)
def test_ctrl_c_reaches_every_shard_and_the_runner_waits_for_them(tmp_path: Path) -> None:
    """A terminal's Ctrl-C (SIGINT to the process group) ends every shard, the background ones too (a script's
    background jobs start with it ignored), and the runner returns only when they are gone. The shards' tests sleep
    far longer than the runner is given to exit (a loaded CI box once needed more than 30 s), so only the signal can
    end them in time."""
    suite = write_suite(tmp_path / "suite", sleep_s=3600)
    command, env = shards_command("2", suite, tmp_path)
    # As from a terminal: SIGINT at its default in the runner, whatever this pytest inherited (run from a script's
    # background it has SIGINT ignored, and bash cannot trap a signal ignored when it started).
    runner = subprocess.Popen(command, cwd=suite, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len({pid for _, pid in ran(suite)}) < 2:
        time.sleep(0.1)
    pids = {int(pid) for _, pid in ran(suite)}
    assert len(pids) == 2  # both shards are in a test
    os.killpg(runner.pid, signal.SIGINT)
    try:
        assert runner.wait(timeout=180) == 130
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
