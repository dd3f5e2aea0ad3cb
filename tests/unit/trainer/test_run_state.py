"""Checkpoint discovery for resume, retention, metrics.jsonl, and the final adapter export."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from lorafleet.settings import ConfigError
from lorafleet_trainer.checkpoints import (
    check_resumable,
    final_adapter_from,
    newest_checkpoint,
    prune_checkpoints,
    prune_versions,
)
from lorafleet_trainer.run_state import MetricsJsonl, export_final_adapter


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


def _peft_trainer(model_dir, seed):
    """A real PEFT model on the tiny model, as the trainer holds it: one rank, nothing sharded."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", init_lora_weights=False))
    accelerator = SimpleNamespace(is_main_process=True, device=torch.device("cpu"), unwrap_model=lambda m: m)
    return SimpleNamespace(model=model, accelerator=accelerator)


def test_final_adapter_is_exported_and_replaced_whole(tmp_path):
    from lorafleet_ops.tiny_model import make_tiny_model
    from safetensors.torch import load_file

    model_dir = make_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    run.mkdir()
    first = export_final_adapter(_peft_trainer(model_dir, 1), run)
    assert first == run / "final-adapter"
    second = _peft_trainer(model_dir, 2)
    export_final_adapter(second, run)
    config = json.loads((first / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 1
    saved = load_file(str(first / "adapter_model.safetensors"))
    expected = {name: tensor for name, tensor in second.model.state_dict().items() if "lora_" in name}
    assert len(saved) == len(expected) > 0
    for name, tensor in expected.items():  # the second model's weights, whole: PEFT's names without ".default"
        assert (saved[name.replace(".default", "")] == tensor).all(), name
    assert sorted(p.name for p in run.iterdir()) == ["final-adapter"]  # no staging leftovers


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


def _versions(lora, *versions):
    for version in versions:
        (lora / f"trl-policy-v{version}").mkdir(parents=True)


def test_published_versions_keep_trls_window_from_the_newest_and_an_orphan_goes(tmp_path):
    """A start killed between its publish of v10 and TRL's delete of v4 (MAX_STALENESS=4: 6 kept) left v4 behind;
    the next start's syncs delete v5, v6, ... but never name v4 again."""
    lora = tmp_path / ".vllm_lora"
    _versions(lora, 4, *range(6, 12))
    (lora / ".trl-policy-v12.tmp").mkdir()  # TRL staging the next one
    (lora / "notes").mkdir()
    deleted = prune_versions(lora, keep=6)
    assert [path.name for path in deleted] == ["trl-policy-v4"]
    assert sorted(path.name for path in lora.iterdir()) == sorted(
        [f"trl-policy-v{v}" for v in range(6, 12)] + [".trl-policy-v12.tmp", "notes"])
    assert prune_versions(lora, keep=6) == []  # TRL's own window is left as it is
    assert prune_versions(tmp_path / "missing", keep=6) == []


def test_a_gap_in_the_numbering_prunes_by_version_not_by_count(tmp_path):
    lora = tmp_path / ".vllm_lora"
    _versions(lora, 3, 4, 9, 10)  # a resume published past names the fleet still held: v5..v8 never on disk here
    assert sorted(path.name for path in prune_versions(lora, keep=6)) == ["trl-policy-v3", "trl-policy-v4"]


def _adapter(folder, value):
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 1}))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.full((1, 4), value)},
              str(folder / "adapter_model.safetensors"))


def test_a_finished_runs_final_adapter_is_restored_from_its_last_checkpoint_once(tmp_path):
    """Killed after checkpoint-3 but before the export: final-adapter/ missing, or an earlier start's."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    checkpoint = _checkpoint(run, 3, version=4)
    _adapter(checkpoint, 3.0)
    _adapter(run / "final-adapter", 2.0)  # exported by an earlier start's ceiling, two steps back
    found = newest_checkpoint(run)
    target = final_adapter_from(found, run)
    assert target == run / "final-adapter"
    assert (load_file(str(target / "adapter_model.safetensors"))["base_model.model.lm_head.lora_A.weight"] == 3).all()
    written = (target / "adapter_model.safetensors").stat().st_mtime_ns
    os.utime(target / "adapter_model.safetensors", ns=(written - 10**9, written - 10**9))
    assert final_adapter_from(found, run) == target  # the same tensors: kept as it is
    assert (target / "adapter_model.safetensors").stat().st_mtime_ns == written - 10**9
    assert sorted(path.name for path in run.iterdir()) == ["checkpoint-3", "final-adapter"]


def test_a_sharded_checkpoint_leaves_the_final_adapter_as_it_is(tmp_path):
    run = tmp_path / "run"
    _checkpoint(run, 3)
    assert final_adapter_from(newest_checkpoint(run), run) is None
    (run / "final-adapter").mkdir()
    assert final_adapter_from(newest_checkpoint(run), run) == run / "final-adapter"


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
