"""Read-only helpers (/tokenize, /version, ...) passed to one ready replica.

A connection error or a 5xx is retried on another ready replica (each replica at most once per
request); a read timeout is not (the request was slow, not lost): 504. The generation routes have
their own lean path (generation.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
from fastapi import Request
from fastapi.responses import Response
from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER

from .broadcast import error, no_ready_replica
from .fleet import Fleet, Replica
from .metrics import Metrics

log = logging.getLogger("lorafleet.proxy.forward")

UPSTREAM_HEADER = PROXY_UPSTREAM_HEADER
PASSED_RESPONSE_HEADERS = ("content-type", "x-request-id")
CONNECT_TIMEOUT_S = 10.0

Pick = Callable[[list[Replica]], Replica]


class Forwarder:
    def __init__(self, fleet: Fleet, metrics: Metrics, read_timeout_s: float, token: str) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_TIMEOUT_S)
        self.headers = {"accept-encoding": "identity"} | ({"authorization": f"Bearer {token}"} if token else {})

    async def any_replica(self, request: Request, path: str) -> Response:
        """Stateless read-only calls (/tokenize, /version, ...): the least loaded ready replica."""
        raw = await request.body()
        return await self.send(request, request.method, path, raw, lambda rs: min(rs, key=lambda r: r.load))

    async def send(self, request: Request, method: str, path: str, raw: bytes, pick: Pick) -> Response:
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
            started = time.perf_counter()
            try:
                upstream_request = replica.http.build_request(method, replica.url + path, content=raw,
                                                              headers=headers, params=request.query_params,
                                                              timeout=self.timeout)
                upstream = await replica.http.send(upstream_request)
                self.metrics.upstream_latency.labels(path).observe(time.perf_counter() - started)
                if upstream.status_code >= 500:
                    last = self._answer(upstream, replica, upstream.content)
                    self.metrics.upstream_retries.labels("5xx").inc()
                    log.warning("upstream %s path=%s status=%d body=%.300s; retrying elsewhere", replica.url, path,
                                upstream.status_code, upstream.text)
                    continue
                return self._answer(upstream, replica, upstream.content)
            except httpx.TransportError as exc:
                reason = f"{path}: {type(exc).__name__}: {exc}"
                if isinstance(exc, httpx.ConnectError):  # refused: nothing listens, ejected at once
                    self.fleet.note_failure(replica, reason, "refused")
                elif isinstance(exc, httpx.ConnectTimeout):  # slow to accept: ejected only if it lasts
                    self.fleet.note_failure(replica, reason, "timeout")
                if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                    log.warning("upstream %s timed out %s", replica.url, reason)  # slow, not failed: no retry
                    return error(504, f"replica {replica.url} timed out: {reason}", "GatewayTimeout")
                self.metrics.upstream_retries.labels("transport").inc()
                log.warning("upstream %s failed %s; retrying elsewhere", replica.url, reason)
                last = error(502, f"replica {replica.url} failed: {reason}", "BadGateway")
            finally:
                replica.inflight -= 1
        return last if last is not None else no_ready_replica(self.fleet)

    def _answer(self, upstream: httpx.Response, replica: Replica, content: bytes) -> Response:
        return Response(content, status_code=upstream.status_code, headers=self._headers(upstream, replica))

    @staticmethod
    def _headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
        headers = {name: upstream.headers[name] for name in PASSED_RESPONSE_HEADERS if name in upstream.headers}
        headers[UPSTREAM_HEADER] = replica.url
        return headers
