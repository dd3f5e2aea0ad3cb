"""Several runs on one fleet (issue 24), over real HTTP with fake replicas: namespaces, isolation, the slot
budget, run pauses held at the proxy, leases, restart survival and per-run views.

The stateful test over two or three runs is in test_fleet_state_machine.py; the real-vLLM logprob check of
two runs publishing the same names is in test_runs_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.ledger_format import fingerprint, ledger_path
from lorafleet.settings import load_settings
from lorafleet_proxy.app import BearerAuth, create_app
from lorafleet_testing.fakes import FakeReplica, Running, start_fakes, start_server, weights_file
from test_proxy_faults import FAST, until

pytestmark = pytest.mark.integration

KEY = "runs-test-key"


class Fleet:
    """Two fakes behind a proxy (fleet port and public port), and one client per run."""

    def __init__(self, fakes: list[FakeReplica], servers: list[Running], root: Path, overrides: dict[str, Any]) -> None:
        self.fakes, self.servers, self.root, self.overrides = fakes, servers, root, overrides
        self.proxy: Running | None = None
        self.public: Running | None = None
        self.http = httpx.AsyncClient(timeout=10)

    async def start(self) -> None:
        settings = load_settings(proxy_upstreams=",".join(s.url for s in self.servers), adapter_root=str(self.root),
                                 proxy_api_key=KEY, **{**FAST, "max_staleness": 1, **self.overrides})
        app = create_app(settings)
        self.app = app
        self.proxy = await start_server(app)
        self.public = await start_server(BearerAuth(app, KEY), lifespan="off")
        await until(self.all_ready, "every replica ready")

    async def stop(self) -> None:
        for server in (self.public, self.proxy):
            if server is not None:
                await server.stop()

    async def all_ready(self) -> bool:
        view = (await self.http.get(self.url("default", "/fleet"))).json()
        return all(r["state"] == "ready" for r in view["replicas"])

    def url(self, run: str, path: str) -> str:
        assert self.proxy is not None
        return self.proxy.url + ("" if run == "default" else f"/runs/{run}") + path

    def publish(self, run: str, name: str, content: str) -> str:
        directory = self.root / "runs" / run / ".vllm_lora" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps({"r": 1}))
        (directory / "adapter_model.safetensors").write_bytes(weights_file(content.encode()))
        return str(directory)

    async def load(self, run: str, name: str, content: str | None = None) -> httpx.Response:
        path = self.publish(run, name, content or f"{run}/{name}")
        return await self.http.post(self.url(run, "/v1/load_lora_adapter"), json={"lora_name": name, "lora_path": path})

    async def complete(self, run: str, model: str, **extra: Any) -> httpx.Response:
        return await self.http.post(self.url(run, "/v1/completions"),
                                    json={"model": model, "prompt": list(range(40)), "max_tokens": 3, **extra})

    async def models(self, run: str) -> list[str]:
        data = (await self.http.get(self.url(run, "/v1/models"))).json()["data"]
        return [card["id"] for card in data[1:]]


@pytest.fixture
async def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    overrides = getattr(request, "param", {})
    fakes, servers = await start_fakes(2)
    view = Fleet(fakes, servers, tmp_path, overrides)
    await view.start()
    yield view
    await view.http.aclose()
    await view.stop()
    for server in servers:
        await server.stop()


async def test_two_runs_hold_the_same_names_with_their_own_weights(fleet: Fleet) -> None:
    for run in ("a", "b"):
        response = await fleet.load(run, "trl-policy-v1")
        assert response.status_code == 200, response.text
        assert response.text == "Success: LoRA adapter 'trl-policy-v1' added successfully."  # the run's own name
    for fake in fleet.fakes:
        assert set(fake.adapters) == {"a--trl-policy-v1", "b--trl-policy-v1"}
    assert await fleet.models("a") == ["trl-policy-v1"] and await fleet.models("b") == ["trl-policy-v1"]
    assert await fleet.models("default") == []  # the default run sees only its own adapters on the fleet port
    for run in ("a", "b"):
        answer = (await fleet.complete(run, "trl-policy-v1")).json()
        assert answer["model"] == "trl-policy-v1"  # mapped back
        expected = fingerprint(fleet.root / "runs" / run / ".vllm_lora" / "trl-policy-v1")
        assert answer["served_fingerprint"] == expected, f"run {run} decoded with another run's weights"
    ledger = json.loads(ledger_path(fleet.root).read_text())
    assert ledger["version"] == 4
    assert [(e["name"], e["run"]) for e in ledger["adapters"]] == [("a--trl-policy-v1", "a"), ("b--trl-policy-v1", "b")]


async def test_a_run_never_sees_or_touches_another_runs_adapters(fleet: Fleet) -> None:
    assert (await fleet.load("a", "trl-policy-v1")).status_code == 200
    hidden = await fleet.complete("b", "a--trl-policy-v1")
    assert hidden.status_code == 404 and "`a--trl-policy-v1` does not exist" in hidden.text
    assert (await fleet.complete("default", "a--trl-policy-v1")).status_code == 404  # fleet port: hidden too
    unload = await fleet.http.post(fleet.url("b", "/v1/unload_lora_adapter"), json={"lora_name": "a--trl-policy-v1"})
    assert unload.status_code == 404
    unload = await fleet.http.post(fleet.url("b", "/v1/unload_lora_adapter"), json={"lora_name": "trl-policy-v1"})
    assert unload.status_code == 404 and "'trl-policy-v1' cannot be found" in unload.text
    load = await fleet.http.post(fleet.url("default", "/v1/load_lora_adapter"),
                                 json={"lora_name": "a--trl-policy-v1", "lora_path": fleet.publish("a", "x", "x")})
    assert load.status_code == 400 and "another run's adapter name" in load.text
    assert all(set(fake.adapters) == {"a--trl-policy-v1"} for fake in fleet.fakes)
    assert fleet.public is not None  # the public port may name any run's adapter by its qualified name
    public = await fleet.http.post(fleet.public.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                   json={"model": "a--trl-policy-v1", "prompt": "hello", "max_tokens": 2})
    assert public.status_code == 200 and public.json()["model"] == "a--trl-policy-v1"
    models = await fleet.http.get(fleet.public.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert [card["id"] for card in models.json()["data"][1:]] == ["a--trl-policy-v1"]


async def test_streamed_answers_carry_the_runs_own_name(fleet: Fleet) -> None:
    assert (await fleet.load("a", "trl-policy-v1")).status_code == 200
    response = await fleet.complete("a", "trl-policy-v1", stream=True)
    assert response.status_code == 200
    assert "a--" not in response.text and response.text.count('"model": "trl-policy-v1"') == 3, response.text


@pytest.mark.parametrize("fleet", [{"max_staleness": 1}], indirect=True)
async def test_the_slot_budget_refuses_a_run_that_does_not_fit_and_changes_nothing(fleet: Fleet) -> None:
    # The fakes have --max-loras 6: a (3 slots) and b (3 slots) fit; c does not.
    for run in ("a", "b"):
        response = await fleet.http.post(fleet.url(run, "/register"), json={"max_staleness": 1})
        assert response.status_code == 200, response.text
        assert response.json()["slots"] == 3
    refused = await fleet.http.post(fleet.url("c", "/register"), json={"max_staleness": 0})
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert "needs 2 LoRA slot(s)" in message and "slot budget is 6" in message and "a (3), b (3)" in message
    assert refused.json()["error"]["type"] == "SlotBudgetExceeded"
    load = await fleet.load("c", "trl-policy-v1")  # a run that never registered is admitted at its first load
    assert load.status_code == 409 and "slot budget is 6" in load.text
    assert all("c--trl-policy-v1" not in fake.adapters for fake in fleet.fakes)
    info = (await fleet.http.get(fleet.url("a", "/server_info"), params={"config_format": "json"})).json()
    assert info["vllm_config"]["lora_config"]["max_loras"] == 3  # what TRL checks its max_staleness against
    for version in (1, 2, 3):
        assert (await fleet.load("a", f"trl-policy-v{version}")).status_code == 200
    over = await fleet.load("a", "trl-policy-v4")
    assert over.status_code == 409 and "more adapters than the 3 slot(s) it reserved" in over.text
    assert all(len(fake.adapters) <= fake.max_loras for fake in fleet.fakes)
    view = (await fleet.http.get(fleet.url("default", "/fleet"))).json()
    assert view["slots"]["capacity"] == 6 and view["slots"]["by_run"] == {"a": 3, "b": 3}


async def test_a_runs_pause_holds_only_its_requests_and_pauses_no_replica(fleet: Fleet) -> None:
    for run in ("a", "b"):
        assert (await fleet.load(run, "trl-policy-v1")).status_code == 200
    pause = await fleet.http.post(fleet.url("a", "/pause"), params={"mode": "abort"})
    assert pause.status_code == 200
    assert (await fleet.http.get(fleet.url("a", "/is_paused"))).json() == {"is_paused": True}
    assert all(fake.paused is None for fake in fleet.fakes), "a run's pause reached a replica"
    held = asyncio.ensure_future(fleet.complete("a", "trl-policy-v1"))
    other = await fleet.complete("b", "trl-policy-v1")
    assert other.status_code == 200, "run a's pause stalled run b"
    await asyncio.sleep(0.2)
    assert not held.done(), "run a's request was not held while it was paused"
    assert (await fleet.http.post(fleet.url("a", "/resume"))).status_code == 200
    assert (await asyncio.wait_for(held, 5)).status_code == 200


async def test_a_run_pause_survives_a_proxy_restart(fleet: Fleet) -> None:
    assert (await fleet.load("a", "trl-policy-v1")).status_code == 200
    assert (await fleet.http.post(fleet.url("a", "/pause"), params={"mode": "wait"})).status_code == 200
    await fleet.stop()
    await fleet.start()
    assert (await fleet.http.get(fleet.url("a", "/is_paused"))).json() == {"is_paused": True}
    assert await fleet.models("a") == ["trl-policy-v1"]
    assert all(set(fake.adapters) == {"a--trl-policy-v1"} for fake in fleet.fakes)
    assert (await fleet.http.post(fleet.url("a", "/resume"))).status_code == 200
    assert (await fleet.complete("a", "trl-policy-v1")).status_code == 200


async def test_a_run_whose_registration_was_lost_can_still_pause(fleet: Fleet) -> None:
    """A corrupt ledger is rebuilt from the replicas: runs keep their adapters but not their registrations; a pause
    of such a run registers it with the proxy's MAX_STALENESS (found by the state machine: it was a 500)."""
    assert (await fleet.load("b", "trl-policy-v1")).status_code == 200
    await fleet.stop()
    ledger_path(fleet.root).write_text('{"version": 3, "adapters": [{"na')
    await fleet.start()
    assert await fleet.models("b") == ["trl-policy-v1"]
    pause = await fleet.http.post(fleet.url("b", "/pause"), params={"mode": "abort"})
    assert pause.status_code == 200, pause.text
    assert (await fleet.http.get(fleet.url("b", "/is_paused"))).json() == {"is_paused": True}
    assert all(fake.paused is None for fake in fleet.fakes), "a run's pause reached a replica"
    assert (await fleet.http.post(fleet.url("b", "/resume"))).status_code == 200
    assert (await fleet.complete("b", "trl-policy-v1")).status_code == 200


