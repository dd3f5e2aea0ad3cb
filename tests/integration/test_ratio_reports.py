"""A trainer's ratio report at the proxy (issue 54, part 3), over real HTTP against fake replicas behind the real proxy
app: a canary disagreement when another ready replica serves the adapter, only a canary re-check for the last one,
and a run reports on its own adapters only. Without its key a run's report is refused like its other routes
(test_run_keys_fleet.py's ROUTES)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lorafleet_testing.fakes import start_fakes
from lorafleet_testing.waiting import until
from test_proxy_runs import Fleet

pytestmark = pytest.mark.integration

EVIDENCE = "http://r on v1: mean log-ratio +0.5000 nats from its peers' (bound 0.0200; 64 tokens against 128)"


async def open_fleet(tmp_path: Path, replicas: int) -> Fleet:
    fakes, servers = await start_fakes(replicas)
    (tmp_path / "root").mkdir()
    fleet = Fleet(fakes, servers, tmp_path / "root", {"proxy_canary_interval_s": 0.0})
    await fleet.start()
    return fleet


@pytest.fixture
async def fleet(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    opened = await open_fleet(tmp_path, getattr(request, "param", 2))
    yield opened
    await opened.http.aclose()
    await opened.stop()
    for server in opened.servers:
        await server.stop()


async def report(fleet: Fleet, run: str, replica: str, name: str) -> tuple[int, dict]:
    answer = await fleet.http.post(fleet.url(run, "/ratio_report"),
                                   json={"replica": replica, "lora_name": name, "evidence": EVIDENCE})
    return answer.status_code, answer.json()


async def states(fleet: Fleet) -> dict[str, dict]:
    view = (await fleet.http.get(fleet.url("default", "/fleet"))).json()
    return {r["url"]: r for r in view["replicas"]}


async def test_a_report_takes_the_replica_out_resyncs_it_and_it_returns_once_the_canary_agrees(fleet: Fleet) -> None:
    assert (await fleet.load("a", "trl-policy-v1")).status_code == 200
    odd = fleet.servers[0].url
    reloads = fleet.fakes[0].loads().count("a--trl-policy-v1")
    assert await report(fleet, "a", odd, "trl-policy-v1") == (200, {"replica": odd, "lora_name": "trl-policy-v1",
                                                                     "outcome": "quarantined"})
    seen = (await states(fleet))[odd]
    assert seen["state"] != "ready" and "importance ratio" in str(seen.get("last_error")), seen
    await until(fleet.all_ready, "the reported replica re-synced and agreeing again")
    assert fleet.fakes[0].loads().count("a--trl-policy-v1") == reloads + 1  # its adapter loaded again
    assert ("/reset_prefix_cache", None) in fleet.fakes[0].calls  # and its prefix cache reset


@pytest.mark.parametrize("fleet", [1], indirect=True)
async def test_a_report_never_takes_the_last_ready_replica_out_without_the_canary(fleet: Fleet) -> None:
    assert (await fleet.load("default", "trl-policy-v1")).status_code == 200
    only = fleet.servers[0].url
    status, body = await report(fleet, "default", only, "trl-policy-v1")
    assert (status, body["outcome"]) == (200, "rechecked")  # the canary re-loaded it and found it agrees
    assert (await states(fleet))[only]["state"] == "ready"


async def test_a_run_reports_on_its_own_adapters_only(fleet: Fleet) -> None:
    assert (await fleet.load("b", "trl-policy-v1")).status_code == 200
    replica = fleet.servers[0].url
    status, body = await report(fleet, "a", replica, "b--trl-policy-v1")
    assert status == 400 and "not a name of run 'a'" in body["error"]["message"]
    status, body = await report(fleet, "a", replica, "trl-policy-v1")  # run a has no such adapter
    assert status == 404
    status, body = await report(fleet, "b", "http://127.0.0.1:9", "trl-policy-v1")
    assert status == 404 and body["error"]["param"] == "replica"
    answer = await fleet.http.post(fleet.url("b", "/ratio_report"), json={"replica": replica, "lora_name": "x y"})
    assert answer.status_code == 400
    assert all(state["state"] == "ready" for state in (await states(fleet)).values())
