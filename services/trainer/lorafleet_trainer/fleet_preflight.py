"""What the trainer asks the fleet before training: size, adapter-only sync capability, stale names.

TRL silently falls back to merged full-weight sync (NCCL, one replica only behind a proxy) when the
server cannot take adapters; lorafleet refuses to start instead, with TRL's own reason. The decision
itself is TRL's `select_adapter_sync`, fed the same `/server_info` TRL will read. Every call sends the run's key
(TRAINER_RUN_KEY_FILE, run_key_file.py) when it has one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from lorafleet.adapters import policy_version
from lorafleet.logs import log_event
from lorafleet.runs import DEFAULT_RUN, url_run
from lorafleet.settings import TrainerSettings
from lorafleet.vllm_api import VLLMClient, VLLMError, VLLMUnreachable

from lorafleet_trainer.proxy_client import RETRY_STATUSES, ProxyClient

log = logging.getLogger(__name__)
PREFLIGHT_GROUP = "lorafleet.preflight"


class PreflightError(RuntimeError):
    """The fleet cannot serve this run; the message says why and what to change."""


def ready_replicas(fleet: dict[str, Any]) -> int:
    """Ready replicas in the proxy's GET /fleet answer ({"replicas": [{"url", "state", ...}], ...})."""
    replicas = fleet.get("replicas")
    if not isinstance(replicas, list):
        raise ValueError("GET /fleet answer has no 'replicas' list")
    return sum(1 for replica in replicas if isinstance(replica, dict) and replica.get("state") == "ready")


async def count_replicas(client: VLLMClient) -> int:
    """Ready replicas behind the URL: the proxy's /fleet, or 1 for a plain vLLM server (no /fleet)."""
    try:
        response = await client.request("GET", "/fleet")
    except VLLMError as exc:
        if exc.status == 404:
            return 1
        raise
    return ready_replicas(response.json())


def check_adapter_sync(server_config: dict[str, Any], lora_config: Any, max_staleness: int) -> None:
    """Raise PreflightError unless TRL would pick adapter-only sync against this server.

    `server_config` is `/server_info?config_format=json`'s `vllm_config`. TRL's `select_adapter_sync`
    raises for a too-low --max-lora-rank or --max-loras and only warns (then falls back) for the rest;
    both become a refusal here, carrying TRL's message.
    """
    from lorafleet.lora import trl_select_adapter_sync

    try:
        adapter_sync, warnings = trl_select_adapter_sync(server_config, lora_config, max_staleness)
    except ValueError as exc:
        raise PreflightError(f"refusing to start: {exc}") from None
    if not adapter_sync:
        reason = " ".join(warnings) or "TRL would fall back to merged full-weight sync"
        raise PreflightError(
            f"refusing to start: the fleet cannot serve adapter-only sync, and lorafleet does not fall back to "
            f"full-weight sync (it would reach one replica only). {reason}"
        )


class StopRequested(Exception):
    """A stop (a signal, lifecycle.py) came while the trainer waited for its fleet: nothing to train or save."""


def never() -> bool:
    return False