# A lease long enough that run b, which asks again between checks, never comes near it on a loaded machine (at
# 0.6 s, b expired too while the test read /fleet and /metrics under load), short enough to keep the test quick.
@pytest.mark.parametrize("fleet", [{"run_lease_s": 3.0}], indirect=True)
async def test_an_idle_run_expires_and_its_adapters_leave_every_replica(fleet: Fleet) -> None:
    for run in ("a", "b"):
        assert (await fleet.load(run, "trl-policy-v1")).status_code == 200
        assert (await fleet.load(run, "trl-policy-v2")).status_code == 200

    async def a_expired() -> bool:
        """Done once every replica lost a's adapters and the expiry was counted (after the unloads)."""
        assert (await fleet.complete("b", "trl-policy-v1")).status_code == 200  # b keeps its lease
        unloaded = all(set(fake.adapters) == {"b--trl-policy-v1", "b--trl-policy-v2"} for fake in fleet.fakes)
        metrics = (await fleet.http.get(fleet.url("default", "/metrics"))).text
        return unloaded and "lorafleet_proxy_run_expirations_total 1.0" in metrics

    await until(a_expired, "run a expired on every replica and counted", timeout=30)
    view = (await fleet.http.get(fleet.url("default", "/fleet"))).json()
    assert [row["run"] for row in view["runs"] if row["slots"]] == ["b"]
    assert [e["name"] for e in view["ledger"]] == ["b--trl-policy-v1", "b--trl-policy-v2"]
    assert (await fleet.load("a", "trl-policy-v1")).status_code == 200  # a trainer that comes back republishes


