"""Checkpoint discovery for resume, metrics.jsonl, and the final adapter export."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from lorafleet.settings import ConfigError
from lorafleet_trainer.run_state import (
    MetricsJsonl,
    check_resumable,
    export_final_adapter,
    newest_checkpoint,
    prune_checkpoints,
)


def _checkpoint(run, step, version=None, complete=True):
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    if version is not None:
        (path / "rollout_state.json").write_text(json.dumps({"prompt_index": 12, "model_version": version}))
    return path


def test_no_run_folder_or_no_checkpoint_means_a_fresh_run(tmp_path):
    assert newest_checkpoint(tmp_path / "missing") is None
    (tmp_path / "run" / ".vllm_lora").mkdir(parents=True)
    assert newest_checkpoint(tmp_path / "run") is None


def test_newest_complete_checkpoint_wins_numerically_and_keeps_trl_version(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 9, version=3)
    newest = _checkpoint(run, 10, version=4)  # "10" < "9" as strings
    _checkpoint(run, 11, version=5, complete=False)  # crashed mid-save: no trainer_state.json
    (run / "checkpoint-x").mkdir()
    found = newest_checkpoint(run)
    assert (found.path, found.step, found.model_version) == (newest, 10, 4)


def test_checkpoint_without_rollout_state_has_no_version(tmp_path):
    _checkpoint(tmp_path, 5)
    assert newest_checkpoint(tmp_path).model_version is None


def test_metrics_jsonl_appends_one_json_line_per_log_with_step(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    callback = MetricsJsonl(path)
    state = SimpleNamespace(global_step=3, is_world_process_zero=True)
    callback.on_log(None, state, None, logs={"ratio": 1.0004, "reward": 0.25, "perf/weight_sync_s": 0.1})
    callback.on_log(None, SimpleNamespace(global_step=4, is_world_process_zero=True), None,
                    logs={"ratio": float("nan"), "kl": float("inf")})
    callback.on_log(None, SimpleNamespace(global_step=4, is_world_process_zero=False), None, logs={"ratio": 1.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    assert rows[0]["step"] == 3 and rows[0]["ratio"] == 1.0004 and rows[0]["perf/weight_sync_s"] == 0.1
    assert rows[1] == {"step": 4, "time": rows[1]["time"], "ratio": None, "kl": None}  # strict JSON, no NaN


class _Model:
    """Stands in for a PeftModel: save_pretrained writes the adapter files."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        from pathlib import Path

        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_config.json").write_text(json.dumps({"marker": self.marker}))


def test_final_adapter_is_exported_and_replaced_whole(tmp_path):
    first = export_final_adapter(_Model("a"), tmp_path)
    assert first == tmp_path / "final-adapter"
    export_final_adapter(_Model("b"), tmp_path)
    assert json.loads((first / "adapter_config.json").read_text()) == {"marker": "b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final-adapter"]  # no staging leftovers


def test_pruning_keeps_the_newest_k_complete_checkpoints_by_step_number(tmp_path):
    run = tmp_path / "run"
    for step in (9, 10, 11, 12):
        _checkpoint(run, step, version=step)
    crashed = _checkpoint(run, 8, complete=False)  # a save that died halfway, older than the newest
    writing = _checkpoint(run, 13, complete=False)  # newer than every complete one: maybe being written
    os.utime(run / "checkpoint-9", (2e9, 2e9))  # mtime says newest; the step number decides
    (run / "final-adapter").mkdir()
    deleted = prune_checkpoints(run, keep=2)
    assert sorted(path.name for path in deleted) == ["checkpoint-10", "checkpoint-8", "checkpoint-9"]
    assert sorted(path.name for path in run.iterdir()) == ["checkpoint-11", "checkpoint-12", "checkpoint-13",
                                                           "final-adapter"]
    assert writing.exists() and not crashed.exists()
    assert newest_checkpoint(run).step == 12


def test_keep_zero_or_a_missing_folder_prunes_nothing(tmp_path):
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step)
    assert prune_checkpoints(tmp_path, keep=0) == [] and len(list(tmp_path.iterdir())) == 3
    assert prune_checkpoints(tmp_path / "missing", keep=1) == []


def test_a_checkpoint_resumes_only_under_the_sharding_that_can_load_it(tmp_path):
    """Full (one rank, DDP) <-> any rank count without FSDP; FSDP2's sharded state dict <-> FSDP2 only."""
    full = tmp_path / "checkpoint-3"
    full.mkdir()
    (full / "trainer_state.json").write_text("{}")
    (full / "optimizer.pt").write_bytes(b"")
    found = newest_checkpoint(tmp_path)
    assert found is not None and not found.sharded
    check_resumable(found, fsdp2=False)
    with pytest.raises(ConfigError, match="TRAINER_SHARDING=ddp"):
        check_resumable(found, fsdp2=True)
    (full / "pytorch_model_fsdp_0").mkdir()
    assert found.sharded
    check_resumable(found, fsdp2=True)
    with pytest.raises(ConfigError, match="TRAINER_SHARDING=fsdp2 on two or more GPUs"):
        check_resumable(found, fsdp2=False)
