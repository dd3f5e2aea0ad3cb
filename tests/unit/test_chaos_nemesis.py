"""The nemesis's parts on their own: the seeded fault stream, the cuttable relay (real TCP), Compose's restart
policies (real processes)."""

from __future__ import annotations

import itertools
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet_ops.chaos.nemesis import KINDS, fault_stream
from lorafleet_ops.chaos.relay import Relay
from lorafleet_ops.chaos.supervisor import ON_FAILURE, UNLESS_STOPPED, Supervised, Supervisor
from lorafleet_ops.processes import Service

TARGETS = {"replica-0": KINDS, "proxy": ("sigkill", "sigstop"), "trainer-a": ("sigkill",)}


@given(seed=st.integers(0, 2**32), count=st.integers(1, 50))
def test_a_seed_alone_decides_the_fault_stream(seed: int, count: int) -> None:
    first = list(itertools.islice(fault_stream(seed, TARGETS, 5.0, 4.0), count))
    assert first == list(itertools.islice(fault_stream(seed, TARGETS, 5.0, 4.0), count))
    assert [fault.at_step for fault in first] == sorted(fault.at_step for fault in first)
    for fault in first:
        assert fault.kind in TARGETS[fault.target]
        assert (fault.hold_s == 0) == (fault.kind == "sigkill") and fault.hold_s <= 4.0


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(1024):
            self.request.sendall(data)


@pytest.fixture
def relay() -> Iterator[Relay]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = Relay(server.server_address[1]).start()
    yield relay
    relay.close()
    server.shutdown()


def _echo(port: int, payload: bytes = b"hello") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
        conn.sendall(payload)
        return conn.recv(1024)


def _reset(conn: socket.socket) -> bool:
    """The open connection was cut under its user: reset, or closed."""
    try:
        return conn.recv(16) == b""
    except ConnectionResetError:
        return True


def test_the_relay_relays_until_cut_then_holds_connections_unanswered_until_healed(relay: Relay) -> None:
    assert _echo(relay.port) == b"hello"
    open_before = socket.create_connection(("127.0.0.1", relay.port), timeout=2)
    open_before.sendall(b"x")
    assert open_before.recv(16) == b"x"
    relay.cut()
    assert _reset(open_before)
    with pytest.raises(TimeoutError), socket.create_connection(("127.0.0.1", relay.port), timeout=0.5) as held:
        held.sendall(b"z")  # a black hole: accepted, never answered
        held.recv(16)
    relay.heal()
    assert _echo(relay.port, b"again") == b"again"


def _service(tmp_path: Path, name: str, code: str) -> Service:
    return Service(name, [sys.executable, "-c", code], dict(os.environ), tmp_path / f"{name}.log")


def _until(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_restarts_follow_compose_policies(tmp_path: Path) -> None:
    """A trainer (on-failure) restarts after a kill and stays down once it exits 0; a replica (unless-stopped)
    restarts whatever its exit, until the harness stops it."""
    marker = tmp_path / "second-start"
    trainer = Supervised(_service(tmp_path, "trainer", (
        f"import pathlib, time; p = pathlib.Path({str(marker)!r})\n"
        "if p.exists(): raise SystemExit(0)\np.touch(); time.sleep(60)")).start(), ON_FAILURE)
    replica = Supervised(_service(tmp_path, "replica", "raise SystemExit(0)").start(), UNLESS_STOPPED)
    supervisor = Supervisor([trainer, replica]).start()
    try:
        _until(marker.exists)
        trainer.kill()
        _until(lambda: trainer.finished)
        _until(lambda: replica.restarts >= 2)
    finally:
        supervisor.halt()
        replica.stop()
        trainer.stop()
    assert trainer.exits == [-9, 0] and trainer.restarts == 1
    assert set(replica.exits) == {0}
