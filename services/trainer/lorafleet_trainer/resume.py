"""Lossless resume: which prompt groups a checkpoint consumed, where the rollout child restarts, which name is next.

The prompt stream. TRL 1.16's rollout child walks the task's train dataset in row order, round and round
(`_AsyncRolloutLoop._repeat_iterator`: no shuffle; the dataset itself is built from SEED, the same at every start).
lorafleet's child names each prompt group by its *position* in that stream, epoch × rows + row (FleetRolloutLoop), so
a group's prompt id is its dataset row, `position % rows`, and TRL's record of trained groups is a set of positions.

Consumed. A group is consumed by the optimizer step that trains the first of its samples, or that drops it as stale.
Not when it is collated: accelerate fetches (and so collates) one micro-batch ahead, so when step N ends the first
micro-batch of step N+1 is already in TRL's `_trained_groups`, and TRL's own resume point (rollout_state.json's
`prompt_index`, its first untrained group) skips those groups at every resume. Here the collated micro-batches wait
in order (CollatedGroups) and a step takes exactly its gradient_accumulation_steps of them when it ends.

Each checkpoint stores the consumed set in its rollout_state.json: `prompt_index` (the first unconsumed position, where
TRL's own reader would resume too) and `consumed_above` (consumed positions past it: groups finish out of order). A
resume restarts the child at `prompt_index` and skips `consumed_above`: no group consumed into the checkpoint is
consumed again, none before the stream's new head is left out. The bound on what a kill repeats: `rollback_bound`.
Each step's consumed groups go to prompts.jsonl; prompt_log reads it back and judges a run against this contract.

Adapter names. TRL numbers from the checkpoint's version, so a run killed after publishing past its checkpoint would
publish a name again with other weights. Here the next version is past every name on disk (the run's .vllm_lora) and
every name the start-up sweep found loaded in the fleet.

Completeness. A save writes checkpoints.WRITING_MARKER first and removes it last, after rollout_state.json is
rewritten, so a checkpoint cut short by a kill is never resumed from (checkpoints.checkpoint_complete).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafleet.adapters import LORA_DIR_NAME, policy_version
from lorafleet.logs import log_event
from transformers import TrainerCallback

from lorafleet_trainer import trl_seam
from lorafleet_trainer.checkpoints import ROLLOUT_STATE, WRITING_MARKER, Checkpoint
from lorafleet_trainer.fleet_rollouts import RESUME_SKIP_KWARG, RESUME_START_KWARG
from lorafleet_trainer.prompt_log import PROMPTS_FILE
from lorafleet_trainer.queue_view import QueueView
from lorafleet_trainer.run_state import MetricsJsonl

log = logging.getLogger(__name__)


@dataclass
class ConsumedPrompts:
    """The consumed positions of the prompt stream: every one below `start`, and `above` (sparse, past `start`)."""

    start: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, position: int) -> bool:
        """Mark `position` consumed; False when it already was."""
        if position in self:
            return False
        self.above.add(position)
        while self.start in self.above:
            self.above.remove(self.start)
            self.start += 1
        return True

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and (position < self.start or position in self.above)

    @property
    def count(self) -> int:
        return self.start + len(self.above)

    @classmethod
    def from_checkpoint(cls, checkpoint: Checkpoint | None) -> ConsumedPrompts:
        if checkpoint is None:
            return cls()
        consumed = cls(start=checkpoint.prompt_index)
        for position in checkpoint.consumed_above:
            consumed.add(position)
        return consumed


def rollback_bound(save_steps: int, samples_per_step: int, num_generations: int) -> int:
    """Most trained groups one kill makes prompts.jsonl show twice: those of the steps it rolls back.

    A kill rolls back at most SAVE_STEPS steps (a kill while checkpoint N+SAVE_STEPS is written resumes from N). A step
    trains `samples_per_step` samples (FixedCountBatcher) taken in queue order, where a group's samples sit together
    (TRL's score loop queues one group at a time), at least one per group: consecutive steps touch at most
    ceil(steps × samples / G) + 1 groups. Stale-dropped groups take no samples and come on top.
    """
    return math.ceil(save_steps * samples_per_step / max(num_generations, 1)) + 1


def next_version_floor(checkpoint_version: int, lora_dir: Path, fleet_names: Iterable[str]) -> int:
    """The highest adapter version this run may have published: the checkpoint's, any on disk, any in the fleet."""
    on_disk = [entry.name for entry in lora_dir.iterdir()] if lora_dir.is_dir() else []
    versions = [version for name in [*on_disk, *fleet_names] if (version := policy_version(name))]
    return max([checkpoint_version, *versions])


class CollatedGroups(set[int]):
    """TRL's `_trained_groups`, which its collator `update`s once per micro-batch: the same set, plus each
    micro-batch's groups and the stale drops met while it was assembled, queued until the step that trains it ends."""

    def __init__(self, dropped: deque[int]) -> None:
        super().__init__()
        self.pending: deque[tuple[list[int], list[int]]] = deque()
        self._dropped = dropped  # appended to by the queue's reader, which may be a packing thread

    def update(self, *groups: Iterable[int]) -> None:
        batch = [int(group) for each in groups for group in each]
        super().update(batch)
        drops = []
        while self._dropped:
            drops.append(self._dropped.popleft())
        self.pending.append((batch, drops))


class _ObservedQueue(QueueView):
    """TRL's rollout queue as its reader (RolloutQueueDataset) sees it, noting the groups it is about to drop: it
    reads the policy version right after `get` on the same thread (no sync in between) and drops a sample when
    `version - sample.model_version > max_staleness`.

    TRAINER_FAST_STEP's prefetching reader checks against the version a micro-batch packed ahead will train at (not
    lower than the current one), so a drop seen here is one it makes too; one it alone makes, or any made in its
    packing process (which gets TRL's queue itself), is not seen: that group is then never counted consumed, so a
    resume generates it again (never a skip; `consumed_above` grows until the next resume).
    """

    def __init__(self, queue: Any, version: Callable[[], int], max_staleness: int, dropped: deque[int]) -> None:
        super().__init__(queue)
        self._version, self._max_staleness, self._dropped = version, max_staleness, dropped

    def get(self, *args: Any, **kwargs: Any) -> Any:
        sample = self._queue.get(*args, **kwargs)
        if self._version() - sample.model_version > self._max_staleness:
            self._dropped.append(int(sample.group_id))
        return sample

    def __reduce__(self) -> tuple[Any, ...]:
        """Sent to another process (TRAINER_FAST_STEP's packing process), it is TRL's queue itself."""
        return (_unwrapped, (self._queue,))


def _unwrapped(queue: Any) -> Any:
    return queue


class PromptTracker(TrainerCallback):
    """Tracks the consumed prompt groups, logs them per step (prompts.jsonl), saves them with each checkpoint
    (behind the completeness marker) and restores them, with the adapter version floor, on resume.

    Pass it among the Trainer's callbacks (its on_train_begin must run before TRL's, which starts the child and
    publishes the first version), then `bind` the built trainer. Rank 0 alone does anything: it alone holds the
    rollout worker and collates.
    """

    def __init__(self, run_dir: Path, checkpoint: Checkpoint | None, fleet_names: Iterable[str] = ()) -> None:
        self.fleet_names = list(fleet_names)
        self.consumed = ConsumedPrompts.from_checkpoint(checkpoint)
        self.dropped: deque[int] = deque()
        self.collated = CollatedGroups(self.dropped)
        self.prompts = MetricsJsonl(run_dir / PROMPTS_FILE)
        self.attempt = round(time.time(), 3)  # tells this start's lines from those of an earlier start
        self.trainer: Any = None
        self.rows = 0

    def bind(self, trainer: Any) -> None:
        """Wire into the built trainer, before `train()`: TRL reads the queue and the set at dataloader build."""
        self.trainer = trainer
        trl_seam.wrap_save_checkpoint(trainer, self._marked_save)
        worker = getattr(trainer, "rollout_worker", None)
        if worker is None:
            return
        self.rows = len(trainer.train_dataset) if hasattr(trainer.train_dataset, "__len__") else 0
        trl_seam.set_trained_groups(trainer, self.collated)
        trl_seam.wrap_rollout_queue(trainer, lambda queue: _ObservedQueue(
            queue, lambda: trainer.model_version, trainer.args.max_staleness, self.dropped))
        trl_seam.set_loop_kwargs(worker, **{RESUME_START_KWARG: self.consumed.start,
                                            RESUME_SKIP_KWARG: sorted(self.consumed.above)})
        args = trainer.args
        samples = (args.per_device_train_batch_size * args.gradient_accumulation_steps
                   * trainer.accelerator.num_processes)
        log_event(log, "prompt_stream", resume_at=self.consumed.start, skip=len(self.consumed.above),
                  rows=self.rows, log=self.prompts.path,
                  rollback_groups_max=rollback_bound(args.save_steps, samples, args.num_generations))

    # -- Trainer hooks ---------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        worker = getattr(self.trainer, "rollout_worker", None)
        if worker is None:
            return
        trainer = self.trainer
        restored = trainer.model_version
        floor = next_version_floor(restored, Path(args.output_dir) / LORA_DIR_NAME, self.fleet_names)
        if floor != restored:
            log_event(log, "adapter_versions_continue", checkpoint_version=restored, published_max=floor,
                      next=floor + 1, reason="names past the checkpoint's were published before it stopped")
        # TRL's epoch count from the consumed prompts (TRL set it from its own, too early, prompt_index)
        trl_seam.set_resume_point(trainer, groups_before=self.consumed.count, model_version=floor)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.trainer is None or getattr(self.trainer, "rollout_worker", None) is None:
            return
        positions: list[int] = []
        dropped: list[int] = []
        for _ in range(min(args.gradient_accumulation_steps, len(self.collated.pending))):
            batch, drops = self.collated.pending.popleft()
            positions += [position for position in [*drops, *batch] if self.consumed.add(position)]
            dropped += drops
        rows = [position % self.rows for position in positions] if self.rows else positions
        self.prompts.append(state.global_step, {
            "attempt": self.attempt, "policy_version": self.trainer.model_version, "positions": positions,
            "prompts": rows, "dropped": dropped, "next": self.consumed.start,
        })

    # -- checkpoints -----------------------------------------------------------------------------------
    def _marked_save(self, save: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """TRL's `_save_checkpoint` behind the completeness marker, with the consumed prompts in rollout_state.json."""

        def marked(model: Any, trial: Any) -> None:
            trainer = self.trainer
            main = trainer.accelerator.is_main_process
            path = Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"
            if main:
                path.mkdir(parents=True, exist_ok=True)
                (path / WRITING_MARKER).touch()
            save(model, trial)
            if trainer.accelerator.num_processes > 1:  # every rank's files are written before the marker goes
                trainer.accelerator.wait_for_everyone()
            if main:
                if getattr(trainer, "rollout_worker", None) is not None:
                    self._write_state(path)
                (path / WRITING_MARKER).unlink()

        return marked

    def _write_state(self, path: Path) -> None:
        state = {"prompt_index": self.consumed.start, "model_version": self.trainer.model_version,
                 "consumed_above": sorted(self.consumed.above), "dataset_rows": self.rows}
        staged = path / f".{ROLLOUT_STATE}.new"
        staged.write_text(json.dumps(state))
        os.replace(staged, path / ROLLOUT_STATE)
