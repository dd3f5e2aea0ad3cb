"""Gathering: the proxy's view (/fleet, /server_info, /v1/models) and each replica's own, read-only.

A replica that cannot be asked directly (the trainer's container has no route to the replicas nor
vLLM's key) is described by the proxy's last reading of it in /fleet instead, marked `via_proxy`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from lorafleet import ledger_format
from lorafleet.logs import log_event
from lorafleet.run_key_store import read_key_file
from lorafleet.runs import DEFAULT_RUN
from lorafleet.settings import StackSettings
from lorafleet.vllm_api import ServerInfo, VLLMClient, VLLMError, VLLMUnreachable

from lorafleet_ops.commands.doctor.model import ReplicaView, Snapshot

log = logging.getLogger("lorafleet.doctor")

REQUEST_TIMEOUT_S = 30.0


def api_client(url: str, token: str = "", http: httpx.AsyncClient | None = None) -> VLLMClient:
    """A vLLM API client with the doctor's timeout; `http` replaces the transport (tests)."""
    return VLLMClient(url, token=token, timeout=REQUEST_TIMEOUT_S, client=http)


def hidden(exc: VLLMError) -> bool:
    """The replica cannot be asked from here (no route, no answer, or vLLM's key is missing), as opposed to
    one that answered with an error of its own."""
    return isinstance(exc, VLLMUnreachable) or exc.status == 401


def use_proxy_view(replica: ReplicaView) -> bool:
    """Take the proxy's last reading of `replica` (GET /fleet) as its view; False when the proxy has none
    or does not route to it (its reading of a replica out of traffic is stale)."""
    if replica.proxy_state != "ready" or replica.proxy_server_info is None or replica.proxy_adapters is None:
        return False
    try:
        replica.info = ServerInfo.parse(replica.proxy_server_info)
    except (ValueError, KeyError, TypeError):
        return False
    replica.adapters, replica.via_proxy, replica.error = dict(replica.proxy_adapters), True, None
    return True


async def _read_replica(replica: ReplicaView, token: str, http: httpx.AsyncClient | None) -> None:
    async with api_client(replica.url, token, http) as direct:
        try:
            replica.info = await direct.server_info()
            replica.adapters = await direct.loaded_adapters()
            with contextlib.suppress(VLLMError, KeyError, ValueError):  # the proxy's reading, if any, stands
                replica.vllm_version = await direct.version()
        except VLLMError as exc:
            replica.info, replica.error = None, str(exc)
            if hidden(exc) and use_proxy_view(replica):
                log_event(log, "doctor_replica_via_proxy", replica=replica.url, error=exc)
        except (ValueError, KeyError) as exc:
            replica.error = str(exc)


async def _read_proxy(snapshot: Snapshot, views: dict[str, ReplicaView], token: str,
                      http: httpx.AsyncClient | None) -> None:
    """The proxy's view; `token` is the run's key where the fleet URL is a run's on a fleet with run keys."""
    assert snapshot.fleet_url is not None
    async with api_client(snapshot.fleet_url, token, http) as proxy:
        try:
            fleet = (await proxy.request("GET", "/fleet")).json()
            for item in fleet.get("replicas", []):
                url = str(item["url"]).rstrip("/")
                views[url] = ReplicaView(url, item.get("state"), item.get("last_error"),
                                         proxy_generates=item.get("generates"), inflight=int(item.get("inflight", 0)),
                                         vllm_version=item.get("vllm_version"),
                                         proxy_canary_failure=(item.get("canary") or {}).get("failure"),
                                         proxy_attestation=(item.get("attestation") or {}).get("state"),
                                         proxy_attestation_failure=(item.get("attestation") or {}).get("failure"),
                                         proxy_server_info=item.get("server_info"), proxy_adapters=item.get("adapters"))
            snapshot.ledger = [(str(e["name"]), str(e["path"])) for e in fleet.get("ledger", [])]
            snapshot.ledger_sources = {str(e["name"]): str(e.get("source") or e["path"])
                                       for e in fleet.get("ledger", [])}
            snapshot.ledger_source = f"{snapshot.fleet_url}/fleet"
            snapshot.sync_pause = fleet.get("sync_pause")
            snapshot.named_runs = sorted(row["run"] for row in fleet.get("runs", []) if row["run"] != DEFAULT_RUN)
            keys = fleet.get("run_keys") or {}
            snapshot.run_keys = list(keys.get("runs", [])) if keys.get("enabled") else None
            snapshot.proxy_info = (await proxy.request("GET", "/server_info", params={"config_format": "json"})).json()
            cards = await proxy.models()
            snapshot.proxy_base_model = cards[0].id if cards else None
        except (VLLMError, ValueError, KeyError, TypeError) as exc:
            snapshot.proxy_error = str(exc)


async def gather_snapshot(settings: StackSettings, fleet_url: str | None, replica_urls: Sequence[str] = (),
                          http: httpx.AsyncClient | None = None) -> Snapshot:
    """Read the proxy's view and each replica's own, concurrently; the ledger file when the proxy is down."""
    snapshot = Snapshot(fleet_url=fleet_url.rstrip("/") if fleet_url else None)
    views: dict[str, ReplicaView] = {}
    if snapshot.fleet_url:
        snapshot.fleet_token = read_key_file(settings.trainer_run_key_file)  # a run's URL on a fleet with run keys
        await _read_proxy(snapshot, views, snapshot.fleet_token, http)
    else:
        snapshot.proxy_error = "no fleet URL given"
    for url in replica_urls:
        views.setdefault(url.rstrip("/"), ReplicaView(url.rstrip("/")))
    snapshot.replicas = list(views.values())
    if snapshot.ledger is None:
        path = ledger_format.ledger_path(settings.adapter_root)
        entries = read_ledger_file(settings.adapter_root, settings.content_store)
        snapshot.ledger = None if entries is None else [(name, path) for name, path, _ in entries]
        snapshot.ledger_sources = {name: source or path for name, path, source in entries or []}
        snapshot.ledger_source = str(path) if snapshot.ledger is not None else f"no readable {path}"
    token = settings.proxy_upstream_token
    await asyncio.gather(*(_read_replica(replica, token, http) for replica in snapshot.replicas))
    snapshot.metrics_path = settings.metrics_path
    with contextlib.suppress(OSError):
        snapshot.metrics_lines = snapshot.metrics_path.read_text().splitlines()
        snapshot.metrics_age_s = max(0.0, time.time() - snapshot.metrics_path.stat().st_mtime)
    return snapshot


def read_ledger_file(adapter_root: Path, content_store: Path | None = None) -> list[tuple[str, str, str]] | None:
    """(name, path, source) of the proxy's ledger file (`lorafleet.ledger_format`), in load order; None when it
    cannot be read. Used when the proxy cannot be asked and the fleet volume is mounted here."""
    try:
        state = ledger_format.read(ledger_format.ledger_path(adapter_root), adapter_root, content_store)
    except ledger_format.LedgerFileError:
        return None
    return None if state is None else [(name, entry.path, entry.source) for name, entry in state.adapters.items()]
