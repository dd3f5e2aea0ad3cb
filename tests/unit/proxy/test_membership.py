"""Fleet membership: joining -> syncing -> ready, ejection, catch-up and restart detection (no network)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from lorafleet.adapters import content_dir
from lorafleet.ledger_format import Entry
from lorafleet.settings import load_settings
from lorafleet.vllm_api import error_body
from lorafleet_proxy import broadcast
from lorafleet_proxy.content_store import ContentStore, Stored
from lorafleet_proxy.fleet import Fleet, State
from lorafleet_proxy.ledger import Ledger, ledger_path
from lorafleet_proxy.router import Router
from lorafleet_testing.fakes import weights_file

ENGINE_DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
R1, R2, R3 = "http://r1:8000", "http://r2:8000", "http://r3:8000"
# What a lorafleet-replica's /openapi.json lists of the routes the fleet uses (vLLM 0.31, dev mode on): path -> method.
ROUTES = {"/health": "get", "/version": "get", "/server_info": "get", "/v1/models": "get", "/v1/completions": "post",
          "/v1/load_lora_adapter": "post", "/v1/unload_lora_adapter": "post", "/pause": "post", "/resume": "post",
          "/is_paused": "get", "/reset_prefix_cache": "post"}


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
    gated: set[str] = field(default_factory=set)  # paths that wait for `gate` (a slow answer)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    routes: dict[str, str] = field(default_factory=lambda: dict(ROUTES))  # what its /openapi.json lists

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
        if path == "/version":
            return httpx.Response(200, json={"version": "0.31.0"})
        if path == "/openapi.json":
            return httpx.Response(200, json={"openapi": "3.1.0", "paths": {
                route: {method: {}} for route, method in self.routes.items()}})
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
        if path == "/v1/completions":  # the proxy's one-token warm-up before admitting a replica
            model = json.loads(request.content)["model"]
            return httpx.Response(200, json={"object": "text_completion", "model": model, "choices": [
                {"index": 0, "text": "!", "finish_reason": "length"}]})
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

    async def dispatch(request: httpx.Request) -> httpx.Response:
        engine = engines[f"http://{request.url.netloc.decode()}"]
        if request.url.path in engine.gated:
            await engine.gate.wait()
        return engine.handle(request)

    transport = httpx.MockTransport(dispatch)
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


def publish(directory: Path, weights: bytes) -> Path:
    """A trainer's publish: an adapter folder with its config and weights (written over what was there)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 1}))
    (directory / "adapter_model.safetensors").write_bytes(weights_file(weights))
    return directory


def stored(root: Path, name: str, weights: bytes) -> Stored:
    """`name` published under run r's folder of `root` with `weights`, and taken into `root`'s content store."""
    source = publish(root / "runs" / "r" / ".vllm_lora" / name, weights)
    return ContentStore(content_dir(root), root).ingest(str(source))


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


