"""Pause elision (issue 13): the trainer's keep pause touches no replica; every other pause still does.

The proxy runs in-process over real HTTP with both of its ports (the fleet port, and the public port
wrapped in BearerAuth) in front of fake replicas that record every state-changing call they get.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet.vllm_api import metric_total
from lorafleet_proxy.app import BearerAuth, create_app
from lorafleet_testing.fakes import FakeReplica, Running, start_fakes, start_server
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

KEY = "elision-test-key"


class Ports:
    """One proxy app served on a fleet port and a public port, and a client for each."""

    def __init__(self, fakes: list[FakeReplica], root: Path, port: int | None = None, **overrides: Any) -> None:
        self.fakes, self.root, self.port, self.overrides = fakes, root, port, overrides
        self.servers: list[Running] = []

    async def start(self) -> Ports:
        settings = load_settings(proxy_upstreams=",".join(fake.url for fake in self.fakes),
                                 adapter_root=str(self.root), proxy_health_interval_s=0.05, **self.overrides)
        app = create_app(settings)
        fleet_port = await start_server(app, port=self.port)
        public_port = await start_server(BearerAuth(app, KEY), lifespan="off")
        self.servers = [fleet_port, public_port]
        self.fleet = httpx.AsyncClient(base_url=fleet_port.url, timeout=10)
        self.public = httpx.AsyncClient(base_url=public_port.url, timeout=10,
                                        headers={"Authorization": f"Bearer {KEY}"})
        for _ in range(250):
            if [r["state"] for r in (await self.fleet.get("/fleet")).json()["replicas"]] == ["ready"] * len(self.fakes):
                return self
            await asyncio.sleep(0.02)
        raise AssertionError("replicas never became ready")

    async def stop(self) -> None:
        for client in (self.fleet, self.public):
            await client.aclose()
        for server in reversed(self.servers):
            await server.stop()

    def calls(self) -> list[list[tuple[str, Any]]]:
        """Each replica's pause/resume calls so far."""
        return [[call for call in fake.calls if call[0] in ("/pause", "/resume")] for fake in self.fakes]

    async def is_paused(self) -> bool:
        return bool((await self.fleet.get("/is_paused")).json()["is_paused"])

    async def elided(self) -> float:
        return metric_total((await self.fleet.get("/metrics")).text, "lorafleet_proxy_pauses_elided_total")

    async def held_pauses(self) -> float:
        """How many broadcast pauses held the replicas until a resume (the pause-held histogram's count)."""
        text = (await self.fleet.get("/metrics")).text
        return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                    if sample.name == "lorafleet_proxy_pause_duration_seconds_count")


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeReplica]]:
    replicas, servers = await start_fakes(2)
    yield replicas
    for server in servers:
        await server.stop()


@pytest.fixture
async def proxy(fakes: list[FakeReplica], tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Ports]:
    ports = await Ports(fakes, tmp_path, **getattr(request, "param", {})).start()
    yield ports
    await ports.stop()


async def test_trainer_keep_pause_and_its_resume_touch_no_replica(proxy: Ports) -> None:
    before = proxy.calls()
    assert (await proxy.fleet.get("/fleet")).json()["sync_pause"] == "elide"  # the default
    paused = await proxy.fleet.post("/pause", params={"mode": "keep"})
    assert paused.status_code == 200 and paused.json() == {"status": "paused"}  # what TRL expects
    assert proxy.calls() == before, "an elided pause reached a replica"
    assert await proxy.is_paused() is False, "/is_paused must report the replicas' real state"
    assert [fake.paused for fake in proxy.fakes] == [None, None]
    resumed = await proxy.fleet.post("/resume")
    assert resumed.status_code == 200 and resumed.json() == {"status": "resumed"}
    assert proxy.calls() == before, "the resume of an elided pause reached a replica"
    assert await proxy.elided() == 1
    assert await proxy.held_pauses() == 0


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_abort_and_wait_pauses_from_the_trainer_are_broadcast(proxy: Ports, mode: str) -> None:
    before = proxy.calls()
    assert (await proxy.fleet.post("/pause", params={"mode": mode})).json() == {"status": "paused"}
    assert [calls[len(done):] for calls, done in zip(proxy.calls(), before, strict=True)] == [[("/pause", mode)]] * 2
    assert await proxy.is_paused() is True
    assert (await proxy.fleet.post("/resume")).json() == {"status": "resumed"}
    assert [fake.paused for fake in proxy.fakes] == [None, None]
    assert await proxy.is_paused() is False
    assert await proxy.elided() == 0
    assert await proxy.held_pauses() == 1


