"""Lossless resume's pure parts: the consumed set, the resumed prompt stream, the rollback bound, the version floor,
per-step attribution under accelerate's prefetch, and the completeness marker around a save."""

from __future__ import annotations

import json
import logging
import pickle
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet_trainer.checkpoints import WRITING_MARKER, checkpoint_complete, newest_checkpoint
from lorafleet_trainer.fleet_rollouts import RESUME_SKIP_KWARG, RESUME_START_KWARG, FleetRolloutLoop, stream_positions
from lorafleet_trainer.resume import (
    PROMPTS_FILE,
    ConsumedPrompts,
    PromptTracker,
    _ObservedQueue,
    next_version_floor,
    rollback_bound,
)


@given(st.lists(st.integers(min_value=0, max_value=60)))
def test_the_consumed_set_is_exactly_what_was_added_however_out_of_order(positions):
    consumed = ConsumedPrompts()
    fresh = [consumed.add(position) for position in positions]
    added = set(positions)
    assert fresh.count(True) == len(added)  # a second consumption of a group is reported, not counted
    assert all(position in consumed for position in added)
    assert not any(position in consumed for position in set(range(62)) - added)
    assert consumed.start == min(set(range(62)) - added)  # the first unconsumed position
    assert consumed.above == {position for position in added if position > consumed.start}
    assert consumed.count == len(added)


@given(st.integers(min_value=0, max_value=30), st.sets(st.integers(min_value=0, max_value=60)))
def test_a_resumed_stream_starts_at_the_head_and_skips_the_consumed_past_it(start, skip):
    stream = stream_positions(start, skip)
    produced = [next(stream) for _ in range(40)]
    assert produced == [position for position in range(start, start + 40 + len(skip)) if position not in skip][:40]


def test_the_child_names_groups_by_stream_position_and_repeats_each_row_per_generation():
    loop = SimpleNamespace(dataset=["r0", "r1", "r2"], num_generations=2, _resume_start=2, _resume_skip=(3, 5))
    walk = FleetRolloutLoop._repeat_iterator(loop)  # type: ignore[arg-type]
    assert [next(walk) for _ in range(8)] == [(2, "r2"), (2, "r2"), (4, "r1"), (4, "r1"), (6, "r0"), (6, "r0"),
                                              (7, "r1"), (7, "r1")]  # epoch 1 from position 3 on


def test_rollback_bound_counts_save_steps_of_whole_groups_plus_one_split():
    assert rollback_bound(save_steps=1, samples_per_step=32, num_generations=8) == 5  # the tiny task
    assert rollback_bound(save_steps=2, samples_per_step=32, num_generations=8) == 9
    assert rollback_bound(save_steps=1, samples_per_step=12, num_generations=8) == 3  # 12 samples span 3 groups


def test_the_version_floor_passes_every_name_on_disk_and_in_the_fleet(tmp_path):
    lora = tmp_path / ".vllm_lora"
    assert next_version_floor(4, lora, []) == 4  # nothing published yet
    for name in ("trl-policy-v3", "trl-policy-v7", "trl-policy-v12x", "other"):
        (lora / name).mkdir(parents=True)  # v7: cut short by a kill mid-sync, still a name taken
    assert next_version_floor(4, lora, []) == 7
    assert next_version_floor(4, lora, ["trl-policy-v9", "base"]) == 9
    assert next_version_floor(11, lora, ["trl-policy-v9"]) == 11


# -- the tracker on a stand-in trainer -------------------------------------------------------------------


class Worker:
    def __init__(self) -> None:
        self._loop_kwargs: dict[str, Any] = {}
        self.version = -1

    def update_model_version(self, version: int) -> None:
        self.version = version


class Queue:
    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def get(self, timeout: float) -> Any:
        return self.samples.pop(0)

    def qsize(self) -> int:
        return len(self.samples)


def _trainer(tmp_path: Path, save: Any, queue: Any = None, version: int = 0) -> Any:
    args = SimpleNamespace(output_dir=str(tmp_path), gradient_accumulation_steps=1, per_device_train_batch_size=32,
                           save_steps=2, num_generations=8, max_staleness=4)
    trainer = SimpleNamespace(
        args=args, accelerator=SimpleNamespace(is_main_process=True, num_processes=1), rollout_worker=Worker(),
        train_dataset=list(range(10)), rollout_queue=queue, model_version=version, state=SimpleNamespace(global_step=0),
        _trained_groups=set(), _groups_before_resume=0, _get_output_dir=lambda trial: str(tmp_path),
    )
    trainer._save_checkpoint = save
    return trainer


def _trl_save(trainer: Any, seen: list[bool]) -> Any:
    """What TRL + transformers write, in their order; `seen` records whether the marker was there meanwhile."""

    def save(model: Any, trial: Any) -> None:
        path = Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"
        (path / "rollout_state.json").write_text(json.dumps({"prompt_index": 99, "model_version": 1}))
        seen.append((path / WRITING_MARKER).exists())
        (path / "trainer_state.json").write_text("{}")

    return save


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / PROMPTS_FILE).read_text().splitlines()]


