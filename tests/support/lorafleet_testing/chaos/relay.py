"""A TCP relay between the proxy and one replica that the nemesis can cut: a network partition without root.

The proxy's PROXY_UPSTREAMS name the relays, not the replicas. Cut, the relay resets every open connection and
holds new ones unanswered (a black hole: the proxy's connects succeed and then time out, as across a partition);
healed, it closes what it held and relays again. It runs its own event loop on a thread of the harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from lorafleet.ports import free_port

CHUNK = 1 << 16


class Relay:
    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target_port = target_port
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{self.port}", daemon=True)
        self._open: set[asyncio.StreamWriter] = set()
        self._held: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._server: asyncio.Server | None = None

    def start(self) -> Relay:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def cut(self) -> None:
        self._call(self._set_cut, True)

    def heal(self) -> None:
        self._call(self._set_cut, False)

    def close(self) -> None:
        self._call(self._set_cut, True)
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _call(self, function: Callable[..., None], *args: object) -> None:
        async def run() -> None:
            function(*args)

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=10)

    def _set_cut(self, cut: bool) -> None:
        self._cut = cut
        doomed = self._open if cut else self._held
        for writer in list(doomed):
            writer.transport.abort()
        doomed.clear()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            self._held.add(writer)  # unanswered until healed
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()  # the replica is down: refused, as it would be without the relay
            return
        self._open.update((writer, upstream_writer))
        try:
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for each in (writer, upstream_writer):
                self._open.discard(each)
                each.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(OSError, RuntimeError):
        writer.write_eof()
