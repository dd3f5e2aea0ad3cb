"""The proxy's upstream client (lorafleet_proxy.upstream) against scripted servers on real sockets.

Every framing vLLM's server can use (content-length, chunked, until-close), every split of the answer
into TCP reads, a connection cut at every byte of an answer, timeouts, keep-alive reuse and expiry,
backpressure, and giving an answer up half-way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lorafleet.ports import free_port
from lorafleet_proxy.upstream import (
    ConnectRefused,
    ConnectTimeout,
    Disconnected,
    Pool,
    ReadTimeout,
)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class Scripted:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One whole request (head and content-length body), or b"" once the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return b""
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[Scripted]:
    """A server that runs `script` on every connection it accepts."""
    state = Scripted("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await script(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    state.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        server.close()


def answering(*answers: bytes, record: Scripted | None = None, close: bool = False) -> Script:
    """Answer each request on a connection with the next of `answers` (the last one repeats)."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = 0
        while request := await read_request(reader):
            if record is not None:
                record.requests.append(request)
            writer.write(answers[min(index, len(answers) - 1)])
            await writer.drain()
            index += 1
            if close:
                return

    return script


def pool(url: str, **kwargs: float) -> Pool:
    options = {"connect_timeout_s": 2.0, "read_timeout_s": 2.0, "keepalive_s": 2.0} | kwargs
    return Pool(url, {"content-type": "application/json", "authorization": "Bearer k"},
                ("content-type", "x-request-id"), **options)


