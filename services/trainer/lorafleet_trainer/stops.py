"""When this start stops, decided without torch or transformers: a signal, a per-start ceiling, low disk.

The start's checks (start_checks.py) need the decision before anything heavy is imported (a start refused for low
disk pays no import of torch), and training needs the same object later: lifecycle.RunLifecycle, the Trainer
callback, acts on it at each step. A second SIGTERM/SIGINT exits at once (the rollout child is killed first,
`on_force`).
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

from lorafleet.adapters import run_dir
from lorafleet.logs import log_event
from lorafleet.runs import run_slots
from lorafleet.settings import TrainerSettings

from lorafleet_trainer import early_stop
from lorafleet_trainer.early_stop import STOP_SIGNALS

log = logging.getLogger("lorafleet_trainer.lifecycle")  # the lines' logger before the split: logs unchanged
GB = 1024**3

# Stop reasons, as logged in the last line (`event=stopped reason=...`).
SIGNAL = "signal"
MAX_WALL = "run_max_wall_s"
MAX_STEPS = "run_max_steps"
LOW_DISK = "low_disk"
OTHER_RANK = "other_rank"  # several ranks: another one had a reason, all stop at the same step
CEILINGS = (MAX_WALL, MAX_STEPS)  # a spent budget ends the run: the final adapter is exported too


class StoppedWhileWaiting(Exception):
    """Raised out of the rollout wait to abandon a step that has not started (see StopDecision.check_health)."""


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


class StopDecision:
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
        self.first_step: int | None = None  # set at train begin (RunLifecycle)
        self.on_force: Callable[[], None] = lambda: None  # set by the seam's shield_rollout_worker
        self.agree: Callable[[bool], bool] = bool  # under several ranks: stop when any rank must (set by main)
        self._signals = 0

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

    def install_signal_handlers(self) -> None:
        """From here on this object decides; a signal held since the process started counts as the first."""
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
