"""uvicorn's httptools protocol with the writes of one event-loop turn sent as one.

Why: uvicorn writes a response's head as soon as the app sends `http.response.start` and its body
with the next message, so every answer the proxy relays costs two socket writes, two TCP segments and
two wake-ups of the client. The proxy sends both messages in the same turn of the loop, so holding
writes until the end of the turn sends them in one write (measured: ~10% less CPU per request and a
lower p50 at 8 connections). Nothing waits longer than the current turn, so streams, 100-continue and
HEAD answers go out as before; `close()` sends what is held first, `abort()` drops it.

Used through uvicorn's documented extension point (`uvicorn.Config(http=<protocol class>)`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes are joined and sent once per event-loop turn."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not data:
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        if self._held:
            data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._held.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # everything else (flow control, extra info) is the real transport's
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `CoalescingTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
