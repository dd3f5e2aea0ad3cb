"""Every answer of a vLLM replica checked against the weights it names, while adapters are unloaded and reloaded under
saturating mixed traffic (issue 54's hunt for a replica answering the base model for an adapter).

Each subject (the base model, or an adapter of one of several runs) has a fixed text. Its reference answer is a
teacher-forced probe measured alone before the stress: the text's word prefixes, one greedy token each, with its
logprob, the largest of the distribution there (continuous across a near-tie, so only the logprobs are judged) and a
fresh `cache_salt`, so every prefix is computed with the weights served now. Then more clients than the replica has
LoRA slots send that probe for subjects drawn at random, while a churner unloads an adapter and loads the same files
again, cycle after cycle (a name is never reloaded from other files: the ledger forbids it). Every answer is compared
with its subject's reference position by position; one that departs beyond the tolerance is a mismatch, and the
subject whose reference it sits nearest names the weights it was computed with (the slot it was read from).
Used by tests/integration/test_lora_stress.py (short) and bench/lora_stress.py (long, with and without the plugin).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

TOLERANCE = 1e-4  # float32 on one replica: the same weights answer alike but for the last bits
POSITIONS = 6  # prefixes scored per probe
WORDS = ("the", "cat", "and", "the", "dog", "are", "big", "and", "the", "fox", "is", "small", "and", "one", "plus",
         "two", "is", "three", "what", "is", "the", "sum")
PAUSE_S = 0.1
OK, NOT_LOADED = 200, 404  # an adapter between its unload and its reload is answered 404


def probe_body(model: str, subject: str) -> dict[str, Any]:
    """The subject's probe: its text's word prefixes (the text starts with the subject's name), one greedy token
    each with its logprob, in a fresh cache salt."""
    words = [subject, *WORDS]
    return {"model": model, "prompt": [" ".join(words[:end]) for end in range(8, 8 + POSITIONS)], "max_tokens": 1,
            "temperature": 0.0, "logprobs": 0, "return_token_ids": True,
            "cache_salt": f"lorafleet-stress-{uuid.uuid4().hex}"}


def logprobs_of(body: dict[str, Any]) -> list[float]:
    choices = sorted(body["choices"], key=lambda choice: int(choice["index"]))
    return [float(choice["logprobs"]["token_logprobs"][0]) for choice in choices]


def gap(mine: list[float], theirs: list[float]) -> float:
    """The largest |Δ logprob| over the positions."""
    return max(abs(a - b) for a, b in zip(mine, theirs, strict=True))


@dataclass
class Tally:
    """What the stress saw: answers checked and mismatched per subject, the largest gap of a matching answer, the
    largest of any, and each mismatch with the subject whose reference it sits nearest."""

    checked: dict[str, int] = field(default_factory=dict)
    mismatched: dict[str, int] = field(default_factory=dict)
    not_loaded: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # other statuses, by code
    reloads: int = 0
    largest_gap_matching: float = 0.0
    largest_gap: float = 0.0
    mismatches: list[dict[str, Any]] = field(default_factory=list)

    def record(self, subject: str, answer: list[float], references: dict[str, list[float]]) -> None:
        distance = gap(answer, references[subject])
        self.checked[subject] = self.checked.get(subject, 0) + 1
        self.largest_gap = max(self.largest_gap, distance)
        if distance <= TOLERANCE:
            self.largest_gap_matching = max(self.largest_gap_matching, distance)
            return
        self.mismatched[subject] = self.mismatched.get(subject, 0) + 1
        nearest = min(references, key=lambda other: gap(answer, references[other]))
        self.mismatches.append({"subject": subject, "gap": distance, "nearest": nearest,
                                "nearest_gap": gap(answer, references[nearest])})

    def summary(self) -> dict[str, Any]:
        return {"answers_checked": sum(self.checked.values()), "mismatches": sum(self.mismatched.values()),
                "checked": self.checked, "mismatched": self.mismatched, "not_loaded": self.not_loaded,
                "refused": self.refused, "reloads": self.reloads, "tolerance": TOLERANCE,
                "largest_gap_matching": self.largest_gap_matching, "largest_gap": self.largest_gap,
                "decoded_as": decoded_as(self.mismatches),
                "largest_gap_to_nearest": max((m["nearest_gap"] for m in self.mismatches), default=0.0)}


def decoded_as(mismatches: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """subject -> the subject each of its mismatching answers sat nearest -> how many."""
    table: dict[str, dict[str, int]] = {}
    for mismatch in mismatches:
        row = table.setdefault(mismatch["subject"], {})
        row[mismatch["nearest"]] = row.get(mismatch["nearest"], 0) + 1
    return table


async def answer(http: httpx.AsyncClient, url: str, model: str, subject: str) -> tuple[int, list[float]]:
    reply = await http.post(url + "/v1/completions", json=probe_body(model, subject))
    return reply.status_code, logprobs_of(reply.json()) if reply.status_code == OK else []


async def load(http: httpx.AsyncClient, url: str, name: str, path: str) -> None:
    reply = await http.post(url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    if reply.status_code != OK:
        raise RuntimeError(f"loading {name} from {path} on {url}: {reply.status_code} {reply.text}")


async def unload(http: httpx.AsyncClient, url: str, name: str) -> None:
    reply = await http.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
    if reply.status_code != OK:
        raise RuntimeError(f"unloading {name} on {url}: {reply.status_code} {reply.text}")


async def references(http: httpx.AsyncClient, url: str, models: dict[str, str]) -> dict[str, list[float]]:
    """Each subject's answer alone, one request at a time; asked twice, the two must be equal (else the replica is
    not deterministic alone and the tolerance means nothing)."""
    alone: dict[str, list[float]] = {}
    for subject, model in models.items():
        first, second = [await answer(http, url, model, subject) for _ in range(2)]
        if first[0] != OK or second[0] != OK or gap(first[1], second[1]) > TOLERANCE:
            raise RuntimeError(f"{subject} alone: {first} then {second}")
        alone[subject] = first[1]
    return alone


async def client(http: httpx.AsyncClient, url: str, models: dict[str, str], alone: dict[str, list[float]],
                 tally: Tally, rng: random.Random, done: asyncio.Event, least: int) -> None:
    """Probes for random subjects until the churn is done and it has sent at least `least`."""
    sent = 0
    while sent < least or not done.is_set():
        subject = rng.choice(list(models))
        status, logprobs = await answer(http, url, models[subject], subject)
        sent += 1
        if status == OK:
            tally.record(subject, logprobs, alone)
        elif status == NOT_LOADED:
            tally.not_loaded += 1
        else:
            tally.refused[str(status)] = tally.refused.get(str(status), 0) + 1


async def churn(http: httpx.AsyncClient, url: str, paths: dict[str, str], cycles: int, tally: Tally,
                rng: random.Random, done: asyncio.Event) -> None:
    """`cycles` times: unload an adapter and load the same files again."""
    try:
        for _ in range(cycles):
            name = rng.choice(list(paths))
            await unload(http, url, name)
            await asyncio.sleep(PAUSE_S)  # absent a moment: its slot is freed and clients are refused it
            await load(http, url, name, paths[name])
            tally.reloads += 1
    finally:
        done.set()


async def stress(url: str, base: str, paths: dict[str, str], *, clients: int, cycles: int, least: int = 4,
                 seed: int = 0) -> dict[str, Any]:
    """Load `paths` (adapter name -> folder) on the replica at `url`, measure every subject alone, run `clients`
    probing clients against `cycles` unload/reload cycles, unload the adapters; the Tally's summary."""
    models = {"base": base, **{name: name for name in paths}}
    tally = Tally()
    async with httpx.AsyncClient(timeout=300) as http:
        for name, path in paths.items():
            await load(http, url, name, path)
        try:
            alone = await references(http, url, models)
            done = asyncio.Event()
            rng = random.Random(seed)
            await asyncio.gather(
                churn(http, url, paths, cycles, tally, random.Random(rng.random()), done),
                *(client(http, url, models, alone, tally, random.Random(rng.random()), done, least)
                  for _ in range(clients)))
        finally:
            for name in paths:
                await http.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
    return tally.summary()
