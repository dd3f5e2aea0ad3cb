"""When a run stops on purpose: a signal, a per-start ceiling, or a volume running out of space.

Every such stop ends at a step boundary with a complete checkpoint (TRL's rollout_state.json with it,
so adapter names keep counting after the resume): either after the current step (the callback asks
the Trainer to save and stop), or, when the trainer is idle waiting for rollouts, at once (the wait
is abandoned; no optimizer step is in progress, so the weights are exactly those of the last step).

A second SIGTERM/SIGINT exits at once (the rollout child is killed first). TRL's rollout child is a
process of its own (rollout_server.py); a terminal's Ctrl-C or a supervisor signalling the whole
process group would kill it mid-rollout and the parent would die with "Rollout worker child has
failed". The child is therefore started with SIGINT/SIGTERM blocked: the parent alone decides, and
stops it through TRL's own stop event.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorafleet.adapters import LORA_DIR_NAME, run_dir
from lorafleet.logs import log_event
from lorafleet.runs import run_slots
from lorafleet.settings import TrainerSettings
from transformers import TrainerCallback

from lorafleet_trainer import early_stop
from lorafleet_trainer.early_stop import STOP_SIGNALS
from lorafleet_trainer.rollout_server import ShieldedContext
from lorafleet_trainer.run_state import checkpoint_complete, prune_checkpoints, prune_versions

log = logging.getLogger(__name__)
GB = 1024**3

# Stop reasons, as logged in the last line (`event=stopped reason=...`).
SIGNAL = "signal"
MAX_WALL = "run_max_wall_s"
MAX_STEPS = "run_max_steps"
LOW_DISK = "low_disk"
OTHER_RANK = "other_rank"  # several ranks: another one had a reason, all stop at the same step
CEILINGS = (MAX_WALL, MAX_STEPS)  # a spent budget ends the run: the final adapter is exported too


class StoppedWhileWaiting(Exception):
    """Raised out of the rollout wait to abandon a step that has not started (see RunLifecycle.check_health)."""


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


@dataclass(frozen=True)
class Limits:
    max_wall_s: float  # 0 = none
    max_steps: int  # steps this start may take; 0 = none
    min_free_bytes: int  # 0 = no guard
    volume: Path
    keep_checkpoints: int = 0  # newest checkpoints kept after each save; 0 = all
    keep_versions: int = 0  # published versions kept in .vllm_lora (TRL's MAX_STALENESS + 2); 0 = all

    @classmethod
    def from_settings(cls, settings: TrainerSettings) -> Limits:
        return cls(
            max_wall_s=settings.run_max_wall_s,
            max_steps=settings.run_max_steps,
            min_free_bytes=int(settings.trainer_min_free_gb * GB),
            # The run's own folder: in the stack it is the trainer's only writable mount of the store.
            volume=run_dir(settings.adapter_root, settings.run_name),
            keep_checkpoints=settings.checkpoint_keep,
            keep_versions=run_slots(settings.max_staleness),
        )


class RunLifecycle(TrainerCallback):
    """Decides when this start stops: first signal, RUN_MAX_WALL_S, RUN_MAX_STEPS, TRAINER_MIN_FREE_GB.

    `clock` starts at construction (the process start, for RUN_MAX_WALL_S); `disk` measures free bytes.
    """

    def __init__(
        self, limits: Limits, clock: Callable[[], float] = time.monotonic, disk: Callable[[Path], int] | None = None
    ) -> None:
        self.limits = limits
        self.clock = clock
        self.disk = disk or free_bytes
        self.started = clock()
        self.reason: str | None = None
        self.first_step: int | None = None
        self.on_force: Callable[[], None] = lambda: None  # set by shield_rollout_worker
        self.agree: Callable[[bool], bool] = bool  # under several ranks: stop when any rank must (set by main)
        self._signals = 0

    # -- the decision ----------------------------------------------------------------------------------
    def low_disk(self) -> str | None:
        """A refusal message when the adapter volume has less free space than required, else None."""
        if not self.limits.min_free_bytes:
            return None
        free = self.disk(self.limits.volume)
        if free >= self.limits.min_free_bytes:
            return None
        return (
            f"{self.limits.volume} has {free / GB:.2f} GB free, under TRAINER_MIN_FREE_GB="
            f"{self.limits.min_free_bytes / GB:g}; free space or lower the setting"
        )

    def due(self, global_step: int | None = None) -> str | None:
        """Why this start should stop now (the first reason recorded wins), or None to go on."""
        if self.reason is None:
            wall = self.clock() - self.started
            if self.limits.max_wall_s and wall >= self.limits.max_wall_s:
                self.reason = MAX_WALL
            elif (
                self.limits.max_steps and global_step is not None and self.first_step is not None
                and global_step - self.first_step >= self.limits.max_steps
            ):
                self.reason = MAX_STEPS
            elif self.low_disk():
                self.reason = LOW_DISK
        return self.reason

    def stop_requested(self) -> bool:
        """A stop reason is recorded (a signal, or a ceiling met): what a wait during start-up gives up on."""
        return self.reason is not None

    # -- signals ---------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """From here on this callback decides; a signal held since the process started counts as the first."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        if (held := early_stop.take()) is not None:
            self._on_signal(held, None)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        self._signals += 1
        if self._signals == 1:
            self.reason = self.reason or SIGNAL
            log_event(log, "stop_requested", signal=name, action="checkpoint at the next step boundary, then exit 0",
                      again="a second signal exits at once without a checkpoint")
            return
        log_event(log, "stop_forced", logging.WARNING, signal=name, checkpoint="none (resume from the newest)")
        self.on_force()
        logging.shutdown()
        os._exit(128 + signum)

    # -- Trainer hooks ---------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.first_step = state.global_step
        # A resumed TrainerState brings the SAVE_STEPS of the run that wrote it; this start's setting wins.
        state.save_steps = args.save_steps

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.limits.keep_versions and state.is_world_process_zero:
            prune_versions(Path(args.output_dir) / LORA_DIR_NAME, self.limits.keep_versions)
        if self.agree(self.due(state.global_step) is not None):
            self.reason = self.reason or OTHER_RANK
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.is_world_process_zero:
            prune_checkpoints(Path(args.output_dir), self.limits.keep_checkpoints)

    def check_health(self, worker_check: Callable[[float], None]) -> Callable[[float], None]:
        """Wrap TRL's rollout-worker health check, which the trainer calls every 5 s while no rollout arrives.

        That wait is a step boundary (a step's micro-batches are all fetched before its forward), so a stop
        that is due can abandon it instead of waiting for a step a stalled fleet may never deliver.
        """

        def check(stale_after_s: float) -> None:
            worker_check(stale_after_s)
            if self.due():
                raise StoppedWhileWaiting(self.reason)

        return check


