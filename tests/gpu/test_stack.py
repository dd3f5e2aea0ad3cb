"""The Compose stack on a GPU runner: `pytest -m gpu tests/gpu` (needs Docker, the NVIDIA runtime and >= 3 GPUs).

Not part of `make test` (CI has no GPU and no engine). It brings the real stack up with two replicas,
checks the fleet through the public port, runs the doctor, scales to three and tears everything down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
KEY = os.environ.get("PROXY_API_KEY", "gpu-runner-test-key")
UPSTREAM_TOKEN = os.environ.get("PROXY_UPSTREAM_TOKEN", "gpu-runner-replica-key")
PUBLIC = f"http://127.0.0.1:{os.environ.get('PROXY_PUBLIC_PORT', '8080')}"


def _engine_and_gpus() -> str | None:
    if shutil.which("docker") is None or shutil.which("nvidia-smi") is None:
        return "needs docker and nvidia-smi"
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        return "no Docker engine"
    gpus = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    return None if gpus >= 3 else f"needs 3 GPUs, found {gpus}"


def _compose(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PROXY_API_KEY": KEY, "PROXY_UPSTREAM_TOKEN": UPSTREAM_TOKEN, "COMPOSE_PROFILES": "gpu"}
    return subprocess.run(["docker", "compose", *args], cwd=REPO, env=env, text=True, capture_output=True,
                          check=check, timeout=3600)


@pytest.fixture(scope="module")
def stack():
    reason = _engine_and_gpus()
    if reason:
        pytest.skip(reason)
    _compose("up", "-d", "--build", "--wait", "--scale", "vllm=2", "vllm", "proxy")
    yield
    _compose("--profile", "*", "down", check=False)


def _get(path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(PUBLIC + path, headers=headers, timeout=30)


def test_public_port_needs_the_key(stack):
    assert _get("/health", key=None).status_code == 401
    assert _get("/health").status_code == 200


def test_fleet_is_two_ready_replicas_on_distinct_gpus(stack):
    fleet = _get("/fleet").json()
    assert [r["state"] for r in fleet["replicas"]] == ["ready", "ready"]
    claims = _compose("logs", "vllm").stdout
    devices = {line.split("device=")[1].split()[0] for line in claims.splitlines() if "exec_vllm" in line}
    assert len(devices) == 2


def test_doctor_passes_on_the_stack(stack):
    result = _compose("run", "--rm", "--no-deps", "trainer", "lorafleet", "doctor", "--json", check=False)
    checks = json.loads(result.stdout)
    assert result.returncode == 0, checks


def test_scale_out_syncs_the_third_replica(stack):
    _compose("up", "-d", "--wait", "--no-recreate", "--scale", "vllm=3", "vllm")
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        states = [r["state"] for r in _get("/fleet").json()["replicas"]]
        if states.count("ready") == 3:
            return
        time.sleep(5)
    pytest.fail(f"third replica never became ready: {states}")
