"""The proxy over real HTTP against in-process fake replicas that inject faults with vLLM's exact bodies (issue 3)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet.settings import load_settings
from lorafleet.vllm_api import metric_total
from lorafleet_proxy.app import BearerAuth, create_app
from lorafleet_proxy.sync import LOAD_RETRY_FIRST_S
from lorafleet_testing.fakes import ENGINE_DEAD, FakeReplica, Running, start_fakes, start_server, weights_file
from lorafleet_testing.waiting import until

pytestmark = pytest.mark.integration

FAST = {"proxy_health_interval_s": 0.05, "proxy_eject_after": 2, "proxy_lora_load_timeout_s": 5.0}
# A load deadline that fits RETRIES attempts by construction: the proxy's backoff sleeps FIRST, 2*FIRST, ...
# before them, and each attempt is one local round trip, given up to ROUND_TRIP_S on a loaded 2-core box.
RETRIES = 3
ROUND_TRIP_S = 0.5
RETRY_DEADLINE_S = LOAD_RETRY_FIRST_S * (2 ** (RETRIES - 1) - 1) + RETRIES * ROUND_TRIP_S


class Fleet:
    """Fakes plus a proxy in front of them, and an HTTP client for the proxy."""

    def __init__(self, fakes: list[FakeReplica], servers: list[Running], proxy: Running, root: Path) -> None:
        self.fakes, self.servers, self.proxy, self.root = fakes, servers, proxy, root
        self.http = httpx.AsyncClient(base_url=proxy.url, timeout=10)

    def adapter(self, name: str) -> str:
        """Run r's adapter folder for `name` (written once, its weights the name's bytes): what a trainer publishes."""
        folder = self.root / "runs" / "r" / ".vllm_lora" / name
        if not (folder / "adapter_config.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "adapter_model.safetensors").write_bytes(weights_file(name.encode()))
            (folder / "adapter_config.json").write_text("{}")
        return str(folder)

    def stored(self, name: str) -> str:
        """The proxy's content-store folder of `name`'s adapter: what the replicas are asked to load."""
        return str(self.root / ".content" / fingerprint(self.adapter(name)).removeprefix("sha256:"))

    def entry(self, name: str, source: str) -> dict[str, str]:
        """The ledger's entry for `name` loaded from the adapter folder named `source`."""
        return {"name": name, "run": "default", "path": self.stored(source),
                "fingerprint": fingerprint(self.adapter(source)), "source": self.adapter(source)}

    async def load(self, name: str, path: str | None = None) -> httpx.Response:
        return await self.http.post("/v1/load_lora_adapter", json={"lora_name": name,
                                                                   "lora_path": path or self.adapter(name)})

    async def fleet(self) -> dict[str, Any]:
        return (await self.http.get("/fleet")).json()

    async def wait_states(self, *states: str, timeout: float = 5.0) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            view = await self.fleet()
            return view if [r["state"] for r in view["replicas"]] == list(states) else None

        return await until(reached, f"replica states {states}", timeout)


async def start_proxy(urls: list[str], root: Path, **overrides: Any) -> Running:
    settings = load_settings(proxy_upstreams=",".join(urls), adapter_root=str(root), **{**FAST, **overrides})
    return await start_server(create_app(settings))


@pytest.fixture
async def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    count, overrides = getattr(request, "param", (2, {}))
    fakes, servers = await start_fakes(count)
    proxy = await start_proxy([s.url for s in servers], tmp_path, **overrides)
    view = Fleet(fakes, servers, proxy, tmp_path)
    await view.wait_states(*["ready"] * count)
    yield view
    await view.http.aclose()
    await proxy.stop()
    for server in servers:
        if not server.task.done():
            await server.stop()


# --- broadcasts ----------------------------------------------------------------------------------
async def test_load_is_broadcast_idempotent_and_persisted(fleet: Fleet) -> None:
    response = await fleet.load("trl-policy-v1")
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'trl-policy-v1' added successfully."
    assert all(fake.adapters == {"trl-policy-v1": fleet.stored("trl-policy-v1")} for fake in fleet.fakes)

    again = await fleet.load("trl-policy-v1")
    assert again.status_code == 200
    assert all(fake.loads() == ["trl-policy-v1"] for fake in fleet.fakes), "an idempotent re-load reached replicas"

    ledger = json.loads((fleet.root / ".fleet" / "proxy-ledger.json").read_text())
    assert ledger == {"version": 4, "paused": None, "runs": {}, "adapters": [fleet.entry("trl-policy-v1",
                                                                                         "trl-policy-v1")]}
    view = await fleet.fleet()
    assert view["ledger"] == ledger["adapters"]
    assert all(r["adapters"] == {"trl-policy-v1": fleet.stored("trl-policy-v1")} for r in view["replicas"])


