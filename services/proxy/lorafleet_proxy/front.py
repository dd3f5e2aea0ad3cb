"""The proxy's front: every request enters here; calls for one replica are relayed without FastAPI.

`Front` is the outermost ASGI layer (inside bearer auth on the public port). For every request it enforces the body
limit (`PROXY_MAX_BODY_BYTES`, 413) and counts the answer by route and status; it relays the generation routes and
the read-only helpers itself (validated only as far as routing reads, original bytes forwarded through upstream.py,
retried on another candidate before any byte reached the client, streams aborted when the replica cuts them) and
hands everything else to FastAPI. A relayed request is made once into a `RelayedRequest` (request.py) that routing,
the retries, each attempt and its accounting read. Runs (`/runs/<run>/`, names, fair-share turns) are the `runs`
package's decision; the front asks. Why and how, step by step: docs/concepts/architecture.md ("One rollout", "The
generation path").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from lorafleet.runs import RunNameError
from lorafleet.vllm_api import (
    PROXY_ADAPTER_HEADER,
    PROXY_ATTESTED_AGE_HEADER,
    PROXY_ATTESTED_HEADER,
    PROXY_FINGERPRINT_HEADER,
    PROXY_UPSTREAM_HEADER,
)
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import bad_request, error, model_not_found, no_ready_replica, not_held_yet
from .fleet import Fleet
from .metrics import Metrics
from .replica_state import Failure, Replica
from .request import RelayedRequest
from .router import BadPrompt, Prompt, Router
from .runs import NameMap, RunKeyRefused, Runs, Turn
from .upstream import ConnectRefused, ConnectTimeout, ReadTimeout, ReplicaAnswer, UpstreamError, Upstreams

log = logging.getLogger("lorafleet.proxy.front")

ROUTES = ("/v1/completions", "/v1/chat/completions")  # generation: POST, routed by prefix affinity
READ_ONLY_ROUTES = {"/tokenize": "POST", "/detokenize": "POST", "/version": "GET", "/is_sleeping": "GET"}
NOT_FOUND_MARK = b"does not exist"  # vLLM's 404 for a model it does not serve
UPSTREAM_HEADER = PROXY_UPSTREAM_HEADER.lower().encode()  # which replica answered (tests and operators read it)
# Provenance of a generation answer (docs/concepts/provenance.md): the weights that produced it, by their fleet name (an
# adapter's fleet-unique name, or the base model's), the run it was served for, and for an adapter the content
# fingerprint the replica loaded it with (two versions under one name differ there).
ADAPTER_HEADER = PROXY_ADAPTER_HEADER.lower().encode()
RUN_HEADER = b"x-lorafleet-run"
FINGERPRINT_HEADER = PROXY_FINGERPRINT_HEADER.lower().encode()
ATTESTED_HEADER = PROXY_ATTESTED_HEADER.lower().encode()
ATTESTED_AGE_HEADER = PROXY_ATTESTED_AGE_HEADER.lower().encode()


class StreamBroken(Exception):
    """A replica's stream broke after bytes reached the client: raised so the server aborts the connection."""


@dataclass(frozen=True, slots=True)
class Failed:
    """An attempt that sent nothing to the client: what to answer if no other replica does better."""

    response: Response
    retry: bool
    fault: bool = True  # the replica failed (5xx, reset, timeout): the circuit breaker counts it


def parse(raw: bytes) -> dict[str, Any] | Response:
    """The request body, checked where routing reads it (the rest is the replica's business)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return bad_request(f"invalid JSON body: {exc}")
    if not isinstance(body, dict):
        return bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return bad_request("model must be a string", "body.model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return bad_request("stream must be a boolean", "body.stream")
    return body


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when it is larger than `limit` (declared or actual)."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            return None
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        return body if len(body) <= limit else None
    chunks, size = [body], len(body)
    while message.get("more_body", False):
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the already-read body once, then defers to the server's (disconnects)."""
    pending = True

    async def again() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def serves_base(replica: Replica, name: str) -> bool:
    """`name` is the replica's base model: its model path or a served name (unknown info: let it decide)."""
    if replica.info is None:
        return True
    served = replica.info.raw.get("vllm_config", {}).get("model_config", {}).get("served_model_name")
    return name == replica.info.model or name == served or (isinstance(served, list) and name in served)


