"""Restarts the chaos run's services the way compose.yaml does: replicas and the proxy `unless-stopped`, trainers
`on-failure` (a trainer that exits 0 has finished, or was stopped cleanly, and stays down).

One thread polls every service; a process found exited is started again (same command, same port) after
RESTART_DELAY_S, like Compose's first restart. Each start's exit code is kept: a trainer's last one is what the
checker judges. A trainer that exits 0 having stopped short of its steps for a reason an operator mends (`short`:
its disk was full) is started again once the nemesis no longer `held` its disk full, as that operator would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lorafleet_ops.processes import Service

UNLESS_STOPPED = "unless-stopped"
ON_FAILURE = "on-failure"
RESTART_DELAY_S = 1.0
POLL_S = 0.25


@dataclass
class Supervised:
    service: Service
    policy: str
    exits: list[int] = field(default_factory=list)
    restarts: int = 0
    stopped: bool = False  # stopped by the harness (or scaled away): never restarted
    held: bool = False  # the nemesis holds what stopped it short (a full disk): not restarted yet
    short: Callable[[], bool] = field(default=lambda: False, repr=False)  # its exit 0 stopped short of its work
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # a restart against a stop or resume

    @property
    def finished(self) -> bool:
        """Exited 0 under `on-failure`, and not short of its work: not restarted, done."""
        return (self.policy == ON_FAILURE and not self.service.alive and self.exits[-1:] == [0]
                and not self.short())

    def kill(self) -> None:
        """SIGKILL the group; the supervisor notes the exit and restarts it."""
        self.service.kill()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
        self.service.stop()

    def resume(self) -> None:
        """Start a stopped service again (a replica scaled back up); the supervisor restarts it from then on."""
        with self.lock:
            self.service.start()
            self.stopped = False


class Supervisor:
    def __init__(self, services: list[Supervised]) -> None:
        self.services = services
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def halt(self) -> None:
        self._halt.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        exited_at: dict[int, float] = {}
        while not self._halt.wait(POLL_S):
            for index, each in enumerate(self.services):
                process = each.service.process
                if each.stopped:
                    exited_at.pop(index, None)
                    continue
                if process is None or process.poll() is None:
                    continue
                if index not in exited_at:
                    exited_at[index] = time.monotonic()
                    each.exits.append(process.returncode)
                waiting = each.held and each.exits[-1:] == [0]
                if each.finished or waiting or time.monotonic() - exited_at[index] < RESTART_DELAY_S:
                    continue
                del exited_at[index]
                with each.lock:
                    if each.stopped:
                        continue
                    each.restarts += 1
                    each.service.start()