def test_a_step_consumes_its_own_micro_batches_not_the_one_accelerate_prefetched(tmp_path):
    seen: list[bool] = []
    trainer = _trainer(tmp_path, None)
    trainer._save_checkpoint = _trl_save(trainer, seen)
    tracker = PromptTracker(tmp_path, None)
    tracker.bind(trainer)
    assert trainer._trained_groups is tracker.collated
    collate = trainer._trained_groups.update  # TRL's collator, once per micro-batch
    collate(group for group in (0, 0, 1, 2, 3))
    collate(iter([4, 5, 6, 7]))  # step 2's first micro-batch, fetched before step 1 trains
    trainer.state.global_step = 1
    tracker.on_step_end(trainer.args, trainer.state, None)
    assert 4 not in tracker.consumed and tracker.consumed.start == 4
    trainer._save_checkpoint(None, None)  # checkpoint 1: prompt_index 4, not TRL's first-untrained 8
    checkpoint = newest_checkpoint(tmp_path)
    assert checkpoint is not None and (checkpoint.step, checkpoint.prompt_index) == (1, 4)
    assert seen == [True] and checkpoint_complete(checkpoint.path)
    collate([9, 10])  # out of order: 8 still generating
    trainer.state.global_step = 2
    tracker.on_step_end(trainer.args, trainer.state, None)
    rows = _records(tmp_path)
    assert [(row["step"], row["positions"], row["next"]) for row in rows] == [(1, [0, 1, 2, 3], 4),
                                                                              (2, [4, 5, 6, 7], 8)]
    trainer.state.global_step = 3
    tracker.on_step_end(trainer.args, trainer.state, None)
    assert _records(tmp_path)[-1]["prompts"] == [9, 0] and _records(tmp_path)[-1]["positions"] == [9, 10]
    trainer._save_checkpoint(None, None)
    state = json.loads((tmp_path / "checkpoint-3" / "rollout_state.json").read_text())
    assert state == {"prompt_index": 8, "model_version": 0, "consumed_above": [9, 10], "dataset_rows": 10}


def test_a_resume_restores_the_stream_the_epoch_count_and_a_version_past_every_published_name(tmp_path, caplog):
    run = tmp_path
    checkpoint = run / "checkpoint-3"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text("{}")
    (checkpoint / "rollout_state.json").write_text(json.dumps({"prompt_index": 8, "model_version": 4,
                                                               "consumed_above": [9, 10]}))
    (run / ".vllm_lora" / "trl-policy-v6").mkdir(parents=True)  # published after checkpoint 3, before the kill
    trainer = _trainer(run, lambda model, trial: None, version=4)  # TRL restored the checkpoint's version
    tracker = PromptTracker(run, newest_checkpoint(run), fleet_names=["trl-policy-v5"])
    tracker.bind(trainer)
    kwargs = trainer.rollout_worker._loop_kwargs
    assert (kwargs[RESUME_START_KWARG], kwargs[RESUME_SKIP_KWARG]) == (8, [9, 10])
    with caplog.at_level(logging.INFO):
        tracker.on_train_begin(trainer.args, trainer.state, None)
    assert trainer.model_version == trainer.rollout_worker.version == 6  # TRL publishes v7 next, never v5 again
    assert trainer._groups_before_resume == 10
    assert "adapter_versions_continue" in caplog.text


def test_stale_drops_count_as_consumed_by_the_step_whose_micro_batch_met_them(tmp_path):
    sample = lambda group, version: SimpleNamespace(group_id=group, model_version=version)  # noqa: E731
    trainer = _trainer(tmp_path, lambda model, trial: None,
                       queue=Queue([sample(0, 5), sample(1, 6), sample(2, 9)]), version=10)
    tracker = PromptTracker(tmp_path, None)
    tracker.bind(trainer)
    taken = [trainer.rollout_queue.get(timeout=5.0).group_id for _ in range(3)]
    assert taken == [0, 1, 2] and trainer.rollout_queue.qsize() == 0
    trainer._trained_groups.update([1, 2])
    trainer.state.global_step = 1
    tracker.on_step_end(trainer.args, trainer.state, None)
    record = _records(tmp_path)[0]
    assert (record["positions"], record["dropped"], record["next"]) == ([0, 1, 2], [0], 3)  # 10 - 5 > 4: dropped


def test_the_observed_queue_travels_to_another_process_as_trls_queue_itself():
    """TRAINER_FAST_STEP's packing process is handed the trainer's rollout queue: it must get TRL's, not a wrapper
    holding the trainer's closures."""
    assert pickle.loads(pickle.dumps(_ObservedQueue(["trl"], lambda: 0, 4, deque()))) == ["trl"]


def test_a_save_cut_short_leaves_its_marker_and_is_never_resumed_from(tmp_path, caplog):
    def killed(model: Any, trial: Any) -> None:
        (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
        raise KeyboardInterrupt  # stands in for the kill: nothing after this line runs

    trainer = _trainer(tmp_path, killed)
    complete = tmp_path / "checkpoint-2"
    complete.mkdir()
    (complete / "trainer_state.json").write_text("{}")
    PromptTracker(tmp_path, None).bind(trainer)
    trainer.state.global_step = 4
    with pytest.raises(KeyboardInterrupt):
        trainer._save_checkpoint(None, None)
    assert (tmp_path / "checkpoint-4" / WRITING_MARKER).exists()
    with caplog.at_level(logging.WARNING):
        found = newest_checkpoint(tmp_path)
    assert found is not None and found.path == complete
    skipped = [record.fields["checkpoint"] for record in caplog.records
               if record.getMessage() == "checkpoint_incomplete"]
    assert skipped == [tmp_path / "checkpoint-4"]


def test_a_checkpoint_is_complete_only_with_a_whole_trainer_state_and_no_marker(tmp_path):
    assert not checkpoint_complete(tmp_path)  # nothing written yet
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3, "log_hist')  # cut mid-write
    assert not checkpoint_complete(tmp_path)
    (tmp_path / "trainer_state.json").write_text('{"global_step": 3}')
    assert checkpoint_complete(tmp_path)  # also a checkpoint written before the marker existed
    (tmp_path / WRITING_MARKER).touch()
    assert not checkpoint_complete(tmp_path)
