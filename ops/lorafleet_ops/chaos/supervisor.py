"""Restarts the chaos run's services the way compose.yaml does: replicas and the proxy `unless-stopped`, trainers
`on-failure` (a trainer that exits 0 has finished, or was stopped cleanly, and stays down).

One thread polls every service; a process found exited is started again (same command, same port) after
RESTART_DELAY_S, like Compose's first restart. Each start's exit code is kept: a trainer's last one is what the
checker judges.
"""

from __future__ import annotations

import threading
import time
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
    stopped: bool = False  # stopped by the harness: never restarted

    @property
    def finished(self) -> bool:
        """Exited 0 under `on-failure`: not restarted, done."""
        return self.policy == ON_FAILURE and not self.service.alive and self.exits[-1:] == [0]

    def kill(self) -> None:
        """SIGKILL the group; the supervisor notes the exit and restarts it."""
        self.service.kill()

    def stop(self) -> None:
        self.stopped = True
        self.service.stop()


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
                if each.stopped or process is None or process.poll() is None:
                    continue
                if index not in exited_at:
                    exited_at[index] = time.monotonic()
                    each.exits.append(process.returncode)
                if each.finished or time.monotonic() - exited_at[index] < RESTART_DELAY_S:
                    continue
                del exited_at[index]
                each.restarts += 1
                each.service.start()
