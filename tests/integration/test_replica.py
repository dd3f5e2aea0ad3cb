"""Real `lorafleet-replica` processes in CPU mode on the tiny model (issue 4)."""

from __future__ import annotations

import asyncio

import pytest
from lorafleet.settings import round_lora_rank
from lorafleet.vllm_api import VLLMClient

pytestmark = pytest.mark.integration


async def test_replicas_claim_distinct_core_sets_and_serve_lora_slots(shared_replicas, replica_env):
    bindings = []
    for replica in shared_replicas:
        async with VLLMClient(replica.url) as client:
            assert await client.health()
            info = await client.server_info()
        env = info.raw["vllm_env"]
        bindings.append(env["VLLM_CPU_OMP_THREADS_BIND"])
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] in (True, "1", "True")
        assert info.lora is not None
        assert info.lora.max_loras == int(replica_env["MAX_STALENESS"]) + 2
        assert info.lora.max_lora_rank == round_lora_rank(int(replica_env["LORA_RANK"]))
        assert info.raw["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert len(set(bindings)) == len(bindings), f"replicas share a core set: {bindings}"


async def test_seeded_prompts_past_one_steps_token_budget_leave_the_replica_serving(shared_replicas, replica_env):
    """TRL's rollout worker seeds every completion. vllm-cpu's engine core died (`CPU Generator does not use offset`)
    on a seeded request whose prefill the scheduler split across steps, taking both shared replicas down under a
    training run; so CPU replicas run without chunked prefill. A burst of seeded prompts that together overflow one
    step's token budget: every one answered, the replica still healthy."""
    replica = shared_replicas[0]
    async with VLLMClient(replica.url, timeout=120) as client:
        scheduler = (await client.server_info()).raw["vllm_config"]["scheduler_config"]
        assert scheduler["enable_chunked_prefill"] is False
        budget = scheduler["max_num_batched_tokens"]
        base = next(card.id for card in await client.models() if card.parent is None)
        prompt_len = int(replica_env["MAX_MODEL_LEN"]) - 8
        count = budget // prompt_len + 4

        async def sample(seed: int) -> dict:
            prompt = [(seed * 7 + k) % 200 + 10 for k in range(prompt_len)]
            return await client.completions({"model": base, "prompt": prompt, "max_tokens": 4, "temperature": 0.7,
                                             "seed": seed})

        answers = await asyncio.gather(*(sample(seed) for seed in range(count)))
        assert [len(answer["choices"]) for answer in answers] == [1] * count
        assert await client.health()


async def test_a_cpu_replica_with_the_default_dtype_serves_float32_and_answers(start_replicas):
    """VLLM_DTYPE's default, `auto` (passed as such: the tier's replicas set float32). vllm-cpu 0.31 resolves it to
    bfloat16 on a CPU with AVX512-BF16 or AMX, whose logprobs are not the CPU trainer's float32 ones (and such a
    replica was reported to lose its engine core at its first completion). On CPU lorafleet-replica serves float32."""
    (replica,) = start_replicas(1, VLLM_DTYPE="auto")
    try:
        async with VLLMClient(replica.url, timeout=120) as client:
            dtype = (await client.server_info()).raw["vllm_config"]["model_config"]["dtype"]
            assert "float32" in str(dtype), dtype
            base = next(card.id for card in await client.models() if card.parent is None)
            answer = await client.completions({"model": base, "prompt": "the cat", "max_tokens": 4, "seed": 1})
            assert len(answer["choices"]) == 1
            assert await client.health()
    finally:
        replica.stop()
