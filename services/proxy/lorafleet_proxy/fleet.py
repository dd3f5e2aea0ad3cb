"""Fleet membership: which replicas exist, which are ready, and bringing each one in line with the ledger.

A replica is `joining` until its /health answers 200, then `syncing` while every ledger adapter is
loaded onto it in order (and anything else unloaded), then `ready`: only ready replicas get traffic
and take part in broadcasts. Failed health checks (or failed routed calls) eject it; when it
answers again it re-syncs. A ready replica whose adapters stop matching the ledger (it restarted)
goes back to syncing. Ejection and re-sync drop the replica's routing ownership: its cache is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum

import httpx
from lorafleet.settings import Settings
from lorafleet.vllm_api import ServerInfo, VLLMClient, VLLMError, metric_total

from .discovery import resolve
from .ledger import Ledger
from .metrics import Metrics
from .router import Router

log = logging.getLogger("lorafleet.proxy.fleet")

LOAD_RETRY_FIRST_S = 0.05
LOAD_RETRY_MAX_S = 1.0
HEALTH_TIMEOUT_S = 5.0
# Idle connections expire before vLLM's (uvicorn's) 5 s keep-alive does: reusing one the server is
# closing at that very moment would fail the request.
KEEPALIVE_EXPIRY_S = 2.0


class State(StrEnum):
    JOINING = "joining"
    SYNCING = "syncing"
    READY = "ready"
    EJECTED = "ejected"


def upstream_pool(transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """One connection pool per replica: httpx scans its whole pool for every request, so pools stay small."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(30.0, connect=5.0), limits=limits)


@dataclass(eq=False)
class Replica:
    url: str
    http: httpx.AsyncClient = field(repr=False)
    client: VLLMClient = field(repr=False)
    state: State = State.JOINING
    inflight: int = 0
    routed: int = 0
    engine_queue: int = 0  # vLLM's running + waiting requests at the last health check (other clients too)
    adapters: dict[str, str] = field(default_factory=dict)
    last_error: str | None = None
    failures: int = 0
    info: ServerInfo | None = None
    sync_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def load(self) -> int:
        return max(self.inflight, self.engine_queue)

    def as_json(self) -> dict[str, object]:
        return {"url": self.url, "state": self.state.value, "inflight": self.inflight, "routed": self.routed,
                "adapters": dict(self.adapters), "last_error": self.last_error}


async def load_until(client: VLLMClient, name: str, path: str, deadline: float) -> str:
    """Load one adapter, retrying "No adapter found" (a volume not caught up yet) with backoff until `deadline`."""
    delay = LOAD_RETRY_FIRST_S
    attempt = 0
    while True:
        attempt += 1
        try:
            answer = await client.load_lora_adapter(name, path, timeout=max(deadline - time.monotonic(), 1.0))
        except VLLMError as exc:
            if not exc.adapter_not_found or time.monotonic() + delay >= deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, LOAD_RETRY_MAX_S)
            continue
        log.info("load name=%s replica=%s attempts=%d", name, client.base_url, attempt)
        return answer