class Front:
    """The outermost ASGI layer: bounds every body, counts every request by route and status, relays the
    generation and read-only routes itself and passes the rest to `app` (FastAPI's stack)."""

    def __init__(self, app: ASGIApp, fleet: Fleet, router: Router, metrics: Metrics, upstreams: Upstreams,
                 max_body_bytes: int, routes: Iterable[str], runs: Runs) -> None:
        self.app = app
        self.fleet = fleet
        self.runs = runs
        self.router = router
        self.metrics = metrics
        self.upstreams = upstreams
        self.max_body_bytes = max_body_bytes
        self.routes = frozenset(routes)  # known paths: the route label stays bounded ("other" for the rest)
        # Metric children looked up once: `labels()` takes a lock and builds a tuple on every call.
        self.latencies = {path: metrics.upstream_latency.labels(path) for path in (*ROUTES, *READ_ONLY_ROUTES)}
        self.outcomes = {outcome: metrics.router.labels(outcome) for outcome in ("affinity", "spilled", "unmatched")}
        self.retries = {reason: metrics.upstream_retries.labels(reason) for reason in ("5xx", "transport", "404")}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the server answers if the app fails before it starts a response

        async def record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if self.runs.under_prefix(scope):
            try:
                scope = self.runs.enter(scope)
            except RunNameError as exc:
                await error(404, str(exc), "NotFoundError")(scope, receive, record)
                self.metrics.count_request("other", 404)
                return
            except RunKeyRefused as exc:
                await error(exc.status, exc.message, exc.error_type)(scope, receive, record)
                self.metrics.count_request("other", exc.status)
                return
        try:
            await self.serve(scope, receive, record)
        finally:
            self.metrics.count_request(scope["path"] if scope["path"] in self.routes else "other", status)

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = await read_body(scope, receive, self.max_body_bytes)
        if raw is None:
            too_large = error(413, f"the request body is larger than {self.max_body_bytes} bytes "
                              "(PROXY_MAX_BODY_BYTES)", "Request Entity Too Large")
            await too_large(scope, receive, send)
        elif scope["method"] == "POST" and scope["path"] in ROUTES:
            await self.generate(scope, raw, receive, send)
        elif READ_ONLY_ROUTES.get(scope["path"]) == scope["method"]:
            await self.relay(self.request(scope, raw, receive, send))
        else:
            await self.app(scope, replay(raw, receive), send)

    def request(self, scope: Scope, raw: bytes, receive: Receive, send: Send, adapter: str = "", shown: str = "",
                stream: bool = False, prompts: list[Prompt] | None = None, names: NameMap | None = None,
                turn: Turn | None = None) -> RelayedRequest:
        """The request as the relay carries it (the generation-only fields left empty for a read-only helper)."""
        path: str = scope["path"]
        target = path + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
        return RelayedRequest(scope, receive, send, scope["method"], path, target, raw, self.runs.of(scope), adapter,
                              shown, stream, prompts, names, turn)

    async def generate(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        body = parse(raw)
        if isinstance(body, Response):
            await body(scope, receive, send)
            return
        try:
            prompts = self.router.prompt_blocks(body)
        except BadPrompt as exc:
            await bad_request(str(exc), exc.param)(scope, receive, send)
            return
        model: str = body.get("model") or ""
        resolved = self.runs.resolve(scope, model)
        if resolved is None:  # another run's adapter: as if it did not exist
            await model_not_found(model)(scope, receive, send)
            return
        adapter, names = resolved
        if names is not None:
            raw = orjson.dumps({**body, "model": adapter})
        stream = body.get("stream") is True
        if not self.runs.shared:
            await self.relay(self.request(scope, raw, receive, send, adapter, model, stream, prompts, names))
            return
        candidates = lambda: [replica.url for replica in self.candidates(adapter, set())[0]]  # noqa: E731
        async with self.runs.turn(self.runs.of(scope), body, candidates,
                                  lambda room: self.route(adapter, prompts, room)) as turn:
            await self.relay(self.request(scope, raw, receive, send, adapter, model, stream, prompts, names, turn))

    async def relay(self, request: RelayedRequest) -> None:
        """Relay to one candidate replica, retrying on another; without prompts: the least loaded, no routing. A
        fair-share turn's replica goes first (routed when its turn came), and a retry's slot moves with it."""
        turn = request.turn
        tried: set[str] = set()
        last: Response | None = None
        while True:
            candidates, held = self.candidates(request.adapter, tried)
            if not candidates:
                break
            placed = turn.replica if turn is not None and not tried else None
            if placed is not None and any(candidate.url == placed for candidate in candidates):
                replica = self.fleet.replicas[placed]  # routed when its turn came
            elif request.prompts is None:
                replica = min(candidates, key=lambda candidate: candidate.load)
            else:
                replica = self.fleet.replicas[self.route(request.adapter, request.prompts,
                                                         [r.url for r in candidates])]
            if turn is not None:
                turn.moved(replica.url)  # a retry's slot goes with it
            tried.add(replica.url)
            failed = await self.attempt(request, replica, held)
            if failed is None:
                return
            last = failed.response
            if not failed.retry:
                break
        if last is None:
            shown = request.shown or request.adapter
            last = (no_ready_replica(self.fleet) if not self.fleet.ready()
                    else not_held_yet(shown) if request.adapter and self.fleet.published(request.adapter)
                    else model_not_found(shown))
        await last(request.scope, request.receive, request.send)

    def route(self, adapter: str, prompts: list[Prompt], urls: list[str]) -> str:
        """The router's choice among `urls` for these prompts (recorded there, counted by outcome)."""
        decision = self.router.choose(adapter, prompts, {url: self.fleet.replicas[url].load for url in urls})
        self.outcomes[decision.outcome].inc()
        return decision.replica

    def candidates(self, adapter: str, tried: set[str]) -> tuple[list[Replica], bool]:
        """Untried ready replicas that can serve `adapter`, and whether the name is a loaded adapter."""
        ready = [replica for replica in self.fleet.ready() if replica.url not in tried]
        if not adapter:
            return ready, False
        holders = [replica for replica in ready if adapter in replica.adapters]
        if holders:
            return holders, True
        return [replica for replica in ready if serves_base(replica, adapter)], False

    @staticmethod
    def base_name(replica: Replica) -> str:
        return replica.info.model if replica.info is not None else ""

    async def attempt(self, request: RelayedRequest, replica: Replica, held: bool) -> Failed | None:
        """One exchange with one replica; None once the client has its answer, else why it failed.

        A generation's subject (the weights asked for, by fleet name) and run go with the answer as provenance
        headers; the answer is counted per (replica, adapter), and the circuit breaker counts its outcome."""
        if not request.generation:
            return await self._exchange(request, replica, held, [])
        subject = request.adapter or self.base_name(replica)
        provenance = [(ADAPTER_HEADER, subject.encode()), (RUN_HEADER, request.run.encode())]
        if subject and (loaded := replica.held.get(subject)) is not None and loaded.fingerprint:
            provenance.append((FINGERPRINT_HEADER, loaded.fingerprint.encode()))
        seen = replica.attestation
        if subject and seen.at is not None and (attested := seen.digests.get(subject)) is not None:
            provenance += [(ATTESTED_HEADER, attested.encode()),
                           (ATTESTED_AGE_HEADER, f"{time.monotonic() - seen.at:.1f}".encode())]
        try:
            failed = await self._exchange(request, replica, held, provenance)
        except StreamBroken as exc:
            self.fleet.generation_done(replica, True, str(exc))
            raise
        if failed is None:
            replica.served[subject] = replica.served.get(subject, 0) + 1
            self.metrics.count_answer(replica.url, subject)
            self.fleet.generation_done(replica, False)
        elif failed.fault:
            self.fleet.generation_done(replica, True, f"{failed.response.status_code} on {request.path}")
        return failed

    async def _exchange(self, request: RelayedRequest, replica: Replica, held: bool,
                        provenance: list[tuple[bytes, bytes]]) -> Failed | None:
        path = request.path
        replica.inflight += 1
        replica.routed += 1
        started = time.perf_counter()
        answer: ReplicaAnswer | None = None
        try:
            answer = await self.upstreams.pool(replica.url, self.fleet.replicas).request(request.method,
                                                                                        request.target, request.raw)
            status = answer.status
            if status >= 500 or status == 404 or not request.stream:
                content = await answer.read()
                self.latencies[path].observe(time.perf_counter() - started)
                if request.names is not None:
                    content = request.names.body(content)
                if status >= 500 or (status == 404 and held and NOT_FOUND_MARK in content):
                    reason = "5xx" if status >= 500 else "404"
                    self.retries[reason].inc()
                    log.warning("upstream %s path=%s status=%d body=%.300s; retrying elsewhere", replica.url,
                                path, status, content.decode(errors="replace"))
                    headers = {name.decode(): value.decode("latin-1")
                               for name, value in self._headers(answer, replica, provenance)}
                    return Failed(Response(content, status, headers), True, fault=status >= 500)
                await request.send({"type": "http.response.start", "status": status,
                                    "headers": [*self._headers(answer, replica, provenance),
                                                (b"content-length", b"%d" % len(content))]})
                await request.send({"type": "http.response.body", "body": content})
                if (answers := request.answers) is not None:
                    answers.append(content)
                return None
            self.latencies[path].observe(time.perf_counter() - started)
            await request.send({"type": "http.response.start", "status": status,
                                "headers": self._headers(answer, replica, provenance)})
            await self._relay_stream(answer, replica, request)
            return None
        except ConnectTimeout as exc:  # slow to accept: ejected only if it lasts
            return self._transport_failure(replica, path, exc, "timeout")
        except ReadTimeout as exc:  # slow, not failed, so no retry
            reason = f"{path}: {exc}"
            log.warning("upstream %s timed out %s", replica.url, reason)
            return Failed(error(504, f"replica {replica.url} timed out: {reason}", "GatewayTimeout"), False)
        except ConnectRefused as exc:  # refused: nothing listens, ejected at once
            return self._transport_failure(replica, path, exc, "refused")
        except UpstreamError as exc:  # reset, disconnected, malformed before any byte was sent
            return self._transport_failure(replica, path, exc, None)
        finally:
            replica.inflight -= 1
            if answer is not None:
                answer.close()

    @staticmethod
    async def _relay_stream(answer: ReplicaAnswer, replica: Replica, request: RelayedRequest) -> None:
        """Chunks as they come; a client that leaves stops the stream (the replica sees its connection close).

        With the run's names, they are written back (`StreamRename` holds a tail that may be a split name)."""
        renaming = request.names.stream() if request.names is not None else None
        path, send, receive = request.path, request.send, request.receive

        async def relay() -> None:
            try:
                async for chunk in answer.chunks():
                    if renaming is not None:
                        chunk = renaming.feed(chunk)
                        if not chunk:
                            continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as exc:
                log.warning("upstream %s broke a stream on %s: %s; aborting the client connection",
                            replica.url, path, exc)
                raise StreamBroken(f"replica {replica.url} broke the stream: {exc}") from exc
            await send({"type": "http.response.body", "body": renaming.flush() if renaming is not None else b""})

        async def client_left() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        relaying, watching = asyncio.ensure_future(relay()), asyncio.ensure_future(client_left())
        try:
            await asyncio.wait((relaying, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relaying, watching):
                task.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        if relaying.done() and not relaying.cancelled():
            relaying.result()  # StreamBroken propagates: the server aborts the client's connection
        else:
            log.info("client left a stream from %s on %s; closing the upstream request", replica.url, path)

    def _transport_failure(self, replica: Replica, path: str, exc: UpstreamError, kind: Failure | None) -> Failed:
        """Retry elsewhere; a replica that refused the connection (or keeps timing out) is also reported."""
        reason = f"{path}: {type(exc).__name__}: {exc}"
        if kind is not None:
            self.fleet.note_failure(replica, reason, kind)
        self.retries["transport"].inc()
        log.warning("upstream %s failed %s; retrying elsewhere", replica.url, reason)
        return Failed(error(502, f"replica {replica.url} failed: {reason}", "BadGateway"), True)

    @staticmethod
    def _headers(answer: ReplicaAnswer, replica: Replica,
                 provenance: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The replica's kept headers (content type, request id), which replica answered, and with what weights."""
        return [*answer.headers, (UPSTREAM_HEADER, replica.url.encode()), *provenance]
