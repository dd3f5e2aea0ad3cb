"""Run the checklist: gather the snapshot, run the probe when it is safe or asked for, evaluate, log."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx
from lorafleet.logs import log_event
from lorafleet.settings import StackSettings

from lorafleet_ops.commands.doctor.fleet_checks import evaluate
from lorafleet_ops.commands.doctor.gather import gather_snapshot
from lorafleet_ops.commands.doctor.model import CheckResult, ProbeReport, Snapshot, Status
from lorafleet_ops.commands.doctor.probe import run_probe

log = logging.getLogger("lorafleet.doctor")

# metrics.jsonl written this recently means a trainer is logging steps: the fleet is training.
TRAINING_RECENT_S = 300.0


def training(snapshot: Snapshot) -> str | None:
    """Why the fleet looks like it is training (requests in flight, a run logging steps, runs' adapters served), or
    None. Served adapters count because a run between two requests holds its LoRA slots all the same: the probe's
    load would take one of them, and its pause would stall that run."""
    inflight = sum(replica.inflight for replica in snapshot.replicas)
    signs = []
    if inflight:
        signs.append(f"{inflight} request(s) in flight through the proxy")
    if snapshot.ledger:
        signs.append(f"{len(snapshot.ledger)} adapter(s) of runs served")
    if snapshot.metrics_age_s is not None and snapshot.metrics_age_s < TRAINING_RECENT_S:
        signs.append(f"{snapshot.metrics_path} written {snapshot.metrics_age_s:.0f}s ago")
    return ", ".join(signs) or None


async def run_doctor(settings: StackSettings, fleet_url: str | None = None, *, replicas: Sequence[str] = (),
                     probe: bool | None = True, peft_config: Any = None,
                     http: httpx.AsyncClient | None = None) -> list[CheckResult]:
    """Run the checklist against the fleet behind `fleet_url` (default TRAINER_VLLM_URL) and/or `replicas`.

    `probe`: True runs the probe (it pauses the fleet briefly and takes one LoRA slot), False skips
    the two checks it feeds (adapter_root, broadcasts), None runs it unless the fleet is training.
    `peft_config` is the trainer's LoraConfig (built from the settings when None). `http` replaces
    the HTTP client (tests serve recorded payloads through it).
    """
    url = settings.trainer_vllm_url if fleet_url is None else fleet_url
    snapshot = await gather_snapshot(settings, url, replicas, http)
    busy = training(snapshot) if probe is None else None
    if busy:
        report = ProbeReport(skipped=f"probe not run: the fleet is training ({busy}); it would pause the fleet and "
                             "take a LoRA slot: pass --probe (make doctor PROBE=1) to run it anyway")
    elif probe is False:
        report = ProbeReport(skipped="probe disabled (--no-probe)")
    else:
        report = await run_probe(settings, snapshot, http)
    results = evaluate(snapshot, settings, report, peft_config)
    for result in results:
        log_event(log, "doctor_check", check=result.name, status=result.status.value, reason=result.reason)
    return results


def run_doctor_sync(settings: StackSettings, fleet_url: str | None = None, **kwargs: Any) -> list[CheckResult]:
    """`run_doctor` for synchronous callers (the CLI, the demo)."""
    return asyncio.run(run_doctor(settings, fleet_url, **kwargs))


def failed(results: Sequence[CheckResult]) -> list[CheckResult]:
    return [result for result in results if result.status is Status.FAIL]
