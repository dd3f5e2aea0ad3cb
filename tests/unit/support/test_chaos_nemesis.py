"""The nemesis's parts on their own: the seeded fault stream (scaling included), the cuttable relay (real TCP),
Compose's restart policies (real processes), the run folder's tmpfs filled to the trainer's threshold (root only)."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
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
from lorafleet_ops.processes import Service
from lorafleet_testing.chaos import disk
from lorafleet_testing.chaos.nemesis import HELD, KINDS, fault_stream
from lorafleet_testing.chaos.relay import Relay
from lorafleet_testing.chaos.supervisor import ON_FAILURE, UNLESS_STOPPED, Supervised, Supervisor

REPLICA_KINDS = ("sigkill", "sigstop", "partition", "scale")
TARGETS = {"replica-0": REPLICA_KINDS, "replica-1": REPLICA_KINDS, "replica-2": REPLICA_KINDS,
           "proxy": ("sigkill", "sigstop"), "trainer-a": ("sigkill", "disk_full")}


@given(seed=st.integers(0, 2**32), count=st.integers(1, 80))
def test_a_seed_alone_decides_the_fault_stream(seed: int, count: int) -> None:
    first = list(itertools.islice(fault_stream(seed, TARGETS, 5.0, 4.0, ["replica-2"]), count))
    assert first == list(itertools.islice(fault_stream(seed, TARGETS, 5.0, 4.0, ["replica-2"]), count))
    assert [fault.at_step for fault in first] == sorted(fault.at_step for fault in first)
    for fault in first:
        assert fault.kind in TARGETS[fault.target] and fault.kind in KINDS
        assert (fault.hold_s > 0) == (fault.kind in HELD) and fault.hold_s <= 4.0
        assert (fault.action != "") == (fault.kind == "scale")


@given(seed=st.integers(0, 2**32), count=st.integers(1, 120))
def test_scaling_keeps_a_replica_and_strikes_none_that_is_gone(seed: int, count: int) -> None:
    """A removed replica suffers nothing until it is added back; one added was gone; one always stays."""
    gone = {"replica-2"}
    for fault in itertools.islice(fault_stream(seed, TARGETS, 5.0, 4.0, gone), count):
        if fault.action == "up":
            assert fault.target in gone
            gone.discard(fault.target)
        else:
            assert fault.target not in gone
        if fault.action == "down":
            gone.add(fault.target)
        assert len(gone) < 3


def test_scaling_needs_two_replica_slots() -> None:
    with pytest.raises(ValueError, match="2 replica slots"):
        next(fault_stream(1, {"replica-0": REPLICA_KINDS, "proxy": ("sigkill",)}, 5.0, 4.0))


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


def test_a_trainer_stopped_short_for_low_disk_restarts_once_the_disk_is_freed(tmp_path: Path) -> None:
    """Exit 0 is done, unless the start stopped short (its disk full): then it restarts when no longer held."""
    marker = tmp_path / "second-start"
    trainer = Supervised(_service(tmp_path, "trainer", (
        f"import pathlib; p = pathlib.Path({str(marker)!r})\n"
        "if p.exists(): raise SystemExit(0)\np.touch()")).start(), ON_FAILURE,
        held=True, short=lambda: not marker.with_name("done").exists())
    supervisor = Supervisor([trainer]).start()
    try:
        _until(lambda: trainer.exits == [0])
        time.sleep(1.5)  # past the restart delay: held, so not restarted
        assert trainer.restarts == 0 and not trainer.finished
        trainer.held = False
        _until(lambda: trainer.restarts == 1 and trainer.exits == [0, 0])
        marker.with_name("done").touch()
        _until(lambda: trainer.finished)
    finally:
        supervisor.halt()
        trainer.stop()


def test_a_scaled_down_service_stays_down_until_resumed(tmp_path: Path) -> None:
    replica = Supervised(_service(tmp_path, "replica", "import time; time.sleep(60)").start(), UNLESS_STOPPED)
    supervisor = Supervisor([replica]).start()
    try:
        replica.stop()
        time.sleep(1.5)
        assert not replica.service.alive and replica.restarts == 0
        replica.resume()
        assert replica.service.alive
        replica.service.kill()
        _until(lambda: replica.restarts == 1 and replica.service.alive)
    finally:
        supervisor.halt()
        replica.stop()


@pytest.mark.skipif(disk.unavailable(Path("/tmp")) is not None, reason="mounting a tmpfs needs root")
def test_a_fill_crosses_the_trainers_threshold_and_the_files_outlive_the_mount(tmp_path: Path) -> None:
    run = disk.RunDisk(tmp_path / "run", logging.getLogger("test")).mount()
    try:
        (run.folder / "prompts.jsonl").write_text("{}\n")
        assert shutil.disk_usage(run.folder).free > run.threshold_gb * disk.GB
        run.fill()
        free = shutil.disk_usage(run.folder).free
        assert 0 < free < run.threshold_gb * disk.GB
        run.heal()
        assert shutil.disk_usage(run.folder).free > run.threshold_gb * disk.GB
    finally:
        run.unmount()
    assert (tmp_path / "run" / "prompts.jsonl").read_text() == "{}\n"
    assert not (tmp_path / "run" / disk.FILL).exists()