async def test_a_replica_without_the_dev_routes_is_refused_then_admitted_once_it_has_them(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    for route in ("/pause", "/resume", "/is_paused", "/reset_prefix_cache", "/server_info"):
        del engines[R1].routes[route]  # vLLM mounts them only with VLLM_SERVER_DEV_MODE=1
    await check_and_sync(fleet, R1)
    replica = fleet.replicas[R1]
    assert replica.state is State.SYNCING and fleet.ready() == []
    assert replica.last_error is not None and "refused: vLLM 0.31.0 lacks the dev routes" in replica.last_error
    assert "VLLM_SERVER_DEV_MODE=1" in replica.last_error and "POST /pause" in replica.last_error
    assert engines[R1].loads == [] and "/server_info" not in engines[R1].calls, "a refused replica is left alone"
    assert fleet.replicas[R1].as_json()["vllm_version"] is None
    engines[R1].routes = dict(ROUTES)  # restarted with the setting: the next try after the backoff admits it
    replica.next_sync_at = 0.0
    await check_and_sync(fleet, R1)
    assert replica.state is State.READY and replica.last_error is None and engines[R1].loads == ["trl-policy-v1"]
    assert replica.as_json()["vllm_version"] == "0.31.0"


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


# --- issue 11: one test per defect -----------------------------------------------------------------
async def ready_fleet(fleet: Fleet) -> None:
    for url in fleet.replicas:
        await check_and_sync(fleet, url)
    assert len(fleet.ready()) == len(fleet.replicas)


async def test_1_a_malformed_answer_fails_one_replica_and_the_loop_survives(
    fleet: Fleet, engines: dict[str, Engine]
) -> None:
    await ready_fleet(fleet)
    engines[R1].malformed.add("/v1/models")
    await fleet.health_round()  # must not raise
    assert "malformed reply" in (fleet.replicas[R1].last_error or "")
    assert fleet.replicas[R2].state is State.READY and fleet.replicas[R2].last_error is None
    failures = fleet.metrics.check_failures.labels("malformed")._value.get()
    assert failures == 1

    calls = 0

    async def broken_round() -> None:
        nonlocal calls
        calls += 1
        raise KeyError("a bug")

    loop = asyncio.create_task(fleet._supervised("health", broken_round, 0.001))
    for _ in range(200):
        if calls >= 3:
            break
        await asyncio.sleep(0.005)
    assert not loop.done() and calls >= 3, "one exception stopped the loop"
    assert fleet.metrics.loop_errors.labels("health")._value.get() >= 3
    loop.cancel()


async def test_2_an_unreadable_ledger_is_rebuilt_from_the_replicas_and_nothing_is_unloaded(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    (tmp_path / ".fleet").mkdir()
    ledger_path(tmp_path).write_text('{"version": 2, "adapt')
    a, b = stored(tmp_path, "trl-policy-v1", b"a").path, stored(tmp_path, "trl-policy-v2", b"b").path
    engines[R1].adapters = {"trl-policy-v1": a, "trl-policy-v2": b}
    engines[R2].adapters = {"trl-policy-v1": a}
    fleet = make_fleet(engines, tmp_path)
    try:
        assert fleet.ledger.rebuilding
        await fleet.health_round()  # rebuilds
        await fleet.health_round()  # starts the syncs
        for replica in fleet.replicas.values():
            if replica.sync_task:
                await replica.sync_task
        assert not fleet.ledger.rebuilding and list(fleet.ledger.paths()) == ["trl-policy-v1", "trl-policy-v2"]
        assert fleet.metrics.ledger_rebuilds._value.get() == 1
        assert [c for e in engines.values() for c in e.calls if c == "/v1/unload_lora_adapter"] == []
        assert engines[R2].adapters == engines[R1].adapters, "the replica missing v2 was given it, nobody lost one"
        assert json.loads(ledger_path(tmp_path).read_text())["version"] == 4
    finally:
        await fleet.stop()


async def test_2_a_failed_ledger_write_fails_the_load_and_rolls_it_back(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await ready_fleet(fleet)

    def read_only(*_: object, **__: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("lorafleet.ledger_format.write", read_only)
    monkeypatch.setattr("lorafleet_proxy.ledger.write", read_only)
    adapter = publish(tmp_path / "v1", b"weights")
    response = await broadcast.load_adapter(fleet, fleet.ledger.content,
                                            {"lora_name": "trl-policy-v1", "lora_path": str(adapter)})
    assert response.status_code == 500
    assert "Read-only file system" in json.loads(response.body)["error"]["message"]
    assert all(engine.adapters == {} for engine in engines.values()), "loaded although the ledger was not written"
    assert len(fleet.ledger) == 0


async def test_3_a_partial_pause_of_a_paused_fleet_keeps_it_paused_and_pause_survives_a_restart(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    await ready_fleet(fleet)
    assert (await broadcast.pause(fleet, "keep")).status_code == 200
    engines[R2].fail["/pause"] = 500
    response = await broadcast.pause(fleet, "abort")
    assert response.status_code == 500
    assert engines[R1].paused is not None and engines[R2].paused is not None, "a replica was resumed: fleet mixed"
    assert fleet.ledger.paused == "keep"

    engines[R2].fail.clear()
    engines[R3] = Engine()  # a proxy restarted during the pause restores the pause and applies it to newcomers
    restarted = make_fleet(engines, tmp_path)
    try:
        assert restarted.ledger.paused == "keep"
        await ready_fleet(restarted)
        assert [engine.paused for engine in engines.values()] == ["keep", "keep", "keep"]
        assert all(path != "/resume" for path in engines[R1].calls[-3:])
    finally:
        await restarted.stop()


async def test_4_an_unload_or_resume_failing_everywhere_changes_nothing(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    await ready_fleet(fleet)
    assert (await broadcast.pause(fleet, "keep")).status_code == 200
    for engine in engines.values():
        engine.fail["/v1/unload_lora_adapter"] = 500
        engine.fail["/resume"] = 500
    unloaded = await broadcast.unload_adapter(fleet, {"lora_name": "trl-policy-v1"})
    resumed = await broadcast.resume(fleet)
    assert unloaded.status_code == resumed.status_code == 500
    assert len(fleet.ready()) == 2, "a broadcast that failed everywhere took replicas out of traffic"
    assert list(fleet.ledger.paths()) == ["trl-policy-v1"] and fleet.ledger.paused == "keep"
    assert json.loads(ledger_path(tmp_path).read_text())["adapters"][0]["name"] == "trl-policy-v1"


async def test_5_sync_holds_no_lock_during_replica_io_and_checks_a_read_after_its_last_change(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    put(fleet.ledger, "trl-policy-v1", str(tmp_path / "v1"))
    locked_during: list[str] = []
    restarted = False

    def watch(path: str) -> None:
        nonlocal restarted
        if fleet.lock.locked():
            locked_during.append(path)
        if path == "/resume" and not restarted:  # the replica restarts right after its adapters were read
            restarted = True
            engines[R1].adapters.clear()

    engines[R1].on_call = watch
    await check_and_sync(fleet, R1)
    assert locked_during == [], f"replica I/O under the fleet lock: {locked_during}"
    assert fleet.replicas[R1].state is State.READY
    assert engines[R1].adapters == {"trl-policy-v1": str(tmp_path / "v1")}, "ready without the ledger's adapter"


async def test_5_a_failing_sync_backs_off(engines: dict[str, Engine], tmp_path: Path) -> None:
    # a backoff of 2 × 30 s: the second check comes well inside it on any machine (the fixture's 0.01 s interval
    # gives 20 ms, which a loaded box can outlast between two checks)
    fleet = make_fleet(engines, tmp_path, proxy_health_interval_s=30.0)
    try:
        engines[R1].fail["/server_info"] = 500
        await check_and_sync(fleet, R1)
        replica = fleet.replicas[R1]
        assert replica.state is State.SYNCING and replica.next_sync_at > time.monotonic()
        calls = engines[R1].calls.count("/server_info")
        await check_and_sync(fleet, R1)
        assert engines[R1].calls.count("/server_info") == calls, "a failing sync was retried without backoff"
    finally:
        await fleet.stop()


async def test_8_timeouts_eject_only_after_the_window_refusals_at_once_and_removal_releases(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    fleet = make_fleet(engines, tmp_path, proxy_eject_slow_after_s=0.2)
    try:
        await ready_fleet(fleet)
        engines[R1].hang.add("/health")
        for _ in range(3):
            await fleet.check(fleet.replicas[R1])
        assert fleet.replicas[R1].state is State.READY, "a slow (busy) replica was ejected at once"
        await asyncio.sleep(0.25)
        await fleet.check(fleet.replicas[R1])
        assert fleet.replicas[R1].state is State.EJECTED
        await fleet.check(fleet.replicas[R1])  # still hanging: /fleet keeps saying for how long, not a bare timeout
        assert "timing out for" in (fleet.replicas[R1].last_error or ""), fleet.replicas[R1].last_error

        engines[R2].healthy = False
        await fleet.check(fleet.replicas[R2])
        assert fleet.replicas[R2].state is State.EJECTED, "a refused connection must eject at once"

        removed = fleet.replicas[R2]
        fleet.metrics.inflight.labels(R2).set(0)
        fleet.set_members([R1])
        await fleet.health_round()
        assert removed.http.is_closed, "the removed replica's pool stays open"
        assert R2 not in {s.labels.get("replica") for m in fleet.metrics.registry.collect() for s in m.samples}
    finally:
        await fleet.stop()


async def test_rebind_by_content_same_name_same_path_new_weights(
    fleet: Fleet, engines: dict[str, Engine], tmp_path: Path
) -> None:
    adapter = tmp_path / "runs" / "r" / ".vllm_lora" / "trl-policy-v2"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(weights_file(b"published before the crash"))
    await ready_fleet(fleet)
    body = {"lora_name": "trl-policy-v2", "lora_path": str(adapter)}
    assert (await broadcast.load_adapter(fleet, fleet.ledger.content, body)).status_code == 200
    first = fleet.ledger.get("trl-policy-v2")
    assert first is not None and first.fingerprint.startswith("sha256:")
    assert (await broadcast.load_adapter(fleet, fleet.ledger.content, body)).status_code == 200
    assert engines[R1].loads == ["trl-policy-v2"], "the same content was loaded twice"

    (adapter / "adapter_model.safetensors").write_bytes(weights_file(b"republished after the resume"))
    assert (await broadcast.load_adapter(fleet, fleet.ledger.content, body)).status_code == 200
    for engine in engines.values():
        # Not the canary's probes nor attestation's reports (reads).
        changes = [call for call in engine.calls if call not in ("/v1/completions", "/collective_rpc")]
        assert changes[-3:] == ["/v1/unload_lora_adapter", "/reset_prefix_cache", "/v1/load_lora_adapter"]
    assert fleet.ledger.get("trl-policy-v2") != first


async def test_5_a_cancelled_sync_is_awaited_before_the_next_one_and_at_stop(
    fleet: Fleet, engines: dict[str, Engine]
) -> None:
    engines[R1].gated.add("/server_info")
    await fleet.check(fleet.replicas[R1])
    first = fleet.replicas[R1].sync_task
    assert first is not None
    await asyncio.sleep(0.01)
    fleet.resync(fleet.replicas[R1], "test")  # cancels the first, starts a second that waits for it
    second = fleet.replicas[R1].sync_task
    assert second is not first
    engines[R1].gated.clear()
    engines[R1].gate.set()
    await second
    assert first.done() and fleet.replicas[R1].state is State.READY

    engines[R2].gated.add("/server_info")
    await fleet.check(fleet.replicas[R2])
    hanging = fleet.replicas[R2].sync_task
    await asyncio.sleep(0.01)
    fleet.eject(fleet.replicas[R2], "test")
    await fleet.stop()
    assert hanging is not None and hanging.done(), "stop left a cancelled sync running"