async def test_keep_pause_on_the_public_port_is_broadcast(proxy: Ports) -> None:
    assert (await proxy.public.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert [fake.paused for fake in proxy.fakes] == ["keep", "keep"]
    assert await proxy.is_paused() is True
    assert (await proxy.public.get("/is_paused")).json() == {"is_paused": True}
    assert (await proxy.public.post("/resume")).json() == {"status": "resumed"}
    assert [fake.paused for fake in proxy.fakes] == [None, None]
    assert await proxy.elided() == 0


async def test_operator_pause_survives_the_trainers_elided_sync(proxy: Ports) -> None:
    """An operator holds the fleet; a trainer sync (keep pause, resume) must not undo that."""
    assert (await proxy.public.post("/pause", params={"mode": "abort"})).status_code == 200
    assert (await proxy.fleet.post("/pause", params={"mode": "keep"})).status_code == 200
    assert (await proxy.fleet.post("/resume")).status_code == 200
    assert [fake.paused for fake in proxy.fakes] == ["abort", "abort"]
    assert await proxy.is_paused() is True
    assert (await proxy.public.post("/resume")).status_code == 200
    assert await proxy.is_paused() is False


async def test_a_broadcast_pause_after_an_elided_one_gets_a_broadcast_resume(proxy: Ports) -> None:
    assert (await proxy.fleet.post("/pause", params={"mode": "keep"})).status_code == 200
    assert (await proxy.fleet.post("/pause", params={"mode": "wait"})).status_code == 200
    assert [fake.paused for fake in proxy.fakes] == ["wait", "wait"]
    assert (await proxy.fleet.post("/resume")).status_code == 200
    assert [fake.paused for fake in proxy.fakes] == [None, None], "the resume was elided: the fleet stays paused"


@pytest.mark.parametrize("proxy", [{"proxy_sync_pause": "broadcast"}], indirect=True)
async def test_broadcast_mode_pauses_every_replica_for_the_trainer(proxy: Ports) -> None:
    assert (await proxy.fleet.get("/fleet")).json()["sync_pause"] == "broadcast"
    assert (await proxy.fleet.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert [fake.paused for fake in proxy.fakes] == ["keep", "keep"]
    assert await proxy.is_paused() is True
    assert (await proxy.fleet.post("/resume")).json() == {"status": "resumed"}
    assert [fake.paused for fake in proxy.fakes] == [None, None]
    assert await proxy.is_paused() is False
    assert await proxy.elided() == 0


@pytest.mark.parametrize("mode", ["elide", "broadcast"])
async def test_a_restarted_proxy_keeps_the_mode(fakes: list[FakeReplica], tmp_path: Path, mode: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode is a setting (PROXY_SYNC_PAUSE from the environment): a restart mid-sync keeps it.

    The trainer's resume after the restart reaches a proxy that never saw the elided pause: it is
    broadcast, which is harmless (the replicas were never paused), and the next sync is elided again.
    """
    monkeypatch.setenv("PROXY_SYNC_PAUSE", mode)
    first = await Ports(fakes, tmp_path).start()
    port = int(first.servers[0].url.rsplit(":", 1)[1])
    assert (await first.fleet.post("/pause", params={"mode": "keep"})).status_code == 200
    await first.stop()

    second = await Ports(fakes, tmp_path, port=port).start()
    try:
        assert (await second.fleet.get("/fleet")).json()["sync_pause"] == mode
        assert (await second.fleet.post("/resume")).status_code == 200  # TRL retries it across the restart
        assert [fake.paused for fake in fakes] == [None, None]
        before = second.calls()
        assert (await second.fleet.post("/pause", params={"mode": "keep"})).status_code == 200
        touched = second.calls() != before
        assert touched is (mode == "broadcast")
        assert await second.is_paused() is (mode == "broadcast")
        assert (await second.fleet.post("/resume")).status_code == 200
        assert await second.is_paused() is False
    finally:
        await second.stop()
