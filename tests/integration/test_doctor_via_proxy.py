"""The doctor where the trainer runs it: the replicas are reachable only through the proxy (issue: the
trainer's container sits on the fleet network only and holds no vLLM key).

Fake replicas behind the real proxy app, over real HTTP. The proxy holds the replicas' key
(PROXY_UPSTREAM_TOKEN); the doctor has none. Two ways the replicas refuse the doctor:
- `vllm_key`: vLLM's own --api-key middleware (it guards /v1 only: /server_info still answers);
- `no_access`: every path refused without the key, as the compose stack's internal network refuses
  the trainer every connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet_ops.commands.doctor import Status, render_table, run_doctor
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import FakeReplica, Running, start_server
from lorafleet_trainer.fleet_preflight import doctor_preflight
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

KEY = "replicas-only-key"


class KeyEverywhere(AuthenticationMiddleware):
    """vLLM's key check on every path (not only /v1): nothing of the replica answers the doctor."""

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
        if scope["type"] == "http" and not self.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)


def _asgi3(app: AuthenticationMiddleware) -> ASGIApp:
    """vLLM's middleware returns an awaitable from a plain __call__, which uvicorn would take for ASGI 2."""
    async def serve(scope: Scope, receive: Receive, send: Send) -> None:
        await app(scope, receive, send)
    return serve


@pytest.fixture(params=["vllm_key", "no_access"])
async def fleet(request: pytest.FixtureRequest, tiny_model: Path,
                tmp_path: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """(proxy fleet URL, replica URLs): two key-guarded fake replicas serving the tiny model, the proxy in front."""
    guard: type[AuthenticationMiddleware] = AuthenticationMiddleware if request.param == "vllm_key" else KeyEverywhere
    fakes = [FakeReplica(base_model=str(tiny_model), vllm_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True})
             for _ in range(2)]
    servers: list[Running] = []
    for fake in fakes:
        servers.append(await start_server(_asgi3(guard(fake.served(), tokens=[KEY]))))
        fake.url = servers[-1].url
    settings = load_settings(proxy_upstreams=",".join(fake.url for fake in fakes), adapter_root=str(tmp_path),
                             proxy_upstream_token=KEY, proxy_health_interval_s=0.05)
    servers.append(await start_server(create_app(settings)))
    proxy = servers[-1].url
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
        for _ in range(250):
            replicas = (await client.get("/fleet")).json()["replicas"]
            if all(r["state"] == "ready" and r["server_info"] for r in replicas):
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"replicas never became ready: {replicas}")
    yield proxy, [fake.url for fake in fakes]
    for server in reversed(servers):
        await server.stop()


async def test_trainer_doctor_passes_through_the_proxy_alone(fleet, tiny_model: Path, tmp_path: Path) -> None:
    proxy, replicas = fleet
    async with httpx.AsyncClient(timeout=10) as client:  # the doctor really is refused by each replica
        for url in replicas:
            assert (await client.get(f"{url}/v1/models")).status_code == 401
    # The trainer's call (fleet.doctor_preflight): its settings hold no key, the proxy's fleet port is all it has.
    settings = load_settings(base_model=str(tiny_model), adapter_root=str(tmp_path), lora_rank=8, max_staleness=4,
                             run_name="via-proxy", trainer_vllm_url=proxy, proxy_upstream_token="")
    results = await run_doctor(settings, settings.trainer_vllm_url)
    table = render_table(results)
    checks = {result.name: result for result in results}
    # The fakes answer as vLLM's key middleware does, not as lorafleet's attestation extension: the proxy shows them
    # unattested, and the doctor's fleet check warns so (test_attestation.py). Any other warning is a failure here.
    unattested = checks["fleet"].status is Status.WARN and all(
        "is unattested" in part for part in checks["fleet"].reason.split(";")[1:])
    assert not [r for r in results if r.status is Status.FAIL or (r.status is Status.WARN and not (
        r.name == "fleet" and unattested))], table
    assert "2 seen via the proxy" in checks["lora_enabled"].reason, table
    assert "all 2 replica(s)" in checks["adapter_root"].reason, table
    assert "load, unload, pause, resume through the proxy observed on all 2" in checks["broadcasts"].reason, table
    assert not [p for p in tmp_path.rglob("*probe*") if p.is_dir()], "the probe's files must be deleted"
    async with httpx.AsyncClient(base_url=proxy, timeout=10) as client:
        view = (await client.get("/fleet")).json()
        assert all(not r["adapters"] for r in view["replicas"]) and not view["ledger"] and view["paused"] is None
        assert all(set(r["server_info"]) == {"vllm_config", "vllm_env"} for r in view["replicas"])  # kept small
        assert (await client.get("/is_paused")).json() == {"is_paused": False}
    await doctor_preflight(settings, None)  # the trainer's own gate: it would raise PreflightError on a FAIL
