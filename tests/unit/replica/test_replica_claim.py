"""Device claims with real processes: exclusive, held across exec, freed by the kernel on death (issue 4)."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Claim a device, then exec `sleep` the way the entrypoint execs vLLM: the lock must survive the exec.
CLAIMANT = """
import os, sys
from pathlib import Path
from lorafleet_vllm.claim import NoFreeDevice, claim_device
try:
    claim = claim_device(sys.argv[2].split(","), Path(sys.argv[1]), kind="gpu", pool_variable="VLLM_GPUS",
                         shares=int(sys.argv[3]))
except NoFreeDevice as exc:
    print("BUSY", exc, flush=True)
    sys.exit(3)
print("CLAIMED", claim.device, flush=True)
os.execv("/bin/sleep", ["sleep", "120"])
"""

POOL = "2,3,4,5"


def _claimant(lock_dir: Path, pool: str = POOL, shares: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLAIMANT, str(lock_dir), pool, str(shares)],
                            stdout=subprocess.PIPE, text=True)


LINE_TIMEOUT_S = 30.0  # a claimant answers in well under a second; a hung one must fail the test, not stall it


def _first_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], LINE_TIMEOUT_S)
    assert ready, f"the claimant printed no line within {LINE_TIMEOUT_S:.0f}s"
    return process.stdout.readline().strip()


@pytest.fixture
def processes():
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_six_claimants_for_four_devices(tmp_path: Path, processes):
    processes.extend(_claimant(tmp_path) for _ in range(6))
    lines = [_first_line(process) for process in processes]
    claimed = sorted(line.split()[1] for line in lines if line.startswith("CLAIMED"))
    busy = [line for line in lines if line.startswith("BUSY")]
    assert claimed == ["2", "3", "4", "5"]
    assert len(busy) == 2
    assert all("VLLM_GPUS has 4 device(s)" in line and "4 running replica(s)" in line for line in busy)
    losers = [p for p, line in zip(processes, lines, strict=True) if line.startswith("BUSY")]
    assert all(p.wait(timeout=30) == 3 for p in losers)

    # The winners have exec'd into `sleep` and still hold their devices.
    holder = next(p for p, line in zip(processes, lines, strict=True) if line == "CLAIMED 4")
    assert holder.poll() is None
    late = _claimant(tmp_path)
    processes.append(late)
    assert _first_line(late).startswith("BUSY")

    # A holder killed (SIGKILL, no clean-up code runs) frees exactly its device.
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 10
    while True:
        retry = _claimant(tmp_path)
        processes.append(retry)
        line = _first_line(retry)
        if line.startswith("CLAIMED") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert line == "CLAIMED 4"


def test_a_shared_pool_fills_every_device_before_sharing_one(tmp_path: Path, processes):
    """VLLM_CPU_SETS=auto: two cores, up to two replicas each; the third and fourth share, the fifth is refused,
    and a dead sharer frees its share only."""
    processes.extend(_claimant(tmp_path, "0,1", shares=2) for _ in range(2))
    first = sorted(_first_line(process) for process in processes)
    assert first == ["CLAIMED 0", "CLAIMED 1"], "each core gets a replica before any is shared"
    processes.extend(_claimant(tmp_path, "0,1", shares=2) for _ in range(2))
    sharers = [_first_line(process) for process in processes[2:]]
    assert sorted(sharers) == ["CLAIMED 0", "CLAIMED 1"]
    refused = _claimant(tmp_path, "0,1", shares=2)
    processes.append(refused)
    line = _first_line(refused)
    assert line.startswith("BUSY") and "each shared by up to 2 replicas" in line and "4 running replica(s)" in line
    processes[3].kill()
    processes[3].wait()
    deadline = time.monotonic() + 10
    while True:
        retry = _claimant(tmp_path, "0,1", shares=2)
        processes.append(retry)
        line = _first_line(retry)
        if line.startswith("CLAIMED") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert line == sharers[1], f"the dead sharer held {sharers[1]}; the retry got {line}"
