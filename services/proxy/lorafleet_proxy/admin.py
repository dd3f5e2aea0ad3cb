"""The admin plane's state changes: adapter load/unload, run registration, pause/resume, cache resets, and the
engine-local dev routes the proxy refuses. Everything here goes to every ready replica or to none (broadcast.py)
or is a run's own business (the `runs` package); views.py holds the read-only half of the plane.

FastAPI serves these routes (the front hands them over untouched): typed bodies are checked before a handler
runs, so bad input holds no lock and reaches no replica.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from . import broadcast
from .content_store import ContentStore
from .elision import PauseElision
from .errors import adapter_not_found, error
from .fleet import Fleet
from .metrics import Metrics
from .openapi import mount
from .ratio_verdict import act_on_report
from .runs import Runs, foreign_name, not_its_own
from .schemas import (
    LoadLoRAAdapterRequest,
    PauseMode,
    RatioReportRequest,
    RegisterRunRequest,
    ResetPrefixCacheQuery,
    UnloadLoRAAdapterRequest,
)

# Dev routes that change one engine's state: broadcasting them would need their own all-or-nothing
# semantics (and the merged-weight sync they serve cannot work across replicas), so they are refused.
REFUSED_ROUTES = ("/sleep", "/wake_up", "/collective_rpc", "/abort_requests", "/release_kv_cache_memory",
                  "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/start_draft_weight_update", "/update_weight_version", "/get_world_size", "/weight_info")
CACHE_RESET_ROUTES = ("/reset_mm_cache", "/reset_encoder_cache")


class AdminPlane:
    """The handlers of the fleet-wide changes, with what they need injected; `router()` mounts them."""

    def __init__(self, fleet: Fleet, content: ContentStore, runs: Runs, metrics: Metrics,
                 elision: PauseElision) -> None:
        self.fleet = fleet
        self.content = content  # the copies the replicas load (the ledger's store)
        self.runs = runs
        self.metrics = metrics
        self.elision = elision

    def router(self) -> APIRouter:
        return mount([
            ("/v1/load_lora_adapter", "POST", self.load_lora_adapter),
            ("/v1/unload_lora_adapter", "POST", self.unload_lora_adapter),
            ("/register", "POST", self.register),
            ("/ratio_report", "POST", self.ratio_report),
            ("/pause", "POST", self.pause),
            ("/resume", "POST", self.resume),
            ("/reset_prefix_cache", "POST", self.reset_prefix_cache),
            *((path, "POST", self.reset_other_cache) for path in CACHE_RESET_ROUTES),
            *((path, method, self.refused, f"refused_{method}{path}".lower())
              for path in REFUSED_ROUTES for method in ("GET", "POST")),
        ])

    async def timed(self, op: str, call: Awaitable[Response]) -> Response:
        started = time.perf_counter()
        response = await call
        self.metrics.broadcast_done(op, response.status_code, time.perf_counter() - started)
        self.metrics.track_pause(self.fleet.paused is not None)  # pause -> resume observes the stall
        return response

    async def load_lora_adapter(self, request: Request, body: LoadLoRAAdapterRequest) -> Response:
        run, name = self.runs.of(request.scope), body.lora_name
        if foreign_name(run, name):
            return not_its_own(run, name)
        path = self.runs.confine_load(request.scope, body.lora_path)
        if isinstance(path, Response):
            return path
        qualified = self.runs.qualify(run, name)
        load = broadcast.load_adapter(self.fleet, self.content,
                                      {**body.model_dump(), "lora_name": qualified, "lora_path": path},
                                      run, self.runs.load_admission(run, qualified))
        return self.runs.renamed(await self.timed("load", load), qualified, name)

    async def unload_lora_adapter(self, request: Request, body: UnloadLoRAAdapterRequest) -> Response:
        run, name = self.runs.of(request.scope), body.lora_name
        if foreign_name(run, name):
            return adapter_not_found(name)
        qualified = self.runs.qualify(run, name)
        unload = broadcast.unload_adapter(self.fleet, {**body.model_dump(), "lora_name": qualified})
        return self.runs.renamed(await self.timed("unload", unload), qualified, name)

    async def register(self, request: Request, body: RegisterRunRequest) -> Response:
        """lorafleet's own: reserve a run's LoRA slots (max_staleness + 2) and set its fair-share weight."""
        return await self.runs.register(self.runs.of(request.scope), body.max_staleness, body.weight)

    async def ratio_report(self, request: Request, body: RatioReportRequest) -> Response:
        """lorafleet's own: a run reports a replica whose rollouts of one of its adapters depart from its peers'.
        Treated as a canary disagreement (ratio_verdict.py); a run reports on its own adapters only."""
        run, name = self.runs.of(request.scope), body.lora_name
        if foreign_name(run, name):
            return not_its_own(run, name)
        qualified = self.runs.qualify(run, name)
        if self.fleet.recorded(qualified) is None:
            return adapter_not_found(name)
        if body.replica not in self.fleet.replicas:
            return error(404, f"no replica {body.replica!r} in the fleet", "NotFoundError", "replica")
        outcome = await act_on_report(self.fleet, self.fleet.replicas[body.replica], qualified, body.evidence)
        return JSONResponse({"replica": body.replica, "lora_name": name, "outcome": outcome})

    async def pause(self, request: Request, mode: PauseMode = "abort") -> Response:
        if self.elision.elide_pause(request.scope, mode, self.runs.of(request.scope)):
            self.metrics.pauses_elided.inc()
            return JSONResponse({"status": "paused"})
        return await self.runs.pause(request.scope, mode,
                                     lambda: self.timed("pause", broadcast.pause(self.fleet, mode)))

    async def resume(self, request: Request) -> Response:
        if self.elision.elide_resume(request.scope, self.runs.of(request.scope)):
            return JSONResponse({"status": "resumed"})
        return await self.runs.resume(request.scope, lambda: self.timed("resume", broadcast.resume(self.fleet)))

    async def reset_prefix_cache(self, query: Annotated[ResetPrefixCacheQuery, Query()]) -> Response:
        return await self.timed("reset_prefix_cache", broadcast.reset_prefix_cache(self.fleet, query.params()))

    async def reset_other_cache(self, request: Request) -> Response:
        return await broadcast.reset_cache(self.fleet, request.url.path, {})  # vLLM's routes take no parameters

    async def refused(self, request: Request) -> Response:
        # 403, not 5xx: a refusal by policy (these routes are open on the replicas even with --api-key).
        return error(403, f"{request.url.path} is refused by the lorafleet proxy: it changes one engine's "
                     "state and would leave the replicas inconsistent. Adapter-only sync (runtime LoRA) is the "
                     "supported way to update the fleet's policy.", "Forbidden")
