"""Claim one device from a pool with an exclusive lock file, held for the life of the process.

`docker compose up --scale vllm=N` starts N identical containers and Compose cannot give each
its own GPU (docker/compose#11863). Every replica sees the whole pool and takes the first device
whose lock it can get. A pool may allow sharing (`shares` > 1, CPU core sets chosen
automatically): once every device has a holder, the next replica takes a second lock on the first
device, and so on. `flock` locks belong to the open file, so:
- the lock survives `exec` into vLLM (the descriptor is made inheritable) and is shared with the
  engine processes vLLM forks, which also hold the device;
- the kernel drops it when the last of those processes exits, even on SIGKILL or a container
  crash, so a restart or scale-down frees the device with no clean-up step.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path


class NoFreeDevice(RuntimeError):
    """Every device of the pool is claimed by a running replica."""


@dataclass(frozen=True)
class Claim:
    device: str
    lock_path: Path
    fd: int


def _lock_name(kind: str, device: str) -> str:
    return f"{kind}-{device.replace(',', '_')}.lock"


def claim_device(pool: list[str], lock_dir: Path, *, kind: str, pool_variable: str, shares: int = 1) -> Claim:
    """Lock the first free device of `pool` under `lock_dir` and return the claim (fd stays open).

    `kind` ("gpu" or "cpu") namespaces the lock files; `pool_variable` names the setting in errors; `shares` is
    how many replicas may hold one device (1: exclusive).
    """
    lock_dir.mkdir(parents=True, exist_ok=True)
    holders: list[str] = []
    for share, device in ((share, device) for share in range(shares) for device in pool):
        path = lock_dir / (_lock_name(kind, device) + (f".{share}" if share else ""))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders.append(f"{device} ({_read_holder(fd) or 'unknown holder'})")
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode())
        os.set_inheritable(fd, True)
        return Claim(device=device, lock_path=path, fd=fd)
    shared = f", each shared by up to {shares} replicas," if shares > 1 else ""
    raise NoFreeDevice(
        f"no free {kind.upper()} for this replica: {pool_variable} has {len(pool)} device(s){shared} "
        f"({', '.join(pool)}) and {len(holders)} running replica(s) hold them: {'; '.join(holders)}. "
        f"Add devices to {pool_variable} or run fewer replicas."
    )


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
