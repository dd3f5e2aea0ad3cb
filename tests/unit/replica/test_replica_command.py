"""The replica's `vllm serve` command and environment, built from the shared settings (issue 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.adapters import fleet_dir
from lorafleet.settings import ConfigError, ReplicaSettings, load_settings
from lorafleet_vllm.claim import claim_device
from lorafleet_vllm.command import OWN_VLLM_VARIABLES, build_launch
from lorafleet_vllm.main import EXIT_NO_DEVICE, core_list, offline_for_local_model


def replica_settings(**overrides: object) -> ReplicaSettings:
    """The replica's own section, as `lorafleet-replica` loads it."""
    return load_settings(ReplicaSettings, **overrides)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize(("staleness", "max_loras"), [(0, 2), (4, 6), (8, 10)])
@pytest.mark.parametrize(("rank", "max_lora_rank"), [(1, 1), (2, 8), (8, 8), (9, 16), (512, 512)])
def test_lora_flags_follow_staleness_and_rank(staleness, max_loras, rank, max_lora_rank):
    launch = build_launch(replica_settings(max_staleness=staleness, lora_rank=rank), "0")
    assert _flag(launch.argv, "--max-loras") == str(max_loras)
    assert _flag(launch.argv, "--max-lora-rank") == str(max_lora_rank)
    assert "--enable-lora" in launch.argv
    assert _flag(launch.argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(launch.argv, "--generation-config") == "vllm"
    assert launch.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert launch.env["VLLM_SERVER_DEV_MODE"] == "1"


def test_rank_above_512_is_a_config_error_naming_the_variable():
    with pytest.raises(ConfigError, match="LORA_RANK"):
        replica_settings(lora_rank=513)


def test_gpu_mode_pins_the_claimed_gpu():
    settings = replica_settings(replica_device="gpu", vllm_gpu_memory_utilization=0.7, max_model_len=2048)
    launch = build_launch(settings, "3")
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch.env
    assert _flag(launch.argv, "--gpu-memory-utilization") == "0.7"
    assert _flag(launch.argv, "--max-model-len") == "2048"
    assert launch.argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B"]


def test_cpu_mode_binds_the_claimed_core_set_and_sizes_the_kv_cache():
    launch = build_launch(replica_settings(replica_device="cpu", vllm_cpu_kv_cache_bytes=2**28), "0-3")
    assert launch.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert "CUDA_VISIBLE_DEVICES" not in launch.env
    assert _flag(launch.argv, "--kv-cache-memory-bytes") == str(2**28)


def test_only_cpu_mode_turns_chunked_prefill_off():
    # vllm-cpu's engine dies on a seeded request whose prefill is split; CUDA's does not
    # (docs/guides/cpu-mode.md#what-differs-on-cpu-replicas)
    assert "--no-enable-chunked-prefill" in build_launch(replica_settings(replica_device="cpu"), "0").argv
    assert "--no-enable-chunked-prefill" not in build_launch(replica_settings(replica_device="gpu"), "0").argv


@pytest.mark.parametrize(("device", "dtype", "served"), [
    ("cpu", "auto", "float32"), ("cpu", "bfloat16", "bfloat16"), ("cpu", "float16", "float16"),
    ("gpu", "auto", "auto"), ("gpu", "float32", "float32"),
])
def test_auto_dtype_is_float32_on_cpu_and_an_explicit_one_is_kept(device, dtype, served):
    # vllm-cpu 0.31 picks bfloat16 for `auto` on AVX512-BF16/AMX CPUs, not the CPU trainer's float32
    # (docs/guides/cpu-mode.md#what-differs-on-cpu-replicas)
    launch = build_launch(replica_settings(replica_device=device, vllm_dtype=dtype), "0")
    assert _flag(launch.argv, "--dtype") == served


def test_cpu_mode_runs_the_model_in_the_engine_process_unless_told_otherwise():
    uni = build_launch(replica_settings(replica_device="cpu"), "0")
    assert _flag(uni.argv, "--distributed-executor-backend") == "uni"
    assert uni.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform swaps uni for mp
    mp = build_launch(replica_settings(replica_device="cpu", vllm_cpu_executor="mp"), "0")
    assert "--distributed-executor-backend" not in mp.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in mp.env
    gpu = build_launch(replica_settings(replica_device="gpu"), "0")
    assert "--distributed-executor-backend" not in gpu.argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu.env


@pytest.mark.parametrize(("core_set", "threads", "places"), [("0", "1", "{0}"), ("0-3", "4", "{0,1,2,3}"),
                                                        ("1,4-5", "3", "{1,4,5}")])
def test_uni_binds_the_models_openmp_threads_to_the_core_set(core_set, threads, places):
    # vLLM binds only an mp worker (vllm/utils/ompmultiprocessing.py); under uni lorafleet gives the same variables
    launch = build_launch(replica_settings(replica_device="cpu"), core_set)
    env = launch.environment({"PATH": "/bin"})
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == (threads, places, "true")
    assert launch.shown_env()["OMP_NUM_THREADS"] == threads


def test_an_operators_openmp_settings_win_and_mp_and_gpu_set_none():
    launch = build_launch(replica_settings(replica_device="cpu"), "0-1")
    env = launch.environment({"OMP_NUM_THREADS": "1", "OMP_PROC_BIND": "false"})
    assert (env["OMP_NUM_THREADS"], env["OMP_PROC_BIND"], env["OMP_PLACES"]) == ("1", "false", "{0,1}")
    for settings in (replica_settings(replica_device="cpu", vllm_cpu_executor="mp"),
                     replica_settings(replica_device="gpu")):
        env = build_launch(settings, "0").environment({})
        assert not {"OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"} & env.keys()


def test_a_local_model_keeps_the_openmp_defaults(tmp_path: Path):
    settings = replica_settings(replica_device="cpu", base_model=str(tmp_path))
    launch = offline_for_local_model(settings, build_launch(settings, "0"))
    assert launch.env["HF_HUB_OFFLINE"] == "1" and launch.env_defaults["OMP_NUM_THREADS"] == "1"


def test_extra_args_are_appended_last_and_shell_split():
    launch = build_launch(replica_settings(vllm_extra_args="--enforce-eager --served-model-name 'my model'"), "0")
    assert launch.argv[-3:] == ["--enforce-eager", "--served-model-name", "my model"]


def test_own_vllm_prefixed_settings_are_not_handed_to_vllm():
    launch = build_launch(replica_settings(), "0")
    inherited = {name: "x" for name in OWN_VLLM_VARIABLES} | {"VLLM_LOGGING_LEVEL": "DEBUG", "PATH": "/bin"}
    env = launch.environment(inherited)
    assert not OWN_VLLM_VARIABLES & env.keys()
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG" and env["PATH"] == "/bin"


@pytest.mark.parametrize(
    ("variable", "value"),
    [("MAX_STALENESS", "-1"), ("VLLM_GPUS", "0,zero"), ("VLLM_CPU_SETS", "a;b"), ("REPLICA_PORT", "70000"),
     ("REPLICA_DEVICE", "tpu")],
)
def test_dry_run_rejects_bad_settings_naming_the_variable(tmp_path: Path, variable, value):
    env = {**os.environ, "ADAPTER_ROOT": str(tmp_path), variable: value}
    result = subprocess.run([sys.executable, "-m", "lorafleet_vllm.main", "--dry-run"], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert variable in result.stderr


def test_dry_run_prints_device_env_and_command(tmp_path: Path):
    env = {**os.environ, "ADAPTER_ROOT": str(tmp_path), "REPLICA_DEVICE": "gpu", "VLLM_GPUS": "4,5"}
    result = subprocess.run([sys.executable, "-m", "lorafleet_vllm.main", "--dry-run"], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=60, check=True)
    plan = json.loads(result.stdout)
    assert plan["device"] == "4"
    assert plan["env"]["CUDA_VISIBLE_DEVICES"] == "4"
    assert plan["argv"][:2] == ["vllm", "serve"]
    assert plan["lock"].startswith(str(tmp_path / ".fleet"))


def test_upstream_token_becomes_vllms_api_key_in_the_environment_not_argv():
    launch = build_launch(replica_settings(proxy_upstream_token="t0ken"), "0")
    assert launch.env["VLLM_API_KEY"] == "t0ken"
    assert not any("t0ken" in arg for arg in launch.argv), "the key would show in every process listing"
    assert launch.shown_env()["VLLM_API_KEY"] == "<secret>"
    assert "VLLM_API_KEY" not in build_launch(replica_settings(), "0").env


def test_dry_run_masks_the_api_key(tmp_path: Path):
    env = {**os.environ, "ADAPTER_ROOT": str(tmp_path), "REPLICA_DEVICE": "gpu", "PROXY_UPSTREAM_TOKEN": "t0ken"}
    result = subprocess.run([sys.executable, "-m", "lorafleet_vllm.main", "--dry-run"], env=env,
                            capture_output=True, text=True, cwd=tmp_path, timeout=60, check=True)
    assert "t0ken" not in result.stdout
    assert json.loads(result.stdout)["env"]["VLLM_API_KEY"] == "<secret>"


# --- Kubernetes: REPLICA_DEVICE_ASSIGNMENT=scheduler ------------------------------------------------------------------
def _dry_run(root: Path, preexec_fn: Callable[[], None] | None = None, **settings: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ADAPTER_ROOT": str(root), **settings}
    return subprocess.run([sys.executable, "-m", "lorafleet_vllm.main", "--dry-run"], env=env, capture_output=True,
                          text=True, cwd=root, timeout=60, preexec_fn=preexec_fn)


def test_scheduler_assignment_takes_no_claim_and_leaves_the_gpu_to_the_runtime(tmp_path: Path):
    """Every Kubernetes pod sees its one GPU as index 0: claims on a shared fleet folder would collide."""
    shared, fresh = tmp_path / "shared", tmp_path / "fresh"
    fresh.mkdir()
    held = claim_device(["0"], fleet_dir(shared) / "claims", kind="gpu", pool_variable="VLLM_GPUS")
    try:
        claiming = _dry_run(shared, REPLICA_DEVICE="gpu", VLLM_GPUS="0")
        assert claiming.returncode == EXIT_NO_DEVICE, claiming.stderr
        for root in (shared, fresh):
            result = _dry_run(root, REPLICA_DEVICE="gpu", VLLM_GPUS="0", REPLICA_DEVICE_ASSIGNMENT="scheduler")
            assert result.returncode == 0, result.stderr
            plan = json.loads(result.stdout)
            assert plan["device"] is None and plan["lock"] is None
            assert "CUDA_VISIBLE_DEVICES" not in plan["env"]
        assert not fleet_dir(fresh).exists(), "a replica on a read-only store must not need ADAPTER_ROOT/.fleet"
    finally:
        os.close(held.fd)
    launch = build_launch(replica_settings(replica_device="gpu", replica_device_assignment="scheduler"), None)
    assert launch.environment({"CUDA_VISIBLE_DEVICES": "GPU-1f2e"})["CUDA_VISIBLE_DEVICES"] == "GPU-1f2e"


def test_scheduler_assignment_binds_cpu_threads_to_the_cores_the_pod_may_use(tmp_path: Path):
    core = min(os.sched_getaffinity(0))
    result = _dry_run(tmp_path, lambda: os.sched_setaffinity(0, {core}), REPLICA_DEVICE="cpu",
                      REPLICA_DEVICE_ASSIGNMENT="scheduler", VLLM_CPU_SETS="0;1")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["device"] == plan["env"]["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    assert plan["lock"] is None


def _cores(core_set: str) -> set[int]:
    cores: set[int] = set()
    for part in core_set.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


@given(st.sets(st.integers(min_value=0, max_value=511), min_size=1))
def test_core_list_is_the_same_cores_in_vllms_syntax(cores: set[int]):
    text = core_list(cores)
    assert _cores(text) == cores
    assert replica_settings(vllm_cpu_sets=text).cpu_pool == [text]
    assert len(text.split(",")) == 1 + sum(1 for core in cores if core + 1 not in cores and core != max(cores))


def test_every_replica_carries_the_attestation_extension() -> None:
    import importlib

    from lorafleet.engine_identity import EXTENSION_CLASS

    argv = build_launch(load_settings(ReplicaSettings, replica_device="cpu"), "0").argv
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION_CLASS
    module, _, name = EXTENSION_CLASS.rpartition(".")
    assert hasattr(importlib.import_module(module), name)  # vLLM imports it by this name in each worker
