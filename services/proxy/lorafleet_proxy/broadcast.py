"""Fleet-wide state changes: every ready replica or none.

Each operation holds the fleet lock, so broadcasts never interleave with each other or with a
replica's final sync check. The ledger is the truth replicas converge to: a replica that fails to
undo or apply a change is taken out of traffic and re-synced rather than left inconsistent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, PlainTextResponse, Response
from lorafleet.adapters import AdapterNameError, AdapterPathError, check_adapter_name, confine
from lorafleet.vllm_api import VLLMError, VLLMUnreachable, error_body

from .fleet import Fleet, Replica, load_until

log = logging.getLogger("lorafleet.proxy.broadcast")

PAUSE_MODES = ("abort", "wait", "keep")
T = TypeVar("T")


def error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    """A vLLM-style JSON error produced by the proxy itself."""
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


def relay(exc: VLLMError, context: str) -> JSONResponse:
    """A replica's failure with its own status, type and message, plus what the proxy did about it."""
    status = exc.status or 502
    error_type = exc.error_type if exc.status else "BadGateway"
    return error(status, f"{exc.message} [proxy: {context}]", error_type)


def no_ready_replica(fleet: Fleet) -> JSONResponse:
    states = {replica.url: replica.state.value for replica in fleet.replicas.values()}
    return error(503, f"no ready replica in the fleet: {states}", "ServiceUnavailable")


