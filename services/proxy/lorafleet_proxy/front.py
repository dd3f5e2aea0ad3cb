"""The proxy's front: every request enters here; calls for one replica are relayed without FastAPI.

Why: the generation routes carry every rollout (TRL keeps ~128 in flight per replica), and FastAPI's
request handling, a general HTTP client and re-encoding bodies cost far more than routing. `Front`
is the outermost ASGI layer of the app (inside bearer auth on the public port). For every request it
enforces the body size limit (`PROXY_MAX_BODY_BYTES`, 413) and counts the answer by route and status;
it relays the generation routes (POST /v1/completions, /v1/chat/completions) and the read-only
helpers (/tokenize, /detokenize, /version, /is_sleeping) itself and hands everything else (admin,
broadcasts, docs) to FastAPI. The upstream client is upstream.py: one keep-alive pool per replica.

Generation requests: the body is read once, parsed with orjson, and only the fields routing reads are
checked (`model` a string, `stream` a boolean, `prompt` a string / token ids in [0, 2^63) / a batch
of those, `messages` a list of objects); everything else passes through untouched and the original
bytes are forwarded. Bad input is a 400 in vLLM's validation-error shape before any routing: nothing
reaches a replica. Read-only helpers go to the least loaded ready replica, body and query as given.

Which replicas: a request naming an adapter goes only to ready replicas that hold it (prefix affinity
among them); the base model (no `model`, its path or a served name from /server_info) goes to any
ready replica. Any other name is a 404 from the proxy itself in vLLM's body ("The model `<n>` does
not exist.", NotFoundError); nothing is sent.

Retries: a connection error, a 5xx, or a holder's 404 "model does not exist" (it lost the adapter)
before any byte reached the client is retried on another candidate, each replica at most once; a
read timeout is a 504 and is not retried (the request was slow, not lost). Non-streaming answers are
read whole first, so a replica dying mid-answer is retried too.

Streams (`"stream": true`) are passed through chunk by chunk. If the replica's stream breaks after
bytes reached the client, the proxy aborts the client's connection (no terminating chunk): the
client sees an incomplete response, never a clean end. In-flight accounting wraps the whole exchange
in try/finally, so a client that goes away at any point never leaks a count.

Runs (the `runs` package decides; the front asks): a request under `/runs/<run>/` is served as the same route
without the prefix, for that run: its `model` is mapped to the run's fleet-unique adapter name and back in the
answer (`NameMap`), and, while several runs share the fleet, it waits while its run is paused and takes its turn
in the fair-share queue (`Runs.turn`), which admits it onto a replica with room: the front tells it the request's
candidates and routes among those with room when asked; the relay goes there first. A single-run fleet pays one set
lookup for all of that.
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
from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import bad_request, error, model_not_found, no_ready_replica
from .fleet import Failure, Fleet
from .metrics import Metrics
from .replica import KEEPALIVE_EXPIRY_S, Replica
from .router import BadPrompt, Prompt, Router
from .runs import NameMap, RunKeyRefused, Runs, Turn
from .upstream import Answer, ConnectRefused, ConnectTimeout, Pool, ReadTimeout, UpstreamError

log = logging.getLogger("lorafleet.proxy.front")

ROUTES = ("/v1/completions", "/v1/chat/completions")  # generation: POST, routed by prefix affinity
READ_ONLY_ROUTES = {"/tokenize": "POST", "/detokenize": "POST", "/version": "GET", "/is_sleeping": "GET"}
NOT_FOUND_MARK = b"does not exist"  # vLLM's 404 for a model it does not serve (see README)
UPSTREAM_HEADER = PROXY_UPSTREAM_HEADER.lower().encode()  # which replica answered (tests and operators read it)
# Provenance of a generation answer (README "Provenance"): the weights that produced it, by their fleet name (an
# adapter's fleet-unique name, or the base model's), and the run it was served for.
ADAPTER_HEADER = b"x-lorafleet-adapter"
RUN_HEADER = b"x-lorafleet-run"
PASSED_RESPONSE_HEADERS = ("content-type", "x-request-id")
CONNECT_TIMEOUT_S = 10.0


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


class Upstreams:
    """One keep-alive pool per replica URL (upstream.py); pools of replicas that left the fleet are closed."""

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
                                          self.read_timeout_s, KEEPALIVE_EXPIRY_S)
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
            await self.relay(scope, raw, receive, send)
        else:
            await self.app(scope, replay(raw, receive), send)

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
            await self.relay(scope, raw, receive, send, adapter, prompts, stream, model, names)
            return
        candidates = lambda: [replica.url for replica in self.candidates(adapter, set())[0]]  # noqa: E731
        async with self.runs.turn(self.runs.of(scope), body, candidates,
                                  lambda room: self.route(adapter, prompts, room)) as turn:
            await self.relay(scope, raw, receive, send, adapter, prompts, stream, model, names, turn)

    async def relay(self, scope: Scope, raw: bytes, receive: Receive, send: Send, adapter: str = "",
                    prompts: list[Prompt] | None = None, stream: bool = False, shown: str = "",
                    names: NameMap | None = None, turn: Turn | None = None) -> None:
        """Relay to one candidate replica, retrying on another; `prompts` None: the least loaded, no routing.

        `shown`: the model as the client named it; `names`: the run's names to write back; `turn` (shared runs): the
        fair-share turn, whose replica goes first and whose `answers` get the body of a non-streamed answer (token
        counts)."""
        path: str = scope["path"]
        url = path + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
        tried: set[str] = set()
        last: Response | None = None
        while True:
            candidates, held = self.candidates(adapter, tried)
            if not candidates:
                break
            placed = turn.replica if turn is not None and not tried else None
            if placed is not None and any(candidate.url == placed for candidate in candidates):
                replica = self.fleet.replicas[placed]  # routed when its turn came
            elif prompts is None:
                replica = min(candidates, key=lambda candidate: candidate.load)
            else:
                replica = self.fleet.replicas[self.route(adapter, prompts, [r.url for r in candidates])]
            if turn is not None:
                turn.moved(replica.url)  # a retry's slot goes with it
            tried.add(replica.url)
            subject = (adapter or self.base_name(replica)) if prompts is not None else None
            failed = await self.attempt(replica, scope["method"], path, url, raw, stream, held, send, receive,
                                        names, turn.answers if turn is not None else None, subject,
                                        self.runs.of(scope))
            if failed is None:
                return
            last = failed.response
            if not failed.retry:
                break
        if last is None:
            last = no_ready_replica(self.fleet) if not self.fleet.ready() else model_not_found(shown or adapter)
        await last(scope, receive, send)

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

    async def attempt(self, replica: Replica, method: str, path: str, url: str, raw: bytes, stream: bool,
                      held: bool, send: Send, receive: Receive, names: NameMap | None = None,
                      answers: list[bytes] | None = None, subject: str | None = None, run: str = "") -> Failed | None:
        """One exchange with one replica; None once the client has its answer, else why it failed.

        `subject` (generations only): the weights asked for, by fleet name; the answer carries it and the run as
        provenance headers, is counted per (replica, adapter), and the circuit breaker counts its outcome."""
        provenance = [] if subject is None else [(ADAPTER_HEADER, subject.encode()), (RUN_HEADER, run.encode())]
        try:
            failed = await self._exchange(replica, method, path, url, raw, stream, held, send, receive, names,
                                          answers, provenance)
        except StreamBroken as exc:
            if subject is not None:
                self.fleet.generation_done(replica, True, str(exc))
            raise
        if subject is not None:
            if failed is None:
                replica.served[subject] = replica.served.get(subject, 0) + 1
                self.metrics.count_answer(replica.url, subject)
                self.fleet.generation_done(replica, False)
            elif failed.fault:
                self.fleet.generation_done(replica, True, f"{failed.response.status_code} on {path}")
        return failed

    async def _exchange(self, replica: Replica, method: str, path: str, url: str, raw: bytes, stream: bool,
                        held: bool, send: Send, receive: Receive, names: NameMap | None,
                        answers: list[bytes] | None, provenance: list[tuple[bytes, bytes]]) -> Failed | None:
        replica.inflight += 1
        replica.routed += 1
        started = time.perf_counter()
        answer: Answer | None = None
        try:
            answer = await self.upstreams.pool(replica.url, self.fleet.replicas).request(method, url, raw)
            status = answer.status
            if status >= 500 or status == 404 or not stream:
                content = await answer.read()
                self.latencies[path].observe(time.perf_counter() - started)
                if names is not None:
                    content = names.body(content)
                if status >= 500 or (status == 404 and held and NOT_FOUND_MARK in content):
                    reason = "5xx" if status >= 500 else "404"
                    self.retries[reason].inc()
                    log.warning("upstream %s path=%s status=%d body=%.300s; retrying elsewhere", replica.url,
                                path, status, content.decode(errors="replace"))
                    headers = {name.decode(): value.decode("latin-1")
                               for name, value in self._headers(answer, replica, provenance)}
                    return Failed(Response(content, status, headers), True, fault=status >= 500)
                await send({"type": "http.response.start", "status": status,
                            "headers": [*self._headers(answer, replica, provenance),
                                        (b"content-length", b"%d" % len(content))]})
                await send({"type": "http.response.body", "body": content})
                if answers is not None:
                    answers.append(content)
                return None
            self.latencies[path].observe(time.perf_counter() - started)
            await send({"type": "http.response.start", "status": status,
                        "headers": self._headers(answer, replica, provenance)})
            await self._relay_stream(answer, replica, path, send, receive, names)
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
    async def _relay_stream(answer: Answer, replica: Replica, path: str, send: Send, receive: Receive,
                            names: NameMap | None = None) -> None:
        """Chunks as they come; a client that leaves stops the stream (the replica sees its connection close).

        With `names`, the run's names are written back (`StreamRename` holds a tail that may be a split name)."""
        renaming = names.stream() if names is not None else None

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
    def _headers(answer: Answer, replica: Replica, provenance: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The replica's kept headers (content type, request id), which replica answered, and with what weights."""
        return [*answer.headers, (UPSTREAM_HEADER, replica.url.encode()), *provenance]
