"""The proxy's FastAPI app: one vLLM server (data_parallel_size 1) in front of the fleet.

`create_app(settings)` wires one app's parts (router, ledger, fleet, runs, upstream pools, metrics, the front and
the admin plane), so tests can run several in one process. The lifespan starts discovery, health checks and the
runs' lease loop. What each part does is in its own module; this one only connects them.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import httpx
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from lorafleet.settings import ConfigError, ProxySettings
from starlette.types import ASGIApp, Receive, Scope, Send

from . import broadcast
from .admin import AdminPlane
from .auth import BearerAuth
from .content_store import ContentStore
from .elision import PauseElision
from .errors import validation_error
from .fleet import Fleet
from .front import Front
from .ledger import Ledger, ledger_path
from .metrics import Metrics
from .openapi import document, relayed_router
from .router import Router
from .runs import Runs
from .upstream import Upstreams
from .views import FleetViews

__all__ = ["BearerAuth", "ProxyApp", "create_app", "require_upstreams"]

log = logging.getLogger("lorafleet.proxy")

DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default, until a replica reports its own


def require_upstreams(settings: ProxySettings) -> None:
    if not settings.upstream_urls and not settings.proxy_upstream_dns:
        raise ConfigError("PROXY_UPSTREAMS / PROXY_UPSTREAM_DNS: set one of them (replica base URLs, or host:port "
                          "of a DNS name that resolves to every replica)")


class ProxyApp(FastAPI):
    """FastAPI with the generation front before its middleware stack: rollouts never enter FastAPI's machinery."""

    front: ASGIApp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.front(scope, receive, send)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: ProxySettings = app.state.settings
    fleet: Fleet = app.state.fleet
    ledger: Ledger = app.state.ledger
    log.info("proxy starting routing=%s upstreams=%s dns=%s ledger=%s adapters=%d", settings.proxy_routing,
             settings.upstream_urls, settings.proxy_upstream_dns or "-", ledger.path, len(ledger))
    await fleet.start()
    fleet.supervise("content", ledger.collect_content, min(max(settings.proxy_content_grace_s / 2, 1.0), 60.0))
    fleet.supervise("leases", app.state.runs.expire_idle,
                    min(settings.run_lease_s / 4, settings.proxy_health_interval_s))
    if settings.proxy_canary_interval_s > 0:
        fleet.supervise("canary", fleet.canary_round, settings.proxy_canary_interval_s)
    if settings.proxy_attest_interval_s > 0:
        fleet.supervise("attestation", fleet.attestation_round, settings.proxy_attest_interval_s)
    try:
        yield
    finally:
        await fleet.stop()
        app.state.upstreams.close()


def create_app(settings: ProxySettings, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy app for these settings; `transport` replaces the network for in-process tests."""
    require_upstreams(settings)
    metrics = Metrics()
    router = Router(settings.proxy_routing, settings.proxy_imbalance, settings.proxy_max_tracked_blocks,
                    settings.proxy_block_size or DEFAULT_BLOCK_SIZE, settings.proxy_route_max_blocks)
    content = ContentStore(settings.content_store, settings.adapter_root, settings.proxy_content_grace_s,
                           max_bytes=settings.proxy_adapter_max_mb << 20)
    ledger = Ledger(ledger_path(settings.adapter_root), settings.adapter_root, content)
    ledger.restore()
    fleet = Fleet(settings, router, ledger, transport, metrics)
    upstreams = Upstreams(settings.proxy_request_timeout_s, settings.proxy_upstream_token)
    fleet.on_eject.append(upstreams.abandon)  # a hung replica's requests in flight are retried elsewhere
    runs = Runs(settings, fleet, ledger, metrics, partial(broadcast.unload_from_ready, fleet))

    app = ProxyApp(title="lorafleet proxy", lifespan=lifespan, docs_url=None, redoc_url=None,
                   openapi_url="/openapi.json", exception_handlers={RequestValidationError: validation_error})
    app.state.settings, app.state.upstreams = settings, upstreams
    app.state.fleet, app.state.router, app.state.ledger, app.state.metrics, app.state.runs = (
        fleet, router, ledger, metrics, runs)
    app.include_router(relayed_router())
    elision = PauseElision(settings.proxy_sync_pause)
    app.include_router(AdminPlane(fleet, ledger.content, runs, metrics, elision).router())
    app.include_router(FleetViews(settings, fleet, ledger, router, runs, metrics).router())
    app.openapi = lambda: document(app)  # type: ignore[method-assign]
    app.front = Front(partial(FastAPI.__call__, app), fleet, router, metrics, upstreams,
                      settings.proxy_max_body_bytes, {route.path for route in app.routes},  # type: ignore[attr-defined]
                      runs)
    return app
