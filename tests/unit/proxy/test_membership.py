"""Fleet membership: joining -> syncing -> ready, ejection, catch-up and restart detection (no network)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from lorafleet.ledger_file import Entry
from lorafleet.settings import load_settings
from lorafleet.vllm_api import error_body
from lorafleet_proxy.fleet import Fleet, State
from lorafleet_proxy.ledger import Ledger, ledger_path
from lorafleet_proxy.router import Router

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
R1, R2 = "http://r1:8000", "http://r2:8000"


@dataclass
class Engine:
    """Just enough of one vLLM replica, answering like vLLM 0.31, with faults to inject."""

    healthy: bool = True  # False: connection refused (the process is gone)
    adapters: dict[str, str] = field(default_factory=dict)
    paused: str | None = None
    missing_for: int = 0  # "No adapter found" this many times first
    loads: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    fail: dict[str, int] = field(default_factory=dict)  # path -> status answered with vLLM's engine-dead body
    hang: set[str] = field(default_factory=set)  # paths that time out
    malformed: set[str] = field(default_factory=set)  # paths answering 200 with a body of the wrong shape
    on_call: Callable[[str], None] | None = None

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if not self.healthy:
            raise httpx.ConnectError("connection refused", request=request)
        if path in self.hang:
            raise httpx.ReadTimeout("timed out", request=request)
        self.calls.append(path)
        if self.on_call is not None:
            self.on_call(path)
        if path in self.malformed:
            return httpx.Response(200, json={"data": [{"no-id": True}], "vllm_config": 3})
        if path in self.fail:
            return httpx.Response(self.fail[path], json=error_body(ENGINE_DEAD, "InternalServerError", self.fail[path]))
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
                return httpx.Response(404, json=error_body(message, "NotFoundError", 404))
            if body["lora_name"] in self.adapters:
                message = (f"The lora adapter '{body['lora_name']}' has already been loaded. If you want to load the "
                           "adapter in place, set 'load_inplace' to True.")
                return httpx.Response(400, json=error_body(message, "InvalidUserInput", 400))
            self.adapters[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            name = json.loads(request.content)["lora_name"]
            if self.adapters.pop(name, None) is None:
                return httpx.Response(404, json=error_body(f"The lora adapter '{name}' cannot be found.",
                                                           "NotFoundError", 404))
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")
        if path == "/pause":
            self.paused = request.url.params["mode"]
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.paused = None
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/is_paused":
            return httpx.Response(200, json={"is_paused": self.paused is not None})
        if path == "/reset_prefix_cache":
            return httpx.Response(200, json={"success": True})
        return httpx.Response(404)


@pytest.fixture
def engines() -> dict[str, Engine]:
    return {R1: Engine(), R2: Engine()}


@pytest.fixture
async def fleet(engines: dict[str, Engine], tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = make_fleet(engines, tmp_path)
    yield fleet
    await fleet.stop()


def make_fleet(engines: dict[str, Engine], root: Path, **overrides: object) -> Fleet:
    settings = load_settings(proxy_upstreams=",".join(engines), adapter_root=str(root),
                             **{"proxy_eject_after": 2, "proxy_health_interval_s": 0.01, **overrides})
    transport = httpx.MockTransport(lambda request: engines[f"http://{request.url.netloc.decode()}"].handle(request))
    ledger = Ledger(ledger_path(root), root)
    ledger.restore()
    fleet = Fleet(settings, Router(block_size=16), ledger, transport)
    fleet.set_members(settings.upstream_urls)
    return fleet


def put(ledger: Ledger, name: str, path: str, digest: str = "") -> None:
    state = ledger.state()
    state.adapters.pop(name, None)
    state.adapters[name] = Entry(path, digest)
    ledger.commit(state)


async def check_and_sync(fleet: Fleet, url: str) -> None:
    replica = fleet.replicas[url]
    await fleet.check(replica)
    if replica.sync_task is not None:
        await replica.sync_task


async def test_a_replica_syncs_the_ledger_in_order_before_it_is_ready(fleet: Fleet, engines: dict[str, Engine],
                                                                      tmp_path: Path) -> None:
    assert fleet.replicas[R1].state is State.JOINING and fleet.ready() == []
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    put(fleet.ledger, "trl-policy-v2", str(tmp_path / "v2"))
    engines[R1].adapters["stale-run"] = str(tmp_path / "stale")
    engines[R1].missing_for = 2  # the volume lags for the first adapter
    await check_and_sync(fleet, R1)
    replica = fleet.replicas[R1]
    assert replica.state is State.READY and fleet.ready() == [replica]
    assert engines[R1].loads == ["trl-policy-v1"] * 3 + ["trl-policy-v2"]
    assert engines[R1].adapters == replica.adapters == fleet.ledger.paths(), "stale adapters must be unloaded"
    assert fleet.router.block_size == 128, "the routing block size follows the replicas' KV block size"


async def test_failed_health_checks_eject_and_forget_then_the_replica_resyncs(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    await check_and_sync(fleet, R1)
    await check_and_sync(fleet, R2)
    replica = fleet.replicas[R1]
    prompt = fleet.router.prompt_blocks({"model": "trl-policy-v1", "prompt": list(range(300))})
    fleet.router.choose("trl-policy-v1", prompt, {R1: 0})
    assert R1 in fleet.router._slots

    engines[R1].fail["/health"] = 503
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
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    await check_and_sync(fleet, R1)
    engines[R1].adapters.clear()
    await fleet.check(fleet.replicas[R1])
    assert fleet.replicas[R1].state is State.SYNCING
    await fleet.replicas[R1].sync_task
    assert fleet.replicas[R1].state is State.READY and engines[R1].adapters


async def test_a_replica_joining_a_paused_fleet_is_paused_before_it_is_ready(
    fleet: Fleet, engines: dict[str, Engine]
) -> None:
    state = fleet.ledger.state()
    state.paused = "keep"
    fleet.ledger.commit(state)
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
