"""The proxy's FastAPI app: one vLLM server (data_parallel_size 1) in front of the fleet.

`create_app(settings)` builds everything (router, ledger, fleet, forwarder, metrics) for one app, so
tests can run several in one process. The lifespan starts discovery and health checks.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, Literal

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from lorafleet.ledger_file import LedgerState, entries_json
from lorafleet.runs import DEFAULT_RUN, qualify
from lorafleet.settings import ConfigError, Settings
from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER, VLLMError
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from . import broadcast
from .broadcast import error, no_ready_replica, relay
from .elision import PUBLIC_PORT_SCOPE_KEY, PauseElision, on_public_port
from .fairshare import FairShare
from .fleet import Fleet, State
from .front import READ_ONLY_ROUTES, ROUTES, Front, Upstreams
from .ledger import Ledger, ledger_path
from .metrics import Metrics
from .openapi import document
from .requests import (
    LoadLoRAAdapterRequest,
    PauseMode,
    RegisterRunRequest,
    ResetPrefixCacheQuery,
    UnloadLoRAAdapterRequest,
    validation_error,
)
from .router import Router
from .runs import RUN_SCOPE_KEY, Runs, foreign_name, renamed

log = logging.getLogger("lorafleet.proxy")

DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default, until a replica reports its own
# Dev routes that change one engine's state: broadcasting them would need their own all-or-nothing
# semantics (and the merged-weight sync they serve cannot work across replicas), so they are refused.
REFUSED_ROUTES = ("/sleep", "/wake_up", "/collective_rpc", "/abort_requests", "/release_kv_cache_memory",
                  "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/start_draft_weight_update", "/update_weight_version", "/get_world_size", "/weight_info")
CACHE_RESET_ROUTES = ("/reset_mm_cache", "/reset_encoder_cache")


def require_upstreams(settings: Settings) -> None:
    if not settings.upstream_urls and not settings.proxy_upstream_dns:
        raise ConfigError("PROXY_UPSTREAMS / PROXY_UPSTREAM_DNS: set one of them (replica base URLs, or host:port "
                          "of a DNS name that resolves to every replica)")


class BearerAuth:
    """The public port: every request needs `Authorization: Bearer <PROXY_API_KEY>` (401 vLLM-style otherwise)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: a valid 'Authorization: Bearer <key>' header is required"
                await error(401, message, "Unauthorized")(scope, receive, send)
                return
            scope = {**scope, PUBLIC_PORT_SCOPE_KEY: True}  # routes treat operators' calls apart (pause elision)
        await self.app(scope, receive, send)


