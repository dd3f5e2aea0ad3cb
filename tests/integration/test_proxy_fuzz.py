"""Schemathesis against the proxy's own OpenAPI document, on both ports, with recording fake replicas behind it.

Every generated case (positive and negative, every documented route, the generation routes included)
is sent three times over real HTTP: to the fleet port, to the public port with the key, and to the
public port without it. Properties:
- the proxy itself never answers 5xx: a 5xx is allowed only when a replica answered 5xx to that
  request and the proxy's body carries the replica's message;
- a request the proxy rejected as invalid (its own 400) reached no replica, and every admin body a
  replica received is valid under the proxy's request models;
- the public port answers 401 without the key, and nothing reaches a replica.

`LORAFLEET_FUZZ_EXAMPLES` (default 25) sets examples per route and mode; results go to
results/fuzz-proxy.json (cases, requests, failures).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from lorafleet.settings import load_settings
from lorafleet.vllm_api import PROXY_UPSTREAM_HEADER as UPSTREAM_HEADER
from lorafleet_proxy.app import BearerAuth, create_app
from lorafleet_proxy.canary import greedy_prompt
from lorafleet_proxy.schemas import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from lorafleet_testing.fakes import FakeReplica, Received, Running, start_fakes, start_server
from pydantic import BaseModel, ValidationError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

EXAMPLES = int(os.environ.get("LORAFLEET_FUZZ_EXAMPLES", "25"))
KEY = "fuzz-key"
RESULTS = Path(__file__).resolve().parents[2] / "results" / "fuzz-proxy.json"
ADMIN_BODIES: dict[str, type[BaseModel]] = {"/v1/load_lora_adapter": LoadLoRAAdapterRequest,
                                            "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}
# Reads the proxy makes on its own (health checks, adapter and metrics polls): harmless, and not caused by a case.
BACKGROUND = {("GET", path) for path in ("/health", "/v1/models", "/metrics", "/server_info", "/is_paused")}
CANARY_BODY = greedy_prompt().encode()  # in every agreement-canary probe (every PROXY_CANARY_INTERVAL_S)


@dataclass
class Stack:
    """Two fake replicas and the proxy app on its two ports, in an event loop of their own (a thread)."""

    root: Path
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    fakes: list[FakeReplica] = field(default_factory=list)
    servers: list[Running] = field(default_factory=list)
    fleet_url: str = ""
    public_url: str = ""

    def run(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def start(self) -> None:
        self.fakes, replicas = await start_fakes(2)
        settings = load_settings(proxy_upstreams=",".join(r.url for r in replicas), adapter_root=str(self.root),
                                 proxy_api_key=KEY, proxy_public_port=1, proxy_health_interval_s=0.5,
                                 proxy_lora_load_timeout_s=2.0)
        app = create_app(settings)
        fleet_port = await start_server(app)
        public_port = await start_server(BearerAuth(app, KEY), lifespan="off")
        self.servers = [*replicas, fleet_port, public_port]
        self.fleet_url, self.public_url = fleet_port.url, public_port.url
        async with httpx.AsyncClient() as client:
            for _ in range(500):
                if (await client.get(self.fleet_url + "/health")).status_code == 200:
                    return
                await asyncio.sleep(0.02)
        raise AssertionError("the proxy never became healthy")

    async def stop(self) -> None:
        for server in reversed(self.servers):
            await server.stop()

    def marks(self) -> list[int]:
        return [len(fake.received) for fake in self.fakes]

    def since(self, marks: list[int]) -> list[Received]:
        return [entry for fake, mark in zip(self.fakes, marks, strict=True) for entry in fake.received[mark:]
                if (entry.method, entry.path) not in BACKGROUND and CANARY_BODY not in entry.body]


@dataclass
class Tally:
    cases: int = 0
    requests: int = 0
    failures: list[str] = field(default_factory=list)


TALLY = Tally()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("fuzz-root").resolve())
    thread = threading.Thread(target=stack.loop.run_forever, daemon=True)
    thread.start()
    stack.run(stack.start())
    yield stack
    stack.run(stack.stop())
    stack.loop.call_soon_threadsafe(stack.loop.stop)
    thread.join(10)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"examples_per_route": EXAMPLES, "cases": TALLY.cases, "requests": TALLY.requests,
                                   "failures": len(TALLY.failures), "first_failures": TALLY.failures[:20]},
                                  indent=2) + "\n")


def _document() -> dict[str, Any]:
    """The document the proxy serves at /openapi.json (the stack test below checks it is the served one)."""
    app = create_app(load_settings(proxy_upstreams="http://127.0.0.1:9", adapter_root="/nonexistent"))
    return app.openapi()


schema = schemathesis.openapi.from_dict(_document())


def _own_rejection(status: int, body: bytes, headers: Any) -> bool:
    """The proxy's own 400, not a replica's: forwarded answers name their replica, broadcast relays their context."""
    return status == 400 and b"[proxy:" not in body and UPSTREAM_HEADER.lower() not in {h.lower() for h in headers}


def _check(label: str, path: str, response: Any, reached: list[Received]) -> list[str]:
    problems = []
    status, body = response.status_code, response.content
    if status >= 500:
        relayed = [r for r in reached if r.status >= 500 and _message(r.answer) and _message(r.answer) in body]
        if not relayed:
            problems.append(f"{label}: proxy-originated {status}: {body[:300]!r}")
    if _own_rejection(status, body, response.headers) and any(r.path == path for r in reached):
        problems.append(f"{label}: rejected with 400 but reached a replica: {[(r.method, r.path) for r in reached]}")
    for entry in reached:
        model = ADMIN_BODIES.get(entry.path)
        if model is not None:
            try:
                model.model_validate_json(entry.body)
            except ValidationError as exc:
                problems.append(f"{label}: invalid body reached a replica at {entry.path}: {exc.errors()[:1]}")
    return problems


def _message(answer: bytes) -> bytes:
    try:
        return str(json.loads(answer)["error"]["message"]).encode()
    except (ValueError, KeyError, TypeError):
        return answer


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_proxy_never_fails_on_its_own_and_rejects_before_any_replica(case: Any, stack: Stack) -> None:
    TALLY.cases += 1
    problems: list[str] = []
    for label, base, headers in (("fleet", stack.fleet_url, {}),
                                 ("public", stack.public_url, {"Authorization": f"Bearer {KEY}"}),
                                 ("public-nokey", stack.public_url, {})):
        marks = stack.marks()
        response = case.call(base_url=base, headers=headers, timeout=30)
        time.sleep(0)  # let the recorder's appends land (same process, another thread)
        TALLY.requests += 1
        reached = stack.since(marks)
        where = f"{label} {case.method} {case.formatted_path}"
        if label == "public-nokey":
            if response.status_code != 401 or reached:
                problems.append(f"{where}: {response.status_code} without the key, replicas got "
                                f"{[(r.method, r.path, r.body[:80]) for r in reached]}")
            continue
        problems += _check(where, case.path, response, reached)
    TALLY.failures += problems
    assert not problems, "\n".join(problems)
