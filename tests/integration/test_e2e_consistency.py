"""End to end through a real proxy in front of the real replicas: the fleet serves ONE policy (issue 7).

- the same prompt, seed and adapter give identical tokens and logprobs on every replica;
- completions sampled through the proxy, re-scored by transformers + PEFT on CPU, agree with vLLM's
  logprobs: the trainer/server importance ratio is 1 within 0.01.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

pytestmark = pytest.mark.integration

ADAPTER = "e2e-policy-v1"
PROMPT_TEXT = "<|im_start|>user\nwhat is the sum of two and three ?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def fleet(shared_replicas, start_proxy, make_adapter, adapter_root):
    # Every replica ready before the load: with one still joining, the load reaches one replica and the
    # other only catches up moments later, while the test samples each replica directly.
    proxy = start_proxy(shared_replicas, root=adapter_root, PROXY_MIN_READY=str(len(shared_replicas)))
    path = make_adapter(ADAPTER, seed=21)
    response = httpx.post(proxy.url + "/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)},
                          timeout=120)
    assert response.status_code == 200, response.text
    yield proxy, path
    httpx.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": ADAPTER}, timeout=60)
    proxy.stop()


def _sample(url: str, prompt: list[int], seed: int) -> dict:
    body = {"model": ADAPTER, "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "n": 1, "seed": seed, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.fixture(scope="module")
def prompt_ids(shared_replicas) -> list[int]:
    response = httpx.post(shared_replicas[0].url + "/tokenize", json={"prompt": PROMPT_TEXT}, timeout=30)
    return response.json()["tokens"]


@pytest.mark.compat
def test_every_replica_gives_identical_tokens_and_logprobs(fleet, shared_replicas, prompt_ids):
    for seed in (7, 8):
        choices = [_sample(replica.url, prompt_ids, seed) for replica in shared_replicas]
        reference = choices[0]
        for other in choices[1:]:
            assert other["token_ids"] == reference["token_ids"]
            assert other["logprobs"]["token_logprobs"] == pytest.approx(
                reference["logprobs"]["token_logprobs"], abs=1e-5
            )


def test_importance_ratio_against_transformers_and_peft(fleet, tiny_model, prompt_ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proxy, adapter_path = fleet
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    policy = PeftModel.from_pretrained(model, str(adapter_path)).eval()
    log_ratios = []
    for seed in range(4):
        choice = _sample(proxy.url, prompt_ids, seed)
        completion = choice["token_ids"]
        ids = torch.tensor([prompt_ids + completion])
        with torch.no_grad():
            logits = policy(ids).logits[0, len(prompt_ids) - 1 : -1]
        trainer_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0]
        for trained, served in zip(trainer_logprobs.tolist(), choice["logprobs"]["token_logprobs"], strict=True):
            log_ratios.append(trained - served)
    ratio = math.exp(sum(log_ratios) / len(log_ratios))
    worst = max(abs(value) for value in log_ratios)
    assert abs(ratio - 1.0) <= 0.01, f"mean importance ratio {ratio:.5f}"
    assert worst < 0.05, f"a token's log-ratio is {worst:.4f}"
