"""Real `lorafleet-replica` processes in CPU mode on the tiny model (issue 4)."""

from __future__ import annotations

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
