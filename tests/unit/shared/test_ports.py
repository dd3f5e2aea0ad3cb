"""lorafleet.ports.free_port: a launcher that asks for several ports before it starts any server gets distinct ones,
whatever range the host's kernel hands out (the GPU host's canary-noise run got one port for two replicas)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from lorafleet import ports

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("ephemeral", ["32768\t60999\n", "1024\t65535\n", None], ids=["linux default",
                                                                                     "starts low", "unreadable"])
def test_ports_asked_for_before_any_server_binds_are_distinct_and_free(
        ephemeral: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    if ephemeral is not None:
        range_file.write_text(ephemeral)
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", range_file)
    handed = [ports.free_port() for _ in range(64)]  # nothing binds any of them in between
    assert len(set(handed)) == len(handed), sorted(handed)
    for port in handed:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # each still free


def test_a_port_the_os_keeps_offering_is_handed_out_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the OS's pick repeats (bind to 0 can give the same port twice while nothing holds it), the second ask
    gets another port or a clear error, never the first port again."""
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "missing")
    first = ports.free_port()

    class Repeating(socket.socket):
        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", first)

    monkeypatch.setattr(ports.socket, "socket", Repeating)
    with pytest.raises(OSError, match="handed out"):
        ports.free_port()
