"""The lean generation path over real HTTP against fake replicas (issue 11 defects 6-7, issue 12 bad input)."""
# ruff: noqa: F811  (tests take test_proxy_faults' `fleet` fixture as an argument of the same name)

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet_proxy.app import BearerAuth, create_app
from lorafleet_testing.fakes import start_fakes, start_server
from test_proxy_faults import FAST, Fleet, _completion, fleet  # noqa: F401  (fleet is a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SLOW_HEALTH = {"proxy_health_interval_s": 5.0}  # the proxy does not notice a replica's lost adapters by itself


def completions(fleet: Fleet) -> int:
    return sum(fake.completions for fake in fleet.fakes)


async def inflight(fleet: Fleet) -> list[int]:
    return [replica["inflight"] for replica in (await fleet.fleet())["replicas"]]


# --- issue 11 defect 6: only replicas holding the adapter ------------------------------------------
@pytest.mark.parametrize("fleet", [(2, SLOW_HEALTH)], indirect=True)
async def test_a_replica_that_lost_the_adapter_is_skipped_by_retrying_a_holder(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1")).status_code == 200
    fleet.fakes[0].adapters.clear()  # restarted: vLLM now answers 404 "does not exist" for the name
    for seed in range(6):
        response = await fleet.http.post("/v1/completions",
                                         json=_completion(list(range(seed, seed + 40)), "trl-policy-v1"))
        assert response.status_code == 200, response.text
        assert response.headers["x-proxy-upstream"] == fleet.fakes[1].url
    text = (await fleet.http.get("/metrics")).text
    assert 'lorafleet_proxy_upstream_retries_total{reason="404"}' in text


async def test_an_adapter_no_ready_replica_holds_is_404_from_the_proxy_and_nothing_is_sent(fleet: Fleet) -> None:
    response = await fleet.http.post("/v1/completions", json=_completion([1] * 40, "trl-policy-v9"))
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `trl-policy-v9` does not exist.",
                                          "type": "NotFoundError", "param": "model", "code": 404}}
    assert completions(fleet) == 0
    base = await fleet.http.post("/v1/completions", json=_completion([1] * 40, "fake-base"))
    assert base.status_code == 200, "the base model goes to any ready replica"


@pytest.mark.parametrize("fleet", [(2, SLOW_HEALTH)], indirect=True)
async def test_a_ledger_adapter_no_ready_replica_holds_yet_is_503_so_the_client_retries(fleet: Fleet) -> None:
    """Between a proxy's restart and its replicas' re-sync, a name the ledger has is not gone: 503 (TRL's rollouts
    wait for the fleet on it), never vLLM's 404, which ends a trainer's run. Nothing is sent to a replica."""
    assert (await fleet.load("trl-policy-v1")).status_code == 200
    app = fleet.proxy.server.config.app
    for replica in app.state.fleet.replicas.values():
        replica.adapters.clear()  # the proxy's view, as before a re-sync
    sent = completions(fleet)
    response = await fleet.http.post("/v1/completions", json=_completion([1] * 40, "trl-policy-v1"))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "ServiceUnavailable" and "retry" in response.json()["error"]["message"]
    assert completions(fleet) == sent


async def test_adapter_requests_go_only_to_replicas_holding_it(fleet: Fleet) -> None:
    assert (await fleet.load("trl-policy-v1")).status_code == 200
    # The proxy's view of replica 0 loses the adapter (as between a restart and its re-sync).
    app = fleet.proxy.server.config.app
    app.state.fleet.replicas[fleet.fakes[0].url].adapters.clear()
    for seed in range(6):
        response = await fleet.http.post("/v1/completions",
                                         json=_completion(list(range(seed, seed + 40)), "trl-policy-v1"))
        assert response.status_code == 200 and response.headers["x-proxy-upstream"] == fleet.fakes[1].url
    assert fleet.fakes[0].completions == 0


# --- issue 11 defect 7: streams ------------------------------------------------------------------------
async def test_a_stream_cut_mid_body_aborts_the_client_connection(fleet: Fleet) -> None:
    for fake in fleet.fakes:
        fake.faults.die_mid_request = True
    with pytest.raises(httpx.RemoteProtocolError):
        async with fleet.http.stream("POST", "/v1/completions", json=_completion([5] * 40, stream=True)) as response:
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                pass
    assert await inflight(fleet) == [0, 0]


