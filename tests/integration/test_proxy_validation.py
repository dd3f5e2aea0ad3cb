"""Bad admin input is vLLM's 400 before any broadcast: no fleet lock taken, nothing sent to a replica (issue 12).

Each bad body is sent while a slow load holds the fleet lock (a replica answering "No adapter found"
until the load deadline): an answer that comes back while that load is still pending proves the check ran before the
lock (an order, not a time bound: it holds however fast the machine).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import start_fakes, start_server, weights_file
from lorafleet_testing.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LOAD = "/v1/load_lora_adapter"
LOCK_HELD_S = 10.0  # the slow load's deadline: the lock is held this long, far longer than the bad requests take
UNLOAD = "/v1/unload_lora_adapter"
# (path, query, JSON body, param named in the 400)
BAD: list[tuple[str, dict[str, str], Any, str]] = [
    (LOAD, {}, {"lora_name": "a", "lora_path": ["/x", "/y"]}, "body.lora_path"),
    (LOAD, {}, {"lora_name": "a", "lora_path": {"p": "/x"}}, "body.lora_path"),
    (LOAD, {}, {"lora_name": "a", "lora_path": 7}, "body.lora_path"),
    (LOAD, {}, {"lora_name": "a", "lora_path": ""}, "body.lora_path"),
    (LOAD, {}, {"lora_name": "a"}, "body.lora_path"),
    (LOAD, {}, {"lora_name": ["a"], "lora_path": "runs/r/.vllm_lora/a"}, "body.lora_name"),
    (LOAD, {}, {"lora_name": "../evil", "lora_path": "runs/r/.vllm_lora/a"}, "body.lora_name"),
    (LOAD, {}, {"lora_name": "a", "lora_path": "runs/r/.vllm_lora/a", "load_inplace": "yes"}, "body.load_inplace"),
    (LOAD, {}, {"lora_name": "a", "lora_path": "runs/r/.vllm_lora/a", "is_3d_lora_weight": True},
     "body.is_3d_lora_weight"),
    (LOAD, {}, ["lora_name", "a"], "body"),
    (UNLOAD, {}, {"lora_name": 3}, "body.lora_name"),
    (UNLOAD, {}, {}, "body.lora_name"),
    ("/pause", {"mode": "later"}, None, "query.mode"),
    ("/reset_prefix_cache", {"reset_external": "maybe"}, None, "query.reset_external"),
]


async def test_bad_admin_input_is_400_before_the_lock_and_reaches_no_replica(tmp_path: Path) -> None:
    fakes, servers = await start_fakes(2)
    settings = load_settings(proxy_upstreams=",".join(s.url for s in servers), adapter_root=str(tmp_path),
                             proxy_health_interval_s=0.05, proxy_lora_load_timeout_s=LOCK_HELD_S)
    proxy = await start_server(create_app(settings))
    try:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            async def both_ready() -> bool:  # /health is 200 with one: the slow load must reach replica 0 too
                view = (await client.get("/fleet")).json()
                return all(replica["state"] == "ready" for replica in view["replicas"])

            await until(both_ready, "both replicas ready", 30)
            fakes[0].faults.not_found_loads = 10**6  # the load below holds the fleet lock until its deadline
            slow_adapter = tmp_path / "runs" / "r" / "slow"  # the proxy copies it into its store, then asks replicas
            slow_adapter.mkdir(parents=True)
            (slow_adapter / "adapter_config.json").write_text("{}")
            (slow_adapter / "adapter_model.safetensors").write_bytes(weights_file(b"slow"))
            slow = asyncio.create_task(client.post(LOAD, json={"lora_name": "slow", "lora_path": "runs/r/slow"}))
            while not fakes[0].loads():
                await asyncio.sleep(0.01)
            before = [len(fake.received) for fake in fakes]
            for path, query, body, param in BAD:
                answer = await client.post(path, params=query, json=body)
                assert not slow.done(), f"{path} {body} was answered after the lock holder: it queued behind the lock"
                assert answer.status_code == 400, (path, body, answer.text)
                error = answer.json()["error"]
                assert (error["type"], error["code"], error["param"]) == ("Bad Request", 400, param), error
            reached = [(r.method, r.path) for fake, mark in zip(fakes, before, strict=True)
                       for r in fake.received[mark:] if r.path in (LOAD, UNLOAD, "/pause", "/reset_prefix_cache")
                       and b"slow" not in r.body]
            assert reached == [], f"bad requests reached replicas: {reached}"
            assert (await slow).status_code == 504, "the lock holder did not run to its deadline"
    finally:
        await proxy.stop()
        for server in servers:
            await server.stop()