async def wait_healthy(client: VLLMClient, timeout_s: float, stopping: Callable[[], bool] = never) -> None:
    """Wait for the fleet's /health; a refusal of this run's key (401/403) is final: waiting cannot mend it, and a
    stop asked for meanwhile ends the wait (StopRequested)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stopping():
            raise StopRequested
        try:
            await client.request("GET", "/health", timeout=5.0)
            return
        except VLLMError as exc:
            if exc.status in (401, 403):
                raise PreflightError(f"refusing to start: {client.base_url}/health answered {exc.status}: "
                                     f"{exc.message} (TRAINER_RUN_KEY_FILE)") from None
        if time.monotonic() > deadline:
            raise PreflightError(
                f"refusing to start: {client.base_url}/health did not answer 200 within {timeout_s:.0f}s"
            )
        await asyncio.sleep(2.0)


async def probe_fleet(settings: TrainerSettings, client: VLLMClient, stopping: Callable[[], bool] = never) -> int:
    """Wait for the fleet to be healthy and return its ready replica count (TRAINER_REPLICAS wins when set)."""
    await wait_healthy(client, settings.trainer_server_timeout_s, stopping)
    if settings.trainer_replicas:
        return settings.trainer_replicas
    replicas = await count_replicas(client)
    if replicas < 1:
        raise PreflightError(f"refusing to start: {client.base_url} reports no ready replica")
    return replicas


async def register_run(settings: TrainerSettings, client: VLLMClient) -> None:
    """On a shared fleet (TRAINER_VLLM_URL ends in /runs/<run>), reserve this run's LoRA slots before TRL starts.

    The proxy answers 409 naming its slot budget when MAX_STALENESS + 2 slots do not fit beside the other
    runs'; the trainer refuses to start with that message rather than failing inside TRL's first sync.
    """
    run = url_run(settings.trainer_vllm_url)
    if run == DEFAULT_RUN:
        return
    try:
        answer = (await client.request("POST", "/register", json_body={"max_staleness": settings.max_staleness,
                                                                  "weight": settings.run_weight})).json()
    except VLLMError as exc:
        if fleet_gone(exc):
            raise  # not a refusal: prepare_fleet waits for the fleet and asks again
        raise PreflightError(f"refusing to start: the fleet did not admit run {run!r}: {exc.message}") from None
    log_event(log, "run_registered", run=run, slots=answer.get("slots"), weight=settings.run_weight,
              budget=answer.get("budget", {}).get("capacity"))


async def preflight(settings: TrainerSettings, lora_config: Any, client: VLLMClient) -> None:
    """Refuse a fleet TRL would not sync adapters to, before anything changes it (the doctor runs after the sweep)."""
    await wait_healthy(client, settings.trainer_server_timeout_s)
    info = await client.server_info()
    check_adapter_sync(info.raw["vllm_config"], lora_config, settings.max_staleness)
    assert info.lora is not None  # check_adapter_sync refused a server without lora_config
    log_event(
        log, "preflight_passed", url=client.base_url, max_lora_rank=info.lora.max_lora_rank,
        max_loras=info.lora.max_loras, dp=info.data_parallel_size, server_dtype=info.dtype,
    )


async def sweep_policies(client: VLLMClient) -> list[str]:
    """Unload every `trl-policy-v*` the fleet still lists, so this run's names cannot collide with old ones.

    TRL numbers from v1 on a fresh run and from the checkpoint's version on resume; a name still loaded
    from an earlier run is either refused (400 "already loaded", fatal in TRL) or, behind the proxy
    (same name, same path = success), silently served with the old weights. Nothing is in flight
    before training starts, so every policy name can go.
    """
    swept = []
    for name in sorted(filter(policy_version, await client.loaded_adapters()), key=policy_version):
        try:
            await client.unload_lora_adapter(name)
        except VLLMError as exc:
            if exc.status != 404:  # gone meanwhile is fine
                raise
        swept.append(name)
    if swept:
        log_event(log, "swept_stale_policies", url=client.base_url, names=",".join(swept))
    return swept


async def doctor_preflight(settings: TrainerSettings, lora_config: Any) -> None:
    """Run the doctor's checklist against the fleet and refuse to train on any FAIL (PreflightError).

    The doctor belongs to the operations package, which may import the trainer and so is never imported by it: it is
    found by name, as the entry point `lorafleet.preflight: doctor` (ops/pyproject.toml), and a trainer installed
    without it refuses to start rather than train unchecked.
    """
    found = entry_points(group=PREFLIGHT_GROUP, name="doctor")
    if not found:
        raise PreflightError("refusing to start: the doctor (the lorafleet-ops package, entry point "
                             f"{PREFLIGHT_GROUP}: doctor) is not installed beside the trainer")
    refusal = await next(iter(found)).load()(settings, lora_config)
    if refusal:
        raise PreflightError(refusal)


def fleet_client(settings: TrainerSettings, run_key: str) -> VLLMClient:
    """A client for TRAINER_VLLM_URL that sends `run_key` as its Bearer key ("" = none)."""
    return ProxyClient.from_settings(settings, run_key).control()


async def fleet_size(settings: TrainerSettings, *, run_key: str, stopping: Callable[[], bool] = never) -> int:
    """probe_fleet against TRAINER_VLLM_URL."""
    async with fleet_client(settings, run_key) as client:
        return await probe_fleet(settings, client, stopping)


def fleet_gone(exc: VLLMError) -> bool:
    """No answer, or a status the control calls wait out (the proxy's 502/503: nothing done), not a refusal."""
    return isinstance(exc, VLLMUnreachable) or exc.status in RETRY_STATUSES


async def prepare_fleet(settings: TrainerSettings, lora_config: Any, *, run_key: str,
                        stopping: Callable[[], bool] = never) -> list[str]:
    """register_run (shared fleets), preflight, sweep_policies, then the doctor's whole checklist, against
    TRAINER_VLLM_URL. (The doctor reads TRAINER_RUN_KEY_FILE itself.) Returns the swept names: this run's next
    version must pass them (resume.py).

    A proxy killed or restarted between these calls is waited for, up to TRAINER_FLEET_WAIT_S, and the calls are made
    again from the health wait (each is idempotent): a start met by a proxy restart no longer refuses (the chaos run
    found it)."""
    deadline = time.monotonic() + settings.trainer_fleet_wait_s
    while True:
        try:
            async with fleet_client(settings, run_key) as client:
                await wait_healthy(client, settings.trainer_server_timeout_s, stopping)
                await register_run(settings, client)
                await preflight(settings, lora_config, client)
                swept = await sweep_policies(client)
            break
        except VLLMError as exc:
            if not fleet_gone(exc) or time.monotonic() > deadline:
                raise
            cause = "ConnectionError" if isinstance(exc, VLLMUnreachable) else f"HTTP {exc.status}"
            log_event(log, "control_call_waiting", logging.WARNING, call="start-up checks", cause=f"{cause}: {exc}",
                      reason="waiting for the fleet, up to TRAINER_FLEET_WAIT_S")
            await asyncio.sleep(2.0)
    await doctor_preflight(settings, lora_config)
    return swept
