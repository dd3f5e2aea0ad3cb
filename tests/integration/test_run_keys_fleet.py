"""Per-run keys over real HTTP (issue 34): a named run's routes on the fleet port need that run's key.

Every route a run can call is tried without a key, with a key of no run and with another run's key: each is 401 or
403 with vLLM's error body, and nothing changes anywhere (no replica is asked, the ledger file keeps its bytes, no
run appears in /fleet, no lease starts). With its key a run works as before, the default run needs none, the
operator's key on the public port reaches every run, and a key made while the proxy runs is taken at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from lorafleet.ledger_format import ledger_path
from lorafleet.run_key_store import provision
from lorafleet_testing.fakes import start_fakes
from test_proxy_runs import KEY, Fleet

pytestmark = pytest.mark.integration

# (method, route under /runs/<run>, JSON body): every route a trainer calls, and the views
ROUTES = [
    ("POST", "/v1/load_lora_adapter", {"lora_name": "trl-policy-v9", "lora_path": "/x"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "trl-policy-v1"}),
    ("POST", "/register", {"max_staleness": 1}),
    ("POST", "/ratio_report", {"replica": "http://x", "lora_name": "trl-policy-v1", "evidence": "departs"}),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/v1/completions", {"model": "trl-policy-v1", "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": "trl-policy-v1", "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None),
    ("GET", "/server_info", None),
    ("GET", "/is_paused", None),
    ("GET", "/fleet", None),
    ("GET", "/health", None),
]


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[tuple[Fleet, dict[str, str]]]:
    directory = tmp_path / "run-keys"
    minted = {run: provision(directory, run) for run in ("a", "b")}
    fakes, servers = await start_fakes(2)
    fleet = Fleet(fakes, servers, tmp_path / "root", {"run_keys_dir": str(directory)})
    (tmp_path / "root").mkdir()
    await fleet.start()
    yield fleet, minted
    await fleet.http.aclose()
    await fleet.stop()
    for server in servers:
        await server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(fleet: Fleet, run: str, method: str, route: str, body: object,
               headers: dict[str, str]) -> httpx.Response:
    return await fleet.http.request(method, fleet.url(run, route), json=body, headers=headers)


async def observed(fleet: Fleet) -> tuple[object, ...]:
    """Everything a refused request could have changed."""
    view = (await fleet.http.get(fleet.url("default", "/fleet"))).json()
    replica_calls = tuple((tuple(fake.calls), fake.completions) for fake in fleet.fakes)  # health checks aside
    runs = [{key: value for key, value in row.items() if key not in ("idle_s", "lease_left_s")} for row in view["runs"]]
    last_seen = {run: live.last_seen for run, live in fleet.app.state.runs.live.items()}  # no lease renewed
    return (ledger_path(fleet.root).read_bytes(), view["ledger"], runs, view["slots"], view["paused"],
            replica_calls, last_seen)


async def test_without_its_key_no_route_of_a_run_answers_and_nothing_changes(keyed: tuple[Fleet, dict[str, str]]) \
        -> None:
    fleet, minted = keyed
    assert (await call(fleet, "a", *ROUTES[0][:2], {"lora_name": "trl-policy-v1",
                                                    "lora_path": fleet.publish("a", "trl-policy-v1", "a1")},
                       bearer(minted["a"]))).status_code == 200
    before = await observed(fleet)
    credentials = [({}, 401, "Unauthorized"), (bearer("lfr_of-no-run"), 401, "Unauthorized"),
                   ({"Authorization": minted["a"]}, 401, "Unauthorized"),  # no scheme
                   (bearer(minted["b"]), 403, "Forbidden")]
    for method, route, body in ROUTES:
        for headers, status, error_type in credentials:
            response = await call(fleet, "a", method, route, body, headers)
            assert response.status_code == status, (route, headers, response.text)
            error = response.json()["error"]
            assert error["type"] == error_type and error["code"] == status and "run 'a'" in error["message"]
    # A run that has no key at all is refused the same way, even when it would only register.
    response = await call(fleet, "c", "POST", "/register", {"max_staleness": 1}, bearer(minted["a"]))
    assert response.status_code == 403
    response = await call(fleet, "c", "POST", "/register", {"max_staleness": 1}, {})
    assert response.status_code == 401
    assert await observed(fleet) == before


async def test_with_their_keys_runs_work_the_default_run_needs_none_and_operators_reach_every_run(
        keyed: tuple[Fleet, dict[str, str]]) -> None:
    fleet, minted = keyed
    for run in ("a", "b"):
        load = await call(fleet, run, "POST", "/v1/load_lora_adapter",
                          {"lora_name": "trl-policy-v1", "lora_path": fleet.publish(run, "trl-policy-v1", run)},
                          bearer(minted[run]))
        assert load.status_code == 200, load.text
        answer = await call(fleet, run, "POST", "/v1/completions",
                            {"model": "trl-policy-v1", "prompt": "hi", "max_tokens": 2}, bearer(minted[run]))
        assert answer.status_code == 200 and answer.json()["model"] == "trl-policy-v1"
        assert answer.headers["x-lorafleet-run"] == run
        for route in ("/pause?mode=keep", "/resume"):
            assert (await call(fleet, run, "POST", route, None, bearer(minted[run]))).status_code == 200
    default = await call(fleet, "default", "POST", "/v1/completions", {"model": "fake-base", "prompt": "hi"}, {})
    assert default.status_code == 200, default.text
    assert fleet.public is not None  # the operator's key admits every run's routes on the public port
    for run in ("a", "b"):
        models = await fleet.http.get(f"{fleet.public.url}/runs/{run}/v1/models", headers=bearer(KEY))
        assert models.status_code == 200 and [card["id"] for card in models.json()["data"][1:]] == ["trl-policy-v1"]
    refused = await fleet.http.get(f"{fleet.public.url}/runs/a/v1/models", headers=bearer(minted["a"]))
    assert refused.status_code == 401  # the public port takes the operator's key only
    view = (await fleet.http.get(fleet.url("default", "/fleet"))).json()
    assert view["run_keys"] == {"enabled": True, "runs": ["a", "b"]}


async def test_a_key_made_or_rotated_while_the_proxy_runs_takes_effect_without_a_restart(
        keyed: tuple[Fleet, dict[str, str]], tmp_path: Path) -> None:
    fleet, minted = keyed
    directory = tmp_path / "run-keys"
    new = provision(directory, "c")
    rotated = provision(directory, "a", rotate=True)

    async def taken() -> bool:
        response = await call(fleet, "c", "GET", "/v1/models", None, bearer(new))
        return response.status_code == 200

    for _ in range(60):
        if await taken():
            break
        await asyncio.sleep(0.1)
    assert await taken(), "a key made while the proxy runs was not taken"
    assert (await call(fleet, "a", "GET", "/v1/models", None, bearer(minted["a"]))).status_code == 401
    assert (await call(fleet, "a", "GET", "/v1/models", None, bearer(rotated))).status_code == 200
