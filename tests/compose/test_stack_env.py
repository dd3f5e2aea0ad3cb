"""What the Compose stack test (tests/stack/test_stack.py) relies on, proven without an engine or GPUs.

- the device layout: trainer and replica GPUs disjoint, one GPU per replica plus one for the scale-out; the cpu
  profile's automatic core sets;
- the `.env` it makes from `.env.example` (as a user does) passes the settings schema and renders with the real
  Compose binary in the project copy, whose build contexts resolve inside it; a developer's `.env` is not copied;
- `make up CPU=1` builds the replica image before the trainer built on it, then waits;
- tools/engine.sh names the minimum Engine and Compose versions;
- the session runs the user's `make up` in the copy, always removes volumes, saves logs when `up` fails, and checks
  the exit code before parsing JSON (a recording stand-in for docker and make);
- the module collects and skips with one line naming what is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lorafleet.settings import StackSettings, env_name, load_settings
from lorafleet_testing import stack_driver
from lorafleet_testing.compose_helpers import COMPOSE_FILE, COMPOSE_VAR, ENV_EXAMPLE, REPO, parse_env_example
from lorafleet_testing.stack_driver import Stack, StackError, StackSession, copy_project, missing_requirements
from lorafleet_testing.stack_plan import (
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
    user_env_file,
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
def test_cpu_layout_is_every_core_and_needs_two(cores: int, replicas: int) -> None:
    assert cpu_layout(cores, replicas) == tuple(str(core) for core in range(cores))
    with pytest.raises(NotEnoughDevices, match="needs 2 CPU cores"):
        cpu_layout(1, replicas)


# --- the env file: made as a user makes it -----------------------------------------------------------------------

ENV_NAMES = st.sampled_from([*sorted(parse_env_example(ENV_EXAMPLE.read_text())), "NEW_ONE", "ANOTHER_NEW"])


@given(st.dictionaries(ENV_NAMES, st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
                       max_size=8))
def test_user_env_file_sets_each_value_once_and_keeps_the_rest(values: dict[str, str]) -> None:
    example = ENV_EXAMPLE.read_text()
    made = user_env_file(example, values)
    entries = parse_env_example(made)
    for name, value in values.items():
        assert entries[name].value == value and not entries[name].commented, name
        assert sum(line.startswith(f"{name}=") for line in made.splitlines()) == 1, name
    untouched = [line for line in example.splitlines()
                 if not any(line.lstrip("# ").startswith(f"{name}=") for name in values)]
    kept = made.splitlines()
    assert all(line in kept for line in untouched)


def project_copy(plan: StackPlan, tmp_path: Path) -> Path:
    """What the stack test renders: compose.yaml and .env.example copied, .env made from the example."""
    directory = tmp_path / "lorafleet"
    directory.mkdir()
    for name in ("compose.yaml", ".env.example"):
        shutil.copy(REPO / name, directory / name)
    plan.write_env_file(directory)
    return directory


@pytest.mark.parametrize("plan", plans(), ids=lambda p: p.project)
def test_env_file_is_valid_for_the_settings_schema(plan: StackPlan, tmp_path: Path, monkeypatch: Any) -> None:
    for field in StackSettings.model_fields:
        monkeypatch.delenv(env_name(field), raising=False)
    monkeypatch.setenv("LORAFLEET_ENV_FILE", str(project_copy(plan, tmp_path) / ".env"))
    settings = load_settings()
    assert settings.proxy_api_key == plan.api_key and settings.proxy_public_port == plan.public_port
    assert settings.proxy_upstream_token == plan.upstream_token
    if plan.profile == "gpu":
        assert settings.gpu_pool == list(plan.replica_pool) and len(settings.gpu_pool) >= plan.replicas + 1
        assert settings.base_model == plan.base_model
    else:
        assert settings.cpu_sets_auto, "the cpu profile keeps the example's VLLM_CPU_SETS=auto"
    known = {env_name(f) for f in StackSettings.model_fields} | {m["name"] for m in COMPOSE_VAR.finditer(
        COMPOSE_FILE.read_text())} | COMPOSE_CLI_VARS
    assert set(plan.env()) <= known, f"the env file sets variables nothing reads: {set(plan.env()) - known}"


def render(plan: StackPlan, directory: Path, compose_bin: Path, tool_env: dict[str, str]) -> dict[str, Any]:
    """`config --format json` of the copy, the profile chosen as `make ... CPU=1` chooses it (COMPOSE_PROFILES)."""
    env = {**tool_env, "COMPOSE_PROFILES": plan.profile}
    done = subprocess.run([str(compose_bin), "--project-directory", str(directory), "config", "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("plan", plans(), ids=lambda p: p.project)
def test_compose_renders_the_stack_from_the_users_env_file(
    plan: StackPlan, tmp_path: Path, compose_bin: Path, tool_env: dict[str, str]
) -> None:
    directory = project_copy(plan, tmp_path)
    project = render(plan, directory, compose_bin, tool_env)
    assert project["name"] == plan.project
    assert project["networks"]["replicas"]["name"] == f"{plan.project}_replicas"  # Stack.container_ip looks there
    assert {v["name"] for v in project["volumes"].values()} == {f"{plan.project}_{v}" for v in project["volumes"]}
    services = project["services"]
    replica, proxy = services[plan.replica_service], services["proxy"]
    assert replica["deploy"]["replicas"] == plan.replicas
    for name in (plan.replica_service, plan.trainer_service, "proxy"):
        env = services[name]["environment"]
        assert env["RUN_NAME"] == plan.env()["RUN_NAME"], name
        if plan.profile == "gpu":
            assert env["VLLM_GPUS"] == ",".join(plan.replica_pool), name
        else:
            assert env.get("VLLM_CPU_SETS") in (None, "auto"), name  # unset: the schema's default, auto
    for name in (plan.replica_service, plan.trainer_service):
        assert services[name]["environment"]["BASE_MODEL"] == plan.base_model, name
    assert replica["environment"]["REPLICA_DEVICE"] == plan.profile
    assert [(p["host_ip"], str(p["published"]), int(p["target"])) for p in proxy["ports"]] == [
        ("127.0.0.1", str(plan.public_port), plan.public_port)]
    assert proxy["environment"]["PROXY_API_KEY"] == plan.api_key
    for name, svc in services.items():  # relative build contexts resolve inside the project's own directory
        if svc.get("build"):
            assert svc["build"]["context"] == str(directory), name
    if plan.profile == "gpu":
        trainer_gpus = services[plan.trainer_service]["environment"]["CUDA_VISIBLE_DEVICES"].split(",")
        assert trainer_gpus == list(plan.trainer_gpus)
        assert not set(trainer_gpus) & set(plan.replica_pool)


def test_the_project_copy_is_a_fresh_clone_without_the_developers_env(tmp_path: Path) -> None:
    """Problem 4 of the first real run: the project directory is a copy of the checkout (build contexts resolve),
    holding the tracked and untracked-not-ignored files only: no `.env`, no venv, no results."""
    repo = tmp_path / "repo"
    (repo / "services").mkdir(parents=True)
    (repo / ".gitignore").write_text(".env\nresults/\n")
    (repo / "services" / "Dockerfile").write_text("FROM scratch\n")
    (repo / "new.txt").write_text("untracked, not ignored\n")
    (repo / ".env").write_text("PROXY_API_KEY=developer\n")
    (repo / "results").mkdir()
    (repo / "results" / "x.json").write_text("{}")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", ".gitignore", "services"], check=True)
    copy = copy_project(tmp_path / "copy", repo=repo)
    found = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_file())
    assert found == [".gitignore", "new.txt", "services/Dockerfile"], found


def test_make_up_builds_the_replica_image_first_then_waits(tmp_path: Path) -> None:
    """`make up CPU=1` checks the engine, builds the replica image (the cpu trainer's base) before the rest, then
    `up --wait`: no BuildKit-only build context ties `compose run` of the trainer to a rebuild."""
    (_, _, cpu_plan) = plans()
    directory = project_copy(cpu_plan, tmp_path)
    shutil.copy(REPO / "Makefile", directory / "Makefile")
    done = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(directory), "up", "CPU=1"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    order = [next(i for i, line in enumerate(lines) if re.search(pattern, line))
             for pattern in ("tools/engine.sh check$", "compose build vllm-cpu$", "compose build$",
                             "compose up -d --wait")]
    assert order == sorted(order) and len(set(order)) == 4, done.stdout
    assert all("COMPOSE_PROFILES=cpu" in lines[i] for i in order[1:]), done.stdout


# --- the engine: versions and what is missing ------------------------------------------------------------------


def fake_docker(tmp_path: Path, engine: str, compose: str, system: str = "Debian GNU/Linux 12 (bookworm)") \
        -> dict[str, str]:
    """A docker CLI on PATH that reports these versions and operating system (no engine here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "docker"
    script.write_text("#!/bin/sh\n"
                      f'case "$1" in version) echo "{engine}";; compose) echo "{compose}";; info) echo "{system}";; '
                      '*) exit 1;; esac\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}


@pytest.mark.parametrize(
    ("engine", "compose", "expected"),
    [
        ("20.10.24+dfsg1", "2.40.3", None),
        ("28.2.2", "v2.24.0", None),
        ("19.03.15", "2.40.3", "Docker Engine 19.03.15 is too old: lorafleet needs Engine 20.10 or newer"),
        ("20.10.24+dfsg1", "2.23.3", "Docker Compose 2.23.3 is too old: lorafleet needs Compose v2.24 or newer"),
    ],
)
def test_engine_check_names_the_minimum_versions(tmp_path: Path, engine: str, compose: str,
                                                 expected: str | None) -> None:
    done = subprocess.run(["bash", str(REPO / "tools" / "engine.sh"), "check"], env=fake_docker(tmp_path, engine,
                          compose), capture_output=True, text=True, timeout=30, check=False)
    if expected is None:
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert done.returncode == 1 and done.stdout.strip().startswith(expected), done.stdout + done.stderr
        assert len(done.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("system", ["Docker Desktop", "Docker Desktop 4.38.0 (181591)"])
def test_engine_check_refuses_docker_desktop_for_the_per_run_binds(tmp_path: Path, system: str) -> None:
    """A trainer's folder is a bind of the adapters volume's directory on the engine's host: Docker Desktop's engine
    is in a VM, so `make up` and `make train` stop at the check naming why, before any container starts."""
    done = subprocess.run(["bash", str(REPO / "tools" / "engine.sh"), "check"], env=fake_docker(tmp_path, "28.0.1",
                          "2.33.1", system), capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 1 and done.stdout.startswith(f"Docker Desktop ({system}) cannot give a trainer its own "
                                                           "run's folder"), done.stdout + done.stderr
    assert "ADAPTERS_DIR" in done.stdout and len(done.stdout.strip().splitlines()) == 1
    dry = subprocess.run(["make", "-n", "train", "RUN=b", "CPU=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=30, check=True).stdout.splitlines()
    assert dry.index("bash tools/engine.sh check") < min(i for i, line in enumerate(dry) if "compose" in line), dry


def test_the_stack_guide_states_engine_sh_minimum_versions() -> None:
    engine_sh = (REPO / "tools" / "engine.sh").read_text()
    minimums = dict(re.findall(r"^MIN_(ENGINE|COMPOSE)=(\S+)$", engine_sh, re.M))
    guide = (REPO / "docs" / "guides" / "gpu-stack.md").read_text()
    assert f"Engine {minimums['ENGINE']}" in guide and f"Compose v{minimums['COMPOSE']}" in guide, minimums


# --- the stack session ------------------------------------------------------------------------------------------


class RecordingDocker:
    """Stands in for docker and make (no engine here): records each argv, answers from `fail_on` / `outputs`."""

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
    plan = gpu_plan if profile == "gpu" else cpu_plan
    stack = Stack(plan, project_copy(plan, tmp_path), runner=docker)
    return StackSession(stack, tmp_path / "artifacts", wait_timeout_s=60)


def test_the_session_runs_make_up_in_the_copy_as_the_user_types_it(tmp_path: Path) -> None:
    docker = RecordingDocker()
    session = session_for(tmp_path, docker, profile="cpu")
    session.start()
    (up,) = docker.called("up")
    assert up[:5] == ["make", "--no-print-directory", "-C", str(session.stack.directory), "up"] and "CPU=1" in up
    session.stop()
    (down,) = docker.called("down")
    assert down[down.index("--project-directory") + 1] == str(session.stack.directory)
    assert {"--volumes", "--remove-orphans"} <= set(down) and down[down.index("--profile") + 1] == "*"
    assert not docker.called("logs")


def test_failed_up_saves_logs_and_removes_everything(tmp_path: Path) -> None:
    """When `make up` fails, every container's state and logs are saved, and `down --volumes` still runs."""
    docker = RecordingDocker(fail_on="up", outputs={"ps": "c1\nc2\n", "logs": "Traceback: the replica died"})
    session = session_for(tmp_path, docker)
    with pytest.raises(StackError, match=r"(?s)exited 1:\n.*up failed: boom"):
        session.start()
    assert [argv[-1] for argv in docker.called("logs")] == ["c1", "c2"]
    saved = (tmp_path / "artifacts" / "lf-stack-gpu-make-up.log").read_text()
    assert saved.count("Traceback: the replica died") == 2
    assert docker.called("down")


def test_json_is_parsed_only_after_the_exit_code(tmp_path: Path) -> None:
    docker = RecordingDocker(fail_on="ps")
    with pytest.raises(StackError, match="exited 1"):
        session_for(tmp_path, docker).stack.containers("proxy")


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


def fake_host(monkeypatch: Any, *, binaries: set[str], check_says: str, gpus: int = 0) -> Any:
    monkeypatch.setattr(stack_driver.shutil, "which", lambda name: f"/usr/bin/{name}" if name in binaries else None)
    listing = "".join(f"{i}, GPU-{i}\n" for i in range(gpus))

    def runner(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        if argv[0] == "bash" and argv[-1] == "check":  # tools/engine.sh check
            return subprocess.CompletedProcess(list(argv), 1 if check_says else 0, check_says, "")
        return subprocess.CompletedProcess(list(argv), 0, listing, "")

    return runner


@pytest.mark.parametrize(
    ("binaries", "check_says", "gpus", "profile", "expected"),
    [
        (set(), "", 0, "gpu", "no `docker` CLI on PATH"),
        ({"docker"}, "no Docker engine answers at the default socket (start one: ...)\n", 0, "cpu",
         "stack test: no Docker engine answers at the default socket"),
        ({"docker"}, "Docker Engine 19.03.1 is too old: lorafleet needs Engine 20.10 or newer\n", 0, "cpu",
         "Engine 19.03.1 is too old"),
        ({"docker"}, "", 0, "gpu", "no `nvidia-smi` on PATH"),
        ({"docker", "nvidia-smi"}, "", 3, "gpu",
         "needs 4 GPUs (1 trainer + 2 replicas + 1 for the scale-out), found 3"),
        ({"docker", "nvidia-smi"}, "", 4, "gpu", None),
        ({"docker"}, "", 0, "cpu", None),
    ],
)
def test_missing_requirements_name_what_is_missing_in_one_line(
    monkeypatch: Any, binaries: set[str], check_says: str, gpus: int, profile: str, expected: str | None
) -> None:
    monkeypatch.setattr(stack_driver.os, "cpu_count", lambda: 2)
    reason = missing_requirements(profile, 2, runner=fake_host(monkeypatch, binaries=binaries, check_says=check_says,
                                                                  gpus=gpus))
    if expected is None:
        assert reason is None
    else:
        assert reason and expected in reason and "\n" not in reason, reason


@pytest.mark.timeout(120)
def test_stack_module_collects_and_skips_with_one_line_reason(tmp_path: Path) -> None:
    """On this host (no engine, no GPUs) every stack test is collected and skipped with the same one-line reason;
    with CI=true the same reason fails the tier instead."""
    reason = missing_requirements("gpu", 2)
    if reason is None:
        pytest.skip("this host can run the stack test itself (make test-gpu)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAFLEET_STACK_") and k != "CI"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/stack/test_stack.py", "-q", "-rs", "-p", "no:cacheprovider",
         "--basetemp", str(tmp_path / "t")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=110, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) >= 7 and f"{len(skipped)} skipped" in done.stdout, done.stdout
    assert all(line.endswith(reason) for line in skipped), done.stdout
    failing = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/stack/test_stack.py", "-q", "-p", "no:cacheprovider", "--basetemp",
         str(tmp_path / "ci"), "-k", "every_replica_is_ready"],
        cwd=REPO, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=110, check=False,
    )
    assert failing.returncode == 1 and reason in failing.stdout, failing.stdout + failing.stderr