async def test_unload_is_broadcast_and_404_like_vllm_when_nobody_has_it(fleet: Fleet) -> None:
    await fleet.load("trl-policy-v1")
    response = await fleet.http.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert response.status_code == 200
    assert all(fake.adapters == {} for fake in fleet.fakes)
    missing = await fleet.http.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert missing.status_code == 404
    assert missing.json() == {"error": {"message": "The lora adapter 'trl-policy-v1' cannot be found.",
                                        "type": "NotFoundError", "param": None, "code": 404}}
    assert (await fleet.fleet())["ledger"] == []


async def test_failed_load_on_one_replica_rolls_back_and_returns_its_error(fleet: Fleet) -> None:
    fleet.fakes[1].faults.load_error = (500, "rank 16 is larger than max_lora_rank 8", "InternalServerError")
    response = await fleet.load("trl-policy-v1")
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"
    assert "rank 16 is larger than max_lora_rank 8" in response.json()["error"]["message"]
    assert fleet.fakes[0].loads() == ["trl-policy-v1"], "the healthy replica was never asked"
    assert all(fake.adapters == {} for fake in fleet.fakes), "the accepted load was not rolled back"
    assert (await fleet.fleet())["ledger"] == []
    text = (await fleet.http.get("/metrics")).text
    assert 'lorafleet_proxy_broadcast_rollbacks_total{op="load"} 1.0' in text
    assert 'lorafleet_proxy_broadcasts_total{op="load",outcome="failed"} 1.0' in text


async def test_lagging_volume_is_retried_per_replica_until_it_appears(fleet: Fleet) -> None:
    fleet.fakes[1].faults.not_found_loads = 3
    response = await fleet.load("trl-policy-v1")
    assert response.status_code == 200, response.text
    assert fleet.fakes[0].loads() == ["trl-policy-v1"]
    assert fleet.fakes[1].loads() == ["trl-policy-v1"] * 4


@pytest.mark.parametrize("fleet", [(2, {"proxy_lora_load_timeout_s": RETRY_DEADLINE_S})], indirect=True)
async def test_volume_that_never_catches_up_is_504_not_404_and_rolled_back(fleet: Fleet) -> None:
    fleet.fakes[1].faults.not_found_loads = 10_000
    response = await fleet.load("trl-policy-v1")
    assert response.status_code == 504, "TRL reads 404 as 'runtime LoRA disabled'"
    assert "No adapter found" in response.json()["error"]["message"]
    assert fleet.fakes[0].adapters == {}
    # Retried with backoff: how many attempts fit the deadline depends on the machine's speed, that one did not.
    assert len(fleet.fakes[1].loads()) >= 2, "no backoff retries"


async def test_same_name_new_path_unloads_resets_caches_then_loads(fleet: Fleet) -> None:
    await fleet.load("trl-policy-v1", fleet.adapter("old-run-v1"))
    response = await fleet.load("trl-policy-v1", fleet.adapter("new-run-v1"))
    assert response.status_code == 200, response.text
    for fake in fleet.fakes:
        assert [path for path, _ in fake.calls] == ["/resume", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
                                                    "/reset_prefix_cache", "/v1/load_lora_adapter"]
        assert fake.adapters == {"trl-policy-v1": fleet.stored("new-run-v1")}
    assert (await fleet.fleet())["ledger"] == [fleet.entry("trl-policy-v1", "new-run-v1")]


async def test_unsafe_paths_and_names_are_400_and_nothing_is_sent(fleet: Fleet, tmp_path: Path) -> None:
    outside = await fleet.load("trl-policy-v1", "/etc")
    escape = await fleet.load("trl-policy-v1", str(fleet.root / ".." / "elsewhere"))
    bad_name = await fleet.load("../evil", fleet.adapter("x"))
    inplace = await fleet.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": fleet.adapter("a"),
                                                                   "load_inplace": True})
    for response in (outside, escape, inplace):
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "InvalidUserInput"
    assert bad_name.status_code == 400 and bad_name.json()["error"]["param"] == "body.lora_name"
    assert all(fake.loads() == [] for fake in fleet.fakes)


