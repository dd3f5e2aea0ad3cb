"""When a run stops on purpose, acted on at each step: a signal, a per-start ceiling, or a volume running out of space.

The decision itself (stops.py) is light, made before torch is imported; RunLifecycle, the Trainer callback, acts on it.

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

from collections.abc import Callable
from pathlib import Path
from typing import Any

from lorafleet.adapters import LORA_DIR_NAME
from transformers import TrainerCallback

from lorafleet_trainer import trl_seam
from lorafleet_trainer.checkpoints import checkpoint_complete, prune_checkpoints, prune_versions
from lorafleet_trainer.rollout_server import ShieldedContext
from lorafleet_trainer.stops import OTHER_RANK, StopDecision


class RunLifecycle(TrainerCallback):
    """The Trainer's side of `stops` (a StopDecision): a stop that is due saves and ends training at the step's end,
    the retention rules run after each step and save."""

    def __init__(self, stops: StopDecision) -> None:
        self.stops = stops

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.stops.first_step = state.global_step
        # A resumed TrainerState brings the SAVE_STEPS of the run that wrote it; this start's setting wins.
        state.save_steps = args.save_steps

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        limits = self.stops.limits
        if limits.keep_versions and state.is_world_process_zero:
            prune_versions(Path(args.output_dir) / LORA_DIR_NAME, limits.keep_versions)
        if self.stops.agree(self.stops.due(state.global_step) is not None):
            self.stops.reason = self.stops.reason or OTHER_RANK
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if state.is_world_process_zero:
            prune_checkpoints(Path(args.output_dir), self.stops.limits.keep_checkpoints)


def shield_rollout_worker(trainer: Any, stops: StopDecision) -> None:
    """Start TRL's rollout child shielded from stop signals; abandon rollout waits when a stop is due;
    kill the child on a forced exit. (TRL 1.16 `AsyncRolloutWorker`: `_mp_ctx`, `_process`, `check_health`.)"""
    worker = getattr(trainer, "rollout_worker", None)
    if worker is None:  # not rank 0
        return
    trl_seam.set_process_context(worker, ShieldedContext())
    if trainer.accelerator.num_processes == 1:  # with several ranks, rank 0 alone must not leave a collective
        trl_seam.wrap_health_check(worker, stops.check_health)

    def kill_child() -> None:
        process = trl_seam.rollout_child(worker)
        if process is not None and process.pid is not None:
            process.kill()

    stops.on_force = kill_child


def stop_agreement(accelerator: Any) -> Callable[[bool], bool]:
    """How ranks agree to stop at the same step: any rank's reason stops all (a lone rank would hang the rest)."""
    if accelerator.num_processes == 1:
        return bool

    def any_rank(flag: bool) -> bool:
        import torch

        total = accelerator.reduce(torch.tensor(int(flag), device=accelerator.device), reduction="sum")
        return int(total.item()) > 0

    return any_rank


def checkpoint_now(trainer: Any, stops: StopDecision) -> Path:
    """The checkpoint of the step reached, written unless that step already has a complete one."""
    path = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
    if not checkpoint_complete(path):
        trl_seam.save_checkpoint(trainer)  # with TRL's rollout_state.json and resume.py's marker
        prune_checkpoints(path.parent, stops.limits.keep_checkpoints)
    return path
