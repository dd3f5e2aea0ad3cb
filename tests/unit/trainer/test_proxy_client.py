"""The trainer's one client to the proxy: its URL, the run key's header, and no call site building its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lorafleet.settings import TrainerSettings, load_settings
from lorafleet_trainer import proxy_client
from lorafleet_trainer.proxy_client import RETRY_STATUSES, ProxyClient

pytestmark = pytest.mark.timeout(60)
PACKAGE = Path(proxy_client.__file__).parent
# What builds a URL or a key header of its own: the proxy client alone may.
OWN_CLIENTS = {"bearer", "AsyncClient", "VLLMClient", "post"}


def test_the_client_carries_the_settings_url_and_the_key(monkeypatch):
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")
    settings = load_settings(TrainerSettings, trainer_vllm_url="http://proxy:8000/runs/a/")
    proxy = ProxyClient.from_settings(settings, "lfr_key")
    assert proxy.url == "http://proxy:8000/runs/a" and proxy.run == "a"
    assert proxy.route("/ratio_report") == "http://proxy:8000/runs/a/ratio_report"
    assert proxy.headers == {"Authorization": "Bearer lfr_key"}
    assert ProxyClient(proxy.url).headers == {}
    assert proxy.control().base_url.rstrip("/") == proxy.url
    assert set(RETRY_STATUSES) == {502, 503}


async def test_the_async_client_is_rooted_at_the_url_and_sends_the_key():
    async with ProxyClient("http://proxy:8000/runs/a", "lfr_key").http(timeout=5) as client:
        request = client.build_request("POST", "/v1/completions")
    assert str(request.url) == "http://proxy:8000/runs/a/v1/completions"
    assert request.headers["Authorization"] == "Bearer lfr_key"


def test_no_trainer_module_but_the_proxy_client_builds_its_own_way_to_the_proxy():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("proxy_client.py", "run_key_file.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if name in OWN_CLIENTS and (name != "post" or owner in ("httpx", "requests")):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {owner + '.' if owner else ''}{name}")
    assert not found, f"calls to the proxy built outside proxy_client.py: {found}"
