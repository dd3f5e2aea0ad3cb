"""The fork server TRL's rollout child comes from: the child's imports done in it, and nothing outliving its trainer.

A stand-in trainer (a real Python process) starts the server and a child from it; the test reads /proc and kills.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)  # the server imports torch, transformers and TRL: slow on a loaded box

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


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def trainer():
    process = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        server, child = (int(pid) for pid in process.stdout.readline().split())
        yield process, server, child
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def test_the_server_has_the_childs_modules_before_any_child_asks(trainer):
    _, server, child = trainer
    for pid in (server, child):
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch_cpu" in maps, f"pid {pid} has not imported torch"
    assert Path(f"/proc/{child}/status").read_text().count("PPid:\t" + str(server)) == 1  # forked from the server


def test_the_server_and_the_child_die_with_a_killed_trainer(trainer):
    process, server, child = trainer
    assert alive(server) and alive(child)
    os.kill(process.pid, signal.SIGKILL)  # the trainer alone, not its group: the kernel must end the rest
    process.wait()
    deadline = time.monotonic() + 240
    while (alive(server) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(server), "the fork server outlived its trainer"
    assert not alive(child), "the rollout child outlived its trainer"
