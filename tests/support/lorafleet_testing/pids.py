"""Whether a process the test started, or one its process started, still runs (Linux /proc)."""

from __future__ import annotations

from pathlib import Path


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (dead, its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command name, which may hold ")"
