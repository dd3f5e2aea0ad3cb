"""Where the replicas are: a static URL list, or every address a DNS name resolves to (Compose, k8s)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


async def resolve(target: str) -> list[str]:
    """`host:port` -> one `http://address:port` per address, sorted. Raises OSError when resolution fails."""
    host, _, port = target.rpartition(":")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    return sorted({_url(str(info[4][0]), int(port)) for info in infos})