async def test_a_client_gone_before_the_answer_leaks_no_inflight_count(fleet: Fleet) -> None:
    for fake in fleet.fakes:
        fake.faults.latency_s = 0.3
    with pytest.raises(httpx.ReadTimeout):
        await fleet.http.post("/v1/completions", json=_completion([6] * 40, stream=True), timeout=0.1)
    assert sum(await inflight(fleet)) == 1, "the request is still at the replica"
    await asyncio.sleep(0.6)
    assert await inflight(fleet) == [0, 0]


async def test_a_client_leaving_a_stream_ends_the_upstream_request(fleet: Fleet) -> None:
    for fake in fleet.fakes:
        fake.faults.stream_delay_s = 1.0  # three chunks: the whole stream takes 3 s
    async with httpx.AsyncClient(base_url=fleet.proxy.url) as client, client.stream(
            "POST", "/v1/completions", json=_completion([8] * 40, stream=True)) as response:
        first = await response.aiter_bytes().__anext__()
        assert first.startswith(b"data: ")
        assert sum(await inflight(fleet)) == 1
    for _ in range(50):  # the client closed its connection: the proxy lets go long before the stream would end
        if await inflight(fleet) == [0, 0]:
            break
        await asyncio.sleep(0.02)
    assert await inflight(fleet) == [0, 0]


# --- issue 12: bad input on the generation routes --------------------------------------------------------
BAD_BODIES = {
    "lone surrogate": b'{"model": "fake-base", "prompt": "\\ud800 x"}',
    "lone surrogate in chat": b'{"model": "fake-base", "messages": [{"role": "user", "content": "\\udfff"}]}',
    "token id 2^63": json.dumps(_completion([1, 2, 2**63])).encode(),
    "token id 2^64": json.dumps(_completion([1, 2, 2**64])).encode(),
    "negative token id": json.dumps(_completion([1, -2, 3])).encode(),
    "float token id": json.dumps(_completion([1, 2.5, 3])).encode(),
    "string in token ids": json.dumps(_completion([1, "2", 3])).encode(),
    "model not a string": json.dumps(_completion([1, 2, 3], 5)).encode(),  # type: ignore[arg-type]
    "prompt an object": json.dumps({"model": "fake-base", "prompt": {"text": "x"}}).encode(),
    "prompt a number": json.dumps({"model": "fake-base", "prompt": 7}).encode(),
    "messages a string": json.dumps({"model": "fake-base", "messages": "hi"}).encode(),
    "stream a string": json.dumps(_completion([1, 2, 3], stream="yes")).encode(),
    "not an object": b"[1, 2, 3]",
    "not JSON": b"{model",
}


@pytest.mark.parametrize("name", list(BAD_BODIES))
async def test_bad_generation_input_is_400_vllm_style_and_never_sent(fleet: Fleet, name: str) -> None:
    path = "/v1/chat/completions" if b"messages" in BAD_BODIES[name] else "/v1/completions"
    response = await fleet.http.post(path, content=BAD_BODIES[name], headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["type"] == "Bad Request"
    assert completions(fleet) == 0


async def test_body_limit_and_auth_on_both_ports(tmp_path: Path) -> None:
    _, servers = await start_fakes(1)
    settings = load_settings(proxy_upstreams=servers[0].url, adapter_root=str(tmp_path), proxy_api_key="s3cret",
                             proxy_public_port=1, proxy_max_body_bytes=4096, **FAST)
    app = create_app(settings)
    fleet_port = await start_server(app)
    public = await start_server(BearerAuth(app, settings.proxy_api_key), lifespan="off")
    key = {"Authorization": "Bearer s3cret"}
    big: dict[str, Any] = _completion(list(range(2000)))
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(250):
                if (await client.get(fleet_port.url + "/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            for base, headers in ((fleet_port.url, {}), (public.url, key)):
                ok = await client.post(base + "/v1/completions", json=_completion([1] * 40), headers=headers)
                assert ok.status_code == 200, ok.text
                for path in ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/tokenize"):
                    response = await client.post(base + path, json=big, headers=headers)
                    assert response.status_code == 413, (base, path, response.text)
                    assert response.json()["error"]["code"] == 413
                chunked = await client.post(base + "/v1/completions", headers=headers,
                                            content=_chunks(json.dumps(big).encode()))
                assert chunked.status_code == 413, "a body without Content-Length is bounded too"
            denied = await client.post(public.url + "/v1/completions", json=_completion([1] * 40))
            assert denied.status_code == 401
    finally:
        await public.stop()
        await fleet_port.stop()
        await servers[0].stop()


async def _chunks(data: bytes) -> Any:
    for start in range(0, len(data), 1000):
        yield data[start : start + 1000]
