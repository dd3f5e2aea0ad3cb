"""The admin plane's read-only half: the fleet as one vLLM server (/server_info, /v1/models, /is_paused) and the
proxy's own views (/health, /fleet, /metrics).

Each answer is made for the fleet, not copied from one replica: /server_info carries the LoRA limits every
replica can honour and data_parallel_size 1 (TRL checks both), /v1/models lists the ledger's adapters as the
requesting run names them.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from lorafleet.ledger_format import entries_json
from lorafleet.settings import ProxySettings
from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER, VLLMError
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .errors import no_ready_replica, relay
from .fleet import Fleet, State
from .ledger import Ledger
from .metrics import Metrics
from .openapi import mount
from .router import Router
from .runs import Runs


class FleetViews:
    """The handlers of the read-only routes, with what they need injected; `router()` mounts them."""

    def __init__(self, settings: ProxySettings, fleet: Fleet, ledger: Ledger, router: Router, runs: Runs,
                 metrics: Metrics) -> None:
        self.settings = settings
        self.fleet = fleet
        self.ledger = ledger
        self.routing = router
        self.runs = runs
        self.metrics = metrics

    def router(self) -> APIRouter:
        handlers = {"/is_paused": self.is_paused, "/server_info": self.server_info, "/v1/models": self.models,
                    "/health": self.health, "/ping": self.health, "/fleet": self.fleet_view,
                    "/metrics": self.prometheus}
        return mount((path, "GET", handler) for path, handler in handlers.items())

    async def is_paused(self, request: Request) -> Response:  # the replicas' own state: an elided pause paused none
        return await self.runs.is_paused(request.scope, self._replicas_paused)

    async def _replicas_paused(self) -> Response:
        ready = self.fleet.ready()
        if not ready:
            return no_ready_replica(self.fleet)
        answers = await asyncio.gather(*(replica.client.is_paused() for replica in ready), return_exceptions=True)
        return JSONResponse({"is_paused": any(answer is True for answer in answers)})

    async def server_info(self, request: Request, config_format: Literal["text", "json"] = "text") -> Response:
        """Every ready replica is asked. json: the fleet's view (LoRA limits all honour); text: one replica's own."""
        ready = self.fleet.ready()
        if not ready:
            return no_ready_replica(self.fleet)
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
            merged = fleet_server_info([answer.json() for _, answer in answers])
            lora = merged["vllm_config"].get("lora_config")
            if isinstance(lora, dict):
                self.runs.lora_limits(request.scope, lora)
            return JSONResponse(merged)
        replica, answer = answers[0]
        return Response(answer.content, media_type=answer.headers.get("content-type"),
                        headers={PROXY_UPSTREAM_HEADER: replica.url})

    async def models(self, request: Request) -> Response:
        ready = self.fleet.ready()
        if not ready:
            return no_ready_replica(self.fleet)
        try:
            data = (await ready[0].client.request("GET", "/v1/models")).json().get("data", [])
        except VLLMError as exc:
            return relay(exc, f"/v1/models failed on {ready[0].url}")
        base = [card for card in data if card.get("parent") is None][:1]
        cards = {card["id"]: card for card in data}
        parent = base[0]["id"] if base else None
        adapters = [{**(cards.get(name) or {"id": name, "object": "model", "created": int(time.time()),
                                            "owned_by": "vllm", "root": entry.path, "parent": parent,
                                            "max_model_len": None, "permission": []}), "id": shown}
                    for name, shown, entry in self.runs.visible_adapters(request.scope)]
        return JSONResponse({"object": "list", "data": base + adapters})

    async def health(self) -> Response:
        ready = len(self.fleet.ready())
        min_ready = self.settings.proxy_min_ready
        ok = ready >= min_ready
        body = {"status": "ok" if ok else "unavailable", "ready": ready, "min_ready": min_ready,
                "replicas": [{"url": r.url, "state": r.state.value, "last_error": r.last_error}
                             for r in self.fleet.replicas.values()]}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def fleet_view(self) -> Response:
        ledger, router = self.ledger, self.routing
        return JSONResponse({
            "replicas": [replica.as_json() for replica in self.fleet.replicas.values()],
            "ledger": entries_json(ledger.state()),
            "runs": self.runs.view(),
            "run_keys": {"enabled": self.runs.keys.enabled, "runs": self.runs.keys.runs()},
            "slots": self.runs.budget(),
            "paused": ledger.paused,
            "broadcast_epoch": self.fleet.broadcast_epoch,  # odd while a fleet-wide change is on its way
            "ledger_rebuilding": ledger.rebuilding,
            "loops_alive": self.fleet.loops_alive(),
            "router": {"mode": router.mode, "block_size": router.block_size, **router.counters,
                       "tracked_blocks": router.tracked_blocks},
            "min_ready": self.settings.proxy_min_ready,
            "sync_pause": self.settings.proxy_sync_pause,
        })

    async def prometheus(self) -> Response:
        metrics, replicas = self.metrics, self.fleet.replicas.values()
        for state in State:
            metrics.replicas.labels(state.value).set(sum(r.state is state for r in replicas))
        for replica in replicas:
            metrics.inflight.labels(replica.url).set(replica.inflight)
            metrics.replica_adapters.labels(replica.url).set(len(replica.adapters))
        metrics.tracked_blocks.set(self.routing.tracked_blocks)
        metrics.ledger_size.set(len(self.ledger))
        self.runs.export()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def fleet_server_info(payloads: list[dict[str, Any]]) -> dict[str, Any]:
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