class Fleet:
    """The replicas, their states and the background loops that keep them in line with the ledger."""

    def __init__(self, settings: Settings, router: Router, ledger: Ledger,
                 transport: httpx.AsyncBaseTransport | None = None, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.router = router
        self.ledger = ledger
        self.transport = transport  # None = the network; tests pass an in-process transport
        self._retired: list[httpx.AsyncClient] = []  # pools of removed replicas, closed at stop
        self.replicas: dict[str, Replica] = {}
        self.lock = asyncio.Lock()  # held by broadcasts and by a sync's final check: one consistent ledger view
        self.generation = 0  # bumped by every broadcast, so a health check can tell its snapshot is stale
        self.paused_mode: str | None = None  # the fleet is paused (a syncing replica is paused before it is ready)
        self.metrics = metrics or Metrics()  # the app's: ejections, catch-up syncs, broadcast rollbacks
        self._tasks: list[asyncio.Task[None]] = []
        self._block_sizes: set[int] = set()

    @contextlib.asynccontextmanager
    async def broadcasting(self) -> AsyncIterator[None]:
        """Hold the lock for a fleet-wide change and bump the generation, so a health check's snapshot is stale."""
        async with self.lock:
            self.generation += 1
            yield

    # --- membership ------------------------------------------------------------------------------
    def ready(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.state is State.READY]

    def set_members(self, urls: list[str]) -> None:
        for url in urls:
            if url not in self.replicas:
                http = upstream_pool(self.transport)
                token = self.settings.proxy_upstream_token
                self.replicas[url] = Replica(url, http, VLLMClient(url, token=token, client=http))
                log.info("replica discovered url=%s", url)
        for url in [url for url in self.replicas if url not in urls]:
            replica = self.replicas.pop(url)
            self._retired.append(replica.http)
            self._cancel_sync(replica)
            self.router.forget_replica(url)
            log.warning("replica removed url=%s (no longer discovered) state=%s", url, replica.state)

    async def start(self) -> None:
        if self.settings.proxy_upstream_dns:
            await self._discover()
            self._tasks.append(asyncio.create_task(self._dns_loop(), name="proxy-dns"))
        else:
            self.set_members(self.settings.upstream_urls)
        self._tasks.append(asyncio.create_task(self._health_loop(), name="proxy-health"))

    async def stop(self) -> None:
        for replica in self.replicas.values():
            self._cancel_sync(replica)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for http in [replica.http for replica in self.replicas.values()] + self._retired:
            await http.aclose()

    async def _discover(self) -> None:
        try:
            self.set_members(await resolve(self.settings.proxy_upstream_dns))
        except OSError as exc:
            log.warning("dns: cannot resolve %s: %s (keeping %d replica(s))", self.settings.proxy_upstream_dns,
                        exc, len(self.replicas))

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.proxy_dns_interval_s)
            await self._discover()

    # --- health ----------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.check(replica) for replica in list(self.replicas.values())))
            await asyncio.sleep(self.settings.proxy_health_interval_s)

    async def check(self, replica: Replica) -> None:
        """One health check: eject on repeated failure, start a sync when due, reconcile a ready replica."""
        if not await replica.client.health(timeout=HEALTH_TIMEOUT_S):
            self.note_failure(replica, "health check failed")
            return
        replica.failures = 0
        if replica.state is State.READY:
            await self._reconcile(replica)
        elif replica.sync_task is None or replica.sync_task.done():
            self._start_sync(replica)

    def note_failure(self, replica: Replica, error: str) -> None:
        """A failed health check or routed call; enough in a row eject the replica."""
        replica.failures += 1
        replica.last_error = error
        if replica.failures >= self.settings.proxy_eject_after:
            self.eject(replica, error)

    def eject(self, replica: Replica, error: str) -> None:
        """Out of traffic and broadcasts now; when it answers health checks again it re-syncs to the ledger."""
        if replica.state not in (State.SYNCING, State.READY):
            return
        self._cancel_sync(replica)
        replica.state = State.EJECTED
        replica.last_error = error
        replica.adapters = {}
        replica.engine_queue = 0
        self.router.forget_replica(replica.url)
        self.metrics.ejections.inc()
        log.warning("replica ejected url=%s failures=%d error=%s", replica.url, replica.failures, error)

    def resync(self, replica: Replica, reason: str) -> None:
        """Take a replica out of traffic and bring it back in line with the ledger."""
        if replica.state is State.EJECTED:
            return
        log.warning("replica resync url=%s reason=%s", replica.url, reason)
        replica.last_error = reason
        replica.state = State.SYNCING
        self.router.forget_replica(replica.url)
        self._cancel_sync(replica)
        self._start_sync(replica)

    async def _reconcile(self, replica: Replica) -> None:
        """Compare a ready replica's /v1/models with the ledger (a restarted replica lost its adapters)."""
        generation = self.generation
        if self.lock.locked():
            return
        try:
            actual = await replica.client.loaded_adapters()
        except VLLMError as exc:
            self.note_failure(replica, f"/v1/models: {exc}")
            return
        with contextlib.suppress(VLLMError, ValueError):
            text = await replica.client.metrics()
            replica.engine_queue = int(metric_total(text, "vllm:num_requests_running")
                                       + metric_total(text, "vllm:num_requests_waiting"))
        if self.lock.locked() or generation != self.generation or replica.state is not State.READY:
            return  # a broadcast ran meanwhile: this snapshot may predate it
        wanted = self.ledger.entries()
        if actual != wanted:
            missing = sorted(set(wanted.items()) - set(actual.items()))
            extra = sorted(set(actual.items()) - set(wanted.items()))
            self.resync(replica, f"adapters differ from the ledger (restarted?): missing={missing} extra={extra}")

    def _start_sync(self, replica: Replica) -> None:
        replica.sync_task = asyncio.create_task(self.sync(replica), name=f"proxy-sync {replica.url}")

    def _cancel_sync(self, replica: Replica) -> None:
        if replica.sync_task is not None and replica.sync_task is not asyncio.current_task():
            replica.sync_task.cancel()
        replica.sync_task = None

    # --- catch-up --------------------------------------------------------------------------------
    async def sync(self, replica: Replica) -> None:
        """Load every ledger adapter (in order) onto the replica, unload the rest, then mark it ready."""
        replica.state = State.SYNCING
        self.router.forget_replica(replica.url)
        started = time.monotonic()
        deadline = started + self.settings.proxy_lora_load_timeout_s
        try:
            replica.info = await replica.client.server_info()
            self._adopt_block_size(replica)
            while True:
                actual = await replica.client.loaded_adapters()
                async with self.lock:
                    wanted = self.ledger.entries()
                    stale = [name for name, path in actual.items() if wanted.get(name) != path]
                    missing = [(name, path) for name, path in wanted.items() if actual.get(name) != path]
                    if not stale and not missing:
                        await self._match_pause(replica)
                        replica.adapters = actual
                        replica.state = State.READY
                        replica.last_error = None
                        self.metrics.replica_sync_seconds.observe(time.monotonic() - started)
                        log.info("replica ready url=%s adapters=%s", replica.url, list(actual))
                        return
                log.info("replica syncing url=%s unload=%s load=%s", replica.url, stale, [n for n, _ in missing])
                for name in stale:
                    with contextlib.suppress(VLLMError):
                        await replica.client.unload_lora_adapter(name)
                if any(name in wanted for name in stale):
                    await replica.client.reset_prefix_cache()  # a name rebound to new weights: no stale blocks
                for name, path in missing:
                    await load_until(replica.client, name, path, deadline)
        except VLLMError as exc:
            replica.last_error = f"sync: {exc}"
            log.warning("replica sync failed url=%s error=%s (retried at the next health check)", replica.url, exc)

    async def _match_pause(self, replica: Replica) -> None:
        if self.paused_mode is not None:
            await replica.client.pause(self.paused_mode)  # type: ignore[arg-type]
        else:
            await replica.client.resume()

    def _adopt_block_size(self, replica: Replica) -> None:
        size = replica.info.block_size if replica.info else None
        if not size:
            return
        self._block_sizes.add(int(size))
        if len(self._block_sizes) > 1:
            log.warning("replicas report different KV block sizes %s; routing keeps %d",
                        sorted(self._block_sizes), self.router.block_size)
        elif self.settings.proxy_block_size == 0:
            self.router.set_block_size(int(size))
