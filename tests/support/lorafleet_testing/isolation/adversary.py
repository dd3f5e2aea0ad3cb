"""The adversary's schedule and one attempt: a seeded stream of tricks, each set up, raced against its own load
through the proxy with the adversary's valid run key, answered, observed on every replica, and cleaned up.

The schedule is drawn from the seed alone (`schedule`), so a seed replays the same tricks in the same order with the
same choices; what a race meets depends on the machine's timing, which is why a race is tried many times.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from lorafleet.ledger_format import CONFIG_FILE, WEIGHTS_SUFFIX

from lorafleet_testing.isolation.tricks import RACES, TRICKS, Plan, Scene, Skipped, clear, plan

SAME_CONTENT = "same-content-race"  # the adversary's load raced by another tenant's load of the same bytes
KINDS = (*TRICKS, SAME_CONTENT)
WEIGHT = {**{trick: 3 for trick in RACES}, SAME_CONTENT: 1}  # races need many tries; the rest one each in ~40


def schedule(seed: int) -> Iterator[tuple[int, str, random.Random]]:
    """(number, trick, the attempt's own random stream), forever, from `seed` alone."""
    rng = random.Random(seed)
    weights = [WEIGHT.get(kind, 1) for kind in KINDS]
    number = 0
    while True:
        number += 1
        yield number, rng.choices(KINDS, weights)[0], random.Random(rng.getrandbits(64))


def digests(folder: str | Path) -> dict[str, str]:
    """sha256 of each adapter file of `folder` (config and weights), as the checker compares them."""
    try:
        names = sorted(p.name for p in Path(folder).iterdir())
    except OSError:
        return {}
    return {name: hashlib.sha256((Path(folder) / name).read_bytes()).hexdigest() for name in names
            if name == CONFIG_FILE or name.endswith(WEIGHTS_SUFFIX)}


@dataclass
class Tenant:
    """A run as its trainer speaks to the proxy: its prefix and its key."""

    run: str
    key: str

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def load(self, http: httpx.AsyncClient, name: str, path: str) -> httpx.Response:
        return await http.post(f"/runs/{self.run}/v1/load_lora_adapter", headers=self.headers(),
                               json={"lora_name": name, "lora_path": path})

    async def unload(self, http: httpx.AsyncClient, name: str) -> httpx.Response:
        return await http.post(f"/runs/{self.run}/v1/unload_lora_adapter", headers=self.headers(),
                               json={"lora_name": name})


async def observe(replicas: list[str], when: int) -> list[dict[str, Any]]:
    """What every replica lists (/v1/models: adapter name -> folder) and the digests of each folder's files now."""
    rows = []
    async with httpx.AsyncClient(timeout=30) as http:
        for url in replicas:
            cards = (await http.get(url + "/v1/models")).json()["data"]
            rows += [{"attempt": when, "replica": url, "name": card["id"], "root": card["root"],
                      "files": await asyncio.to_thread(digests, card["root"])} for card in cards if card.get("parent")]
    return rows


async def attempt(http: httpx.AsyncClient, adversary: Tenant, scene: Scene, number: int, trick: str,
                  rng: random.Random, rival: tuple[Tenant, str, str] | None) -> dict[str, Any]:
    """One hostile attempt; its record (the answer as the adversary got it). `rival`: (tenant, name, path) of another
    tenant's load of the adversary's own content, for the same-content race."""
    try:
        chosen: Plan = plan("own" if trick == SAME_CONTENT else trick, scene, rng, number)
    except Skipped as why:
        return {"attempt": number, "trick": trick, "skipped": str(why)}
    stop = threading.Event()
    racer = threading.Thread(target=chosen.racer, args=(stop,), daemon=True) if chosen.racer else None
    started = time.monotonic()
    if racer:
        racer.start()
    try:
        calls = [adversary.load(http, chosen.name, chosen.path)]
        if trick == SAME_CONTENT and rival is not None:
            tenant, name, path = rival
            calls.append(tenant.load(http, name, path))
        answers = await asyncio.gather(*calls)
    finally:
        stop.set()
        if racer:
            await asyncio.to_thread(racer.join)
    answer = answers[0]
    record = {"attempt": number, "trick": trick, "name": chosen.name, "path": chosen.path,
              "status": answer.status_code, "body": answer.text[:600], "seconds": round(time.monotonic() - started, 3)}
    if len(answers) > 1:
        record["rival_status"] = answers[1].status_code
    for leftover in list(scene.own.iterdir()):
        clear(leftover)
    return record
