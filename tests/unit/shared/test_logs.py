"""lorafleet.logs: a service configured by it answers SIGUSR1 with every thread's stack in its log, and goes on."""

from __future__ import annotations

import signal
import subprocess
import sys

WAITS = """
import sys, threading, time
from lorafleet.logs import configure
configure("trainer")
threading.Thread(target=lambda: time.sleep(60), name="waiter", daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_sigusr1_writes_every_threads_stack_and_the_process_goes_on() -> None:
    process = subprocess.Popen([sys.executable, "-c", WAITS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGUSR1)
        dump: list[str] = []
        while sum("(most recent call first)" in line for line in dump) < 2:  # the main thread and the waiter
            line = process.stderr.readline()
            assert line, f"the process ended or wrote no stacks: {dump}"
            dump.append(line)
        assert process.poll() is None, "SIGUSR1 stopped the process"
        assert any('File "<string>"' in line for line in dump), dump  # where the threads wait
    finally:
        process.kill()
        process.communicate(timeout=30)
