"""The settings schema: derived values, and bad values stopping the program with the variable's name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lorafleet.settings import VLLM_LORA_RANKS, ConfigError, StackSettings, env_name, load_settings, round_lora_rank


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No setting leaks in from the caller's environment or a .env in the working directory."""
    for name in StackSettings.model_fields:
        monkeypatch.delenv(env_name(name), raising=False)
    monkeypatch.chdir(tmp_path)


def from_env(monkeypatch: pytest.MonkeyPatch, **env: str) -> StackSettings:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return load_settings()


@pytest.mark.parametrize(("staleness", "max_loras"), [(0, 2), (4, 6), (8, 10)])
def test_max_loras_is_staleness_plus_two(monkeypatch: pytest.MonkeyPatch, staleness: int, max_loras: int) -> None:
    assert from_env(monkeypatch, MAX_STALENESS=str(staleness)).max_loras == max_loras


@pytest.mark.parametrize(("rank", "max_rank"), [(1, 1), (2, 8), (8, 8), (9, 16), (320, 320), (321, 512), (512, 512)])
def test_max_lora_rank_rounds_up_to_a_rank_vllm_accepts(
    monkeypatch: pytest.MonkeyPatch, rank: int, max_rank: int
) -> None:
    assert from_env(monkeypatch, LORA_RANK=str(rank)).max_lora_rank == max_rank


def test_round_lora_rank_is_the_smallest_accepted_rank_for_every_rank() -> None:
    for rank in range(1, VLLM_LORA_RANKS[-1] + 1):
        rounded = round_lora_rank(rank)
        assert rounded in VLLM_LORA_RANKS and rounded >= rank
        assert all(allowed < rank for allowed in VLLM_LORA_RANKS if allowed < rounded), rank


def test_rank_above_512_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"LORA_RANK: LoRA rank 513 is above vLLM's largest --max-lora-rank \(512\)"):
        from_env(monkeypatch, LORA_RANK="513")


def test_derived_values_are_in_the_dump_every_service_logs(monkeypatch: pytest.MonkeyPatch) -> None:
    dumped = from_env(monkeypatch, MAX_STALENESS="3", LORA_RANK="16").model_dump()
    assert (dumped["max_loras"], dumped["max_lora_rank"]) == (5, 16)


@pytest.mark.parametrize(
    ("variable", "value", "why"),
    [
        ("LORA_RANK", "abc", "valid integer"),
        ("LORA_RANK", "0", "greater than or equal to 1"),
        ("MAX_STALENESS", "-1", "greater than or equal to 0"),
        ("MAX_STALENESS", "1.5", "valid integer"),
        ("RUN_NAME", "../escape", "plain folder name"),
        ("RUN_NAME", "a b", "plain folder name"),
        ("RUN_NAME", "", "plain folder name"),
        ("ADAPTER_ROOT", "relative/adapters", "absolute path"),
        ("VLLM_GPUS", "0,0", "distinct GPU indices"),
        ("VLLM_GPUS", "gpu0", "distinct GPU indices"),
        ("VLLM_GPUS", " , ", "distinct GPU indices"),
        ("VLLM_CPU_SETS", "0-", "core sets"),
        ("PROXY_UPSTREAMS", "http://a:8000,ftp://b", "'ftp://b' is not an http(s) URL"),
        ("TRAINER_VLLM_URL", "proxy:8000", "is not an http(s) URL"),
        ("PROXY_UPSTREAM_DNS", "vllm", "host:port"),
        ("REPLICA_PORT", "70000", "less than or equal to 65535"),
        ("LOG_LEVEL", "LOUD", "Input should be"),
        ("REPLICA_DEVICE", "tpu", "Input should be"),
    ],
)
def test_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, variable: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError) as error:
        from_env(monkeypatch, **{variable: value})
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert len(lines) == 2 and lines[1].strip().startswith(f"{variable}: "), str(error.value)
    assert why in lines[1] and repr(value) in lines[1]


def test_every_bad_variable_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as error:
        from_env(monkeypatch, LORA_RANK="x", RUN_NAME="../x", VLLM_GPUS="")
    reported = {line.strip().split(":")[0] for line in str(error.value).splitlines()[1:]}
    assert reported == {"LORA_RANK", "RUN_NAME", "VLLM_GPUS"}


