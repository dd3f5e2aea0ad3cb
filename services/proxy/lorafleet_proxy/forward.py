"""Passing requests to one ready replica: routed generation calls and read-only helpers.

A connection error or a 5xx before any byte reached the client is retried on another ready replica
(each replica at most once per request); a read timeout is not (the request was slow, not lost):
504. Non-streaming answers are read whole before they are returned, so a replica dying mid-answer
is retried too; streaming answers (`"stream": true`) are passed through chunk by chunk and cannot
be retried once started.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from .broadcast import error, no_ready_replica
from .fleet import Fleet, Replica
from .metrics import Metrics
from .router import Router

log = logging.getLogger("lorafleet.proxy.forward")

UPSTREAM_HEADER = "X-Proxy-Upstream"
PASSED_RESPONSE_HEADERS = ("content-type", "x-request-id")
CONNECT_TIMEOUT_S = 10.0

Pick = Callable[[list[Replica]], Replica]


class Forwarder:
    def __init__(self, fleet: Fleet, router: Router, metrics: Metrics, read_timeout_s: float, token: str) -> None:
        self.fleet = fleet
        self.router = router
        self.metrics = metrics
        self.timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        self.headers = {"accept-encoding": "identity"} | ({"authorization": f"Bearer {token}"} if token else {})

    async def routed(self, request: Request, path: str) -> Response:
        """/v1/completions and /v1/chat/completions: one replica chosen by prefix affinity."""
        raw = await request.body()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object", "Bad Request")
        prompts = self.router.prompt_blocks(body)
        adapter = str(body.get("model") or "")

        def pick(candidates: list[Replica]) -> Replica:
            decision = self.router.choose(adapter, prompts, {replica.url: replica.load for replica in candidates})
            self.metrics.router.labels(decision.outcome).inc()
            return self.fleet.replicas[decision.replica]

        return await self.send(request, "POST", path, raw, pick, stream=body.get("stream") is True)

    async def any_replica(self, request: Request, path: str) -> Response:
        """Stateless read-only calls (/tokenize, /version, ...): the least loaded ready replica."""
        raw = await request.body()
        return await self.send(request, request.method, path, raw, lambda rs: min(rs, key=lambda r: r.load))

    async def send(self, request: Request, method: str, path: str, raw: bytes, pick: Pick, *,
                   stream: bool = False) -> Response:
        headers = dict(self.headers)
        if "content-type" in request.headers:
            headers["content-type"] = request.headers["content-type"]
        tried: set[str] = set()
        last: Response | None = None
        while candidates := [replica for replica in self.fleet.ready() if replica.url not in tried]:
            replica = pick(candidates)
            tried.add(replica.url)
            replica.inflight += 1
            replica.routed += 1
            handed_over = False
            started = time.perf_counter()
            try:
                upstream_request = replica.http.build_request(method, replica.url + path, content=raw,
                                                              headers=headers, params=request.query_params,
                                                              timeout=self.timeout)
                upstream = await replica.http.send(upstream_request, stream=True)
                if upstream.status_code >= 500 or not stream:
                    await upstream.aread()
                self.metrics.upstream_latency.labels(path).observe(time.perf_counter() - started)
                if upstream.status_code >= 500:
                    last = self._answer(upstream, replica, upstream.content)
                    self.metrics.upstream_retries.labels("5xx").inc()
                    log.warning("upstream %s path=%s status=%d body=%.300s; retrying elsewhere", replica.url, path,
                                upstream.status_code, upstream.text)
                    continue
                if not stream:
                    return self._answer(upstream, replica, upstream.content)
                handed_over = True
                return StreamingResponse(self._pipe(upstream, replica), status_code=upstream.status_code,
                                         headers=self._headers(upstream, replica))
            except httpx.TransportError as exc:
                reason = f"{path}: {type(exc).__name__}: {exc}"
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):  # nothing listens: likely dead
                    self.fleet.note_failure(replica, reason)
                if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                    log.warning("upstream %s timed out %s", replica.url, reason)  # slow, not failed: no retry
                    return error(504, f"replica {replica.url} timed out: {reason}", "GatewayTimeout")
                self.metrics.upstream_retries.labels("transport").inc()
                log.warning("upstream %s failed %s; retrying elsewhere", replica.url, reason)
                last = error(502, f"replica {replica.url} failed: {reason}", "BadGateway")
            finally:
                if not handed_over:
                    replica.inflight -= 1
        return last if last is not None else no_ready_replica(self.fleet)

    async def _pipe(self, upstream: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:  # bytes already reached the client: nothing to retry
            log.warning("upstream %s broke a stream: %s: %s", replica.url, type(exc).__name__, exc)
        finally:
            replica.inflight -= 1
            await upstream.aclose()

    def _answer(self, upstream: httpx.Response, replica: Replica, content: bytes) -> Response:
        return Response(content, status_code=upstream.status_code, headers=self._headers(upstream, replica))

    @staticmethod
    def _headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
        headers = {name: upstream.headers[name] for name in PASSED_RESPONSE_HEADERS if name in upstream.headers}
        headers[UPSTREAM_HEADER] = replica.url
        return headers