@pytest.mark.parametrize("fleet", [(2, {"proxy_sync_pause": "broadcast"})], indirect=True)
async def test_partial_pause_is_compensated_and_mode_is_kept(fleet: Fleet) -> None:
    fleet.fakes[1].faults.pause_fails = True
    response = await fleet.http.post("/pause", params={"mode": "keep"})
    assert response.status_code == 500
    assert ENGINE_DEAD in response.json()["error"]["message"]
    assert ("/pause", "keep") in fleet.fakes[0].calls
    assert fleet.fakes[0].paused is None, "the replica that paused was not resumed"
    assert 'lorafleet_proxy_broadcast_rollbacks_total{op="pause"} 1.0' in (await fleet.http.get("/metrics")).text

    fleet.fakes[1].faults.pause_fails = False
    assert (await fleet.http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert [fake.paused for fake in fleet.fakes] == ["keep", "keep"]
    assert (await fleet.http.get("/is_paused")).json() == {"is_paused": True}
    assert (await fleet.http.post("/resume")).json() == {"status": "resumed"}
    assert [fake.paused for fake in fleet.fakes] == [None, None]
    text = (await fleet.http.get("/metrics")).text
    assert "lorafleet_proxy_pause_duration_seconds_count 1.0" in text  # one stall: the failed pause was undone
    assert "lorafleet_proxy_fleet_paused 0.0" in text
    bad = await fleet.http.post("/pause", params={"mode": "later"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "query.mode"


@pytest.mark.parametrize("fleet", [(2, {"proxy_health_interval_s": 60.0, "proxy_sync_pause": "broadcast"})],
                         indirect=True)
async def test_a_replica_dead_during_a_sync_is_ejected_and_the_sync_succeeds(fleet: Fleet) -> None:
    """A replica killed between health checks must not fail the trainer's pause/load/resume/unload."""
    await fleet.load("trl-policy-v1")
    await fleet.servers[1].stop()  # no health check will notice for a minute: only the broadcast sees it
    paused = await fleet.http.post("/pause", params={"mode": "keep"})
    assert paused.status_code == 200, paused.text
    view = await fleet.fleet()
    assert [r["state"] for r in view["replicas"]] == ["ready", "ejected"]
    assert "no answer during a broadcast" in view["replicas"][1]["last_error"]
    assert metric_total((await fleet.http.get("/metrics")).text, "lorafleet_proxy_replica_ejections_total") == 1
    assert fleet.fakes[0].paused
    assert (await fleet.load("trl-policy-v2")).status_code == 200
    assert (await fleet.http.post("/resume")).status_code == 200
    unloaded = await fleet.http.post("/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"})
    assert unloaded.status_code == 200
    assert fleet.fakes[0].adapters == {"trl-policy-v2": fleet.stored("trl-policy-v2")}
    assert [entry["name"] for entry in (await fleet.fleet())["ledger"]] == ["trl-policy-v2"]


async def test_state_changing_dev_routes_are_refused(fleet: Fleet) -> None:
    for path in ("/sleep", "/wake_up", "/collective_rpc", "/update_weights", "/get_world_size"):
        response = await fleet.http.post(path)
        assert response.status_code == 403, path
        assert response.json()["error"]["type"] == "Forbidden"


# --- routing and forwarding ----------------------------------------------------------------------
def _completion(prompt: list[int], model: str = "fake-base", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 3, "return_token_ids": True, "logprobs": 0, **extra}


async def test_rollouts_of_a_prompt_stick_to_one_replica(fleet: Fleet) -> None:
    prompt = list(range(100, 164))  # four 16-token blocks
    upstreams = set()
    for _ in range(4):
        response = await fleet.http.post("/v1/completions", json=_completion(prompt))
        assert response.status_code == 200
        upstreams.add(response.headers["x-proxy-upstream"])
    assert len(upstreams) == 1
    router = (await fleet.fleet())["router"]
    assert router["block_size"] == 16 and router["affinity"] == 3 and router["unmatched"] == 1


async def test_replica_dying_mid_request_is_retried_elsewhere(fleet: Fleet) -> None:
    fleet.fakes[0].faults.die_mid_request = True
    fleet.fakes[1].faults.die_mid_request = False
    for seed in range(4):
        response = await fleet.http.post("/v1/completions", json=_completion(list(range(seed, seed + 40))))
        assert response.status_code == 200, response.text
        assert response.headers["x-proxy-upstream"] == fleet.fakes[1].url
        assert response.json()["choices"][0]["token_ids"] == [7, 8, 9]


async def test_5xx_is_retried_and_relayed_when_every_replica_fails(fleet: Fleet) -> None:
    fleet.fakes[0].faults.completion_status = 500
    ok = await fleet.http.post("/v1/completions", json=_completion([1] * 40))
    assert ok.status_code == 200 and ok.headers["x-proxy-upstream"] == fleet.fakes[1].url
    fleet.fakes[1].faults.completion_status = 500
    failed = await fleet.http.post("/v1/completions", json=_completion([2] * 40))
    assert failed.status_code == 500 and failed.json()["error"]["message"] == ENGINE_DEAD


async def test_streaming_is_passed_through(fleet: Fleet) -> None:
    chunks = []
    async with fleet.http.stream("POST", "/v1/completions", json=_completion([3] * 40, stream=True)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for chunk in response.aiter_text():
            chunks.append(chunk)
    text = "".join(chunks)
    assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
    assert all(r["inflight"] == 0 for r in (await fleet.fleet())["replicas"])


async def test_dead_replica_is_ejected_and_a_returning_one_resyncs_before_traffic(fleet: Fleet) -> None:
    await fleet.load("trl-policy-v1")
    await fleet.load("trl-policy-v2")
    port = int(fleet.servers[0].url.rsplit(":", 1)[1])
    await fleet.servers[0].stop()
    for seed in range(6):  # no client-visible failure while the dead replica is still "ready"
        response = await fleet.http.post("/v1/completions", json=_completion(list(range(seed, seed + 40))))
        assert response.status_code == 200
    view = await fleet.wait_states("ejected", "ready")
    assert view["replicas"][0]["adapters"] == {} and view["replicas"][0]["last_error"]
    assert (await fleet.http.get("/health")).status_code == 200

    reborn = FakeReplica()  # a restarted replica: no adapters
    reborn.url = fleet.servers[0].url
    fleet.servers[0] = await start_server(reborn.app(), port)
    await fleet.wait_states("ready", "ready")
    assert reborn.loads() == ["trl-policy-v1", "trl-policy-v2"], "catch-up must load the ledger in order"


@pytest.mark.parametrize("status", [500, 503])
async def test_a_replica_that_answers_health_but_cannot_generate_is_never_admitted(tmp_path: Path,
                                                                                   status: int) -> None:
    """Ready means it generates: /health 200 with an engine that fails every request (vLLM's CPU image without a
    C++ compiler) stays out of traffic, with the replica's own error, until a warm-up completion succeeds."""
    fakes, servers = await start_fakes(2)
    fakes[1].faults.completion_status = status
    proxy = await start_proxy([s.url for s in servers], tmp_path)
    view = Fleet(fakes, servers, proxy, tmp_path)
    try:
        async def one_ready_one_mute() -> dict[str, Any] | None:
            snapshot = await view.fleet()
            mute = snapshot["replicas"][1]
            return snapshot if snapshot["replicas"][0]["state"] == "ready" and mute["generates"] is False else None

        snapshot = await until(one_ready_one_mute, "the mute replica reported")
        mute = snapshot["replicas"][1]
        assert mute["state"] == "syncing" and mute["adapters"] == {}, mute
        assert mute["last_error"].startswith(f"sync: {status}") and "cannot generate" in mute["last_error"]
        assert ENGINE_DEAD in mute["last_error"], "the replica's own error is kept"
        assert (await view.load("trl-policy-v1")).status_code == 200  # broadcasts go to ready replicas only
        for seed in range(6):
            response = await view.http.post("/v1/completions", json=_completion(list(range(seed, seed + 40))))
            assert response.status_code == 200 and response.headers["x-proxy-upstream"] == servers[0].url
        assert (await view.fleet())["replicas"][1]["routed"] == 0
        fakes[1].faults.completion_status = None  # the engine recovers (say, restarted with a compiler)
        admitted = await view.wait_states("ready", "ready", timeout=15)
        assert admitted["replicas"][1]["generates"] is True and admitted["replicas"][1]["last_error"] is None
        assert "trl-policy-v1" in fakes[1].adapters, "admitted only after catch-up"
    finally:
        await view.http.aclose()
        await proxy.stop()
        for server in servers:
            await server.stop()


@pytest.mark.parametrize("fleet", [(2, {"proxy_health_interval_s": 60.0, "proxy_eject_after": 5})], indirect=True)
async def test_a_routed_request_refused_by_a_replica_ejects_it_at_once(fleet: Fleet) -> None:
    """Refused = nothing listens: the routed call that finds out ejects it, without waiting for health checks."""
    await fleet.servers[0].stop()
    dead = fleet.servers[0].url
    for seed in range(8):  # spread over both replicas; the first one sent to the dead replica ejects it
        response = await fleet.http.post("/v1/completions", json=_completion(list(range(seed, seed + 40))))
        assert response.status_code == 200 and response.headers["x-proxy-upstream"] != dead
        replica = next(r for r in (await fleet.fleet())["replicas"] if r["url"] == dead)
        if replica["state"] == "ejected":
            break
    assert replica["state"] == "ejected" and replica["routed"] == 1, f"not ejected by the first refused call: {replica}"
    assert "Cannot connect" in replica["last_error"] or "Connect" in replica["last_error"], replica["last_error"]


async def test_restarted_replica_that_lost_its_adapters_goes_back_through_syncing(fleet: Fleet) -> None:
    await fleet.load("trl-policy-v1")
    fleet.fakes[0].adapters.clear()  # what a fast restart looks like from outside

    async def reloaded() -> dict[str, str]:
        return fleet.fakes[0].adapters

    await until(reloaded, "the adapter loaded again on the restarted replica")
    assert fleet.fakes[0].adapters == {"trl-policy-v1": fleet.stored("trl-policy-v1")}
    await fleet.wait_states("ready", "ready")


# --- fleet views ---------------------------------------------------------------------------------
async def test_server_info_models_health_metrics(fleet: Fleet) -> None:
    fleet.fakes[1].max_loras = 3
    await fleet.load("trl-policy-v1")
    info = (await fleet.http.get("/server_info", params={"config_format": "json"})).json()["vllm_config"]
    assert info["lora_config"]["max_loras"] == 3 and info["lora_config"]["max_lora_rank"] == 8
    assert info["parallel_config"]["data_parallel_size"] == 1
    models = (await fleet.http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["fake-base", "trl-policy-v1"]
    assert models[0]["max_model_len"] == 512 and models[1]["root"] == fleet.stored("trl-policy-v1")
    health = await fleet.http.get("/health")
    assert health.status_code == 200 and [r["state"] for r in health.json()["replicas"]] == ["ready", "ready"]
    text = (await fleet.http.get("/metrics")).text
    assert 'lorafleet_proxy_broadcasts_total{op="load",outcome="ok"} 1.0' in text
    assert 'lorafleet_proxy_replicas{state="ready"} 2.0' in text
    assert all(f'lorafleet_proxy_replica_adapters{{replica="{server.url}"}} 1.0' in text for server in fleet.servers)
    assert "lorafleet_proxy_replica_sync_duration_seconds_count 2.0" in text
    assert 'lorafleet_proxy_requests_total{route="/v1/load_lora_adapter",status="200"} 1.0' in text


@pytest.mark.parametrize("fleet", [(1, {"proxy_min_ready": 2})], indirect=True)
async def test_health_is_503_below_min_ready(fleet: Fleet) -> None:
    response = await fleet.http.get("/health")
    assert response.status_code == 503
    assert response.json()["ready"] == 1 and response.json()["min_ready"] == 2


async def test_ledger_is_restored_by_a_restarted_proxy(fleet: Fleet) -> None:
    await fleet.load("trl-policy-v1")
    await fleet.load("trl-policy-v2")
    fresh, servers = await start_fakes(1)
    proxy = await start_proxy([servers[0].url], fleet.root)
    try:
        async with httpx.AsyncClient(base_url=proxy.url) as client:
            async def ready() -> dict[str, Any] | None:
                view = (await client.get("/fleet")).json()
                return view if view["replicas"][0]["state"] == "ready" else None

            view = await until(ready, "the restarted proxy's replica to be ready")
        assert [entry["name"] for entry in view["ledger"]] == ["trl-policy-v1", "trl-policy-v2"]
        assert fresh[0].loads() == ["trl-policy-v1", "trl-policy-v2"]
    finally:
        await proxy.stop()
        await servers[0].stop()


async def test_dns_discovery_and_public_port_auth(tmp_path: Path) -> None:
    _, servers = await start_fakes(1)
    port = servers[0].url.rsplit(":", 1)[1]
    settings = load_settings(proxy_upstream_dns=f"127.0.0.1:{port}", adapter_root=str(tmp_path),
                             proxy_api_key="s3cret", proxy_public_port=1, **FAST)
    app = create_app(settings)
    fleet_port = await start_server(app)
    public = await start_server(BearerAuth(app, settings.proxy_api_key), lifespan="off")
    try:
        async with httpx.AsyncClient() as client:
            async def healthy() -> bool:
                return (await client.get(fleet_port.url + "/health")).status_code == 200

            await until(healthy, "the proxy to discover its replica through DNS")
            denied = await client.get(public.url + "/v1/models")
            wrong = await client.get(public.url + "/v1/models", headers={"Authorization": "Bearer nope"})
            allowed = await client.get(public.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert denied.status_code == wrong.status_code == 401
        assert denied.json()["error"]["code"] == 401
        assert allowed.status_code == 200 and allowed.json()["data"][0]["id"] == "fake-base"
    finally:
        await public.stop()
        await fleet_port.stop()
        await servers[0].stop()
