"""The fork server TRL's rollout child comes from: the child's imports done in it, stop signals blocked in the child,
and nothing outliving its trainer.

A stand-in trainer (a real Python process) starts the server and a child from it, as `train()` and TRL do; the
tests read /proc, signal and kill. The server imports torch, transformers and TRL, so one start serves the module
until a test kills it; the next test then gets a new one, in whatever order the tests run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from lorafleet_testing.pids import running

pytestmark = pytest.mark.timeout(300)  # the server's imports are slow on a loaded box

TRAINER = textwrap.dedent("""
    import time
    from multiprocessing import forkserver
    from lorafleet_trainer import rollout_server
    from lorafleet_trainer.rollout_server import ShieldedContext

    rollout_server.start()
    child = ShieldedContext().Process(target=time.sleep, args=(3600,), daemon=True)
    child.start()  # once the server has imported the child's modules
    print(forkserver._forkserver._forkserver_pid, child.pid, flush=True)
    time.sleep(3600)
""")


def blocked(pid: int) -> set[signal.Signals]:
    """The stop signals `pid` has blocked."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return {sig for sig in (signal.SIGINT, signal.SIGTERM) if mask & (1 << (sig - 1))}


class StandInTrainers:
    """The module's stand-in trainers: the running one serves every test, a killed one is replaced."""

    def __init__(self) -> None:
        self.started: list[tuple[subprocess.Popen[str], int, int]] = []

    def current(self) -> tuple[subprocess.Popen[str], int, int]:
        """(a running stand-in trainer, its fork server's pid, its rollout child's pid)."""
        if not self.started or self.started[-1][0].poll() is not None:
            process = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True,
                                       start_new_session=True)
            server, child = (int(pid) for pid in process.stdout.readline().split())
            self.started.append((process, server, child))
        return self.started[-1]

    def kill_all(self) -> None:
        for process, _, _ in self.started:
            with contextlib.suppress(ProcessLookupError):  # a killed trainer's group may be gone already
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def trainers() -> Iterator[StandInTrainers]:
    started = StandInTrainers()
    try:
        yield started
    finally:
        started.kill_all()


@pytest.fixture
def trainer(trainers: StandInTrainers) -> tuple[subprocess.Popen[str], int, int]:
    """(a running stand-in trainer, its fork server's pid, its rollout child's pid)."""
    return trainers.current()


def test_the_server_has_the_childs_modules_before_any_child_asks(trainer):
    _, server, child = trainer
    for pid in (server, child):
        assert "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text(), f"pid {pid} has not imported torch"
    assert f"PPid:\t{server}\n" in Path(f"/proc/{child}/status").read_text()  # forked from the server


def test_the_child_ignores_stop_signals_and_the_trainer_keeps_its_own(trainer):
    process, server, child = trainer
    assert blocked(server) == blocked(child) == {signal.SIGINT, signal.SIGTERM}
    assert not blocked(process.pid)  # the trainer's mask is restored once the server started
    os.kill(child, signal.SIGTERM)
    os.kill(child, signal.SIGINT)
    time.sleep(0.5)
    assert running(child)


def test_the_server_and_the_child_die_with_a_killed_trainer(trainer):
    process, server, child = trainer
    assert running(server) and running(child)
    os.kill(process.pid, signal.SIGKILL)  # the trainer alone, not its group: the kernel must end the rest
    process.wait()
    deadline = time.monotonic() + 240
    while (running(server) or running(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(server), "the fork server outlived its trainer"
    assert not running(child), "the rollout child outlived its trainer"
