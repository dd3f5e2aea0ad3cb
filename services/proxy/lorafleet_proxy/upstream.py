"""A lean HTTP/1.1 client for the replicas: keep-alive pools on asyncio protocols, httptools parsing.

Why our own and not aiohttp's or httpx's client: the proxy forwards one small request per rollout
(TRL keeps ~128 in flight per replica), and a general client's per-request machinery (request and
response objects, payload registry, cookie and redirect handling, stream readers, a pool scan) cost
more CPU than routing and serving together (`make bench` measures the result against an aiohttp
forwarder). This client does only what forwarding needs: send the original bytes with fixed
headers in one write, read a whole answer or relay a stream with backpressure, keep connections
alive per replica, and tell failures apart the way the proxy acts on them:

- `ConnectRefused`: the connection could not be opened (refused, unreachable, unknown host).
- `ConnectTimeout`: opening took longer than `connect_timeout_s` (the replica may only be slow).
- `ReadTimeout`: nothing arrived for `read_timeout_s` while an answer was due (the request was slow).
- `Disconnected`: the connection broke, or the answer was malformed, before it was complete.
- `Abandoned`: the proxy gave the exchange up (`Pool.abandon`): the replica left the fleet with it in flight.

`Upstreams` keeps one pool per replica URL for the front and closes the pools of replicas that left the fleet.

The response parser is httptools (llhttp, the parser of Node.js and of uvicorn's server side).
Idle connections are reused newest first and closed once idle for `keepalive_s` (a sweep runs while
any are idle), which stays below the replica's own keep-alive so the proxy never reuses a connection
the server is closing, and a quiet proxy holds no sockets.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httptools
from lorafleet.vllm_api import REPLICA_KEEPALIVE_EXPIRY_S

log = logging.getLogger("lorafleet.proxy.front")  # the front's pools: their events keep the front's logger

# A stream whose client reads slower than the replica writes stops reading from the replica past this.
STREAM_BUFFER_BYTES = 256 * 1024
PASSED_RESPONSE_HEADERS = ("content-type", "x-request-id")  # the replica's headers the client gets
CONNECT_TIMEOUT_S = 10.0


class UpstreamError(Exception):
    """A request that got no complete answer from the replica."""


class ConnectRefused(UpstreamError):
    pass


class ConnectTimeout(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class Disconnected(UpstreamError):
    pass


class Abandoned(UpstreamError):
    """The proxy gave the exchange up: the replica left the fleet (hung, failing) with the request in flight."""


class ReplicaAnswer:
    """One response: status, the headers the pool keeps, and the body as it arrives."""

    __slots__ = ("_buffered", "_chunks", "_connection", "_done", "_error", "_waiter", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], connection: _Connection) -> None:
        self.status = status
        self.headers = headers  # lower-case names, only those in the pool's `kept_headers`
        self._connection = connection
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    async def read(self) -> bytes:
        """The whole body."""
        while not self._done:
            if self._error is not None:
                raise self._error
            await self._wait()
        return b"".join(self._chunks)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (all that is buffered at each step); raises if the replica breaks it."""
        while True:
            if self._chunks:
                chunk = b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                if not self._done:  # once done, the connection may already carry another exchange
                    self._connection.resume()
                yield chunk
            elif self._error is not None:
                raise self._error
            elif self._done:
                return
            else:
                await self._wait()

    def close(self) -> None:
        """Give the answer up; a connection still carrying its body is closed rather than reused."""
        if not self._done:
            self._connection.abort()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > STREAM_BUFFER_BYTES:
            self._connection.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        if not self._done and self._error is None:
            self._error = exc
            self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, carrying one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[ReplicaAnswer] | None = None  # until the answer's headers are in
        self.answer: ReplicaAnswer | None = None  # from the headers until the body is complete
        self.headers: list[tuple[bytes, bytes]] = []
        self.length_known = False
        self.last_read = 0.0
        self.idle_since = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.lost = False

    # --- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Disconnected(f"malformed answer from {self.pool.url}: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        answer = self.answer
        if answer is not None and not self.length_known and exc is None:
            self.answer = None  # an answer delimited by the connection's end (neither length nor chunks)
            self._stop_timer()
            answer._finish()
            return
        reason = f": {exc}" if exc else ""
        self._fail(Disconnected(f"{self.pool.url} closed the connection before the answer was complete{reason}"))

    # --- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in self.pool.kept_headers:
            self.headers.append((name, value))
        elif name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.length_known = True

    def on_headers_complete(self) -> None:
        answer = self.answer = ReplicaAnswer(self.parser.get_status_code(), self.headers, self)
        self.headers = []
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_result(answer)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._feed(body)

    def on_message_complete(self) -> None:
        answer, self.answer = self.answer, None
        self._stop_timer()
        if answer is not None:
            answer._finish()
        if self.parser.should_keep_alive() and self.length_known:
            self.length_known = False
            self.pool.release(self)
        else:
            self.abort()

    # --- used by the pool and the answer ------------------------------------------------------------
    def send(self, data: bytes, read_timeout_s: float) -> asyncio.Future[ReplicaAnswer]:
        self.head = self.loop.create_future()
        self.last_read = self.loop.time()
        self.timer = self.loop.call_later(read_timeout_s, self._check_timeout, read_timeout_s)
        assert self.transport is not None
        self.transport.write(data)
        return self.head

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close at once: the connection is mid-answer or broken, so it is never reused."""
        self.lost = True
        self.pool.forget(self)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def _check_timeout(self, read_timeout_s: float) -> None:
        self.timer = None
        idle = self.loop.time() - self.last_read
        if self.paused or idle < read_timeout_s:  # a paused stream waits for its client, not for the replica
            self.timer = self.loop.call_later(read_timeout_s - idle if not self.paused else read_timeout_s,
                                              self._check_timeout, read_timeout_s)
            return
        self._fail(ReadTimeout(f"no answer from {self.pool.url} for {read_timeout_s:g} s"))
        self.abort()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fail(self, exc: UpstreamError) -> None:
        self._stop_timer()
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(exc)
        answer, self.answer = self.answer, None
        if answer is not None:
            answer._fail(exc)


class Pool:
    """Keep-alive connections to one replica URL (`http://host:port` or `https://...`)."""

    def __init__(self, url: str, headers: dict[str, str], kept_headers: Iterable[str], connect_timeout_s: float,
                 read_timeout_s: float, keepalive_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = parts.netloc.rsplit("@", 1)[-1]
        fixed = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self.head_tail = f"Host: {host_header}\r\n{fixed}".encode("latin-1")
        self.kept_headers = frozenset(name.lower().encode() for name in kept_headers)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self.idle: dict[_Connection, None] = {}  # insertion order: the newest idle connection is last
        self.busy: set[_Connection] = set()  # carrying an exchange
        self.sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    async def request(self, method: str, target: str, body: bytes = b"") -> ReplicaAnswer:
        """Send one request (the pool's fixed headers); returns once the answer's headers are in. Read or
        close the answer."""
        connection = self._idle() or await self._connect()
        self.busy.add(connection)
        data = b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method.encode(), target.encode("latin-1"), self.head_tail, len(body), body)
        try:
            return await connection.send(data, self.read_timeout_s)
        except BaseException:  # cancelled or failed: the exchange is abandoned mid-way
            connection.abort()
            raise

    def release(self, connection: _Connection) -> None:
        self.busy.discard(connection)
        if self.closed or connection.lost:
            connection.abort()
            return
        connection.idle_since = connection.loop.time()
        self.idle[connection] = None
        if self.sweeper is None:
            self.sweeper = connection.loop.call_later(self.keepalive_s, self._sweep)

    def _sweep(self) -> None:
        """Close the connections idle for keepalive_s (oldest first), so a quiet proxy holds no sockets."""
        self.sweeper = None
        loop = asyncio.get_running_loop()
        expired = loop.time() - self.keepalive_s
        for connection in list(self.idle):
            if connection.idle_since > expired:
                self.sweeper = loop.call_later(connection.idle_since - expired, self._sweep)
                break
            connection.abort()

    def forget(self, connection: _Connection) -> None:
        self.idle.pop(connection, None)
        self.busy.discard(connection)

    def abandon(self, reason: str) -> int:
        """Give up every exchange in flight (each fails with `Abandoned`, its connection closed); how many. A hung
        replica's requests would otherwise wait out the read timeout; given up, the front retries them elsewhere."""
        busy, self.busy = self.busy, set()
        for connection in busy:
            connection._fail(Abandoned(f"{self.url}: {reason}"))
            connection.abort()
        return len(busy)

    def close(self) -> None:
        """Close the idle connections; busy ones close when their answer is done."""
        self.closed = True
        if self.sweeper is not None:
            self.sweeper.cancel()
            self.sweeper = None
        for connection in list(self.idle):
            connection.abort()

    def _idle(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self.idle:
            connection = self.idle.popitem()[0]
            if now - connection.idle_since < self.keepalive_s and not connection.lost:
                return connection
            connection.abort()  # the newest one is stale: so are all the others
        return None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(self), self.host, self.port,
                                                             ssl=self.ssl)
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {self.url} took longer than {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectRefused(f"cannot connect to {self.url}: {exc}") from None
        return connection


class Upstreams:
    """One keep-alive pool per replica URL; pools of replicas that left the fleet are closed."""

    def __init__(self, read_timeout_s: float, token: str) -> None:
        self.read_timeout_s = read_timeout_s
        self.headers = {"content-type": "application/json", "accept-encoding": "identity"} | (
            {"authorization": f"Bearer {token}"} if token else {})
        self.pools: dict[str, Pool] = {}

    def pool(self, url: str, members: Iterable[str]) -> Pool:
        pool = self.pools.get(url)
        if pool is None:
            for gone in set(self.pools) - set(members):
                self.pools.pop(gone).close()
            pool = self.pools[url] = Pool(url, self.headers, PASSED_RESPONSE_HEADERS, CONNECT_TIMEOUT_S,
                                          self.read_timeout_s, REPLICA_KEEPALIVE_EXPIRY_S)
        return pool

    def abandon(self, url: str, reason: str) -> None:
        """The replica at `url` left the fleet: its requests in flight fail now (and are retried elsewhere)."""
        pool = self.pools.get(url)
        if pool is not None and (given_up := pool.abandon(reason)):
            log.warning("upstream %s left the fleet with %d request(s) in flight: retrying them elsewhere", url,
                        given_up)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
