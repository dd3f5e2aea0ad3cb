"""The start's cheap refusals, in the order that costs least: disk, a run already complete, the task, the fleet.

Light on purpose (no torch, transformers or TRL import here or reached from here; the task's check imports what it
needs when it runs): a start refused for low disk or one that finds its run already complete exits in a second,
before the rollout fork server or any heavy import is started (main.py's phases run after these).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.logs import log_event
from lorafleet.settings import TrainerSettings
from lorafleet.vllm_api import VLLMError

from lorafleet_trainer.checkpoints import Checkpoint, final_adapter_from, newest_checkpoint
from lorafleet_trainer.fleet_preflight import PreflightError, StopRequested, fleet_size
from lorafleet_trainer.stops import Limits, StopDecision

if TYPE_CHECKING:
    from lorafleet_trainer.tasks.spec import Task

log = logging.getLogger("lorafleet_trainer")  # main's logger, as before these checks had a module
EXIT_PREFLIGHT = 3


class StartEnded(Exception):
    """The start ends here with exit `code`, its last line logged: a refusal, a finished run or an early stop."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass(frozen=True)
class Unspent:
    """A start with something left to train and room to save it: its stop decision, the checkpoint it resumes."""

    stops: StopDecision
    checkpoint: Checkpoint | None

    @property
    def resume_from(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint else None


@dataclass(frozen=True)
class Checked(Unspent):
    """What the checks found besides: the task, the fleet's size, whether this process is the one that talks to it."""

    task: Task | None = None  # None on a dry run (not built) only
    replicas: int = 1
    main_rank: bool = True


def refuse_spent_start(settings: TrainerSettings, *, main_rank: bool, dry_run: bool) -> Unspent:
    """End (StartEnded) a start with too little disk or nothing left to train, before anything heavy is imported
    (main calls it before torch counts the GPUs). A dry run checks nothing."""
    stops = StopDecision(Limits.from_settings(settings))  # RUN_MAX_WALL_S counts from here
    if not dry_run and (low_disk := stops.low_disk()):
        log_event(log, "refused", logging.ERROR, reason=f"refusing to start: {low_disk}")
        raise StartEnded(EXIT_PREFLIGHT)
    checkpoint = newest_checkpoint(settings.run_dir) if settings.trainer_resume else None
    if not dry_run and already_complete(settings, checkpoint, main_rank):
        raise StartEnded(0)
    return Unspent(stops, checkpoint)


def check_start(settings: TrainerSettings, unspent: Unspent, *, main_rank: bool, dry_run: bool,
                run_key: str) -> Checked:
    """Take the stop signals over, then check the task and ask the fleet its size (rank 0), ending the start
    (StartEnded) on a refusal or a stop meanwhile; a dry run checks nothing."""
    stops = unspent.stops
    if not dry_run:  # a stop from here on, or one held since the process started, ends the start with exit 0
        stops.install_signal_handlers()
    if run_key and main_rank:
        log_event(log, "run_key_used", file=settings.trainer_run_key_file)  # never the key itself
    task = None if dry_run else checked_task(settings, main_rank)
    asks_fleet = not (settings.trainer_replicas or dry_run or not main_rank)
    replicas = fleet_replicas(settings, stops, run_key) if asks_fleet else settings.trainer_replicas or 1
    return Checked(stops, unspent.checkpoint, task, replicas, main_rank)


def already_complete(settings: TrainerSettings, checkpoint: Checkpoint | None, main_rank: bool) -> bool:
    """True (and the last line logged) when the newest checkpoint already reached MAX_STEPS, the run's total across
    starts: a trainer killed after its last checkpoint but before it exited, then started again.

    Nothing is trained, published or unloaded (the fleet is not asked anything, so the run's adapters stay served);
    `final-adapter/` gets the checkpoint's weights where the kill came before it was exported.
    """
    if checkpoint is None or checkpoint.step < settings.max_steps:
        return False
    if main_rank:
        log_event(log, "finished", steps=checkpoint.step, model_version=checkpoint.model_version,
                  adapter=final_adapter_from(checkpoint, settings.run_dir), already_complete=True,
                  reason=f"{checkpoint.path.name} reached MAX_STEPS={settings.max_steps}: nothing left to train")
    return True


def checked_task(settings: TrainerSettings, main_rank: bool) -> Task:
    """The task, built and checked before the fleet is asked anything: a broken task changes nothing there."""
    from lorafleet_trainer.tasks.checks import prepare_task  # the task's tokenizer and TRL's helpers: heavy

    task, _ = prepare_task(settings)
    if main_rank:
        log_event(log, "task_ready", **task.summary())
    return task


def fleet_replicas(settings: TrainerSettings, stops: StopDecision, run_key: str) -> int:
    """The fleet's ready replicas once it is healthy; a stop meanwhile or a refusal ends the start."""
    try:
        return asyncio.run(fleet_size(settings, run_key=run_key, stopping=stops.stop_requested))
    except StopRequested:
        stopped_before_training(stops, None)
        raise StartEnded(0) from None
    except (PreflightError, VLLMError) as exc:
        log_event(log, "refused", logging.ERROR, reason=str(exc))
        raise StartEnded(EXIT_PREFLIGHT) from None


def stopped_before_training(stops: StopDecision, resume_from: Path | None) -> bool:
    """True (and the last line logged) when a stop came before the first step: nothing to train or save."""
    if not stops.stop_requested():
        return False
    log_event(log, "stopped", reason=stops.reason, step=None, checkpoint=resume_from)
    return True
