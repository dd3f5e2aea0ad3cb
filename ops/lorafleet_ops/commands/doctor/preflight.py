"""The trainer's gate before it trains: the doctor's whole checklist against the fleet, any FAIL refuses the start.

The trainer imports nothing of the operations package: it finds this function by name, through the entry point
`lorafleet.preflight: doctor` that the ops distribution registers (lorafleet_trainer.fleet_preflight.doctor_preflight).

The one exception is `ratio`: it judges the run's past (metrics.jsonl), so a FAIL there is logged loudly but does
not block resuming once the fleet itself passes. A run checks the fleet itself (the proxy's own URL), and probes it
only while nothing trains on it: no request in flight, no run logging steps, no run's adapter served (after this
run's own sweep). The probe pauses every replica and loads one adapter, so on a fleet another run trains on it would
stall that run and could take the LoRA slot that run's next version needs, failing its sync. A run named by its
key looks like the default run from its URL, so the fleet's state decides, never the URL.
"""

from __future__ import annotations

import logging
from typing import Any

from lorafleet.logs import log_event
from lorafleet.runs import fleet_url
from lorafleet.settings import (
    ConfigError,
    ProxySettings,
    ReplicaSettings,
    StackSettings,
    TrainerSettings,
    load_settings,
    section_fields,
)

from lorafleet_ops.commands.doctor.model import Status
from lorafleet_ops.commands.doctor.render import render_table
from lorafleet_ops.commands.doctor.runner import failed, run_doctor

log = logging.getLogger("lorafleet_trainer.fleet_preflight")  # the trainer's log: these lines are the trainer's start


def stack_view(settings: TrainerSettings) -> StackSettings:
    """The trainer's own settings (flags and task defaults included) with the other sections as this environment
    gives them, for the checks that compare sections (a GPU both the trainer and the replicas would take). A section
    that does not load here is not the trainer's to judge: its schema defaults stand in, and nothing is raised."""
    values: dict[str, Any] = {}
    given: set[str] = set()
    for section in (ReplicaSettings, ProxySettings):
        own = set(section_fields(section))
        try:
            loaded = load_settings(section)
        except ConfigError:
            continue
        values.update(loaded.model_dump(include=own))
        given |= loaded.model_fields_set & own
    values.update({name: getattr(settings, name) for name in TrainerSettings.model_fields})
    return StackSettings.model_construct(_fields_set=given | settings.model_fields_set, **values)


async def trainer_preflight(settings: TrainerSettings, lora_config: Any) -> str | None:
    """None when the trainer may start; else the refusal, with the table of what blocks it."""
    results = await run_doctor(stack_view(settings), fleet_url(settings.trainer_vllm_url), probe=None,
                               peft_config=lora_config)
    blocking = [result for result in failed(results) if result.name != "ratio"]
    for result in results:
        if result.status is not Status.PASS:
            log_event(log, "doctor_check", logging.WARNING if result not in blocking else logging.ERROR,
                      check=result.name, status=result.status.value, reason=result.reason, fix=result.fix)
    if blocking:
        return "refusing to start: the doctor found problems\n" + render_table(blocking)
    log_event(log, "doctor_passed", checks=len(results))
    return None