class ProxyApp(FastAPI):
    """FastAPI with the generation front before its middleware stack: rollouts never enter FastAPI's machinery."""

    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app for these settings; `transport` replaces the network for in-process tests."""
    require_upstreams(settings)
    metrics = Metrics()
    router = Router(settings.proxy_routing, settings.proxy_imbalance, settings.proxy_max_tracked_blocks,
                    settings.proxy_block_size or DEFAULT_BLOCK_SIZE, settings.proxy_route_max_blocks)
    ledger = Ledger(ledger_path(settings.adapter_root), settings.adapter_root)
    ledger.restore()
    fleet = Fleet(settings, router, ledger, transport, metrics)
    upstreams = Upstreams(settings.proxy_request_timeout_s, settings.proxy_upstream_token)
    elision = PauseElision(settings.proxy_sync_pause)
    runs = Runs(settings, fleet, metrics)
    fair = FairShare(lambda: settings.proxy_fair_inflight_per_replica * max(len(fleet.ready()), 1))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("proxy starting routing=%s upstreams=%s dns=%s ledger=%s adapters=%d", settings.proxy_routing,
                 settings.upstream_urls, settings.proxy_upstream_dns or "-", ledger.path, len(ledger))
        await fleet.start()
        fleet.supervise("leases", runs.expire_idle, min(settings.run_lease_s / 4, settings.proxy_health_interval_s))
        try:
            yield
        finally:
            await fleet.stop()
            upstreams.close()

    app = ProxyApp(title="lorafleet proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                   openapi_url="/openapi.json", exception_handlers={RequestValidationError: validation_error})
    app.state.fleet, app.state.router, app.state.ledger, app.state.metrics = fleet, router, ledger, metrics
    app.state.runs, app.state.fair = runs, fair

    def run_of_request(request: Request) -> str:
        return request.scope.get(RUN_SCOPE_KEY, DEFAULT_RUN)  # type: ignore[no-any-return]

    async def timed(op: str, call: Awaitable[Response]) -> Response:
        started = time.perf_counter()
        response = await call
        metrics.broadcast_done(op, response.status_code, time.perf_counter() - started)
        metrics.track_pause(fleet.ledger.paused is not None)  # pause -> resume observes the generation stall
        return response

    # --- relayed to one replica by the front (front.py) before FastAPI; these routes document them -------
    async def relayed_route(request: Request) -> Response:
        """vLLM's call, relayed to one replica: generation by prefix affinity, helpers to the least loaded."""
        return error(500, f"{request.url.path} must be served by the proxy's front", "InternalServerError")

    for path, method in [*((path, "POST") for path in ROUTES), *READ_ONLY_ROUTES.items()]:
        app.add_api_route(path, relayed_route, methods=[method])

    # --- fleet-wide state changes ------------------------------------------------------------------
    def not_its_own(run: str, name: str) -> Response:
        where = "another run's adapter name" if run == DEFAULT_RUN else f"not a name of run {run!r}"
        return error(400, f"invalid adapter name {name!r}: {where} (names with '--' are run-qualified; a run "
                     "reaches its own adapters under /runs/<run>/)", "InvalidUserInput")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request, body: LoadLoRAAdapterRequest) -> Response:
        run, name = run_of_request(request), body.lora_name
        if foreign_name(run, name):
            return not_its_own(run, name)
        qualified = qualify(run, name)

        def admit(state: LedgerState) -> Response | None:
            return runs.admit(state, run) or runs.check_load(state, run, qualified)

        load = broadcast.load_adapter(fleet, {**body.model_dump(), "lora_name": qualified}, run, admit)
        return renamed(await timed("load", load), qualified, name)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterRequest) -> Response:
        run, name = run_of_request(request), body.lora_name
        if foreign_name(run, name):
            return error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        qualified = qualify(run, name)
        unload = broadcast.unload_adapter(fleet, {**body.model_dump(), "lora_name": qualified})
        return renamed(await timed("unload", unload), qualified, name)

    @app.post("/register")
    async def register(request: Request, body: RegisterRunRequest) -> Response:
        """lorafleet's own: reserve a run's LoRA slots (max_staleness + 2) and set its fair-share weight."""
        return await runs.register(run_of_request(request), body.max_staleness, body.weight)

    @app.post("/pause")
    async def pause(request: Request, mode: PauseMode = "abort") -> Response:
        run = run_of_request(request)
        if elision.elide_pause(request.scope, mode, run):
            metrics.pauses_elided.inc()
            return JSONResponse({"status": "paused"})
        if run != DEFAULT_RUN:
            return await runs.pause(run, mode)  # held at the proxy: no replica pauses for one run
        return await timed("pause", broadcast.pause(fleet, mode))

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        run = run_of_request(request)
        if elision.elide_resume(request.scope, run):
            return JSONResponse({"status": "resumed"})
        if run != DEFAULT_RUN:
            return await runs.resume(run)
        return await timed("resume", broadcast.resume(fleet))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(query: Annotated[ResetPrefixCacheQuery, Query()]) -> Response:
        return await timed("reset_prefix_cache", broadcast.reset_prefix_cache(fleet, query.params()))

    async def reset_other_cache(request: Request) -> Response:
        return await broadcast.reset_cache(fleet, request.url.path, {})  # vLLM's routes take no parameters

    for path in CACHE_RESET_ROUTES:
        app.add_api_route(path, reset_other_cache, methods=["POST"])

    async def refused(request: Request) -> Response:
        # 403, not 5xx: a refusal by policy (these routes are open on the replicas even with --api-key).
        return error(403, f"{request.url.path} is refused by the lorafleet proxy: it changes one engine's "
                     "state and would leave the replicas inconsistent. Adapter-only sync (runtime LoRA) is the "
                     "supported way to update the fleet's policy.", "Forbidden")

    for path in REFUSED_ROUTES:
        for method in ("GET", "POST"):
            app.add_api_route(path, refused, methods=[method], operation_id=f"refused_{method}{path}".lower())

    # --- read-only ---------------------------------------------------------------------------------
    @app.get("/is_paused")
    async def is_paused(request: Request) -> Response:  # the replicas' own state: an elided pause paused none
        run = run_of_request(request)
        if run != DEFAULT_RUN:
            return JSONResponse({"is_paused": runs.paused(run)})  # the run's pause, held at the proxy
        ready = fleet.ready()
        if not ready:
            return no_ready_replica(fleet)
        answers = await asyncio.gather(*(replica.client.is_paused() for replica in ready), return_exceptions=True)
        return JSONResponse({"is_paused": any(answer is True for answer in answers)})

    @app.get("/server_info")
    async def server_info(request: Request, config_format: Literal["text", "json"] = "text") -> Response:
        """Every ready replica is asked. json: the fleet's view (LoRA limits all honour); text: one replica's own."""
        ready = fleet.ready()
        if not ready:
            return no_ready_replica(fleet)
        params = {"config_format": config_format}
        results = await asyncio.gather(*(r.client.request("GET", "/server_info", params=params) for r in ready),
                                       return_exceptions=True)
        answers = [(replica, result) for replica, result in zip(ready, results, strict=True)
                   if isinstance(result, httpx.Response)]
        if not answers:
            first = next(result for result in results if isinstance(result, BaseException))
            if isinstance(first, VLLMError):
                return relay(first, "/server_info failed on every ready replica")
            raise first
        if config_format == "json":
            merged = _fleet_server_info([answer.json() for _, answer in answers])
            run = run_of_request(request)
            lora = merged["vllm_config"].get("lora_config")
            if run != DEFAULT_RUN and isinstance(lora, dict):
                lora["max_loras"] = lora["max_cpu_loras"] = runs.slots_for(run)  # what TRL checks its staleness on
            return JSONResponse(merged)
        replica, answer = answers[0]
        return Response(answer.content, media_type=answer.headers.get("content-type"),
                        headers={PROXY_UPSTREAM_HEADER: replica.url})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ready = fleet.ready()
        if not ready:
            return no_ready_replica(fleet)
        try:
            data = (await ready[0].client.request("GET", "/v1/models")).json().get("data", [])
        except VLLMError as exc:
            return relay(exc, f"/v1/models failed on {ready[0].url}")
        base = [card for card in data if card.get("parent") is None][:1]
        cards = {card["id"]: card for card in data}
        parent = base[0]["id"] if base else None
        run = run_of_request(request)
        every_run = run == DEFAULT_RUN and on_public_port(request.scope)  # operators see qualified names
        adapters = [{**(cards.get(name) or {"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": entry.path, "parent": parent,
                                            "max_model_len": None, "permission": []}),
                     "id": name if every_run else runs.own_name(name)}
                    for name, entry in ledger.entries().items() if every_run or entry.run == run]
        return JSONResponse({"object": "list", "data": base + adapters})

    # --- the proxy's own endpoints ---------------------------------------------------------------
    @app.get("/health")
    @app.get("/ping")
    async def health() -> Response:
        ready = len(fleet.ready())
        ok = ready >= settings.proxy_min_ready
        body = {"status": "ok" if ok else "unavailable", "ready": ready, "min_ready": settings.proxy_min_ready,
                "replicas": [{"url": r.url, "state": r.state.value, "last_error": r.last_error}
                             for r in fleet.replicas.values()]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/fleet")
    async def fleet_view() -> Response:
        return JSONResponse({
            "replicas": [replica.as_json() for replica in fleet.replicas.values()],
            "ledger": entries_json(ledger.state()),
            "runs": runs.view(),
            "slots": runs.budget(),
            "paused": ledger.paused,
            "ledger_rebuilding": ledger.rebuilding,
            "loops_alive": fleet.loops_alive(),
            "router": {"mode": router.mode, "block_size": router.block_size, **router.counters,
                       "tracked_blocks": router.tracked_blocks},
            "min_ready": settings.proxy_min_ready,
            "sync_pause": settings.proxy_sync_pause,
        })

    @app.get("/metrics")
    async def prometheus() -> Response:
        for state in State:
            metrics.replicas.labels(state.value).set(sum(r.state is state for r in fleet.replicas.values()))
        for replica in fleet.replicas.values():
            metrics.inflight.labels(replica.url).set(replica.inflight)
            metrics.replica_adapters.labels(replica.url).set(len(replica.adapters))
        metrics.tracked_blocks.set(router.tracked_blocks)
        metrics.ledger_size.set(len(ledger))
        runs.export()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: document(app)  # type: ignore[method-assign]
    app.front = Front(partial(FastAPI.__call__, app), fleet, router, metrics, upstreams,
                      settings.proxy_max_body_bytes, {route.path for route in app.routes},  # type: ignore[attr-defined]
                      runs, fair)
    return app


def _fleet_server_info(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's /server_info, with the LoRA limits every replica can honour and dp=1 (one server)."""
    merged = copy.deepcopy(payloads[0])
    config = merged.setdefault("vllm_config", {})
    loras = [payload.get("vllm_config", {}).get("lora_config") for payload in payloads]
    if all(isinstance(lora, dict) for lora in loras):
        for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            values = [lora[key] for lora in loras if isinstance(lora.get(key), int)]  # type: ignore[union-attr]
            if values:
                config["lora_config"][key] = min(values)
    else:
        config["lora_config"] = None  # a replica without runtime LoRA: the fleet cannot do adapter-only sync
    config.setdefault("parallel_config", {})["data_parallel_size"] = 1
    return merged
