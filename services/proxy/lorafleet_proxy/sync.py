"""Catch-up: bring one replica in line with the ledger (adapters, fingerprints, pause state), then mark it ready.

Ready means it generates: before anything else a sync asks the replica for one token of the base model. /health
answers 200 as soon as vLLM's API server is up, which is not the same thing: an engine can fail at its first
request (vLLM's CPU sampler compiles through torch inductor there and needs a C++ compiler), and on CPU the first
requests compile for tens of seconds. A replica that cannot generate stays out of traffic with the replica's own
error in `last_error` and `generates: false` in GET /fleet; the warm-up also pays the first-request compile before
any rollout or probe waits on it.

A sync works without the fleet lock: it reads what the replica holds, unloads what the ledger does
not name (or names with other content), loads what is missing in ledger order, matches the fleet's
pause state, and reads the replica's adapters once more after that last change. Only then does it
take the lock, with no replica I/O inside, and mark the replica ready if that last read equals the
ledger as it is now and the pause state is unchanged (broadcasts only touch ready replicas, so the
read still holds; a broadcast that ran meanwhile may have changed the ledger, hence the comparison
with the current one). Otherwise it starts over. The whole sync has a deadline
(PROXY_LORA_LOAD_TIMEOUT_S); a sync
that fails is retried by the health loop after a backoff that doubles up to PROXY_SYNC_BACKOFF_MAX_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from lorafleet.ledger_file import Entry
from lorafleet.settings import Settings
from lorafleet.vllm_api import VLLMClient, VLLMError, VLLMUnreachable

from .ledger import Ledger
from .metrics import Metrics
from .replica import Replica, State
from .router import Router


class SyncFleet(Protocol):
    """What a sync needs of the fleet (fleet.Fleet is one); a protocol, so sync does not import fleet."""

    settings: Settings
    router: Router
    ledger: Ledger
    metrics: Metrics
    lock: asyncio.Lock

    def adopt_block_size(self, replica: Replica) -> None: ...

log = logging.getLogger("lorafleet.proxy.sync")

LOAD_RETRY_FIRST_S = 0.05
LOAD_RETRY_MAX_S = 1.0
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
    generated) before the pause, and the sync applies the fleet's pause state next.
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


def differences(replica: Replica, listed: dict[str, str], wanted: dict[str, Entry]) -> tuple[list[str], list[str]]:
    """(names to unload, names to load) so that `replica`, which lists `listed`, holds exactly `wanted`."""
    for name, path in listed.items():  # held at the ledger's path by a previous proxy: the ledger is the record
        if name not in replica.held and name in wanted and wanted[name].path == path:
            replica.held[name] = wanted[name]
    stale = [name for name in listed if name not in wanted or not replica.holds(name, wanted[name])]
    missing = [name for name in wanted if name not in listed or name in stale]
    return stale, missing


def mismatch(replica: Replica, listed: dict[str, str], paused: bool, wanted: dict[str, Entry],
             fleet_paused: str | None) -> str | None:
    """Why a replica that lists `listed` and reports `paused` may not be ready under this ledger, or None."""
    stale, missing = differences(replica, listed, wanted)
    if stale or missing:
        return f"adapters differ from the ledger: unload={stale} load={missing}"
    if paused != (fleet_paused is not None):
        return f"pause state differs from the fleet's (replica paused={paused}, fleet paused={fleet_paused})"
    return None


async def sync(fleet: SyncFleet, replica: Replica) -> None:
    """Sync `replica` to the ledger and mark it ready; on failure leave it syncing with `last_error` set."""
    replica.state = State.SYNCING
    fleet.router.forget_replica(replica.url)
    timeout = fleet.settings.proxy_lora_load_timeout_s
    stage, limit = "warm-up", WARM_UP_TIMEOUT_S
    try:
        async with asyncio.timeout(limit):  # its own bound: a first request compiles on CPU, loads do not
            replica.info = await replica.client.server_info()
            fleet.adopt_block_size(replica)
            await warm_up(replica, time.monotonic() + limit)
        stage, limit = "sync", timeout
        async with asyncio.timeout(timeout):
            started = time.monotonic()
            await _sync(fleet, replica, started + timeout)
            if replica.state is State.READY:
                fleet.metrics.replica_sync_seconds.observe(time.monotonic() - started)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any failure of one replica's sync stays with that replica
        reason = f"{stage} did not finish within {limit:.0f}s" if isinstance(exc, TimeoutError) else f"sync: {exc}"
        if not isinstance(exc, VLLMError | TimeoutError):
            reason = f"sync: malformed reply: {type(exc).__name__}: {exc}"
            fleet.metrics.loop_errors.labels("sync").inc()
        replica.sync_failures += 1
        backoff = min(fleet.settings.proxy_health_interval_s * 2 ** replica.sync_failures,
                      fleet.settings.proxy_sync_backoff_max_s)
        replica.next_sync_at = time.monotonic() + backoff
        replica.last_error = reason
        log.warning("replica sync failed url=%s error=%s (retried in %.1fs)", replica.url, reason, backoff)


async def _sync(fleet: SyncFleet, replica: Replica, deadline: float) -> None:
    while True:
        listed = await replica.client.loaded_adapters()
        replica.observe(listed)
        wanted, paused = fleet.ledger.entries(), fleet.ledger.paused
        stale, missing = differences(replica, listed, wanted)
        if stale or missing:
            log.info("replica syncing url=%s unload=%s load=%s", replica.url, stale, missing)
            await _apply(replica, wanted, stale, missing, deadline)
            continue
        if paused is not None:
            await replica.client.pause(paused)  # type: ignore[arg-type]
        else:
            await replica.client.resume()
        listed = await replica.client.loaded_adapters()  # read after the last change
        replica.observe(listed)
        async with fleet.lock:  # no broadcast half-done, and no replica I/O from here on
            # Broadcasts only touch ready replicas, so `listed` is still this replica's state; compare it with
            # the ledger as it is now (a broadcast may have changed it since it was read above).
            wanted = fleet.ledger.entries()
            if fleet.ledger.paused != paused or mismatch(replica, listed, paused is not None, wanted, paused):
                continue
            if replica.sync_task is not asyncio.current_task():
                return  # superseded (ejected, removed or re-synced meanwhile)
            replica.adapters = {name: entry.path for name, entry in wanted.items()}
            replica.state = State.READY
            replica.last_error = None
            replica.sync_failures = 0
            log.info("replica ready url=%s adapters=%s paused=%s", replica.url, list(wanted), paused)
            return


async def _apply(replica: Replica, wanted: dict[str, Entry], stale: list[str], missing: list[str],
                 deadline: float) -> None:
    for name in stale:
        try:
            await replica.client.unload_lora_adapter(name)
        except VLLMError as exc:
            if exc.status != 404:
                raise
        replica.held.pop(name, None)
    if any(name in wanted for name in stale):
        await replica.client.reset_prefix_cache()  # a name rebound to new weights: no stale blocks
    for name in missing:
        await load_until(replica.client, name, wanted[name].path, deadline)
        replica.held[name] = wanted[name]