def test_secrets_are_never_echoed(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s3cret-bearer-key"
    with pytest.raises(ConfigError, match="PROXY_PORT and PROXY_PUBLIC_PORT must differ") as error:
        from_env(monkeypatch, PROXY_API_KEY=secret, PROXY_UPSTREAM_TOKEN=secret, PROXY_PORT="9000",
                 PROXY_PUBLIC_PORT="9000")
    assert secret not in str(error.value)


def test_same_ports_are_fine_without_a_public_port(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = from_env(monkeypatch, PROXY_PORT="9000", PROXY_PUBLIC_PORT="9000")
    assert settings.proxy_api_key == ""


def test_values_are_parsed_and_normalized(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = from_env(
        monkeypatch,
        VLLM_GPUS=" 2, 3 ,4",
        VLLM_CPU_SETS="0-3; 4,6 ;",
        PROXY_UPSTREAMS="http://a:8000/, https://b:9000",
        ADAPTER_ROOT="/data/store",
        RUN_NAME="exp-1.b_2",
        GRADIENT_CHECKPOINTING="true",
    )
    assert settings.gpu_pool == ["2", "3", "4"]
    assert settings.cpu_pool == ["0-3", "4,6"]
    assert settings.upstream_urls == ["http://a:8000", "https://b:9000"]
    assert settings.run_dir == Path("/data/store/runs/exp-1.b_2")
    assert settings.gradient_checkpointing is True


def test_cpu_sets_auto_are_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = from_env(monkeypatch)
    assert settings.vllm_cpu_sets == "auto" and settings.cpu_sets_auto
    assert settings.cpu_pool == [str(core) for core in sorted(os.sched_getaffinity(0))]
    assert not from_env(monkeypatch, VLLM_CPU_SETS="0;1").cpu_sets_auto


def test_env_file_is_read_and_the_environment_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("MAX_STALENESS=7\nLORA_RANK=9\n")
    monkeypatch.setenv("LORAFLEET_ENV_FILE", ".env")  # `make test` disables .env; this test turns it on
    monkeypatch.setenv("LORA_RANK", "2")
    settings = load_settings()
    assert (settings.max_staleness, settings.lora_rank, settings.max_lora_rank) == (7, 2, 8)


def test_bad_value_in_env_file_names_the_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("MAX_STALENESS=-3\n")
    monkeypatch.setenv("LORAFLEET_ENV_FILE", ".env")
    with pytest.raises(ConfigError, match="MAX_STALENESS: "):
        load_settings()


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.max_staleness = 9  # type: ignore[misc]


def test_defaults_are_valid_and_follow_the_published_recipe() -> None:
    settings = load_settings()
    assert (settings.lora_rank, settings.lora_alpha, settings.max_staleness, settings.weight_sync_steps) == (1, 2, 4, 4)
    assert settings.adapter_root == Path("/adapters")
    assert (settings.max_loras, settings.max_lora_rank) == (6, 1)


def test_an_empty_lorafleet_env_file_disables_the_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("MAX_STALENESS=7\n")
    monkeypatch.setenv("LORAFLEET_ENV_FILE", "")
    assert load_settings().max_staleness == 4


@pytest.mark.parametrize("where", ["environment", "env file"])
def test_the_removed_proxy_host_is_refused_naming_its_replacements(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, where: str
) -> None:
    if where == "environment":
        monkeypatch.setenv("PROXY_HOST", "0.0.0.0")
    else:
        (tmp_path / "stack.env").write_text("PROXY_HOST=0.0.0.0\n")
        monkeypatch.setenv("LORAFLEET_ENV_FILE", str(tmp_path / "stack.env"))
    with pytest.raises(ConfigError, match="PROXY_HOST: replaced by PROXY_FLEET_HOST and PROXY_PUBLIC_HOST"):
        load_settings()


def test_both_proxy_ports_bind_to_loopback_unless_told_otherwise() -> None:
    settings = load_settings()
    assert (settings.proxy_fleet_host, settings.proxy_public_host) == ("127.0.0.1", "127.0.0.1")
