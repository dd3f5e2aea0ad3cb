"""Fleet membership: joining -> syncing -> ready, ejection, catch-up and restart detection (no network)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet_proxy.fleet import Fleet, State
from lorafleet_proxy.ledger import Ledger, ledger_path
from lorafleet_proxy.router import Router

R1, R2 = "http://r1:8000", "http://r2:8000"


@dataclass
class Engine:
    """Just enough of one vLLM replica, answering like vLLM 0.31."""

    healthy: bool = True
    adapters: dict[str, str] = field(default_factory=dict)
    paused: str | None = None
    missing_for: int = 0  # "No adapter found" this many times first
    loads: list[str] = field(default_factory=list)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if not self.healthy:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            return httpx.Response(200)
        if path == "/server_info":
            return httpx.Response(200, json={"vllm_config": {"cache_config": {"block_size": 128},
                                                             "model_config": {"model": "base"}}})
        if path == "/v1/models":
            data = [{"id": "base", "root": "base", "parent": None, "max_model_len": 512}]
            data += [{"id": n, "root": p, "parent": "base"} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"data": data})
        if path == "/v1/load_lora_adapter":
            body = json.loads(request.content)
            self.loads.append(body["lora_name"])
            if self.missing_for:
                self.missing_for -= 1
                message = f"Loading lora {body['lora_name']} failed: No adapter found for <path>"
                return httpx.Response(404, json={"error": {"message": message, "type": "NotFoundError",
                                                           "param": None, "code": 404}})
            self.adapters[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="Success")
        if path == "/v1/unload_lora_adapter":
            self.adapters.pop(json.loads(request.content)["lora_name"], None)
            return httpx.Response(200, text="Success")
        if path == "/pause":
            self.paused = request.url.params["mode"]
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = None
            return httpx.Response(200, json={"status": "resumed"})
        return httpx.Response(404)


@pytest.fixture
def engines() -> dict[str, Engine]:
    return {R1: Engine(), R2: Engine()}


@pytest.fixture
async def fleet(engines: dict[str, Engine], tmp_path: Path) -> Fleet:
    settings = load_settings(proxy_upstreams=f"{R1},{R2}", adapter_root=str(tmp_path), proxy_eject_after=2)
    transport = httpx.MockTransport(lambda request: engines[f"http://{request.url.netloc.decode()}"].handle(request))
    ledger = Ledger(ledger_path(tmp_path), tmp_path)
    fleet = Fleet(settings, Router(block_size=16), ledger, transport)
    fleet.set_members(settings.upstream_urls)
    return fleet


async def check_and_sync(fleet: Fleet, url: str) -> None:
    replica = fleet.replicas[url]
    await fleet.check(replica)
    if replica.sync_task is not None:
        await replica.sync_task


async def test_a_replica_syncs_the_ledger_in_order_before_it_is_ready(fleet: Fleet, engines: dict[str, Engine],
                                                                      tmp_path: Path) -> None:
    assert fleet.replicas[R1].state is State.JOINING and fleet.ready() == []
    fleet.ledger.put("trl-policy-v1", str(tmp_path / "v1"))
    fleet.ledger.put("trl-policy-v2", str(tmp_path / "v2"))
    engines[R1].adapters["stale-run"] = str(tmp_path / "stale")
    engines[R1].missing_for = 2  # the volume lags for the first adapter
    await check_and_sync(fleet, R1)
    replica = fleet.replicas[R1]
    assert replica.state is State.READY and fleet.ready() == [replica]
    assert engines[R1].loads == ["trl-policy-v1"] * 3 + ["trl-policy-v2"]
    assert engines[R1].adapters == replica.adapters == fleet.ledger.entries(), "stale adapters must be unloaded"
    assert fleet.router.block_size == 128, "the routing block size follows the replicas' KV block size"


async def test_failed_health_checks_eject_and_forget_then_the_replica_resyncs(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    fleet.ledger.put("trl-policy-v1", str(tmp_path / "v1"))
    await check_and_sync(fleet, R1)
    await check_and_sync(fleet, R2)
    replica = fleet.replicas[R1]
    prompt = fleet.router.prompt_blocks({"model": "trl-policy-v1", "prompt": list(range(300))})
    fleet.router.choose("trl-policy-v1", prompt, {R1: 0})
    assert R1 in fleet.router._slots

    engines[R1].healthy = False
    await fleet.check(replica)
    assert replica.state is State.READY, "one failed check is not enough"
    await fleet.check(replica)
    assert replica.state is State.EJECTED and replica.adapters == {} and replica.last_error
    assert R1 not in fleet.router._slots, "an ejected replica keeps no routing ownership"
    assert [r.url for r in fleet.ready()] == [R2]

    engines[R1] = Engine()  # it came back restarted, without adapters
    await check_and_sync(fleet, R1)
    assert replica.state is State.READY and engines[R1].adapters == {"trl-policy-v1": str(tmp_path / "v1")}


async def test_a_ready_replica_that_lost_its_adapters_goes_back_to_syncing(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    fleet.ledger.put("trl-policy-v1", str(tmp_path / "v1"))
    await check_and_sync(fleet, R1)
    engines[R1].adapters.clear()
    await fleet.check(fleet.replicas[R1])
    assert fleet.replicas[R1].state is State.SYNCING
    await fleet.replicas[R1].sync_task
    assert fleet.replicas[R1].state is State.READY and engines[R1].adapters


async def test_a_replica_joining_a_paused_fleet_is_paused_before_it_is_ready(
    fleet: Fleet, engines: dict[str, Engine]
) -> None:
    fleet.paused_mode = "keep"
    await check_and_sync(fleet, R2)
    assert fleet.replicas[R2].state is State.READY and engines[R2].paused == "keep"


async def test_a_joining_replica_that_never_answers_stays_joining(fleet: Fleet, engines: dict[str, Engine]) -> None:
    engines[R1].healthy = False
    for _ in range(3):
        await fleet.check(fleet.replicas[R1])
    assert fleet.replicas[R1].state is State.JOINING


async def test_removed_members_are_dropped(fleet: Fleet) -> None:
    fleet.set_members([R2])
    assert list(fleet.replicas) == [R2]
