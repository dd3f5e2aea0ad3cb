"""A free TCP port for a server this process is about to start: the trainer's ranks (their rendezvous) and every
local process launcher (the demo, the test tiers) take theirs from here."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # below it: well-known and registered services' ports


def free_port() -> int:
    """A TCP port nothing is bound to right now, below the kernel's ephemeral range where it can tell.

    A port the OS picks (bind to 0) comes from the range outgoing connections take their local ports from, so
    between this check and the server's own bind a client connection can take it ("address already in use"; seen
    under the test suite's load). Ports below that range are only ever taken by an explicit bind.
    """
    with contextlib.suppress(OSError, ValueError):
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
        for port in random.sample(range(LOWEST_PORT, low), min(200, low - LOWEST_PORT)):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:  # no such range here (not Linux), or all of it taken: the OS picks
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
