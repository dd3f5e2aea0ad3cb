"""Fleet-wide state changes: every ready replica or none.

Each operation runs under `guarded` (the fleet lock, nothing while the ledger is rebuilt, the ready replicas as
targets), compensates when a replica fails (roll back those that applied it, or take the failing one out of traffic
to re-sync), and is acknowledged only once the ledger holds it on disk (a failed write puts the replicas back: a
500 naming the cause). Load, pause and resume change the replicas first and the ledger second; unload (and the
unload half of a rebind) the ledger first. Each broadcast's rules: docs/concepts/sync.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from lorafleet.adapters import AdapterNameError, check_adapter_name
from lorafleet.ledger_format import Entry, LedgerState, RunRecord
from lorafleet.logs import log_event
from lorafleet.runs import DEFAULT_RUN
from lorafleet.vllm_api import VLLMError, VLLMUnreachable

from .canary import Key
from .content_store import ContentError, ContentStore, NoAdapter, Stored
from .errors import FleetStates, adapter_not_found, error, ledger_failed, no_ready_replica, rebuilding, relay
from .replica_state import Replica, State
from .sync import load_until, retry_until

log = logging.getLogger("lorafleet.proxy.broadcast")


class BroadcastFleet(FleetStates, Protocol):
    """What a fleet-wide change needs of the fleet (fleet.Fleet is one): its lock and targets, the ledger read and
    written, the canary's and attestation's verdicts, and the changes of replica state a broadcast makes."""

    @property
    def paused(self) -> str | None: ...

    @property
    def rebuilding(self) -> bool: ...

    @property
    def load_timeout_s(self) -> float: ...

    def broadcasting(self) -> AbstractAsyncContextManager[None]: ...

    def ready(self) -> list[Replica]: ...

    # The ledger: each write answers the error it met (None: written).
    def snapshot(self) -> LedgerState: ...

    def recorded(self, name: str) -> Entry | None: ...

    def commit(self, state: LedgerState) -> Exception | None: ...

    def record_load(self, name: str, entry: Entry, runs: dict[str, RunRecord]) -> Exception | None: ...

    def record_unload(self, name: str) -> Exception | None: ...

    def record_pause(self, mode: str | None) -> Exception | None: ...

    # The verdicts a load waits for.
    async def judge(self, subject: str, replicas: list[Replica], key: Key | None = None,
                    ) -> tuple[list[Replica], bool, str]: ...

    async def attest_load(self, name: str, entry: Entry, holders: list[Replica],
                          ) -> tuple[Entry, dict[Replica, str]]: ...

    # What a broadcast changes of the replicas' states.
    def eject(self, replica: Replica, error: str) -> None: ...

    def resync(self, replica: Replica, reason: str) -> None: ...

    def quarantine(self, replica: Replica, subject: str, reason: str) -> None: ...

    def distrust(self, replica: Replica, subjects: list[str], reason: str) -> None: ...

    def mark_loaded(self, name: str, entry: Entry) -> None: ...

    def mark_unloaded(self, name: str, replicas: list[Replica]) -> None: ...

    def prefix_caches_reset(self) -> None: ...

    def rolled_back(self, operation: str) -> None: ...

    def load_phase(self, phase: str) -> AbstractContextManager[None]: ...


PAUSE_MODES = ("abort", "wait", "keep")
T = TypeVar("T")
P = ParamSpec("P")
Operation = Callable[Concatenate[BroadcastFleet, list[Replica], P], Awaitable[Response]]  # (fleet, targets, ...)
Guarded = Callable[Concatenate[BroadcastFleet, P], Awaitable[Response]]  # (fleet, ...)


def guarded(*, needs_ready: bool = True) -> Callable[[Operation[P]], Guarded[P]]:
    """The guard every fleet-wide change runs under: the fleet lock held (broadcasts never interleave with each
    other or with a sync's final check), nothing done while the ledger is being rebuilt, and the ready replicas
    as targets (a 503 when there are none, unless the operation `needs_ready=False`)."""

    def wrap(operation: Operation[P]) -> Guarded[P]:
        @functools.wraps(operation)
        async def run(fleet: BroadcastFleet, *args: P.args, **kwargs: P.kwargs) -> Response:
            async with fleet.broadcasting():
                if fleet.rebuilding:
                    return rebuilding(fleet)
                targets = fleet.ready()
                if needs_ready and not targets:
                    return no_ready_replica(fleet)
                return await operation(fleet, targets, *args, **kwargs)

        return run

    return wrap


async def _each(
    fleet: BroadcastFleet, replicas: list[Replica], call: Callable[[Replica], Awaitable[T]]
) -> list[tuple[Replica, T | VLLMError]]:
    """Run `call` on every replica concurrently; VLLMErrors come back as results, anything else raises.

    A replica that gives no answer at all (connection refused or reset: it died) is ejected and left out
    of the results, so a broadcast is all-or-nothing over the replicas that are alive; the ejected one
    re-syncs to the ledger before it gets traffic again. If none answers, the errors are returned.
    """
    results = await asyncio.gather(*(call(replica) for replica in replicas), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, VLLMError):
            raise result
    pairs: list[tuple[Replica, Any]] = list(zip(replicas, results, strict=True))
    answered = [(replica, result) for replica, result in pairs if not isinstance(result, VLLMUnreachable)]
    if not answered:
        return pairs
    for replica, result in pairs:
        if isinstance(result, VLLMUnreachable):
            fleet.eject(replica, f"no answer during a broadcast: {result.message}")
    return answered


def _failures(results: list[tuple[Replica, Any]]) -> list[tuple[Replica, VLLMError]]:
    return [(replica, result) for replica, result in results if isinstance(result, VLLMError)]


# --- load ------------------------------------------------------------------------------------------
def _check_load_request(fleet: BroadcastFleet, body: dict[str, Any]) -> tuple[str, str] | JSONResponse:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if body.get("load_inplace"):
        return error(400, "load_inplace is refused by the fleet proxy: in-place reloads keep serving prefix-cache "
                     "blocks computed with the old weights (vllm#42125). Load the new weights under a new name.",
                     "InvalidUserInput")
    try:
        check_adapter_name(name)
    except AdapterNameError as exc:
        return error(400, str(exc), "InvalidUserInput")
    return name, str(path)


async def load_adapter(fleet: BroadcastFleet, content: ContentStore, body: dict[str, Any], run: str = DEFAULT_RUN,
                       admit: Callable[[LedgerState], JSONResponse | None] | None = None) -> Response:
    """All-or-nothing load; idempotent for the same path and content; a new path or new content under a
    known name is a rebind (unload everywhere, reset prefix caches, load), never "already loaded".

    The replicas load the copy in `content` (the store the ledger's entries name); `body["lora_name"]` is the
    fleet-unique name of `run`'s adapter; `admit` (under the fleet lock, before any replica is touched) may register
    the run in the state it is given, or refuse the load (runs)."""
    checked = _check_load_request(fleet, body)
    if isinstance(checked, JSONResponse):
        return checked
    name, path = checked
    with fleet.load_phase("store"):
        stored = await _store(content, path, fleet.load_timeout_s)
    if isinstance(stored, JSONResponse):
        return stored
    with content.pinned(stored):
        return await _load(fleet, name, Entry(stored.path, stored.fingerprint, run, stored.source), admit)


async def _store(content: ContentStore, path: str, timeout_s: float) -> Stored | JSONResponse:
    """Copy the adapter folder `path` (as the route confined it: runs.confinement) into the content store, through the
    store's one walk (in a thread: the event loop goes on), retrying while it has no adapter_config.json (the volume
    catching up) until the load's deadline; then a 400. Nothing here resolves `path`: the walk is the check."""
    try:
        return await retry_until(lambda: asyncio.to_thread(content.ingest, path),
                                 lambda exc: isinstance(exc, NoAdapter), time.monotonic() + timeout_s)
    except NoAdapter as exc:  # the client named no adapter; never 404 to TRL (it reads 404 as "runtime LoRA disabled")
        return error(400, f"{exc} (still missing after {timeout_s:.0f}s)", "InvalidUserInput", "lora_path")
    except ContentError as exc:
        log_event(log, "load_refused", logging.WARNING, path=path, error=exc)
        return error(400, str(exc), "InvalidUserInput", "lora_path")


@guarded()
async def _load(fleet: BroadcastFleet, targets: list[Replica], name: str, entry: Entry,
                admit: Callable[[LedgerState], JSONResponse | None] | None) -> Response:
    path = entry.path
    planned = fleet.snapshot()  # the load's admission may register its run here
    if admit is not None and (refusal := admit(planned)) is not None:
        return refusal
    known = fleet.recorded(name)
    if (known is not None and not _same(known, entry)) or any(
            name in r.held and not r.holds(name, entry) for r in targets):
        rebound = await _rebind(fleet, name, targets)
        if rebound is not None:
            return rebound
    todo = [replica for replica in targets if replica.state is State.READY and not replica.holds(name, entry)]
    deadline = time.monotonic() + fleet.load_timeout_s
    with fleet.load_phase("load"):
        results = await _each(fleet, todo, lambda replica: _load_one(replica, name, path, deadline))
    loaded = [replica for replica, result in results if not isinstance(result, VLLMError)]
    failed = _failures(results)
    if failed:
        return await _roll_back(fleet, name, loaded, failed, len(targets))
    if fleet.paused is None:  # a paused replica would queue the probe: the round after the resume asks
        with fleet.load_phase("canary"):
            refusal = await _canary_gate(fleet, name, entry, [r for r in targets if r.state is State.READY], deadline)
        if refusal is not None:
            return refusal
    with fleet.load_phase("attest"):
        attested = await _attestation_gate(fleet, name, entry, [r for r in targets if r.state is State.READY])
    if not isinstance(attested, Entry):
        return attested
    entry = attested
    with fleet.load_phase("ledger"):
        recorded = fleet.record_load(name, entry, planned.runs)
    if (exc := recorded) is not None:
        await _unload_from(fleet, name, loaded, "rollback after a failed ledger write")
        return ledger_failed(exc, f"the load of {name!r} was rolled back on {len(loaded)} replica(s)")
    fleet.mark_loaded(name, entry)
    log.info("load ok name=%s path=%s source=%s fingerprint=%s replicas=%d (already there: %d)", name, path,
             entry.source, entry.fingerprint, len(targets), len(targets) - len(todo))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _canary_gate(fleet: BroadcastFleet, name: str, entry: Entry, holders: list[Replica],
                       deadline: float) -> Response | None:
    """The load answers only after the canary ran on it: a replica whose answer departs is quarantined before it
    ever serves the name. Without a majority (two replicas that disagree) both reload the adapter from its files
    once and are asked again; if they still disagree nothing tells which is right, and the load is rolled back."""
    key = (name, entry.fingerprint or entry.path)
    odd, decided, why = await fleet.judge(name, holders, key)
    if not decided and len(holders) > 1:
        log.warning("canary undecided at the load of %s (%s): reloading it on %d replicas", name, why, len(holders))
        await _each(fleet, holders, lambda replica: _reload(replica, name, entry.path, deadline))
        odd, decided, why = await fleet.judge(name, holders, key)
        if not decided:
            await _unload_from(fleet, name, holders, "rollback: the canary could not decide")
            return error(502, f"canary: the replicas answer differently with {name!r} even after reloading it, and "
                         f"no majority can tell which is right ({why}); the load was rolled back", "CanaryDisagreement")
    for replica in odd:
        fleet.quarantine(replica, name, why)
    return None if fleet.ready() else no_ready_replica(fleet)


async def _attestation_gate(fleet: BroadcastFleet, name: str, entry: Entry, holders: list[Replica]) -> Entry | Response:
    """The load answers only after the replicas' engines attested it (attestation.py): the entry gains its reference;
    a replica that disagrees is distrusted; when none agrees (vLLM applying fewer of its modules than its files name,
    vllm#34186) the load is rolled back."""
    entry, odd = await fleet.attest_load(name, entry, holders)
    if odd and len(odd) == len(holders):
        await _unload_from(fleet, name, holders, "rollback: no replica's engine attests it")
        why = "; ".join(sorted(set(odd.values())))
        applied = all("projections its files name" in reason for reason in odd.values())
        return error(400 if applied else 502, f"attestation: {why}; the load was rolled back",
                     "InvalidUserInput" if applied else "AttestationDisagreement", "lora_path" if applied else None)
    for replica, why in odd.items():
        fleet.distrust(replica, [name], f"attestation: {why}")
    return entry


async def _reload(replica: Replica, name: str, path: str, deadline: float) -> str:
    """Unload, reset the prefix cache, load again: the adapter read afresh from its files."""
    await replica.client.unload_lora_adapter(name)
    await replica.client.reset_prefix_cache()
    return await load_until(replica.client, name, path, deadline)


def _same(known: Entry, entry: Entry) -> bool:
    """Same adapter: the same store folder, so the same content (a store folder is named by its content)."""
    return known.path == entry.path


async def _load_one(replica: Replica, name: str, path: str, deadline: float) -> str:
    try:
        return await load_until(replica.client, name, path, deadline)
    except VLLMError as exc:
        # The proxy's view was stale: the replica already holds this exact adapter.
        if exc.already_loaded and (await replica.client.loaded_adapters()).get(name) == path:
            return "already loaded"
        raise


async def _unload_from(fleet: BroadcastFleet, name: str, replicas: list[Replica], why: str) -> None:
    """Unload `name` from `replicas`; one that fails leaves traffic and re-syncs to the ledger."""
    undone = await _each(fleet, replicas, lambda replica: replica.client.unload_lora_adapter(name))
    for replica, result in _failures(undone):
        if result.status != 404:
            fleet.resync(replica, f"{why}: unload of {name} failed: {result}")
    fleet.mark_unloaded(name, replicas)


async def unload_from_ready(fleet: BroadcastFleet, name: str, why: str) -> None:
    """Unload `name` from every ready replica (the caller took the lock and dropped it from the ledger)."""
    await _unload_from(fleet, name, fleet.ready(), why)


async def _roll_back(fleet: BroadcastFleet, name: str, accepted: list[Replica], failed: list[tuple[Replica, VLLMError]],
                     total: int) -> JSONResponse:
    await _unload_from(fleet, name, accepted, "rollback")
    fleet.rolled_back("load")
    replica, first = failed[0]
    context = (f"{len(failed)}/{total} replica(s) failed to load {name!r}, first {replica.url}; "
               f"rolled back on {len(accepted)}")
    log.warning("load failed name=%s %s: %s", name, context, first)
    if first.adapter_not_found:
        # Never 404 to TRL (it reads 404 as "runtime LoRA disabled"): the volume did not catch up in time.
        return error(504, f"{first.message} (still missing after {fleet.load_timeout_s:.0f}s) "
                     f"[proxy: {context}]", "GatewayTimeout")
    return relay(first, context)


async def _rebind(fleet: BroadcastFleet, name: str, targets: list[Replica]) -> JSONResponse | None:
    """Same name, other path or content: unload everywhere and reset prefix caches before the load.

    The ledger drops the name first; if no replica could unload it, the ledger gets it back."""
    log.warning("load name=%s rebinds a known name to other weights: unloading it and resetting prefix caches", name)
    previous = fleet.snapshot()
    if (exc := fleet.record_unload(name)) is not None:
        return ledger_failed(exc, f"nothing was changed on the replicas (rebinding {name!r})")
    unloaded = await _each(fleet, targets, lambda replica: replica.client.unload_lora_adapter(name))
    broken = [(replica, result) for replica, result in _failures(unloaded) if result.status != 404]
    if broken and len(broken) == len(unloaded):
        fleet.commit(previous)
        return relay(broken[0][1], f"unloading {name!r} before rebinding it failed on every replica")
    for replica, result in broken:
        fleet.resync(replica, f"unload of {name} before rebinding failed: {result}")
    fleet.mark_unloaded(name, targets)
    reset = await _each(fleet, [r for r in targets if r.state is State.READY],
                        lambda replica: replica.client.reset_prefix_cache())
    for replica, result in _failures(reset):
        fleet.resync(replica, f"prefix-cache reset before rebinding {name} failed: {result}")
    return None if fleet.ready() else no_ready_replica(fleet)


# --- unload ----------------------------------------------------------------------------------------
async def unload_adapter(fleet: BroadcastFleet, body: dict[str, Any]) -> Response:
    """Unload everywhere; 404 like vLLM when neither the ledger nor any replica had it.

    The ledger drops the name first. If every replica fails to unload it, the ledger gets it back and
    the error is returned (no replica leaves traffic); a replica that fails alone re-syncs without it."""
    name = body.get("lora_name")
    if not name:
        return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
    try:
        check_adapter_name(name)
    except AdapterNameError as exc:
        return error(400, str(exc), "InvalidUserInput")
    return await _unload(fleet, name)


@guarded(needs_ready=False)
async def _unload(fleet: BroadcastFleet, targets: list[Replica], name: str) -> Response:
    previous = fleet.snapshot()
    in_ledger = name in previous.adapters
    if (exc := fleet.record_unload(name)) is not None:
        return ledger_failed(exc, f"{name!r} was not unloaded from any replica")
    results = await _each(fleet, targets, lambda replica: replica.client.unload_lora_adapter(name))
    removed = [replica for replica, result in results if not isinstance(result, VLLMError)]
    absent = [replica for replica, result in _failures(results) if result.status == 404]
    broken = [(replica, exc) for replica, exc in _failures(results) if exc.status != 404]
    if broken and not removed and not absent:
        if in_ledger and (exc := fleet.commit(previous)) is not None:
            log.error("unload name=%s failed everywhere and the ledger could not be restored: %s", name, exc)
        return relay(broken[0][1], f"unload of {name!r} failed on every replica ({len(broken)}); "
                     "nothing changed")
    fleet.mark_unloaded(name, removed + absent)
    for replica, exc in broken:
        fleet.resync(replica, f"unload of {name} failed: {exc}")  # it re-syncs to the ledger without it
    if not removed and not in_ledger and not broken:
        return adapter_not_found(name)
    log.info("unload ok name=%s replicas=%d resyncing=%d", name, len(removed), len(broken))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


# --- pause / resume / caches -----------------------------------------------------------------------
async def _set_pause(fleet: BroadcastFleet, replicas: list[Replica], mode: str | None, why: str) -> None:
    """Put `replicas` back into pause state `mode` (None = running); one that fails re-syncs."""
    if not replicas:
        return
    call = ((lambda replica: replica.client.pause(mode)) if mode is not None  # type: ignore[arg-type]
            else (lambda replica: replica.client.resume()))
    for replica, exc in _failures(await _each(fleet, replicas, call)):
        fleet.resync(replica, f"{why}: {exc}")


async def pause(fleet: BroadcastFleet, mode: str) -> Response:
    """Pause every ready replica and record the pause in the ledger; if some fail (or the ledger write
    does), the replicas that paused are put back in the fleet's previous state and the failure reported."""
    if mode not in PAUSE_MODES:
        return error(400, f"Input should be 'abort', 'wait' or 'keep' (got {mode!r})", "Bad Request", "query.mode")
    return await _pause(fleet, mode)


@guarded()
async def _pause(fleet: BroadcastFleet, targets: list[Replica], mode: str) -> Response:
    previous = fleet.paused
    results = await _each(fleet, targets, lambda replica: replica.client.pause(mode))  # type: ignore[arg-type]
    paused = [replica for replica, result in results if not isinstance(result, VLLMError)]
    failed = _failures(results)
    if failed:
        if previous is None:
            await _set_pause(fleet, paused, None, "resume after a partial pause failed")
        fleet.rolled_back("pause")
        context = (f"pause failed on {len(failed)}/{len(targets)} replica(s); the {len(paused)} paused are "
                   f"back to the fleet's previous state ({'paused' if previous else 'running'})")
        log.warning("pause failed mode=%s %s: %s", mode, context, failed[0][1])
        return relay(failed[0][1], context)
    if (exc := fleet.record_pause(mode)) is not None:
        if previous is None:
            await _set_pause(fleet, paused, None, "resume after a failed ledger write")
        return ledger_failed(exc, "the replicas are back to the fleet's previous pause state")
    log.info("pause ok mode=%s replicas=%d", mode, len(targets))
    return JSONResponse({"status": "paused"})


@guarded(needs_ready=False)
async def resume(fleet: BroadcastFleet, targets: list[Replica]) -> Response:
    """Resume every ready replica and record it in the ledger. If every replica fails, nothing changes and
    the error is returned; one that fails alone leaves traffic and re-syncs (which resumes it)."""
    previous = fleet.paused
    results = await _each(fleet, targets, lambda replica: replica.client.resume())
    resumed = [replica for replica, result in results if not isinstance(result, VLLMError)]
    failed = _failures(results)
    if failed and not resumed:
        return relay(failed[0][1], f"resume failed on every replica ({len(results)}); the fleet stays "
                     f"{'paused' if previous else 'running'}")
    if (exc := fleet.record_pause(None)) is not None:
        await _set_pause(fleet, resumed, previous, "pause again after a failed ledger write")
        return ledger_failed(exc, "the replicas are back to the fleet's previous pause state")
    for replica, exc in failed:
        fleet.resync(replica, f"resume failed: {exc}")
    log.info("resume ok replicas=%d resyncing=%d", len(resumed), len(failed))
    return JSONResponse({"status": "resumed"})


async def post_everywhere(fleet: BroadcastFleet, path: str, params: dict[str, str]) -> list[tuple[Replica, Any]]:
    """POST `path` to every ready replica (cache resets); results as (replica, response or VLLMError)."""
    async with fleet.broadcasting():
        return await _each(fleet, fleet.ready(),
                           lambda replica: replica.client.request("POST", path, params=params))


async def reset_cache(fleet: BroadcastFleet, path: str, params: dict[str, str]) -> Response:
    """Other cache resets (/reset_mm_cache, ...): no routing state to clear; an empty 200 when all succeed."""
    results = await post_everywhere(fleet, path, params)
    failed = _failures(results)
    return relay(failed[0][1], f"{path} failed on {failed[0][0].url}") if failed else Response()


async def reset_prefix_cache(fleet: BroadcastFleet, params: dict[str, str]) -> Response:
    results = await post_everywhere(fleet, "/reset_prefix_cache", params)
    fleet.prefix_caches_reset()
    failed = _failures(results)
    if failed:
        return relay(failed[0][1], f"/reset_prefix_cache failed on {len(failed)}/{len(results)} replica(s)")
    return JSONResponse({"success": all(result.json().get("success") for _, result in results)})
