"""Catch-up: bring one replica in line with the ledger (adapters, fingerprints, pause state).

The replica's life around it (joining, the warm-up that proves it generates, ready, ejected) is told in fleet.py;
admission.py runs a catch-up as one stage of admitting a replica.

A catch-up works without the fleet lock: it reads what the replica holds, unloads what the ledger does
not name (or names with other content), loads what is missing in ledger order, matches the fleet's
pause state, and reads the replica's adapters once more after that last change. Only then does it
take the lock, with no replica I/O inside, and mark the replica ready if that last read equals the
ledger as it is now and the pause state is unchanged (broadcasts only touch ready replicas, so the
read still holds; a broadcast that ran meanwhile may have changed the ledger, hence the comparison
with the current one). Otherwise it starts over.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from lorafleet.ledger_format import Entry
from lorafleet.vllm_api import VLLMClient, VLLMError

from .replica_state import Replica


class SyncFleet(Protocol):
    """What a catch-up needs of the fleet (fleet.Fleet is one); a protocol, so sync does not import fleet."""

    lock: asyncio.Lock

    @property
    def paused(self) -> str | None: ...

    def wanted(self) -> dict[str, Entry]: ...

    async def verify(self, replica: Replica) -> None: ...

    def mark_ready(self, replica: Replica, adapters: dict[str, str]) -> None: ...


log = logging.getLogger("lorafleet.proxy.sync")

T = TypeVar("T")
LOAD_RETRY_FIRST_S = 0.05
LOAD_RETRY_MAX_S = 1.0


async def retry_until(call: Callable[[], Awaitable[T]], missing: Callable[[Exception], bool], deadline: float) -> T:
    """`call()`, retried with backoff while it fails with an error `missing` says is an adapter not there yet (a
    volume not caught up), until `deadline`; the last error then raises."""
    delay = LOAD_RETRY_FIRST_S
    while True:
        try:
            return await call()
        except Exception as exc:
            if not missing(exc) or time.monotonic() + delay >= deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, LOAD_RETRY_MAX_S)


async def load_until(client: VLLMClient, name: str, path: str, deadline: float) -> str:
    """Load one adapter, retrying "No adapter found" (a volume not caught up yet) with backoff until `deadline`."""
    attempts = 0

    async def load() -> str:
        nonlocal attempts
        attempts += 1
        return await client.load_lora_adapter(name, path, timeout=max(deadline - time.monotonic(), 1.0))

    answer = await retry_until(load, lambda exc: isinstance(exc, VLLMError) and exc.adapter_not_found, deadline)
    log.info("load name=%s replica=%s attempts=%d", name, client.base_url, attempts)
    return answer


def differences(replica: Replica, listed: dict[str, str], wanted: dict[str, Entry]) -> tuple[list[str], list[str]]:
    """(names to unload, names to load) so that `replica`, which lists `listed`, holds exactly `wanted`."""
    for name, path in listed.items():  # held at the ledger's path by a previous proxy: the ledger is the record
        if name not in replica.held and name in wanted and wanted[name].path == path:
            replica.held[name] = wanted[name]
    stale = [name for name in listed
             if name not in wanted or not replica.holds(name, wanted[name]) or name in replica.suspect]
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


async def catch_up(fleet: SyncFleet, replica: Replica, deadline: float) -> None:
    """Loop until `replica` holds exactly the ledger and the fleet's pause state, then mark it ready (or return
    when another sync superseded this one)."""
    if "" in replica.suspect:  # the canary doubted its base model: no cache block computed before survives
        await replica.client.reset_prefix_cache()
        replica.suspect.discard("")
    while True:
        listed = await replica.client.loaded_adapters()
        replica.observe(listed)
        wanted, paused = fleet.wanted(), fleet.paused
        stale, missing = differences(replica, listed, wanted)
        if stale or missing:
            log.info("replica syncing url=%s unload=%s load=%s", replica.url, stale, missing)
            await _apply(fleet, replica, wanted, stale, missing, deadline)
            continue
        if paused is not None:
            await replica.client.pause(paused)  # type: ignore[arg-type]
        else:
            await replica.client.resume()
        if paused is None:
            await fleet.verify(replica)  # the canary's probe (a paused replica would queue it until the resume)
        listed = await replica.client.loaded_adapters()  # read after the last change
        replica.observe(listed)
        async with fleet.lock:  # no broadcast half-done, and no replica I/O from here on
            # Broadcasts only touch ready replicas, so `listed` is still this replica's state; compare it with
            # the ledger as it is now (a broadcast may have changed it since it was read above).
            wanted = fleet.wanted()
            if fleet.paused != paused or mismatch(replica, listed, paused is not None, wanted, paused):
                continue
            if replica.sync_task is not asyncio.current_task():
                return  # superseded (ejected, removed or re-synced meanwhile)
            fleet.mark_ready(replica, {name: entry.path for name, entry in wanted.items()})
            log.info("replica ready url=%s adapters=%s paused=%s", replica.url, list(replica.adapters), paused)
            return


async def _apply(fleet: SyncFleet, replica: Replica, wanted: dict[str, Entry], stale: list[str], missing: list[str],
                 deadline: float) -> None:
    for name in stale:
        try:
            await replica.client.unload_lora_adapter(name)
        except VLLMError as exc:
            if exc.status != 404:
                raise
        replica.held.pop(name, None)
        if name not in wanted:
            replica.suspect.discard(name)
    if any(name in wanted for name in stale):
        await replica.client.reset_prefix_cache()  # a name rebound to new weights, or doubted: no stale blocks
    for name in missing:  # from the content store: no file a trainer can change
        await load_until(replica.client, name, wanted[name].path, deadline)
        replica.held[name] = wanted[name]
        replica.suspect.discard(name)