async def _each(
    fleet: Fleet, replicas: list[Replica], call: Callable[[Replica], Awaitable[T]]
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


def _forget(fleet: Fleet, name: str, targets: list[Replica]) -> bool:
    """Drop `name` from the ledger, the router and the replicas' views; True when the ledger had it."""
    in_ledger = fleet.ledger.remove(name)
    fleet.router.drop_adapter(name)
    for replica in targets:
        replica.adapters.pop(name, None)
    return in_ledger


# --- load ------------------------------------------------------------------------------------------
def _check_load_request(fleet: Fleet, body: dict[str, Any]) -> tuple[str, str] | JSONResponse:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if body.get("load_inplace"):
        return error(400, "load_inplace is refused by the fleet proxy: in-place reloads keep serving prefix-cache "
                     "blocks computed with the old weights (vllm#42125). Load the new weights under a new name.",
                     "InvalidUserInput")
    try:
        check_adapter_name(name)
        resolved = confine(str(path), fleet.settings.adapter_root)
    except (AdapterNameError, AdapterPathError) as exc:
        return error(400, str(exc), "InvalidUserInput")
    return name, str(resolved)


async def load_adapter(fleet: Fleet, body: dict[str, Any]) -> Response:
    """All-or-nothing load; idempotent for the same path; a new path under a known name is a new run."""
    checked = _check_load_request(fleet, body)
    if isinstance(checked, JSONResponse):
        return checked
    name, path = checked
    async with fleet.broadcasting():
        targets = fleet.ready()
        if not targets:
            return no_ready_replica(fleet)
        known = fleet.ledger.get(name)
        if (known is not None and known != path) or any(r.adapters.get(name, path) != path for r in targets):
            rebound = await _rebind(fleet, name, targets)
            if rebound is not None:
                return rebound
        todo = [replica for replica in targets if replica.adapters.get(name) != path]
        deadline = time.monotonic() + fleet.settings.proxy_lora_load_timeout_s
        results = await _each(fleet, todo, lambda replica: _load_one(replica, name, path, deadline))
        failed = _failures(results)
        if failed:
            return await _roll_back(fleet, name, [r for r, result in results if not isinstance(result, VLLMError)],
                                    failed, len(targets))
        for replica, _ in results:
            replica.adapters[name] = path
        if fleet.ledger.get(name) != path:
            fleet.ledger.put(name, path)
        log.info("load ok name=%s path=%s replicas=%d (already there: %d)", name, path, len(targets),
                 len(targets) - len(todo))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def _load_one(replica: Replica, name: str, path: str, deadline: float) -> str:
    try:
        return await load_until(replica.client, name, path, deadline)
    except VLLMError as exc:
        # The proxy's view was stale: the replica already holds this exact adapter.
        if exc.already_loaded and (await replica.client.loaded_adapters()).get(name) == path:
            return "already loaded"
        raise


async def _roll_back(fleet: Fleet, name: str, accepted: list[Replica], failed: list[tuple[Replica, VLLMError]],
                     total: int) -> JSONResponse:
    undone = await _each(fleet, accepted, lambda replica: replica.client.unload_lora_adapter(name))
    fleet.metrics.rollbacks.labels("load").inc()
    for replica, result in _failures(undone):
        fleet.resync(replica, f"rollback unload of {name} failed: {result}")
    replica, first = failed[0]
    context = (f"{len(failed)}/{total} replica(s) failed to load {name!r}, first {replica.url}; "
               f"rolled back on {len(accepted)}")
    log.warning("load failed name=%s %s: %s", name, context, first)
    if first.adapter_not_found:
        # Never 404 to TRL (it reads 404 as "runtime LoRA disabled"): the volume did not catch up in time.
        return error(504, f"{first.message} (still missing after {fleet.settings.proxy_lora_load_timeout_s:.0f}s) "
                     f"[proxy: {context}]", "GatewayTimeout")
    return relay(first, context)


async def _rebind(fleet: Fleet, name: str, targets: list[Replica]) -> JSONResponse | None:
    """Same name, other path: a new run reusing names. Unload everywhere and reset prefix caches first."""
    log.warning("load name=%s rebinds a known name to a new path: unloading it and resetting prefix caches", name)
    unloaded = await _each(fleet, targets, lambda replica: replica.client.unload_lora_adapter(name))
    for replica, result in _failures(unloaded):
        if result.status != 404:
            fleet.resync(replica, f"unload of {name} before rebinding failed: {result}")
            return relay(result, f"unloading {name!r} before rebinding it failed on {replica.url}")
    _forget(fleet, name, targets)
    reset = await _each(fleet, targets, lambda replica: replica.client.reset_prefix_cache())
    for replica, result in _failures(reset):
        fleet.resync(replica, f"prefix-cache reset failed: {result}")
        return relay(result, f"prefix-cache reset before rebinding {name!r} failed on {replica.url}")
    return None


# --- unload ----------------------------------------------------------------------------------------
async def unload_adapter(fleet: Fleet, body: dict[str, Any]) -> Response:
    """Unload everywhere; 404 like vLLM when neither the ledger nor any replica had it."""
    name = body.get("lora_name")
    if not name:
        return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
    try:
        check_adapter_name(name)
    except AdapterNameError as exc:
        return error(400, str(exc), "InvalidUserInput")
    async with fleet.broadcasting():
        targets = fleet.ready()
        results = await _each(fleet, targets, lambda replica: replica.client.unload_lora_adapter(name))
        in_ledger = _forget(fleet, name, targets)
        removed = [replica for replica, result in results if not isinstance(result, VLLMError)]
        broken = [(replica, exc) for replica, exc in _failures(results) if exc.status != 404]
        for replica, exc in broken:
            fleet.resync(replica, f"unload of {name} failed: {exc}")  # it re-syncs to the ledger without it
        if broken and not removed:
            return relay(broken[0][1], f"unload of {name!r} failed on {len(broken)}/{len(targets)} replica(s)")
        if not removed and not in_ledger and not broken:
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        log.info("unload ok name=%s replicas=%d resyncing=%d", name, len(removed), len(broken))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


# --- pause / resume / caches -----------------------------------------------------------------------
async def pause(fleet: Fleet, mode: str) -> Response:
    """Pause every ready replica; if some fail, resume the ones already paused and report the failure."""
    if mode not in PAUSE_MODES:
        return error(400, f"Input should be 'abort', 'wait' or 'keep' (got {mode!r})", "Bad Request", "query.mode")
    async with fleet.broadcasting():
        targets = fleet.ready()
        if not targets:
            return no_ready_replica(fleet)
        results = await _each(fleet, targets, lambda replica: replica.client.pause(mode))  # type: ignore[arg-type]
        failed = _failures(results)
        if failed:
            paused = [replica for replica, result in results if not isinstance(result, VLLMError)]
            undone = await _each(fleet, paused, lambda replica: replica.client.resume())
            fleet.metrics.rollbacks.labels("pause").inc()
            for replica, exc in _failures(undone):
                fleet.resync(replica, f"resume after a partial pause failed: {exc}")
            context = f"pause failed on {len(failed)}/{len(targets)} replica(s); resumed the {len(paused)} paused"
            log.warning("pause failed mode=%s %s: %s", mode, context, failed[0][1])
            return relay(failed[0][1], context)
        fleet.paused_mode = mode
        log.info("pause ok mode=%s replicas=%d", mode, len(targets))
        return JSONResponse({"status": "paused"})


async def resume(fleet: Fleet) -> Response:
    """Resume every ready replica; one that fails leaves traffic and re-syncs (which resumes it)."""
    async with fleet.broadcasting():
        fleet.paused_mode = None
        targets = fleet.ready()
        results = await _each(fleet, targets, lambda replica: replica.client.resume())
        failed = _failures(results)
        for replica, exc in failed:
            fleet.resync(replica, f"resume failed: {exc}")
        if failed and len(failed) == len(results):
            return relay(failed[0][1], f"resume failed on every replica ({len(results)})")
        log.info("resume ok replicas=%d resyncing=%d", len(targets) - len(failed), len(failed))
        return JSONResponse({"status": "resumed"})


async def post_everywhere(fleet: Fleet, path: str, params: dict[str, str]) -> list[tuple[Replica, Any]]:
    """POST `path` to every ready replica (cache resets); results as (replica, response or VLLMError)."""
    async with fleet.broadcasting():
        return await _each(fleet, fleet.ready(),
                           lambda replica: replica.client.request("POST", path, params=params))


async def reset_cache(fleet: Fleet, path: str, params: dict[str, str]) -> Response:
    """Other cache resets (/reset_mm_cache, ...): no routing state to clear; an empty 200 when all succeed."""
    results = await post_everywhere(fleet, path, params)
    failed = _failures(results)
    return relay(failed[0][1], f"{path} failed on {failed[0][0].url}") if failed else Response()


async def reset_prefix_cache(fleet: Fleet, params: dict[str, str]) -> Response:
    results = await post_everywhere(fleet, "/reset_prefix_cache", params)
    fleet.router.clear()
    failed = _failures(results)
    if failed:
        return relay(failed[0][1], f"/reset_prefix_cache failed on {len(failed)}/{len(results)} replica(s)")
    return JSONResponse({"success": all(result.json().get("success") for _, result in results)})