def framed(body: bytes, framing: str, cuts: list[int]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-request-id: r1\r\nserver: x\r\n"
    if framing == "length":
        return head + b"content-length: %d\r\n\r\n" % len(body) + body
    if framing == "close":
        return head + b"connection: close\r\n\r\n" + body
    chunks, start = [], 0
    for cut in [*sorted({min(cut, len(body)) for cut in cuts}), len(body)]:
        if cut > start:
            chunks.append(b"%x\r\n%s\r\n" % (cut - start, body[start:cut]))
            start = cut
    return head + b"transfer-encoding: chunked\r\n\r\n" + b"".join(chunks) + b"0\r\n\r\n"


bodies = st.binary(max_size=3000)
framings = st.sampled_from(["length", "chunked", "close"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, framing=framings, cuts=st.lists(st.integers(0, 3000), max_size=6),
       writes=st.lists(st.integers(1, 4000), max_size=6))
async def test_any_framing_and_any_split_reads_the_whole_body(body: bytes, framing: str, cuts: list[int],
                                                              writes: list[int]) -> None:
    answer_bytes = framed(body, framing, cuts)

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        start = 0
        for size in writes:  # the answer in pieces, each its own TCP write
            writer.write(answer_bytes[start : start + size])
            await writer.drain()
            await asyncio.sleep(0)
            start += size
        writer.write(answer_bytes[start:])
        await writer.drain()
        await reader.read()  # keep the connection until the client is done (until-close: close right away)

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer_bytes)
        await writer.drain()

    async with scripted(until_close if framing == "close" else script) as server:
        replica = pool(server.url)
        answer = await replica.request("POST", "/v1/completions", b"{}")
        assert answer.status == 200
        assert answer.headers == [(b"content-type", b"application/json"), (b"x-request-id", b"r1")]
        assert await answer.read() == body
        replica.close()


async def test_the_request_is_sent_as_given() -> None:
    record = Scripted("")
    ok = framed(b"{}", "length", [])
    async with scripted(answering(ok, record=record)) as server:
        replica = pool(server.url)
        await (await replica.request("POST", "/v1/completions?x=1", b'{"prompt":[1,2]}')).read()
        replica.close()
    port = server.url.rsplit(":", 1)[1]
    assert record.requests == [
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:%s\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer k\r\nContent-Length: 16\r\n\r\n{\"prompt\":[1,2]}" % port.encode()]


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_connection_cut_at_any_byte_is_disconnected(framing: str) -> None:
    """The fault at every point: the replica writes the first k bytes of its answer and closes."""
    answer_bytes = framed(b'{"text": "' + b"x" * 40 + b'"}', framing, [7, 20])
    for cut in range(len(answer_bytes)):

        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut: int = cut) -> None:
            await read_request(reader)
            writer.write(answer_bytes[:cut])
            await writer.drain()

        async with scripted(script) as server:
            replica = pool(server.url)
            with pytest.raises(Disconnected):
                answer = await replica.request("POST", "/v1/completions", b"{}")
                await answer.read()
            assert not replica.idle, f"a broken connection was kept (cut at byte {cut})"
            replica.close()


async def test_keep_alive_reuses_one_connection_until_it_expires() -> None:
    ok = framed(b"{}", "length", [])
    async with scripted(answering(ok)) as server:
        replica = pool(server.url, keepalive_s=0.2)
        for _ in range(5):
            assert await (await replica.request("POST", "/v1/completions", b"{}")).read() == b"{}"
        assert server.connections == 1
        await asyncio.sleep(0.3)  # idle past keepalive_s: never reused (the server may be closing it)
        assert await (await replica.request("POST", "/v1/completions", b"{}")).read() == b"{}"
        assert server.connections == 2
        replica.close()


async def test_a_quiet_pool_closes_its_idle_connections() -> None:
    closed = asyncio.Event()

    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(framed(b"{}", "length", []))
        await writer.drain()
        await reader.read()  # returns when the client closes the connection
        closed.set()

    async with scripted(once) as server:
        replica = pool(server.url, keepalive_s=0.2)
        await (await replica.request("POST", "/v1/completions", b"{}")).read()
        assert len(replica.idle) == 1
        await asyncio.wait_for(closed.wait(), 2)  # closed by the proxy, not by the server
        assert not replica.idle and replica.sweeper is None
        replica.close()


async def test_connections_the_server_closes_leave_the_pool() -> None:
    ok = framed(b"{}", "length", [])
    async with scripted(answering(ok, close=True)) as server:  # answers once, then closes (keep-alive expiry)
        replica = pool(server.url)
        for _ in range(3):
            assert await (await replica.request("POST", "/v1/completions", b"{}")).read() == b"{}"
            await asyncio.sleep(0.05)
            assert not replica.idle
        assert server.connections == 3
        replica.close()


async def test_connection_close_in_the_answer_is_honoured() -> None:
    answer_bytes = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    async with scripted(answering(answer_bytes)) as server:
        replica = pool(server.url)
        assert await (await replica.request("POST", "/v1/completions", b"{}")).read() == b"{}"
        assert not replica.idle
        replica.close()


async def test_nothing_listening_is_refused() -> None:
    replica = pool(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ConnectRefused):
        await replica.request("POST", "/v1/completions", b"{}")


async def test_a_slow_connect_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()

    async def never(*_: object, **__: object) -> None:
        await asyncio.sleep(60)

    monkeypatch.setattr(loop, "create_connection", never)
    with pytest.raises(ConnectTimeout):
        await pool("http://127.0.0.1:9", connect_timeout_s=0.05).request("POST", "/v1/completions", b"{}")


async def test_a_replica_that_never_answers_times_out_and_the_connection_is_dropped() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # holds the connection, answers nothing

    async with scripted(silent) as server:
        replica = pool(server.url, read_timeout_s=0.1)
        with pytest.raises(ReadTimeout):
            await replica.request("POST", "/v1/completions", b"{}")
        assert not replica.idle
        replica.close()


async def test_a_stream_that_stalls_times_out_but_a_slow_steady_one_does_not() -> None:
    async def steady_then_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(5):  # 0.3 s in all, each gap below the 0.15 s read timeout
            writer.write(b"5\r\nchunk\r\n")
            await writer.drain()
            await asyncio.sleep(0.06)
        await reader.read()  # then nothing

    async with scripted(steady_then_stall) as server:
        replica = pool(server.url, read_timeout_s=0.15)
        answer = await replica.request("POST", "/v1/completions", b"{}")
        received = b""
        with pytest.raises(ReadTimeout):
            async for chunk in answer.chunks():
                received += chunk
        assert received == b"chunk" * 5
        replica.close()


async def test_a_slow_client_pauses_the_replica_and_loses_nothing() -> None:
    payload = bytes(range(256)) * 4096 * 4  # 4 MiB, far above the stream buffer

    async def streaming(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(payload), 65536):
            piece = payload[start : start + 65536]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async with scripted(streaming) as server:
        replica = pool(server.url)
        answer = await replica.request("POST", "/v1/completions", b"{}")
        received, paused = [], False
        async for chunk in answer.chunks():
            received.append(chunk)
            await asyncio.sleep(0.01)  # the client reads slowly
            paused = paused or answer._connection.paused
        assert b"".join(received) == payload
        assert paused, "the replica's connection was never paused for the slow client"
        assert len(replica.idle) == 1  # complete: the connection went back to the pool
        replica.close()


async def test_an_answer_given_up_half_way_closes_its_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nchunk\r\n")
        await writer.drain()
        await reader.read()  # returns once the client closed

    async with scripted(endless) as server:
        replica = pool(server.url)
        answer = await replica.request("POST", "/v1/completions", b"{}")
        async for _ in answer.chunks():
            break
        answer.close()
        assert not replica.idle
        await asyncio.sleep(0.05)
        answer2 = await asyncio.wait_for(replica.request("POST", "/v1/completions", b"{}"), 2)
        answer2.close()
        assert server.connections == 2
        replica.close()


async def test_a_cancelled_request_never_leaves_its_connection_in_the_pool() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(0.2)
        writer.write(framed(b"{}", "length", []))
        await writer.drain()
        await reader.read()

    async with scripted(slow) as server:
        replica = pool(server.url)
        task = asyncio.ensure_future(replica.request("POST", "/v1/completions", b"{}"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)
        assert not replica.idle
        replica.close()


@pytest.mark.parametrize("garbage", [b"HTTP/1.1 abc\r\n\r\n", b"NOT HTTP AT ALL\r\n\r\n",
                                     b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"])
async def test_a_malformed_answer_is_disconnected(garbage: bytes) -> None:
    async with scripted(answering(garbage)) as server:
        replica = pool(server.url)
        with pytest.raises(Disconnected):
            await (await replica.request("POST", "/v1/completions", b"{}")).read()
        assert not replica.idle
        replica.close()


def test_only_http_urls_make_a_pool() -> None:
    with pytest.raises(ValueError, match="not an http"):
        pool("ftp://replica:21")
