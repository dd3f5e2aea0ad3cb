"""Preflight refusals (TRL's own decision), fleet size, and the stale-policy sweep, over vLLM-shaped answers."""

from __future__ import annotations

import json

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet.vllm_api import VLLMClient, error_body
from lorafleet_trainer.fleet_preflight import (
    PreflightError,
    check_adapter_sync,
    count_replicas,
    preflight,
    probe_fleet,
    ready_replicas,
    register_run,
    sweep_policies,
)
from peft import LoraConfig


def server_config(max_lora_rank=8, max_loras=6, dp=1, lora=True):
    return {
        "lora_config": {"max_lora_rank": max_lora_rank, "max_loras": max_loras, "max_cpu_loras": 6} if lora else None,
        "parallel_config": {"data_parallel_size": dp, "tensor_parallel_size": 1},
        "model_config": {"model": "/models/tiny", "dtype": "torch.float32"},
    }


def lora(**kwargs):
    return LoraConfig(**{"r": 1, "lora_alpha": 2, "target_modules": "all-linear", "task_type": "CAUSAL_LM", **kwargs})


def test_a_servable_fleet_passes():
    check_adapter_sync(server_config(), lora(), max_staleness=4)


@pytest.mark.parametrize(
    ("config", "adapter", "staleness", "message"),
    [
        (server_config(lora=False), lora(), 4, "started without `--enable-lora`"),
        (server_config(max_lora_rank=8), lora(r=16), 4, "rank 16, but the vLLM server was started with "
         "`--max-lora-rank 8`. Restart it with `--max-lora-rank 16`"),
        (server_config(max_loras=5), lora(), 4, "`--max-loras 5`, but `max_staleness=4` lets requests still name 5"),
        (server_config(dp=2), lora(), 4, "`--data-parallel-size > 1`"),
        (server_config(), lora(use_dora=True), 4, "DoRA adapters are not servable by vLLM"),
        (server_config(), lora(bias="all"), 4, "trains bias terms"),
    ],
)
def test_what_cannot_serve_adapter_only_sync_is_refused_with_trls_reason(config, adapter, staleness, message):
    with pytest.raises(PreflightError) as refused:
        check_adapter_sync(config, adapter, max_staleness=staleness)
    assert str(refused.value).startswith("refusing to start: ")
    assert message in str(refused.value)


def _client(handler, url: str = "http://fleet") -> VLLMClient:
    return VLLMClient(url, client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))


def test_ready_replicas_counts_only_ready_ones():
    fleet = {"replicas": [{"url": "a", "state": "ready"}, {"url": "b", "state": "syncing"},
                          {"url": "c", "state": "ready"}, {"url": "d", "state": "ejected"}], "ledger": []}
    assert ready_replicas(fleet) == 2
    with pytest.raises(ValueError, match="no 'replicas' list"):
        ready_replicas({"detail": "Not Found"})


async def test_a_plain_vllm_server_without_fleet_counts_as_one_replica():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json={"detail": "Not Found"})  # vLLM's answer to an unknown route

    assert await count_replicas(_client(handler)) == 1


async def test_probe_fleet_reads_the_proxy_and_lets_the_setting_win():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"replicas": [{"url": "a", "state": "ready"}] * 3, "ledger": []})

    assert await probe_fleet(load_settings(), _client(handler)) == 3
    assert await probe_fleet(load_settings(trainer_replicas=5), _client(handler)) == 5


async def test_preflight_reads_server_info_and_refuses_too_few_slots():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}?{request.url.query.decode()}")
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, json={"vllm_config": server_config(max_loras=4)})

    with pytest.raises(PreflightError, match="Restart the server with `--max-loras 6`"):
        await preflight(load_settings(max_staleness=4), lora(), _client(handler))
    assert "GET /server_info?config_format=json" in seen


async def test_preflight_refuses_a_fleet_that_never_gets_healthy():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"status": "no ready replica"})

    with pytest.raises(PreflightError, match="did not answer 200 within 0s"):
        await preflight(load_settings(trainer_server_timeout_s=0.01), lora(), _client(handler))


