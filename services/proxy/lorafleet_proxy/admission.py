"""A replica's way into traffic: the warm-up, then the catch-up, each within its own bound, retried after a backoff.

The health round asks `Admission` whether a replica's next sync is due and starts it; a sync begins with the
replica out of routing (`Fleet.begin_sync`), proves it generates (one greedy token of the base model), brings it in
line with the ledger (sync.catch_up, which marks it ready) and on failure leaves it syncing with `last_error` set
and the next try after a backoff that doubles up to PROXY_SYNC_BACKOFF_MAX_S. The states: docs/concepts/fleet-state.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import VLLMError, VLLMUnreachable
from lorafleet.vllm_compat import admission as vllm_admission

from .metrics import Metrics
from .replica_state import Replica, State
from .router import Router
from .sync import SyncFleet, catch_up

log = logging.getLogger("lorafleet.proxy.fleet")

WARM_UP_PROMPT = "Hello"
# The warm-up's own bound, apart from PROXY_LORA_LOAD_TIMEOUT_S (a deadline for adapter loads): vLLM's first request
# on CPU compiles for tens of seconds, minutes on a busy 2-core box. A hung replica is ejected by the health loop,
# which cancels its sync, long before this.
WARM_UP_TIMEOUT_S = 600.0


class CannotGenerate(VLLMError):
    """The replica answers /health but failed the one-token warm-up completion; keeps the replica's own error."""

    def __init__(self, cause: VLLMError) -> None:
        super().__init__(cause.status, f"cannot generate: {cause.message}", cause.error_type, cause.body)


async def warm_up(replica: Replica, deadline: float) -> None:
    """One greedy token of the base model before `deadline`; raises CannotGenerate when it fails.

    A paused replica queues new requests until it is resumed, so it is not asked: it was admitted (and so
    generated) before the pause, and the catch-up applies the fleet's pause state next.
    """
    if await replica.client.is_paused():
        log.info("warm-up skipped url=%s: the replica is paused", replica.url)
        return
    base = next(card.id for card in await replica.client.models() if card.parent is None)
    started = time.monotonic()
    try:
        await replica.client.completions({"model": base, "prompt": WARM_UP_PROMPT, "max_tokens": 1,
                                          "temperature": 0.0}, timeout=max(deadline - started, 1.0))
    except VLLMUnreachable:
        raise  # no answer at all: the health loop's business, not a verdict on generation
    except VLLMError as exc:
        replica.generates = False
        raise CannotGenerate(exc) from exc
    replica.generates = True
    log.info("warm-up done url=%s model=%s seconds=%.2f", replica.url, base, time.monotonic() - started)


class AdmissionFleet(SyncFleet, Protocol):
    """What admitting a replica needs of the fleet (fleet.Fleet is one): to take it out of routing; the catch-up's."""

    def begin_sync(self, replica: Replica) -> None: ...


def backoff_s(settings: ProxySettings, failures: int) -> float:
    """The wait before the next sync of a replica whose last `failures` syncs (or breaker trips) failed in a row."""
    return min(settings.proxy_health_interval_s * 2 ** failures, settings.proxy_sync_backoff_max_s)


class Admission:
    """The syncs of the fleet's replicas: when the next one is due, starting and cancelling them, and each sync's
    stages. A replica's KV block size, read at admission, sets the router's (unless PROXY_BLOCK_SIZE does)."""

    def __init__(self, fleet: AdmissionFleet, settings: ProxySettings, router: Router, metrics: Metrics) -> None:
        self.fleet = fleet
        self.settings = settings
        self.router = router
        self.metrics = metrics
        self.cancelled: set[asyncio.Task[None]] = set()  # cancelled syncs until they have finished
        self._block_sizes: set[int] = set()

    def due(self, replica: Replica, rebuilding: bool) -> bool:
        """No sync running, the ledger readable (not `rebuilding`), and the replica's backoff over."""
        running = replica.sync_task is not None and not replica.sync_task.done()
        return not running and not rebuilding and time.monotonic() >= replica.next_sync_at

    def start(self, replica: Replica) -> None:
        previous = replica.sync_task if replica.sync_task is not None and not replica.sync_task.done() else None
        replica.sync_task = asyncio.create_task(self._after(previous, replica), name=f"proxy-sync {replica.url}")

    def cancel(self, replica: Replica) -> None:
        task = replica.sync_task
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            self.cancelled.add(task)
            task.add_done_callback(self.cancelled.discard)

    async def _after(self, previous: asyncio.Task[None] | None, replica: Replica) -> None:
        if previous is not None:
            await asyncio.wait({previous})  # a cancelled sync finishes before the next one touches the replica
        await self._admit(replica)

    async def _admit(self, replica: Replica) -> None:
        """syncing: the warm-up, then the catch-up, each within its own bound; ready at the end, or left syncing
        with `last_error` set and the next try after a backoff."""
        self.fleet.begin_sync(replica)
        stage, limit = "warm-up", WARM_UP_TIMEOUT_S
        try:
            async with asyncio.timeout(limit):  # its own bound: a first request compiles on CPU, loads do not
                replica.vllm = await vllm_admission(replica.client)  # raises Incompatible: refused, stays out
                replica.info = await replica.client.server_info()
                self.adopt_block_size(replica)
                await warm_up(replica, time.monotonic() + limit)
            stage, limit = "sync", self.settings.proxy_lora_load_timeout_s
            async with asyncio.timeout(limit):
                started = time.monotonic()
                await catch_up(self.fleet, replica, started + limit)
                if replica.state is State.READY:
                    self.metrics.replica_sync_seconds.observe(time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of one replica's sync stays with that replica
            reason = f"{stage} did not finish within {limit:.0f}s" if isinstance(exc, TimeoutError) else f"sync: {exc}"
            if not isinstance(exc, VLLMError | TimeoutError):
                reason = f"sync: malformed reply: {type(exc).__name__}: {exc}"
                self.metrics.loop_errors.labels("sync").inc()
            replica.sync_failures += 1
            backoff = backoff_s(self.settings, replica.sync_failures)
            replica.next_sync_at = time.monotonic() + backoff
            replica.last_error = reason
            log.warning("replica sync failed url=%s error=%s (retried in %.1fs)", replica.url, reason, backoff)

    def adopt_block_size(self, replica: Replica) -> None:
        size = replica.info.block_size if replica.info else None
        if not size:
            return
        self._block_sizes.add(int(size))
        if len(self._block_sizes) > 1:
            log.warning("replicas report different KV block sizes %s; routing keeps %d",
                        sorted(self._block_sizes), self.router.block_size)
        elif self.settings.proxy_block_size == 0:
            self.router.set_block_size(int(size))
