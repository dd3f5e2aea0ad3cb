"""What Linux's /proc says of a process the test started, or one its process started: whether it still runs, and
which processes of a group catch a signal."""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path


def _after_name(stat: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name, which may hold ")": state, ppid, pgrp, ..."""
    return stat.read_text().rsplit(")", 1)[1].split()


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (dead, its parent has not reaped it yet)."""
    try:
        return _after_name(Path(f"/proc/{pid}/stat"))[0] != "Z"
    except FileNotFoundError:
        return False


def catching(group: int, sig: signal.Signals) -> list[int]:
    """The processes of process group `group` with a handler for `sig` (bit sig - 1 of SigCgt in /proc/PID/status)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, StopIteration):  # a process that ended meanwhile
            if int(_after_name(stat)[2]) != group:
                continue
            status = (stat.parent / "status").read_text().splitlines()
            caught = int(next(line.split()[1] for line in status if line.startswith("SigCgt:")), 16)
            if caught >> (sig - 1) & 1:
                found.append(int(stat.parent.name))
    return found
