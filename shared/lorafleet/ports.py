"""A free TCP port for a server this process is about to start: the trainer's ranks (their rendezvous) and every
local process launcher (the demo, the test tiers) take theirs from here."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # below it: well-known and registered services' ports


_HANDED_OUT: set[int] = set()  # every port this process has returned: none is returned twice


def free_port() -> int:
    """A TCP port nothing is bound to right now and that this process has not handed out before, below the kernel's
    ephemeral range where it can tell.

    A port the OS picks (bind to 0) comes from the range outgoing connections take their local ports from, so
    between this check and the server's own bind a client connection can take it ("address already in use"; seen
    under the test suite's load). Ports below that range are only ever taken by an explicit bind. A launcher asks
    for several ports before it starts any server (replicas that share a GPU start one after the other): a port
    that is free now is free at the next call too, so without the record two replicas could be handed one port and
    the second's health check would be answered by the first (seen on a GPU host whose ephemeral range starts low).
    """
    with contextlib.suppress(OSError, ValueError):
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
        for port in random.sample(range(LOWEST_PORT, low), min(200, low - LOWEST_PORT)):
            if port not in _HANDED_OUT and _bindable(port):
                return _hand_out(port)
    for _ in range(200):  # no such range here (not Linux), or all of it taken: the OS picks
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            return _hand_out(port)
    raise OSError("no free TCP port that this process has not handed out already")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _hand_out(port: int) -> int:
    _HANDED_OUT.add(port)
    return port
