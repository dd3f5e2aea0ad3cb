"""The proxy's HTTP protocol (lorafleet_proxy.server_protocol): one event-loop turn's writes go out as one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from lorafleet.ports import free_port
from lorafleet_proxy.server_protocol import CoalescingHttpToolsProtocol, CoalescingTransport


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def test_writes_of_one_turn_are_joined_and_sent_at_its_end() -> None:
    real = RecordingTransport()
    transport = CoalescingTransport(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.write(b"")
    transport.write(b"body")
    assert real.writes == []
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    transport.write(b"chunk")  # the next turn's write is its own
    await asyncio.sleep(0)
    assert real.writes[1:] == [b"chunk"]
    assert transport.get_extra_info("peername") == "info:peername"


async def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    loop = asyncio.get_running_loop()
    closing, aborting = RecordingTransport(), RecordingTransport()
    first, second = CoalescingTransport(closing, loop), CoalescingTransport(aborting, loop)  # type: ignore[arg-type]
    first.write(b"last words")
    first.close()
    second.write(b"never sent")
    second.abort()
    await asyncio.sleep(0)
    assert closing.writes == [b"last words"] and closing.closed
    assert aborting.writes == [] and aborting.aborted


async def test_a_real_server_answers_streams_and_heads_on_the_protocol() -> None:
    app = FastAPI()

    @app.get("/plain")
    async def plain() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            for index in range(3):
                yield f"part{index};".encode()
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks())

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           http=CoalescingHttpToolsProtocol))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            for _ in range(3):  # keep-alive: several answers on one connection
                assert (await http.get("/plain")).json() == {"ok": "yes"}
            assert (await http.get("/stream")).content == b"part0;part1;part2;"
            head = await http.head("/plain")
            assert head.status_code == 405 and head.content == b""
    finally:
        server.should_exit = True
        await task
