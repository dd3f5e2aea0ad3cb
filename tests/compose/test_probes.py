"""The commands compose.yaml and the Dockerfiles run inside containers, executed here for real.

No engine is needed to prove that a healthcheck probe exits 0 on a 200 and non-zero on a 503 or a dead port,
or that the store-init command creates the layout the read-only mounts depend on.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from lorafleet.ports import free_port
from lorafleet_testing.compose_helpers import REPO, RenderFn


class HealthServer:
    """A local /health endpoint whose status code the test sets."""

    def __init__(self) -> None:
        self.status = 200
        self.key = ""  # set: /health answers 401 unless asked with this Bearer key (a named run's fleet routes)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code = server.status if self.path.rstrip("/").endswith("/health") else 404
                if server.key and self.headers.get("Authorization") != f"Bearer {server.key}":
                    code = 401
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def health() -> Iterator[HealthServer]:
    server = HealthServer()
    yield server
    server.close()


def run_probe(test: list[str], env: dict[str, str]) -> int:
    """Run a healthcheck `test` (exec form) the way Docker does; the images' python3 is this interpreter here."""
    assert test[:2] == ["CMD", "python3"], test
    command = [sys.executable, *test[2:]]
    env = {"PATH": os.environ["PATH"], **env}
    return subprocess.run(command, env=env, capture_output=True, timeout=30, check=False).returncode


def dockerfile_probe(path: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", path.read_text())
    (exec_form,) = re.findall(r"^HEALTHCHECK .*?CMD (\[.*\])\s*$", text, flags=re.MULTILINE)
    return ["CMD", *json.loads(exec_form)]


def probe_env(service: str, port: int) -> dict[str, str]:
    if service.startswith("trainer"):
        return {"TRAINER_VLLM_URL": f"http://127.0.0.1:{port}/"}
    if service == "proxy":
        return {"PROXY_PORT": str(port), "PROXY_FLEET_HOST": "127.0.0.1"}
    return {"REPLICA_PORT": str(port)}


@pytest.mark.parametrize("service", ["vllm", "vllm-cpu", "proxy", "trainer", "trainer-cpu"])
def test_compose_healthcheck_follows_health(project: dict, health: HealthServer, service: str) -> None:
    test = project["services"][service]["healthcheck"]["test"]
    assert run_probe(test, probe_env(service, health.port)) == 0
    health.status = 503
    assert run_probe(test, probe_env(service, health.port)) != 0
    assert run_probe(test, probe_env(service, free_port())) != 0


@pytest.mark.parametrize("service", ["trainer", "trainer-cpu"])
def test_a_named_runs_trainer_is_healthy_with_its_run_key(project: dict, health: HealthServer, service: str,
                                                          tmp_path: Path) -> None:
    test = project["services"][service]["healthcheck"]["test"]
    health.key = "lfr_the-run-key"
    env = {"TRAINER_VLLM_URL": f"http://127.0.0.1:{health.port}/runs/b"}
    assert run_probe(test, env) != 0  # without its key the run's routes answer 401
    key_file = tmp_path / "key"
    key_file.write_text(health.key + "\n")
    assert run_probe(test, {**env, "TRAINER_RUN_KEY_FILE": str(key_file)}) == 0
    assert health.key not in json.dumps(test)  # read from the file, never in the command


@pytest.mark.parametrize(
    ("dockerfile", "service"),
    [("services/vllm/Dockerfile", "vllm"), ("services/vllm/Dockerfile.cpu", "vllm-cpu"),
     ("services/proxy/Dockerfile", "proxy")],
)
def test_dockerfile_healthcheck_follows_health(health: HealthServer, dockerfile: str, service: str) -> None:
    test = dockerfile_probe(REPO / dockerfile)
    assert run_probe(test, probe_env(service, health.port)) == 0
    health.status = 500
    assert run_probe(test, probe_env(service, health.port)) != 0


def test_store_init_creates_the_layout_the_mounts_need(render: RenderFn, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    root.mkdir()
    entrypoint = render(ADAPTER_ROOT=str(root))["services"]["store-init"]["entrypoint"]
    command = [part.replace("$$", "$") for part in entrypoint]  # compose prints `$` escaped
    for _ in range(2):  # idempotent: it runs again on every `up`
        subprocess.run(command, check=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert (root / "runs").is_dir()
    mode = (root / ".fleet").stat().st_mode
    assert stat.S_IMODE(mode) == 0o1777, oct(mode)