async def test_sweep_unloads_every_policy_name_and_nothing_else():
    unloaded = []
    models = {"object": "list", "data": [
        {"id": "/models/tiny", "root": "/models/tiny", "parent": None, "max_model_len": 512},
        {"id": "trl-policy-v10", "root": "/adapters/runs/a/.vllm_lora/trl-policy-v10", "parent": "/models/tiny"},
        {"id": "trl-policy-v9", "root": "/adapters/runs/a/.vllm_lora/trl-policy-v9", "parent": "/models/tiny"},
        {"id": "my-eval-adapter", "root": "/adapters/eval", "parent": "/models/tiny"},
    ]}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models)
        name = json.loads(request.content)["lora_name"]
        unloaded.append(name)
        if name == "trl-policy-v10":  # unloaded by someone else meanwhile: vLLM's 404
            body = error_body(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
            return httpx.Response(404, json=body)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")

    assert await sweep_policies(_client(handler)) == ["trl-policy-v9", "trl-policy-v10"]
    assert unloaded == ["trl-policy-v9", "trl-policy-v10"]


async def test_sweep_stops_on_a_real_failure():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "trl-policy-v1", "root": "/a", "parent": "/m"}]})
        return httpx.Response(502, json=error_body("proxy: 1/2 servers failed", "BadGateway", 502))

    with pytest.raises(Exception, match="502"):
        await sweep_policies(_client(handler))


async def test_a_trainer_under_a_run_prefix_reserves_its_slots_and_the_default_run_asks_nothing():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"run": "b", "slots": 3, "weight": 2.0, "budget": {"capacity": 6}})

    url = "http://proxy:8000/runs/b"
    await register_run(load_settings(trainer_vllm_url=url, max_staleness=1, run_weight=2.0), _client(handler, url))
    assert seen == [("/runs/b/register", {"max_staleness": 1, "weight": 2.0})]
    await register_run(load_settings(trainer_vllm_url="http://proxy:8000"), _client(handler))
    assert len(seen) == 1


async def test_a_run_the_budget_refuses_stops_the_trainer_with_the_proxys_reason():
    def handler(request: httpx.Request) -> httpx.Response:
        message = "run 'b' does not fit the fleet's slot budget: it needs 6 LoRA slot(s)"
        return httpx.Response(409, json=error_body(message, "SlotBudgetExceeded", 409))

    url = "http://proxy:8000/runs/b"
    with pytest.raises(PreflightError, match="did not admit run 'b': run 'b' does not fit the fleet's slot budget"):
        await register_run(load_settings(trainer_vllm_url=url), _client(handler, url))


@pytest.mark.parametrize("gone", ["killed", "502", "503"])
async def test_a_proxy_gone_during_the_start_up_checks_is_waited_for_and_the_checks_run_again(monkeypatch, gone):
    """The chaos run's finding: a proxy killed while a trainer ran its start-up checks ended that start refused
    (exit 3). Each check is idempotent, so they are made again once the fleet answers; a refusal stays final."""
    from lorafleet_trainer import fleet_preflight as trainer_fleet

    seen: list[str] = []
    url = "http://proxy:8000/runs/b"

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/runs/b/register" and seen.count("/runs/b/register") == 1:
            if gone == "killed":
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
            return httpx.Response(int(gone), json=error_body("no ready replica", "Service Unavailable", int(gone)))
        if request.url.path.endswith("/register"):
            return httpx.Response(200, json={"run": "b", "slots": 3, "budget": {"capacity": 6}})
        if request.url.path.endswith("/server_info"):
            return httpx.Response(200, json={"vllm_config": server_config()})
        if request.url.path.endswith("/v1/models"):
            return httpx.Response(200, json={"object": "list", "data": []})
        return httpx.Response(200)

    async def no_doctor(settings, lora_config):
        return None

    monkeypatch.setattr(trainer_fleet, "fleet_client", lambda settings, run_key: _client(handler, url))
    monkeypatch.setattr(trainer_fleet, "doctor_preflight", no_doctor)
    monkeypatch.setattr(trainer_fleet.asyncio, "sleep", lambda s: _no_wait())
    swept = await trainer_fleet.prepare_fleet(load_settings(trainer_vllm_url=url, max_staleness=1), lora(),
                                              run_key="")
    assert swept == [] and seen.count("/runs/b/register") == 2 and seen[-1] == "/runs/b/v1/models"

    refusals: list[str] = []

    def refusing(request: httpx.Request) -> httpx.Response:
        refusals.append(request.url.path)
        if request.url.path.endswith("/register"):
            body = error_body("does not fit the fleet's slot budget", "SlotBudgetExceeded", 409)
            return httpx.Response(409, json=body)
        return httpx.Response(200)

    monkeypatch.setattr(trainer_fleet, "fleet_client", lambda settings, run_key: _client(refusing, url))
    with pytest.raises(PreflightError, match="slot budget"):
        await trainer_fleet.prepare_fleet(load_settings(trainer_vllm_url=url), lora(), run_key="")
    assert refusals.count("/runs/b/register") == 1


async def _no_wait() -> None:
    return None
