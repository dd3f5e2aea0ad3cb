"""The real `lorafleet-proxy` process with PROXY_API_KEY, checked over real sockets (issue 12).

Fake replicas (in this process, recording what they receive) stand behind it. Every route of the proxy's
OpenAPI document, the document itself and an unknown path are called on the public port with no key, a
wrong key and the right key. Each port binds its own address (fleet 127.0.0.1, public 127.0.0.2), so the
test also shows that neither port answers on the other's address, and that what listens on the public
port is the proxy's app (its /health names the fake replicas; its document equals the fleet port's).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest
from lorafleet.ports import free_port
from lorafleet_ops.processes import proxy_service
from lorafleet_testing.fakes import start_fakes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KEY = "process-key"
FLEET_HOST, PUBLIC_HOST = "127.0.0.1", "127.0.0.2"
READS = {"/health", "/v1/models", "/metrics", "/server_info", "/is_paused"}  # the proxy's own background polls


async def _wait_healthy(url: str, proxy_alive: object, timeout_s: float = 60) -> None:
    async with httpx.AsyncClient(timeout=2) as client:
        for _ in range(int(timeout_s / 0.1)):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            assert proxy_alive(), "the proxy process exited"  # type: ignore[operator]
            await asyncio.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


async def test_public_port_of_the_real_process_wants_the_key_on_every_route(tmp_path: Path) -> None:
    fakes, servers = await start_fakes(2)
    public_port = free_port()
    env = {"ADAPTER_ROOT": str(tmp_path), "PROXY_UPSTREAMS": ",".join(s.url for s in servers), "PROXY_API_KEY": KEY,
           "PROXY_PUBLIC_PORT": str(public_port), "PROXY_FLEET_HOST": FLEET_HOST, "PROXY_PUBLIC_HOST": PUBLIC_HOST,
           "PROXY_HEALTH_INTERVAL_S": "0.2", "LORAFLEET_ENV_FILE": ""}
    proxy = proxy_service("proxy-auth", env, tmp_path / "logs").start()
    fleet_url, public_url = proxy.url, f"http://{PUBLIC_HOST}:{public_port}"
    fleet_port = int(fleet_url.rsplit(":", 1)[1])
    try:
        await _wait_healthy(fleet_url, lambda: proxy.alive)
        async with httpx.AsyncClient(timeout=30) as client:
            document = (await client.get(fleet_url + "/openapi.json")).json()
            calls = [(method.upper(), path) for path, ops in document["paths"].items() for method in ops]
            calls += [("GET", "/openapi.json"), ("GET", "/no/such/route"), ("DELETE", "/v1/models")]
            assert len(calls) > 30

            for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"}),
                                   ("key without scheme", {"Authorization": KEY}),
                                   ("key in another header", {"X-Api-Key": KEY})):
                marks = [len(fake.received) for fake in fakes]
                for method, path in calls:
                    answer = await client.request(method, public_url + path, headers=headers, json={})
                    assert answer.status_code == 401, f"{label}: {method} {path} -> {answer.status_code}"
                    assert answer.json()["error"]["code"] == 401
                reached = [(r.method, r.path) for fake, mark in zip(fakes, marks, strict=True)
                           for r in fake.received[mark:] if not (r.method == "GET" and r.path in READS)]
                assert reached == [], f"{label}: requests reached replicas: {reached}"

            auth = {"Authorization": f"Bearer {KEY}"}
            for method, path in calls:
                answer = await client.request(method, public_url + path, headers=auth, json={})
                assert answer.status_code != 401 and answer.status_code < 500, f"{method} {path}: {answer.text}"
                if path == "/pause":
                    await client.post(public_url + "/resume", headers=auth)

            health = (await client.get(public_url + "/health", headers=auth)).json()
            assert sorted(r["url"] for r in health["replicas"]) == sorted(s.url for s in servers)
            assert (await client.get(public_url + "/openapi.json", headers=auth)).json() == document

            for host, port in ((PUBLIC_HOST, fleet_port), (FLEET_HOST, public_port)):
                with pytest.raises(httpx.ConnectError):
                    await client.get(f"http://{host}:{port}/health")
    finally:
        proxy.stop()
        for server in servers:
            await server.stop()