async def test_runs_are_listed_per_run_with_tokens_and_shares(fleet: Fleet) -> None:
    for run in ("a", "b"):
        assert (await fleet.load(run, "trl-policy-v1")).status_code == 200
    for _ in range(3):
        assert (await fleet.complete("a", "trl-policy-v1")).status_code == 200
    assert (await fleet.complete("b", "trl-policy-v1")).status_code == 200
    rows = {row["run"]: row for row in (await fleet.http.get(fleet.url("default", "/fleet"))).json()["runs"]}
    assert rows["a"]["adapters"] == ["trl-policy-v1"] and rows["a"]["generated_tokens"] == 9
    assert rows["b"]["generated_tokens"] == 3 and rows["a"]["share"] == 0.75
    metrics = (await fleet.http.get(fleet.url("default", "/metrics"))).text
    assert 'lorafleet_proxy_run_tokens_total{kind="generated",run="a"} 9.0' in metrics
    assert 'lorafleet_proxy_run_slots{run="a"} 3.0' in metrics


async def test_a_malformed_run_name_is_refused(fleet: Fleet) -> None:
    response = await fleet.http.get(fleet.url("default", "/runs/a--b/v1/models"))
    assert response.status_code == 404 and "invalid run name" in response.text


async def test_trls_own_client_works_under_a_run_prefix(fleet: Fleet) -> None:
    """TRL 1.16's VLLMClient, unmodified, pointed at /runs/a: every call it makes in LoRA mode (health, models,
    server info, pause, load, resume, unload) is served for run a, in run a's namespace."""
    from accelerate import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient as TRLClient

    PartialState(cpu=True)  # TRL's logging needs accelerate's state, as inside a trainer
    client = TRLClient(fleet.url("a", ""), server_timeout=10)
    path = fleet.publish("a", "trl-policy-v1", "a/v1")

    def sync() -> dict[str, Any]:
        client.wait_for_server_ready(poll_interval_s=0.1)
        assert client.get_max_model_len() == 512
        info = client.get_server_info()
        client.pause()
        client.load_lora_adapter("trl-policy-v1", path)
        client.resume()
        return info

    info = await asyncio.to_thread(sync)
    assert info["lora_config"]["max_loras"] == 6  # before its first load run a could get every free slot
    assert all(set(fake.adapters) == {"a--trl-policy-v1"} for fake in fleet.fakes)
    assert all(fake.paused is None for fake in fleet.fakes)
    await asyncio.to_thread(client.unload_lora_adapter, "trl-policy-v1")
    assert all(fake.adapters == {} for fake in fleet.fakes)