def shield_rollout_worker(trainer: Any, lifecycle: RunLifecycle) -> None:
    """Start TRL's rollout child shielded from stop signals; abandon rollout waits when a stop is due;
    kill the child on a forced exit. (TRL 1.16 `AsyncRolloutWorker`: `_mp_ctx`, `_process`, `check_health`.)"""
    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:  # not rank 0
        return
    worker._mp_ctx = ShieldedContext()
    if trainer.accelerator.num_processes == 1:  # with several ranks, rank 0 alone must not leave a collective
        worker.check_health = lifecycle.check_health(worker.check_health)

    def kill_child() -> None:
        process = getattr(worker, "_process", None)
        if process is not None and process.pid is not None:
            process.kill()

    lifecycle.on_force = kill_child


def stop_agreement(accelerator: Any) -> Callable[[bool], bool]:
    """How ranks agree to stop at the same step: any rank's reason stops all (a lone rank would hang the rest)."""
    if accelerator.num_processes == 1:
        return bool

    def any_rank(flag: bool) -> bool:
        import torch

        total = accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), reduction="sum")
        return int(total.item()) > 0

    return any_rank


def checkpoint_now(trainer: Any, lifecycle: RunLifecycle) -> Path:
    """The checkpoint of the step reached, written unless that step already has a complete one."""
    path = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    if not checkpoint_complete(path):
        trainer._save_checkpoint(trainer.model, trial=None)  # with TRL's rollout_state.json and resume.py's marker
        prune_checkpoints(path.parent, lifecycle.limits.keep_checkpoints)
    return path
