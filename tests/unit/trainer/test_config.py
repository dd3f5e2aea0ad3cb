"""Settings (env, flags, task defaults) -> AsyncGRPOConfig / LoraConfig, as a table."""

from __future__ import annotations

import pytest
from lorafleet.settings import ConfigError, StackSettings
from lorafleet_trainer.config import base_dtype, build_configs, score_queue_groups, use_bf16
from lorafleet_trainer.main import FLAG_FIELDS, build_parser, main, resolve_settings
from lorafleet_trainer.ranks import plan_ranks
from lorafleet_trainer.tasks.builtin import tiny as tiny_task

ALL_FIELDS = set(StackSettings.model_fields)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No trainer setting leaks in from the environment or a .env file."""
    for name in ALL_FIELDS:
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ADAPTER_ROOT", str(tmp_path / "adapters"))


def configs(replicas: int = 1, cuda: bool = False, **overrides: str):
    settings = resolve_settings(overrides)
    return build_configs(settings, replicas=replicas, ranks=plan_ranks(settings, 8 if cuda else 0))


def test_defaults_are_the_best_published_run(tmp_path):
    built = configs(replicas=2)
    grpo, lora = built.grpo, built.lora
    assert (lora.r, lora.lora_alpha, lora.target_modules) == (1, 2, "all-linear")
    assert (lora.bias, lora.use_dora, lora.modules_to_save) == ("none", False, None)
    assert grpo.learning_rate == 4e-5
    assert grpo.num_generations == 8
    assert grpo.token_budget == 16384
    assert grpo.gradient_checkpointing is False
    assert grpo.max_inflight_tasks == 2 * 128  # 128 per replica
    assert grpo.queue_maxsize == 2 * 2 * 128  # twice the in-flight rollouts
    assert (grpo.max_staleness, grpo.weight_sync_steps) == (4, 4)
    assert grpo.adam_beta2 == 0.95
    assert grpo.output_dir == str(tmp_path / "adapters" / "runs" / "run1")
    assert grpo.vllm_server_base_url == "http://proxy:8000"
    assert grpo.logging_steps == 1 and grpo.report_to == []


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({"LEARNING_RATE": "1e-4"}, "learning_rate", 1e-4),
        ({"NUM_GENERATIONS": "4"}, "num_generations", 4),
        ({"TOKEN_BUDGET": "0"}, "token_budget", 0),
        ({"TRAIN_BATCH_SIZE": "12"}, "per_device_train_batch_size", 12),
        ({"GRADIENT_ACCUMULATION_STEPS": "3"}, "gradient_accumulation_steps", 3),
        ({"GRADIENT_CHECKPOINTING": "true"}, "gradient_checkpointing", True),
        ({"MAX_INFLIGHT_PER_REPLICA": "10"}, "max_inflight_tasks", 10),
        ({"MAX_INFLIGHT_PER_REPLICA": "10"}, "queue_maxsize", 20),
        ({"QUEUE_MAXSIZE": "77"}, "queue_maxsize", 77),
        ({"MAX_COMPLETION_LENGTH": "64"}, "max_completion_length", 64),
        ({"TEMPERATURE": "0.7"}, "temperature", 0.7),
        ({"MAX_STEPS": "9"}, "max_steps", 9),
        ({"SAVE_STEPS": "3"}, "save_steps", 3),
        ({"SEED": "42"}, "seed", 42),
        ({"MAX_STALENESS": "2"}, "max_staleness", 2),
        ({"WEIGHT_SYNC_STEPS": "1"}, "weight_sync_steps", 1),
        ({"TRAINER_VLLM_URL": "http://127.0.0.5:8000/"}, "vllm_server_base_url", "http://127.0.0.5:8000"),
        ({"TRAINER_SERVER_TIMEOUT_S": "30"}, "vllm_server_timeout", 30.0),
        ({"RUN_NAME": "exp7"}, "output_dir", "RUN_DIR/exp7"),
        ({"TRAINER_REPORT_TO": "wandb,trackio"}, "report_to", ["wandb", "trackio"]),
        ({"TRAINER_PRECISION": "fp32"}, "bf16", False),
    ],
)
def test_env_maps_to_grpo_config(monkeypatch, tmp_path, env, field, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if expected == "RUN_DIR/exp7":
        expected = str(tmp_path / "adapters" / "runs" / "exp7")
    assert getattr(configs().grpo, field) == expected


@pytest.mark.parametrize(
    ("env", "field", "expected"), [({"LORA_RANK": "8"}, "r", 8), ({"LORA_ALPHA": "16"}, "lora_alpha", 16)]
)
def test_env_maps_to_lora_config(monkeypatch, env, field, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert getattr(configs().lora, field) == expected


@pytest.mark.parametrize(
    ("precision", "cuda", "bf16"),
    [("auto", True, True), ("auto", False, False), ("fp32", True, False), ("bf16", False, True)],
)
def test_precision_follows_the_device_unless_set(precision, cuda, bf16):
    # Mapped without building TrainingArguments, which rejects bf16 on a box without a bf16 GPU.
    assert use_bf16(resolve_settings({"trainer_precision": precision}), cuda) is bf16


def test_flags_override_env(monkeypatch):
    monkeypatch.setenv("LEARNING_RATE", "1e-4")
    args = build_parser().parse_args(["--learning-rate", "2e-4", "--vllm-url", "http://x:1", "--task", "jsonl"])
    overrides = {name: value for name in FLAG_FIELDS if (value := getattr(args, name)) is not None}
    settings = resolve_settings(overrides)
    assert (settings.learning_rate, settings.trainer_vllm_url, settings.trainer_task) == (2e-4, "http://x:1", "jsonl")


def test_every_flag_is_a_setting():
    assert set(FLAG_FIELDS) <= ALL_FIELDS


def test_task_defaults_fill_only_unset_settings(monkeypatch, tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "lorafleet-tiny.json").write_text('{"seed": 0}')
    monkeypatch.setenv("TEMPERATURE", "0.9")
    settings = resolve_settings({"trainer_task": "tiny", "base_model": str(model), "max_steps": "3"})
    tiny = tiny_task.defaults
    assert settings.temperature == 0.9  # env wins
    assert settings.max_steps == 3  # flag wins
    assert settings.num_generations == tiny["num_generations"]
    assert settings.learning_rate == tiny["learning_rate"]


def test_tiny_task_refuses_a_model_that_is_not_the_tiny_one(tmp_path):
    settings = resolve_settings({"trainer_task": "tiny"})
    with pytest.raises(ConfigError, match="BASE_MODEL: TRAINER_TASK=tiny needs a model built by"):
        tiny_task.build_task(None, settings)


def test_the_old_recipe_setting_is_refused_with_its_new_name(monkeypatch):
    monkeypatch.setenv("TRAINER_RECIPE", "tiny")
    with pytest.raises(ConfigError, match="TRAINER_RECIPE: replaced by TRAINER_TASK"):
        resolve_settings({})


@pytest.mark.parametrize(("queue", "generations", "groups"), [(512, 8, 16), (8, 8, 1), (16, 4, 4), (3, 8, 1)])
def test_score_queue_is_bounded_by_the_sample_queue(queue, generations, groups):
    assert score_queue_groups(queue, generations) == groups


def test_dry_run_prints_the_effective_config_and_exits_zero(capsys):
    assert main(["--dry-run", "--learning-rate", "3e-5", "--replicas", "3"]) == 0
    line = next(line for line in capsys.readouterr().err.splitlines() if "event=effective_config" in line)
    assert "learning_rate=3e-05" in line and "replicas=3" in line and "max_inflight_tasks=384" in line


def test_bad_value_exits_2_naming_the_variable(capsys):
    assert main(["--learning-rate", "fast"]) == 2
    assert "LEARNING_RATE" in capsys.readouterr().err


def test_score_queue_bound_reaches_the_rollout_childs_kwargs():
    from types import SimpleNamespace

    from lorafleet_trainer.main import bound_score_queue

    worker = SimpleNamespace(_loop_kwargs={"queue_maxsize": 8})
    bound_score_queue(SimpleNamespace(rollout_worker=worker), 2)
    assert worker._loop_kwargs == {"queue_maxsize": 8, "score_queue_maxsize": 2}


@pytest.mark.parametrize(("bf16", "dtype"), [(True, "bfloat16"), (False, "float32")])
def test_the_frozen_base_is_loaded_in_the_mixed_precision_dtype(bf16, dtype):
    # bf16 autocast runs the base's matmuls in bf16 either way: a float32 copy only costs memory and casts.
    assert base_dtype(bf16) == dtype


def test_the_cpu_trainer_keeps_float32_weights():
    assert configs().grpo.dtype == "float32"  # CPU: no autocast, the replicas serve float32
