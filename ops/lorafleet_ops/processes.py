"""Run lorafleet services as plain local processes: the demo and the integration and GPU process tiers.

The same console scripts the containers run (`lorafleet-replica`, `lorafleet-proxy`,
`lorafleet-train`) are started with an explicit environment, each in its own process group so
that stopping one stops vLLM's engine processes too, with its output in a log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from lorafleet.ports import free_port


def rss_mib(pid: int) -> float:
    """Resident memory of a process now (Linux /proc), in MiB to one decimal: what the benchmarks sample."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"process {pid} reports no VmRSS")


def script(name: str) -> str:
    """Path of a console script installed next to this interpreter (the venv need not be on PATH)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


@dataclass
class Service:
    """One started process: its name, command, environment and log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    url: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Service:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash or `docker kill` would."""
        self.signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait(timeout=30)

    def group_gone(self, timeout_s: float = 15.0) -> bool:
        """True once no process of its group is left (a trainer's rollout child included), waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after `grace_s`."""
        if self.process is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.kill()
        # vLLM's engine processes share the group; make sure none outlives the API server.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def wait_healthy(services: Iterable[Service], timeout_s: float = 240.0, path: str = "/health") -> None:
    """Poll `<url><path>` of every service until all answer 200; fail fast when one dies."""
    pending = list(services)
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while pending:
            for service in list(pending):
                if not service.alive:
                    raise RuntimeError(f"{service.name} exited before becoming healthy:\n{service.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(service.url + path).status_code == 200:
                        pending.remove(service)
            if pending and time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise TimeoutError(f"not healthy after {timeout_s:.0f}s: {names}\n{pending[0].log_tail()}")
            if pending:
                time.sleep(0.5)


def start_in_waves(services: Sequence[Service], wave: int, timeout_s: float = 240.0) -> None:
    """Start `services` `wave` at a time, each wave healthy before the next starts (replicas sharing a GPU:
    lorafleet_ops.placement's `wave`); the caller stops them, started or not, when this raises."""
    for first in range(0, len(services), max(1, wave)):
        batch = services[first:first + max(1, wave)]
        for service in batch:
            service.start()
        wait_healthy(batch, timeout_s=timeout_s)


def replica_service(name: str, env: Mapping[str, str], log_dir: Path, port: int | None = None) -> Service:
    """A `lorafleet-replica` on 127.0.0.1:`port` with the given settings environment: CPU mode unless `env` says
    REPLICA_DEVICE=gpu (lorafleet_ops.placement's replica_env)."""
    port = port or free_port()
    full_env = {**os.environ, "REPLICA_DEVICE": "cpu", "REPLICA_HOST": "127.0.0.1", **env,
                "REPLICA_PORT": str(port)}
    return Service(name, [script("lorafleet-replica")], full_env, log_dir / f"{name}.log", f"http://127.0.0.1:{port}")


def proxy_service(name: str, env: Mapping[str, str], log_dir: Path, port: int | None = None) -> Service:
    """A `lorafleet-proxy` whose fleet port is 127.0.0.1:`port`."""
    port = port or free_port()
    loopback = {"PROXY_FLEET_HOST": "127.0.0.1", "PROXY_PUBLIC_HOST": "127.0.0.1"}
    full_env = {**os.environ, **loopback, **env, "PROXY_PORT": str(port)}
    return Service(name, [script("lorafleet-proxy")], full_env, log_dir / f"{name}.log", f"http://127.0.0.1:{port}")


def trainer_service(name: str, env: Mapping[str, str], log_dir: Path) -> Service:
    """A `lorafleet-train` run; its settings (recipe, model, proxy URL, steps) come from `env`."""
    full_env = {**os.environ, **env}
    return Service(name, [script("lorafleet-train")], full_env, log_dir / f"{name}.log")
